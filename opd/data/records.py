"""Training records: a `Record` (one row of the training data), its images and crops, and eligibility (the set C of
Eq. 4).

A record with a crop (a crop file or a bbox) belongs to the crop teacher's candidate set C; its other scalar fields
are kept in `Record.extra` (teacher routing). The crop-to-full area ratio a_i (Eq. 5's last feature) comes from the
bbox, else from the two images' sizes. A row becomes a Record in `opd.data.parse` (the two forms and their checks);
paths, `Record.source` and the rest: docs/MODULES.md#opddatarecords.
"""

from dataclasses import dataclass
from pathlib import Path

from PIL import Image, UnidentifiedImageError

from opd.cli import UserError


class DataError(UserError, ValueError):
    """A bad training record or source: the message names the file (or dataset), the row and the field."""


@dataclass(frozen=True)
class Record:
    """One training prompt x_i, q_i with its privileged crop x~_i when it has one."""

    source: str
    """The record's row, for error messages: 'file:line' (JSONL), 'file row N' (parquet), 'org/name[split] row N'."""
    image: Path
    """The full image x_i (an embedded image: its file in the content-addressed image cache)."""
    problem: str
    """The question q_i; '<image>' marks where the image goes (front when absent)."""
    answer: str
    """The reference answer (not used by OPD training; kept for evaluation and the toy world)."""
    crop: Path | None = None
    """A crop image file x~_i (Vision-OPD's `teacher_images`)."""
    bbox: tuple[int, int, int, int] | None = None
    """[x1, y1, x2, y2] in full-image pixels; the crop is cut from the full image."""
    image_size: tuple[int, int] = (0, 0)
    """(width, height) of the full image."""
    crop_size: tuple[int, int] = (0, 0)
    """(width, height) of the crop file, when there is one."""
    image_key: str = "images"
    """The record's own field of the full image ('images' or 'image', or the column mapped to it), for error messages."""
    solution: str | None = None
    """An optional worked solution (field `solution`), OPSD's privileged text when present."""
    extra: tuple[tuple[str, str], ...] = ()
    """Every other scalar field of the row as (name, text), in file order: e.g. `task` or `modality`, which a
    routing table (`--teachers`, `opd.teachers`) maps to a teacher."""

    def field(self, name: str) -> str | None:
        """The text of one of the record's other fields (`extra`), or None when the row has no such field."""
        return dict(self.extra).get(name)

    @property
    def reference(self) -> str:
        """The privileged text of OPSD's teacher: the solution when the record has one, else the answer."""
        return self.solution if self.solution else self.answer

    @property
    def eligible(self) -> bool:
        """Whether the record belongs to the crop-eligible set C (Eq. 4)."""
        return self.crop is not None or self.bbox is not None

    @property
    def area_ratio(self) -> float:
        """a_i of Eq. 5: crop area / full-image area, from the bbox, else from the crop file's size
        (capped at 1: a crop cut at native resolution covers at most the whole image); 0 without a crop."""
        full = self.image_size[0] * self.image_size[1]
        if full == 0:
            return 0.0
        if self.bbox is not None:
            x1, y1, x2, y2 = self.bbox
            return (x2 - x1) * (y2 - y1) / full
        if self.crop is not None:
            return min(1.0, self.crop_size[0] * self.crop_size[1] / full)
        return 0.0


def open_image(path: Path, where: str, field: str) -> Image.Image:
    """Opens an image as RGB or raises a DataError naming the record and field."""
    try:
        with Image.open(path) as im:
            return im.convert("RGB")
    except FileNotFoundError:
        raise DataError(f"{where}: field '{field}': image file not found: {path}") from None
    except (UnidentifiedImageError, OSError) as e:
        raise DataError(f"{where}: field '{field}': cannot read image {path}: {e}") from None


def full_image(record: Record) -> Image.Image:
    """The student's view x_i: the full image."""
    return open_image(record.image, record.source, record.image_key)


def crop_image(record: Record) -> Image.Image:
    """The evidence-centred crop x~_i: the crop file, else the bbox cut from the full image."""
    if record.crop is not None:
        return open_image(record.crop, record.source, "teacher_images")
    if record.bbox is None:
        raise DataError(f"{record.source}: field 'teacher_images': the record has no crop (not in C)")
    return full_image(record).crop(record.bbox)
