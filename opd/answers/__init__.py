"""Answer parsing for the evaluation benchmarks, and the options of a question's text.

A shared package, not evaluation code: eval.py grades with it (`opd.eval.evaluate`), OPOD's task reward reads its
responses with it (`opd.methods.opod.task_reward`), the toy world's probes too. One module per answer kind:
`opd.answers.text` (shared cleaning), `choice` (over `mentions` and `elimination`), `yes_no` (POPE), `free_form`,
`grade` (one benchmark item's record) and `options` (a question's written options).

The paper (Appendix B.2) scores with "benchmark-native option or exact-answer parsing"; public toolkits get a few
cases wrong (the first capital letter of a reply, the article "A" read as option A, "Yes." failing an exact match,
eliminations, POPE denials with a contrast, ...), and those decide points on small benchmarks. An unparsed reply is
``None`` and scores as wrong; free-form answers are compared after SQuAD-style normalisation, else by a conservative
rule-based fallback; the paper's LLM judge (:mod:`opd.eval.judge`) is not done here.
Details (the cases and the rules): docs/MODULES.md#opdanswers.
"""
