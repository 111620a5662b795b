"""Multiple-choice replies: `parse_choice`, the option letter a reply chooses, or None when unparsed.

The rules, in order: a reply that is exactly one option's text ("Beach" for "A beach."); else the last explicit
answer ("the answer is (C)", "**C**", a reply opening with "(b)"), unless an elimination's pick comes after it
(`opd.answers.elimination`); else, unless the reply refuses, the one option letter a sentence chooses ("I'd go with
B", "..., B."); else the one option whose text appears as the answer, not after "not", "than", "instead of" ...
(`opd.answers.mentions`), with a comparison that must answer the question's comparative.
"""

from __future__ import annotations

import re
import string

from opd.answers.elimination import elimination_pick
from opd.answers.mentions import governed, letter_words, option_spans, tail
from opd.answers.text import MARKED, REFUSAL, clean

# "the answer is (C)", "Answer: c", "correct option is B", "final answer: **C**".
_STATED = re.compile(
    r"\b(?:answer|choice|option)\s*(?:(?:is|would be|should be|will be)\b|:)\s*:?\s*"
    r"(?:option\s*|choice\s*)?(?P<open>[(\[]?)(?P<letter>[A-Za-z])(?P<close>[)\]]?)(?![A-Za-z0-9])",
    re.IGNORECASE,
)
# "B is correct", "(C) is the right answer".
_IS_CORRECT = re.compile(r"(?<![A-Za-z])\(?([A-Z])\)?\s+is\s+(?:the\s+)?(?:correct|right|best)\b")
# A reply that opens with "(b)", "b.", "C)", "C:", "C," or a letter alone on the first line.
_LEADING = re.compile(
    r"^\s*(?:(?:[Oo]ption|[Cc]hoice)\s*)?"
    r"(?:\(([A-Za-z])\)"  # (b)
    r"|([A-Za-z])[.):](?=\s|$)"  # b.  C)  C:
    r"|([A-Z]),(?=\s)"  # C, because ...
    r"|([A-Za-z])[ \t]*(?:\n|$))"  # C alone on the first line
)
# A last line that is only a letter: "...\n\n(C)".
_TRAILING = re.compile(r"\n\s*\(?([A-Za-z])\)?\s*\.?\s*$")
# A second letter right after the chosen one: "A or B", "B/C", "A, B".
_HEDGE = re.compile(
    r"^\)?\s*(?:,|/|[Oo][Rr]\b|[Aa][Nn][Dd]\b)\s*(?:[Oo]ption\s*)?(?:\(([A-Za-z])\)|([A-Z]))(?![A-Za-z])"
)


def _explicit_letters(text: str) -> list[tuple[int, str, int]]:
    """Explicit answer statements as (position, letter, end of the letter), in text order."""
    found = []
    for m in _STATED.finditer(text):
        letter = m.group("letter")
        bracketed = bool(m.group("open") and m.group("close"))
        # A bare lower-case letter followed by more words is an article ("the answer is a dog").
        if letter.islower() and not bracketed and re.match(r"[ \t]+[A-Za-z0-9]", text[m.end():]):
            continue
        found.append((m.start("letter"), letter, m.end("letter")))
    found += [(m.start(1), m.group(1), m.end(1)) for m in _IS_CORRECT.finditer(text)]
    found += [(m.start(1), m.group(1), m.end(1) + 1) for m in MARKED.finditer(text)]
    m = _LEADING.match(text)
    if m:
        group = next(g for g in range(1, 5) if m.group(g))
        found.append((m.start(group), m.group(group), m.end(group)))
    m = _TRAILING.search(text)
    if m:
        found.append((m.start(1), m.group(1), m.end(1)))
    return sorted(found)


# A choosing phrase right before a letter: "I'd go with B", "I think it's B", "pick: B", "option B".
_CHOICE_CUE = re.compile(
    r"\b(?:choos(?:e|ing)|chose|pick(?:ed|ing)?|select(?:ed|ing)?|go(?:ing)?\s+(?:with|for)"
    r"|went\s+(?:with|for)|opt(?:ing)?\s+for|settle\s+on|guess|say|think|believe"
    r"|it['\u2019]s|it\s+is|that['\u2019]s|that\s+is|(?:would|should|must|has\s+to)\s+be|is"
    r"|option|choice|letter)[ \t]*:?[ \t]*[\"'\u201c\u2018]?$",
    re.IGNORECASE,
)
# What may follow a chosen letter: the end of the reply, line or sentence, or a reason ("B because").
_LETTER_END = re.compile(
    r"[\"'\u201d\u2019]?(?:[ \t]*[.!]*[ \t]*(?:\n|$)|[.!]+\s"
    r"|[ \t]*,?[ \t]*(?:because|since|as|given|due\s+to|based\s+on)\b)",
    re.IGNORECASE,
)


_COMPARISON = re.compile(r"\bthan\b|\bcompared\s+(?:to|with)\b|\bin\s+comparison\s+(?:to|with)\b", re.IGNORECASE)
_COMPARISON_NEGATION = re.compile(r"\b(?:not|no|never)\b|n't\b", re.IGNORECASE)
_COMPARATIVE_WORD = re.compile(
    r"\b(more|most|less|least|fewer|fewest)\s+([a-z]+)|\b([a-z]+?)(?:er|est)\b", re.IGNORECASE
)
# Stems of "-er"/"-est" adjectives (as the suffix leaves them), grouped by meaning.
_COMPARATIVE_STEMS = {
    "clos": "near", "near": "near", "farth": "far", "furth": "far", "bigg": "big", "larg": "big",
    "great": "big", "small": "small", "tall": "tall", "short": "short", "long": "long", "high": "high",
    "low": "low", "wid": "wide", "narrow": "narrow", "heavi": "heavy", "light": "light", "thick": "thick",
    "thinn": "thin", "dark": "dark", "bright": "bright", "old": "old", "young": "young", "fast": "fast",
    "slow": "slow", "deep": "deep", "shallow": "shallow",
}


def _sentence_letter(text: str, keys, options: dict | None = None) -> str | None:
    """The option letter that a sentence chooses without an answer keyword, else None.

    The reply must name exactly one of ``keys`` as a letter word (not counting mentions after "not" or
    "than" ...: "It's B, not C" names B), and one of its mentions must follow a choosing phrase ("I'd
    go with B", "I think it's B", "option B") or end a sentence, line or clause before a reason
    ("Because of the orange leaves, B.", "B because ..."). "B or C", "either B or C" name two: None.
    A letter that is also another option's text (options A: "X", B: "C", C: "Q": "The letter on the sign is
    C.") may name either option: it is not read here.
    """
    texts = {str(v).strip().strip("()").strip().upper(): str(k).strip("() ").upper() for k, v in (options or {}).items()}
    free = [(s, e, letter) for s, e, letter in letter_words(text)
            if letter in keys and not governed(text, s) and texts.get(letter, letter) == letter]  # fmt: skip
    if len({letter for _, _, letter in free}) != 1:
        return None
    for s, e, letter in free:
        if _CHOICE_CUE.search(tail(text, s)) or _LETTER_END.match(text, e):
            return letter
    return None


def _comparatives(text: str | None) -> set[str]:
    """The comparative/superlative adjectives in ``text`` by meaning ("closer", "nearest" -> "near";
    "more visible" -> "more visible"); words outside the known list are ignored."""
    found = set()
    for m in _COMPARATIVE_WORD.finditer(text or ""):
        if m.group(1):
            if m.group(2).lower() not in ("than", "of", "and", "or", "the"):
                direction = "more" if m.group(1).lower() in ("more", "most") else "less"
                found.add(f"{direction} {m.group(2).lower()}")
        elif m.group(3).lower() in _COMPARATIVE_STEMS:
            found.add(_COMPARATIVE_STEMS[m.group(3).lower()])
    return found


def _sentence_around(text: str, pos: int) -> str:
    """The sentence (or line) of ``text`` holding position ``pos``."""
    starts = [m.end() for m in re.finditer(r"[.!?](?=\s)|\n", text[:pos])]
    end = re.search(r"[.!?](?=\s|$)|\n", text[pos:])
    return text[(starts[-1] if starts else 0):(pos + end.start() if end else len(text))]


def _comparison_holds(sentence: str, question: str | None) -> bool:
    """False when a "than"/"compared to" sentence cannot be read as choosing its subject: the comparison's
    clause is negated ("is not closer than"), or, given the question, it uses a comparative the question does not
    ("farther" for "Which is closer?"). True for sentences with no comparison."""
    m = _COMPARISON.search(sentence)
    if not m:
        return True
    if _COMPARISON_NEGATION.search(re.split(r"[,;:]", sentence[:m.start()])[-1]):
        return False
    asked, said = _comparatives(question), _comparatives(sentence)
    return not (asked and said and not asked & said)


def _option_text_match(text: str, options: dict[str, str], question: str | None = None) -> str | None:
    """The one option whose text appears as the answer, else None.

    Mentions after "not", "than", "instead of", "compared to" ... name an option as not the answer, so
    "The bike is closer to the tree than the car." reads the bike; an option named only that way is not
    read ("It is not blue." -> None). A "than"/"compared to" sentence must pass :func:`_comparison_holds`.
    """
    free = [(s, e, key) for s, e, key in option_spans(text, options) if not governed(text, s)]
    keys = {key for _, _, key in free}
    if len(keys) != 1:
        return None
    if not all(_comparison_holds(_sentence_around(text, s), question) for s, _, _ in free):
        return None
    return keys.pop()


_LONE_LETTER = re.compile(r"\s*[(\[]?([A-Za-z])[)\]]?[.:]?\s*")
_LEADING_ARTICLE = re.compile(r"^(?:a|an|the)\s+")


def _bare(text) -> str:
    """Lower case, single spaces, without surrounding whitespace, quotes, brackets or punctuation."""
    return re.sub(r"\s+", " ", str(text)).strip().lower().strip(string.punctuation + "\u201c\u201d\u2018\u2019 ")


def _bare_option(text: str, options: dict[str, str], keys) -> str | None:
    """The option whose text the whole reply is, else None.

    The reply and the option text are compared in lower case, without surrounding whitespace, quotes,
    brackets or punctuation (so a trailing period does not count): "Beach." is option "A beach." only
    when no option's text is "Beach" itself, since a leading article ("a", "an", "the") is dropped from
    both only when nothing matches with it. Two options with that same text give None. A reply that is
    one option letter alone ("C", "(C)", "C.") is left to the letter rules, even when another option's
    text is that letter ("Which letter is on the sign?" with option B "C": "(C)" stays option C).
    """
    lone = _LONE_LETTER.fullmatch(text)
    if lone and lone.group(1).upper() in keys:
        return None
    reply = _bare(text)
    for strip in (False, True):
        norm = (lambda t: _LEADING_ARTICLE.sub("", t)) if strip else (lambda t: t)
        hits = {key for key, value in options.items() if norm(reply) and norm(_bare(value)) == norm(reply)}
        if hits:
            return hits.pop() if len(hits) == 1 else None
    return None


def parse_choice(reply: str, options: dict[str, str], question: str | None = None) -> str | None:
    """The option letter a reply chooses, as one of ``options``' keys, or None when unparsed.

    Only the text after any think block is read, and only the last ``<answer>...</answer>`` body when
    there is one. Order: a reply that is exactly one option's text (:func:`_bare_option`: "Beach" for "A
    beach."); else the last explicit answer ("the answer is (C)", "Answer: c", "**C**", "C is correct", a reply
    opening with "(b)", "b.", "C)", "C:", a lone letter, or a last line holding only a letter), unless an
    elimination's pick comes after it (:func:`elimination_pick`: "(A) is wrong since ..., which leaves B.");
    else, unless the reply refuses, the one option letter a sentence chooses ("I think it's B.", "I'd go
    with C.", "Because of the orange leaves, B."); else the single option whose text appears as the answer
    (number words match digits; "than the car" / "not the car" do not count). An option whose text is one
    word ("Go", "Yes") does not win when the reply also names another option's letter. Letters outside
    the option keys are ignored; a hedge between two letters ("A or B", "either B or C", "which leaves B or
    C") and a refusal give None. ``question``, when given, lets a comparison ("The car is farther than the
    bike.") that does not answer the question's comparative ("Which is closer?") stay unparsed.
    """
    keys = {str(k).strip("() ").upper(): k for k in options}
    text = clean(reply)
    bare = _bare_option(text, options, keys)
    if bare is not None:
        return bare
    explicit = [(pos, letter.upper(), end) for pos, letter, end in _explicit_letters(text) if letter.upper() in keys]
    pick = elimination_pick(text, options, keys)
    if pick and (not explicit or pick[0] > explicit[-1][0]):
        return pick[1]
    if explicit:
        _, letter, end = explicit[-1]
        hedge = _HEDGE.match(text[end:])
        other = hedge and (hedge.group(1) or hedge.group(2)).upper()
        if other and other in keys and other != letter:
            return None
        return keys[letter]
    if REFUSAL.search(text) and not any(REFUSAL.search(str(v)) for v in options.values()):
        return None
    letter = _sentence_letter(text, keys, options)
    if letter:
        return keys[letter]
    key = _option_text_match(text, options, question)
    one_word = key is not None and len(str(options[key]).split()) == 1
    if one_word and any(letter in keys and keys[letter] != key for _, _, letter in letter_words(text)):
        return None
    return key
