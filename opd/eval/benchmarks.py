"""Loaders for the evaluation benchmarks (the paper's seven, `PAPER`, and the family's, `FAMILY`), each read as shipped.

``load_benchmark(name, data_dir)`` reads ``data_dir/<name>/``: the first of the benchmark's layouts whose files are
there (`opd.eval.bench_rows.layouts`, in the order docs/EVAL.md's "Expected files" lists them; ``**/`` is any
sub-folder, where a Hugging Face download leaves its parquet files), and last a Vision-OPD evaluation JSON (a list of
``{"images": [path], "query": ..., "response": gold}`` rows, paths relative to the JSON file, the crop in
``teacher_images``/``crop_images``, other scalar fields in ``meta``). A sibling's files in the same folder are never
read (`opd.eval.bench_rows.skipped`: HR-Bench 4K and 8K, MME-RealWorld EN and CN, the Lite subset).

Images stay encoded until used: ``item.image()`` (or ``load_image(item.image)``) decodes to RGB. At load time only
the image header is read, so a missing or corrupt image fails early with the file, row and field named. Reading
parquet needs ``pyarrow`` (imported only then).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from opd.eval.bench_items import BenchItem, BenchmarkDataError, ImageRef
from opd.eval.bench_rows import ImageSource, layouts, skipped


def _find(root: Path, patterns: tuple[str, ...], name: str) -> list[Path]:
    for pattern in patterns:
        hits = sorted(p for p in root.glob(pattern) if p.is_file() and not skipped(name, p.name))
        if hits:
            return hits
    return []


def has_files(name: str, data_dir) -> bool:
    """Whether ``data_dir/<name>/`` holds files of one of the benchmark's layouts (names only; nothing is read)."""
    root = Path(data_dir) / name
    return root.is_dir() and any(_find(root, patterns, name) for patterns, *_ in layouts(name))


def expected_files(name: str) -> str:
    """The files a benchmark's folder needs, short form: the first pattern of each layout."""
    firsts = [patterns[0] for patterns, *_ in layouts(name)]
    return " or ".join(firsts[:-1]) + " (or a Vision-OPD *.json)"


def _load(name: str, root: Path, check_images: bool) -> list[BenchItem]:
    if not root.is_dir():
        raise BenchmarkDataError(f"{root}: benchmark folder not found (docs/EVAL.md lists the files expected)")
    for patterns, reader, row_fn, columns in layouts(name):
        files = _find(root, patterns, name)
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


def load_hrbench8k(root: Path, check_images: bool = True) -> list[BenchItem]:
    return _load("hrbench8k", Path(root), check_images)


def load_mmerealworld(root: Path, check_images: bool = True) -> list[BenchItem]:
    return _load("mmerealworld", Path(root), check_images)


def load_mmerealworld_cn(root: Path, check_images: bool = True) -> list[BenchItem]:
    return _load("mmerealworld_cn", Path(root), check_images)


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
    "hrbench8k": load_hrbench8k,
    "mmerealworld": load_mmerealworld,
    "mmerealworld_cn": load_mmerealworld_cn,
}

PAPER = ("vstar", "zoombench", "hrbench4k", "mmvp", "cvbench", "mmstar", "pope")
"""The paper's seven (Table 1), eval.py's default --benchmarks."""
FAMILY = ("vstar", "zoombench", "hrbench4k", "hrbench8k", "mmerealworld", "mmerealworld_cn")
"""The family's six (Vision-OPD's table and its forks'), eval.py --preset family."""


def load_benchmark(name: str, data_dir, check_images: bool = True) -> list[BenchItem]:
    """All items of benchmark ``name`` from ``data_dir/<name>/`` (see the module docstring)."""
    if name not in LOADERS:
        raise BenchmarkDataError(f"unknown benchmark {name!r}; known: {', '.join(LOADERS)}")
    return LOADERS[name](Path(data_dir) / name, check_images=check_images)
