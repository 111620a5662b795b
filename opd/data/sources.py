"""Training data sources: JSONL, parquet files and folders, `datasets` save_to_disk folders and hub ids, the
column mapping, and the data settings (`DataConfig`); each row becomes a `opd.data.records.Record`.

`load_records(path, split=None, columns=None)` reads by what `path` is: a JSONL file, a parquet file or folder of
them (a `split` picks that split's files by the hub's naming), a `save_to_disk` folder, or a hub id `org/name` (the
`datasets` cache first, else a download within `opd.models.loading.HUB_TIMEOUT_S`, else a one-line error). Several
splits without a `split`, or a `split` for a source without splits, are refused. `datasets` is imported only for a
save_to_disk folder or a hub id (`opd.data.hub`); parquet is read with pyarrow. `columns` maps a source's column to
a record field (`parse_columns` reads "question=problem,img=images"); a missing column is refused in one line.
Images, the record forms and their checks are `opd.data.parse`'.
Details (splits, tables, images): docs/MODULES.md#opddatasources.
"""

import json
import os
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pyarrow.parquet as pq

from opd.builtin import builtin_path
from opd.data.parse import one_line, parse_record
from opd.data.records import Record
from opd.data.settings import DataError, parse_columns
from opd.storage import cache_dir, jsonl_lines

NOT_JSONL = (".arrow", ".csv", ".tsv", ".zip", ".gz", ".tar")
"""File suffixes `load_records` refuses by name (a JSONL file is read line by line; parquet is read as a table)."""

SPLIT_NAMES = ("train", "validation", "valid", "val", "dev", "test", "eval")
"""Split names recognised in a parquet folder's paths when no split is given (two or more are refused)."""

HUB_DATASET_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
"""A hub dataset id, 'org/name'."""

BATCH_ROWS = 32
"""Table rows decoded per batch: the rows' embedded image bytes held at once."""


def _check_columns(columns: dict[str, str]) -> dict[str, str]:
    """A column mapping as given to load_records (a dict, or the command line's string), checked."""
    if isinstance(columns, str):
        return parse_columns(columns)
    columns = dict(columns or {})
    for column, field in columns.items():
        if not isinstance(column, str) or not isinstance(field, str) or not column or not field:
            raise DataError(f"column mapping {columns!r}: expected column name -> field name strings")
    if len(set(columns.values())) != len(columns):
        raise DataError(f"column mapping {columns!r}: two columns are mapped to the same field")
    return columns


def _rename(row: object, columns: dict[str, str], where: str) -> object:
    """A JSONL row with its keys renamed by the mapping (a key that is absent is skipped)."""
    if not columns or not isinstance(row, dict):
        return row
    renamed = {}
    for key, value in row.items():
        target = columns.get(key, key)
        if target in renamed or (target != key and target in row and target not in columns):
            raise DataError(f"{where}: field '{key}': mapped to '{target}', but the row has a '{target}' too")
        renamed[target] = value
    return renamed


def _table_fields(label: str, have: list[str], columns: dict[str, str]) -> None:
    """Refuses, in one line, a table whose columns (after the mapping) cannot make a record."""
    listed = ", ".join(have) or "none"
    for column, field in columns.items():
        if column not in have:
            raise DataError(f"{label}: the column mapping names column '{column}', which the data does not have "
                            f"(columns: {listed})")  # fmt: skip
        if field in have and field not in columns:
            raise DataError(f"{label}: the column mapping maps '{column}' to '{field}', but the data has a "
                            f"'{field}' column too (map that one to another name)")  # fmt: skip
    fields = {columns.get(c, c) for c in have}
    missing = ([] if fields & {"images", "image"} else ["'images' (or 'image')"]) + [
        f"'{f}'" for f in ("problem", "answer") if f not in fields]  # fmt: skip
    if missing:
        raise DataError(f"{label}: missing field{'s' if len(missing) > 1 else ''} {', '.join(missing)}; its columns: "
                        f"{listed} (map a column to a field with the column mapping, e.g. question=problem)")  # fmt: skip


def _table_row(row: dict, columns: dict[str, str]) -> dict:
    """A table row as a record row: mapped names, null cells dropped (an absent field)."""
    return {columns.get(k, k): v for k, v in row.items() if v is not None}


def _parse_tables(batches: Iterator[tuple[list[dict], list[str]]], root: Path, columns: dict[str, str],
                  image_cache: Path | None) -> list[Record]:  # fmt: skip
    """Records of (rows, sources) batches, each batch's images decoded on a few threads, in order."""
    if image_cache is None:
        image_cache = cache_dir() / "data-images"
    names = {field: column for column, field in columns.items()}
    records: list[Record] = []
    with ThreadPoolExecutor(max_workers=4) as pool:  # image decoding releases the GIL
        for rows, sources in batches:
            records += pool.map(lambda r, w: parse_record(_table_row(r, columns), w, root, names, image_cache),
                                rows, sources)  # fmt: skip
    return records


def _split_of(relative: Path) -> str | None:
    """The split a parquet file belongs to by the hub's naming (a folder, or the file name's start)."""
    for part in relative.parts[:-1]:
        if part in SPLIT_NAMES:
            return part
    match = re.match(r"^([A-Za-z]+)(?:[-_.]|$)", relative.stem)
    return match.group(1) if match and match.group(1) in SPLIT_NAMES else None


def _in_split(relative: Path, split: str) -> bool:
    return split in relative.parts[:-1] or re.match(rf"^{re.escape(split)}(?:[-_.]|$)", relative.stem) is not None


def _parquet_files(folder: Path, split: str | None) -> list[Path]:
    """The parquet files of a folder (of one split when given), sorted; a one-line error when there are none."""
    files = sorted(p for p in folder.rglob("*.parquet") if p.is_file())
    if split is not None:
        chosen = [p for p in files if _in_split(p.relative_to(folder), split)]
        if not chosen:
            splits = sorted({s for p in files if (s := _split_of(p.relative_to(folder)))})
            raise DataError(f"{folder}: no parquet file of split '{split}' (a folder or file name starting with it; "
                            f"splits found: {', '.join(splits) or 'none'})")  # fmt: skip
        return chosen
    splits = sorted({s for p in files if (s := _split_of(p.relative_to(folder)))})
    if len(splits) > 1:
        raise DataError(f"{folder}: holds parquet files of splits {', '.join(splits)}; choose one (--data-split)")
    return files


def _parquet_batches(files: list[Path], columns: dict[str, str]) -> Iterator[tuple[list[dict], list[str]]]:
    """(rows, sources) batches of parquet files, read with pyarrow a batch at a time."""
    for path in files:
        try:
            reader = pq.ParquetFile(path, pre_buffer=False)  # a row group at a time: memory bounded by one
            _table_fields(str(path), reader.schema_arrow.names, columns)
            start = 0
            for batch in reader.iter_batches(batch_size=BATCH_ROWS):
                rows = batch.to_pylist()
                yield rows, [f"{path} row {start + i}" for i in range(len(rows))]
                start += len(rows)
        except DataError:
            raise
        except Exception as e:  # pyarrow's own error types (ArrowInvalid, OSError) for a damaged file
            raise DataError(f"{path}: cannot read parquet file: {one_line(e)}") from None


def _dataset_batches(ds, label: str, columns: dict[str, str]) -> Iterator[tuple[list[dict], list[str]]]:
    """(rows, sources) batches of a `datasets.Dataset`, as raw Arrow rows (images not decoded by datasets)."""
    _table_fields(label, list(ds.column_names), columns)
    start = 0
    for table in ds.with_format("arrow").iter(batch_size=BATCH_ROWS):
        rows = table.to_pylist()
        yield rows, [f"{label} row {start + i}" for i in range(len(rows))]
        start += len(rows)


def _from_datasets(source: str, split: str | None, hub_id: bool):
    """(dataset, label) of a save_to_disk folder or of a hub id (`opd.data.hub`, which imports `datasets`)."""
    from opd.data import hub  # deferred: datasets takes about 1 s to import; JSONL and parquet never load it

    return hub.load_hub(source, split) if hub_id else hub.load_from_disk(Path(source), split)


def _is_hub_id(text: str) -> bool:
    """Meant as a hub dataset id: 'org/name', not a local path (no leading '.', '/' or '~', its folder part
    absent here) nor a data file's name."""
    if not HUB_DATASET_ID.match(text) or ".." in text or text.startswith((".", "~")):
        return False
    if os.path.isdir(os.path.dirname(text)):
        return False
    return Path(text).suffix.lower() not in (".jsonl", ".json", ".parquet", ".arrow", ".csv", ".tsv", ".txt")


def load_records(path: str | Path, split: str | None = None, columns: dict[str, str] | str | None = None, *,
                 image_cache: Path | None = None) -> list[Record]:  # fmt: skip
    """Reads the training data at `path`: a JSONL file, a parquet file or folder, a save_to_disk folder or a hub id
    (see the module docstring), with `split` for a source of splits and `columns` (column -> field, or the
    command line's "question=problem" string) for names that differ. `image_cache` is where embedded images
    are written (default `opd.storage.cache_dir()/data-images`).

    JSONL: blank lines are skipped, anything else must be a valid record. Rows are parsed in file order and
    their images decoded on a few threads; the first bad row in order is the one reported. A built-in name ('toy',
    'tiny': `opd.builtin`) is its training JSONL, built on first use."""
    path = builtin_path(path, "data") or path
    columns = _check_columns(columns)
    text = str(path)
    path = Path(path)
    if path.is_dir():
        if (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():
            ds, label = _from_datasets(str(path), split, hub_id=False)
            records = _parse_tables(_dataset_batches(ds, label, columns), path, columns, image_cache)
        elif any(p.is_file() for p in path.rglob("*.parquet")):
            files = _parquet_files(path, split)
            records = _parse_tables(_parquet_batches(files, columns), path, columns, image_cache)
        else:
            raise DataError(f"{path}: is a folder holding neither parquet files nor a dataset saved by datasets' "
                            "save_to_disk (state.json or dataset_dict.json); give such a folder, a parquet file "
                            "or a training JSONL file")  # fmt: skip
        if not records:
            raise DataError(f"{path}: no records")
        return records
    if not path.is_file():
        if not path.exists() and _is_hub_id(text):
            ds, label = _from_datasets(text, split, hub_id=True)
            records = _parse_tables(_dataset_batches(ds, label, columns), Path.cwd(), columns, image_cache)
            if not records:
                raise DataError(f"{label}: no records")
            return records
        raise DataError(f"{path}: training data file not found")
    with path.open("rb") as f:
        head = f.read(4)
    if head == b"PAR1" or path.suffix.lower() == ".parquet":
        if split is not None:
            raise DataError(f"{path}: one parquet file, which has no splits; drop the split '{split}' "
                            "(or give the folder of the split's files)")  # fmt: skip
        records = _parse_tables(_parquet_batches([path], columns), path.parent, columns, image_cache)
        if not records:
            raise DataError(f"{path}: no records")
        return records
    if path.suffix.lower() in NOT_JSONL:
        hint = "give the folder save_to_disk wrote" if path.suffix.lower() == ".arrow" else "convert it to JSONL or parquet"
        raise DataError(f"{path}: not a JSONL or parquet file; {hint}")
    if split is not None:
        raise DataError(f"{path}: a JSONL file, which has no splits; drop the split '{split}'")
    rows, keys = [], {}
    for lineno, line in jsonl_lines(path, lambda n, message: DataError(f"{path}:{n}: {message}")):
        where = f"{path}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: malformed JSON line: {e.msg} (column {e.colno})") from None
        if isinstance(row, dict):
            keys.update(dict.fromkeys(row))
        rows.append((_rename(row, columns, where), where))
    if not rows:
        raise DataError(f"{path}: no records")
    absent = [c for c in columns if c not in keys]
    if absent:  # as a table's column mapping (_table_fields): a mapped key no row has is a mistake, not a no-op
        raise DataError(f"{path}: the column mapping names key '{absent[0]}', which no row has "
                        f"(keys: {', '.join(keys) or 'none'})")
    names = {field: column for column, field in columns.items()}
    with ThreadPoolExecutor(max_workers=4) as pool:  # image decoding releases the GIL
        return list(pool.map(lambda r: parse_record(r[0], r[1], path.parent, names), rows))


