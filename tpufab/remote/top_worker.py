#!/usr/bin/env python3
"""tpufab top, worker side (stdlib only, Python 3.6+): this worker's load over a short interval.

    top_worker.py [--interval SECONDS] [--run-dir DIR] [--top N]

Samples /proc twice, ``--interval`` apart (default 1 s), and prints one JSON object on one line:

    {"host_cpu_percent": 0-100 over every core (/proc/stat), "cores",
     "processes_cpu_percent": the visible processes' use summed (100 = one core busy),
     "load": [1, 5, 15 min],
     "memory": {"total_bytes", "available_bytes"},
     "runs": [{"run", "processes", "cpu_percent", "rss_bytes"}],     tpufab runs alive here
     "busiest": [{"pid", "command", "cpu_percent", "rss_bytes", "run"?}],  the top N processes
     "tpu": {"available": bool, "devices", "holders": [{"pid", "command", "devices"}],
             "chips": [{"chip", "duty_cycle_percent", "hbm_used_bytes", "hbm_total_bytes",
                        "idle_seconds"?, "programs"?, "programs_seconds"?}],
             "idle"?: true (no process holds the TPU), "code"?, "why"?}}

``--stream --run ID [--every S] [--for S]`` instead samples only what straggler detection
needs (each chip's duty cycle and program count and time) every ``--every`` seconds (at least
0.25), one ``@tpufab-answer sample {"at": this worker's clock, "available", "chips" | "code",
"why"}`` line each, until the run has ended here, ``--for`` seconds passed or nobody reads.

A run's processes are those in the process group or session of the recipe tpufab started
(``<run-dir>/<id>/pid``) and, for `run --image`, those inside its container (the cgroup
named by ``<run-dir>/<id>/container-id``; workerlib.container_pids). TPU use comes from libtpu's runtime metrics service (gRPC on
localhost:8431, what Google's ``tpu-info`` reads), asked while /proc is sampled, through
grpcio: this script runs itself again (``--tpu-only``) under a Python that has it (the
``tpu-info`` command's, or ~/.venv's; workerlib.grpc_python). Who holds the device files comes
from /proc/*/fd.
"""

import argparse
import os
import subprocess
import sys
import time

from tpufab.remote.workerlib import (
    DEVICE_GLOBS,
    TpuMetrics,
    Watched,
    answer,
    argv_of,
    container_pids,
    expand_globs,
    grpc_python,
    have_grpc,
    read_answer,
    read_end,
    scan_holders,
)

TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
TPU_INFO_SECONDS = 8.0


def cpu_times():
    """(busy, total) jiffies of every core together, from /proc/stat's first line."""
    with open("/proc/stat") as fh:
        parts = [int(x) for x in fh.readline().split()[1:]]
    idle = parts[3] + (parts[4] if len(parts) > 4 else 0)   # idle + iowait
    total = sum(parts[:8])                                   # guest time is inside user
    return total - idle, total


def processes():
    """{pid: (pgid, sid, ticks, rss_bytes, comm)} of every process readable now."""
    found = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as fh:
                data = fh.read()
        except OSError:
            continue
        right = data.rindex(b")")
        comm = data[data.index(b"(") + 1:right].decode("utf-8", "replace")
        f = data[right + 2:].split()
        found[int(name)] = (int(f[2]), int(f[3]), int(f[11]) + int(f[12]), int(f[21]) * PAGE,
                            comm)
    return found


def live_runs(run_dir):
    """{run id: recipe pid} of the runs whose recipe still lives here."""
    base = os.path.expanduser(run_dir)
    try:
        names = os.listdir(base)
    except OSError:
        return {}
    runs = {}
    for name in names:
        if read_end(os.path.join(base, name)) is not None:
            continue
        try:
            with open(os.path.join(base, name, "pid")) as fh:
                pid = int(fh.read().strip())
        except (OSError, ValueError):
            continue
        if os.path.exists(f"/proc/{pid}"):
            runs[name] = pid
    return runs


def memory():
    info = {}
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                info[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return {}
    return {"total_bytes": info.get("MemTotal"), "available_bytes": info.get("MemAvailable")}


def tpu_holders():
    """{pid: sorted device paths} of the processes holding this worker's TPU device files."""
    devices = expand_globs(DEVICE_GLOBS)
    holders, _ = scan_holders(Watched(devices))
    return devices, {pid: sorted(paths) for pid, paths in holders.items()}


def start_tpu_metrics():
    """libtpu's metrics, asked for in the background (a Popen, or the answer at once)."""
    if have_grpc():
        return tpu_metrics_here()
    python = grpc_python()
    if python is None:
        return {"available": False, "code": "NO_CLIENT",
                "why": "no gRPC client on this worker to read libtpu's metrics service "
                       "(pip install tpu-info)"}
    try:
        return subprocess.Popen([python, os.path.abspath(__file__), "--tpu-only"],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    except OSError as err:
        return {"available": False, "code": "NO_CLIENT", "why": f"cannot start {python}: {err}"}


def tpu_metrics_here():
    try:
        client = TpuMetrics()
    except Exception as err:  # noqa: BLE001 - a broken grpcio is said, not raised
        return {"available": False, "code": "NO_CLIENT", "why": f"grpc: {err}"}
    try:
        return client.read()
    except Exception as err:  # noqa: BLE001 - garbage from the service is said per host
        return {"available": False, "code": "GARBAGE", "why": f"{type(err).__name__}: {err}"}
    finally:
        client.close()


def finish_tpu(started, devices, holders):
    """The worker's "tpu" answer: holders, and the metrics service's chips or why not."""
    if isinstance(started, dict):
        found = started
    else:
        try:
            out, _ = started.communicate(timeout=TPU_INFO_SECONDS)
            found = read_answer(out.decode("utf-8", "replace"), kind="tpu") or {
                "available": False, "code": "GARBAGE", "why": "the metrics client answered nothing"}
        except subprocess.TimeoutExpired:
            started.kill()
            started.communicate()
            found = {"available": False, "code": "TIMEOUT",
                     "why": f"the metrics service did not answer within {TPU_INFO_SECONDS:g} s"}
    if not devices:
        return {"available": False, "why": "no TPU device files on this worker"}
    found = dict(found)
    found["devices"] = len(devices)
    found.setdefault("chips", [])
    found["holders"] = [{"pid": pid, "command": command_text(pid, "?", 40), "devices": paths}
                        for pid, paths in sorted(holders.items())]
    if not found.get("available") and not holders:
        found["idle"] = True
        found["why"] = "no process holds the TPU"
    return found


def command_text(pid, comm, width=60):
    text = " ".join(argv_of(pid)) or f"[{comm}]"
    return text if len(text) <= width else text[:width - 3] + "..."


def sample(interval, run_dir, top):
    me = os.getpid()
    busy0, total0 = cpu_times()
    before = processes()
    started = time.monotonic()
    time.sleep(interval)
    busy1, total1 = cpu_times()
    after = processes()
    seconds = max(time.monotonic() - started, 1e-3)
    cpu = 100.0 * (busy1 - busy0) / max(total1 - total0, 1)
    runs = live_runs(run_dir)
    run_of_group = {pid: run for run, pid in runs.items()}
    base = os.path.expanduser(run_dir)
    inside = container_pids([os.path.join(base, run) for run in runs])
    run_of_pid = {pid: os.path.basename(folder) for folder, pids in inside.items()
                  for pid in pids}
    per_run = {run: {"run": run, "processes": 0, "cpu_percent": 0.0, "rss_bytes": 0}
               for run in runs}
    rows = []
    for pid, (pgid, sid, ticks, rss, comm) in after.items():
        if pid == me:
            continue
        was = before.get(pid)
        used = ticks - was[2] if was is not None else 0
        percent = 100.0 * used / TICKS / seconds
        run = run_of_group.get(pgid) or run_of_group.get(sid) or run_of_pid.get(pid)
        if run is not None:
            entry = per_run[run]
            entry["processes"] += 1
            entry["cpu_percent"] += percent
            entry["rss_bytes"] += rss
        rows.append((percent, pid, comm, rss, run))
    rows.sort(key=lambda r: (-r[0], r[1]))
    busiest = []
    for percent, pid, comm, rss, run in rows[:top]:
        if percent < 1.0:
            break
        row = {"pid": pid, "command": command_text(pid, comm),
               "cpu_percent": round(percent, 1), "rss_bytes": rss}
        if run:
            row["run"] = run
        busiest.append(row)
    for entry in per_run.values():
        entry["cpu_percent"] = round(entry["cpu_percent"], 1)
    return {"host_cpu_percent": round(cpu, 1), "cores": os.cpu_count() or 1,
            "processes_cpu_percent": round(sum(r[0] for r in rows), 1),
            "load": [round(x, 2) for x in os.getloadavg()], "memory": memory(),
            "runs": sorted(per_run.values(), key=lambda e: e["run"]), "busiest": busiest,
            "interval": round(seconds, 3)}


STREAM_KEYS = ("hbm_total", "duty", "programs", "collectives")
MIN_EVERY = 0.25


def stream(args):
    """``--stream``: samples of this worker's chips until the run ends here (in a Python that
    has grpcio; this one re-runs itself under one, or says why it cannot, once)."""
    every = max(MIN_EVERY, args.every)
    rundir = os.path.join(os.path.expanduser(args.run_dir), args.run)
    if not have_grpc():
        python = grpc_python()
        if python is None:
            answer("sample", {"at": time.time(), "available": False, "code": "NO_CLIENT",
                              "why": "no gRPC client on this worker to read libtpu's metrics "
                                     "service (pip install tpu-info)"})
            return 0
        sys.stdout.flush()
        os.execv(python, [python, os.path.abspath(__file__), *sys.argv[1:]])
    try:
        client = TpuMetrics()
    except Exception as err:  # noqa: BLE001 - a broken grpcio is said, not raised
        answer("sample", {"at": time.time(), "available": False, "code": "NO_CLIENT",
                          "why": f"grpc: {err}"})
        return 0
    until = time.monotonic() + args.seconds
    try:
        while time.monotonic() < until:
            began = time.monotonic()
            try:
                found = client.read(STREAM_KEYS)
            except Exception as err:  # noqa: BLE001 - garbage is said per sample
                found = {"available": False, "code": "GARBAGE",
                         "why": f"{type(err).__name__}: {err}"}
            found["at"] = time.time()
            answer("sample", found)
            if read_end(rundir) is not None or not os.path.isdir(rundir):
                return 0
            time.sleep(max(0.0, every - (time.monotonic() - began)))
    except (BrokenPipeError, KeyboardInterrupt):
        return 0
    finally:
        client.close()
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(prog="top_worker.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--run-dir", default="~/.tpufab/runs")
    parser.add_argument("--top", type=int, default=3)
    parser.add_argument("--tpu-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--run", default="")
    parser.add_argument("--every", type=float, default=0.5)
    parser.add_argument("--for", dest="seconds", type=float, default=7 * 86400.0)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.stream:
        return stream(args)
    if args.tpu_only:  # in a Python that has grpcio (start_tpu_metrics)
        answer("tpu", tpu_metrics_here())
        return 0
    devices, holders = tpu_holders()
    started = start_tpu_metrics() if devices else {}
    found = sample(max(0.1, min(args.interval, 30.0)), args.run_dir, max(0, args.top))
    found["tpu"] = finish_tpu(started, devices, holders)
    answer("answer", found)
    return 0


if __name__ == "__main__":
    sys.exit(main())
