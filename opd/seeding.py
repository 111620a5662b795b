"""Seeds derived from several integers, so that draws that must agree across ranks (or across a
resume) are pure functions of (seed, step, ...) instead of a shared mutable generator."""

from __future__ import annotations

import numpy as np
import torch


def mix_seed(*keys: int) -> int:
    """A 63-bit seed mixing the given integers (numpy's SeedSequence hash)."""
    return int(np.random.SeedSequence([int(k) for k in keys]).generate_state(1, dtype=np.uint64)[0] >> 1)


def seeded_generator(*keys: int) -> torch.Generator:
    """A CPU generator seeded by mix_seed(*keys), e.g. (selector seed, step, stream)."""
    return torch.Generator().manual_seed(mix_seed(*keys))
