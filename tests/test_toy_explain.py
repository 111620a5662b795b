"""The second toy task (experiments/harness/explain.py, experiments/toy_explain.py), the shared toy-experiment code
(experiments/harness/experiment.py, experiments/harness/report.py) and the collapse diagnostics
(experiments/harness/diagnose.py, experiments/toy_collapse.py).

Unit tests check the responses against eval.py's parser, the supervised batch against the tokenizer, and
the trace statistics against hand-computed values. The smoke run (one seed, two steps per run) checks the
report's structure, its tables against the ledgers and traces (recomputed here), and resuming. A diagnosed
run must be the same run as a plain one, and its labels must match the utilities computed before the step.
"""

import importlib.util
import json
import math
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from harness import report as toy_report
from harness.experiment import label, order, split_name
from harness.explain import EXPLAIN, STYLES, draw_styles, response_lengths, response_text, style_of
from opd.answers.choice import parse_choice
from opd.loop.ledger import read_ledger, summarize
from opd.toy.world import OPTIONS, SHAPES, WorldConfig, sample

ROOT = Path(__file__).resolve().parents[1]


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"toy_script_{name}", ROOT / "experiments" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve string annotations through sys.modules
    spec.loader.exec_module(module)
    return module


# ----------------------------------------------------------------------------- the task


def test_every_response_ends_in_the_answer_the_parser_reads():
    s = sample(WorldConfig(), "eval", 0)
    for style in STYLES:
        for colour in OPTIONS.values():
            text = response_text(s, style, colour)
            letter = next(k for k, v in OPTIONS.items() if v == colour)
            assert parse_choice(text, OPTIONS) == letter, text
            assert style_of(text) == style
    # the final answer decides when the explanation names another colour
    assert parse_choice("Blue. I see a small blue diamond here. Answer: A", OPTIONS) == "A"
    assert style_of("xyz") is None


def test_response_lengths_span_5_to_60_tokens():
    from opd.tiny import tiny_tokenizer

    tok = tiny_tokenizer()
    spans = response_lengths()
    assert 5 <= min(lo for lo, _ in spans.values()) <= 10 and 45 <= max(hi for _, hi in spans.values()) <= 60
    for style, (lo, hi) in spans.items():  # one token per character, plus <|im_end|>
        n = [len(tok(STYLES[style].format(letter="A", colour=c, Colour=c.capitalize(), shape=sh),
                     add_special_tokens=False)["input_ids"]) + 1 for c in OPTIONS.values() for sh in SHAPES]
        assert (min(n), max(n)) == (lo, hi), style


def test_styles_are_drawn_with_their_weights():
    rng = np.random.default_rng(0)
    drawn = draw_styles(rng, 6000)
    counts = {s: drawn.count(s) for s in STYLES}
    assert all(abs(c / 6000 - 1 / len(STYLES)) < 0.02 for c in counts.values()), counts
    assert draw_styles(np.random.default_rng(1), 20) == draw_styles(np.random.default_rng(1), 20)


def test_supervised_batch_targets_are_the_response_tokens():
    from opd.toy.sft import SFTConfig, build_model, toy_processor

    processor = toy_processor(32)
    model = build_model(processor, SFTConfig())
    samples = [sample(WorldConfig(), "sft", i) for i in range(5)]
    inputs, target = EXPLAIN.batch(processor, model, samples, ["crop", "full", "crop", "full", "crop"], np.random.default_rng(3))
    styles = draw_styles(np.random.default_rng(3), 5)
    tok = processor.tokenizer
    end = tok.convert_tokens_to_ids("<|im_end|>")
    for i, (s, style) in enumerate(zip(samples, styles)):
        ids = target[i][target[i] != -100].tolist()
        assert ids[-1] == end and tok.decode(ids[:-1]) == response_text(s, style)
        assert (target[i][len(ids):] == -100).all()  # padding after <|im_end|> is ignored by the loss
    n, width = target.shape
    assert inputs["input_ids"].shape[0] == n and bool((inputs["attention_mask"][:, -width:] == (target != -100)).all())


# ----------------------------------------------------------------------------- names and trace statistics


def test_run_names_order_and_labels():
    names = ["learned-25-no-exploration", "learned-10", "full-100", "learned-25-no-overlap", "random-25", "learned-25",
             "entropy-25", "learned-50"]
    assert order(names) == ["full-100", "random-25", "entropy-25", "learned-50", "learned-25", "learned-10",
                            "learned-25-no-overlap", "learned-25-no-exploration"]
    assert split_name("learned-25-no-rank-loss") == ("learned", 25, "no-rank-loss")
    assert label("learned-25-no-confidence") == "Learned-25 without confidence" and label("full-100") == "Full querying"


def test_trace_statistics_on_a_hand_made_trace():
    driver = load_script("toy_explain")
    trace = [
        {"candidates": [0, 1, 2, 3], "selected": [0, 1], "length": [5, 10, 30, 55], "utility": [0.4, 0.2]},
        {"candidates": [0, 1, 2, 3], "selected": [1, 3], "length": [5, 10, 30, 55], "utility": [0.3, 0.1]},
    ]
    assert driver.coverage(trace, 2) == pytest.approx((1 + 2) / 2)  # rows 0,1 = prompt 0; rows 1,3 = prompts 0,1
    assert driver.lengths(trace) == pytest.approx((25.0, (5 + 10 + 10 + 55) / 4))
    bands = driver.utility_by_length([trace], slice(0, 2))
    assert bands[0] == (3, pytest.approx((0.4 + 0.2 + 0.3) / 3)) and bands[3] == (1, pytest.approx(0.1))
    assert bands[1][0] == 0 and math.isnan(bands[1][1])


def test_idle_estimate_counts_each_phase_once():
    driver = load_script("toy_explain")
    timing = {"world_s": 3.0, "cpu_world_s": 2.0, "cpu_sft_s": 100.0, "cpu_base_eval_s": 10.0, "runs_s": 500.0,
              "cpu_runs_s": 600.0, "cpu_s": 712.0, "total_s": 620.0, "invocations": 1}
    assert driver.idle_estimate(timing, 2) == pytest.approx(2 + 100 + 10 + 600 / 2)  # cpu_s is the phases' sum


def test_spearman_against_hand_values():
    assert toy_report.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert toy_report.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert toy_report.ranks([3.0, 1.0, 3.0, 2.0]).tolist() == [2.5, 0.0, 2.5, 1.0]  # ties share their mean rank
    x, y = [1, 2, 3, 4, 5], [2, 1, 4, 3, 5]  # d^2 = 1+1+1+1+0: 1 - 6 * 4 / (5 * 24)
    assert toy_report.spearman(x, y) == pytest.approx(1 - 6 * 4 / 120)
    assert math.isnan(toy_report.spearman([1, 2], [1, 2])) and math.isnan(toy_report.spearman([1, 1, 1], [1, 2, 3]))


# ----------------------------------------------------------------------------- the smoke run


def _table(text: str, heading: str) -> list[list[str]]:
    """The first table under `heading`, without its header row."""
    block = text.split(heading, 1)[1].split("\n## ", 1)[0]
    first = block[block.index("\n| "):].split("\n\n", 1)[0]
    rows = [line for line in first.splitlines() if line.startswith("| ") and not line.startswith("| ---")]
    return [[c.strip() for c in row.strip("|").split("|")] for row in rows[1:]]


@pytest.mark.slow
def test_smoke_reproduction_report_ledgers_and_traces(tmp_path):
    driver = load_script("toy_explain")
    out = tmp_path / "explain"
    text = driver.main(["--smoke", "--out", str(out)])
    assert (out / "report.md").read_text() == text
    for heading in ("## The responses", "## The regional-to-global gap", "## Table 3 analogue", "## Table 4 analogue",
                    "## What each policy selects", "## Table 7 analogue", "## Table 8 analogue", "## Figure 3 analogue",
                    "## Figure 4 analogue", "## Plots"):
        assert heading in text, heading
    assert re.search(r"- Command: `python experiments/toy_explain.py --smoke", text) and re.search(r"- Wall time: \d+ s", text)
    for png in ("world.png", "fig2_budget.png", "fig5_cost.png", "fig3_audit.png", "fig4_geometry.png", "fig6_selection.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG" and f"]({png})" in text
    base = json.loads((out / "base_eval.json").read_text())
    assert base["gap"] == pytest.approx(base["crop"] - base["full"])
    styles = _table(text, "## The responses")  # one row per style and one for other text, 5 cells each
    assert [r[0] for r in styles] == [*STYLES, "other"] and all(len(r) == 5 for r in styles)
    samples = json.loads((out / "base_samples.json").read_text())
    assert len(samples) == 4 and all(s["tokens"] <= 16 for s in samples)

    expected = {"Full querying": ("full-100", 1.0), "Random-25": ("random-25", 0.25), "Entropy-25": ("entropy-25", 0.25),
                "Learned-25": ("learned-25", 0.25), "Learned-50": ("learned-50", 0.5)}
    ablations = {f"Learned-25 {v}": f"learned-25-{k}" for k, v in driver.ABLATIONS.items()}
    table3 = {row[0]: row for row in _table(text, "## Table 3 analogue")}
    table4 = {row[0]: row for row in _table(text, "## Table 4 analogue")}
    table7 = {row[0]: row for row in _table(text, "## Table 7 analogue")}
    selects = {row[0]: row for row in _table(text, "## What each policy selects")}
    assert set(table3) == set(expected) and set(table7) == set(expected) | set(ablations) == set(selects)
    assert set(table4) == {"Full learned selector"} | set(ablations)
    full_tokens = summarize(read_ledger(out / "runs" / "full-100" / "seed0" / "ledger.jsonl"))["scored_tokens"]
    folders = {**{k: v[0] for k, v in expected.items()}, **ablations}
    for name, folder in folders.items():
        rho = expected[name][1] if name in expected else 0.25
        run = out / "runs" / folder / "seed0"
        rows = read_ledger(run / "ledger.jsonl")
        assert len(rows) == 2 and driver.check_ledger(rows, rho, split_name(folder)[0]) == []
        s = summarize(rows)
        assert s["calls"] == sum(math.floor(rho * r["candidates"] + 1e-9) for r in rows)  # the budget is spent exactly
        cand, calls, q, scored, vs_full = (table7[name][j] for j in (1, 2, 3, 4, 5))
        assert int(cand.replace(",", "")) == s["candidates"] and int(calls.replace(",", "")) == s["calls"]
        assert float(q.rstrip("%")) == pytest.approx(100 * s["calls"] / s["candidates"], abs=0.006)
        assert int(scored.replace(",", "")) == s["scored_tokens"]
        assert float(vs_full.rstrip("%")) == pytest.approx(100 * s["scored_tokens"] / full_tokens, abs=0.006)
        # the trace agrees with the ledger, step by step
        trace = [json.loads(x) for x in (run / "trace.jsonl").read_text().splitlines()]
        for t, r in zip(trace, rows, strict=True):
            assert len(t["selected"]) == r["selected"] and len(t["candidates"]) == r["candidates"]
            assert sum(t["length"][i] for i in t["selected"]) == r["scored_tokens"]
            assert sum(t["length"][i] for i in t["candidates"]) == r["candidate_tokens"]
            # the trace keeps 5 significant digits of each label (harness/experiment.py): <= 5e-5 relative each, >= 0
            assert len(t["utility"]) == r["selected"] and np.nanmean(t["utility"]) == pytest.approx(r["utility_mean"], rel=1e-4)
        cand_len, sel_len = np.mean([t["length"][i] for t in trace for i in t["candidates"]]), np.mean(
            [t["length"][i] for t in trace for i in t["selected"]])
        assert float(selects[name][1]) == pytest.approx(cand_len, abs=0.06) and float(selects[name][2]) == pytest.approx(sel_len, abs=0.06)
        done = json.loads((run / "done.json").read_text())
        results = json.loads((run / "eval" / "results.json").read_text())["benchmarks"]
        assert done["full"] == results["zoombench"]["score"] and done["crop"] == results["zoombench@crop"]["score"]
        if name in table3:  # accuracy and token ratio vs Full (one seed: the mean is the seed's)
            assert float(table3[name][3]) == pytest.approx(done["full"], abs=0.006)
            assert float(table3[name][2]) == pytest.approx(100 * s["scored_tokens"] / full_tokens, abs=0.006)
        if name in table4:
            assert float(table4[name][1]) == pytest.approx(done["full"], abs=0.006)
            assert float(table4[name][-1]) == pytest.approx(100 * s["scored_tokens"] / full_tokens, abs=0.006)
        settings = json.loads((run / "checkpoint-000002" / "train_config.json").read_text())
        assert all(settings[k.replace("-", "_")] == (folder.endswith(k)) for k in driver.ABLATIONS)
    assert "checked on 18 ledger rows: all hold." in text

    # resuming: every run is reused, the report is rebuilt identically below its time stamp
    stamps = {p: p.stat().st_mtime_ns for p in out.glob("runs/*/seed0/done.json")}
    again = driver.main(["--smoke", "--out", str(out)])
    assert again.split("- Finished")[1].split("\n", 1)[1] == text.split("- Finished")[1].split("\n", 1)[1]
    assert {p: p.stat().st_mtime_ns for p in out.glob("runs/*/seed0/done.json")} == stamps


# ----------------------------------------------------------------------------- the collapse diagnostics


@pytest.fixture(scope="module")
def letter_world(tmp_path_factory):
    """The first task's world (small) and a base trained for a few steps."""
    from opd.toy.sft import SFTConfig, train_base
    from opd.toy.world import export_world

    root = tmp_path_factory.mktemp("letters")
    world = WorldConfig(n_opd=16, n_audit=8, n_eval=8)
    export_world(root / "world", world)
    train_base(root / "base", world, SFTConfig(steps=6, batch=4), log=lambda m: None)
    return root


def _config(root: Path, out: Path, **kw):
    from opd.config import TrainConfig

    fields = dict(model=str(root / "base"), data=str(root / "world" / "train.jsonl"), out=str(out), policy="learned",
                  rho=0.25, steps=3, prompts_per_step=4, rollouts_per_prompt=2, max_prompt_len=512, max_response_len=4,
                  lr=1.5e-4, micro_batch=64, seed=2, selector_seed=2, replay_start=2, replay_batch=8, save_every=0)
    return TrainConfig(**{**fields, **kw})


@pytest.mark.slow
def test_a_diagnosed_run_is_the_same_run_and_its_labels_match(letter_world, tmp_path, float64_model):
    """In float64 (tests/float64.py): the labels Run.step hands the selector come from the training forward over S's
    micro-batches, the precomputed u_i from harness.audit.score_utility over the candidates' micro-batches; the same
    computation grouped otherwise. The utilities are ~1e-9 (JSDs of nearly equal distributions), so float32 rounding
    of the two groupings left them 3e-3 apart relative (the bound was 1e-3)."""
    from float64 import F32_EPS, assert_same_weights

    from opd.run import Run
    from harness.diagnose import Diagnosed

    plain = Run(_config(letter_world, tmp_path / "plain", dtype="float64"))
    plain_rows = [plain.step(s) for s in range(3)]
    run = Run(_config(letter_world, tmp_path / "diag", dtype="float64"))
    diagnosed = Diagnosed(run)
    pairs = [diagnosed.step(s) for s in range(3)]
    for a, (b, d) in zip(plain_rows, pairs):
        same = ("selected", "scored_tokens", "candidate_tokens", "teacher_rows", "budget", "candidates")
        assert {k: a[k] for k in same} == {k: b[k] for k in same}
        # The same step on the same rollouts: float64 reduction order (~1e-16) times the cancellation in D's ~1e-9
        # values (the float32 labels below showed an amplification of ~2.5e4) stays under 1e-9.
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-9) and a["utility_mean"] == pytest.approx(b["utility_mean"], rel=1e-9)
        # Both label sets are float32 casts (u.float()) of float64 values ~2.5e4 * F64_EPS (relative) apart, so they
        # differ by at most one float32 ulp: <= F32_EPS relative to the largest label. A label of another row: ~1.
        assert d["label_error"] <= 2 * F32_EPS and len(d["labels"]) == len(d["selected"]) == a["selected"]
        # utility_mean is torch's float32 mean of these float32 labels (>= 0): n values, <= (n + 1) float32 roundings
        n = len(d["labels"])
        assert np.isclose(np.nanmean(d["labels"]), a["utility_mean"], rtol=(n + 1) * F32_EPS, atol=0)
        assert len(d["teacher_p"]) == len(d["gold"]) == 4 and all(len(p) == 4 and 0 <= min(p) for p in d["teacher_p"])
    assert_same_weights(dict(plain.model.named_parameters()), dict(run.model.named_parameters()), plain.cfg.optim.lr, 3)

    oracle_run = Run(_config(letter_world, tmp_path / "oracle", policy="random"))
    _, d = Diagnosed(oracle_run, oracle=True).step(0)
    u = np.asarray(d["u_all"])
    cand = np.flatnonzero(~np.isnan(u))
    top = sorted(cand[np.argsort(-u[cand], kind="stable")[: d["budget"]]].tolist())
    assert d["selected"] == top


@pytest.mark.slow
def test_collapse_smoke_report(tmp_path):
    driver = load_script("toy_collapse")
    out = tmp_path / "collapse"
    text = driver.main(["--smoke", "--out", str(out)])
    rows = _table(text, "## Runs and checks")
    assert [r[0] for r in rows] == ["Learned-25", "Entropy-25", "Random-25", "Oracle-25", "Learned-25 (low lr)"]
    assert all(re.fullmatch(r"\d\.\de[-+]\d+", r[6]) for r in rows)  # the label check is reported (tested above)
    assert (out / "fig_collapse.png").read_bytes()[:4] == b"\x89PNG"
    probes = [json.loads(x) for x in (out / "runs" / "learned-25" / "seed0" / "probes.jsonl").read_text().splitlines()]
    assert [p["step"] for p in probes] == [0, 1, 2]

    # --report-only trains nothing: the seed-1 runs are listed as not run, no folder of theirs appears
    stamps = {p: p.stat().st_mtime_ns for p in out.glob("runs/*/seed0/done.json")}
    again = driver.main(["--smoke", "--out", str(out), "--seeds", "0,1", "--report-only"])
    assert [r[1] for r in _table(again, "## Runs and checks")] == ["0"] * 5
    assert "- Not run (no done.json): learned-25 seed 1, entropy-25 seed 1" in again
    assert not list(out.glob("runs/*/seed1")) and {p: p.stat().st_mtime_ns for p in out.glob("runs/*/seed0/done.json")} == stamps
