"""Verbs that move files and bytes: put, get, forward, profile."""

from __future__ import annotations

from tpufab.verbs.common import note, pod_for, say, settings_from_flags
from tpufab.verbs.declare import Opt, verb

FILES_TIMEOUT = 300.0   # put/get: seconds a worker may go without answering (no progress)
FORWARD_TIMEOUT = 20.0  # forward: seconds to wait for the worker to answer when connecting


@verb(options={"local": "Local file or directory.",
                 "remote": Opt("Where on each worker (default: the home directory; into it if "
                               "it is a directory or ends with /).", argument=True),
                 "no_relay": "Send each worker its own copy over SSH instead of one upload "
                             "that a worker relays to the others."},
      pod_method="put")
def put(local: str, remote: str | None = None, *, name: str | None = None,
        worker: str = "all", no_relay: bool = False, timeout: float = FILES_TIMEOUT,
        zone: str | None = None, project: str | None = None,
        no_os_login: bool = False, jump: str | None = None) -> None:
    """Copy a local file or directory to every (selected) worker; identical files are skipped.

    Verified (sha256) and atomic (a temporary name, then a rename); to many workers the
    file is uploaded once and relayed by one worker over the pod's network (--no-relay to
    send each its own copy over SSH). ``timeout``: seconds a worker may go without
    answering, during a step or the copy (default 300); then it is named and given up on.
    """
    from pathlib import Path

    from tpufab.pod.api import TransferError
    from tpufab.views.progress import BytesProgress
    from tpufab.views.report import show

    pod = pod_for(settings_from_flags(name=name, zone=zone, project=project, timeout=timeout,
                                      no_os_login=no_os_login, jump=jump))
    try:
        report = pod.put(local, remote, workers=worker, no_relay=no_relay, timeout=timeout,
                         progress=BytesProgress(f"put {Path(local).name}"))
    except TransferError as err:
        show(err.report)   # failures included: the error sentence follows
        raise
    show(report)


@verb(options={"remote": "File or directory on the workers.",
                 "local": "Where here: LOCAL/w0/..., LOCAL/w1/... (one worker: LOCAL)."},
      pod_method="get")
def get(remote: str, local: str, *, name: str | None = None, worker: str = "all",
        timeout: float = FILES_TIMEOUT, zone: str | None = None, project: str | None = None,
        no_os_login: bool = False, jump: str | None = None) -> None:
    """Copy a file or directory from every (selected) worker: LOCAL/w0/..., LOCAL/w1/...

    ``timeout``: seconds a worker may go without answering (default 300)."""
    from tpufab.pod.api import TransferError
    from tpufab.views.progress import BytesProgress
    from tpufab.views.report import show

    pod = pod_for(settings_from_flags(name=name, zone=zone, project=project, timeout=timeout,
                                      no_os_login=no_os_login, jump=jump))
    try:
        report = pod.get(remote, local, workers=worker, timeout=timeout,
                         progress=BytesProgress(f"get {remote}"))
    except TransferError as err:
        show(err.report)   # failures included: the error sentence follows
        raise
    show(report)


@verb(options={"ports": Opt("PORT, LOCAL:REMOTE or LOCAL:HOST:REMOTE (several allowed).",
                             rest=True),
                 "worker": Opt("Worker index.", short="-w")},
      pod_method="forward")
def forward(ports: list[str], *, name: str | None = None, worker: int = 0,
            timeout: float = FORWARD_TIMEOUT, zone: str | None = None,
            project: str | None = None,
        no_os_login: bool = False, jump: str | None = None) -> int:
    """Forward local ports to a worker (default 0) over SSH until Ctrl-C: PORT[:REMOTE_PORT].

    ``timeout``: seconds to wait for the worker to answer when connecting (default 20, or
    connect_timeout if shorter); a worker that does not is named in one sentence.
    """
    from tpufab import nodeset

    pod = pod_for(settings_from_flags(name=name, zone=zone, project=project,
                                   no_os_login=no_os_login, jump=jump, timeout=timeout))
    forwarder = pod.forward(*ports, workers=int(worker), timeout=timeout,
                            on_event=lambda text: note(text, "yellow"))
    forwards = forwarder.forwards
    label = nodeset.label(int(worker))
    for f in forwards:
        say(f"{f.url} -> {label} {f.remote_host}:{f.remote}")
    note(f"Forwarding {len(forwards)} port{'s' if len(forwards) > 1 else ''} to {label} of "
         f"{pod.name}; Ctrl-C to stop.", "dim")
    try:
        while not forwarder.wait(1.0):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        forwarder.close()
    note(f"Stopped forwarding ({forwarder.connections} connection"
         f"{'s' if forwarder.connections != 1 else ''}).")
    return 0


@verb(options={"duration": "How long to trace: 5s, 500ms, 1m.",
                 "run": "Run id (default: the latest running run).",
                 "port": "Profiler port (default: the job's TPUFAB_PROFILER_PORT)."},
      pod_method="profile")
def profile(*, name: str | None = None, worker: str = "0", duration: str = "5s",
            run: str | None = None, port: int | None = None, zone: str | None = None,
            project: str | None = None,
        no_os_login: bool = False, jump: str | None = None) -> None:
    """Capture a profiler trace from a running JAX job and bring it back under its local logs."""
    pod = pod_for(settings_from_flags(name=name, zone=zone, project=project,
                                   no_os_login=no_os_login, jump=jump))
    from tpufab.views.report import show

    show(pod.profile(workers=worker, duration=duration, run=run, port=port,
                     progress=lambda text: note(text, "dim")))
