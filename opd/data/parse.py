"""Reading a training row into a `opd.data.records.Record`: the two record forms, their checks and their images.

Two forms, one JSON object per line or one table row each (sources: `opd.data.sources.load_records`):

- Vision-OPD form: {"images": ["full.jpg"], "teacher_images": ["crop.jpg"], "problem": "<image>Q", "answer": "B"}
- bbox form:       {"image": "full.jpg", "bbox": [x1, y1, x2, y2], "problem": "<image>Q", "answer": "B"}

Every image is decoded once when read, so a damaged one stops the run at once, as a `DataError` naming the row and
field; embedded images (table rows) are written once each into a content-addressed image cache. Details:
docs/MODULES.md#opddatarecords.
"""

import hashlib
import io
import json
import math
import os
import threading
from pathlib import Path

from PIL import Image, UnidentifiedImageError

from opd.data.records import Record
from opd.data.settings import DataError
from opd.models.chat import IMAGE_MARK


def one_line(exc: BaseException) -> str:
    """An exception's message on one line (pyarrow's and datasets' messages may span several)."""
    return " ".join(str(exc).split()) or type(exc).__name__


def _decode(source, label: str, where: str, field: str) -> tuple[tuple[int, int], str | None]:
    """((width, height), PIL format) of an image file or file object after decoding it in full."""
    try:
        with Image.open(source) as im:
            size, fmt = im.size, im.format
            im.draft("RGB", (max(1, size[0] // 8), max(1, size[1] // 8)))
            im.load()
            return size, fmt
    except FileNotFoundError:
        raise DataError(f"{where}: field '{field}': image file not found: {label}") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise DataError(f"{where}: field '{field}': cannot read image {label}: {one_line(e)}") from None


def image_size(path: Path, where: str, field: str) -> tuple[int, int]:
    """(width, height) of an image after decoding it in full, or a DataError naming the record and field.

    JPEGs are decoded at reduced scale (`draft`), which still reads every byte of the compressed
    stream, so a truncated or damaged body fails here too."""
    return _decode(path, str(path), where, field)[0]


SUFFIXES = {"JPEG": ".jpg", "PNG": ".png", "WEBP": ".webp", "GIF": ".gif", "BMP": ".bmp", "TIFF": ".tif"}
"""The cache file suffix of an embedded image by its PIL format (any other: '.' + the format's name)."""


def _embedded(data: bytes, name: str | None, where: str, field: str, cache: Path) -> tuple[Path, tuple[int, int]]:
    """An embedded image's file in the content-addressed cache (written when absent) and its size, after
    decoding the bytes once from memory; a damaged one raises a DataError naming the row and field."""
    data = bytes(data)
    label = f"(embedded, {len(data)} bytes{f', {name!r}' if name else ''})"
    size, fmt = _decode(io.BytesIO(data), label, where, field)
    digest = hashlib.sha256(data).hexdigest()
    suffix = SUFFIXES.get(fmt or "", f".{(fmt or 'img').lower()}")
    target = cache / digest[:2] / f"{digest}{suffix}"
    try:
        if not (target.is_file() and target.stat().st_size == len(data)):
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f".{digest}.{os.getpid()}.{threading.get_ident()}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, target)
    except OSError as e:
        raise DataError(f"{where}: field '{field}': cannot write the embedded image to the image cache {cache}: "
                        f"{one_line(e)}") from None  # fmt: skip
    return target, size


def _remote_bytes(path: str, where: str, field: str) -> bytes:
    """The bytes of a hub dataset's image given by URL or archive path ('zip://...::https://...')."""
    from datasets.utils.file_utils import xopen  # deferred: datasets (1 s) only for a hub dataset's remote image

    try:
        with xopen(path, "rb") as f:
            return f.read()
    except Exception as e:  # fsspec and HTTP errors of every kind
        raise DataError(f"{where}: field '{field}': cannot fetch image {path}: {one_line(e)}") from None


def _image(row: dict, key: str, where: str, root: Path, own: str, cache: Path | None) -> tuple[Path, tuple[int, int]]:
    """The image file of field `key` (named `own` in the row) and its decoded size.

    JSONL rows (cache None) hold a path string or a list of one; table rows also an Image struct
    {bytes, path} or raw bytes, whose bytes go to the image cache."""
    value = row[key]
    if isinstance(value, list):
        if len(value) != 1:
            raise DataError(f"{where}: field '{own}': expected exactly one image, got {len(value)}")
        value = value[0]
    if cache is not None:
        name = None
        if isinstance(value, dict) and ("bytes" in value or "path" in value):
            data, name = value.get("bytes"), value.get("path")
            value = data if data is not None else name
        if isinstance(value, str) and ("://" in value or "::" in value):
            value = _remote_bytes(value, where, own)
        if isinstance(value, (bytes, bytearray, memoryview)):
            return _embedded(value, name, where, own, cache)
    if not isinstance(value, str) or not value:
        raise DataError(f"{where}: field '{own}': expected an image path, got {value!r}")
    path = Path(value)
    path = path if path.is_absolute() else root / path
    return path, image_size(path, where, own)


def _bbox(value, size: tuple[int, int], where: str, own: str = "bbox") -> tuple[int, int, int, int]:
    if not isinstance(value, (list, tuple)) or len(value) != 4:
        raise DataError(f"{where}: field '{own}': expected [x1, y1, x2, y2], got {value!r}")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in value):
        raise DataError(f"{where}: field '{own}': expected four numbers, got {value!r}")
    x1, y1, x2, y2 = (int(round(v)) for v in value)
    w, h = size
    if not (0 <= x1 < x2 <= w and 0 <= y1 < y2 <= h):
        raise DataError(
            f"{where}: field '{own}': {list(value)} is empty or outside the {w}x{h} image "
            "(need 0 <= x1 < x2 <= width and 0 <= y1 < y2 <= height)"
        )
    return x1, y1, x2, y2


def parse_record(row: object, where: str, root: Path, names: dict[str, str] | None = None,
                 image_cache: Path | None = None) -> Record:  # fmt: skip
    """Validates one row (either form) into a Record, decoding its images.

    `names` maps a record field to the row's own name for it (the column a mapping renamed), for error
    messages; `image_cache` (table rows only) admits embedded images, written there (`_embedded`)."""
    names = names or {}

    def own(key: str) -> str:
        return names.get(key, key)

    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
    image_key = "images" if "images" in row else "image" if "image" in row else None
    if image_key is None:
        raise DataError(f"{where}: field '{own('images')}': missing (need 'images' or 'image')")
    for key in ("problem", "answer", "solution"):
        if key not in row:
            if key == "solution":
                continue
            raise DataError(f"{where}: field '{own(key)}': missing")
        if not isinstance(row[key], (str, int, float)) or isinstance(row[key], bool):
            raise DataError(f"{where}: field '{own(key)}': expected a string, got {row[key]!r}")
    marks = {key: str(row[key]).count(IMAGE_MARK) for key in ("problem", "answer", "solution") if key in row}
    if marks["problem"] > 1:
        raise DataError(f"{where}: field '{own('problem')}': {marks['problem']} '{IMAGE_MARK}' marks for the record's one image")
    for key in ("answer", "solution"):
        if marks.get(key):
            raise DataError(f"{where}: field '{own(key)}': holds '{IMAGE_MARK}', which marks an image only in 'problem'")
    image, size = _image(row, image_key, where, root, own(image_key), image_cache)
    crop = crop_size = None
    if row.get("teacher_images") is not None:  # [] or "" is an error (_image), not "no crop"
        crop, crop_size = _image(row, "teacher_images", where, root, own("teacher_images"), image_cache)
    bbox = _bbox(row["bbox"], size, where, own("bbox")) if row.get("bbox") is not None else None
    solution = str(row["solution"]) if "solution" in row else None
    extra = tuple(
        (k, v if isinstance(v, str) else json.dumps(v))
        for k, v in row.items()
        if k not in KNOWN_FIELDS and isinstance(v, (str, int, float, bool))
    )
    return Record(where, image, str(row["problem"]), str(row["answer"]), crop, bbox, size, crop_size or (0, 0),
                  own(image_key), solution, extra)  # fmt: skip


KNOWN_FIELDS = ("images", "image", "teacher_images", "bbox", "problem", "answer", "solution")
"""The fields `parse_record` reads itself; any other scalar field is kept in `Record.extra` (routing)."""
