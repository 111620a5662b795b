"""Results files and tables in the paper's Table 1 layout.

``results.json`` holds ``{"meta": {...}, "benchmarks": {name: score dict}}`` where each score dict
comes from :func:`opd.eval.metrics.score` (``"score"`` in percent). It is written atomically (a temp
file in the same folder, then ``os.replace``), so a crash never leaves half a file.

Tables follow Table 1's column order: V*Bench, ZoomBench, HR-Bench 4K, MMVP, CV-Bench, MMStar,
POPE, Avg. The average is the unweighted mean over the benchmarks present (the paper averages
all seven); absent benchmarks show "-" and are listed under the table.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

COLUMNS = (
    ("vstar", "V*Bench"),
    ("zoombench", "ZoomBench"),
    ("hrbench4k", "HR-Bench 4K"),
    ("mmvp", "MMVP"),
    ("cvbench", "CV-Bench"),
    ("mmstar", "MMStar"),
    ("pope", "POPE"),
)


def write_results(path, benchmarks: dict[str, dict], meta: dict | None = None) -> Path:
    """Write ``{"meta": meta, "benchmarks": benchmarks}`` to ``path`` atomically; return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"meta": meta or {}, "benchmarks": benchmarks}
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(payload, fh, indent=2, sort_keys=True, allow_nan=False)
            fh.write("\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


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


def row_scores(benchmarks: dict[str, dict]) -> dict[str, float | None]:
    """Each Table 1 column's score (None when absent) and "avg" over the present ones."""
    scores = {}
    for key, _ in COLUMNS:
        value = (benchmarks.get(key) or {}).get("score")
        scores[key] = float(value) if value is not None else None
    present = [v for v in scores.values() if v is not None]
    scores["avg"] = sum(present) / len(present) if present else None
    return scores


def _fmt(value: float | None, signed: bool = False) -> str:
    if value is None:
        return "-"
    return f"{value:+.2f}" if signed else f"{value:.2f}"


def _table(rows: list[tuple[str, dict]], signed: bool = False, first: str = "Run") -> list[str]:
    header = [first] + [title for _, title in COLUMNS] + ["Avg."]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"]
    for label, scores in rows:
        cells = [label] + [_fmt(scores[key], signed) for key, _ in COLUMNS] + [_fmt(scores["avg"], signed)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _missing_note(label: str, scores: dict) -> str | None:
    missing = [title for key, title in COLUMNS if scores[key] is None]
    if not missing:
        return None
    return f"{label}: missing {', '.join(missing)}; Avg. is over the {len(COLUMNS) - len(missing)} present."


def markdown_table(benchmarks: dict[str, dict], label: str = "model") -> str:
    """One-row Markdown table in Table 1 order, 2 decimals, with a note naming missing benchmarks."""
    scores = row_scores(benchmarks)
    lines = _table([(label, scores)], first="Model")
    note = _missing_note(label, scores)
    return "\n".join(lines + ([f"\n{note}"] if note else [])) + "\n"


def _label(path, data: dict) -> str:
    """meta["label"] if set, else the name of the run folder holding results.json."""
    if (data.get("meta") or {}).get("label"):
        return str(data["meta"]["label"])
    path = Path(path).resolve()
    return (path.parent if path.suffix == ".json" else path).name or str(path)


def compare_runs(paths) -> str:
    """Runs side by side (one row each, Table 1 order), then each run's deltas against the first."""
    paths = list(paths)
    if not paths:
        raise ValueError("compare_runs: no results files given")
    runs = []
    for p in paths:
        data = read_results(p)
        runs.append((_label(p, data), row_scores(data["benchmarks"])))
    lines = ["Scores (%)", ""] + _table(runs)
    base = runs[0][1]
    deltas = []
    for label, scores in runs[1:]:
        d = {k: (scores[k] - base[k]) if scores[k] is not None and base[k] is not None else None for k in base}
        deltas.append((label, d))
    if deltas:
        lines += ["", f"Delta vs {runs[0][0]} (points)", ""] + _table(deltas, signed=True)
    notes = [n for n in (_missing_note(label, s) for label, s in runs) if n]
    if len({tuple(k for k, _ in COLUMNS if s[k] is not None) for _, s in runs}) > 1:
        notes.append("The runs cover different benchmarks, so their Avg. columns are not comparable.")
    if notes:
        lines += [""] + notes
    return "\n".join(lines) + "\n"
