"""The toy-world experiment (experiments/toy.py, opd/toy/world.py, opd/toy/sft.py) and the audit diagnostics
(experiments/harness/audit.py).

The smoke run (one seed, two OPD steps per policy, a 16-item benchmark) checks the report's structure,
the ledgers' arithmetic against the report's tables, and resuming; the audit functions are checked
against hand-computed values.
"""

import importlib.util
import json
import math
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from harness import audit
from opd.data.sources import load_records
from opd.eval.benchmarks import load_benchmark
from opd.eval.bench_items import prompt_text
from opd.loop.ledger import read_ledger, summarize
from opd.toy.world import WorldConfig, export_world, sample

ROOT = Path(__file__).resolve().parents[1]


def load_driver():
    spec = importlib.util.spec_from_file_location("toy_experiment", ROOT / "experiments" / "toy.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve string annotations through sys.modules
    spec.loader.exec_module(module)
    return module


# ----------------------------------------------------------------------------- the world


def test_world_is_deterministic_and_read_by_the_real_loaders(tmp_path):
    cfg = WorldConfig(n_opd=6, n_audit=2, n_eval=5)
    a, b = sample(cfg, "eval", 3), sample(cfg, "eval", 3)
    assert np.array_equal(np.asarray(a.image), np.asarray(b.image)) and a.bbox == b.bbox and a.answer == b.answer
    assert not np.array_equal(np.asarray(a.image), np.asarray(sample(cfg, "opd", 3).image))
    x1, y1, x2, y2 = a.bbox
    assert 0 <= x1 < x2 <= cfg.canvas and 0 <= y1 < y2 <= cfg.canvas

    root = export_world(tmp_path / "world", cfg)
    records = load_records(root / "train.jsonl")
    assert len(records) == 6 and all(r.eligible and 0 < r.area_ratio < 1 for r in records)
    items = load_benchmark("zoombench", root / "bench")
    assert len(items) == 5 and all(i.kind == "choice" and i.crop is not None for i in items)
    for i, item in enumerate(items):
        s = sample(cfg, "eval", i)
        assert item.answer == s.answer
        assert prompt_text(item) == s.problem.replace("<image>", "")  # training and eval prompts match
        x1, y1, x2, y2 = s.bbox
        assert item.crop().size == (x2 - x1, y2 - y1) and item.image().size == (cfg.canvas, cfg.canvas)
    assert export_world(tmp_path / "world", cfg) == root  # reused
    with pytest.raises(SystemExit):
        export_world(tmp_path / "world", WorldConfig(n_opd=7, n_audit=2, n_eval=5))


# ----------------------------------------------------------------------------- audit statistics


def test_capture_curve_on_a_known_ranking():
    u = torch.tensor([4.0, 3.0, 2.0, 1.0])
    np.testing.assert_allclose(audit.capture_curve(u, u, [0.25, 0.5, 1.0]), [0.4, 0.7, 1.0])
    np.testing.assert_allclose(audit.capture_curve(u, -u, [0.25, 0.5]), [0.1, 0.3])
    # ties go to the lower index: all scores equal -> the first rows
    np.testing.assert_allclose(audit.capture_curve(u, torch.zeros(4), [0.5]), [0.7])
    # floor(0.25 x 10) = 2 rows
    u10 = torch.arange(10, 0, -1).double()
    np.testing.assert_allclose(audit.capture_curve(u10, u10, [0.25]), [(10 + 9) / 55])
    # pooled over batches: sum of captured / sum of totals
    batches = [(u, u), (torch.tensor([1.0, 1.0, 1.0, 5.0]), torch.tensor([0.0, 0.0, 0.0, 1.0]))]
    np.testing.assert_allclose(audit.pooled_capture(batches, [0.25]), [(4 + 5) / (10 + 8)])
    np.testing.assert_allclose(audit.random_capture(10, [0.25, 0.5, 1.0]), [0.2, 0.5, 1.0])


def test_band_index_and_rank_bands():
    scores = torch.tensor([0.1, 0.8, 0.3, 0.9, 0.5, 0.2, 0.7, 0.4])
    assert audit.band_index(scores, 4).tolist() == [3, 0, 2, 0, 1, 3, 1, 2]
    # utility equals the score: band means are the means of each rank pair
    result = audit.rank_bands([(scores, scores), (scores, scores)], 4, n_boot=200)
    means = [b["mean"] for b in result["bands"]]
    np.testing.assert_allclose(means, [0.85, 0.6, 0.35, 0.15])
    assert all(b["n"] == 4 for b in result["bands"])
    assert result["top_over_next"] == pytest.approx(0.85 / 0.6)
    assert [t["bands"] for t in result["tests"]] == [[0, 1], [1, 2], [2, 3]]
    # two batches, both differences positive: exact one-sided sign-flip p = 1/4; Holm x3, monotone
    assert [t["p"] for t in result["tests"]] == [0.25, 0.25, 0.25]
    assert [t["p_holm"] for t in result["tests"]] == [0.75, 0.75, 0.75]


def test_bootstrap_interval():
    assert audit.bootstrap_ci([2.0] * 10) == (2.0, 2.0, 2.0)
    mean, lo, hi = audit.bootstrap_ci([1.0, 2.0, 3.0, 4.0], n_boot=4000, seed=0)
    assert mean == 2.5 and 1.0 <= lo < 2.5 < hi <= 4.0
    # coverage of the true mean on a fixed seed: about 95% (percentile bootstrap runs a little under)
    rng = np.random.default_rng(7)
    covered = 0
    for rep in range(300):
        x = rng.normal(1.0, 2.0, size=40)
        _, lo, hi = audit.bootstrap_ci(x, n_boot=1000, seed=rep)
        covered += lo <= 1.0 <= hi
    assert 0.88 <= covered / 300 <= 0.99


def test_sign_flip_and_holm():
    assert audit.sign_flip_pvalue([1.0, 2.0, 0.5, 3.0, 1.5]) == pytest.approx(1 / 32)  # exact: only the identity
    assert audit.sign_flip_pvalue([1.0, -1.0]) == pytest.approx(0.75)  # patterns' means 0, 1, -1, 0 vs observed 0
    assert audit.sign_flip_pvalue([]) == 1.0
    p = audit.sign_flip_pvalue(np.ones(20), n_perm=999, seed=0)  # Monte Carlo: 1 / (n_perm + 1)
    assert p == pytest.approx(1 / 1000)
    np.testing.assert_allclose(audit.holm([0.01, 0.04, 0.03]), [0.03, 0.06, 0.06])
    np.testing.assert_allclose(audit.holm([0.5, 0.6]), [1.0, 1.0])


def test_gradient_cosine_and_ratio_on_hand_vectors():
    assert audit.cosine(torch.tensor([1.0, 0.0]), torch.tensor([1.0, 1.0])) == pytest.approx(1 / math.sqrt(2))
    assert audit.cosine(torch.tensor([1.0, 2.0]), torch.tensor([-2.0, 1.0])) == pytest.approx(0.0)
    assert audit.cosine(torch.zeros(3), torch.ones(3)) == 0.0
    rows = [{"norm_selected": 2.0, "norm_unselected": 1.0, "cosine": 0.5},
            {"norm_selected": 4.0, "norm_unselected": 1.0, "cosine": 0.3}]
    s = audit.geometry_summary(rows)
    assert s["norm_ratio"] == pytest.approx(3.0)
    assert (s["ratio_min"], s["ratio_max"]) == (2.0, 4.0)
    assert s["mean_cosine"] == pytest.approx(0.4)
    assert s["angle_deg"] == pytest.approx(math.degrees(math.acos(0.4)))


@pytest.mark.slow
def test_audit_on_a_run_leaves_it_unchanged_and_gradients_add_up(tiny, tmp_path, float64_model):
    """opd_gradient is linear in the row set (token-weighted), and the audits touch no training state. In float64
    (tests/float64.py): S, C \\ S and C fall into other micro-batches, so the three gradients sum in other orders."""
    from float64 import F32_EPS

    from opd.config import TrainConfig
    from opd.run import Run

    model, data = tiny
    cfg = TrainConfig(model=str(model), data=str(data), out=str(tmp_path / "run"), prompts_per_step=4,
                      rollouts_per_prompt=4, max_response_len=6, steps=1, lr=1e-3, micro_batch=5, replay_start=2,
                      replay_batch=8, policy="learned", rho=0.5, dtype="float64")
    run = Run(cfg)
    run.log(run.step(0))
    params = {k: v.detach().clone() for k, v in run.model.named_parameters()}
    counters = (run.teacher.rows_scored, len(run.teacher.batches))
    rng_state = torch.get_rng_state()
    replay = len(run.selector.model.replay)

    ctx = audit.AuditContext.of(run)
    batch = audit.sample_batch(ctx, run.selector, run.records[:4], seed=3)
    u = audit.score_utility(ctx, batch)
    c = batch.eligible.nonzero().squeeze(-1)
    assert c.numel() > 2 and torch.isfinite(u[c]).all() and (u[c] >= 0).all() and torch.isnan(u[~batch.eligible]).all()
    s = audit.frozen_selection(batch, 0.5)
    assert s.numel() == math.floor(0.5 * c.numel())
    rest = c[~torch.isin(c, s)]
    g_s, g_r, g_all = (audit.opd_gradient(ctx, batch, rows) for rows in (s, rest, c))
    t_s, t_r = (int(batch.rollouts.lengths[rows].sum()) for rows in (s, rest))
    # Eq. 11's token weights are float32 (budgeted_weights): each gradient is its exact value times fl32(1 / tokens), off
    # by <= F32_EPS / 2 relative, element by element; the float64 sums' order adds ~1e-16 relative.
    combined = (t_s * g_s + t_r * g_r) / (t_s + t_r)
    bound = F32_EPS / 2 * (g_all.abs() + (t_s * g_s.abs() + t_r * g_r.abs()) / (t_s + t_r)) + 1e-12 * float(g_all.abs().max())
    assert ((g_all - combined).abs() <= bound).all(), float(((g_all - combined).abs() / bound).max())
    assert g_s.norm() > 0

    assert all(torch.equal(params[k], v) for k, v in run.model.named_parameters())
    assert all(p.grad is None for p in run.model.parameters())
    assert (run.teacher.rows_scored, len(run.teacher.batches)) == counters
    assert torch.equal(torch.get_rng_state(), rng_state)
    assert len(run.selector.model.replay) == replay

    geo = audit.gradient_geometry(ctx, run.selector, run.records, rho=0.5, n_batches=1)
    assert geo["rows"][0]["selected"] > 0 and -1 <= geo["rows"][0]["cosine"] <= 1


# ----------------------------------------------------------------------------- the smoke run


def _table(text: str, heading: str) -> list[list[str]]:
    block = text.split(heading, 1)[1].split("\n## ", 1)[0]
    rows = [line for line in block.splitlines() if line.startswith("| ") and not line.startswith("| ---")]
    return [[c.strip() for c in row.strip("|").split("|")] for row in rows[1:]]


@pytest.mark.slow
def test_smoke_reproduction_report_and_ledgers(tmp_path):
    driver = load_driver()
    out = tmp_path / "toy"
    text = driver.main(["--smoke", "--out", str(out)])
    assert (out / "report.md").read_text() == text
    for heading in ("## The regional-to-global gap", "## Table 3 analogue", "## Table 7 analogue",
                    "## Table 8 analogue", "## Figure 3 analogue", "## Figure 4 analogue", "## Plots"):
        assert heading in text, heading
    assert re.search(r"- Machine: .+", text) and re.search(r"- Command: `python experiments/toy.py --smoke", text)
    assert re.search(r"- Wall time: \d+ s", text)
    for png in ("world.png", "fig2_budget.png", "fig5_cost.png", "fig3_audit.png", "fig4_geometry.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG" and f"]({png})" in text

    base = json.loads((out / "base_eval.json").read_text())
    assert set(base) >= {"full", "crop", "gap"} and base["gap"] == pytest.approx(base["crop"] - base["full"])

    expected = {"Full querying": ("full-100", 1.0), "Random-25": ("random-25", 0.25), "Entropy-25": ("entropy-25", 0.25),
                "Learned-25": ("learned-25", 0.25), "Learned-50": ("learned-50", 0.5)}
    table3 = {row[0]: row for row in _table(text, "## Table 3 analogue")}
    table7 = {row[0]: row for row in _table(text, "## Table 7 analogue")}
    assert set(table3) == set(expected) == set(table7)
    full_tokens = summarize(read_ledger(out / "runs" / "full-100" / "seed0" / "ledger.jsonl"))["scored_tokens"]
    for name, (folder, rho) in expected.items():
        run = out / "runs" / folder / "seed0"
        rows = read_ledger(run / "ledger.jsonl")
        assert len(rows) == 2 and driver.check_ledger(rows, rho, folder.split("-")[0]) == []
        s = summarize(rows)
        assert s["calls"] == sum(r["selected"] for r in rows) and s["candidates"] == sum(r["candidates"] for r in rows)
        assert s["calls"] == sum(math.floor(rho * r["candidates"] + 1e-9) for r in rows)  # the budget is spent exactly
        assert json.loads((run / "summary.json").read_text())["calls"] == s["calls"]
        cand, calls, q, scored, vs_full = (table7[name][j] for j in (1, 2, 3, 4, 5))
        assert int(cand.replace(",", "")) == s["candidates"] and int(calls.replace(",", "")) == s["calls"]
        assert float(q.rstrip("%")) == pytest.approx(100 * s["calls"] / s["candidates"], abs=0.006)
        assert int(scored.replace(",", "")) == s["scored_tokens"]
        assert float(vs_full.rstrip("%")) == pytest.approx(100 * s["scored_tokens"] / full_tokens, abs=0.006)
        assert float(table3[name][1]) == pytest.approx(100 * s["calls"] / s["candidates"], abs=0.006)
        done = json.loads((run / "done.json").read_text())
        results = json.loads((run / "eval" / "results.json").read_text())["benchmarks"]
        assert done["full"] == results["zoombench"]["score"] and done["crop"] == results["zoombench@crop"]["score"]
        assert float(table3[name][3]) == pytest.approx(done["full"], abs=0.006)
        assert (run / "checkpoint-000002" / "policy" / "config.json").exists()
    assert "checked on 10 ledger rows: all hold." in text

    learned = out / "runs" / "learned-25" / "seed0"
    a = json.loads((learned / "audit.json").read_text())
    assert set(a["capture"]) >= {"oracle", "random"} and len(a["bands"]["bands"]) == 4
    assert a["capture"]["oracle"][-1] == pytest.approx(1.0) and a["capture"]["random"][1] == pytest.approx(0.25)
    assert all(o >= x - 1e-12 for key in a["capture"] for o, x in zip(a["capture"]["oracle"], a["capture"][key]))
    g = json.loads((learned / "geometry.json").read_text())
    assert [c["step"] for c in g] == [1, 2] and all(c["rows"][0]["norm_selected"] > 0 for c in g)

    # resuming: every run is reused, the report is rebuilt
    stamps = {p: p.stat().st_mtime_ns for p in out.glob("runs/*/seed0/done.json")}
    assert driver.main(["--smoke", "--out", str(out)]).split("- Finished")[1].split("\n", 1)[1] == \
        text.split("- Finished")[1].split("\n", 1)[1]
    assert {p: p.stat().st_mtime_ns for p in out.glob("runs/*/seed0/done.json")} == stamps


# --------------------------------------------------------------------------- the scripts' entry (harness/entry.py)


@dataclass
class TinyConfig:
    preset: str = "default"
    """Starting values: 'default' or 'smoke' (--smoke)."""
    out: str = "runs/tiny"
    """Output folder."""
    steps: int = 10
    """Units of work."""


TINY_PRESETS = {"default": {}, "smoke": {"steps": 2, "out": "runs/tiny-smoke"}}


def test_entry_parses_times_runs_and_reports_atomically(tmp_path, monkeypatch, capfd):
    """A trivial experiment through `harness.entry.Entry`: the flags (opd.cli.parse_config, --smoke), the output
    folder, OUT/timing.json over two invocations and a --report-only one, the runs left to do, and a report and a
    plot written whole (a write that fails before its os.replace leaves the earlier file as it was)."""
    from opd.cli import UserError
    from harness.entry import Entry, parse
    from harness.report import _pyplot, save_figure, write_report

    smoke = TinyConfig(preset="smoke", steps=2, out="runs/tiny-smoke")
    def parsed(*argv):
        return parse(TinyConfig, TINY_PRESETS, list(argv), "d")

    assert parsed() == TinyConfig()
    assert parsed("--smoke") == parsed("--preset", "smoke") == smoke
    # --smoke wins over a --preset given with it; a flag wins over the preset
    assert parsed("--smoke", "--preset", "default", "--steps", "3") == TinyConfig("smoke", "runs/tiny-smoke", 3)
    with pytest.raises(UserError, match="unknown flag --stesp; did you mean --steps"):
        parsed("--stesp", "1")

    def report(root, cfg, timing, command):
        plt = _pyplot()
        fig, ax = plt.subplots(figsize=(1, 1))
        ax.plot([0, cfg.steps])
        save_figure(fig, root / "plot.png", dpi=40)
        return write_report(root, f"# {cfg.steps} steps, {timing.get('invocations', 0)} invocation(s)\n\n`{command}`\n",
                            {"timing": timing})  # fmt: skip

    out = tmp_path / "a" / "b"
    threads = torch.get_num_threads()
    try:
        entry = Entry.start(TinyConfig, TINY_PRESETS, ["--smoke", "--out", str(out)], "A trivial experiment.\n\nMore.",
                            "python tiny.py")  # fmt: skip
        assert entry.cfg == TinyConfig("smoke", str(out), 2) and entry.root == out and out.is_dir()
        assert torch.get_num_threads() == 1  # quiet()
        runs = [{"folder": str(out / "runs" / name)} for name in ("done", "skipped", "todo")]
        (out / "runs" / "done").mkdir(parents=True)
        (out / "runs" / "done" / "done.json").write_text("{}")
        trained = []
        entry.runs(runs, 1, trained.append, skip=lambda j: j["folder"].endswith("skipped"), reused="done or skipped")
        assert trained == runs[2:]
        with entry.phase("work_s"):
            sum(range(1000))
        text = entry.finish(report)
        printed = capfd.readouterr().out
        assert "3 OPD runs, 2 done or skipped, 1 at a time" in printed
        assert re.search(rf"\d\d:\d\d:\d\d report -> {re.escape(str(out / 'report.md'))} \(\d+ s in all\)\n", printed)
        assert text == (out / "report.md").read_text()
        assert text == f"# 2 steps, 1 invocation(s)\n\n`python tiny.py --smoke --out {out}`\n"
        timing = json.loads((out / "timing.json").read_text())
        assert timing["invocations"] == 1
        assert {"runs_s", "cpu_runs_s", "work_s", "cpu_work_s", "total_s", "cpu_s"} <= set(timing)
        assert json.loads((out / "report.json").read_text()) == {"timing": timing}
        assert (out / "plot.png").read_bytes()[:4] == b"\x89PNG"
        assert sorted(p.name for p in out.iterdir()) == ["plot.png", "report.json", "report.md", "runs", "timing.json"]

        # a second invocation adds its time; --report-only adds none
        def invocation():
            return Entry.start(TinyConfig, TINY_PRESETS, ["--smoke", "--out", str(out)], "d", "python tiny.py")

        def invocations():
            return json.loads((out / "timing.json").read_text())["invocations"]

        again = invocation().finish(report)
        assert again.startswith("# 2 steps, 2 invocation(s)") and invocations() == 2
        only = invocation().report_only(report)
        assert only == again and invocations() == 2
        assert "report (finished runs only, nothing trained) -> " in capfd.readouterr().out
    finally:
        torch.set_num_threads(threads)

    png = (out / "plot.png").read_bytes()

    def no_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", no_replace)
    with pytest.raises(OSError, match="disk full"):
        write_report(out, "half", {})
    plt = _pyplot()
    fig = plt.figure(figsize=(1, 1))
    with pytest.raises(OSError, match="disk full"):
        save_figure(fig, out / "plot.png", dpi=40)
    monkeypatch.undo()
    assert (out / "report.md").read_text() == only and (out / "plot.png").read_bytes() == png
    assert not (out / ".plot.png.tmp").exists() and fig.number not in plt.get_fignums()  # closed, no temp file left
