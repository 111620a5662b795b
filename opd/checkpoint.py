"""Checkpoints: everything a run needs to continue to the same result, written atomically.

DIR/checkpoint-NNNNNN/ holds policy/ (HF `save_pretrained` with its processor, loadable by eval.py),
teacher/ (the EMA teacher, same format), state.pt (step, policy optimizer, selector - network,
normalizer, replay, optimizer - RNG states and the config) and train_config.json (the run's settings,
readable without loading the optimizer state, for `train.py --resume`). It is written into a temporary folder and
renamed into place; DIR/latest then names it (also replaced atomically). Older checkpoints beyond
`keep` are removed only after the new one is complete.
"""

import json
import random
import shutil
from pathlib import Path

import numpy as np
import torch

from opd.ledger import write_atomic


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(out_dir: str | Path, step: int, policy, processor, teacher, state: dict, keep: int = 1) -> Path:
    """Writes checkpoint-{step} (step = the next step to run) and points DIR/latest at it."""
    out_dir = Path(out_dir)
    final = out_dir / f"checkpoint-{step:06d}"
    tmp = out_dir / f".checkpoint-{step:06d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    policy.save_pretrained(tmp / "policy")
    processor.save_pretrained(tmp / "policy")
    teacher.save_pretrained(tmp / "teacher")
    torch.save({**state, "step": step, "rng": rng_state()}, tmp / "state.pt")
    if "config" in state:
        (tmp / "train_config.json").write_text(json.dumps(state["config"], indent=2) + "\n")
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    write_atomic(out_dir / "latest", final.name + "\n")
    old = sorted(p for p in out_dir.glob("checkpoint-*") if p.is_dir() and p != final)
    for p in old[: max(0, len(old) - (keep - 1))]:
        shutil.rmtree(p, ignore_errors=True)
    return final


def find_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder from a run folder (via DIR/latest) or the checkpoint folder itself."""
    path = Path(path)
    if (path / "state.pt").is_file():
        return path
    latest = path / "latest"
    if latest.is_file():
        ckpt = path / latest.read_text().strip()
        if (ckpt / "state.pt").is_file():
            return ckpt
        raise FileNotFoundError(f"{latest} names {ckpt.name}, which is missing or incomplete")
    raise FileNotFoundError(f"no checkpoint in {path} (expected {path}/latest or {path}/state.pt)")


def load_state(ckpt: Path) -> dict:
    return torch.load(Path(ckpt) / "state.pt", map_location="cpu", weights_only=False)


def load_config(ckpt: Path) -> dict:
    """The run's settings stored with a checkpoint (train_config.json; state.pt for older checkpoints)."""
    path = Path(ckpt) / "train_config.json"
    if path.is_file():
        return json.loads(path.read_text())
    return load_state(ckpt).get("config", {})
