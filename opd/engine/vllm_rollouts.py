"""Rollouts and greedy replies from the optional vLLM engine (Algorithm 1, line 3), through its server
(`opd.engine.vllm_server.VLLMServer`).

- `generate_rollouts_vllm(...)` samples rollouts and returns the HF path's `opd.engine.rollout.Rollouts`;
  `generate_text(...)` answers greedily for eval.py.

Prompts are sent as the trainer's token ids (`opd.models.chat.encode_prompt`) to vLLM's tokens-in endpoint with
their images, and every request checks the server's final prompt ids against the trainer's: a mismatch is an error.
Departures from `opd.engine.rollout.generate_rollouts` (documented on `EngineRollouts`): bf16 log-probs, no full
distribution (so no token entropy H_t of Eq. 5: `entropy_available=False`), vLLM's per-request seeds.
Details: docs/MODULES.md#opdenginevllm_rollouts.
"""

from __future__ import annotations

import base64
import io
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from opd.cli import UserError
from opd.engine.rollout import Rollouts, mix_seed, response_mask
from opd.engine.vllm_server import VLLMServer
from opd.models.chat import EncodedPrompt

SUPPRESS_BIAS = -100.0  # vLLM clamps logit_bias to [-100, 100] (the OpenAI bound): a vision token keeps e^-100 of its
# probability; a float, as opd.eval.backends sends it too (transformers serve refuses an int bias)


def image_url(image) -> str:
    """A PIL image as a lossless PNG data URL: the server decodes the pixels the trainer's processor sees (and
    preprocesses them with its own processor). Also the image of `opd.eval.backends`' chat requests."""
    buf = io.BytesIO()
    image.convert("RGB").save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def engine_prompt_ids(input_ids: list[int], image_token_id: int | None) -> list[int]:
    """The trainer's prompt ids with each run of image-pad tokens collapsed to one: vLLM expands every
    `<|image_pad|>` of a token prompt to the image's token count itself (it would expand a pre-expanded run
    again: 4 image tokens became 7 in a probe)."""
    if image_token_id is None:
        return list(input_ids)
    out: list[int] = []
    for t in input_ids:
        if t == image_token_id and out and out[-1] == image_token_id:
            continue
        out.append(t)
    return out


def _generate_one(
    server: VLLMServer, prompt: EncodedPrompt, images, sampling: dict, image_token_id: int | None, timeout: float
) -> dict:
    ids = prompt.input_ids.tolist()
    images = list(images or [])
    body = {
        "token_ids": engine_prompt_ids(ids, image_token_id) if images else ids,
        "sampling_params": sampling,
        "return_token_ids": True,
        "output_mode": "tokens",
    }
    if images:
        body["content_parts"] = [{"type": "image_url", "url": image_url(im)} for im in images]
    out = server.post("/inference/v1/generate", body, timeout=timeout)
    if out.get("prompt_token_ids") != ids:
        got = out.get("prompt_token_ids") or []
        raise UserError(
            f"vLLM's prompt has {len(got)} tokens, the trainer's {len(ids)}: the server's processor expands the "
            "images differently (is the server started on the same model folder and processor settings?)"
        )
    return out


def _requests(server: VLLMServer, prompts, images, sampling_of, image_token_id, max_concurrency, timeout):
    """One request per prompt, `max_concurrency` in flight (the engine batches concurrent requests)."""
    if images is None:
        images = [None] * len(prompts)
    if len(images) != len(prompts):
        raise ValueError(f"{len(images)} image lists for {len(prompts)} prompts")
    with ThreadPoolExecutor(max_workers=max(1, min(max_concurrency, len(prompts)))) as pool:
        futures = [
            pool.submit(_generate_one, server, p, im, sampling_of(j), image_token_id, timeout)
            for j, (p, im) in enumerate(zip(prompts, images))
        ]  # fmt: skip
        return [f.result() for f in futures]


def _image_token_id(vision: list[int] | None, image_token_id: int | None) -> int | None:
    if image_token_id is not None:
        return image_token_id
    return vision[0] if vision else None  # opd.models.loading.special_ids lists image_token_id first


@dataclass
class EngineRollouts(Rollouts):
    """`opd.engine.rollout.Rollouts` from the engine, field for field, plus what differs from the HF path:

    - `entropy` is zeros: the engine returns the sampled token's log-prob (and at most a top-20), not the
      distribution, so H_{i,t} is unknown; `entropy_available` is False. Eq. 5's entropy feature then falls
      back to the mean sampled-token NLL, -mean_t logp (the paper's fallback; the integrator documents it).
    - `logp` is the engine's log p(y_t), computed in bf16, of the distribution sampled from: after the
      vision-token suppression and the temperature / top-p / top-k warpers (`processed_logprobs`), which are
      identities at the defaults (temperature 1, top_p 1, top_k 0), as the HF path's. It is within bf16
      rounding of the trainer's float32 log-prob of the same token (tests/test_vllm.py), not equal to it.
    """

    entropy_available: bool = False


def generate_rollouts_vllm(
    server: VLLMServer,
    prompts: list[EncodedPrompt],
    images: list[list] | None,
    n_per_prompt: int,
    max_new_tokens: int,
    *,
    eos: list[int],
    pad: int,
    vision: list[int],
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    step: int = 0,
    rank: int = 0,
    image_token_id: int | None = None,
    max_concurrency: int = 64,
    timeout: float = 3600.0,
) -> EngineRollouts:
    """Samples `n_per_prompt` responses to each prompt through the engine; the same rows, padding and masks
    as `opd.engine.rollout.generate_rollouts` (rows prompt-major, pad after EOS, mask up to and including the first
    EOS, `valid` False for a response holding a vision token).

    `images[j]` are prompt j's PIL images (the ones `encode_prompt` encoded; None or [] for a text prompt).
    `eos`, `pad`, `vision` are `opd.models.loading.special_ids(policy)`'s lists (`**special_ids(policy)`): EOS ids stop
    a response (`stop_token_ids`), vision ids get logit bias -100 (vLLM's bound; their probability drops by
    e^-100, effectively the HF path's suppression; any that slipped through would mark its row invalid).
    Seeds: prompt j's request has seed mix_seed(seed, step, rank, j) and vLLM gives its k-th sample seed+k,
    so a step's rollouts are a function of (seed, step, rank) and of the weights (a resumed run samples the
    same responses, up to bf16 batch-shape nondeterminism of the engine's kernels; on a CPU only when no prompt's
    prefill was split across scheduler steps: docs/DEPARTURES.md item 54).
    """
    image_token_id = _image_token_id(vision, image_token_id)
    bias = {str(t): SUPPRESS_BIAS for t in vision or []}

    def sampling_of(j: int) -> dict:
        return {
            "n": n_per_prompt, "max_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p,
            "top_k": top_k, "min_p": 0.0, "seed": mix_seed(seed, step, rank, j) >> 2, "logprobs": 0,
            "stop_token_ids": list(eos), "logit_bias": bias, "skip_special_tokens": False, "detokenize": False,
            "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
        }  # fmt: skip

    outs = _requests(server, prompts, images, sampling_of, image_token_id, max_concurrency, timeout)
    rows, tokens, logps = [], [], []
    for j, out in enumerate(outs):
        choices = sorted(out["choices"], key=lambda c: c["index"])
        if len(choices) != n_per_prompt:
            raise UserError(f"vLLM returned {len(choices)} samples for prompt {j}, expected {n_per_prompt}")
        for c in choices:
            ids = c["token_ids"]
            content = (c.get("logprobs") or {}).get("content") or []
            if len(content) != len(ids) or any(e["token_id"] != t for e, t in zip(content, ids)):
                raise UserError(f"vLLM returned log-probs that do not match the sampled tokens (prompt {j})")
            rows.append(j)
            tokens.append(ids)
            logps.append([e["logprob"] for e in content])
    width = max([1, *(len(t) for t in tokens)])
    response_ids = torch.full((len(rows), width), pad, dtype=torch.long)  # (N, T)
    logp = torch.zeros((len(rows), width), dtype=torch.float32)  # (N, T)
    for i, (t, lp) in enumerate(zip(tokens, logps)):
        response_ids[i, : len(t)] = torch.tensor(t, dtype=torch.long)
        logp[i, : len(lp)] = torch.tensor(lp, dtype=torch.float32)
    mask = response_mask(response_ids, list(eos))  # (N, T)
    is_vision = torch.isin(response_ids, torch.tensor(vision or [-1])) & mask
    return EngineRollouts(
        prompt_index=torch.tensor(rows, dtype=torch.long),
        response_ids=response_ids,
        response_mask=mask,
        logp=torch.where(mask, logp, torch.zeros_like(logp)),
        entropy=torch.zeros_like(logp),
        prompt_len=torch.tensor([len(prompts[j]) for j in rows], dtype=torch.long),
        valid=~is_vision.any(-1),
        entropy_available=False,
    )


def generate_greedy_ids(
    server: VLLMServer,
    prompts: list[EncodedPrompt],
    images: list[list] | None,
    max_new_tokens: int,
    *,
    eos: list[int],
    vision: list[int],
    image_token_id: int | None = None,
    max_concurrency: int = 64,
    timeout: float = 3600.0,
    **_,
) -> list[list[int]]:
    """Greedy (temperature 0) response token ids of each prompt, up to and including EOS; vision tokens
    suppressed as in `generate_rollouts_vllm`, no sampling defaults (`--generation-config vllm`)."""
    image_token_id = _image_token_id(vision, image_token_id)
    sampling = {
        "n": 1, "max_tokens": max_new_tokens, "temperature": 0.0, "stop_token_ids": list(eos),
        "logit_bias": {str(t): SUPPRESS_BIAS for t in vision or []}, "detokenize": False,
        "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
    }  # fmt: skip
    outs = _requests(server, prompts, images, lambda j: sampling, image_token_id, max_concurrency, timeout)
    return [out["choices"][0]["token_ids"] for out in outs]


def generate_text(
    server: VLLMServer,
    prompts: list[EncodedPrompt],
    images: list[list] | None,
    max_new_tokens: int,
    processor,
    *,
    eos: list[int],
    vision: list[int],
    **kwargs,
) -> list[str]:
    """Greedy replies for evaluation (eval.py --backend vllm): `generate_greedy_ids` decoded by the trainer's
    own processor with special tokens skipped and stripped, as `opd.eval.inference.generate_replies` does."""
    ids = generate_greedy_ids(server, prompts, images, max_new_tokens, eos=eos, vision=vision, **kwargs)
    return [r.strip() for r in processor.batch_decode(ids, skip_special_tokens=True)]
