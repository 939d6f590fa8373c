#!/usr/bin/env python3
"""tpufab status, worker side (stdlib only, Python 3.6+): what this worker looks like now.

    facts_worker.py [--run-dir DIR] [--deploy-dir DIR ...] [--devices-glob GLOB ...]
             [--mount-state-dir DIR] [--setup-dir DIR] [--disk PATH ...] [--max-runs N]
             [--python PATH ...] [--probe-mounts SECONDS]

Prints one JSON object on one line and exits 0 (a fact it cannot read is reported as
missing, never as a failure):

    {"host", "uptime_s", "boot_id", "load",
     "devices": [{"path", "holders": [{"pid", "command", "names"}]}], "unreadable_processes",
     "runs": [{"run", "state", "exit_code"?, "signal"?, "recipe", "started_at", "ended_at",
               "job"? (the supervised job it is an attempt of)}],
     "runs_total", "deploys": [{"dir", "exists", "commit", "branch"}],
     "mounts": [{"at", "fstype", "source", "url"}],
     "setup": [{"hash", "done", "mtime"}],
     "disk": [{"path", "free_bytes", "total_bytes"}],
     "memory": {"total_bytes", "available_bytes"}, "python", "time",
     "packages": {"python", "executable", "jax", "jaxlib", "libtpu", ...}   (with --python)
     "mount_probes": [{"at", "ok", "error", "seconds"}],                   (with --probe-mounts)
     "notices": ["preempted ...", "maintenance: ..."]}  (where a metadata server answers)
     "ray": {"raylet", "head", "gcs_address", "node_ip"}  (where a raylet or Ray's GCS runs)

``--python``: the interpreters a job would use, first that exists wins (`~/.venv/bin/python`
as the recipes pick it); its package versions are read from their installed metadata, in a
child process, without importing the packages. ``--probe-mounts``: list every FUSE mount in a
child process that is killed after SECONDS, so a hung mount is reported, not waited for.

Only reads: it never changes anything on the worker. Holders of the TPU device files (both
families: /dev/accel* and /dev/vfio/<n>) are found by scanning /proc/*/fd. Other users'
processes can only be read by root: when some are unreadable, that scan alone is done again
through ``sudo -n`` (``--holders-only``; TPU VM users have passwordless sudo), and where sudo
is not allowed they are counted in ``unreadable_processes``.
"""

import argparse
import glob
import json
import os
import socket
import subprocess
import sys
import threading
import time

from tpufab.remote.workerlib import (
    DEVICE_GLOBS,
    CarriedRunIds,
    Watched,
    answer,
    argv_of,
    command_of,
    expand_globs,
    mount_records,
    proc_stat,
    program_names,
    ray_daemons,
    read_answer,
    read_text,
    scan_holders,
    state_of_run,
    unescape,
)

PACKAGES = ("jax", "jaxlib", "libtpu", "libtpu-nightly", "torch", "torch_xla")
VERSIONS = r"""
import json, sys
try:
    from importlib import metadata
except ImportError:
    metadata = None
found = {"python": "%d.%d.%d" % tuple(sys.version_info[:3]), "executable": sys.executable}
for name in sys.argv[1:]:
    try:
        found[name] = metadata.version(name) if metadata else None
    except Exception:
        found[name] = None
print(json.dumps(found))
"""


# -- uptime, memory, disk ----------------------------------------------------------------


def uptime():
    text = read_text("/proc/uptime")
    try:
        return float(text.split()[0]) if text else None
    except ValueError:
        return None


def load():
    text = read_text("/proc/loadavg")
    try:
        return [float(x) for x in text.split()[:3]] if text else None
    except ValueError:
        return None


def memory():
    """MemTotal and MemAvailable from /proc/meminfo, in bytes."""
    found = {}
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                if key in ("MemTotal", "MemAvailable"):
                    found[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return {"total_bytes": found.get("MemTotal"), "available_bytes": found.get("MemAvailable")}


def disk(paths):
    out = []
    for path in paths:
        full = os.path.expanduser(path)
        try:
            st = os.statvfs(full)
        except OSError:
            continue
        out.append({"path": full, "free_bytes": st.f_bavail * st.f_frsize,
                    "total_bytes": st.f_blocks * st.f_frsize})
    return out


# -- TPU device files --------------------------------------------------------------------


def device_holders(paths):
    """{path: [{"pid", "command", "names"}]} and how many processes could not be read."""
    holders = {path: [] for path in paths}
    if not paths:
        return holders, 0
    held, unreadable = scan_holders(Watched(paths))
    for pid, found in sorted(held.items()):
        proc = proc_stat(pid)
        if proc is None or proc.exited:
            continue
        argv = argv_of(pid)
        entry = {"pid": pid, "command": command_of(proc, argv, say_renamed=True),
                 "names": program_names(proc.comm, argv)}
        for path in found:
            holders[path].append(entry)
    return holders, unreadable


# -- tpufab runs (records written by run_worker.py) ------------------------------------------


def run_state(rundir, carried=None):
    """A run's state (workerlib's ``state_of_run``) with its recipe and start time."""
    info = {}
    meta = read_text(os.path.join(rundir, "meta.json"))
    if meta:
        try:
            info = json.loads(meta)
        except ValueError:
            info = {}
    state = {"run": os.path.basename(rundir), "recipe": info.get("recipe"),
             "started_at": info.get("started_at")}
    if info.get("job"):      # an attempt of a supervised job (run_worker.py's meta.json)
        state["job"] = info["job"]
    state.update(state_of_run(rundir, carried))
    return state


def runs(run_dir, limit):
    """Every running run and the ``limit`` most recent others (ids sort by start time)."""
    base = os.path.expanduser(run_dir)
    try:
        names = sorted(n for n in os.listdir(base) if os.path.isdir(os.path.join(base, n)))
    except OSError:
        return [], 0
    carried = CarriedRunIds()   # one /proc scan at most, for every run that needs it
    states = [run_state(os.path.join(base, name), carried) for name in names]
    live = [s for s in states if s["state"] in ("running", "starting")]
    ended = [s for s in states if s["state"] not in ("running", "starting")]
    kept = live + ended[-limit:] if limit else live
    kept.sort(key=lambda s: s["run"])
    return kept, len(states)


# -- deployed commit (read from .git without running git) --------------------------------


def git_dir(path):
    dot = os.path.join(path, ".git")
    if os.path.isdir(dot):
        return dot
    text = read_text(dot)   # a worktree or submodule: "gitdir: <path>"
    if text and text.startswith("gitdir:"):
        target = text[len("gitdir:"):].strip()
        return target if os.path.isabs(target) else os.path.join(path, target)
    return None


def resolve_ref(gdir, ref):
    value = read_text(os.path.join(gdir, ref))
    if value:
        return value
    common = read_text(os.path.join(gdir, "commondir"))
    bases = [os.path.join(gdir, common)] if common else []
    for base in [gdir] + bases:
        value = read_text(os.path.join(base, ref))
        if value:
            return value
        packed = read_text(os.path.join(base, "packed-refs")) or ""
        for line in packed.splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[1] == ref:
                return parts[0]
    return None


def deployed(path):
    full = os.path.expanduser(path)
    found = {"dir": full, "exists": os.path.isdir(full), "commit": None, "branch": None}
    gdir = git_dir(full) if found["exists"] else None
    head = read_text(os.path.join(gdir, "HEAD")) if gdir else None
    if head and head.startswith("ref:"):
        ref = head[4:].strip()
        found["branch"] = ref[len("refs/heads/"):] if ref.startswith("refs/heads/") else ref
        found["commit"] = resolve_ref(gdir, ref)
    elif head:
        found["commit"] = head
    return found


# -- mounts ------------------------------------------------------------------------------


def mounts(state_dir, proc_mounts="/proc/mounts"):
    """FUSE mounts (gcsfuse, rclone...), with the gs:// URL tpufab recorded for each."""
    recorded = {record["at"]: record for _, record in mount_records(state_dir)}
    found = []
    try:
        with open(proc_mounts) as fh:
            lines = fh.read().splitlines()
    except OSError:
        lines = []
    for line in lines:
        parts = line.split()
        if len(parts) < 3 or not parts[2].startswith("fuse"):
            continue
        at = unescape(parts[1])
        if parts[2] in ("fuse.lxcfs", "fusectl") or at.startswith("/sys"):
            continue
        record = recorded.get(at, {})
        found.append({"at": at, "fstype": parts[2], "source": unescape(parts[0]),
                      "url": record.get("url")})
    return found


# -- setup scripts run by `tpufab setup` -------------------------------------------------


def setups(setup_dir):
    """Every script the setup runner ran here: it keeps <hash>.log (and <hash>.done once it
    succeeded) in setup_dir; the script itself lives in the content-hash cache."""
    base = os.path.expanduser(setup_dir)
    out = []
    for path in glob.glob(os.path.join(base, "*.log")):
        digest = os.path.basename(path)[:-4]
        done = os.path.join(base, digest + ".done")
        try:
            mtime = os.path.getmtime(done if os.path.exists(done) else path)
        except OSError:
            continue
        out.append({"hash": digest, "done": os.path.exists(done), "mtime": mtime})
    out.sort(key=lambda s: s["mtime"])
    return out


# -- what a job would run on: its Python and packages ------------------------------------


def start_packages(candidates):
    """Start reading PACKAGES' versions as the first existing interpreter of ``candidates``
    sees them (in a child, so the rest of the facts are gathered meanwhile)."""
    for candidate in candidates:
        path = os.path.expanduser(candidate)
        if os.sep not in path:
            path = shutil_which(path)
        if not path or not os.access(path, os.X_OK):
            continue
        try:
            child = subprocess.Popen([path, "-I", "-c", VERSIONS, *PACKAGES],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     stdin=subprocess.DEVNULL)
        except OSError as err:
            return {"executable": path, "error": str(err)[:200]}
        return (path, child)
    return {"error": "none of " + ", ".join(candidates) + " exists"}


def finish_packages(started, timeout=20.0):
    if isinstance(started, dict):
        return started
    path, child = started
    try:
        out, err = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()
        return {"executable": path, "error": f"no answer in {timeout:g} s"}
    if child.returncode != 0:
        tail = err.decode("utf-8", "replace").strip().splitlines()[-1:]
        return {"executable": path, "error": (tail[0] if tail else
                                              f"exit status {child.returncode}")[:200]}
    try:
        return json.loads(out.decode().strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"executable": path, "error": "no answer"}


def shutil_which(name):
    for folder in os.environ.get("PATH", "/usr/bin:/bin").split(os.pathsep):
        path = os.path.join(folder, name)
        if os.access(path, os.X_OK):
            return path
    return None


def probe_mounts(found, timeout):
    """Whether each mount answers a directory listing within ``timeout`` seconds."""
    results = [None] * len(found)

    def probe(index, at):
        started = time.monotonic()
        try:
            done = subprocess.run(["ls", "-A", "--", at], timeout=timeout,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                  stdin=subprocess.DEVNULL)
            error = None if done.returncode == 0 else (
                done.stderr.decode("utf-8", "replace").strip()[:200]
                or f"exit status {done.returncode}")
        except subprocess.TimeoutExpired:
            error = f"no answer in {timeout:g} s"
        except OSError as err:
            error = str(err)[:200]
        results[index] = {"at": at, "ok": error is None, "error": error,
                          "seconds": round(time.monotonic() - started, 3)}

    threads = [threading.Thread(target=probe, args=(i, m["at"]), daemon=True)
               for i, m in enumerate(found)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 2)
    return [r if r is not None else {"at": found[i]["at"], "ok": False, "seconds": None,
                                     "error": f"no answer in {timeout:g} s"}
            for i, r in enumerate(results)]


# -- main --------------------------------------------------------------------------------


def holders_as_root(globs):
    """The holder scan as root through ``sudo -n`` (never a password prompt), or None."""
    if not os.path.isfile(__file__):  # run from stdin (a full disk): no file to hand sudo
        return None
    # run again as checked as this run was (the verifying loader's argv), else as this file
    again = globals().get("__tpufab_rerun__") or [sys.executable, "-I", "-S",
                                                  os.path.abspath(__file__)]
    argv = ["sudo", "-n", *again, "--holders-only"]
    for pattern in globs:
        argv += ["--devices-glob", pattern]
    try:
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, timeout=30)
        found = read_answer(done.stdout)  # its own answer, as root
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0 or found is None:
        return None
    return {d["path"]: d["holders"] for d in found["devices"]}, found["unreadable_processes"]


METADATA = "http://metadata.google.internal/computeMetadata/v1/instance/"
NOTICE_KEYS = ("preempted", "maintenance-event")


def start_notices():
    """Read the metadata server's preemption and maintenance notices in the background (a
    thread per key, each at most NOTICE_SECONDS): {key: value} when finish_notices joins."""
    import urllib.request

    found = {}

    def read(key):
        request = urllib.request.Request(METADATA + key, headers={"Metadata-Flavor": "Google"})
        try:
            with urllib.request.urlopen(request, timeout=NOTICE_SECONDS) as answer:
                found[key] = answer.read().decode(errors="replace").strip()
        except (OSError, ValueError):  # no metadata server here: nothing to say
            pass

    threads = [threading.Thread(target=read, args=(k,), daemon=True) for k in NOTICE_KEYS]
    for t in threads:
        t.start()
    return threads, found


NOTICE_SECONDS = 1.0


def finish_notices(started):
    """The notices in force: ["preempted", "maintenance: TERMINATE_ON_HOST_MAINTENANCE"];
    None when the metadata server did not answer (not a cloud VM)."""
    threads, found = started
    deadline = time.monotonic() + NOTICE_SECONDS + 0.5
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if not found:
        return None
    notices = []
    if found.get("preempted") == "TRUE":
        notices.append("preempted (instance/preempted=TRUE)")
    event = found.get("maintenance-event")
    if event and event != "NONE":
        notices.append(f"maintenance: {event} (instance/maintenance-event)")
    return notices


def gather(args):
    reading = start_packages(args.python) if args.python else None
    notices = None if args.holders_only else start_notices()
    globs = args.devices_glob or DEVICE_GLOBS
    paths = expand_globs(globs)
    holders, unreadable = device_holders(paths)
    if unreadable and paths and os.geteuid() != 0:
        as_root = holders_as_root(globs)
        if as_root is not None:
            holders, unreadable = as_root
    if args.holders_only:
        return {"devices": [{"path": p, "holders": holders.get(p, [])} for p in paths],
                "unreadable_processes": unreadable}
    recent, total = runs(args.run_dir, args.max_runs)
    found_mounts = mounts(args.mount_state_dir)
    extra = {}
    if reading is not None:
        extra["packages"] = finish_packages(reading)
    if args.probe_mounts:
        extra["mount_probes"] = probe_mounts(found_mounts, args.probe_mounts)
    said = finish_notices(notices)
    if said is not None:
        extra["notices"] = said
    ray = ray_daemons()
    if ray is not None:
        extra["ray"] = ray
    return {**extra,
        "host": socket.gethostname(),
        "uptime_s": uptime(),
        "boot_id": read_text("/proc/sys/kernel/random/boot_id"),
        "load": load(),
        "devices": [{"path": p, "holders": holders[p]} for p in paths],
        "unreadable_processes": unreadable,
        "runs": recent,
        "runs_total": total,
        "deploys": [deployed(d) for d in args.deploy_dir],
        "mounts": found_mounts,
        "setup": setups(args.setup_dir),
        "disk": disk(args.disk or ["~", "/"]),
        "memory": memory(),
        "python": ".".join(str(v) for v in sys.version_info[:3]),
        "time": time.time(),
    }


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="facts_worker.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", default="~/.tpufab/runs")
    parser.add_argument("--deploy-dir", action="append", default=[])
    parser.add_argument("--devices-glob", action="append", default=[])
    parser.add_argument("--mount-state-dir", default="~/.cache/tpufab/mounts")
    parser.add_argument("--setup-dir", default="~/.tpufab/setup")
    parser.add_argument("--disk", action="append", default=[])
    parser.add_argument("--holders-only", action="store_true",
                        help="only the device holders (what `sudo -n` runs)")
    parser.add_argument("--max-runs", type=int, default=5,
                        help="finished runs to list besides the running ones")
    parser.add_argument("--python", action="append", default=[],
                        help="interpreter whose package versions to report (first found)")
    parser.add_argument("--probe-mounts", type=float, default=0.0,
                        help="list each FUSE mount, giving up after this many seconds")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    answer("answer", gather(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
