"""Evaluation while training (`train.py --eval-every N --eval-data DIR`): the current policy scored on a held subset
of the paper's benchmarks with eval.py's protocol, logged to the ledger and the trackers as `eval/<benchmark>`,
`eval/<benchmark>_crop` and `eval/<benchmark>_crop_gap` (eval.py's own results name the crop view `<benchmark>@crop`).

Every N steps and at the last step, each benchmark's first `--eval-limit` items are answered greedily in each of
`--eval-views` and scored as eval.py does (`opd.eval.evaluate.score_view`, `opd.eval.metrics`). Every rank answers its
share, padded so every rank runs the same number of `generate` calls; a prompt that fails on one rank stops every
rank with one line. Nothing is written besides the ledger row and the trackers. `--eval-before` scores the policy
once before step 0; `--eval-data toy` is the toy world's held-out items.
Details: docs/MODULES.md#opdevallive.
"""

from __future__ import annotations

from accelerate.utils import gather_object

from opd.builtin import builtin_path
from opd.cli import UserError
from opd.eval import benchmarks, inference
from opd.eval.bench_items import BenchmarkDataError
from opd.eval.config import LiveEvalConfig
from opd.eval.evaluate import score_view
from opd.eval.metrics import zoom_gap

CROP = "_crop"
"""The crop view's suffix of a live-evaluation metric (`eval/zoombench_crop`, `eval/zoombench_crop_gap`): '@', eval.py's
own mark for the view, is not a valid tracker name (MLflow refuses it), and the ledger keeps the trackers' names."""


class LiveEval:
    """The held subsets, loaded once; `due(step)` and `__call__` (every rank alike)."""

    def __init__(self, settings: LiveEvalConfig, steps: int):
        self.settings, self.steps = settings, steps
        self.replies: dict[tuple[str, str], dict[str, str]] = {}
        """The last evaluation's replies, index -> reply by (benchmark, view), every rank's (gathered): kept for
        tests/test_live_eval.py, which compares them with eval.py's on the step's checkpoint (a few KB)."""
        self.items = {}
        data = builtin_path(settings.data, "bench") or settings.data  # 'toy': built here on first use
        for name in settings.names():
            try:
                items = benchmarks.load_benchmark(name, data)
            except (BenchmarkDataError, ImportError) as exc:  # a bad file (named with row and field); no pyarrow
                raise UserError(f"--eval-data: benchmark '{name}': {exc}") from None
            for view in settings.view_list():
                subset = [i for i in items if view == "full" or i.crop is not None]
                subset = subset[: settings.limit] if settings.limit else subset
                if subset:
                    self.items[name, view] = subset

    def due(self, step: int) -> bool:
        """After step index `step`: every --eval-every steps and at the last step."""
        every = self.settings.every
        return bool(every) and ((step + 1) % every == 0 or step + 1 == self.steps)

    def __call__(self, accelerator, policy, processor, enable_thinking: bool, generation) -> dict[str, float]:
        """{'eval/<name>' (the full view) or 'eval/<name>_crop': score, 'eval/<name>_crop_gap': crop - full} on every
        rank; `generation()` is the policy's generation context (a sharded one gathers there)."""
        s = self.settings
        rank, world = accelerator.process_index, accelerator.num_processes
        gather = gather_object if world > 1 else (lambda x: x)
        out: dict[str, float] = {}
        records: dict[tuple[str, str], list[dict]] = {}
        for (name, view), items in self.items.items():
            share = items[rank::world]
            longest = -(-len(items) // world)
            padded = share + [items[0]] * (longest - len(share))  # the same number of generate() calls everywhere
            with generation():
                replies = _answer(policy, processor, padded, s.batch, s.max_new_tokens, enable_thinking, view,
                                  gather)[: len(share)]  # fmt: skip
            gathered = gather([(item.index, reply) for item, reply in zip(share, replies)])
            stored = {index: {"reply": reply, "view": view} for index, reply in gathered}
            self.replies[name, view] = {index: reply for index, reply in gathered}
            result, records[name, view] = score_view(name, items, stored)
            key = f"eval/{name}" + ("" if view == "full" else CROP)
            out[key] = float(result["score"]) if result.get("score") is not None else float("nan")
        for name in s.names():
            if (name, "crop") in records and (name, "full") in records:  # the same items in both views
                gap = zoom_gap(records[name, "full"], records[name, "crop"])
                out[f"eval/{name}{CROP}_gap"] = float(gap["gap"]) if gap["n"] else float("nan")
        return out


def _answer(policy, processor, items, batch: int, max_new_tokens: int, enable_thinking: bool, view: str,
            gather) -> list[str]:
    """Greedy replies to `items` in batches of `batch` (`opd.eval.inference`'s encoding and generation). Before each
    batch's generate every rank gathers every rank's encoding error (None when its prompts encoded): the same
    collective on every rank, so a prompt that fails on one rank raises its one-line UserError on all of them
    (printed once, by rank 0, naming the rank) instead of leaving the others in the sharded policy's collectives."""
    was_training = policy.training
    policy.eval()
    replies: list[str] = []
    try:
        for start in range(0, len(items), batch):
            chunk, prompts, error = items[start : start + batch], [], None
            try:
                prompts = [inference.encode_item(processor, item, view, enable_thinking) for item in chunk]
            except UserError as exc:  # an image that does not decode (named with its file, row and item)
                error = str(exc)
            everyone = gather([error])  # one entry per rank
            errors = [(r, e) for r, e in enumerate(everyone) if e is not None]
            if errors:
                where, message = errors[0]
                raise UserError(f"--eval-data: {message}" + (f" (met by rank {where})" if len(everyone) > 1 else ""))
            replies += inference.generate_replies(policy, processor, prompts, max_new_tokens)
    finally:
        policy.train(was_training)
    return replies


def evaluations(rows: list[dict]) -> list[dict]:
    """The live evaluations a ledger's rows hold, in order: {"after": steps trained (0: --eval-before's, in the first
    row as `eval_before`), "eval/<name>...": score} (summary.json's `evaluations`, summary.md's table)."""
    out = []
    for row in rows:
        if isinstance(row.get("eval_before"), dict):
            out.append({"after": row["step"], **_scores_of(row["eval_before"])})
        if scores := _scores_of(row):
            out.append({"after": row["step"] + 1, **scores})
    return out


def _scores_of(row: dict) -> dict[str, float]:
    """The row's live-evaluation scores under today's names (a row an earlier version wrote has '@crop': read as
    '_crop', so that a resumed run's summary has one column per score)."""
    return {k.replace("@crop", CROP): v for k, v in row.items() if k.startswith("eval/")}


def score_label(key: str) -> str:
    """A score's column name: 'eval/zoombench' -> 'zoombench, full image', '..._crop' -> 'zoombench, crop',
    '..._crop_gap' -> 'zoombench, crop - full' (keys as `_scores_of` gives them: an old ledger's '@crop' renamed)."""
    name = key.removeprefix("eval/")
    for suffix, view in ((CROP + "_gap", "crop - full"), (CROP, "crop")):
        if name.endswith(suffix):
            return f"{name.removesuffix(suffix)}, {view}"
    return f"{name}, full image"


def format_score(key: str, value: float) -> str:
    """A score as the tables print it: two decimals, a gap signed; 'n/a' for NaN (no item answered)."""
    if value != value:  # NaN
        return "n/a"
    return f"{value:+.2f}" if key.endswith("_gap") else f"{value:.2f}"


def format_scores(scores: dict) -> str:
    """One evaluation in one line for the console: 'zoombench, full image 47.50; zoombench, crop 100.00; ...'."""
    return "; ".join(f"{score_label(k)} {format_score(k, v)}" for k, v in _scores_of(scores).items())
