"""Grading one benchmark item: `grade` reads the reply with the parser of the item's kind and makes the per-item
record of `opd.eval.metrics`: "choice" items with `opd.answers.choice.parse_choice`, "yesno" items (POPE) with
`opd.answers.yes_no.parse_yes_no`, the others (free-form answers) with `opd.answers.free_form.free_form_match`.
"""

from __future__ import annotations

from opd.answers.choice import parse_choice
from opd.answers.free_form import free_form_match
from opd.answers.text import strip_thinking
from opd.answers.yes_no import parse_yes_no


def grade(item, reply: str) -> dict:
    """One per-item record for :mod:`opd.eval.metrics` from a benchmark item and the model's reply.

    Keys: index, kind, category, meta, answer, reply, pred (parsed letter / yes-no / text, or None),
    parsed (bool) and correct (bool; an unparsed reply is wrong). The item's question goes to every parser:
    comparisons and elimination for multiple choice, the asked object for yes/no (POPE), the subject echo
    for free-form answers (:func:`free_form_match`).
    """
    if item.kind == "choice":
        pred = parse_choice(reply, item.options, question=item.question)
        correct = pred is not None and pred.upper() == item.answer.upper()
    elif item.kind == "yesno":
        pred = parse_yes_no(reply, question=item.question)
        correct = pred is not None and pred == item.answer
    else:
        pred = strip_thinking(reply) or None
        correct = free_form_match(reply, item.answer, question=item.question)
    return {
        "index": item.index,
        "kind": item.kind,
        "category": item.category,
        "meta": dict(item.meta),
        "answer": item.answer,
        "reply": reply,
        "pred": pred,
        "parsed": pred is not None,
        "correct": bool(correct),
    }
