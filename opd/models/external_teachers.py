"""External teachers: a fixed checkpoint in place of the EMA self-teacher, and teachers routed by a record field.

- `--teacher-model PATH`: one frozen checkpoint scores the selected rows in the method's teacher view(s).
- `--teachers route.json`: a table from one record field's value to checkpoints, e.g.
  {"field": "task", "teachers": {"colour": "teachers/colour", "count": "teachers/count"}, "default": "colour"}.

The run's `TeacherSet` (`opd.models.ema_teacher`) then holds them in a fixed order, each selected row routed to one
by `Routes`; each teacher is loaded once, frozen, run only on its rows, and must have the policy's tokenizer
(`check_same_tokenizer`). Ledger labels: a view with one teacher, `<teacher>:<view>` with several. Checkpoint
forms, routes and refusals: docs/MODULES.md#opdmodelsexternal_teachers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from opd.cli import Section, UserError
from opd.data.parse import KNOWN_FIELDS
from opd.data.records import VIEWS
from opd.models.ema_teacher import TeacherSet


@dataclass
class TeacherConfig(Section):
    """Who teaches: the method's teacher view over the EMA self-teacher, or fixed external checkpoints."""

    teacher_view: str | None = None
    """The teacher's privileged view (opd/data/records.py:VIEWS); none = the method's (crop for bas-opd)."""
    teacher_model: str | None = None
    """A fixed teacher checkpoint (folder or hub id, the policy's tokenizer) in place of the EMA self-teacher;
    frozen, run only on the selected rows (opd/models/external_teachers.py)."""
    teachers: str | None = None
    """A routing table (JSON, opd/models/external_teachers.py): a record field's values mapped to teacher checkpoints, each
    loaded once, frozen and run only on the selected rows routed to it."""

    @property
    def external(self) -> bool:
        """Whether fixed checkpoints teach instead of the EMA self-teacher."""
        return bool(self.teacher_model or self.teachers)

    def check(self) -> list[str]:
        problems = []
        if self.teacher_view is not None and self.teacher_view not in VIEWS:
            problems.append(f"--teacher-view {self.teacher_view!r}: choose one of {', '.join(sorted(VIEWS))}")
        if self.teacher_model and self.teachers:
            problems.append("--teacher-model gives one teacher and --teachers routes to several: choose one")
        return problems


@dataclass(frozen=True)
class Routes:
    """A routing table: records' `field` value -> route name -> teacher checkpoint."""

    field: str
    teachers: dict[str, str]
    """route (a value of the field) -> checkpoint folder or hub id."""
    default: str | None = None
    """The route of a value that has none (None: such a record is refused)."""
    source: str = "route.json"

    def route(self, record) -> str | None:
        """The route of a record: its field's value when routed, else the default (None when neither)."""
        value = record.field(self.field)
        if value is not None and value in self.teachers:
            return value
        return self.default

    def check_records(self, records) -> None:
        """Refuses, in one line, the first record without a route (no such field, or a value without one)."""
        for r in records:
            if self.route(r) is None:
                value = r.field(self.field)
                what = f"no field '{self.field}'" if value is None else f"field '{self.field}': {value!r} has no teacher"
                raise UserError(
                    f"{r.source}: {what} in --teachers {self.source} (routes: {', '.join(self.teachers)}; "
                    'add "default": "<route>" to route the others)'
                )


def load_routes(path: str | Path) -> Routes:
    """Reads and checks a routing table (see the module docstring); every problem is one UserError line."""
    path = Path(path)
    where = f"--teachers {path}"
    if not path.is_file():
        raise UserError(f"{where}: routing file not found")
    try:
        spec = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise UserError(f"{where}: malformed JSON: {e.msg} (line {e.lineno})") from None
    if not isinstance(spec, dict) or not isinstance(spec.get("field"), str) or not spec["field"]:
        raise UserError(f'{where}: expected {{"field": "<record field>", "teachers": {{"<value>": "<checkpoint>", ...}}}}')
    if spec["field"] in KNOWN_FIELDS:
        raise UserError(f"{where}: field '{spec['field']}' is one the records' own fields ({', '.join(KNOWN_FIELDS)}), "
                        "which do not route: name another field of the records (e.g. 'task')")
    teachers = spec.get("teachers")
    if not isinstance(teachers, dict) or not teachers:
        raise UserError(f"{where}: 'teachers' must map at least one value of '{spec['field']}' to a checkpoint")
    unknown = sorted(set(spec) - {"field", "teachers", "default"})
    if unknown:
        raise UserError(f"{where}: unknown keys {', '.join(unknown)} (known: field, teachers, default)")
    resolved = {}
    for route, ckpt in teachers.items():
        if not isinstance(ckpt, str) or not ckpt:
            raise UserError(f"{where}: teacher of route {route!r} must be a checkpoint path, got {ckpt!r}")
        local = (path.parent / ckpt) if not Path(ckpt).is_absolute() else Path(ckpt)
        resolved[str(route)] = str(local) if local.exists() or ckpt.startswith((".", "/")) else ckpt  # else a hub id
    default = spec.get("default")
    if default is not None and default not in resolved:
        raise UserError(f"{where}: default route {default!r} is not one of {', '.join(resolved)}")
    return Routes(spec["field"], resolved, default, str(path))


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


def teacher_source(path: str) -> str:
    """What a teacher name loads (`opd.builtin.model_source`: 'tiny', a `train.py` run or checkpoint folder's
    exported policy/, else the name unchanged)."""
    from opd.builtin import model_source

    return model_source(path, f"teacher {path}")


def load_teacher(path: str, what: str, policy_processor, policy_vocab: int, load_model, load_processor):
    """A frozen `Teacher` from a checkpoint (any name `teacher_source` takes): its processor (checked against the
    policy's tokenizer first, so a wrong teacher is refused before its weights load), then `load_model(path)`."""
    from opd.models.ema_teacher import Teacher
    from opd.models.chat import lm_head_weight

    path = teacher_source(path)
    try:
        processor = load_processor(path)
    except UserError as exc:  # named by its flag (or route file and route), the path said once
        reason = str(exc).replace(f"model {path} ", "it ").replace(f"model '{path}' ", "it ").removesuffix(f": {path}")
        raise UserError(f"{what}: {reason}") from None
    check_same_tokenizer(policy_processor, processor, what, policy_vocab, policy_vocab)
    model = load_model(path)
    check_same_tokenizer(policy_processor, processor, what, policy_vocab, lm_head_weight(model).shape[0])
    return Teacher(model, processor)


def build_routed(routes: Routes, policy_processor, policy_vocab: int, load_model, load_processor) -> TeacherSet:
    """A TeacherSet with one frozen teacher per route, each checkpoint loaded once."""
    loaded: dict[str, object] = {}
    teachers = {}
    for route, name in routes.teachers.items():
        ckpt = teacher_source(name)  # 'tiny' and a run folder by the folder they load
        if ckpt not in loaded:
            loaded[ckpt] = load_teacher(ckpt, f"--teachers {routes.source}: route {route!r} ({name})", policy_processor,
                                        policy_vocab, load_model, load_processor)  # fmt: skip
        teachers[route] = loaded[ckpt]
    return TeacherSet(teachers, routes)
