"""Training records: the JSONL formats, crops, eligibility (the set C of Eq. 4) and the step's prompt batch.

Two record forms are read, one JSON object per line:

- Vision-OPD form: {"images": ["full.jpg"], "teacher_images": ["crop.jpg"], "problem": "<image>Q", "answer": "B"}
- bbox form:       {"image": "full.jpg", "bbox": [x1, y1, x2, y2], "problem": "<image>Q", "answer": "B"}
  (the crop is cut from the full image; `images` + `bbox` is accepted too)

Image paths are relative to the JSONL file's folder unless absolute. An optional `solution` string
is OPSD's privileged text (`opd.views`). Any other scalar field (e.g. `task`, `modality`) is kept as
text in `Record.extra`, where a teacher routing table (`--teachers`) reads it. A row with a crop (either form) belongs to the crop-eligible
set C of the crop-teacher methods; a row with neither is trained on without a teacher there (methods
whose teacher needs no crop, RP-OPSD and OPSD, take every row).

The crop-to-full area ratio a_i (the last feature of Eq. 5) comes from the bbox when there is one,
else from the crop file's and the full image's sizes, assuming the crop was cut from the full image at
its native resolution (as Vision-OPD's crops are); a crop file larger than the full image (an
upscaled crop) gives a_i = 1, the most a cut can cover. A row without a crop has a_i = 0.

Every image is decoded once when the file is read (JPEGs at reduced scale, which still reads every
byte of the compressed stream), so a damaged file stops the run at once instead of steps later.
Every problem is reported as a `DataError` naming the file, the line and the record's own field.
"""

import json
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

from opd.chat import IMAGE_MARK
from opd.cli import UserError


class DataError(UserError, ValueError):
    """A bad training record: the message names the file, the line and the field."""


@dataclass(frozen=True)
class Record:
    """One training prompt x_i, q_i with its privileged crop x~_i when it has one."""

    source: str
    """'file:line' of the record, for error messages."""
    image: Path
    """The full image x_i."""
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
    """The record's own field of the full image ('images' or 'image'), for error messages."""
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


def image_size(path: Path, where: str, field: str) -> tuple[int, int]:
    """(width, height) of an image after decoding it in full, or a DataError naming the record and field.

    JPEGs are decoded at reduced scale (`draft`), which still reads every byte of the compressed
    stream, so a truncated or damaged body fails here too."""
    try:
        with Image.open(path) as im:
            size = im.size
            im.draft("RGB", (max(1, size[0] // 8), max(1, size[1] // 8)))
            im.load()
            return size
    except FileNotFoundError:
        raise DataError(f"{where}: field '{field}': image file not found: {path}") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise DataError(f"{where}: field '{field}': cannot read image {path}: {e}") from None


def _one_path(row: dict, key: str, where: str, root: Path) -> Path:
    value = row[key]
    if isinstance(value, list):
        if len(value) != 1:
            raise DataError(f"{where}: field '{key}': expected exactly one image, got {len(value)}")
        value = value[0]
    if not isinstance(value, str) or not value:
        raise DataError(f"{where}: field '{key}': expected an image path, got {value!r}")
    path = Path(value)
    return path if path.is_absolute() else root / path


def _bbox(value, size: tuple[int, int], where: str) -> tuple[int, int, int, int]:
    if not isinstance(value, (list, tuple)) or len(value) != 4:
        raise DataError(f"{where}: field 'bbox': expected [x1, y1, x2, y2], got {value!r}")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in value):
        raise DataError(f"{where}: field 'bbox': expected four numbers, got {value!r}")
    x1, y1, x2, y2 = (int(round(v)) for v in value)
    w, h = size
    if not (0 <= x1 < x2 <= w and 0 <= y1 < y2 <= h):
        raise DataError(
            f"{where}: field 'bbox': {list(value)} is empty or outside the {w}x{h} image "
            "(need 0 <= x1 < x2 <= width and 0 <= y1 < y2 <= height)"
        )
    return x1, y1, x2, y2


def parse_record(row: object, where: str, root: Path) -> Record:
    """Validates one decoded JSONL row (either form) into a Record, decoding its images."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
    image_key = "images" if "images" in row else "image" if "image" in row else None
    if image_key is None:
        raise DataError(f"{where}: field 'images': missing (need 'images' or 'image')")
    for key in ("problem", "answer", "solution"):
        if key not in row:
            if key == "solution":
                continue
            raise DataError(f"{where}: field '{key}': missing")
        if not isinstance(row[key], (str, int, float)) or isinstance(row[key], bool):
            raise DataError(f"{where}: field '{key}': expected a string, got {row[key]!r}")
    marks = {key: str(row[key]).count(IMAGE_MARK) for key in ("problem", "answer", "solution") if key in row}
    if marks["problem"] > 1:
        raise DataError(f"{where}: field 'problem': {marks['problem']} '{IMAGE_MARK}' marks for the record's one image")
    for key in ("answer", "solution"):
        if marks.get(key):
            raise DataError(f"{where}: field '{key}': holds '{IMAGE_MARK}', which marks an image only in 'problem'")
    image = _one_path(row, image_key, where, root)
    size = image_size(image, where, image_key)
    crop = crop_size = None
    if row.get("teacher_images") is not None:  # [] or "" is an error (_one_path), not "no crop"
        crop = _one_path(row, "teacher_images", where, root)
        crop_size = image_size(crop, where, "teacher_images")
    bbox = _bbox(row["bbox"], size, where) if row.get("bbox") is not None else None
    solution = str(row["solution"]) if "solution" in row else None
    extra = tuple(
        (k, v if isinstance(v, str) else json.dumps(v))
        for k, v in row.items()
        if k not in KNOWN_FIELDS and isinstance(v, (str, int, float, bool))
    )
    return Record(where, image, str(row["problem"]), str(row["answer"]), crop, bbox, size, crop_size or (0, 0), image_key,
                  solution, extra)  # fmt: skip


NOT_JSONL = (".parquet", ".arrow", ".csv", ".tsv", ".zip", ".gz", ".tar")
"""File suffixes `load_records` refuses by name (a JSONL file is read line by line)."""

KNOWN_FIELDS = ("images", "image", "teacher_images", "bbox", "problem", "answer", "solution")
"""The fields `parse_record` reads itself; any other scalar field is kept in `Record.extra` (routing)."""


def load_records(path: str | Path) -> list[Record]:
    """Reads a training JSONL file; blank lines are skipped, anything else must be a valid record.

    Rows are parsed in file order and their images decoded on a few threads; the first bad line in
    file order is the one reported."""
    path = Path(path)
    if path.is_dir():
        raise DataError(f"{path}: is a folder; give the training JSONL file (one JSON object per line)")
    if not path.is_file():
        raise DataError(f"{path}: training data file not found")
    with path.open("rb") as f:
        head = f.read(4)
    if head == b"PAR1" or path.suffix.lower() in NOT_JSONL:
        raise DataError(f"{path}: not a JSONL file (one JSON object per line); convert it to JSONL")
    rows = []
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")  # a byte-order mark is no error
            except UnicodeDecodeError as e:
                raise DataError(f"{where}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1})") from None
            if not line.strip():
                continue
            try:
                rows.append((json.loads(line), where))
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: malformed JSON line: {e.msg} (column {e.colno})") from None
    if not rows:
        raise DataError(f"{path}: no records")
    with ThreadPoolExecutor(max_workers=4) as pool:  # image decoding releases the GIL
        return list(pool.map(lambda r: parse_record(r[0], r[1], path.parent), rows))


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


def step_prompt_indices(n_records: int, prompts_per_step: int, step: int, seed: int) -> list[int]:
    """The record ids of training step `step`: epochs of a seeded permutation, last partial batch dropped.

    Epoch e uses permutation seed (seed, e); one epoch is floor(n / B) steps (the paper's 111 steps of
    28 prompts over 3,120 pairs). Pure function of its arguments, so a resumed run sees the same data.
    """
    steps_per_epoch = n_records // prompts_per_step
    if steps_per_epoch == 0:
        raise ValueError(f"{n_records} records cannot fill one step of {prompts_per_step} prompts")
    epoch, within = divmod(step, steps_per_epoch)
    perm = np.random.default_rng([seed, epoch]).permutation(n_records)
    return perm[within * prompts_per_step : (within + 1) * prompts_per_step].tolist()


def shard(items: list, rank: int, world: int) -> list:
    """The contiguous block of a global step batch that rank `rank` generates and trains on."""
    if len(items) % world:
        raise ValueError(f"{len(items)} prompts per step do not split over {world} processes")
    per = len(items) // world
    return items[rank * per : (rank + 1) * per]
