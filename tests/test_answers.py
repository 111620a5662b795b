"""Answer parsing, including the cases public toolkits get wrong (reference-facts: Benchmarks)."""

import pytest

from opd.eval.answers import exact_match, grade, normalize_answer, parse_choice, parse_yes_no, strip_thinking
from opd.eval.benchmarks import BenchItem

COLORS = {"A": "red", "B": "blue", "C": "green", "D": "dark red"}
YES_NO = {"A": "Yes", "B": "No"}  # MMVP-style options after loading "(a) Yes (b) No"
LOWER = {"a": "Left", "b": "Right"}  # keys as some files spell them


@pytest.mark.parametrize(
    "reply, expected",
    [
        # explicit final answers
        ("The answer is B", "B"),  # not "T" (first capital letter)
        ("The answer is (C).", "C"),
        ("Answer: C", "C"),
        ("answer: (c)", "C"),
        ("ANSWER: d", "D"),
        ("The correct option is B.", "B"),
        ("The final answer is \\boxed{C}", "C"),
        ("**C**", "C"),
        ("The answer is **B**.", "B"),
        ("**Answer:** A", "A"),
        ("B is correct.", "B"),
        ("A is the correct answer.", "A"),
        # letter forms at the start, and lone letters
        ("C", "C"),
        ("c", "C"),
        ("(b)", "B"),
        ("b.", "B"),
        ("C.", "C"),
        ("(C)", "C"),
        ("C)", "C"),
        ("C: green", "C"),
        ("A. red", "A"),
        ("(B) blue", "B"),  # option quoted back with its letter
        ("C, because the leaves are green.", "C"),
        ("  D\n", "D"),
        ("Option B", "B"),
        # reasoning that mentions other letters, then a final statement
        ("Option A is wrong. B is also wrong. Answer: C", "C"),
        ("A seems plausible, but looking closer the answer is D.", "D"),
        ("The answer is A. Wait, actually the answer is (b).", "B"),
        ("Looking at the image, A and B are unlikely.\n\nC", "C"),
        ("<think>A is red, B is blue, so maybe A.</think>The answer is C.", "C"),
        ("Let me look.</think>\n\nB", "B"),
        ("<think>The answer is A", None),  # cut off while thinking
        ("<answer>C</answer>", "C"),
        ("A looks red, B looks blue.\n<answer>(b)</answer>", "B"),
        # never the first capital letter, never the article "a"
        ("Because the car is blue.", "B"),  # via the option text "blue", not the "B" of "Because"
        ("Because of the lighting it is hard to say.", None),
        ("A dog is sitting on the mat.", None),
        ("A car is parked outside.", None),
        ("The answer is a dog.", None),
        ("There is a car in the image.", None),
        # option text when exactly one option's text appears
        ("green", "C"),
        ("The car is dark red.", "D"),  # "red" inside "dark red" does not count
        ("I think it's blue.", "B"),
        ("The car is red or blue.", None),
        ("The options are (A) red, (B) blue, (C) green and (D) dark red.", None),
        # letters outside the options, hedges, refusals
        ("The answer is E", None),
        ("E", None),
        ("A or B", None),
        ("The answer is A or B.", None),
        ("(A) or (B)", None),
        ("A, B and C are all possible.", None),
        ("I cannot determine the color from this image.", None),
        ("It is not possible to tell; it might be red.", None),
        ("", None),
    ],
)
def test_parse_choice(reply, expected):
    assert parse_choice(reply, COLORS) == expected


@pytest.mark.parametrize(
    "reply, options, expected",
    [
        ("Yes, the door is open.", YES_NO, "A"),
        ("No.", YES_NO, "B"),
        ("(a)", YES_NO, "A"),
        ("(b) No", YES_NO, "B"),
        ("The answer is yes.", YES_NO, "A"),
        ("(b)", LOWER, "b"),  # lower-case keys come back as given
        ("B", LOWER, "b"),
        ("Right.", LOWER, "b"),
        ("cannot be determined", {"A": "red", "B": "Cannot be determined"}, "B"),
    ],
)
def test_parse_choice_other_options(reply, options, expected):
    assert parse_choice(reply, options) == expected


@pytest.mark.parametrize(
    "reply, expected",
    [
        ("Yes.", "yes"),
        ("yes", "yes"),
        ("YES", "yes"),
        ("Yes, there is a dog in the image.", "yes"),
        ("yes, there is", "yes"),
        ("No, there is not.", "no"),
        ("No", "no"),
        ("no.", "no"),
        ("There is no dog in the image.", "no"),
        ("There isn't a dog.", "no"),
        ("There is a dog in the image.", "yes"),
        ("I don't see a dog.", "no"),
        ("The image shows a dog on a sofa.", "yes"),
        ("The answer is yes.", "yes"),
        ("Answer: No", "no"),
        ("<think>Maybe no.</think>Yes.", "yes"),
        ("**Yes**", "yes"),
        ("I looked carefully. <answer>No</answer>", "no"),
        ("I cannot determine that.", None),
        ("It is hard to say.", None),
        ("", None),
    ],
)
def test_parse_yes_no(reply, expected):
    assert parse_yes_no(reply) == expected


@pytest.mark.parametrize(
    "text, expected",
    [("The Red Car.", "red car"), ("  an   apple!", "apple"), ("Two", "2"), ("EXIT", "exit"), ("a, b; c", "b c")],
)
def test_normalize_answer(text, expected):
    assert normalize_answer(text) == expected


@pytest.mark.parametrize(
    "pred, gold, expected",
    [
        ("Exit", "EXIT", True),
        ("exit.", "Exit", True),
        ("The answer is: two", "2", True),
        ("Answer: the red car\nbecause ...", "red car", True),
        ("exits", "exit", False),
        ("", "", False),
        (None, "x", False),
    ],
)
def test_exact_match(pred, gold, expected):
    assert exact_match(pred, gold) is expected


def test_strip_thinking():
    assert strip_thinking("<think>\n\n</think>\n\nB") == "B"
    assert strip_thinking("<THINK>x</THINK> y <think>z</think>w").split() == ["y", "w"]


def _item(kind, answer, options=None):
    return BenchItem("t", "7", "q", options or {}, answer, kind, "cat", lambda: None, None, {"k": 1})


def test_grade_records():
    rec = grade(_item("choice", "B", COLORS), "The answer is B")
    assert rec == {"index": "7", "kind": "choice", "category": "cat", "meta": {"k": 1}, "answer": "B",
                   "reply": "The answer is B", "pred": "B", "parsed": True, "correct": True}
    assert grade(_item("choice", "B", COLORS), "A or B")["parsed"] is False
    assert grade(_item("yesno", "no"), "No, there is not.")["correct"] is True
    assert grade(_item("yesno", "no"), "Maybe.")["correct"] is False
    assert grade(_item("open", "Exit"), "exit")["correct"] is True
