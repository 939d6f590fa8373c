"""The verbs, one module per family as the user sees them (project, launch, nodes, workers,
files, data, jobs, status, check, sim). Each verb is a function declared once with `@verb`
(tpufab.verbs.declare): a verb on a pod's workers takes its flags from its `tpufab.Pod`
method and only prints; the others turn their flags into Settings and call the library.
Both front doors, the `tpufab` command (tpufab.cli) and the invoke collection
(tpufab.tasks), are generated from these declarations. Heavy modules are imported inside the
verbs so `tpufab --help` and `invoke --list` stay instant. No library module imports this
package.

To add a verb: its Pod method, then in a family module the function and `@verb(pod_method=
..., options={...})` with the help of each flag that tpufab.verbs.declare.COMMON does not
already describe (docs/architecture.md, "Add a verb"). A family module is found by itself:
any module here but declare and common; its ``PLACE`` says where its verbs show in `tpufab
--help`, its ``GROUPS`` the help of the command groups it declares (`tpufab sim ...`).
tests/test_front_doors.py checks that both front doors agree.
"""

from __future__ import annotations

import importlib
import pkgutil
from functools import cache
from types import ModuleType

from tpufab.verbs.declare import Verb

NOT_FAMILIES = ("declare", "common")


@cache
def families() -> list[ModuleType]:
    """Every family module, in the order `tpufab --help` lists them (their PLACE)."""
    found = [importlib.import_module(f"{__name__}.{info.name}")
             for info in pkgutil.iter_modules(__path__) if info.name not in NOT_FAMILIES]
    return sorted(found, key=lambda module: (getattr(module, "PLACE", 99), module.__name__))


def group_help(group: str) -> str | None:
    """The help of a command group (`tpufab sim`), from the family that declares it."""
    return next((module.GROUPS[group] for module in families()
                 if group in getattr(module, "GROUPS", {})), None)


def all_verbs() -> list[Verb]:
    """Every declared verb, in the order the front doors list them."""
    from tpufab.verbs.declare import DECLARED

    place = {module.__name__: i for i, module in enumerate(families())}
    return sorted(DECLARED, key=lambda v: place.get(v.fn.__module__, len(place)))
