"""Evaluation on the paper's seven benchmarks (Table 1), or the family's six (--preset family), from shipped files.

    python eval.py --model runs/paper-4b --data-dir data/eval --out runs/paper-4b/eval
    python eval.py --preset family --model runs/paper-4b --data-dir data/eval --out runs/paper-4b/eval
    python eval.py --compare runs/base runs/paper-4b/eval
    torchrun --nproc_per_node 8 eval.py --model runs/paper-4b --data-dir data/eval --out runs/paper-4b/eval

Greedy decoding (temperature 0, seed 42), the model and processor loaded as in training, non-thinking unless
--enable-thinking; --backend openai / vllm answer through a server with the same prompts, parsers and aggregates.
Predictions are appended to OUT/<benchmark>/predictions.jsonl as they come (a stopped run resumes; the model's files'
digest is the resume key); the scores go to OUT/results.json and OUT/results.md. Errors the user can fix are one line
and exit code 2. docs/EVAL.md has the files each benchmark needs and where scoring departs from the paper.

The command line only: the settings, their checks and `main` live in `opd.eval.cli`, the run in `opd.eval.run`.
"""

import sys

from opd.cli import run_cli
from opd.eval.cli import EvalConfig, check_config, main, parse_args  # noqa: F401 (eval.main: tests and tools)

if __name__ == "__main__":
    run_cli(main, sys.argv[1:], "eval.py")
