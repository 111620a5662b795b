"""Evaluation on the paper's seven benchmarks (Table 1) from their shipped local files.

    python eval.py --model runs/paper-4b --data-dir data/eval --out runs/paper-4b/eval
    python eval.py --model Qwen/Qwen3.5-4B --benchmarks zoombench --view crop --data-dir data/eval --out runs/base
    python eval.py --compare runs/base runs/paper-4b/eval
    torchrun --nproc_per_node 8 eval.py --model runs/paper-4b --data-dir data/eval --out runs/paper-4b/eval
    python eval.py --backend openai --base-url http://127.0.0.1:8000/v1 --model runs/paper-4b --data-dir data/eval

Greedy decoding (temperature 0, seed 42) with plain Hugging Face `generate`, the model and processor
loaded as in training, the non-thinking prompt unless --enable-thinking. Predictions are appended to
OUT/<benchmark>/predictions.jsonl as they come, so a stopped run resumes where it stopped (with the
same model: its files' digest, not its path, is the resume key); the scores go to OUT/results.json and
OUT/results.md (Table 1 order, unweighted average). docs/EVAL.md lists the files each benchmark needs
and where scoring departs from the paper. Errors the user can fix are one line and exit code 2.

A sharded (--fsdp) training checkpoint without a policy/ export is exported first (`opd.export`). Under a
launcher (torchrun, accelerate launch) each process answers its share of every benchmark
(`opd.eval.parallel`); rank 0 merges and scores. --backend openai / vllm answer through a server
(`opd.eval.backends`) with the same prompts, parsers and aggregates.

This script is the command line only: the settings, their checks and `main` live in `opd.eval.cli` (library
code calls `opd.eval.cli.main(argv)`), the run itself in `opd.eval.run`.
"""

import sys

from opd.cli import run_cli
from opd.eval.cli import EvalConfig, check_config, main, parse_args  # noqa: F401 (eval.main: tests and tools)
from opd.eval.run import evaluate, resolve_model  # noqa: F401

if __name__ == "__main__":
    run_cli(main, sys.argv[1:], "eval.py")
