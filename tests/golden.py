"""Recorded ledgers: the behaviour a restructuring must keep, run through train.py's command line.

Each case is a train.py command line on the built-in tiny model and data (`--preset tiny`), 3 steps, in float64
(tests/float64.py: the model's float32 casts run in float64 too), so that a run's ledger is the same computation on
any x86-64 CPU up to float64 rounding. `record()` writes tests/golden/ledgers.json; tests/test_golden.py runs every
case again and compares each ledger field that does not measure time.

    python tests/golden.py            # record every case (on a change that is meant to change a result)
    python tests/golden.py NAME ...   # record only these cases (the others keep their recorded ledgers)
    python tests/golden.py --worker ARGS   # (internal) one train.py run in float64, under torchrun for 2 ranks

A case's ledger changes only when its result is meant to: the commit that re-records it says why.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
GOLDEN = Path(__file__).resolve().parent / "golden" / "ledgers.json"
BASE = ["--preset", "tiny", "--steps", "3", "--dtype", "float64", "--report-to", "none", "--save-every", "0"]
TEACHER = "{teacher}"  # a second tiny model (seed 1), the external teacher of GKD and OPOD

CASES: dict[str, list[str]] = {
    "bas-opd learned-25": [],
    "random-25": ["--policy", "random"],
    "entropy-25": ["--policy", "entropy"],
    "full": ["--policy", "full", "--rho", "1"],
    "vision-opd": ["--method", "vision-opd"],
    "rp-opsd": ["--method", "rp-opsd"],
    "opd-v": ["--method", "opd-v"],
    "opsd (LoRA recipe)": ["--method", "opsd"],
    "dapd": ["--method", "dapd"],
    "gkd": ["--method", "gkd", "--teacher-model", TEACHER],
    "opod": ["--method", "opod", "--teacher-model", TEACHER],
    "tm-opd (budgeted)": ["--method", "tm-opd", "--teacher-model", TEACHER, "--policy", "learned", "--rho", "0.25"],
    "lora": ["--lora-r", "4", "--lr", "1e-3"],
    "cap": ["--max-per-prompt", "1"],
    "unbiased": ["--unbiased"],
    "sampling knobs": ["--sample-temperature", "1.3", "--sample-top-p", "0.9", "--sample-top-k", "20"],
    "loss knobs": ["--loss-temperature", "1.1", "--loss-agg", "sequence-mean", "--support", "teacher_renorm"],
    "micro-batch mean, plain path": ["--loss-agg", "micro-batch", "--micro-batch", "3", "--loss-chunk", "0"],
    "is-clip, cosine": ["--is-clip", "2", "--lr-schedule", "cosine", "--warmup-steps", "1"],
    "ablations": ["--no-overlap", "--no-confidence", "--no-rank-loss", "--no-exploration"],
    "2-rank ddp": ["@2"],
    "2-rank ddp dapd": ["@2", "--method", "dapd"],
    "2-rank fsdp": ["@2", "--fsdp"],
    "2-rank fsdp lora": ["@2", "--fsdp", "--lora-r", "4", "--lr", "1e-3"],
}
"""name -> train.py flags after BASE; '@2' runs it on 2 ranks (torchrun, gloo)."""

def measured(row: dict) -> dict:
    """The ledger fields that are results, not times or the launch's description."""
    return {k: v for k, v in row.items() if k != "launch" and not k.endswith("_s") and "_s_" not in k}


def teacher_model(cache: Path) -> Path:
    from opd.tiny import build_tiny_model

    return build_tiny_model(cache / "golden-teacher", seed=1)


def argv(name: str, out: Path, teacher: Path) -> tuple[int, list[str]]:
    """(processes, train.py flags) of case `name` writing into `out`."""
    flags = CASES[name]
    ranks = 2 if flags[:1] == ["@2"] else 1
    flags = [str(teacher) if f == TEACHER else f for f in flags if f != "@2"]
    return ranks, [*BASE, "--out", str(out), *flags]


def run_case(name: str, out: Path, teacher: Path, in_process: bool = False) -> list[dict]:
    """The measured ledger rows of case `name`: a subprocess (a fresh interpreter, as a user's run), or with
    `in_process` a one-rank case in this process (the model's float32 casts in float64 here too)."""
    ranks, flags = argv(name, out, teacher)
    if in_process and ranks == 1:
        from float64 import float64_model

        import train

        float64_model()
        train.main(flags)
        return [measured(json.loads(line)) for line in (out / "ledger.jsonl").read_text().splitlines() if line.strip()]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    me = [str(Path(__file__).resolve()), "--worker"]
    if ranks == 1:
        cmd = [sys.executable, *me, *flags]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *me, *flags]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    rows = [json.loads(line) for line in (out / "ledger.jsonl").read_text().splitlines() if line.strip()]
    return [measured(r) for r in rows]


def worker(flags: list[str]) -> None:
    """One train.py run with the model's float32 casts in float64 (tests/float64.py)."""
    from float64 import float64_model

    float64_model()
    import train
    from opd.cli import run_cli

    run_cli(train.main, flags, "train.py")


def record(names: list[str]) -> None:
    import tempfile

    stored = json.loads(GOLDEN.read_text()) if GOLDEN.is_file() else {}
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("BAS_OPD_CACHE", str(Path(tmp) / "cache"))
        teacher = teacher_model(Path(tmp))
        for name in names or list(CASES):
            stored[name] = run_case(name, Path(tmp) / "run", teacher)
            subprocess.run(["rm", "-rf", str(Path(tmp) / "run")], check=True)
            GOLDEN.parent.mkdir(exist_ok=True)  # after every case: a failure keeps the ones recorded
            GOLDEN.write_text(json.dumps({k: stored[k] for k in CASES if k in stored}, indent=1, sort_keys=True) + "\n")
            print(f"recorded {name}: {len(stored[name])} rows", flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2:])
    else:
        record(sys.argv[1:])
