"""The toy world's privileged signals for the seed family (experiments/family.py).

The family's methods differ in what their teacher sees, so each needs a base model for which that signal is
privileged (its teacher view answers better than the student's):

- crop (BAS-OPD, Vision-OPD, OPD-V): the toy experiment's base, trained on crops only;
- resolution (RP-OPSD): a base that keeps an image's own size (`SFTConfig.max_resolution`), trained on full
  canvases at their native 64 x 64 pixels; the student's half-resolution view is one visual token;
- text (OPSD): a base that reads a hint (`HINT`: crops with the plain question, and full images with the question
  and the reference answer in OPSD's teacher template); the student's prompt never holds the answer.

`view_accuracy` answers records greedily in any view of `opd.data.records.VIEWS` (the teacher's privileged
accuracy); `write_eval_records` turns the benchmark's items into training-format records.
Details: docs/MODULES.md#harnessfamily.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from opd.answers.choice import parse_choice
from opd.data.family_views import reference_prompt
from opd.data.records import get_view
from opd.eval.inference import generate_replies
from opd.loop.ledger import write_atomic
from opd.models.chat import collate, encode_prompt
from opd.toy.world import OPTIONS, sample


@dataclass(frozen=True)
class HintTask:
    """Supervised targets of the hint base (an `opd.toy.sft` task): the letter and <|im_end|>; a sample
    drawn as 'crop' is shown as the crop with the plain question, one drawn as 'full' as the full image
    with the answer in OPSD's teacher template."""

    name: str = "hint"

    def batch(self, processor, model, samples, views: list[str], rng):
        ids = processor.tokenizer.convert_tokens_to_ids
        prompts = [
            encode_prompt(processor, [s.crop()], s.problem) if v == "crop"
            else encode_prompt(processor, [s.image], reference_prompt(s.problem, s.answer))
            for s, v in zip(samples, views)
        ]  # fmt: skip
        target = torch.tensor([[ids(s.answer), ids("<|im_end|>")] for s in samples])  # (n, 2)
        return collate(prompts, model.generation_config.pad_token_id, target), target


HINT = HintTask()


def write_eval_records(world_dir: Path, world, out: Path) -> Path:
    """The benchmark's items as training-format records (image + bbox), so any view of opd.data.records.VIEWS can be
    built for them; the images are the benchmark's own files. Returns the JSONL path."""
    rows = []
    for i in range(world.n_eval):
        s = sample(world, "eval", i)
        rows.append({"image": str((world_dir / "bench" / "zoombench" / "images" / f"{i:05d}.png").resolve()),
                     "bbox": list(s.bbox), "problem": s.problem, "answer": s.answer})  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, "".join(json.dumps(r) + "\n" for r in rows))
    return out


@torch.no_grad()
def view_accuracy(model, processor, records, view: str, batch: int = 100) -> float:
    """Greedy accuracy (%) on `records` asked in `view` (opd.data.records.VIEWS; the masked view seeded by the record's
    index), answers parsed as eval.py parses them."""
    model.eval()
    correct = 0
    for start in range(0, len(records), batch):
        group = records[start : start + batch]
        prompts = [encode_prompt(processor, *get_view(view)(r, start + j)) for j, r in enumerate(group)]
        replies = generate_replies(model, processor, prompts, max_new_tokens=4)
        correct += sum(parse_choice(reply, OPTIONS) == r.answer for reply, r in zip(replies, group))
    return 100.0 * correct / len(records)
