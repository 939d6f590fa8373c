#!/usr/bin/env python3
"""tpufab status, worker side (stdlib only, Python 3.6+): what this worker looks like now.

    facts.py [--run-dir DIR] [--deploy-dir DIR ...] [--devices-glob GLOB ...]
             [--mount-state-dir DIR] [--setup-dir DIR] [--disk PATH ...] [--max-runs N]
             [--python PATH ...] [--probe-mounts SECONDS]

Prints one JSON object on one line and exits 0 (a fact it cannot read is reported as
missing, never as a failure):

    {"host", "uptime_s", "boot_id", "load",
     "devices": [{"path", "holders": [{"pid", "command", "names"}]}], "unreadable_processes",
     "runs": [{"run", "state", "exit_code"?, "signal"?, "recipe", "started_at", "ended_at"}],
     "runs_total", "deploys": [{"dir", "exists", "commit", "branch"}],
     "mounts": [{"at", "fstype", "source", "url"}],
     "setup": [{"hash", "done", "mtime"}],
     "disk": [{"path", "free_bytes", "total_bytes"}],
     "memory": {"total_bytes", "available_bytes"}, "python", "time",
     "packages": {"python", "executable", "jax", "jaxlib", "libtpu", ...}   (with --python)
     "mount_probes": [{"at", "ok", "error", "seconds"}]}                   (with --probe-mounts)

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
import stat
import subprocess
import sys
import threading
import time

DEVICE_GLOBS = ("/dev/accel*", "/dev/vfio/[0-9]*")
COMMAND_CHARS = 200
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


# -- small readers -----------------------------------------------------------------------


def read_text(path):
    try:
        with open(path, errors="replace") as fh:
            return fh.read().strip()
    except OSError:
        return None


def read_int(path):
    text = read_text(path)
    try:
        return int(text) if text else None
    except ValueError:
        return None


def read_float(path):
    text = read_text(path)
    try:
        return float(text) if text else None
    except ValueError:
        return None


def proc_stat(pid):
    """(state, pgid, start_time) of ``pid``, or None when it does not exist."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read()
    except OSError:
        return None
    fields = data[data.rindex(b")") + 2:].split()
    return fields[0].decode(), int(fields[2]), int(fields[19])


def alive(pid, start_time):
    found = proc_stat(pid)
    return found is not None and found[2] == start_time and found[0] not in ("Z", "X", "x")


def supervising(rundir):
    """The run's supervisor is still there (verified by the start time launch.py records;
    by its name, ``tpufab-run``, for runs recorded before it did)."""
    pid = read_int(os.path.join(rundir, "supervisor"))
    if pid is None:
        return False
    start_time = read_int(os.path.join(rundir, "supervisor_start_time"))
    if start_time is not None:
        return alive(pid, start_time)
    found = proc_stat(pid)
    return found is not None and found[0] not in ("Z", "X", "x") and \
        read_text(f"/proc/{pid}/comm") == "tpufab-run"


def program_names(pid):
    """Its comm and its program's base name (tpukill's protected names match either)."""
    names = [read_text(f"/proc/{pid}/comm") or ""]
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            first = fh.read().split(b"\0", 1)[0].decode("utf-8", "replace")
    except OSError:
        first = ""
    words = first.split(":")[0].split()
    if words:
        names.append(os.path.basename(words[0]))
    return names


def command_of(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            argv = [a.decode("utf-8", "replace") for a in fh.read().split(b"\0") if a]
    except OSError:
        argv = []
    comm = read_text(f"/proc/{pid}/comm") or "?"
    text = " ".join(argv) or f"[{comm}]"
    if argv and os.path.basename(argv[0])[:15] != comm:  # renamed itself (prctl): say both
        text = f"{comm}: {text}"
    return text if len(text) <= COMMAND_CHARS else text[:COMMAND_CHARS - 3] + "..."


def all_pids():
    return sorted(int(n) for n in os.listdir("/proc") if n.isdigit())


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


def _common_rdevs():
    """/dev/null and friends: a placeholder device made as a copy of one of them must not
    make every process holding /dev/null look like a TPU holder."""
    found = set()
    for name in ("null", "zero", "full", "random", "urandom", "tty", "console", "ptmx"):
        try:
            found.add(os.stat("/dev/" + name).st_rdev)
        except OSError:
            pass
    return found


def device_paths(globs):
    paths = []
    for pattern in globs:
        for path in sorted(glob.glob(pattern)):
            if path not in paths:
                paths.append(path)
    return paths


def device_holders(paths):
    """{path: [{"pid", "command"}]} and how many processes could not be read."""
    by_path, by_rdev = {}, {}
    common = _common_rdevs()
    for path in paths:
        by_path[path] = path
        by_path[os.path.realpath(path)] = path
        try:
            st = os.stat(path)
        except OSError:
            continue
        if stat.S_ISCHR(st.st_mode) and st.st_rdev not in common:
            by_rdev[st.st_rdev] = path
    holders = {path: [] for path in paths}
    unreadable = 0
    me = os.getpid()
    if not paths:
        return holders, unreadable
    for pid in all_pids():
        if pid == me:
            continue
        fd_dir = f"/proc/{pid}/fd"
        try:
            fds = os.listdir(fd_dir)
        except PermissionError:
            unreadable += 1
            continue
        except OSError:
            continue
        held = set()
        for fd in fds:
            fd_path = fd_dir + "/" + fd
            try:
                link = os.readlink(fd_path)
            except OSError:
                continue
            path = by_path.get(link)
            if path is None and by_rdev and link.startswith("/dev/"):
                try:
                    path = by_rdev.get(os.stat(fd_path).st_rdev)
                except OSError:
                    path = None
            if path is not None:
                held.add(path)
        if held:
            command = command_of(pid)
            names = program_names(pid)
            for path in held:
                holders[path].append({"pid": pid, "command": command, "names": names})
    return holders, unreadable


# -- tpufab runs (records written by launch.py) ------------------------------------------


def read_end(rundir):
    """How a run ended (launch.py's ``end.json``, else its one-value files), or None."""
    try:
        with open(os.path.join(rundir, "end.json"), "rb") as fh:
            text = fh.read(4096).strip()
        record = json.loads(text.decode()) if text else None
    except (OSError, ValueError):
        record = None
    if isinstance(record, dict):
        return record
    exit_code = read_int(os.path.join(rundir, "exit_code"))
    killed = read_text(os.path.join(rundir, "killed"))
    if exit_code is None and not killed:
        return None
    found = {"ended_at": read_float(os.path.join(rundir, "ended_at"))}
    if exit_code is not None:
        found["exit_code"] = exit_code
    else:
        found["killed"] = killed
    return found


def run_state(rundir):
    """A run's state. The end record is read again after the liveness checks (the
    supervisor writes it, then exits), so a run that ends in between is never "lost"."""
    state = {"run": os.path.basename(rundir)}
    meta = read_text(os.path.join(rundir, "meta.json"))
    info = {}
    if meta:
        try:
            info = json.loads(meta)
        except ValueError:
            info = {}
    state["recipe"] = info.get("recipe")
    state["started_at"] = info.get("started_at")
    pid = read_int(os.path.join(rundir, "pid"))
    start_time = read_int(os.path.join(rundir, "start_time"))
    end = read_end(rundir)
    if end is None:
        if pid is not None and start_time is not None and alive(pid, start_time):
            state["state"] = "running"
        elif supervising(rundir):
            state["state"] = "running"   # the recipe just ended; its supervisor is writing that
        else:
            end = read_end(rundir)
            if end is None and pid is None and \
                    read_int(os.path.join(rundir, "supervisor")) is None:
                try:
                    young = time.time() - os.path.getmtime(rundir) < 30
                except OSError:
                    young = False
                state["state"] = "starting" if young else "lost"
            elif end is None:
                state["state"] = "lost"
    if end is not None:
        if end.get("killed"):
            state.update(state="killed", signal=end["killed"])
        else:
            state.update(state="exited", exit_code=end.get("exit_code"))
        if end.get("disk_full"):
            state["disk_full"] = end["disk_full"]
    state["ended_at"] = end.get("ended_at") if end else None
    return state


def runs(run_dir, limit):
    """Every running run and the ``limit`` most recent others (ids sort by start time)."""
    base = os.path.expanduser(run_dir)
    try:
        names = sorted(n for n in os.listdir(base) if os.path.isdir(os.path.join(base, n)))
    except OSError:
        return [], 0
    states = [run_state(os.path.join(base, name)) for name in names]
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


def unescape(field):
    """/proc/mounts escapes space, tab, newline and backslash as \\ooo."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and len(field[i + 1:i + 4]) == 3 and field[i + 1:i + 4].isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def mounts(state_dir, proc_mounts="/proc/mounts"):
    """FUSE mounts (gcsfuse, rclone...), with the gs:// URL tpufab recorded for each."""
    recorded = {}
    base = os.path.expanduser(state_dir)
    for path in sorted(glob.glob(os.path.join(base, "*.json"))):
        try:
            with open(path) as fh:
                data = json.load(fh)
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and data.get("at"):
            recorded[data["at"]] = data
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
    argv = ["sudo", "-n", sys.executable, "-I", "-S", os.path.abspath(__file__),
            "--holders-only"]
    for pattern in globs:
        argv += ["--devices-glob", pattern]
    try:
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, timeout=30)
        answer = json.loads(done.stdout.decode().strip().splitlines()[-1])
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    return {d["path"]: d["holders"] for d in answer["devices"]}, answer["unreadable_processes"]


def gather(args):
    reading = start_packages(args.python) if args.python else None
    globs = args.devices_glob or DEVICE_GLOBS
    paths = device_paths(globs)
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
    parser = argparse.ArgumentParser(prog="facts.py", description=__doc__.split("\n\n")[0])
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
    json.dump(gather(args), sys.stdout, sort_keys=True, separators=(",", ":"))
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
