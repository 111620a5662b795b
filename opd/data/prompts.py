"""What each side sees: the run's records as the student's and the teachers' encoded prompts, and which rows can be
candidates (the set C of Algorithm 1).

A record's rows are candidates when every view of the method can be built for it (the crop views need a crop) and,
with routed teachers, the record has a teacher. Every prompt of every view a record is used in must fit
--max-prompt-len: `check` says so before step 0 (`opd.data.checks`, the data's start-up checks). Each step's prompts
come from a seeded permutation per epoch (`step_prompt_indices`), sharded over the ranks (`shard`); a view's
randomness (OPD-V's mask) is seeded by (seed, step, record id), so every rank encodes alike.
"""

from __future__ import annotations

import numpy as np
import torch

from opd.models.chat import encode_prompt
from opd.cli import UserError
from opd.data.checks import check_lengths
from opd.data.records import Record
from opd.data.sources import DataConfig
from opd.methods.objective import StepBatch
from opd.engine.rollout import Rollouts
from opd.seeding import mix_seed
from opd.data.views import get_view, views_eligible


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


class Prompts:
    """The run's records, views and teachers: the prompts each step encodes, and the candidates C."""

    def __init__(self, records: list[Record], processor, method, teacher_views: tuple[str, ...], teachers,
                 data: DataConfig, seed: int, rank: int = 0, world: int = 1):  # fmt: skip
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

    def check(self) -> None:
        """Refuses a record without a route (routed teachers) and a prompt over --max-prompt-len (`check_lengths`)."""
        if self.teachers.routes is not None:
            self.teachers.routes.check_records(self.records)
        check_lengths(self)

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
        """What the objective gets for one step on this rank (`opd.methods.objective.StepBatch`): its records, rollouts and
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
