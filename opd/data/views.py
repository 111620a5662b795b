"""Views: what the student (Eq. 1) and the teacher (Eq. 2) see of a training record.

A view maps a record to the images and question text of a prompt; the response tokens are always the student's own.

- `full`: the full image x_i and the question q_i (the student of every method but RP-OPSD).
- `crop`: the evidence-centred crop x~_i and q_i (BAS-OPD's and Vision-OPD's teacher, Eq. 2).
- `half_resolution`, `masked`, `reference_answer`: the other methods' views (`opd.data.family_views`).

A view is eligible for a record when it can be built (`crop`, `masked`: a crop or bbox); a method's candidate set C
is the rows eligible for all its views. Details and departures: docs/MODULES.md#opddataviews.
"""

from collections.abc import Callable
from dataclasses import dataclass

from PIL import Image

from opd.data.family_views import half_layout, half_view, masked_view, reference_layout, reference_view
from opd.data.records import Record, crop_image, full_image


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


def crop_size(record: Record) -> tuple[int, int]:
    """(width, height) of `crop_image(record)`: the bbox's, else the crop file's."""
    if record.bbox is not None:
        x1, y1, x2, y2 = record.bbox
        return x2 - x1, y2 - y1
    return record.crop_size


VIEWS: dict[str, View] = {
    "full": View(lambda r, seed: ([full_image(r)], r.problem), layout=lambda r: ([r.image_size], r.problem)),
    "crop": View(lambda r, seed: ([crop_image(r)], r.problem), True, lambda r: ([crop_size(r)], r.problem)),
    "half_resolution": View(half_view, layout=half_layout),
    "masked": View(masked_view, True, lambda r: ([crop_size(r)], r.problem)),
    "reference_answer": View(reference_view, layout=reference_layout),
}


def get_view(name: str) -> View:
    """Looks a view up by name."""
    if name not in VIEWS:
        raise ValueError(f"unknown view {name!r}; known: {', '.join(sorted(VIEWS))}")
    return VIEWS[name]


def views_eligible(record: Record, views) -> bool:
    """Whether every one of `views` can be built for the record (the crop views need a crop)."""
    return all(VIEWS[v].eligible(record) for v in views)


student_view = VIEWS["full"]
"""The student's input of the paper (Eq. 1): the full image x_i and the question q_i."""
