"""check: is the pod fit to run on? (run --check uses the same quick checks)."""

from __future__ import annotations

from tpufab.verbs.common import note, pod_for, settings_from_flags
from tpufab.verbs.declare import Opt, verb


@verb(pod_method="check", view=("as_json",),
      options={"quick": "Only compare the workers; skip the collective across every host.",
               "timeout": Opt("Seconds the collective may take before it gives up.", min=1)})
def check(*, name: str | None = None, quick: bool = False, as_json: bool = False,
          timeout: float = 120.0, zone: str | None = None, project: str | None = None,
        no_os_login: bool = False,
          jump: str | None = None) -> int:
    """Check every worker at once: TPU free, versions and commit agree, disk, memory, clock,
    mounts; then (unless --quick) a real collective across every host.

    ``timeout``: seconds the collective may take (default 120); connecting to a worker
    waits at most that long too (or connect_timeout, if shorter).

    Exit code 0 when every check passed, 1 otherwise (one line per problem, with its fix).
    """
    from tpufab.views.report import show

    settings = settings_from_flags(name=name, zone=zone, project=project,
                                   no_os_login=no_os_login, jump=jump)
    report = pod_for(settings).check(quick=quick, timeout=timeout,
                                     progress=None if as_json else lambda m: note(m, "dim"))
    show(report, as_json=as_json)
    return 0 if report.ok else 1
