"""Views: what the student (Eq. 1) and the teacher (Eq. 2) see of a training record.

A view maps a record to the images and question text of a prompt; the response tokens are always the student's own.

- `full`: the full image x_i and the question q_i (the student of every method but RP-OPSD).
- `crop`: the evidence-centred crop x~_i and q_i (BAS-OPD's and Vision-OPD's teacher, Eq. 2).
- `half_resolution`: x_i at half width and height (RP-OPSD's student).
- `masked`: the crop with a black rectangle of area W H / 3, seeded by (seed, step, record id) (OPD-V's negative).
- `reference_answer`: the full image, q_i and the record's reference (OPSD's privileged text).

A view is eligible for a record when it can be built (`crop`, `masked`: a crop or bbox); a method's candidate set C
is the rows eligible for all its views. Details and departures: docs/MODULES.md#opddataviews.
"""

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

from opd.data.records import Record, crop_image, full_image

REFERENCE_TEMPLATE = "{problem}\n\nReference answer (visible to you only): {reference}\nAnswer the question above."
"""OPSD's privileged prompt in this project: the question, then the reference, then the instruction."""


@dataclass(frozen=True)
class View:
    """One view: `fn(record, seed) -> (images, question)`; `needs_crop` when it cannot be built without one;
    `layout(record) -> (image sizes, question)`: the (width, height) of each image `fn` gives and the question,
    without decoding an image (the prompt-length check before step 0, `opd.models.chat.prompt_length`)."""

    fn: Callable[[Record, int], tuple[list[Image.Image], str]]
    needs_crop: bool = False
    layout: Callable[[Record], tuple[list[tuple[int, int]], str]] | None = None

    def __call__(self, record: Record, seed: int = 0) -> tuple[list[Image.Image], str]:
        return self.fn(record, seed)

    def eligible(self, record: Record) -> bool:
        return record.eligible or not self.needs_crop


def half_resolution(image: Image.Image) -> Image.Image:
    """x^L of RP-OPSD: width and height halved (at least 1 pixel each), Lanczos."""
    return image.resize((max(1, image.width // 2), max(1, image.height // 2)), Image.LANCZOS)


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


def crop_size(record: Record) -> tuple[int, int]:
    """(width, height) of `crop_image(record)`: the bbox's, else the crop file's."""
    if record.bbox is not None:
        x1, y1, x2, y2 = record.bbox
        return x2 - x1, y2 - y1
    return record.crop_size


VIEWS: dict[str, View] = {
    "full": View(lambda r, seed: ([full_image(r)], r.problem), layout=lambda r: ([r.image_size], r.problem)),
    "crop": View(lambda r, seed: ([crop_image(r)], r.problem), True, lambda r: ([crop_size(r)], r.problem)),
    "half_resolution": View(
        lambda r, seed: ([half_resolution(full_image(r))], r.problem),
        layout=lambda r: ([(max(1, r.image_size[0] // 2), max(1, r.image_size[1] // 2))], r.problem),
    ),
    "masked": View(lambda r, seed: ([masked(crop_image(r), seed)], r.problem), True, lambda r: ([crop_size(r)], r.problem)),
    "reference_answer": View(
        lambda r, seed: ([full_image(r)], reference_prompt(r.problem, r.reference)),
        layout=lambda r: ([r.image_size], reference_prompt(r.problem, r.reference)),
    ),
}


def get_view(name: str) -> View:
    """Looks a view up by name."""
    if name not in VIEWS:
        raise ValueError(f"unknown view {name!r}; known: {', '.join(sorted(VIEWS))}")
    return VIEWS[name]


student_view = VIEWS["full"]
"""The student's input of the paper (Eq. 1): the full image x_i and the question q_i."""
