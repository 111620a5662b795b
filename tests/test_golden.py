"""The recorded ledgers (tests/golden.py) stay what they were: a restructuring changes no result.

Each case runs train.py's command line again (3 steps of the tiny model in float64; one rank in this process, two
under torchrun) and compares
every ledger field that is a result: counts exactly, floats to a relative 1e-9. The bound: every float is a float64
computation (tests/float64.py), whose rounding differs between CPUs (vector widths, summation orders) by a few ulps
(~1e-16 relative); three AdamW steps (each dividing by sqrt(v), ~1e3 amplification at most on these sizes) keep the
difference below ~1e-12, so 1e-9 leaves three orders of margin; a change of the computation (a lost token, a
weight, another micro-batch mean) moves a float32-sized 1e-7 at the least.
"""

import json
import math

import pytest
from golden import CASES, GOLDEN, run_case, teacher_model

REL = 1e-9


def assert_same_row(name: str, got: dict, want: dict) -> None:
    assert set(got) == set(want), f"{name}: fields {sorted(set(got) ^ set(want))}"
    for key, value in want.items():
        if isinstance(value, float) or isinstance(got[key], float):
            if math.isnan(value):
                assert math.isnan(got[key]), f"{name} step {want['step']}: {key}"
            else:
                assert got[key] == pytest.approx(value, rel=REL, abs=1e-300), f"{name} step {want['step']}: {key}"
        else:
            assert got[key] == value, f"{name} step {want['step']}: {key}"


@pytest.fixture(scope="module")
def golden_teacher(tmp_path_factory):
    return teacher_model(tmp_path_factory.mktemp("golden"))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_a_recorded_ledger_is_reproduced(name, tmp_path, golden_teacher):
    recorded = json.loads(GOLDEN.read_text())
    assert name in recorded, f"{name} has no recorded ledger: python tests/golden.py {name!r}"
    rows = run_case(name, tmp_path / "run", golden_teacher, in_process=True)
    assert len(rows) == len(recorded[name])
    for got, want in zip(rows, recorded[name]):
        assert_same_row(name, got, want)


def test_every_case_is_recorded():
    assert set(json.loads(GOLDEN.read_text())) == set(CASES)
