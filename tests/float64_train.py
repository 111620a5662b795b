"""train.py with the tiny Qwen3.5's float32 casts in float64 for float64 weights (tests/float64.py): for a CLI run
with --dtype float64 that a test compares with another grouping of the same computation (tests/test_fsdp.py)."""

import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from float64 import float64_model  # noqa: E402

float64_model()
sys.argv[0] = str(ROOT / "train.py")
runpy.run_path(sys.argv[0], run_name="__main__")
