"""The objective classes by name: where the run gets the class that runs a method's objective.

The method table (`opd.methods.table`) names each method's objective by its torch-free spec (`opd.methods.specs`), so
that train.py's settings load without torch; the run (`opd.run`) asks `objective_class(method.objective)` for
the class (`opd.methods.interface.Objective`). A new objective is one entry of `OBJECTIVES`.
"""

from opd.methods.dapd import DAPD
from opd.methods.objective import Distillation
from opd.methods.interface import Objective
from opd.methods.opod import OPOD
from opd.methods.specs import ObjectiveSpec
from opd.methods.tm_opd import TMOPD

OBJECTIVES: dict[str, type[Objective]] = {cls.spec.name: cls for cls in (Distillation, DAPD, OPOD, TMOPD)}
"""Each objective class by its spec's name."""


def objective_class(objective: ObjectiveSpec | str) -> type[Objective]:
    """The class that runs `objective` (a spec, `Method.objective`, or its name)."""
    name = objective if isinstance(objective, str) else objective.name
    if name not in OBJECTIVES:
        raise ValueError(f"unknown objective {name!r}; known: {', '.join(OBJECTIVES)}")
    return OBJECTIVES[name]
