"""The recorded ledgers (tests/golden.py) stay what they were: a restructuring changes no result.

Each case runs train.py's command line again (3 steps of the tiny model in float64; one rank in this process, two
under torchrun) and compares every ledger field that is a result: counts exactly, floats to a relative 1e-4.

The bound. The model computes in float64 (tests/float64.py), but some of its inputs are float32 values: the image
processor's pixel values and the rotary embeddings' cos and sin tables. Their last bit differs between machines (CPU
type, library builds): the cases recorded on an AMD EPYC and rerun on an Intel Xeon agreed in every count and
differed in their floats by float32's rounding, 1e-8 relative at step 0 and up to 3e-5 after three steps (the
`cap` case; the median case 3e-7). So the bound is float32's epsilon (1.2e-7) times the ~1e3 that three AdamW
steps (each dividing by sqrt(v)) can amplify it: 1e-4. A change of the computation is caught by the counts
(selected rows, tokens, budgets: exact) and by the floats: a lost token, a weight or a mean taken over other rows
moves the loss or the gradient norm by 1e-3 or more.
"""

import json
import math

import pytest
from golden import CASES, GOLDEN, run_case, teacher_model

REL = 1e-4


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
