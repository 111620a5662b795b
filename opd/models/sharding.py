"""FSDP2 for the policy and the EMA teacher (`--fsdp`): torch's `fully_shard`, applied in one place.

`shard_model` gives every repeated block (Qwen3.5: each decoder layer and vision block) its own FSDP group and the
rest (embeddings, LM head, norms, the vision patch embedding and merger) the root group, on a 1-D mesh over every
process (NCCL on GPUs, gloo on CPUs). Parameters keep `--dtype`; under `--mixed-precision bf16` gathered copies are
bfloat16 and gradients are reduce-scattered in float32. The loop relies on FSDP2's own behaviour: the root's
gathered LM head after a forward (`reshard` frees a teacher's), collectives in lockstep (`opd.methods.lockstep`),
`generation` gathering the policy for HF `generate`, and the EMA update on local shards (`local_pairs`).
Details: docs/MODULES.md#opdmodelssharding. Checkpoints of sharded models: `opd.loop.checkpoint`.
"""

import contextlib
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from opd.models.loading import load_model
from opd.models.lora import save_adapter

GENERATION = ("gathered", "layerwise")
"""How a sharded policy generates: 'gathered' all-gathers every parameter once before `generate` and frees
them after; 'layerwise' lets each forward gather layer by layer (one all-gather per layer per token)."""


def ensure_process_group(device: torch.device) -> None:
    """A one-process group when no launcher made one (FSDP2 needs a process group even for one rank)."""
    if dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def device_mesh(device: torch.device) -> DeviceMesh:
    """The 1-D data-parallel mesh over every process (FSDP shards along it)."""
    ensure_process_group(device)
    return init_device_mesh(device.type, (dist.get_world_size(),))


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The modules that get their own FSDP group: the model's repeated blocks (`_no_split_modules`, e.g.
    Qwen3_5DecoderLayer and Qwen3_5VisionBlock), in forward order."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    units = [m for m in model.modules() if type(m).__name__ in names]
    if not units:
        raise ValueError(f"{type(model).__name__} names no repeated blocks (_no_split_modules) to shard")
    return units


def mixed_precision_policy(mixed_precision: str) -> MixedPrecisionPolicy:
    """bf16/fp16 gathered parameters (compute) with float32 gradient reduction; 'no': the parameters' dtype."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed_precision)
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None)


def shard_model(model: nn.Module, device: torch.device, mixed_precision: str = "no") -> nn.Module:
    """fully_shard on each repeated block, then on the root; parameters move to `device` as they are sharded.

    `model` may be on the CPU (as loaded): each rank keeps only its 1/world slice of every parameter."""
    mesh = device_mesh(device)
    policy = mixed_precision_policy(mixed_precision)
    # FSDP2 warns that in-place ops on a view returned by the root would skip its backward hook; the loop only
    # slices the outputs (hidden states, logits) and never modifies them in place.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    for unit in shard_units(model):
        fully_shard(unit, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def load_sharded_model(
    path: str, dtype: str, device: torch.device, mixed_precision: str = "no", grad_checkpointing: bool = False
) -> nn.Module:
    """`opd.models.loading.load_model` into CPU memory, then `shard_model` (each rank keeps its shards, on `device`), in
    train mode. Every rank reads the whole checkpoint once; weights it lacks are initialised from one seed on
    every rank, so the shards fit together."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = load_model(path, dtype, "cpu").train()
    if grad_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return shard_model(model, device, mixed_precision)


def is_sharded(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def fsdp_modules(model: nn.Module) -> list[FSDPModule]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def reshard(model: nn.Module) -> None:
    """Frees every gathered parameter of a sharded model (a no-op for one that is not sharded): its
    registered parameters are the shards again, as the optimizer and the EMA update expect."""
    for m in fsdp_modules(model):
        m.reshard()


def init_root(model: nn.Module) -> None:
    """FSDP2's lazy initialisation, with `model` as its root, now (a no-op once done, as at every later forward).

    FSDP2 takes the first sharded module whose forward runs as the root of everything below it, and then requires
    the model itself to be that root. Hugging Face `generate` (transformers 5) encodes a batch's images with
    `get_image_features` before its first forward of the model, so a policy that generates before its first training
    forward (`--eval-before`, a run's first rollouts without shared prefill) would make each vision block a root of
    its own ("FSDP state has already been lazily initialized for model.visual.blocks.0"). This is the root's own
    initialisation (torch 2.14's FSDPState._lazy_init, which the root's first forward calls): the same state,
    earlier."""
    model._get_fsdp_state()._lazy_init()


@contextlib.contextmanager
def generation(model: nn.Module, mode: str = "gathered"):
    """Generation with a sharded policy: `init_root` first; then 'gathered': every group is all-gathered once (in the
    same order on every rank) and kept through all of `generate`'s forwards, which then need no communication;
    'layerwise': only the root group (embeddings, LM head, the vision tower's patch embedding and merger) is
    gathered here, and each block's forward gathers and frees its own. The root group is gathered up front in both
    modes because `generate` runs the vision tower outside the model's forward (see `init_root`), where FSDP would
    not gather the root's parameters (a LoRA policy's `generate` never runs its root's forward at all). The model is
    resharded afterwards either way."""
    if mode not in GENERATION:
        raise ValueError(f"unknown generation mode {mode!r}; known: {', '.join(GENERATION)}")
    if not is_sharded(model):
        yield
        return
    init_root(model)
    gathered = fsdp_modules(model) if mode == "gathered" else [model]
    for m in gathered:
        m.set_reshard_after_forward(False, recurse=False)
        m.unshard()
    try:
        yield
    finally:
        for m in gathered:
            m.set_reshard_after_forward(m is not model, recurse=False)  # the root: as torch's default
        reshard(model)


def local_pairs(target: nn.Module, source: nn.Module):
    """(target, source) pairs of tensors to update in place: the local shards of two models sharded the
    same way (asserted), or the whole tensors of unsharded ones; parameters in order."""
    for t, s in zip(target.parameters(), source.parameters(), strict=True):
        if isinstance(t, DTensor) or isinstance(s, DTensor):
            if not (isinstance(t, DTensor) and isinstance(s, DTensor)) or t.placements != s.placements:
                raise ValueError("the teacher and the policy must be sharded the same way")
            yield t.to_local(), s.to_local()
        else:
            yield t, s


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full weights on the CPU: gathered to rank 0 for a sharded model (a collective, run by every rank;
    the other ranks get an empty dict), copied for an unsharded one."""
    if not is_sharded(model):
        return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def full_tensor(x):
    """A DTensor's full value (a collective on every rank); anything else as is."""
    return x.full_tensor() if isinstance(x, DTensor) else x


def export_pretrained(model, folder: Path, processor=None, adapter: str | None = None) -> None:
    """`save_pretrained` of a sharded model: the full weights gathered to rank 0's CPU memory (a collective,
    run by every rank) and written there by rank 0, with the processor when given; `adapter` (LoRA): that adapter
    of the model only (`opd.models.lora.save_adapter`)."""
    full = full_state_dict(model)
    if dist.get_rank() == 0:
        if adapter is not None:
            save_adapter(model, adapter, folder, state_dict=full)
        else:
            model.save_pretrained(folder, state_dict=full)
        if processor is not None:
            processor.save_pretrained(folder)
