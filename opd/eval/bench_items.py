"""One evaluation benchmark item (`BenchItem`), its lazily decoded images (`ImageRef`), its prompt (`prompt_text`)
and the loaders' error (`BenchmarkDataError`). The loaders are `opd.eval.benchmarks`, the files and rows they read
`opd.eval.bench_rows`.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from PIL import Image

from opd.cli import UserError


class BenchmarkDataError(UserError, ValueError):
    """A benchmark file is missing or malformed; the message names the file, row and field."""


@dataclass(frozen=True)
class ImageRef:
    """A lazily decoded image: a file path or encoded bytes, with where it came from for errors."""

    origin: str
    path: Path | None = None
    data: bytes | None = field(default=None, repr=False)

    def _file(self) -> str:
        return f" {self.path}" if self.path is not None else ""

    def _open(self) -> Image.Image:
        try:
            return Image.open(self.path) if self.path is not None else Image.open(io.BytesIO(self.data or b""))
        except (OSError, ValueError) as exc:
            raise BenchmarkDataError(f"{self.origin}: cannot decode image{self._file()}: {exc}") from exc

    def check(self) -> None:
        """Read the header only (cheap); raise BenchmarkDataError if the image is missing or corrupt."""
        if self.path is not None and not self.path.is_file():
            raise BenchmarkDataError(f"{self.origin}: image file not found: {self.path}")
        self._open().close()

    def __call__(self) -> Image.Image:
        with self._open() as img:
            try:
                return img.convert("RGB")
            except (OSError, ValueError) as exc:
                raise BenchmarkDataError(f"{self.origin}: cannot decode image{self._file()}: {exc}") from exc


@dataclass
class BenchItem:
    """One benchmark question. ``image``/``crop`` are callables returning an RGB PIL image."""

    benchmark: str
    index: str
    question: str
    options: dict[str, str]
    answer: str
    kind: str  # "choice", "yesno" or "open"
    category: str
    image: Callable[[], Image.Image]
    crop: Callable[[], Image.Image] | None = None
    meta: dict = field(default_factory=dict)


def item_origin(item: BenchItem) -> str:
    """Where an item was read, for errors: "FILE line N (NAME item INDEX)" (its row, from its image's origin),
    else "NAME item INDEX"."""
    origin = getattr(item.image, "origin", None)
    label = f"{item.benchmark} item {item.index}"
    return f"{origin.rsplit(' field ', 1)[0]} ({label})" if isinstance(origin, str) and origin else label


def load_image(src) -> Image.Image:
    """An RGB PIL image from an ImageRef/callable, a path, encoded bytes or a PIL image."""
    if isinstance(src, Image.Image):
        return src.convert("RGB")
    if isinstance(src, (bytes, bytearray)):
        return ImageRef("bytes", data=bytes(src))()
    if isinstance(src, (str, Path)):
        return ImageRef(str(src), path=Path(src))()
    if callable(src):
        return load_image(src())
    raise TypeError(f"cannot load an image from {type(src).__name__}")


def prompt_text(item: BenchItem) -> str:
    """The question, its options as "(A) text" lines, and a short answer instruction."""
    lines = [item.question]
    lines += [f"({key}) {text}" for key, text in item.options.items()]
    if item.kind == "choice":
        lines.append("Answer with the option's letter from the given choices directly.")
    elif item.kind == "yesno":
        lines.append("Answer yes or no.")
    return "\n".join(lines)
