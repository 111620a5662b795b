"""Float64 for the tests that claim two runs are one computation grouped two ways (DDP and FSDP against one
unsharded rank, a diagnosed run against a plain one, micro-batch sizes, the two loss paths, a gradient's row sets):
with TrainConfig(dtype="float64") (--dtype float64) a change of summation order moves a sum by ~1e-16 relative
instead of float32's ~1e-7, whatever the CPU's vector width or summation order.

Float64 weights alone are not enough: transformers' Qwen3.5 casts to float32 inside the model whatever the weights'
dtype (`FLOAT32_CASTS`), and those casts make a float64 run depend on how its rows are grouped:
- its PyTorch linear attention (what the CPU runs) casts q, k, v, beta and g to float32, and the chunked form's error
  depends on where a sequence falls in its 64-token chunks, i.e. on its left padding: one prompt alone and the same
  prompt left-padded beside a longer one gave logits 1e-5 apart (relative), in float32 and in a float64 model alike.
  DAPD's rollout contexts, of different lengths, so moved 2-rank DDP weights by up to 1.6e-3 from 1-rank ones;
- its RMSNorm computes in float32, so each norm weight's gradient is a float32 sum over the micro-batch's tokens
  (DDP weights 7e-9 apart, the largest difference once the linear attention was float64);
- the other casts (the gated norm, the decay's a.float() and A_log.float(), the vision rotary embedding) round
  per-token gradients to float32 on the way back, which matters where two groupings scale them differently (Eq. 11's
  weight 1 / tokens of a row set, tests/test_toy.py) and for A_log's own gradient (DDP weights 8e-11 apart).
`float64_model()` runs them in float64 for float64 inputs: the same source with its float32 casts made float64 casts,
decorators and all; float32 and half-precision inputs run transformers' own code. Then the padded and unpadded
logits agree to 2e-16, and 1- and 2-rank DDP weights to 5e-13, FSDP ones to 1.3e-12 (2 steps at lr 1e-3). What
stays float32 are the rotary embeddings' cos and sin (functions of the positions alone, the same for any grouping)
and the eager attention's softmax (the CPU runs SDPA).

`assert_same_weights` is the bound for weights after AdamW steps (see WEIGHT_TOLERANCE).
"""

import inspect
import textwrap

import torch

F64_EPS = torch.finfo(torch.float64).eps  # 2.2e-16
F32_EPS = torch.finfo(torch.float32).eps  # 1.2e-7

FLOAT32_CASTS = (
    "torch_chunk_gated_delta_rule",  # the linear attention, over a prompt (chunks of 64 tokens)
    "torch_recurrent_gated_delta_rule",  # the same, one token at a time (generation)
    "Qwen3_5RMSNorm.forward",
    "Qwen3_5RMSNormGated.forward",  # the linear attention's output norm
    "Qwen3_5GatedDeltaNet.forward",  # its decay: -A_log.float().exp() * softplus(a.float() + dt_bias)
    "apply_rotary_pos_emb_vision",
)
"""What `float64_model()` runs in float64 for float64 inputs, in transformers' modeling_qwen3_5."""
_done: set[str] = set()


def _at_float64(module, qualname: str):
    """(the original, `module.qualname` recompiled, decorators and all, with its casts to float32 (torch.float32,
    .float()) made casts to float64)."""
    owner, _, name = qualname.rpartition(".")
    original = getattr(getattr(module, owner), name) if owner else getattr(module, name)
    source = textwrap.dedent(inspect.getsource(inspect.unwrap(original)))
    if "torch.float32" not in source and ".float()" not in source:
        raise AssertionError(f"transformers' {module.__name__}.{qualname} has no float32 cast now: update tests/float64.py")
    source = source.replace("torch.float32", "torch.float64").replace(".float()", ".double()")
    namespace = dict(vars(module))
    exec(compile(source, f"<tests/float64.py: {qualname} at float64>", "exec"), namespace)
    return original, namespace[name]


def _first_tensor(args, kwargs) -> torch.Tensor | None:
    return next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)


def float64_model() -> None:
    """Process-wide and idempotent: `FLOAT32_CASTS` compute in float64 when their first tensor argument is float64."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen

    for qualname in FLOAT32_CASTS:
        if qualname in _done:
            continue
        original, at_float64 = _at_float64(qwen, qualname)
        owner, _, name = qualname.rpartition(".")

        def dispatch(*args, _original=original, _at_float64=at_float64, **kwargs):
            first = _first_tensor(args, kwargs)
            return (_at_float64 if first is not None and first.dtype == torch.float64 else _original)(*args, **kwargs)

        setattr(getattr(qwen, owner) if owner else qwen, name, dispatch)
        _done.add(qualname)


WEIGHT_TOLERANCE = 1e-7
"""Float64 weights after AdamW steps from two groupings of one computation differ by at most
steps * lr * WEIGHT_TOLERANCE. AdamW moves a weight by lr * m / (sqrt(v) + eps) per step (eps = 1e-8): homogeneous of
degree 0 in the gradients, so a relative gradient error r moves an update by ~r * lr, except where the gradient g is
~0: there the update is ~lr * g / eps, and a gradient error dg (float64 summation order: ~n * F64_EPS * sum|terms|)
moves it by up to lr * dg / eps. The float32 runs measured that amplification: 33 weights moved by ~0.15 of an update
(3e-4 at lr 1e-3) from float32 noise (~F32_EPS), so dg / eps ~ 0.15 * F64_EPS / F32_EPS ~ 3e-10 of an update in
float64 (measured, every DDP and FSDP test: <= 6.4e-10, 1.3e-12 after 2 steps at lr 1e-3). 1e-7 leaves a factor >100
for another CPU's summation order and stays ~1e6 below float32's differences. A gradient that misses a row, weighs one wrongly or is averaged
over the wrong count moves updates far more (through eps, even a factor 2 on a gradient of 1e-4 moves its update by
~5e-5 of it)."""


def assert_same_weights(one: dict, two: dict, lr: float, steps: int, what: str = "") -> None:
    """Two {name: tensor} of float64 weights after `steps` AdamW steps of learning rate `lr`: equal up to
    steps * lr * WEIGHT_TOLERANCE, tensor by tensor."""
    assert one.keys() == two.keys(), what
    bound = steps * lr * WEIGHT_TOLERANCE
    for k, v in one.items():
        assert v.dtype == two[k].dtype == torch.float64, (what, k, v.dtype)
        diff = float((two[k].detach() - v.detach()).abs().max()) if v.numel() else 0.0
        assert diff <= bound, (what, k, diff, bound)
