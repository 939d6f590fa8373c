#!/usr/bin/env python3
"""tpufab stacks, worker side (stdlib only): every Python stack of a run, or of the TPU's holders.

    stacks_worker.py --home DIR [--run ID | --latest] [--native] [--devices-glob GLOB ...]
                     [--lockfile PATH ...] [--timeout S]

Which processes: with --run ID, that run's live processes (its verified process group,
whatever carries its TPUFAB_RUN_ID, as `kill --run` finds them, and with `run --image` the
processes of the run's tpufab-labelled container, seen from the host's PID namespace: the
cgroup named by the id its `docker run --cidfile` wrote; py-spy runs on the host, so the
image needs no py-spy and no CAP_SYS_PTRACE); with --latest, those of the
newest run recorded on this worker when it is still running, else (and with neither) every
process holding a TPU device file or a libtpu lockfile (as `kill` finds them). Only Python
processes are dumped; the run's supervisor (tpufab-run) never is.

Each one gets `py-spy dump --json` (with --native, `--native` too). Run as root (through
`sudo -n`, to attach to processes it did not start), it runs only the py-spy tpufab installed
there: /opt/tpufab/py-spy/py-spy, root's, matching the sha256 recorded beside it when it was
installed (`--install`: copied from a root-owned py-spy, the simulated pod's shared site, else
`pip install --target` as root); a py-spy the login user can change (~/.local/bin, the venv,
PATH) never runs as root. As the login user (no sudo), its own py-spy: PATH, ~/.venv/bin,
~/.local/bin, the shared site. A process py-spy cannot attach to is reported with the reason
(kernel.yama.ptrace_scope, another user's process, a tracer already attached, a container
without CAP_SYS_PTRACE) and the fix.

What py-spy prints is bounded (MAX_DUMP bytes a process, MAX_THREADS threads, MAX_FRAMES frames
a thread, MAX_TEXT characters a name) and the whole answer too (MAX_ANSWER): a py-spy that
prints without end is stopped and named.

    stacks_worker.py --install --home DIR      (py-spy where this worker runs it; one answer)

Prints one JSON object: {"ok", "error"?, "missing_py_spy"?, "run", "run_state", "source"
("run" | "tpu holders"), "py_spy", "ptrace_scope", "euid", "processes": [{"pid", "command",
"threads": [{"name", "id", "active", "frames": [{"function", "file", "line"}]}] | "error",
"reason", "fix"}]}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from tpufab.remote.workerlib import (
    SUPERVISOR_NAME,
    Watched,
    alive,
    answer,
    argv_of,
    command_of,
    container_pids,
    expand_globs,
    proc_stat,
    read_int,
    run_processes,
    scan_holders,
    state_of_run,
)

DEFAULT_LOCKFILES = ("/tmp/libtpu_lockfile", "/tmp/libtpu.so_lockfile")
SIM_SITE_BIN = "/opt/tpufab-sim/share/site/bin"
ROOT_DIR = "/opt/tpufab/py-spy"                  # root's py-spy, installed by tpufab
ROOT_PY_SPY = ROOT_DIR + "/py-spy"
ROOT_HASH = ROOT_DIR + "/py-spy.sha256"
# root-owned places a py-spy may be copied from (never one the login user can change)
ROOT_SOURCES = (SIM_SITE_BIN + "/py-spy", "/usr/local/bin/py-spy", "/usr/bin/py-spy")
MAX_DUMP = 4 << 20         # bytes of py-spy's output for one process
MAX_ANSWER = 6 << 20       # bytes of frames, names and commands in the whole answer
MAX_THREADS = 1024
MAX_FRAMES = 512
MAX_TEXT = 1024            # characters of a name, a file, a command
DUMP_TIMEOUT = 20.0
DUMP_TRIES = 3             # a read that raced the process is tried again
RETRY_PAUSE = 0.2          # seconds, times the try


def sha256_of(path):
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def root_only(path):
    """``path`` and every directory above it belong to root and no one else may write them
    (what only root can have put there)."""
    import stat

    path = os.path.abspath(path)
    while True:
        try:
            info = os.lstat(path)
        except OSError:
            return False
        if info.st_uid != 0 or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) or \
                stat.S_ISLNK(info.st_mode):
            return False
        if path == "/":
            return True
        path = os.path.dirname(path)


def trusted_py_spy():
    """Root's py-spy: (path, None), or (None, why not)."""
    if not os.path.isfile(ROOT_PY_SPY):
        return None, f"tpufab has not installed py-spy in {ROOT_DIR} yet"
    if not (root_only(ROOT_PY_SPY) and root_only(ROOT_HASH)):
        return None, f"{ROOT_PY_SPY} is not root's alone"
    try:
        with open(ROOT_HASH) as fh:
            recorded = fh.read().split()[0]
        actual = sha256_of(ROOT_PY_SPY)
    except (OSError, IndexError):
        return None, f"{ROOT_HASH} cannot be read"
    if actual != recorded:
        return None, (f"{ROOT_PY_SPY} is not the py-spy tpufab installed (its sha256 differs "
                      "from the one recorded then)")
    return ROOT_PY_SPY, None


def install_root_py_spy():
    """py-spy in ROOT_DIR with its sha256 beside it (as root): copied from a root-owned
    py-spy, else pip-installed there. The answer: {"ok", "py_spy", "from", "error"?}."""
    import shutil
    import tempfile

    os.makedirs(ROOT_DIR, mode=0o755, exist_ok=True)
    for folder in (os.path.dirname(ROOT_DIR), ROOT_DIR):
        os.chown(folder, 0, 0)
        os.chmod(folder, 0o755)
    work = tempfile.mkdtemp(dir=ROOT_DIR, prefix=".install-")
    try:
        source = next((c for c in ROOT_SOURCES if os.path.isfile(c) and os.access(c, os.X_OK)
                       and root_only(c) and os.path.getsize(c) > 0), None)
        new = os.path.join(work, "py-spy")
        if source is not None:
            shutil.copyfile(source, new)
        else:
            pip = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet",
                                  "--disable-pip-version-check", "--no-warn-script-location",
                                  "--target", os.path.join(work, "t"), "py-spy"],
                                 capture_output=True, text=True, timeout=600)
            built = os.path.join(work, "t", "bin", "py-spy")
            if pip.returncode != 0 or not os.path.isfile(built):
                lines = [ln.strip() for ln in (pip.stderr or pip.stdout).splitlines()
                         if ln.strip()]
                errors = [ln for ln in lines if ln.lower().startswith("error")]
                return {"ok": False, "error": ((errors or lines or
                                                [f"pip exited {pip.returncode}"])[0])[:200]}
            shutil.copyfile(built, new)
            source = "pip install py-spy"
        os.chmod(new, 0o755)
        digest = sha256_of(new)
        with open(os.path.join(work, "py-spy.sha256"), "w") as fh:
            fh.write(f"{digest}  py-spy\n")
        os.chmod(os.path.join(work, "py-spy.sha256"), 0o644)
        os.replace(new, ROOT_PY_SPY)
        os.replace(os.path.join(work, "py-spy.sha256"), ROOT_HASH)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"ok": True, "py_spy": ROOT_PY_SPY, "from": source}


def install_user_py_spy(home):
    """py-spy in the login user's venv (else ``pip install --user``): for a stacks worker
    that runs as that user (no sudo)."""
    venv = os.path.join(home, ".venv", "bin", "python")
    argv = ([venv, "-m", "pip", "install"] if os.access(venv, os.X_OK) else
            ["python3", "-m", "pip", "install", "--user"])
    pip = subprocess.run(argv + ["--quiet", "--disable-pip-version-check", "py-spy"],
                         capture_output=True, text=True, timeout=600)
    if pip.returncode != 0:
        lines = [ln.strip() for ln in (pip.stderr or pip.stdout).splitlines() if ln.strip()]
        errors = [ln for ln in lines if ln.lower().startswith("error")]
        return {"ok": False,
                "error": ((errors or lines or [f"pip exited {pip.returncode}"])[0])[:200]}
    return {"ok": True, "py_spy": find_py_spy(home)}


def find_py_spy(home):
    """py-spy's path, or None. As root only root's (``trusted_py_spy``); as the login user:
    PATH, the login user's venv and ~/.local, the sim's site."""
    if os.geteuid() == 0:
        return trusted_py_spy()[0]
    for folder in os.environ.get("PATH", "").split(os.pathsep) + [
            os.path.join(home, ".venv", "bin"), os.path.join(home, ".local", "bin"),
            SIM_SITE_BIN, "/usr/local/bin"]:
        if not folder:
            continue
        path = os.path.join(folder, "py-spy")
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


def ptrace_scope():
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as fh:
            return int(fh.read().strip())
    except (OSError, ValueError):
        return None


def is_python(pid):
    """The process runs a Python interpreter (its executable, else its argv[0], is python*)."""
    try:
        exe = os.path.basename(os.readlink(f"/proc/{pid}/exe"))
    except OSError:
        argv = argv_of(pid)
        exe = os.path.basename(argv[0]) if argv else ""
    return exe.startswith(("python", "pypy"))


def status_field(pid, name):
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith(name + ":"):
                    return line.split(":", 1)[1].split()
    except OSError:
        pass
    return []


def tracer_of(pid):
    """The pid of the process tracing ``pid`` (a debugger, py-spy), or 0."""
    tracer = status_field(pid, "TracerPid")
    return int(tracer[0]) if tracer and tracer[0].isdigit() else 0


def why_not(pid, error, scope):
    """(reason, fix) for a process py-spy could not dump, from its error and this host."""
    denied = refused(error)
    tracer = tracer_of(pid)
    if tracer:
        proc = proc_stat(tracer)
        name = proc.comm if proc else "?"
        return (f"another tracer ({name}, pid {tracer}) is attached to it",
                f"detach {name} (pid {tracer}) from it, then run `tpufab stacks` again")
    if not proc_stat(pid) or (proc_stat(pid).exited):
        return "it ended while being read", "run `tpufab stacks` again"
    if not denied:
        return (f"py-spy could not read it ({error})",
                "check that it is a CPython process py-spy supports (`py-spy --version`)")
    euid = os.geteuid()
    owner = status_field(pid, "Uid")
    owner = int(owner[1]) if len(owner) > 1 and owner[1].isdigit() else None
    if euid == 0:
        if scope == 3:
            return ("kernel.yama.ptrace_scope is 3: no process may attach to another, not "
                    "even root", "set it lower in the boot configuration and reboot the worker")
        return ("root may not attach here: the worker lacks CAP_SYS_PTRACE (a container?)",
                "give it CAP_SYS_PTRACE (docker: --cap-add SYS_PTRACE)")
    if owner is not None and owner != euid:
        return (f"it belongs to uid {owner} and this command runs as uid {euid} without sudo",
                "give the login user passwordless sudo (as on TPU VMs) so tpufab runs py-spy as "
                "root")
    if scope is not None and scope >= 1:
        return (f"kernel.yama.ptrace_scope is {scope}: only root may attach to a process "
                "that is not its own child, and sudo -n does not work for the login user",
                "give the login user passwordless sudo, or `sudo sysctl -w "
                "kernel.yama.ptrace_scope=0` on the worker")
    return (f"ptrace was refused ({error})", "run `tpufab stacks` with passwordless sudo")


def py_spy_error(stderr, returncode):
    """py-spy's message and its causes on one line ("Error: ...; Caused by:; 0: ..."), without
    the backtrace a build with RUST_BACKTRACE on would add."""
    lines = []
    for line in stderr.decode("utf-8", "replace").splitlines():
        line = line.strip()
        if line.startswith("Stack backtrace"):
            break
        if line:
            lines.append(line)
    return "; ".join(lines)[:300] or f"exit status {returncode}"


def refused(error):
    """py-spy's error is the kernel refusing ptrace."""
    text = error.lower()
    return "permission denied" in text or "operation not permitted" in text or \
        "os error 1)" in text or "os error 13" in text


def transient(pid, error):
    """py-spy failed on a live process, not for permission nor a tracer: most likely a read that
    raced the process ("Failed to get stack traces", "Failed to suspend process", a thread state
    copied while it changed), worth another try."""
    if refused(error) or tracer_of(pid):
        return False
    proc = proc_stat(pid)
    return bool(proc) and not proc.exited


def dump(py_spy, pid, native, scope, timeout, tries=DUMP_TRIES):
    """One process's threads, or why there are none. A read that raced the process is tried
    again (up to ``tries`` in all, within ``timeout``), as py-spy's own sampler skips one."""
    argv = [py_spy, "dump", "--json", "--pid", str(pid)]
    if native:
        argv.append("--native")
    env = dict(os.environ, RUST_BACKTRACE="0")
    deadline = time.monotonic() + timeout
    for attempt in range(1, tries + 1):
        left = deadline - time.monotonic()
        try:
            done = bounded_run(argv, timeout=max(left, 0.5), env=env)
        except subprocess.TimeoutExpired:
            return {"error": f"py-spy took over {timeout:g} s",
                    "reason": "the process did not let py-spy read it in time",
                    "fix": "run `tpufab stacks` again (without --native it is quicker)"}
        except OSError as err:
            return {"error": str(err), "reason": f"py-spy could not start ({err})",
                    "fix": "reinstall py-spy on the worker (`tpufab setup`)"}
        if done.returncode is None:
            return {"error": f"py-spy printed more than {MAX_DUMP >> 20} MiB for one process",
                    "reason": "py-spy printed more than a stack could be (a forged py-spy?)",
                    "fix": f"check {py_spy} on the worker"}
        if done.returncode == 0:
            try:
                threads = json.loads(done.stdout.decode("utf-8", "replace"))
            except ValueError:
                threads = None
            if isinstance(threads, list):
                return {"threads": [thread_of(t) for t in threads[:MAX_THREADS]
                                    if isinstance(t, dict)]}
        error = py_spy_error(done.stderr, done.returncode)
        if attempt == tries or deadline - time.monotonic() < 1.0 or not transient(pid, error):
            break
        time.sleep(RETRY_PAUSE * attempt)   # let the process move past what raced the read
    reason, fix = why_not(pid, error, scope)
    if attempt > 1:
        error = f"{error} (tried {attempt} times)"
    return {"error": error, "reason": reason, "fix": fix}


class Done:
    def __init__(self, returncode, stdout, stderr):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def bounded_run(argv, *, timeout, env, limit=MAX_DUMP):
    """``subprocess.run(argv, capture_output=True)`` that keeps at most ``limit`` bytes of
    stdout (and 64 KiB of stderr): past that the process is killed and the answer's
    ``returncode`` is None. Raises TimeoutExpired past ``timeout``."""
    import select

    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                            stdin=subprocess.DEVNULL)
    out, err = bytearray(), bytearray()
    streams = {proc.stdout.fileno(): (out, limit), proc.stderr.fileno(): (err, 64 << 10)}
    deadline = time.monotonic() + timeout
    try:
        while streams:
            left = deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(argv, timeout)
            ready, _, _ = select.select(list(streams), [], [], left)
            for fd in ready:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    del streams[fd]
                    continue
                buf, cap = streams[fd]
                if len(buf) + len(chunk) > cap:
                    if buf is out:
                        return Done(None, bytes(out), bytes(err))
                    chunk = chunk[:max(0, cap - len(buf))]
                buf += chunk
        proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        return Done(proc.returncode, bytes(out), bytes(err))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()


def text(value):
    return str(value if value is not None else "")[:MAX_TEXT]


def thread_of(entry):
    frames = []
    for frame in (entry.get("frames") or ())[:MAX_FRAMES]:
        if not isinstance(frame, dict):
            continue
        line = frame.get("line")
        frames.append({"function": text(frame.get("name") or "?"),
                       "file": text(frame.get("short_filename") or frame.get("filename") or ""),
                       "path": text(frame.get("filename") or ""),
                       "line": line if isinstance(line, int) else None})
    ident = entry.get("os_thread_id") or entry.get("thread_id")
    return {"name": text(entry.get("thread_name") or ""),
            "id": ident if isinstance(ident, int) else None, "active": bool(entry.get("active")),
            "gil": bool(entry.get("owns_gil")), "frames": frames}


def latest_run(run_dir):
    try:
        names = sorted(n for n in os.listdir(run_dir) if os.path.isdir(os.path.join(run_dir, n)))
    except OSError:
        return None
    return names[-1] if names else None


def run_pids(run_dir, run):
    rundir = os.path.join(run_dir, run)
    pid = read_int(os.path.join(rundir, "pid"))
    start_time = read_int(os.path.join(rundir, "start_time"))
    group = pid if pid is not None and start_time is not None and alive(pid, start_time) \
        else None
    found = [p.pid for p in run_processes({run: group})[run] if p.comm != SUPERVISOR_NAME]
    inside = container_pids([rundir]).get(rundir, [])    # `run --image`: its container's
    return found + [pid for pid in inside if pid not in found]


def holder_pids(globs, lockfiles):
    paths = expand_globs(globs) + [p for p in lockfiles if os.path.exists(p)]
    if not paths:
        return []
    holders, _unreadable = scan_holders(Watched(paths))
    return sorted(holders)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--home", default=os.path.expanduser("~"))
    parser.add_argument("--run")
    parser.add_argument("--latest", action="store_true")
    parser.add_argument("--native", action="store_true")
    parser.add_argument("--devices-glob", action="append", dest="devices_globs", default=[])
    parser.add_argument("--lockfile", action="append", dest="lockfiles")
    parser.add_argument("--timeout", type=float, default=DUMP_TIMEOUT)
    parser.add_argument("--install", action="store_true")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.install:
        return install_root_py_spy() if os.geteuid() == 0 else install_user_py_spy(args.home)

    run_dir = os.path.join(args.home, ".tpufab", "runs")
    answer = {"ok": True, "run": None, "run_state": None, "source": "tpu holders",
              "euid": os.geteuid(), "ptrace_scope": ptrace_scope(), "processes": []}
    run = args.run or (latest_run(run_dir) if args.latest else None)
    pids = None
    if run:
        rundir = os.path.join(run_dir, run)
        if not os.path.isdir(rundir):
            if args.run:
                answer.update(ok=False, run=run, error=f"no run {run} on this worker")
                return answer
        else:
            state = state_of_run(rundir)["state"]
            answer.update(run=run, run_state=state)
            if args.run or state in ("running", "starting"):
                answer["source"] = "run"
                pids = run_pids(run_dir, run)
    if pids is None:
        pids = holder_pids(args.devices_globs, args.lockfiles or list(DEFAULT_LOCKFILES))
    me = os.getpid()
    pids = [p for p in pids if p != me and is_python(p)]
    py_spy = find_py_spy(args.home)
    answer["py_spy"] = py_spy
    if pids and py_spy is None:
        answer.update(ok=False, missing_py_spy=True,
                      error=trusted_py_spy()[1] if os.geteuid() == 0 else
                      "py-spy is not installed (looked on PATH, in ~/.venv/bin, "
                      f"~/.local/bin and {SIM_SITE_BIN})")
        return answer
    scope = answer["ptrace_scope"]
    started = time.monotonic()
    budget = MAX_ANSWER
    for pid in pids:
        proc = proc_stat(pid)
        if proc is None or proc.exited:
            continue
        entry = {"pid": pid, "command": text(command_of(proc))}
        left = max(2.0, args.timeout - (time.monotonic() - started))
        entry.update(dump(py_spy, pid, args.native, scope, left))
        size = len(json.dumps(entry))
        if size > budget:
            entry = {"pid": pid, "command": entry["command"],
                     "error": f"its stacks would take the answer past {MAX_ANSWER >> 20} MiB",
                     "reason": "its stacks are larger than tpufab reads from one worker",
                     "fix": f"look at it on the worker: `sudo py-spy dump --pid {pid}`"}
            size = len(json.dumps(entry))
        budget -= size
        answer["processes"].append(entry)
    return answer


if __name__ == "__main__":
    answer("answer", main())
    sys.exit(0)
