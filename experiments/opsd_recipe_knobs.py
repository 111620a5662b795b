"""OPSD's published recipe with one knob at a time set back to the family's paper settings (issue 19's question:
which of the recipe's knobs costs the points in the toy world, docs/FAMILY.md "The published recipes").

Reuses a finished `experiments/family.py` folder (its world, hint base and benchmark): each run is the family's
`opsd/full-100-recipe` job with one change, trained and scored by the same `harness.experiment.train_one`, into
OUT/runs/opsd-knobs/<knob>/seed<k>/. `recipe` is the unchanged recipe (the control: it must reproduce the family's
own run of that seed). Resumable: a finished run (done.json) is kept.

    .venv/bin/python experiments/opsd_recipe_knobs.py --out runs/family --seeds 1
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

KNOBS = {
    "recipe": {},
    "plain-sampling": {"sample_temperature": 1.0, "sample_top_p": 1.0, "sample_top_k": 0, "loss_temperature": 1.0},
    "token-mean": {"loss_agg": "token-mean"},
    "top100-renorm": {"support": "teacher_renorm"},
    "full-ft": {"lora_r": 0, "lr": None},  # lr None: the family's; the other LoRA flags back to their defaults
    "lora-lr-2e-3": {"lr": 2e-3},
    "lora-all-linear": {"lora_targets": "default"},  # opd.models.settings.DEFAULT_TARGETS: the linear-attention layers too
}
"""Each run's change to the recipe job: none; the family's sampling (temperature 1, no truncation) and loss
temperature 1; Eq. 11's token mean instead of OPSD's per-sequence mean; the teacher's top-100 renormalised instead
of the full vocabulary; full fine-tuning at the family's lr instead of LoRA r 64 at 2e-4; LoRA r 64 at ten times
the recipe's lr (is the adapter under-trained in 120 steps?); LoRA on every linear layer of the language model
(`opd.models.settings.DEFAULT_TARGETS`: Qwen3.5's linear-attention projections too, which OPSD's seven names miss)."""


def main(argv=None) -> list[dict]:
    from experiments.family import SMOKE, FamilyConfig, job
    from harness.experiment import run_jobs

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="a finished experiments/family.py folder")
    p.add_argument("--seeds", type=int, default=1, help="seeds 0..N-1 of each knob (default 1)")
    p.add_argument("--knobs", default=",".join(KNOBS), help=f"comma-separated, of {', '.join(KNOBS)}")
    p.add_argument("--jobs", type=int, default=1, help="runs trained at once (default 1)")
    p.add_argument("--smoke", action="store_true", help="on a `family.py --smoke` folder: its few steps (the test)")
    a = p.parse_args(argv)
    root = Path(a.out)
    if not (root / "base-text").is_dir():
        p.error(f"--out {root}: no hint base (base-text/): run experiments/family.py --out {root} first")
    import torch

    torch.set_num_threads(1)  # as the family's workers: one thread per run
    cfg = FamilyConfig(**SMOKE) if a.smoke else FamilyConfig()
    jobs = []
    for knob in [k.strip() for k in a.knobs.split(",") if k.strip()]:
        if knob not in KNOBS:
            p.error(f"--knobs: unknown {knob!r}; choose from {', '.join(KNOBS)}")
        for seed in range(a.seeds):
            spec = {"method": "opsd", "policy": "full", "pct": 100, "variant": "recipe", "seed": seed,
                    "name": f"opsd-knobs/{knob}"}  # fmt: skip
            j = job(cfg, spec, root)
            change = {k: (cfg.lr if v is None else v) for k, v in KNOBS[knob].items()}
            if change.get("lora_targets") == "default":
                from opd.models.settings import DEFAULT_TARGETS

                change["lora_targets"] = DEFAULT_TARGETS
            train = {**j["train"], **change}
            if not train.get("lora_r"):
                train = {k: v for k, v in train.items() if not k.startswith("lora_") or k == "lora_r"}
            j["train"] = train
            j["folder"] = str(root / "runs" / "opsd-knobs" / knob / f"seed{seed}")
            Path(j["folder"]).mkdir(parents=True, exist_ok=True)
            jobs.append(j)
    run_jobs(jobs, a.jobs)
    rows = []
    for j in jobs:
        done = Path(j["folder"]) / "done.json"
        if done.exists():
            d = json.loads(done.read_text())
            rows.append({"knob": j["spec"]["name"].split("/")[1], "seed": j["spec"]["seed"], "full": d["full"],
                         "train_s": d["train_s"]})  # fmt: skip
    for r in rows:
        print(f"{r['knob']:>16} seed {r['seed']}: {r['full']:.1f}% ({r['train_s']:.0f} s)")
    return rows


if __name__ == "__main__":
    main()
