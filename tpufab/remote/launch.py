#!/usr/bin/env python3
"""tpufab runs, worker side (stdlib only): start a recipe detached, report, follow, stop.

    launch.py start  --run ID --recipe PATH [--recipe-sha256 HEX] [--cwd DIR] [--commit SHA]
                     [--env-file PATH] [--env-stdin] [--keep-env-file] [--run-dir DIR] [-- ARGS]
    launch.py status [--run ID ...] [--run-dir DIR]
    launch.py tail   --run ID [--offset N] [--follow] [--run-dir DIR]
    launch.py stop   --run ID [--grace S] [--run-dir DIR]

A run lives in <run-dir>/<run-id>/ (default ~/.tpufab/runs): `recipe/<name>` (the exact file
that runs), `pid`, `pgid`, `start_time` (field 22 of /proc/<pid>/stat), `commit`,
`recipe_sha256`, `env_keys` (names only, never values), `meta.json`, `log` (stdout and stderr),
and, once the recipe ends, `exit_code` or `killed` (signal name) plus `ended_at`.

The recipe runs in its own session and process group with stdin from /dev/null, under a
small supervisor (also its own session) that waits for it and records how it ended, so
neither survives on the SSH connection that started them. The job environment (secrets
included) comes from a JSON object in a 0600 file or on stdin, never from argv.

`start`, `status` and `stop` print one JSON object. `tail` streams the log bytes (whole lines
while the run is live), then prints one JSON status line on stderr and exits with the run's
code (128+N when killed by signal N, 255 when lost). Killing a follower never touches the run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

DEFAULT_RUN_DIR = "~/.tpufab/runs"
RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# The fan-out agent tags the processes of a connection with this, and reaps them when the
# connection goes away; a run must outlive its connection, so it never inherits the tag.
DROPPED_ENV = ("TPUFAB_TASK",)
POLL = 0.05
EXIT_LOST = 255


class UsageError(Exception):
    pass


# -- small file helpers ------------------------------------------------------------------


def write_atomic(path, text, mode=0o644):
    tmp = f"{path}.tmp-{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)


def read_text(path):
    try:
        with open(path) as fh:
            return fh.read().strip()
    except OSError:
        return None


def read_int(path):
    text = read_text(path)
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def proc_stat(pid):
    """(state, pgid, start_time) of `pid`, or None when it does not exist."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read()
    except OSError:
        return None
    fields = data[data.rindex(b")") + 2:].split()
    return fields[0].decode(), int(fields[2]), int(fields[19])


def same_process(pid, start_time):
    stat = proc_stat(pid)
    return stat is not None and stat[2] == start_time and stat[0] not in ("Z", "X", "x")


def run_processes(run_id, pgid=None):
    """Live processes of a run: those carrying its TPUFAB_RUN_ID (wherever they went:
    setsid, nohup), plus members of process group `pgid` when the caller verified it."""
    needle = f"\0TPUFAB_RUN_ID={run_id}\0".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        stat = proc_stat(int(name))
        if stat is None or stat[0] in ("Z", "X", "x"):
            continue
        if pgid is not None and stat[1] == pgid:
            found.append(int(name))
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as fh:
                env = b"\0" + fh.read() + b"\0"
        except OSError:
            continue
        if needle in env:
            found.append(int(name))
    return found


def run_path(run_dir, run_id):
    if not RUN_ID.match(run_id or ""):
        raise UsageError(f"bad run id {run_id!r}")
    return os.path.join(os.path.expanduser(run_dir), run_id)


# -- start -------------------------------------------------------------------------------


def read_environment(args):
    """The job environment: JSON objects of strings from --env-file and/or --env-stdin.

    Both may be given: the file holds what differs per worker (its rank), stdin what must
    never touch a disk (secrets); stdin wins on a clash.
    """
    env = {}
    sources = []
    if args.env_file:
        path = os.path.expanduser(args.env_file)
        try:
            with open(path, "rb") as fh:
                sources.append(fh.read())
        finally:
            if not args.keep_env_file:
                try:
                    os.unlink(path)
                except OSError:
                    pass
    if args.env_stdin:
        sources.append(sys.stdin.buffer.read())
    for raw in sources:
        part = json.loads(raw.decode() or "{}")
        if not isinstance(part, dict):
            raise UsageError("the job environment must be a JSON object")
        env.update(part)
    for key, value in env.items():
        if not ENV_KEY.match(key) or not isinstance(value, str):
            raise UsageError(f"bad environment entry {key!r}: names are identifiers, "
                             "values strings")
    return env


def recipe_argv(path, args):
    with open(path, "rb") as fh:
        head = fh.read(2)
    if head == b"#!":
        return [path, *args]
    if path.endswith(".py"):
        return ["python3", path, *args]
    return ["/bin/sh", path, *args]


def start(args):
    env = read_environment(args)   # first: the env file is consumed even if we fail below
    rundir = run_path(args.run_dir, args.run)
    recipe = os.path.expanduser(args.recipe)
    with open(recipe, "rb") as fh:
        content = fh.read()
    digest = hashlib.sha256(content).hexdigest()
    if args.recipe_sha256 and args.recipe_sha256 != digest:
        raise UsageError(f"recipe {recipe} has sha256 {digest}, expected {args.recipe_sha256}")
    home = os.path.expanduser("~")
    cwd = os.path.expanduser(args.cwd) if args.cwd else home
    cwd_note = None
    if not os.path.isdir(cwd):
        cwd_note, cwd = cwd, home

    os.makedirs(os.path.dirname(rundir), exist_ok=True)
    try:
        os.mkdir(rundir, 0o700)
    except FileExistsError:
        raise UsageError(f"run {args.run} already exists in {os.path.dirname(rundir)}") from None
    os.mkdir(os.path.join(rundir, "recipe"))
    copy = os.path.join(rundir, "recipe", os.path.basename(recipe) or "recipe")
    shutil.copyfile(recipe, copy)
    os.chmod(copy, 0o755)
    argv = recipe_argv(copy, args.args)

    job_env = {k: v for k, v in os.environ.items() if k not in DROPPED_ENV}
    job_env.update(env)
    job_env["TPUFAB_RUN_ID"] = args.run
    job_env["TPUFAB_RUN_DIR"] = rundir
    job_env.setdefault("PYTHONUNBUFFERED", "1")   # log lines as they happen, not per 8 KiB

    write_atomic(os.path.join(rundir, "commit"), (args.commit or "") + "\n")
    write_atomic(os.path.join(rundir, "recipe_sha256"), digest + "\n")
    write_atomic(os.path.join(rundir, "env_keys"), "".join(k + "\n" for k in sorted(env)))
    meta = {"run": args.run, "recipe": os.path.basename(copy), "args": args.args, "cwd": cwd,
            "commit": args.commit, "recipe_sha256": digest, "host": socket.gethostname(),
            "started_at": time.time()}
    if cwd_note:
        meta["cwd_missing"] = cwd_note
    write_atomic(os.path.join(rundir, "meta.json"), json.dumps(meta, sort_keys=True) + "\n")

    ready_r, ready_w = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    if os.fork() == 0:   # the supervisor
        os.close(ready_r)
        code = 1
        try:
            supervise(rundir, argv, cwd, job_env, ready_w)
            code = 0
        finally:
            os._exit(code)
    os.close(ready_w)
    with os.fdopen(ready_r, "rb") as fh:
        ready = fh.read()
    if not ready:
        raise UsageError(f"the supervisor of run {args.run} died before starting it")
    started = json.loads(ready.decode())
    if "error" in started:
        raise UsageError(started["error"])
    started.update(meta)
    started["state"] = "running"
    started["run_dir"] = rundir
    started["log"] = os.path.join(rundir, "log")
    return started


def supervise(rundir, argv, cwd, env, ready_w):
    """Start the recipe in its own session, tell the caller, then record how it ends."""
    os.setsid()
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    devnull = os.open(os.devnull, os.O_RDWR)
    diag = os.open(os.path.join(rundir, "supervisor.log"),
                   os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(devnull, 0)
    os.dup2(diag, 1)
    os.dup2(diag, 2)
    try:
        with open("/proc/self/comm", "w") as fh:
            fh.write("tpufab-run")
    except OSError:
        pass
    log = os.open(os.path.join(rundir, "log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        child = subprocess.Popen(argv, cwd=cwd, env=env, stdin=devnull, stdout=log,
                                 stderr=log, start_new_session=True, close_fds=True)
    except OSError as err:
        os.write(ready_w, json.dumps({"error": f"cannot start {argv[0]}: {err}"}).encode())
        os.close(ready_w)
        write_atomic(os.path.join(rundir, "exit_code"), "127\n")
        write_atomic(os.path.join(rundir, "ended_at"), f"{time.time()}\n")
        return
    os.close(log)
    stat = proc_stat(child.pid)
    start_time = stat[2] if stat else 0
    write_atomic(os.path.join(rundir, "pid"), f"{child.pid}\n")
    write_atomic(os.path.join(rundir, "pgid"), f"{child.pid}\n")
    write_atomic(os.path.join(rundir, "start_time"), f"{start_time}\n")
    own = proc_stat(os.getpid())
    write_atomic(os.path.join(rundir, "supervisor_start_time"), f"{own[2] if own else 0}\n")
    write_atomic(os.path.join(rundir, "supervisor"), f"{os.getpid()}\n")
    os.write(ready_w, json.dumps({"pid": child.pid, "pgid": child.pid,
                                  "start_time": start_time}).encode())
    os.close(ready_w)
    code = child.wait()
    if code < 0:
        write_atomic(os.path.join(rundir, "killed"), signal.Signals(-code).name + "\n")
    else:
        write_atomic(os.path.join(rundir, "exit_code"), f"{code}\n")
    write_atomic(os.path.join(rundir, "ended_at"), f"{time.time()}\n")


# -- status --------------------------------------------------------------------------------


def run_status(rundir):
    """One run's state: running, exited (exit_code), killed (signal) or lost."""
    status = {"run": os.path.basename(rundir)}
    meta = read_text(os.path.join(rundir, "meta.json"))
    if meta:
        info = json.loads(meta)
        for key in ("commit", "recipe", "recipe_sha256", "started_at", "args", "cwd"):
            status[key] = info.get(key)
    pid = read_int(os.path.join(rundir, "pid"))
    start_time = read_int(os.path.join(rundir, "start_time"))
    status["pid"] = pid
    exit_code = read_int(os.path.join(rundir, "exit_code"))
    killed = read_text(os.path.join(rundir, "killed"))
    if exit_code is not None:
        status.update(state="exited", exit_code=exit_code)
    elif killed:
        status.update(state="killed", signal=killed)
    elif pid is not None and start_time is not None and same_process(pid, start_time):
        status["state"] = "running"
    elif pid is not None and start_time is not None and run_processes(status["run"]):
        status["state"] = "running"   # the leader is gone, some of its processes live on
    elif supervisor_alive(rundir):
        status["state"] = "running"   # the recipe just ended; its supervisor is recording it
    else:
        # No supervisor left to say how it ended (reboot, supervisor killed): lost.
        status["state"] = "lost" if pid is not None or not _starting(rundir) else "starting"
    ended = read_text(os.path.join(rundir, "ended_at"))
    status["ended_at"] = float(ended) if ended else None
    if os.path.exists(os.path.join(rundir, "stop_requested")):
        status["stop_requested"] = True
    try:
        status["log_size"] = os.path.getsize(os.path.join(rundir, "log"))
    except OSError:
        status["log_size"] = 0
    return status


def supervisor_alive(rundir):
    """The run's supervisor still lives (verified by its start time)."""
    pid = read_int(os.path.join(rundir, "supervisor"))
    start_time = read_int(os.path.join(rundir, "supervisor_start_time"))
    return pid is not None and start_time is not None and same_process(pid, start_time)


def _starting(rundir):
    supervisor = read_int(os.path.join(rundir, "supervisor"))
    return supervisor is None and time.time() - os.path.getmtime(rundir) < 30


def status(args):
    base = os.path.expanduser(args.run_dir)
    if args.run:
        names = args.run
        for name in names:
            if not os.path.isdir(run_path(args.run_dir, name)):
                raise UsageError(f"no run {name} on this worker")
    else:
        try:
            names = sorted(n for n in os.listdir(base) if os.path.isdir(os.path.join(base, n)))
        except OSError:
            names = []
    return {"host": socket.gethostname(),
            "runs": [run_status(run_path(args.run_dir, name)) for name in names]}


def exit_status(state):
    if state["state"] == "exited":
        return state["exit_code"] & 0xFF
    if state["state"] == "killed":
        try:
            return 128 + signal.Signals[state["signal"]].value
        except KeyError:
            return 128
    return EXIT_LOST


# -- tail ----------------------------------------------------------------------------------


def tail(args):
    rundir = run_path(args.run_dir, args.run)
    if not os.path.isdir(rundir):
        raise UsageError(f"no run {args.run} on this worker")
    path = os.path.join(rundir, "log")
    out = sys.stdout.buffer
    offset = args.offset
    with open(path, "rb") as fh:
        while True:
            state = run_status(rundir)
            live = state["state"] in ("running", "starting")
            fh.seek(offset)
            data = fh.read()
            if live and args.follow:
                # Hold back a partial last line until it is complete (or the run ends).
                data = data[:data.rfind(b"\n") + 1]
            if data:
                out.write(data)
                out.flush()
                offset += len(data)
            if not (live and args.follow):
                break
            time.sleep(POLL)
    state["offset"] = offset
    sys.stderr.write(json.dumps(state, sort_keys=True) + "\n")
    return exit_status(state) if state["state"] not in ("running", "starting") else 0


# -- stop ----------------------------------------------------------------------------------


def stop(args):
    """TERM the run's processes, KILL after --grace. The group is signalled only while its
    leader is verified by start time; escaped processes are found by TPUFAB_RUN_ID."""
    rundir = run_path(args.run_dir, args.run)
    if not os.path.isdir(rundir):
        raise UsageError(f"no run {args.run} on this worker")
    before = run_status(rundir)
    result = {"run": args.run, "before": before["state"], "signal": None}
    pid = read_int(os.path.join(rundir, "pid"))
    start_time = read_int(os.path.join(rundir, "start_time"))
    group = pid if pid is not None and same_process(pid, start_time) else None
    if before["state"] in ("running", "starting"):
        write_atomic(os.path.join(rundir, "stop_requested"), f"{time.time()}\n")
    for signum, timeout in ((signal.SIGTERM, args.grace), (signal.SIGKILL, 5.0)):
        procs = run_processes(args.run, group)
        if not procs:
            break
        if group is not None:
            try:
                os.killpg(group, signum)
            except ProcessLookupError:
                pass
        for other in procs:
            stat = proc_stat(other)
            if stat is not None and (group is None or stat[1] != group):
                try:
                    os.kill(other, signum)
                except ProcessLookupError:
                    pass
        result["signal"] = signal.Signals(signum).name[3:]
        deadline = time.monotonic() + timeout
        while run_processes(args.run, group) and time.monotonic() < deadline:
            time.sleep(POLL)
    # The supervisor records the end right after the recipe is gone.
    deadline = time.monotonic() + 5.0
    while run_status(rundir)["state"] in ("running", "starting") and \
            time.monotonic() < deadline:
        time.sleep(POLL)
    after = run_status(rundir)
    result["state"] = after["state"]
    if "exit_code" in after:
        result["exit_code"] = after["exit_code"]
    if "signal" in after:
        result["ended_by"] = after["signal"]
    left = run_processes(args.run, group)
    if left:
        result["still_running"] = left
    return result


# -- main ----------------------------------------------------------------------------------


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("start", help="start a recipe detached")
    p.add_argument("--run", required=True)
    p.add_argument("--recipe", required=True, help="the recipe file (copied into the run)")
    p.add_argument("--recipe-sha256", help="refuse to start if the recipe's hash differs")
    p.add_argument("--cwd", help="working directory (home when absent or missing)")
    p.add_argument("--commit", help="the deployed commit, recorded with the run")
    p.add_argument("--env-file", help="JSON object of the job environment (0600; "
                   "removed after reading unless --keep-env-file)")
    p.add_argument("--env-stdin", action="store_true",
                   help="read a JSON job environment from stdin (on top of --env-file)")
    p.add_argument("--keep-env-file", action="store_true")
    p.add_argument("args", nargs="*", help="arguments for the recipe (after --)")
    p = sub.add_parser("status", help="state of runs (all, or --run ID ...)")
    p.add_argument("--run", action="append")
    p = sub.add_parser("tail", help="stream a run's log")
    p.add_argument("--run", required=True)
    p.add_argument("--offset", type=int, default=0)
    p.add_argument("--follow", action="store_true", help="keep streaming until the run ends")
    p = sub.add_parser("stop", help="stop a run: TERM its process group, then KILL")
    p.add_argument("--run", required=True)
    p.add_argument("--grace", type=float, default=10.0)
    for p in sub.choices.values():
        p.add_argument("--run-dir", default=DEFAULT_RUN_DIR)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if args.command == "tail":
            try:
                return tail(args)
            except (BrokenPipeError, KeyboardInterrupt):
                return 0
        result = {"start": start, "status": status, "stop": stop}[args.command](args)
    except (UsageError, OSError, ValueError) as err:
        json.dump({"error": str(err)}, sys.stdout)
        sys.stdout.write("\n")
        return 2
    json.dump(result, sys.stdout, sort_keys=True)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
