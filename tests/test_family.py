"""The seed-family comparison (experiments/family.py): its smoke run, its ledger checks and resuming."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from harness.family import HINT, write_eval_records
from opd.data.sources import load_records
from opd.loop.ledger import read_ledger
from opd.toy.world import WorldConfig, export_world, sample
from opd.data.family_views import reference_prompt

ROOT = Path(__file__).resolve().parents[1]


def family_module():
    spec = importlib.util.spec_from_file_location("family_experiment", ROOT / "experiments" / "family.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_ledger_check_counts_every_teacher_view():
    family = family_module()
    row = {"step": 0, "candidates": 8, "budget": 2, "selected": 2, "teacher_rows": 4, "scored_tokens": 5, "candidate_tokens": 20}
    assert family.check_ledger([row], 0.25, "random", views=2) == []
    problems = family.check_ledger([row], 0.25, "random", views=1)
    assert problems == ["step 0: 4 teacher rows for |S| = 2 x 1 views"]
    assert family.check_ledger([{**row, "selected": 3}], 0.25, "random", views=2)  # over the budget
    assert family.check_ledger([{**row, "teacher_rows": 12}], 0.25, "random", 1, "dapd") == []  # six anchors per row
    assert family.check_ledger([row], 0.25, "random", 1, "dapd") == ["step 0: 4 anchor rows for |S| = 2 x 6 pairs"]
    opod = {**row, "teacher_rows": 5, "teacher_rows_a:full": 1, "teacher_rows_b:full": 1, "teacher_rows_a:verify": 1,
            "teacher_rows_b:verify": 1, "teacher_rows_b:answer": 1}  # fmt: skip
    assert family.check_ledger([opod], 0.25, "random", 1, "opod") == []  # per row 2 forwards, 1 per prompt
    assert family.check_ledger([{**opod, "teacher_rows_b:verify": 0}], 0.25, "random", 1, "opod")
    assert family.check_ledger([{**row, "selected": 0, "teacher_rows": 0}], 0.25, "random", 1, "opod") == []


def test_hint_base_sees_the_teachers_text_and_never_the_students_prompt(tmp_path, tiny):
    """The hint base's hinted samples use OPSD's teacher prompt exactly; its plain samples are crops."""
    from opd.toy.sft import SFTConfig, build_model, toy_processor

    world = WorldConfig(n_opd=4, n_audit=2, n_eval=3)
    processor = toy_processor(world.resolution)
    model = build_model(processor, SFTConfig())
    samples = [sample(world, "sft", i) for i in range(2)]
    inputs, target = HINT.batch(processor, model, samples, ["full", "crop"], None)
    text = processor.tokenizer.decode(inputs["input_ids"][0])
    assert reference_prompt(samples[0].problem, samples[0].answer).removeprefix("<image>") in text
    assert "Reference answer" not in processor.tokenizer.decode(inputs["input_ids"][1])
    ids = processor.tokenizer.convert_tokens_to_ids
    assert target.tolist() == [[ids(s.answer), ids("<|im_end|>")] for s in samples]
    export_world(tmp_path / "world", world)
    records = load_records(write_eval_records(tmp_path / "world", world, tmp_path / "eval.jsonl"))
    assert [r.answer for r in records] == [sample(world, "eval", i).answer for i in range(3)]
    assert [r.bbox for r in records] == [tuple(sample(world, "eval", i).bbox) for i in range(3)]


@pytest.mark.slow
def test_smoke_comparison_writes_the_report_and_resumes(tmp_path, tiny):
    family = family_module()
    out = tmp_path / "family"
    text = family.main(["--smoke", "--out", str(out)])
    for heading in ("## The bases: privileged-minus-plain gap", "## Accuracy after training and teacher cost", "## Plots"):
        assert heading in text
    for name in ("Vision-OPD / BAS-OPD", "OPD-V", "RP-OPSD", "OPSD", "DAPD", "OPOD"):
        assert f"| {name} | Full" in text and f"| {name} | Learned-25" in text
    assert "| RP-OPSD | Full, fixed teacher (--ema-tau 0) |" in text
    assert "| OPOD | Full, no policy gradient (--opod-pg-weight 0) |" in text
    for name in ("OPSD", "DAPD"):  # the published recipes: LoRA adapters in their checkpoints
        assert f"| {name} | Full, the published recipe (LoRA r 64, its sampling, lr and schedule) |" in text
    recipe = out / "runs" / "dapd" / "full-100-recipe" / "seed0"
    config = json.loads((recipe / "checkpoint-000002" / "train_config.json").read_text())
    assert config["lora_r"] == 64 and config["lr"] == 5e-6 and config["sample_top_k"] == 20
    assert "Ledger arithmetic checked on 44 rows: all hold." in text  # 22 runs x 2 steps (OPSD and DAPD with their recipes too)
    for heading in ("## The privilege illusion: OPSD and DAPD on the hint base", "## OPOD's routes"):
        assert heading in text
    assert "| square | resolution base |" in text and "| diamond | crop base (the student's own base) |" in text
    route = json.loads((out / "opod_route.json").read_text())
    assert route == {"field": "shape", "teachers": {"square": "base-resolution", "triangle": "base-resolution",
                                                    "diamond": "base-crop"}}  # fmt: skip
    dapd = read_ledger(out / "runs" / "dapd" / "full-100" / "seed0" / "ledger.jsonl")
    assert all(r["teacher_rows"] == 6 * r["selected"] == 6 * r["teacher_rows_base:privileged_reference"] for r in dapd)
    assert set(json.loads((out / "runs" / "dapd" / "random-25" / "seed0" / "views.json").read_text())) == {"reference_answer"}
    opod = read_ledger(out / "runs" / "opod" / "full-100" / "seed0" / "ledger.jsonl")
    for r in opod:  # each route's rows go to its teacher only: squares and triangles share one checkpoint
        assert r["teacher_rows_square:full"] + r["teacher_rows_triangle:full"] + r["teacher_rows_diamond:full"] == r["selected"]
        assert {"beta_square", "beta_triangle", "beta_diamond"} <= set(r)
    assert (out / "family_accuracy.png").is_file() and (out / "family_cost.png").is_file()
    gaps = json.loads((out / "base_gaps.json").read_text())
    assert set(gaps) == {"crop", "resolution", "text"} and set(gaps["crop"]) == {"full", "crop", "masked"}
    opdv = read_ledger(out / "runs" / "opd-v" / "full-100" / "seed0" / "ledger.jsonl")
    assert all(r["teacher_rows"] == 2 * r["selected"] == 2 * r["teacher_rows_masked"] for r in opdv)
    done = out / "runs" / "rp-opsd" / "learned-25" / "seed0" / "done.json"
    stamp = done.stat().st_mtime_ns
    family.main(["--smoke", "--out", str(out)])  # resumed: every run is reused
    assert done.stat().st_mtime_ns == stamp
    assert json.loads((out / "timing.json").read_text())["invocations"] == 2
    # OPSD's recipe one knob at a time (experiments/opsd_recipe_knobs.py) on the same folder: the control is the
    # family's own recipe run, step for step; a knob changes the stored settings and nothing else
    from experiments.opsd_recipe_knobs import main as knobs

    rows = knobs(["--out", str(out), "--smoke", "--knobs", "recipe,full-ft"])
    assert [(r["knob"], r["seed"]) for r in rows] == [("recipe", 0), ("full-ft", 0)]
    family_run = read_ledger(out / "runs" / "opsd" / "full-100-recipe" / "seed0" / "ledger.jsonl")
    control = read_ledger(out / "runs" / "opsd-knobs" / "recipe" / "seed0" / "ledger.jsonl")
    assert [r["loss"] for r in control] == [r["loss"] for r in family_run]
    assert [r["selected"] for r in control] == [r["selected"] for r in family_run]
    full_ft = out / "runs" / "opsd-knobs" / "full-ft" / "seed0"
    stored = json.loads((full_ft / "checkpoint-000002" / "train_config.json").read_text())
    recipe = json.loads((out / "runs" / "opsd" / "full-100-recipe" / "seed0" / "checkpoint-000002" / "train_config.json").read_text())
    changed = {k for k in stored if stored[k] != recipe.get(k) and not k.startswith("lora_") and k != "out"}
    assert stored["lora_r"] == 0 and stored["lr"] == family.FamilyConfig(**family.SMOKE).lr and changed == {"lr"}
