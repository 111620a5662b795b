"""The core, measured while training runs: the files of opd/ whose code runs inside Algorithm 1's steps.

`trace(flags)` runs train.py's `main` in this process under `sys.setprofile`; inside every call of
`opd.loop.step.Stepper.step` each function call is noted: its file (when it is one of opd/'s) and, for the
equations' functions (`EQUATIONS`), the fewest calls between it and the step (the frames of opd's own modules on the
stack, one per call; torch's frames and a decorator's wrapper are not calls a reader follows). Outside the steps
(building the run, live evaluation, checkpoints, the summary) nothing is noted.

    python tests/core_trace.py            # the README's default through its selector's first updates (--steps 8)
"""

from __future__ import annotations

import importlib
import inspect
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OPD = str(ROOT / "opd")
DEFAULT = ["--policy", "learned", "--rho", "0.25", "--steps", "8", "--eval-limit", "8",
           "--report-to", "none", "--save-every", "0"]  # fmt: skip
"""The README's default command through the selector's first updates (the replay reaches 96 labels at step 5, so
steps 6-7 run every line of Algorithm 1), with less of what runs outside the steps (live evaluation on 8 items, no
checkpoint). Its evaluation before step 0 stays: the process's first forwards run there, as in the README's run
(transformers logs its one-time notes in them, outside the steps)."""

EQUATIONS = {
    "Eq. 1 (student)": ("opd.models.chat", "response_logits"),
    "Eq. 2 (teacher)": ("opd.models.ema_teacher", "Teacher.logits"),
    "Eq. 3": ("opd.maths.divergence", "generalized_jsd"),
    "Eq. 4": ("opd.selection.selectors", "query_budget"),
    "Eq. 5": ("opd.selection.selectors", "rollout_features"),
    "Eq. 6": ("opd.selection.selectors", "OnlineUtilityModel.predict"),
    "Eq. 7": ("opd.maths.divergence", "token_jsd"),
    "Eq. 8": ("opd.maths.divergence", "teacher_confidence"),
    "Eq. 9": ("opd.maths.divergence", "sample_utility"),
    "Eq. 10": ("opd.selection.selectors", "selector_loss"),
    "Eq. 11": ("opd.maths.divergence", "budgeted_weights"),
    "Eq. 12": ("opd.selection.selectors", "weighted_huber"),
    "line 13 (EMA)": ("opd.models.ema_teacher", "EMATeacher.update"),
}
"""What a reader looks for -> (module, qualified name) of the function the default step runs for it."""


@dataclass
class Trace:
    files: dict[str, int] = field(default_factory=dict)
    """opd's files whose code ran inside a step -> their whole line counts."""
    depths: dict[str, int] = field(default_factory=dict)
    """Each equation's fewest calls below Stepper.step."""
    autograd_functions: set[str] = field(default_factory=set)
    """Custom torch.autograd.Function classes of opd whose forward or backward ran inside a step."""
    functions: dict[str, set[str]] = field(default_factory=dict)
    """opd's file -> the names of its functions that ran inside a step."""
    imported: set[str] = field(default_factory=set)
    """opd's files first imported inside a step (their module bodies ran there, none of their functions need have)."""

    @property
    def lines(self) -> int:
        return sum(self.files.values())


def _codes() -> dict:
    codes = {}
    for what, (module, qual) in EQUATIONS.items():
        obj = importlib.import_module(module)
        for part in qual.split("."):
            obj = getattr(obj, part)
        codes[inspect.unwrap(obj).__code__] = what
    return codes


class Tracer:
    """A context under which every call inside `Stepper.step` is noted (`Trace`); an import inside a step (a module's
    body, its class bodies and whatever they call) is noted apart, in `imported`, not as code of the step."""

    def __init__(self):
        from opd.loop.step import Stepper

        self.root, self.codes, self.out = Stepper.step.__code__, _codes(), Trace()
        self.seen: set[str] = set()
        self.inside = self.importing = 0

    def profile(self, frame, event, arg):
        code = frame.f_code
        if code is self.root:
            self.inside += 1 if event == "call" else -1 if event == "return" else 0
            return
        if code.co_name == "<module>":  # an import inside a step: its module body and all it runs are not the step's
            self.importing += 1 if event == "call" else -1 if event == "return" else 0
            if event == "call" and self.inside and code.co_filename.startswith(OPD):
                self.out.imported.add(str(Path(code.co_filename).relative_to(ROOT)))
            return
        if event != "call" or not self.inside or self.importing:
            return
        name = code.co_filename
        if name.startswith(OPD):
            self.seen.add(name)
            self.out.functions.setdefault(str(Path(name).relative_to(ROOT)), set()).add(code.co_name)
            if code.co_name in ("forward", "backward") and code.co_varnames[:1] == ("ctx",):  # autograd.Function
                self.out.autograd_functions.add(f"{Path(name).relative_to(ROOT)}:{code.co_name}")
        if code in self.codes:
            calls, f = 1, frame.f_back
            while f is not None and f.f_code is not self.root:
                calls += f.f_code.co_filename.startswith(OPD)
                f = f.f_back
            what = self.codes[code]
            self.out.depths[what] = min(self.out.depths.get(what, calls), calls)

    def __enter__(self) -> Trace:
        sys.setprofile(self.profile)
        return self.out

    def __exit__(self, *exc):
        sys.setprofile(None)
        self.out.files = {str(Path(p).relative_to(ROOT)): len(Path(p).read_text().splitlines()) for p in sorted(self.seen)}


def trace(flags: list[str]) -> Trace:
    """Runs train.py with `flags` in this process; returns what ran inside its steps."""
    import train

    with Tracer() as out:
        train.main(flags)
    return out


if __name__ == "__main__":
    import tempfile

    sys.path[:0] = [str(ROOT)]
    with tempfile.TemporaryDirectory() as tmp:
        t = trace([*DEFAULT, "--out", str(Path(tmp) / "run"), *sys.argv[1:]])
    for name, n in sorted(t.files.items(), key=lambda kv: -kv[1]):
        print(f"{n:6d}  {name}  ({', '.join(sorted(t.functions[name]))})")
    print(f"{t.lines:6d}  in {len(t.files)} files")
    for what, d in t.depths.items():
        print(f"  {what}: {d} calls below the step")
    print("missing:", sorted(set(EQUATIONS) - set(t.depths)) or "none")
    print("autograd.Function forwards:", sorted(t.autograd_functions) or "none")
    print("imported inside a step (module bodies only):", sorted(t.imported - set(t.files)) or "none")
