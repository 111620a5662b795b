"""A sharded (--fsdp) training checkpoint as a `save_pretrained` folder, in one process.

    python -m opd.export RUN/checkpoint-000004            # writes RUN/checkpoint-000004/policy/
    python -m opd.export RUN --out exports/step4          # RUN's latest checkpoint, elsewhere

A `--fsdp` run writes every checkpoint as checkpoint-N/sharded/, one torch.distributed.checkpoint (DCP) of
{"policy", "teacher", "optimizer"}, and only its last checkpoint also as policy/ in `save_pretrained` form
(`opd.checkpoint.save_sharded`). `export_checkpoint` turns any of them into that form without a launcher or a
process group: DCP reads its own shards in one process (`dcp.load(..., no_dist=True)`), and only the "policy"
entries are read, into CPU tensors of the shapes and dtypes the checkpoint records. The model class, config,
generation config and processor come from the run's own `--model` (checkpoint-N/train_config.json: `model`,
none = the built-in tiny model), built on the meta device (no weights are initialised or read from it); its
parameter names must be the checkpoint's, one for one. The folder is written by the same call the trainer's
export makes (`model.save_pretrained(folder, state_dict=full)`, `opd.checkpoint.export_pretrained`) into a
temporary sibling and renamed into place, so the weights are the ones the trainer would have exported at that
step, bit for bit. eval.py calls it (`ensure_export`) when given such a checkpoint.

Memory: the full policy in its training dtype (float32: 4 bytes per parameter, 16 GB for a 4B model) on the CPU.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

from opd.cli import Parser, UserError, run_cli

POLICY = "policy."  # the DCP key prefix of the policy's entries (opd.checkpoint._sharded_state)


def run_config(ckpt: Path) -> dict:
    """The run's settings stored with a checkpoint (train_config.json), or a one-line UserError."""
    from opd.checkpoint import load_config

    try:
        return load_config(ckpt)
    except (OSError, ValueError) as exc:
        raise UserError(f"{ckpt}: cannot read the run's settings (train_config.json): {exc}") from None


def run_model_source(ckpt: Path, config: dict | None = None) -> tuple[str, dict]:
    """(the folder or hub id the run's --model loads, the run's config) for a checkpoint, or a one-line
    UserError when that model is gone. The stored --model is read as train.py was given it: a relative path is
    relative to the current folder (train.py's, when run from where the run was started); when it is not there,
    the error names train_config.json's field `model` and the folder it was looked for in."""
    from opd.checkpoint import model_source
    from opd.model import resolve_model_source

    config = run_config(ckpt) if config is None else config
    name = config.get("model")
    if name is None:  # --preset tiny without --model: the built-in tiny model (rebuilt if its cache is gone)
        from opd.tiny import tiny_defaults

        return str(tiny_defaults()[0]), config
    try:
        return resolve_model_source(model_source(name, f"--model {name}")), config
    except UserError as exc:
        relative = name != "tiny" and not Path(name).expanduser().is_absolute()
        where = f"; a relative path is read from the current folder, {Path.cwd()}" if relative else ""
        raise UserError(f"{ckpt}: the run's --model {name} (train_config.json field 'model'{where}) is not there "
                        f"({exc}); the export needs its config and processor: restore it"
                        + (", or run from the folder train.py ran in" if relative else "")) from None


def _policy_metadata(sharded: Path) -> dict:
    """name -> DCP tensor metadata of the policy's entries (the prefix removed)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = FileSystemReader(str(sharded)).read_metadata().state_dict_metadata
    entries = {k[len(POLICY):]: v for k, v in meta.items() if k.startswith(POLICY)}
    bad = [k for k, v in entries.items() if not isinstance(v, TensorStorageMetadata)]
    if bad:
        raise UserError(f"{sharded}: policy entries that are not tensors: {', '.join(bad[:3])}")
    return entries


def _skeleton(source: str, dtype: str):
    """The run's model class and config on the meta device (no weights), with the model's generation config."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText, GenerationConfig

    from opd.model import DTYPES

    config = AutoConfig.from_pretrained(source)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config, dtype=DTYPES.get(dtype, torch.float32))
    try:  # the trainer's policy carried the checkpoint's own (eos ids, pad): its export writes it
        model.generation_config = GenerationConfig.from_pretrained(source)
    except OSError:
        pass
    return model


def export_checkpoint(ckpt: str | Path, out: str | Path | None = None) -> Path:
    """Writes the policy of a sharded checkpoint (or of a run folder's latest one) as a `save_pretrained` folder
    with its processor: `out`, by default checkpoint-N/policy/. Returns the folder. One process, no
    torch.distributed process group; a UserError (one line) for a folder that is not a sharded checkpoint, a
    run model that is gone or does not match the checkpoint's parameters, or an `out` that exists."""
    import torch
    import torch.distributed.checkpoint as dcp

    from opd.checkpoint import find_checkpoint
    from opd.model import load_processor

    try:
        ckpt = find_checkpoint(Path(ckpt).expanduser())
    except FileNotFoundError as exc:
        raise UserError(str(exc)) from None
    sharded = ckpt / "sharded"
    if not (sharded / ".metadata").is_file():
        raise UserError(f"{ckpt} has no sharded checkpoint ({sharded}/.metadata): only --fsdp runs write one"
                        + ("; its policy/ is already the export" if (ckpt / "policy").is_dir() else ""))
    out = Path(out).expanduser() if out is not None else ckpt / "policy"
    if out.exists():
        raise UserError(f"{out} exists (an earlier export?): remove it or give another --out")
    config = run_config(ckpt)
    if config.get("lora_r"):  # the shards hold peft's wrapped names and the adapters (opd/lora.py); first: no model read
        raise UserError(f"{ckpt}: a LoRA (--lora-r {config['lora_r']}) run's sharded checkpoint; opd.export writes "
                        "whole models only (the run's last checkpoint holds its adapter export)")
    source, config = run_model_source(ckpt, config)
    dtype = config.get("dtype", "float32")
    entries = _policy_metadata(sharded)
    model = _skeleton(source, dtype)
    names = set(model.state_dict())
    missing, extra = sorted(names - entries.keys()), sorted(entries.keys() - names)
    if missing or extra:
        detail = "; ".join(f"{what} {len(keys)} ({', '.join(keys[:2])}{', ...' if len(keys) > 2 else ''})"
                           for what, keys in (("missing", missing), ("unexpected", extra)) if keys)
        raise UserError(f"{ckpt}: its policy does not fit the run's --model {source} ({type(model).__name__}): "
                        f"parameters {detail}")
    state = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in entries.items()}
    with warnings.catch_warnings():  # "torch.distributed is disabled ...: assuming ... a single process": meant
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({"policy": state}, checkpoint_id=sharded, no_dist=True)  # only the policy's entries are read
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.export-", dir=out.parent))
    try:
        model.save_pretrained(tmp, state_dict=state)  # as opd.checkpoint.export_pretrained
        load_processor(source).save_pretrained(tmp)
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it 0700: the mode a plain mkdir gives the folder
        try:
            os.rename(tmp, out)
        except OSError:  # another process exported it meanwhile
            if not (out / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _umask() -> int:
    """This process's umask (read by setting it and setting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def sharded_without_export(path: str | Path) -> Path | None:
    """The checkpoint a train.py run or checkpoint folder names (its latest), when it is sharded and has no
    policy/ export yet; None for anything else (left to `opd.checkpoint.model_source`). A sharded folder
    without DCP metadata (an incomplete write) is a UserError."""
    from opd.checkpoint import find_checkpoint

    folder = Path(path).expanduser()
    run_like = (folder / "latest").is_file() or (folder / "state.pt").is_file()
    if not folder.is_dir() or (folder / "config.json").is_file() or not run_like:
        return None
    try:
        ckpt = find_checkpoint(folder)
    except FileNotFoundError:
        return None
    if (ckpt / "policy").is_dir() or not (ckpt / "sharded").is_dir():
        return None
    if not (ckpt / "sharded" / ".metadata").is_file():
        raise UserError(f"{ckpt}/sharded has no .metadata: an incomplete --fsdp checkpoint, nothing to export")
    return ckpt


def ensure_export(path: str | Path, what: str = "--model", log=print) -> Path | None:
    """For eval.py: exports a sharded checkpoint without policy/ (`sharded_without_export`) to its policy/,
    saying so in one line first; returns the new folder, or None when there was nothing to do."""
    ckpt = sharded_without_export(path)
    if ckpt is None:
        return None
    log(f"{what} {path}: {ckpt.name} is a sharded (--fsdp) checkpoint without policy/; exporting it to "
        f"{ckpt / 'policy'} first (python -m opd.export)")
    return export_checkpoint(ckpt)


def main(argv: list[str] | None = None) -> Path:
    parser = Parser(prog="python -m opd.export", description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("checkpoint", help="a --fsdp checkpoint folder (checkpoint-N) or a run folder (its latest)")
    parser.add_argument("--out", default=None, help="where to write the save_pretrained folder "
                        "(default: CHECKPOINT/policy/); it must not exist")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    out = export_checkpoint(args.checkpoint, args.out)
    print(f"python -m opd.export: wrote {out} in {time.perf_counter() - t0:.1f} s "
          f"(eval.py --model {out})", flush=True)
    return out


if __name__ == "__main__":
    run_cli(main, sys.argv[1:], "python -m opd.export")
