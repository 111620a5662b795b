"""Training data through `datasets`: a folder written by `save_to_disk` and a hub dataset id (`opd.data.sources`
reads every other source, and imports this module only for these two, so that JSONL and parquet never load datasets).

A hub id is looked up in datasets' cache first (offline), then downloaded when the hub answers; a source of several
splits is read at the split asked for, or at its only one. datasets' progress bars and warnings are silenced: one line
per problem (`DataError`).
"""

from __future__ import annotations

from pathlib import Path

import datasets
from datasets import config
from datasets.utils import logging as dlog
from datasets.utils.tqdm import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

from opd.data.parse import one_line
from opd.data.settings import DataError
from opd.models.loading import hub_reachable


def _pick_split(dd, split: str | None, label: str):
    """(dataset, split) of a DatasetDict: the split asked for, or its only one."""
    names = list(dd.keys())
    if split is None:
        if len(names) != 1:
            raise DataError(f"{label}: holds splits {', '.join(names) or 'none'}; choose one (--data-split)")
        split = names[0]
    elif split not in dd:
        raise DataError(f"{label}: no split '{split}' (splits: {', '.join(names) or 'none'})")
    return dd[split], split


class _quiet_datasets:
    """datasets without its progress bars and warnings (one line per problem is this module's contract)."""

    def __enter__(self):
        self.verbosity, self.bars = dlog.get_verbosity(), not are_progress_bars_disabled()
        dlog.set_verbosity_error()
        disable_progress_bars()

    def __exit__(self, *exc):
        dlog.set_verbosity(self.verbosity)
        if self.bars:
            enable_progress_bars()


def load_from_disk(folder: Path, split: str | None):
    """(dataset, label) of a save_to_disk folder: a Dataset's, or a DatasetDict's split."""
    try:
        with _quiet_datasets():
            ds = datasets.load_from_disk(str(folder))
    except Exception as e:  # a damaged state.json, missing arrow files, another datasets version's layout
        raise DataError(f"{folder}: cannot read the datasets folder (save_to_disk): {one_line(e)}") from None
    if isinstance(ds, datasets.DatasetDict):
        ds, split = _pick_split(ds, split, str(folder))
        return ds, f"{folder}[{split}]"
    if split is not None:
        raise DataError(f"{folder}: a single dataset (Dataset.save_to_disk), which has no splits; "
                        f"drop the split '{split}'")  # fmt: skip
    return ds, str(folder)


def load_hub(name: str, split: str | None):
    """(dataset, label) of hub dataset `name`: its copy in datasets' cache (found offline), else downloaded
    when the hub answers within `opd.models.loading.HUB_TIMEOUT_S`, else a one-line DataError at once."""
    dd = None
    only = {"split": split} if split is not None else {}  # a split asked for: only its files are prepared
    saved = config.HF_HUB_OFFLINE
    config.HF_HUB_OFFLINE = True  # datasets then looks in its cache only (CachedDatasetModuleFactory)
    try:
        with _quiet_datasets():
            dd = datasets.load_dataset(name, **only)
    except Exception as e:  # not cached (ConnectionError, FileNotFoundError, DatasetNotFoundError, ...)
        if split is not None and _unknown_split(e):  # cached, without that split
            raise DataError(f"{name}: no split '{split}' ({one_line(e)})") from None
        dd = None
    finally:
        config.HF_HUB_OFFLINE = saved
    if dd is None:
        if not hub_reachable():
            raise DataError(f"{name}: not a local file or folder, not in the datasets cache ({config.HF_DATASETS_CACHE}), "
                            "and the hub cannot be reached (offline)")  # fmt: skip
        try:
            with _quiet_datasets():
                dd = datasets.load_dataset(name, **only)
        except Exception as e:
            if split is not None and _unknown_split(e):
                raise DataError(f"{name}: no split '{split}' ({one_line(e)})") from None
            raise DataError(f"{name}: cannot load the dataset from the hub: {one_line(e)}") from None
    if isinstance(dd, datasets.DatasetDict):
        ds, split = _pick_split(dd, split, name)
    else:
        ds, split = dd, split or str(getattr(dd, "split", None) or "train")
    return ds, f"{name}[{split}]"


def _unknown_split(exc: BaseException) -> bool:
    """Whether `datasets.load_dataset(..., split=S)` failed because the dataset has no split S."""
    text = str(exc)
    return isinstance(exc, ValueError) and text.startswith(("Unknown split", "Bad split"))
