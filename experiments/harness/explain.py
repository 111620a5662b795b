"""The second toy task: the same world and question, answered by a short explanation and then the answer.

The world, its images, crops, questions, training JSONL and benchmark are the first task's (`opd.toy.world`,
docs/TOY.md); only what the model says changes: a response is one of `STYLES`, from "Blue." and the letter on the
next line to "Blue. I see a small blue square here. Answer: C" (the colour it sees, then nothing, a clause or a
sentence, then an explicit answer eval.py's parser reads), 7 to 54 tokens (`response_lengths`), so rollouts of one
prompt differ in length and content. Only the crop-trained base differs (`opd.toy.sft.train_base(...,
task=EXPLAIN)`): its targets are `response_text(sample, style)`, the style drawn per sample from `STYLE_WEIGHTS`.

The colour comes first: named mid-sentence, OPD erased one colour word from both views within 10-30 steps
(docs/TOY_EXPLAIN.md, "How the task was found"). Details: docs/MODULES.md#harnessexplain.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from opd.models.chat import collate, encode_prompt
from opd.toy.world import OPTIONS, SHAPES, Sample

STYLES = {
    "terse": "{Colour}.\n{letter}",
    "answer": "{Colour}. Answer: {letter}",
    "because": "{Colour}, so the answer is {letter}.",
    "sentence": "{Colour}: the {shape} is {colour}. Answer: {letter}",
    "clauses": "{Colour}. I see a small {colour} {shape} here. Answer: {letter}",
}
"""Response templates, shortest to longest; every one ends in an answer eval.py's parser reads."""

STYLE_WEIGHTS = {"terse": 1.0, "answer": 1.0, "because": 1.0, "sentence": 1.0, "clauses": 1.0}
"""Relative frequency of each style in the base model's supervised data (uniform)."""


def response_text(sample: Sample, style: str, colour: str | None = None) -> str:
    """The response of `style` for `sample` (without <|im_end|>); `colour` overrides the true colour
    (the answer letter follows the colour named, as in the supervised data)."""
    colour = colour or sample.colour
    letter = next(k for k, v in OPTIONS.items() if v == colour)
    return STYLES[style].format(letter=letter, colour=colour, Colour=colour.capitalize(), shape=sample.shape)


def response_lengths() -> dict[str, tuple[int, int]]:
    """(shortest, longest) length in tokens of each style over every colour and shape, <|im_end|>
    included (the tiny tokenizer has one token per character)."""
    out = {}
    for style, template in STYLES.items():
        n = [len(template.format(letter="A", colour=c, Colour=c, shape=s)) + 1 for c in OPTIONS.values() for s in SHAPES]
        out[style] = (min(n), max(n))
    return out


def draw_styles(rng: np.random.Generator, n: int) -> list[str]:
    """n styles drawn independently with probabilities proportional to `STYLE_WEIGHTS`."""
    names = list(STYLE_WEIGHTS)
    p = np.array([STYLE_WEIGHTS[s] for s in names], dtype=float)
    return [names[int(j)] for j in rng.choice(len(names), size=n, p=p / p.sum())]


def style_of(text: str) -> str | None:
    """The style a generated response follows (by what follows its first word), None when it follows none."""
    t = text.strip()
    word = t.split(maxsplit=1)[0] if t else ""
    if not any(word.rstrip(".,:").lower() == c for c in OPTIONS.values()):
        return None
    rest = t[len(word.rstrip(".,:")):]
    for style, template in STYLES.items():
        tail = template.split("{Colour}", 1)[1].split("{", 1)[0]  # the fixed text right after the colour
        if rest.startswith(tail):
            return style
    return None


@dataclass(frozen=True)
class ExplainTask:
    """The supervised targets of `opd.toy.sft.train_base` for this task (`task=EXPLAIN`)."""

    name: str = "explain"

    def batch(self, processor, model, samples: list[Sample], views: list[str], rng: np.random.Generator):
        """(model inputs, targets (n, T) with -100 after each response's <|im_end|>) for teacher forcing
        `response_text` in a style drawn from `rng`."""
        tok = processor.tokenizer
        end = tok.convert_tokens_to_ids("<|im_end|>")
        prompts = [encode_prompt(processor, [s.crop() if v == "crop" else s.image], s.problem) for s, v in zip(samples, views)]
        texts = [response_text(s, style) for s, style in zip(samples, draw_styles(rng, len(samples)))]
        ids = [tok(t, add_special_tokens=False)["input_ids"] + [end] for t in texts]
        width = max(len(x) for x in ids)
        pad = model.generation_config.pad_token_id
        response = torch.full((len(ids), width), pad, dtype=torch.long)
        mask = torch.zeros((len(ids), width), dtype=torch.long)
        for i, x in enumerate(ids):
            response[i, : len(x)] = torch.tensor(x)
            mask[i, : len(x)] = 1
        target = response.masked_fill(mask == 0, -100)
        return collate(prompts, pad, response, mask), target


EXPLAIN = ExplainTask()
