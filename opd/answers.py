"""Answer parsing for the evaluation benchmarks, and the options of a question's text (`split_options`).

A shared module, not evaluation code: eval.py grades with it (`opd.eval.evaluate`), OPOD's task reward reads its
responses with it (`opd.methods.opod.task_reward`), the toy world's probes too.

The paper (Appendix B.2) scores with "benchmark-native option or exact-answer parsing". Public
toolkits get a few cases wrong, and those cases decide points on small benchmarks:

* taking the first capital letter of a reply ("Because ..." read as B, "The answer is B" read as T);
* reading the article "a"/"A" as option A ("A dog is sitting ..." is not an answer);
* POPE replies such as "Yes." failing an exact string match;
* a letter chosen inside a sentence without an answer keyword ("I think it's B.") read as unparsed;
* an option's text matched on an ordinary word ("I'd go with C." read as the option "Go");
* POPE replies that state presence ("It looks like there is a bench.", "A bench is visible");
* counting options written as digits while the reply spells the number ("Two" for "2"), or the reverse;
* a comparison that names a second option ("The bike is closer than the car.") read as a tie;
* a reply that rules options out and ends on its pick ("A can't be it since ..., which leaves B", "rules
  out A and C, so B", "Red is ruled out, which leaves blue.") read as unparsed or as the first letter named;
* a reply that is exactly one option's text ("Beach" for "A beach.", "Section A" for option B "Section A")
  read through a letter inside it or missed for its article;
* a POPE denial with a contrast ("There's no dog, just a cat", "I don't see a car; there is a truck")
  read as a tie between a "no" and a "yes": the statement about the asked object decides;
* a free-form answer stated in a short sentence ("There are 3 birds on the wire." for "3", 'The sign
  says "STOP".', "The car is red.") failing the exact match.

The rules here take a reply that is exactly one option's text as that option; else an explicit final
answer or, when it comes later, the pick that ends an elimination; else the one option letter that a
sentence chooses ("I'd go with B", "..., B."); else the option whose text is the only one that appears
as the answer (not after "not", "than", "instead of" ...); and otherwise report the reply as unparsed
(``None``), which scores as wrong. Yes/no replies are read against the asked object when the question
names one ("Is there a dog in the image?"). Free-form answers (ZoomBench open questions) are compared
after SQuAD-style normalisation (lower case, no punctuation, no articles, single spaces), and else by a
conservative rule-based fallback (:func:`free_form_match`) that reads the answer out of one short,
unhedged sentence; the paper judged the remaining ones with an LLM (:mod:`opd.eval.judge`), which this
module does not do.
"""

from __future__ import annotations

import re
import string

_THINK_BLOCK = re.compile(r"<think>.*?</think>", re.IGNORECASE | re.DOTALL)
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.IGNORECASE | re.DOTALL)
_BOLD_LETTER = re.compile(r"\*\*\s*\(?([A-Za-z])\)?\s*[.:]?\s*\*\*")
_BOXED_LETTER = re.compile(r"\\boxed\{\s*\(?([A-Za-z])\)?\s*\}")
_MARKED = re.compile(r"\u27e6([A-Za-z])\u27e7")  # letters marked by **X** or \boxed{X}
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
_REFUSAL = re.compile(
    r"\b(?:cannot|can't|can not|unable to|not able to|impossible to|not possible to)\s+(?:be\s+)?"
    r"(?:determine|determined|tell|say|answer|know|identify|decide)\b"
    r"|\bnot (?:enough|sufficient) information\b|\binsufficient information\b"
    r"|\bnone of the (?:options|above|choices)\b|\bnot sure\b",
    re.IGNORECASE,
)


def strip_thinking(reply: str) -> str:
    """Remove ``<think>...</think>`` blocks; text after a lone ``</think>`` is the answer.

    An unclosed ``<think>`` (a reply cut off while reasoning) drops everything after it.
    """
    text = _THINK_BLOCK.sub(" ", reply or "")
    if "</think>" in text.lower():
        text = re.split(r"</think>", text, flags=re.IGNORECASE)[-1]
    text = re.split(r"<think>", text, flags=re.IGNORECASE)[0]
    return text.strip()


def _final_part(reply: str) -> str:
    """The reply after think blocks; only the last ``<answer>...</answer>`` body when there is one."""
    text = strip_thinking(reply)
    tagged = _ANSWER_TAG.findall(text)
    return tagged[-1].strip() if tagged else text


def _clean(reply: str) -> str:
    text = _final_part(reply)
    text = _BOXED_LETTER.sub(lambda m: f"\u27e6{m.group(1)}\u27e7", text)
    text = _BOLD_LETTER.sub(lambda m: f"\u27e6{m.group(1)}\u27e7", text)
    return text.replace("**", "").replace("__", "").replace("`", "").strip()


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
    found += [(m.start(1), m.group(1), m.end(1) + 1) for m in _MARKED.finditer(text)]
    m = _LEADING.match(text)
    if m:
        group = next(g for g in range(1, 5) if m.group(g))
        found.append((m.start(group), m.group(group), m.end(group)))
    m = _TRAILING.search(text)
    if m:
        found.append((m.start(1), m.group(1), m.end(1)))
    return sorted(found)


_NUMBER_WORDS = {
    w: str(i)
    for i, w in enumerate(
        "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
        "fifteen sixteen seventeen eighteen nineteen twenty".split()
    )
}
_DIGIT_WORDS = {digit: word for word, digit in _NUMBER_WORDS.items()}

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


def _letter_words(text: str) -> list[tuple[int, int, str]]:
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


def _tail(text: str, end: int, limit: int = 80) -> str:
    """Up to ``limit`` characters of ``text`` before ``end``, on the same line, from a word start."""
    head = text[max(0, end - limit):end].split("\n")[-1]
    if end > limit and len(head) == limit:
        head = re.sub(r"^\S*", "", head)  # a word cut in half
    return head


def _governed(text: str, start: int) -> bool:
    """Whether the mention at ``start`` follows, in its clause, "not", "no", "n't", "than", "instead of",
    "compared to", "unlike" ... (with up to two or three words between): a mention named as *not* the answer."""
    head = re.split(r"[.!?;,:]", _tail(text, start))[-1]
    return bool(_GOVERNOR.search(" " + head))


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
    free = [(s, e, letter) for s, e, letter in _letter_words(text)
            if letter in keys and not _governed(text, s) and texts.get(letter, letter) == letter]  # fmt: skip
    if len({letter for _, _, letter in free}) != 1:
        return None
    for s, e, letter in free:
        if _CHOICE_CUE.search(_tail(text, s)) or _LETTER_END.match(text, e):
            return letter
    return None


def _number_alternatives(token: str) -> str | None:
    """A regex matching a number token both as a digit and as a word ("2" / "two"), else None."""
    low = token.lower()
    other = _NUMBER_WORDS.get(low) or _DIGIT_WORDS.get(low)
    return f"(?:{re.escape(low)}|{other})" if other else None


def _option_pattern(value) -> str | None:
    """A case-insensitive, word-bounded regex for an option's text; number tokens match as digits and words."""
    needle = re.sub(r"\s+", " ", str(value)).strip().rstrip(".").strip()
    if not needle:
        return None
    parts = [_number_alternatives(token) or re.escape(token) for token in needle.split(" ")]
    return r"(?<!\w)(?<!\d[.,])" + r"\s+".join(parts) + r"(?!\w)(?![.,]\d)"


def _option_spans(text: str, options: dict[str, str]) -> list[tuple[int, int, str]]:
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
    free = [(s, e, key) for s, e, key in _option_spans(text, options) if not _governed(text, s)]
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
    found = [(s, e, keys[letter]) for s, e, letter in _letter_words(text) if letter in keys and not _governed(text, s)]
    return found + [(s, e, key) for s, e, key in _option_spans(text, options) if not _governed(text, s)]


def _elimination_pick(text: str, options: dict[str, str], keys: dict) -> tuple[int, str | None] | None:
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


def parse_choice(reply: str, options: dict[str, str], question: str | None = None) -> str | None:
    """The option letter a reply chooses, as one of ``options``' keys, or None when unparsed.

    Only the text after any think block is read, and only the last ``<answer>...</answer>`` body when
    there is one. Order: a reply that is exactly one option's text (:func:`_bare_option`: "Beach" for "A
    beach."); else the last explicit answer ("the answer is (C)", "Answer: c", "**C**", "C is correct", a reply
    opening with "(b)", "b.", "C)", "C:", a lone letter, or a last line holding only a letter), unless an
    elimination's pick comes after it (:func:`_elimination_pick`: "(A) is wrong since ..., which leaves B.");
    else, unless the reply refuses, the one option letter a sentence chooses ("I think it's B.", "I'd go
    with C.", "Because of the orange leaves, B."); else the single option whose text appears as the answer
    (number words match digits; "than the car" / "not the car" do not count). An option whose text is one
    word ("Go", "Yes") does not win when the reply also names another option's letter. Letters outside
    the option keys are ignored; a hedge between two letters ("A or B", "either B or C", "which leaves B or
    C") and a refusal give None. ``question``, when given, lets a comparison ("The car is farther than the
    bike.") that does not answer the question's comparative ("Which is closer?") stay unparsed.
    """
    keys = {str(k).strip("() ").upper(): k for k in options}
    text = _clean(reply)
    bare = _bare_option(text, options, keys)
    if bare is not None:
        return bare
    explicit = [(pos, letter.upper(), end) for pos, letter, end in _explicit_letters(text) if letter.upper() in keys]
    pick = _elimination_pick(text, options, keys)
    if pick and (not explicit or pick[0] > explicit[-1][0]):
        return pick[1]
    if explicit:
        _, letter, end = explicit[-1]
        hedge = _HEDGE.match(text[end:])
        other = hedge and (hedge.group(1) or hedge.group(2)).upper()
        if other and other in keys and other != letter:
            return None
        return keys[letter]
    if _REFUSAL.search(text) and not any(_REFUSAL.search(str(v)) for v in options.values()):
        return None
    letter = _sentence_letter(text, keys, options)
    if letter:
        return keys[letter]
    key = _option_text_match(text, options, question)
    one_word = key is not None and len(str(options[key]).split()) == 1
    if one_word and any(letter in keys and keys[letter] != key for _, _, letter in _letter_words(text)):
        return None
    return key


_YES = {"yes", "yeah", "yep", "yup", "correct", "true"}
_NO_DOUBT = re.compile(r"\bno\s+doubt\b", re.IGNORECASE)  # affirms ("No doubt, there is a dog."): not a "no"
_NO = {"no", "nope", "nah", "incorrect", "false"}
_SENTENCE_SPLIT = re.compile(r"(?<=[.!?;])\s+|\n+")
_YES_NO_STATED = re.compile(r"\banswer\s*(?:is|would\s+be|:)\s*:?\s*[\"'(\[]?\s*(yes|no)\b", re.IGNORECASE)
_ANSWER_NO = re.compile(r"\bno\b(?=\s*(?:[,.!;:]|$))", re.IGNORECASE)  # "no" as an answer, not "no dog"
_REPORTED = r"(?!\s+(?:that|if|whether|how|what|why)\b)"  # "I see that ..." reports, it does not locate
# Statements of presence; each is read as "no" when negated ("there is no", "isn't visible", "I can't see").
_EXIST_CUE = re.compile(
    r"\bthere\s*(?:'s|'re|(?:is|are|was|were)(?:n't)?|exists?|(?:seems?|appears?)\s+to\s+be"
    r"|(?:does|do)(?:n't|\s+not)\s+(?:seem|appear)\s+to\s+be)\b"
    r"|\b(?:visible|observable|discernible|noticeable)\b"
    r"|\b(?:can|could)(?:not|n't|\s+not)?\s+(?:\w+ly\s+)?be\s+(?:seen|spotted|found|observed|noticed)\b"
    r"|\b(?:is|are|was|were)(?:n't|\s+not)?\s+(?:\w+ly\s+)?(?:present|seen|shown|depicted|pictured)\b"
    r"|\b(?:is|are)(?:n't|\s+not)?\s+(?:\w+\s+)?(?:in|inside)\s+(?:the|this)\s+(?:image|picture|photo|photograph|scene)\b"
    r"|\b(?:i|we|you)\s+(?:(?:can|could|do|did)(?:not|n't|\s+not)?\s+)?(?:\w+ly\s+|also\s+|still\s+)?"
    r"(?:see|spot|notice|observe|detect)\b" + _REPORTED +
    r"|\b(?:i|we|you)\s+(?:can|could|do|did)(?:not|n't|\s+not)\s+find\b"
    r"|\bappears?\s+(?:to\s+be\s+)?(?:in|on|at|near|behind|beside|inside|under|next\s+to)\b"
    r"|\b(?:image|picture|photo|photograph|scene)\s+(?:(?:does|do)(?:n't|\s+not)\s+|also\s+|clearly\s+)?"
    r"(?:shows?|contains?|has|have|depicts?|features?|includes?|displays?)\b" + _REPORTED,
    re.IGNORECASE,
)
_EXIST_NEG = re.compile(r"\babsent\b|\bnowhere\s+to\s+be\s+(?:seen|found)\b|\bno\s+(?:signs?|traces?)\s+of\b", re.IGNORECASE)
_NEG_WORD = re.compile(r"\b(?:no|not|never|none|nothing|nobody|neither|nor|cannot)\b|n't\b", re.IGNORECASE)
_NEG_SUBJECT = re.compile(r"\s*(?:no|neither|nothing|none|nobody|not\s+(?:a|an|any|one|even))\b", re.IGNORECASE)
_NEG_AFTER = re.compile(r"n't\b|\s+(?:\w+ly\s+)?(?:no|not|none|nothing|nobody|neither)\b", re.IGNORECASE)
# A second thing said to be absent in a presence statement: "a table with no chairs", "a dog, not a cat".
_OTHER_NEG = re.compile(r"\bno\s+(?!doubt\b)[a-z]|\bnot\s+(?:a|an|any)\s|\bnor\b", re.IGNORECASE)
_CLAUSE_SPLIT = re.compile(r"[,;:]|\b(?:but|however|although|though|while|whereas|and|yet)\b", re.IGNORECASE)
_UNSURE = re.compile(
    r"\b(?:unclear|uncertain|not\s+clear|ambiguous|hard\s+to\s+(?:tell|say)|difficult\s+to\s+(?:tell|say)"
    r"|no\s+way\s+to\s+(?:tell|know|say)|enough\s+to\s+(?:tell|say|know|determine|be\s+sure)|whether"
    r"|might|may|perhaps|possibly|maybe)\b",
    re.IGNORECASE,
)


def _clause_presence(clause: str) -> set[str]:
    """The polarities of the presence statements in one clause (see :func:`_presence`)."""
    found = set()
    if _EXIST_NEG.search(clause):
        found.add("no")
    for m in _EXIST_CUE.finditer(clause):
        near = " ".join(clause[:m.start()].split()[-3:]) + " " + m.group(0)
        negated = _NEG_SUBJECT.match(clause) or _NEG_WORD.search(near) or _NEG_AFTER.match(clause, m.end())
        found.add("no" if negated else "yes")
    return found


def _presence(sentence: str) -> set[str]:
    """The polarities ("yes"/"no") of the presence statements in one sentence; empty when it has none.

    Each statement ("there is", "is visible", "can be seen", "I see", "appears in", "is present", "the
    image shows") is "no" when it is negated: inside it or by one of the three words before it ("There
    isn't", "I can't see", "is not present", "I don't think there is"), by the word right after it ("There
    is no", "I see no"), or by its clause's subject ("No bench is visible", "Nothing ... appears"); a
    negation further back ("A man who isn't wearing a hat is visible") does not count. "absent" and "no
    sign of" are "no". A sentence with a statement that also says another thing is absent ("a table with no chairs",
    "a dog, not a cat") holds both.
    """
    found = set()
    for clause in _CLAUSE_SPLIT.split(sentence):
        found |= _clause_presence(clause)
    if found and _OTHER_NEG.search(sentence):
        found.add("no")
    return found


# The object a presence question asks about: "Is there a dog in the image?", "Are there any traffic lights?",
# "Does the image contain a cup?", "Can you see a bench?", "Is a bench visible in the picture?".
_ARTICLES = r"(?:(?:a|an|any|some|the)\s+)?"
_OBJECT = r"(?P<{}>[a-z][a-z'\-]*(?:\s+[a-z][a-z'\-]*){{0,2}}?)"
_OBJECT_END = (r"(?=\s+(?:in|on|at|inside|within|near|visible|present|shown|seen|pictured|depicted|here|there)\b"
               r"|\s*[?.]|\s*$)")
_ASKED = re.compile(
    r"\b(?:is|are)\s+there\s+" + _ARTICLES + _OBJECT.format("there") + _OBJECT_END
    + r"|\b(?:does|do)\s+(?:the|this)\s+(?:image|picture|photo|photograph|scene)\s+(?:contain|show|have|include|depict)"
    r"\s+" + _ARTICLES + _OBJECT.format("shows") + _OBJECT_END
    + r"|\b(?:can|do)\s+you\s+(?:see|spot|find)\s+" + _ARTICLES + _OBJECT.format("see") + _OBJECT_END
    + r"|^\s*(?:is|are)\s+" + _ARTICLES + _OBJECT.format("seen") + r"\s+(?:visible|present|shown|seen|pictured)\b",
    re.IGNORECASE,
)
_IRREGULAR = {"person": ("people", "persons"), "man": ("men",), "woman": ("women",), "child": ("children",),
              "mouse": ("mice",), "knife": ("knives",), "leaf": ("leaves",), "foot": ("feet",)}
# A negation scoped to the asked object: "no dog", "not a dog", "I don't see any dog", "without a dog",
# "instead of a dog", "rather than a dog" (up to three words between), in the object's own clause.
_OBJECT_NEG = re.compile(
    r"(?:\b(?:no|not|never|without|nor|neither|none\s+of|instead\s+of|rather\s+than|other\s+than)|n't)"
    r"(?:\s+[\w'-]+){0,3}\s+$",
    re.IGNORECASE,
)
# A mention affirmed by a contrast: "no cats, but a dog", "no cat here, only a dog", "just a dog".
_CONTRAST = re.compile(r"\b(?:but|however|only|just|merely|solely|instead|rather|whereas)\b", re.IGNORECASE)
# "No" as a determiner ("No cat here, only a dog."), not as an answer ("No, ...", "No there isn't", "No it's not").
_NO_DETERMINER = re.compile(
    r"\s*no\s+(?!(?:there|it|its|it's|i|i'm|the|this|that|they|we|you|not|sir|way|doubt|sorry)\b)[a-z]", re.IGNORECASE
)


def _asked_object(question: str | None) -> re.Pattern | None:
    """A regex for the object a presence question asks about, in singular and plural; else None.

    "Is there a dining table in the image?" matches "dining table(s)" and, when the reply never says the
    whole phrase, "table(s)" alone; "person" also matches "people". Other questions ("Is the door open?")
    name no asked object: None.
    """
    m = _ASKED.search(str(question or ""))
    if not m:
        return None
    words = next(g for g in m.groups() if g).lower().split()
    head = words[-1]
    forms = {head, head + "s", head + "es", *_IRREGULAR.get(head, ())}
    if head.endswith("y"):
        forms.add(head[:-1] + "ies")
    forms |= {head[:-1]} if head.endswith("s") and not head.endswith("ss") else set()
    forms |= {head[:-3] + "y"} if head.endswith("ies") else set()
    forms |= {v for k, vs in _IRREGULAR.items() if head in vs for v in (k, *vs)}
    tail = "(?:" + "|".join(sorted(map(re.escape, forms), key=len, reverse=True)) + ")"
    whole = r"\s+".join([*map(re.escape, words[:-1]), tail])
    return re.compile(rf"(?<![\w-])(?:{whole}(?![\w-])|(?P<head>{tail})(?![\w-]))", re.IGNORECASE)


def _object_polarity(sentences: list[str], asked: re.Pattern) -> str | None:
    """"yes"/"no" from the statements about the asked object only; "unsure", or None when there are none.

    Each clause (:data:`_CLAUSE_SPLIT`) of a sentence that mentions the object (the whole phrase when the
    reply has it anywhere, else its head noun) says: "no" when a negation is scoped to the mention ("There's
    no dog, just a cat", "I don't see a car; there is a truck", "not a dog but a cat"), else the polarity of
    its presence statements ("Yes, there is a dog, but no cat" asked about the dog: yes), else "yes" when a
    contrast affirms it ("No cats here, only a dog"). What the reply says of other things does not count.
    Statements of both kinds, or a sentence about the object that is unsure or refuses, give "unsure".
    """
    whole = any(m.group("head") is None for s in sentences for m in asked.finditer(s))
    found = set()
    for sentence in sentences:
        if sentence.endswith("?"):
            continue
        bounds = [0] + [x for m in _CLAUSE_SPLIT.finditer(sentence) for x in m.span()] + [len(sentence)]
        spans = list(zip(bounds[::2], bounds[1::2]))
        mentioned = False
        for i, (lo, hi) in enumerate(spans):
            clause = sentence[lo:hi]
            m = next((m for m in asked.finditer(clause) if not whole or m.group("head") is None), None)
            if m is None:
                continue
            mentioned, before = True, clause[:m.start()]
            joint = sentence[spans[i - 1][1]:lo] if i else ""
            if _OBJECT_NEG.search(" " + before):
                found.add("no")
            elif _clause_presence(clause):
                found |= _clause_presence(clause)
            elif _CONTRAST.search(joint + " " + before):
                found.add("yes")
        if mentioned and (_UNSURE.search(sentence) or _REFUSAL.search(sentence)):
            return "unsure"
    return (found.pop() if len(found) == 1 else "unsure") if found else None


def parse_yes_no(reply: str, question: str | None = None) -> str | None:
    """"yes", "no" or None for a yes/no question (POPE).

    The first statement (a leading question such as "Is there a dog?" is skipped) decides when it opens
    with yes/no ("Yes.", "No, there is not"); else the last "the answer is yes/no"; else a "yes" or an
    answering "no" ("..., so no.") in the first statement, of one kind only. Else, when ``question`` asks
    about an object ("Is there a dog in the image?"), the statements about that object (:func:`_object_polarity`):
    a negation scoped to it decides whatever else the reply affirms ("There's no dog, just a cat." -> no;
    "There is a dog, but no cat." -> yes); a reply opening with "No" as a determiner ("No cats here, only a
    dog.") is read this way too, and is "no" when it says nothing about the object. Else the presence
    statements of the whole reply (:func:`_presence`): all "yes" ("There's a man ...", "It looks like there
    is a bench.", "A wooden bench is visible") -> yes, all "no" ("There is no dog", "I don't see a dog") ->
    no, both -> None, and None when a sentence holding one is unsure or refuses ("hard to tell whether there
    is ..."). With none, a single kind of yes/no word in the first statement decides. Anything else is None.
    "No doubt" affirms and is no "no" ("No doubt, there is a dog." -> yes, from its presence statement).
    """
    text = _NO_DOUBT.sub("without doubt", _clean(reply).lstrip("\"'([ ").replace("\u2019", "'"))
    sentences = [s.strip() for s in _SENTENCE_SPLIT.split(text) if s.strip()]
    first_words = [re.findall(r"[a-z]+(?:'[a-z]+)*", s.lower()) for s in sentences]
    opening = next(
        (i for i, (s, w) in enumerate(zip(sentences, first_words)) if w and (not s.endswith("?") or w[0] in _YES | _NO)),
        None,
    )
    if opening is None:
        return None
    first, words = sentences[opening], first_words[opening]
    asked = _asked_object(question)
    scoped = _object_polarity(sentences, asked) if asked else None
    if words[0] in _YES:
        return "yes"
    if words[0] in _NO:
        determiner = words[0] == "no" and _NO_DETERMINER.match(first)
        if determiner and scoped is not None:
            return None if scoped == "unsure" else scoped
        return "no"
    stated = _YES_NO_STATED.findall(text)
    if stated:
        return stated[-1].lower()
    said_yes, said_no = "yes" in words, bool(_ANSWER_NO.search(first))
    if said_yes != said_no:
        return "yes" if said_yes else "no"
    if scoped is not None:
        return None if scoped == "unsure" else scoped
    polarities = set()
    for sentence in sentences:
        if sentence.endswith("?"):
            continue
        found = _presence(sentence)
        if found and (_UNSURE.search(sentence) or _REFUSAL.search(sentence)):
            return None
        polarities |= found
    if polarities:
        return polarities.pop() if len(polarities) == 1 else None
    has_yes, has_no = "yes" in words, "no" in words
    if has_yes != has_no:
        return "yes" if has_yes else "no"
    return None


_FINAL_ANSWER = re.compile(r"(?:final answer|answer)\s*(?:is|:)\s*", re.IGNORECASE)


def normalize_answer(text) -> str:
    """SQuAD-style normalisation: lower case, no punctuation, no articles, single spaces;
    number words zero..twenty become digits."""
    text = str(text).lower()
    text = "".join(" " if ch in string.punctuation else ch for ch in text)
    words = [_NUMBER_WORDS.get(w, w) for w in text.split() if w not in ("a", "an", "the")]
    return " ".join(words)


def exact_match(pred, gold) -> bool:
    """Free-form match after :func:`normalize_answer`.

    The prediction is the reply after any think block (or its last ``<answer>`` body); when it states
    "answer is X" / "Answer: X", the text after the last such statement (up to the end of its line) is
    compared. Empty never matches.
    """
    text = _final_part(str(pred if pred is not None else ""))
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
    r"|\b(?:" + "|".join(sorted(_NUMBER_WORDS, key=len, reverse=True)) + r")\b",
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
        return _TENS[parts[0]] + (float(_NUMBER_WORDS[parts[1]]) if len(parts) > 1 else 0.0)
    return float(_NUMBER_WORDS[low])


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
    text = _final_part(str(reply if reply is not None else "")).replace("**", "").replace("`", "").strip()
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
