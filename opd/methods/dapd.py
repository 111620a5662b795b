"""DAPD: dual-anchored policy distillation (arXiv 2608.01735; uanu2002/DAPD), on Algorithm 1's loop.

Six forward KL terms KL(anchor || student), each on one completion (the rollout or the reference), with the anchor
and the student each given a context (none, the reference, or the row's own rollout) and the anchor one of two
frozen copies of the policy: `base` (the initial weights) or `snapshot` (refreshed every `--ema-every` steps with
tau = 1). Weights sum to 2; each term is `family.clamped_forward_kl` at temperature 1.1, clip 0.05, a token mean,
computed chunk by chunk (`chunked.clamped_kl_from_hidden`). The budget selects K = floor(rho |C|) rollouts before
any anchor forward; each enters all six pairs (`teacher_rows` = 6 |S|); the label u_i comes from the OPSD pair.
Departures from DAPD's code: contexts carry the student's image; the rollout context is the reference template with
the rollout in its slot; the run's rollouts per prompt (DAPD: one); each pair's token mean is over the global tokens
of S (docs/DEPARTURES.md, 36); full fine-tuning keeps the base as a separate frozen copy.
Details (the pair table, contexts, sharding): docs/MODULES.md#opdmethodsdapd.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from opd.data.family_views import reference_prompt
from opd.data.records import StepBatch, View, get_view
from opd.maths.chunked import clamped_kl_from_hidden
from opd.maths.divergence import global_denominator
from opd.methods.lockstep import MicroBatch, lockstep
from opd.methods.interface import Objective, ObjectiveContext, ObjectiveResult
from opd.methods.objective import begin, plan_micro_batches
from opd.methods.policy_gradient import position_weights
from opd.methods.specs import DAPD_SPEC, DAPDConfig
from opd.models.hidden import completion_inputs, lm_head_weight, response_hidden
from opd.models.ema_teacher import Stopwatch, TeacherSet, book_forward, update_due


@dataclass(frozen=True)
class Pair:
    """One KL(anchor || student) term: the completion both score, each side's context, the anchor, the weight."""

    name: str
    completion: str
    """'rollout' (the row's sampled response) or 'reference' (the record's reference text)."""
    anchor_context: str
    """'none', 'reference' or 'rollout' (see the module docstring)."""
    student_context: str
    anchor: str
    """'base' (the initial weights) or 'snapshot' (refreshed every --ema-every steps)."""
    weight: float


PAIRS = (
    Pair("entangled_rollout", "rollout", "reference", "none", "snapshot", 2 / 15),
    Pair("inference_reference", "reference", "none", "reference", "base", 2 / 15),
    Pair("privileged_rollout", "rollout", "reference", "rollout", "base", 2 / 15),
    Pair("entangled_reference", "reference", "rollout", "none", "snapshot", 2 / 5),
    Pair("inference_rollout", "rollout", "none", "rollout", "base", 2 / 5),
    Pair("privileged_reference", "reference", "rollout", "reference", "base", 4 / 5),
)
"""DAPD's six pairs in its order (dapd/objective.py); weights sum to 2."""

ANCHORS = ("snapshot", "base")
COMPLETIONS = ("rollout", "reference")
CONTEXTS = ("none", "reference", "rollout")


def student_groups(pairs=PAIRS) -> dict[tuple[str, str], list[Pair]]:
    """The pairs by the student's (completion, context), in first-appearance order: one student forward each."""
    groups: dict[tuple[str, str], list[Pair]] = {}
    for p in pairs:
        groups.setdefault((p.completion, p.student_context), []).append(p)
    return groups


def context_text(problem: str, context: str, reference: str, rollout_text: str) -> str:
    """The question text of a context: 'none' the plain question; 'reference' the question with the
    reference in `family_views.REFERENCE_TEMPLATE`; 'rollout' the same template with the rollout's text."""
    if context == "none":
        return problem
    if context == "reference":
        return reference_prompt(problem, reference)
    if context == "rollout":
        return reference_prompt(problem, rollout_text)
    raise ValueError(f"unknown context {context!r}; known: {', '.join(CONTEXTS)}")


def reference_completion(tokenizer, reference: str, eos_id: int, max_len: int) -> torch.Tensor:
    """The 'reference' completion: the reference's token ids followed by EOS, at most max_len ids."""
    ids = tokenizer(reference, add_special_tokens=False)["input_ids"] + [eos_id]
    return torch.tensor(ids[:max_len], dtype=torch.long)


class DAPD(Objective):
    """The DAPD objective (see the module docstring): the six pairs on S, the snapshot refresh after a valid
    update every `ema_every` steps."""

    spec = DAPD_SPEC  # its name, Config (DAPDConfig), refuses, needs_ema_teacher (`opd.methods.specs`)

    @classmethod
    def build_teachers(cls, teachers: TeacherSet, initial_teacher) -> TeacherSet:
        """The two anchors: `snapshot`, the run's EMA teacher, and `base`, the initial weights (frozen, reloaded on
        resume)."""
        snapshot = teachers.teachers.get("teacher")
        if snapshot is None or not snapshot.trainable:  # opd.config refuses --ema-tau 0 first
            raise TypeError(f"DAPD: {cls.needs_ema_teacher}")
        return TeacherSet({"snapshot": snapshot, "base": initial_teacher()})

    def __init__(self, ctx: ObjectiveContext, config: DAPDConfig | None = None, initial_teacher=None):
        super().__init__(ctx, config or DAPDConfig(), initial_teacher)
        self.anchors = {name: ctx.teachers.teachers[name] for name in ANCHORS}
        self._prompts: dict[tuple[str, int], object] = {}  # one step's encoded contexts (`_context_prompt`)

    @property
    def labels(self) -> list[str]:
        return [f"{p.anchor}:{p.name}" for p in PAIRS]

    def __call__(self, batch: StepBatch) -> ObjectiveResult:
        ctx = self.ctx
        acc, dc, device = ctx.accelerator, ctx.loss, ctx.device
        ro, sel = batch.rollouts, batch.selected
        eos = ctx.ids["eos"][0]
        # Each completion's token count over all ranks (Hajek: sum_i w_i T_i), as the family's Eq. 11 denominator:
        # the rollouts' is the result's (`begin`), the references' one more all-reduce.
        res = begin(ctx, batch, self.labels)
        refs = {j: reference_completion(ctx.tokenizer, batch.records[j].reference, eos, ctx.max_response_len)
                for j in {*ro.prompt_index[sel].tolist(), int(ro.prompt_index[0])}}  # fmt: skip (row 0: padding)
        w = batch.weights  # unbiased selection's 1 / pi_i (None: 1): every pair's token mean in its Hajek form
        ref_lengths = torch.tensor([len(refs[int(j)]) if int(j) in refs else 0 for j in ro.prompt_index.tolist()])
        n_roll, n_ref = res.global_tokens, global_denominator(acc, ref_lengths, sel, w)
        sums = torch.zeros(len(PAIRS), dtype=torch.float64)  # this rank's sum of D per pair
        res.loss_share = 0.0
        if res.empty:  # S is empty everywhere: no anchor forward, zero loss
            res.metrics = {f"kl_{p.name}": 0.0 for p in PAIRS}
            return res
        denominators = {"rollout": float(n_roll), "reference": max(1.0 if w is None else 1e-300, float(n_ref))}
        scale = acc.num_processes
        lengths = torch.tensor([len(batch.student_prompts[int(ro.prompt_index[i])]) for i in sel.tolist()], dtype=torch.long)
        lengths = lengths + ro.lengths[sel] + torch.tensor([len(refs[int(ro.prompt_index[i])]) for i in sel.tolist()],
                                                          dtype=torch.long)  # fmt: skip
        plan = [sel[g] for g in plan_micro_batches(lengths, dc.micro_batch, dc.micro_batch_tokens)] if sel.numel() else []

        self._prompts = {}
        try:
            for mb in lockstep(ctx, batch, {"pairs": plan}, release=[a.model for a in self.anchors.values()]):
                self._micro_batch(batch, mb, refs, denominators, scale, res, sums)
        finally:
            self._prompts = {}
        reduced = acc.reduce(sums.to(device), "sum").cpu()  # every rank, also with nothing to do
        res.metrics = {f"kl_{p.name}": float(reduced[k]) / denominators[p.completion] for k, p in enumerate(PAIRS)}
        res.loss_share = float(sum(p.weight * sums[k] / denominators[p.completion] for k, p in enumerate(PAIRS)))
        res.loss_sum = res.loss_share * res.global_tokens
        return res

    def _inputs(self, batch: StepBatch, rows: torch.Tensor, refs: dict, completion: str, context: str):
        """(inputs, mask, width) of `rows` in one (completion, context) and their prompt lengths."""
        ro = batch.rollouts
        prompts = [self._context_prompt(batch, i, context) for i in rows.tolist()]
        if completion == "rollout":
            completions = [ro.response_ids[i, : int(ro.lengths[i])] for i in rows.tolist()]
        else:
            completions = [refs[int(ro.prompt_index[i])] for i in rows.tolist()]
        inputs, mask, _, width = completion_inputs(prompts, completions, self.ctx.ids["pad"], self.ctx.device)
        return inputs, mask, width, sum(len(p) for p in prompts)

    def _context_prompt(self, batch: StepBatch, i: int, context: str):
        """Row i's prompt in a context (`context_text`): none = the student's prompt; reference = the reference view
        (with context_thinking: encoded with the thinking prompt, once per prompt of the step); rollout = the
        reference template with the row's decoded rollout (once per row of the step). An encoding is a pure function
        of (record, text, thinking), so the step's cache (`self._prompts`) gives the same ids as encoding again."""
        ctx, ro = self.ctx, batch.rollouts
        j = int(ro.prompt_index[i])
        thinking = True if self.config.context_thinking else None
        if context == "none":
            return batch.student_prompts[j]
        if context == "reference" and not self.config.context_thinking:
            return batch.teacher_prompt("snapshot", "reference_answer", j)  # encoded once per step by the loop
        key = ("reference", j) if context == "reference" else ("rollout", i)
        if key in self._prompts:
            return self._prompts[key]
        record = batch.records[j]
        if context == "reference":
            prompt = ctx.encode("reference_answer", record, 0, None, thinking)
        else:
            text = ctx.tokenizer.decode(ro.response_ids[i, : int(ro.lengths[i])], skip_special_tokens=True)
            images, _ = get_view(ctx.student_view)(record)
            question = context_text(record.problem, "rollout", "", text)
            view = View(lambda r, seed, images=images, question=question: (images, question))
            prompt = ctx.encode(view, record, 0, None, thinking)
        self._prompts[key] = prompt
        return prompt

    def _micro_batch(self, batch, mb: MicroBatch, refs, denominators, scale, res, sums) -> None:
        """One micro-batch of `mb.rows`: the six anchor forwards, then one student forward and backward per student
        context (DDP: only the step's last backward synchronises). Padding (sharded lockstep): the same forwards and
        backwards with zero weights, nothing counted or labelled."""
        ctx, rows = self.ctx, mb.rows
        dc, device = ctx.loss, ctx.device
        cache: dict[tuple[str, str], tuple] = {}

        def inputs_of(completion: str, context: str):
            if (completion, context) not in cache:
                cache[completion, context] = self._inputs(batch, rows, refs, completion, context)
            return cache[completion, context]

        anchor_h = {}
        with ctx.autocast():
            for p in PAIRS:  # the anchors: six detached forwards, each in its own context
                inputs, mask, width, prompt_tokens = inputs_of(p.completion, p.anchor_context)
                anchor = self.anchors[p.anchor]
                forward = Stopwatch(device)
                with mb.teacher(anchor):
                    anchor_h[p.name] = anchor.hidden(inputs, width)[mask]  # (P, H)
                if mb.real:
                    book_forward(res.teachers[f"{p.anchor}:{p.name}"], inputs, mask, prompt_tokens, forward.seconds())
        groups = list(student_groups().items())
        for g, ((completion, context), pairs) in enumerate(groups):  # the student: one forward and backward per context
            inputs, mask, width, _ = inputs_of(completion, context)
            with mb.synced(last=g == len(groups) - 1):
                with ctx.autocast():
                    h_s = response_hidden(ctx.student, inputs, width)[mask]  # (P, H)
                    w_s = lm_head_weight(getattr(ctx.student, "module", ctx.student))
                    weight = mb.weight(torch.ones(h_s.shape[0], device=device) * (scale / denominators[completion]))
                    w_pos = position_weights(batch, rows, mask, weight.dtype) if mb.real else None  # (P,) 1 / pi_i
                    if w_pos is not None:  # each position times its row's 1 / pi_i
                        weight = weight * w_pos
                    timing: dict[str, float] = {}
                    utility = dc.topk if pairs[0] is PAIRS[0] else 0
                    loss, d, terms = clamped_kl_from_hidden(
                        h_s, w_s, [anchor_h[p.name] for p in pairs],
                        [lm_head_weight(self.anchors[p.anchor].model) for p in pairs], [weight * p.weight for p in pairs],
                        self.config.temperature, self.config.clip, dc.chunk or max(1, h_s.shape[0]), utility_k=utility,
                        timing=timing, stopwatch=Stopwatch,
                    )  # fmt: skip
                mb.backward(loss, free=False)  # the anchors' LM heads are read again by the next context's loss
            if not mb.real:
                continue
            for k, p in enumerate(pairs):
                d_k = d[k].double() if w_pos is None else d[k].double() * w_pos.double()
                sums[PAIRS.index(p)] += float(d_k.sum())
                res.teachers[f"{p.anchor}:{p.name}"].seconds += timing.get("teacher_s", 0.0) / len(pairs)
            if terms is not None:  # pair 1 (the OPSD pair): Eq. 7-9
                res.label(rows, terms, mask, dc)
        mb.free()  # sharded: the anchors' gathered roots (LM heads) are freed

    def after_update(self, step: int) -> None:
        """The snapshot refresh: snapshot <- policy (tau = --ema-tau, 1 for DAPD) every --ema-every steps."""
        if update_due(self.ctx.ema.every, step):
            self.anchors["snapshot"].update(self.ctx.model(), self.ctx.ema.tau)
