"""Verbs that move files and bytes: put, get, forward, profile."""

from __future__ import annotations

import time

from tpufab.errors import ConfigError
from tpufab.verbs.common import note, pod_for, say, settings_from_flags
from tpufab.verbs.declare import Opt, verb

FILES_TIMEOUT = 300.0   # put/get: seconds a worker may go without answering (no progress)


def _report(report, verb: str) -> None:
    """The folded summary on stdout (failures included: the error sentence follows)."""
    for line in report.lines():
        say(f"{verb}: {line}")


@verb(options={"local": "Local file or directory.",
                 "remote": Opt("Where on each worker (default: the home directory; into it if "
                               "it is a directory or ends with /).", argument=True),
                 "no_relay": "Send each worker its own copy over SSH instead of one upload "
                             "that a worker relays to the others."})
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

    from tpufab import transfer
    from tpufab.progress import BytesProgress

    if not Path(local).expanduser().exists():
        raise ConfigError(f"{local} does not exist here; check the local path (put copies a "
                          "file or directory from this machine).")
    pod = pod_for(settings_from_flags(name=name, zone=zone, project=project, timeout=timeout,
                                      no_os_login=no_os_login, jump=jump))
    try:
        report = pod.put(local, remote, workers=worker, relay=not no_relay,
                         progress=BytesProgress(f"put {Path(local).name}"))
    except transfer.TransferError as err:
        _report(err.report, "put")
        raise
    _report(report, "put")


@verb(options={"remote": "File or directory on the workers.",
                 "local": "Where here: LOCAL/w0/..., LOCAL/w1/... (one worker: LOCAL)."})
def get(remote: str, local: str, *, name: str | None = None, worker: str = "all",
        timeout: float = FILES_TIMEOUT, zone: str | None = None, project: str | None = None,
        no_os_login: bool = False, jump: str | None = None) -> None:
    """Copy a file or directory from every (selected) worker: LOCAL/w0/..., LOCAL/w1/...

    ``timeout``: seconds a worker may go without answering (default 300)."""
    from tpufab import transfer
    from tpufab.progress import BytesProgress

    if not remote or not remote.strip():
        raise ConfigError("No remote path given: tpufab get REMOTE LOCAL.")
    pod = pod_for(settings_from_flags(name=name, zone=zone, project=project, timeout=timeout,
                                      no_os_login=no_os_login, jump=jump))
    try:
        report = pod.get(remote, local, workers=worker, progress=BytesProgress(f"get {remote}"))
    except transfer.TransferError as err:
        _report(err.report, "get")
        raise
    _report(report, "get")


@verb(options={"ports": Opt("PORT, LOCAL:REMOTE or LOCAL:HOST:REMOTE (several allowed).",
                             rest=True),
                 "worker": Opt("Worker index.", short="-w")})
def forward(ports: list[str], *, name: str | None = None, worker: int = 0,
            zone: str | None = None, project: str | None = None,
        no_os_login: bool = False, jump: str | None = None) -> int:
    """Forward local ports to a worker (default 0) over SSH until Ctrl-C: PORT[:REMOTE_PORT]."""
    from tpufab import forward as forwarding
    from tpufab import nodeset

    forwards = forwarding.parse_forwards(ports)
    pod = pod_for(settings_from_flags(name=name, zone=zone, project=project,
                                   no_os_login=no_os_login, jump=jump))
    forwarder = forwarding.forward(pod.fanout, forwards, worker=int(worker),
                                   on_event=lambda text: note(text, "yellow"))
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
                 "port": "Profiler port (default: the job's TPUFAB_PROFILER_PORT)."})
def profile(*, name: str | None = None, worker: str = "0", duration: str = "5s",
            run: str | None = None, port: int | None = None, zone: str | None = None,
            project: str | None = None,
        no_os_login: bool = False, jump: str | None = None) -> None:
    """Capture a profiler trace from a running JAX job and bring it back under its local logs."""
    from tpufab import profiling

    seconds = profiling.parse_duration(duration)
    pod = pod_for(settings_from_flags(name=name, zone=zone, project=project,
                                   no_os_login=no_os_login, jump=jump))
    began = time.monotonic()
    note(f"Capturing {seconds:g} s of trace...", "dim")
    captured = pod.profile(workers=worker, seconds=seconds, run=run, port=port)
    for line in captured.lines():
        say(f"profile: {line}")
    note(f"Traces under {captured.local_dir} ({time.monotonic() - began:.1f} s). View them "
         f"with `xprof --logdir {captured.local_dir}` or TensorBoard's profile plugin.")
