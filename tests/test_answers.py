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


SIGNS = {"A": "Stop", "B": "Wait", "C": "Turn left", "D": "Go"}  # one option is the ordinary word "Go"
COUNTS = {"A": "2", "B": "3", "C": "4", "D": "5"}  # CV-Bench-style counting options
SPELLED = {"A": "one", "B": "two", "C": "three"}
OBJECTS = {"A": "bike", "B": "car"}
TEN = {k: f"option {k.lower()}" for k in "ABCDEFGHIJ"}  # keys up to J, so "I" is an option letter


@pytest.mark.parametrize(
    "reply, expected",
    [
        # one option letter, chosen by a verb or ending a sentence, with no answer keyword
        ("I think it's B.", "B"),
        ("I would choose B.", "B"),
        ("It's B.", "B"),
        ("Because of the orange leaves, B.", "B"),
        ("I'd say D", "D"),
        ("Based on the colors, I'm going with C.", "C"),
        ("That would be option D.", "D"),
        ("My pick: C", "C"),
        ("Probably B, since the sky is clear.", "B"),
        ("It is C because the leaves are green.", "C"),
        ("I'd say 'B'.", "B"),
        ("I would pick (c).", "C"),  # a bracketed letter may be lower case
        ("Definitely C.\nThe leaves are green.", "C"),
        ("A dog is sitting, so I'd choose B.", "B"),  # the article "A" is not a second letter
        ("I would say A because the car is red.", "A"),  # "A because": the letter, not the article
        ("It's B, not C.", "B"),  # C is named as not the answer
        ("I'd pick C instead of B.", "C"),
        ("It's blue, so C.", "C"),  # the chosen letter beats the option text
        # stay unparsed: hedges, two letters, negations, questions, articles, no choosing position
        ("either B or C", None),
        ("It could be B or C.", None),
        ("I'd go with B or C.", None),
        ("A is red and B is blue, so B.", None),  # two letters named
        ("It's not B.", None),
        ("Is it B?", None),
        ("The leaf in panel B is orange.", None),  # a letter that is not chosen
        ("It's A dog.", None),
        ("I cannot tell, but maybe B.", None),  # a refusal
        ("<think>I think it's B", None),  # cut off while thinking
        ("Vitamin B is important.", None),
        ("It's B/C.", None),
    ],
)
def test_parse_choice_letter_in_sentence(reply, expected):
    assert parse_choice(reply, COLORS) == expected


@pytest.mark.parametrize(
    "reply, options, expected",
    [
        ("I think it's B.", TEN, "B"),  # the pronoun "I" is not option I
        ("I would choose (I).", TEN, "I"),
        ("I think it's I.", TEN, "I"),
        ("I think it's C.", YES_NO, None),  # not one of the options
        ("It's B.", YES_NO, "B"),
        ("I think it's b.", COLORS, None),  # a bare lower-case letter inside a sentence is not read
    ],
)
def test_parse_choice_letter_in_sentence_other_options(reply, options, expected):
    assert parse_choice(reply, options) == expected


@pytest.mark.parametrize(
    "reply, expected",
    [
        ("I'd go with C.", "C"),  # not D ("Go")
        ("I'll go with B.", "B"),
        ("I'd go with Go.", "D"),  # "go with" is the verb; "Go" after it is the option
        ("Go.", "D"),
        ("I'd go for the option to turn left.", "C"),
        ("I would go with stop.", "A"),
        ("Go, B.", "B"),  # the letter ends the sentence: it is chosen
        ("The sign in panel B says go.", None),  # one-word option text, and another option's letter named
        ("B looks right; we can go now.", None),
        ("The sign says go, so A is best.", "A"),  # an explicit "A is best" wins
    ],
)
def test_parse_choice_option_word_vs_letter(reply, expected):
    assert parse_choice(reply, SIGNS) == expected


@pytest.mark.parametrize(
    "reply, options, expected",
    [
        ("Two", COUNTS, "A"),
        ("There are two chairs.", COUNTS, "A"),
        ("I count Five cars.", COUNTS, "D"),
        ("There are 3 chairs, not 2.", COUNTS, "B"),
        ("4", COUNTS, "C"),
        ("2", SPELLED, "B"),
        ("I count 3 apples.", SPELLED, "C"),
        ("There are two or three.", COUNTS, None),
        ("There are more than two chairs.", COUNTS, None),  # "than two" is not an answer
        ("About 2.5 metres.", COUNTS, None),  # "2" inside a decimal
        ("There are 12 chairs.", COUNTS, None),  # "2" inside "12"
    ],
)
def test_parse_choice_number_words(reply, options, expected):
    assert parse_choice(reply, options) == expected


@pytest.mark.parametrize(
    "reply, expected",
    [
        ("The bike is closer to the tree than the car.", "A"),
        ("The car is larger than the bike.", "B"),
        ("Compared to the car, the bike is closer.", "A"),
        ("The bike, not the car.", "A"),
        ("The bike rather than the car.", "A"),
        ("I'd say the car instead of the bike.", "B"),
        ("It isn't the car, it's the bike.", "A"),
        ("No, the bike is closer than the car.", "A"),
        # stay unparsed
        ("The bike and the car are equally close.", None),
        ("The bike is not closer than the car.", None),  # a negated comparison
        ("The bike is closer than the car, but the car is closer to the house.", None),
        ("It is not the bike.", None),  # the only option named is named as not the answer
        ("The tree is closer than the house.", None),
        ("The car isn't the closer one, the bike is.", None),  # "not" must come before the option it rejects
    ],
)
def test_parse_choice_comparison(reply, expected):
    assert parse_choice(reply, OBJECTS) == expected


@pytest.mark.parametrize(
    "reply, question, expected",
    [
        ("The bike is closer to the tree than the car.", "Which is closer to the tree, the bike or the car?", "A"),
        ("The bike is nearer to the camera than the car.", "Which object is closest to the camera?", "A"),
        ("The car is farther from the tree than the bike.", "Which is closer to the tree, the bike or the car?", None),
        ("The car is farther from the tree than the bike.", "Which is farther from the tree?", "B"),
        ("The car has more wheels than the bike.", "Which has more wheels?", "B"),
        ("The car has fewer wheels than the bike.", "Which has more wheels?", None),
    ],
)
def test_parse_choice_comparison_against_question(reply, question, expected):
    assert parse_choice(reply, OBJECTS, question=question) == expected


def test_parse_choice_single_option_text_rules():
    assert parse_choice("It is not blue.", COLORS) is None  # was read as B
    assert parse_choice("It is red, not blue.", COLORS) == "A"
    assert parse_choice("There is no red car; it is green.", COLORS) == "C"
    assert parse_choice("I think it's red rather than green.", COLORS) == "A"
    assert parse_choice("The car is red, and not dark red.", COLORS) == "A"


@pytest.mark.parametrize(
    "reply, expected",
    [
        # presence stated anywhere in a sentence reads yes
        ("There's a man standing next to the car.", "yes"),
        ("It looks like there is a bench.", "yes"),
        ("A wooden bench is visible", "yes"),
        ("A bench can be seen on the left.", "yes"),
        ("I can see a bench near the path.", "yes"),
        ("I see two benches.", "yes"),
        ("A bench appears in the background.", "yes"),
        ("A bench is present in the park.", "yes"),
        ("A dog is in the picture.", "yes"),
        ("It appears that there is a dog.", "yes"),
        ("There is a dog that is not sleeping.", "yes"),  # the negation is about sleeping
        ("A man who isn't wearing a hat is visible.", "yes"),
        ("Is there a dog? There is.", "yes"),  # a leading question is skipped
        # its negations read no
        ("There does not appear to be a bench.", "no"),
        ("No bench is visible.", "no"),
        ("A bench isn't visible.", "no"),
        ("I cannot see a bench.", "no"),
        ("The bench is not present in the image.", "no"),
        ("There are no benches in the picture.", "no"),
        ("I can see that there is no bench.", "no"),
        ("I don't think there is a dog.", "no"),
        ("It seems there's no dog.", "no"),
        ("Nothing like a dog appears in the image.", "no"),
        ("The dog is absent.", "no"),
        ("The picture has no dog.", "no"),
        ("Is there a dog? No.", "no"),
        ("Sorry, no.", "no"),
        ("Let me look. I see a kitchen. There is no dog. So the answer is no.", "no"),  # stated answer
        # both, or unsure: unparsed
        ("There is a bench, but no dog.", None),
        ("There is a table with no chairs.", None),
        ("The image shows a park. There is no dog.", None),
        ("It's hard to tell if there is a bench.", None),
        ("There might be a dog.", None),
        ("A dog might be visible.", None),
        ("I can't see clearly enough to tell.", None),
        ("Is there a dog?", None),
    ],
)
def test_parse_yes_no_presence(reply, expected):
    assert parse_yes_no(reply) == expected


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


def test_grade_passes_the_question_to_comparisons():
    item = BenchItem("t", "1", "Which object is closer to the camera, the bike or the car?", OBJECTS, "A",
                     "choice", "cat", lambda: None)
    assert grade(item, "The bike is closer to the camera than the car.")["pred"] == "A"
    assert grade(item, "The car is farther from the camera than the bike.")["parsed"] is False


@pytest.mark.parametrize(
    "reply, expected",
    [
        ("No doubt, there is a dog.", "yes"),  # "no doubt" affirms: the presence statement decides
        ("There is no doubt a dog is in the image.", "yes"),  # not "there is no ..."
        ("No doubt.", None),  # nothing else said: not a "no"
        ("No, there is no dog.", "no"),
        ("No doubt there is a cat, but there is no dog.", None),  # a presence and an absence
    ],
)
def test_parse_yes_no_no_doubt_is_not_no(reply, expected):
    assert parse_yes_no(reply) == expected


LETTERS_AS_TEXT = {"A": "X", "B": "C", "C": "Q", "D": "W"}  # "Which letter is on the sign?": option texts are letters


@pytest.mark.parametrize(
    "reply, options, expected",
    [
        # "C" is option C's letter and option B's text: a sentence naming it may mean either
        ("The letter on the sign is C.", LETTERS_AS_TEXT, None),
        ("I think it's C.", LETTERS_AS_TEXT, None),
        ("The answer is C.", LETTERS_AS_TEXT, "C"),  # an explicit answer statement names an option's letter
        ("(C)", LETTERS_AS_TEXT, "C"),
        ("The sign shows the letter Q.", LETTERS_AS_TEXT, "C"),  # Q is only a text: option C's
        ("I think it's W.", LETTERS_AS_TEXT, "D"),
        # option texts equal to their own letters: no ambiguity
        ("The letter on the sign is C.", {"A": "A", "B": "B", "C": "C", "D": "D"}, "C"),
    ],
)
def test_parse_choice_letter_that_is_also_an_option_text(reply, options, expected):
    assert parse_choice(reply, options) == expected


@pytest.mark.parametrize(
    "reply, expected",
    [
        # the one-word rule, kept on purpose: a one-word option text ("blue") does not win against a letter word
        # that names another option ("D"), even one a reader takes for a name ("Vitamin D"): which of the two
        # the reply answers is not certain from its words, as with "The sign in panel B says go."; unparsed
        ("Vitamin D is important, but the car is blue.", None),
        ("The car is blue.", "B"),  # without the letter word: the option text decides
        ("The car is dark red.", "D"),  # a two-word text is specific enough without the rule
    ],
)
def test_parse_choice_one_word_option_text_against_a_letter_word(reply, expected):
    assert parse_choice(reply, COLORS) == expected
