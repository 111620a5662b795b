"""The teacher-supervision cost ledger (Appendix C; Tables 7 and 8).

`DIR/ledger.jsonl` holds one JSON object per training step with the fields the paper's cost tables need (|C|, K,
|S|, scored and candidate tokens, teacher and step seconds, overrun), and per teacher label its rows, tokens and
seconds; a resumed run first cuts the file back to its checkpoint's step. Departure: the paper's "Tokens vs. Full"
divides by a separate full-querying run's scored tokens, a single run's summary by the tokens of all its candidates.
Details: docs/MODULES.md#opdloopledger.
"""

import json
import os
from pathlib import Path

from opd.storage import write_atomic  # noqa: F401 (the run's summary files are written through it)

REQUIRED = ("step", "candidates", "budget", "selected", "scored_tokens", "teacher_forward_s", "step_s")


PHASES = ("prompt", "generation", "select", "teacher_forward", "student", "optimizer", "ema", "selector", "wait")
"""Table 8's breakdown: prompt encoding, rollout generation, selection, teacher forward, student
forward + backward, optimizer step, EMA, selector update, and waiting on other ranks (collectives)."""


def read_ledger(path: str | Path) -> list[dict]:
    """The ledger's rows; a torn last line (a run killed mid-write) is dropped."""
    rows = []
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    for j, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if j != len(lines) - 1:
                raise ValueError(f"{path}:{j + 1}: malformed ledger line") from None
    return rows


class Ledger:
    def __init__(self, path: str | Path, resume_step: int | None = None):
        """Opens DIR/ledger.jsonl; with resume_step, keeps only the rows of steps before it."""
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        rows = read_ledger(self.path) if self.path.exists() and resume_step is not None else []
        rows = [r for r in rows if r["step"] < (resume_step or 0)]
        write_atomic(self.path, "".join(json.dumps(r) + "\n" for r in rows))
        self.rows = rows

    def append(self, row: dict) -> None:
        missing = [k for k in REQUIRED if k not in row]
        if missing:
            raise ValueError(f"ledger row lacks {missing}")
        self.rows.append(row)
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())


def summarize(rows: list[dict]) -> dict:
    """Table 7 and Table 8 of the paper for one run: totals, ratios and time sums."""
    total = lambda key: sum(r.get(key, 0) for r in rows)  # noqa: E731
    candidates, calls = total("candidates"), total("selected")
    scored, cand_tokens = total("scored_tokens"), total("candidate_tokens")
    steps = len(rows)
    return {
        "steps": steps,
        "candidates": candidates,
        "calls": calls,
        "query_ratio": calls / candidates if candidates else 0.0,
        "scored_tokens": scored,
        "candidate_tokens": cand_tokens,
        "token_ratio": scored / cand_tokens if cand_tokens else 0.0,
        "max_overrun": max((r["selected"] - r["budget"] for r in rows), default=0) if rows else 0,
        "teacher_forward_s": total("teacher_forward_s"),
        "mean_teacher_s": total("teacher_forward_s") / steps if steps else 0.0,
        "mean_step_s": total("step_s") / steps if steps else 0.0,
        "step_s": total("step_s"),
        "teacher_tokens": total("teacher_tokens"),
        "teacher_padded_tokens": total("teacher_padded_tokens"),
        "teachers": {
            view: {"rows": total(f"teacher_rows_{view}"), "tokens": total(f"teacher_tokens_{view}"),
                   "forward_s": total(f"teacher_forward_s_{view}")}
            for view in teacher_views(rows)
        },  # fmt: skip
        "phases_s": {p: total(f"{p}_s") for p in PHASES},
    } | {"teacher_models": per_teacher(teacher_views(rows), total)}


def teacher_of(label: str) -> str:
    """The teacher of a ledger label: 'name' of 'name:view'; 'teacher' for a plain view (the run's one teacher)."""
    return label.split(":", 1)[0] if ":" in label else "teacher"


def per_teacher(labels: list[str], total) -> dict:
    """Forward rows, input tokens and forward seconds summed per teacher (routes, DAPD's anchors) over its views."""
    out: dict[str, dict] = {}
    for lab in labels:
        t = out.setdefault(teacher_of(lab), {"rows": 0, "tokens": 0, "forward_s": 0.0})
        t["rows"] += total(f"teacher_rows_{lab}")
        t["tokens"] += total(f"teacher_tokens_{lab}")
        t["forward_s"] += total(f"teacher_forward_s_{lab}")
    return out


def teacher_views(rows: list[dict]) -> list[str]:
    """The teacher views the ledger's rows record (`teacher_rows_<view>`), in order of appearance."""
    return list(dict.fromkeys(k.removeprefix("teacher_rows_") for r in rows for k in r if k.startswith("teacher_rows_")))


def format_summary(summary: dict, name: str = "this run", scores=None) -> str:
    """The summary in Markdown: the live evaluations first when the run had them (--eval-every; --eval-before's
    scores as 'before training', with the full-image change beside the teacher's query ratio), then the paper's
    Table 7 (supervision counts) and Table 8 (observed time). `scores`: (label, format) of an evaluation's score
    keys (`opd.eval.live.score_label`, `format_score`, given by `opd.run`); None leaves the evaluations out."""
    s = summary
    return "\n".join(
        [
            *_evaluation_lines(s.get("evaluations"), s, scores),
            "| Policy | Candidates | Teacher calls | Query ratio | Scored tokens | Tokens vs. all candidates | Max overrun |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
            f"| {name} | {s['candidates']:,} | {s['calls']:,} | {100 * s['query_ratio']:.2f}% | "
            f"{s['scored_tokens']:,} | {100 * s['token_ratio']:.2f}% | {max(0, s['max_overrun'])} |",
            "",
            "| Policy | Teacher forward sum | Mean teacher/step | Mean step | Total step time |",
            "| --- | ---: | ---: | ---: | ---: |",
            f"| {name} | {s['teacher_forward_s']:,.2f} s | {s['mean_teacher_s']:,.2f} s | "
            f"{s['mean_step_s']:,.2f} s | {s['step_s']:,.2f} s |",
            "",
            "| Phase | " + " | ".join(PHASES) + " |",
            "| --- |" + " ---: |" * len(PHASES),
            "| share of step time | "
            + " | ".join(f"{100 * s['phases_s'][p] / s['step_s']:.1f}%" if s["step_s"] else "-" for p in PHASES)
            + " |",
            "",
            f"Teacher input tokens: {s['teacher_tokens']:,} real, {s['teacher_padded_tokens']:,} with padding "
            f"({100 * (1 - s['teacher_tokens'] / s['teacher_padded_tokens']):.1f}% padding)."
            if s["teacher_padded_tokens"]
            else "Teacher input tokens: none.",
            *_teacher_lines(s.get("teachers", {})),
            *_model_lines(s.get("teacher_models", {})),
        ]
    )


def _teacher_lines(teachers: dict) -> list[str]:
    """Per teacher view (OPD-V has two teachers per scored row; with several teachers, per teacher:view): forward
    rows, input tokens, forward time."""
    if not teachers:
        return []
    return ["", "| Teacher view | Forward rows | Input tokens | Forward sum |", "| --- | ---: | ---: | ---: |"] + [
        f"| {v} | {t['rows']:,} | {t['tokens']:,} | {t['forward_s']:,.2f} s |" for v, t in teachers.items()
    ]


def _model_lines(models: dict) -> list[str]:
    """Per teacher when the run has several (routed teachers, DAPD's anchors): calls summed over its views."""
    if len(models) < 2:
        return []
    return ["", "| Teacher | Forward rows | Input tokens | Forward sum |", "| --- | ---: | ---: | ---: |"] + [
        f"| {m} | {t['rows']:,} | {t['tokens']:,} | {t['forward_s']:,.2f} s |" for m, t in models.items()
    ]


def _evaluation_lines(evaluations: dict | None, summary: dict, scores) -> list[str]:
    """summary.json's `evaluations` as a table (one row per evaluation) and, with a 'before training' row, one line:
    each benchmark's full-image score before and after, beside the share of candidates the teacher scored."""
    if not evaluations or not evaluations.get("rows") or scores is None:
        return []
    score_label, format_score = scores
    rows = evaluations["rows"]
    keys = list(dict.fromkeys(k for r in rows for k in r if k.startswith("eval/")))
    data = f" on --eval-data {evaluations['data']}" if evaluations.get("data") else ""
    lines = [f"| Live evaluation{data} (greedy, eval.py's scoring) | " + " | ".join(map(score_label, keys)) + " |",
             "| --- |" + " ---: |" * len(keys)]
    for r in rows:
        when = "before training" if r["after"] == 0 else f"after step {r['after']}"
        lines.append(f"| {when} | " + " | ".join(format_score(k, r[k]) if k in r else "-" for k in keys) + " |")
    lines.append("")
    first, last = rows[0], rows[-1]
    if first["after"] == 0 and last["after"] > 0:
        full = [k for k in keys if score_label(k).endswith(", full image") and k in first and k in last]
        moved = "; ".join(f"{score_label(k)} {format_score(k, first[k])} -> {format_score(k, last[k])} "
                          f"({last[k] - first[k]:+.2f} points)" for k in full)  # fmt: skip
        lines += [f"Before -> after {last['after']} steps: {moved}, the teacher queried on "
                  f"{100 * summary['query_ratio']:.2f}% of the candidates ({summary['calls']:,} of "
                  f"{summary['candidates']:,} rollouts).", ""]
    return lines
