#!/usr/bin/env python3
"""tpufab kill, worker side (stdlib only): leave every TPU on this host free, safely.

    kill_worker.py [--devices-glob GLOB ...] [--lockfile PATH ...] [--run-dir DIR] [--run ID]
               [--grace S] [--settle S] [--dry-run] [--force]

1. tpufab runs (all, or --run ID): the recorded process group is signalled only after the
   recorded pid is verified by its start time (a reused pid is never signalled).
2. Remaining holders of the TPU device files (every family: /dev/accel* and /dev/vfio/N)
   and of the libtpu lockfiles, found by scanning /proc/*/fd. Protected processes (pid 1,
   sshd, systemd, container runtimes, TPU runtime and health agents, and this kill's own
   ancestry) are reported and left alone; --force stops the name-protected ones too (never
   pid 1 or the ancestry).
   Everything is sent SIGTERM at once, then SIGKILL after --grace seconds for what is left
   (given up to KILL_WAIT seconds to exit).
3. Wait (bounded by --settle) until no unprotected process holds a device file or lockfile,
   then remove each lockfile that no live process holds.
4. Print one JSON report on stdout. Nothing to do is a clean no-op. --dry-run only reports.
Exit status: 0 when the devices are free (or --dry-run), 1 otherwise.
"""

from __future__ import annotations

import fnmatch
import os
import select
import signal
import sys
import time

from tpufab.remote.workerlib import (
    DEVICE_GLOBS,
    Watched,
    alive,
    answer,
    argv_of,
    command_of,
    expand_globs,
    is_live,
    proc_stat,
    program_names,
    read_end,
    read_int,
    read_json,
    run_processes,
    scan_holders,
)

DEFAULT_LOCKFILES = ("/tmp/libtpu_lockfile", "/tmp/libtpu.so_lockfile")
DEFAULT_RUN_DIR = "~/.tpufab/runs"

# Matched (fnmatch) against the kernel's comm and the basename of argv[0].
PROTECTED_NAMES = (
    "init", "systemd", "systemd-*", "(sd-pam)",
    "sshd", "sshd-session", "sshd-auth",
    "containerd", "containerd-shim*", "dockerd", "docker", "docker-proxy", "docker-init",
    "runc", "crun", "crio", "conmon", "podman", "kubelet", "tini",
    "tpu-runtime", "tpu_runtime", "tpu-runtime-*", "tpu_runtime_*", "tpu-device-plugin",
    "healthagent", "health-agent", "health_agent", "tpu-health*", "tpu_health*",
    "tpu-monitor*", "tpu_monitor*",
    "google_guest_agent", "google-guest-agent", "google_osconfig_agent",
    "google-osconfig-agent", "guest-agent",
)
POLL = 0.02
CONFIRM = 0.2    # after the holders are gone, how long to watch for one coming back
# How long SIGKILLed processes get to exit before they are reported NOT KILLED: one inside
# a driver call dies when the call returns, and on a starved host (load 99 in CI) 2 s was
# too short. The wait ends as soon as they are gone (pidfds), so it costs nothing else.
KILL_WAIT = 10.0


def ancestry(pid):
    """`pid` and every ancestor up to pid 1."""
    chain = []
    while pid > 0 and pid not in chain:
        chain.append(pid)
        proc = proc_stat(pid)
        if proc is None:
            break
        pid = proc.ppid
    return chain


def protected_name(names, patterns=PROTECTED_NAMES):
    """The first of `names` that a protected pattern matches ("" when none). `tpufab status`
    uses it too, so both say the same about a protected holder."""
    for name in names:
        for pattern in patterns:
            if name and fnmatch.fnmatchcase(name, pattern):
                return name
    return ""


def protection(proc, own_ancestry, patterns):
    """Why `proc` must not be stopped without --force ("" when it may be)."""
    if proc.pid == 1:
        return "pid 1"
    if proc.pid in own_ancestry:
        return "ancestor of this kill"
    name = protected_name(program_names(proc.comm, argv_of(proc.pid)), patterns)
    return f"protected name {name}" if name else ""


def unforceable(reason):
    return reason in ("pid 1", "ancestor of this kill")


# -- tpufab runs -------------------------------------------------------------------------


def list_runs(run_dir, only):
    run_dir = os.path.expanduser(run_dir)
    try:
        names = sorted(os.listdir(run_dir))
    except OSError:
        return []
    if only:
        names = [name for name in names if name == only]
    return [(name, os.path.join(run_dir, name)) for name in names
            if os.path.isdir(os.path.join(run_dir, name))]


def supervised_job(rundir):
    """The supervised job the run is an attempt of (its meta.json, written by run_worker.py
    from the job environment's TPUFAB_SUPERVISED_JOB), or None."""
    meta = read_json(os.path.join(rundir, "meta.json"))
    job = meta.get("job") if isinstance(meta, dict) else None
    return job if isinstance(job, str) and job else None


# -- stopping ------------------------------------------------------------------------------


class Target:
    __slots__ = ("proc", "command", "reasons", "signal", "error")

    def __init__(self, proc, reason):
        self.proc = proc
        self.command = command_of(proc)
        self.reasons = [reason]
        self.signal = None
        self.error = None

    def alive(self):
        return alive(self.proc.pid, self.proc.start_time)

    def send(self, signum):
        """Signal this exact process (a pidfd pins it; no signal reaches a recycled pid)."""
        pid = self.proc.pid
        try:
            pidfd = os.pidfd_open(pid) if hasattr(os, "pidfd_open") else None
        except ProcessLookupError:
            return
        except OSError:
            pidfd = None      # no pidfd support: the start-time check below still applies
        try:
            if not self.alive():
                return
            if pidfd is not None and hasattr(signal, "pidfd_send_signal"):
                signal.pidfd_send_signal(pidfd, signum)
            else:
                os.kill(pid, signum)
            self.signal = signal.Signals(signum).name[3:]
        except ProcessLookupError:
            pass
        except PermissionError:
            self.error = "permission denied (run as root)"
        finally:
            if pidfd is not None:
                os.close(pidfd)

    def describe(self):
        entry = {"pid": self.proc.pid, "name": self.proc.comm, "command": self.command,
                 "reason": "; ".join(self.reasons)}
        if self.signal:
            entry["signal"] = self.signal
        if self.error:
            entry["error"] = self.error
        return entry


class Group:
    """A run's process group, signalled with killpg while its leader is verified (``pgid``
    is None otherwise)."""

    def __init__(self, run_id, pgid):
        self.run_id = run_id
        self.pgid = pgid


def wait_until(condition, timeout):
    deadline = time.monotonic() + timeout
    while True:
        if condition():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL)


def wait_gone(targets, timeout):
    """Wait until every target has exited (True) or `timeout` passed (False).

    Sleeps on pidfds (the kernel wakes us when a process exits) instead of polling /proc, so
    a 5 s grace costs no CPU on each of 64 workers; polls where pidfds are missing.
    """
    poller = select.poll() if hasattr(os, "pidfd_open") else None
    fds = {}
    try:
        for target in targets:
            if poller is None:
                break
            try:
                fd = os.pidfd_open(target.proc.pid)
            except ProcessLookupError:
                continue
            except OSError:
                poller = None
                break
            if not target.alive():      # checked after opening: the pidfd is this process
                os.close(fd)
                continue
            fds[fd] = target
            poller.register(fd, select.POLLIN)
        if poller is None:
            return wait_until(lambda: not any(t.alive() for t in targets), timeout)
        deadline = time.monotonic() + timeout
        while fds:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            for fd, _ in poller.poll(max(1, int(left * 1000))):
                poller.unregister(fd)
                del fds[fd]
                os.close(fd)
        return True
    finally:
        for fd in fds:
            os.close(fd)


def stop_all(targets, groups, grace, kill_timeout, own):
    """SIGTERM everything, SIGKILL what is left after `grace`; returns the survivors."""
    runs = {g.run_id: g.pgid for g in groups}

    def collect():
        # Late forks of a run join the targets between the phases.
        for name, procs in run_processes(runs).items():
            for proc in procs:
                if proc.pid not in targets and proc.pid not in own:
                    targets[proc.pid] = Target(proc, f"run {name}")

    for signum, timeout in ((signal.SIGTERM, grace), (signal.SIGKILL, kill_timeout)):
        collect()
        pending = [t for t in targets.values() if t.alive()]
        if not pending:
            break
        reached = set()
        for group in groups:
            if group.pgid is not None:
                try:
                    os.killpg(group.pgid, signum)
                    reached.add(group.pgid)
                except OSError:
                    pass
        for target in pending:
            if target.proc.pgid in reached:
                target.signal = signal.Signals(signum).name[3:]
            else:
                target.send(signum)
        wait_gone(pending, timeout)
    collect()
    return [t for t in targets.values() if t.alive()]


# -- Ray (tpufab ray): its processes are stopped by `ray stop` first -----------------------

RAY_MAIN = "import sys; from ray.scripts.scripts import main; sys.argv[0] = 'ray'; sys.exit(main())"


def ray_role(proc):
    """'Ray raylet', 'Ray worker', ... for a process of a Ray cluster, else None."""
    argv = argv_of(proc.pid)
    names = program_names(proc.comm, argv)
    if "raylet" in names or "gcs_server" in names:
        return "Ray " + ("raylet" if "raylet" in names else "GCS")
    if any(n.startswith("ray::") for n in names + argv[:1]):
        return "Ray worker"
    if any("/ray/" in a for a in argv[:3]):
        return "Ray daemon"
    return None


def ray_stop(targets, grace):
    """`ray stop` (Ray's own SIGTERM of its raylets and workers) with the Python a Ray process
    runs, when a target is part of a Ray cluster; then the bounded wait. Returns the targets
    it stopped."""
    ray = [t for t in targets.values() if ray_role(t.proc)]
    if not ray:
        return []
    python = None     # the Python a Ray daemon runs (its argv[0]: a venv's, not /proc/exe's)
    for name in os.listdir("/proc"):
        argv = argv_of(int(name)) if name.isdigit() else []
        if any("/ray/" in a for a in argv[1:3]) and os.path.isabs(argv[0]) \
                and os.access(argv[0], os.X_OK):
            python = argv[0]
            break
    if python:
        import subprocess

        try:
            subprocess.run([python, "-c", RAY_MAIN, "stop", f"--grace-period={int(grace)}"],
                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, timeout=grace + 30)
        except (OSError, subprocess.SubprocessError):
            pass
    wait_gone(ray, grace)
    stopped = [t for t in ray if not t.alive()]
    for t in stopped:
        t.signal = "ray stop"
    return stopped


# -- the report ----------------------------------------------------------------------------


def kill(devices_globs, lockfiles, run_dir, run_id, grace, settle, dry_run, force,
         protected_names=PROTECTED_NAMES):
    started = time.monotonic()
    own = set(ancestry(os.getpid()))
    devices = expand_globs(devices_globs)
    locks = [os.path.expanduser(path) for path in lockfiles]
    watched = Watched(devices + locks)
    report = {
        "host": os.uname().nodename,
        "dry_run": dry_run,
        "force": force,
        "grace": grace,
        "devices": devices,
        "runs": [],
        "killed": [],
        "would_kill": [],
        "failed": [],
        "protected": [],
        "holders_left": [],
    }
    targets = {}
    groups = []

    # 0. tpufab's containers (`run --image`: label tpufab-run), stopped through the runtime;
    # every other container (the VM's tpu-runtime, a user's own) is left alone.
    report["containers"] = stop_containers(run_id, grace, dry_run)

    # 1. tpufab runs, verified by pid and start time.
    own_pgids = {proc.pgid for proc in map(proc_stat, own) if proc is not None}
    runs = {}
    for name, path in list_runs(run_dir, run_id):
        entry = {"run": name}
        job = supervised_job(path)
        if job:
            entry["job"] = job
        report["runs"].append(entry)
        pid, pgid = read_int(os.path.join(path, "pid")), read_int(os.path.join(path, "pgid"))
        start_time = read_int(os.path.join(path, "start_time"))
        ended = read_end(path) is not None
        if pid is None or pgid is None or start_time is None:
            entry["state"] = "ended" if ended else "no record"
            runs[name] = None               # stragglers still carry its TPUFAB_RUN_ID
            continue
        entry.update(pid=pid, pgid=pgid)
        leader = proc_stat(pid)
        leader_ok = not ended and leader is not None and leader.start_time == start_time \
            and not leader.exited and leader.pgid == pgid
        if ended:
            entry["state"] = "ended"
        elif leader is not None and leader.start_time != start_time:
            entry["state"] = "pid reused (not signalled)"
        if leader_ok and pgid in own_pgids:
            leader_ok = False   # never killpg our own group; signal the others one by one
        runs[name] = pgid if leader_ok else None
    members = run_processes(runs)
    for entry in report["runs"]:
        name = entry["run"]
        procs = [proc for proc in members[name] if proc.pid not in own]
        if not procs:
            entry.setdefault("state", "not running")
            continue
        if entry.get("state") == "ended":
            entry["stragglers"] = [proc.pid for proc in procs]
        entry["state"] = "would stop" if dry_run else "stopping"
        groups.append(Group(name, runs[name]))
        for proc in procs:
            targets[proc.pid] = Target(proc, f"run {name}")

    # 2. Holders of the device files and lockfiles.
    holders, unreadable = scan_holders(watched)
    protected = {}
    for pid, paths in sorted(holders.items()):
        proc = proc_stat(pid)
        if proc is None or proc.exited:
            continue
        if pid in targets:
            targets[pid].reasons.append("holds " + ", ".join(sorted(paths)))
            continue
        why = protection(proc, own, protected_names)
        if why and (unforceable(why) or not force):
            protected[pid] = {"pid": pid, "name": proc.comm, "command": command_of(proc),
                              "holds": sorted(paths), "why": why}
            continue
        targets[pid] = Target(proc, "holds " + ", ".join(sorted(paths)))
    for target in targets.values():
        role = ray_role(target.proc)
        if role:
            target.reasons.append(role)

    if dry_run:
        report["would_kill"] = [t.describe() for t in targets.values()]
        report["protected"] = list(protected.values())
        report["lockfiles"] = lockfile_plan(locks, holders, targets)
        report["device_free"] = not any(
            set(paths) & set(devices) for pid, paths in holders.items() if pid not in protected)
        return finish(report, unreadable, started)

    # Ray's processes first through `ray stop`, then everything at once: one grace period.
    ray_stop(targets, grace)
    survivors = stop_all(targets, groups, grace, max(KILL_WAIT, settle), own)
    for target in targets.values():
        if target in survivors:
            target.error = target.error or "still alive after SIGKILL"
            report["failed"].append(target.describe())
        elif target.signal:
            report["killed"].append(target.describe())
    for entry in report["runs"]:
        if entry.get("state") == "stopping":
            left = [t for t in survivors if t.reasons[0] == f"run {entry['run']}"]
            entry["state"] = "still running" if left else "stopped"

    # 3. Bounded wait until no unprotected process holds a device file or lockfile.
    final = {}

    def quiet():
        held, _ = scan_holders(watched)
        final.clear()
        final.update(held)
        return not any(pid not in protected for pid in held)

    if wait_until(quiet, settle if report["killed"] else 0) and report["killed"]:
        # Something may start the job again (a supervisor, a restart loop): watch a moment
        # longer, so such a newcomer is reported instead of a free TPU.
        wait_until(lambda: not quiet(), CONFIRM)
    for pid, paths in sorted(final.items()):
        proc = proc_stat(pid)
        if proc is None or proc.exited:
            continue
        if pid in protected:
            protected[pid]["holds"] = sorted(paths)
            continue
        entry = {"pid": pid, "name": proc.comm, "command": command_of(proc),
                 "holds": sorted(paths)}
        parent = proc_stat(proc.ppid)
        if parent is not None and proc.ppid > 1:
            entry.update(ppid=proc.ppid, parent=parent.comm)
        report["holders_left"].append(entry)
    report["protected"] = list(protected.values())
    report["device_free"] = not any(
        set(entry["holds"]) & set(devices) for entry in report["holders_left"])
    report["lockfiles"] = remove_lockfiles(locks, final)
    return finish(report, unreadable, started)


def lockfile_plan(locks, holders, targets):
    plan = []
    for path in locks:
        held_by = sorted(pid for pid, paths in holders.items() if path in paths)
        if not os.path.lexists(path):
            plan.append({"path": path, "action": "absent"})
        elif all(pid in targets for pid in held_by):
            plan.append({"path": path, "action": "would remove", "held_by": held_by})
        else:
            plan.append({"path": path, "action": "would keep", "held_by": held_by})
    return plan


def remove_lockfiles(locks, holders):
    """Remove each lockfile no live process holds; a held lock is never removed."""
    results = []
    for path in locks:
        held_by = sorted(pid for pid, paths in holders.items()
                         if path in paths and is_live(pid))
        if not os.path.lexists(path):
            results.append({"path": path, "action": "absent"})
        elif held_by:
            results.append({"path": path, "action": "kept", "held_by": held_by})
        else:
            try:
                os.unlink(path)
                results.append({"path": path, "action": "removed"})
            except FileNotFoundError:
                results.append({"path": path, "action": "absent"})
            except OSError as err:
                results.append({"path": path, "action": "kept", "error": err.strerror})
    return results


CONTAINER_LABEL = "tpufab-run"


# where Docker and podman keep one folder per container: none there, no `docker ps` (a
# runtime's start costs ~0.2 s of CPU, on every worker of every kill)
CONTAINER_DIRS = ("/var/lib/docker/containers", "/var/lib/containers/storage/overlay-containers")


def any_containers():
    for folder in CONTAINER_DIRS:
        try:
            if any(entry.is_dir() for entry in os.scandir(folder)):
                return True
        except OSError:
            continue
    return False


def stop_containers(run_id, grace, dry_run):
    """``[{"name", "run", "action": stopped|would stop|failed, "error"?}]`` for the running
    containers labelled tpufab-run (=RUN with --run); [] where there is no docker."""
    import shutil
    import subprocess

    docker = shutil.which("docker")
    if docker is None or not any_containers():
        return []
    label = CONTAINER_LABEL + (f"={run_id}" if run_id else "")
    try:
        listed = subprocess.run([docker, "ps", "--filter", f"label={label}", "--format",
                                 "{{.ID}} {{.Names}}"], capture_output=True, text=True,
                                timeout=30, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if listed.returncode != 0:
        return []
    found = [line.split() for line in listed.stdout.splitlines() if line.strip()]
    out = [{"id": f[0], "name": f[-1], "run": f[-1].removeprefix("tpufab-")} for f in found]
    if dry_run or not out:
        for entry in out:
            entry["action"] = "would stop"
        return out
    try:
        stopped = subprocess.run([docker, "stop", "-t", str(max(0, int(grace))),
                                  *(e["id"] for e in out)], capture_output=True, text=True,
                                 timeout=grace + 60, stdin=subprocess.DEVNULL)
        error = None if stopped.returncode == 0 else (stopped.stderr.strip() or "failed")
    except (OSError, subprocess.TimeoutExpired) as err:
        error = str(err)
    for entry in out:
        entry["action"] = "stopped" if error is None else "failed"
        if error:
            entry["error"] = error[-300:]
    return out


def finish(report, unreadable, started):
    report["lockfiles_removed"] = [e["path"] for e in report["lockfiles"]
                                   if e["action"] == "removed"]
    report["noop"] = not (report["killed"] or report["would_kill"] or report["failed"]
                          or report["lockfiles_removed"] or report.get("containers"))
    if unreadable:
        report["unreadable_processes"] = unreadable
        report["hint"] = "some processes could not be inspected; run tpukill as root"
    report["elapsed_s"] = round(time.monotonic() - started, 3)
    return report


# Flags that take a value (repeatable ones append), and on/off flags. Parsed by hand: on a
# 64-worker kill every worker starts this script at once, and argparse alone costs ~10 ms of
# CPU per start (gettext, shutil, locale); argparse is only loaded for --help or a mistake.
VALUE_FLAGS = {"--devices-glob": "devices_globs", "--lockfile": "lockfiles",
               "--run-dir": "run_dir", "--run": "run_id", "--grace": "grace",
               "--settle": "settle"}
REPEATED = ("devices_globs", "lockfiles")
SWITCHES = {"--dry-run": "dry_run", "--force": "force"}


class Args:
    def __init__(self):
        self.devices_globs = None
        self.lockfiles = None
        self.run_dir = DEFAULT_RUN_DIR
        self.run_id = None
        self.grace = 5.0
        self.settle = 2.0
        self.dry_run = False
        self.force = False


def quick_parse(argv):
    """The flags below, or None when anything needs argparse (help, errors)."""
    args = Args()
    items = list(argv)
    while items:
        item = items.pop(0)
        name, eq, value = item.partition("=")
        if name in SWITCHES and not eq:
            setattr(args, SWITCHES[name], True)
            continue
        if name not in VALUE_FLAGS:
            return None
        if not eq:
            if not items:
                return None
            value = items.pop(0)
        dest = VALUE_FLAGS[name]
        if dest in REPEATED:
            setattr(args, dest, (getattr(args, dest) or []) + [value])
        elif dest in ("grace", "settle"):
            try:
                setattr(args, dest, float(value))
            except ValueError:
                return None
        else:
            setattr(args, dest, value)
    return args


def parse_args(argv):
    quick = quick_parse(argv)
    if quick is not None:
        return quick
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices-glob", action="append", dest="devices_globs",
                        help="device files to free (repeatable; default: both families)")
    parser.add_argument("--lockfile", action="append", dest="lockfiles",
                        help="libtpu lockfiles (repeatable; default: /tmp/libtpu*_lockfile)")
    parser.add_argument("--run-dir", default=DEFAULT_RUN_DIR)
    parser.add_argument("--run", dest="run_id", help="only this tpufab run (step 1)")
    parser.add_argument("--grace", type=float, default=5.0,
                        help="seconds between SIGTERM and SIGKILL")
    parser.add_argument("--settle", type=float, default=2.0,
                        help="at most this long to wait for killed processes to let go")
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--force", action="store_true",
                        help="also stop holders protected by name (never pid 1 or ancestors)")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    report = kill(args.devices_globs or DEVICE_GLOBS,
                  args.lockfiles or DEFAULT_LOCKFILES, args.run_dir, args.run_id,
                  args.grace, args.settle, args.dry_run, args.force)
    answer("answer", report)
    ok = args.dry_run or (report["device_free"] and not report["failed"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
