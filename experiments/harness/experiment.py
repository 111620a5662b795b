"""Running a toy experiment: one OPD run (opd.run.Run, audits, eval.py), the runs in parallel, the ledger
checks and reading the results back. Shared by the experiment scripts (experiments/toy.py, toy_explain.py,
toy_collapse.py, family.py), whose `main()` starts with `harness.entry.Entry`.

A run is described by a job, a plain dict (it travels to a worker process):

- `spec`: {"policy", "pct", "seed", "name"} (and "ablation" for a Table 4 variant), copied into done.json;
- `folder`: the run's output folder; `train`: the `opd.config.TrainConfig` fields (without `out`);
- `audit_data`: the held JSONL of the audits; `audit_batches`: Figure 3 batches at the end (0: none);
  `selection_batches` / `selection_draws`: `harness.audit.selection_audit` at the end (0: none);
  `geometry_steps`: steps after which Figure 4's gradient geometry is measured; `grad_batches`;
- `eval`: {"bench", "batch", "max_new_tokens"} of eval.py; `trace`: whether to write trace.jsonl.

A run's folder is finished when it holds done.json; an unfinished one is deleted and trained again.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import math
import multiprocessing as mp
import os
import platform
import resource
import shutil
import sys
import time
from pathlib import Path

import torch
import transformers

from harness.audit import AuditContext, audit_utility, gradient_geometry, selection_audit
from opd.config import TrainConfig
from opd.data.sources import load_records
from opd.eval.cli import main as eval_main
from opd.loop.ledger import read_ledger, summarize, write_atomic
from opd.run import Run


def quiet() -> None:
    """One thread, and no progress bars from transformers' loading and saving."""
    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()


def say(*parts) -> None:
    print(time.strftime("%H:%M:%S"), *parts, file=sys.__stdout__, flush=True)


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (f"{cpu}, {os.cpu_count()} logical CPUs, {platform.system()} {platform.release()}, Python "
            f"{platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}")


def evaluate(model: Path, bench: Path, out: Path, batch: int, max_new_tokens: int, label: str) -> dict:
    """eval.py on the toy benchmark, full and crop view; returns {"full", "crop", "gap", "unparsed"} (percent)."""
    argv = ["--model", str(model), "--benchmarks", "zoombench", "--view", "crop", "--data-dir", str(bench),
            "--out", str(out), "--batch-size", str(batch), "--max-new-tokens", str(max_new_tokens), "--device", "cpu",
            "--dtype", "float32", "--no-progress", "--label", label]
    with open(out.parent / f"{out.name}.log", "w") as log, contextlib.redirect_stdout(log):
        res = eval_main(argv)["results"]
    return {"full": res["zoombench"]["score"], "crop": res["zoombench@crop"]["score"],
            "gap": res["zoombench@crop"]["zoom_gap"]["gap"], "unparsed": res["zoombench"]["unparsed"]}


# ----------------------------------------------------------------------------- one run


class Trace:
    """Per step, from the run's selector calls: the candidates, S, every row's response length T_i, mean token
    entropy and crop area a_i, and the utility labels u_i of S (written to trace.jsonl, one line per step)."""

    def __init__(self, run, path: Path):
        self.path, self.row = path, None
        selector = run.selector
        select, observe = selector.select, selector.observe

        def traced_select(phi, eligible, budget, step, *args, **kwargs):
            chosen, pi = select(phi, eligible, budget, step, *args, **kwargs)
            self.row = {"step": step, "budget": budget, "candidates": eligible.nonzero().squeeze(-1).tolist(),
                        "selected": chosen.tolist(), "length": phi[:, 3].round().int().tolist(),
                        "entropy": [round(float(x), 5) for x in phi[:, 2]],
                        "area": [round(float(x), 5) for x in phi[:, 5]]}
            return chosen, pi

        def traced_observe(phi, u, step):
            self.row["utility"] = [float(f"{float(x):.5g}") for x in u]
            with self.path.open("a") as f:
                f.write(json.dumps(self.row) + "\n")
            return observe(phi, u, step)

        selector.select, selector.observe = traced_select, traced_observe


def attach(target: str, run, job: dict):
    """job["hook"] 'module:Class' (importable: a study's own selection arm or measurement, experiments/) built
    with (run, job) before the run's first step; its `end()`, when it has one, runs after the last step."""
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)(run, job)


def finished_or_cleared(out: Path) -> dict | None:
    """A run folder's done.json when the run finished; else None, with the folder emptied for a fresh start
    (an unfinished run starts over)."""
    done = out / "done.json"
    if done.exists():
        return json.loads(done.read_text())
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    return None


def train_one(job: dict) -> dict:
    """Trains, audits and evaluates one run (in a worker process or in this one); returns its done.json."""
    quiet()
    spec, out = job["spec"], Path(job["folder"])
    done = out / "done.json"
    if (finished := finished_or_cleared(out)) is not None:
        return finished
    tcfg = TrainConfig(**job["train"], out=str(out))
    steps = tcfg.run.steps
    t0 = time.perf_counter()
    geometry = []
    checkpoints = set(job.get("geometry_steps", ()))
    audit_records = load_records(job["audit_data"])
    with open(out / "train.log", "w") as log, contextlib.redirect_stdout(log):
        run = Run(tcfg)
        hook = attach(job["hook"], run, job) if job.get("hook") else None
        if job.get("trace"):
            Trace(run, out / "trace.jsonl")
        for step in range(steps):
            row = run.step(step)
            run.log(row)
            if step + 1 in checkpoints:
                g = gradient_geometry(AuditContext.of(run), run.selector, audit_records, rho=0.25, n_batches=job["grad_batches"])
                geometry.append({"step": step + 1, **g})
            if (step + 1) % max(1, steps // 4) == 0:
                say(f"  {spec['name']} seed {spec['seed']}: step {step + 1}/{steps}, loss {row['loss']:.4f}, "
                    f"|S|/K {row['selected']}/{row['budget']}, {time.perf_counter() - t0:.0f} s")
        run.save(steps)
        if hook is not None and hasattr(hook, "end"):
            hook.end()
        summary = run.finish()
        audit = None
        if job.get("audit_batches"):
            audit = audit_utility(AuditContext.of(run), run.selector, audit_records, n_batches=job["audit_batches"])
        selection = None
        if job.get("selection_batches"):  # the run's own selection against the full-query gradient (harness.audit)
            selection = selection_audit(AuditContext.of(run), run.selector, audit_records, job["selection_batches"],
                                        job.get("selection_draws", 4))  # fmt: skip
    train_s = time.perf_counter() - t0
    if geometry:
        write_atomic(out / "geometry.json", json.dumps(geometry, indent=1) + "\n")
    if audit is not None:
        write_atomic(out / "audit.json", json.dumps(audit, indent=1) + "\n")
    if selection is not None:
        write_atomic(out / "selection.json", json.dumps(selection, indent=1) + "\n")
    del run
    t1 = time.perf_counter()
    ev = job["eval"]
    scores = evaluate(out, Path(ev["bench"]), out / "eval", ev["batch"], ev["max_new_tokens"], f"{spec['name']}-seed{spec['seed']}")
    record = {**spec, "train_s": train_s, "eval_s": time.perf_counter() - t1, "summary": summary, **scores}
    write_atomic(done, json.dumps(record, indent=1) + "\n")  # the finished marker: whole or absent
    say(f"done {spec['name']} seed {spec['seed']}: full {scores['full']:.1f}%, crop {scores['crop']:.1f}% "
        f"({train_s:.0f} s training, {record['eval_s']:.0f} s eval)")
    return record


def run_jobs(jobs: list[dict], parallel: int, worker=None) -> None:
    """Trains the jobs with `worker` (default `train_one`; an importable function), `parallel` at a time in
    spawned processes with one thread each (1: in this one)."""
    worker = worker or train_one
    if parallel > 1 and len(jobs) > 1:
        env = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "TOKENIZERS_PARALLELISM")}
        os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        try:
            with mp.get_context("spawn").Pool(parallel, maxtasksperchild=1) as pool:
                for _ in pool.imap_unordered(worker, jobs):
                    pass
        finally:
            for k, v in env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    else:
        for job in jobs:
            worker(job)


def cpu_seconds() -> float:
    """CPU seconds (user + system) of this process and of its finished child processes (the run workers)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


class Timing:
    """OUT/timing.json: wall seconds per phase and CPU seconds in all ("cpu_s"), summed over the invocations
    that built the folder. On a shared machine the wall time grows with the other load; the CPU time
    divided by the cores in use is what the same work takes on an otherwise idle machine."""

    def __init__(self, root: Path):
        self.path = root / "timing.json"
        self.total = json.loads(self.path.read_text()) if self.path.exists() else {}
        self.spent: dict[str, float] = {}
        self.t_start = time.perf_counter()
        self.cpu_start = cpu_seconds()

    @contextlib.contextmanager
    def phase(self, key: str):
        """Adds the block's wall seconds to `key` and its CPU seconds to "cpu_" + key."""
        t0, c0 = time.perf_counter(), cpu_seconds()
        yield
        self.spent[key] = self.spent.get(key, 0.0) + time.perf_counter() - t0
        self.spent["cpu_" + key] = self.spent.get("cpu_" + key, 0.0) + cpu_seconds() - c0

    def save(self) -> dict:
        for k, v in self.spent.items():  # a resumed invocation adds its own time to the earlier ones'
            self.total[k] = self.total.get(k, 0.0) + v
        self.total["total_s"] = self.total.get("total_s", 0.0) + time.perf_counter() - self.t_start
        self.total["cpu_s"] = self.total.get("cpu_s", 0.0) + cpu_seconds() - self.cpu_start
        self.total["invocations"] = self.total.get("invocations", 0) + 1
        write_atomic(self.path, json.dumps(self.total, indent=1) + "\n")
        return self.total


# ----------------------------------------------------------------------------- ledger checks and results


def check_ledger(rows: list[dict], rho: float, policy: str) -> list[str]:
    """The ledger's arithmetic: K = floor(rho |C|), |S| <= K (= |C| for full), teacher rows = |S|,
    scored tokens <= candidate tokens, steps 0..n-1. Returns the problems (empty when all hold)."""
    problems = []
    for j, r in enumerate(rows):
        budget = int(math.floor(rho * r["candidates"] + 1e-9))
        if r["step"] != j:
            problems.append(f"row {j}: step {r['step']}")
        if r["budget"] != budget:
            problems.append(f"step {r['step']}: budget {r['budget']} != floor({rho} x {r['candidates']}) = {budget}")
        if r["selected"] > r["budget"] or r["overrun"] != max(0, r["selected"] - r["budget"]):
            problems.append(f"step {r['step']}: |S| {r['selected']} over K {r['budget']}")
        if policy == "full" and r["selected"] != r["candidates"]:
            problems.append(f"step {r['step']}: full querying selected {r['selected']} of {r['candidates']}")
        if r["teacher_rows"] != r["selected"]:
            problems.append(f"step {r['step']}: teacher rows {r['teacher_rows']} != |S| {r['selected']}")
        if not 0 <= r["scored_tokens"] <= r["candidate_tokens"]:
            problems.append(f"step {r['step']}: scored tokens {r['scored_tokens']} vs candidates' {r['candidate_tokens']}")
    return problems


def run_folder(root: Path, spec: dict) -> Path:
    return root / "runs" / spec["name"] / f"seed{spec['seed']}"


def read_run(root: Path, spec: dict) -> dict | None:
    """One finished run read back (done.json, the ledger's summary and problems, audit/geometry/selection
    JSON, the trace), or None while it has not finished."""
    folder = run_folder(root, spec)
    if not (folder / "done.json").exists():
        return None
    rec = json.loads((folder / "done.json").read_text())
    rows = read_ledger(folder / "ledger.jsonl")
    rec["ledger"] = summarize(rows)
    rec["ledger_problems"] = check_ledger(rows, spec["pct"] / 100, spec["policy"])
    rec["ledger_rows"] = len(rows)
    rec["max_weight"] = max((r.get("max_weight", 1.0) for r in rows), default=1.0)
    for name in ("audit", "geometry", "selection"):
        path = folder / f"{name}.json"
        rec[name] = json.loads(path.read_text()) if path.exists() else None
    trace = folder / "trace.jsonl"
    if trace.exists():
        rec["trace"] = [json.loads(line) for line in trace.read_text().splitlines() if line.strip()]
    return rec


def collect(root: Path, specs: list[dict]) -> dict:
    """Everything the report needs, read back from the finished run folders: {name: [record per seed]}."""
    runs = {}
    for spec in specs:
        if (rec := read_run(root, spec)) is not None:
            runs.setdefault(spec["name"], []).append(rec)
    return runs


POLICIES = {"full": "Full", "random": "Random", "entropy": "Entropy", "learned": "Learned"}
ABLATIONS = {"no-overlap": "without overlap", "no-confidence": "without confidence",
             "no-rank-loss": "without ranking loss", "no-exploration": "without exploration"}
"""Table 4's variants: the run-name suffix and its label (train.py's --no-* switches)."""


def split_name(name: str) -> tuple[str, int, str]:
    """'learned-25-no-overlap' -> ('learned', 25, 'no-overlap'); 'full-100' -> ('full', 100, '')."""
    policy, pct, *rest = name.split("-")
    return policy, int(pct), "-".join(rest)


def order(runs) -> list[str]:
    """Full, Random, Entropy, Learned by falling budget, then the ablations in Table 4's order."""
    key = {"full": 0, "random": 1, "entropy": 2, "learned": 3}
    ablation = {"": 0, **{a: j + 1 for j, a in enumerate(ABLATIONS)}}

    def rank(n: str):
        policy, pct, variant = split_name(n)
        return ablation[variant], key[policy], -pct

    return sorted(runs, key=rank)


def label(name: str) -> str:
    policy, pct, variant = split_name(name)
    base = "Full querying" if policy == "full" else f"{POLICIES[policy]}-{pct}"
    return f"{base} {ABLATIONS[variant]}" if variant else base
