"""Verbs that move files and bytes: put, get, forward, profile."""

from __future__ import annotations

import threading
import time

from tpufab.errors import ConfigError
from tpufab.verbs.common import note, pod_for, say, settings_from_flags
from tpufab.verbs.declare import Opt, verb

PROGRESS_AFTER = 0.5   # seconds: a quick transfer prints only its summary


class BarProgress:
    """A rich progress bar (bytes, speed, workers done) once a transfer takes a moment."""

    def __init__(self, what: str):
        self.what = what
        self.bar = None
        self.task = None
        self.total = 0
        self.workers = 0
        self.done: set[int] = set()
        self.moved = 0
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None

    def start(self, total_bytes: int, workers: int) -> None:
        self.total, self.workers = total_bytes, workers
        if total_bytes:
            self._timer = threading.Timer(PROGRESS_AFTER, self._show)
            self._timer.daemon = True
            self._timer.start()

    def _show(self) -> None:
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        from tpufab.console import stderr

        with self._lock:
            if self._timer is None:
                return
            self.bar = Progress(TextColumn("{task.description}"), BarColumn(),
                                DownloadColumn(binary_units=True), TransferSpeedColumn(),
                                TextColumn("{task.fields[workers]}"), TimeRemainingColumn(),
                                console=stderr(), transient=True)
            self.task = self.bar.add_task(self.what, total=self.total, completed=self.moved,
                                          workers=self._workers_text())
            self.bar.start()

    def _workers_text(self) -> str:
        return f"{len(self.done)}/{self.workers} workers done"

    def advance(self, nbytes: int) -> None:
        with self._lock:
            self.moved += nbytes
            if self.bar is not None:
                self.bar.update(self.task, completed=self.moved)

    def worker_done(self, worker: int) -> None:
        with self._lock:
            self.done.add(worker)
            if self.bar is not None:
                self.bar.update(self.task, workers=self._workers_text())

    def stop(self) -> None:
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            if self.bar is not None:
                self.bar.stop()
                self.bar = None


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
        worker: str = "all", no_relay: bool = False, zone: str | None = None,
        project: str | None = None) -> None:
    """Copy a local file or directory to every (selected) worker; identical files are skipped.

    Verified (sha256) and atomic (a temporary name, then a rename); to many workers the
    file is uploaded once and relayed by one worker over the pod's network (--no-relay to
    send each its own copy over SSH).
    """
    from pathlib import Path

    from tpufab import transfer

    if not Path(local).expanduser().exists():
        raise ConfigError(f"{local} does not exist here; check the local path (put copies a "
                          "file or directory from this machine).")
    pod = pod_for(settings_from_flags(name=name, zone=zone, project=project))
    try:
        report = pod.put(local, remote, workers=worker, relay=not no_relay,
                         progress=BarProgress(f"put {Path(local).name}"))
    except transfer.TransferError as err:
        _report(err.report, "put")
        raise
    _report(report, "put")


@verb(options={"remote": "File or directory on the workers.",
                 "local": "Where here: LOCAL/w0/..., LOCAL/w1/... (one worker: LOCAL)."})
def get(remote: str, local: str, *, name: str | None = None, worker: str = "all",
        zone: str | None = None, project: str | None = None) -> None:
    """Copy a file or directory from every (selected) worker: LOCAL/w0/..., LOCAL/w1/..."""
    from tpufab import transfer

    if not remote or not remote.strip():
        raise ConfigError("No remote path given: tpufab get REMOTE LOCAL.")
    pod = pod_for(settings_from_flags(name=name, zone=zone, project=project))
    try:
        report = pod.get(remote, local, workers=worker, progress=BarProgress(f"get {remote}"))
    except transfer.TransferError as err:
        _report(err.report, "get")
        raise
    _report(report, "get")


@verb(options={"ports": Opt("PORT, LOCAL:REMOTE or LOCAL:HOST:REMOTE (several allowed).",
                             rest=True),
                 "worker": Opt("Worker index.", short="-w")})
def forward(ports: list[str], *, name: str | None = None, worker: int = 0,
            zone: str | None = None, project: str | None = None) -> int:
    """Forward local ports to a worker (default 0) over SSH until Ctrl-C: PORT[:REMOTE_PORT]."""
    from tpufab import forward as forwarding
    from tpufab import nodeset

    forwards = forwarding.parse_forwards(ports)
    pod = pod_for(settings_from_flags(name=name, zone=zone, project=project))
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
            project: str | None = None) -> None:
    """Capture a profiler trace from a running JAX job and bring it back under its local logs."""
    from tpufab import profiling

    seconds = profiling.parse_duration(duration)
    pod = pod_for(settings_from_flags(name=name, zone=zone, project=project))
    began = time.monotonic()
    note(f"Capturing {seconds:g} s of trace...", "dim")
    captured = pod.profile(workers=worker, seconds=seconds, run=run, port=port)
    for line in captured.lines():
        say(f"profile: {line}")
    note(f"Traces under {captured.local_dir} ({time.monotonic() - began:.1f} s). View them "
         f"with `xprof --logdir {captured.local_dir}` or TensorBoard's profile plugin.")
