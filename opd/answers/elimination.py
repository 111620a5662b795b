"""The pick that ends an elimination in a multiple-choice reply (`elimination_pick`).

"A can't be it since the car is red, which leaves B.", "It rules out A and C, so B.", "Red is ruled out, which leaves
blue.": the option named right after "which leaves", "the only one left is", "by elimination" ..., right before "is
the only one left", "remains", "must be correct" ..., or after "so", "therefore" ... once the reply has ruled something
out. `opd.answers.choice.parse_choice` takes it when it comes after the reply's last explicit answer.
"""

from __future__ import annotations

import re

from opd.answers.mentions import governed, letter_words, option_spans

# An elimination's pick after these words: "which leaves B", "leaving (us with) only blue", "the only option
# left is B", "the remaining one is B", "by elimination, B", "what's left is B".
_LEFT_AFTER = re.compile(
    r"\b(?:(?:which|that|this|it)\s+(?:only\s+)?leaves|leaving|leaves\s+(?=us\b|only\b|just\b))"
    r"(?:\s+(?:us|me))?(?:\s+with)?(?:\s+(?:only|just))?"
    r"|\b(?:the\s+)?only\s+(?:one|option|choice|candidate|answer|possibility)\s+(?:left|remaining|standing"
    r"|that\s+remains|that(?:'s|\u2019s|\s+is)\s+left)\b"
    r"|\b(?:the\s+)?(?:remaining|last\s+remaining)\s+(?:one|option|choice|candidate|answer|possibility)\b"
    r"|\bby\s+(?:the\s+)?(?:process\s+of\s+)?elimination\b"
    r"|\bwhat(?:'s|\u2019s|\s+is)\s+left\s+is\b|\bwhat\s+remains\s+is\b",
    re.IGNORECASE,
)
# An elimination's pick before these words: "B is the only one left", "so only blue remains", "B must be correct".
_LEFT_BEFORE = re.compile(
    r"\b(?:is|remains)\s+(?:the\s+)?(?:only|last)(?:\s+(?:one|option|choice|candidate|answer|possibility))?"
    r"\s+(?:left|remaining|standing|that\s+remains|that(?:'s|\u2019s|\s+is)\s+left)\b"
    r"|\bremains\b(?=\s*(?:[.!]|$))|\bis\s+all\s+that(?:'s|\u2019s|\s+is)\s+left\b"
    r"|\b(?:must|has\s+to|should)\s+be\s+(?:the\s+)?(?:correct|right|answer|one)\b",
    re.IGNORECASE,
)
# A conclusion ("so B", "therefore it must be blue"); an elimination pick only after a ruling-out word.
_THEN_CUE = re.compile(r"\b(?:so|thus|therefore|hence|then)\b|\b(?:must|has\s+to|have\s+to)\s+be\b", re.IGNORECASE)
_RULED_OUT = re.compile(
    r"\brul(?:e|es|ed|ing)\s+out\b|\beliminat\w*|\bexclud\w*|\b(?:wrong|incorrect|impossible|not|cannot)\b"
    r"|\b(?:is|are)\s+out\b|n['\u2019]t\b",
    re.IGNORECASE,
)
# Where a pick after its cue ends: its sentence, or a reason ("which leaves B, since ...", "B as the answer").
_PICK_STOP = re.compile(
    r"[.!?](?=\s|$)|\n|;|,?\s+(?:because|since|as|given|due\s+to|based\s+on|which|where|while|but|though"
    r"|although)\b|\s+[\u2014\u2013-]\s",
    re.IGNORECASE,
)
_PICK_START = re.compile(r"[.!?;,:\n]|\b(?:so|then|thus|therefore|hence|which|and|but|leaving)\b", re.IGNORECASE)
_SENTENCE_END = re.compile(r"[.!?](?=\s|$)|\n")


def _mentions(text: str, options: dict[str, str], keys: dict) -> list[tuple[int, int, str]]:
    """Options named in ``text`` by letter word or by text, as (start, end, key), not counting mentions named
    as not the answer ("not C", "than the car"); a letter that is also another option's text names both."""
    found = [(s, e, keys[letter]) for s, e, letter in letter_words(text) if letter in keys and not governed(text, s)]
    return found + [(s, e, key) for s, e, key in option_spans(text, options) if not governed(text, s)]


def elimination_pick(text: str, options: dict[str, str], keys: dict) -> tuple[int, str | None] | None:
    """(position, key) of the pick that ends an elimination, (position, None) for a hedged one, else None.

    A pick is the one option named (by letter or by text) right after "which leaves", "leaving", "the
    only one left is", "by elimination" ... ("A can't be it since the car is red, which leaves B."), or
    right before "is the only one left", "remains", "must be correct" ("A and C are out, so B is the only
    one left."), or after "so", "therefore", "must be" ... once the reply has ruled something out ("It
    rules out A and C, so B.", "Red is wrong, so it must be blue."). The cue nearest the end that names an
    option decides; naming two ("which leaves B or C") is a hedge. A pick followed, in a later sentence, by
    a mention of another option ("... which leaves B. But maybe C.") is no final pick: (position, None).
    """
    mentions = _mentions(text, options, keys)

    def named(lo: int, hi: int) -> set:
        return {key for s, e, key in mentions if lo <= s and e <= hi}

    cues = [(m.start(), m.end(), True) for m in _LEFT_AFTER.finditer(text)]
    cues += [(m.start(), m.end(), False) for m in _LEFT_BEFORE.finditer(text)]
    ruled_out = _RULED_OUT.search(text)
    cues += [(m.start(), m.end(), True) for m in _THEN_CUE.finditer(text) if ruled_out and ruled_out.end() <= m.start()]
    for start, end, after in sorted(cues, reverse=True):
        if after:
            stop = _PICK_STOP.search(text, end)
            lo, hi = end, stop.start() if stop else len(text)
        else:
            heads = list(_PICK_START.finditer(text, 0, start))
            lo, hi = (heads[-1].end() if heads else 0), start
        picked = named(lo, hi)
        if not picked:
            continue
        if len(picked) > 1:
            return start, None
        key = picked.pop()
        finish = _SENTENCE_END.search(text, max(hi, end))
        if finish and named(finish.end(), len(text)) - {key}:
            return start, None
        return start, key
    return None
