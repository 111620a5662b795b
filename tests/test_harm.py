"""Selection part 4 (experiments/harm*.py; docs/SELECTION.md, "Part 4"): the harm world exact and nested in h, its
crops missing the target, its images independent of h; the diminishing-returns pick against a brute force; the paired
interval against a hand computation; the decision rule on hand-made records; the smoke, resumed."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))

from harm_world import HarmConfig, base_world, harmful  # noqa: E402
from harm_policies import diminishing_top  # noqa: E402
from harm_report import decision, interval, t975  # noqa: E402
from harness.regime import is_large  # noqa: E402
from opd.toy.world import sample  # noqa: E402

SIZES = dict(n_opd=40, n_audit=20, n_eval=60)


def _disjoint(box, where, t):
    (x1, y1, x2, y2), (tx, ty) = box, where
    return x1 > tx + t or tx > x2 or y1 > ty + t or ty > y2


def test_harmful_items_are_exactly_round_h_n_small_nested_and_their_crops_miss_the_target():
    worlds = [HarmConfig(share=0.5, harm=h, **SIZES) for h in (0.0, 0.1, 0.25)]
    shifted = HarmConfig(share=0.5, harm=0.25, harm_scale=0.6, **SIZES)
    for split, n in (("opd", 40), ("audit", 20), ("eval", 60)):
        sets = [{i for i in range(n) if harmful(w, split, i)} for w in worlds]
        assert [len(x) for x in sets] == [round(w.harm * n) for w in worlds]
        assert sets[0] <= sets[1] <= sets[2]
        assert sets[2] == {i for i in range(n) if harmful(shifted, split, i)}
        assert not any(is_large(worlds[2], split, i) for i in sets[2])
    usual_min = (20 / 64) ** 2  # the smallest usual crop: side 2 x 10 pixels
    for i in range(60):
        plain, usual, shift = (sample(w, "eval", i) for w in (worlds[0], worlds[2], shifted))
        assert plain.image.tobytes() == usual.image.tobytes() == shift.image.tobytes()  # only the crops move
        assert usual.extra["harm"] == shift.extra["harm"] == int(harmful(worlds[2], "eval", i))
        if usual.extra["harm"]:
            assert _disjoint(usual.bbox, usual.where, usual.target) and _disjoint(shift.bbox, shift.where, shift.target)
            side = usual.bbox[2] - usual.bbox[0]
            assert side == plain.bbox[2] - plain.bbox[0]  # the usual area
            assert shift.bbox[2] - shift.bbox[0] == max(16, round(0.6 * side))
            assert ((shift.bbox[2] - shift.bbox[0]) / 64) ** 2 < usual_min  # a_i tells
        else:
            assert usual.bbox == plain.bbox == shift.bbox
    assert not any(harmful(worlds[2], "sft", i) for i in range(50))
    assert base_world(shifted) == HarmConfig(share=0.5, **SIZES)
    with pytest.raises(ValueError, match="1 - share"):
        HarmConfig(share=0.5, harm=0.6)


def _brute(scores, candidates, prompts, n, gamma):
    s = {int(c): float(scores[c]) for c in candidates}
    low = min(s.values())
    s = {c: v - low + 1e-6 for c, v in s.items()}
    picked, taken = [], {}
    for _ in range(n):
        best = max((c for c in s if c not in picked), key=lambda c: (s[c] * gamma ** taken.get(prompts[c], 0), -c))
        picked.append(best)
        taken[prompts[best]] = taken.get(prompts[best], 0) + 1
    return picked


def test_diminishing_top_against_a_brute_force_and_by_hand():
    scores = torch.tensor([1.0, 0.95, 0.9, 0.5, 0.45, 0.0])
    prompts = torch.tensor([0, 0, 0, 1, 1, 2])
    cands = torch.arange(6)
    # by hand: shifted scores 1, .95, .9, .5, .45, 0; picks 0 (1), then .475 / .45 / .5 -> 3, then .475 -> 1
    assert diminishing_top(scores, cands, prompts, 3, 0.5).tolist() == [0, 3, 1]
    assert diminishing_top(scores, cands, prompts, 3, 1.0).tolist() == [0, 1, 2]  # gamma 1: plain top-K
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        scores = torch.randn(24, generator=gen, dtype=torch.float64)
        prompts = torch.randint(0, 6, (24,), generator=gen)
        cands = torch.randperm(24, generator=gen)[:18].sort().values
        got = diminishing_top(scores, cands, prompts, 7, 0.5).tolist()
        assert got == _brute(scores, cands.tolist(), prompts.tolist(), 7, 0.5)


def test_the_paired_interval_by_hand():
    c = interval([1.0, 2.0, 3.0, 4.0])
    sd = math.sqrt(((1.5**2) * 2 + (0.5**2) * 2) / 3)
    assert c["mean"] == 2.5 and c["n"] == 4
    assert c["hi"] - c["mean"] == pytest.approx(3.182 * sd / 2, rel=1e-12)
    assert t975(7) == 2.365 and t975(22) == 2.086  # between table entries: the smaller df's (wider)
    assert math.isnan(interval([3.0])["lo"])


def _rec(seed, full, tokens=100.0):
    return {"full": full, "ledger": {"scored_tokens": tokens}, "seed": seed}


def test_the_decision_rule_on_hand_made_records():
    seeds = range(8)
    by = {"random-25": {s: _rec(s, 80.0, 25) for s in seeds},
          "full-100": {s: _rec(s, 81.0 + 0.1 * s, 100) for s in seeds},
          "learned-25": {s: _rec(s, 83.0 + 0.2 * (s % 2), 15) for s in seeds},
          "oracle-25": {s: _rec(s, 79.0 + s % 3, 25) for s in seeds}}  # fmt: skip
    d = decision(by)
    assert d["pays"] and d["reproduces"] and d["tokens"]["mean"] == pytest.approx(0.15)
    by["learned-25"] = {s: _rec(s, 80.0 + (1 if s % 2 else -1), 15) for s in seeds}  # mean 0: does not pay
    d = decision(by)
    assert not d["pays"] and not d["reproduces"] and not d["oracle_wins"] and "label" in d["fault"]
    by["oracle-25"] = {s: _rec(s, 82.0 + 0.1 * s, 25) for s in seeds}
    assert "features" in decision(by)["fault"]


@pytest.mark.slow
def test_the_harm_study_smoke_records_every_run_and_resumes(tmp_path):
    """experiments/harm.py --smoke: every world x policy and the noise leg leave a record; Oracle-25's ledger has
    |S| = K; a second invocation trains nothing (the records), even with the run folders gone."""
    import harm

    out, results = tmp_path / "out", tmp_path / "results"
    text = harm.main(["--smoke", "--out", str(out), "--results", str(results)])
    recs = sorted(results.glob("*/*/seed0.json"))
    assert len(recs) == len(harm.WORLDS) * len(harm.POLICIES) + len(harm.NOISE)
    oracle = json.loads((results / "h25" / "oracle-25" / "seed0.json").read_text())
    assert oracle["ledger"]["calls"] == oracle["ledger"]["steps"] * 4 and oracle["mix"]["S"]
    assert oracle["factors_end"] and all(0 <= r["o"] <= 1 and r["c"] <= 1 for r in oracle["factors_end"])
    assert "Decision:" in text and "all hold" in text
    import shutil

    shutil.rmtree(out / "runs")
    before = {p: p.stat().st_mtime_ns for p in recs}
    harm.main(["--smoke", "--out", str(out), "--results", str(results)])
    assert {p: p.stat().st_mtime_ns for p in recs} == before and not (out / "runs").exists()
