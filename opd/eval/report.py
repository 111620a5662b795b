"""Results files and tables in the paper's Table 1 layout.

``results.json`` holds ``{"meta": {...}, "benchmarks": {name: score dict}}`` where each score dict
comes from :func:`opd.eval.metrics.score` (``"score"`` in percent). It is written atomically (a temp
file in the same folder, then ``os.replace``), so a crash never leaves half a file.

A table has one column per benchmark asked for (`ORDER`: the paper's Table 1 order, V*Bench, ZoomBench,
HR-Bench 4K, MMVP, CV-Bench, MMStar, POPE, with the family's HR-Bench 8K and MME-RealWorld EN / CN after
HR-Bench 4K), then Avg.: the unweighted mean over the benchmarks present (the paper averages all seven).
A benchmark asked for but absent shows "-" and is named under the table.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from opd.eval.benchmarks import PAPER
from opd.storage import write_atomic

TITLES = {
    "vstar": "V*Bench",
    "zoombench": "ZoomBench",
    "hrbench4k": "HR-Bench 4K",
    "hrbench8k": "HR-Bench 8K",
    "mmerealworld": "MME-RealWorld EN",
    "mmerealworld_cn": "MME-RealWorld CN",
    "mmvp": "MMVP",
    "cvbench": "CV-Bench",
    "mmstar": "MMStar",
    "pope": "POPE",
}
ORDER = tuple(TITLES)
"""Column order: the paper's seven (Table 1) and the family's six (opd.eval.benchmarks.PAPER / FAMILY) both keep
their own order in it."""

COLUMNS = tuple((key, TITLES[key]) for key in PAPER)  # the paper's Table 1 columns: a table's default


def columns(names=None) -> tuple[tuple[str, str], ...]:
    """(key, title) of each benchmark in `names` that a table has a column for, in `ORDER`; None: the paper's seven."""
    if names is None:
        return COLUMNS
    wanted = set(names)
    return tuple((key, TITLES[key]) for key in ORDER if key in wanted)


def write_results(path, benchmarks: dict[str, dict], meta: dict | None = None) -> Path:
    """Write ``{"meta": meta, "benchmarks": benchmarks}`` to ``path`` atomically; return the path."""
    payload = {"meta": meta or {}, "benchmarks": benchmarks}
    text = json.dumps(payload, indent=2, sort_keys=True, allow_nan=False) + "\n"  # a NaN fails before any write
    return write_atomic(path, text)


def read_results(path) -> dict:
    """A results.json as written by :func:`write_results` (a folder means its results.json)."""
    path = Path(path)
    if path.is_dir():
        path = path / "results.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"{path}: results file not found") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON: {exc}") from exc
    if not isinstance(data, dict) or not isinstance(data.get("benchmarks"), dict):
        raise ValueError(f"{path}: field 'benchmarks' missing; not a results.json from opd.eval.report")
    return data


def row_scores(benchmarks: dict[str, dict], names=None) -> dict[str, float | None]:
    """Each column's score (None when absent; `columns(names)`) and "avg" over the present ones."""
    scores = {}
    for key, _ in columns(names):
        value = (benchmarks.get(key) or {}).get("score")
        scores[key] = float(value) if value is not None else None
    present = [v for v in scores.values() if v is not None]
    scores["avg"] = sum(present) / len(present) if present else None
    return scores


def _fmt(value: float | None, signed: bool = False) -> str:
    if value is None:
        return "-"
    return f"{value:+.2f}" if signed else f"{value:.2f}"


def _table(rows: list[tuple[str, dict]], cols, signed: bool = False, first: str = "Run") -> list[str]:
    header = [first] + [title for _, title in cols] + ["Avg."]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"]
    for label, scores in rows:
        cells = [label] + [_fmt(scores[key], signed) for key, _ in cols] + [_fmt(scores["avg"], signed)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _missing_note(label: str, scores: dict, cols) -> str | None:
    missing = [title for key, title in cols if scores[key] is None]
    if not missing:
        return None
    return f"{label}: missing {', '.join(missing)}; Avg. is over the {len(cols) - len(missing)} present."


def markdown_table(benchmarks: dict[str, dict], label: str = "model", names=None) -> str:
    """One-row Markdown table, a column per benchmark in `names` (eval.py: those it evaluated; None: the paper's
    seven) in `ORDER`, 2 decimals, with a note naming the ones asked for but absent."""
    cols = columns(names)
    scores = row_scores(benchmarks, names)
    lines = _table([(label, scores)], cols, first="Model")
    note = _missing_note(label, scores, cols)
    return "\n".join(lines + ([f"\n{note}"] if note else [])) + "\n"


GENERIC = re.compile(r"^(eval|evals|evaluation|results?|bench|benchmarks?)([-_.].*)?$", re.IGNORECASE)
"""Folder names that say nothing about the model (eval, eval-4, results, ...): a row is named by the folder above."""


def _run_folder(folder: Path) -> bool:
    """A train.py run folder (its ledger or its latest checkpoint's name is there)."""
    return (folder / "ledger.jsonl").is_file() or (folder / "latest").is_file()


def default_label(folder) -> str:
    """The row label of an eval.py output folder without --label: its name, unless that is generic (`GENERIC`: eval,
    eval-4, ...) or the folder lies inside a train.py run folder; then the parent's name (runs/paper-4b/eval ->
    paper-4b)."""
    folder = Path(folder).resolve()
    parent = folder.parent
    if parent != folder and parent.name and (GENERIC.match(folder.name) or _run_folder(parent)):
        return parent.name
    return folder.name or str(folder)


def _stored_label(data: dict, folder: Path) -> str | None:
    """The label a results.json was given with --label (None: none given). Files written before `label_from`
    existed always stored one: the folder's name unless --label said otherwise."""
    meta = data.get("meta") or {}
    label = meta.get("label")
    if not label:
        return None
    if "label_from" in meta:
        return str(label) if meta["label_from"] == "--label" else None
    return None if str(label) == folder.name else str(label)


def _model_label(data: dict) -> str | None:
    """The model's own name a results.json was labelled with (eval.py without --label, `opd.eval.config.model_name`);
    None for files labelled by their folder (as eval.py did before) or by --label."""
    meta = data.get("meta") or {}
    return str(meta["label"]) if meta.get("label_from") == "model" and meta.get("label") else None


def row_labels(folders: list[Path], stored: list[str | None], named: list[str | None] | None = None) -> list[str]:
    """One label per run: its stored --label, else its model's name (`named`), else `default_label`; runs whose
    labels other than --label collide are named by the shortest tail of their paths that tells them apart (a/eval
    and b/eval: a and b; x/a/eval and y/a/eval: x/a/eval and y/a/eval)."""
    named = named or [None] * len(folders)
    labels = [s if s is not None else m or default_label(f) for f, s, m in zip(folders, stored, named)]
    for n in range(len(labels)):
        clash = [m for m, label in enumerate(labels) if label == labels[n]]
        if stored[n] is not None or len(clash) < 2:
            continue
        mine = {m: Path(folders[m]).resolve().parts for m in clash if stored[m] is None}
        taken = {label for m, label in enumerate(labels) if m not in mine}
        for depth in range(2, max(len(p) for p in mine.values()) + 1):
            tails = {m: str(Path(*p[-depth:])) for m, p in mine.items()}
            if len(set(tails.values())) == len(tails) and taken.isdisjoint(tails.values()):
                break
        for m, tail in tails.items():
            labels[m] = tail
    return labels


def compare_runs(paths) -> str:
    """Runs side by side (one row each; a column per benchmark any of them scored, in `ORDER`), then each run's
    deltas against the first."""
    paths = list(paths)
    if not paths:
        raise ValueError("compare_runs: no results files given")
    datas = [read_results(p) for p in paths]
    folders = [Path(p).resolve() for p in paths]
    folders = [f.parent if f.suffix == ".json" else f for f in folders]
    labels = row_labels(folders, [_stored_label(d, f) for d, f in zip(datas, folders)], [_model_label(d) for d in datas])
    names = {key for d in datas for key, value in d["benchmarks"].items() if (value or {}).get("score") is not None}
    cols = columns(names) or COLUMNS
    runs = [(label, row_scores(d["benchmarks"], [k for k, _ in cols])) for label, d in zip(labels, datas)]
    lines = ["Scores (%)", ""] + _table(runs, cols)
    base = runs[0][1]
    deltas = []
    for label, scores in runs[1:]:
        d = {k: (scores[k] - base[k]) if scores[k] is not None and base[k] is not None else None for k in base}
        deltas.append((label, d))
    if deltas:
        lines += ["", f"Delta vs {runs[0][0]} (points)", ""] + _table(deltas, cols, signed=True)
    notes = [n for n in (_missing_note(label, s, cols) for label, s in runs) if n]
    if len({tuple(k for k, _ in cols if s[k] is not None) for _, s in runs}) > 1:
        notes.append("The runs cover different benchmarks, so their Avg. columns are not comparable.")
    if notes:
        lines += [""] + notes
    return "\n".join(lines) + "\n"
