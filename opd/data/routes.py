"""Teachers routed by a record field (`--teachers route.json`): a table from one field's value to checkpoints, e.g.
{"field": "task", "teachers": {"colour": "teachers/colour", "count": "teachers/count"}, "default": "colour"}.

`load_routes` reads and checks the table (every problem one line); `Routes.route` names a record's route, and
`Routes.check_records` refuses a record without one. The teachers themselves are loaded by
`opd.models.external_teachers` (each checkpoint once, frozen, the policy's tokenizer)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from opd.cli import UserError
from opd.data.parse import KNOWN_FIELDS


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
