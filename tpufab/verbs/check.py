"""check: is the pod fit to run on? (run --check uses the same quick checks)."""

from __future__ import annotations

from tpufab.verbs.common import note
from tpufab.verbs.declare import Call, Opt, verb

PLACE = 9   # where this family's verbs show in `tpufab --help`


@verb(pod_method="check",
      options={"quick": "Only compare the workers; skip the collective across every host.",
               "timeout": Opt("Seconds the collective may take before it gives up.", min=1)})
def check(call: Call, *, as_json: bool = False) -> int:
    """Check every worker at once: TPU free, versions and commit agree, disk, memory, clock,
    mounts; then (unless --quick) a real collective across every host.

    ``timeout``: seconds the collective may take; connecting to a worker waits at most that
    long too (or connect_timeout, if shorter).

    Exit code 0 when every check passed, 1 otherwise (one line per problem, with its fix).
    """
    from tpufab.views.report import show

    report = call(progress=None if as_json else lambda m: note(m, "dim"))
    show(report, as_json=as_json)
    return 0 if report.ok else 1
