"""The built-in toy world (train.py's `--model toy` / `--data toy`): a seeded world where the crop really helps
(`world`), its crop-trained tiny Qwen3.5 base model (`sft`) and train.py's default built from them (`default`).
The toy studies' harness (runs, audits, reports, other worlds) is experiments/harness/, outside the library."""
