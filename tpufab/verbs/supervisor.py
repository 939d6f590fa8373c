"""The supervisor VM's verbs (docs/supervisor.md, "The VM"): `tpufab supervisor up | status
| ssh [-- CMD] | down [--force]`."""

from __future__ import annotations

from tpufab.verbs.common import say
from tpufab.verbs.declare import Opt, verb

PLACE = 7   # beside the supervised jobs' verbs in `tpufab --help`
GROUPS = {"supervisor": "The supervisor VM that keeps supervised jobs going "
                        "(`tpufab supervisor status`)."}

OPTIONS = {
    "bucket": Opt("The supervisor's bucket (default: the supervisor_bucket setting, else "
                  "<project>-tpufab).", metavar="BUCKET"),
    "force": "Delete it even with live jobs (they wait in the bucket for the next supervisor).",
    "command": Opt("A command to run on the VM instead of a login shell (after --).",
                   rest=True, metavar="CMD..."),
}


@verb(name="up", group="supervisor", options=OPTIONS)
def supervisor_up(*, project: str | None = None, zone: str | None = None,
                  bucket: str | None = None) -> int:
    """Make the project's supervisor VM if there is none (the setting supervisor_name, a
    supervisor_machine_type VM running this laptop's own tpufab), or check the one there.

    Its startup script first asks which permissions its service account lacks and stops, named
    in one sentence with the role to grant, if any is missing. A supervisor running another
    tpufab is upgraded in place when it holds no live job, else refused."""
    from tpufab.pod.supervised import supervisor_up as up
    from tpufab.term.console import stderr

    vm = up(project=project, zone=zone, bucket=bucket, console=stderr())
    what = "made" if vm.created else "upgraded to this tpufab" if vm.upgraded else "running"
    say(f"Supervisor {vm.name} ({vm.machine_type}, {vm.zone}) {what}: tpufab {vm.version}.")
    return 0


@verb(name="status", group="supervisor", default=True, options=OPTIONS)
def supervisor_status(*, as_json: bool = False, project: str | None = None,
                      zone: str | None = None, bucket: str | None = None) -> int:
    """The supervisor VM: its machine type, uptime, tpufab, jobs and hourly cost (list price,
    docs/supervisor.md). `tpufab supervisor` alone is the same."""
    from tpufab.pod.supervised import supervisor_status as status
    from tpufab.views.supervised import show_supervisor

    show_supervisor(status(project=project, zone=zone, bucket=bucket), as_json=as_json)
    return 0


@verb(name="ssh", group="supervisor", options=OPTIONS)
def supervisor_ssh(*, command: list[str] | None = None, project: str | None = None,
                   zone: str | None = None) -> int:
    """SSH into the supervisor VM (a login shell), or run CMD there: `tpufab supervisor ssh
    -- sudo journalctl -u tpufab-supervisor -n 50`. One CMD word is a command line as typed
    (as ssh takes it); several are each quoted."""
    from tpufab.pod.supervised import supervisor_ssh as ssh

    return ssh(command or (), project=project, zone=zone)


@verb(name="down", group="supervisor", options=OPTIONS)
def supervisor_down(*, force: bool = False, project: str | None = None,
                    zone: str | None = None, bucket: str | None = None) -> int:
    """Delete the supervisor VM; the bucket keeps every job's record. Refused while a job is
    live, unless --force."""
    from tpufab.pod.supervised import supervisor_down as down

    say(down(force=force, project=project, zone=zone, bucket=bucket))
    return 0
