"""The teacher's privileged view x~_i (Eq. 2): what the crop-conditioned teacher sees instead of x_i.

A view maps a record to the images and question text of the teacher's prompt. The paper's view is
the evidence-centred crop with the same question. Other privileged views (a higher-resolution image
as in RP-OPSD, a masked image as in OPD-V, a text hint) are one more function in `VIEWS`; the
training loop only calls `teacher_view(name)` and never changes. A view must keep the response
tokens' meaning: the teacher scores the student's own response after this prompt.
"""

from collections.abc import Callable

from PIL import Image

from opd.data import Record, crop_image, full_image

View = Callable[[Record], tuple[list[Image.Image], str]]


def student_view(record: Record) -> tuple[list[Image.Image], str]:
    """The student's input (Eq. 1): the full image x_i and the question q_i."""
    return [full_image(record)], record.problem


def crop_view(record: Record) -> tuple[list[Image.Image], str]:
    """The paper's privileged view (Eq. 2): the evidence-centred crop x~_i and the same question q_i."""
    return [crop_image(record)], record.problem


VIEWS: dict[str, View] = {"crop": crop_view}


def teacher_view(name: str) -> View:
    """Looks a privileged view up by name."""
    if name not in VIEWS:
        raise ValueError(f"unknown teacher view {name!r}; known: {', '.join(sorted(VIEWS))}")
    return VIEWS[name]
