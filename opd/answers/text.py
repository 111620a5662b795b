"""The shared cleaning of a model's reply, for every parser of opd.answers.

The reply after its think blocks (`strip_thinking`) and only its last ``<answer>...</answer>`` body when it has one
(`final_part`); letters marked ``**X**`` or ``\\boxed{X}`` kept as marks (`clean`, read back by `MARKED`) while the
rest of the markdown goes; refusals ("cannot determine", "not sure": `REFUSAL`); the number words zero..twenty
(`NUMBER_WORDS`); and SQuAD-style normalisation (`normalize_answer`).
"""

from __future__ import annotations

import re
import string

_THINK_BLOCK = re.compile(r"<think>.*?</think>", re.IGNORECASE | re.DOTALL)
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.IGNORECASE | re.DOTALL)
_BOLD_LETTER = re.compile(r"\*\*\s*\(?([A-Za-z])\)?\s*[.:]?\s*\*\*")
_BOXED_LETTER = re.compile(r"\\boxed\{\s*\(?([A-Za-z])\)?\s*\}")
MARKED = re.compile(r"\u27e6([A-Za-z])\u27e7")  # letters marked by **X** or \boxed{X}


REFUSAL = re.compile(
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


def final_part(reply: str) -> str:
    """The reply after think blocks; only the last ``<answer>...</answer>`` body when there is one."""
    text = strip_thinking(reply)
    tagged = _ANSWER_TAG.findall(text)
    return tagged[-1].strip() if tagged else text


def clean(reply: str) -> str:
    text = final_part(reply)
    text = _BOXED_LETTER.sub(lambda m: f"\u27e6{m.group(1)}\u27e7", text)
    text = _BOLD_LETTER.sub(lambda m: f"\u27e6{m.group(1)}\u27e7", text)
    return text.replace("**", "").replace("__", "").replace("`", "").strip()


NUMBER_WORDS = {
    w: str(i)
    for i, w in enumerate(
        "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
        "fifteen sixteen seventeen eighteen nineteen twenty".split()
    )
}


def normalize_answer(text) -> str:
    """SQuAD-style normalisation: lower case, no punctuation, no articles, single spaces;
    number words zero..twenty become digits."""
    text = str(text).lower()
    text = "".join(" " if ch in string.punctuation else ch for ch in text)
    words = [NUMBER_WORDS.get(w, w) for w in text.split() if w not in ("a", "an", "the")]
    return " ".join(words)
