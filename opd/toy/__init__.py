"""The toy world (experiments/toy.py): a seeded world where the crop really helps (`world`) and its
crop-trained tiny Qwen3.5 base model (`sft`)."""
