"""Step-by-step diagnostics of a toy OPD run (the collapse investigation, experiments/toy_collapse.py).

`Diagnosed(run)` wraps an `opd.run.Run` of the first toy task (one-letter answers) and trains it step by step
exactly as `run.step(step)` would (the same rollouts, selections and updates: a test checks the ledger against an
undiagnosed run), while recording what the step's selection did: every candidate's utility u_i (Eq. 9, by
`harness.audit.score_utility`, before the step), the teacher's and the student's option-letter probabilities, and
the selection S and labels the selector receives (checked against the precomputed u_i of the same rows).
`oracle=True` selects the top floor(rho |C|) candidates by the precomputed u_i instead (no exploration).

`diagnose_one` runs one diagnosed job (diag.jsonl, probes.jsonl, eval.py, done.json); `view_accuracy` probes a
model's answer on a view cheaply (the argmax over the option letters at the first response position).
Details: docs/MODULES.md#harnessdiagnose.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import torch

from harness.audit import AuditContext, HeldBatch, score_utility
from harness.experiment import evaluate, finished_or_cleared, quiet, say
from opd.config import TrainConfig
from opd.data.sources import load_records
from opd.engine.rollout import generate_rollouts
from opd.loop.ledger import write_atomic
from opd.run import Run
from opd.models.chat import collate
from opd.engine.rollout import mix_seed
from opd.selection.selectors import query_budget, rollout_features, top_subset
from opd.toy.world import OPTIONS


@torch.no_grad()
def letter_probs(run, model, records, view: str, batch: int = 64) -> torch.Tensor:
    """(n, 4) probabilities of the option letters A-D at the first response position of `view`."""
    letters = [run.processor.tokenizer.convert_tokens_to_ids(k) for k in OPTIONS]
    out = []
    for start in range(0, len(records), batch):
        prompts = [run.prompts.encode(view, r) for r in records[start : start + batch]]
        inputs = {k: v.to(run.acc.device) for k, v in collate(prompts, run.ids["pad"]).items()}
        with run.autocast():
            logits = model(**inputs, logits_to_keep=1, use_cache=False).logits[:, -1].float()
        out.append(torch.softmax(logits, -1)[:, letters].cpu())
    return torch.cat(out)


def view_accuracy(run, model, records, view: str) -> float:
    """Percent of records whose most likely option letter (first response position) is the answer."""
    gold = torch.tensor([list(OPTIONS).index(r.answer) for r in records])
    return 100.0 * float((letter_probs(run, model, records, view).argmax(-1) == gold).float().mean())


class Diagnosed:
    """Trains `run` step by step as `run.step` does, recording each step's selection diagnostics."""

    def __init__(self, run, oracle: bool = False):
        self.run, self.oracle = run, oracle
        self.captured: dict = {}
        self.u_all: torch.Tensor | None = None
        selector = run.selector
        select, observe = selector.select, selector.observe

        def traced_select(phi, eligible, budget, step, *args, **kwargs):
            if self.oracle:
                candidates = eligible.nonzero().squeeze(-1)
                chosen, pi = top_subset(self.u_all.nan_to_num(-1.0), candidates, budget).sort().values, None
            else:
                chosen, pi = select(phi, eligible, budget, step, *args, **kwargs)
            self.captured["selected"] = chosen.clone()
            self.captured["predicted"] = selector.predict(phi)  # the u^ this selection ranked by (normalizer updated)
            return chosen, pi

        def traced_observe(phi, u, step):
            self.captured["labels"] = u.clone()
            return observe(phi, u, step)

        selector.select, selector.observe = traced_select, traced_observe

    def step(self, step: int) -> tuple[dict, dict]:
        """One training step; returns (the ledger row, the step's diagnostics)."""
        run, cfg = self.run, self.run.cfg
        records = run.prompts.of_step(step)
        prompts = run.prompts.student(records)
        torch.manual_seed(mix_seed(cfg.run.seed, step, run.acc.process_index))  # as Run.step seeds its sampling
        s = cfg.sampling
        with run.autocast():
            ro = generate_rollouts(run.model, prompts, s.rollouts_per_prompt, s.max_response_len, s.rollout_batch,
                                   s.share_prefill)  # fmt: skip
        rows = ro.prompt_index.tolist()
        eligible = torch.tensor([run.prompts.eligible(records[j]) for j in rows], dtype=torch.bool) & ro.valid
        area = torch.tensor([records[j].area_ratio for j in rows])
        phi = rollout_features(ro.logp, ro.entropy, ro.response_mask, ro.prompt_len, area)
        self.u_all = score_utility(AuditContext.of(run), HeldBatch(records, ro, prompts, phi, eligible, None))
        teacher_p = letter_probs(run, run.teacher.model, records, run.teacher_views[0])
        student_p = letter_probs(run, run.model, records, "full")
        self.captured = {}
        row = run.step(step, ro)
        selected, predicted = self.captured["selected"], self.captured["predicted"]
        labels = self.captured["labels"]  # Run.step hands the selector the labels of S, in S's order
        letters = [run.processor.tokenizer.convert_tokens_to_ids(k) for k in OPTIONS]
        first = ro.response_ids[:, 0].tolist()
        diag = {
            "step": step,
            "budget": query_budget(cfg.selection.rho, int(eligible.sum())),
            "prompt": rows,
            "gold": [list(OPTIONS).index(r.answer) for r in records],
            "sampled": [letters.index(t) if t in letters else -1 for t in first],
            "selected": selected.tolist(),
            "u_all": [float(x) for x in self.u_all],
            "labels": [float(x) for x in labels],
            "label_error": float((labels - self.u_all[selected]).abs().max() / self.u_all[selected].abs().max().clamp(min=1e-30))
            if selected.numel() else 0.0,  # relative to the largest label of S
            "predicted": [float(x) for x in predicted] if predicted is not None else None,
            "teacher_p": teacher_p.tolist(),
            "student_p": student_p.tolist(),
        }
        return row, diag


def diagnose_one(job: dict) -> dict:
    """A diagnosed run (a job of `harness.experiment` plus "oracle" and "probe_every"): trains with
    `Diagnosed`, writes diag.jsonl (one line per step) and probes.jsonl (the teacher's crop-view and the
    student's full-image accuracy on the audit records every `probe_every` steps), evaluates with eval.py,
    and returns done.json."""
    quiet()
    spec, out = job["spec"], Path(job["folder"])
    done = out / "done.json"
    if (finished := finished_or_cleared(out)) is not None:
        return finished
    probe_records = load_records(job["audit_data"])
    t0 = time.perf_counter()
    with open(out / "train.log", "w") as log, contextlib.redirect_stdout(log):
        run = Run(TrainConfig(**job["train"], out=str(out)))
        diagnosed = Diagnosed(run, oracle=job.get("oracle", False))
        with (out / "diag.jsonl").open("w") as diag_file, (out / "probes.jsonl").open("w") as probe_file:
            for step in range(run.steps + 1):
                if step % job["probe_every"] == 0 or step == run.steps:
                    probe = {"step": step, "teacher_crop": view_accuracy(run, run.teacher.model, probe_records, run.teacher_views[0]),
                             "student_full": view_accuracy(run, run.model, probe_records, "full"),
                             "student_crop": view_accuracy(run, run.model, probe_records, run.teacher_views[0])}
                    probe_file.write(json.dumps(probe) + "\n")
                if step == run.steps:
                    break
                row, diag = diagnosed.step(step)
                run.log(row)
                diag_file.write(json.dumps(diag) + "\n")
                if (step + 1) % max(1, run.steps // 4) == 0:
                    say(f"  {spec['name']} seed {spec['seed']}: step {step + 1}/{run.steps}, teacher crop "
                        f"{probe['teacher_crop']:.0f}% at step {probe['step']}, {time.perf_counter() - t0:.0f} s")
        run.save(run.steps)
        summary = run.finish()
    train_s = time.perf_counter() - t0
    del run
    ev = job["eval"]
    scores = evaluate(out, Path(ev["bench"]), out / "eval", ev["batch"], ev["max_new_tokens"], f"{spec['name']}-seed{spec['seed']}")
    record = {**spec, "train_s": train_s, "summary": summary, **scores}
    write_atomic(done, json.dumps(record, indent=1) + "\n")  # the finished marker: whole or absent
    say(f"done {spec['name']} seed {spec['seed']}: full {scores['full']:.1f}%, crop {scores['crop']:.1f}% ({train_s:.0f} s)")
    return record
