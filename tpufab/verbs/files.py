"""Verbs that move files and bytes: put, get, forward, profile."""

from __future__ import annotations

from tpufab.errors import TpufabError
from tpufab.verbs.common import note, say
from tpufab.verbs.declare import Call, Opt, verb

PLACE = 5   # where this family's verbs show in `tpufab --help`


@verb(options={"local": "Local file or directory.",
               "remote": Opt("Where on each worker (default: the home directory; into it if "
                             "it is a directory or ends with /).", argument=True),
               "no_relay": "Send each worker its own copy over SSH instead of one upload "
                           "that a worker relays to the others."},
      pod_method="put", api_only=("relay",))
def put(call: Call) -> None:
    """Copy a local file or directory to every (selected) worker; identical files are skipped.

    Verified (sha256) and atomic (a temporary name, then a rename); to many workers the
    file is uploaded once and relayed by one worker over the pod's network (--no-relay to
    send each its own copy over SSH). ``timeout``: seconds a worker may go without
    answering, during a step or the copy; then it is named and given up on.
    """
    from pathlib import Path

    from tpufab.views.progress import BytesProgress
    from tpufab.views.report import show

    try:
        report = call(progress=BytesProgress(f"put {Path(call.args['local']).name}"))
    except TpufabError as err:
        if err.report is not None:
            show(err.report)   # failures included: the error sentence follows
        raise
    show(report)


@verb(options={"remote": "File or directory on the workers.",
               "local": "Where here: LOCAL/w0/..., LOCAL/w1/... (one worker: LOCAL)."},
      pod_method="get")
def get(call: Call) -> None:
    """Copy a file or directory from every (selected) worker: LOCAL/w0/..., LOCAL/w1/...

    ``timeout``: seconds a worker may go without answering."""
    from tpufab.views.progress import BytesProgress
    from tpufab.views.report import show

    try:
        report = call(progress=BytesProgress(f"get {call.args['remote']}"))
    except TpufabError as err:
        if err.report is not None:
            show(err.report)   # failures included: the error sentence follows
        raise
    show(report)


@verb(options={"ports": Opt("PORT, LOCAL:REMOTE or LOCAL:HOST:REMOTE (several allowed).",
                            rest=True),
               "workers": Opt("Worker index.", flag="--worker", short="-w")},
      pod_method="forward", api_only=("worker",))
def forward(call: Call) -> int:
    """Forward local ports to a worker (default 0) over SSH until Ctrl-C: PORT[:REMOTE_PORT].

    ``timeout``: seconds to wait for the worker to answer when connecting (or connect_timeout
    if shorter); a worker that does not is named in one sentence.
    """
    from tpufab import nodeset

    forwarder = call(on_event=lambda text: note(text, "yellow"))
    forwards = forwarder.forwards
    label = nodeset.label(int(call.args["workers"]))
    for f in forwards:
        say(f"{f.url} -> {label} {f.remote_host}:{f.remote}")
    note(f"Forwarding {len(forwards)} port{'s' if len(forwards) > 1 else ''} to {label} of "
         f"{call.pod.name}; Ctrl-C to stop.", "dim")
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
               "port": "Profiler port (default: the job's TPUFAB_PROFILER_PORT).",
               "to": "Also copy the logdir to this Cloud Storage folder: gs://BUCKET/PREFIX.",
               "max_size": "A host's trace brought back at most (larger: it stays there); "
                           "default 2GiB."},
      pod_method="profile", api_only=("seconds",))
def profile(call: Call) -> None:
    """Capture a profiler trace from a running JAX job and bring it back under its local logs."""
    from tpufab.views.report import show

    show(call(progress=lambda text: note(text, "dim")))
