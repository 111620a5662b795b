"""External teachers: a fixed checkpoint in place of the EMA self-teacher, and teachers routed by a record field.

- `--teacher-model PATH`: one frozen checkpoint scores the selected rows in the method's teacher view(s).
- `--teachers route.json`: a table from one record field's value to checkpoints (`opd.data.routes`).

The run's `TeacherSet` (`opd.models.ema_teacher`) then holds them in a fixed order, each selected row routed to one
by `opd.data.routes.Routes`; each teacher is loaded once, frozen, run only on its rows, and must have the policy's tokenizer
(`check_same_tokenizer`). Ledger labels: a view with one teacher, `<teacher>:<view>` with several. Checkpoint
forms, routes and refusals: docs/MODULES.md#opdmodelsexternal_teachers.
"""

from __future__ import annotations


from opd.cli import UserError
from opd.models.hidden import lm_head_weight
from opd.models.ema_teacher import Teacher, TeacherSet


def tokenizer_difference(policy_processor, teacher_processor) -> str | None:
    """How the teacher's tokenizer differs from the policy's (vocabulary, special tokens), or None when equal."""
    a = getattr(policy_processor, "tokenizer", policy_processor)
    b = getattr(teacher_processor, "tokenizer", teacher_processor)
    va, vb = a.get_vocab(), b.get_vocab()
    if va != vb:
        if len(va) != len(vb):
            return f"{len(vb):,} tokens, the policy's {len(va):,}"
        token = next(t for t in sorted(va) if vb.get(t) != va[t])
        return f"token {token!r} has id {vb.get(token)}, the policy's {va[token]}"
    for name in ("eos_token", "pad_token"):
        if getattr(a, name, None) != getattr(b, name, None):
            return f"{name} {getattr(b, name, None)!r}, the policy's {getattr(a, name, None)!r}"
    return None


def check_same_tokenizer(policy_processor, teacher_processor, what: str, policy_vocab: int, teacher_vocab: int) -> None:
    """Refuses a teacher whose tokenizer or LM head differs from the policy's (one line naming `what`)."""
    diff = tokenizer_difference(policy_processor, teacher_processor)
    if diff is None and policy_vocab != teacher_vocab:
        diff = f"an LM head of {teacher_vocab:,} rows, the policy's {policy_vocab:,}"
    if diff is not None:
        raise UserError(
            f"{what}: its tokenizer differs from the policy's ({diff}); a teacher scores the student's own token "
            "ids, so it needs the policy's tokenizer"
        )


def load_teacher(path: str, what: str, policy_processor, policy_vocab: int, load_model, load_processor):
    """A frozen `Teacher` from a checkpoint folder or hub id (a teacher name resolved: `opd.builtin.teacher_source`):
    its processor (checked against the policy's tokenizer first, so a wrong teacher is refused before its weights
    load), then `load_model(path)`."""
    try:
        processor = load_processor(path)
    except UserError as exc:  # named by its flag (or route file and route), the path said once
        reason = str(exc).replace(f"model {path} ", "it ").replace(f"model '{path}' ", "it ").removesuffix(f": {path}")
        raise UserError(f"{what}: {reason}") from None
    check_same_tokenizer(policy_processor, processor, what, policy_vocab, policy_vocab)
    model = load_model(path)
    check_same_tokenizer(policy_processor, processor, what, policy_vocab, lm_head_weight(model).shape[0])
    return Teacher(model, processor)


def build_routed(routes, resolve, policy_processor, policy_vocab: int, load_model, load_processor) -> TeacherSet:
    """A TeacherSet with one frozen teacher per route of `routes` (`opd.data.routes.Routes`), each checkpoint loaded
    once; `resolve`: a teacher name -> what it loads (`opd.builtin.teacher_source`)."""
    loaded: dict[str, object] = {}
    teachers = {}
    for route, name in routes.teachers.items():
        ckpt = resolve(name)  # 'tiny' and a run folder by the folder they load
        if ckpt not in loaded:
            loaded[ckpt] = load_teacher(ckpt, f"--teachers {routes.source}: route {route!r} ({name})", policy_processor,
                                        policy_vocab, load_model, load_processor)  # fmt: skip
        teachers[route] = loaded[ckpt]
    return TeacherSet(teachers, routes)
