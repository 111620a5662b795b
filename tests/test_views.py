"""Views of the family (geometry, seeds, text) and the method table."""

import json

import numpy as np
import pytest
from PIL import Image

from opd.data.sources import load_records
from opd.methods.table import METHODS, get_method
from opd.data.family_views import REFERENCE_TEMPLATE, half_resolution, mask_box, masked
from opd.data.records import VIEWS, get_view


@pytest.fixture
def records(tmp_path):
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (45, 61, 3), dtype=np.uint8)).save(tmp_path / "full.png")
    Image.fromarray(rng.integers(0, 255, (21, 30, 3), dtype=np.uint8)).save(tmp_path / "crop.png")
    rows = [
        {"images": ["full.png"], "teacher_images": ["crop.png"], "problem": "<image>Q1?", "answer": "B"},
        {"image": "full.png", "bbox": [10, 5, 40, 35], "problem": "<image>Q2?", "answer": "3", "solution": "three dots"},
        {"images": ["full.png"], "problem": "<image>Q3?", "answer": "no"},
    ]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return load_records(tmp_path / "t.jsonl")


def test_half_resolution_halves_each_side_with_lanczos(records):
    full = VIEWS["full"](records[0])[0][0]
    (half,), question = VIEWS["half_resolution"](records[0])
    assert full.size == (61, 45) and half.size == (30, 22) and question == "<image>Q1?"
    assert np.array_equal(np.asarray(half), np.asarray(full.resize((30, 22), Image.LANCZOS)))
    assert half_resolution(Image.new("RGB", (1, 1))).size == (1, 1)


@pytest.mark.parametrize("size", [(30, 21), (64, 64), (200, 37), (7, 300), (3, 3)])
def test_mask_has_a_third_of_the_area_within_one_pixel_row(size):
    width, height = size
    for seed in range(200):
        x0, y0, x1, y1 = mask_box(width, height, seed)
        w, h = x1 - x0, y1 - y0
        assert 0 <= x0 < x1 <= width and 0 <= y0 < y1 <= height
        assert abs(w * h - width * height / 3) <= max(w, h), (seed, w, h)
        if w < width and h < height:  # not clamped by a side: the aspect ratio lies in U(0.5, 2), up to rounding
            assert 0.5 - 1 / h - 0.02 <= w / h <= 2 + 2 / h + 0.02


def test_mask_is_black_where_drawn_and_untouched_elsewhere():
    rng = np.random.default_rng(3)
    image = Image.fromarray(rng.integers(1, 255, (40, 50, 3), dtype=np.uint8))
    out = np.asarray(masked(image, seed=11))
    x0, y0, x1, y1 = mask_box(50, 40, 11)
    inside = np.zeros((40, 50), dtype=bool)
    inside[y0:y1, x0:x1] = True
    assert (out[inside] == 0).all()
    assert np.array_equal(out[~inside], np.asarray(image)[~inside])


def test_mask_position_follows_the_seed():
    boxes = [mask_box(64, 64, seed) for seed in range(50)]
    assert boxes == [mask_box(64, 64, seed) for seed in range(50)]  # the same seed, the same mask
    assert len(set(boxes)) > 40  # a fresh mask per (seed, step, row), not one fixed rectangle


def test_masked_view_masks_the_crop_and_reference_view_adds_the_reference(records):
    (img,), q = VIEWS["masked"](records[0], 5)
    crop = VIEWS["crop"](records[0])[0][0]
    assert img.size == crop.size == (30, 21) and q == "<image>Q1?"
    assert np.array_equal(np.asarray(img), np.asarray(masked(crop, 5)))
    (img,), q = VIEWS["reference_answer"](records[0])
    assert img.size == (61, 45) and q == REFERENCE_TEMPLATE.format(problem="<image>Q1?", reference="B")
    assert VIEWS["reference_answer"](records[1])[1].endswith("Reference answer (visible to you only): three dots\n"
                                                            "Answer the question above.")  # fmt: skip
    assert VIEWS["full"](records[1])[1] == "<image>Q2?"  # the student's prompt is unchanged


def test_eligibility_follows_what_a_view_needs(records):
    assert [VIEWS["crop"].eligible(r) for r in records] == [True, True, False]
    assert [VIEWS["masked"].eligible(r) for r in records] == [True, True, False]
    for name in ("full", "half_resolution", "reference_answer"):
        assert all(VIEWS[name].eligible(r) for r in records)
    with pytest.raises(ValueError, match="unknown view 'zoom'"):
        get_view("zoom")


def test_method_table():
    assert list(METHODS) == ["bas-opd", "vision-opd", "rp-opsd", "opd-v", "opsd", "dapd", "gkd", "opod", "tm-opd"]
    for m in METHODS.values():
        m.check()
    assert get_method("opd-v").teacher_views == ("crop", "masked")
    rp = get_method("rp-opsd")
    assert (rp.student_view, rp.teacher_views, rp.support, rp.divergence) == ("half_resolution", ("full",), "teacher", "bc_rkl")
    assert get_method("opsd").settings["ema_tau"] == 0.0 and get_method("vision-opd").settings == {"policy": "full", "rho": 1.0}
    assert get_method("bas-opd").settings == {}
    dapd, opod = get_method("dapd"), get_method("opod")
    assert (dapd.objective.name, dapd.external_teachers, dapd.teacher_views) == ("dapd", "refused", ("reference_answer",))
    assert dapd.settings == {"policy": "full", "rho": 1.0, "ema_tau": 1.0, "ema_every": 100}
    assert (opod.objective.name, opod.external_teachers, opod.token_weight) == ("opod", "required", "gate")
