#!/usr/bin/env python3
"""tpufab runs, worker side (stdlib only): start a recipe detached, report, follow, stop.

    run_worker.py start  --run ID --recipe PATH [--recipe-sha256 HEX] [--cwd DIR] [--commit SHA]
                     [--in-checkout PATH] [--env-file PATH] [--env-stdin] [--keep-env-file] [--mounts-dir DIR]
                     [--image REF [--hardened]] [--run-dir DIR] [-- ARGS]
    run_worker.py status [--run ID ...] [--run-dir DIR]
    run_worker.py tail   --run ID [--offset N] [--follow] [--run-dir DIR]
    run_worker.py stop   --run ID [--grace S] [--run-dir DIR]

A run lives in <run-dir>/<run-id>/ (default ~/.tpufab/runs): `recipe/<name>` (the exact bytes
given; what runs is the recipe's own file in the deployed checkout, `--in-checkout`, when it
holds those bytes, so `$0` and `$(dirname "$0")` mean what they do at home, else this copy;
`meta.json` says which, as `recipe_path`), `pid`, `pgid`, `start_time` (field 22 of /proc/<pid>/stat), `commit`,
`recipe_sha256`, `env_keys` (names only, never values), `meta.json`, `log` (stdout and stderr),
`end.json` (4 KiB reserved when the run starts, so how it ended can be recorded on a full
disk) and, once the recipe ends, `exit_code` or `killed` (signal name) plus `ended_at`.

Preemption and maintenance notices: while the recipe runs, the supervisor watches the VM's
metadata server (`instance/preempted`, `instance/maintenance-event`, with `wait_for_change`).
When a notice comes, it writes it to `notice` (the path is in the recipe's
`TPUFAB_PREEMPT_NOTICE`), appends a line to the log, and sends the recipe's process group
`TPUFAB_PREEMPT_SIGNAL` from the job environment (default TERM; `none` sends nothing), so the
job can checkpoint. Where there is no metadata server (not a cloud VM) it quietly does nothing.

The recipe runs in its own session and process group with stdin from /dev/null, under a
small supervisor (also its own session) that waits for it and records how it ended, so
neither survives on the SSH connection that started them. The job environment (secrets
included) comes from a JSON object in a 0600 file or on stdin, never from argv.

With --image the supervisor runs `docker run` instead (`container_argv`: privileged, host
network, the host's shm size, memlock unlimited where the host allows it, /tmp, the checkout
and the run's folder at their own paths, label `tpufab-run=ID`, name `tpufab-ID`), and the
job environment reaches the recipe on the container's stdin (ENTER), never in argv, a file or
`docker inspect`; `stop` stops that container through the runtime.

The recipe's output reaches `log` only through the supervisor, which masks every secret
value of the job environment (as is, URL-encoded and JSON-escaped; also when a value is
split across two writes) as `***` before writing. When the disk fills up, output is counted
and dropped (the recipe never blocks on it) and `end.json` says so.

`start`, `status` and `stop` print one JSON object. `tail` streams the log bytes (whole lines
while the run is live), then prints one JSON status line on stderr and exits with the run's
code (128+N when killed by signal N, 255 when lost). Killing a follower never touches the run.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

from tpufab.remote.workerlib import (
    CONTAINER_ID,
    SUPERVISOR_NAME,
    CarriedRunIds,
    EndRecord,
    Masker,
    alive,
    answer,
    mount_records,
    proc_stat,
    read_int,
    read_text,
    run_processes,
    secret_forms,
    state_of_run,
    write_atomic,
)

DEFAULT_RUN_DIR = "~/.tpufab/runs"
METADATA = "http://metadata.google.internal/computeMetadata/v1/instance/"
NOTICE_MARK = "tpufab: notice:"  # the log line babysit looks for
RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# The fan-out agent tags the processes of a connection with this, and reaps them when the
# connection goes away; a run must outlive its connection, so it never inherits the tag.
DROPPED_ENV = ("TPUFAB_TASK",)
POLL = 0.05
EXIT_LOST = 255
CHUNK = 1 << 16
SUPERVISED_JOB = "TPUFAB_SUPERVISED_JOB"   # the supervised job a run is an attempt of
DRAIN_BOUND = 30.0   # seconds the end record waits for the log to take what the recipe wrote
LINE_LIMIT = 1 << 20     # tail --follow holds back a partial line up to this size
DISK_FULL = (28, 122)    # ENOSPC, EDQUOT


class UsageError(Exception):
    pass


# -- small file helpers ------------------------------------------------------------------


def run_path(run_dir, run_id):
    if not RUN_ID.match(run_id or ""):
        raise UsageError(f"bad run id {run_id!r}")
    return os.path.join(os.path.expanduser(run_dir), run_id)


# -- start -------------------------------------------------------------------------------


def read_environment(args):
    """The job environment and the values to mask: JSON objects of strings from --env-file
    and/or --env-stdin.

    Both may be given: the file holds what differs per worker (its rank), stdin what must
    never touch a disk (secrets, masked in the log); stdin wins on a clash.
    """
    env = {}
    sources = []
    if args.env_file:
        path = os.path.expanduser(args.env_file)
        try:
            with open(path, "rb") as fh:
                sources.append((fh.read(), False))
        finally:
            if not args.keep_env_file:
                try:
                    os.unlink(path)
                except OSError:
                    pass
    if args.env_stdin:
        sources.append((sys.stdin.buffer.read(), True))
    secrets = []
    for raw, secret in sources:
        part = json.loads(raw.decode() or "{}")
        if not isinstance(part, dict):
            raise UsageError("the job environment must be a JSON object")
        env.update(part)
        if secret:
            secrets += [v for v in part.values() if isinstance(v, str)]
    for key, value in env.items():
        if not ENV_KEY.match(key) or not isinstance(value, str):
            raise UsageError(f"bad environment entry {key!r}: names are identifiers, "
                             "values strings")
    return env, secrets


def job_python(env):
    """The job's Python, handed to the recipe as $TPUFAB_PYTHON (and running a .py recipe):
    $TPUFAB_PYTHON, $VIRTUAL_ENV/bin/python, ~/.venv/bin/python (what setup makes), python3."""
    for candidate in (env.get("TPUFAB_PYTHON"),
                      env.get("VIRTUAL_ENV") and os.path.join(env["VIRTUAL_ENV"], "bin", "python"),
                      os.path.expanduser("~/.venv/bin/python")):
        if candidate and os.access(os.path.expanduser(candidate), os.X_OK):
            return os.path.expanduser(candidate)
    return "python3"


def recipe_argv(path, args, env=None):
    """A .py file runs with the job's Python (like `python train.py`, whatever its shebang);
    anything else by its shebang (read here when the file is not executable, as a checkout's
    file may be), else sh."""
    if path.endswith(".py"):
        return [job_python(os.environ if env is None else env), path, *args]
    with open(path, "rb") as fh:
        head = fh.readline(4096)
    if head.startswith(b"#!"):
        if os.access(path, os.X_OK):
            return [path, *args]
        words = head[2:].decode("utf-8", "replace").split(None, 1)
        if words:
            return [words[0], *words[1:2], path, *args]
    return ["/bin/sh", path, *args]


def checkout_recipe(path, digest):
    """The recipe's own file in the deployed checkout when it holds the bytes tpufab shipped
    (sha256 ``digest``): (path, None); else (None, why not)."""
    try:
        with open(path, "rb") as fh:
            there = hashlib.sha256(fh.read()).hexdigest()
    except OSError as err:
        return None, f"{path}: {err.strerror}"
    if there != digest:
        return None, f"{path} differs from the recipe given"
    return path, None


def output_dirs(run_id, rundir, mounts_dir):
    """TPUFAB_OUTPUT_DIR and TPUFAB_PROFILE_DIR: on the first bucket tpufab mounted here
    (``<mount>/tpufab/runs/<run-id>/{output,profile}``, shared by every worker), else in the
    run's own directory. Made here, so a recipe can write at once."""
    bases = [os.path.join(record["at"], "tpufab", "runs", run_id)
             for _, record in (mount_records(mounts_dir) if mounts_dir else ())
             if os.path.ismount(record["at"])]
    for base in (*bases, rundir):
        dirs = {"TPUFAB_OUTPUT_DIR": os.path.join(base, "output"),
                "TPUFAB_PROFILE_DIR": os.path.join(base, "profile")}
        try:
            for path in dirs.values():
                os.makedirs(path, exist_ok=True)
        except OSError:
            continue                  # a read-only or broken mount: the next place
        return dirs
    return {}

# -- a recipe inside a container image (`run --image`) -----------------------------------

CONTAINER_LABEL = "tpufab-run"
# Runs in the container (its python3): the job environment comes on stdin (never argv, a
# file or `docker inspect`), on top of the image's own; then stdin is /dev/null, as for a
# recipe without an image, and the recipe replaces it.
ENTER = ("import json,os,sys\n"
         "env=json.loads(sys.stdin.buffer.read().decode() or '{}')\n"
         "fd=os.open(os.devnull,os.O_RDONLY);os.dup2(fd,0);os.close(fd)\n"
         "os.execvpe(sys.argv[1],sys.argv[1:],{**os.environ,**env})\n")
TPU_DEVICES = ("/dev/accel", "/dev/vfio/")


def docker_prefix():
    """`docker`, through `sudo -n` unless root or allowed on the daemon's socket."""
    if os.geteuid() == 0 or os.access("/var/run/docker.sock", os.W_OK):
        return ["docker"]
    return ["sudo", "-n", "docker"]


def container_name(run_id):
    return "tpufab-" + re.sub(r"[^A-Za-z0-9_.-]", "-", run_id)


def shm_bytes():
    """The host's shared memory size (/dev/shm), for the container's."""
    try:
        st = os.statvfs("/dev/shm")
        size = st.f_blocks * st.f_frsize
    except OSError:
        size = 0
    if size <= 0:
        try:
            size = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
        except (OSError, ValueError):
            size = 1 << 30
    return size


def tpu_device_files():
    found = []
    for base in ("/dev", "/dev/vfio"):
        try:
            names = sorted(os.listdir(base))
        except OSError:
            continue
        for name in names:
            path = os.path.join(base, name)
            if path.startswith(TPU_DEVICES) and name != "vfio":
                found.append(path)
    return found


def memlock_unlimited(prefix):
    """Whether this host lets a container have memlock unlimited (raising the hard limit
    needs CAP_SYS_RESOURCE: a TPU VM's root has it; some sandboxes refuse it)."""
    root = [] if prefix[0] != "sudo" else ["sudo", "-n"]
    try:
        return subprocess.run([*root, "prlimit", "--memlock=unlimited:unlimited", "true"],
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def container_argv(args, rundir, cwd, recipe_argv_, notes):
    """`docker run` for the recipe in ``args.image``: privileged (or --hardened: each TPU
    device file given alone), host network, the host's shared memory size, memlock
    unlimited, /tmp shared, the checkout and the run's folder at their own paths, a tpufab
    label and a name from the run id."""
    prefix = docker_prefix()
    argv = [*prefix, "run", "--rm", "-i", "--init", "--name", container_name(args.run),
            "--label", f"{CONTAINER_LABEL}={args.run}", "--network", "host",
            "--shm-size", f"{shm_bytes()}b"]
    devices = tpu_device_files()
    if not args.hardened:
        argv.append("--privileged")
    for path in devices:
        try:
            is_device = os.path.exists(path) and (os.stat(path).st_mode & 0o170000) in (
                0o020000, 0o060000)
        except OSError:
            continue
        if is_device and args.hardened:
            argv += ["--device", f"{path}:{path}"]
        elif not is_device:   # a placeholder file (the simulated pod): bound as it is
            argv += ["-v", f"{path}:{path}"]
    if memlock_unlimited(prefix):
        argv += ["--ulimit", "memlock=-1:-1"]
    else:
        notes.append("memlock: this host refuses unlimited (no CAP_SYS_RESOURCE); the "
                     "container has the host's limit")
    mounts = ["/tmp"]
    for path in (cwd, rundir):
        if path and not any(path == m or path.startswith(m.rstrip("/") + "/") for m in mounts):
            mounts.append(path)
    for path in mounts:
        argv += ["-v", f"{path}:{path}"]
    cidfile = os.path.join(rundir, CONTAINER_ID)   # its id: top and stacks find its processes
    if os.path.lexists(cidfile):
        os.unlink(cidfile)
    argv += ["--cidfile", cidfile, "-w", cwd, args.image, "python3", "-S", "-c", ENTER,
             *recipe_argv_]
    return argv


def container_stop(run_id, grace):
    """Stop the run's container (by its name; only if it carries the run's label)."""
    prefix = docker_prefix()
    name = container_name(run_id)
    try:
        found = subprocess.run([*prefix, "ps", "-q", "--filter", f"name=^{name}$", "--filter",
                                f"label={CONTAINER_LABEL}={run_id}"], capture_output=True,
                               text=True, timeout=30, stdin=subprocess.DEVNULL)
        if found.returncode != 0 or not found.stdout.strip():
            return None
        stopped = subprocess.run([*prefix, "stop", "-t", str(max(0, int(grace))), name],
                                 capture_output=True, text=True, timeout=grace + 60,
                                 stdin=subprocess.DEVNULL)
        return name if stopped.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired):
        return None


def start(args):
    env, secrets = read_environment(args)   # first: the env file is consumed even on failure
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
    # the bytes that were hashed, not the file again (it may have changed since)
    fd = os.open(copy, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o755)
    with os.fdopen(fd, "wb") as fh:
        fh.write(content)
    os.chmod(copy, 0o755)

    job_env = {k: v for k, v in os.environ.items() if k not in DROPPED_ENV}
    job_env.update(env)
    if env.get("VIRTUAL_ENV"):   # the environment tpufab built: its bin first on PATH
        job_env["VIRTUAL_ENV"] = os.path.expanduser(env["VIRTUAL_ENV"])
        job_env["PATH"] = os.path.join(job_env["VIRTUAL_ENV"], "bin") + os.pathsep + \
            job_env.get("PATH", os.defpath)
    job_env["TPUFAB_RUN_ID"] = args.run
    job_env["TPUFAB_RUN_DIR"] = rundir
    job_env["TPUFAB_PREEMPT_NOTICE"] = os.path.join(rundir, "notice")
    job_env.setdefault("PYTHONUNBUFFERED", "1")   # log lines as they happen, not per 8 KiB
    job_env["TPUFAB_PYTHON"] = job_python(job_env)  # one lookup: every recipe runs $TPUFAB_PYTHON
    for key, value in output_dirs(args.run, rundir, args.mounts_dir).items():
        if key not in env:                        # `--env TPUFAB_OUTPUT_DIR=...` wins
            job_env[key] = value
    run_path_ = copy
    checkout_note = None
    if args.in_checkout:
        found, checkout_note = checkout_recipe(os.path.expanduser(args.in_checkout), digest)
        run_path_ = found or copy
    container_env = None
    notes = []
    if args.image:
        # inside the image: the job environment alone (plus the image's own), its python3
        container_env = dict(env)
        for key in ("TPUFAB_RUN_ID", "TPUFAB_RUN_DIR", "TPUFAB_PREEMPT_NOTICE",
                    "PYTHONUNBUFFERED", "TPUFAB_OUTPUT_DIR", "TPUFAB_PROFILE_DIR"):
            if key in job_env:
                container_env.setdefault(key, job_env[key])
        container_env.setdefault("TPUFAB_PYTHON", "python3")
        inside = ([container_env["TPUFAB_PYTHON"], run_path_, *args.args]   # the image's
                  if run_path_.endswith(".py") else recipe_argv(run_path_, args.args))
        argv = container_argv(args, rundir, cwd, inside, notes)
        job_env = {k: v for k, v in os.environ.items() if k not in DROPPED_ENV}
        job_env["TPUFAB_RUN_ID"] = args.run
    else:
        argv = recipe_argv(run_path_, args.args, job_env)

    write_atomic(os.path.join(rundir, "commit"), (args.commit or "") + "\n")
    write_atomic(os.path.join(rundir, "recipe_sha256"), digest + "\n")
    write_atomic(os.path.join(rundir, "env_keys"), "".join(k + "\n" for k in sorted(env)))
    meta = {"run": args.run, "recipe": os.path.basename(copy), "args": args.args, "cwd": cwd,
            "commit": args.commit, "recipe_sha256": digest, "host": socket.gethostname(),
            "started_at": time.time(), "output_dir": job_env.get("TPUFAB_OUTPUT_DIR"),
            "profile_dir": job_env.get("TPUFAB_PROFILE_DIR")}
    meta["recipe_path"] = run_path_
    meta["recipe_shipped"] = run_path_ == copy
    if checkout_note:
        meta["in_checkout_missing"] = checkout_note
    if cwd_note:
        meta["cwd_missing"] = cwd_note
    if env.get(SUPERVISED_JOB):     # started by tpufab's supervisor: the job it belongs to
        meta["job"] = env[SUPERVISED_JOB]
    if args.image:
        meta["image"] = args.image
        meta["container"] = container_name(args.run)
        if notes:
            meta["container_notes"] = notes
    write_atomic(os.path.join(rundir, "meta.json"), json.dumps(meta, sort_keys=True) + "\n")

    ready_r, ready_w = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    if os.fork() == 0:   # the supervisor
        os.close(ready_r)
        code = 1
        try:
            supervise(rundir, argv, cwd, job_env, ready_w,
                      [f.encode() for f in secret_forms(secrets)],
                      stdin_data=None if container_env is None else
                      json.dumps(container_env).encode())
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


def supervise(rundir, argv, cwd, env, ready_w, forms=(), stdin_data=None):
    """Start the recipe in its own session, tell the caller, copy its output (masked) into
    the log, then record how it ended. ``stdin_data``: written to its stdin (a pipe), then
    closed (the job environment of a container)."""
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
            fh.write(SUPERVISOR_NAME)
    except OSError:
        pass
    end = EndRecord(rundir)
    log = os.open(os.path.join(rundir, "log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    out_r, out_w = os.pipe()
    try:
        child = subprocess.Popen(argv, cwd=cwd, env=env,
                                 stdin=devnull if stdin_data is None else subprocess.PIPE,
                                 stdout=out_w, stderr=out_w, start_new_session=True,
                                 close_fds=True)
    except OSError as err:
        os.write(ready_w, json.dumps({"error": f"cannot start {argv[0]}: {err}"}).encode())
        os.close(ready_w)
        end.write(exit_code=127)
        return
    os.close(out_w)
    if stdin_data is not None:
        threading.Thread(target=feed, args=(child.stdin, stdin_data), daemon=True).start()
    recipe = proc_stat(child.pid)
    start_time = recipe.start_time if recipe else 0
    own = proc_stat(os.getpid())
    try:  # before any output is copied: the recipe's own output may fill the disk
        write_atomic(os.path.join(rundir, "pid"), f"{child.pid}\n")
        write_atomic(os.path.join(rundir, "pgid"), f"{child.pid}\n")
        write_atomic(os.path.join(rundir, "start_time"), f"{start_time}\n")
        write_atomic(os.path.join(rundir, "supervisor_start_time"),
                     f"{own.start_time if own else 0}\n")
        write_atomic(os.path.join(rundir, "supervisor"), f"{os.getpid()}\n")
    except OSError as err:  # no record of it: it must not run on unsupervised
        with contextlib.suppress(OSError):
            os.killpg(child.pid, signal.SIGKILL)
        child.wait()
        os.write(ready_w, json.dumps({"error": f"cannot record run {os.path.basename(rundir)} "
                                               f"in {rundir}: {err.strerror or err}"}).encode())
        os.close(ready_w)
        return
    copier = LogCopier(out_r, log, Masker(forms), rundir)
    thread = threading.Thread(target=copier.run, name="tpufab-log", daemon=True)
    thread.start()
    os.write(ready_w, json.dumps({"pid": child.pid, "pgid": child.pid,
                                  "start_time": start_time}).encode())
    os.close(ready_w)
    threading.Thread(target=relay_notices, args=(rundir, child, env), daemon=True).start()
    code = child.wait()
    # Everything the recipe wrote before it ended is in the pipe by now: record the end once
    # the copier has drained it into the log (so a reader who sees the end sees all of that
    # output), not at the pipe's end of file, which a process the recipe left behind may hold
    # off for as long as it lives; the copier goes on copying what such a process writes.
    copier.ended()
    copier.drained.wait(DRAIN_BOUND)
    end.write(exit_code=code if code >= 0 else None,
              killed=signal.Signals(-code).name if code < 0 else None,
              disk_full=copier.disk_full())
    thread.join()


def feed(pipe, data):
    try:
        pipe.write(data)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            pipe.close()


class LogCopier:
    """Copies the recipe's output from a pipe into the log, masking secrets. On a full disk
    the output is counted and dropped (the recipe never blocks on it); once there is room
    again, a line says how much is missing there."""

    def __init__(self, pipe, log, masker, where):
        self.pipe, self.log, self.masker, self.where = pipe, log, masker, where
        self.wake_r, self.wake_w = os.pipe()
        self.drained = threading.Event()   # all that was in the pipe at ended() is in the log
        self.written = 0
        self.missing = 0        # dropped since the last successful write
        self.lost = 0           # dropped in all
        self.full_at = None     # log size when the disk first filled up
        self.error = None

    def ended(self):
        """The recipe has ended: `drained` is set once the pipe has nothing more to read."""
        os.write(self.wake_w, b"x")

    def run(self):
        poller = select.poll()
        poller.register(self.pipe, select.POLLIN)
        poller.register(self.wake_r, select.POLLIN)
        try:
            while True:
                ready = {fd for fd, _ in poller.poll()}
                if self.pipe in ready:
                    data = os.read(self.pipe, CHUNK)
                    if not data:
                        break
                    self._write(self.masker.feed(data))
                elif self.wake_r in ready:
                    # Woken after the recipe ended, and the pipe is empty now: what the recipe
                    # wrote is in the log (what the masker holds back is a secret's possible
                    # start, kept until more output or the end of file decides it).
                    poller.unregister(self.wake_r)
                    self.drained.set()
            self._write(self.masker.flush())
        finally:
            self.drained.set()
            os.close(self.pipe)
            os.close(self.log)

    def _write(self, data):
        if not data:
            return
        if self.missing:
            note = (f"[tpufab: {self.missing} bytes of output lost here: "
                    f"{self.error}]\n").encode()
            if self._put(note):
                self._drop(len(data))
                return
            self.missing = 0
        left = self._put(data)
        if left:
            self._drop(left)

    def _drop(self, size):
        self.missing += size
        self.lost += size

    def _put(self, data):
        """Write all of `data`; the number of bytes that did not fit."""
        view = memoryview(data)
        while view:
            try:
                n = os.write(self.log, view)
            except OSError as err:
                if err.errno not in DISK_FULL:
                    raise
                if self.full_at is None:
                    self.full_at = self.written
                self.error = os.strerror(err.errno).lower()
                return len(view)
            self.written += n
            view = view[n:]
        return 0

    def disk_full(self):
        """What the end record says about a disk that filled up, or None."""
        if self.full_at is None:
            return None
        return {"dir": self.where, "log_bytes": self.full_at, "lost_bytes": self.lost,
                "error": self.error}


# -- preemption and maintenance notices ---------------------------------------------------


def metadata_value(key, etag=None, timeout=None):
    """(value, etag) of instance/KEY; with etag, block until it changes (or timeout s)."""
    url = METADATA + key
    if etag is not None:
        url += "?wait_for_change=true&last_etag=" + etag + f"&timeout_sec={int(timeout or 300)}"
    request = urllib.request.Request(url, headers={"Metadata-Flavor": "Google"})
    with urllib.request.urlopen(request, timeout=(timeout or 10) + 10) as answer:
        return answer.read().decode().strip(), answer.headers.get("ETag", "")


def notice_of(key, value):
    if key == "preempted" and value == "TRUE":
        return "preempted: the VM is being preempted (instance/preempted=TRUE)"
    if key == "maintenance-event" and value not in ("", "NONE"):
        return f"maintenance: {value} (instance/maintenance-event)"
    return None


def relay_notices(rundir, child, env):
    """Watch both keys (a thread each); the first notice signals the recipe's group once."""
    name = (env.get("TPUFAB_PREEMPT_SIGNAL") or "TERM").upper().removeprefix("SIG")
    signum = None if name == "NONE" else getattr(signal, "SIG" + name, signal.SIGTERM)
    once = threading.Lock()

    def deliver(text):
        if not once.acquire(blocking=False):
            return
        write_atomic(os.path.join(rundir, "notice"), text + "\n")
        sent = "nothing sent" if signum is None else \
            f"sent SIG{signal.Signals(signum).name[3:]} to the recipe"
        with open(os.path.join(rundir, "log"), "a") as log:
            log.write(f"{NOTICE_MARK} {text}; {sent}\n")
        if signum is not None and child.poll() is None:
            try:
                os.killpg(child.pid, signum)
            except ProcessLookupError:
                pass

    def watch(key):
        failures = 0
        etag = None
        while child.poll() is None:
            try:
                value, etag = metadata_value(key, etag, timeout=300 if etag else None)
            except (OSError, ValueError):  # no metadata server here, or it went away
                failures += 1
                if failures >= 3:
                    return
                time.sleep(1.0 * failures)
                continue
            failures = 0
            text = notice_of(key, value)
            if text:
                deliver(text)
                return

    for key in ("preempted", "maintenance-event"):
        threading.Thread(target=watch, args=(key,), daemon=True).start()


# -- status --------------------------------------------------------------------------------


def run_status(rundir, carried=None):
    """One run's state (workerlib's ``state_of_run``: running, starting, exited with
    exit_code, killed by signal, or lost) with what run_worker.py recorded about it."""
    status = {"run": os.path.basename(rundir)}
    meta = read_text(os.path.join(rundir, "meta.json"))
    try:
        info = json.loads(meta) if meta else {}
    except ValueError:      # not run_worker.py's (a stray directory): a run without its record
        info = {}
    if isinstance(info, dict):
        for key in ("commit", "recipe", "recipe_sha256", "started_at", "args", "cwd"):
            status[key] = info.get(key)
        if info.get("job"):
            status["job"] = info["job"]
    status["pid"] = read_int(os.path.join(rundir, "pid"))
    status.update(state_of_run(rundir, carried))
    if os.path.exists(os.path.join(rundir, "stop_requested")):
        status["stop_requested"] = True
    notice = read_text(os.path.join(rundir, "notice"))
    if notice:
        status["notice"] = notice
    try:
        log = os.stat(os.path.join(rundir, "log"))
        status["log_size"] = log.st_size
        # seconds since the recipe last wrote, on this worker's clock: what the stall
        # watchdog asks before it calls a silence a stall (its client may have been paused)
        status["log_age"] = round(max(0.0, time.time() - log.st_mtime), 3)
    except OSError:
        status["log_size"] = 0
    return status


def status(args):
    base = os.path.expanduser(args.run_dir)
    if args.run:
        names = args.run
        for name in names:
            if not os.path.isdir(run_path(args.run_dir, name)):
                raise UsageError(f"no run {name} on this worker")
    else:
        try:   # (a directory no run could have made, `.tmp`, `my dir`, is not a run)
            names = sorted(n for n in os.listdir(base) if RUN_ID.match(n)
                           and os.path.isdir(os.path.join(base, n)))
        except OSError:
            names = []
    carried = CarriedRunIds()   # one /proc scan at most, for every run that needs it
    return {"host": socket.gethostname(),
            "runs": [run_status(run_path(args.run_dir, name), carried) for name in names]}


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
    """Stream the log from --offset in bounded pieces; with --follow, until the run ends,
    holding back a partial last line (up to LINE_LIMIT) while it is live."""
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
            hold = live and args.follow
            while True:
                fh.seek(offset)
                data = fh.read(LINE_LIMIT)
                if hold:
                    cut = data.rfind(b"\n") + 1
                    if cut or len(data) < LINE_LIMIT:
                        data = data[:cut]     # a longer line goes out in LINE_LIMIT pieces
                if not data:
                    break
                out.write(data)
                offset += len(data)
            out.flush()
            if not hold:
                break
            time.sleep(POLL)
    state["offset"] = offset
    answer("state", state, sys.stderr)
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
    group = pid if pid is not None and alive(pid, start_time) else None
    if before["state"] in ("running", "starting"):
        write_atomic(os.path.join(rundir, "stop_requested"), f"{time.time()}\n")
    meta = read_text(os.path.join(rundir, "meta.json"))
    try:
        container = json.loads(meta).get("container") if meta else None
    except (ValueError, AttributeError):
        container = None
    if container and before["state"] in ("running", "starting"):
        # its processes are root's (the runtime's): stopped through the runtime
        result["container"] = container_stop(args.run, args.grace)
    for signum, timeout in ((signal.SIGTERM, args.grace), (signal.SIGKILL, 5.0)):
        procs = run_processes({args.run: group})[args.run]
        if not procs:
            break
        if group is not None:
            try:
                os.killpg(group, signum)
            except (ProcessLookupError, PermissionError):
                pass
        for other in procs:
            if group is None or other.pgid != group:
                try:
                    os.kill(other.pid, signum)
                except (ProcessLookupError, PermissionError):   # a container's (root's)
                    pass
        result["signal"] = signal.Signals(signum).name[3:]
        deadline = time.monotonic() + timeout
        while run_processes({args.run: group})[args.run] and time.monotonic() < deadline:
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
    left = run_processes({args.run: group})[args.run]
    if left:
        result["still_running"] = [proc.pid for proc in left]
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
    p.add_argument("--in-checkout", help="the recipe's path in the deployed checkout: run "
                   "it there (so $0 is that path) when it holds the same bytes")
    p.add_argument("--env-file", help="JSON object of the job environment (0600; "
                   "removed after reading unless --keep-env-file)")
    p.add_argument("--env-stdin", action="store_true",
                   help="read a JSON job environment from stdin (on top of --env-file)")
    p.add_argument("--keep-env-file", action="store_true")
    p.add_argument("--mounts-dir", help="where tpufab records its mounts; the first mounted "
                   "one holds TPUFAB_OUTPUT_DIR and TPUFAB_PROFILE_DIR")
    p.add_argument("--image", help="run the recipe inside this image (pinned by digest)")
    p.add_argument("--hardened", action="store_true", help="with --image: not privileged; "
                   "each TPU device file given alone")
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
        answer("answer", {"error": str(err)})
        return 2
    answer("answer", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
