"""Free-form answers (ZoomBench's open questions): `exact_match` and `free_form_match`.

`exact_match` compares after SQuAD-style normalisation (`opd.answers.text.normalize_answer`), reading the text after
a last "answer is X" / "Answer: X"; `free_form_match` adds a conservative rule-based fallback that reads the answer
out of one short, unhedged sentence ("There are 3 birds on the wire." for "3", 'The sign says "STOP".', "The car is
red."). It only ever decides "correct": the rest is the LLM judge's (`opd.eval.judge`), which this module does not do.
"""

from __future__ import annotations

import re

from opd.answers.text import NUMBER_WORDS, final_part, normalize_answer

_FINAL_ANSWER = re.compile(r"(?:final answer|answer)\s*(?:is|:)\s*", re.IGNORECASE)


def exact_match(pred, gold) -> bool:
    """Free-form match after :func:`normalize_answer`.

    The prediction is the reply after any think block (or its last ``<answer>`` body); when it states
    "answer is X" / "Answer: X", the text after the last such statement (up to the end of its line) is
    compared. Empty never matches.
    """
    text = final_part(str(pred if pred is not None else ""))
    stated = list(_FINAL_ANSWER.finditer(text))
    if stated:
        text = text[stated[-1].end():].split("\n")[0]
    want = normalize_answer(gold)
    return bool(want) and normalize_answer(text) == want


# ----------------------------------------------------------------------------- free-form fallback

_FREE_MAX_WORDS = 20
# What makes a free-form reply tentative, approximate, plural in its answers or negated: left to the judge.
_FREE_HEDGE = re.compile(
    r"\b(?:or|either|maybe|perhaps|possibly|probably|likely|might|may|could|unclear|uncertain|unsure|guess"
    r"|approximately|about|around|roughly|nearly|almost|over|under|at\s+least|at\s+most|more\s+than|less\s+than"
    r"|fewer\s+than|up\s+to|some|several|many|few|not|no|never|none|nothing|neither|nor|cannot"
    r"|hard\s+to|difficult\s+to)\b|n['\u2019]t\b",
    re.IGNORECASE,
)
_TENS = {"twenty": 20, "thirty": 30, "forty": 40, "fifty": 50, "sixty": 60, "seventy": 70, "eighty": 80, "ninety": 90}
_UNIT_WORDS = "one|two|three|four|five|six|seven|eight|nine"
# A number as digits ("3", "1,200", "2.5") or words ("three", "forty-two"); not part of "12", "2.5" or "3rd".
_NUMBER_TOKEN = re.compile(
    r"(?<![\w.,])(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?!\w|[.,]\d)"
    r"|\b(?:" + "|".join(_TENS) + r")(?:[- ](?:" + _UNIT_WORDS + r"))?\b"
    r"|\b(?:" + "|".join(sorted(NUMBER_WORDS, key=len, reverse=True)) + r")\b",
    re.IGNORECASE,
)
# "one" as a pronoun ("the red one", "one of them") is no count.
_PRONOUN_ONE = re.compile(r"\b(?:the|this|that|which|each|every|any|another|no|a|an)\s+$", re.IGNORECASE)
_QUOTED = re.compile(r"\"([^\"]+)\"|\u201c([^\u201d]+)\u201d|(?<!\w)'([^']+)'(?!\w)|\u2018([^\u2019]+)\u2019(?!\w)")
# Words that state a text or a name: "says", "reads", "shows the word", "is called", "named", "is labelled".
_NAMING = re.compile(
    r"\b(?:(?:is|are|was|were)\s+)?(?:says?|said|reads?|spells?|spelled|spelt|shows?|displays?|called|named"
    r"|labell?ed|titled|written)\b(?:\s+(?:as|out))?(?:\s+the\s+(?:word|words|text|name|number|letters?))?\s*:?\s*",
    re.IGNORECASE,
)
_COPULA = re.compile(r"\b(?:is|are|was|were)\b|(?<=\w)['\u2019](?:s|re)\b", re.IGNORECASE)
_COLOUR_TAIL = re.compile(r"\s+(?:in\s+colou?r|colou?red)\s*$", re.IGNORECASE)
_COLOURS = frozenset(
    "red orange yellow green blue purple violet pink brown black white gray grey silver gold golden beige tan "
    "navy teal maroon cyan magenta turquoise".split()
)
# Words a reply's subject may hold besides the question's own: articles, pronouns, "I think", "the name", ...
_ECHO_FREE = frozenset(
    "a an the of in on at to for with from by s it this that these those they he she its his her their there here "
    "i we think believe see can looks look like seems seem appears appear so yes word words text name color "
    "colour number letter letters label title answer".split()
)


def _number_value(token: str) -> float:
    """The value of a :data:`_NUMBER_TOKEN` match ("1,200" -> 1200, "forty-two" -> 42, "three" -> 3)."""
    low = token.lower().replace(",", "")
    if low[0].isdigit():
        return float(low)
    parts = re.split(r"[- ]", low)
    if parts[0] in _TENS:
        return _TENS[parts[0]] + (float(NUMBER_WORDS[parts[1]]) if len(parts) > 1 else 0.0)
    return float(NUMBER_WORDS[low])


def _same_number(said: str, gold) -> bool:
    """Whether two texts are each one number, of the same value ("twenty-five" and "25")."""
    a, b = _NUMBER_TOKEN.fullmatch(said.strip()), _NUMBER_TOKEN.fullmatch(str(gold).strip().rstrip("."))
    return bool(a and b) and _number_value(a.group(0)) == _number_value(b.group(0))


def _echoes(subject: str, question: str | None) -> bool:
    """Whether every word of ``subject`` is the question's own (singular or plural) or in :data:`_ECHO_FREE`:
    "The car" for "What color is the car?", "It", "The name of the shop" for "What is the shop called?"."""
    asked = set(normalize_answer(question or "").split())
    asked |= {w[:-1] for w in asked if w.endswith("s")} | {w + "s" for w in asked}
    return all(w in asked or w in _ECHO_FREE for w in normalize_answer(subject).split())


def _stated_spans(text: str, gold: str, question: str | None) -> list[tuple[int, int]]:
    """Where a short sentence states a free-form answer, as spans of ``text`` that may be compared with gold.

    * a count: the reply's only number, when the gold answer is a number ("There are 3 birds on the wire.",
      "I count three birds."; "3 birds and 2 cats" names two: none);
    * a quoted text: the reply's only quoted span ('The sign says "STOP".');
    * a named text: what follows "says", "reads", "shows (the word)", "is called", "named" ... ("The sign says
      STOP.", "The shop is called Luigi's.", "The clock shows 3:15."), when the words before it echo the
      question (:func:`_echoes`);
    * a copula's complement: all that follows "is"/"are"/"'s" ("The car is red.", "It's red in colour."),
      when the subject echoes the question;
    * a colour: the reply's only colour word, equal to the gold colour, right before a word of a colour
      question ("The man is wearing a red shirt." for "What color is the man's shirt?").
    """
    spans = []
    numbers = [m for m in _NUMBER_TOKEN.finditer(text)
               if not (m.group(0).lower() == "one" and (_PRONOUN_ONE.search(text[:m.start()])
                                                       or re.match(r"\s+of\b", text[m.end():])))]  # fmt: skip
    gold_number = _NUMBER_TOKEN.fullmatch(str(gold).strip().rstrip("."))
    if gold_number and len({_number_value(m.group(0)) for m in numbers}) == 1:
        spans += [m.span() for m in numbers if _number_value(m.group(0)) == _number_value(gold_number.group(0))]
    quoted = list(_QUOTED.finditer(text))
    if len(quoted) == 1:
        group = next(g for g in range(1, 5) if quoted[0].group(g))
        spans.append(quoted[0].span(group))
    tail_end = len(text.rstrip(" \t.!"))
    for m in list(_NAMING.finditer(text)) + list(_COPULA.finditer(text)):
        if _echoes(text[:m.start()], question) and m.end() < tail_end:
            cut = _COLOUR_TAIL.search(text, m.end(), tail_end)
            spans.append((m.end(), cut.start() if cut else tail_end))
    want = normalize_answer(gold)
    colours = {w for w in normalize_answer(text).split() if w in _COLOURS}
    if want in _COLOURS and colours == {want} and re.search(r"\bcolou?r", question or "", re.IGNORECASE):
        asked = set(normalize_answer(question).split()) - _ECHO_FREE
        for m in re.finditer(rf"\b{re.escape(want)}\b\s+(\w+)", text, re.IGNORECASE):
            if m.group(1).lower() in asked:
                spans.append((m.start(), m.start() + len(want)))
    return spans


def free_form_match(reply, gold, question: str | None = None) -> bool:
    """Whether a free-form reply gives the gold answer: :func:`exact_match`, else the rule-based fallback.

    The fallback reads only a short declarative reply: one sentence (after any think block, or the last
    ``<answer>`` body) of at most 20 words. The spans :func:`_stated_spans` finds there are compared with
    the gold answer after :func:`normalize_answer` (case, punctuation and articles aside; number words as
    digits; "twenty-five" is 25), and one that equals it matches when the rest of the sentence does not
    hedge, approximate or negate (:data:`_FREE_HEDGE`: "or", "maybe", "about", "at least", "not", "n't" ...).
    Longer replies, several sentences, several candidate answers ("3 birds and 2 cats", two quoted texts,
    two colours) and hedges are left unmatched: wrong without a judge, and the judge's to decide when one
    is used (:mod:`opd.eval.judge`); the fallback only ever decides "correct". ``question`` (the item's)
    lets a subject echo it ("The car is red." for "What color is the car?"); without it only a pronoun
    subject ("It's red."), counts and quotes are read.
    """
    if exact_match(reply, gold):
        return True
    text = final_part(str(reply if reply is not None else "")).replace("**", "").replace("`", "").strip()
    want = normalize_answer(gold)
    if not want or "\n" in text or len(text.split()) > _FREE_MAX_WORDS:
        return False
    if re.search(r"[.!?;](?=\s+\S)", _QUOTED.sub('""', text)):
        return False
    for start, end in _stated_spans(text, gold, question):
        rest = text[:start] + " " + text[end:]
        said = text[start:end]
        same = normalize_answer(said) == want or _same_number(said, gold)
        if same and not _FREE_HEDGE.search(rest):
            return True
    return False
