"""Answer parsing for the evaluation benchmarks, and the options of a question's text.

A shared package, not evaluation code: eval.py grades with it (`opd.eval.evaluate`), OPOD's task reward reads its
responses with it (`opd.methods.opod.task_reward`), the toy world's probes too. One module per answer kind:

* `opd.answers.text`: the shared cleaning (think blocks, the ``<answer>`` body, marked letters, refusals, number
  words, SQuAD-style normalisation);
* `opd.answers.choice`: multiple-choice letters (`parse_choice`), over `opd.answers.mentions` (where a reply names
  an option, by letter or by text) and `opd.answers.elimination` (the pick that ends an elimination);
* `opd.answers.yes_no`: yes/no replies, POPE (`parse_yes_no`);
* `opd.answers.free_form`: free-form answers (`exact_match`, `free_form_match`);
* `opd.answers.grade`: one benchmark item's record, with the parser of its kind (`grade`);
* `opd.answers.options`: a question's written options (`split_options`, `clean_question`).

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
conservative rule-based fallback (`opd.answers.free_form.free_form_match`) that reads the answer out of one short,
unhedged sentence; the paper judged the remaining ones with an LLM (:mod:`opd.eval.judge`), which this
package does not do.
"""
