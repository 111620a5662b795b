"""Evaluation on the paper's seven benchmarks (eval.py): loaders, answer parsing, official metrics,
greedy inference, the resumable loop, the optional LLM judge and the result tables."""
