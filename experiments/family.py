"""The seed family side by side in the toy world: Vision-OPD / BAS-OPD, OPD-V, RP-OPSD, OPSD, DAPD and OPOD.

    .venv/bin/python experiments/family.py --out runs/family                 # 3 seeds; hours on 2 shared cores (a DAPD run ~30 min)
    .venv/bin/python experiments/family.py --out runs/family-smoke --smoke   # one seed, a few steps (the test)

1. The world of experiments/toy.py (`opd.toy.world`), and three base models (`harness.family`), one per
   privileged signal: `crop` (trained on crops: BAS-OPD, Vision-OPD, OPD-V), `resolution` (trained on
   full canvases at their native 64 x 64 pixels: RP-OPSD, whose student sees them at 32 x 32) and `text`
   (trained on crops and on hinted full images: OPSD and DAPD, whose reference context is the same hint). OPOD
   trains the crop base with two external teachers routed by the record's `shape` (`opod_routes`): squares and
   triangles to the resolution base (the full canvas at its native 64 x 64 pixels: a stronger teacher of the
   student's own input), diamonds to the crop base itself (the student's initial weights: no better than it).
2. Each base's privileged-minus-plain gap: greedy accuracy on the held-out items in every view its
   methods use, built as training builds them (`harness.family.view_accuracy`).
3. For each method, Full querying (the method as published), Random-25 and Learned-25 (BAS-OPD's
   budget on top), over `--seeds` seeds, through `opd.run.Run` with the method's paper settings; each run is
   scored by eval.py on the held-out benchmark in the student's view at the original resolution (the
   full canvas) and, for the crop methods, on the crops (the teacher's pathway); OPSD's and DAPD's trained
   students also with the hint (the privilege illusion), RP-OPSD's at half resolution, OPOD's per route. Extra
   runs (`VARIANTS`): RP-OPSD with a fixed teacher; OPOD without its policy-gradient term (its reward reads the
   record's answer, which no other method's student is trained on).
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

from harness.entry import Entry, sft_config, world_config  # noqa: E402
from harness.experiment import run_folder, say  # noqa: E402
from harness.report import _pyplot, save_figure, write_report  # noqa: E402
from harness.report import mean_std as _ms  # noqa: E402
from opd.loop.ledger import write_atomic  # noqa: E402

METHODS = ("bas-opd", "opd-v", "rp-opsd", "opsd", "dapd", "opod")
"""The methods run; Vision-OPD is BAS-OPD with every candidate queried (its Full row)."""
BASE_OF = {"bas-opd": "crop", "opd-v": "crop", "rp-opsd": "resolution", "opsd": "text", "dapd": "text", "opod": "crop"}
VIEWS_OF = {"crop": ("full", "crop", "masked"), "resolution": ("full", "half_resolution"), "text": ("full", "reference_answer")}
"""The views each base is asked in for its gap (the first is the student's plain view)."""
PRIVILEGED = {"bas-opd": "crop", "opd-v": "crop", "rp-opsd": "full", "opsd": "reference_answer", "dapd": "reference_answer",
              "opod": "full"}  # fmt: skip
"""The teacher's view (OPOD: its external teachers see the student's own view, the full canvas)."""
PLAIN = {"bas-opd": "full", "opd-v": "full", "rp-opsd": "half_resolution", "opsd": "full", "dapd": "full", "opod": "full"}
OPOD_ROUTES = {"square": "resolution", "triangle": "resolution", "diamond": "crop"}
"""OPOD's routing table: a record's `shape` -> the base whose checkpoint is that route's teacher (`opod_routes`)."""
KINDS = (("full", 100, ""), ("random", 25, ""), ("learned", 25, ""))
VARIANTS = {"rp-opsd": (("full", 100, "frozen"),), "opod": (("full", 100, "no-pg"),),
            "opsd": (("full", 100, "recipe"),), "dapd": (("full", 100, "recipe"),)}  # fmt: skip
"""Extra runs of a method: RP-OPSD with a fixed teacher, which tells the EMA teacher's drift from the rest; OPOD
without its policy-gradient term, which tells its teachers' share from the reward's (r_task reads the answer); OPSD
and DAPD with their published recipes (`opd.methods.table.Method.recipe`: LoRA r 64, their sampling, learning rate and
schedule), where every other run here keeps the family's full fine-tuning at one learning rate for comparability."""
VARIANT_SETTINGS = {"frozen": {"ema_tau": 0.0}, "no-pg": {"opod_pg_weight": 0.0}}
VARIANT_LABELS = {"frozen": ("Full, fixed teacher (--ema-tau 0)", "Full,\nfixed teacher"),
                  "no-pg": ("Full, no policy gradient (--opod-pg-weight 0)", "Full,\nno PG"),
                  "recipe": ("Full, the published recipe (LoRA r 64, its sampling, lr and schedule)", "Full,\nits recipe")}  # fmt: skip
"""(table label, plot tick) of each variant."""


def kinds_of(method: str) -> list[str]:
    """The run kinds of a method: 'full-100', 'random-25', 'learned-25', then its variants ('full-100-frozen')."""
    return ["-".join(str(x) for x in k if x != "") for k in KINDS + VARIANTS.get(method, ())]
NAMES = {"bas-opd": "Vision-OPD / BAS-OPD", "opd-v": "OPD-V", "rp-opsd": "RP-OPSD", "opsd": "OPSD", "dapd": "DAPD",
         "opod": "OPOD"}  # fmt: skip


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
    skip: str = ""
    """Runs not trained by this invocation, comma-separated: a name (`dapd/learned-25`, every seed) or one seed
    (`dapd/learned-25/seed1`); their finished runs are still reported (what a time limit cut, said in the report)."""
    only: str = ""
    """When set, the only runs this invocation trains, comma-separated names or name/seedK as for --skip (the rest is
    reported if finished): e.g. `opsd/full-100-recipe,dapd/full-100-recipe`."""


SMOKE = dict(seeds=1, steps=2, prompts_per_step=2, rollouts_per_prompt=4, replay_start=4, replay_batch=16, jobs=1,
             n_opd=16, n_audit=8, n_eval=16, sft_steps=4, signal_sft_steps=4, sft_batch=4, eval_batch=16,
             out="runs/family-smoke")  # fmt: skip
PRESETS = {"default": {}, "smoke": SMOKE}


# ----------------------------------------------------------------------------- world and bases


def base_configs(cfg: FamilyConfig) -> dict:
    """(SFTConfig, task) of each privileged signal's base."""
    from harness.family import HINT

    sft = sft_config(cfg)
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
    from opd.data.sources import load_records
    from opd.models.loading import load_model, load_processor
    from harness.family import view_accuracy, write_eval_records

    records = load_records(write_eval_records(root / "world", world_config(cfg), root / "eval_records.jsonl"))
    gaps = {}
    for signal, views in VIEWS_OF.items():
        model, processor = load_model(str(root / f"base-{signal}")), load_processor(str(root / f"base-{signal}"))
        gaps[signal] = {v: view_accuracy(model, processor, records, v, cfg.eval_batch) for v in views}
        say(f"base {signal}: " + ", ".join(f"{v} {a:.1f}%" for v, a in gaps[signal].items()))
    write_atomic(path, json.dumps(gaps, indent=1) + "\n")
    return gaps


def opod_routes(root: Path) -> Path:
    """OUT/opod_route.json, OPOD's `--teachers` table (`opd.models.external_teachers`): the record field `shape` routed to the
    base checkpoints of OPOD_ROUTES (paths relative to OUT)."""
    path = root / "opod_route.json"
    spec = {"field": "shape", "teachers": {shape: f"base-{base}" for shape, base in OPOD_ROUTES.items()}}
    write_atomic(path, json.dumps(spec, indent=1) + "\n")
    return path


def shape_of(problem: str) -> str:
    """The target's shape named by a toy question ("What colour is the small <shape>?")."""
    return problem.split("small ", 1)[1].split("?", 1)[0]


def route_gaps(root: Path, cfg: FamilyConfig) -> dict:
    """{shape: {base: accuracy %}}: greedy accuracy in the full view on the held-out items of each shape, of the
    student's base (crop) and each OPOD teacher's base, each through its own processor. Cached in
    OUT/route_gaps.json."""
    path = root / "route_gaps.json"
    if path.exists():
        return json.loads(path.read_text())
    from opd.data.sources import load_records
    from opd.models.loading import load_model, load_processor
    from harness.family import view_accuracy

    records = load_records(root / "eval_records.jsonl")
    out: dict = {shape: {} for shape in OPOD_ROUTES}
    for base in dict.fromkeys([BASE_OF["opod"], *OPOD_ROUTES.values()]):
        model, processor = load_model(str(root / f"base-{base}")), load_processor(str(root / f"base-{base}"))
        for shape in OPOD_ROUTES:
            group = [r for r in records if shape_of(r.problem) == shape]
            out[shape][base] = view_accuracy(model, processor, group, "full", cfg.eval_batch) if group else float("nan")
    write_atomic(path, json.dumps(out, indent=1) + "\n")
    return out


def trust_region_profile(root: Path, cfg: FamilyConfig, prompts: int = 16) -> dict:
    """OPD-V's token weight on the crop base's own rollouts of `prompts` training prompts (step 0, seed 0):
    share of positive weights and mean weight at the answer letter, for correct and wrong letters, and at
    <|im_end|>. Cached in OUT/trust_region.json."""
    path = root / "trust_region.json"
    if path.exists():
        return json.loads(path.read_text())
    import torch

    from opd.maths.chunked import sampled_logp_from_hidden
    from opd.config import TrainConfig
    from opd.methods.objective import micro_batch_inputs
    from opd.models.hidden import lm_head_weight
    from opd.run import Run
    from opd.engine.rollout import generate_rollouts
    from opd.engine.rollout import mix_seed
    from opd.maths.weights import trust_region

    run = Run(TrainConfig(model=str(root / "base-crop"), data=str(root / "world" / "train.jsonl"),
                          out=str(root / "trust_region_run"), overwrite=True, method="opd-v", policy="full", rho=1.0,
                          prompts_per_step=min(prompts, cfg.n_opd), max_response_len=cfg.max_response_len))  # fmt: skip
    ids = run.prompts.ids(0)
    records = [run.records[i] for i in ids]
    torch.manual_seed(0)
    ro = generate_rollouts(run.model, run.prompts.student(records), cfg.rollouts_per_prompt, cfg.max_response_len)
    logp = {}
    for view in run.teacher_views:  # the positive (crop) and negative (masked) teacher, as training builds them
        prompts_v = [run.prompts.encode(view, records[j], mix_seed(run.cfg.run.seed, 0, ids[j])) for j in ro.prompt_index.tolist()]
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
    write_atomic(path, json.dumps(profile, indent=1) + "\n")
    shutil.rmtree(root / "trust_region_run", ignore_errors=True)
    return profile


# ----------------------------------------------------------------------------- runs


def run_specs(cfg: FamilyConfig) -> list[dict]:
    """Every OPD run: (method, policy, pct, seed), the costliest first (Full, then Random-25 of every seed, then
    Learned-25)."""
    specs = [{"method": m, "policy": p, "pct": pct, "variant": v, "seed": s, "name": f"{m}/{p}-{pct}" + (f"-{v}" if v else "")}
             for s in range(cfg.seeds) for m in METHODS for p, pct, v in KINDS + VARIANTS.get(m, ())]  # fmt: skip
    return sorted(specs, key=lambda s: (-s["pct"], s["policy"] == "learned", s["method"] != "opd-v", s["seed"]))


def job(cfg: FamilyConfig, spec: dict, root: Path) -> dict:
    """One run as an `harness.experiment` job: the method's paper settings, its base, no audit; eval.py on
    the benchmark in the student's view (the full canvas) and on the crops."""
    from opd.methods.table import METHODS as TABLE

    world = root / "world"
    train = {
        **TABLE[spec["method"]].settings, "method": spec["method"], "policy": spec["policy"], "rho": spec["pct"] / 100,
        "model": str(root / f"base-{BASE_OF[spec['method']]}"), "data": str(world / "train.jsonl"), "steps": cfg.steps,
        "prompts_per_step": cfg.prompts_per_step, "rollouts_per_prompt": cfg.rollouts_per_prompt,
        "max_prompt_len": 512, "max_response_len": cfg.max_response_len, "lr": cfg.lr, "micro_batch": 64,
        "seed": spec["seed"], "selector_seed": spec["seed"], "replay_start": cfg.replay_start,
        "replay_batch": cfg.replay_batch, "save_every": 0, "keep_checkpoints": 1,
        **VARIANT_SETTINGS.get(spec.get("variant", ""), {}),
        **(TABLE[spec["method"]].recipe if spec.get("variant") == "recipe" else {}),  # its lr too, over the family's
        **({"teachers": str(root / "opod_route.json")} if spec["method"] == "opod" else {}),
    }  # fmt: skip
    return {"spec": spec, "folder": str(run_folder(root, spec)), "train": train, "audit_data": str(world / "audit.jsonl"),
            "eval": {"bench": str(world / "bench"), "batch": cfg.eval_batch, "max_new_tokens": 4}}  # fmt: skip


TRAINED_VIEWS = {"rp-opsd": ("half_resolution",), "opsd": ("reference_answer",), "dapd": ("reference_answer",)}
"""Views asked of a trained student besides eval.py's (RP-OPSD's own training view; OPSD's and DAPD's hinted view)."""


def trained_views(root: Path, cfg: FamilyConfig) -> None:
    """OUT/runs/.../views.json: a finished run's final policy in TRAINED_VIEWS (greedy, as base_gaps)."""
    from opd.run_folder import find_checkpoint
    from opd.data.sources import load_records
    from opd.models.loading import load_model, load_processor
    from harness.family import view_accuracy

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
        write_atomic(folder / "views.json", json.dumps(acc) + "\n")


def teacher_rows_problem(r: dict, method: str, views: int) -> str | None:
    """Whether a ledger row's teacher forward rows are the method's count for its |S|: `views` x |S| for the
    distillation methods; DAPD six anchor forwards per row (one per pair); OPOD, per teacher, one distillation
    and one verification forward per row and one answer forward per prompt (at most |S|, and the labels add up)."""
    s, rows = r["selected"], r["teacher_rows"]
    if s == 0:
        return None if rows == 0 else f"{rows} teacher rows for an empty S"
    if method == "dapd":
        return None if rows == 6 * s else f"{rows} anchor rows for |S| = {s} x 6 pairs"
    if method == "opod":
        kind = {k: sum(v for lab, v in r.items() if lab.startswith("teacher_rows_") and lab.endswith(f":{k}"))
                for k in ("full", "verify", "answer")}  # fmt: skip
        if kind["full"] != s or kind["verify"] != s or not 0 < kind["answer"] <= s or rows != sum(kind.values()):
            return f"{rows} teacher rows ({kind}) for |S| = {s}"
        return None
    return None if rows == views * s else f"{rows} teacher rows for |S| = {s} x {views} views"


def check_ledger(rows: list[dict], rho: float, policy: str, views: int, method: str = "") -> list[str]:
    """The ledger's arithmetic for a method with `views` teacher views: K = floor(rho |C|), |S| <= K
    (= |C| for full), teacher forward rows as `teacher_rows_problem` wants, scored tokens <= candidate tokens."""
    problems = []
    for j, r in enumerate(rows):
        budget = int(rho * r["candidates"] + 1e-9)
        if r["step"] != j or r["budget"] != budget or r["selected"] > budget:
            problems.append(f"step {r['step']}: K {r['budget']} (want {budget}), |S| {r['selected']}")
        if policy == "full" and r["selected"] != r["candidates"]:
            problems.append(f"step {r['step']}: full querying selected {r['selected']} of {r['candidates']}")
        wrong = teacher_rows_problem(r, method, views)
        if wrong:
            problems.append(f"step {r['step']}: {wrong}")
        if not 0 <= r["scored_tokens"] <= r["candidate_tokens"]:
            problems.append(f"step {r['step']}: scored tokens {r['scored_tokens']} vs candidates' {r['candidate_tokens']}")
    return problems


# ----------------------------------------------------------------------------- report


def collect(root: Path, cfg: FamilyConfig) -> dict:
    """{method: {kind: [done records with their ledger summary and checks]}} from the run folders."""
    from opd.loop.ledger import read_ledger, summarize
    from opd.methods.table import get_method

    runs: dict = {}
    for spec in run_specs(cfg):
        folder = run_folder(root, spec)
        if not (folder / "done.json").exists():
            continue
        rec = json.loads((folder / "done.json").read_text())
        rows = read_ledger(folder / "ledger.jsonl")
        rec["ledger"] = summarize(rows)
        views = len(get_method(spec["method"]).teacher_views)
        rec["ledger_problems"] = check_ledger(rows, spec["pct"] / 100, spec["policy"], views, spec["method"])
        rec["ledger_rows"] = len(rows)
        views = folder / "views.json"
        rec["views"] = json.loads(views.read_text()) if views.exists() else {}
        if spec["method"] == "opod":
            rec["routes"] = opod_route_stats(folder, rows)
        runs.setdefault(spec["method"], {}).setdefault(spec["name"].split("/")[1], []).append(rec)
    return runs


def opod_route_stats(folder: Path, rows: list[dict]) -> dict:
    """Per route (shape) of an OPOD run: eval.py's accuracy on the benchmark items of that shape (from its
    predictions), the final beta and the mean gate over the steps that had tokens of the route."""
    preds = [json.loads(line) for line in (folder / "eval" / "zoombench" / "predictions.jsonl").read_text().splitlines()]
    out = {}
    for shape in OPOD_ROUTES:
        mine = [p["correct"] for p in preds if p["category"] == shape]
        gates = [r[f"gate_mean_{shape}"] for r in rows if np.isfinite(r.get(f"gate_mean_{shape}", float("nan")))]
        out[shape] = {"accuracy": 100.0 * np.mean(mine) if mine else float("nan"), "beta": rows[-1].get(f"beta_{shape}"),
                      "gate": float(np.mean(gates)) if gates else float("nan")}  # fmt: skip
    return out


def kind_label(method: str, kind: str) -> str:
    policy, pct, *variant = kind.split("-")
    if variant:
        return VARIANT_LABELS["-".join(variant)][0]
    if policy == "full":
        return "Full (Vision-OPD)" if method == "bas-opd" else "Full (as published)"
    return f"{policy.capitalize()}-{pct}" + (" (BAS-OPD)" if method == "bas-opd" and policy == "learned" else "")


def plots(root: Path, runs: dict, gaps: dict) -> list[str]:
    plt = _pyplot()
    methods = [m for m in METHODS if m in runs]
    if not methods:
        return []
    cols = min(4, len(methods))
    n_rows = -(-len(methods) // cols)
    fig, axes = plt.subplots(n_rows, cols, figsize=(3.2 * cols, 3.6 * n_rows), sharey=True, squeeze=False)
    for ax in axes.flat[len(methods):]:
        ax.axis("off")
    for ax, m in zip(axes.flat, methods):
        g, kinds = gaps[BASE_OF[m]], kinds_of(m)
        acc = [np.array([r["full"] for r in runs[m].get(k, [])]) for k in kinds]
        ax.bar(range(len(kinds)), [a.mean() if a.size else 0 for a in acc], yerr=[a.std(ddof=1) if a.size > 1 else 0 for a in acc],
               capsize=3, color=["tab:blue", "tab:gray", "tab:orange", "tab:purple"][: len(kinds)])
        for j, a in enumerate(acc):
            if not a.size:
                ax.text(j, 2, "not run", ha="center", fontsize=7, rotation=90)
        ax.axhline(g["full"], ls=":", color="k", lw=1, label="base, student's eval view")
        if m == "opod":  # external teachers: the resolution base on the full canvas at 64 px
            ax.axhline(gaps["resolution"]["full"], ls="--", color="tab:red", lw=1, label="resolution teacher (2 of 3 routes)")
        else:
            ax.axhline(g[PRIVILEGED[m]], ls="--", color="tab:red", lw=1, label="base, teacher's view")
        if PLAIN[m] != "full":
            ax.axhline(g[PLAIN[m]], ls="-.", color="tab:green", lw=1, label="base, student's training view")
        ticks = ["Full", "Random-25", "Learned-25"] + [VARIANT_LABELS[k[2]][1] for k in VARIANTS.get(m, ())]
        ax.set_xticks(range(len(kinds)), ticks, fontsize=8)
        ax.set_title(NAMES[m], fontsize=9)
        ax.legend(fontsize=6, loc="lower right")
    for row in axes:
        row[0].set_ylabel("accuracy on the full canvas (%)")
    fig.suptitle("The seed family in the toy world: accuracy after training (mean ± std over seeds)", fontsize=9)
    fig.tight_layout()
    save_figure(fig, root / "family_accuracy.png", dpi=130)

    fig, ax = plt.subplots(figsize=(8.6, 4.2))
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
    ax.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.01, 0.5))  # outside: 20 runs' labels
    ax.set_title("Accuracy vs teacher time", fontsize=9)
    fig.tight_layout()
    save_figure(fig, root / "family_cost.png", dpi=130)
    return ["family_accuracy.png", "family_cost.png"]


def _digits(values, digits: int) -> str:
    """'mean ± std' with `digits` decimals (std with n - 1), the mean alone for one value, '-' for none."""
    v = np.asarray([x for x in values if x is not None and np.isfinite(x)], dtype=float)
    if v.size == 0:
        return "-"
    return f"{v.mean():.{digits}f} ± {v.std(ddof=1):.{digits}f}" if v.size > 1 else f"{v.mean():.{digits}f}"


ILLUSION_HINTED = 90.0
"""A trained student 'reads the hint' when its hinted accuracy is at least this (%)."""


def illusion_section(runs: dict, gaps: dict) -> list[str]:
    """The privilege illusion (the student imitating answers it cannot see): a trained student of the hint base
    that answers well with the hint (>= ILLUSION_HINTED) but worse without it than the base did."""
    base = gaps["text"]
    lines = ["", "## The privilege illusion: OPSD and DAPD on the hint base", "",
             f"The hint base answers {base['full']:.1f}% without the hint and {base['reference_answer']:.1f}% with it. "
             f"A run shows the illusion when its trained student answers >= {ILLUSION_HINTED:.0f}% with the hint and "
             "below the base without it (greedy, the held-out items; mean ± std over seeds).", "",
             "| Method | Run | Without the hint (%) | With the hint (%) | Without - base (points) | Runs with the illusion |",
             "| --- | --- | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for m in ("opsd", "dapd"):
        for kind in kinds_of(m):
            rs = runs.get(m, {}).get(kind, [])
            if not rs:
                continue
            plain, hinted = [r["full"] for r in rs], [r["views"].get("reference_answer", float("nan")) for r in rs]
            ill = sum(h >= ILLUSION_HINTED and p < base["full"] for p, h in zip(plain, hinted))
            lines.append(f"| {NAMES[m]} | {kind_label(m, kind)} | {_ms(plain)} | {_ms(hinted)} | "
                         f"{_ms([p - base['full'] for p in plain])} | {ill} of {len(rs)} |")  # fmt: skip
    return lines


def opod_section(runs: dict, route_acc: dict) -> list[str]:
    """OPOD per route: the teacher's and the student base's accuracy on that shape's items, the trained students'
    (eval.py's predictions), and the controller's strength and the mean gate in the Full runs."""
    rs = runs.get("opod", {})
    if not rs:
        return []
    kinds = [k for k in kinds_of("opod") if rs.get(k)]
    full = rs.get("full-100", [])
    lines = ["", "## OPOD's routes", "",
             "Each record's `shape` routes its rows to a teacher (OUT/opod_route.json). Accuracy (%) on the held-out "
             "items of that shape in the full view: the teacher's and the student base's (greedy, each through its own "
             "processor), then the trained students' (eval.py). beta: the route's strength at the last step; gate: "
             "mean c_t over the steps with tokens of the route (Full runs).", "",
             "| Route (shape) | Teacher | Teacher (%) | Student base (%) | "
             + " | ".join(kind_label("opod", k) for k in kinds) + " | beta (Full) | gate (Full) |",
             "| --- | --- | ---: | ---: | " + " | ".join("---:" for _ in kinds) + " | ---: | ---: |"]  # fmt: skip
    for shape, base in OPOD_ROUTES.items():
        teacher = "crop base (the student's own base)" if base == BASE_OF["opod"] else f"{base} base"
        accs = " | ".join(_ms([r["routes"][shape]["accuracy"] for r in rs[k]]) for k in kinds)
        lines.append(f"| {shape} | {teacher} | {route_acc[shape][base]:.1f} | {route_acc[shape][BASE_OF['opod']]:.1f} | "
                     f"{accs} | {_digits([r['routes'][shape]['beta'] for r in full], 3)} | "
                     f"{_digits([r['routes'][shape]['gate'] for r in full], 4)} |")  # fmt: skip
    return lines


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
              "forwards = teacher forward rows over all teacher views; scored tokens = sum of T_i over S. Every run keeps "
              "the family's full fine-tuning, learning rate and plain sampling for comparability (each method's paper "
              "settings, `opd.methods.table.Method.settings`), but the 'published recipe' runs, which add the method's own "
              "recipe (`Method.recipe`: LoRA, sampling, lr, schedule).", "",
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
            if m == "opod":
                other = ", ".join(f"{shape} {_ms([r['routes'][shape]['accuracy'] for r in rs])}" for shape in OPOD_ROUTES)
            lines.append(
                f"| {NAMES[m]} | {kind_label(m, kind)} | {_ms([r['full'] for r in rs])} | {crop} | {other} | "
                f"{np.mean([x['calls'] for x in led]):,.0f} | "
                f"{np.mean([sum(t['rows'] for t in x['teachers'].values()) for x in led]):,.0f} | "
                f"{np.mean([x['scored_tokens'] for x in led]):,.0f} | {_ms(ratio)}% | "
                f"{_ms([x['teacher_forward_s'] for x in led])} | {_ms([x['step_s'] for x in led])} |")
    lines += illusion_section(runs, gaps) + opod_section(runs, json.loads((root / "route_gaps.json").read_text()))
    profile = json.loads((root / "trust_region.json").read_text())
    lines += ["", "## OPD-V's token weight on the crop base", "",
              "w_t = ReLU(log pi_T+(y_t) - log pi_T-(y_t)) on the crop base's own rollouts (step 0): the share of "
              "tokens with w_t > 0 and the mean w_t.", "", "| Tokens | n | w > 0 | mean w |", "| --- | ---: | ---: | ---: |"]
    lines += [f"| {k} | {v['n']} | {100 * v['positive']:.1f}% | {v['mean']:.3f} |" for k, v in profile.items()]
    missing = [f"{s['name']} seed {s['seed']}" for s in run_specs(cfg) if not (run_folder(root, s) / "done.json").exists()]
    lines += ["", f"Ledger arithmetic checked on {n_rows:,} rows: " + ("all hold." if not problems else
              f"{len(problems)} problems: " + "; ".join(problems[:10]))]
    if missing:
        lines += ["", f"Not trained (left out by --skip or unfinished): {', '.join(missing)}."]
    lines += ["", "## Plots", ""]
    lines += [f"![{f}]({f})" for f in files]
    return write_report(root, "\n".join(lines) + "\n", {"gaps": gaps, "timing": timing, "runs": runs})


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> str:
    entry = Entry.start(FamilyConfig, PRESETS, argv, __doc__, ".venv/bin/python experiments/family.py")
    cfg, root = entry.cfg, entry.root
    entry.world(world_config(cfg), phase="bases_s")
    for signal, (sft, task) in base_configs(cfg).items():
        entry.base(world_config(cfg), sft, folder=f"base-{signal}", task=task, phase="bases_s",
                   what=f"base '{signal}' ({sft.steps} supervised steps)")
    with entry.phase("bases_s"):
        base_gaps(root, cfg)
        trust_region_profile(root, cfg)
        opod_routes(root)
        route_gaps(root, cfg)
    skip = {n.strip() for n in cfg.skip.split(",") if n.strip()}
    only = {n.strip() for n in cfg.only.split(",") if n.strip()}

    def left_out(j) -> bool:
        names = {j["spec"]["name"], f"{j['spec']['name']}/seed{j['spec']['seed']}"}
        return bool(names & skip) or bool(only and not names & only)

    entry.runs([job(cfg, s, root) for s in run_specs(cfg)], cfg.jobs, reused="already done or skipped", skip=left_out)
    with entry.phase("runs_s"):
        trained_views(root, cfg)
    return entry.finish(report)


if __name__ == "__main__":
    from opd.cli import run_cli

    run_cli(main, sys.argv[1:], "family.py")
