"""The toy world as train.py's default: what `--preset toy` (the preset when none is given) trains and evaluates, and
what the name 'toy' stands for (`opd.builtin`: --model, --teacher-model, --data, --eval-data, eval.py's --model and
--data-dir).

It is docs/TOY.md's world (`opd.toy.world`, seed 0: one small coloured target in a cluttered canvas, the question
its colour) with `WORLD.n_opd` training records and `WORLD.n_eval` held-out items, and a base trained on its crops
only (`opd.toy.sft`, the experiments' recipe: 150 steps), so that it reads crops well and the full image poorly: the
regional-to-global gap a run then closes. Unlike the experiments' bases it has vLLM-servable shapes
(`SFTConfig.vllm_shapes`), so `--rollout-engine vllm` serves it.

`toy_defaults()` builds both on first use under `opd.tiny.cache_dir()/toy-<digest>/` (world/, base/) and reuses
them after: under a file lock (one builder; another process waits for it and then reuses its folders), with one
torch thread (the same weights whatever the machine's cores), each folder written whole (`export_world`,
`train_base`).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from opd.tiny import cache_dir
from opd.toy.sft import SFT_VERSION, SFTConfig, train_base
from opd.toy.world import WORLD_VERSION, WorldConfig, export_world

WORLD = WorldConfig(seed=0, n_opd=1920, n_audit=0, n_eval=200)
"""The default world: 1920 training records (one epoch of the toy preset: 60 steps of 32 prompts) and 200 held-out
items (the preset's live evaluation and `eval.py --data-dir toy`)."""
SFT = SFTConfig(steps=150, vllm_shapes=True)
"""The default base: the experiments' recipe (150 steps of 16 crops, lr 1e-3) in vLLM-servable shapes."""


@dataclass(frozen=True)
class ToyDefault:
    """The default toy world's files."""

    base: Path
    """The base model (a `save_pretrained` folder with its processor)."""
    data: Path
    """The training JSONL (bbox form)."""
    bench: Path
    """The held-out benchmark, as eval.py's --data-dir (zoombench/toy.json with crops)."""


def root() -> Path:
    """cache_dir()/toy-<digest>: the digest of WORLD, SFT and their code versions, so that a change to any of them
    builds a new folder (an old one stays as it was)."""
    key = json.dumps([WORLD_VERSION, asdict(WORLD), SFT_VERSION, asdict(SFT)], sort_keys=True)
    return cache_dir() / f"toy-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def toy_defaults(log=None) -> ToyDefault:
    """The default toy world and base, built on first use (about a minute on one CPU core, said through `log`, default
    print) and reused after."""
    folder = root()
    toy = ToyDefault(folder / "base", folder / "world" / "train.jsonl", folder / "world" / "bench")
    if _complete(folder):
        return toy
    say = log or (lambda line: print(line, flush=True))
    folder.mkdir(parents=True, exist_ok=True)
    with _locked(folder.parent / f".{folder.name}.lock"):
        if not _complete(folder):  # another process may have built it while this one waited
            _build(folder, say)
    return toy


def _complete(folder: Path) -> bool:
    return (folder / "world" / "world.json").is_file() and (folder / "base" / "sft.json").is_file()


@contextlib.contextmanager
def _locked(path: Path):
    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build(folder: Path, say) -> None:
    t0 = time.perf_counter()
    say(f"toy world: building it once in {folder} ({WORLD.n_opd} training images, {WORLD.n_eval} held-out items), "
        f"then its base model ({SFT.steps} supervised steps on crops, about a minute on one core)")
    export_world(folder / "world", WORLD)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same weights on every machine, and faster than two threads for a model this size
    try:
        train_base(folder / "base", WORLD, SFT, log=say)
    finally:
        torch.set_num_threads(threads)
    say(f"toy world: built in {time.perf_counter() - t0:.0f} s; reused from now on")
