"""Smoke tests of the benchmark scripts (bench/): each main runs at toy sizes and prints its table.

Timings and targets are not checked here (benchmarks, not timed tests; docs/BENCHMARKS.md has the
measured numbers); only that every script runs, prints a Markdown table and writes its JSON.
"""

import json

import pytest

from bench import loss_memory, prefill, step_breakdown, teacher_budget


def _check(capsys, out, report, header: str) -> dict:
    printed = capsys.readouterr().out
    assert header in printed and "| ---" in printed and "Target:" in printed
    assert printed.strip().endswith(report["markdown"].strip().splitlines()[-1].strip())
    return json.loads(out.read_text())


def test_loss_memory_quick(tmp_path, capsys):
    out = tmp_path / "loss.json"
    report = loss_memory.main(["--quick", "--no-peer", "--out", str(out)])
    saved = _check(capsys, out, report, "| N | ours: peak memory")
    kinds = {(r["mode"], r["method"]) for r in saved["results"] if r["status"] == "ok"}
    assert kinds == {("logits", "ours"), ("hidden", "chunked"), ("hidden", "whole"), ("hidden", "products")}
    assert all(r["median_s"] > 0 for r in saved["results"] if r["status"] == "ok")


def test_loss_memory_guard_reports_does_not_fit(tmp_path, capsys):
    out = tmp_path / "loss.json"
    loss_memory.main(
        ["--quick", "--no-peer", "--mode", "logits", "--positions", "16", "--rss-cap-gb", "0.5", "--out", str(out)]
    )
    saved = json.loads(out.read_text())
    assert [r["status"] for r in saved["results"]] == ["does not fit"]
    assert "does not fit" in capsys.readouterr().out


def test_loss_memory_peer_quick(tmp_path, capsys):
    pytest.importorskip("trl")
    out = tmp_path / "loss.json"
    report = loss_memory.main(["--quick", "--mode", "logits", "--positions", "32", "--out", str(out)])
    saved = _check(capsys, out, report, "peer: peak memory")
    assert {r["method"]: r["status"] for r in saved["results"]} == {"ours": "ok", "peer": "ok"}


def test_teacher_budget_quick(tmp_path, capsys):
    out = tmp_path / "teacher.json"
    report = teacher_budget.main(["--quick", "--out", str(out)])
    saved = _check(capsys, out, report, "| rho | selected / candidates")
    assert [r["micro_batch_tokens"] for r in saved["results"]] == [0, 64]
    for r in saved["results"]:
        full, part = r["rows"][-1], r["rows"][0]
        assert full["rho"] == 1.0 and full["selected"] == full["candidates"] and part["selected"] < full["selected"]
        assert full["teacher_padded_tokens"] >= full["teacher_tokens"] > full["scored_tokens"] > 0


def test_step_breakdown_quick(tmp_path, capsys):
    out = tmp_path / "step.json"
    report = step_breakdown.main(["--quick", "--out", str(out)])
    saved = _check(capsys, out, report, "| phase | tiny: mean")
    assert len(saved["results"][0]["rows"]) == 3
    assert report["means"]["tiny"]["step"] > 0


def test_prefill_quick(tmp_path, capsys):
    out = tmp_path / "prefill.json"
    report = prefill.main(["--quick", "--out", str(out)])
    saved = _check(capsys, out, report, "sharing off")
    r = saved["results"][0]
    assert r["same_samples"] and r["on"]["prefill_tokens"] < r["off"]["prefill_tokens"]
