"""Official aggregates against hand-computed values."""

import pytest

from opd.eval.metrics import accuracy, score, zoom_gap


def rec(index, correct, category="", parsed=True, pred=None, answer=None, **meta):
    return {"index": str(index), "correct": correct, "category": category, "parsed": parsed,
            "pred": pred, "answer": answer, "meta": meta}


def test_accuracy_is_percent():
    assert accuracy([rec(1, True), rec(2, False), rec(3, True), rec(4, True)]) == 75.0
    assert accuracy([]) is None


def test_vstar_pooled_and_per_category():
    records = [rec(1, True, "direct_attributes"), rec(2, True, "direct_attributes"), rec(3, False, "direct_attributes"),
               rec(4, True, "relative_position"), rec(5, False, "relative_position", parsed=False)]
    out = score("vstar", records)
    assert out["score"] == pytest.approx(60.0)  # 3/5 pooled, not the mean of 66.67 and 50
    assert out["per_category"] == pytest.approx({"direct_attributes": 200 / 3, "relative_position": 50.0})
    assert (out["n"], out["unparsed"]) == (5, 1)


def test_hrbench_mean_over_cycles():
    # cycle0: 3 of 4 right (75%); cycle1: 1 of 2 right (50%) -> 62.5, while pooled would be 66.67.
    records = [rec(0, True, "single", cycle_category="c0"), rec(1, True, "single", cycle_category="c0"),
               rec(2, True, "cross", cycle_category="c0"), rec(3, False, "cross", cycle_category="c0"),
               rec(4, True, "single", cycle_category="c1"), rec(5, False, "cross", cycle_category="c1")]
    out = score("hrbench4k", records)
    assert out["score"] == pytest.approx(62.5)
    assert out["per_cycle"] == pytest.approx({"c0": 75.0, "c1": 50.0})
    assert out["single"] == pytest.approx((100.0 + 100.0) / 2)
    assert out["cross"] == pytest.approx((50.0 + 0.0) / 2)
    assert "note" not in out


def test_mmvp_question_and_pair_accuracy():
    flags = [True, True, True, False, False, False]  # pairs (1,2) right, (3,4) and (5,6) not
    records = [rec(i + 1, c) for i, c in enumerate(flags)] + [rec(7, True)]
    out = score("mmvp", records)
    assert out["score"] == pytest.approx(400 / 7)
    assert out["pair_accuracy"] == pytest.approx(100 / 3)
    assert (out["pairs"], out["incomplete_pairs"]) == (3, 1)


def test_mmvp_pair_from_meta():
    records = [rec("x", True, pair=1), rec("y", True, pair=1), rec("z", True, pair=2), rec("w", False, pair=2)]
    assert score("mmvp", records)["pair_accuracy"] == 50.0


def test_cvbench_formula_with_unequal_source_counts():
    def cv(i, ok, source, kind):
        return rec(i, ok, source=source, type=kind, task="Count")

    records = ([cv(i, i < 3, "ADE20K", "2D") for i in range(4)]  # 75%
               + [cv(10 + i, i < 1, "COCO", "2D") for i in range(2)]  # 50%
               + [cv(20 + i, i < 2, "Omni3D", "3D") for i in range(5)])  # 40%
    out = score("cvbench", records)
    assert out["score"] == pytest.approx(0.5 * ((75 + 50) / 2 + 40))  # 51.25
    assert out["score"] != pytest.approx(accuracy(records))  # pooled would be 54.55
    assert out["per_source"] == pytest.approx({"ADE20K": 75.0, "COCO": 50.0, "Omni3D": 40.0})
    assert out["acc_2d"] == pytest.approx(400 / 6) and out["acc_3d"] == pytest.approx(40.0)
    assert "missing_sources" not in out


def test_cvbench_partial_run_names_missing_sources():
    out = score("cvbench", [rec(1, True, source="COCO", type="2D"), rec(2, False, source="Omni3D", type="3D")])
    assert out["score"] == pytest.approx(50.0)
    assert out["missing_sources"] == ["ADE20K"]


def test_mmstar_accuracy_and_categories():
    records = [rec(1, True, "math", l2_category="geometry"), rec(2, False, "math", l2_category="geometry"),
               rec(3, True, "coarse perception", l2_category="image emotion")]
    out = score("mmstar", records)
    assert out["score"] == pytest.approx(200 / 3)
    assert out["per_category"] == pytest.approx({"coarse perception": 100.0, "math": 50.0})
    assert out["per_l2_category"] == pytest.approx({"geometry": 50.0, "image emotion": 100.0})


def pope(i, answer, pred, split):
    return rec(i, pred == answer, split, parsed=pred is not None, pred=pred, answer=answer, split=split)


def test_pope_f1_per_split():
    records = [pope(1, "yes", "yes", "adversarial"), pope(2, "yes", "no", "adversarial"),
               pope(3, "no", "yes", "adversarial"), pope(4, "no", "no", "adversarial"),
               pope(5, "yes", "yes", "random"), pope(6, "yes", "yes", "random"),
               pope(7, "no", "no", "random"), pope(8, "no", None, "random")]  # unparsed: wrong, not "yes"
    out = score("pope", records)
    adv, rnd = out["per_split"]["adversarial"], out["per_split"]["random"]
    assert (adv["accuracy"], adv["precision"], adv["recall"], adv["f1"]) == pytest.approx((50, 50, 50, 50))
    assert (rnd["accuracy"], rnd["precision"], rnd["recall"], rnd["f1"]) == pytest.approx((75, 100, 100, 100))
    assert rnd["yes_ratio"] == pytest.approx(50.0)
    overall = out["overall"]
    assert (overall["precision"], overall["recall"], overall["f1"]) == pytest.approx((75, 75, 75))
    assert out["score"] == pytest.approx(62.5) and out["unparsed"] == 1


def test_pope_no_yes_predictions_gives_zero_f1():
    stats = score("pope", [pope(1, "yes", "no", "random"), pope(2, "no", "no", "random")])["per_split"]["random"]
    assert stats["precision"] is None and stats["recall"] == 0.0 and stats["f1"] == 0.0


def test_zoombench_and_zoom_gap():
    full = [rec(1, True, "text"), rec(2, False, "text"), rec(3, False, "brand"), rec(4, True, "brand")]
    crop = [rec(1, True), rec(2, True), rec(3, True), rec(9, False)]
    assert score("zoombench", full)["score"] == 50.0
    gap = zoom_gap(full, crop)  # common indices 1-3: full 1/3, crop 3/3
    assert gap["n"] == 3
    assert gap["gap"] == pytest.approx(100 - 100 / 3)


def test_score_rejects_unknown_and_empty():
    with pytest.raises(ValueError, match="unknown benchmark 'mmbench'"):
        score("mmbench", [rec(1, True)])
    with pytest.raises(ValueError, match="pope: no records"):
        score("pope", [])
