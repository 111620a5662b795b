"""The run's own settings, torch-free (`train.py --help` and a config's checks import nothing heavy): checkpointing
(`opd.loop.checkpoint`), the optimizer (`opd.loop.optim`), the --out folder (`opd.loop.folder`), the trackers
(`opd.loop.tracking`)."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from opd.cli import Section, UserError, launch_only, resumable

PACKAGES = {"aim": "aim", "comet_ml": "comet_ml", "mlflow": "mlflow", "tensorboard": "tensorboard", "wandb": "wandb",
            "clearml": "clearml", "dvclive": "dvclive", "swanlab": "swanlab", "trackio": "trackio"}  # fmt: skip
"""accelerate's tracker names (`accelerate.tracking.LOGGER_TYPE_TO_CLASS`'s, in its order) -> the pip package that
provides each."""


MODULES = {"tensorboard": ("tensorboard", "tensorboardX")}
"""The modules whose presence makes a tracker available, as accelerate's `is_<name>_available` decide (the tracker's
own name when not listed)."""


MLFLOW_DB = "mlflow.db"
"""MLflow's store in the run folder (SQLite: MLflow's default backend, read without MLFLOW_ALLOW_FILE_STORE)."""


PROJECT = "bas-opd"
"""The trackers' project when neither --tracker-project nor $WANDB_PROJECT names one."""


def parse_report_to(text: str | None) -> list[str]:
    """The tracker names of --report-to ('none' or '' -> []); one line for an unknown or uninstalled one. Torch-free
    (no accelerate import): a bad setting answers in a second; the names are accelerate's (`PACKAGES`), a tracker
    installed when one of its `MODULES` is (accelerate's own test: tests/test_tracking.py compares them)."""
    names = [n.strip().lower() for n in (text or "").split(",") if n.strip()]
    if names in ([], ["none"]):
        return []
    if "none" in names:
        raise UserError(f"--report-to {text}: 'none' means no tracker and cannot be combined with others; give "
                        f"--report-to none alone, or only tracker names")
    unknown = [n for n in names if n not in PACKAGES]
    if unknown:
        raise UserError(f"--report-to {text}: unknown tracker {', '.join(unknown)}; "
                        f"choose from {', '.join(PACKAGES)} or none")
    missing = [n for n in names if not any(importlib.util.find_spec(m) for m in MODULES.get(n, (n,)))]
    if missing:
        raise UserError(f"--report-to {text}: {', '.join(missing)} not installed (pip install "
                        f"{' '.join(PACKAGES.get(n, n) for n in missing)}, or see requirements-trackers.txt)")
    if "mlflow" in names and not os.environ.get("MLFLOW_TRACKING_URI"):
        lacking = [m for m in ("sqlalchemy", "alembic") if importlib.util.find_spec(m) is None]
        if lacking:
            raise UserError(f"--report-to {text}: MLflow's store DIR/{MLFLOW_DB} (SQLite, MLflow's default) needs "
                            f"{' and '.join(lacking)} (pip install -r requirements-trackers.txt, or the full mlflow "
                            "package); or set MLFLOW_TRACKING_URI to a store of your own")  # fmt: skip
    return list(dict.fromkeys(names))


LR_SCHEDULES = ("constant", "linear", "cosine")
"""--lr-schedule's names (transformers.get_scheduler's, 'constant' becoming 'constant_with_warmup' with a warm-up)."""


@dataclass
class CheckpointConfig(Section):
    """When the run writes checkpoints, and how many it keeps."""

    save_every: int = resumable(0)
    """Checkpoint every N steps (0: only at the end)."""
    keep_checkpoints: int = resumable(1)
    """Checkpoints kept in the output folder."""

    def due(self, step: int, steps: int) -> bool:
        """Whether a checkpoint follows step index `step` of a run of `steps`."""
        return step + 1 == steps or bool(self.save_every and (step + 1) % self.save_every == 0)

    def check(self) -> list[str]:
        problems = []
        if self.save_every < 0:
            problems.append(f"--save-every {self.save_every}: must be >= 0 (0 = only at the end)")
        if self.keep_checkpoints < 1:
            problems.append(f"--keep-checkpoints {self.keep_checkpoints}: must be at least 1")
        return problems


@dataclass
class OptimConfig(Section):
    """The policy's AdamW, its gradient clip and its learning-rate schedule."""

    lr: float = 2e-6
    """AdamW learning rate of the policy (the peak of --lr-schedule)."""
    lr_schedule: str = "constant"
    """The learning rate over the steps (transformers' schedulers): constant, linear (to 0) or cosine (to 0), each
    after --warmup-steps of linear warm-up from 0."""
    warmup_steps: int = 0
    """Steps of linear warm-up (Vision-OPD, OPD-V, RP-OPSD: 10)."""
    schedule_steps: int = 0
    """Steps the schedule spans (its decay reaches 0 there); 0 = --steps (DAPD: a 500-step schedule)."""
    weight_decay: float = 0.01
    """AdamW weight decay of the policy."""
    grad_clip: float = 1.0
    """Gradient-norm clip of the policy update (not in the paper; the peers' 1.0); 0 = no clipping."""
    adam_beta1: float = 0.9
    """AdamW's beta1 (torch's default)."""
    adam_beta2: float = 0.999
    """AdamW's beta2 (torch's default; tinker's: 0.95)."""
    adam_eps: float = 1e-8
    """AdamW's epsilon (torch's default)."""

    def check(self) -> list[str]:
        problems = []
        if self.lr_schedule not in LR_SCHEDULES:
            problems.append(f"--lr-schedule {self.lr_schedule!r}: choose one of {', '.join(LR_SCHEDULES)}")
        if self.warmup_steps < 0 or self.schedule_steps < 0:
            problems.append("--warmup-steps and --schedule-steps must be >= 0")
        for flag, value in (("lr", self.lr), ("weight-decay", self.weight_decay)):
            if not value >= 0:  # NaN too
                problems.append(f"--{flag} {value}: must be >= 0")
        if not self.grad_clip >= 0:
            problems.append(f"--grad-clip {self.grad_clip}: must be >= 0 (0 = no clipping)")
        if not (0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1):
            problems.append(f"--adam-beta1 {self.adam_beta1} and --adam-beta2 {self.adam_beta2}: each must lie in [0, 1)")
        if not self.adam_eps > 0:
            problems.append(f"--adam-eps {self.adam_eps}: must be > 0")
        return problems


@dataclass
class FolderConfig(Section):
    """Where the run writes, and whether it continues or replaces the run already there."""

    out: str = resumable("runs/tiny")
    """Output folder: ledger.jsonl, summary.md, checkpoints, TensorBoard logs."""
    resume: str | None = launch_only(None, resumable_too=True)
    """Continue from a run folder (its latest checkpoint) or a checkpoint folder, with the run's own settings."""
    overwrite: bool = launch_only(False)
    """Start over in an --out folder that holds a run, deleting its ledger, summary and checkpoints."""
    auto_resume: bool = launch_only(False, resumable_too=True)
    """Continue the run in --out when it holds a checkpoint (a requeued job's same command), else start it (a
    folder without a checkpoint is started over); flags that differ from the stored run's are refused as with
    --resume (verl's resume_mode=auto)."""
    allow_data_change: bool = resumable(False)
    """With --resume: continue although --data's files changed since the run started (refused otherwise); the result
    then differs from an uninterrupted run's."""

    def check(self) -> list[str]:
        problems = []
        if Path(self.out).exists() and not Path(self.out).is_dir():
            problems.append(f"--out {self.out}: is a file; a run needs a folder")
        if self.resume and self.overwrite:
            problems.append("--resume continues a run and --overwrite deletes it: choose one")
        return problems


@dataclass
class TrackerConfig(Section):
    """Where the step's metrics go besides the ledger: accelerate's trackers."""

    report_to: str = resumable("tensorboard")
    """Experiment trackers through accelerate, comma-separated: tensorboard (DIR/tb), wandb, mlflow (DIR/mlflow.db),
    trackio, comet_ml, aim, clearml, dvclive, swanlab; none for none (opd/loop/tracking.py)."""
    run_label: str | None = resumable(None)
    """The run's name in the trackers (default: the --out folder's name and the policy, e.g. 'tiny learned-25')."""
    tracker_project: str | None = None
    """The trackers' project (W&B's project, MLflow's experiment, ...); none: $WANDB_PROJECT, else 'bas-opd'."""
    wandb_entity: str | None = None
    """W&B's entity (a team or user); none: $WANDB_ENTITY, else W&B's default."""
    tracker_tags: str | None = None
    """Tags of the tracker run, comma-separated (W&B's tags, MLflow's tags)."""
    tracker_group: str | None = None
    """The group of the tracker run (W&B's group: e.g. one per sweep or seed set)."""

    @property
    def project(self) -> str:
        return self.tracker_project or os.environ.get("WANDB_PROJECT") or PROJECT

    @property
    def tags(self) -> list[str]:
        return [t.strip() for t in (self.tracker_tags or "").split(",") if t.strip()]

    def check(self) -> list[str]:
        try:
            parse_report_to(self.report_to)
        except UserError as exc:
            return [str(exc)]
        return []
