"""The options written in a question's text: `split_options` splits "question (A) x (B) y", "A. x" lines and
"Options: A: x, B: y" into the question and its options, and `clean_question` drops the image placeholder and a
trailing answer instruction ("Answer with the option's letter from the given choices directly."). The benchmark
loaders (`opd.eval.benchmarks`) and OPOD's task reward (`opd.methods.opod`) use them.
"""

from __future__ import annotations

import re

_INSTRUCTIONS = (
    "Answer with the option's letter from the given choices directly.",
    "Answer with the option letter from the given choices directly.",
    "Answer the option letter directly.",
    "Please answer yes or no.",
    "Answer yes or no.",
    "Select from the following choices.",
)


# ----------------------------------------------------------------------------- option parsing

_PAREN_MARK = re.compile(r"\(([A-Za-z])\)[ \t]*")
_LINE_MARK = re.compile(r"(?m)^[ \t]*([A-Z])[.:)][ \t]+")
_INLINE_MARK = re.compile(r"(?:(?<=\s)|(?<=^)|(?<=,))([A-Z])[:.][ \t]+")


def _chain(marks: list[re.Match]) -> list[re.Match]:
    """The longest run of markers lettered A, B, C, ... in order (last one on ties)."""
    best: list[re.Match] = []
    for i, m in enumerate(marks):
        if m.group(1).upper() != "A":
            continue
        run = [m]
        for n in marks[i + 1:]:
            if n.group(1).upper() == chr(ord(run[-1].group(1).upper()) + 1):
                run.append(n)
        if len(run) >= len(best):
            best = run
    return best if len(best) >= 2 else []


def split_options(text: str) -> tuple[str, dict[str, str]]:
    """Split "question (A) x (B) y" / "A. x" lines / "Options: A: x, B: y" into question and options.

    Option keys come back upper case ("(a) Open" -> "A"). The last option ends at its line's end, so
    a trailing instruction line is dropped. No options found: ``(text, {})``.
    """
    for pattern, scope in ((_PAREN_MARK, None), (_LINE_MARK, None), (_INLINE_MARK, "options")):
        start = 0
        if scope:
            hit = re.search(r"(?:Options|Choices)\s*:\s*", text, re.IGNORECASE)
            if not hit:
                continue
            start = hit.end()
        marks = _chain([m for m in pattern.finditer(text) if m.start() >= start])
        if not marks:
            continue
        options = {}
        for m, n in zip(marks, marks[1:] + [None]):
            body = text[m.end(): n.start() if n else len(text)]
            if n is None:  # the last option ends with its line and loses a trailing instruction
                body = clean_question(body.split("\n")[0])
            options[m.group(1).upper()] = body.strip().rstrip(",;").strip()
        head = text[: hit.start()] if scope else text[: marks[0].start()]
        return clean_question(head), options
    return clean_question(text), {}


def clean_question(text: str) -> str:
    """The question without its image placeholder and a trailing answer instruction (`_INSTRUCTIONS`)."""
    text = text.replace("<image>", "").strip()
    changed = True
    while changed:
        changed = False
        for phrase in _INSTRUCTIONS:
            if text.lower().endswith(phrase.lower()):
                text, changed = text[: -len(phrase)].rstrip(), True
    return text
