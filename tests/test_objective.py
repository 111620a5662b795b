"""The objective seam (opd/methods/interface.py; the default pass: opd/methods/objective.py): an objective runs with
an ObjectiveContext alone, built here by hand from a model, a teacher and an encoder, with no opd.run.Run; its result
is Eq. 11 written out on full logits."""

from contextlib import nullcontext

import pytest
import torch
from accelerate import Accelerator
from float64 import float64_model

from opd.models.chat import collate, encode_prompt
from opd.methods.dapd import DAPD
from opd.data.sources import load_records
from opd.methods.objective import Distillation
from opd.maths.family import budgeted_loss, topk_divergence
from opd.models.ema_teacher import EMATeacher, Teacher, TeacherSet
from opd.models.settings import EMAConfig
from opd.models.chat import response_logits
from opd.maths.loss import LossConfig
from opd.methods.table import METHODS
from opd.models.loading import load_model, load_processor, special_ids
from opd.methods.interface import Objective, ObjectiveContext
from opd.methods.lockstep import lockstep
from opd.methods.objectives import objective_class
from opd.methods.specs import DAPDConfig
from opd.engine.rollout import Rollouts, response_mask
from opd.data.records import StepBatch, get_view

F64 = torch.float64


@pytest.fixture(autouse=True, scope="module")
def float64_qwen():
    """The same computation grouped two ways (micro-batches of 2 against all rows at once): float64 throughout
    (tests/float64.py), so the comparison holds to float64 rounding on any CPU."""
    float64_model()


def context(tiny, teachers, **kw) -> ObjectiveContext:
    """An ObjectiveContext from a float64 tiny model, with nothing of train.py."""
    model_dir = str(tiny[0])
    student = load_model(model_dir, "float64").train()
    processor = load_processor(model_dir)
    acc = Accelerator(cpu=True)

    def encode(view, record, seed=0, processor_=None, thinking=None):
        images, question = (get_view(view) if isinstance(view, str) else view)(record, seed)
        return encode_prompt(processor_ or processor, images, question, bool(thinking), 512)

    base = dict(accelerator=acc, student=student, model=lambda: student, teachers=teachers(student, model_dir),
                encode=encode, processor=processor, ids=special_ids(student), autocast=nullcontext, student_view="full",
                teacher_views=("crop",), loss=LossConfig(topk=7, micro_batch=2, chunk=3, support="student_tail"), max_response_len=8,
                ema=EMAConfig(tau=0.5, every=1))  # fmt: skip
    return ObjectiveContext(**(base | kw))


def batch_of(ctx: ObjectiveContext, tiny, selected: list[int]) -> StepBatch:
    """Four prompts x 2 responses of random characters (EOS last), S = `selected`."""
    records = [r for r in load_records(tiny[1]) if r.eligible][:4]
    prompts = [ctx.encode("full", r) for r in records]
    g = torch.Generator().manual_seed(1)
    chars = torch.tensor(ctx.tokenizer.convert_tokens_to_ids(list("abcdefgh")))
    ids = chars[torch.randint(0, 8, (8, 6), generator=g)]
    for i, length in enumerate([6, 3, 5, 2, 4, 6, 1, 5]):
        ids[i, length - 1] = ctx.ids["eos"][0]
        ids[i, length:] = ctx.ids["pad"]
    mask = response_mask(ids, ctx.ids["eos"])
    index = torch.arange(4).repeat_interleave(2)
    ro = Rollouts(index, ids, mask, torch.zeros(8, 6), torch.zeros(8, 6), torch.tensor([len(prompts[j]) for j in index]),
                  torch.ones(8, dtype=torch.bool))  # fmt: skip
    cache = {}

    def teacher_prompt(name, view, j):
        if (name, view, j) not in cache:
            cache[name, view, j] = ctx.encode(view, records[j], j)
        return cache[name, view, j]

    return StepBatch(0, records, list(range(4)), ro, prompts, torch.tensor(selected), teacher_prompt, ["teacher"] * 8)


def perturbed_ema(student, _path):
    teacher = EMATeacher(student)
    with torch.no_grad():
        g = torch.Generator().manual_seed(7)
        for p in teacher.model.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.05)
    return TeacherSet({"teacher": teacher})


def test_distillation_runs_with_the_context_alone_and_is_eq_11(tiny):
    ctx = context(tiny, perturbed_ema)
    batch = batch_of(ctx, tiny, [0, 3, 4, 6])
    res = Distillation(ctx)(batch)
    ro, sel = batch.rollouts, batch.selected
    with torch.no_grad():
        width = ro.response_ids.shape[1]
        s_in = collate([batch.student_prompts[j] for j in ro.prompt_index.tolist()], ctx.ids["pad"], ro.response_ids, ro.response_mask)
        t_in = collate([batch.teacher_prompt("teacher", "crop", j) for j in ro.prompt_index.tolist()], ctx.ids["pad"],
                       ro.response_ids, ro.response_mask)  # fmt: skip
        d = topk_divergence(response_logits(ctx.student, s_in, width), response_logits(ctx.teachers.teachers["teacher"].model,
                            t_in, width), 7, 0.5)  # (8, T) Eq. 3 on full logits  # fmt: skip
    z = torch.zeros(8, dtype=F64)
    z[sel] = 1.0
    want = budgeted_loss(d, z, ro.response_mask)  # Eq. 11
    assert res.global_tokens == int(ro.lengths[sel].sum()) and res.teachers["crop"].rows == 4
    torch.testing.assert_close(torch.tensor(res.loss_share, dtype=F64), want, rtol=1e-12, atol=0)
    assert torch.isnan(res.utility[[1, 2, 5, 7]]).all() and torch.isfinite(res.utility[sel]).all()
    before = [p.clone() for p in ctx.teachers.teachers["teacher"].model.parameters()]
    Distillation(ctx).after_update(0)  # the EMA of Algorithm 1 line 13, with the context's tau
    after = list(ctx.teachers.teachers["teacher"].model.parameters())
    for b, a, s in zip(before, after, ctx.student.parameters()):
        torch.testing.assert_close(a, 0.5 * b + 0.5 * s.detach(), rtol=1e-12, atol=1e-15)


def test_one_process_micro_batches_give_the_lockstep_pass_exactly(tiny):
    """The default pass's one-process schedule (`one_process`) and the ranks' lockstep (`opd.methods.lockstep`, which
    the run takes with several processes or shards) run the same micro-batches on one process: the same loss, labels,
    teacher rows and gradients, to the bit (float64)."""
    results = []
    for schedule in (None, lockstep):
        ctx = context(tiny, perturbed_ema, schedule=schedule)
        res = Distillation(ctx)(batch_of(ctx, tiny, [0, 3, 4, 6, 7]))
        grads = [p.grad.clone() for p in ctx.student.parameters() if p.grad is not None]
        results.append((res, grads))
    (a, ga), (b, gb) = results
    assert a.loss_share == b.loss_share and a.teachers["crop"].rows == b.teachers["crop"].rows == 5
    assert torch.equal(a.utility.nan_to_num(-1.0), b.utility.nan_to_num(-1.0)) and len(ga) == len(gb) > 0
    assert all(torch.equal(x, y) for x, y in zip(ga, gb))


def test_dapd_builds_its_teachers_and_runs_with_the_context_alone(tiny):
    """DAPD's anchors come from `build_teachers` (the default set and a loader of the initial weights): the run's EMA
    teacher is the snapshot, the loader's model the base; six anchor forwards per selected row."""
    loads = []

    def teachers(student, path):
        loads.append(path)
        return DAPD.build_teachers(TeacherSet({"teacher": EMATeacher(student)}), lambda: Teacher(load_model(path, "float64")))

    ctx = context(tiny, teachers, teacher_views=("reference_answer",))
    assert ctx.teachers.names == ["snapshot", "base"] and isinstance(ctx.teachers.teachers["base"], Teacher)
    res = DAPD(ctx, DAPDConfig())(batch_of(ctx, tiny, [1, 2, 5]))
    assert sum(c.rows for c in res.teachers.values()) == 6 * 3 and len(res.metrics) == 6
    assert res.global_tokens == int(batch_of(ctx, tiny, [1, 2, 5]).rollouts.lengths[[1, 2, 5]].sum())


def test_every_method_names_an_objective_class_with_its_own_config():
    for name, method in METHODS.items():
        method.check()
        assert issubclass(objective_class(method.objective), Objective), name
        config = method.objective.Config
        assert config is None or all(hasattr(config(), "check") for _ in [0]), name
    with pytest.raises(TypeError, match="snapshot anchor is the run's EMA teacher"):
        DAPD.build_teachers(TeacherSet({"teacher": Teacher(torch.nn.Linear(1, 1))}), lambda: None)
