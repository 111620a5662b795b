"""Loaders for the paper's seven evaluation benchmarks, reading each one as it is shipped.

``load_benchmark(name, data_dir)`` looks under ``data_dir/<name>/`` and reads the first layout
found, in the order listed below (``**/`` means any sub-folder, as a Hugging Face download leaves
parquet files under ``data/``). Every benchmark also accepts a Vision-OPD evaluation JSON as the
last choice (``*.json``: a list of ``{"images": [path], "query": ..., "response": gold, ...}`` rows,
image paths relative to the JSON file; ``teacher_images``/``crop_images`` give the crop; options are
read from the query unless ``question_format``/``question_type`` says open; other scalar fields such
as ``category`` or ``cycle_category`` land in ``meta``).

=============  ========================================================================================
benchmark      expected files under ``data_dir/<name>/``
=============  ========================================================================================
``vstar``      ``test_questions.jsonl`` (rows ``image`` relative path, ``text`` with "(A) ..." options,
               ``label``, ``category``, ``question_id``) with the image folders beside it; or a
               VLMEvalKit TSV ``*.tsv``; or ``**/*.parquet`` (lmms-lab/vstar-bench: the same fields
               with an embedded ``image``). 191 items (direct_attributes 115, relative_position 76).
``zoombench``  ``**/*.parquet`` with ``id``, ``query`` (or ``prompt``), ``response`` (or ``answer``),
               ``question_type`` ("mcq" or open), ``image``, ``crop_image``. 845 items: 621 multiple
               choice (options inside the query) and 224 open-ended.
``hrbench4k``  ``hr_bench_4k.tsv`` / ``*4k*.tsv`` (VLMEvalKit TSV: ``index, question, answer,
               category, A-D, cycle_category, image`` base64) or ``**/*4k*.parquet``; files whose
               name holds "8k" are never read. 800 items = 200 questions x 4 option cycles.
``mmvp``       ``Questions.csv`` (``Index`` (also spelled ``lndex``), ``Question``, ``Options`` like
               "(a) Open (b) Closed", ``Correct Answer`` like "(a)") with ``MMVP Images/<Index>.jpg``
               (also ``MMVP Imgaes/``, ``images/``); or ``**/*.parquet`` with the same columns and an
               ``image``. 300 items, 150 pairs (indices 1-2, 3-4, ...).
``cvbench``    ``test.jsonl`` / ``*.jsonl`` (``idx, type, task, source, prompt, choices, answer "(A)",
               filename`` relative to the folder) or ``test.parquet`` / ``**/test_2d*.parquet`` +
               ``**/test_3d*.parquet`` / ``**/*.parquet`` with an ``image``. 2,638 items.
``mmstar``     ``**/*.parquet`` (``index, question`` with "Options: A: ..., B: ..." inline, ``image,
               answer, category, l2_category``) or ``*.tsv`` (VLMEvalKit: option columns ``A``-``D``).
               1,500 items.
``pope``       ``**/*.parquet`` (``question_id, question, answer`` yes/no, ``image, category``
               adversarial/popular/random). 9,000 items.
=============  ========================================================================================

Images stay encoded until used: ``item.image()`` (or ``load_image(item.image)``) decodes to RGB.
At load time only the image header is read, so a missing or corrupt image fails early with the
file, row and field named. Reading parquet needs ``pyarrow`` (imported only then).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from opd.eval.bench_items import BenchItem, BenchmarkDataError, ImageRef
from opd.eval.bench_rows import ImageSource, layouts


def _find(root: Path, patterns: tuple[str, ...]) -> list[Path]:
    for pattern in patterns:
        hits = sorted(p for p in root.glob(pattern) if p.is_file() and "8k" not in p.name.lower())
        if hits:
            return hits
    return []


def has_files(name: str, data_dir) -> bool:
    """Whether ``data_dir/<name>/`` holds files of one of the benchmark's layouts (names only; nothing is read)."""
    root = Path(data_dir) / name
    return root.is_dir() and any(_find(root, patterns) for patterns, *_ in layouts(name))


def expected_files(name: str) -> str:
    """The files a benchmark's folder needs, short form: the first pattern of each layout."""
    firsts = [patterns[0] for patterns, *_ in layouts(name)]
    return " or ".join(firsts[:-1]) + " (or a Vision-OPD *.json)"


def _load(name: str, root: Path, check_images: bool) -> list[BenchItem]:
    if not root.is_dir():
        raise BenchmarkDataError(f"{root}: benchmark folder not found (opd/eval/benchmarks.py lists the files expected)")
    for patterns, reader, row_fn, columns in layouts(name):
        files = _find(root, patterns)
        if not files:
            continue
        items: list[BenchItem] = []
        for path in files:
            rows = list(reader(path))
            if not rows:
                raise BenchmarkDataError(f"{path}: no rows")
            for column in columns:
                if not any(alt in rows[0][0] for alt in column.split("|")):
                    raise BenchmarkDataError(f"{path}: missing column '{column.split('|')[0]}'")
            images = ImageSource(path.parent, rows)
            start = len(items)
            items += [row_fn(row, images, start + n) for n, row in enumerate(rows)]
        _check_items(items, check_images)
        return items
    wanted = "; or ".join(", ".join(p) for p, *_ in layouts(name))
    raise BenchmarkDataError(f"{root}: no {name} files found; expected one of: {wanted}")


def _check_items(items: list[BenchItem], check_images: bool) -> None:
    seen: dict[str, str] = {}
    for item in items:
        origin = getattr(item.image, "origin", item.index).rsplit(" field ", 1)[0]
        if item.index in seen:
            raise BenchmarkDataError(
                f"{origin}: field 'index': duplicate index {item.index!r} (first at {seen[item.index]})"
            )
        seen[item.index] = origin
        if check_images:
            for ref in (item.image, item.crop):
                if isinstance(ref, ImageRef):
                    ref.check()


def load_vstar(root: Path, check_images: bool = True) -> list[BenchItem]:
    return _load("vstar", Path(root), check_images)


def load_zoombench(root: Path, check_images: bool = True) -> list[BenchItem]:
    return _load("zoombench", Path(root), check_images)


def load_hrbench4k(root: Path, check_images: bool = True) -> list[BenchItem]:
    return _load("hrbench4k", Path(root), check_images)


def load_mmvp(root: Path, check_images: bool = True) -> list[BenchItem]:
    return _load("mmvp", Path(root), check_images)


def load_cvbench(root: Path, check_images: bool = True) -> list[BenchItem]:
    return _load("cvbench", Path(root), check_images)


def load_mmstar(root: Path, check_images: bool = True) -> list[BenchItem]:
    return _load("mmstar", Path(root), check_images)


def load_pope(root: Path, check_images: bool = True) -> list[BenchItem]:
    return _load("pope", Path(root), check_images)


LOADERS: dict[str, Callable[..., list[BenchItem]]] = {
    "vstar": load_vstar,
    "zoombench": load_zoombench,
    "hrbench4k": load_hrbench4k,
    "mmvp": load_mmvp,
    "cvbench": load_cvbench,
    "mmstar": load_mmstar,
    "pope": load_pope,
}


def load_benchmark(name: str, data_dir, check_images: bool = True) -> list[BenchItem]:
    """All items of benchmark ``name`` from ``data_dir/<name>/`` (see the module docstring)."""
    if name not in LOADERS:
        raise BenchmarkDataError(f"unknown benchmark {name!r}; known: {', '.join(LOADERS)}")
    return LOADERS[name](Path(data_dir) / name, check_images=check_images)
