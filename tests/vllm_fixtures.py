"""One real vLLM server per test session, on tiny vLLM-compatible Qwen3.5 models, and HF references.

`start_engine` (the body of a session fixture) builds two tiny models of `opd.tiny.build_tiny_vllm_model` (A: seed 0, B: seed 1),
starts `opd.engine.vllm_server.VLLMServer` on A (127.0.0.1, a free port) and stops it by its PID at the end. It skips,
with the reason, only when the vLLM venv is not built (`scripts/install_vllm.sh`); $BAS_OPD_VLLM_VENV points
at another venv, and $BAS_OPD_VLLM_URL at a server already running on `build_tiny_vllm_model(dir, seed=0)`
(connected to, not stopped; the weight-push test leaves model A loaded). tests/conftest.py's session fixture
`vllm_engine` is its one caller, so the modules that use it share one server."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from PIL import Image

from opd.models.chat import EncodedPrompt, collate, encode_prompt
from opd.cli import UserError
from opd.engine.vllm_server import DEFAULT_VENV, VLLMServer, check_venv
from opd.models.loading import load_model, load_processor, neutral_generation_defaults, special_ids
from opd.tiny import build_tiny_dataset, build_tiny_vllm_model

VLLM_VENV = Path(os.environ.get("BAS_OPD_VLLM_VENV", DEFAULT_VENV))


@dataclass
class Engine:
    server: VLLMServer
    model_a: Path
    model_b: Path
    data: Path  # the tiny training JSONL (its images are the prompts' images)


@dataclass
class Ref:
    """The trainer's side: an HF model, its processor, `special_ids`, encoded prompts and their images."""

    model: object
    processor: object
    ids: dict
    prompts: list
    images: list


def start_engine(tmp_path_factory):
    url = os.environ.get("BAS_OPD_VLLM_URL")
    if not url:
        try:
            check_venv(VLLM_VENV)
        except UserError as exc:
            pytest.skip(str(exc))
    root = tmp_path_factory.mktemp("vllm")
    model_a = build_tiny_vllm_model(root / "model-a", seed=0)
    model_b = build_tiny_vllm_model(root / "model-b", seed=1)
    data = build_tiny_dataset(root / "data")
    if url:
        yield Engine(VLLMServer.connect(url), model_a, model_b, data)
        return
    server = VLLMServer.start(model_a, VLLM_VENV, seed=0, max_model_len=1024, log_path=root / "vllm-server.log")
    sys.__stdout__.write(f"\n[vllm] server pid {server.pid} at {server.url}, started in {server.start_seconds:.1f} s\n")
    try:
        yield Engine(server, model_a, model_b, data)
    finally:
        server.stop()


def tiny_prompts(processor, data: Path, n: int) -> tuple[list[EncodedPrompt], list[list[Image.Image]]]:
    """The first n records of the tiny dataset as (encoded prompts, their images), as the trainer encodes them."""
    prompts, images = [], []
    for line in data.read_text().splitlines()[:n]:
        row = json.loads(line)
        paths = row.get("images") or [row["image"]]
        ims = [Image.open(data.parent / p).convert("RGB") for p in paths]
        prompts.append(encode_prompt(processor, ims, row["problem"]))
        images.append(ims)
    return prompts, images


def hf(model_dir: Path, dtype: str = "float32"):
    """(model, processor, special ids) of a tiny model through the project's own loaders."""
    model = load_model(str(model_dir), dtype=dtype).eval()
    return model, load_processor(str(model_dir)), special_ids(model)


@torch.no_grad()
def hf_response_logp(model, prompts, rows, response_ids, mask, ids) -> torch.Tensor:
    """log p(y_t) of given responses under an HF model, vision ids suppressed and renormalised as in
    sampling; (N, T), zeros outside the mask."""
    batch = collate([prompts[j] for j in rows], ids["pad"], response_ids, mask)
    width = response_ids.shape[1]
    logits = model(**batch).logits[:, -width - 1 : -1].float()  # (N, T, V): position t predicts y_t
    logits[..., ids["vision"]] = float("-inf")
    logp = torch.log_softmax(logits, -1).gather(-1, response_ids.unsqueeze(-1)).squeeze(-1)  # (N, T)
    return torch.where(mask, logp, torch.zeros_like(logp))


@torch.no_grad()
def hf_greedy_ids(model, prompts, max_new_tokens: int, ids) -> list[list[int]]:
    """HF greedy response ids, vision tokens suppressed (as opd.eval.inference), cut after the first EOS."""
    batch = collate(prompts, ids["pad"])
    with neutral_generation_defaults(model):
        out = model.generate(**batch, do_sample=False, max_new_tokens=max_new_tokens, suppress_tokens=ids["vision"])
    result = []
    for row in out[:, batch["input_ids"].shape[1] :].tolist():
        cut = next((k + 1 for k, t in enumerate(row) if t in ids["eos"]), len(row))
        result.append(row[:cut])
    return result


def common_prefix(a: list[int], b: list[int]) -> int:
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1
    return k


def padded(seqs: list[list[int]], pad: int, eos: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Response id lists as a (N, T) pad-filled block and its mask (up to and including the first EOS)."""
    from opd.engine.rollout import response_mask

    width = max(1, *(len(s) for s in seqs))
    out = torch.full((len(seqs), width), pad, dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = torch.tensor(s, dtype=torch.long)
    return out, response_mask(out, eos) & (torch.arange(width) < torch.tensor([len(s) for s in seqs])[:, None])


@torch.no_grad()
def teacher_forced_argmax(model, prompts, seqs: list[list[int]], ids) -> tuple[float, torch.Tensor, torch.Tensor]:
    """Greedy sequences checked position by position against an HF model fed the same prefix: (share of tokens
    that are its argmax, its logit margin argmax - token at each disagreement, the (N, T, V) logits)."""
    resp, mask = padded(seqs, ids["pad"], ids["eos"])
    width = resp.shape[1]
    logits = model(**collate(prompts, ids["pad"], resp, mask)).logits[:, -width - 1 : -1].float()
    logits[..., ids["vision"]] = float("-inf")
    best = logits.argmax(-1)
    wrong = (best != resp) & mask
    margin = logits.gather(-1, best.unsqueeze(-1)) - logits.gather(-1, resp.unsqueeze(-1))
    return float((best == resp)[mask].float().mean()), margin.squeeze(-1)[wrong], logits


@torch.no_grad()
def bf16_logit_error(model_dir: Path, prompts, seqs: list[list[int]], ids) -> float:
    """max |logit(bf16 copy) - logit(float32)| of an HF model over the positions of these sequences: what bf16
    rounding alone does to these logits, the scale of a near-tie."""
    fp32, _, _ = hf(model_dir)
    bf16, _, _ = hf(model_dir, dtype="bfloat16")
    _, _, a = teacher_forced_argmax(fp32, prompts, seqs, ids)
    _, _, b = teacher_forced_argmax(bf16, prompts, seqs, ids)
    finite = torch.isfinite(a)
    return float((a - b).abs()[finite].max())


def engine_score(server, prompt: EncodedPrompt, images, response: list[int]) -> list[float]:
    """The engine's log p(y_t) of a given response (prompt log-probs of prompt + response, no sampling
    processors applied), with these images; checks the server's prompt equals the trainer's ids + response."""
    from opd.engine.vllm_rollouts import engine_prompt_ids, image_url

    full = prompt.input_ids.tolist() + list(response)
    body = {
        "token_ids": engine_prompt_ids(full, prompt_image_id(prompt)),
        "content_parts": [{"type": "image_url", "url": image_url(im)} for im in images],
        "sampling_params": {"max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0},
        "return_token_ids": True,
    }
    out = server.post("/inference/v1/generate", body)
    assert out["prompt_token_ids"] == full
    return [out["prompt_logprobs"][len(prompt) + k][str(t)]["logprob"] for k, t in enumerate(response)]


def prompt_image_id(prompt: EncodedPrompt) -> int:
    """The image-pad id of an encoded prompt: the id its mm_token_type_ids mark as image (type 1)."""
    return int(prompt.input_ids[prompt.mm_token_type_ids == 1][0])


@torch.no_grad()
def hf_score(model, prompt: EncodedPrompt, response: list[int]) -> list[float]:
    """HF log p(y_t) of a given response, no suppression (as the engine's prompt log-probs)."""
    ids = torch.tensor([response])
    logits = model(**collate([prompt], 0, ids)).logits[:, -len(response) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids.unsqueeze(-1)).reshape(-1).tolist()
