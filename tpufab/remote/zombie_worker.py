#!/usr/bin/env python3
"""Leave the mess a crashed TPU job leaves behind (stdlib only; for the simulated pod).

    zombie_worker.py [--devices-glob GLOB ...] [--lockfile PATH ...] [--holders N]
              [--ignore-term K] [--lock-holder [--lock-holder-name NAME]]
              [--protected-name NAME | --no-protected]

Starts detached processes (own session, stdio on /dev/null) that hold the TPU, looking as a
crashed job's do (``python3 train.py``; the protected one by its NAME alone):
  holder-0..N-1  hold every device file; holder-0 also holds the lockfiles with flock, as
                 libtpu does; the first K of them ignore SIGTERM (only SIGKILL stops them);
  lock-holder    (with --lock-holder) holds the lockfiles instead of holder-0, like a
                 forked helper that kept libtpu's lock after its parent died;
  protected      named NAME (default tpu-runtime, like the TPU runtime agent), holds the
                 first device file; a normal kill must leave it alone.
Prints one JSON object once every process holds what it should:
  {"zombies": [{"pid", "role", "name", "ignores_term", "holds": [...]}], "devices": [...],
   "lockfiles": [...]}
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import select
import shutil
import signal
import sys
import tempfile
import time

from tpufab.remote.workerlib import DEVICE_GLOBS, answer, expand_globs

DEFAULT_LOCKFILES = ("/tmp/libtpu_lockfile",)
READY_TIMEOUT = 10.0
# What a holder shows as its command line once it holds the TPU: a crashed job's process.
JOB_ARGV = ("python3", "train.py")


def spawn(role, name, devices, lockfiles, ignore_term):
    """Fork one detached holder; returns (pid, read end of its readiness pipe)."""
    ready_r, ready_w = os.pipe()
    sys.stdout.flush()
    pid = os.fork()
    if pid:
        os.close(ready_w)
        return pid, ready_r
    os.close(ready_r)
    try:
        hold(role, name, devices, lockfiles, ignore_term, ready_w)
    except Exception as err:  # noqa: BLE001 - reported to the parent, then exit
        os.write(ready_w, json.dumps({"role": role, "error": f"{type(err).__name__}: {err}"})
                 .encode())
    finally:
        os._exit(1)


def hold(role, name, devices, lockfiles, ignore_term, ready_w):
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    if name:
        with open("/proc/self/comm", "w") as fh:
            fh.write(name[:15])
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    if ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    held = []
    for path in devices:
        held.append(os.open(path, os.O_RDONLY | os.O_NONBLOCK))
    for path in lockfiles:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.append(fd)
    argv = [name] if name else list(JOB_ARGV)
    os.write(ready_w, json.dumps({"pid": os.getpid(), "role": role, "name": name or "python3",
                                  "ignores_term": ignore_term, "argv": argv,
                                  "holds": list(devices) + list(lockfiles)}).encode())
    os.close(ready_w)
    become(argv, held)


def become(argv, held):
    """Go on holding ``held`` as a process whose command line is ``argv``, doing nothing: a
    private folder holds ``argv[0]``, a link to cat, and (for a script) a FIFO of the
    script's name that no one ever writes, so cat waits on it forever; without a script, cat
    waits on a FIFO as its stdin. Ignored signals stay ignored across exec (SIGTERM for the
    stubborn ones); the held descriptors and the flock stay with the process."""
    cat = shutil.which("cat", path="/usr/bin:/bin") or "/bin/cat"
    where = tempfile.mkdtemp(prefix=".tpufab-zombie-")
    os.symlink(cat, os.path.join(where, argv[0]))
    fifo = os.path.join(where, argv[1] if len(argv) > 1 else "stdin")
    os.mkfifo(fifo, 0o600)
    if len(argv) == 1:
        stdin = os.open(fifo, os.O_RDWR)  # never EOF: cat reads it forever
        os.dup2(stdin, 0)
    for fd in held:
        os.set_inheritable(fd, True)
    os.chdir(where)
    os.execv(os.path.join(where, argv[0]), argv)


def wait_exec(reports, timeout):
    """Wait (bounded) until every ready holder's command line is the job's it took on."""
    deadline = time.monotonic() + timeout
    for report in reports:
        if not report or "argv" not in report:
            continue
        wanted = ("\0".join(report["argv"]) + "\0").encode()
        while time.monotonic() < deadline:
            try:
                with open(f"/proc/{report['pid']}/cmdline", "rb") as fh:
                    if fh.read() == wanted:
                        break
            except OSError:
                break
            time.sleep(0.01)
        report.pop("argv", None)


def wait_ready(pipes, timeout):
    """Read each child's one JSON line (its readiness report), bounded by `timeout`."""
    reports = {}
    buffers = {fd: b"" for fd in pipes}
    deadline = time.monotonic() + timeout
    while buffers:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        readable, _, _ = select.select(list(buffers), [], [], left)
        for fd in readable:
            chunk = os.read(fd, 65536)
            if chunk:
                buffers[fd] += chunk
                continue
            os.close(fd)
            data = buffers.pop(fd)
            reports[fd] = json.loads(data.decode()) if data else None
    for fd in buffers:
        os.close(fd)
        reports[fd] = None
    return reports


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices-glob", action="append", dest="devices_globs")
    parser.add_argument("--lockfile", action="append", dest="lockfiles")
    parser.add_argument("--holders", type=int, default=2)
    parser.add_argument("--ignore-term", type=int, default=1,
                        help="how many holders ignore SIGTERM")
    parser.add_argument("--lock-holder", action="store_true",
                        help="one more process holding only the lockfiles")
    parser.add_argument("--lock-holder-name",
                        help="process name of the lock-holder (a protected name keeps it)")
    parser.add_argument("--protected-name", default="tpu-runtime")
    parser.add_argument("--no-protected", action="store_true")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)

    devices = expand_globs(args.devices_globs or DEVICE_GLOBS)
    lockfiles = args.lockfiles or list(DEFAULT_LOCKFILES)
    if not devices:
        answer("answer", {"error": "no TPU device files match "
                          + " ".join(args.devices_globs or DEVICE_GLOBS)})
        return 2

    # One process takes the flock, as one libtpu process does: holder-0, or the
    # lock-holder when asked for (a forked helper that kept the lock after its parent died).
    plan = []
    for i in range(args.holders):
        locks = lockfiles if i == 0 and not args.lock_holder else []
        plan.append((f"holder-{i}", None, devices, locks, i < args.ignore_term))
    if args.lock_holder:
        plan.append(("lock-holder", args.lock_holder_name, [], lockfiles, False))
    if not args.no_protected:
        plan.append(("protected", args.protected_name, devices[:1], [], False))

    pipes = [spawn(*entry)[1] for entry in plan]
    reports = wait_ready(pipes, READY_TIMEOUT)
    wait_exec(list(reports.values()), READY_TIMEOUT)
    zombies = [reports[fd] or {"role": role, "error": "did not get ready"}
               for fd, (role, *_rest) in zip(pipes, plan, strict=True)]
    answer("answer", {"zombies": zombies, "devices": devices, "lockfiles": lockfiles})
    return 0 if all("error" not in z for z in zombies) else 1


if __name__ == "__main__":
    sys.exit(main())
