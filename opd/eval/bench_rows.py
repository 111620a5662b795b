"""The benchmarks' files and rows, as `opd.eval.benchmarks.load_benchmark` reads them: the file readers (JSONL, a
JSON list, CSV/TSV, parquet), the image fields (`ImageSource`: Hugging Face structs, bytes, base64, paths), each
benchmark's row parser and the layouts tried for each benchmark (`layouts`, in the order the table of
`opd.eval.benchmarks` lists them).
"""

from __future__ import annotations

import ast
import base64
import binascii
import csv
import hashlib
import json
import re
import sys
from pathlib import Path
from typing import Iterator

from opd.answers.options import clean_question, split_options
from opd.storage import jsonl_lines  # the training reader's decoding (UTF-8, a byte-order mark allowed)
from opd.eval.bench_items import BenchItem, BenchmarkDataError, ImageRef


def _letter(value) -> str:
    """A gold answer's letter: "(A)", "A", "a.", "(a)", "B. Nike", "C: red" -> "A"/"A"/"A"/"A"/"B"/"C".

    Anything else (option text, free text) gives "".
    """
    text = str(value or "")
    m = re.fullmatch(r"\s*\(?([A-Za-z])\)?[.:]?\s*", text) or re.match(r"\s*[(\[]?([A-Z])(?:[.)\]]|[:\-]\s)", text)
    return m.group(1).upper() if m else ""


# ----------------------------------------------------------------------------- file readers

Row = tuple[dict, str]  # (fields, "file line N" / "file row N")


def _read_jsonl(path: Path) -> Iterator[Row]:
    for n, line in jsonl_lines(path, lambda n, message: BenchmarkDataError(f"{path} line {n}: {message}")):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise BenchmarkDataError(f"{path} line {n}: bad JSON: {exc}") from exc
        if not isinstance(row, dict):
            raise BenchmarkDataError(f"{path} line {n}: expected a JSON object")
        yield row, f"{path} line {n}"


def _read_json_list(path: Path) -> Iterator[Row]:
    try:
        rows = json.loads(path.read_text(encoding="utf-8-sig"))
    except UnicodeDecodeError as exc:
        raise BenchmarkDataError(f"{path}: not UTF-8 text (at byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise BenchmarkDataError(f"{path}: bad JSON: {exc}") from exc
    if not isinstance(rows, list):
        raise BenchmarkDataError(f"{path}: expected a JSON list of rows")
    for n, row in enumerate(rows):
        if not isinstance(row, dict):
            raise BenchmarkDataError(f"{path} row {n}: expected a JSON object")
        yield row, f"{path} row {n}"


def _read_delimited(path: Path, delimiter: str) -> Iterator[Row]:
    try:
        yield from _delimited_rows(path, delimiter)
    except UnicodeDecodeError as exc:
        raise BenchmarkDataError(f"{path}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x})") from None


def _delimited_rows(path: Path, delimiter: str) -> Iterator[Row]:
    csv.field_size_limit(min(sys.maxsize, 2**31 - 1))  # base64 images are long fields
    with open(path, encoding="utf-8-sig", newline="") as fh:
        reader = csv.reader(fh, delimiter=delimiter)
        header = next(reader, None)
        if not header:
            raise BenchmarkDataError(f"{path}: empty file, no header line")
        header = [h.strip() for h in header]
        for values in reader:
            if not any(v.strip() for v in values):
                continue
            if len(values) != len(header):
                raise BenchmarkDataError(
                    f"{path} line {reader.line_num}: {len(values)} fields, header has {len(header)}"
                )
            yield dict(zip(header, values)), f"{path} line {reader.line_num}"


def _read_parquet(path: Path) -> Iterator[Row]:
    try:
        import pyarrow.parquet as pq  # optional: parquet files only; eval.py reads every other layout without it
    except ImportError as exc:
        raise ImportError(f"reading {path} needs pyarrow: pip install pyarrow") from exc
    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as exc:  # pyarrow raises its own error types for corrupt files
        raise BenchmarkDataError(f"{path}: cannot read parquet: {exc}") from exc
    for n, row in enumerate(rows):
        yield row, f"{path} row {n}"


def _get(row: Row, *names: str, required: bool = True):
    """The first present, non-empty field among ``names``; BenchmarkDataError naming it if required."""
    fields, where = row
    for name in names:
        value = fields.get(name)
        if value is not None and not (isinstance(value, str) and value.strip() == "") and value == value:
            return value
    if required:
        raise BenchmarkDataError(f"{where}: missing field '{names[0]}'")
    return None


class ImageSource:
    """Turns image fields (HF structs, bytes, base64, paths, VLMEvalKit index references) into ImageRefs.

    Identical encoded images are kept once (HR-Bench repeats each image over its 4 option cycles).
    """

    def __init__(self, base: Path, rows: list[Row]):
        self.base = base
        self.blobs: dict[bytes, bytes] = {}
        # VLMEvalKit TSVs may store a repeated image as the index of the row that holds it.
        self.by_index = {
            str(f.get("index")): f["image"] for f, _ in rows if isinstance(f.get("image"), str) and len(f["image"]) > 64
        }

    def ref(self, value, where: str, field_name: str) -> ImageRef:
        origin = f"{where} field '{field_name}'"
        if value is None or (isinstance(value, str) and not value.strip()):
            raise BenchmarkDataError(f"{origin}: missing image")
        if isinstance(value, dict):  # Hugging Face image struct {"bytes": ..., "path": ...}
            data, path = value.get("bytes"), value.get("path")
            if data is None and not path:
                raise BenchmarkDataError(f"{origin}: image struct has neither bytes nor path")
            return self.ref(data if data is not None else path, where, field_name)
        if isinstance(value, (list, tuple)):
            if not value:
                raise BenchmarkDataError(f"{origin}: empty image list")
            return self.ref(value[0], where, field_name)
        if isinstance(value, (bytes, bytearray)):
            return self._blob(bytes(value), origin)
        text = str(value).strip()
        if len(text) <= 64 and text in self.by_index:
            text = self.by_index[text]
        if len(text) <= 1024 and re.search(r"\.[A-Za-z]{2,5}$", text):
            path = Path(text)
            return ImageRef(origin, path=path if path.is_absolute() else self.base / path)
        try:
            return self._blob(base64.b64decode(re.sub(r"\s+", "", text), validate=True), origin)
        except (binascii.Error, ValueError) as exc:
            raise BenchmarkDataError(f"{origin}: neither an image path nor base64 image data") from exc

    def _blob(self, data: bytes, origin: str) -> ImageRef:
        return ImageRef(origin, data=self.blobs.setdefault(hashlib.sha1(data).digest(), data))


# ----------------------------------------------------------------------------- per-benchmark rows


def _index(row: Row, n: int, *names: str) -> str:
    value = _get(row, *names, required=False)
    return str(n) if value is None else str(value).strip()


def _choice(bench, index, question, options, answer, category, image, crop=None, meta=None, where=""):
    letter = _letter(answer)
    if not letter:  # the gold answer given as the option's text
        hits = [k for k, v in options.items() if str(v).strip().lower() == str(answer).strip().lower()]
        letter = hits[0] if len(hits) == 1 else ""
    if letter not in options:
        raise BenchmarkDataError(f"{where}: field 'answer': {answer!r} is not among the options {sorted(options)}")
    return BenchItem(bench, index, question, options, letter, "choice", category, image, crop, meta or {})


def _from_prompt(bench, index, prompt, answer, category, image, crop, meta, where, split=True) -> BenchItem:
    """A prompt with options inside is multiple choice; else yes/no when the gold is yes/no; else open.

    ``split=False`` (a row marked open-ended) never reads options out of the prompt.
    """
    question, options = split_options(str(prompt)) if split else (clean_question(str(prompt)), {})
    answer = str(answer).strip()
    if options:
        return _choice(bench, index, question, options, answer, category, image, crop, meta, where)
    if answer.lower().rstrip(".") in ("yes", "no"):
        return BenchItem(bench, index, question, {}, answer.lower().rstrip("."), "yesno", category, image, crop, meta)
    return BenchItem(bench, index, question, {}, answer, "open", category, image, crop, meta)


def _mcq_row(bench: str, row: Row, images: ImageSource, n: int, meta_fields=()) -> BenchItem:
    """VLMEvalKit-style row: question, option columns A-J (or options inline), answer letter."""
    fields, where = row
    question = str(_get(row, "question", "text"))
    options = {k: str(fields[k]).strip() for k in "ABCDEFGHIJ" if _get(row, k, required=False) is not None}
    if options:
        question = clean_question(question)
    else:
        question, options = split_options(question)
    if not options:
        raise BenchmarkDataError(f"{where}: field 'question': no options (no A-D columns, none inline)")
    image = images.ref(_get(row, "image", "image_path"), where, "image")
    meta = {name: _get(row, *alts, required=False) for name, alts in meta_fields}
    return _choice(bench, _index(row, n, "index", "question_id", "id"), question, options,
                   _get(row, "answer", "label"), str(_get(row, "category", required=False) or ""), image,
                   meta={k: v for k, v in meta.items() if v is not None}, where=where)


_OPD_FIELDS = {"images", "teacher_images", "crop_images", "query", "problem", "response"}
_OPEN_TYPES = {"open", "open_question", "open-ended", "open_ended", "free_form"}


def _visionopd_row(bench: str, row: Row, images: ImageSource, n: int) -> BenchItem:
    """Vision-OPD eval JSON row: images [path], query, response (the gold answer), optional teacher_images."""
    fields, where = row
    image = images.ref(_get(row, "images"), where, "images")
    crop_field = next((k for k in ("teacher_images", "crop_images") if fields.get(k)), None)
    crop = images.ref(fields[crop_field], where, crop_field) if crop_field else None
    meta = {k: v for k, v in fields.items() if k not in _OPD_FIELDS and isinstance(v, (str, int, float, bool))}
    explicit = _get(row, "id", "index", "question_id", "source_id", "sample_uid", required=False)
    index = str(n) if explicit is None else str(explicit).strip()
    if bench == "mmvp":  # pairs from 1-based ids, else from the row order
        number = int(index) if explicit is not None and index.isdigit() else n + 1
        meta.setdefault("pair", (number - 1) // 2 + 1)
    if bench == "cvbench" and "source" not in meta:
        path = str(fields["images"][0] if isinstance(fields["images"], list) else fields["images"]).lower()
        meta.update({"source": v for k, v in _CV_SOURCES.items() if k in path})
    form = str(meta.get("question_format", meta.get("question_type", "")))
    category = str(next((meta[k] for k in ("category", "task", "split") if k in meta), form))
    item = _from_prompt(bench, index, _get(row, "query", "problem"), _get(row, "response"), category, image, crop,
                        meta, where, split=form.lower() not in _OPEN_TYPES)
    if bench == "zoombench" and not item.category:
        item.category = item.kind
    return item


def _vstar_row(row: Row, images: ImageSource, n: int) -> BenchItem:
    question, options = split_options(str(_get(row, "text")))
    if not options:
        raise BenchmarkDataError(f"{row[1]}: field 'text': no \"(A) ...\" options found")
    image = images.ref(_get(row, "image"), row[1], "image")
    return _choice("vstar", _index(row, n, "question_id"), question, options, _get(row, "label"),
                   str(_get(row, "category")), image, where=row[1])


def _mmvp_row(row: Row, images: ImageSource, n: int, image_dir: Path | None) -> BenchItem:
    raw = _get(row, "Index", "lndex", "index", required=False)
    raw = n + 1 if raw is None else raw  # 1-based, as MMVP numbers its images
    try:
        number = int(float(raw))
    except ValueError as exc:
        raise BenchmarkDataError(f"{row[1]}: field 'Index': {raw!r} is not a number") from exc
    raw_options = _get(row, "Options", "options")
    if isinstance(raw_options, (list, tuple)):
        options = {chr(ord("A") + i): str(o) for i, o in enumerate(raw_options)}
    else:
        options = split_options(str(raw_options))[1]
    if len(options) < 2:
        raise BenchmarkDataError(f"{row[1]}: field 'Options': expected \"(a) ... (b) ...\", got {raw_options!r}")
    if image_dir is not None:
        found = [p for p in (image_dir / f"{number}{s}" for s in (".jpg", ".png", ".jpeg")) if p.is_file()]
        image = ImageRef(f"{row[1]} field 'image'", path=found[0] if found else image_dir / f"{number}.jpg")
    else:
        image = images.ref(_get(row, "image"), row[1], "image")
    return _choice("mmvp", str(number), clean_question(str(_get(row, "Question", "question"))), options,
                   _get(row, "Correct Answer", "answer"), "mmvp", image, meta={"pair": (number - 1) // 2 + 1},
                   where=row[1])


_CV_SOURCES = {"ade20k": "ADE20K", "coco": "COCO", "omni3d": "Omni3D"}


def _cvbench_row(row: Row, images: ImageSource, n: int) -> BenchItem:
    fields, where = row
    choices = _get(row, "choices")
    if isinstance(choices, str):
        try:
            choices = json.loads(choices)
        except json.JSONDecodeError:
            choices = None
    if not isinstance(choices, (list, tuple)) or len(choices) < 2:
        raise BenchmarkDataError(f"{where}: field 'choices': expected a list of at least 2 options")
    options = {chr(ord("A") + i): str(c) for i, c in enumerate(choices)}
    source = str(_get(row, "source"))
    if source.lower() not in _CV_SOURCES:
        raise BenchmarkDataError(f"{where}: field 'source': {source!r} is not ADE20K, COCO or Omni3D")
    kind_type = str(_get(row, "type")).upper()
    image_field = "image" if fields.get("image") is not None else "filename"
    image = images.ref(_get(row, image_field), where, image_field)
    meta = {"source": _CV_SOURCES[source.lower()], "type": kind_type, "task": str(_get(row, "task"))}
    question = split_options(str(_get(row, "prompt", "question")))[0]
    return _choice("cvbench", f"{kind_type}/{_get(row, 'idx', 'index')}", question, options,
                   _get(row, "answer"), meta["task"], image, meta=meta, where=where)


def _pope_row(row: Row, images: ImageSource, n: int) -> BenchItem:
    answer = str(_get(row, "answer")).strip().lower().rstrip(".")
    if answer not in ("yes", "no"):
        raise BenchmarkDataError(f"{row[1]}: field 'answer': {answer!r} is not yes/no")
    split = str(_get(row, "category"))
    meta = {"split": split}
    if _get(row, "image_source", required=False) is not None:
        meta["image_source"] = str(row[0]["image_source"])
    image = images.ref(_get(row, "image"), row[1], "image")
    question = clean_question(str(_get(row, "question")))
    index = f"{split}/{_index(row, n, 'id', 'question_id')}"
    return BenchItem("pope", index, question, {}, answer, "yesno", split, image, None, meta)


def _zoombench_row(row: Row, images: ImageSource, n: int) -> BenchItem:
    """ZoomBench parquet row: id, query (or prompt), response (or answer), question_type "mcq" or open."""
    fields, where = row
    image = images.ref(_get(row, "image"), where, "image")
    crop = images.ref(fields["crop_image"], where, "crop_image") if fields.get("crop_image") is not None else None
    prompt, answer = _get(row, "query", "prompt", "question"), _get(row, "response", "answer")
    index = _index(row, n, "id", "index", "question_id")
    qtype = str(_get(row, "question_type", required=False) or "").strip().lower()
    meta = {"question_type": qtype} if qtype else {}
    item = _from_prompt("zoombench", index, prompt, answer, "", image, crop, meta, where,
                        split=not qtype or qtype == "mcq")  # an open question is never split into options
    if qtype == "mcq" and item.kind != "choice":
        raise BenchmarkDataError(f"{where}: field 'query': question_type is mcq but no options were found")
    category = _get(row, "category", "type", "task", required=False)
    item.category = str(category) if category is not None else item.kind
    return item


_MME_OPTION = re.compile(r"\s*\(([A-Z])\)\s*(.*)", re.DOTALL)


def _mme_options(row: Row) -> dict[str, str]:
    """MME-RealWorld's options: columns A-E (VLMEvalKit's TSV), else the list "Answer choices" (the official JSON) /
    "multi-choice options" (lmms-eval, the Base64 JSONs) of "(A) text" strings, also as the text of such a list
    or as "(A) ... (B) ..." text."""
    fields, where = row
    columns = {k: str(fields[k]).strip() for k in "ABCDE" if _get(row, k, required=False) is not None}
    if len(columns) >= 2:
        return columns
    raw = _get(row, "Answer choices", "multi-choice options", "options", "choices")
    if isinstance(raw, str) and raw.strip().startswith("["):
        try:
            raw = ast.literal_eval(raw.strip())
        except (ValueError, SyntaxError):
            pass
    if isinstance(raw, str):
        return split_options(raw)[1]
    options = {}
    for n, choice in enumerate(raw if isinstance(raw, (list, tuple)) else []):
        m = _MME_OPTION.fullmatch(str(choice))
        key, text = (m.group(1), m.group(2).strip()) if m else (chr(ord("A") + n), str(choice).strip())
        options[key] = text
    return options


_MME_IMAGE_DIRS = ("", "MME-RealWorld", "MME-RealWorld-CN", "images", "data")


def _mme_image(images: ImageSource, row: Row) -> ImageRef:
    """The row's image: embedded (base64 "image" / lmms-eval's "bytes", an HF struct) or the official JSON's "Image"
    path, looked up beside the JSON and in its image folders (`_MME_IMAGE_DIRS`)."""
    fields, where = row
    name = next((k for k in ("Image", "image", "bytes", "image_path") if _get(row, k, required=False) is not None),
                "Image")
    value = _get(row, name)
    if isinstance(value, str) and not Path(value).is_absolute() and re.search(r"\.[A-Za-z]{2,5}$", value.strip()):
        found = [images.base / d / value.strip() for d in _MME_IMAGE_DIRS]
        value = str(next((path for path in found if path.is_file()), value))
    return images.ref(value, where, name)


def _mme_row(bench: str, row: Row, images: ImageSource, n: int) -> BenchItem:
    """MME-RealWorld (EN or CN) in any of its shipped forms: the official JSON (Question_id, Image, Text, Answer
    choices, Ground truth, Task, Subtask, Category), VLMEvalKit's TSV and lmms-eval's parquet (index, question,
    A-E / multi-choice options, answer, category "Task/Subtask", l2-category, image / bytes). A Vision-OPD JSON row
    (images, query, response) is read as every benchmark's."""
    fields, where = row
    if "images" in fields or "query" in fields:
        return _visionopd_row(bench, row, images, n)
    options = _mme_options(row)
    if len(options) < 2:
        raise BenchmarkDataError(f"{where}: field 'Answer choices': expected \"(A) ...\" options")
    category = str(_get(row, "category", "Category", required=False) or "")
    task, _, subtask = category.partition("/") if "/" in category and "Task" not in fields else ("", "", "")
    task = str(_get(row, "Task", required=False) or task)
    subtask = str(_get(row, "Subtask", required=False) or subtask)
    fine = _get(row, "l2-category", "l2_category", required=False)
    fine = str(fine if fine is not None else (category if "Task" in fields else ""))
    meta = {k: v for k, v in (("task", task), ("subtask", subtask), ("l2_category", fine)) if v}
    question = clean_question(str(_get(row, "Text", "question")))
    index = _index(row, n, "Question_id", "index", "question_id")
    return _choice(bench, index, question, options, _get(row, "Ground truth", "answer"),
                   f"{task}/{subtask}" if task and subtask else category, _mme_image(images, row), meta=meta,
                   where=where)


# ----------------------------------------------------------------------------- layouts per benchmark


def _tsv(path: Path) -> Iterator[Row]:
    return _read_delimited(path, "\t")


def _csv(path: Path) -> Iterator[Row]:
    return _read_delimited(path, ",")


def layouts(name: str) -> list[tuple]:
    """(glob patterns, reader, row function, required columns "a|b" = a or b), in the order tried."""

    def mcq(*meta):
        return lambda row, images, n: _mcq_row(name, row, images, n, meta)

    def mme_layouts(official: str, vlmevalkit: str) -> list[tuple]:
        row = lambda row, images, n: _mme_row(name, row, images, n)  # noqa: E731
        answer = ("Ground truth|answer|response", "Text|question|query|problem")
        return [((official, "*.json"), _read_json_list, row, answer + ("Image|images|image",)),
                ((vlmevalkit, "*.tsv"), _tsv, row, answer + ("image|image_path",)),
                (("**/*.parquet",), _read_parquet, row, answer + ("image|bytes",))]

    hr_meta, star_meta = ("cycle_category", ("cycle_category",)), ("l2_category", ("l2_category", "l2-category"))
    hr_cols = ("question", "answer", "cycle_category", "image")
    star_cols = ("question", "answer", "image", "category")
    cv_cols = ("prompt|question", "choices", "answer", "source", "type", "idx|index")
    table = {
        "vstar": [(("test_questions.jsonl", "*.jsonl"), _read_jsonl, _vstar_row, ("text", "label", "image")),
                  (("*.tsv",), _tsv, mcq(), ("question", "answer", "image")),
                  (("**/*.parquet",), _read_parquet, _vstar_row, ("text", "label", "image"))],
        "zoombench": [(("**/*.parquet",), _read_parquet, _zoombench_row,
                       ("query|prompt|question", "response|answer", "image"))],
        "hrbench4k": [(("hr_bench_4k.tsv", "*4k*.tsv", "*4K*.tsv", "*.tsv"), _tsv, mcq(hr_meta), hr_cols),
                      (("**/*4k*.parquet", "**/*4K*.parquet", "**/*.parquet"), _read_parquet, mcq(hr_meta), hr_cols)],
        "hrbench8k": [(("hr_bench_8k.tsv", "*8k*.tsv", "*8K*.tsv", "*.tsv"), _tsv, mcq(hr_meta), hr_cols),
                      (("**/*8k*.parquet", "**/*8K*.parquet", "**/*.parquet"), _read_parquet, mcq(hr_meta), hr_cols)],
        "mmerealworld": mme_layouts("MME_RealWorld.json", "MME-RealWorld.tsv"),
        "mmerealworld_cn": mme_layouts("MME_RealWorld_CN.json", "MME-RealWorld-CN.tsv"),
        "mmvp": [(("Questions.csv",), _csv,
                  lambda row, images, n: _mmvp_row(row, images, n, _mmvp_image_dir(images.base)),
                  ("Index|lndex", "Question", "Options", "Correct Answer")),
                 (("**/*.parquet",), _read_parquet, lambda row, images, n: _mmvp_row(row, images, n, None),
                  ("Question", "Options", "Correct Answer", "image"))],
        "cvbench": [(("test.jsonl", "*.jsonl"), _read_jsonl, _cvbench_row, cv_cols + ("filename|image",)),
                    (("test.parquet", "**/test_[23][dD]*.parquet", "**/*.parquet"), _read_parquet, _cvbench_row,
                     cv_cols + ("image",))],
        "mmstar": [(("**/*.parquet",), _read_parquet, mcq(star_meta), star_cols),
                   (("*.tsv",), _tsv, mcq(star_meta), star_cols)],
        "pope": [(("**/*.parquet",), _read_parquet, _pope_row, ("question", "answer", "image", "category"))],
    }
    vision_opd = (("*.json",), _read_json_list, lambda row, images, n: _visionopd_row(name, row, images, n),
                  ("images", "query|problem", "response"))
    return table[name] + [vision_opd]


def skipped(name: str, filename: str) -> bool:
    """Files a benchmark's folder may hold that belong to a sibling: HR-Bench 4K never reads an 8K file nor 8K a 4K
    one; MME-RealWorld EN never reads a CN file, and neither reads the Lite subset (another benchmark)."""
    lower = filename.lower()
    if name in ("hrbench4k", "hrbench8k"):
        return ("8k" if name == "hrbench4k" else "4k") in lower
    if name in ("mmerealworld", "mmerealworld_cn"):
        return "lite" in lower or (name == "mmerealworld" and re.search(r"(^|[^a-z])cn([^a-z]|$)", lower) is not None)
    return False


def _mmvp_image_dir(folder: Path) -> Path:
    for name in ("MMVP Images", "MMVP Imgaes", "images", "Images"):
        if (folder / name).is_dir():
            return folder / name
    raise BenchmarkDataError(f"{folder / 'Questions.csv'}: no image folder 'MMVP Images/' beside it")
