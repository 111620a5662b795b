"""OPOD: on-policy omni distillation (arXiv 2607.20918), on Algorithm 1's loop. Medium confidence.

There is no public code; the formulas come from a third-party transcription (summarised in docs/FAMILY.md), and
every constant it does not give is a flag of `train.py` with a stated default (a guess). Each response is routed to
the teacher of its kind (`--teachers route.json`, or `--teacher-model`). Per step, on the selected rows S:

1. gated distillation: Eq. 3 weighted per token by beta_m ReLU(log pi_T - log pi_theta) (guess: a per-token weight);
2. the per-teacher controller (`GateController`) moving beta_m towards its warm-up gate level;
3. the verification reward (`verified_reward`): task correctness (`opd.answers`) + 0.2 A + 0.1 B, B costing two
   teacher forwards per row (`--opod-reward-b 0` skips them);
4. a group-relative policy-gradient term over each prompt's rows in S (`group_advantages`), plus an optional KL.

Sharded (`--fsdp`): teachers and the KL's reference are sharded like the policy; every rank runs as many
micro-batches as the busiest one.
Details (formulas, guesses, constants): docs/MODULES.md#opdmethodsopod."""

from __future__ import annotations

import math

import torch

from opd.answers.choice import parse_choice
from opd.answers.free_form import exact_match
from opd.answers.options import split_options
from opd.answers.yes_no import parse_yes_no
from opd.data.family_views import reference_prompt
from opd.data.records import StepBatch, View, get_view
from opd.maths.chunked import sampled_logp_from_hidden
from opd.methods.lockstep import MicroBatch, lockstep
from opd.methods.interface import Objective, ObjectiveContext, ObjectiveResult
from opd.methods.objective import distill, distill_labels
from opd.methods.policy_gradient import PolicyGradient, row_advantages
from opd.methods.specs import OPOD_SPEC, OPODConfig
from opd.models.ema_teacher import Stopwatch, book_forward
from opd.models.hidden import completion_inputs, lm_head_weight


def task_reward(reply: str, problem: str, answer: str) -> float:
    """r_task: 1.0 when the reply's parsed answer is the record's, else 0.0. Multiple choice (options in the
    problem and a letter answer): `parse_choice`; a yes/no answer: `parse_yes_no`; else `exact_match`."""
    _, options = split_options(problem.replace("<image>", ""))
    if options and answer.strip().upper() in options:
        pred = parse_choice(reply, options)
        return float(pred is not None and pred.upper() == answer.strip().upper())
    if answer.strip().lower() in ("yes", "no"):
        return float(parse_yes_no(reply) == answer.strip().lower())
    return float(exact_match(reply, answer))


def answer_confidence(correct: torch.Tensor, mean_teacher_logp: torch.Tensor, clip: float = 2.0) -> torch.Tensor:
    """OPOD's A = 1[correct] clip(mean_t log pi_T(y_t), -C, 0), C = clip. (...) -> (...)."""
    return correct.to(mean_teacher_logp.dtype) * mean_teacher_logp.clamp(min=-clip, max=0.0)


def verification_gain(logp_with: torch.Tensor, logp_without: torch.Tensor, clip: float = 2.0) -> torch.Tensor:
    """OPOD's B = clip(log pi_T(a* | x, z) - log pi_T(a* | x), -C, C), C = clip. (...) -> (...)."""
    return (logp_with - logp_without).clamp(min=-clip, max=clip)


def verified_reward(r_task: torch.Tensor, a: torch.Tensor, b: torch.Tensor, weight_a: float = 0.2,
                    weight_b: float = 0.1) -> torch.Tensor:
    """OPOD's verification reward r = r_task + 0.2 A + 0.1 B (weights as arguments). (...) -> (...)."""
    return r_task + weight_a * a + weight_b * b


def group_advantages(rewards: torch.Tensor, groups: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """Group-relative advantages (GRPO): for row i of group g,

        Ahat_i = (r_i - mean_g r) / (std_g r + eps),   std_g with Bessel's correction (n - 1),

    and 0 for a group of one row (no baseline). rewards, groups (n,) -> (n,) float64."""
    r = rewards.double()
    out = torch.zeros_like(r)
    for g in torch.unique(groups).tolist():
        idx = (groups == g).nonzero().squeeze(-1)
        if idx.numel() < 2:
            continue
        x = r[idx]
        out[idx] = (x - x.mean()) / (x.std(unbiased=True) + eps)
    return out


def controller_step(beta: float, gate_mean: float, eps: float, eta: float, beta_min: float, beta_max: float) -> float:
    """OPOD's per-teacher controller: beta <- clip(beta + eta (cbar - eps), beta_min, beta_max)."""
    return min(beta_max, max(beta_min, beta + eta * (gate_mean - eps)))


class GateController:
    """beta_m per teacher: at `beta_init` through a warm-up of `warmup` observed steps whose mean gate sets
    eps_m = max(mean, eps_floor); then `controller_step` on every observed step. A step without tokens of
    teacher m is not observed for m. Its state is saved in checkpoints (resume-exact)."""

    def __init__(self, names, beta_init=1.0, beta_min=0.1, beta_max=2.0, eta=0.1, warmup=10, eps_floor=0.02):
        self.beta = {n: float(beta_init) for n in names}
        self.eps: dict[str, float | None] = {n: None for n in names}
        self.warm = {n: [0.0, 0] for n in names}  # sum of cbar, steps observed
        self.beta_min, self.beta_max, self.eta, self.warmup, self.eps_floor = beta_min, beta_max, eta, warmup, eps_floor

    def observe(self, name: str, gate_mean: float | None) -> None:
        if gate_mean is None or not math.isfinite(gate_mean):
            return
        if self.eps[name] is None:
            self.warm[name][0] += gate_mean
            self.warm[name][1] += 1
            if self.warm[name][1] >= self.warmup:
                self.eps[name] = max(self.warm[name][0] / self.warm[name][1], self.eps_floor)
            return
        self.beta[name] = controller_step(self.beta[name], gate_mean, self.eps[name], self.eta, self.beta_min, self.beta_max)

    def state_dict(self) -> dict:
        return {"beta": dict(self.beta), "eps": dict(self.eps), "warm": {k: list(v) for k, v in self.warm.items()}}

    def load_state_dict(self, state: dict) -> None:
        if state:
            self.beta, self.eps = dict(state["beta"]), dict(state["eps"])
            self.warm = {k: list(v) for k, v in state["warm"].items()}


class OPOD(Objective):
    """The OPOD objective (see the module docstring)."""

    spec = OPOD_SPEC  # its name, Config (OPODConfig), refuses (`opd.methods.specs`)

    def __init__(self, ctx: ObjectiveContext, config: OPODConfig | None = None, initial_teacher=None):
        super().__init__(ctx, config or OPODConfig(), initial_teacher)
        c = self.config
        self.controller = GateController(ctx.teachers.names, c.beta_init, c.beta_min, c.beta_max, c.eta, c.warmup,
                                         c.eps_floor)  # fmt: skip
        self.reference = initial_teacher() if c.kl > 0 else None
        self.pg = PolicyGradient(ctx, c.pg_weight, reference=self.reference, kl=c.kl)  # 4. L_pg (+ the KL)
        self.pending: dict[str, float | None] = {}

    @property
    def labels(self) -> list[str]:
        t = self.ctx.teachers
        extra = ("verify", "answer") if self.config.reward_b else ()
        return distill_labels(self.ctx) + [t.label(n, v) for n in t.names for v in extra]  # the pass's, then B's

    def __call__(self, batch: StepBatch) -> ObjectiveResult:
        ctx, c = self.ctx, self.config
        acc = ctx.accelerator
        ro, sel, names = batch.rollouts, batch.selected, ctx.teachers.names
        beta = torch.tensor([self.controller.beta.get(r, 0.0) if r is not None else 0.0 for r in batch.route])
        token_sums: dict = {}  # per row: sum of the gate c_t and of log pi_T(y_t)
        pass_ = ctx.distill_pass or distill  # the run's pass (the fused one with a token weight)
        res = pass_(self, batch, row_weights=beta, sync=False, token_sums=token_sums, labels=self.labels)  # 1. L_tc
        res.metrics = {f"beta_{n}": self.controller.beta[n] for n in names}
        self.pending = {}
        if res.empty:  # S is empty everywhere: nothing more to do (every rank alike)
            return res
        rows = sel.tolist()
        lengths = ro.lengths.double()
        tok = ctx.tokenizer
        replies = {i: tok.decode(ro.response_ids[i, : int(ro.lengths[i])], skip_special_tokens=True) for i in rows}
        r_task = torch.tensor([task_reward(replies[i], batch.records[int(ro.prompt_index[i])].problem,
                                           batch.records[int(ro.prompt_index[i])].answer) for i in rows], dtype=torch.float64)  # fmt: skip
        mean_t = (token_sums["teacher_logp"].double()[sel] / lengths[sel].clamp(min=1)) if rows else torch.zeros(0, dtype=torch.float64)
        a = answer_confidence(r_task > 0.5, mean_t, c.reward_clip)
        b = self._verification(batch, res, replies) if c.reward_b else torch.zeros(len(rows), dtype=torch.float64)
        reward = verified_reward(r_task, a, b, c.reward_a, c.reward_b)
        adv = group_advantages(reward, ro.prompt_index[sel], c.adv_eps) if rows else reward
        adv_of = dict(zip(rows, adv.tolist()))  # 4. L_pg (+ KL) over N = the distillation's denominator, synced
        pg_value, kl_value = self.pg.run(batch, row_advantages(adv_of), res.global_tokens)
        # The controller's statistics and the metrics, summed over ranks (one collective, every rank).
        route = [batch.route[i] for i in rows]
        per_teacher = []
        for n in names:
            mine = torch.tensor([r == n for r in route], dtype=torch.bool)
            per_teacher += [float(token_sums["token_weight"][sel][mine].sum()) if rows else 0.0,
                            float(ro.lengths[sel][mine].sum()) if rows else 0.0]  # fmt: skip
        stats = [float(reward.sum()), float(r_task.sum()), float(a.sum()), float(b.sum()), len(rows), pg_value, kl_value,
                 *per_teacher]  # fmt: skip
        total = acc.reduce(torch.tensor(stats, dtype=torch.float64, device=acc.device), "sum").cpu().tolist()
        n = max(1.0, total[4])
        res.metrics |= {"reward_mean": total[0] / n, "task_reward_mean": total[1] / n, "reward_a_mean": total[2] / n,
                        "reward_b_mean": total[3] / n, "pg_loss": total[5], "kl_loss": total[6]}  # fmt: skip
        for k, name in enumerate(names):
            g, t = total[7 + 2 * k], total[8 + 2 * k]
            self.pending[name] = g / t if t else None
            res.metrics[f"gate_mean_{name}"] = g / t if t else float("nan")
        res.loss_share = res.loss_sum / res.global_tokens + pg_value + kl_value
        return res

    def _verification(self, batch: StepBatch, res: ObjectiveResult, replies: dict) -> torch.Tensor:
        """B of every row of S: the routed teacher's log-prob of the answer after the response (in the reference slot)
        minus without it; two forward kinds, counted under the views 'verify' and 'answer'. Sharded: every rank runs
        as many forwards per teacher as the busiest one (the rest on row 0, uncounted)."""
        ctx = self.ctx
        ro, tok = batch.rollouts, ctx.tokenizer
        rows = batch.selected.tolist()
        view = ctx.teacher_views[0]
        micro = ctx.loss.micro_batch
        answer_ids = {j: torch.tensor(tok(batch.records[j].answer, add_special_tokens=False)["input_ids"], dtype=torch.long)
                      for j in {int(ro.prompt_index[i]) for i in rows}}  # fmt: skip
        jobs = {}  # teacher -> [(kind, keys, prompts, completions)]
        for name in ctx.teachers.names:
            teacher = ctx.teachers.teachers[name]
            mine = [k for k, i in enumerate(rows) if batch.route[i] == name]
            prompts_of = sorted({int(ro.prompt_index[rows[k]]) for k in mine})
            jobs[name] = [("answer", group, [batch.teacher_prompt(name, view, j) for j in group], [answer_ids[j] for j in group])
                          for group in _chunks(prompts_of, micro)]  # log pi_T(a* | x): once per prompt
            for group in _chunks(mine, micro):  # log pi_T(a* | x, z): once per row
                prompts = []
                for k in group:
                    record = batch.records[int(ro.prompt_index[rows[k]])]
                    images, _ = get_view(view)(record)
                    text = replies[rows[k]]
                    v = View(lambda r, seed, images=images, text=text: (images, reference_prompt(r.problem, text)))
                    prompts.append(ctx.encode(v, record, 0, teacher.processor))
                jobs[name].append(("verify", group, prompts, [answer_ids[int(ro.prompt_index[rows[k]])] for k in group]))
        without, with_z = {}, {}
        pad = ("padding", [], [batch.student_prompts[int(ro.prompt_index[0])]], [ro.response_ids[0, : int(ro.lengths[0])]])
        for mb in lockstep(ctx, batch, jobs, sync=False, release=ctx.teacher_models):  # teacher forwards only: nothing to sync
            kind, keys, prompts, completions = mb.item if mb.real else pad
            sums = self._answer_logp(mb, ctx.teachers.teachers[mb.group], kind, prompts, completions, res)
            (without if kind == "answer" else with_z).update(zip(keys, sums))
        out = torch.zeros(len(rows), dtype=torch.float64)
        for k, i in enumerate(rows):
            if k in with_z:
                out[k] = verification_gain(torch.tensor(with_z[k]), torch.tensor(without[int(ro.prompt_index[i])]),
                                           self.config.reward_clip)  # fmt: skip
        return out

    @torch.no_grad()
    def _answer_logp(self, mb: MicroBatch, teacher, view: str, prompts, completions, res: ObjectiveResult) -> list[float]:
        """sum over the completion's tokens of log pi_T, for each prompt + completion (one teacher forward of
        teacher `mb.group`; padding: uncounted, nothing returned)."""
        ctx = self.ctx
        device = ctx.device
        watch = Stopwatch(device)
        inputs, mask, ids, width = completion_inputs(prompts, completions, ctx.ids["pad"], device)
        with ctx.autocast(), mb.teacher(teacher):
            h = teacher.hidden(inputs, width)[mask]  # (P, H)
            logp = sampled_logp_from_hidden(h, lm_head_weight(teacher.model), ids[mask], ctx.loss.chunk or max(1, h.shape[0]))
        sums = torch.zeros(mask.shape, dtype=torch.float64, device=device).masked_scatter(mask, logp.double()).sum(-1)
        seconds = watch.seconds()
        if not mb.real:  # a sharded rank's lockstep forward: nothing counted
            return []
        book_forward(res.teachers[ctx.teachers.label(mb.group, view)], inputs, mask, sum(len(p) for p in prompts), seconds)
        return sums.cpu().tolist()

    def after_update(self, step: int) -> None:
        """The controller's step on each teacher's mean gate of this step (external teachers do not move)."""
        for name, mean in self.pending.items():
            self.controller.observe(name, mean)

    def state_dict(self) -> dict:
        return {"controller": self.controller.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.controller.load_state_dict(state.get("controller", {}))


def _chunks(items: list, n: int) -> list[list]:
    return [items[k : k + n] for k in range(0, len(items), max(1, n))]
