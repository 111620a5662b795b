"""On-policy rollouts with plain Hugging Face `generate` (Algorithm 1, line 3): y_i ~ p_theta(. | x_i, q_i).

n rollouts per prompt, left padding, masked after EOS; `RolloutStats` keeps Eq. 5's log p_old(y_{i,t} | ...) and
H_{i,t} while sampling; all detached; `mix_seed`: the seeds of a step's draws. vLLM's: `opd.engine.vllm_sampler`.
Details: docs/MODULES.md#opdenginerollout."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from opd.engine.sampling import SamplingConfig
from opd.models.chat import EncodedPrompt, collate
from opd.models.loading import neutral_generation_config, special_ids


def mix_seed(*keys: int) -> int:
    """A 63-bit seed mixing integers (numpy's SeedSequence hash): every draw of a step that ranks (or a resume) must
    repeat is a pure function of (seed, step, ...): the rollouts', the selector's, the views'."""
    return int(np.random.SeedSequence([int(k) for k in keys]).generate_state(1, dtype=np.uint64)[0] >> 1)


def seeded_generator(*keys: int) -> torch.Generator:
    """A CPU generator seeded by mix_seed(*keys), e.g. (selector seed, step, stream)."""
    return torch.Generator().manual_seed(mix_seed(*keys))


class RolloutStats:
    """generate()'s logits processor: applies the run's warpers, keeps log p(y_t) and H_t of the distribution."""

    def __init__(self, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0):
        self.logp, self.entropy = [], []  # per generated position: (N,) each
        self._prev: torch.Tensor | None = None
        self.warpers = ([TemperatureLogitsWarper(temperature)] if temperature != 1.0 else []) + (
            [TopKLogitsWarper(top_k)] if top_k else []) + ([TopPLogitsWarper(top_p)] if top_p < 1.0 else [])  # fmt: skip

    def _gather_prev(self, tokens: torch.Tensor) -> None:
        self.logp.append(self._prev.gather(-1, tokens.unsqueeze(-1)).squeeze(-1))  # (N,)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self._prev is not None:
            self._gather_prev(input_ids[:, -1])
        for warp in self.warpers:  # temperature, top-k, top-p: the distribution sampled from
            scores = warp(input_ids, scores)
        logp = torch.log_softmax(scores if scores.dtype == torch.float64 else scores.float(), dim=-1)  # (N, V)
        p = logp.exp()
        self.entropy.append(-torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(-1))  # (N,) H_t; 0 log 0 = 0
        self._prev = logp
        return scores

    def finish(self, last_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gathers the last step; returns (logp, entropy), each (N, T)."""
        if self._prev is not None:
            self._gather_prev(last_tokens)
            self._prev = None
        return torch.stack(self.logp, dim=1), torch.stack(self.entropy, dim=1)


@dataclass
class Rollouts:
    """A rank's rollout batch: rows are (prompt, sample) pairs, all tensors detached on the CPU."""

    prompt_index: torch.Tensor  # (N,) local prompt id of each row
    response_ids: torch.Tensor  # (N, T) sampled tokens, pad after EOS
    response_mask: torch.Tensor  # (N, T) bool: m_{i,t}, valid tokens up to and including EOS
    logp: torch.Tensor  # (N, T) log p_old(y_{i,t} | x_i, q_i, y_{i,<t})
    entropy: torch.Tensor  # (N, T) H_{i,t} of the sampling distribution
    prompt_len: torch.Tensor  # (N,) L_i, prompt tokens including image tokens
    valid: torch.Tensor  # (N,) bool: False when a response holds a vision special token

    def __len__(self) -> int:
        return self.response_ids.shape[0]

    @property
    def lengths(self) -> torch.Tensor:
        """T_i, the valid response tokens of each row."""
        return self.response_mask.sum(-1)


def response_mask(response_ids: torch.Tensor, eos_ids: list[int]) -> torch.Tensor:
    """m_{i,t}: true up to and including the first EOS, false after it (all true when no EOS)."""
    is_eos = torch.isin(response_ids, torch.tensor(eos_ids, device=response_ids.device))  # (N, T)
    eos_before = torch.cumsum(is_eos.long(), dim=1) - is_eos.long()  # EOS strictly before t
    return eos_before == 0


def prefill_shared_cache(model, batch: dict[str, torch.Tensor], n: int):
    """Prefills each prompt once, expands the cache to its n rollouts; None if it cannot (generate() prefills all)."""
    prefix = {k: (v[:, :-1] if k in ("input_ids", "attention_mask", "mm_token_type_ids") else v) for k, v in batch.items()}
    out = model(**prefix, use_cache=True, logits_to_keep=1)
    cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
    if cache is None or not hasattr(cache, "reorder_cache"):
        return None
    cache.reorder_cache(torch.arange(batch["input_ids"].shape[0], device=batch["input_ids"].device).repeat_interleave(n))
    core = model.get_base_model() if hasattr(model, "get_base_model") else model  # a LoRA policy: peft's base model
    inner = getattr(core, "model", None)
    if getattr(inner, "rope_deltas", None) is not None:
        inner.rope_deltas = inner.rope_deltas.repeat_interleave(n, dim=0)
    return cache


def generate_rollouts(model, prompts: list[EncodedPrompt], n_per_prompt: int, max_new_tokens: int, batch_rows: int = 0,
                      share_prefill: bool = True, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                      ids: dict | None = None, generation_config=None) -> Rollouts:  # fmt: skip
    """`n_per_prompt` responses per prompt, about `batch_rows` rows per generate() call (0: all), from the global torch
    generator (the caller seeds it); `ids`, `generation_config` None: `special_ids`, `neutral_generation_config`."""
    if ids is None or generation_config is None:
        ids = special_ids(model) if ids is None else ids
        generation_config = neutral_generation_config(model) if generation_config is None else generation_config
    n = n_per_prompt
    rows = [j for j in range(len(prompts)) for _ in range(n)]
    per_call = max(1, (batch_rows or len(rows)) // n)  # prompts per generate() call
    sampling = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max_new_tokens, suppress_tokens=ids["vision"])
    was_training, saved = model.training, model.generation_config
    model.eval()
    model.generation_config = generation_config  # generate() fills unset fields from it: no shipped defaults leak
    chunks = []
    try:
        with torch.no_grad():
            for start in range(0, len(prompts), per_call):
                group, stats = prompts[start : start + per_call], RolloutStats(temperature, top_k, top_p)
                chunks.append(_generate(model, group, n, ids["pad"], share_prefill, sampling, stats))
    finally:
        model.generation_config = saved
    model.train(was_training)
    width = max(c[0].shape[1] for c in chunks)

    def cat(j: int, fill) -> torch.Tensor:
        return torch.cat([torch.nn.functional.pad(c[j], (0, width - c[j].shape[1]), value=fill) for c in chunks])

    response_ids = cat(0, ids["pad"])  # (N, T)
    mask = response_mask(response_ids, ids["eos"])  # (N, T)
    vision = torch.isin(response_ids, torch.tensor(ids["vision"] or [-1])) & mask
    logp, entropy = cat(1, 0.0), cat(2, 0.0)
    return Rollouts(
        prompt_index=torch.tensor(rows),
        response_ids=response_ids,
        response_mask=mask,
        logp=torch.where(mask, logp, torch.zeros_like(logp)),
        entropy=torch.where(mask, entropy, torch.zeros_like(entropy)),
        prompt_len=torch.tensor([len(prompts[j]) for j in rows]),
        valid=~vision.any(-1),
    )


def _generate(model, group: list[EncodedPrompt], n: int, pad: int, share_prefill: bool, sampling: dict,
              stats: RolloutStats) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One generate() call: n rollouts of each prompt of `group` -> (response ids, logp, entropy) on the CPU."""
    device = next(model.parameters()).device
    unique = {k: v.to(device) for k, v in collate(group, pad).items()}
    cache = prefill_shared_cache(model, unique, n) if share_prefill else None
    if cache is not None:
        batch = {k: unique[k].repeat_interleave(n, dim=0) for k in ("input_ids", "attention_mask", "mm_token_type_ids")}
        batch["cache"] = cache
    else:
        batch = {k: v.to(device) for k, v in collate([p for p in group for _ in range(n)], pad).items()}
    out = model.generate(**batch, **sampling, logits_processor=LogitsProcessorList([stats]))
    response = out[:, unique["input_ids"].shape[1] :]  # (rows, T)
    logp, entropy = stats.finish(response[:, -1])
    return response.cpu(), logp.cpu(), entropy.cpu()


class Sampler:
    """Algorithm 1, line 3 on one rank, seeded by (seed, step, rank); `gather`: the context a generation runs in."""

    def __init__(self, sampling: SamplingConfig, acc, model, autocast, seed: int, gather=nullcontext):
        self.cfg, self.acc, self.model, self.autocast = sampling, acc, model, autocast
        self.seed, self.gather = seed, gather
        policy = model()
        self.ids, self.generation_config = special_ids(policy), neutral_generation_config(policy)
        self.distribution = sampling.distribution  # temperature, top_k, top_p

    def __call__(self, step: int, records: list, prompts: list) -> tuple[Rollouts, bool]:
        """(this rank's rollouts of step `step`, whether their token entropies are known: yes)."""
        cfg = self.cfg
        torch.manual_seed(mix_seed(self.seed, step, self.acc.process_index))
        with self.autocast(), self.gather():
            rollouts = generate_rollouts(self.model(), prompts, cfg.rollouts_per_prompt, cfg.max_response_len,
                                         cfg.rollout_batch, cfg.share_prefill, **self.distribution, ids=self.ids,
                                         generation_config=self.generation_config)  # fmt: skip
        return rollouts, True

    def updated(self) -> None:
        """After a valid update: the policy itself samples next, nothing to refresh."""

    def stop(self) -> None:
        """Nothing to stop."""
