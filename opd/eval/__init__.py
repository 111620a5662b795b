"""Evaluation on the paper's seven benchmarks (eval.py): the command line (`cli`: settings, checks, `main`), one
run (`run`), the output folder's lock (`lock`) and writes (`storage`), loaders, answer parsing, official metrics,
greedy inference, the resumable loop, the optional LLM judge and the result tables."""
