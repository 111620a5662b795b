"""Worker for the DDP test: two training steps on fixed rollouts, with 1 or 2 processes.

Run directly (one process) or under `torchrun --nproc_per_node 2` (gloo on the CPU). Every rank builds
its shard of one global batch of fixed responses, so the 1- and 2-process runs train on the same
global batch. With --skew, only rows of rank 0 have high entropy: the entropy policy then selects
nothing on rank 1, which must still complete the step.
Writes OUT/result.pt: the policy's parameters, the selections, and the ledger rows. --method applies the
method's paper settings but its policy and rho; --teacher-model gives an external teacher (OPOD's).
--dtype float64 (the equality test's) also runs the model's float32 casts in float64 (tests/float64.py).
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from opd.config import TrainConfig
from opd.run import Run, end_processes
from opd.methods.table import METHODS  # noqa: E402
from opd.engine.synthetic import fixed_rollouts  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--policy", default="random")
    p.add_argument("--rho", type=float, default=0.25)
    p.add_argument("--skew", action="store_true")
    p.add_argument("--method", default="bas-opd")
    p.add_argument("--teacher-model", default=None)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--unbiased", action="store_true")
    a = p.parse_args()
    if a.dtype == "float64":
        from float64 import float64_model

        float64_model()
    settings = {k: v for k, v in METHODS[a.method].settings.items() if k not in ("policy", "rho")}
    cfg = TrainConfig(
        **settings, out=a.out, method=a.method, policy=a.policy, rho=a.rho, prompts_per_step=4, rollouts_per_prompt=4,
        steps=2, lr=1e-3, micro_batch=3, replay_start=4, replay_batch=16, max_prompt_len=512, max_response_len=10,
        teacher_model=a.teacher_model, dtype=a.dtype, unbiased=a.unbiased,
    )  # fmt: skip
    run = Run(cfg)
    if a.method == "dapd":  # the policy moved off its anchors (as after training), so that every pair's KL and gradient
        from fsdp_worker import perturb  # is far above float rounding at step 0 (equal on every rank: one seed)

        perturb(run.model)
    selected, select = [], run.selector.select
    run.selector.select = lambda *args, **kw: selected.append(select(*args, **kw)) or selected[-1]
    rows, teacher_rows = [], []
    teachers = list(dict.fromkeys(run.teachers.teachers.values()))  # every teacher (DAPD: both anchors)
    for step in range(2):
        before = sum(t.rows_scored for t in teachers)
        high = run.cfg.data.prompts_per_step * run.cfg.sampling.rollouts_per_prompt // 2 if a.skew else None  # rank 0's rows
        rows.append(run.step(step, fixed_rollouts(run, step, high_entropy_below=high)))
        teacher_rows.append(sum(t.rows_scored for t in teachers) - before)
    counts = run.acc.gather(torch.tensor(teacher_rows)).view(run.acc.num_processes, -1)
    if run.acc.is_main_process:
        params = {k: v.detach().clone() for k, v in run.model.state_dict().items()}
        teacher = {k: v.detach().clone() for k, v in run.teacher.model.state_dict().items()}
        torch.save({"params": params, "teacher": teacher, "rows": rows, "teacher_rows": counts,
                    "selected": [s for s, _ in selected], "pi": [p for _, p in selected]}, Path(a.out) / "result.pt")  # fmt: skip
    run.acc.wait_for_everyone()
    end_processes()  # no gloo thread left at the interpreter's exit (a rank aborted: "terminate called ...")


if __name__ == "__main__":
    main()
