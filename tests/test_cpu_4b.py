"""What the 4B rehearsal on a CPU (bench/cpu_4b.py, issue 36) found, at tiny shapes; and the rehearsal itself on
its reduced variant (Qwen3.5-4B's vocabulary, head dimensions, vision width and module names; small otherwise),
slow-marked.

- The full-vocabulary support (GKD; OPSD's recipe) held about 13 chunks' worth of (chunk, V) float32 tensors at
  once in `opd.maths.chunked.budgeted_loss_from_hidden` (autograd through the JSD over whole (C, V) blocks): 6.5 GB at
  the default chunk of 512 and Qwen3.5's 248,320 tokens, where bench/memory_table.py counts 3 (1.5 GB).
"""

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from opd.maths.chunked import budgeted_loss_from_hidden
from opd.maths.family import topk_divergence

F64 = torch.float64


class LiveBytes(TorchDispatchMode):
    """The most bytes of storages that ops under the mode allocated, alive at once (a storage counts while a
    tensor an op returned on it lives; views and in-place or out= results allocate nothing)."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, list[int]] = {}  # storage address -> [bytes, tensors alive on it]
        self.now = self.peak = 0

    def _gone(self, key: int) -> None:
        entry = self.live[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.now -= entry[0]
            del self.live[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func._schema.is_mutable or getattr(func, "is_view", False):
            return out
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.numel():
                key = t.untyped_storage().data_ptr()
                if key not in self.live:
                    self.live[key] = [t.untyped_storage().nbytes(), 0]
                    self.now += self.live[key][0]
                    self.peak = max(self.peak, self.now)
                self.live[key][1] += 1
                weakref.finalize(t, self._gone, key)
        return out


def full_support_case(P=64, H=4, V=2048, seed=0):
    g = torch.Generator().manual_seed(seed)
    h_s = torch.randn(P, H, generator=g, dtype=F64).requires_grad_(True)
    w_s = torch.randn(V, H, generator=g, dtype=F64).requires_grad_(True)
    h_t, w_t = torch.randn(P, H, generator=g, dtype=F64), torch.randn(V, H, generator=g, dtype=F64)
    weights = torch.rand(P, generator=g, dtype=F64)
    return h_s, w_s, h_t, w_t, weights


@pytest.mark.parametrize("divergence", ["jsd", "bc_rkl"])
def test_full_vocabulary_support_holds_at_most_three_chunks_of_logits(divergence):
    """Memory: the full-vocabulary support's loss (forward and backward) holds at most 3 (chunk, V) tensors' bytes
    at once (bench/memory_table.py's count: both sides' logits and the gradient buffer); it held 12.8 before."""
    h_s, w_s, h_t, w_t, weights = full_support_case()
    chunk, V = 64, w_s.shape[0]
    mode = LiveBytes()
    with mode:
        loss, _, _ = budgeted_loss_from_hidden(h_s, w_s, h_t, w_t, weights, 5, 0.5, chunk, support="full",
                                               divergence=divergence)  # fmt: skip
        loss.backward()
    one = chunk * V * 8  # one (chunk, V) float64 tensor
    assert one < mode.peak <= 3 * one, mode.peak / one


@pytest.mark.parametrize("chunk", [1, 7, 64])
@pytest.mark.parametrize("divergence,alpha", [("jsd", 0.5), ("jsd", 0.2), ("bc_rkl", 1.0)])
def test_full_vocabulary_support_by_blocks_equals_the_plain_divergence(chunk, divergence, alpha):
    """Values and gradients of the blocked full-vocabulary path equal autograd through `topk_divergence` on whole
    logits (float64), for chunks smaller than, not dividing, and equal to the positions."""
    h_s, w_s, h_t, w_t, weights = full_support_case(P=23, H=5, V=300, seed=3)
    loss, d, _ = budgeted_loss_from_hidden(h_s, w_s, h_t, w_t, weights, 5, alpha, chunk, support="full",
                                           divergence=divergence)  # fmt: skip
    loss.backward()
    got = h_s.grad.clone(), w_s.grad.clone()
    h_s.grad = w_s.grad = None
    plain = topk_divergence(h_s @ w_s.T, h_t @ w_t.T, 5, alpha, support="full", divergence=divergence)  # (P,)
    (weights * plain).sum().backward()
    torch.testing.assert_close(loss, (weights * plain).sum().detach(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(d, plain.detach(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(got[0], h_s.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got[1], w_s.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.slow
def test_the_rehearsal_runs_on_the_reduced_4b(tmp_path, capsys):
    """bench/cpu_4b.py --reduced: train.py --preset paper-4b --lora-r 64 --dtype bfloat16 on Qwen3.5-4B's vocabulary,
    head dimensions, vision width and module names (hidden 256, 4 layers, 2 vision blocks), loaded by from_pretrained
    in bfloat16, one step each of bas-opd (the EMA adapter teacher) and gkd (an external random-weight teacher):
    both finish with finite losses, every default LoRA target is found on the real module tree, and each phase and
    window has its seconds and peak."""
    import json

    from bench import cpu_4b

    out = tmp_path / "cpu_4b.json"
    report = cpu_4b.main(["--reduced", "--methods", "bas-opd,gkd", "--steps", "1", "--response-len", "4",
                          "--threads", "1", "--cache", str(tmp_path / "cache"), "--out", str(out)])  # fmt: skip
    saved = json.loads(out.read_text())
    assert "| phase | step 0 |" in capsys.readouterr().out
    by_method = {r["method"]: r for r in saved["results"]}
    assert set(by_method) == {"bas-opd", "gkd"} and not any("error" in r for r in report["results"])
    bas, gkd = by_method["bas-opd"]["rows"][0], by_method["gkd"]["rows"][0]
    assert (bas["candidates"], bas["budget"], bas["selected"]) == (4, 1, 1)  # rho 0.25 of 2 x 2 rollouts with crops
    assert (gkd["budget"], gkd["selected"], gkd["teacher_rows"]) == (4, 4, 4)  # GKD queries every row
    for r in (bas, gkd):
        assert r["loss"] == r["loss"] and r["grad_norm"] > 0 and not r["skipped"]
        assert r["generation_s"] > 0 and r["student_s"] > 0 and r["teacher_forward_s"] > 0
    for r in saved["results"]:
        assert r["peak_bytes"] >= max(r["window_peaks"].values()) > r["runtime_bytes"] > 0
        assert {"load", "generation", "objective: chunked loss", "objective: backward"} <= set(r["window_peaks"])
        # the adapter on the loaded model (peft) is what memory_table.py counts from the regex on the meta model:
        # per layer gate/up/down, per linear-attention layer in_proj_qkv/in_proj_z/out_proj, per full-attention q/k/v/o
        assert r["adapted_modules"] == 3 * 4 + 3 * 3 + 4 * 1
        assert r["trainable_params"] == r["estimate"]["adapter_params"] > 0 and r["estimate"]["peak"] > 0


def test_the_lora_estimate_counts_no_lm_head_gradient():
    """bench/memory_table.py's LoRA rows: the LM head is frozen (opd.maths.chunked forms no dL/dW for it), so the loss
    term is one chunk's three (C, V) float32 buffers and the positions' hidden-state buffers, without the 4 V H
    bytes of dL/dW that full fine-tuning's rows hold (the rehearsal measured 2.5 GB below the estimate before)."""
    from bench import memory_table as mt
    from opd.tiny import tiny_config, tiny_processor

    shape = mt.model_shape(tiny_config(tiny_processor().tokenizer))
    s = mt.Settings(micro_batch=2, response_len=16, loss_chunk=8, prompt_len=40, image_tokens=4)
    lora, full = mt.estimate_lora(shape, s, 8), mt.estimate(shape, s, "ddp", 1)
    V, H = shape.vocab, shape.hidden
    assert lora["loss"] == 3 * 8 * V * 4 + 2 * 16 * H * 8
    assert full["loss"] == lora["loss"] + 4 * V * H
    short = mt.estimate_lora(shape, mt.Settings(micro_batch=2, response_len=16, loss_chunk=512, prompt_len=40,
                                                image_tokens=4), 8)  # fmt: skip
    assert short["loss"] == 3 * 32 * V * 4 + 2 * 16 * H * 8  # 32 positions: one chunk of 32, not of 512
