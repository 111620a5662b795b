"""Training records, their views (the full image x_i, the crop x~_i) and a step's prompts, in reading order.

`Record`: one row (x_i, q_i, and x~_i when it has a crop file or bbox: the set C of Eq. 4; a_i of Eq. 5). `VIEWS`:
what the student (Eq. 1) and a teacher (Eq. 2) see: `full`, `crop` and the other methods' (`opd.data.family_views`).
`Prompts`: a step's records, their encoded prompts, the candidates C and the `StepBatch` the objective gets.
Rows become Records in `opd.data.parse`; start-up checks: `opd.data.checks`. Details: docs/MODULES.md#opddatarecords."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from opd.cli import UserError
from opd.data.settings import DataError
from opd.data.family_views import half_resolution, masked, reference_prompt
from opd.engine.rollout import Rollouts, mix_seed
from opd.models.chat import encode_prompt


@dataclass(frozen=True)
class Record:
    """One training prompt x_i, q_i with its privileged crop x~_i when it has one."""

    source: str  # the row, for errors: 'file:line' (JSONL), 'file row N' (parquet), 'org/name[split] row N'
    image: Path  # x_i (an embedded image: its file in the content-addressed image cache)
    problem: str  # q_i; '<image>' marks where the image goes (front when absent)
    answer: str  # the reference answer (unused by OPD training; for evaluation and the toy world)
    crop: Path | None = None  # x~_i's file (Vision-OPD's `teacher_images`)
    bbox: tuple[int, int, int, int] | None = None  # [x1, y1, x2, y2] in x_i's pixels; the crop is cut from x_i
    image_size: tuple[int, int] = (0, 0)  # (width, height) of x_i
    crop_size: tuple[int, int] = (0, 0)  # (width, height) of the crop file, when there is one
    image_key: str = "images"  # the row's field of x_i ('images', 'image' or the column mapped to it), for errors
    solution: str | None = None  # optional worked solution (field `solution`): OPSD's privileged text
    extra: tuple[tuple[str, str], ...] = ()  # other scalar fields (name, text), file order: teacher routing (`task`)

    def field(self, name: str) -> str | None:
        """The text of one of the record's other fields (`extra`), or None when the row has no such field."""
        return dict(self.extra).get(name)

    @property
    def reference(self) -> str:
        """OPSD teacher's privileged text: the solution when the record has one, else the answer."""
        return self.solution if self.solution else self.answer

    @property
    def eligible(self) -> bool:
        """Whether the record is in the crop-eligible set C (Eq. 4)."""
        return self.crop is not None or self.bbox is not None

    @property
    def area_ratio(self) -> float:
        """a_i of Eq. 5: crop area / full-image area (bbox, else crop file's size, capped at 1); 0 without a crop."""
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


@dataclass(frozen=True)
class View:
    """A view: `fn(record, seed) -> (images, question)` (its layout, decoding no image: `opd.data.checks.LAYOUTS`)."""

    fn: Callable[[Record, int], tuple[list[Image.Image], str]]
    needs_crop: bool = False

    def __call__(self, record: Record, seed: int = 0) -> tuple[list[Image.Image], str]:
        return self.fn(record, seed)

    def eligible(self, record: Record) -> bool:
        return record.eligible or not self.needs_crop


VIEWS: dict[str, View] = {
    "full": View(lambda r, seed: ([full_image(r)], r.problem)),
    "crop": View(lambda r, seed: ([crop_image(r)], r.problem), needs_crop=True),
    "half_resolution": View(lambda r, seed: ([half_resolution(full_image(r))], r.problem)),
    "masked": View(lambda r, seed: ([masked(crop_image(r), seed)], r.problem), needs_crop=True),
    "reference_answer": View(lambda r, seed: ([full_image(r)], reference_prompt(r.problem, r.reference))),
}


def get_view(name: str) -> View:
    """Looks a view up by name."""
    if name not in VIEWS:
        raise ValueError(f"unknown view {name!r}; known: {', '.join(sorted(VIEWS))}")
    return VIEWS[name]


def views_eligible(record: Record, views) -> bool:
    """Whether every one of `views` can be built for the record (the crop views need a crop)."""
    return all(VIEWS[v].eligible(record) for v in views)


student_view = VIEWS["full"]  # the student's input (Eq. 1): x_i and q_i


def step_prompt_indices(n_records: int, prompts_per_step: int, step: int, seed: int) -> list[int]:
    """Record ids of step `step`: epoch e (floor(n / B) steps) is a permutation seeded by (seed, e); pure function."""
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


@dataclass
class StepBatch:
    """This rank's part of one step, what the objective gets (made by `Prompts.batch`)."""

    step: int
    records: list  # local prompt j is records[j]
    record_ids: list[int]
    rollouts: Rollouts
    student_prompts: list  # opd.models.chat.EncodedPrompt, one per local prompt
    selected: torch.Tensor  # local row ids of S
    teacher_prompt: Callable  # (teacher name, view, j) -> local prompt j in that teacher's view
    route: list  # per local row: its teacher's name (None outside C)
    weights: torch.Tensor | None = None  # (N_local,) w_i = 1 / pi_i on S, every per-row term (Eq. 11); None: all 1
    full_tokens: float | None = None  # --estimator ht: T_C, the Horvitz-Thompson token denominator; None: Hajek

    def routed(self, teacher: str) -> torch.Tensor:
        """Local row ids of S routed to `teacher` (a name of the run's teacher set), in S's order."""
        sel = self.selected
        return sel[[self.route[i] == teacher for i in sel.tolist()]] if sel.numel() else sel


class Prompts:
    """The run's records, views and teachers: each step's prompts and the candidates C (`data`: `DataConfig`)."""

    def __init__(self, records: list[Record], processor, method, teacher_views: tuple[str, ...], teachers,
                 data, seed: int, rank: int = 0, world: int = 1):  # fmt: skip
        self.records, self.processor, self.method, self.teachers = records, processor, method, teachers
        self.student_view, self.teacher_views = method.student_view, teacher_views
        self.data, self.seed, self.rank, self.world = data, seed, rank, world

    @property
    def views(self) -> tuple[str, ...]:
        """Every view of the method: the student's, then the teachers'."""
        return (self.student_view, *self.teacher_views)

    def eligible(self, record: Record) -> bool:
        """In C: every view of the method can be built and, with routed teachers, the record has a teacher."""
        return views_eligible(record, self.views) and self.teachers.route(record) is not None

    def ids(self, step: int) -> list[int]:
        """This rank's record ids of step `step`."""
        ids = step_prompt_indices(len(self.records), self.data.prompts_per_step, step, self.seed)
        return shard(ids, self.rank, self.world)

    def of_step(self, step: int) -> list[Record]:
        """This rank's records of step `step`."""
        return [self.records[i] for i in self.ids(step)]

    def encode(self, view, record: Record, seed: int = 0, processor=None, thinking: bool | None = None):
        """One prompt of `view` (View or name); `seed`: its randomness; `processor`, `thinking`: None: the run's."""
        images, problem = get_view(view)(record, seed) if isinstance(view, str) else view(record, seed)
        thinking = self.data.enable_thinking if thinking is None else thinking
        try:
            return encode_prompt(processor or self.processor, images, problem, thinking, self.data.max_prompt_len)
        except ValueError as exc:  # a context built at step time (DAPD's rollout, OPOD's verification) too long
            raise UserError(f"{record.source}: {exc}", local=True) from None

    def student(self, records: list[Record]) -> list:
        """The student's prompts (Eq. 1) of a step's records, in the method's student view."""
        view = get_view(self.student_view)
        return [self.encode(view, r) for r in records]

    def candidates(self, records: list[Record], rollouts: Rollouts) -> torch.Tensor:
        """(N_local,) bool: the rows that can be candidates (their record eligible, their response valid)."""
        rows = rollouts.prompt_index.tolist()
        return torch.tensor([self.eligible(records[j]) for j in rows], dtype=torch.bool) & rollouts.valid

    def batch(self, step: int, record_ids: list[int], rollouts: Rollouts, student_prompts: list,
              selected: torch.Tensor, weights: torch.Tensor | None = None,
              full_tokens: float | None = None) -> StepBatch:  # fmt: skip
        """This rank's `StepBatch` of step `step`; teacher prompts encoded once per step, seeded by (seed, step, id)."""
        records = [self.records[i] for i in record_ids]
        cache: dict[tuple, object] = {}
        teachers = self.teachers.teachers

        def teacher_prompt(name: str, view: str, j: int):
            processor = teachers[name].processor if name in teachers else None
            key = (id(processor), view, j)
            if key not in cache:
                cache[key] = self.encode(view, records[j], mix_seed(self.seed, step, record_ids[j]), processor)
            return cache[key]

        route = [self.teachers.route(records[j]) for j in rollouts.prompt_index.tolist()]
        return StepBatch(step, records, list(record_ids), rollouts, student_prompts, selected, teacher_prompt, route,
                         weights, full_tokens)  # fmt: skip
