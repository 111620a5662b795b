"""LoRA through peft (`--lora-r`): the policy is a frozen base plus a trainable adapter, and its teachers are the
same base with another adapter, or with none. One base in memory.

- The student: the base with the adapter `default` (rank `--lora-r`, `--lora-alpha`, `--lora-targets`); only the
  adapter is trained.
- The EMA teacher: the adapter `teacher`, updated by EMA on the adapter's parameters only, activated per forward.
- A fixed teacher (OPSD) and DAPD's `base` anchor: the base with the adapter disabled, as their code reads it.

Checkpoints hold the adapters (`save_adapter`), not the base; `opd.models.loading.load_model` merges an adapter
folder into its base. Sharded (`--fsdp`): the adapters are sharded with their layers.
Details: docs/MODULES.md#opdmodelslora.
"""

from __future__ import annotations

import contextlib
import json
import re
import warnings
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from peft.tuners.tuners_utils import BaseTunerLayer
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.tensor import DTensor

from opd.models.settings import LoRAConfig

STUDENT = "default"


def target_modules(targets: str):
    """peft's target_modules: a regex string as is, a comma-separated list of names as a list."""
    if any(c in targets for c in "()[]*.|\\^$+?"):
        return targets
    return [t.strip() for t in targets.split(",") if t.strip()]


def matched_modules(model: nn.Module, targets: str) -> list[str]:
    """The names of the linear modules `targets` would adapt (the check behind a one-line error)."""
    spec = target_modules(targets)
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    if isinstance(spec, str):
        return [n for n in names if re.fullmatch(spec, n)]
    return [n for n in names if n.split(".")[-1] in spec]


def wrap(model: nn.Module, lora: LoRAConfig, adapters: tuple[str, ...] = ()) -> nn.Module:
    """The peft model: `model` (frozen) with the trainable adapter `default` and, for each name of `adapters`, a
    frozen copy of it (the EMA teacher, DAPD's snapshot)."""
    config = LoraConfig(r=lora.r, lora_alpha=lora.scale_alpha, lora_dropout=lora.dropout,
                        target_modules=target_modules(lora.targets), bias="none")  # fmt: skip
    with warnings.catch_warnings():  # peft reads transformers' deprecated `is_gradient_checkpointing` (a v6 rename)
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        peft_model = get_peft_model(model, config)
    for name in adapters:
        peft_model.add_adapter(name, config)
        copy_adapter(peft_model, STUDENT, name)
    _set_trainable(peft_model)  # add_adapter may leave its own adapter active: train and use `default` only
    return peft_model


def _set_trainable(model: nn.Module) -> None:
    """requires_grad on the student adapter's parameters only."""
    for name, p in model.named_parameters():
        p.requires_grad_(f".{STUDENT}." in name and "lora_" in name)
    for m in _tuner_layers(model):
        m._active_adapter = [STUDENT]


def _tuner_layers(model: nn.Module):
    return [m for m in model.modules() if isinstance(m, BaseTunerLayer)]


def is_lora(model: nn.Module) -> bool:
    return isinstance(model, PeftModel)


@contextlib.contextmanager
def active_adapter(model: nn.Module, name: str | None):
    """Forwards inside use the adapter `name` (None: none, the base alone); restored after. requires_grad untouched."""
    layers = _tuner_layers(model)
    saved = [(m._active_adapter, m._disable_adapters) for m in layers]
    for m in layers:
        if name is None:
            m._disable_adapters = True
        else:
            m._active_adapter, m._disable_adapters = [name], False
    try:
        yield
    finally:
        for m, (active, disabled) in zip(layers, saved):
            m._active_adapter, m._disable_adapters = active, disabled


def adapter_pairs(model: nn.Module, target: str, source: str = STUDENT):
    """(target adapter parameter, source adapter parameter) pairs by name, local shards when sharded."""
    params = dict(model.named_parameters())
    for name, t in params.items():
        if f".{target}." not in name or "lora_" not in name:
            continue
        s = params[name.replace(f".{target}.", f".{source}.")]
        if isinstance(t, DTensor):
            yield t.to_local(), s.to_local()
        else:
            yield t, s


@torch.no_grad()
def copy_adapter(model: nn.Module, source: str, target: str) -> None:
    for t, s in adapter_pairs(model, target, source):
        t.copy_(s)


def adapter_state(model: nn.Module, name: str, state_dict: dict | None = None) -> dict[str, torch.Tensor]:
    """The adapter's weights under peft's names for `name` = default (CPU copies)."""
    sd = get_peft_model_state_dict(model, state_dict=state_dict, adapter_name=name)
    return {k: v.detach().cpu().clone() for k, v in sd.items()}


def save_adapter(model: nn.Module, name: str, folder: Path, state_dict: dict | None = None) -> None:
    """`folder`/adapter_model.safetensors + adapter_config.json (loadable by peft as the default adapter)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(adapter_state(model, name, state_dict), str(folder / "adapter_model.safetensors"))
    config = model.peft_config[name].to_dict()
    config = {k: (sorted(v) if isinstance(v, set) else v) for k, v in config.items()}
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2, default=str) + "\n")


def load_adapter(model: nn.Module, name: str, folder: Path) -> None:
    """Loads `folder`'s adapter weights (saved by `save_adapter`) into the adapter `name`. Every LoRA tensor of that
    adapter must come from the file: a missing one (another --lora-targets or rank, a truncated file) would keep
    its initial value silently, so it is an error, as is a tensor the model has no place for."""
    path = Path(folder) / "adapter_model.safetensors"
    result = set_peft_model_state_dict(model, load_file(str(path)), adapter_name=name)
    unexpected = list(getattr(result, "unexpected_keys", []))
    if unexpected:
        raise ValueError(f"{folder}: adapter weights the model has no place for: {unexpected[:3]}")
    missing = [k for k in getattr(result, "missing_keys", []) if "lora_" in k and f".{name}." in k]
    if missing:
        raise ValueError(f"{path}: {len(missing)} tensors of the adapter '{name}' are missing (e.g. {missing[:3]}): "
                         "the checkpoint was saved with other --lora-targets / --lora-r, or is incomplete")
    _set_trainable(model)


def is_adapter_folder(path: str | Path) -> bool:
    p = Path(path)
    return (p / "adapter_config.json").is_file() and not (p / "config.json").is_file()


def merged(path: str | Path, load_base) -> nn.Module:
    """The model of an adapter folder: its base (`load_base(base path)`) with the adapter merged in."""
    base_path = json.loads((Path(path) / "adapter_config.json").read_text())["base_model_name_or_path"]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        model = PeftModel.from_pretrained(load_base(base_path), str(path))
    return model.merge_and_unload()


def merged_state_dict(state: dict[str, torch.Tensor], scaling: float, adapter: str = STUDENT) -> dict[str, torch.Tensor]:
    """The weights of the base with `adapter` merged in, under the base model's own names, from a peft model's state
    dict (`state_dict()`, or `opd.models.sharding.full_state_dict` of a sharded one): for each adapted linear layer

        W' = W + scaling B A          (peft's `get_delta_weight`: lora_B @ lora_A times alpha / r)

    and every other tensor as it is; the adapters' own tensors (every adapter's) are left out. The model being
    trained is not touched (peft's `merge_adapter` would change it in place)."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if "lora_" in key:
            continue
        name = key.removeprefix("base_model.model.").replace(".base_layer.", ".")
        a = key.replace(".base_layer.weight", f".lora_A.{adapter}.weight")
        if key.endswith(".base_layer.weight") and a in state:
            b = key.replace(".base_layer.weight", f".lora_B.{adapter}.weight")
            work = torch.float32 if value.dtype in (torch.float16, torch.bfloat16) else value.dtype  # as peft's merge
            delta = (state[b].to(work) @ state[a].to(work)) * scaling  # (out, in)
            value = value + delta.to(value.dtype)
        out[name] = value
    return out


def base_parameters(model: nn.Module) -> int:
    """Elements of the frozen base (everything but the adapters)."""
    return sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n)
