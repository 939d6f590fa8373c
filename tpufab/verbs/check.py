"""check: is the pod fit to run on? (run --check uses the same quick checks)."""

from __future__ import annotations

from tpufab.errors import ConfigError
from tpufab.verbs.common import note, pod_for, print_json, say, settings_from_flags
from tpufab.verbs.declare import Opt, verb


@verb(options={"quick": "Only compare the workers; skip the collective across every host.",
               "timeout": Opt("Seconds the collective may take before it gives up.", min=1)})
def check(*, name: str | None = None, quick: bool = False, as_json: bool = False,
          timeout: float = 120.0, zone: str | None = None, project: str | None = None,
        no_os_login: bool = False,
          jump: str | None = None) -> int:
    """Check every worker at once: TPU free, versions and commit agree, disk, memory, clock,
    mounts; then (unless --quick) a real collective across every host.

    Exit code 0 when every check passed, 1 otherwise (one line per problem, with its fix).
    """
    from tpufab import check as checking

    if timeout <= 0:
        raise ConfigError(f"--timeout must be more than 0 seconds, not {timeout:g}.")
    settings = settings_from_flags(name=name, zone=zone, project=project,
                                   no_os_login=no_os_login, jump=jump)
    pod = pod_for(settings).connected
    report = checking.run_check(settings, pod, quick=quick, timeout=timeout,
                                progress=None if as_json else lambda m: note(m, "dim"))
    if as_json:
        print_json(report.to_json())
        return 0 if report.ok else 1
    for line in checking.report_lines(report):
        say(line)
    note(checking.summary(report), None if report.ok else "bold red")
    return 0 if report.ok else 1
