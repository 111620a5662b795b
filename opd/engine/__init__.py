"""Rollouts (Algorithm 1, line 3): Hugging Face `generate`, the optional vLLM engine, and fixed stand-ins.
"""
