"""One training run on accelerate (DDP, or FSDP2 with --fsdp): the composition root, above every part it builds.

The steps are `opd.loop.step.Stepper` (Algorithm 1, lines 3-14, on every rank in lockstep). `Run` is their lifecycle:
it builds and checks everything before anything is replaced (`_build`: the settings checked, the folder locked, the
records, models, teachers, prompts, selector, objective, schedule and sampler), resumes a checkpoint, starts the
trackers, runs the steps with live evaluation and checkpoints (`train`), and writes the summary (Tables 7/8). The rest
of the run lives elsewhere: its settings in `opd.config`, its folder (lock, resume, overwrite, identities) in
`opd.loop.folder`, its models and teachers in `opd.loop.build`, its prompts in `opd.data.records`, its rollouts in
`opd.engine.rollout` (vLLM: `opd.engine.vllm_sampler`), the objectives behind `opd.methods.objective`.
"""

from __future__ import annotations

import json
import time
from contextlib import nullcontext
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import Accelerator, PartialState
from tqdm.auto import tqdm

from opd.loop.build import ModelBuilder, Resume, default_sources
from opd.loop.checkpoint import prune, save_checkpoint, save_sharded
from opd.cli import UserError
from opd.config import TrainConfig, refuse_changed_settings
from opd.data.settings import parse_columns
from opd.data.sources import load_records
from opd.eval.live import LiveEval, evaluations, format_score, format_scores, score_label
from opd.loop.ledger import Ledger, format_summary, summarize, write_atomic
from opd.loop.row import ledger_row
from opd.models.loading import autocast, special_ids
from opd.methods.micro_batch import fused, fused_distill
from opd.methods.lockstep import lockstep
from opd.methods.interface import ObjectiveContext
from opd.methods.objectives import objective_class
from opd.loop.optim import lr_scheduler, restore_group_lr
from opd.data.checks import check_prompts, check_records
from opd.data.records import Prompts, get_view
from opd.engine.rollout import Rollouts
from opd.loop.folder import RunFolder, eval_command, launch_info
from opd.run_folder import checkpoint_of, find_latest, load_config
from opd.engine.rollout import Sampler
from opd.engine.vllm_sampler import VLLMSampler
from opd.selection.designs import selector_from_config
from opd.selection.state import load_selector_state, selector_state
from opd.models.sharding import generation, is_sharded
from opd.loop.step import Stepper
from opd.storage import DiskFullError, drop_temporaries
from opd.loop.settings import parse_report_to
from opd.loop.tracking import Trackers


def end_processes() -> None:
    """After a finished run, on every rank: a barrier, then the process group destroyed (under torchrun or accelerate
    launch), so that no rank exits while another still communicates and no gloo/NCCL thread is left running at the
    interpreter's exit (which aborted a rank with "terminate called without an active exception")."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        PartialState().destroy_process_group()


class Run:
    """One training run: Algorithm 1 on every rank (`step`), its checkpoints, ledger and summary (`train`)."""

    def __init__(self, cfg: TrainConfig, accelerator: Accelerator | None = None):
        cpu = not torch.cuda.is_available()  # without CUDA: gloo DDP under torchrun / accelerate launch
        cfg.check(PartialState(cpu=cpu).num_processes)
        self.acc = accelerator or Accelerator(cpu=cpu)
        self.cfg = cfg
        self.folder = RunFolder(self.acc, cfg.folder)  # one run per folder: a second process is refused first
        self.out = self.folder.out
        try:
            self._build()
        except BaseException:
            self.folder.release(failed=True)  # a failed start leaves no folder behind
            raise

    def _build(self) -> None:
        """Everything the run needs, built and checked (model, processor, teachers, routes, optimizer, every prompt's
        length) before --overwrite replaces anything: a failed start leaves the old run intact."""
        cfg, acc = self.cfg, self.acc
        self.method = cfg.method
        self.autocast = autocast(acc.device, cfg.model.mixed_precision)
        self.teacher_views = ((cfg.teacher.teacher_view or self.method.teacher_view),) + self.method.teacher_views[1:]
        self.launch = launch_info(acc.num_processes)
        self.initial_model, data_path = default_sources(cfg.model.model, cfg.data.data, acc,  # DAPD's base, OPOD's ref
                                                        vllm=cfg.engine.vllm)
        self.records = load_records(data_path, cfg.data.data_split, parse_columns(cfg.data.data_columns))
        views = (self.method.student_view, *self.teacher_views)
        check_records(self.records, views, data_path, cfg.data.prompts_per_step, cfg.run.method)
        found = self.folder.existing_run()
        self.steps = cfg.run.steps or len(self.records) // cfg.data.prompts_per_step
        resume = self._resume()
        self.folder.identify_data(data_path)
        objective = objective_class(self.method.objective)  # the class that runs the method's objective
        models = ModelBuilder(cfg, acc, self.folder, self.initial_model, resume).build(objective)
        self.student, self.optimizer, self.processor = models.student, models.optimizer, models.processor
        self.models, self.teachers, self.teacher = models, models.teachers, models.teacher  # the first: with routes
        self.ids = special_ids(self.model)
        self.selector = selector_from_config(cfg.selection, cfg.selector)
        self.prompts = Prompts(self.records, self.processor, self.method, self.teacher_views, self.teachers, cfg.data,
                               cfg.run.seed, acc.process_index, acc.num_processes)  # fmt: skip
        vocab = self.model.get_output_embeddings().weight.shape[0]  # the plain path's logits: micro-batch x T x vocab
        loss, note = cfg.loss.for_method(self.method).for_vocabulary(vocab, cfg.sampling.max_response_len)
        if note:
            acc.print(note)
        self.context = ObjectiveContext(
            accelerator=acc, student=self.student, model=partial(acc.unwrap_model, self.student),
            teachers=self.teachers,
            encode=self.prompts.encode, processor=self.processor, ids=self.ids, autocast=self.autocast,
            student_view=self.method.student_view, teacher_views=self.teacher_views,
            loss=loss, max_response_len=cfg.sampling.max_response_len, ema=cfg.ema, sharded=is_sharded(self.student),
            distill_pass=fused_distill if fused(loss, self.teacher_views) else None,  # the extension, else the plain
            schedule=lockstep if is_sharded(self.student) or acc.num_processes > 1 else None,  # None: one process's
        )  # fmt: skip
        self.objective = objective(self.context, cfg.objective(), models.initial_teacher)
        state = resume.state if resume is not None else {}
        # the schedule's span is fixed when the run starts (--schedule-steps, else its --steps); a resume keeps it
        self.schedule_span = state.get("schedule_span") or cfg.optim.schedule_steps or self.steps
        self.scheduler = lr_scheduler(self.optimizer, cfg.optim.lr_schedule, cfg.optim.warmup_steps, self.schedule_span)
        check_prompts(self.prompts)
        self.live = LiveEval(cfg.eval, self.steps) if cfg.eval.every else None  # the held items, loaded once
        policy = partial(acc.unwrap_model, self.student)
        if cfg.engine.vllm:  # the vLLM engine's sampler (an extension), else the policy's own HF generate
            self.sampler = VLLMSampler(cfg.sampling, cfg.engine, acc, policy, self.autocast, cfg.model.fsdp_generation,
                                       cfg.run.seed, get_view(self.method.student_view), self.out,
                                       models.lora_scaling)  # fmt: skip
            length = cfg.data.max_prompt_len + cfg.sampling.max_response_len + 16
            self.sampler.start(self.initial_model, length, cfg.model.fsdp)
        else:
            gather = partial(generation, self.model, cfg.model.fsdp_generation) if cfg.model.fsdp else nullcontext
            self.sampler = Sampler(cfg.sampling, acc, policy, self.autocast, cfg.run.seed, gather)
        self.stepper = Stepper(acc, cfg.selection.rho, cfg.optim.grad_clip, self.records, self.prompts, self.sampler,
                               self.selector, self.objective, self.student, self.optimizer, self.scheduler,
                               self.teachers)  # fmt: skip
        if resume is not None:
            self._load_state(resume.state)
        self._start_trackers(found)

    def _resume(self) -> Resume | None:
        """--resume: the checkpoint, its settings checked; None for a new run."""
        self.start = 0
        if not self.cfg.folder.resume:
            return None
        ckpt = checkpoint_of(self.cfg.folder.resume)
        refuse_changed_settings(self.cfg, load_config(ckpt), ckpt)
        resume = Resume.load(ckpt, self.folder)
        self.start = resume.start
        if self.steps < self.start:
            raise UserError(f"--steps {self.steps}: the checkpoint {ckpt} is already at step {self.start}")
        self.folder.note_resume(ckpt, resume.state)
        return resume

    def _load_state(self, state: dict) -> None:
        """A resumed run's optimizer (unsharded: sharded ones came with the shards), schedule, selector, objective."""
        if not self.cfg.model.fsdp:
            self.optimizer.load_state_dict(state["optimizer"])
        if "scheduler" in state:
            self.scheduler.load_state_dict(state["scheduler"])
            restore_group_lr(self.optimizer, self.scheduler)  # the sharded path loaded the optimizer first
        load_selector_state(self.selector, state["selector"])
        self.objective.load_state_dict(state.get("objective", {}))
        self.stepper.warned_no_eligible = state.get("warned_no_eligible", False)

    def _start_trackers(self, found: list) -> None:
        """--overwrite sets the old run aside (only now, with every input built); the trackers start (one that
        cannot start, a wandb login or an mlflow server, puts the old run back); the ledger opens."""
        cfg, main = self.cfg, self.acc.is_main_process
        aside = self.folder.set_aside(found)
        if main:
            self.folder.digests.save()
        try:
            self.trackers = Trackers(self.acc, parse_report_to(cfg.trackers.report_to), self.out, cfg.trackers.project,
                                     cfg.trackers.run_label or f"{self.out.name} {self.run_name}", cfg.flags(),
                                     resume=bool(cfg.folder.resume), settings=cfg.trackers)  # fmt: skip
        except BaseException:
            self.folder.restore(aside)
            raise
        self.folder.drop(aside)
        latest = find_latest(self.out)
        if main and cfg.folder.resume and latest is not None and latest.resolve() == Path(cfg.folder.resume).resolve():
            prune(self.out, cfg.checkpoint.keep_checkpoints)  # a kill after `latest` moved left the previous one
        self.ledger = Ledger(self.out / "ledger.jsonl", self.start if cfg.folder.resume else None) if main else None

    @property
    def run_name(self) -> str:
        """The table label: policy-percent, e.g. learned-25, prefixed by the method's label (none for bas-opd)."""
        prefix = self.method.name if self.method.label is None else self.method.label
        return f"{prefix} {self.cfg.selection.label}".strip()

    @property
    def model(self):
        """The policy unwrapped (DDP's module; a sharded or plain one as it is)."""
        return self.acc.unwrap_model(self.student)

    def step(self, step: int, rollouts: Rollouts | None = None) -> dict:
        """One iteration of Algorithm 1 on every rank (`opd.loop.step.Stepper.step`); `rollouts` may stand in for
        sampling (tests). Returns its ledger row (`opd.loop.row.ledger_row`)."""
        return ledger_row(self.acc, self.stepper.step(step, rollouts))

    def save(self, next_step: int) -> None:
        """A checkpoint of the run after `next_step` steps (atomic; sharded: every rank writes its shards)."""
        cfg = self.cfg
        state = {
            "selector": selector_state(self.selector), "config": cfg.flags(), "warned_no_eligible": self.stepper.warned_no_eligible,
            "objective": self.objective.state_dict(), "identities": self.folder.identities,
            "world_size": self.acc.num_processes, "scheduler": self.scheduler.state_dict(),
            "schedule_span": self.schedule_span,
        }  # fmt: skip
        teacher, adapters = self.models.saved_teacher, self.models.adapters  # LoRA: the adapters, not the base
        keep = cfg.checkpoint.keep_checkpoints
        if cfg.model.fsdp:  # every rank writes its shards; the last checkpoint is also exported for eval.py
            save_sharded(self.out, next_step, self.student, teacher, self.optimizer, state, keep,
                         self.processor if next_step == self.steps else None, adapters)  # fmt: skip
        elif self.acc.is_main_process:
            state["optimizer"] = self.optimizer.state_dict()
            save_checkpoint(self.out, next_step, self.model, self.processor, teacher, state, keep, adapters)
        self.acc.wait_for_everyone()

    def log(self, row: dict) -> None:
        """The row into the ledger and the trackers (rank 0)."""
        if not self.acc.is_main_process:
            return
        if row["step"] == self.start:  # the first row of this launch says what ran
            row = {**row, "launch": self.launch}
        self.ledger.append(row)
        self.trackers.log(row, self.objective.name, self.stepper.objective_keys)

    def evaluate(self, step: int) -> dict:
        """Live evaluation after step `step` when due (every rank answers its share): eval.py's protocol, the weights
        in --dtype, no --mixed-precision autocast; printed (rank 0)."""
        if self.live is None or not self.live.due(step):
            return {}
        return self._live_scores(f"after step {step + 1}")

    def evaluate_before(self) -> dict:
        """--eval-before: the live evaluation of the weights a new run starts from (before step 0), printed; {} for a
        resumed run or without the flag. The first ledger row keeps it (`eval_before`)."""
        if self.live is None or not self.cfg.eval.before or self.start > 0:
            return {}
        return self._live_scores("before training")

    def _live_scores(self, when: str) -> dict:
        t0 = time.perf_counter()
        scores = self.live(self.acc, self.model, self.processor, self.cfg.data.enable_thinking,
                           lambda: generation(self.model, self.cfg.model.fsdp_generation))  # fmt: skip
        scores["eval_s"] = time.perf_counter() - t0
        if self.acc.is_main_process:
            tqdm.write(f"train.py: eval {when} ({scores['eval_s']:.0f} s): {format_scores(scores)}")
        return scores

    def train(self) -> dict:
        """Runs steps start..steps-1, checkpoints, and returns the Table 7/8 summary. A full disk at the first
        checkpoint leaves the folder as before the run (nothing to resume: the same command starts over)."""
        restart = False
        try:
            return self._train()
        except DiskFullError:
            restart = find_latest(self.out) is None
            raise
        finally:
            self.trackers.finish()
            self.sampler.stop()
            if restart:
                self.folder.clear()
            self.folder.release()

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
            for place in self.trackers.where():
                print(f"train.py: {place}", flush=True)
        # loss: Eq. 11 this step; queried: teacher calls |S| / budget K (Eq. 4); utility: mean u_i over S (Eq. 9)
        before = self.evaluate_before()
        bar = tqdm(total=self.steps, initial=self.start, desc=self.run_name, disable=not main)
        step = self.start
        try:
            for step in range(self.start, self.steps):
                row = self.step(step)
                if before and step == 0:
                    row["eval_before"] = before
                row |= self.evaluate(step)
                self.log(row)
                bar.update(1)
                bar.set_postfix(loss=f"{row['loss']:.3e}", queried=f"{row['selected']}/{row['budget']}",
                                utility=f"{row['utility_mean']:.2e}")  # fmt: skip
                if self.cfg.checkpoint.due(step, self.steps):
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
        every = self.cfg.checkpoint.save_every
        when = f"every {every} steps" if every else "only at its end: --save-every 0"
        return (f"at step {step}, before its first checkpoint (it checkpoints {when}): nothing can be resumed; "
                "the same command with --overwrite starts over (--save-every N makes a run resumable sooner)")

    def summary(self) -> dict:
        """summary.json's content: Tables 7/8 from the ledger, the world size and every launch."""
        summary = summarize(self.ledger.rows)
        summary["world_size"] = self.acc.num_processes
        summary["launches"] = [r["launch"] for r in self.ledger.rows if "launch" in r]
        if found := evaluations(self.ledger.rows):  # --eval-every's scores (--eval-before's first)
            summary["evaluations"] = {"data": self.cfg.eval.data, "rows": found}
        return summary

    def summary_is_current(self) -> bool:
        """Whether summary.json and summary.md exist and summary.json matches the ledger (every rank: the answer
        is rank 0's)."""
        current = 1
        if self.acc.is_main_process:
            try:
                stored = json.loads((self.out / "summary.json").read_text())
            except (OSError, ValueError):
                stored = None
            fresh = json.loads(json.dumps(self.summary()))  # as stored: tuples become lists
            stored_ws = stored.get("world_size") if isinstance(stored, dict) else None
            current = int(stored is not None and {**fresh, "world_size": stored_ws} == stored
                          and (self.out / "summary.md").is_file())  # fmt: skip
        flag = torch.tensor([current if self.acc.is_main_process else 0], device=self.acc.device)
        return bool(self.acc.reduce(flag, "sum").item())  # rank 0's answer on every rank

    def finish(self) -> dict:
        """summary.json and summary.md from the ledger (rank 0), printed; returns the summary."""
        summary = {}
        if self.acc.is_main_process:
            summary = self.summary()
            table = format_summary(summary, self.run_name, (score_label, format_score))
            for name in ("summary.json", "summary.md"):  # a kill mid-write of an earlier launch (the folder is ours)
                drop_temporaries(self.out / name)
            write_atomic(self.out / "summary.json", json.dumps(summary, indent=2) + "\n")
            write_atomic(self.out / "summary.md", table + "\n")
            print("\n" + table, flush=True)
            latest = self.out / "latest"
            hint = eval_command(self.out, self.cfg.eval.data, self.cfg.data.data)
            ckpt = f" and {latest.read_text().strip()}/ (evaluate it with: {hint})" if latest.is_file() else ""
            print(f"\ntrain.py: wrote {self.out}/ledger.jsonl, summary.md, summary.json{ckpt}", flush=True)
        self.acc.wait_for_everyone()
        return summary
