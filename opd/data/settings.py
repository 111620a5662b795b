"""The data's settings, torch-free (`train.py --help` and a config's checks import nothing heavy): the training
records and the step's prompts (`opd.data.sources`, `opd.data.records`), who teaches them (`opd.data.routes`,
`opd.models.external_teachers`) and the views' names."""

from __future__ import annotations

from dataclasses import dataclass

from opd.cli import Section, UserError

class DataError(UserError, ValueError):
    """A bad training record or source: the message names the file (or dataset), the row and the field."""


def parse_columns(text: str | None, flag: str = "--data-columns") -> dict[str, str]:
    """A column mapping from the command line: "question=problem,img=images" -> {"question": "problem",
    "img": "images"} (source column -> record field); None or "" -> {}. A one-line DataError names `flag`."""
    if text is None or not text.strip():
        return {}
    mapping: dict[str, str] = {}
    for part in text.split(","):
        column, eq, field = (s.strip() for s in part.partition("="))
        if not eq or not column or not field or "=" in field:
            raise DataError(f"{flag} {text!r}: expected COLUMN=FIELD pairs separated by commas "
                            f"(e.g. question=problem,img=images), got {part.strip()!r}")  # fmt: skip
        if column in mapping:
            raise DataError(f"{flag} {text!r}: column '{column}' is mapped twice")
        if field in mapping.values():
            raise DataError(f"{flag} {text!r}: two columns are mapped to field '{field}'")
        mapping[column] = field
    return mapping


VIEW_NAMES = ("full", "crop", "half_resolution", "masked", "reference_answer")
"""The views a record can be seen in (`opd.data.records.VIEWS`' names; --teacher-view's choices)."""


@dataclass
class DataConfig(Section):
    """The training records and the prompts each step draws from them."""

    data: str | None = None
    """Training data (Vision-OPD or bbox form): a JSONL file, a parquet file or folder, a `datasets` save_to_disk
    folder, a hub id org/name (opd/data/sources.py), or a built-in name: 'toy' (the default preset's: the toy world's
    training split) or 'tiny'; none (--preset tiny): the tiny dataset."""
    data_split: str | None = None
    """The split of --data when it has several (a DatasetDict folder, a hub id, a parquet folder of split files)."""
    data_columns: str | None = None
    """Column renames of --data, "COLUMN=FIELD,..." (e.g. "question=problem,img=images"); unmapped columns keep
    their names."""
    prompts_per_step: int = 28
    """Prompts per step over all processes."""
    max_prompt_len: int = 8192
    """Longest prompt in tokens (image tokens included); longer prompts are an error."""
    enable_thinking: bool = False
    """Qwen3.5's thinking generation prompt instead of the non-thinking one."""

    def check(self) -> list[str]:
        problems = []
        if self.prompts_per_step < 1:
            problems.append(f"--prompts-per-step {self.prompts_per_step}: must be at least 1")
        if self.max_prompt_len < 1:
            problems.append(f"--max-prompt-len {self.max_prompt_len}: must be at least 1")
        try:
            parse_columns(self.data_columns)
        except UserError as exc:
            problems.append(str(exc))
        return problems


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
        if self.teacher_view is not None and self.teacher_view not in VIEW_NAMES:
            problems.append(f"--teacher-view {self.teacher_view!r}: choose one of {', '.join(sorted(VIEW_NAMES))}")
        if self.teacher_model and self.teachers:
            problems.append("--teacher-model gives one teacher and --teachers routes to several: choose one")
        return problems
