"""Building what a run trains and who teaches it: the policy (full weights or a LoRA adapter; replicated for DDP or
sharded with FSDP2), its AdamW, its processor, the EMA self-teacher or the external teachers, and the objective's own
teachers (DAPD's anchors), from the run's --model or from the checkpoint it resumes.

- Full fine-tuning, DDP: the policy loaded on the device and `accelerator.prepare`d; the EMA teacher a deep copy
  (Algorithm 1, line 1), or the checkpoint's teacher/ on resume.
- Full fine-tuning, FSDP2 (`--fsdp`): every rank holds 1/world of the policy, its optimizer state and the EMA
  teacher (`opd.models.sharding`); a resume rebuilds them from the run's own --model, then loads the shards.
- LoRA (`--lora-r`, `opd.models.lora`): the run's initial --model, frozen, with the trained adapter; the EMA teacher is the
  adapter `teacher` on the same base (a fixed one, --ema-tau 0: the base alone); a resume loads both adapters.
- External teachers (`--teacher-model`, `--teachers`): frozen checkpoints, each loaded once (`opd.models.external_teachers`).

Every model a resume loads again from its path (external teachers, DAPD's base, a sharded run's --model) is
identified by its files' digest first (`opd.loop.folder.RunFolder.identify`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from opd.builtin import builtin_path, is_builtin, model_source, teacher_source
from opd.cli import UserError
from opd.data.routes import load_routes
from opd.loop.checkpoint import load_sharded, load_state
from opd.loop.optim import adamw
from opd.models import lora as lora_mod
from opd.models.adapter_teacher import AdapterTeacher
from opd.models.hidden import lm_head_weight
from opd.models.ema_teacher import EMATeacher, Teacher, TeacherSet, parameter_pairs
from opd.models.external_teachers import build_routed, load_teacher
from opd.models.loading import load_model, load_processor, resolve_model_source
from opd.models.sharding import load_sharded_model, local_pairs, shard_model


def default_sources(model: str | None, data: str | None, accelerator, vllm: bool = False) -> tuple[str, str]:
    """(model, data) as folder and file: a built-in name ('toy', the default preset's; 'tiny': `opd.builtin`) is
    built once by rank 0, then read by every rank; what is not given (`--preset tiny`, a TrainConfig without a
    preset) is the built-in tiny one, with `vllm` (--rollout-engine vllm) the tiny model's vLLM-servable variant; a
    train.py run folder as --model is its policy/."""
    wanted = [(model or "tiny", "model", vllm and model is None), (data or "tiny", "data", False)]
    if any(is_builtin(name, kind) for name, kind, _ in wanted):
        if accelerator.is_main_process:
            for name, kind, variant in wanted:
                builtin_path(name, kind, variant)
        accelerator.wait_for_everyone()
    (model, _, variant), (data, _, _) = wanted
    built = builtin_path(model, "model", variant)
    model = str(built) if built is not None else model_source(model, f"--model {model}")
    data = str(builtin_path(data, "data") or data)
    resolve_model_source(model)
    return model, data


@dataclass
class Resume:
    """The checkpoint a resumed run continues from: its folder, its state and the next step to run."""

    ckpt: Path
    state: dict
    start: int

    @classmethod
    def load(cls, ckpt: Path, folder) -> Resume:
        """The checkpoint's state; the models it identified go to `folder` (`opd.loop.folder.RunFolder`), so that a
        model changed since then is refused by name."""
        state = load_state(ckpt)
        folder.stored_identities = state.get("identities", {})
        return cls(ckpt, state, int(state["step"]))


@dataclass
class Models:
    """What the run trains and who teaches it."""

    student: torch.nn.Module
    """The policy as trained (DDP-prepared, or FSDP2-sharded)."""
    optimizer: torch.optim.Optimizer
    processor: object
    teachers: TeacherSet
    """The objective's teachers (`opd.methods.interface.Objective.build_teachers`)."""
    initial_teacher: Callable[[], Teacher]
    """A frozen teacher of the run's initial weights (DAPD's base anchor, OPOD's reference)."""
    lora: object = None
    """The run's LoRA settings (`opd.models.settings.LoRAConfig`) when the policy is a frozen base with an adapter; None: full
    fine-tuning."""

    @property
    def teacher(self) -> Teacher:
        """The run's first teacher (the EMA self-teacher, the fixed --teacher-model, DAPD's snapshot)."""
        return next(iter(self.teachers.teachers.values()))

    @property
    def saved_teacher(self) -> torch.nn.Module | None:
        """The teacher whose weights a checkpoint holds: a full-weight EMA teacher (it moves with training); None for
        a frozen teacher (reloaded from its path) and under LoRA (the EMA teacher is an adapter, `adapters`)."""
        return self.teacher.model if self.teacher.trainable and self.lora is None else None

    @property
    def adapters(self) -> dict | None:
        """Under LoRA, the adapters a checkpoint holds: {'policy': the trained one, 'teacher': the EMA teacher's, or
        None when the teacher is the base or external}; None under full fine-tuning."""
        if self.lora is None:
            return None
        return {"policy": lora_mod.STUDENT, "teacher": getattr(self.teacher, "adapter", None)}

    @property
    def lora_scaling(self) -> float | None:
        """alpha / r, the scale of the adapter merged into weights pushed to the vLLM engine; None without LoRA."""
        return None if self.lora is None else self.lora.scale_alpha / self.lora.r


def copy_weights(teacher: EMATeacher, student: torch.nn.Module) -> None:
    """Algorithm 1, line 1 for a teacher built apart (sharded): theta-bar <- theta, shard by shard, buffers too."""
    with torch.no_grad():
        for t, s in (teacher.pairs or parameter_pairs)(teacher.model, student):
            t.copy_(s)
        for t, s in zip(teacher.model.buffers(), student.buffers(), strict=True):
            t.copy_(s)


def _trainable(model) -> list:
    return [p for p in model.parameters() if p.requires_grad]


class ModelBuilder:
    """Builds `Models` for one run (`build`), on every rank alike."""

    def __init__(self, cfg, accelerator, folder, initial_model: str, resume: Resume | None):
        self.cfg, self.acc, self.folder, self.initial_model, self.resume = cfg, accelerator, folder, initial_model, resume
        self.shard = dict(dtype=cfg.model.dtype, device=accelerator.device, mixed_precision=cfg.model.mixed_precision)

    def load_frozen(self, path: str, role: str) -> torch.nn.Module:
        """A frozen model (an external teacher, DAPD's base), identified first, sharded like the policy under --fsdp."""
        path = self.folder.identify(path, role)
        if self.cfg.model.fsdp:
            return load_sharded_model(path, **self.shard).eval()
        return load_model(path, self.cfg.model.dtype, self.acc.device)

    def build(self, objective_cls) -> Models:
        cfg, resume = self.cfg, self.resume
        model_path, teacher_path = self.initial_model, None
        if resume is not None and not cfg.model.fsdp:  # sharded: the weights are in ckpt/sharded, loaded after sharding
            model_path = str(resume.ckpt / "policy")
            teacher_path = str(resume.ckpt / "teacher") if (resume.ckpt / "teacher").is_dir() else None
        if cfg.model.fsdp:  # a sharded run is rebuilt from its own --model on resume, then overwritten from the shards
            self.folder.identify(model_path, "--model")
        processor = load_processor(model_path)
        initial_teacher = lambda: Teacher(self.load_frozen(self.initial_model, "--model"))  # noqa: E731 (DAPD, OPOD)
        if cfg.lora.r:
            student, optimizer, teacher, initial_teacher = self._lora()
        elif cfg.model.fsdp:
            student, optimizer, teacher = self._sharded(model_path)
        else:
            student, optimizer, teacher = self._replicated(model_path, teacher_path)
        unwrapped = self.acc.unwrap_model(student)
        default = self._external(processor, unwrapped) if cfg.teacher.external else TeacherSet({"teacher": teacher})
        teachers = objective_cls.build_teachers(default, initial_teacher)  # DAPD: its two anchors
        models = Models(student, optimizer, processor, teachers, initial_teacher, cfg.lora if cfg.lora.r else None)
        if cfg.model.fsdp and resume is not None:  # a LoRA run's EMA teacher is an adapter of the policy: in its shards
            load_sharded(resume.ckpt, student, models.saved_teacher, optimizer)
        return models

    def _replicated(self, model_path: str, teacher_path: str | None):
        """Full fine-tuning, DDP: the policy prepared by accelerate; the EMA teacher a copy (or the resumed one)."""
        cfg = self.cfg
        student = load_model(model_path, cfg.model.dtype, self.acc.device).train()  # from_pretrained: eval mode
        if cfg.model.grad_checkpointing:
            # non-reentrant: the reentrant variant marks DDP parameters ready twice
            student.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        teacher = None
        if not cfg.teacher.external and teacher_path:  # a resumed EMA teacher
            teacher = EMATeacher(load_model(teacher_path, cfg.model.dtype, self.acc.device), copy_weights=False)
        elif not cfg.teacher.external:
            teacher = EMATeacher(student)  # Algorithm 1, line 1
        student, optimizer = self.acc.prepare(student, adamw(cfg.optim, student.parameters()))
        return student, optimizer, teacher

    def _sharded(self, model_path: str):
        """Full fine-tuning, FSDP2: every rank holds 1/world of the policy, its optimizer state and the teacher."""
        cfg = self.cfg
        student = load_sharded_model(model_path, grad_checkpointing=cfg.model.grad_checkpointing, **self.shard)
        teacher = None
        if not cfg.teacher.external:
            teacher = EMATeacher(load_sharded_model(model_path, **self.shard), copy_weights=False, pairs=local_pairs)
            copy_weights(teacher, student)  # Algorithm 1, line 1, shard by shard
        return student, adamw(cfg.optim, student.parameters()), teacher

    def _lora(self):
        """The LoRA policy (opd/models/lora.py): the run's initial --model, frozen, with the trained adapter `default`; the EMA
        teacher is the adapter `teacher` on the same base (a fixed one, --ema-tau 0: the base alone); a resume loads
        both adapters from the checkpoint (sharded: from its shards). Also returns the initial-weights teacher (the
        base with the adapter disabled) for DAPD's base and OPOD's reference."""
        cfg, device = self.cfg, self.acc.device
        ema = not cfg.teacher.external and cfg.ema.tau > 0
        adapters = ("teacher",) if ema else ()
        with torch.random.fork_rng(devices=[]):  # the adapters' initialisation: one seed, the same on every rank
            torch.manual_seed(cfg.run.seed)
            path = self.folder.identify(self.initial_model, "--model")
            base = load_model(path, cfg.model.dtype, "cpu" if cfg.model.fsdp else device)
            if not lora_mod.matched_modules(base, cfg.lora.targets):
                raise UserError(f"--lora-targets {cfg.lora.targets!r}: matches no linear module of {self.initial_model}")
            student = lora_mod.wrap(base, cfg.lora, adapters).train()
        if cfg.model.grad_checkpointing:
            student.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            student.enable_input_require_grads()  # the frozen embeddings' outputs feed checkpointed layers
        if self.resume is not None and not cfg.model.fsdp:
            lora_mod.load_adapter(student, lora_mod.STUDENT, self.resume.ckpt / "policy")
            if ema:
                lora_mod.load_adapter(student, "teacher", self.resume.ckpt / "teacher")
        if cfg.model.fsdp:
            student = shard_model(student, device, cfg.model.mixed_precision)
            optimizer = adamw(cfg.optim, _trainable(student))
        else:
            student, optimizer = self.acc.prepare(student, adamw(cfg.optim, _trainable(student)))
        unwrapped = self.acc.unwrap_model(student)
        teacher = None if cfg.teacher.external else AdapterTeacher(unwrapped, "teacher" if ema else None)
        return student, optimizer, teacher, lambda: AdapterTeacher(unwrapped, None)

    def _external(self, processor, model) -> TeacherSet:
        """--teacher-model (one frozen teacher) or --teachers (one per route, each checkpoint loaded once); `model`:
        the policy unwrapped (its vocabulary is the teachers' to match)."""
        cfg, vocab = self.cfg.teacher, lm_head_weight(model).shape[0]
        if cfg.teacher_model:
            what = f"--teacher-model {cfg.teacher_model}"
            teacher = load_teacher(teacher_source(cfg.teacher_model), what, processor, vocab, lambda p: self.load_frozen(p, what),
                                   load_processor)  # fmt: skip
            return TeacherSet({"teacher": teacher})
        routes = load_routes(cfg.teachers)
        given = {teacher_source(name): name for name in routes.teachers.values()}  # the folder loaded -> its name
        load = lambda path: self.load_frozen(path, f"teacher {given.get(path, path)}")  # noqa: E731
        return build_routed(routes, teacher_source, processor, vocab, load, load_processor)
