"""Selective distillation of one step (Algorithm 1, lines 11-12): Eq. 1, 2, 3, 9 and 11 on the selected rows.

A rank's selected rows are grouped by length into micro-batches (at most `micro_batch` rows and, when
set, `micro_batch_tokens` padded teacher tokens), so the teacher computes little padding. For each
micro-batch: the teacher's detached final hidden states on the crop prompt (Eq. 2) and the student's on
the full-image prompt (Eq. 1), both over the same sampled response tokens; then, one chunk of
`loss_chunk` valid positions at a time, both sides' logits through the LM head, the top-k JSD per token
(Eq. 3) and the utility terms (Eq. 7-8), without ever holding (positions x vocabulary) logits beyond a
chunk (`opd.chunked`); its share of the budgeted loss (Eq. 11) is backpropagated at once, and the
utility labels (Eq. 9) come from the same chunks. `loss_chunk = 0` computes whole micro-batch logits
instead (`opd.chunked.topk_jsd_from_logits`); tests check both against `topk_support` +
`generalized_jsd` + `utility_labels` on full logits.

Distributed: Eq. 11's denominator is the global count of selected valid tokens (one all-reduce, run
by every rank); DDP averages gradients over ranks, so each rank's loss is scaled by the world size.
Gradients are synchronised on each rank's last backward only. A rank holding no selected row while
others do runs one zero-weighted forward/backward on one of its rows so that the gradient all-reduce
still happens on every rank; when S is empty everywhere, no rank runs a forward.

Sharded (FSDP2, `opd.sharding`): every forward and backward of the student and the teacher gathers
parameters collectively, so the ranks run in lockstep: every rank runs as many micro-batches as the
rank with the most (one all-gather of the counts), padding with zero-weighted micro-batches on one of
its own rows (teacher forwards on the student's prompt, not counted as teacher calls), and gradients
are reduce-scattered after every backward (FSDP keeps no unsharded gradient between micro-batches). The
LM-head weights are read after their model's forward, when FSDP has gathered them (the root group), and
the teacher is resharded after each micro-batch's loss, before the student's backward.

The family (`opd.methods`): the teacher runs once per selected row and teacher view (OPD-V: the
crop and the masked crop); the support and divergence are the method's (`DistillConfig.support`,
`.divergence`), and a per-token weight w_t (OPD-V's trust region from the two teachers' sampled-token
log-probs; Vision-OPD's importance ratio with `is_clip`) multiplies Eq. 11's weights, whose
denominator still counts every selected valid token.

Teachers (`opd.teachers`): one teacher (the EMA self-teacher or a fixed `--teacher-model`) or several,
each row routed to one (`route`, OPOD's and `--teachers`' routing by a record field). S's rows are planned
into micro-batches per teacher, in the teachers' fixed order, so each teacher runs only on the selected
rows routed to it; sharded, every rank runs as many micro-batches per teacher as the busiest rank.
`row_weights` multiplies a row's Eq. 11 weights (OPOD's per-teacher strength beta), and the token weight
'gate' multiplies each token's by OPOD's gate ReLU(log pi_T(y_t) - log pi_theta(y_t)) from the chunk's
logits (`weights.teacher_gate`), whose per-row sums come back for OPOD's controller and reward.

The seam of the loop (`train.Run.step`): an objective is called with the step's `StepBatch` and returns a
`DistillResult` after backpropagating its share of the loss; `after_update` runs after a valid optimizer
step (the teachers' update: the EMA, DAPD's snapshot refresh). `Distillation` here is the family's
objective (every method that is a loss and a view); DAPD (`opd.dapd`) and OPOD (`opd.opod`) are others.

Cost accounting: each teacher view's forward, and the teacher-side LM-head work of the loss (its
logits, log-softmax and gathers inside the chunked loss; the sampled-token log-probs of OPD-V), are
teacher time, per view (`TeacherCost`).

Where this departs from the paper: the student forward runs on selected rows only. Rows with z_i = 0
contribute nothing to Eq. 11 or its gradient, so their forward would be discarded work.
"""

import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from opd.chat import EncodedPrompt, collate
from opd.chunked import budgeted_loss_from_hidden, sampled_logp_from_hidden, topk_jsd_from_logits
from opd.divergence import budgeted_weights
from opd.rollout import Rollouts
from opd.sharding import is_sharded, reshard
from opd.teacher import Teacher, lm_head_weight, response_hidden, response_logits
from opd.utility import sample_utility
from opd.weights import importance_ratio, teacher_gate, trust_region


@dataclass
class DistillConfig:
    k: int = 100
    alpha: float = 0.5
    micro_batch: int = 4
    """Most rows per student/teacher forward."""
    micro_batch_tokens: int = 0
    """Most padded teacher tokens (rows x longest prompt + response) per forward; 0 = no limit."""
    loss_chunk: int = 512
    """Positions per LM-head chunk of the loss; 0 = the plain path on whole micro-batch logits."""
    use_overlap: bool = True
    use_confidence: bool = True
    support: str = "student_tail"
    """The divergence's support (opd.methods.SUPPORTS)."""
    divergence: str = "jsd"
    """'jsd' (Eq. 3 with alpha) or 'bc_rkl'."""
    token_weight: str = "none"
    """'none', 'trust_region' (needs a second, negative teacher view) or 'gate' (OPOD's teacher gate)."""
    is_clip: float = 0.0
    """Importance-ratio clip c; 0 = no ratio."""


@dataclass
class TeacherCost:
    """What one teacher view cost on this rank: forward rows, real and padded input tokens, seconds."""

    rows: int = 0
    tokens: int = 0
    padded_tokens: int = 0
    seconds: float = 0.0


@dataclass
class DistillResult:
    loss_sum: float = 0.0
    """sum over this rank's selected valid tokens of D_alpha (Eq. 11's numerator, local part)."""
    tokens: int = 0
    """this rank's selected valid tokens (Eq. 11's denominator, local part)."""
    global_tokens: int = 0
    """Eq. 11's denominator over all ranks."""
    utility: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    """(N_local,) u_i for selected rows, NaN for unselected rows (they get no label)."""
    teachers: dict[str, TeacherCost] = field(default_factory=dict)
    """Per ledger label (teacher view, or teacher:view): rows, prompt + valid response tokens, input tokens
    with padding, seconds."""
    student_s: float = 0.0
    gate_sum: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    """(N_local,) with the 'gate' token weight: sum over the row's valid tokens of the gate c_t (0 outside S)."""
    teacher_logp_sum: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    """(N_local,) with the 'gate' token weight: sum over the row's valid tokens of log pi_T(y_t) (0 outside S)."""
    loss_share: float | None = None
    """This rank's share of the step's loss (summed over ranks: the loss); None: loss_sum / global_tokens."""
    metrics: dict = field(default_factory=dict)
    """Extra ledger fields of the objective (already the same on every rank)."""

    @property
    def teacher_s(self) -> float:
        return sum(c.seconds for c in self.teachers.values())

    @property
    def share(self) -> float:
        """This rank's share of the step's loss."""
        return self.loss_share if self.loss_share is not None else self.loss_sum / max(1, self.global_tokens)


def plan_micro_batches(lengths: torch.Tensor, max_rows: int, max_tokens: int = 0) -> list[torch.Tensor]:
    """Groups rows by length: sorted longest first, filled greedily while rows <= max_rows and
    rows x longest <= max_tokens (a row longer than max_tokens goes alone). Returns index tensors."""
    order = torch.sort(lengths, descending=True, stable=True).indices.tolist()
    batches, current = [], []
    for i in order:
        longest = int(lengths[current[0]]) if current else int(lengths[i])
        if current and (len(current) == max_rows or (max_tokens and (len(current) + 1) * longest > max_tokens)):
            batches.append(torch.tensor(current))
            current = []
        current.append(i)
    if current:
        batches.append(torch.tensor(current))
    return batches


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def micro_batch_inputs(
    prompts: list[EncodedPrompt], rollouts: Rollouts, rows: torch.Tensor, pad_id: int, device: torch.device
) -> tuple[dict[str, torch.Tensor], torch.Tensor, int]:
    """Model inputs for `rows`: their prompts + their responses trimmed to the longest valid one."""
    width = int(rollouts.lengths[rows].max().clamp(min=1))
    response = rollouts.response_ids[rows, :width]  # (n, T)
    mask = rollouts.response_mask[rows, :width]  # (n, T)
    inputs = collate(prompts, pad_id, response, mask)
    return {k: v.to(device) for k, v in inputs.items()}, mask.to(device), width


def completion_inputs(
    prompts: list[EncodedPrompt], completions: list[torch.Tensor], pad_id: int, device: torch.device
) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor, int]:
    """Model inputs for prompts each followed by its own completion ids (1-D), right-padded to the longest:
    (inputs, mask (n, T), completion ids (n, T), T). The completions of DAPD's reference and OPOD's answer."""
    width = max(1, max(len(c) for c in completions))
    ids = torch.full((len(completions), width), pad_id, dtype=torch.long)  # (n, T)
    mask = torch.zeros((len(completions), width), dtype=torch.bool)  # (n, T)
    for i, c in enumerate(completions):
        ids[i, : len(c)] = c
        mask[i, : len(c)] = True
    inputs = collate(prompts, pad_id, ids, mask)
    return {k: v.to(device) for k, v in inputs.items()}, mask.to(device), ids.to(device), width


def micro_batch_loss(student, teacher: Teacher, s_inputs, t_inputs: list, mask, width: int, weights, cfg: DistillConfig,
                     response=None, old_logp=None, extras: dict | None = None):
    """This micro-batch's share of Eq. 11 (differentiable), its per-token D (detached, (n, T)), the utility
    labels u_i (Eq. 9, (n,)), and the teacher seconds per teacher view (list, in t_inputs' order).

    t_inputs: the positive teacher's inputs, then the negative teacher's (OPD-V); weights (n, T): Eq. 11's
    per-token weights (times the DDP world size); response, old_logp (n, T): the sampled tokens and their
    log-probs at sampling (for the trust region and the importance ratio). With the 'gate' token weight
    `extras` (a dict) receives 'gate' and 'teacher_logp' (n, T), 0 outside the mask.
    """
    device = mask.device
    seconds = [0.0] * len(t_inputs)
    is_clip = dict(token_ids=response[mask], old_logp=old_logp[mask], is_clip=cfg.is_clip) if cfg.is_clip else {}

    def teacher_forward(j: int, fn):
        _sync(device)
        t0 = time.perf_counter()
        out = fn()
        _sync(device)
        seconds[j] += time.perf_counter() - t0
        return out

    if cfg.loss_chunk == 0:  # whole micro-batch logits
        t_logits = teacher_forward(0, lambda: teacher.logits(t_inputs[0], width))  # (n, T, V) Eq. 2
        if cfg.token_weight == "trust_region":  # OPD-V: w_t = ReLU(log pi_T+(y_t) - log pi_T-(y_t))
            n_logits = teacher_forward(1, lambda: teacher.logits(t_inputs[1], width))  # (n, T, V)
            pos, neg = (torch.log_softmax(x.float(), -1).gather(-1, response.unsqueeze(-1)).squeeze(-1) for x in (t_logits, n_logits))
            weights = weights * trust_region(pos, neg)  # (n, T)
            del n_logits
        s_logits = response_logits(student, s_inputs, width)  # (n, T, V) Eq. 1
        per_token, terms = topk_jsd_from_logits(
            s_logits, t_logits, cfg.k, cfg.alpha, support=cfg.support, divergence=cfg.divergence
        )  # (n, T) Eq. 3 (or the method's D), (n, T, 3)
        if cfg.is_clip or cfg.token_weight == "gate":
            logp = torch.log_softmax(s_logits.float(), -1).gather(-1, response.unsqueeze(-1)).squeeze(-1)  # (n, T)
        if cfg.is_clip:
            weights = weights * importance_ratio(logp, old_logp, cfg.is_clip)
        if cfg.token_weight == "gate":  # OPOD: c_t = ReLU(log pi_T(y_t) - log pi_theta(y_t))
            t_logp = torch.log_softmax(t_logits.float(), -1).gather(-1, response.unsqueeze(-1)).squeeze(-1)  # (n, T)
            gate = teacher_gate(t_logp, logp.detach())
            weights = weights * gate
            if extras is not None:
                extras["gate"], extras["teacher_logp"] = gate * mask, t_logp * mask
        loss = torch.where(weights > 0, per_token * weights, torch.zeros_like(per_token)).sum()  # Eq. 11
        per_token = per_token.detach()
    else:  # final hidden states, LM head chunk by chunk
        h_t = teacher_forward(0, lambda: teacher.hidden(t_inputs[0], width)[mask])  # (P, H) Eq. 2, valid positions
        w_t = lm_head_weight(teacher.model)  # after the forward: gathered there when sharded
        w_flat = weights[mask]  # (P,)
        if cfg.token_weight == "trust_region":
            y = response[mask]  # (P,)
            pos = teacher_forward(0, lambda: sampled_logp_from_hidden(h_t, w_t, y, cfg.loss_chunk))  # (P,)
            neg = teacher_forward(1, lambda: sampled_logp_from_hidden(
                teacher.hidden(t_inputs[1], width)[mask], w_t, y, cfg.loss_chunk))  # (P,)
            w_flat = w_flat * trust_region(pos, neg)
        h_s = response_hidden(student, s_inputs, width)[mask]  # (P, H) Eq. 1
        w_s = lm_head_weight(getattr(student, "module", student))  # DDP: .module
        timing: dict[str, float] = {}
        gate = dict(gate_ids=response[mask], extras={}) if cfg.token_weight == "gate" else {}
        loss, d_alpha, flat_terms = budgeted_loss_from_hidden(
            h_s, w_s, h_t, w_t, w_flat, cfg.k, cfg.alpha, cfg.loss_chunk, support=cfg.support,
            divergence=cfg.divergence, timing=timing, **is_clip, **gate,
        )  # Eq. 11 of Eq. 3 (or the method's D)
        seconds[0] += timing.get("teacher_s", 0.0)  # the teacher's LM head inside the fused loss
        if gate and extras is not None:
            t_y, s_y = gate["extras"]["teacher_logp"], gate["extras"]["student_logp"]  # (P,) each
            for key, flat in (("gate", teacher_gate(t_y, s_y)), ("teacher_logp", t_y)):
                extras[key] = torch.zeros(mask.shape, dtype=flat.dtype, device=device).masked_scatter(mask, flat)
        per_token = torch.zeros(mask.shape, dtype=d_alpha.dtype, device=device).masked_scatter(mask, d_alpha)
        terms = torch.zeros((*mask.shape, 3), dtype=flat_terms.dtype, device=device)
        terms[mask] = flat_terms
    d, o, c = terms.unbind(-1)  # (n, T) each, Eq. 7-8
    o = o if cfg.use_overlap else torch.ones_like(o)
    c = c if cfg.use_confidence else torch.ones_like(c)
    return loss, per_token, sample_utility(d, o, c, mask), seconds


def distill(
    accelerator,
    student,
    teacher,
    rollouts: Rollouts,
    student_prompts: list[EncodedPrompt],
    teacher_prompt,
    selected: torch.Tensor,
    cfg: DistillConfig,
    pad_id: int,
    autocast=nullcontext,
    teacher_views: tuple[str, ...] = ("crop",),
    *,
    route: list | None = None,
    row_weights: torch.Tensor | None = None,
    sync: bool = True,
    label: Callable[[str, str], str] | None = None,
) -> DistillResult:
    """Backpropagates this rank's share of Eq. 11 and returns its sums and utility labels.

    selected: local row ids of S on this rank. teacher: one Teacher, with teacher_prompt(view, j) -> the
    EncodedPrompt of local prompt j in a teacher view; or {name: Teacher} (the routed teachers, in the
    same order on every rank), with teacher_prompt(name, view, j) and route[i] = the teacher name of local
    row i. teacher_prompt is called only for prompts with a selected row. teacher_views: the positive
    teacher's view first, then OPD-V's negative one. autocast() -> the mixed precision context of the
    forwards. row_weights (N_local,): multiplies each row's Eq. 11 weights. sync=False: no backward
    synchronises DDP gradients (a later pass of the caller does). label(name, view) -> the ledger label
    of a teacher's view (default: the view with one teacher, name:view with several).
    """
    if isinstance(teacher, dict):
        teachers, prompt = teacher, teacher_prompt
    else:
        teachers, prompt = {"teacher": teacher}, (lambda name, view, j: teacher_prompt(view, j))
    names = list(teachers)
    label = label or (lambda name, view: view if len(names) == 1 else f"{name}:{view}")
    route = route if route is not None else [names[0]] * len(rollouts)
    device = accelerator.device
    res = DistillResult(utility=torch.full((len(rollouts),), float("nan")),
                        teachers={label(n, v): TeacherCost() for n in names for v in teacher_views})  # fmt: skip
    if cfg.token_weight == "gate":
        res.gate_sum, res.teacher_logp_sum = torch.zeros(len(rollouts)), torch.zeros(len(rollouts))
    res.tokens = int(rollouts.lengths[selected].sum()) if selected.numel() else 0
    res.global_tokens = int(accelerator.reduce(torch.tensor(res.tokens, device=device), "sum").item())
    if res.global_tokens == 0:  # S is empty everywhere: no teacher call, zero distillation term
        return res
    scale = accelerator.num_processes  # DDP and FSDP average gradients over ranks
    weights = torch.ones(len(rollouts)) if row_weights is None else row_weights.float().cpu()
    ctx = _Context(accelerator, student, rollouts, student_prompts, prompt, cfg, pad_id, autocast, teacher_views,
                   res, scale, weights, label)  # fmt: skip
    plans = {n: _plan(rollouts, ctx.prompt_of(n), selected[[route[i] == n for i in selected.tolist()]] if selected.numel()
                      else selected, cfg, teacher_views[0]) for n in names}  # fmt: skip
    if is_sharded(student):
        try:
            counts = accelerator.gather(torch.tensor([[len(plans[n]) for n in names]], device=device)).max(0).values
            for n, steps in zip(names, counts.tolist()):  # every rank: the same count per teacher, in the same order
                for j in range(steps):
                    rows, padding = (plans[n][j], False) if j < len(plans[n]) else (torch.tensor([0]), True)
                    _run_micro_batch(ctx, n, teachers[n], rows, padding=padding)
        finally:
            for t in teachers.values():
                reshard(t.model)
        return res
    work = [(n, rows) for n in names for rows in plans[n]]
    if not work:  # keep this rank in the gradient all-reduce with a zero-weighted forward
        if sync:
            dummy_backward(accelerator, student, rollouts, student_prompts, pad_id, autocast)
        return res
    for j, (n, rows) in enumerate(work):
        last = sync and j == len(work) - 1
        with nullcontext() if last else accelerator.no_sync(student):
            _run_micro_batch(ctx, n, teachers[n], rows)
    return res


def dummy_backward(accelerator, student, rollouts: Rollouts, student_prompts, pad_id: int, autocast) -> None:
    """A zero-weighted forward and backward on this rank's first row: a rank with nothing to train still
    joins DDP's gradient all-reduce (every rank runs the same collectives)."""
    inputs, _, _ = micro_batch_inputs(
        [student_prompts[int(rollouts.prompt_index[0])]], rollouts, torch.tensor([0]), pad_id, accelerator.device
    )
    with autocast():
        dummy = student(**inputs, logits_to_keep=1, use_cache=False).logits.float().sum() * 0.0
    accelerator.backward(dummy)


@dataclass
class _Context:
    """What every micro-batch of one `distill` call shares."""

    accelerator: object
    student: object
    rollouts: Rollouts
    student_prompts: list
    teacher_prompt: Callable
    cfg: DistillConfig
    pad_id: int
    autocast: Callable
    views: tuple[str, ...]
    res: DistillResult
    scale: int
    row_weights: torch.Tensor
    label: Callable

    def prompt_of(self, name: str):
        return lambda view, j: self.teacher_prompt(name, view, j)


def _plan(rollouts: Rollouts, teacher_prompt, selected: torch.Tensor, cfg: DistillConfig, view: str) -> list[torch.Tensor]:
    """This rank's micro-batches of `selected` (local row ids), grouped by teacher length."""
    if not selected.numel():
        return []
    prompt_of = rollouts.prompt_index[selected].tolist()
    t_len = torch.tensor([len(teacher_prompt(view, j)) for j in prompt_of]) + rollouts.lengths[selected]
    return [selected[g] for g in plan_micro_batches(t_len, cfg.micro_batch, cfg.micro_batch_tokens)]


def _run_micro_batch(ctx: _Context, name: str, teacher: Teacher, rows: torch.Tensor, padding: bool = False) -> None:
    """One micro-batch of `rows` (local ids) scored by teacher `name`: teacher forward(s), student forward, Eq. 11's
    share backpropagated; its sums, labels and costs go into `ctx.res`. padding=True (sharded lockstep): the same
    forwards and backward with zero weights, on the student's prompts for every view; nothing is counted or
    labelled."""
    acc, rollouts, res, cfg = ctx.accelerator, ctx.rollouts, ctx.res, ctx.cfg
    device = acc.device
    prompt_ids = rollouts.prompt_index[rows].tolist()
    _sync(device)
    t0 = time.perf_counter()
    t_inputs = []
    for view in ctx.views:
        prompts = [ctx.student_prompts[p] if padding else ctx.teacher_prompt(name, view, p) for p in prompt_ids]
        inputs, mask, width = micro_batch_inputs(prompts, rollouts, rows, ctx.pad_id, device)
        t_inputs.append(inputs)
        if not padding:
            cost = res.teachers[ctx.label(name, view)]
            cost.rows += len(rows)
            cost.tokens += int(mask.sum()) + sum(len(p) for p in prompts)
            cost.padded_tokens += inputs["input_ids"].numel()
    s_inputs, _, _ = micro_batch_inputs([ctx.student_prompts[p] for p in prompt_ids], rollouts, rows, ctx.pad_id, device)
    weights = budgeted_weights(ctx.row_weights[rows].to(device), mask, res.global_tokens) * ctx.scale  # Eq. 11
    if padding:
        weights = torch.zeros_like(weights)
    response = rollouts.response_ids[rows, :width].to(device)  # (n, T)
    old_logp = rollouts.logp[rows, :width].to(device)  # (n, T)
    extras: dict = {}
    with ctx.autocast(), teacher.uncounted() if padding else nullcontext():
        loss, per_token, u, seconds = micro_batch_loss(
            ctx.student, teacher, s_inputs, t_inputs, mask, width, weights, cfg, response, old_logp, extras
        )  # fmt: skip
    reshard(teacher.model)  # sharded: the teacher's gathered root (LM head) is freed before the student's backward
    acc.backward(loss)
    del per_token
    _sync(device)
    if padding:
        return
    res.loss_sum += float(loss.detach()) * res.global_tokens / ctx.scale  # sum of w_t D over S's tokens
    res.utility[rows] = u.float().cpu()
    if "gate" in extras:
        res.gate_sum[rows] = extras["gate"].sum(-1).float().cpu()
        res.teacher_logp_sum[rows] = extras["teacher_logp"].sum(-1).float().cpu()
    for view, sec in zip(ctx.views, seconds):
        res.teachers[ctx.label(name, view)].seconds += sec
    res.student_s += time.perf_counter() - t0 - sum(seconds)


@dataclass
class StepBatch:
    """What the loop hands an objective for one step: this rank's part of it."""

    step: int
    records: list
    """This rank's records of the step (local prompt j is records[j])."""
    record_ids: list[int]
    rollouts: Rollouts
    student_prompts: list[EncodedPrompt]
    selected: torch.Tensor
    """Local row ids of S."""
    teacher_prompt: Callable
    """(teacher name, view, j) -> local prompt j in a teacher's view, encoded once per step with that teacher's
    processor; a view's randomness (the mask) is seeded by (seed, step, record id)."""
    route: list
    """Per local row: the name of its teacher (None outside C)."""


class Distillation:
    """The family's objective (`opd.methods`: student view, teacher view(s), support, divergence, token
    weight): Eq. 11 on S against the run's teacher(s) (`distill`), and the teachers' update after a valid
    step (the EMA of Algorithm 1 line 13, every `ema_every` steps; frozen teachers do not move)."""

    def __init__(self, run):
        self.run = run

    @property
    def labels(self) -> list[str]:
        """The ledger labels of every teacher forward this objective can run, in a fixed order."""
        t = self.run.teachers
        return [t.label(n, v) for n in t.names for v in self.run.teacher_views]

    def distill_config(self) -> DistillConfig:
        return self.run.cfg.distill()

    def __call__(self, batch: StepBatch, row_weights: torch.Tensor | None = None, sync: bool = True) -> DistillResult:
        run = self.run
        res = distill(
            run.acc, run.student, run.teachers.teachers, batch.rollouts, batch.student_prompts, batch.teacher_prompt,
            batch.selected, self.distill_config(), run.ids["pad"], run.autocast, run.teacher_views, route=batch.route,
            row_weights=row_weights, sync=sync, label=run.teachers.label,
        )  # fmt: skip
        for lab in self.labels:  # every label on every rank, in order (the ledger's all-reduce)
            res.teachers.setdefault(lab, TeacherCost())
        res.teachers = {lab: res.teachers[lab] for lab in self.labels}
        return res

    def after_update(self, step: int) -> None:
        """Algorithm 1, line 13 after a valid update, every `ema_every` steps (DAPD's snapshot: tau = 1)."""
        cfg = self.run.cfg
        if (step + 1) % max(1, cfg.ema_every) == 0:
            for t in dict.fromkeys(self.run.teachers.teachers.values()):  # a shared teacher once
                t.update(self.run.policy, cfg.ema_tau)

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
