"""Training records: the data sources, the record forms, crops, eligibility (the set C of Eq. 4) and the step's prompt batch.

`load_records(path, split=None, columns=None)` reads, by what `path` is:

- a JSONL file, one JSON object per line (any file but a parquet one or the suffixes of `NOT_JSONL`);
- a parquet file (`*.parquet`, or any file that starts with parquet's magic bytes `PAR1`);
- a folder of parquet files (found recursively, read in sorted path order); with a `split`, only that split's
  files by the hub's naming: a folder named after the split, or a file name `SPLIT`, `SPLIT-*`, `SPLIT_*`
  or `SPLIT.*` (`train-00000-of-00002.parquet`). Without one, files of two or more known split names
  (`SPLIT_NAMES`) are refused rather than mixed;
- a folder written by `datasets.Dataset.save_to_disk` (it holds state.json), or by `DatasetDict.save_to_disk`
  (dataset_dict.json) with a `split`;
- a hub id `org/name` that is no local path, with a `split`: the copy in the `datasets` cache when it is there
  (looked up in datasets' offline mode, without the network), else `datasets.load_dataset` downloads it into
  that cache when the hub answers within `opd.models.loading.HUB_TIMEOUT_S`, else a one-line error at once; given a
  `split`, only that split is loaded (`load_dataset(..., split=)`: the other splits are not prepared).

A source of several splits given no `split` is refused naming them, unless it has one only (that one is
read); a `split` given for a source without splits (JSONL, a parquet file, a Dataset's folder) is refused.
`datasets` is imported only for a save_to_disk folder or a hub id (parquet is read with pyarrow, batch by
batch, without a copy into datasets' cache), so JSONL users never load it.

Two record forms are read, one JSON object per line or one table row each:

- Vision-OPD form: {"images": ["full.jpg"], "teacher_images": ["crop.jpg"], "problem": "<image>Q", "answer": "B"}
- bbox form:       {"image": "full.jpg", "bbox": [x1, y1, x2, y2], "problem": "<image>Q", "answer": "B"}
  (the crop is cut from the full image; `images` + `bbox` is accepted too)

Image paths are relative to the JSONL file's folder unless absolute. An optional `solution` string
is OPSD's privileged text (`opd.data.views`). Any other scalar field (e.g. `task`, `modality`) is kept as
text in `Record.extra`, where a teacher routing table (`--teachers`) reads it. A row with a crop (either form) belongs to the crop-eligible
set C of the crop-teacher methods; a row with neither is trained on without a teacher there (methods
whose teacher needs no crop, RP-OPSD and OPSD, take every row).

In a table (parquet, datasets) the fields are columns and a null cell is an absent field (a row without a
crop has teacher_images null). An image is a path string, relative to the parquet file's folder or to the
folder given (parquet shards, save_to_disk) unless absolute, or the `datasets` Image feature (a struct
{bytes, path}: its bytes, when there, are the image file itself; else its path is read as a path string),
alone or in a list of one; raw bytes are an embedded image too. A table without the columns of a record
(an image, problem, answer) is refused in one line naming the missing fields and the columns it has.
`columns` maps a source's column (or JSONL key) to a record field, e.g. {"question": "problem",
"img": "images"}; `parse_columns` reads the command line's "question=problem,img=images". A mapped column the
table lacks, or a mapped key no JSONL row has, is refused in one line. Errors name the row's own column.

Embedded images (bytes in the row, no file) are written once each into a content-addressed folder,
`opd.tiny.cache_dir()/data-images/<sha256[:2]>/<sha256>.<format>` (or `image_cache`), and the record points
at that file, rather than keeping the bytes on the Record: `Record.image` / `Record.crop` stay paths, so every
other module (views, chat, teachers, eval) reads them as it reads a JSONL's images, and memory stays bounded:
the load holds the bytes of one parquet row group or `BATCH_ROWS` rows at a time, where a bytes field would
hold every image of 3,000+ 1-4 MP ones in each process (in each rank under DDP) for the whole run. The same
bytes map to the same file, so a reload, a second rank or a second run writes nothing; each file is written
under a temporary name and renamed into place, so ranks loading at once never see half a file. The folder
can be deleted at any time (the next load writes it again). The bytes are the image file as stored: like a
JSONL's files, and unlike datasets' own decoding, no EXIF rotation is applied.

The crop-to-full area ratio a_i (the last feature of Eq. 5) comes from the bbox when there is one,
else from the crop file's and the full image's sizes, assuming the crop was cut from the full image at
its native resolution (as Vision-OPD's crops are); a crop file larger than the full image (an
upscaled crop) gives a_i = 1, the most a cut can cover. A row without a crop has a_i = 0.

Every image is decoded once when the data is read (JPEGs at reduced scale, which still reads every
byte of the compressed stream; embedded ones from memory, before they are written), so a damaged one stops
the run at once instead of steps later. Every problem is reported as a `DataError` naming the row and the
record's own field. `Record.source` names the row: 'file:line' (1-based) for JSONL, 'file row N' for parquet,
'folder row N' / 'folder[split] row N' for save_to_disk and 'org/name[split] row N' for the hub (N 0-based,
as `ds[N]` and pyarrow count rows; per file for parquet shards).
"""

import hashlib
import io
import json
import math
import os
import re
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

from opd.models.chat import IMAGE_MARK
from opd.cli import Section, UserError


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


def _one_line(exc: BaseException) -> str:
    """An exception's message on one line (pyarrow's and datasets' messages may span several)."""
    return " ".join(str(exc).split()) or type(exc).__name__


def open_image(path: Path, where: str, field: str) -> Image.Image:
    """Opens an image as RGB or raises a DataError naming the record and field."""
    try:
        with Image.open(path) as im:
            return im.convert("RGB")
    except FileNotFoundError:
        raise DataError(f"{where}: field '{field}': image file not found: {path}") from None
    except (UnidentifiedImageError, OSError) as e:
        raise DataError(f"{where}: field '{field}': cannot read image {path}: {e}") from None


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
        raise DataError(f"{where}: field '{field}': cannot read image {label}: {_one_line(e)}") from None


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
                        f"{_one_line(e)}") from None  # fmt: skip
    return target, size


def _remote_bytes(path: str, where: str, field: str) -> bytes:
    """The bytes of a hub dataset's image given by URL or archive path ('zip://...::https://...')."""
    from datasets.utils.file_utils import xopen

    try:
        with xopen(path, "rb") as f:
            return f.read()
    except Exception as e:  # fsspec and HTTP errors of every kind
        raise DataError(f"{where}: field '{field}': cannot fetch image {path}: {_one_line(e)}") from None


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


NOT_JSONL = (".arrow", ".csv", ".tsv", ".zip", ".gz", ".tar")
"""File suffixes `load_records` refuses by name (a JSONL file is read line by line; parquet is read as a table)."""

KNOWN_FIELDS = ("images", "image", "teacher_images", "bbox", "problem", "answer", "solution")
"""The fields `parse_record` reads itself; any other scalar field is kept in `Record.extra` (routing)."""

SPLIT_NAMES = ("train", "validation", "valid", "val", "dev", "test", "eval")
"""Split names recognised in a parquet folder's paths when no split is given (two or more are refused)."""

HUB_DATASET_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
"""A hub dataset id, 'org/name'."""

BATCH_ROWS = 32
"""Table rows decoded per batch: the rows' embedded image bytes held at once."""


@dataclass
class DataConfig(Section):
    """The training records and the prompts each step draws from them."""

    data: str | None = None
    """Training data (Vision-OPD or bbox form): a JSONL file, a parquet file or folder, a `datasets` save_to_disk
    folder, a hub id org/name (opd/data/records.py), or a built-in name: 'toy' (the default preset's: the toy world's
    training split) or 'tiny'; none (--preset tiny): the tiny dataset."""
    data_split: str | None = None
    """The split of --data when it has several (a DatasetDict folder, a hub id, a parquet folder of split files)."""
    data_columns: str | None = None
    """Column renames of --data, "COLUMN=FIELD,..." (e.g. "question=problem,img=images"); unmapped columns keep
    their names."""
    prompts_per_step: int = 28
    """Prompts per step over all processes."""
    max_prompt_len: int = 8192
    """Longest prompt in tokens (image tokens included); longer prompts are an error."""
    enable_thinking: bool = False
    """Qwen3.5's thinking generation prompt instead of the non-thinking one."""

    def check(self) -> list[str]:
        problems = []
        if self.prompts_per_step < 1:
            problems.append(f"--prompts-per-step {self.prompts_per_step}: must be at least 1")
        if self.max_prompt_len < 1:
            problems.append(f"--max-prompt-len {self.max_prompt_len}: must be at least 1")
        try:
            parse_columns(self.data_columns)
        except UserError as exc:
            problems.append(str(exc))
        return problems


def parse_columns(text: str | None, flag: str = "--data-columns") -> dict[str, str]:
    """A column mapping from the command line: "question=problem,img=images" -> {"question": "problem",
    "img": "images"} (source column -> record field); None or "" -> {}. A one-line DataError names `flag`."""
    if text is None or not text.strip():
        return {}
    mapping: dict[str, str] = {}
    for part in text.split(","):
        column, eq, field = (s.strip() for s in part.partition("="))
        if not eq or not column or not field or "=" in field:
            raise DataError(f"{flag} {text!r}: expected COLUMN=FIELD pairs separated by commas "
                            f"(e.g. question=problem,img=images), got {part.strip()!r}")  # fmt: skip
        if column in mapping:
            raise DataError(f"{flag} {text!r}: column '{column}' is mapped twice")
        if field in mapping.values():
            raise DataError(f"{flag} {text!r}: two columns are mapped to field '{field}'")
        mapping[column] = field
    return mapping


def _check_columns(columns: dict[str, str]) -> dict[str, str]:
    """A column mapping as given to load_records (a dict, or the command line's string), checked."""
    if isinstance(columns, str):
        return parse_columns(columns)
    columns = dict(columns or {})
    for column, field in columns.items():
        if not isinstance(column, str) or not isinstance(field, str) or not column or not field:
            raise DataError(f"column mapping {columns!r}: expected column name -> field name strings")
    if len(set(columns.values())) != len(columns):
        raise DataError(f"column mapping {columns!r}: two columns are mapped to the same field")
    return columns


def _rename(row: object, columns: dict[str, str], where: str) -> object:
    """A JSONL row with its keys renamed by the mapping (a key that is absent is skipped)."""
    if not columns or not isinstance(row, dict):
        return row
    renamed = {}
    for key, value in row.items():
        target = columns.get(key, key)
        if target in renamed or (target != key and target in row and target not in columns):
            raise DataError(f"{where}: field '{key}': mapped to '{target}', but the row has a '{target}' too")
        renamed[target] = value
    return renamed


def _table_fields(label: str, have: list[str], columns: dict[str, str]) -> None:
    """Refuses, in one line, a table whose columns (after the mapping) cannot make a record."""
    listed = ", ".join(have) or "none"
    for column, field in columns.items():
        if column not in have:
            raise DataError(f"{label}: the column mapping names column '{column}', which the data does not have "
                            f"(columns: {listed})")  # fmt: skip
        if field in have and field not in columns:
            raise DataError(f"{label}: the column mapping maps '{column}' to '{field}', but the data has a "
                            f"'{field}' column too (map that one to another name)")  # fmt: skip
    fields = {columns.get(c, c) for c in have}
    missing = ([] if fields & {"images", "image"} else ["'images' (or 'image')"]) + [
        f"'{f}'" for f in ("problem", "answer") if f not in fields]  # fmt: skip
    if missing:
        raise DataError(f"{label}: missing field{'s' if len(missing) > 1 else ''} {', '.join(missing)}; its columns: "
                        f"{listed} (map a column to a field with the column mapping, e.g. question=problem)")  # fmt: skip


def _table_row(row: dict, columns: dict[str, str]) -> dict:
    """A table row as a record row: mapped names, null cells dropped (an absent field)."""
    return {columns.get(k, k): v for k, v in row.items() if v is not None}


def _parse_tables(batches: Iterator[tuple[list[dict], list[str]]], root: Path, columns: dict[str, str],
                  image_cache: Path | None) -> list[Record]:  # fmt: skip
    """Records of (rows, sources) batches, each batch's images decoded on a few threads, in order."""
    if image_cache is None:
        from opd.tiny import cache_dir

        image_cache = cache_dir() / "data-images"
    names = {field: column for column, field in columns.items()}
    records: list[Record] = []
    with ThreadPoolExecutor(max_workers=4) as pool:  # image decoding releases the GIL
        for rows, sources in batches:
            records += pool.map(lambda r, w: parse_record(_table_row(r, columns), w, root, names, image_cache),
                                rows, sources)  # fmt: skip
    return records


def _split_of(relative: Path) -> str | None:
    """The split a parquet file belongs to by the hub's naming (a folder, or the file name's start)."""
    for part in relative.parts[:-1]:
        if part in SPLIT_NAMES:
            return part
    match = re.match(r"^([A-Za-z]+)(?:[-_.]|$)", relative.stem)
    return match.group(1) if match and match.group(1) in SPLIT_NAMES else None


def _in_split(relative: Path, split: str) -> bool:
    return split in relative.parts[:-1] or re.match(rf"^{re.escape(split)}(?:[-_.]|$)", relative.stem) is not None


def _parquet_files(folder: Path, split: str | None) -> list[Path]:
    """The parquet files of a folder (of one split when given), sorted; a one-line error when there are none."""
    files = sorted(p for p in folder.rglob("*.parquet") if p.is_file())
    if split is not None:
        chosen = [p for p in files if _in_split(p.relative_to(folder), split)]
        if not chosen:
            splits = sorted({s for p in files if (s := _split_of(p.relative_to(folder)))})
            raise DataError(f"{folder}: no parquet file of split '{split}' (a folder or file name starting with it; "
                            f"splits found: {', '.join(splits) or 'none'})")  # fmt: skip
        return chosen
    splits = sorted({s for p in files if (s := _split_of(p.relative_to(folder)))})
    if len(splits) > 1:
        raise DataError(f"{folder}: holds parquet files of splits {', '.join(splits)}; choose one (--data-split)")
    return files


def _parquet_batches(files: list[Path], columns: dict[str, str]) -> Iterator[tuple[list[dict], list[str]]]:
    """(rows, sources) batches of parquet files, read with pyarrow a batch at a time."""
    import pyarrow.parquet as pq

    for path in files:
        try:
            reader = pq.ParquetFile(path, pre_buffer=False)  # a row group at a time: memory bounded by one
            _table_fields(str(path), reader.schema_arrow.names, columns)
            start = 0
            for batch in reader.iter_batches(batch_size=BATCH_ROWS):
                rows = batch.to_pylist()
                yield rows, [f"{path} row {start + i}" for i in range(len(rows))]
                start += len(rows)
        except DataError:
            raise
        except Exception as e:  # pyarrow's own error types (ArrowInvalid, OSError) for a damaged file
            raise DataError(f"{path}: cannot read parquet file: {_one_line(e)}") from None


def _dataset_batches(ds, label: str, columns: dict[str, str]) -> Iterator[tuple[list[dict], list[str]]]:
    """(rows, sources) batches of a `datasets.Dataset`, as raw Arrow rows (images not decoded by datasets)."""
    _table_fields(label, list(ds.column_names), columns)
    start = 0
    for table in ds.with_format("arrow").iter(batch_size=BATCH_ROWS):
        rows = table.to_pylist()
        yield rows, [f"{label} row {start + i}" for i in range(len(rows))]
        start += len(rows)


def _pick_split(dd, split: str | None, label: str):
    """(dataset, split) of a DatasetDict: the split asked for, or its only one."""
    names = list(dd.keys())
    if split is None:
        if len(names) != 1:
            raise DataError(f"{label}: holds splits {', '.join(names) or 'none'}; choose one (--data-split)")
        split = names[0]
    elif split not in dd:
        raise DataError(f"{label}: no split '{split}' (splits: {', '.join(names) or 'none'})")
    return dd[split], split


class _quiet_datasets:
    """datasets without its progress bars and warnings (one line per problem is this module's contract)."""

    def __enter__(self):
        from datasets.utils import logging as dlog
        from datasets.utils.tqdm import are_progress_bars_disabled, disable_progress_bars

        self.verbosity, self.bars = dlog.get_verbosity(), not are_progress_bars_disabled()
        dlog.set_verbosity_error()
        disable_progress_bars()

    def __exit__(self, *exc):
        from datasets.utils import logging as dlog
        from datasets.utils.tqdm import enable_progress_bars

        dlog.set_verbosity(self.verbosity)
        if self.bars:
            enable_progress_bars()


def _load_from_disk(folder: Path, split: str | None):
    """(dataset, label) of a save_to_disk folder: a Dataset's, or a DatasetDict's split."""
    import datasets

    try:
        with _quiet_datasets():
            ds = datasets.load_from_disk(str(folder))
    except Exception as e:  # a damaged state.json, missing arrow files, another datasets version's layout
        raise DataError(f"{folder}: cannot read the datasets folder (save_to_disk): {_one_line(e)}") from None
    if isinstance(ds, datasets.DatasetDict):
        ds, split = _pick_split(ds, split, str(folder))
        return ds, f"{folder}[{split}]"
    if split is not None:
        raise DataError(f"{folder}: a single dataset (Dataset.save_to_disk), which has no splits; "
                        f"drop the split '{split}'")  # fmt: skip
    return ds, str(folder)


def _load_hub(name: str, split: str | None):
    """(dataset, label) of hub dataset `name`: its copy in datasets' cache (found offline), else downloaded
    when the hub answers within `opd.models.loading.HUB_TIMEOUT_S`, else a one-line DataError at once."""
    import datasets
    from datasets import config

    dd = None
    only = {"split": split} if split is not None else {}  # a split asked for: only its files are prepared
    saved = config.HF_HUB_OFFLINE
    config.HF_HUB_OFFLINE = True  # datasets then looks in its cache only (CachedDatasetModuleFactory)
    try:
        with _quiet_datasets():
            dd = datasets.load_dataset(name, **only)
    except Exception as e:  # not cached (ConnectionError, FileNotFoundError, DatasetNotFoundError, ...)
        if split is not None and _unknown_split(e):  # cached, without that split
            raise DataError(f"{name}: no split '{split}' ({_one_line(e)})") from None
        dd = None
    finally:
        config.HF_HUB_OFFLINE = saved
    if dd is None:
        from opd.models.loading import hub_reachable

        if not hub_reachable():
            raise DataError(f"{name}: not a local file or folder, not in the datasets cache ({config.HF_DATASETS_CACHE}), "
                            "and the hub cannot be reached (offline)")  # fmt: skip
        try:
            with _quiet_datasets():
                dd = datasets.load_dataset(name, **only)
        except Exception as e:
            if split is not None and _unknown_split(e):
                raise DataError(f"{name}: no split '{split}' ({_one_line(e)})") from None
            raise DataError(f"{name}: cannot load the dataset from the hub: {_one_line(e)}") from None
    if isinstance(dd, datasets.DatasetDict):
        ds, split = _pick_split(dd, split, name)
    else:
        ds, split = dd, split or str(getattr(dd, "split", None) or "train")
    return ds, f"{name}[{split}]"


def _unknown_split(exc: BaseException) -> bool:
    """Whether `datasets.load_dataset(..., split=S)` failed because the dataset has no split S."""
    text = str(exc)
    return isinstance(exc, ValueError) and text.startswith(("Unknown split", "Bad split"))


def _is_hub_id(text: str) -> bool:
    """Meant as a hub dataset id: 'org/name', not a local path (no leading '.', '/' or '~', its folder part
    absent here) nor a data file's name."""
    if not HUB_DATASET_ID.match(text) or ".." in text or text.startswith((".", "~")):
        return False
    if os.path.isdir(os.path.dirname(text)):
        return False
    return Path(text).suffix.lower() not in (".jsonl", ".json", ".parquet", ".arrow", ".csv", ".tsv", ".txt")


def load_records(path: str | Path, split: str | None = None, columns: dict[str, str] | str | None = None, *,
                 image_cache: Path | None = None) -> list[Record]:  # fmt: skip
    """Reads the training data at `path`: a JSONL file, a parquet file or folder, a save_to_disk folder or a hub id
    (see the module docstring), with `split` for a source of splits and `columns` (column -> field, or the
    command line's "question=problem" string) for names that differ. `image_cache` is where embedded images
    are written (default `opd.tiny.cache_dir()/data-images`).

    JSONL: blank lines are skipped, anything else must be a valid record. Rows are parsed in file order and
    their images decoded on a few threads; the first bad row in order is the one reported. A built-in name ('toy',
    'tiny': `opd.builtin`) is its training JSONL, built on first use."""
    from opd.builtin import builtin_path

    path = builtin_path(path, "data") or path
    columns = _check_columns(columns)
    text = str(path)
    path = Path(path)
    if path.is_dir():
        if (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():
            ds, label = _load_from_disk(path, split)
            records = _parse_tables(_dataset_batches(ds, label, columns), path, columns, image_cache)
        elif any(p.is_file() for p in path.rglob("*.parquet")):
            files = _parquet_files(path, split)
            records = _parse_tables(_parquet_batches(files, columns), path, columns, image_cache)
        else:
            raise DataError(f"{path}: is a folder holding neither parquet files nor a dataset saved by datasets' "
                            "save_to_disk (state.json or dataset_dict.json); give such a folder, a parquet file "
                            "or a training JSONL file")  # fmt: skip
        if not records:
            raise DataError(f"{path}: no records")
        return records
    if not path.is_file():
        if not path.exists() and _is_hub_id(text):
            ds, label = _load_hub(text, split)
            records = _parse_tables(_dataset_batches(ds, label, columns), Path.cwd(), columns, image_cache)
            if not records:
                raise DataError(f"{label}: no records")
            return records
        raise DataError(f"{path}: training data file not found")
    with path.open("rb") as f:
        head = f.read(4)
    if head == b"PAR1" or path.suffix.lower() == ".parquet":
        if split is not None:
            raise DataError(f"{path}: one parquet file, which has no splits; drop the split '{split}' "
                            "(or give the folder of the split's files)")  # fmt: skip
        records = _parse_tables(_parquet_batches([path], columns), path.parent, columns, image_cache)
        if not records:
            raise DataError(f"{path}: no records")
        return records
    if path.suffix.lower() in NOT_JSONL:
        hint = "give the folder save_to_disk wrote" if path.suffix.lower() == ".arrow" else "convert it to JSONL or parquet"
        raise DataError(f"{path}: not a JSONL or parquet file; {hint}")
    if split is not None:
        raise DataError(f"{path}: a JSONL file, which has no splits; drop the split '{split}'")
    rows, keys = [], {}
    for lineno, line in jsonl_lines(path, lambda n, message: DataError(f"{path}:{n}: {message}")):
        where = f"{path}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: malformed JSON line: {e.msg} (column {e.colno})") from None
        if isinstance(row, dict):
            keys.update(dict.fromkeys(row))
        rows.append((_rename(row, columns, where), where))
    if not rows:
        raise DataError(f"{path}: no records")
    absent = [c for c in columns if c not in keys]
    if absent:  # as a table's column mapping (_table_fields): a mapped key no row has is a mistake, not a no-op
        raise DataError(f"{path}: the column mapping names key '{absent[0]}', which no row has "
                        f"(keys: {', '.join(keys) or 'none'})")
    names = {field: column for column, field in columns.items()}
    with ThreadPoolExecutor(max_workers=4) as pool:  # image decoding releases the GIL
        return list(pool.map(lambda r: parse_record(r[0], r[1], path.parent, names), rows))


def jsonl_lines(path: Path, error) -> Iterator[tuple[int, str]]:
    """(line number from 1, text) of each non-blank line of a UTF-8 JSONL file, a byte-order mark at its start
    allowed; a line that is not UTF-8 raises `error(line number, message)` (the caller's error class and place).
    Read line by line (bounded memory); the training data's reader and the benchmarks' (`opd.eval.benchmarks`)."""
    with Path(path).open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")  # a byte-order mark is no error
            except UnicodeDecodeError as e:
                raise error(lineno, f"not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1})") from None
            if line.strip():
                yield lineno, line


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
