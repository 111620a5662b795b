"""The reader's path, measured while a step runs: from Algorithm 1's step (`opd.loop.step.Stepper.step`) to the function
each equation's line of training runs, in at most 4 calls.

A step of the tiny model (one rank, Learned-25 after the selector's first update, so that every line of Algorithm 1
runs: the predictor, the teacher, the replay update, the EMA) runs under `sys.setprofile`; at each call of an equation's
function the calls between it and `Stepper.step` are counted: the frames of opd's own modules on the stack, one per
call (torch's frames and a decorator's wrapper between them are not calls a reader follows).

The equations' functions are the ones docs/EQUATIONS.md names as what training runs. Eq. 3 and Eq. 11 on the chunked
path are one fused kernel (`opd.maths.chunked.budgeted_loss_from_hidden`: both sides' logits, D per position and
Eq. 11's weighted sum chunk by chunk, with their analytic gradient); what runs inside it (its autograd function, the
chunk's support and `generalized_jsd`) is the kernel's own, not a further call of the step's.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OPD = str(ROOT / "opd")
LAZY = str(ROOT / "opd" / "lazy.py")  # a decorator's wrapper (`no_grad`): the same call, not one more

TARGETS = {
    "Eq. 1 (student)": ("opd.models.ema_teacher", "response_hidden"),
    "Eq. 2 (teacher)": ("opd.models.ema_teacher", "Teacher.hidden"),
    "Eq. 3 + 11 (fused kernel)": ("opd.maths.chunked", "budgeted_loss_from_hidden"),
    "Eq. 4": ("opd.selection.selectors", "query_budget"),
    "Eq. 5": ("opd.selection.features", "rollout_features"),
    "Eq. 6": ("opd.selection.predictor", "OnlineUtilityModel.predict"),
    "Eq. 9": ("opd.maths.utility", "labels_from_terms"),
    "Eq. 10": ("opd.maths.utility", "selector_loss"),
    "Eq. 11 (aggregation)": ("opd.maths.loss", "aggregation_weights"),
    "line 13 (EMA)": ("opd.models.ema_teacher", "EMATeacher.update"),
}
"""What a reader looks for -> (module, qualified name) of the function training runs for it."""


def depths(run, rollouts) -> dict[str, int]:
    """Runs `run.step(1, rollouts)` under a profiler; returns each target's fewest calls below Stepper.step."""
    import importlib
    import inspect

    codes = {}
    for what, (module, qual) in TARGETS.items():
        obj = importlib.import_module(module)
        for part in qual.split("."):
            obj = getattr(obj, part)
        codes[inspect.unwrap(obj).__code__] = what  # the function under a decorator (`opd.lazy.no_grad`)
    from opd.loop.step import Stepper

    root = Stepper.step.__code__
    found: dict[str, int] = {}

    def profile(frame, event, arg):
        if event != "call" or frame.f_code not in codes:
            return
        calls, f = 1, frame.f_back
        while f is not None and f.f_code is not root:
            calls += f.f_code.co_filename.startswith(OPD) and f.f_code.co_filename != LAZY
            f = f.f_back
        if f is not None:
            what = codes[frame.f_code]
            found[what] = min(found.get(what, calls), calls)

    sys.setprofile(profile)
    try:
        run.step(1, rollouts)
    finally:
        sys.setprofile(None)
    return found
