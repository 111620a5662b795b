"""The seed family side by side in the toy world: Vision-OPD / BAS-OPD, OPD-V, RP-OPSD and OPSD.

    .venv/bin/python experiments/family.py --out runs/family                 # 3 seeds, about 40 minutes on 2 cores
    .venv/bin/python experiments/family.py --out runs/family-smoke --smoke   # one seed, a few steps (the test)

1. The world of experiments/toy.py (`opd.toy.world`), and three base models (`opd.toy.family`), one per
   privileged signal: `crop` (trained on crops: BAS-OPD, Vision-OPD, OPD-V), `resolution` (trained on
   full canvases at their native 64 x 64 pixels: RP-OPSD, whose student sees them at 32 x 32) and `text`
   (trained on crops and on hinted full images: OPSD).
2. Each base's privileged-minus-plain gap: greedy accuracy on the held-out items in every view its
   methods use, built as training builds them (`opd.toy.family.view_accuracy`).
3. For each method, Full querying (the method as published), Random-25 and Learned-25 (BAS-OPD's
   budget on top), over `--seeds` seeds, through `train.Run` with the method's paper settings; each run is
   scored by eval.py on the held-out benchmark in the student's view at the original resolution (the
   full canvas) and, for the crop methods, on the crops (the teacher's pathway).
4. OUT/report.md (copied to docs/FAMILY.md by hand): the tables and plots, read from the files on disk.

Resumable: the world, the bases, their gaps and every finished run (its done.json) are reused; an
unfinished run starts over. `--jobs 2` trains two runs at a time (one thread each).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from opd.toy.experiment import Timing, parse, quiet, run_folder, run_jobs, say  # noqa: E402
from opd.toy.report import mean_std as _ms  # noqa: E402

METHODS = ("bas-opd", "opd-v", "rp-opsd", "opsd")
"""The methods run; Vision-OPD is BAS-OPD with every candidate queried (its Full row)."""
BASE_OF = {"bas-opd": "crop", "opd-v": "crop", "rp-opsd": "resolution", "opsd": "text"}
VIEWS_OF = {"crop": ("full", "crop", "masked"), "resolution": ("full", "half_resolution"), "text": ("full", "reference_answer")}
"""The views each base is asked in for its gap (the first is the student's plain view)."""
PRIVILEGED = {"bas-opd": "crop", "opd-v": "crop", "rp-opsd": "full", "opsd": "reference_answer"}
PLAIN = {"bas-opd": "full", "opd-v": "full", "rp-opsd": "half_resolution", "opsd": "full"}
KINDS = (("full", 100, ""), ("random", 25, ""), ("learned", 25, ""))
VARIANTS = {"rp-opsd": (("full", 100, "frozen"),)}
"""Extra runs of a method: RP-OPSD with a fixed teacher, which tells the EMA teacher's drift from the rest."""
VARIANT_SETTINGS = {"frozen": {"ema_tau": 0.0}}


def kinds_of(method: str) -> list[str]:
    """The run kinds of a method: 'full-100', 'random-25', 'learned-25', then its variants ('full-100-frozen')."""
    return ["-".join(str(x) for x in k if x != "") for k in KINDS + VARIANTS.get(method, ())]
NAMES = {"bas-opd": "Vision-OPD / BAS-OPD", "opd-v": "OPD-V", "rp-opsd": "RP-OPSD", "opsd": "OPSD"}


@dataclass
class FamilyConfig:
    preset: str = "default"
    """Starting values: 'default' (the reported comparison) or 'smoke' (one seed, a few steps; --smoke)."""
    out: str = "runs/family"
    """Output folder: world/, base-<signal>/, runs/<method>/<policy>-<pct>/seed<k>/, report.md, plots."""
    seeds: int = 3
    """Training seeds 0..seeds-1 (data order, rollout sampling and selector seed of every run)."""
    steps: int = 120
    """OPD steps per run (one epoch of the 960 training records at 8 prompts per step)."""
    prompts_per_step: int = 8
    """Prompts per OPD step."""
    rollouts_per_prompt: int = 8
    """Rollouts per prompt."""
    max_response_len: int = 4
    """Most sampled tokens per rollout (a letter and <|im_end|>)."""
    lr: float = 1.5e-4
    """AdamW learning rate of the policy (the toy experiment's)."""
    replay_start: int = 96
    """Labels in replay before the selector's first update."""
    replay_batch: int = 256
    """Replay minibatch."""
    jobs: int = 2
    """Runs trained at once, each in its own process with one thread (1: in this process)."""
    world_seed: int = 0
    """Seed of the toy world."""
    n_opd: int = 960
    """Training records of the world."""
    n_audit: int = 160
    """Held records of the world (the toy experiment's; the family runs no audit)."""
    n_eval: int = 400
    """Held-out benchmark items."""
    sft_steps: int = 150
    """Supervised steps of the crop base (the toy experiment's base)."""
    signal_sft_steps: int = 400
    """Supervised steps of the resolution and text bases, which learn a second skill (64-pixel canvases of
    4 visual tokens; reading a hint): with 150 steps neither learned it (measured: 24% and 66%)."""
    sft_batch: int = 16
    """Supervised batch of each base model."""
    max_resolution: int = 64
    """The resolution base's largest image side (its processor keeps sizes between 32 and this)."""
    resolution_crop_share: float = 0.5
    """The resolution base: share of supervised samples shown as crops (the rest as native 64-pixel canvases;
    with none it did not learn the canvases in 150 steps, 24%)."""
    hint_share: float = 0.5
    """The text base: share of supervised samples shown as the hinted full image (the rest as crops)."""
    eval_batch: int = 100
    """eval.py --batch-size."""


SMOKE = dict(seeds=1, steps=2, prompts_per_step=2, rollouts_per_prompt=4, replay_start=4, replay_batch=16, jobs=1,
             n_opd=16, n_audit=8, n_eval=16, sft_steps=4, signal_sft_steps=4, sft_batch=4, eval_batch=16,
             out="runs/family-smoke")  # fmt: skip
PRESETS = {"default": {}, "smoke": SMOKE}


# ----------------------------------------------------------------------------- world and bases


def world_config(cfg: FamilyConfig):
    from opd.toy.world import WorldConfig

    return WorldConfig(seed=cfg.world_seed, n_opd=cfg.n_opd, n_audit=cfg.n_audit, n_eval=cfg.n_eval)  # the toy's world


def base_configs(cfg: FamilyConfig) -> dict:
    """(SFTConfig, task) of each privileged signal's base."""
    from opd.toy.family import HINT
    from opd.toy.sft import SFTConfig

    sft = SFTConfig(steps=cfg.sft_steps, batch=cfg.sft_batch)
    signal = dataclasses.replace(sft, steps=cfg.signal_sft_steps)
    return {
        "crop": (sft, None),
        "resolution": (dataclasses.replace(signal, crop_share=cfg.resolution_crop_share, max_resolution=cfg.max_resolution), None),
        "text": (dataclasses.replace(signal, crop_share=1.0 - cfg.hint_share), HINT),
    }


def base_gaps(root: Path, cfg: FamilyConfig) -> dict:
    """{signal: {view: accuracy %}} of each base on the held-out items; cached in OUT/base_gaps.json."""
    path = root / "base_gaps.json"
    if path.exists():
        return json.loads(path.read_text())
    from opd.data import load_records
    from opd.model import load_model, load_processor
    from opd.toy.family import view_accuracy, write_eval_records

    records = load_records(write_eval_records(root / "world", world_config(cfg), root / "eval_records.jsonl"))
    gaps = {}
    for signal, views in VIEWS_OF.items():
        model, processor = load_model(str(root / f"base-{signal}")), load_processor(str(root / f"base-{signal}"))
        gaps[signal] = {v: view_accuracy(model, processor, records, v, cfg.eval_batch) for v in views}
        say(f"base {signal}: " + ", ".join(f"{v} {a:.1f}%" for v, a in gaps[signal].items()))
    path.write_text(json.dumps(gaps, indent=1) + "\n")
    return gaps


def trust_region_profile(root: Path, cfg: FamilyConfig, prompts: int = 16) -> dict:
    """OPD-V's token weight on the crop base's own rollouts of `prompts` training prompts (step 0, seed 0):
    share of positive weights and mean weight at the answer letter, for correct and wrong letters, and at
    <|im_end|>. Cached in OUT/trust_region.json."""
    path = root / "trust_region.json"
    if path.exists():
        return json.loads(path.read_text())
    import torch

    from opd.chunked import sampled_logp_from_hidden
    from opd.distill import micro_batch_inputs
    from opd.rollout import generate_rollouts
    from opd.seeding import mix_seed
    from opd.teacher import lm_head_weight
    from opd.weights import trust_region
    from train import Run, TrainConfig

    run = Run(TrainConfig(model=str(root / "base-crop"), data=str(root / "world" / "train.jsonl"),
                          out=str(root / "trust_region_run"), overwrite=True, method="opd-v", policy="full", rho=1.0,
                          prompts_per_step=min(prompts, cfg.n_opd), max_response_len=cfg.max_response_len))  # fmt: skip
    ids = run.prompt_ids(0)
    records = [run.records[i] for i in ids]
    torch.manual_seed(0)
    ro = generate_rollouts(run.policy, run.student_prompts(records), cfg.rollouts_per_prompt, cfg.max_response_len)
    logp = {}
    for view in run.teacher_views:  # the positive (crop) and negative (masked) teacher, as training builds them
        prompts_v = [run.encode(view, records[j], mix_seed(run.cfg.seed, 0, ids[j])) for j in ro.prompt_index.tolist()]
        inputs, mask, width = micro_batch_inputs(prompts_v, ro, torch.arange(len(ro)), run.ids["pad"], "cpu")
        h = run.teacher.hidden(inputs, width)[mask]
        logp[view] = sampled_logp_from_hidden(h, lm_head_weight(run.teacher.model), ro.response_ids[:, :width][mask])
    w = trust_region(logp["crop"], logp["masked"])  # (P,)
    letter = torch.zeros_like(mask)
    letter[:, 0] = True
    letter = letter[mask]  # the answer letter is each response's first token
    tokenizer = run.processor.tokenizer
    answers = torch.tensor([tokenizer.convert_tokens_to_ids(records[j].answer) for j in ro.prompt_index.tolist()])
    correct = ro.response_ids[:, 0] == answers  # (N,)
    profile = {}
    for name, sel in (("correct letters", correct), ("wrong letters", ~correct)):
        x = w[letter][sel]
        profile[name] = {"n": int(sel.sum()), "positive": float((x > 0).float().mean()), "mean": float(x.mean())}
    x = w[~letter]
    profile["end of message"] = {"n": int(x.numel()), "positive": float((x > 0).float().mean()), "mean": float(x.mean())}
    path.write_text(json.dumps(profile, indent=1) + "\n")
    shutil.rmtree(root / "trust_region_run", ignore_errors=True)
    return profile


# ----------------------------------------------------------------------------- runs


def run_specs(cfg: FamilyConfig) -> list[dict]:
    """Every OPD run: (method, policy, pct, seed), the costliest first."""
    specs = [{"method": m, "policy": p, "pct": pct, "variant": v, "seed": s, "name": f"{m}/{p}-{pct}" + (f"-{v}" if v else "")}
             for s in range(cfg.seeds) for m in METHODS for p, pct, v in KINDS + VARIANTS.get(m, ())]  # fmt: skip
    return sorted(specs, key=lambda s: (-s["pct"], s["method"] != "opd-v", s["seed"]))


def job(cfg: FamilyConfig, spec: dict, root: Path) -> dict:
    """One run as an `opd.toy.experiment` job: the method's paper settings, its base, no audit; eval.py on
    the benchmark in the student's view (the full canvas) and on the crops."""
    from opd.methods import METHODS as TABLE

    world = root / "world"
    train = {
        **TABLE[spec["method"]].settings, "method": spec["method"], "policy": spec["policy"], "rho": spec["pct"] / 100,
        "model": str(root / f"base-{BASE_OF[spec['method']]}"), "data": str(world / "train.jsonl"), "steps": cfg.steps,
        "prompts_per_step": cfg.prompts_per_step, "rollouts_per_prompt": cfg.rollouts_per_prompt,
        "max_prompt_len": 512, "max_response_len": cfg.max_response_len, "lr": cfg.lr, "micro_batch": 64,
        "seed": spec["seed"], "selector_seed": spec["seed"], "replay_start": cfg.replay_start,
        "replay_batch": cfg.replay_batch, "save_every": 0, "keep_checkpoints": 1,
        **VARIANT_SETTINGS.get(spec.get("variant", ""), {}),
    }  # fmt: skip
    return {"spec": spec, "folder": str(run_folder(root, spec)), "train": train, "audit_data": str(world / "audit.jsonl"),
            "eval": {"bench": str(world / "bench"), "batch": cfg.eval_batch, "max_new_tokens": 4}}  # fmt: skip


TRAINED_VIEWS = {"rp-opsd": ("half_resolution",), "opsd": ("reference_answer",)}
"""Views asked of a trained student besides eval.py's (RP-OPSD's own training view; OPSD's teacher view)."""


def trained_views(root: Path, cfg: FamilyConfig) -> None:
    """OUT/runs/.../views.json: a finished run's final policy in TRAINED_VIEWS (greedy, as base_gaps)."""
    from opd.checkpoint import find_checkpoint
    from opd.data import load_records
    from opd.model import load_model, load_processor
    from opd.toy.family import view_accuracy

    records = None
    for spec in run_specs(cfg):
        folder = run_folder(root, spec)
        views = TRAINED_VIEWS.get(spec["method"], ())
        if not views or not (folder / "done.json").exists() or (folder / "views.json").exists():
            continue
        records = records or load_records(root / "eval_records.jsonl")
        policy = str(find_checkpoint(folder) / "policy")
        model, processor = load_model(policy), load_processor(policy)
        acc = {v: view_accuracy(model, processor, records, v, cfg.eval_batch) for v in views}
        (folder / "views.json").write_text(json.dumps(acc) + "\n")


def check_ledger(rows: list[dict], rho: float, policy: str, views: int) -> list[str]:
    """The ledger's arithmetic for a method with `views` teacher views: K = floor(rho |C|), |S| <= K
    (= |C| for full), teacher forward rows = views x |S|, scored tokens <= candidate tokens."""
    problems = []
    for j, r in enumerate(rows):
        budget = int(rho * r["candidates"] + 1e-9)
        if r["step"] != j or r["budget"] != budget or r["selected"] > budget:
            problems.append(f"step {r['step']}: K {r['budget']} (want {budget}), |S| {r['selected']}")
        if policy == "full" and r["selected"] != r["candidates"]:
            problems.append(f"step {r['step']}: full querying selected {r['selected']} of {r['candidates']}")
        if r["teacher_rows"] != views * r["selected"]:
            problems.append(f"step {r['step']}: {r['teacher_rows']} teacher rows for |S| = {r['selected']} x {views} views")
        if not 0 <= r["scored_tokens"] <= r["candidate_tokens"]:
            problems.append(f"step {r['step']}: scored tokens {r['scored_tokens']} vs candidates' {r['candidate_tokens']}")
    return problems


# ----------------------------------------------------------------------------- report


def collect(root: Path, cfg: FamilyConfig) -> dict:
    """{method: {kind: [done records with their ledger summary and checks]}} from the run folders."""
    from opd.ledger import read_ledger, summarize
    from opd.methods import get_method

    runs: dict = {}
    for spec in run_specs(cfg):
        folder = run_folder(root, spec)
        if not (folder / "done.json").exists():
            continue
        rec = json.loads((folder / "done.json").read_text())
        rows = read_ledger(folder / "ledger.jsonl")
        rec["ledger"] = summarize(rows)
        views = len(get_method(spec["method"]).teacher_views)
        rec["ledger_problems"] = check_ledger(rows, spec["pct"] / 100, spec["policy"], views)
        rec["ledger_rows"] = len(rows)
        views = folder / "views.json"
        rec["views"] = json.loads(views.read_text()) if views.exists() else {}
        runs.setdefault(spec["method"], {}).setdefault(spec["name"].split("/")[1], []).append(rec)
    return runs


def kind_label(method: str, kind: str) -> str:
    policy, pct, *variant = kind.split("-")
    if variant:
        return "Full, fixed teacher (--ema-tau 0)"
    if policy == "full":
        return "Full (Vision-OPD)" if method == "bas-opd" else "Full (as published)"
    return f"{policy.capitalize()}-{pct}" + (" (BAS-OPD)" if method == "bas-opd" and policy == "learned" else "")


def plots(root: Path, runs: dict, gaps: dict) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = [m for m in METHODS if m in runs]
    if not methods:
        return []
    fig, axes = plt.subplots(1, len(methods), figsize=(3.2 * len(methods), 3.6), sharey=True, squeeze=False)
    for ax, m in zip(axes[0], methods):
        g, kinds = gaps[BASE_OF[m]], kinds_of(m)
        acc = [np.array([r["full"] for r in runs[m].get(k, [])]) for k in kinds]
        ax.bar(range(len(kinds)), [a.mean() if a.size else 0 for a in acc], yerr=[a.std(ddof=1) if a.size > 1 else 0 for a in acc],
               capsize=3, color=["tab:blue", "tab:gray", "tab:orange", "tab:purple"][: len(kinds)])
        ax.axhline(g["full"], ls=":", color="k", lw=1, label="base, student's eval view")
        ax.axhline(g[PRIVILEGED[m]], ls="--", color="tab:red", lw=1, label="base, teacher's view")
        if PLAIN[m] != "full":
            ax.axhline(g[PLAIN[m]], ls="-.", color="tab:green", lw=1, label="base, student's training view")
        ax.set_xticks(range(len(kinds)), ["Full", "Random-25", "Learned-25", "Full,\nfixed teacher"][: len(kinds)], fontsize=8)
        ax.set_title(NAMES[m], fontsize=9)
        ax.legend(fontsize=6, loc="lower right")
    axes[0][0].set_ylabel("accuracy on the full canvas (%)")
    fig.suptitle("The seed family in the toy world: accuracy after training (mean ± std over seeds)", fontsize=9)
    fig.tight_layout()
    fig.savefig(root / "family_accuracy.png", dpi=130)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5.4, 3.8))
    for m in methods:
        for k, marker in zip(kinds_of(m), ("o", "s", "^", "D")):
            rs = runs[m].get(k, [])
            if rs:
                x = np.mean([r["ledger"]["teacher_forward_s"] for r in rs])
                y = np.array([r["full"] for r in rs])
                ax.errorbar([x], [y.mean()], yerr=[y.std(ddof=1) if y.size > 1 else 0], fmt=marker, capsize=3,
                            color=f"C{methods.index(m)}", label=f"{NAMES[m]} {kind_label(m, k)}")
    ax.set_xlabel("teacher forward time per run (s, all teacher views)")
    ax.set_ylabel("accuracy on the full canvas (%)")
    ax.legend(fontsize=6, ncol=2)
    ax.set_title("Accuracy vs teacher time", fontsize=9)
    fig.tight_layout()
    fig.savefig(root / "family_cost.png", dpi=130)
    plt.close(fig)
    return ["family_accuracy.png", "family_cost.png"]


def report(root: Path, cfg: FamilyConfig, timing: dict, command: str) -> str:
    runs, gaps = collect(root, cfg), json.loads((root / "base_gaps.json").read_text())
    files = plots(root, runs, gaps)
    n_rows = sum(r["ledger_rows"] for m in runs.values() for rs in m.values() for r in rs)
    problems = [f"{r['name']} seed {r['seed']}: {p}" for m in runs.values() for rs in m.values() for r in rs
                for p in r["ledger_problems"]]  # fmt: skip
    lines = [
        "# The seed family in the toy world", "",
        f"Command: `{command}`; {cfg.seeds} seeds; {cfg.steps} steps of {cfg.prompts_per_step} prompts x "
        f"{cfg.rollouts_per_prompt} rollouts; lr {cfg.lr}; wall time {timing.get('total_s', 0):.0f} s on this machine "
        f"({timing.get('invocations', 1)} invocation(s)).", "",
        "## The bases: privileged-minus-plain gap", "",
        "Greedy accuracy (%) on the held-out items in each view, built as training builds it.", "",
        "| Base (its methods) | Views: accuracy | Teacher's view - student's training view |",
        "| --- | --- | ---: |",
    ]  # fmt: skip
    for signal, views in gaps.items():
        ms = [m for m in METHODS if BASE_OF[m] == signal]
        acc = ", ".join(f"{v} {a:.1f}" for v, a in views.items())
        gap = views[PRIVILEGED[ms[0]]] - views[PLAIN[ms[0]]]
        lines.append(f"| {signal} ({', '.join(NAMES[m] for m in ms)}) | {acc} | {gap:+.1f} |")
    lines += ["", "## Accuracy after training and teacher cost", "",
              "Accuracy: eval.py on the held-out benchmark in the student's view at the original resolution (the full "
              "canvas), mean ± std over seeds. Teacher calls = |S| summed over steps (rows, the budget's unit); "
              "forwards = teacher forward rows over all teacher views; scored tokens = sum of T_i over S.", "",
              "| Method | Run | Accuracy (%) | Crop view (%) | Other views (%) | Teacher calls | Teacher forwards | "
              "Scored tokens | Tokens vs Full | Teacher forward (s) | Step (s) |",
              "| --- | --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for m in METHODS:
        full_tok = {r["seed"]: r["ledger"]["scored_tokens"] for r in runs.get(m, {}).get("full-100", [])}
        for kind in kinds_of(m):
            rs = runs.get(m, {}).get(kind, [])
            if not rs:
                continue
            led = [r["ledger"] for r in rs]
            ratio = [100 * r["ledger"]["scored_tokens"] / full_tok[r["seed"]] for r in rs if full_tok.get(r["seed"])]
            crop = _ms([r.get("crop") for r in rs]) if BASE_OF[m] == "crop" else "-"
            other = ", ".join(f"{v} {_ms([r['views'].get(v) for r in rs])}" for v in TRAINED_VIEWS.get(m, ())) or "-"
            lines.append(
                f"| {NAMES[m]} | {kind_label(m, kind)} | {_ms([r['full'] for r in rs])} | {crop} | {other} | "
                f"{np.mean([x['calls'] for x in led]):,.0f} | "
                f"{np.mean([sum(t['rows'] for t in x['teachers'].values()) for x in led]):,.0f} | "
                f"{np.mean([x['scored_tokens'] for x in led]):,.0f} | {_ms(ratio)}% | "
                f"{_ms([x['teacher_forward_s'] for x in led])} | {_ms([x['step_s'] for x in led])} |")
    profile = json.loads((root / "trust_region.json").read_text())
    lines += ["", "## OPD-V's token weight on the crop base", "",
              "w_t = ReLU(log pi_T+(y_t) - log pi_T-(y_t)) on the crop base's own rollouts (step 0): the share of "
              "tokens with w_t > 0 and the mean w_t.", "", "| Tokens | n | w > 0 | mean w |", "| --- | ---: | ---: | ---: |"]
    lines += [f"| {k} | {v['n']} | {100 * v['positive']:.1f}% | {v['mean']:.3f} |" for k, v in profile.items()]
    lines += ["", f"Ledger arithmetic checked on {n_rows:,} rows: " + ("all hold." if not problems else
              f"{len(problems)} problems: " + "; ".join(problems[:10])), "", "## Plots", ""]
    lines += [f"![{f}]({f})" for f in files]
    text = "\n".join(lines) + "\n"
    (root / "report.md").write_text(text)
    (root / "report.json").write_text(json.dumps({"gaps": gaps, "timing": timing, "runs": runs}, indent=1, default=str) + "\n")
    return text


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> str:
    cfg = parse(FamilyConfig, PRESETS, __doc__.split("\n")[0], argv)
    quiet()
    from opd.toy.sft import train_base
    from opd.toy.world import export_world

    root = Path(cfg.out)
    root.mkdir(parents=True, exist_ok=True)
    command = ".venv/bin/python experiments/family.py " + " ".join(sys.argv[1:] if argv is None else argv)
    timing = Timing(root)
    with timing.phase("bases_s"):
        say(f"world -> {root / 'world'}")
        export_world(root / "world", world_config(cfg))
        for signal, (sft, task) in base_configs(cfg).items():
            say(f"base '{signal}' ({sft.steps} supervised steps) -> {root / f'base-{signal}'}")
            train_base(root / f"base-{signal}", world_config(cfg), sft, log=lambda msg: say(msg), task=task)
        base_gaps(root, cfg)
        trust_region_profile(root, cfg)
    with timing.phase("runs_s"):
        specs = run_specs(cfg)
        todo = [s for s in specs if not (run_folder(root, s) / "done.json").exists()]
        say(f"{len(specs)} OPD runs, {len(specs) - len(todo)} already done, {cfg.jobs} at a time")
        run_jobs([job(cfg, s, root) for s in todo], cfg.jobs)
        trained_views(root, cfg)
    text = report(root, cfg, timing.save(), command)
    say(f"report -> {root / 'report.md'} ({timing.total['total_s']:.0f} s in all)")
    return text


if __name__ == "__main__":
    main()
