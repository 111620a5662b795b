"""OPOD: on-policy omni distillation (arXiv 2607.20918), on Algorithm 1's loop. Medium confidence.

There is no public code; the formulas come from a third-party transcription
(`../shared/notes/seed-family.md`). Every constant the transcription does not give is a flag of
`train.py` with a stated default (marked "guess" below).

Each response is routed to the teacher of its kind (`--teachers route.json`: a record field such as `task`
or `modality` -> a teacher checkpoint; `--teacher-model` for one), separate frozen checkpoints, not the
policy's own weights. Per step, on the selected rows S (K = floor(rho |C|) rows, chosen before any teacher
forward; OPOD queries every row: its settings are --policy full --rho 1):

1. Gated distillation (`opd.distill` with the token weight 'gate'). For row i routed to teacher m_i:

       c_t = ReLU(log pi_T(y_t) - log pi_theta(y_t))        (`weights.teacher_gate`, detached)
       L_tc = sum_{i in S, t} beta_{m_i} c_t D_t / sum_{i in S} T_i

   D_t the family's Eq. 3 (student top-k + tail, JSD_alpha) against the routed teacher. Guess: the
   transcription's L_tc = mean_i beta_{m_i} c_i has no gradient with a detached gate; we read c_t as the
   weight of the per-token divergence (as OPD-V's trust region), with the family's token mean.
2. The per-teacher controller (`GateController`, `controller_step`): after a valid update,

       beta_m <- clip(beta_m + eta (cbar_m - eps_m), beta_min, beta_max)

   cbar_m the step's mean gate over teacher m's tokens (all ranks), eps_m = max(mean of cbar_m over the
   first `--opod-warmup` (10) steps with tokens of m, `--opod-eps-floor` 0.02). beta_m stays at
   `--opod-beta-init` during its warm-up (guess). beta_min 0.1 (paper); beta_init 1.0, beta_max 2.0,
   eta 0.1 (guesses).
3. The verification reward (`verified_reward`) of each row of S:

       A = 1[correct] clip(mean_t log pi_T(y_t), -C, 0)                 (`answer_confidence`)
       B = clip(log pi_T(a* | x, z) - log pi_T(a* | x), -C, C)         (`verification_gain`)
       r = r_task + 0.2 A + 0.1 B,  C = 2

   r_task = 1 when the project's answer parser (`opd.eval.answers`, `task_reward`) finds the record's
   answer in the decoded response, else 0. Guesses: A's "answer tokens" are all of the response's valid
   tokens (our responses are the answer); "x, z" is the teacher's view with the response z in the reference
   slot of `views.REFERENCE_TEMPLATE` (DAPD's bridge), "x" the teacher's own prompt, a* the answer's tokens
   (no EOS), log-probs summed over a*. B costs two more teacher forwards per row: the ledger counts them
   under the views 'verify' (one per row) and 'answer' (one per prompt with a selected row);
   `--opod-reward-b 0` skips them.
4. A group-relative policy-gradient term over each prompt's rows in S (`group_advantages`):

       Ahat_i = (r_i - mean_g r) / (std_g r + eps)       (std with Bessel's correction, as TRL's GRPO; eps 1e-4)
       L_pg = - sum_{i in S, t} Ahat_i log pi_theta(y_t) / sum_{i in S} T_i

   on-policy (one update per batch: the importance ratio is 1 and PPO's clip inactive), so its gradient is
   the REINFORCE form computed here (`chunked.weighted_logp_from_hidden`). A group is the rows of S from one
   prompt (the reward needs the teacher, which never sees an unselected row); a group of one row has
   advantage 0. Total: L_tc + `--opod-pg-weight` (1) L_pg + `--opod-kl` (0, guess: the paper's weight is not
   known) KL(pi_theta || pi_ref), the KL by the k3 estimator on the sampled tokens against the initial policy,
   its coefficient from the sampling log-probs (on-policy).

The teachers see the student's own view by default (`--teacher-view` changes it). Sharded (`--fsdp`): the
teachers (and the KL's reference) are sharded like the policy; the distillation pass, B's forwards and the
policy-gradient pass each run as many micro-batches per model on every rank as on the busiest one, the missing
ones zero-weighted (or uncounted) forwards on the rank's row 0.
"""

from __future__ import annotations

import math
import time
from contextlib import nullcontext

import torch

from opd.chunked import sampled_logp_from_hidden, weighted_logp_from_hidden
from opd.distill import (
    DistillResult, Distillation, StepBatch, TeacherCost, completion_inputs, dummy_backward, micro_batch_inputs,
    plan_micro_batches,
)  # fmt: skip
from opd.eval.answers import exact_match, parse_choice, parse_yes_no
from opd.eval.benchmarks import split_options
from opd.sharding import is_sharded, reshard
from opd.teacher import Teacher, lm_head_weight, response_hidden
from opd.views import View, get_view, reference_prompt


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


class OPOD:
    """The OPOD objective (see the module docstring)."""

    def __init__(self, run):
        self.run = run
        cfg = run.cfg
        self.distillation = Distillation(run)
        self.controller = GateController(run.teachers.names, cfg.opod_beta_init, cfg.opod_beta_min, cfg.opod_beta_max,
                                         cfg.opod_eta, cfg.opod_warmup, cfg.opod_eps_floor)  # fmt: skip
        self.reference = Teacher(run.load_frozen(run.initial_model, "--model")) if cfg.opod_kl > 0 else None
        self.pending: dict[str, float | None] = {}

    @property
    def labels(self) -> list[str]:
        t = self.run.teachers
        extra = ("verify", "answer") if self.run.cfg.opod_reward_b else ()
        return self.distillation.labels + [t.label(n, v) for n in t.names for v in extra]

    def __call__(self, batch: StepBatch) -> DistillResult:
        run, acc, cfg = self.run, self.run.acc, self.run.cfg
        ro, sel, names = batch.rollouts, batch.selected, self.run.teachers.names
        beta = torch.tensor([self.controller.beta.get(r, 0.0) if r is not None else 0.0 for r in batch.route])
        res = self.distillation(batch, row_weights=beta, sync=False)  # 1. L_tc, gated, beta per row
        res.teachers = {lab: res.teachers.get(lab, TeacherCost()) for lab in self.labels}
        res.metrics = {f"beta_{n}": self.controller.beta[n] for n in names}
        self.pending = {}
        if res.global_tokens == 0:  # S is empty everywhere: nothing more to do (every rank alike)
            return res
        rows = sel.tolist()
        lengths = ro.lengths.double()
        tok = run.processor.tokenizer
        replies = {i: tok.decode(ro.response_ids[i, : int(ro.lengths[i])], skip_special_tokens=True) for i in rows}
        r_task = torch.tensor([task_reward(replies[i], batch.records[int(ro.prompt_index[i])].problem,
                                           batch.records[int(ro.prompt_index[i])].answer) for i in rows], dtype=torch.float64)  # fmt: skip
        mean_t = (res.teacher_logp_sum.double()[sel] / lengths[sel].clamp(min=1)) if rows else torch.zeros(0, dtype=torch.float64)
        a = answer_confidence(r_task > 0.5, mean_t, cfg.opod_reward_clip)
        b = self._verification(batch, res, replies) if cfg.opod_reward_b else torch.zeros(len(rows), dtype=torch.float64)
        reward = verified_reward(r_task, a, b, cfg.opod_reward_a, cfg.opod_reward_b)
        adv = group_advantages(reward, ro.prompt_index[sel], cfg.opod_adv_eps) if rows else reward
        pg_value, kl_value = self._policy_gradient(batch, res, adv)  # 4. L_pg (+ KL), the step's synced backward
        # The controller's statistics and the metrics, summed over ranks (one collective, every rank).
        route = [batch.route[i] for i in rows]
        per_teacher = []
        for n in names:
            mine = torch.tensor([r == n for r in route], dtype=torch.bool)
            per_teacher += [float(res.gate_sum[sel][mine].sum()) if rows else 0.0, float(ro.lengths[sel][mine].sum()) if rows else 0.0]
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

    def _verification(self, batch: StepBatch, res: DistillResult, replies: dict) -> torch.Tensor:
        """B of every row of S: the routed teacher's log-prob of the answer after the response (in the reference slot)
        minus without it; two forward kinds, counted under the views 'verify' and 'answer'. Sharded: every rank runs
        as many forwards per teacher as the busiest one (the rest on row 0, uncounted)."""
        run = self.run
        ro, tok = batch.rollouts, run.processor.tokenizer
        rows = batch.selected.tolist()
        view = run.teacher_views[0]
        answer_ids = {j: torch.tensor(tok(batch.records[j].answer, add_special_tokens=False)["input_ids"], dtype=torch.long)
                      for j in {int(ro.prompt_index[i]) for i in rows}}  # fmt: skip
        jobs = {}  # teacher -> [(kind, keys, prompts, completions)]
        for name in run.teachers.names:
            teacher = run.teachers.teachers[name]
            mine = [k for k, i in enumerate(rows) if batch.route[i] == name]
            prompts_of = sorted({int(ro.prompt_index[rows[k]]) for k in mine})
            jobs[name] = [("answer", group, [batch.teacher_prompt(name, view, j) for j in group], [answer_ids[j] for j in group])
                          for group in _chunks(prompts_of, run.cfg.micro_batch)]  # log pi_T(a* | x): once per prompt
            for group in _chunks(mine, run.cfg.micro_batch):  # log pi_T(a* | x, z): once per row
                prompts = []
                for k in group:
                    record = batch.records[int(ro.prompt_index[rows[k]])]
                    images, _ = get_view(view)(record)
                    text = replies[rows[k]]
                    v = View(lambda r, seed, images=images, text=text: (images, reference_prompt(r.problem, text)))
                    prompts.append(run.encode(v, record, 0, teacher.processor))
                jobs[name].append(("verify", group, prompts, [answer_ids[int(ro.prompt_index[rows[k]])] for k in group]))
        steps = {n: len(v) for n, v in jobs.items()}
        if is_sharded(run.student):
            counts = run.acc.gather(torch.tensor([[steps[n] for n in jobs]], device=run.acc.device)).max(0).values
            steps = dict(zip(jobs, counts.tolist()))
        without, with_z = {}, {}
        pad = ("padding", [], [batch.student_prompts[int(ro.prompt_index[0])]], [ro.response_ids[0, : int(ro.lengths[0])]])
        for name in run.teachers.names:
            teacher = run.teachers.teachers[name]
            for step in range(steps[name]):
                kind, keys, prompts, completions = jobs[name][step] if step < len(jobs[name]) else pad
                sums = self._answer_logp(teacher, name, kind, prompts, completions, res)
                (without if kind == "answer" else with_z).update(zip(keys, sums))
            reshard(teacher.model)
        out = torch.zeros(len(rows), dtype=torch.float64)
        for k, i in enumerate(rows):
            if k in with_z:
                out[k] = verification_gain(torch.tensor(with_z[k]), torch.tensor(without[int(ro.prompt_index[i])]),
                                           run.cfg.opod_reward_clip)  # fmt: skip
        return out

    @torch.no_grad()
    def _answer_logp(self, teacher, name: str, view: str, prompts, completions, res: DistillResult) -> list[float]:
        """sum over the completion's tokens of log pi_T, for each prompt + completion (one teacher forward)."""
        run = self.run
        device = run.acc.device
        _sync(device)
        t0 = time.perf_counter()
        inputs, mask, ids, width = completion_inputs(prompts, completions, run.ids["pad"], device)
        with run.autocast(), teacher.uncounted() if view == "padding" else nullcontext():
            h = teacher.hidden(inputs, width)[mask]  # (P, H)
            logp = sampled_logp_from_hidden(h, lm_head_weight(teacher.model), ids[mask], run.cfg.loss_chunk or max(1, h.shape[0]))
        sums = torch.zeros(mask.shape, dtype=torch.float64, device=device).masked_scatter(mask, logp.double()).sum(-1)
        _sync(device)
        if view == "padding":  # a sharded rank's lockstep forward: nothing counted
            return []
        cost = res.teachers[run.teachers.label(name, view)]
        cost.seconds += time.perf_counter() - t0
        cost.rows += len(prompts)
        cost.tokens += int(mask.sum()) + sum(len(p) for p in prompts)
        cost.padded_tokens += inputs["input_ids"].numel()
        return sums.cpu().tolist()

    def _policy_gradient(self, batch: StepBatch, res: DistillResult, adv: torch.Tensor) -> tuple[float, float]:
        """Backpropagates -pg_weight sum Ahat_i log pi_theta(y_t) / N (+ the KL) on this rank's rows of S, the last
        backward synchronising DDP's gradients (a rank without rows: a zero-weighted one). Returns this rank's
        share of the PG value and of the KL value."""
        run, acc, cfg = self.run, self.run.acc, self.run.cfg
        ro, sel, device = batch.rollouts, batch.selected, acc.device
        scale, n_global = acc.num_processes, res.global_tokens
        plan = [sel[g] for g in plan_micro_batches(ro.lengths[sel], cfg.micro_batch, cfg.micro_batch_tokens)] if sel.numel() else []
        steps = len(plan)
        if is_sharded(run.student):  # lockstep: as many micro-batches as the busiest rank, the rest zero-weighted on row 0
            steps = int(acc.gather(torch.tensor([len(plan)], device=device)).max())
        elif not plan:  # keep this rank in DDP's gradient all-reduce
            dummy_backward(acc, run.student, ro, batch.student_prompts, run.ids["pad"], run.autocast)
            return 0.0, 0.0
        adv_of = dict(zip(sel.tolist(), adv.tolist())) | ({} if 0 in sel.tolist() else {0: 0.0})
        pg_value = kl_value = 0.0
        for j in range(steps):
            padding = j >= len(plan)
            rows = torch.tensor([0]) if padding else plan[j]
            with nullcontext() if j == len(plan) - 1 or padding else acc.no_sync(run.student):
                pids = ro.prompt_index[rows].tolist()
                inputs, mask, width = micro_batch_inputs([batch.student_prompts[p] for p in pids], ro, rows, run.ids["pad"], device)
                y = ro.response_ids[rows, :width].to(device)[mask]  # (P,)
                a = torch.tensor([adv_of[i] for i in rows.tolist()], device=device).unsqueeze(-1).expand(mask.shape)[mask]
                coef = -cfg.opod_pg_weight * a / n_global  # (P,) d L_pg / d log pi(y_t)
                k3 = None
                if self.reference is not None:  # KL(pi_theta || pi_ref), k3 on the sampled tokens
                    with run.autocast():
                        h_r = self.reference.hidden(inputs, width)[mask]
                        ref = sampled_logp_from_hidden(h_r, lm_head_weight(self.reference.model), y, cfg.loss_chunk or max(1, h_r.shape[0]))
                    old = ro.logp[rows, :width].to(device)[mask].to(ref.dtype)  # (P,) log pi_theta at sampling
                    k3 = torch.exp(ref - old) - (ref - old) - 1.0
                    coef = coef + cfg.opod_kl * (1.0 - torch.exp(ref - old)) / n_global  # d k3 / d log pi
                    reshard(self.reference.model)
                if padding:
                    coef, k3 = torch.zeros_like(coef), None
                with run.autocast():
                    h = response_hidden(run.student, inputs, width)[mask]  # (P, H)
                    w = lm_head_weight(getattr(run.student, "module", run.student))
                    loss, logp = weighted_logp_from_hidden(h, w, y, coef.double() * scale, cfg.loss_chunk or max(1, h.shape[0]))
                acc.backward(loss)
                if padding:
                    continue
                pg_value += float((-cfg.opod_pg_weight * a.double() * logp.double()).sum()) / n_global
                if k3 is not None:
                    kl_value += cfg.opod_kl * float(k3.double().sum()) / n_global
        return pg_value, kl_value

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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
