"""torch, imported when a function runs: the settings path loads without it.

`opd.config` (train.py's flags, `--help`, `--print-config`) imports every module that holds a section, and the
method table with its objectives. Those modules import torch (and transformers, and the modules that load them)
inside the functions that compute, not at their top, so that the settings load in a fraction of a second instead of
the 5-10 s torch and transformers take (tests/test_config.py checks that neither is imported). `no_grad` is
`@torch.no_grad()` for their functions.
"""

from __future__ import annotations

import functools


def no_grad(fn):
    """`@torch.no_grad()` whose torch is imported when `fn` runs."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        import torch

        with torch.no_grad():
            return fn(*args, **kwargs)

    return wrapper
