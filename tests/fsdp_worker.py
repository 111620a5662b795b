"""Worker for the FSDP2 tests (tests/test_fsdp.py): one process without --fsdp (the unsharded reference)
or `torchrun --nproc_per_node 2 ... --fsdp` (gloo on the CPU).

--scenario steps: for each of --methods, two training steps on fixed rollouts (`opd.engine.synthetic`, the same
global batch whatever the number of ranks, as tests/ddp_worker.py); with --skew only rank 0's rows have
high entropy, so the entropy policy selects nothing on rank 1. Writes OUT/<method>.pt: the full policy
and teacher weights, the ledger rows, the selections and the teacher rows per rank and step (and per teacher
with --teacher-model / --teachers: external teachers, sharded like the policy; --data: another training JSONL).
--dtype float64 (the equality tests'): both runs in float64, the model's float32 casts too (tests/float64.py).

--scenario resume (with --fsdp): a 3-step run (checkpoint every 2 steps) and the same run stopped after
2 steps and resumed, both with real generation; then the final checkpoint's export (policy/, teacher/)
is loaded with from_pretrained on rank 0 and its logits compared with the in-memory sharded policy.
Writes OUT/resume.pt.

--scenario generate (with --fsdp): each rank samples its prompts' rollouts with the sharded policy in
both `opd.models.sharding.GENERATION` modes and with an unsharded copy of the same weights, from the same seed.
Writes OUT/generate.pt: per rank, whether the samples are identical and the largest log-prob difference.

--scenario live: train.py --preset tiny for 2 steps with --eval-before and --eval-every 2 on --eval-data (pope and
zoombench in both views; pope's 5 items give the ranks shares of 3 and 2, so one rank pads), with --fsdp and
--generation or without (DDP under torchrun). Writes OUT/live.pt: every evaluation's replies (index -> reply by
(benchmark, view), gathered from every rank) and the ledger rows.
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from opd.models.chat import collate  # noqa: E402
from opd.config import TrainConfig
from opd.run import Run, end_processes
from opd.methods.table import METHODS  # noqa: E402
from opd.models.loading import load_model  # noqa: E402
from opd.engine.rollout import generate_rollouts  # noqa: E402
from opd.models.sharding import GENERATION, full_state_dict, generation  # noqa: E402
from opd.engine.synthetic import fixed_rollouts  # noqa: E402

BASE = dict(
    prompts_per_step=4, rollouts_per_prompt=4, steps=2, lr=1e-3, micro_batch=3, replay_start=4, replay_batch=16,
    max_prompt_len=512, max_response_len=10,
)  # fmt: skip


def steps(a) -> None:
    for method in a.methods.split(","):
        settings = {k: v for k, v in METHODS[method].settings.items() if k not in ("policy", "rho")}
        cfg = TrainConfig(**{**BASE, **settings}, method=method, out=f"{a.out}/{method}", policy=a.policy,
                          rho=a.rho, fsdp=a.fsdp, micro_batch_tokens=a.micro_batch_tokens,
                          grad_checkpointing=a.grad_checkpointing, teacher_model=a.teacher_model, teachers=a.teachers,
                          data=a.data, opod_kl=a.opod_kl, dtype=a.dtype)  # fmt: skip
        run = Run(cfg)
        if method == "dapd":  # the policy moved off its anchors, so every pair's gradient is far above rounding at step 0
            perturb(run.model)
        selected, select = [], run.selector.select
        run.selector.select = lambda *args, **kw: selected.append(select(*args, **kw)) or selected[-1]
        rows, teacher_rows = [], []
        teachers = list(dict.fromkeys(run.teachers.teachers.values()))  # every teacher (DAPD: both anchors)
        for step in range(2):
            before = sum(t.rows_scored for t in teachers)
            high = cfg.data.prompts_per_step * cfg.sampling.rollouts_per_prompt // 2 if a.skew else None  # rank 0's rows
            rows.append(run.step(step, fixed_rollouts(run, step, high_entropy_below=high)))
            teacher_rows.append(sum(t.rows_scored for t in teachers) - before)
        counts = run.acc.gather(torch.tensor(teacher_rows)).view(run.acc.num_processes, -1)
        policy, teacher = full_state_dict(run.model), full_state_dict(run.teacher.model)
        per_teacher = {n: t.rows_scored for n, t in run.teachers.teachers.items()}
        per_teacher = run.acc.gather(torch.tensor([list(per_teacher.values())])).view(run.acc.num_processes, -1)
        if run.acc.is_main_process:
            result = {"params": policy, "teacher": teacher, "rows": rows, "teacher_rows": counts, "selected": [s for s, _ in selected],
                      "per_teacher": per_teacher, "teacher_names": run.teachers.names}
            torch.save(result, Path(a.out) / f"{method}.pt")
        run.acc.wait_for_everyone()


@torch.no_grad()
def perturb(model, scale: float = 0.05, seed: int = 7) -> None:
    """Adds the same seeded noise to every parameter on every rank (a sharded one: its shard of the noise)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        noise = torch.randn(p.shape, generator=gen) * scale
        if isinstance(p, DTensor):
            noise = distribute_tensor(noise, p.device_mesh, p.placements)
        p.add_(noise)


def resume(a) -> None:
    kw = {**BASE, "policy": "learned", "rho": 0.5, "replay_start": 8, "replay_batch": 8, "max_response_len": 6, "save_every": 2,
          "fsdp": True}
    kw.pop("steps")
    whole = Run(TrainConfig(**kw, steps=3, out=f"{a.out}/whole"))
    whole.train()
    Run(TrainConfig(**kw, steps=2, out=f"{a.out}/split")).train()
    resumed = Run(TrainConfig(**kw, steps=3, out=f"{a.out}/split", resume=f"{a.out}/split"))
    start = resumed.start
    resumed.train()
    result = {"start": start}
    for name, run in (("whole", whole), ("resumed", resumed)):
        result[name] = {"params": full_state_dict(run.model), "teacher": full_state_dict(run.teacher.model)}
    # The export against the in-memory model: the same inputs through both, on rank 0's copy of the export.
    records = resumed.prompts.of_step(0)
    batch = collate(resumed.prompts.student(records), resumed.ids["pad"])
    with torch.no_grad():
        in_memory = resumed.model(**batch, use_cache=False).logits
    ckpt = Path(a.out) / "split" / (Path(a.out) / "split" / "latest").read_text().strip()
    if resumed.acc.is_main_process:
        exported = load_model(str(ckpt / "policy"))
        with torch.no_grad():
            result["export_logits"] = exported(**batch, use_cache=False).logits
        result["in_memory_logits"] = in_memory
        result["export_teacher"] = {k: v.clone() for k, v in load_model(str(ckpt / "teacher")).state_dict().items()}
        result["checkpoint"] = sorted(p.name for p in ckpt.iterdir())
        torch.save(result, Path(a.out) / "resume.pt")
    resumed.acc.wait_for_everyone()


def generate(a) -> None:
    from opd.tiny import tiny_defaults

    run = Run(TrainConfig(**{**BASE, "max_response_len": 12}, out=f"{a.out}/generate", fsdp=True))
    prompts = run.prompts.student(run.prompts.of_step(0))
    seed = 1000 + run.acc.process_index
    outs = {}
    for mode in GENERATION:
        torch.manual_seed(seed)
        with generation(run.model, mode):
            outs[mode] = generate_rollouts(run.model, prompts, 3, 12)
    plain = load_model(str(tiny_defaults()[0]))  # the same weights, unsharded, on this rank alone
    torch.manual_seed(seed)
    reference = generate_rollouts(plain, prompts, 3, 12)
    same = [torch.equal(outs[m].response_ids, reference.response_ids) for m in GENERATION]
    logp = [float((outs[m].logp - reference.logp).abs().max()) for m in GENERATION]
    resharded = all(not isinstance(p, torch.Tensor) or type(p).__name__ == "DTensor" for p in run.model.parameters())
    report = torch.tensor([[*same, *logp, resharded]], dtype=torch.float64)
    gathered = run.acc.gather(report)
    if run.acc.is_main_process:
        torch.save({"modes": GENERATION, "per_rank": gathered}, Path(a.out) / "generate.pt")
    run.acc.wait_for_everyone()


def live(a) -> None:
    import os

    import train
    from opd.eval.live import LiveEval
    from opd.loop.ledger import read_ledger

    found, call = [], LiveEval.__call__

    def recording(self, *args, **kwargs):
        scores = call(self, *args, **kwargs)
        found.append(dict(self.replies))  # every rank's replies (gathered), on every rank
        return scores

    LiveEval.__call__ = recording
    flags = ["--preset", "tiny", "--steps", "2", "--dtype", a.dtype, "--eval-before", "--eval-every", "2",
             "--eval-data", a.eval_data, "--eval-benchmarks", "pope,zoombench", "--eval-views", "full,crop",
             "--eval-limit", "5", "--eval-max-new-tokens", "6", "--out", f"{a.out}/run"]  # fmt: skip
    train.main(flags + (["--fsdp", "--fsdp-generation", a.generation] if a.fsdp else []))  # ends the process group
    if os.environ.get("RANK", "0") == "0":
        rows = read_ledger(Path(a.out) / "run" / "ledger.jsonl")
        torch.save({"replies": found, "rows": rows}, Path(a.out) / "live.pt")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--scenario", default="steps", choices=("steps", "resume", "generate", "live"))
    p.add_argument("--methods", default="bas-opd")
    p.add_argument("--policy", default="random")
    p.add_argument("--rho", type=float, default=0.25)
    p.add_argument("--skew", action="store_true")
    p.add_argument("--fsdp", action="store_true")
    p.add_argument("--micro-batch-tokens", type=int, default=0)
    p.add_argument("--grad-checkpointing", action="store_true")
    p.add_argument("--teacher-model", default=None)
    p.add_argument("--teachers", default=None)
    p.add_argument("--data", default=None)
    p.add_argument("--opod-kl", type=float, default=0.0)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--eval-data", default=None)
    p.add_argument("--generation", default="gathered")
    a = p.parse_args()
    torch.set_num_threads(1)
    if a.dtype == "float64":  # the model's float32 casts in float64 too
        from float64 import float64_model

        float64_model()
    {"steps": steps, "resume": resume, "generate": generate, "live": live}[a.scenario](a)
    end_processes()  # no gloo thread left at the interpreter's exit (a rank aborted: "terminate called ...")


if __name__ == "__main__":
    main()
