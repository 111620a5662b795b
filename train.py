"""BAS-OPD training: Algorithm 1 of the paper as one loop on accelerate (DDP, or FSDP2 with --fsdp).

    accelerate launch train.py --policy learned --rho 0.25            # built-in tiny model, CPU, ~1 min
    accelerate launch train.py --preset paper-4b --data train.jsonl   # Qwen3.5-4B, the paper's settings

Each step: every rank samples rollouts for its shard of the prompts (line 3); features are
all-gathered and every rank makes the same budgeted selection S (lines 4-9); the crop teacher scores
only the rank's rows in S, and the student is updated on Eq. 11 (lines 11-13); utility labels are
all-gathered and every rank updates the same CPU selector (line 14). DIR/ledger.jsonl records the
teacher cost of each step.
"""

import contextlib
import dataclasses
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import Accelerator, PartialState
from tqdm.auto import tqdm
from transformers.utils import logging as hf_logging

from opd import runlock
from opd.checkpoint import (
    find_checkpoint, load_config, load_sharded, load_state, model_source, save_checkpoint, save_sharded,
)
from opd.chat import encode_prompt, prompt_length
from opd.cli import UserError, given_flags, run_cli, section_config, with_sections
from opd.data import Record, load_records, parse_columns, shard, step_prompt_indices
from opd.distill import AGGREGATIONS, DistillConfig
from opd.eval.live import LiveEval, LiveEvalSettings
from opd.divergence import check_loss
from opd.external_teachers import TeacherSet, build_routed, load_routes, load_teacher, teacher_source
from opd.features import rollout_features
from opd.identity import DigestCache, model_identity
from opd import lora as lora_mod
from opd.lora import DEFAULT_TARGETS, LoRASettings
from opd.lr_schedule import LR_SCHEDULES, lr_scheduler, restore_group_lr
from opd.ledger import PHASES, Ledger, PhaseTimer, format_summary, summarize, write_atomic
from opd.model import DTYPES, autocast, load_model, load_processor, resolve_model_source, special_ids
from opd.predictor import PredictorConfig
from opd.rollout import Rollouts, generate_rollouts
from opd.seeding import mix_seed
from opd.selectors import POLICIES, Selector, query_budget
from opd.sharding import GENERATION, full_tensor, generation, load_sharded_model, shard_model
from opd.ema_teacher import AdapterTeacher, EMATeacher, Teacher, lm_head_weight
from opd.objective import ObjectiveContext, StepBatch
from opd.tiny import tiny_defaults
from opd.tracking import Trackers, parse_report_to
from opd.methods import METHODS, get_method
from opd.views import VIEWS, get_view

SECTIONS = {m.objective.name: m.objective.Config for m in METHODS.values() if m.objective.Config is not None}
"""The objectives that own a config dataclass (`opd.objective.Objective.Config`), by flag prefix: DAPD's
`--dapd-*`, OPOD's `--opod-*`. Found in the method table, so train.py names no objective."""


@dataclass
class RunConfig:
    """The run's settings: one flag per field (`opd.cli`); `TrainConfig` adds each objective's own (SECTIONS)."""

    preset: str = "tiny"
    """Starting values: 'tiny' (built-in model and data, CPU), 'paper-4b' / 'paper-9b' (the paper's tables)."""
    model: str | None = None
    """HF image-text-to-text checkpoint (folder or hub id); none with --preset tiny: the built-in tiny model."""
    data: str | None = None
    """Training data (Vision-OPD or bbox form): a JSONL file, a parquet file or folder, a `datasets` save_to_disk
    folder, or a hub id org/name (opd/data.py); none with --preset tiny: the built-in tiny dataset."""
    data_split: str | None = None
    """The split of --data when it has several (a DatasetDict folder, a hub id, a parquet folder of split files)."""
    data_columns: str | None = None
    """Column renames of --data, "COLUMN=FIELD,..." (e.g. "question=problem,img=images"); unmapped columns keep
    their names."""
    out: str = "runs/tiny"
    """Output folder: ledger.jsonl, summary.md, checkpoints, TensorBoard logs."""
    resume: str | None = None
    """Continue from a run folder (its latest checkpoint) or a checkpoint folder, with the run's own settings."""
    overwrite: bool = False
    """Start over in an --out folder that holds a run, deleting its ledger, summary and checkpoints."""
    method: str = "bas-opd"
    """Method of the family (opd/methods.py): bas-opd, vision-opd, rp-opsd, opd-v, opsd, dapd, opod or gkd; sets
    its views, support, divergence, token weight (DAPD, OPOD: their own objective) and its paper's settings (under
    the flags given)."""
    policy: str = "learned"
    """Selection policy: full, random, entropy or learned."""
    rho: float = 0.25
    """Query ratio rho in (0, 1]; the budget is K = floor(rho |C|) per step (Eq. 4)."""
    steps: int = 0
    """Training steps; 0 = one epoch (floor(records / prompts_per_step), the paper's 111)."""
    prompts_per_step: int = 28
    """Prompts per step over all processes."""
    rollouts_per_prompt: int = 8
    """Sampled responses per prompt; candidates per step = prompts_per_step x rollouts_per_prompt."""
    max_prompt_len: int = 8192
    """Longest prompt in tokens (image tokens included); longer prompts are an error."""
    max_response_len: int = 1024
    """Most new tokens per rollout."""
    enable_thinking: bool = False
    """Qwen3.5's thinking generation prompt instead of the non-thinking one."""
    teacher_view: str | None = None
    """The teacher's privileged view (opd/views.py); none = the method's (crop for bas-opd)."""
    teacher_model: str | None = None
    """A fixed teacher checkpoint (folder or hub id, the policy's tokenizer) in place of the EMA self-teacher;
    frozen, run only on the selected rows (opd/external_teachers.py)."""
    teachers: str | None = None
    """A routing table (JSON, opd/external_teachers.py): a record field's values mapped to teacher checkpoints, each loaded
    once, frozen and run only on the selected rows routed to it."""
    lr: float = 2e-6
    """AdamW learning rate of the policy (the peak of --lr-schedule)."""
    lr_schedule: str = "constant"
    """The learning rate over the steps (transformers' schedulers): constant, linear (to 0) or cosine (to 0), each
    after --warmup-steps of linear warm-up from 0."""
    warmup_steps: int = 0
    """Steps of linear warm-up (Vision-OPD, OPD-V, RP-OPSD: 10)."""
    schedule_steps: int = 0
    """Steps the schedule spans (its decay reaches 0 there); 0 = --steps (DAPD: a 500-step schedule)."""
    lora_r: int = 0
    """LoRA rank (peft; opd/lora.py): 0 = full fine-tuning (BAS-OPD's); else the policy trains an adapter on a frozen
    base and its teachers are that base with another adapter (EMA) or none (fixed, DAPD's base)."""
    lora_alpha: float = 0.0
    """LoRA alpha: the adapter's output times alpha / r; 0 = 2 r."""
    lora_dropout: float = 0.0
    """Dropout on the adapter's input in the student's forwards."""
    lora_targets: str = DEFAULT_TARGETS
    """Modules LoRA adapts: a regex over module names, or comma-separated module names (default: the language
    model's attention, MLP and linear-attention projections)."""
    sample_temperature: float = 1.0
    """Rollout sampling temperature (OPSD, DAPD: 1.1); Eq. 5's features and the ledger describe the distribution
    actually sampled."""
    sample_top_p: float = 1.0
    """Rollout nucleus sampling: the smallest top set of probability >= p (OPSD, DAPD: 0.95); 1 = off."""
    sample_top_k: int = 0
    """Rollout sampling among the k most likely tokens (OPSD, DAPD: 20); 0 = off."""
    loss_temperature: float = 1.0
    """Both sides' logits divided by it before the divergence (OPSD: 1.1); the utility labels use it too."""
    loss_agg: str = "token-mean"
    """Eq. 11's aggregation: token-mean (one mean over S's tokens, BAS-OPD), sequence-mean (each row's token mean,
    averaged over rows: OPSD) or micro-batch (a token mean per micro-batch, summed weighted by rows: verl's)."""
    support: str | None = None
    """The divergence's support (opd/divergence.py: student_tail, teacher, teacher_renorm, full); none = the method's."""
    weight_decay: float = 0.01
    """AdamW weight decay of the policy."""
    grad_clip: float = 1.0
    """Gradient-norm clip of the policy update (not in the paper; the peers' 1.0); 0 = no clipping."""
    ema_tau: float = 0.05
    """EMA rate tau of the crop teacher, applied after each valid update."""
    ema_every: int = 1
    """Apply the teacher update every N steps (1: the EMA of every step; DAPD's snapshot: 100, with --ema-tau 1)."""
    alpha: float = 0.5
    """Generalized JSD mixture weight (0.5: symmetric JSD); unused by rp-opsd's reverse KL."""
    is_clip: float = 0.0
    """Importance-ratio clip c (Vision-OPD's is_clip 2): each token's loss times min(pi/pi_old, c); 0 = off."""
    topk: int = 100
    """Top-k support of the distillation loss and the utility terms."""
    micro_batch: int = 4
    """Most rows per student/teacher forward."""
    micro_batch_tokens: int = 0
    """Most padded teacher tokens per forward (rows grouped by length under it); 0 = rows only."""
    loss_chunk: int = 512
    """Response positions per LM-head chunk in the loss (logits never held beyond it); 0 = whole micro-batch logits."""
    rollout_batch: int = 0
    """Rows per generate() call, in whole prompts; 0 = all of a rank's rows at once."""
    rollout_engine: str = "hf"
    """Who samples the rollouts: hf (Hugging Face generate, the default and the reference) or vllm (a vLLM server in
    its own venv, scripts/install_vllm.sh; the policy's weights pushed to it before each step's generation;
    opd/engine.py). With vllm the token entropy is unavailable: Eq. 5's entropy feature is 0 and Entropy-25 ranks
    by the mean sampled-token NLL (the paper's fallback)."""
    vllm_url: str | None = None
    """A vLLM server already running (http://127.0.0.1:PORT, started with opd.engine.server_command's flags) for
    --rollout-engine vllm; none: the run starts its own on rank 0 and stops it at the end."""
    share_prefill: bool = True
    """Encode and prefill each prompt once for its rollouts (when the model's cache can be expanded)."""
    explore: float = 0.10
    """Exploration ratio eps of the learned selector: K_e = ceil(eps K); with --unbiased the uniform share of the
    inclusion probabilities."""
    unbiased: bool = False
    """Sample S with inclusion probabilities that grow with the score (learned: predicted utility; entropy: mean
    entropy) instead of taking the top K, and weigh each row's loss by 1 / pi (Eq. 11's Hajek form; opd/selectors.py)."""
    max_per_prompt: int = 0
    """At most N rows of S per prompt (top-K and uniform policies); 0 = no cap."""
    selector_seed: int = 0
    """Seed of the selector's initialisation and of every selection/replay draw."""
    selector_lr: float = 1e-3
    """Adam learning rate of the selector."""
    selector_hidden: int = 32
    """Hidden width of the selector MLP."""
    norm_momentum: float = 0.99
    """Momentum of the running feature normalizer."""
    replay_capacity: int = 512
    """FIFO replay capacity."""
    replay_start: int = 96
    """Labels in replay before the first selector update."""
    replay_batch: int = 256
    """Replay minibatch size."""
    selector_updates: int = 2
    """Selector updates per step that brought new labels."""
    half_life: float = 10.0
    """Replay age half-life h in steps (recency weight 2^(-age/h))."""
    rank_weight: float = 0.2
    """Weight lambda_rank of the pairwise ranking loss (Eq. 10)."""
    min_gap: float = 1e-6
    """Minimum utility gap for a ranking pair."""
    no_overlap: bool = False
    """Ablation: utility without the top-k overlap factor (o = 1)."""
    no_confidence: bool = False
    """Ablation: utility without the teacher-confidence factor (c = 1)."""
    no_rank_loss: bool = False
    """Ablation: selector trained without the ranking loss."""
    no_exploration: bool = False
    """Ablation: learned selection without random exploration (K_e = 0)."""
    seed: int = 42
    """Training seed: data order and rollout sampling."""
    dtype: str = "float32"
    """Weight dtype of policy and teacher (float32 keeps lr 2e-6 updates representable)."""
    mixed_precision: str = "no"
    """Autocast of the forwards: no, bf16 or fp16 (weights stay in --dtype)."""
    grad_checkpointing: bool = False
    """Recompute activations in backward (long responses on a real model)."""
    fsdp: bool = False
    """Shard the policy, its gradients and AdamW state, and the EMA teacher over the processes (FSDP2,
    torch's fully_shard) instead of replicating them (DDP); checkpoints are then sharded."""
    fsdp_generation: str = "gathered"
    """With --fsdp: 'gathered' all-gathers the policy once per generate() call; 'layerwise' gathers it layer
    by layer at every generated token (less memory, far more communication)."""
    report_to: str = "tensorboard"
    """Experiment trackers through accelerate, comma-separated: tensorboard (DIR/tb), wandb, mlflow (DIR/mlruns),
    trackio, comet_ml, aim, clearml, dvclive, swanlab; none for none (opd/tracking.py)."""
    run_label: str | None = None
    """The run's name in the trackers (default: the --out folder's name and the policy, e.g. 'tiny learned-25')."""
    save_every: int = 0
    """Checkpoint every N steps (0: only at the end)."""
    keep_checkpoints: int = 1
    """Checkpoints kept in the output folder."""

    def predictor(self) -> PredictorConfig:
        return PredictorConfig(
            seed=self.selector_seed, lr=self.selector_lr, hidden=self.selector_hidden,
            norm_momentum=self.norm_momentum, replay_capacity=self.replay_capacity, replay_start=self.replay_start,
            replay_batch=self.replay_batch, updates_per_step=self.selector_updates, half_life=self.half_life,
            rank_weight=0.0 if self.no_rank_loss else self.rank_weight, min_gap=self.min_gap,
        )  # fmt: skip

    def distill(self) -> DistillConfig:
        method = get_method(self.method)
        return DistillConfig(
            self.topk, self.alpha, self.micro_batch, self.micro_batch_tokens, self.loss_chunk,
            not self.no_overlap, not self.no_confidence, self.support or method.support, method.divergence,
            method.token_weight, self.is_clip, self.loss_temperature, self.loss_agg,
        )  # fmt: skip

    def lora(self) -> LoRASettings | None:
        """LoRA's settings (opd/lora.py), or None for full fine-tuning."""
        if not self.lora_r:
            return None
        return LoRASettings(self.lora_r, self.lora_alpha, self.lora_dropout, self.lora_targets)

    def live_eval(self) -> LiveEvalSettings:
        """--eval-* (opd/eval/live.py's section of TrainConfig)."""
        return section_config(self, "eval", LiveEvalSettings)

    def sampling(self) -> dict:
        """The rollouts' sampling distribution (opd.rollout.generate_rollouts)."""
        return dict(temperature=self.sample_temperature, top_p=self.sample_top_p, top_k=self.sample_top_k)

    def objective(self):
        """The method's objective's own config (e.g. `opd.dapd.DAPDConfig`), or None when it has none."""
        cls = get_method(self.method).objective
        return section_config(self, cls.name, cls.Config) if cls.Config is not None else None


TrainConfig = with_sections(RunConfig, {**SECTIONS, "eval": LiveEvalSettings}, "TrainConfig")
"""RunConfig's fields plus each objective's (`--dapd-clip` is field dapd_clip; `TrainConfig.objective()` builds
the method's own config from them) and the live evaluation's (`--eval-every` is field eval_every)."""


PAPER = dict(
    data=None, prompts_per_step=28, rollouts_per_prompt=8, max_prompt_len=8192, max_response_len=1024,
    steps=0, lr=2e-6, micro_batch=4, mixed_precision="bf16", grad_checkpointing=True, save_every=10,
)  # fmt: skip
PRESETS: dict[str, dict] = {
    # Scaled down so a CPU runs it in about a minute: 4 prompts x 8 rollouts, 16-token responses, a
    # learning rate a random tiny model moves under, and a replay that starts within the run.
    "tiny": dict(
        prompts_per_step=4, rollouts_per_prompt=8, max_prompt_len=512, max_response_len=16, steps=8, lr=1e-4,
        micro_batch=8, replay_start=16, replay_batch=64, save_every=4, out="runs/tiny",
    ),  # fmt: skip
    "paper-4b": dict(PAPER, model="Qwen/Qwen3.5-4B", out="runs/paper-4b"),
    "paper-9b": dict(PAPER, model="Qwen/Qwen3.5-9B", out="runs/paper-9b"),
}


RESUMABLE = (
    "resume", "out", "steps", "save_every", "keep_checkpoints", "report_to", "run_label",
    "eval_every", "eval_data", "eval_benchmarks", "eval_limit", "eval_views", "eval_max_new_tokens", "eval_batch",
    "micro_batch", "micro_batch_tokens", "loss_chunk", "rollout_batch", "share_prefill", "grad_checkpointing", "vllm_url",
    "fsdp_generation",
)  # fmt: skip
"""The fields a resumed run may change: its length, its checkpointing, and memory/speed settings that
leave the method's results unchanged. Every other field is the run's own, read from its checkpoint."""
OBJECTIVE_BATCHING = ("micro_batch", "micro_batch_tokens")
"""RESUMABLE fields that are the objective's own under --loss-agg micro-batch (a token mean per micro-batch)."""


def resumable(stored: dict) -> tuple[str, ...]:
    """RESUMABLE, less the micro-batching of a run whose loss is verl's per-micro-batch mean."""
    if stored.get("loss_agg") == "micro-batch":
        return tuple(f for f in RESUMABLE if f not in OBJECTIVE_BATCHING)
    return RESUMABLE


VLLM_PUSH = ".vllm-push"
"""DIR/.vllm-push/: a sharded run's gathered weights for the vLLM engine (`Run._push_weights`), removed at the end."""
OVERWRITTEN = ".overwritten"
"""DIR/.overwritten/: an --overwrite's old run, set aside until the new one has started its trackers."""
RUN_FILES = ("ledger.jsonl", "summary.json", "summary.md", "latest", "tb", "mlruns", "wandb", "trackers.json",
             ".summary.json.tmp", ".summary.md.tmp", OVERWRITTEN, VLLM_PUSH)  # fmt: skip
"""What a training run writes into its --out folder, besides checkpoint-NNNNNN/ (and a kill's leftovers)."""
DIGESTS = ".digests.json"
"""DIR/.digests.json: the digest cache of the frozen models a run loads (`opd.identity.DigestCache`); kept by
--overwrite, since it describes files outside the run. DIR/.lock is the run's lock (`opd.runlock`)."""


def run_files(out: Path) -> list[Path]:
    """The files and folders of a training run in `out` (none when it holds no run)."""
    if not out.is_dir():
        return []
    return sorted(p for p in out.iterdir() if p.name in RUN_FILES or p.name.startswith(("checkpoint-", ".checkpoint-")))


def launch_info(world: int) -> dict:
    """What ran: the number of processes, the launcher and this process's command line."""
    env = os.environ
    launcher = "accelerate" if any(k.startswith("ACCELERATE_") for k in env) else "torchrun" if "TORCHELASTIC_RUN_ID" in env else "python"
    return {"world_size": world, "launcher": launcher, "command": shlex.join([Path(sys.executable).name, *sys.argv])}


def check_config(cfg: TrainConfig, world: int) -> None:
    """Refuses impossible settings with a message naming the flag."""
    problems = []
    if cfg.policy not in POLICIES:
        problems.append(f"--policy {cfg.policy!r}: choose one of {', '.join(POLICIES)}")
    if not 0.0 < cfg.rho <= 1.0:
        problems.append(f"--rho {cfg.rho}: the query ratio must lie in (0, 1]")
    if cfg.policy == "full" and cfg.rho != 1.0:
        problems.append(f"--policy full queries every candidate: it needs --rho 1, got {cfg.rho}")
    if cfg.prompts_per_step % world:
        problems.append(f"--prompts-per-step {cfg.prompts_per_step} does not split over {world} processes")
    if not 0.0 <= cfg.alpha <= 1.0:
        problems.append(f"--alpha {cfg.alpha}: must lie in [0, 1]")
    if cfg.topk < 2:
        problems.append(f"--topk {cfg.topk}: must be at least 2")
    if not 0.0 <= cfg.explore < 1.0:
        problems.append(f"--explore {cfg.explore}: must lie in [0, 1)")
    if cfg.unbiased and cfg.policy == "random":
        problems.append("--unbiased with --policy random: uniform selection is already unbiased (every row has pi = K / |C|)")
    elif cfg.unbiased and cfg.policy not in ("entropy", "learned"):
        problems.append(f"--unbiased samples by a score: it needs --policy entropy or learned, not {cfg.policy}")
    if cfg.lora_r < 0:
        problems.append(f"--lora-r {cfg.lora_r}: must be >= 0 (0 = full fine-tuning)")
    if cfg.lora_alpha < 0 or not 0 <= cfg.lora_dropout < 1:
        problems.append(f"--lora-alpha {cfg.lora_alpha} must be >= 0 and --lora-dropout {cfg.lora_dropout} in [0, 1)")
    if cfg.lr_schedule not in LR_SCHEDULES:
        problems.append(f"--lr-schedule {cfg.lr_schedule!r}: choose one of {', '.join(LR_SCHEDULES)}")
    if cfg.warmup_steps < 0 or cfg.schedule_steps < 0:
        problems.append("--warmup-steps and --schedule-steps must be >= 0")
    if not cfg.sample_temperature > 0:
        problems.append(f"--sample-temperature {cfg.sample_temperature}: must be > 0")
    if not 0 < cfg.sample_top_p <= 1:
        problems.append(f"--sample-top-p {cfg.sample_top_p}: must lie in (0, 1]")
    if cfg.sample_top_k < 0:
        problems.append(f"--sample-top-k {cfg.sample_top_k}: must be >= 0 (0 = off)")
    if not cfg.loss_temperature > 0:
        problems.append(f"--loss-temperature {cfg.loss_temperature}: must be > 0")
    if cfg.loss_agg not in AGGREGATIONS:
        problems.append(f"--loss-agg {cfg.loss_agg!r}: choose one of {', '.join(AGGREGATIONS)}")
    elif cfg.unbiased and cfg.loss_agg != "token-mean":
        problems.append("--unbiased weighs Eq. 11's token mean (its Hajek form): it needs --loss-agg token-mean")
    if cfg.is_clip and (cfg.sample_top_p < 1 or cfg.sample_top_k):
        problems.append("--is-clip's ratio compares the student with the sampling distribution: it needs untruncated "
                        "sampling (--sample-top-p 1 --sample-top-k 0)")
    elif cfg.is_clip and cfg.sample_temperature != cfg.loss_temperature:
        problems.append(f"--is-clip's ratio divides the student at --loss-temperature {cfg.loss_temperature:g} by the "
                        f"rollouts' log-probs at --sample-temperature {cfg.sample_temperature:g}: give both the same value")
    if cfg.unbiased and (cfg.no_exploration or cfg.explore == 0):
        problems.append("--unbiased needs exploration (--explore > 0, no --no-exploration): rows scored 0 would get "
                        "pi = 0 and never be drawn, and the 1 / pi weighting would not be unbiased")
    if cfg.support is not None:
        try:
            check_loss(cfg.support, get_method(cfg.method).divergence if cfg.method in METHODS else "jsd")
        except ValueError as exc:
            problems.append(f"--support {cfg.support!r}: {exc}")
    if cfg.rollout_engine not in ("hf", "vllm"):
        problems.append(f"--rollout-engine {cfg.rollout_engine!r}: choose hf or vllm")
    elif cfg.rollout_engine == "vllm" and cfg.lora_r:
        problems.append("--rollout-engine vllm pushes whole weights: with --lora-r use --rollout-engine hf (an adapter "
                        "push is a documented next step)")
    if cfg.max_per_prompt < 0:
        problems.append(f"--max-per-prompt {cfg.max_per_prompt}: must be at least 1 (0 = no cap)")
    if cfg.unbiased and cfg.max_per_prompt:
        problems.append("--unbiased and --max-per-prompt: a cap would change the inclusion probabilities; choose one")
    for name in ("micro_batch", "rollouts_per_prompt", "prompts_per_step", "max_response_len", "keep_checkpoints"):
        if getattr(cfg, name) < 1:
            problems.append(f"--{name.replace('_', '-')} {getattr(cfg, name)}: must be at least 1")
    if cfg.mixed_precision not in ("no", "bf16", "fp16"):
        problems.append(f"--mixed-precision {cfg.mixed_precision!r}: choose no, bf16 or fp16")
    if cfg.micro_batch_tokens < 0 or cfg.loss_chunk < 0:
        problems.append("--micro-batch-tokens and --loss-chunk must be >= 0")
    if cfg.steps < 0:
        problems.append(f"--steps {cfg.steps}: must be >= 0")
    if not cfg.grad_clip >= 0:  # NaN too
        problems.append(f"--grad-clip {cfg.grad_clip}: must be >= 0 (0 = no clipping)")
    for name in ("lr", "weight_decay", "selector_lr", "rank_weight", "min_gap", "replay_start"):
        if not getattr(cfg, name) >= 0:  # NaN too
            problems.append(f"--{name.replace('_', '-')} {getattr(cfg, name)}: must be >= 0")
    for name in ("selector_hidden", "replay_capacity", "replay_batch", "selector_updates"):
        if getattr(cfg, name) < 1:
            problems.append(f"--{name.replace('_', '-')} {getattr(cfg, name)}: must be at least 1")
    if not cfg.half_life > 0:
        problems.append(f"--half-life {cfg.half_life}: the replay's age half-life must be > 0 steps")
    if not 0.0 <= cfg.norm_momentum < 1.0:
        problems.append(f"--norm-momentum {cfg.norm_momentum}: must lie in [0, 1)")
    if not 0.0 <= cfg.ema_tau <= 1.0:
        problems.append(f"--ema-tau {cfg.ema_tau}: the EMA rate must lie in [0, 1] (0: a fixed teacher, 1: a copy)")
    if cfg.max_prompt_len < 1:
        problems.append(f"--max-prompt-len {cfg.max_prompt_len}: must be at least 1")
    if cfg.method not in METHODS:
        problems.append(f"--method {cfg.method!r}: choose one of {', '.join(METHODS)}")
    if cfg.teacher_view is not None and cfg.teacher_view not in VIEWS:
        problems.append(f"--teacher-view {cfg.teacher_view!r}: choose one of {', '.join(sorted(VIEWS))}")
    if cfg.fsdp_generation not in GENERATION:
        problems.append(f"--fsdp-generation {cfg.fsdp_generation!r}: choose one of {', '.join(GENERATION)}")
    if not cfg.is_clip >= 0:  # NaN too
        problems.append(f"--is-clip {cfg.is_clip}: must be >= 0 (0 = off)")
    if cfg.dtype not in DTYPES:
        problems.append(f"--dtype {cfg.dtype!r}: choose one of {', '.join(DTYPES)}")
    if cfg.preset != "tiny" and cfg.data is None:
        problems.append(f"--data is required with --preset {cfg.preset} (a Vision-OPD-style training JSONL)")
    if Path(cfg.out).exists() and not Path(cfg.out).is_dir():
        problems.append(f"--out {cfg.out}: is a file; a run needs a folder")
    if cfg.resume and cfg.overwrite:
        problems.append("--resume continues a run and --overwrite deletes it: choose one")
    if cfg.ema_every < 1:
        problems.append(f"--ema-every {cfg.ema_every}: must be at least 1")
    if cfg.teacher_model and cfg.teachers:
        problems.append("--teacher-model gives one teacher and --teachers routes to several: choose one")
    if cfg.method in METHODS:
        method = METHODS[cfg.method]
        external = cfg.teacher_model or cfg.teachers
        if method.external_teachers == "refused" and external:
            problems.append(f"--method {cfg.method} anchors on the policy's own weights (base and snapshot): "
                            "--teacher-model and --teachers do not apply")
        if method.external_teachers == "required" and not external:
            problems.append(f"--method {cfg.method} distils from a separate teacher checkpoint: give --teacher-model "
                            "PATH or --teachers route.json")
        if method.objective.needs_ema_teacher and cfg.ema_tau == 0:
            problems.append(f"--method {cfg.method}: --ema-tau 0 (a fixed teacher) does not apply "
                            f"({method.objective.needs_ema_teacher})")
        defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
        for flag, reason in method.objective.refuses.items():
            if getattr(cfg, flag) != defaults[flag]:
                problems.append(f"--method {cfg.method}: --{flag.replace('_', '-')} does not apply ({reason})")
    for prefix, config in SECTIONS.items():  # every objective's own checks (its flags are checked whatever the method)
        problems += section_config(cfg, prefix, config).check()
    if problems:
        raise UserError("; ".join(problems))
    parse_columns(cfg.data_columns)  # a bad mapping: one line before anything loads
    parse_report_to(cfg.report_to)  # an unknown or uninstalled tracker too
    live = cfg.live_eval().check()
    if live:
        raise UserError("; ".join(live))


class Run:
    """Everything one training run holds: model, teacher, optimizer, selector, data, ledger."""

    def __init__(self, cfg: TrainConfig, accelerator: Accelerator | None = None):
        # cpu=True without CUDA: accelerate then sets up gloo DDP under torchrun / accelerate launch.
        cpu = not torch.cuda.is_available()
        check_config(cfg, PartialState(cpu=cpu).num_processes)
        self.acc = accelerator or Accelerator(cpu=cpu)
        self.cfg = cfg
        self.out = Path(cfg.out)
        created = not self.out.exists()
        self._lock_out_folder()  # one run per folder: a second process is refused before it reads anything
        try:
            self._build()
        except BaseException:
            runlock.release(self.out)
            if created and self.acc.is_main_process:  # a failed start leaves no folder behind
                for name in (runlock.LOCK_NAME, DIGESTS):
                    (self.out / name).unlink(missing_ok=True)
                with contextlib.suppress(OSError):
                    self.out.rmdir()  # only if nothing else is there
            raise

    def _build(self) -> None:
        """Everything the run needs, built and checked (model, processor, teachers, routes, optimizer, every
        prompt's length) before --overwrite deletes anything: a failed start leaves the old run intact."""
        cfg = self.cfg
        self.autocast = autocast(self.acc.device, cfg.mixed_precision)
        self.method = get_method(cfg.method)
        self.teacher_views = ((cfg.teacher_view or self.method.teacher_view),) + self.method.teacher_views[1:]
        self.launch = launch_info(self.acc.num_processes)
        model_path, data_path = cfg.model, cfg.data
        if model_path is None or data_path is None:
            if self.acc.is_main_process:
                tiny_defaults()  # built once, then every rank reads the cached folders
            self.acc.wait_for_everyone()
            tiny_model, tiny_data = tiny_defaults()
            model_path, data_path = model_path or str(tiny_model), data_path or str(tiny_data)
        model_path = model_source(model_path, f"--model {model_path}")  # a train.py run folder: its policy/
        resolve_model_source(model_path)
        self.records: list[Record] = load_records(data_path, cfg.data_split, parse_columns(cfg.data_columns))
        self._check_records(data_path)
        found = self._check_out_folder()
        self.steps = cfg.steps or len(self.records) // cfg.prompts_per_step
        self.initial_model = model_path  # the run's starting weights (DAPD's base anchor, OPOD's reference)
        state, teacher_path = None, None
        self.start = 0
        self.digests = DigestCache(self.out / DIGESTS)
        self.identities: dict[str, str] = {}  # what each frozen model loaded was (its files' digest), by role
        self.stored_identities: dict[str, str] = {}
        if cfg.resume:
            ckpt = checkpoint_of(cfg.resume)
            refuse_changed_settings(cfg, load_config(ckpt), ckpt)
            state = load_state(ckpt)
            self.start = int(state["step"])
            self.stored_identities = state.get("identities", {})
            if not cfg.fsdp:  # sharded checkpoints hold the weights in ckpt/sharded, loaded after sharding
                model_path = str(ckpt / "policy")
                teacher_path = str(ckpt / "teacher") if (ckpt / "teacher").is_dir() else None  # frozen teachers: not saved
            if self.steps < self.start:
                raise UserError(f"--steps {self.steps}: the checkpoint {ckpt} is already at step {self.start}")
            self._note_world_size(ckpt, state)
        if cfg.fsdp:  # a sharded run is rebuilt from its own --model on resume, then overwritten from the shards
            self._identify(model_path, "--model")
        self.processor = load_processor(model_path)
        external = bool(cfg.teacher_model or cfg.teachers)
        shard = dict(dtype=cfg.dtype, device=self.acc.device, mixed_precision=cfg.mixed_precision)
        if cfg.fsdp:
            self.load_frozen = lambda path, role: load_sharded_model(self._identify(path, role), **shard).eval()
        else:
            self.load_frozen = lambda path, role: load_model(self._identify(path, role), cfg.dtype, self.acc.device)
        initial_teacher = lambda: Teacher(self.load_frozen(self.initial_model, "--model"))  # noqa: E731 (DAPD, OPOD)
        if cfg.lora_r:  # opd/lora.py: a frozen base with the trained adapter; the teachers share the base
            initial_teacher = self._build_lora(external, ckpt if cfg.resume else None, shard)
        elif cfg.fsdp:  # opd/sharding.py: every rank holds 1/world of the policy, its optimizer state and the teacher
            student = load_sharded_model(model_path, grad_checkpointing=cfg.grad_checkpointing, **shard)
            if not external:
                self.teacher = EMATeacher(load_sharded_model(model_path, **shard), copy_weights=False)
                self.teacher.copy_from(student)  # Algorithm 1, line 1, shard by shard
            self.student = student
            self.optimizer = torch.optim.AdamW(student.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        else:
            student = load_model(model_path, cfg.dtype, self.acc.device).train()  # from_pretrained returns eval mode
            if cfg.grad_checkpointing:
                # non-reentrant: the reentrant variant marks DDP parameters ready twice
                student.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            if not external and teacher_path:  # a resumed EMA teacher
                self.teacher = EMATeacher(load_model(teacher_path, cfg.dtype, self.acc.device), copy_weights=False)
            elif not external:
                self.teacher = EMATeacher(student)
            optimizer = torch.optim.AdamW(student.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
            self.student, self.optimizer = self.acc.prepare(student, optimizer)
        default = self._external_teachers() if external else TeacherSet({"teacher": self.teacher})
        self.teachers = self.method.objective.build_teachers(default, initial_teacher)  # DAPD: its two anchors
        self.teacher = next(iter(self.teachers.teachers.values()))  # the first (the only one, but with routes)
        if cfg.fsdp and state is not None:  # a LoRA run's EMA teacher is an adapter of the policy: in its shards
            sharded_teacher = self.teacher.model if self.teacher.trainable and not cfg.lora_r else None
            load_sharded(ckpt, self.student, sharded_teacher, self.optimizer)
        self.ids = special_ids(self.policy)
        self.selector = Selector(cfg.policy, 0.0 if cfg.no_exploration else cfg.explore, cfg.predictor(), cfg.unbiased,
                                 cfg.max_per_prompt)  # fmt: skip
        self.student_view = get_view(self.method.student_view)
        self.warned_no_eligible = False
        self.context = ObjectiveContext(
            accelerator=self.acc, student=self.student, policy=lambda: self.policy, teachers=self.teachers,
            encode=self.encode, processor=self.processor, ids=self.ids, autocast=self.autocast,
            student_view=self.method.student_view, teacher_views=self.teacher_views, distill=cfg.distill(),
            max_response_len=cfg.max_response_len, ema_tau=cfg.ema_tau, ema_every=cfg.ema_every,
        )  # fmt: skip
        self.objective = self.method.objective(self.context, cfg.objective(), initial_teacher)
        # the schedule's span is fixed when the run starts (--schedule-steps, else its --steps); a resume keeps it
        self.schedule_span = (state or {}).get("schedule_span") or cfg.schedule_steps or self.steps
        self.scheduler = lr_scheduler(self.optimizer, cfg.lr_schedule, cfg.warmup_steps, self.schedule_span)
        if self.teachers.routes is not None:
            self.teachers.routes.check_records(self.records)
        self._check_prompts()
        self.live = LiveEval(cfg.live_eval(), self.steps) if cfg.eval_every else None  # the held items, loaded once
        self.engine = self._start_engine() if cfg.rollout_engine == "vllm" else None
        if state is not None:
            if not cfg.fsdp:
                self.optimizer.load_state_dict(state["optimizer"])
            if "scheduler" in state:
                self.scheduler.load_state_dict(state["scheduler"])
                restore_group_lr(self.optimizer, self.scheduler)  # the sharded path loaded the optimizer first
            self.selector.load_state_dict(state["selector"])
            self.objective.load_state_dict(state.get("objective", {}))
            self.warned_no_eligible = state.get("warned_no_eligible", False)
        aside = self._set_old_run_aside(found)  # --overwrite: only now, with every input built
        if self.acc.is_main_process:
            self.digests.save()
        try:  # a tracker that cannot start (a wandb login, an mlflow server) puts the old run back
            self.trackers = Trackers(self.acc, parse_report_to(cfg.report_to), self.out, "bas-opd",
                                     cfg.run_label or f"{self.out.name} {self.run_name}", dataclasses.asdict(cfg),
                                     resume=bool(cfg.resume))  # fmt: skip
        except BaseException:
            self._restore_old_run(aside)
            raise
        if aside is not None:
            shutil.rmtree(aside)
        self.ledger = Ledger(self.out / "ledger.jsonl", self.start if cfg.resume else None) if self.acc.is_main_process else None
        self.objective_keys: list[str] = []  # the objective's own ledger fields (its tracker namespace)

    def _build_lora(self, external: bool, ckpt: Path | None, shard: dict):
        """The LoRA policy (opd/lora.py): the run's initial --model, frozen, with the trained adapter `default`; the
        EMA teacher is the adapter `teacher` on the same base (a fixed one, --ema-tau 0: the base alone); a resume
        loads both adapters from the checkpoint (sharded: from its shards). Returns the initial-weights teacher
        (the base with the adapter disabled) for DAPD's base and OPOD's reference."""
        cfg = self.cfg
        settings = cfg.lora()
        ema = not external and cfg.ema_tau > 0
        adapters = ("teacher",) if ema else ()
        device = self.acc.device
        with torch.random.fork_rng(devices=[]):  # the adapters' initialisation: one seed, the same on every rank
            torch.manual_seed(cfg.seed)
            base = load_model(self._identify(self.initial_model, "--model"), cfg.dtype, "cpu" if cfg.fsdp else device)
            if not lora_mod.matched_modules(base, settings.targets):
                raise UserError(f"--lora-targets {settings.targets!r}: matches no linear module of {self.initial_model}")
            student = lora_mod.wrap(base, settings, adapters).train()
        if cfg.grad_checkpointing:
            student.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            student.enable_input_require_grads()  # the frozen embeddings' outputs feed checkpointed layers
        if ckpt is not None and not cfg.fsdp:
            lora_mod.load_adapter(student, lora_mod.STUDENT, ckpt / "policy")
            if ema:
                lora_mod.load_adapter(student, "teacher", ckpt / "teacher")
        trainable = lambda m: [p for p in m.parameters() if p.requires_grad]  # noqa: E731 (the adapter's)
        if cfg.fsdp:
            self.student = shard_model(student, device, cfg.mixed_precision)
            self.optimizer = torch.optim.AdamW(trainable(self.student), lr=cfg.lr, weight_decay=cfg.weight_decay)
        else:
            optimizer = torch.optim.AdamW(trainable(student), lr=cfg.lr, weight_decay=cfg.weight_decay)
            self.student, self.optimizer = self.acc.prepare(student, optimizer)
        if not external:
            self.teacher = AdapterTeacher(self.policy, "teacher" if ema else None)
        return lambda: AdapterTeacher(self.policy, None)

    def _start_engine(self):
        """The vLLM engine (opd/engine.py): --vllm-url's, or one started by rank 0 for the run's initial weights (its
        URL handed to every rank); a missing venv or a model the engine cannot serve is one line before anything is
        written. The weights of a resumed run are pushed before the first step (`_push_weights`)."""
        from accelerate.utils import broadcast_object_list

        from opd.engine import VLLMServer, check_venv

        cfg = self.cfg
        self.engine_stale = True  # push the policy's weights before the first generation
        if cfg.vllm_url:
            return VLLMServer.connect(cfg.vllm_url)
        url = [None]
        if self.acc.is_main_process:
            check_venv()
            length = cfg.max_prompt_len + cfg.max_response_len + 16
            server = VLLMServer.start(self.initial_model, seed=cfg.seed, max_model_len=length,
                                      log_path=Path(tempfile.gettempdir()) / f"vllm-{os.getpid()}.log")  # fmt: skip
            self._own_engine = server
            url = [server.url]
        if self.acc.num_processes > 1:
            broadcast_object_list(url)
        return self._own_engine if self.acc.is_main_process else VLLMServer.connect(url[0])

    def _push_weights(self) -> None:
        """The policy's current weights into the engine (rank 0; sharded: gathered by every rank first)."""
        if self.cfg.fsdp:
            from opd.checkpoint import export_pretrained

            folder = self.out / VLLM_PUSH  # one shared path for every rank (and machine); removed at the end
            export_pretrained(self.student, folder)
            if self.acc.is_main_process:
                self.engine.push_weights(folder)
        elif self.acc.is_main_process:
            self.engine.push_weights(self.policy)
        self.acc.wait_for_everyone()
        self.engine_stale = False

    def _lock_out_folder(self) -> None:
        """Rank 0 takes --out's lock (`opd.runlock`); every rank refuses alike when another run holds it."""
        error = ""
        if self.acc.is_main_process:
            try:
                runlock.acquire(self.out)
            except runlock.LockedError as exc:
                error = f"{exc}: wait for it to finish, or give another --out"
            except OSError as exc:  # not a folder, not writable
                error = f"{self.out}: cannot hold a run ({exc.strerror or exc}); give another --out"
        held = self.acc.reduce(torch.tensor([int(bool(error))], device=self.acc.device), "sum")
        if int(held.item()):
            raise UserError(f"--out {error or self.out}" + ("" if error else ": refused on rank 0"))

    def _identify(self, path: str, role: str) -> str:
        """Records the identity (`opd.identity.model_identity`: its files' digest, or a hub id) of a model that a
        resumed run loads again from its path (frozen teachers, DAPD's base, a sharded run's --model), and refuses
        a resume whose model there has changed since the run started. Returns `path`."""
        found = model_identity(path, self.digests)
        ident = found["model"] + (f"@{found['model_revision']}" if found["model_revision"] else "")  # a hub commit too
        before = self.stored_identities.get(role)
        if before is not None and before not in (ident, found["model"]):  # (checkpoints before 12/2026: no commit)
            raise UserError(
                f"--resume {self.cfg.resume}: {role} {path} is not the model the run started with ({before[:19]}... "
                f"then, {ident[:19]}... now): a resumed run needs the same weights; restore them or start a new run"
            )
        self.identities[role] = ident
        return path

    def _note_world_size(self, ckpt: Path, state: dict) -> None:
        """One line when a run resumes on another number of processes (rollouts are seeded per rank)."""
        before = state.get("world_size")
        if before is not None and before != self.acc.num_processes and self.acc.is_main_process:
            print(f"train.py: note: {ckpt} was trained on {before} process(es) and resumes on {self.acc.num_processes}: "
                  "rollouts are seeded per rank, so the result will differ from a run on one number of processes",
                  file=sys.stderr, flush=True)

    def _check_prompts(self) -> None:
        """Every record's prompt in every view it is used in (the student's, and each teacher view with its
        teacher's processor) fits --max-prompt-len, checked before step 0 without decoding an image
        (`opd.chat.prompt_length`): one line naming the file:line, view and length otherwise."""
        cfg = self.cfg
        cache: dict[tuple, int] = {}
        for record in self.records:
            uses = [(self.method.student_view, self.processor)]
            if self.eligible(record):
                name = self.teachers.route(record)
                teacher = self.teachers.teachers.get(name)
                processor = getattr(teacher, "processor", None) or self.processor
                uses += [(v, processor) for v in self.teacher_views]
            for view, processor in uses:
                sizes, question = VIEWS[view].layout(record)
                key = (id(processor), tuple(sizes), question)
                if key not in cache:
                    cache[key] = prompt_length(processor, sizes, question, cfg.enable_thinking)
                if cache[key] > cfg.max_prompt_len:
                    raise UserError(
                        f"{record.source}: its '{view}' prompt has {cache[key]} tokens, over --max-prompt-len "
                        f"{cfg.max_prompt_len} (raise it, or lower the processor's max_pixels)"
                    )

    def _external_teachers(self) -> TeacherSet:
        """--teacher-model (one frozen teacher) or --teachers (one per route, each checkpoint loaded once)."""
        cfg, vocab = self.cfg, lm_head_weight(self.policy).shape[0]
        if cfg.teacher_model:
            what = f"--teacher-model {cfg.teacher_model}"
            teacher = load_teacher(cfg.teacher_model, what, self.processor, vocab, lambda p: self.load_frozen(p, what),
                                   load_processor)  # fmt: skip
            return TeacherSet({"teacher": teacher})
        routes = load_routes(cfg.teachers)
        given = {teacher_source(name): name for name in routes.teachers.values()}  # the folder loaded -> its name
        load = lambda path: self.load_frozen(path, f"teacher {given.get(path, path)}")  # noqa: E731
        return build_routed(routes, self.processor, vocab, load, load_processor)

    def _check_out_folder(self) -> list[Path]:
        """A new run refuses an --out folder that holds a run, unless --overwrite; returns what it would delete."""
        found = [] if self.cfg.resume else run_files(self.out)
        if found and not self.cfg.overwrite:
            names = ", ".join(p.name for p in found[:4]) + (", ..." if len(found) > 4 else "")
            raise UserError(
                f"--out {self.out} holds a run ({names}): continue it with --resume {self.out}, "
                "or start over with --overwrite, which deletes it"
            )
        return found

    def _set_old_run_aside(self, found: list[Path]) -> Path | None:
        """--overwrite: rank 0 moves the old run's files into DIR/.overwritten/, once every rank has built
        everything; deleted once the trackers have started (`Run.__init__`), put back if they fail. Returns the
        folder on rank 0 (None elsewhere, and when there is nothing to delete)."""
        self.acc.wait_for_everyone()
        aside = None
        if found and self.acc.is_main_process:
            aside = self.out / OVERWRITTEN
            if aside.exists():  # a kill's leftover
                shutil.rmtree(aside)
            aside.mkdir()
            for path in found:
                if path != aside:
                    path.rename(aside / path.name)
        self.acc.wait_for_everyone()
        return aside

    def _restore_old_run(self, aside: Path | None) -> None:
        """The old run's files back in place (rank 0), after a failed start (replacing what it had begun to write)."""
        if aside is None:
            return
        for path in aside.iterdir():
            target = self.out / path.name
            if target.is_dir():
                shutil.rmtree(target)
            elif target.exists():
                target.unlink()
            path.rename(target)
        aside.rmdir()

    def _check_records(self, data_path) -> None:
        """Refuses data on which the run would do nothing: too few records for a step, or no crop at all."""
        n, per_step = len(self.records), self.cfg.prompts_per_step
        if n < per_step:
            raise UserError(f"{data_path}: {n} records cannot fill one step of --prompts-per-step {per_step}")
        if not any(self.views_eligible(r) for r in self.records):
            raise UserError(
                f"{data_path}: no record has a crop ('teacher_images' or 'bbox'), which the {self.cfg.method} teacher "
                f"views {', '.join(self.teacher_views)} need: every step would train with zero distillation"
            )

    def views_eligible(self, record: Record) -> bool:
        """Whether every view of the method can be built for the record (the crop views need a crop)."""
        return all(VIEWS[v].eligible(record) for v in (self.method.student_view, *self.teacher_views))

    def eligible(self, record: Record) -> bool:
        """Whether the record's rows can be candidates (the set C): every view of the method can be built and, with
        routed teachers, the record has a teacher."""
        return self.views_eligible(record) and self.teachers.route(record) is not None

    @property
    def run_name(self) -> str:
        """The table label: policy-percent, e.g. learned-25, prefixed by the method's label (none for bas-opd)."""
        name = f"{self.cfg.policy}-{round(100 * self.cfg.rho)}"
        prefix = self.method.name if self.method.label is None else self.method.label
        return f"{prefix} {name}".strip()

    @property
    def policy(self):
        return self.acc.unwrap_model(self.student)

    def prompt_ids(self, step: int) -> list[int]:
        """This rank's record ids of step `step`."""
        ids = step_prompt_indices(len(self.records), self.cfg.prompts_per_step, step, self.cfg.seed)
        return shard(ids, self.acc.process_index, self.acc.num_processes)

    def prompts(self, step: int) -> list[Record]:
        """This rank's records of step `step`."""
        return [self.records[i] for i in self.prompt_ids(step)]

    def encode(self, view, record: Record, seed: int = 0, processor=None, thinking: bool | None = None):
        """One prompt of `view` (a View or its name); `seed` draws the view's randomness (the mask); `processor`:
        an external teacher's (default: the policy's); `thinking`: the thinking prompt (default: --enable-thinking)."""
        images, problem = get_view(view)(record, seed) if isinstance(view, str) else view(record, seed)
        thinking = self.cfg.enable_thinking if thinking is None else thinking
        try:
            return encode_prompt(processor or self.processor, images, problem, thinking, self.cfg.max_prompt_len)
        except ValueError as exc:  # a context built at step time (DAPD's rollout, OPOD's verification) too long
            raise UserError(f"{record.source}: {exc}", local=True) from None

    def student_prompts(self, records: list[Record]) -> list:
        """The student's prompts (Eq. 1) of a step's records, in the method's student view."""
        return [self.encode(self.student_view, r) for r in records]

    def step_batch(self, step: int, record_ids: list[int], rollouts: Rollouts, student_prompts: list,
                   selected: torch.Tensor, weights: torch.Tensor | None = None) -> StepBatch:
        """What the objective gets for one step on this rank (opd.objective.StepBatch): its records, rollouts and
        prompts, the local rows of S, the teachers' prompts (encoded once per step, each with its teacher's
        processor; a view's randomness seeded by (seed, step, record id)) and each row's teacher."""
        records = [self.records[i] for i in record_ids]
        cache: dict[tuple, object] = {}

        def teacher_prompt(name: str, view: str, j: int):
            processor = self.teachers.teachers[name].processor if name in self.teachers.teachers else None
            key = (id(processor), view, j)
            if key not in cache:
                cache[key] = self.encode(view, records[j], mix_seed(self.cfg.seed, step, record_ids[j]), processor)
            return cache[key]

        route = [self.teachers.route(records[j]) for j in rollouts.prompt_index.tolist()]
        return StepBatch(step, records, list(record_ids), rollouts, student_prompts, selected, teacher_prompt, route, weights)

    def step(self, step: int, rollouts: Rollouts | None = None) -> dict:
        """One iteration of Algorithm 1; `rollouts` may stand in for sampling (tests). Returns the ledger row."""
        acc, cfg, device = self.acc, self.cfg, self.acc.device
        t_step = time.perf_counter()
        timer = PhaseTimer(device)
        with timer("prompt"):
            record_ids = self.prompt_ids(step)
            records = [self.records[i] for i in record_ids]
            student_prompts = self.student_prompts(records)

        # Line 3: y_i ~ p_theta(. | x_i, q_i) for every prompt of this rank; C = rows with a crop.
        has_entropy = True
        with timer("generation"):
            if rollouts is None and self.engine is not None:  # vLLM: the policy's weights, then the engine samples
                from opd.engine import generate_rollouts_vllm

                if self.engine_stale:
                    self._push_weights()
                images = [self.student_view(r)[0] for r in records]
                rollouts = generate_rollouts_vllm(
                    self.engine, student_prompts, images, cfg.rollouts_per_prompt, cfg.max_response_len,
                    **special_ids(self.policy), **cfg.sampling(), seed=cfg.seed, step=step, rank=acc.process_index,
                )  # fmt: skip
                has_entropy = False  # Eq. 5's entropy feature is 0 (unavailable); Entropy-25 ranks by the mean NLL
            elif rollouts is None:
                torch.manual_seed(mix_seed(cfg.seed, step, acc.process_index))
                with self.autocast(), generation(self.policy, cfg.fsdp_generation):  # a sharded policy: gathered
                    rollouts = generate_rollouts(
                        self.policy, student_prompts, cfg.rollouts_per_prompt, cfg.max_response_len,
                        cfg.rollout_batch, cfg.share_prefill, **cfg.sampling(),
                    )  # fmt: skip
        rows = rollouts.prompt_index.tolist()
        eligible_local = torch.tensor([self.eligible(records[j]) for j in rows], dtype=torch.bool) & rollouts.valid
        area = torch.tensor([records[j].area_ratio for j in rows])

        # Line 4: detached features (Eq. 5), all-gathered so every rank sees the global candidates.
        phi_local = rollout_features(rollouts.logp, rollouts.entropy, rollouts.response_mask, rollouts.prompt_len, area)
        with timer("wait"):
            phi = acc.gather(phi_local.to(device)).cpu()  # (N, 6)
            eligible = acc.gather(eligible_local.long().to(device)).cpu().bool()  # (N,)
            lengths = acc.gather(rollouts.lengths.to(device)).cpu()  # (N,)
            prompt_of = acc.gather(torch.tensor([record_ids[j] for j in rows], device=device)).cpu()  # (N,) record ids
        n_eligible = int(eligible.sum())
        budget = query_budget(cfg.rho, n_eligible)  # Eq. 4
        if n_eligible == 0 and not self.warned_no_eligible:
            warnings.warn(f"step {step}: no crop-eligible rollout in the batch; training with zero distillation")
            self.warned_no_eligible = True

        # Lines 5-9: S from the global candidates, before any teacher computation.
        with timer("select"):
            selected = self.selector.select(phi, eligible, budget, step, has_entropy, prompt_of)  # global row ids
            pi = self.selector.last_pi  # unbiased selection: S's inclusion probabilities (else None)
        offset = acc.process_index * len(rollouts)
        mine = (selected >= offset) & (selected < offset + len(rollouts))
        local = selected[mine] - offset
        weights = None
        if pi is not None:  # unbiased selection: row i of S weighs 1 / pi_i in every objective's loss
            weights = torch.ones(len(rollouts), dtype=torch.float64)
            weights[local] = 1.0 / pi[mine]

        # Lines 11-13: teacher only on S; the method's objective backpropagated; AdamW; teacher update after a valid one.
        batch = self.step_batch(step, record_ids, rollouts, student_prompts, local, weights)
        teachers = list(dict.fromkeys(self.teachers.teachers.values()))
        rows_before = sum(t.rows_scored for t in teachers)
        t0 = time.perf_counter()
        res = self.objective(batch)
        timer.seconds["teacher_forward"] += res.teacher_s
        timer.seconds["student"] += time.perf_counter() - t0 - res.teacher_s
        with timer("optimizer"):
            trained = [p for p in self.student.parameters() if p.requires_grad]  # LoRA: the adapter only
            for p in trained:  # an empty S still makes a (zero-gradient) optimizer step
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            grad_norm = acc.clip_grad_norm_(trained, cfg.grad_clip or float("inf"))  # 0: no clip
            grad_norm = full_tensor(grad_norm)  # sharded gradients: the global norm
        labels = list(res.teachers)  # the objective's labels, the same on every rank
        with timer("wait"):  # per teacher label: forward rows, real and padded tokens (summed), seconds (slowest rank)
            costs = [[c.rows, c.tokens, c.padded_tokens] for c in res.teachers.values()]
            rows_scored = sum(t.rows_scored for t in teachers) - rows_before
            counts = [res.share, rows_scored, *(x for c in costs for x in c)]
            sums = acc.reduce(torch.tensor(counts, device=device, dtype=torch.float64), "sum").cpu()
            view_s = [c.seconds for c in res.teachers.values()]
            view_s = acc.gather(torch.tensor([view_s], device=device, dtype=torch.float64)).cpu().max(0).values
        per_view = sums[2:].view(len(labels), 3).long()  # (labels, 3)
        loss = float(sums[0])
        valid = bool(torch.isfinite(torch.as_tensor(loss)) and torch.isfinite(torch.as_tensor(grad_norm)))
        if valid:
            with timer("optimizer"):
                self.optimizer.step()
            with timer("ema"):
                self.objective.after_update(step)
            if self.engine is not None:
                self.engine_stale = True  # the next generation pushes the updated weights first
        else:
            warnings.warn(f"step {step}: non-finite loss or gradient ({loss}, {float(grad_norm)}); update and EMA skipped")
        self.optimizer.zero_grad(set_to_none=True)
        lr = self.scheduler.get_last_lr()[0]  # the rate this step's update used
        self.scheduler.step()

        # Line 14: labels of S (gathered), replay, selector update on every rank alike.
        with timer("wait"):
            utility = acc.gather(res.utility.to(device)).cpu()  # (N,) NaN outside S
        with timer("selector"):
            sel_metrics = self.selector.observe(phi[selected], utility[selected], step)
        with timer("wait"):
            phases = torch.tensor([[timer.seconds[p] for p in PHASES]], device=device, dtype=torch.float64)
            phases = acc.gather(phases).cpu().max(0).values  # the slowest rank's seconds per phase
        row = {
            "step": step,
            "rollouts": int(eligible.numel()),
            "candidates": n_eligible,
            "budget": budget,
            "selected": int(selected.numel()),
            "overrun": max(0, int(selected.numel()) - budget),
            "teacher_rows": int(sums[1]),
            # prompt coverage: distinct prompts among the candidates C and in S (a top-K spending the
            # budget on a few prompts shows as selected_prompts far below min(K, candidate_prompts))
            "candidate_prompts": int(prompt_of[eligible].unique().numel()),
            "selected_prompts": int(prompt_of[selected].unique().numel()),
            "scored_tokens": int(lengths[selected].sum()),
            "candidate_tokens": int(lengths[eligible].sum()),
            "teacher_tokens": int(per_view[:, 1].sum()),
            "teacher_padded_tokens": int(per_view[:, 2].sum()),
            "loss": loss,
            "grad_norm": float(grad_norm),
            "lr": lr,
            "skipped": not valid,
            "utility_mean": float(utility[selected].nanmean()) if selected.numel() else float("nan"),
            **({"min_pi": float(pi.min()) if pi.numel() else float("nan"),
                "max_weight": float(1.0 / pi.min()) if pi.numel() else float("nan")} if pi is not None else {}),  # fmt: skip
            **{f"{p}_s": float(v) for p, v in zip(PHASES, phases)},
            **{k.split("/")[-1]: v for k, v in sel_metrics.items()},
        }
        for lab, (rows_v, tokens_v, _), sec in zip(labels, per_view.tolist(), view_s.tolist()):
            row |= {f"teacher_rows_{lab}": rows_v, f"teacher_tokens_{lab}": tokens_v, f"teacher_forward_s_{lab}": sec}
        row |= res.metrics
        self.objective_keys = list(res.metrics)
        row["world_size"] = acc.num_processes
        row["step_s"] = time.perf_counter() - t_step
        return row

    def save(self, next_step: int) -> None:
        state = {
            "selector": self.selector.state_dict(),
            "config": dataclasses.asdict(self.cfg),
            "warned_no_eligible": self.warned_no_eligible,
            "objective": self.objective.state_dict(),
            "identities": self.identities,
            "world_size": self.acc.num_processes,
            "scheduler": self.scheduler.state_dict(),
            "schedule_span": self.schedule_span,
        }
        teacher = self.teacher.model if self.teacher.trainable else None  # a frozen teacher is reloaded from its path
        adapters = None
        if self.cfg.lora_r:  # the adapters, not the base (opd/lora.py); an EMA teacher is an adapter of the policy
            adapters = {"policy": lora_mod.STUDENT, "teacher": getattr(self.teacher, "adapter", None)}
            teacher = None
        if self.cfg.fsdp:  # every rank writes its shards; the last checkpoint is also exported for eval.py
            save_sharded(self.out, next_step, self.student, teacher, self.optimizer, state,
                         self.cfg.keep_checkpoints, self.processor if next_step == self.steps else None, adapters)
        elif self.acc.is_main_process:
            state["optimizer"] = self.optimizer.state_dict()
            save_checkpoint(self.out, next_step, self.policy, self.processor, teacher, state, self.cfg.keep_checkpoints,
                            adapters)  # fmt: skip
        self.acc.wait_for_everyone()

    def log(self, row: dict) -> None:
        if not self.acc.is_main_process:
            return
        if row["step"] == self.start:  # the first row of this launch says what ran
            row = {**row, "launch": self.launch}
        self.ledger.append(row)
        self.trackers.log(row, self.objective.name, self.objective_keys)

    def train(self) -> dict:
        """Runs steps start..steps-1, checkpoints, and returns the Table 7/8 summary."""
        try:
            return self._train()
        finally:
            self.trackers.finish()
            if getattr(self, "_own_engine", None) is not None:
                self._own_engine.stop()
            if self.acc.is_main_process:
                shutil.rmtree(self.out / VLLM_PUSH, ignore_errors=True)
            runlock.release(self.out)

    def _train(self) -> dict:
        main = self.acc.is_main_process
        if self.start >= self.steps:
            if main:
                print(f"train.py: the run in {self.out} is complete ({self.start} of {self.steps} steps); "
                      "nothing to train (give a larger --steps to continue it)", flush=True)
            if not self.summary_is_current():  # killed between its last checkpoint and its summary
                return self.finish()
            return json.loads((self.out / "summary.json").read_text())
        if main:
            print(f"train.py: {self.acc.num_processes} process(es), steps {self.start}..{self.steps - 1}; "
                  f"writing {self.out}/ledger.jsonl, summary.md and checkpoints", flush=True)
        # loss: Eq. 11 this step; queried: teacher calls |S| / budget K (Eq. 4); utility: mean u_i over S (Eq. 9)
        bar = tqdm(total=self.steps, initial=self.start, desc=self.run_name, disable=not main)
        try:
            for step in range(self.start, self.steps):
                row = self.step(step)
                if self.live is not None and self.live.due(step):  # every rank: each answers its share
                    t0 = time.perf_counter()
                    # eval.py's protocol: the weights in --dtype, no --mixed-precision autocast
                    row |= self.live(self.acc, self.policy, self.processor, self.cfg.enable_thinking,
                                     lambda: generation(self.policy, self.cfg.fsdp_generation))  # fmt: skip
                    row["eval_s"] = time.perf_counter() - t0
                self.log(row)
                bar.update(1)
                bar.set_postfix(loss=f"{row['loss']:.3e}", queried=f"{row['selected']}/{row['budget']}", utility=f"{row['utility_mean']:.2e}")
                last = step + 1 == self.steps
                if last or (self.cfg.save_every and (step + 1) % self.cfg.save_every == 0):
                    self.save(step + 1)
        except KeyboardInterrupt:
            bar.close()
            raise KeyboardInterrupt(self.interrupted_note(step)) from None
        bar.close()
        return self.finish()

    def interrupted_note(self, step: int) -> str:
        """What a user stopped by Ctrl-C at `step` has on disk and how to go on."""
        latest = self.out / "latest"
        if latest.is_file():
            return (f"at step {step}; {self.out} keeps {latest.read_text().strip()}: continue with --resume {self.out} "
                    "(the ledger's later rows are retrained)")
        return f"at step {step}, before the first checkpoint (--save-every); start over with --overwrite"

    def summary(self) -> dict:
        """summary.json's content: Tables 7/8 from the ledger, the world size and every launch."""
        summary = summarize(self.ledger.rows)
        summary["world_size"] = self.acc.num_processes
        summary["launches"] = [r["launch"] for r in self.ledger.rows if "launch" in r]
        return summary

    def summary_is_current(self) -> bool:
        """Whether summary.json and summary.md exist and summary.json matches the ledger (every rank: the answer
        is rank 0's)."""
        current = 1
        if self.acc.is_main_process:
            path = self.out / "summary.json"
            try:
                stored = json.loads(path.read_text())
            except (OSError, ValueError):
                stored = None
            fresh = json.loads(json.dumps(self.summary()))  # as stored: tuples become lists
            stored_ws = stored.get("world_size") if isinstance(stored, dict) else None
            current = int(stored is not None and {**fresh, "world_size": stored_ws} == stored
                          and (self.out / "summary.md").is_file())
        return self._agree(current)

    def _agree(self, value: int) -> bool:
        """Rank 0's value on every rank."""
        flag = torch.tensor([value if self.acc.is_main_process else 0], device=self.acc.device)
        return bool(self.acc.reduce(flag, "sum").item())

    def finish(self) -> dict:
        summary = {}
        if self.acc.is_main_process:
            summary = self.summary()
            name = self.run_name
            table = format_summary(summary, name)
            write_atomic(self.out / "summary.json", json.dumps(summary, indent=2) + "\n")
            write_atomic(self.out / "summary.md", table + "\n")
            print("\n" + table, flush=True)
            latest = self.out / "latest"
            ckpt = f" and {latest.read_text().strip()}/ (evaluate it with: eval.py --model {self.out})" if latest.is_file() else ""
            print(f"\ntrain.py: wrote {self.out}/ledger.jsonl, summary.md, summary.json{ckpt}", flush=True)
        self.acc.wait_for_everyone()
        return summary


def checkpoint_of(path: str) -> Path:
    """The checkpoint a --resume path names, or a UserError saying what is missing."""
    try:
        return find_checkpoint(path)
    except FileNotFoundError as exc:
        hint = ""
        if run_files(Path(path)):  # a run stopped before its first checkpoint
            hint = f"; the run stopped before its first checkpoint: start over with --out {path} --overwrite"
        raise UserError(f"--resume {path}: {exc}{hint}") from None


def _same(field: str, a, b) -> bool:
    if field in ("model", "data") and a is not None and b is not None and Path(a).exists() and Path(b).exists():
        return Path(a).resolve() == Path(b).resolve()
    return a == b


def refuse_changed_settings(cfg: TrainConfig, stored: dict, ckpt: Path, given: set[str] | None = None) -> None:
    """A resumed run keeps the settings it was trained with: any other field that differs is refused by name.

    `given` limits the check to the flags given on the command line (the others come from `stored`)."""
    may = resumable(stored)
    fields = [f.name for f in dataclasses.fields(TrainConfig) if f.name not in may and f.name != "overwrite"]
    changed = [f for f in fields if (given is None or f in given) and f in stored and not _same(f, getattr(cfg, f), stored[f])]
    if changed:
        flags = ", ".join(f"--{f.replace('_', '-')} {getattr(cfg, f)!r} (the run has {stored[f]!r})" for f in changed)
        allowed = ", ".join("--" + f.replace("_", "-") for f in may if f not in ("resume", "out"))
        why = (" (--micro-batch and --micro-batch-tokens are the objective's own under --loss-agg micro-batch)"
               if may != RESUMABLE and set(changed) & set(OBJECTIVE_BATCHING) else "")  # fmt: skip
        raise UserError(
            f"--resume {ckpt}: {flags}: a resumed run keeps its own settings; it may change only {allowed}{why}. "
            "Start a new run in another --out to change the others"
        )


def resumed_config(given: dict) -> TrainConfig:
    """--resume: the run's stored settings are the defaults; the flags given may change only RESUMABLE ones."""
    ckpt = checkpoint_of(given["resume"])
    stored = load_config(ckpt)
    cfg = TrainConfig(**{f.name: stored[f.name] for f in dataclasses.fields(TrainConfig) if f.name in stored})
    cfg = dataclasses.replace(cfg, **given, overwrite=False)
    refuse_changed_settings(cfg, stored, ckpt, set(given))
    run_dir = ckpt.parent
    if "out" in given and Path(given["out"]).resolve() != run_dir.resolve():
        raise UserError(f"--out {given['out']}: a resumed run writes into its own folder {run_dir}")
    return dataclasses.replace(cfg, resume=str(ckpt), out=str(run_dir))


def main(argv: list[str] | None = None) -> dict:
    given = given_flags(TrainConfig, PRESETS, argv, description=__doc__.split("\n")[0])
    if given.get("resume") and given.get("overwrite"):
        raise UserError("--resume continues a run and --overwrite deletes it: choose one")
    if given.get("resume"):
        cfg = resumed_config(given)
    else:
        preset = given.pop("preset", TrainConfig.preset)
        method = given.get("method", TrainConfig.method)
        # the method's paper settings and published recipe (an unknown method is refused by name later)
        settings = {**METHODS[method].settings, **METHODS[method].recipe} if method in METHODS else {}
        cfg = TrainConfig(preset=preset, **{**PRESETS[preset], **settings, **given})
        span = cfg.schedule_steps or cfg.steps
        if "warmup_steps" in given and span and cfg.warmup_steps > span:  # a recipe's own warm-up may outlast a short run
            raise UserError(f"--warmup-steps {cfg.warmup_steps}: beyond the schedule's {span} steps (--steps, --schedule-steps)")
    hf_logging.disable_progress_bar()  # weight loading/saving bars would break the training bar
    return Run(cfg).train()


if __name__ == "__main__":
    run_cli(main, sys.argv[1:], "train.py")
