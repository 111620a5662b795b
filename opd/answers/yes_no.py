"""Yes/no replies (POPE): `parse_yes_no`, "yes", "no" or None when unparsed.

A reply that opens with yes/no or states "the answer is yes/no" decides; else, when the question names the object it
asks about ("Is there a dog in the image?"), the statements about that object only ("There's no dog, just a cat." ->
no); else the presence statements of the whole reply ("there is", "is visible", "I see", "the image shows") and their
negations ("there is no", "I can't see", "No bench is visible").
"""

from __future__ import annotations

import re

from opd.answers.text import REFUSAL, clean

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
        if mentioned and (_UNSURE.search(sentence) or REFUSAL.search(sentence)):
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
    text = _NO_DOUBT.sub("without doubt", clean(reply).lstrip("\"'([ ").replace("\u2019", "'"))
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
        if found and (_UNSURE.search(sentence) or REFUSAL.search(sentence)):
            return None
        polarities |= found
    if polarities:
        return polarities.pop() if len(polarities) == 1 else None
    has_yes, has_no = "yes" in words, "no" in words
    if has_yes != has_no:
        return "yes" if has_yes else "no"
    return None
