"""The resumable per-benchmark evaluation loop behind eval.py.

For each benchmark (and view) ``OUT/<key>/`` holds ``predictions.jsonl`` (graded records, appended as the replies
come; a restart skips answered items), ``settings.json`` (what the predictions depend on: a resume with different
settings is refused), ``predictions.rank<r>.jsonl`` under a launcher (merged by rank 0, `merge_parts`) and
``scored.jsonl`` (the last scoring). ``OUT/model_digests.json`` caches the model files' sha256. Scoring reads the
stored replies, so rescoring (another parser, a judge) never regenerates.
Details: docs/MODULES.md#opdevalevaluate.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

from tqdm.auto import tqdm

from opd.answers.grade import grade
from opd.answers.text import strip_thinking
from opd.cli import UserError
from opd.eval import inference
from opd.eval.bench_items import BenchItem
from opd.eval.metrics import score
from opd.eval.parallel import Ranks
from opd.models.identity import DigestCache, file_sha256, hub_snapshot, model_identity  # noqa: F401 (eval.py's resume key)
from opd.storage import Appender, append_jsonl, write_atomic, write_jsonl_atomic  # noqa: F401 (judge, scoring)

NOTES = ("model_path", "base_url", "served_model")  # settings recorded but not compared
SOFT = ("model_revision",)  # compared only when known on both sides


class StoredFileError(UserError, ValueError):
    """A stored JSONL file (predictions, judge cache) has a bad line before its last one."""


def read_jsonl(path, repair: bool = False) -> list[dict]:
    """The rows of a JSONL file ([] when it does not exist).

    A torn last line (no final newline, or not valid JSON) is left out; with ``repair`` the file is
    also truncated to its last complete row so appends continue cleanly. A bad line before the last
    one is an error naming the file and line.
    """
    path = Path(path)
    if not path.is_file():
        return []
    data = path.read_bytes()
    lines = data.split(b"\n")
    rows, good_end, offset = [], 0, 0
    for n, line in enumerate(lines, 1):
        end = offset + len(line) + 1  # past this line's newline
        last = n >= len(lines) - 1  # the final segment, or the final line before a trailing newline
        complete = n < len(lines)  # followed by a newline
        if line.strip():
            try:
                row = json.loads(line)
                if not isinstance(row, dict):
                    raise ValueError("not a JSON object")
            except ValueError as exc:
                if last:
                    break
                raise StoredFileError(f"{path} line {n}: bad JSON row ({exc}); fix or delete the line") from exc
            if not complete:  # valid JSON but the newline never got written: treat as torn
                break
            rows.append(row)
        if complete:
            good_end = end
        offset = end
    if repair and good_end < len(data):
        with open(path, "r+b") as fh:
            fh.truncate(good_end)
    return rows


def _show(key: str, value) -> str:
    text = repr(value)
    return text[:20] + "...'" if key == "model" and str(value).startswith("sha256:") else text


def settings_diff(old: dict, new: dict) -> list[str]:
    """'field: X there, Y now' for each compared setting that differs."""
    diff = []
    for k in sorted(old.keys() | new.keys()):
        if k in NOTES or (k in SOFT and (old.get(k) is None or new.get(k) is None)) or old.get(k) == new.get(k):
            continue
        diff.append(f"{k}: {_show(k, old.get(k))} there, {_show(k, new.get(k))} now")
    return diff


def check_settings(folder: Path, settings: dict) -> bool:
    """Refuses to continue a prediction folder made with other settings; True if it has settings.json."""
    path = Path(folder) / "settings.json"
    if not path.is_file():
        return False
    try:
        old = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(old, dict):
            raise ValueError("not a JSON object")
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise StoredFileError(f"{path}: not a settings file eval.py wrote ({exc}); use another --out, or "
                              f"--overwrite to delete {Path(folder).name}'s predictions and answer it again") from None
    diff = settings_diff(old, settings)
    if diff:
        where = f" (made from {old['model_path']})" if old.get("model_path") else ""
        raise UserError(
            f"{folder} holds predictions made with other settings{where}: {'; '.join(diff)}. "
            f"Use another --out, or --overwrite to delete them and answer {Path(folder).name} again."
        )
    return True


def start_folder(folder: Path, settings: dict, overwrite: bool) -> None:
    """Makes ``folder`` ready for new replies: emptied first with ``overwrite``, settings.json written."""
    folder = Path(folder)
    if overwrite and folder.is_dir():
        shutil.rmtree(folder)
    if check_settings(folder, settings):
        return
    write_atomic(folder / "settings.json", json.dumps(settings, indent=2, sort_keys=True) + "\n")


def load_predictions(folder: Path, repair: bool = True) -> dict[str, dict]:
    """index -> stored record from ``folder/predictions.jsonl`` (repairing a torn last line unless ``repair``
    is False: then it is only left out)."""
    rows = read_jsonl(Path(folder) / "predictions.jsonl", repair=repair)
    by_index: dict[str, dict] = {}
    for row in rows:
        by_index.setdefault(str(row["index"]), row)
    return by_index


PART = "predictions.rank{}.jsonl"  # one process's replies under a launcher (opd.eval.parallel)


def merge_parts(folder: Path, order: list[str] | None = None) -> dict[str, dict]:
    """Moves the replies of the per-process part files (``predictions.rank<r>.jsonl``, a multi-process run's,
    finished or stopped) that predictions.jsonl lacks into it, in ``order`` (item indexes; the parts' order
    otherwise), then deletes the parts; returns index -> record of everything stored. A torn last line of a
    part (a process killed mid-write) is left out: that item is answered again."""
    folder = Path(folder)
    stored = load_predictions(folder)
    parts = sorted(folder.glob(PART.format("*")))
    new: dict[str, dict] = {}
    for part in parts:
        for row in read_jsonl(part):
            index = str(row["index"])
            if index not in stored:
                new.setdefault(index, row)
    if new:
        rank = {index: n for n, index in enumerate(order or [])}
        rows = sorted(new.values(), key=lambda r: rank.get(str(r["index"]), len(rank)))
        append_jsonl(folder / "predictions.jsonl", rows)  # before the parts go: a kill in between loses nothing
        for row in rows:
            stored[str(row["index"])] = row
    for part in parts:
        part.unlink()
    return stored


def predict(
    key: str,
    items: list[BenchItem],
    folder: Path,
    settings: Callable[[], dict],
    get_model: Callable[[], tuple],
    batch_size: int,
    progress: bool = True,
    max_prompt_len: int | None = None,
    overwrite: bool = False,
    ranks=None,
) -> dict[str, dict]:
    """Answers the items of ``folder`` not yet answered and returns index -> record for all stored.

    ``get_model()`` is called only when something is left to answer (rescoring loads no model); it returns
    (model, processor) for Hugging Face `generate` (`inference.answer_items`) or a server backend with its
    own ``answer_items`` (`opd.eval.backends`). ``settings()`` is checked against the folder's settings.json
    before anything loads, and called again after ``get_model()`` (a hub model's revision is known once it is
    downloaded) to write settings.json just before the first reply: a start that fails writes nothing.
    ``overwrite`` answers every item again, deleting the folder's stored replies once the model has loaded.

    ``ranks`` (`opd.eval.parallel.Ranks`, under a launcher): each process answers its share of the unanswered
    items into its own part file, and rank 0 merges them (`merge_parts`); every process returns the same
    records.
    """
    ranks = ranks or Ranks()
    folder = Path(folder)
    order = [item.index for item in items]
    stored = {}
    if not overwrite:
        check_settings(folder, settings())
        stored = ranks.on_main(merge_parts, folder, order) if ranks.world > 1 or any(
            folder.glob(PART.format("*"))) else load_predictions(folder)
    pending = [item for item in items if item.index not in stored]
    if not pending:
        return stored
    engine = get_model()
    final = settings()
    ranks.on_main(start_folder, folder, final, overwrite)
    mine = ranks.share(pending)
    kwargs = {"batch_size": batch_size, "max_new_tokens": final["max_new_tokens"],
              "enable_thinking": final["enable_thinking"], "view": final["view"], "max_prompt_len": max_prompt_len}
    if hasattr(engine, "answer_items"):  # a server backend
        replies: Iterator = engine.answer_items(mine, **kwargs)
    else:
        model, processor = engine
        replies = inference.answer_items(model, processor, mine, **kwargs)
    path = folder / ("predictions.jsonl" if ranks.world == 1 else PART.format(ranks.rank))
    done = len(items) - len(pending)
    desc = key if ranks.world == 1 else f"{key} [rank 0 of {ranks.world}]"
    bar = tqdm(total=done + len(mine), initial=done, desc=desc, unit="item", disable=not progress or not ranks.main)
    try:
        with Appender(path) as fh:  # a full disk: one line, the file cut back to its last whole row
            for n, (item, reply) in enumerate(replies):
                record = {**grade(item, reply), "view": final["view"]}
                fh.add(record, left=len(mine) - n)
                stored[item.index] = record
                bar.update(1)
    finally:
        bar.close()
    if ranks.world > 1:
        ranks.barrier()  # every part complete
        stored = ranks.on_main(merge_parts, folder, order)
    return stored


def score_view(name: str, items: list[BenchItem], stored: dict[str, dict], judge=None) -> tuple[dict, list[dict]]:
    """(score dict, records): the stored replies of ``items`` re-graded, free-form ones judged if asked.

    With a judge, a free-form answer that already matches exactly counts as correct without a request;
    the others take the judge's verdict ("unparsed" scores as wrong). ``record["judge"]`` says which.
    """
    records = []
    for item in items:
        row = stored.get(item.index)
        if row is None:
            continue
        record = {**grade(item, row["reply"]), "view": row.get("view", "full")}
        if judge is not None and item.kind == "open":
            record["exact_match"] = record["correct"]
            answer = strip_thinking(record["reply"])
            if record["correct"]:
                record["judge"] = "exact match"
            elif not answer:
                record["judge"] = "empty reply"
            else:
                record["judge"] = judge.verdict(item.question, item.answer, answer)
                record["correct"] = record["judge"] == "correct"
        records.append(record)
    result = score(name, records)
    if judge is not None:
        judged = [r for r in records if "judge" in r]
        result["judged"] = {v: sum(r["judge"] == v for r in judged)
                            for v in ("exact match", "empty reply", "correct", "incorrect", "unparsed")}
    missing = len(items) - len(records)
    if missing:
        result["missing_predictions"] = missing
    return result, records
