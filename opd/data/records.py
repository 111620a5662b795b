"""A training record, its views (the full image x_i, the crop x~_i) and the step's prompts, in reading order.

- `Record`: one row of the training data (x_i, q_i, and x~_i when it has one: a crop file or a bbox, which puts it in
  the set C of Eq. 4); its other scalar fields in `Record.extra` (teacher routing); a_i of Eq. 5 (`area_ratio`). A row
  becomes a Record in `opd.data.parse`.
- `View` and the table `VIEWS`: what the student (Eq. 1) and a teacher (Eq. 2) see of a record, the images and the
  question (the response tokens are always the student's own): `full` (x_i, q_i), `crop` (x~_i, q_i), and the other
  methods' `half_resolution`, `masked`, `reference_answer` (their transforms: `opd.data.family_views`). A view is
  eligible for a record when it can be built (`crop`, `masked`: a crop or bbox).
- `Prompts`: the step's records, from a seeded permutation per epoch (`step_prompt_indices`) sharded over the ranks
  (`shard`); the student's and the teachers' encoded prompts (a view's randomness, OPD-V's mask, seeded by (seed, step,
  record id), so every rank encodes alike); the candidates C (every view of the method can be built and, with routed
  teachers, the record has a teacher); the step's `StepBatch`, what the objective gets (`opd.methods.objective`).
Start-up checks: `opd.data.checks`. Details: docs/MODULES.md#opddatarecords.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from opd.cli import UserError
from opd.data.settings import DataError
from opd.data.family_views import half_resolution, half_size, masked, reference_prompt
from opd.engine.rollout import Rollouts
from opd.models.chat import encode_prompt
from opd.seeding import mix_seed


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


@dataclass(frozen=True)
class View:
    """One view: `fn(record, seed) -> (images, question)`; `needs_crop` when it cannot be built without one;
    `layout(record) -> (image sizes, question)`: the (width, height) of each image `fn` gives and the question,
    without decoding an image (the prompt-length check before step 0, `opd.models.chat.prompt_length`)."""

    fn: Callable[[Record, int], tuple[list[Image.Image], str]]
    needs_crop: bool = False
    layout: Callable[[Record], tuple[list[tuple[int, int]], str]] | None = None

    def __call__(self, record: Record, seed: int = 0) -> tuple[list[Image.Image], str]:
        return self.fn(record, seed)

    def eligible(self, record: Record) -> bool:
        return record.eligible or not self.needs_crop


def crop_size(record: Record) -> tuple[int, int]:
    """(width, height) of `crop_image(record)`: the bbox's, else the crop file's."""
    if record.bbox is not None:
        x1, y1, x2, y2 = record.bbox
        return x2 - x1, y2 - y1
    return record.crop_size


VIEWS: dict[str, View] = {
    "full": View(lambda r, seed: ([full_image(r)], r.problem), layout=lambda r: ([r.image_size], r.problem)),
    "crop": View(lambda r, seed: ([crop_image(r)], r.problem), True, lambda r: ([crop_size(r)], r.problem)),
    # the other methods' views (their transforms: opd.data.family_views)
    "half_resolution": View(lambda r, seed: ([half_resolution(full_image(r))], r.problem),
                            layout=lambda r: ([half_size(*r.image_size)], r.problem)),
    "masked": View(lambda r, seed: ([masked(crop_image(r), seed)], r.problem), True,
                   lambda r: ([crop_size(r)], r.problem)),
    "reference_answer": View(lambda r, seed: ([full_image(r)], reference_prompt(r.problem, r.reference)),
                             layout=lambda r: ([r.image_size], reference_prompt(r.problem, r.reference))),
}


def get_view(name: str) -> View:
    """Looks a view up by name."""
    if name not in VIEWS:
        raise ValueError(f"unknown view {name!r}; known: {', '.join(sorted(VIEWS))}")
    return VIEWS[name]


def views_eligible(record: Record, views) -> bool:
    """Whether every one of `views` can be built for the record (the crop views need a crop)."""
    return all(VIEWS[v].eligible(record) for v in views)


student_view = VIEWS["full"]
"""The student's input of the paper (Eq. 1): the full image x_i and the question q_i."""


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


@dataclass
class StepBatch:
    """What the loop hands an objective for one step: this rank's part of it (`Prompts.batch`)."""

    step: int
    records: list
    """This rank's records of the step (local prompt j is records[j])."""
    record_ids: list[int]
    rollouts: Rollouts
    student_prompts: list
    """The student's encoded prompts (opd.models.chat.EncodedPrompt), one per local prompt."""
    selected: torch.Tensor
    """Local row ids of S."""
    teacher_prompt: Callable
    """(teacher name, view, j) -> local prompt j in a teacher's view, encoded once per step with that teacher's
    processor; a view's randomness (the mask) is seeded by (seed, step, record id)."""
    route: list
    """Per local row: the name of its teacher (None outside C)."""
    weights: torch.Tensor | None = None
    """(N_local,) unbiased selection's w_i = 1 / pi_i for the rows of S (`opd.selection.designs`), which every objective
    applies to its per-row terms (Eq. 11's Hajek form); None: every row 1 (top-K, uniform, full)."""
    full_tokens: float | None = None
    """Unbiased selection with --estimator ht: T_C, the valid response tokens of every candidate in C over all ranks
    (`opd.selection.designs.Unbiased.full_query_tokens`), the token mean's Horvitz-Thompson denominator in place of the
    Hajek form's sum_S w_i T_i (`opd.maths.family.loss_denominator`); None: the Hajek form, or no weights."""

    def routed(self, teacher: str) -> torch.Tensor:
        """Local row ids of S routed to `teacher` (a name of the run's teacher set), in S's order."""
        sel = self.selected
        return sel[[self.route[i] == teacher for i in sel.tolist()]] if sel.numel() else sel

    def position_weights(self, rows: torch.Tensor, mask: torch.Tensor, dtype) -> torch.Tensor | None:
        """Unbiased selection's 1 / pi_i of each row of `rows`, at each of its valid positions (P,) in mask's
        row-major order; None without it (every weight 1)."""
        if self.weights is None:
            return None
        w = self.weights[rows].to(device=mask.device, dtype=dtype)  # (n,)
        return w.unsqueeze(-1).expand(mask.shape)[mask]  # (P,)


class Prompts:
    """The run's records, views and teachers: the prompts each step encodes, and the candidates C. `data`: the run's
    `opd.data.settings.DataConfig`."""

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
        """Whether the record's rows can be candidates (the set C): every view of the method can be built and, with
        routed teachers, the record has a teacher."""
        return views_eligible(record, self.views) and self.teachers.route(record) is not None

    def ids(self, step: int) -> list[int]:
        """This rank's record ids of step `step`."""
        ids = step_prompt_indices(len(self.records), self.data.prompts_per_step, step, self.seed)
        return shard(ids, self.rank, self.world)

    def of_step(self, step: int) -> list[Record]:
        """This rank's records of step `step`."""
        return [self.records[i] for i in self.ids(step)]

    def encode(self, view, record: Record, seed: int = 0, processor=None, thinking: bool | None = None):
        """One prompt of `view` (a View or its name); `seed` draws the view's randomness (the mask); `processor`: an
        external teacher's (default: the policy's); `thinking`: the thinking prompt (default: --enable-thinking)."""
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
        """What the objective gets for one step on this rank (`StepBatch`): its records, rollouts and
        prompts, the local rows of S (with unbiased selection their `weights` 1 / pi_i, and under --estimator ht C's
        token total `full_tokens`), the teachers' prompts (encoded once per step, each with its teacher's processor;
        a view's randomness seeded by (seed, step, record id)) and each row's teacher."""
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
