"""Fixed stand-in rollouts for tests and benchmarks ("fixed responses may stand in for sampling").

The responses of a step are a pure function of (seed, step, global row index), so a 1-process and an
N-process run see the same global batch, whatever the split over ranks.
"""

import torch

from opd.engine.rollout import Rollouts, response_mask, seeded_generator


def fixed_rollouts(
    run, step: int, min_len: int = 2, max_len: int = 9, seed: int = 123, high_entropy_below: int | None = None
) -> Rollouts:
    """This rank's rows of step `step` of a `opd.run.Run`: random character responses with lengths
    uniform in [min_len, max_len] (EOS last), random log-probs and entropies. Rows whose global index is
    below `high_entropy_below` get 10 nats more entropy (so the entropy policy selects only them)."""
    records = run.prompts.of_step(step)
    prompts = run.prompts.student(records)
    n = run.cfg.sampling.rollouts_per_prompt
    first = run.acc.process_index * len(records) * n
    chars = torch.tensor(run.processor.tokenizer.convert_tokens_to_ids(list("abcdefghij")))
    ids, logp, ent = [], [], []
    for g in range(first, first + len(records) * n):
        gen = seeded_generator(seed, step, g)
        length = int(torch.randint(min_len, max_len + 1, (1,), generator=gen))
        row = chars[torch.randint(0, len(chars), (max_len,), generator=gen)]
        row[length - 1] = run.ids["eos"][0]
        row[length:] = run.ids["pad"]
        ids.append(row)
        logp.append(-torch.rand(max_len, generator=gen) * 3)
        boost = 10.0 if high_entropy_below is not None and g < high_entropy_below else 0.0
        ent.append(torch.rand(max_len, generator=gen) + boost)
    response_ids = torch.stack(ids)  # (N, T)
    mask = response_mask(response_ids, run.ids["eos"])  # (N, T)
    prompt_index = torch.arange(len(records)).repeat_interleave(n)
    return Rollouts(
        prompt_index=prompt_index,
        response_ids=response_ids,
        response_mask=mask,
        logp=torch.stack(logp) * mask,
        entropy=torch.stack(ent) * mask,
        prompt_len=torch.tensor([len(prompts[j]) for j in prompt_index.tolist()]),
        valid=torch.ones(len(prompt_index), dtype=torch.bool),
    )
