"""Supervised jobs (docs/supervisor.md), read from the supervisor's bucket alone: these work
from the laptop while the supervisor VM is down.

    from tpufab.pod import supervised

    for row in supervised.jobs(project="my-project"):     # JobRow: .job, .spec, .state, .holder
        print(row.job, row.state_name)
    logs = supervised.job_logs("job-20261201-221000-ab12")  # every attempt, every worker
    supervised.cancel_job("ab12").summary()                 # an id, or its unique end
    supervised.hand_secrets("ab12").summary()   # its secrets, from os.environ, to its supervisor

The bucket is ``bucket`` (the ``supervisor_bucket`` setting), else ``<project>-tpufab``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from tpufab.config import Settings, load_settings

if TYPE_CHECKING:
    from tpufab.flows.supervisor.handover import SecretsHanded
    from tpufab.flows.supervisor.jobs import CancelOutcome, JobLogs, JobRow
    from tpufab.flows.supervisor.state import Attempt, Records


def _records(project: str | None, bucket: str | None, settings: dict[str, Any]) -> Records:
    from tpufab.flows.supervisor.state import Records

    chosen: Settings = load_settings({"project": project, "supervisor_bucket": bucket,
                                      **settings})
    return Records.from_settings(chosen)


def jobs(*, project: str | None = None, bucket: str | None = None,
         **settings: Any) -> list[JobRow]:
    """`tpufab jobs`: every supervised job in the bucket, oldest first (spec, state, lease and
    who holds it). Raises BucketMissing, or the storage's one sentence when it cannot be read."""
    from tpufab.flows.supervisor import jobs as supervised

    return supervised.list_jobs(_records(project, bucket, settings))


def job_logs(job: str, *, follow: bool = False,
             sink: Callable[[Sequence[int]], Any] | None = None,
             on_attempt: Callable[[int, Attempt | None], None] | None = None,
             poll: float = 2.0, stop: threading.Event | None = None,
             project: str | None = None, bucket: str | None = None,
             **settings: Any) -> JobLogs:
    """`tpufab jobs logs`: the job's output across its attempts. Without ``follow``: as it is
    now (``.attempts``: each attempt's workers' logs, read chunk by chunk when printed); with
    it: every attempt through a view of its own (``sink(workers)``, ``on_attempt`` first),
    as the output comes, until the job is over or ``stop`` is set. ``job``: its id, or a
    unique beginning or end of it (UnknownJob otherwise)."""
    from tpufab.flows.supervisor import jobs as supervised

    records = _records(project, bucket, settings)
    found = records.find(job)
    if not follow:
        return supervised.job_logs(records, found)
    if sink is None:
        raise ValueError("following a job's logs needs a sink for each attempt's output")
    return supervised.follow_logs(records, found, sink=sink, on_attempt=on_attempt, poll=poll,
                                  stop=stop)


def cancel_job(job: str, *, project: str | None = None, bucket: str | None = None,
               by: str | None = None, **settings: Any) -> CancelOutcome:
    """`tpufab jobs cancel`: ask for the job to stop, keeping its record; ``.summary()`` says
    what was done and what happens next (its supervisor stops the run; with no supervisor
    holding it, a job with nothing running is cancelled at once, else it is marked for the
    next one)."""
    import getpass

    from tpufab.flows.supervisor import jobs as supervised

    records = _records(project, bucket, settings)
    found = records.find(job)
    if by is None:
        try:
            by = getpass.getuser()
        except Exception:  # noqa: BLE001 - no passwd entry (containers)
            by = "someone"
    return supervised.cancel_job(records, found, by=by)


def hand_secrets(job: str, *, environ: Mapping[str, str] | None = None,
                 project: str | None = None, zone: str | None = None,
                 bucket: str | None = None, **settings: Any) -> SecretsHanded:
    """`tpufab jobs secrets`: the values of the secrets the job's spec names, read from
    ``environ`` (default: this process's environment), handed to its supervisor again (a
    supervisor that restarted keeps none: the job waits, "needs secrets"): over SSH to the
    supervisor VM, or (``supervisor_vm: false``) to the service on this machine that holds
    it. Never into the bucket, argv or a log. ``.summary()`` says what was done; a job that
    needs none, or is over, is no error; a secret not set is a ConfigError naming it."""
    from tpufab.flows.supervisor.handover import hand_secrets as hand

    return hand(_vm_settings(project, zone, bucket, settings), job, environ=environ)


# -- the supervisor VM (docs/supervisor.md, "The VM"): `tpufab supervisor up | status | ssh |
# down`. These need the project and zone (the VM's) as well as the bucket.

def _vm_settings(project: str | None, zone: str | None, bucket: str | None,
                 settings: dict[str, Any]) -> Settings:
    return load_settings({"project": project, "zone": zone, "supervisor_bucket": bucket,
                          **settings})


def supervisor_up(*, project: str | None = None, zone: str | None = None,
                  bucket: str | None = None, console: Any = None, **settings: Any):
    """`tpufab supervisor up`: the project's supervisor VM, made if missing (the laptop's own
    tpufab installed, its service running), upgraded in place between jobs; a SupervisorVM.
    ``console`` (a rich Console) hears its progress."""
    from tpufab.flows.supervisor import vm

    return vm.ensure(_vm_settings(project, zone, bucket, settings), console=console)


def supervisor_status(*, project: str | None = None, zone: str | None = None,
                      bucket: str | None = None, **settings: Any):
    """`tpufab supervisor status`: the VM (None if there is none), its install, its service's
    heartbeat, the bucket's jobs and the VM's hourly list price; a SupervisorStatus."""
    from tpufab.flows.supervisor import vm

    return vm.status(_vm_settings(project, zone, bucket, settings))


def supervisor_down(*, force: bool = False, project: str | None = None,
                    zone: str | None = None, bucket: str | None = None,
                    **settings: Any) -> str:
    """`tpufab supervisor down`: delete the VM (the bucket keeps the records); refused while
    jobs are live unless ``force``. Returns the sentence saying what was done."""
    from tpufab.flows.supervisor import vm

    return vm.down(_vm_settings(project, zone, bucket, settings), force=force)


def supervisor_ssh(command: Sequence[str] = (), *, project: str | None = None,
                   zone: str | None = None, **settings: Any) -> int:
    """`tpufab supervisor ssh [-- CMD]`: OpenSSH into the VM (its host key pinned from its
    guest attributes), interactive or running CMD; returns ssh's exit status."""
    import subprocess
    import tempfile
    from pathlib import Path

    from tpufab.flows.supervisor import vm

    chosen = _vm_settings(project, zone, None, settings)
    with tempfile.TemporaryDirectory(prefix="tpufab-supervisor-ssh-") as folder:
        argv = vm.ssh_argv(chosen, command, known_hosts=Path(folder) / "known_hosts")
        return subprocess.call(argv)
