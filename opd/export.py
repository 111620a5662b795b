"""A training checkpoint as one `save_pretrained` folder, in one process: a sharded (--fsdp) one, or a LoRA run's.

    python -m opd.export RUN/checkpoint-000004            # sharded: writes RUN/checkpoint-000004/policy/
    python -m opd.export RUN --out exports/step4          # RUN's latest checkpoint, elsewhere
    python -m opd.export LORA_RUN                         # LoRA: writes LORA_RUN/checkpoint-N/merged/

Sharded: `export_checkpoint` reads the DCP shards' "policy" entries in one process (no launcher), into the run's own
`--model` built on the meta device, and writes the folder with the trainer's own export call, so the weights are
bit for bit the trainer's; missing or truncated shards are one line (`check_shards`). LoRA: the adapter's base with
the adapter merged in (peft's merge_and_unload), written to checkpoint-N/merged/ by default. eval.py calls
`ensure_export` for a sharded checkpoint without policy/. Memory: the full policy in its training dtype on the CPU.
Details: docs/MODULES.md#opdexport.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from peft import LoraConfig, get_peft_model
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from transformers import AutoConfig, AutoModelForImageTextToText, GenerationConfig

from opd.builtin import is_builtin, model_source
from opd.cli import Parser, UserError, run_cli
from opd.models.loading import DTYPES, load_model, load_processor, resolve_model_source
from opd.models.lora import STUDENT, is_adapter_folder
from opd.run_folder import find_checkpoint, load_config
from opd.storage import room
from opd.tiny import tiny_defaults

POLICY = "policy."  # the DCP key prefix of the policy's entries (opd.loop.checkpoint._sharded_state)
MERGED = "merged"  # a LoRA checkpoint's export: checkpoint-N/merged/ (its policy/ is the adapter)


def run_config(ckpt: Path) -> dict:
    """The run's settings stored with a checkpoint (train_config.json), or a one-line UserError."""
    try:
        return load_config(ckpt)
    except (OSError, ValueError) as exc:
        raise UserError(f"{ckpt}: cannot read the run's settings (train_config.json): {exc}") from None


def run_model_source(ckpt: Path, config: dict | None = None) -> tuple[str, dict]:
    """(the folder or hub id the run's --model loads, the run's config) for a checkpoint, or a one-line
    UserError when that model is gone. The stored --model is read as train.py was given it: a relative path is
    relative to the current folder (train.py's, when run from where the run was started); when it is not there,
    the error names train_config.json's field `model` and the folder it was looked for in."""
    config = run_config(ckpt) if config is None else config
    name = config.get("model")
    if name is None:  # --preset tiny without --model: the built-in tiny model (rebuilt if its cache is gone; its
        # vLLM-servable variant for a --rollout-engine vllm run, opd.loop.build)
        return str(tiny_defaults(vllm=config.get("rollout_engine") == "vllm")[0]), config
    try:
        return resolve_model_source(model_source(name, f"--model {name}")), config
    except UserError as exc:
        relative = not is_builtin(name, "model") and not Path(name).expanduser().is_absolute()
        where = f"; a relative path is read from the current folder, {Path.cwd()}" if relative else ""
        raise UserError(f"{ckpt}: the run's --model {name} (train_config.json field 'model'{where}) is not there "
                        f"({exc}); the export needs its config and processor: restore it"
                        + (", or run from the folder train.py ran in" if relative else "")) from None


def _policy_metadata(ckpt: Path, sharded: Path) -> tuple[dict, dict]:
    """(name -> DCP tensor metadata of the policy's entries (the prefix removed), DCP's storage index: where each
    entry lies in which file); an unreadable .metadata is a one-line UserError."""
    try:
        meta = FileSystemReader(str(sharded)).read_metadata()
    except Exception as exc:  # noqa: BLE001 (a truncated or foreign pickle: any unpickling error)
        raise UserError(f"{ckpt}: cannot read {sharded}/.metadata ({_one_line(exc)}): an incomplete or damaged "
                        "--fsdp checkpoint; export another checkpoint, or copy this one again") from None
    entries = {k[len(POLICY):]: v for k, v in meta.state_dict_metadata.items() if k.startswith(POLICY)}
    bad = [k for k, v in entries.items() if not isinstance(v, TensorStorageMetadata)]
    if bad:
        raise UserError(f"{sharded}: policy entries that are not tensors: {', '.join(bad[:3])}")
    return entries, meta.storage_data


def _one_line(exc: BaseException) -> str:
    """An error in one line: its type and message, or for DCP's CheckpointException (whose message holds each
    rank's traceback) the root error, its last line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if type(exc).__name__ == "CheckpointException" and lines:
        text = lines[-1]  # "RuntimeError: PytorchStreamReader failed reading zip archive: ..."
    else:
        text = f"{type(exc).__name__}: {' '.join(lines)}"
    return text[:300] + ("..." if len(text) > 300 else "")


def check_shards(ckpt: Path, sharded: Path, storage: dict, names) -> None:
    """Every shard file holding an entry of the policy's `names` is there and long enough for them (DCP's storage
    index gives each entry's file, offset and length), or one UserError naming the checkpoint and what is missing
    or truncated; nothing is read but the files' sizes."""
    wanted = {POLICY + n for n in names}
    need: dict[str, int] = {}
    for index, info in storage.items():
        if index.fqn in wanted:
            need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    missing = sorted(p for p in need if not (sharded / p).is_file())
    short = {p: (sharded / p).stat().st_size for p in sorted(need) if p not in missing}
    short = {p: size for p, size in short.items() if size < need[p]}
    if not missing and not short:
        return
    problems = []
    if missing:
        problems.append(f"{len(missing)} of its {len(need)} shard files holding the policy are missing "
                        f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})")
    if short:
        problems.append("truncated: " + ", ".join(f"{p} ({size} of at least {need[p]} bytes)"
                                                  for p, size in list(short.items())[:3]))
    raise UserError(f"{ckpt}: an incomplete sharded (--fsdp) checkpoint, {sharded}: {'; '.join(problems)}; the "
                    "policy cannot be exported from it: copy the checkpoint again, or export another one")


def _skeleton(source: str, dtype: str):
    """The run's model class and config on the meta device (no weights), with the model's generation config."""
    config = AutoConfig.from_pretrained(source)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config, dtype=DTYPES.get(dtype, torch.float32))
    try:  # the trainer's policy carried the checkpoint's own (eos ids, pad): its export writes it
        model.generation_config = GenerationConfig.from_pretrained(source)
    except OSError:
        pass
    return model


def _lora_skeleton(ckpt: Path, model, entries: dict, config: dict):
    """`model` (on the meta device) wrapped by peft as the run's policy was: the adapter `default` on the modules
    the shards hold one for, of the rank their lora_A records, scaled by the run's --lora-alpha (0: 2 r)."""
    marker = f".lora_A.{STUDENT}.weight"
    targets = sorted(k[: -len(marker)].removeprefix("base_model.model.") for k in entries if k.endswith(marker))
    ranks = {int(entries[f"base_model.model.{t}{marker}"].size[0]) for t in targets}
    if len(ranks) != 1:
        raise UserError(f"{ckpt}: a LoRA (--lora-r {config.get('lora_r')}) run's shards hold "
                        + (f"adapters of several ranks ({sorted(ranks)})" if ranks else f"no adapter '{STUDENT}'"))
    r = ranks.pop()
    lora = LoraConfig(r=r, lora_alpha=config.get("lora_alpha") or 2.0 * r, target_modules=targets, bias="none")
    with torch.device("meta"), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        return get_peft_model(model, lora)


def _fit(ckpt: Path, model, entries: dict, source: str, lora: bool) -> list[str]:
    """The names of `model`'s state that the checkpoint's policy entries give, one for one, or a UserError naming
    what is missing or unexpected (a LoRA run's other adapters, its EMA teacher's, are left out)."""
    names = set(model.state_dict())
    extra = entries.keys() - names
    if lora:
        extra = {k for k in extra if not (".lora_" in k and f".{STUDENT}." not in k)}
    missing, extra = sorted(names - entries.keys()), sorted(extra)
    if missing or extra:
        detail = "; ".join(f"{what} {len(keys)} ({', '.join(keys[:2])}{', ...' if len(keys) > 2 else ''})"
                           for what, keys in (("missing", missing), ("unexpected", extra)) if keys)
        raise UserError(f"{ckpt}: its policy does not fit the run's --model {source} ({type(model).__name__}): "
                        f"parameters {detail}")
    return sorted(names)


def _read_policy(ckpt: Path, sharded: Path, entries: dict, names: list[str]) -> dict:
    """The policy's entries `names` as CPU tensors of their recorded shapes and dtypes, read by DCP in this process;
    a shard that still fails to read is one UserError."""
    state = {k: torch.empty(tuple(entries[k].size), dtype=entries[k].properties.dtype) for k in names}
    with warnings.catch_warnings():  # "torch.distributed is disabled ...: assuming ... a single process": meant
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            dcp.load({"policy": state}, checkpoint_id=sharded, no_dist=True)  # only these entries are read
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 (DCP's is a BaseException)
            raise UserError(f"{ckpt}: cannot read the policy from {sharded} ({_one_line(exc)}): a damaged --fsdp "
                            "checkpoint; copy it again, or export another one") from None
    return state


def from_shards(ckpt: Path, config: dict, lora: bool):
    """(model, state dict to save, processor source) of a sharded checkpoint's policy: the run's --model built on
    the meta device with the shards' weights; a LoRA run's (peft names, the adapters) with its adapter `default`
    merged into the base (peft's merge_and_unload)."""
    sharded = ckpt / "sharded"
    source, config = run_model_source(ckpt, config)
    entries, storage = _policy_metadata(ckpt, sharded)
    model = _skeleton(source, config.get("dtype", "float32"))
    if lora:
        model = _lora_skeleton(ckpt, model, entries, config)
    names = _fit(ckpt, model, entries, source, lora)
    check_shards(ckpt, sharded, storage, names)
    state = _read_policy(ckpt, sharded, entries, names)
    if lora:
        model.load_state_dict(state, strict=True, assign=True)
        model = model.merge_and_unload()
        state = model.state_dict()
    return model, state, source


def from_adapter(ckpt: Path, config: dict):
    """(model, None, processor source) of a LoRA checkpoint's policy/ adapter: its base (adapter_config.json's
    base_model_name_or_path) with the adapter merged, in the run's --dtype: the model `eval.py --model` merges in
    memory (`opd.models.loading.load_model`, `opd.models.lora.merged`), weight for weight."""
    policy = ckpt / "policy"
    try:
        base = json.loads((policy / "adapter_config.json").read_text())["base_model_name_or_path"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"{policy}/adapter_config.json: no base_model_name_or_path ({_one_line(exc)})") from None
    try:
        model = load_model(str(policy), config.get("dtype", "float32"), "cpu")
    except UserError as exc:
        raise UserError(f"{ckpt}: the LoRA adapter's base {base} (policy/adapter_config.json field "
                        f"'base_model_name_or_path') does not load ({exc}); the merge needs it: restore it") from None
    processor = str(policy) if (policy / "tokenizer_config.json").is_file() else base
    return model, None, processor


def _needed(model, state: dict | None) -> int:
    """Bytes of the weights to write (the safetensors file's size, near enough)."""
    tensors = state.values() if state is not None else model.state_dict().values()
    return sum(t.numel() * t.element_size() for t in tensors)


def write_export(model, state: dict | None, processor_source: str, out: Path) -> Path:
    """`model.save_pretrained(out, state_dict=state)` (as `opd.models.sharding.export_pretrained`) with the processor, into
    a temporary sibling renamed into place; a full disk is one line naming the folder and the model's size, and
    leaves no temporary folder."""
    with room(out.parent, f"the export {out.name}/", _needed(model, state)):
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.export-", dir=out.parent))
        try:
            model.save_pretrained(tmp, state_dict=state)
            load_processor(processor_source).save_pretrained(tmp)
            os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it 0700: the mode a plain mkdir gives the folder
            try:
                os.rename(tmp, out)
            except OSError:  # another process exported it meanwhile
                if not (out / "config.json").is_file():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def export_folder(ckpt: Path, lora: bool) -> Path:
    """Where a checkpoint's export goes by default: policy/ (a whole model: what the trainer writes for its last
    checkpoint), merged/ for a LoRA run (its policy/ holds, or would hold, the adapter)."""
    return ckpt / (MERGED if lora else "policy")


def export_checkpoint(ckpt: str | Path, out: str | Path | None = None) -> Path:
    """Writes the policy of a checkpoint (or of a run folder's latest one) as one `save_pretrained` folder with its
    processor, and returns it: a sharded (--fsdp) one's from its shards (by default to checkpoint-N/policy/); a
    LoRA run's (its policy/ adapter, or the shards of a --fsdp one) with the adapter merged into its base (by
    default to checkpoint-N/merged/). One process, no torch.distributed process group; a one-line UserError for a
    folder that holds nothing to export, a missing or truncated shard, a run model that is gone or does not match
    the checkpoint's parameters, or an `out` that exists."""
    try:
        ckpt = find_checkpoint(Path(ckpt).expanduser())
    except FileNotFoundError as exc:
        raise UserError(str(exc)) from None
    adapter = is_adapter_folder(ckpt / "policy")
    sharded = ckpt / "sharded"
    if not adapter and not (sharded / ".metadata").is_file():
        raise UserError(f"{ckpt} has no sharded checkpoint ({sharded}/.metadata): only --fsdp runs write one"
                        + ("; its policy/ is already the export" if (ckpt / "policy").is_dir() else ""))
    config = run_config(ckpt)
    lora = adapter or bool(config.get("lora_r"))
    out = Path(out).expanduser() if out is not None else export_folder(ckpt, lora)
    if out.exists():
        raise UserError(f"{out} exists (an earlier export?): remove it or give another --out")
    model, state, processor = from_adapter(ckpt, config) if adapter else from_shards(ckpt, config, lora)
    return write_export(model, state, processor, out)


def _umask() -> int:
    """This process's umask (read by setting it and setting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def sharded_without_export(path: str | Path) -> Path | None:
    """The checkpoint a train.py run or checkpoint folder names (its latest), when it is sharded and has no
    policy/ export yet; None for anything else (left to `opd.builtin.model_source`). A sharded folder
    without DCP metadata (an incomplete write) is a UserError."""
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
    """For eval.py: the folder to load for a sharded checkpoint without policy/ (`sharded_without_export`), exported
    first (`export_checkpoint`, saying so in one line): its policy/, or a LoRA run's merged/ (kept from an earlier
    export); None when there is nothing to export (`opd.builtin.model_source` decides)."""
    ckpt = sharded_without_export(path)
    if ckpt is None:
        return None
    lora = bool(run_config(ckpt).get("lora_r"))
    target = export_folder(ckpt, lora)
    if lora and (target / "config.json").is_file():  # merged by an earlier run
        return target
    if lora:
        log(f"{what} {path}: {ckpt.name} is a sharded (--fsdp) LoRA checkpoint without an export; merging its "
            f"adapter into its base in {target} first (python -m opd.export)")
    else:
        log(f"{what} {path}: {ckpt.name} is a sharded (--fsdp) checkpoint without policy/; exporting it to "
            f"{target} first (python -m opd.export)")
    return export_checkpoint(ckpt)


def main(argv: list[str] | None = None) -> Path:
    parser = Parser(prog="python -m opd.export", description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("checkpoint", help="a checkpoint folder (checkpoint-N) or a train.py run folder (its latest "
                        "checkpoint): a sharded (--fsdp) one, or a LoRA (--lora-r) run's")
    parser.add_argument("--out", default=None, help="where to write the save_pretrained folder (default: "
                        f"CHECKPOINT/policy/, for a LoRA run CHECKPOINT/{MERGED}/); it must not exist")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    out = export_checkpoint(args.checkpoint, args.out)
    print(f"python -m opd.export: wrote {out} in {time.perf_counter() - t0:.1f} s "
          f"(eval.py --model {out})", flush=True)
    return out


if __name__ == "__main__":
    run_cli(main, sys.argv[1:], "python -m opd.export")
