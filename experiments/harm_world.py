"""A toy world where the crop teacher can hurt: a share h of the items has a crop cut around a decoy (docs/SELECTION.md,
"Part 4").

The world is the paper's regime (`harness.regime`: a share s of large targets the full image answers, small ones only
the crop shows) with one decoy added to every image: a muted off-palette blob (the distractors' palette, `decoy_min`
..`decoy_max` pixels) placed so that a box of the item's usual crop side around it misses the target. On a harmful
item (small items only) the crop is that box: the crop teacher sees no target, so it is diffuse or wrong, and Full
querying distils it. `harm_scale` sets the harmful crop's side against the usual one: 1 keeps the usual area (the
harm cannot be told from a_i before the teacher runs), below 1 shifts it (a_i tells, as a bad crop source would).

Exact and nested: in a finite split the harmful items are the first round(h n) of a seeded permutation of its
*eligible* items (small, with a decoy box that misses the target), so exactly round(h n) are harmful and the set at a
smaller h is inside the one at a larger h. The images do not depend on h or harm_scale (the decoy is drawn in every
item, its place drawn from its own stream): the three worlds of the study differ only in where crops are cut. The
sft split is never harmful, so every world shares the one base (`base_world`). Rows carry "harm" (0 or 1).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np
from PIL import ImageDraw

from harness.regime import RegimeConfig, is_large, split_size
from opd.toy.world import DISTRACTOR_RGB, SPLITS, Sample, sample

DECOY_TRIES = 64
"""Random places tried for the decoy's box before the item counts as ineligible (no decoy drawn)."""


@dataclass(frozen=True)
class HarmConfig(RegimeConfig):
    harm: float = 0.0
    """h: the share of a finite split's items whose crop is cut around the decoy (small items only)."""
    harm_scale: float = 1.0
    """Side of a harmful crop / the item's usual crop side: 1 the usual area, below 1 a shifted (smaller) one."""
    decoy_min: int = 4
    """Smallest side of the decoy blob in canvas pixels."""
    decoy_max: int = 6
    """Largest side of the decoy blob in canvas pixels."""

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 <= self.harm <= 1.0 - self.share:
            raise ValueError(f"harm {self.harm} must lie in [0, 1 - share] (only small items can be harmful)")
        if not 0.0 < self.harm_scale <= 1.0:
            raise ValueError(f"harm_scale {self.harm_scale} must lie in (0, 1] (the crop stays inside the decoy box)")

    def finish(self, s: Sample, split: str, index: int) -> Sample:
        """The decoy drawn into `s`; on a harmful item the crop moved onto it."""
        box = decoy_box(self, s, split, index)
        if box is None:
            return replace(s, extra={"harm": 0})
        draw_decoy(self, s, box, split, index)
        if not harmful(self, split, index):
            return replace(s, extra={"harm": 0})
        return replace(s, bbox=harmful_crop(self, box), extra={"harm": 1})


def _rng(cfg: HarmConfig, split: str, index: int) -> np.random.Generator:
    return np.random.default_rng([cfg.seed, SPLITS[split], index, 43])


def decoy_box(cfg: HarmConfig, s: Sample, split: str, index: int) -> tuple[int, int, int, int] | None:
    """A box of the item's usual crop side inside the canvas, one pixel clear of the target; None when none of
    DECOY_TRIES random places is (then the item has no decoy and cannot be harmful)."""
    side, n = s.bbox[2] - s.bbox[0], cfg.canvas
    (tx, ty), t = s.where, s.target
    for x, y in _rng(cfg, split, index).integers(0, n - side + 1, size=(DECOY_TRIES, 2)).tolist():
        if x > tx + t or tx > x + side or y > ty + t or ty > y + side:
            return (x, y, x + side, y + side)
    return None


def draw_decoy(cfg: HarmConfig, s: Sample, box: tuple[int, int, int, int], split: str, index: int) -> None:
    """A muted off-palette blob at the centre of `box` (the distractors' colours and saturation)."""
    rng = np.random.default_rng([cfg.seed, SPLITS[split], index, 44])
    d = int(rng.integers(cfg.decoy_min, cfg.decoy_max + 1))
    cx, cy = (box[0] + box[2]) // 2, (box[1] + box[3]) // 2
    hue = np.array(DISTRACTOR_RGB[int(rng.integers(len(DISTRACTOR_RGB)))], dtype=float)
    rgb = hue.mean() + cfg.distractor_saturation * (hue - hue.mean()) + rng.integers(-20, 21, size=3)
    x, y = cx - d // 2, cy - d // 2
    ImageDraw.Draw(s.image).ellipse([x, y, x + d - 1, y + d - 1], fill=tuple(int(v) for v in np.clip(rgb, 0, 255)))


def harmful_crop(cfg: HarmConfig, box: tuple[int, int, int, int]) -> tuple[int, int, int, int]:
    """The harmful crop: `box` scaled by harm_scale about its centre (at least crop_min), so it misses the target."""
    side = box[2] - box[0]
    new = min(side, max(cfg.crop_min, round(cfg.harm_scale * side)))
    x1, y1 = box[0] + (side - new) // 2, box[1] + (side - new) // 2
    return (x1, y1, x1 + new, y1 + new)


def harmful(cfg: HarmConfig, split: str, index: int) -> bool:
    """Whether item `index` of `split` has its crop cut around the decoy: exactly round(h n) of a finite split's n
    items, nested in h; never in the sft split."""
    if split == "sft" or cfg.harm <= 0.0:
        return False
    n = split_size(cfg, split)
    return index in _harmful_set(replace(cfg, harm=0.0, harm_scale=1.0), split, n, round(cfg.harm * n))


@lru_cache(maxsize=32)
def _harmful_set(clean: HarmConfig, split: str, n: int, count: int) -> frozenset:
    eligible = [i for i in range(n) if not is_large(clean, split, i)
                and decoy_box(clean, sample(clean, split, i), split, i) is not None]
    if len(eligible) < count:
        raise ValueError(f"{split}: {count} harmful items asked, {len(eligible)} eligible of {n}")
    order = np.random.default_rng([clean.seed, SPLITS[split], 45]).permutation(len(eligible))
    return frozenset(eligible[j] for j in order[:count])


def base_world(cfg: HarmConfig) -> HarmConfig:
    """The world whose sft split trains the one base of every (h, harm_scale): share 0.5, no harm."""
    return replace(cfg, share=0.5, harm=0.0, harm_scale=1.0)
