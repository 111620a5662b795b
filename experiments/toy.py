"""BAS-OPD in a toy world on a CPU: the paper's Tables 3, 7, 8 and Figures 2-5, measured.

    python experiments/toy.py --out runs/toy                 # 3 seeds, about 15-20 minutes on 2 cores
    python experiments/toy.py --out runs/toy-smoke --smoke   # one seed, a few steps (the test)

1. The world (`opd.toy.world`): a cluttered canvas with one small coloured target, exported as a training
   JSONL (full image + bbox), a held audit JSONL and a held-out benchmark in eval.py's Vision-OPD JSON
   layout (read as `zoombench`, crops included).
2. The base (`opd.toy.sft`): a tiny Qwen3.5 trained by teacher forcing on the crops only, so it reads the
   crop well and the full image poorly. eval.py measures both views (the regional-to-global gap).
3. OPD runs through `train.Run` on the same base: Full, Random-25, Entropy-25, Learned-25 and
   Learned-10/50, over `--seeds` seeds (Learned-100 is Full querying: identical selection, reused).
   Each run is evaluated by eval.py on the held-out benchmark (full view and, as a check of the
   teacher's pathway, crop view). Learned-25 runs also get the Figure 3 audit (`opd.audit`) at the
   end and, for the first seed, the Figure 4 gradient geometry at `--grad-checkpoints` points.
4. OUT/report.md: the tables and plots (OUT/*.png) from the files on disk.

Resumable: the world, the base, the base's evaluation and every finished run (its done.json) are
reused; an unfinished run starts over. `--jobs 2` trains two runs at a time (one thread each).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import platform
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402


@dataclass
class ToyConfig:
    preset: str = "default"
    """Starting values: 'default' (the reported experiment) or 'smoke' (one seed, a few steps; --smoke)."""
    out: str = "runs/toy"
    """Output folder: world/, base/, base_eval/, runs/<policy>/seed<k>/, report.md and the plots."""
    seeds: int = 3
    """Training seeds 0..seeds-1 (data order, rollout sampling and selector seed of every run)."""
    steps: int = 120
    """OPD steps per run (120 = one epoch of the 960 training records at 8 prompts per step)."""
    prompts_per_step: int = 8
    """Prompts per OPD step (the paper: 28)."""
    rollouts_per_prompt: int = 8
    """Rollouts per prompt (the paper's 8); candidates per step = prompts x rollouts."""
    max_response_len: int = 4
    """Most sampled tokens per rollout (an answer is a letter and <|im_end|>)."""
    lr: float = 1.5e-4
    """AdamW learning rate of the policy in OPD (the paper's 2e-6 does not move a tiny model)."""
    budgets: str = "10,25,50"
    """Query ratios (percent) of the Learned budget sweep besides 100 (= Full querying, reused)."""
    replay_start: int = 96
    """Labels in replay before the selector's first update (the paper's 96)."""
    replay_batch: int = 256
    """Replay minibatch (the paper's 256)."""
    jobs: int = 2
    """Runs trained at once, each in its own process with one thread (1: in this process)."""
    world_seed: int = 0
    """Seed of the toy world."""
    n_opd: int = 960
    """Training records of the world."""
    n_audit: int = 160
    """Held records for the Figure 3/4 audits."""
    n_eval: int = 400
    """Held-out benchmark items."""
    sft_steps: int = 150
    """Supervised steps of the base model (batch 16, crops only)."""
    sft_batch: int = 16
    """Supervised batch of the base model."""
    eval_batch: int = 100
    """eval.py --batch-size."""
    audit_batches: int = 10
    """Held batches of the Figure 3 audit (prompts_per_step prompts each) per Learned-25 run."""
    audit_seeds: int = 3
    """Learned-25 runs (first seeds) that get the Figure 3 audit."""
    grad_checkpoints: int = 4
    """Figure 4: points in the first seed's Learned-25 run (evenly spaced, the last at the end)."""
    grad_batches: int = 5
    """Figure 4: held batches (selected/unselected gradient pairs) per checkpoint."""


SMOKE = dict(
    seeds=1, steps=2, prompts_per_step=2, rollouts_per_prompt=4, budgets="25,50", replay_start=4, replay_batch=16,
    jobs=1, n_opd=16, n_audit=8, n_eval=16, sft_steps=4, sft_batch=4, eval_batch=16, audit_batches=2, audit_seeds=1,
    grad_checkpoints=2, grad_batches=1, out="runs/toy-smoke",
)  # fmt: skip
PRESETS = {"default": {}, "smoke": SMOKE}
POLICIES = {"full": "Full", "random": "Random", "entropy": "Entropy", "learned": "Learned"}


def parse(argv: list[str] | None) -> ToyConfig:
    from opd.cli import build_parser

    parser = build_parser(ToyConfig, PRESETS, __doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="Same as --preset smoke: one seed, a few steps.")
    args = vars(parser.parse_args(argv))
    preset = "smoke" if args.pop("smoke") else args.pop("preset")
    args.pop("preset", None)
    given = {k: v for k, v in args.items() if v is not None}
    return dataclasses.replace(ToyConfig(preset=preset, **PRESETS[preset]), **given)


def quiet() -> None:
    """One thread, and no progress bars from transformers' loading and saving."""
    import torch
    import transformers

    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()


def say(*parts) -> None:
    print(time.strftime("%H:%M:%S"), *parts, file=sys.__stdout__, flush=True)


# ----------------------------------------------------------------------------- the plan


def run_specs(cfg: ToyConfig) -> list[dict]:
    """Every OPD run of the experiment: (policy, rho, seed), the costliest first."""
    budgets = sorted({int(b) for b in cfg.budgets.split(",") if b.strip()} | {25})
    kinds = [("full", 100), ("random", 25), ("entropy", 25)] + [("learned", b) for b in budgets if b != 100]
    specs = []
    for seed in range(cfg.seeds):
        for policy, pct in kinds:
            specs.append({"policy": policy, "pct": pct, "seed": seed, "name": f"{policy}-{pct}"})
    return sorted(specs, key=lambda s: (-s["pct"], s["seed"]))


def world_config(cfg: ToyConfig):
    from opd.toy.world import WorldConfig

    return WorldConfig(seed=cfg.world_seed, n_opd=cfg.n_opd, n_audit=cfg.n_audit, n_eval=cfg.n_eval)


def sft_config(cfg: ToyConfig):
    from opd.toy.sft import SFTConfig

    return SFTConfig(steps=cfg.sft_steps, batch=cfg.sft_batch)


def train_config(cfg: ToyConfig, spec: dict, base: Path, data: Path, out: Path):
    from train import TrainConfig

    return TrainConfig(
        model=str(base), data=str(data), out=str(out), policy=spec["policy"], rho=spec["pct"] / 100,
        steps=cfg.steps, prompts_per_step=cfg.prompts_per_step, rollouts_per_prompt=cfg.rollouts_per_prompt,
        max_prompt_len=512, max_response_len=cfg.max_response_len, lr=cfg.lr, micro_batch=64,
        seed=spec["seed"], selector_seed=spec["seed"], replay_start=cfg.replay_start, replay_batch=cfg.replay_batch,
        save_every=0, keep_checkpoints=1,
    )  # fmt: skip


def evaluate(model: Path, bench: Path, out: Path, cfg: ToyConfig, label: str) -> dict:
    """eval.py on the toy benchmark, full and crop view; returns {"full", "crop", "gap"} in percent."""
    import eval as eval_py

    argv = ["--model", str(model), "--benchmarks", "zoombench", "--view", "crop", "--data-dir", str(bench),
            "--out", str(out), "--batch-size", str(cfg.eval_batch), "--max-new-tokens", "4", "--device", "cpu",
            "--dtype", "float32", "--no-progress", "--label", label]
    with open(out.parent / f"{out.name}.log", "w") as log, contextlib.redirect_stdout(log):
        res = eval_py.main(argv)["results"]
    return {"full": res["zoombench"]["score"], "crop": res["zoombench@crop"]["score"],
            "gap": res["zoombench@crop"]["zoom_gap"]["gap"], "unparsed": res["zoombench"]["unparsed"]}


# ----------------------------------------------------------------------------- one run


def train_one(args: tuple) -> dict:
    """Trains and evaluates one run (in a worker process or in this one); returns its done.json."""
    cfg_dict, spec, root = args
    quiet()
    cfg, root = ToyConfig(**cfg_dict), Path(root)
    out = root / "runs" / spec["name"] / f"seed{spec['seed']}"
    done = out / "done.json"
    if done.exists():
        return json.loads(done.read_text())
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    from opd.audit import audit_utility, gradient_geometry
    from opd.data import load_records
    from train import Run

    world = root / "world"
    tcfg = train_config(cfg, spec, root / "base", world / "train.jsonl", out)
    t0 = time.perf_counter()
    geometry = []
    checkpoints = set()
    if spec["policy"] == "learned" and spec["pct"] == 25 and spec["seed"] == 0 and cfg.grad_checkpoints:
        checkpoints = {round(cfg.steps * (j + 1) / cfg.grad_checkpoints) for j in range(cfg.grad_checkpoints)}
    audit_records = load_records(world / "audit.jsonl")
    with open(out / "train.log", "w") as log, contextlib.redirect_stdout(log):
        run = Run(tcfg)
        for step in range(cfg.steps):
            row = run.step(step)
            run.log(row)
            if step + 1 in checkpoints:
                g = gradient_geometry(run, audit_records, rho=0.25, n_batches=cfg.grad_batches)
                geometry.append({"step": step + 1, **g})
            if (step + 1) % max(1, cfg.steps // 4) == 0:
                say(f"  {spec['name']} seed {spec['seed']}: step {step + 1}/{cfg.steps}, loss {row['loss']:.4f}, "
                    f"|S|/K {row['selected']}/{row['budget']}, {time.perf_counter() - t0:.0f} s")
        run.save(cfg.steps)
        summary = run.finish()
        audit = None
        if spec["policy"] == "learned" and spec["pct"] == 25 and spec["seed"] < cfg.audit_seeds:
            audit = audit_utility(run, audit_records, n_batches=cfg.audit_batches)
    train_s = time.perf_counter() - t0
    if geometry:
        (out / "geometry.json").write_text(json.dumps(geometry, indent=1) + "\n")
    if audit is not None:
        (out / "audit.json").write_text(json.dumps(audit, indent=1) + "\n")
    del run
    t1 = time.perf_counter()
    scores = evaluate(out, world / "bench", out / "eval", cfg, f"{spec['name']}-seed{spec['seed']}")
    record = {**spec, "train_s": train_s, "eval_s": time.perf_counter() - t1, "summary": summary, **scores}
    done.write_text(json.dumps(record, indent=1) + "\n")
    say(f"done {spec['name']} seed {spec['seed']}: full {scores['full']:.1f}%, crop {scores['crop']:.1f}% "
        f"({train_s:.0f} s training, {record['eval_s']:.0f} s eval)")
    return record


# ----------------------------------------------------------------------------- ledger checks


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


# ----------------------------------------------------------------------------- report


def _ms(values) -> str:
    v = np.asarray([x for x in values if x is not None], dtype=float)
    if v.size == 0:
        return "-"
    return f"{v.mean():.2f} ± {v.std(ddof=1):.2f}" if v.size > 1 else f"{v.mean():.2f}"


def collect(root: Path, cfg: ToyConfig) -> dict:
    """Everything the report needs, read back from the run folders."""
    from opd.ledger import read_ledger, summarize

    runs = {}
    for spec in run_specs(cfg):
        folder = root / "runs" / spec["name"] / f"seed{spec['seed']}"
        if not (folder / "done.json").exists():
            continue
        rec = json.loads((folder / "done.json").read_text())
        rows = read_ledger(folder / "ledger.jsonl")
        rec["ledger"] = summarize(rows)
        rec["ledger_problems"] = check_ledger(rows, spec["pct"] / 100, spec["policy"])
        rec["ledger_rows"] = len(rows)
        for name in ("audit", "geometry"):
            path = folder / f"{name}.json"
            rec[name] = json.loads(path.read_text()) if path.exists() else None
        runs.setdefault(spec["name"], []).append(rec)
    return runs


def order(runs: dict) -> list[str]:
    key = {"full": 0, "random": 1, "entropy": 2, "learned": 3}
    return sorted(runs, key=lambda n: (key[n.split("-")[0]], -int(n.split("-")[1])))


def label(name: str) -> str:
    policy, pct = name.split("-")
    return "Full querying" if policy == "full" else f"{POLICIES[policy]}-{pct}"


def world_figure(root: Path, cfg: ToyConfig, n: int = 6) -> str:
    """OUT/world.png: the first `n` held-out items as the canvas with the crop's bbox, and both views at
    the model's input resolution (resized here with PIL's bicubic filter, as an illustration)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from PIL import Image

    from opd.toy.world import sample

    world = world_config(cfg)
    side = (world.resolution, world.resolution)
    fig, axes = plt.subplots(3, n, figsize=(1.65 * n, 5.2))
    for j in range(n):
        s = sample(world, "eval", j)
        x1, y1, x2, y2 = s.bbox
        views = (s.image, s.image.resize(side, Image.BICUBIC), s.crop().resize(side, Image.BICUBIC))
        for row, im in enumerate(views):
            ax = axes[row, j]
            ax.imshow(im)
            ax.set_xticks([])
            ax.set_yticks([])
        axes[0, j].add_patch(plt.Rectangle((x1 - 0.5, y1 - 0.5), x2 - x1, y2 - y1, fill=False, ec="white", lw=1.2))
        axes[0, j].set_title(f"{s.colour} {s.shape} ({s.answer}), {s.target}px", fontsize=7)
    for row, name in enumerate((f"canvas {world.canvas}x{world.canvas}", f"full view @{world.resolution}",
                                f"crop view @{world.resolution}")):
        axes[row, 0].set_ylabel(name, fontsize=8)
    fig.suptitle("Toy world: the canvas with the crop's bbox, and what the model sees", fontsize=9)
    fig.tight_layout()
    fig.savefig(root / "world.png", dpi=110)
    plt.close(fig)
    return "world.png"


def plots(root: Path, runs: dict, base: dict) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    acc = {n: np.array([r["full"] for r in rs]) for n, rs in runs.items()}
    full = acc.get("full-100")
    tok = {}
    full_tok = {r["seed"]: r["ledger"]["scored_tokens"] for r in runs.get("full-100", [])}
    for n, rs in runs.items():
        tok[n] = np.array([100 * r["ledger"]["scored_tokens"] / full_tok[r["seed"]] for r in rs if full_tok.get(r["seed"])])

    # Figure 2: accuracy vs budget
    fig, ax = plt.subplots(figsize=(5.2, 3.6))
    learned = sorted([(int(n.split("-")[1]), acc[n]) for n in acc if n.startswith("learned")] +
                     ([(100, full)] if full is not None else []))
    if learned:
        x = [b for b, _ in learned]
        ax.errorbar(x, [a.mean() for _, a in learned], yerr=[a.std(ddof=1) if a.size > 1 else 0 for _, a in learned],
                    marker="o", capsize=3, label="Learned (100 = Full)")
        best = int(np.argmax([a.mean() for _, a in learned]))
        ax.plot([x[best]], [learned[best][1].mean()], "o", color="tab:orange", ms=10, zorder=0)
    for n, m, c in (("random-25", "s", "tab:gray"), ("entropy-25", "^", "tab:green")):
        if n in acc:
            ax.errorbar([25 + (2 if m == "s" else -2)], [acc[n].mean()], yerr=[acc[n].std(ddof=1) if acc[n].size > 1 else 0],
                        fmt=m, color=c, capsize=3, label=label(n))
    if full is not None:
        ax.axhline(full.mean(), ls="--", color="tab:blue", lw=1, label="Full querying")
    ax.axhline(base["full"], ls=":", color="k", lw=1, label="base, full image")
    ax.axhline(base["crop"], ls=":", color="tab:red", lw=1, label="base, crop")
    ax.set_xscale("log")
    ax.set_xticks([10, 25, 50, 100], ["10", "25", "50", "100"])
    ax.set_xlabel("teacher-query budget rho (%)")
    ax.set_ylabel("full-image accuracy (%)")
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title("Figure 2 analogue: accuracy vs budget", fontsize=9)
    fig.tight_layout()
    fig.savefig(root / "fig2_budget.png", dpi=130)
    plt.close(fig)
    files.append("fig2_budget.png")

    # Figure 5: accuracy vs cost
    fig, ax = plt.subplots(figsize=(5.2, 3.6))
    for n in order(runs):
        if tok.get(n) is not None and tok[n].size:
            ax.errorbar([tok[n].mean()], [acc[n].mean()], yerr=[acc[n].std(ddof=1) if acc[n].size > 1 else 0],
                        fmt="o", capsize=3)
            ax.annotate(f"{label(n)}", (tok[n].mean(), acc[n].mean()), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.axhline(base["full"], ls=":", color="k", lw=1, label="base, full image")
    ax.set_xlabel("teacher-scored tokens vs Full querying (%)")
    ax.set_ylabel("full-image accuracy (%)")
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title("Figure 5 analogue: accuracy vs teacher cost", fontsize=9)
    fig.tight_layout()
    fig.savefig(root / "fig5_cost.png", dpi=130)
    plt.close(fig)
    files.append("fig5_cost.png")

    audits = [r["audit"] for r in runs.get("learned-25", []) if r.get("audit")]
    if audits:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.6))
        grid = np.array(audits[0]["grid"]) * 100
        for key, style in (("oracle", "-"), ("learned", "-"), ("entropy", "--"), ("random", ":")):
            curves = [a["curve"][key] for a in audits if key in a["curve"]]
            if curves:
                a1.plot(grid, 100 * np.mean(curves, 0), style, label=key)
        a1.axvline(25, color="gray", lw=0.8)
        a1.set_xlabel("top fraction of candidates queried (%)")
        a1.set_ylabel("utility captured (%)")
        a1.legend(fontsize=7)
        a1.set_title("(a) cumulative utility capture", fontsize=9)
        bands = audits[0]["bands"]["bands"]
        means = [b["mean"] for b in bands]
        err = [[b["mean"] - b["low"] for b in bands], [b["high"] - b["mean"] for b in bands]]
        a2.bar(["0-25", "25-50", "50-75", "75-100"], means, yerr=err, capsize=3, color="tab:blue")
        a2.set_xlabel(f"predicted rank band (%), by {audits[0]['bands_by']}")
        a2.set_ylabel("mean utility u_i")
        p = audits[0]["bands"]["tests"][0]["p_holm"]
        a2.set_title(f"(b) utility by rank band, 95% bootstrap CI\n(seed 0; top vs next: p_Holm = {p:.3f})", fontsize=8)
        fig.tight_layout()
        fig.savefig(root / "fig3_audit.png", dpi=130)
        plt.close(fig)
        files.append("fig3_audit.png")

    geometry = [r["geometry"] for r in runs.get("learned-25", []) if r.get("geometry")]
    if geometry:
        g = geometry[0]
        steps = [c["step"] for c in g]
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.4))
        for c in g:
            rs = [row["norm_selected"] / row["norm_unselected"] for row in c["rows"] if row["norm_unselected"] > 0]
            a1.plot([c["step"]] * len(rs), rs, ".", color="tab:gray", alpha=0.6)
            a2.plot([c["step"]] * len(c["rows"]), [row["cosine"] for row in c["rows"]], ".", color="tab:gray", alpha=0.6)
        a1.plot(steps, [c["summary"]["norm_ratio"] for c in g], "o-", label="ratio of mean norms")
        a1.axhline(1, color="k", lw=0.8)
        a1.set_xlabel("training step")
        a1.set_ylabel("||g_S|| / ||g_U||")
        a1.legend(fontsize=7)
        a1.set_title("(a) selected vs unselected OPD gradient norm", fontsize=9)
        a2.plot(steps, [c["summary"]["mean_cosine"] for c in g], "o-")
        a2.axhline(0, color="k", lw=0.8)
        a2.set_xlabel("training step")
        a2.set_ylabel("cos(g_S, g_U)")
        a2.set_title("(b) cosine of selected and unselected gradients", fontsize=9)
        fig.tight_layout()
        fig.savefig(root / "fig4_geometry.png", dpi=130)
        plt.close(fig)
        files.append("fig4_geometry.png")
    return files


def machine() -> str:
    import torch
    import transformers

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


def report(root: Path, cfg: ToyConfig, timing: dict, command: str) -> str:
    """Writes OUT/report.md (and the plots) from the files on disk; returns the Markdown."""
    base = json.loads((root / "base_eval.json").read_text())
    runs = collect(root, cfg)
    world_png = world_figure(root, cfg)
    files = plots(root, runs, base)
    names = order(runs)
    full = runs.get("full-100", [])
    full_tok = {r["seed"]: r["ledger"]["scored_tokens"] for r in full}
    full_acc = np.array([r["full"] for r in full]) if full else None
    gap = base["crop"] - base["full"]
    lines = [
        "# BAS-OPD in a toy world (CPU)",
        "",
        f"- Command: `{command}`",
        f"- Machine: {machine()}; {cfg.jobs} run(s) at a time, one thread each",
        f"- Wall time: {timing.get('total_s', 0):.0f} s in all (world {timing.get('world_s', 0):.0f} s, base model "
        f"{timing.get('sft_s', 0):.0f} s, base evaluation {timing.get('base_eval_s', 0):.0f} s, OPD runs "
        f"{timing.get('runs_s', 0):.0f} s)" + (f", summed over {timing['invocations']} invocations (each reuses what "
        "the earlier ones finished)" if timing.get("invocations", 1) > 1 else ", one invocation from scratch"),
        f"- Finished: {time.strftime('%Y-%m-%d %H:%M:%S')}",
        f"- Setting: {cfg.seeds} seed(s); {cfg.steps} OPD steps of {cfg.prompts_per_step} prompts x "
        f"{cfg.rollouts_per_prompt} rollouts; lr {cfg.lr:g}; JSD alpha 0.5, top-100, EMA 0.05 (paper); selector as "
        f"Table 5 with replay start {cfg.replay_start}, minibatch {cfg.replay_batch}; eval.py greedy on {cfg.n_eval} "
        "held-out items",
        "",
        f"![{world_png}]({world_png})",
        "",
        "## The regional-to-global gap (eval.py, held-out benchmark)",
        "",
        "| Model | Full image | Crop | Crop - full |",
        "| --- | ---: | ---: | ---: |",
        f"| base (SFT on crops) | {base['full']:.2f} | {base['crop']:.2f} | {gap:+.2f} |",
    ]
    for n in names:
        rs = runs[n]
        lines.append(f"| {label(n)} | {_ms([r['full'] for r in rs])} | {_ms([r['crop'] for r in rs])} | "
                     f"{_ms([r['crop'] - r['full'] for r in rs])} |")
    if full_acc is not None and gap > 0:
        closed = (full_acc - base["full"]) / gap
        lines += ["", f"Full querying closes {100 * closed.mean():.1f}% of the base's gap (per seed: "
                  + ", ".join(f"{100 * c:.1f}%" for c in closed) + ")."]
    lines += [
        "",
        "## Table 3 analogue: policy accuracy and teacher cost",
        "",
        "Full-image accuracy on the held-out benchmark, mean ± std over seeds (std with n - 1). Query ratio is "
        "selected / candidates; token ratio is teacher-scored tokens relative to Full querying on the same seed.",
        "",
        "| Policy | Query ratio | Token ratio | Full-image accuracy | Per seed | vs Full (paired) |",
        "| --- | ---: | ---: | ---: | --- | ---: |",
    ]
    by_seed_full = {r["seed"]: r["full"] for r in full}
    for n in names:
        rs = sorted(runs[n], key=lambda r: r["seed"])
        led = [r["ledger"] for r in rs]
        q = 100 * sum(x["calls"] for x in led) / max(1, sum(x["candidates"] for x in led))
        t = [100 * r["ledger"]["scored_tokens"] / full_tok[r["seed"]] for r in rs if full_tok.get(r["seed"])]
        d = [r["full"] - by_seed_full[r["seed"]] for r in rs if r["seed"] in by_seed_full]
        lines.append(f"| {label(n)} | {q:.2f} | {np.mean(t) if t else float('nan'):.2f} | {_ms([r['full'] for r in rs])} | "
                     + ", ".join(f"{r['full']:.1f}" for r in rs) + f" | {'-' if n == 'full-100' else _ms(d)} |")
    lines += ["", "Learned-100 is Full querying (at rho = 1 every policy selects all of C), so the Full row stands for it.",
              "", "## Table 7 analogue: teacher-supervision counts (all seeds summed)", "",
              "| Policy | Candidates | Teacher calls | Query ratio | Scored tokens | Tokens vs. Full | Max overrun |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    total_full_tok = sum(r["ledger"]["scored_tokens"] for r in full)
    for n in names:
        led = [r["ledger"] for r in runs[n]]
        c, k, s = (sum(x[key] for x in led) for key in ("candidates", "calls", "scored_tokens"))
        lines.append(f"| {label(n)} | {c:,} | {k:,} | {100 * k / max(1, c):.2f}% | {s:,} | "
                     f"{100 * s / total_full_tok if total_full_tok else float('nan'):.2f}% | "
                     f"{max(max(0, x['max_overrun']) for x in led)} |")
    lines += ["", "## Table 8 analogue: observed training time (mean ± std over seeds, seconds)", "",
              "| Policy | Teacher forward sum | Mean teacher/step | Mean step | Total step time | Generation sum |",
              "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for n in names:
        led = [r["ledger"] for r in runs[n]]
        lines.append(f"| {label(n)} | {_ms([x['teacher_forward_s'] for x in led])} | "
                     f"{_ms([x['mean_teacher_s'] for x in led])} | {_ms([x['mean_step_s'] for x in led])} | "
                     f"{_ms([x['step_s'] for x in led])} | {_ms([x['phases_s']['generation'] for x in led])} |")
    problems = [f"{n} seed {r['seed']}: {p}" for n in names for r in runs[n] for p in r["ledger_problems"]]
    n_rows = sum(r["ledger_rows"] for n in names for r in runs[n])
    lines += ["", f"Ledger arithmetic (K = floor(rho |C|), |S| <= K, |S| = |C| under Full, teacher rows = |S|, scored "
              f"<= candidate tokens) checked on {n_rows} ledger rows: "
              + ("all hold." if not problems else f"{len(problems)} problem(s): " + "; ".join(problems[:5]))]

    audits = [(r["seed"], r["audit"]) for r in sorted(runs.get("learned-25", []), key=lambda r: r["seed"]) if r.get("audit")]
    if audits:
        lines += ["", "## Figure 3 analogue: frozen-selector utility audit (Learned-25, final state)", "",
                  f"{audits[0][1]['batches']} held batches of {cfg.prompts_per_step} x {cfg.rollouts_per_prompt} "
                  f"candidates per seed, every candidate scored by the EMA teacher. Utility captured by the top 25%:", "",
                  "| Seed | Oracle | Learned | Entropy | Random | Bands by | Band means (top to bottom) | top/next | p_Holm (top > next) | Prompts in top 25%: learned / entropy / random (of P) |",
                  "| --- | ---: | ---: | ---: | ---: | --- | --- | ---: | ---: | --- |"]
        for seed, a in audits:
            j = a["fractions"].index(0.25)
            cap = {k: f"{100 * a['capture'][k][j]:.1f}%" if k in a["capture"] else "-"
                   for k in ("oracle", "learned", "entropy", "random")}
            bands = ", ".join(f"{b['mean']:.2e} [{b['low']:.2e}, {b['high']:.2e}]" for b in a["bands"]["bands"])
            lines.append(f"| {seed} | {cap['oracle']} | {cap['learned']} | {cap['entropy']} | {cap['random']} | "
                         f"{a['bands_by']} | {bands} | {a['bands']['top_over_next']:.2f} | "
                         f"{a['bands']['tests'][0]['p_holm']:.3f} | " + " / ".join(
                             f"{a['coverage'][k]:.1f}" if k in a.get("coverage", {}) else "-"
                             for k in ("learned", "entropy", "random")) + f" (of {a.get('prompts_per_batch', 0):.0f}) |")
    geometry = [r["geometry"] for r in runs.get("learned-25", []) if r.get("geometry")]
    if geometry:
        lines += ["", "## Figure 4 analogue: gradient geometry (Learned-25, seed 0)", "",
                  "S = the frozen selector's top 25% of a held batch, U = the other 75%; g = gradient of Eq. 11's token "
                  "mean over the set with respect to all policy parameters.", "",
                  "| Step | Batches | mean ‖g_S‖ | mean ‖g_U‖ | ratio of means | per-batch ratio range | mean cos | cos range |",
                  "| ---: | ---: | ---: | ---: | ---: | --- | ---: | --- |"]
        for c in geometry[0]:
            s = c["summary"]
            lines.append(f"| {c['step']} | {s['batches']} | {s['mean_norm_selected']:.3e} | {s['mean_norm_unselected']:.3e} | "
                         f"{s['norm_ratio']:.2f} | {s['ratio_min']:.2f}-{s['ratio_max']:.2f} | {s['mean_cosine']:.3f} | "
                         f"{s['cosine_min']:.3f}-{s['cosine_max']:.3f} |")
    lines += ["", "## Plots", ""] + [f"![{f}]({f})" for f in files]
    text = "\n".join(lines) + "\n"
    (root / "report.md").write_text(text)
    (root / "report.json").write_text(json.dumps({"base": base, "timing": timing, "runs": {
        n: [{k: v for k, v in r.items() if k not in ("audit", "geometry")} for r in rs] for n, rs in runs.items()}},
        indent=1, default=str) + "\n")
    return text


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> str:
    cfg = parse(argv)
    quiet()
    from opd.toy.sft import train_base
    from opd.toy.world import export_world

    root = Path(cfg.out)
    root.mkdir(parents=True, exist_ok=True)
    command = "python experiments/toy.py " + " ".join(sys.argv[1:] if argv is None else argv)
    timing_path = root / "timing.json"
    timing = json.loads(timing_path.read_text()) if timing_path.exists() else {}
    t_start = time.perf_counter()
    spent = {}

    t0 = time.perf_counter()
    say(f"world -> {root / 'world'}")
    export_world(root / "world", world_config(cfg))
    spent["world_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    say(f"base model ({cfg.sft_steps} supervised steps on crops) -> {root / 'base'}")
    train_base(root / "base", world_config(cfg), sft_config(cfg), log=lambda m: say(m))
    spent["sft_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    if not (root / "base_eval.json").exists():
        say("evaluating the base with eval.py (full image and crop)")
        base = evaluate(root / "base", root / "world" / "bench", root / "base_eval", cfg, "base")
        (root / "base_eval.json").write_text(json.dumps(base, indent=1) + "\n")
    base = json.loads((root / "base_eval.json").read_text())
    say(f"base: full image {base['full']:.1f}%, crop {base['crop']:.1f}%, gap {base['gap']:+.1f} points")
    spent["base_eval_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    specs = run_specs(cfg)
    todo = [s for s in specs if not (root / "runs" / s["name"] / f"seed{s['seed']}" / "done.json").exists()]
    say(f"{len(specs)} OPD runs, {len(specs) - len(todo)} already done, {cfg.jobs} at a time")
    jobs = [(dataclasses.asdict(cfg), s, str(root)) for s in todo]
    if cfg.jobs > 1 and len(jobs) > 1:
        import multiprocessing as mp

        env = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "TOKENIZERS_PARALLELISM")}
        os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        try:
            with mp.get_context("spawn").Pool(cfg.jobs, maxtasksperchild=1) as pool:
                for _ in pool.imap_unordered(train_one, jobs):
                    pass
        finally:
            for k, v in env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    else:
        for job in jobs:
            train_one(job)
    spent["runs_s"] = time.perf_counter() - t0
    for k, v in spent.items():  # a resumed invocation adds its own time to the earlier ones'
        timing[k] = timing.get(k, 0.0) + v
    timing["total_s"] = timing.get("total_s", 0.0) + time.perf_counter() - t_start
    timing["invocations"] = timing.get("invocations", 0) + 1
    timing_path.write_text(json.dumps(timing, indent=1) + "\n")
    text = report(root, cfg, timing, command)
    say(f"report -> {root / 'report.md'} ({timing['total_s']:.0f} s in all)")
    return text


if __name__ == "__main__":
    main()
