"""Answer parsing, including the cases public toolkits get wrong (reference-facts: Benchmarks)."""

import re

import pytest

from opd.answers.choice import parse_choice
from opd.answers.free_form import exact_match, free_form_match
from opd.answers.grade import grade
from opd.answers.text import normalize_answer, strip_thinking
from opd.answers.yes_no import parse_yes_no
from opd.eval.bench_items import BenchItem

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


# ------------------------------------------------------------ issue 29: elimination

SCENES = {"A": "A beach.", "B": "A forest.", "C": "A city.", "D": "A desert."}  # MMStar: "Options: A: A beach., ..."


@pytest.mark.parametrize(
    "reply, options, expected",
    [
        # by letter: ruled out, then the pick ("which leaves", "that leaves", "leaving", "so", "must be", ...)
        ("C can't be it since the car is blue, which leaves B.", COLORS, "B"),
        ("(A) is wrong since the car is blue, which leaves (B).", COLORS, "B"),  # not the first letter named
        ("A, the red one, is out; that leaves B.", COLORS, "B"),  # not the leading "A,"
        ("A: no. B: no. That leaves C.", COLORS, "C"),
        ("It rules out A and C, so B.", COLORS, "B"),
        ("It's not A or C, so it must be B.", COLORS, "B"),
        ("A and C are wrong. So B.", COLORS, "B"),
        ("Not A, not B, not C, so D.", COLORS, "D"),
        ("I'd rule out A and B, so D.", SIGNS, "D"),
        ("A is wrong and C is wrong, so B is the only one left.", COLORS, "B"),
        ("Since A and C are wrong, B must be correct.", COLORS, "B"),
        ("By elimination, B.", COLORS, "B"),
        ("Neither A nor C fits; what's left is B.", COLORS, "B"),
        ("After ruling out A and C, only B remains.", COLORS, "B"),
        ("A is wrong, leaving B, since C is too bright.", COLORS, "B"),  # a reason after the pick
        ("Option A can't be it because the car is blue, which leaves option C.", COLORS, "C"),
        # by option text
        ("Red is ruled out, which leaves blue.", COLORS, "B"),
        ("Green and red are both ruled out, leaving blue.", COLORS, "B"),
        ("A is out. The only one left is the blue one.", COLORS, "B"),
        ("A and D are too dark and C is too bright; by elimination it's blue.", COLORS, "B"),
        ("Dark red can't be it, which leaves red.", COLORS, "A"),  # "red" inside "dark red" is not a pick
        ("Red can't be it, which leaves the dark red.", COLORS, "D"),
        ("It can't be the bike, since it is far away, which leaves the car.", OBJECTS, "B"),
        ("It's not a beach or a forest, so it must be a city.", SCENES, "C"),
        ("There is no sand, so it isn't a beach; the only option left is a city.", SCENES, "C"),
        ("Stop and Wait are ruled out, leaving Go.", SIGNS, "D"),
        ("Since there's no arrow, Turn left is out, leaving Stop.", SIGNS, "A"),
        # a later explicit answer still wins
        ("A can't be it since the car is blue, which leaves B. Answer: C", COLORS, "C"),
    ],
)
def test_parse_choice_elimination_then_a_choice(reply, options, expected):
    assert parse_choice(reply, options) == expected


@pytest.mark.parametrize(
    "reply",
    [
        "A can't be it, which leaves B or C.",  # a hedge between the two left
        "A is wrong, which leaves B and C.",
        "It's not A, which leaves B, C or D.",
        "Red is ruled out, leaving blue or green.",
        "A and B are wrong; so either C or D.",
        "A is wrong, which leaves B. But maybe C.",  # another option named after the pick
        "(A) is wrong, which leaves B. But maybe C.",  # ... and the leading "(A)" does not come back
        "A is out, so I'm not sure.",  # nothing picked
        "It's not A.",  # ruling out alone
        "A is out.",
        "Well, it isn't A. Hmm.",
        "<think>A can't be it, which leaves B",  # cut off while thinking
        "A is red and B is blue, so B.",  # "so" without anything ruled out: two letters named
    ],
)
def test_parse_choice_elimination_near_misses_stay_unparsed(reply):
    assert parse_choice(reply, COLORS) is None


def test_parse_choice_elimination_letter_that_is_also_an_option_text():
    # "C" is option C's letter and option B's text: the pick may mean either
    assert parse_choice("X is wrong, which leaves C.", LETTERS_AS_TEXT) is None
    assert parse_choice("X is wrong, which leaves Q.", LETTERS_AS_TEXT) == "C"


# ------------------------------------------------------------ issue 29: one option's text


@pytest.mark.parametrize(
    "reply, options, expected",
    [
        ("Beach", SCENES, "A"),  # the option's article dropped
        ("beach.", SCENES, "A"),
        ("The city.", SCENES, "C"),  # another article
        ("City", SCENES, "C"),
        ("**Forest**", SCENES, "B"),
        ("<think>sand, no trees</think>Desert.", SCENES, "D"),
        ("a desert", SCENES, "D"),
        ('"A city."', SCENES, "C"),
        ("  Wait!  ", SIGNS, "B"),
        ("turn left.", SIGNS, "C"),
        ("Section A", {"A": "Section B", "B": "Section A"}, "B"),  # not the letter inside the text
        ("section b.", {"A": "Section B", "B": "Section A"}, "A"),
        ("C. elegans", {"A": "E. coli", "B": "C. elegans", "C": "yeast"}, "B"),  # not the leading "C."
        ("Dog.", {"A": "a dog", "B": "a cat"}, "A"),
        ("the cat", {"A": "cat", "B": "the cat"}, "B"),  # an exact text beats one that matches without its article
        ("A, B and C", {"A": "A and B", "B": "B only", "C": "C only", "D": "A, B and C"}, "D"),  # not a hedge
        ("Not sure", {"A": "Yes", "B": "No", "C": "Not sure"}, "C"),  # not a refusal: an option
        ("Q", LETTERS_AS_TEXT, "C"),
    ],
)
def test_parse_choice_reply_that_is_one_option_text(reply, options, expected):
    assert parse_choice(reply, options) == expected


@pytest.mark.parametrize(
    "reply, options",
    [
        ("Cat", {"A": "a cat", "B": "the cat"}),  # two options with that text
        ("Beach or forest", SCENES),
        ("<think>Beach", SCENES),  # cut off while thinking
        ("Beaches", SCENES),
        ("A city or a desert.", SCENES),
    ],
)
def test_parse_choice_one_option_text_near_misses(reply, options):
    assert parse_choice(reply, options) is None


def test_parse_choice_lone_letter_stays_a_letter_when_it_is_also_an_option_text():
    assert parse_choice("C", LETTERS_AS_TEXT) == "C"  # the prompt asks for a letter
    assert parse_choice("(C)", LETTERS_AS_TEXT) == "C"
    assert parse_choice("C.", LETTERS_AS_TEXT) == "C"


@pytest.mark.parametrize("name", ["vstar", "zoombench", "hrbench4k", "mmvp", "cvbench", "mmstar"])
def test_grade_reads_the_bare_option_text_in_every_multiple_choice_benchmark(tmp_path, name):
    from bench_fixtures import write_all_fixtures

    from opd.eval.benchmarks import load_benchmark

    write_all_fixtures(tmp_path)
    items = [item for item in load_benchmark(name, tmp_path) if item.kind == "choice"]
    assert items
    for item in items:
        text = item.options[item.answer]
        bare = re.sub(r"^(?:a|an|the)\s+", "", text, flags=re.IGNORECASE).rstrip(".")
        for reply in (text, text.lower() + ".", bare, bare.upper()):
            assert grade(item, reply)["pred"] == item.answer, (name, item.index, reply)


def test_grade_reads_the_bare_option_text_in_mmstar_parquet(tmp_path):
    pytest.importorskip("pyarrow")
    from bench_fixtures import write_mmstar_fixture

    from opd.eval.benchmarks import load_benchmark

    write_mmstar_fixture(tmp_path, fmt="parquet")  # options inline: "Options: A: A beach., B: A forest., ..."
    items = {item.index: item for item in load_benchmark("mmstar", tmp_path)}
    assert items["0"].options["C"] == "A city."
    assert [grade(items["0"], r)["pred"] for r in ("A city.", "City", "the city", "A beach")] == ["C", "C", "C", "A"]
    assert grade(items["1"], "1")["pred"] == "A" and grade(items["2"], "8.")["pred"] == "D"


# ------------------------------------------------------------ issue 29: existence, contrast


def _asked(obj: str) -> str:
    return f"Is there a {obj} in the image?"  # POPE's question form


@pytest.mark.parametrize(
    "reply, obj, expected",
    [
        # a negation scoped to the asked object decides, whatever else is affirmed
        ("I don't see a car; there is a truck.", "car", "no"),
        ("There's no dog, just a cat.", "dog", "no"),
        ("There is no dog in the image, but there is a cat.", "dog", "no"),
        ("No dog here, only a cat.", "dog", "no"),
        ("There isn't a dog, but I can see a cat.", "dog", "no"),
        ("There is not a dog but a cat in the image.", "dog", "no"),
        ("Instead of a dog, there is a cat.", "dog", "no"),
        ("Rather than a dog, I see a cat.", "dog", "no"),
        ("The image shows a cat, not a dog.", "dog", "no"),
        ("I see a cat but no dog.", "dog", "no"),
        ("The image shows a park. There is no dog.", "dog", "no"),
        ("There is no dining table, only a desk.", "dining table", "no"),
        ("There are no traffic lights, only street signs.", "traffic light", "no"),
        ("There are no people, just a dog.", "person", "no"),
        ("A man who isn't wearing a hat is visible.", "hat", "no"),
        ("There is a table with no chairs.", "chair", "no"),
        ("Is there a dog? There's no dog, only a cat.", "dog", "no"),
        ("There is no hot dog, just a sandwich.", "hot dog", "no"),
        # the asked object affirmed while another is denied
        ("Yes, there is a dog, but no cat.", "dog", "yes"),
        ("There is a dog, but no cat.", "dog", "yes"),
        ("There is a bench, but no dog.", "bench", "yes"),
        ("The image shows a cat, not a dog.", "cat", "yes"),
        ("I see a cat but no dog.", "cat", "yes"),
        ("There is a table with no chairs.", "table", "yes"),
        ("No cats here, only a dog.", "dog", "yes"),  # "No" as a determiner, not the answer
        ("No cats, but a dog.", "dog", "yes"),
        ("There is a dog that is not sleeping.", "dog", "yes"),
        # unchanged: an answer word, or nothing said about the object
        ("No, there is only a cat.", "dog", "no"),
        ("No.", "dog", "no"),
        ("No cats here.", "dog", "no"),
        ("There is a man walking.", "person", "yes"),  # a synonym is no mention: the old presence rule reads it
    ],
)
def test_parse_yes_no_reads_the_asked_object(reply, obj, expected):
    assert parse_yes_no(reply, _asked(obj)) == expected


@pytest.mark.parametrize(
    "reply, obj",
    [
        ("There might be a dog, but there is definitely a cat.", "dog"),  # unsure about the asked object
        ("There is no dog, though there might be a cat.", "dog"),  # its sentence is unsure
        ("It's hard to tell if there is a dog, but there is a cat.", "dog"),
        ("There is no hot dog, just a dog.", "dog"),  # the asked object denied and affirmed
        ("There is a dog. Wait, there is no dog.", "dog"),
        ("No dog, but a dog.", "dog"),
        ("<think>There is no dog", "dog"),  # cut off while thinking
        ("There is a bench, but no dog.", "cat"),  # "no X" asked about Y, with other wording: as without the question
        ("I don't see a car; there is a truck.", "bus"),
    ],
)
def test_parse_yes_no_asked_object_near_misses_stay_unparsed(reply, obj):
    assert parse_yes_no(reply, _asked(obj)) is None


@pytest.mark.parametrize(
    "question, reply, expected",
    [
        ("Are there any traffic lights?", "There is no traffic light, only a stop sign.", "no"),
        ("Does the image contain a cup?", "I see no cup; there is a glass.", "no"),
        ("Can you see a bench in the picture?", "There is no bench, just a chair.", "no"),
        ("Is a bench visible in the picture?", "No chairs, only a bench.", "yes"),
        ("Is the door open?", "There is a door, but no handle.", None),  # no asked object: the old rules
        (None, "There is no dog in the image, but there is a cat.", None),
    ],
)
def test_parse_yes_no_question_forms(question, reply, expected):
    assert parse_yes_no(reply, question) == expected


def test_grade_passes_the_question_to_yes_no():
    item = BenchItem("pope", "1", _asked("car"), {}, "no", "yesno", "adversarial", lambda: None)
    assert grade(item, "I don't see a car; there is a truck.")["pred"] == "no"
    assert grade(item, "I don't see a car; there is a truck.")["correct"] is True
    yes_item = BenchItem("pope", "2", _asked("dog"), {}, "yes", "yesno", "random", lambda: None)
    assert grade(yes_item, "Yes, there is a dog, but no cat.")["pred"] == "yes"
    assert grade(yes_item, "There is a dog, but no cat.")["correct"] is True


# ------------------------------------------------------------ issue 29: free-form in a sentence


@pytest.mark.parametrize(
    "reply, gold, question",
    [
        # a count stated in a sentence, as digits or words
        ("There are 3 birds on the wire.", "3", "How many birds are on the wire?"),
        ("There are three birds on the wire.", "3", "How many birds are on the wire?"),
        ("I count 3 birds.", "3", "How many birds?"),
        ("3 birds.", "3", "How many birds?"),
        ("The wire has twenty-five birds on it.", "25", "How many birds?"),
        ("There is only one bird.", "1", "How many birds?"),
        ("There are 3.", "three", None),
        ("The answer is 3 birds.", "3", "How many birds?"),
        # a sign's text, quoted or after "says" / "reads" / "shows"
        ('The sign says "STOP".', "STOP", "What does the sign say?"),
        ("The sign says STOP.", "stop", "What does the sign say?"),
        ("It reads 'EXIT'.", "Exit", "What word is on the sign?"),
        ("The word on the sign is EXIT.", "EXIT", "What is written on the sign?"),
        ("The sign shows the word EXIT.", "exit", "What is written on the sign?"),
        ("The clock shows 3:15.", "3:15", "What time does the clock show?"),
        # a colour
        ("The car is red.", "red", "What color is the car?"),
        ("It's red.", "Red", "What colour is the car?"),
        ("The car is red in color.", "red", "What color is the car?"),
        ("It looks like the car is red.", "red", "What color is the car?"),
        ("The man is wearing a red shirt.", "red", "What color is the man's shirt?"),
        ("Red car.", "red", "What color is the car?"),
        # a name
        ("The shop is called Luigi's.", "Luigi's", "What is the name of the shop?"),
        ("The name of the shop is Luigi's.", "Luigi's", "What is the name of the shop?"),
        ("The shop's name is Luigi's.", "luigi's", "What is the name of the shop?"),
        ("It is named Luigi's.", "Luigi's", None),
        ("<think>The awning says Luigi's.</think>The shop is called Luigi's.", "Luigi's", "What is the shop called?"),
    ],
)
def test_free_form_match_reads_the_answer_in_a_short_sentence(reply, gold, question):
    assert free_form_match(reply, gold, question) is True
    assert exact_match(reply, gold) is False  # the strict match (opd.methods.opod's task reward) stays strict


@pytest.mark.parametrize(
    "reply, gold, question",
    [
        # several numbers, qualified or negated counts, a number inside another
        ("There are 3 birds and 2 cats.", "3", "How many birds?"),
        ("There are 3 birds on the 2 wires.", "3", "How many birds?"),
        ("There are about 3 birds.", "3", "How many birds?"),
        ("There are 3 or 4 birds.", "3", "How many birds?"),
        ("There are at least 3 birds.", "3", "How many birds?"),
        ("There are not 3 birds.", "3", "How many birds?"),
        ("There are 13 birds.", "3", "How many birds?"),
        ("The red one has 3 legs.", "3", "How many legs?"),  # "one" may be a count: two numbers
        ("I see 3 birds. Two more are flying.", "3", "How many birds?"),  # two sentences
        # hedges, several candidates, a subject the question does not ask about
        ("The car is red or orange.", "red", "What color is the car?"),
        ("The car might be red.", "red", "What color is the car?"),
        ("The car isn't red.", "red", "What color is the car?"),
        ("The car is in front of a red house.", "red", "What color is the car?"),
        ("The sky is red.", "red", "What color is the car?"),
        ("The car on the left is red.", "red", "What color is the car?"),
        ("The car is red and the truck is blue.", "red", "What color is the car?"),
        ("The car is red.", "red", None),  # no question to echo
        ('The signs say "STOP" and "GO".', "STOP", "What does the sign say?"),
        ("The sign says STOP in big letters.", "STOP", "What does the sign say?"),
        ("The sign does not say STOP.", "STOP", "What does the sign say?"),
        ("The shop is probably called Luigi's.", "Luigi's", "What is the name of the shop?"),
        ("The image shows a dog.", "dog", "What animal is on the sign?"),
        ("<think>There are 3 birds", "3", "How many birds?"),  # cut off while thinking
        ("Looking at the picture closely, I can tell you that there are exactly 3 small birds sitting together on "
         "the long electrical wire.", "3", "How many birds?"),  # a long reply
        ("There are 3 birds on the wire.", "4", "How many birds?"),  # a wrong count
    ],
)
def test_free_form_match_leaves_the_rest_to_the_judge(reply, gold, question):
    assert free_form_match(reply, gold, question) is False


def test_grade_open_answers_use_the_fallback_with_the_question():
    item = BenchItem("zoombench", "zb2", "How many birds are on the wire?", {}, "3", "open", "open", lambda: None)
    assert grade(item, "There are three birds on the wire.")["correct"] is True
    assert grade(item, "There are 3 birds and 2 cats.")["correct"] is False
    sign = BenchItem("zoombench", "zb3", "What word is written on the small sign?", {}, "Exit", "open", "open",
                     lambda: None)
    assert grade(sign, 'The small sign says "EXIT".')["correct"] is True
    assert grade(sign, "It might say EXIT.")["correct"] is False
