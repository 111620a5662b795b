"""The teacher-supervision cost ledger (Appendix C; Tables 7 and 8).

`DIR/ledger.jsonl` holds one JSON object per training step. The fields the paper's cost tables
need: candidates |C|, budget K (Eq. 4), selected |S| (teacher calls), scored_tokens sum_{i in S} T_i,
candidate_tokens sum_{i in C} T_i, teacher_forward_s and step_s (the slowest rank's), overrun
max(0, |S| - K). Lines are appended and flushed as steps finish; a resumed run first cuts the file
back to its checkpoint's step, so no step is counted twice.

Interpretation: the paper's "Tokens vs. Full" divides by a separate full-querying run's scored tokens.
A single run's summary divides by the tokens of all its candidates instead (the tokens a full-query
pass over the same rollouts would have scored).
"""

import json
import os
from pathlib import Path

REQUIRED = ("step", "candidates", "budget", "selected", "scored_tokens", "teacher_forward_s", "step_s")


def write_atomic(path: Path, text: str) -> None:
    """Writes a file through a temporary sibling and os.replace, so readers never see half of it."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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
    }


def format_summary(summary: dict, name: str = "this run") -> str:
    """The summary as the paper's Table 7 (supervision counts) and Table 8 (observed time) in Markdown."""
    s = summary
    return "\n".join(
        [
            "| Policy | Candidates | Teacher calls | Query ratio | Scored tokens | Tokens vs. all candidates | Max overrun |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
            f"| {name} | {s['candidates']:,} | {s['calls']:,} | {100 * s['query_ratio']:.2f}% | "
            f"{s['scored_tokens']:,} | {100 * s['token_ratio']:.2f}% | {max(0, s['max_overrun'])} |",
            "",
            "| Policy | Teacher forward sum | Mean teacher/step | Mean step | Total step time |",
            "| --- | ---: | ---: | ---: | ---: |",
            f"| {name} | {s['teacher_forward_s']:,.2f} s | {s['mean_teacher_s']:,.2f} s | "
            f"{s['mean_step_s']:,.2f} s | {s['step_s']:,.2f} s |",
        ]
    )
