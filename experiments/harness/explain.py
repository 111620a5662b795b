"""The second toy task: the same world and question, answered by a short explanation and then the answer.

The first toy task (`opd.toy.world`, docs/TOY.md) answers with one letter, so every response is two
tokens and the 8 rollouts of a prompt are near-duplicates. This task keeps the world, its images,
crops, questions, training JSONL and held-out benchmark exactly as they are (`export_world`), and
changes only what the model says: a response is one of `STYLES`, from "Blue.\nC" to "Blue. I see a
small blue square here. Answer: C": the colour it sees, then nothing, a clause or a sentence about it,
then an explicit answer that eval.py's parser reads ("Answer: C", "the answer is C", a last line "C").
With the tiny model's character-level tokenizer a response is 7 to 54 tokens (`response_lengths`), so
rollouts of one prompt differ in length and in content (the style drawn, and the colour named when the
full image leaves the student unsure).

Only the crop-trained base model (`opd.toy.sft.train_base(..., task=EXPLAIN)`) differs from the first
task: its supervised targets are `response_text(sample, style)` with the style drawn per sample from
`STYLE_WEIGHTS`, the loss over every response token. What a response's tokens carry is then uneven:
the colour (first token) and the answer letter depend on the image, the other words do not, so the
crop teacher and the full-image student disagree on a few tokens of a long response and on a larger
share of a short one. The crop cannot show where the target sits in the canvas, so no style names a
position (the crop teacher could not know it).

Why the colour comes first: in a first design the colour was named mid-sentence ("I see a small green
square ..."); there OPD at the toy's learning rates (5e-5 to 3e-4) erased one colour word (the one the
full-image student over-predicted) from both views within 10-30 steps, teacher included, even under Full
querying (docs/TOY_EXPLAIN.md, "How the task was found").
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
