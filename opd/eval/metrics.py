"""Official aggregate scores, as pure functions on per-item records.

A record is a dict with at least ``index``, ``correct`` (bool), ``category``, ``meta`` (dict), ``pred``, ``answer``
and ``parsed`` (bool); :func:`opd.answers.grade.grade` makes one. An unparsed reply counts as wrong.
``score(benchmark, records)`` returns a dict whose ``"score"`` is the official number in percent (0-100), with
``"n"``, ``"unparsed"`` and sub-metrics beside it. Each benchmark's rule is its scorer's docstring (`SCORERS`):
pooled accuracy for V*Bench, ZoomBench, MMStar, POPE and MME-RealWorld (EN, CN); the mean of per-cycle accuracies for
HR-Bench 4K and 8K; question accuracy for MMVP (pair accuracy beside it); Cambrian-1's formula for CV-Bench.
:func:`zoom_gap` gives crop minus full accuracy. docs/EVAL.md says where scoring departs from the paper.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable, Iterable


def _pct(num: float, den: float) -> float | None:
    return 100.0 * num / den if den else None


def accuracy(records: Iterable[dict]) -> float | None:
    """Percent of records with ``correct`` true; None for no records."""
    records = list(records)
    return _pct(sum(bool(r["correct"]) for r in records), len(records))


def group_accuracy(records: Iterable[dict], key: Callable[[dict], object]) -> dict[str, float]:
    """Accuracy per value of ``key(record)`` (records whose key is None are left out)."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        k = key(r)
        if k is not None:
            groups[str(k)].append(r)
    return {k: accuracy(v) for k, v in sorted(groups.items())}


def _meta(name: str) -> Callable[[dict], object]:
    return lambda r: (r.get("meta") or {}).get(name)


def _base(records: list[dict]) -> dict:
    return {"n": len(records), "unparsed": sum(not r.get("parsed", True) for r in records)}


def vstar_score(records: list[dict]) -> dict:
    """V*Bench: pooled accuracy; per category (direct_attributes, relative_position)."""
    return {"score": accuracy(records), **_base(records),
            "per_category": group_accuracy(records, lambda r: r.get("category"))}


def hrbench_score(records: list[dict]) -> dict:
    """HR-Bench: mean over option cycles of the per-cycle accuracy; single/cross the same way.

    Records without ``meta["cycle_category"]`` are treated as one cycle (noted in the result).
    """
    def cycle_mean(rs: list[dict]) -> float | None:
        per_cycle = group_accuracy(rs, lambda r: (r.get("meta") or {}).get("cycle_category", "all"))
        return sum(per_cycle.values()) / len(per_cycle) if per_cycle else None

    out = {"score": cycle_mean(records), **_base(records),
           "per_cycle": group_accuracy(records, lambda r: (r.get("meta") or {}).get("cycle_category", "all"))}
    for category in sorted({str(r.get("category")) for r in records}):
        out[category] = cycle_mean([r for r in records if str(r.get("category")) == category])
    if any("cycle_category" not in (r.get("meta") or {}) for r in records):
        out["note"] = "some records have no cycle_category; they were scored as one cycle"
    return out


def mmvp_pair(record: dict) -> int:
    """The MMVP pair of a record: ``meta["pair"]`` or (index - 1) // 2 + 1 for 1-based indices."""
    pair = (record.get("meta") or {}).get("pair")
    return int(pair) if pair is not None else (int(record["index"]) - 1) // 2 + 1


def mmvp_score(records: list[dict]) -> dict:
    """MMVP: question accuracy (score) and pair accuracy (both questions of a pair right)."""
    pairs: dict[int, list[dict]] = defaultdict(list)
    for r in records:
        pairs[mmvp_pair(r)].append(r)
    complete = [rs for rs in pairs.values() if len(rs) == 2]
    return {"score": accuracy(records), **_base(records),
            "pair_accuracy": _pct(sum(all(r["correct"] for r in rs) for rs in complete), len(complete)),
            "pairs": len(complete), "incomplete_pairs": len(pairs) - len(complete)}


def cvbench_score(records: list[dict]) -> dict:
    """CV-Bench: 1/2 * [(acc_ADE20K + acc_COCO)/2 + acc_Omni3D], from ``meta["source"]``.

    With a source missing (a partial run) the formula uses the parts present and lists the rest
    under ``missing_sources``.
    """
    by_source = group_accuracy(records, _meta("source"))
    by_type = group_accuracy(records, lambda r: str((r.get("meta") or {}).get("type", "")).upper() or None)
    two_d = [by_source[s] for s in ("ADE20K", "COCO") if s in by_source]
    parts = ([sum(two_d) / len(two_d)] if two_d else []) + ([by_source["Omni3D"]] if "Omni3D" in by_source else [])
    out = {"score": sum(parts) / len(parts) if parts else None, **_base(records),
           "per_source": by_source, "acc_2d": by_type.get("2D"), "acc_3d": by_type.get("3D"),
           "per_task": group_accuracy(records, _meta("task"))}
    if by_type.get("2D") is not None and by_type.get("3D") is not None:
        out["macro_2d_3d_pooled"] = (by_type["2D"] + by_type["3D"]) / 2
    missing = [s for s in ("ADE20K", "COCO", "Omni3D") if s not in by_source]
    if missing:
        out["missing_sources"] = missing
    return out


def mmstar_score(records: list[dict]) -> dict:
    """MMStar: pooled accuracy; per category and per l2 category."""
    return {"score": accuracy(records), **_base(records),
            "per_category": group_accuracy(records, lambda r: r.get("category")),
            "per_l2_category": group_accuracy(records, _meta("l2_category"))}


def yes_no_stats(records: list[dict]) -> dict:
    """Accuracy, precision, recall, F1 (percent) and yes-ratio with "yes" as the positive class."""
    tp = sum(r["pred"] == "yes" and r["answer"] == "yes" for r in records)
    fp = sum(r["pred"] == "yes" and r["answer"] != "yes" for r in records)
    fn = sum(r["pred"] != "yes" and r["answer"] == "yes" for r in records)
    precision, recall = _pct(tp, tp + fp), _pct(tp, tp + fn)
    f1 = 2 * precision * recall / (precision + recall) if precision and recall else (0.0 if records else None)
    return {"accuracy": accuracy(records), "precision": precision, "recall": recall, "f1": f1,
            "yes_ratio": _pct(sum(r["pred"] == "yes" for r in records), len(records)), "n": len(records)}


def pope_score(records: list[dict]) -> dict:
    """POPE: pooled accuracy (score); accuracy/precision/recall/F1 per split and overall."""
    splits: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        splits[str((r.get("meta") or {}).get("split", r.get("category")))].append(r)
    return {"score": accuracy(records), **_base(records), "overall": yes_no_stats(records),
            "per_split": {k: yes_no_stats(v) for k, v in sorted(splits.items())}}


def zoombench_score(records: list[dict]) -> dict:
    """ZoomBench: pooled accuracy; per kind (choice/yesno/open) and category."""
    return {"score": accuracy(records), **_base(records),
            "per_kind": group_accuracy(records, lambda r: r.get("kind") or (r.get("meta") or {}).get("kind")),
            "per_category": group_accuracy(records, lambda r: r.get("category"))}


def _mme_l2(record: dict) -> str | None:
    """An MME-RealWorld record's l2 category as its official script groups it: lower case, ".../attribute" for
    every attribute category ("Color/attribute/motion" and "color/attribute" are one)."""
    fine = (record.get("meta") or {}).get("l2_category")
    if fine is None:
        return None
    fine = str(fine).lower()
    return fine.split("/")[0] + "/attribute" if "attribute" in fine else fine


def mmerealworld_score(records: list[dict]) -> dict:
    """MME-RealWorld (EN or CN): pooled accuracy over every item (the official "Overall"); per task, per
    task/subtask (the item's category) and per l2 category, each pooled."""
    return {"score": accuracy(records), **_base(records),
            "per_task": group_accuracy(records, _meta("task")),
            "per_subtask": group_accuracy(records, lambda r: r.get("category") or None),
            "per_l2_category": group_accuracy(records, _mme_l2)}


def zoom_gap(full_records: list[dict], crop_records: list[dict]) -> dict:
    """Crop-image minus full-image accuracy (percentage points) on the indices both runs scored."""
    full = {str(r["index"]): r for r in full_records}
    crop = {str(r["index"]): r for r in crop_records}
    common = sorted(full.keys() & crop.keys())
    acc_full = accuracy(full[i] for i in common)
    acc_crop = accuracy(crop[i] for i in common)
    gap = acc_crop - acc_full if common else None
    return {"full": acc_full, "crop": acc_crop, "gap": gap, "n": len(common)}


SCORERS: dict[str, Callable[[list[dict]], dict]] = {
    "vstar": vstar_score,
    "zoombench": zoombench_score,
    "hrbench4k": hrbench_score,
    "mmvp": mmvp_score,
    "cvbench": cvbench_score,
    "mmstar": mmstar_score,
    "pope": pope_score,
    "hrbench8k": hrbench_score,
    "mmerealworld": mmerealworld_score,
    "mmerealworld_cn": mmerealworld_score,
}


def score(benchmark: str, records: list[dict]) -> dict:
    """The official score of ``benchmark`` (percent, key ``"score"``) and its sub-metrics."""
    if benchmark not in SCORERS:
        raise ValueError(f"unknown benchmark {benchmark!r}; known: {', '.join(SCORERS)}")
    records = list(records)
    if not records:
        raise ValueError(f"{benchmark}: no records to score")
    return SCORERS[benchmark](records)
