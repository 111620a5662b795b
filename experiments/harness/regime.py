"""A toy world in the paper's regime: feedback that is often redundant (docs/SELECTION.md, "The paper's regime").

An item is one of two kinds: **large** (a share `share` = s of the items: a target of `large_min`..`large_max`
pixels, which the full image already shows, its crop most of the canvas: the teacher's feedback is close to none) or
**small** (a target of `target_min`..`target_max` pixels that only the small crop shows). So the crop area a_i of
Eq. 5 and the student's entropy carry signal about a rollout's utility. Everything else is `opd.toy.world`'s; the
answers are the explained ones of `harness.explain` (7-54 tokens).

Which items are large is exact and nested in s (`is_large`: exactly round(s n) of a finite split's n, the large
items at a smaller s a subset of those at a larger one); the supervised split uses `sft_share`, fixed whatever s, so
every world of the sweep shares one base (`base_world`). Details: docs/MODULES.md#harnessregime.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

import numpy as np

from opd.toy.world import SPLITS, WorldConfig

PROMPTS, ROLLOUTS = 28, 8
"""The paper's step (Table 6): 28 prompts x 8 rollouts = 224 candidates, K = 56 at rho 0.25."""


@dataclass(frozen=True)
class RegimeConfig(WorldConfig):
    share: float = 0.5
    """s: the share of items (training, audit and benchmark) whose target is large, which the full image answers."""
    sft_share: float = 0.5
    """The share of large targets in the base's supervised split (fixed: every s shares one base)."""
    large_min: int = 24
    """Smallest side of a large target in canvas pixels (12 in the full view at 32 x 32)."""
    large_max: int = 32
    """Largest side of a large target in canvas pixels."""
    target_min: int = 10
    """Smallest side of a small target in canvas pixels (5 in the full view)."""
    target_max: int = 14
    """Largest side of a small target in canvas pixels."""
    n_opd: int = PROMPTS * 30
    """Training records: one epoch of 30 steps of 28 prompts."""

    def __post_init__(self):
        if not 0.0 <= self.share <= 1.0 or not 0.0 <= self.sft_share <= 1.0:
            raise ValueError(f"share {self.share} and sft_share {self.sft_share} must lie in [0, 1]")
        if not self.target_max < self.large_min <= self.large_max:
            raise ValueError(f"small targets {self.target_min}-{self.target_max} px must lie below large ones "
                             f"{self.large_min}-{self.large_max} px")  # fmt: skip

    def target_range(self, split: str, index: int) -> tuple[int, int]:
        """The large range for a large item (`is_large`), else the small one."""
        return (self.large_min, self.large_max) if is_large(self, split, index) else (self.target_min, self.target_max)


def split_size(cfg: RegimeConfig, split: str) -> int:
    return {"opd": cfg.n_opd, "audit": cfg.n_audit, "eval": cfg.n_eval}[split]


@lru_cache(maxsize=64)
def _ranks(seed: int, split: str, n: int) -> np.ndarray:
    return np.random.default_rng([seed, SPLITS[split], 35]).permutation(n)


def is_large(cfg: RegimeConfig, split: str, index: int) -> bool:
    """Whether item `index` of `split` has a large target: exactly round(s n) of a finite split's n items, nested in
    s; in the on-the-fly sft split, each item with probability `sft_share`."""
    if split == "sft":
        return bool(np.random.default_rng([cfg.seed, SPLITS[split], index, 35]).random() < cfg.sft_share)
    n = split_size(cfg, split)
    return bool(_ranks(cfg.seed, split, n)[index] < round(cfg.share * n))


def kind(cfg: RegimeConfig, target: int) -> str:
    """'large' or 'small', from a sample's target side (the `target` of its JSONL or benchmark row)."""
    return "large" if target >= cfg.large_min else "small"


def base_world(cfg: RegimeConfig) -> RegimeConfig:
    """The world whose sft split trains the base shared by every s: `cfg` at share 0.5 (the sft split reads
    sft_share only, so the base is the same for every s; its sft.json names this world)."""
    return replace(cfg, share=0.5)


def small_area_bound(cfg: RegimeConfig) -> float:
    """The largest crop area a_i of a small item (its crop side at target_max, as `opd.toy.world.sample` sizes it);
    a large item's is above it (its side is at least crop_scale x large_min)."""
    side = min(cfg.canvas, max(cfg.crop_min, round(cfg.crop_scale * cfg.target_max)))
    return (side / cfg.canvas) ** 2


def small_share(trace: list[dict], cfg: RegimeConfig, rows: str = "selected") -> float:
    """The share of small items among a run's S (`rows` 'selected') or C ('candidates'), over all its steps, from
    harness.experiment.Trace's rows (their a_i: "area")."""
    bound = small_area_bound(cfg) + 1e-4  # the trace keeps a_i to 5 decimals
    picked = [t["area"][i] <= bound for t in trace for i in t[rows]]
    return float(np.mean(picked)) if picked else float("nan")


def accuracy_by_kind(eval_dir: Path, cfg: RegimeConfig) -> dict:
    """eval.py's accuracy (%) on the large and the small items, in both views: {"full": {"large", "small"}, "crop":
    {...}}, from `eval_dir`/zoombench[@crop]/predictions.jsonl (each row's meta holds the item's target side). A kind
    with no item is NaN."""
    return accuracy_by(eval_dir, lambda meta: kind(cfg, int(meta["target"])), ("large", "small"))


def accuracy_by(eval_dir: Path, kind_of, kinds: tuple[str, ...]) -> dict:
    """eval.py's accuracy (%) per kind in both views, {"full": {kind: %}, "crop": {...}}; `kind_of(meta)` names an
    item's kind from its predictions row's meta; a kind with no item is NaN."""
    out = {}
    for view, folder in (("full", "zoombench"), ("crop", "zoombench@crop")):
        hits: dict[str, list[bool]] = {k: [] for k in kinds}
        for line in (Path(eval_dir) / folder / "predictions.jsonl").read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                hits[kind_of(row["meta"])].append(bool(row["correct"]))
        out[view] = {k: 100.0 * float(np.mean(v)) if v else float("nan") for k, v in hits.items()}
    return out
