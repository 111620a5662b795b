"""A toy world with a regional-to-global gap: one small target in a cluttered canvas.

Each sample is a textured canvas with muted distractor blobs and one target shape in one of four option colours;
the question asks for the target's colour (A) red (B) green (C) blue (D) yellow. An evidence-centred crop around the
target is known by its bounding box. The processor resizes full canvas and crop alike to the same `resolution`, so
the full view shrinks the target among distractors while the crop enlarges it: a base trained on crops reads the
full view poorly. Everything is a pure function of (world seed, split, index): `sample(cfg, split, i)`; splits
"sft", "opd", "audit" and "eval". `export_world(dir, cfg)` writes train.jsonl and audit.jsonl (bbox form) and
`bench/zoombench/toy.json`, which eval.py reads in ZoomBench's slot.
Details: docs/MODULES.md#opdtoyworld.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

WORLD_VERSION = "1"
OPTIONS = {"A": "red", "B": "green", "C": "blue", "D": "yellow"}
TARGET_RGB = {"red": (225, 35, 35), "green": (35, 190, 50), "blue": (40, 60, 230), "yellow": (230, 215, 35)}
DISTRACTOR_RGB = [
    (235, 130, 35), (145, 60, 175), (45, 180, 190), (230, 115, 165), (150, 205, 55),
    (135, 85, 45), (95, 150, 125), (175, 140, 210), (200, 170, 120),
]  # fmt: skip  orange, purple, cyan, pink, lime, brown, teal, lilac, tan
SHAPES = ("square", "triangle", "diamond")
INSTRUCTION = "Answer with the option's letter from the given choices directly."
SPLITS = {"sft": 0, "opd": 1, "audit": 2, "eval": 3}


@dataclass(frozen=True)
class WorldConfig:
    seed: int = 0
    """World seed: every image, bbox and question is a function of (seed, split, index)."""
    canvas: int = 64
    """Side of the full image in pixels."""
    resolution: int = 32
    """Side both views are resized to by the model's processor (min_pixels = max_pixels = side^2)."""
    target_min: int = 8
    """Smallest target side in canvas pixels."""
    target_max: int = 16
    """Largest target side in canvas pixels."""
    distractors: int = 10
    """Distractor blobs per image."""
    brightness: float = 12.0
    """Half-range of the background's grey level around 122 (uniform)."""
    tint: float = 6.0
    """Half-range of the background's random colour tint (per channel, uniform)."""
    texture: float = 6.0
    """Standard deviation of the background's 16-pixel blotches (per channel)."""
    noise: float = 5.0
    """Standard deviation of the background's pixel noise (per channel)."""
    distractor_saturation: float = 0.35
    """Distractor colours are grey + this x (palette colour - grey): 1 = fully saturated, 0 = grey."""
    crop_scale: float = 2.0
    """Crop side / target side (before the minimum and the canvas bound)."""
    crop_min: int = 16
    """Smallest crop side in canvas pixels."""
    n_opd: int = 960
    """Records of the OPD training JSONL (one epoch = n_opd // prompts_per_step steps)."""
    n_audit: int = 160
    """Records of the audit JSONL (held batches of the Figure 3/4 diagnostics)."""
    n_eval: int = 400
    """Items of the held-out benchmark."""

    def target_range(self, split: str, index: int) -> tuple[int, int]:
        """(smallest, largest) target side of sample `index` of `split`: target_min..target_max for every sample here;
        a world that mixes kinds of items overrides it (experiments/harness/regime.py). It draws nothing from the
        sample's rng."""
        return self.target_min, self.target_max

    def finish(self, s: "Sample", split: str, index: int) -> "Sample":
        """The sample as drawn, changed by a world that adds to it (opd.toy's harm world: a decoy and its crop);
        here unchanged."""
        return s


@dataclass
class Sample:
    image: Image.Image
    bbox: tuple[int, int, int, int]
    colour: str
    shape: str
    target: int
    where: tuple[int, int] = (0, 0)
    """The target's top-left corner (x, y) in canvas pixels."""
    extra: dict = field(default_factory=dict)
    """Fields a world adds to the sample's JSONL and benchmark rows (opd.toy's harm world: "harm")."""

    @property
    def answer(self) -> str:
        return next(k for k, v in OPTIONS.items() if v == self.colour)

    @property
    def problem(self) -> str:
        return "<image>" + question_text(self.shape)

    def crop(self) -> Image.Image:
        return self.image.crop(self.bbox)


def question_text(shape: str) -> str:
    """The question as eval.py's `prompt_text` rebuilds it from the benchmark JSON (same tokens in both)."""
    options = "\n".join(f"({k}) {v}" for k, v in OPTIONS.items())
    return f"What colour is the small {shape}?\n{options}\n{INSTRUCTION}"


def _shape(draw: ImageDraw.ImageDraw, shape: str, x: int, y: int, s: int, fill) -> None:
    if shape == "square":
        draw.rectangle([x, y, x + s - 1, y + s - 1], fill=fill)
    elif shape == "triangle":
        draw.polygon([(x, y + s - 1), (x + s - 1, y + s - 1), (x + (s - 1) / 2, y)], fill=fill)
    elif shape == "diamond":
        h = (s - 1) / 2
        draw.polygon([(x + h, y), (x + s - 1, y + h), (x + h, y + s - 1), (x, y + h)], fill=fill)
    else:  # a distractor blob
        draw.ellipse([x, y, x + s - 1, y + s - 1], fill=fill)


def sample(cfg: WorldConfig, split: str, index: int) -> Sample:
    """Sample `index` of `split`: a pure function of (cfg.seed, split, index)."""
    rng = np.random.default_rng([cfg.seed, SPLITS[split], index, int(WORLD_VERSION)])
    n = cfg.canvas
    # muted background: a grey-brown level, smooth blotches and pixel noise
    base = 122 + rng.uniform(-cfg.brightness, cfg.brightness) + rng.uniform(-cfg.tint, cfg.tint, size=3)
    coarse = rng.normal(0, cfg.texture, size=(n // 16 + 1, n // 16 + 1, 3)).repeat(16, 0).repeat(16, 1)[:n, :n]
    pixels = np.clip(base + coarse + rng.normal(0, cfg.noise, size=(n, n, 3)), 0, 255).astype(np.uint8)
    image = Image.fromarray(pixels)
    draw = ImageDraw.Draw(image)
    colour = list(TARGET_RGB)[int(rng.integers(4))]
    shape = SHAPES[int(rng.integers(len(SHAPES)))]
    lo, hi = cfg.target_range(split, index)
    t = int(rng.integers(lo, hi + 1))
    tx, ty = (int(v) for v in rng.integers(2, n - t - 2, size=2))
    for _ in range(cfg.distractors):  # off-palette blobs, kept off the target
        s = int(rng.integers(2, 7))
        x, y = (int(v) for v in rng.integers(0, n - s, size=2))
        if x < tx + t + 1 and tx < x + s + 1 and y < ty + t + 1 and ty < y + s + 1:
            continue
        hue = np.array(DISTRACTOR_RGB[int(rng.integers(len(DISTRACTOR_RGB)))], dtype=float)
        rgb = hue.mean() + cfg.distractor_saturation * (hue - hue.mean()) + rng.integers(-20, 21, size=3)
        _shape(draw, "blob", x, y, s, tuple(int(v) for v in np.clip(rgb, 0, 255)))
    rgb = np.array(TARGET_RGB[colour]) + rng.integers(-15, 16, size=3)
    _shape(draw, shape, tx, ty, t, tuple(int(v) for v in np.clip(rgb, 0, 255)))
    side = int(min(n, max(cfg.crop_min, round(cfg.crop_scale * t))))
    cx = tx + t / 2 + rng.uniform(-0.25, 0.25) * (side - t)
    cy = ty + t / 2 + rng.uniform(-0.25, 0.25) * (side - t)
    x1 = int(np.clip(round(cx - side / 2), 0, n - side))
    y1 = int(np.clip(round(cy - side / 2), 0, n - side))
    return cfg.finish(Sample(image, (x1, y1, x1 + side, y1 + side), colour, shape, t, (tx, ty)), split, index)


def _write(tmp: Path, cfg: WorldConfig) -> None:
    for split, count, name in (("opd", cfg.n_opd, "train.jsonl"), ("audit", cfg.n_audit, "audit.jsonl")):
        (tmp / "images" / split).mkdir(parents=True)
        with (tmp / name).open("w") as f:
            for i in range(count):
                s = sample(cfg, split, i)
                path = f"images/{split}/{i:05d}.png"
                s.image.save(tmp / path)
                f.write(json.dumps({"image": path, "bbox": list(s.bbox), "problem": s.problem, "answer": s.answer,
                                    "target": s.target, "shape": s.shape, **s.extra}) + "\n")
    bench = tmp / "bench" / "zoombench"
    (bench / "images").mkdir(parents=True)
    rows = []
    for i in range(cfg.n_eval):
        s = sample(cfg, "eval", i)
        s.image.save(bench / "images" / f"{i:05d}.png")
        s.crop().save(bench / "images" / f"{i:05d}_crop.png")
        rows.append({"id": f"toy-{i:05d}", "images": [f"images/{i:05d}.png"],
                     "teacher_images": [f"images/{i:05d}_crop.png"], "query": question_text(s.shape),
                     "response": s.answer, "question_type": "mcq", "category": s.shape, "target": s.target,
                     **s.extra})
    (bench / "toy.json").write_text(json.dumps(rows, indent=0) + "\n")
    (tmp / "world.json").write_text(json.dumps({"version": WORLD_VERSION, **asdict(cfg)}, indent=2) + "\n")


def export_world(out_dir: str | Path, cfg: WorldConfig) -> Path:
    """Writes the world's files into `out_dir` (atomically; an existing complete copy of the same
    config is reused, another config is an error). Returns `out_dir`."""
    out = Path(out_dir)
    marker = out / "world.json"
    if marker.exists():
        have = json.loads(marker.read_text())
        want = {"version": WORLD_VERSION, **asdict(cfg)}
        if have != want:
            raise SystemExit(f"{out} holds another world ({have}); use another output folder")
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        _write(tmp, cfg)
        shutil.rmtree(out, ignore_errors=True)
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
