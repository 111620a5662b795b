"""The other methods' views of a training record: their image and text transforms (the views themselves, with the
default's `full` and `crop`, are the table `VIEWS` of `opd.data.records`):

- `half_resolution`: x_i at half width and height, Lanczos (RP-OPSD's student).
- `masked`: the crop with a black rectangle of area W H / 3, seeded by (seed, step, record id) (OPD-V's negative).
- `reference_answer`: the full image, q_i and the record's reference (OPSD's privileged text, `REFERENCE_TEMPLATE`).

Details and departures: docs/MODULES.md#opddatarecords (its views).
"""

import numpy as np
from PIL import Image, ImageDraw

REFERENCE_TEMPLATE = "{problem}\n\nReference answer (visible to you only): {reference}\nAnswer the question above."
"""OPSD's privileged prompt in this project: the question, then the reference, then the instruction."""


def half_size(width: int, height: int) -> tuple[int, int]:
    """Width and height halved, at least 1 pixel each (the `half_resolution` view's image size)."""
    return max(1, width // 2), max(1, height // 2)


def half_resolution(image: Image.Image) -> Image.Image:
    """x^L of RP-OPSD: width and height halved (`half_size`), Lanczos."""
    return image.resize(half_size(image.width, image.height), Image.LANCZOS)


def mask_box(width: int, height: int, seed: int) -> tuple[int, int, int, int]:
    """OPD-V's random mask: (x0, y0, x1, y1), exclusive ends, of area A = floor(W H / 3) within one pixel
    row or column, aspect w / h = r ~ U(0.5, 2) unless a side of the image caps it:

        w = min(W, sqrt(A r)),  h = A / w;  if h > H: h = H, w = A / H;  (x0, y0) uniform.

    (OPD-V caps h at H without widening w, which leaves less than A on a wide image.)
    """
    rng = np.random.default_rng(seed)
    area = max(1, width * height // 3)
    aspect = float(rng.uniform(0.5, 2.0))
    w = min(width, max(1, round((area * aspect) ** 0.5)))
    h = max(1, round(area / w))
    if h > height:
        h, w = height, min(width, max(1, round(area / height)))
    x0 = int(rng.integers(0, width - w + 1))
    y0 = int(rng.integers(0, height - h + 1))
    return x0, y0, x0 + w, y0 + h


def masked(image: Image.Image, seed: int) -> Image.Image:
    """The image with the black rectangle `mask_box(W, H, seed)`."""
    out = image.copy()
    x0, y0, x1, y1 = mask_box(image.width, image.height, seed)
    ImageDraw.Draw(out).rectangle((x0, y0, x1 - 1, y1 - 1), fill=(0, 0, 0))  # PIL's corners are inclusive
    return out


def reference_prompt(problem: str, reference: str) -> str:
    """OPSD's teacher question: `REFERENCE_TEMPLATE` with the record's question and reference."""
    return REFERENCE_TEMPLATE.format(problem=problem, reference=reference)
