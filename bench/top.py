"""Benchmark: one `tpufab top` frame on a 64-worker simulated pod (v4-512).

    sudo .venv/bin/python bench/top.py [--type v4-512] [--frames 5] [--interval 1] [--holders]

``--holders``: a process holding every chip on every worker first (it sleeps: the frame reads
each worker's libtpu metrics service, as `top --tpu` does with a job on the pod), and every
frame must show each worker's chips. The workers then get the tests' shared site and
scripts/setup-sim.sh without its import check (grpcio, which reading the service needs, as
tpu-info's Python has it).

Times what a frame costs: the wall time of the fan-out (the ``--interval`` sample on every
worker included) and the client's CPU (this process and any children, user + sys), for
"warm" frames on open connections (what the live view pays every few seconds) and one "cold"
`tpufab top --once` (interpreter start, imports, TPU API lookup, connecting). Runs its own
simulated pod in a temporary state dir and stops it at the end.
"""

from __future__ import annotations

import argparse
import io
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def quiet():
    from rich.console import Console

    return Console(file=io.StringIO())


def cpu_self() -> float:
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--type", default="v4-512")
    parser.add_argument("--frames", type=int, default=5)
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--holders", action="store_true",
                        help="hold every worker's chips first: frames read the TPU metrics")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("bench/top.py needs root (the simulated pod uses namespaces)", file=sys.stderr)
        return 2

    from tpufab.cloud import lifecycle
    from tpufab.config import load_settings
    from tpufab.hosts import connect as pods
    from tpufab.sim.daemon import down, up
    from tpufab.steps.health import top
    from tpufab.views import top as top_view

    base = Path(tempfile.mkdtemp(prefix="tpufab-bench-top-"))
    if args.holders:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        from helpers import build_shared_site  # the same shared site the tests build

        build_shared_site([base / "sim" / "share"])
    info = up(base / "sim", port=0, timeout=120)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TPUFAB_")}
    env.update(info.env(), TPUFAB_USER_CONFIG=str(base / "none.yaml"),
               TPUFAB_KEEP_ALIVE="0",  # every command connects itself (cold), as before keepers
               TPUFAB_SSH_USER="root",
               TPUFAB_SSH_KEY=str(base / "key" / "tpufab_ed25519"),
               TPUFAB_KNOWN_HOSTS=str(base / "known_hosts"), TPUFAB_NAME="bench-top",
               COLUMNS="200")
    settings = load_settings(env=env, cwd=base)
    warm = []
    try:
        started = time.perf_counter()
        lifecycle.create(load_settings({"type": args.type}, env=env, cwd=base), console=quiet())
        pod = pods.connect(settings, console=quiet())
        print(f"{args.type}: {len(pod.workers)} workers up in "
              f"{time.perf_counter() - started:.1f} s")
        if args.holders:
            from tpufab.steps.host.setup import run_setup

            script = Path(__file__).resolve().parent.parent / "scripts" / "setup-sim.sh"
            # the venv alone: its JAX check would cost ~0.5 GiB a worker, all at once
            run_setup(pod.fanout, script, env={"TPUFAB_SIM_SETUP_CHECK": "0"})[0].close()
            hold = ("setsid python3 -c 'import glob, time; held = [open(p, \"rb\") for p in "
                    "glob.glob(\"/dev/accel*\")]; time.sleep(3600)' </dev/null >/dev/null "
                    "2>&1 & echo held")
            pod.fanout.run(hold, check=True).close()
        first = top.frame(pod, interval=args.interval)   # ships top_worker.py once
        deadline = time.monotonic() + 600
        while args.holders and not all(r.chips for r in first.rows):
            assert time.monotonic() < deadline, "the holders never showed in a frame: " + \
                "; ".join(sorted({r.tpu_text for r in first.rows if not r.chips}))
            print(f"{sum(bool(r.chips) for r in first.rows)} of {len(first.rows)} workers' "
                  "chips seen held", flush=True)
            first = top.frame(pod, interval=args.interval)
        for n in range(args.frames):
            cpu0, t0 = cpu_self(), time.perf_counter()
            got = top.frame(pod, interval=args.interval)
            seconds, cpu = time.perf_counter() - t0, cpu_self() - cpu0
            assert got.ok, top_view.to_json(got)
            assert not args.holders or all(r.chips for r in got.rows), top_view.to_json(got)
            warm.append((seconds, cpu, len(got.folded)))
            print(f"warm frame {n + 1}: {seconds:.2f} s wall, {cpu:.3f} s client CPU, "
                  f"{len(got.folded)} rows"
                  + (f", TPU rows: {[r.text for r in top.fold_tpu({r.worker: r for r in got.rows})]}"
                     if args.holders else ""))
        kids0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "tpufab.cli", "top", "--once",
                               "--interval", f"{args.interval:g}"], env=env, cwd=base,
                              capture_output=True, text=True, timeout=300)
        cold_s = time.perf_counter() - t0
        kids1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        cold_cpu = (kids1.ru_utime + kids1.ru_stime) - (kids0.ru_utime + kids0.ru_stime)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        print(f"cold `tpufab top --once`: {cold_s:.2f} s wall, {cold_cpu:.2f} s CPU")
        print(proc.stdout)
        pod.close()
        lifecycle.delete(settings, yes=True, console=quiet())
    finally:
        down(base / "sim")
        shutil.rmtree(base, ignore_errors=True)

    walls = [w for w, _, _ in warm]
    cpus = [c for _, c, _ in warm]
    print(f"machine: {platform.node()} {os.cpu_count()} cores, {platform.python_version()}, "
          f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(f"warm frame (interval {args.interval:g} s): median {statistics.median(walls):.2f} s "
          f"wall (max {max(walls):.2f}), median {statistics.median(cpus):.3f} s client CPU "
          f"(max {max(cpus):.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
