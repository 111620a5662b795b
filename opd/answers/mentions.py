"""Where a multiple-choice reply names an option, for `opd.answers.choice` and `opd.answers.elimination`.

By letter: the letters that stand alone as words (`letter_words`; not the pronoun "I" nor the article "A"). By text:
where the options' texts appear (`option_spans`; a number matches as a digit and as a word, "2" / "two"; not inside a
longer option's text nor inside a choosing phrase, "Go" in "go with"). And whether a mention follows "not", "than",
"instead of" ... in its clause, so names an option as *not* the answer (`governed`, over the `tail` before it).
"""

from __future__ import annotations

import re

from opd.answers.text import NUMBER_WORDS

_DIGIT_WORDS = {digit: word for word, digit in NUMBER_WORDS.items()}

# A capital letter standing alone as a word ("B", "'C'"), or any letter in brackets ("(b)"); not part
# of "I'd", "X-ray", "B/C", "D.C.".
_LETTER_WORD = re.compile(
    r"\(([A-Za-z])\)|(?<![\w.\-/\\])([A-Z])(?![\w\-/\\])(?!['\u2019][A-Za-z])(?!\.\w)"
)
# Words after "A" that show it is the letter and not the article ("A is", "A or B", "A because ...").
_LETTER_FOLLOWERS = frozenset({
    "is", "was", "seems", "appears", "looks", "matches", "fits", "sounds", "makes", "and", "or", "nor", "but",
    "because", "since", "as", "then", "than", "instead", "rather", "over", "versus", "vs", "would", "should",
    "could", "might", "must", "best", "too", "also",
})


# A choosing verb phrase; an option text inside it ("Go" in "go with") is not an answer.
_CHOICE_VERB = re.compile(
    r"\b(?:go(?:ing)?|went)\s+(?:with|for)\b|\bopt(?:ing)?\s+for\b|\b(?:choose|chose|pick|select)\b",
    re.IGNORECASE,
)
_FILLER = r"(?!(?:but|and|or|so|because|while|though)\b)[\w'\u2019-]+"
# Words that name an option as *not* the answer when they come just before it (up to a few words):
# "not (the) car", "isn't B", "no red car", "than the car", "instead of B", "compared to the car", "unlike the car".
_GOVERNOR = re.compile(
    r"(?:\b(?:than|instead\s+of|compared\s+(?:to|with)|in\s+comparison\s+(?:to|with)|as\s+opposed\s+to"
    r"|unlike|versus|vs)(?:\s+" + _FILLER + r"){0,3}"
    r"|(?:\bnot|\bno|n't)(?:\s+" + _FILLER + r"){0,2})\s+[\"'\u201c\u2018(]?$",
    re.IGNORECASE,
)


def letter_words(text: str) -> list[tuple[int, int, str]]:
    """Letters standing alone as words, as (start, end, upper-case letter) in text order.

    Left out: the pronoun "I" before a word ("I think") and the article "A" before a word that is
    not a verb or conjunction ("A dog is ..."); "A is", "A or B", "A because" keep the letter.
    """
    found = []
    for m in _LETTER_WORD.finditer(text):
        if m.group(1):
            found.append((m.start(), m.end(), m.group(1).upper()))
            continue
        letter = m.group(2)
        follower = re.match(r"[ \t]+([A-Za-z]+)", text[m.end():])
        if follower and (letter == "I" or (letter == "A" and follower.group(1).lower() not in _LETTER_FOLLOWERS)):
            continue
        found.append((m.start(), m.end(), letter))
    return found


def tail(text: str, end: int, limit: int = 80) -> str:
    """Up to ``limit`` characters of ``text`` before ``end``, on the same line, from a word start."""
    head = text[max(0, end - limit):end].split("\n")[-1]
    if end > limit and len(head) == limit:
        head = re.sub(r"^\S*", "", head)  # a word cut in half
    return head


def governed(text: str, start: int) -> bool:
    """Whether the mention at ``start`` follows, in its clause, "not", "no", "n't", "than", "instead of",
    "compared to", "unlike" ... (with up to two or three words between): a mention named as *not* the answer."""
    head = re.split(r"[.!?;,:]", tail(text, start))[-1]
    return bool(_GOVERNOR.search(" " + head))


def _number_alternatives(token: str) -> str | None:
    """A regex matching a number token both as a digit and as a word ("2" / "two"), else None."""
    low = token.lower()
    other = NUMBER_WORDS.get(low) or _DIGIT_WORDS.get(low)
    return f"(?:{re.escape(low)}|{other})" if other else None


def _option_pattern(value) -> str | None:
    """A case-insensitive, word-bounded regex for an option's text; number tokens match as digits and words."""
    needle = re.sub(r"\s+", " ", str(value)).strip().rstrip(".").strip()
    if not needle:
        return None
    parts = [_number_alternatives(token) or re.escape(token) for token in needle.split(" ")]
    return r"(?<!\w)(?<!\d[.,])" + r"\s+".join(parts) + r"(?!\w)(?![.,]\d)"


def option_spans(text: str, options: dict[str, str]) -> list[tuple[int, int, str]]:
    """Where options' texts appear, as (start, end, key).

    A match inside a longer matched option ("red" inside "dark red") and a match inside a choosing
    phrase ("Go" inside "go with") do not count.
    """
    spans = []
    for key, value in options.items():
        pattern = _option_pattern(value)
        if pattern:
            spans += [(m.start(), m.end(), key) for m in re.finditer(pattern, text, re.IGNORECASE)]
    verbs = [m.span() for m in _CHOICE_VERB.finditer(text)]
    return [
        (s, e, key)
        for s, e, key in spans
        if not any(s2 <= s and e <= e2 and (e2 - s2) > (e - s) and k2 != key for s2, e2, k2 in spans)
        and not any(vs <= s and e <= ve for vs, ve in verbs)
    ]
