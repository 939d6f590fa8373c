"""The verbs, one module per family as the user sees them: project (init, use), nodes, workers,
data, jobs, status, sim. Each verb is a function declared once with `@verb`
(tpufab.verbs.declare): it turns flags into Settings, calls the library (through the Pod API
where there is a pod) and prints. Both front doors, the `tpufab` command (tpufab.cli) and the
invoke collection (tpufab.tasks), are generated from these declarations. Heavy modules are
imported inside the verbs so `tpufab --help` and `invoke --list` stay instant. No library
module imports this package.

To add a verb: write `def myverb(*, name: str | None = None, ...) -> int | None` in the family
module, give it a docstring (its first paragraph is the help) and `@verb(options={...})` with
the help of each parameter that tpufab.verbs.declare.COMMON does not already describe
(`Opt(...)` for short flags, aliases, `rest=True` trailing words, `required=True`, `hidden=True`
keywords for tests). A new family module goes into FAMILIES and all_verbs' import. Both front
doors pick it up; tests/test_front_doors.py checks that they agree.
"""

from __future__ import annotations

from tpufab.verbs.declare import Verb

FAMILIES = ("project", "launch", "nodes", "workers", "files", "data", "jobs", "status",
            "check", "sim")

GROUP_HELP = {
    "sim": "The simulated TPU pod: a local TPU API with real SSH workers.",
    "known-hosts": "tpufab's pinned worker host keys.",
    "jobs": "Supervised jobs, read from the supervisor's bucket (`tpufab jobs`: list them).",
}


def all_verbs() -> list[Verb]:
    """Every declared verb, in the order the front doors list them."""
    from tpufab.verbs import (  # noqa: F401
        check,
        data,
        files,
        jobs,
        launch,
        nodes,
        project,
        sim,
        status,
        workers,
    )
    from tpufab.verbs.declare import DECLARED

    family = {name: i for i, name in enumerate(FAMILIES)}
    return sorted(DECLARED, key=lambda v: family.get(v.fn.__module__.rsplit(".", 1)[-1],
                                                      len(FAMILIES)))
