"""Benchmark: `kill` on every worker of a 64-worker simulated pod (v4-512), zombies everywhere.

    sudo .venv/bin/python bench/kill.py [--type v4-512] [--grace 5] [--rounds 3]

Each round leaves a crashed job's mess on every worker (`sim zombie`: two TPU holders, one
of which ignores SIGTERM so it costs the whole grace period and a SIGKILL, the libtpu lockfile
held, and a protected tpu-runtime holder), then times `kill`:

- "cold": a fresh process calling the verb, as `tpufab kill` does (interpreter start, imports,
  TPU API lookup, one SSH connection and agent per worker, kill_worker.py on every worker);
- "warm": the library call on open connections.

The target is grace + 2 s. Prints each round, the medians, and the slowest worker's own
tpukill time. Runs its own simulated pod in a temporary state dir and stops it at the end.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CALL = ("import json, sys\n"
        "from tpufab.verbs import jobs, sim\n"
        "from tpufab.term.console import run\n"
        "verb = getattr(jobs, sys.argv[1], None) or getattr(sim, sys.argv[1])\n"
        "sys.exit(run(verb, **json.loads(sys.argv[2])))\n")


def tree_cpu(root: int) -> float:
    """CPU seconds used by every descendant of ``root`` so far: live processes' own time plus
    what they reaped (cutime/cstime count each ended process once, at its reaper)."""
    parents, times = {}, {}
    tick = os.sysconf("SC_CLK_TCK")
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as fh:
                data = fh.read()
        except OSError:
            continue
        fields = data[data.rindex(b")") + 2:].split()
        parents[int(name)] = int(fields[1])
        times[int(name)] = sum(int(x) for x in fields[11:15]) / tick
    total = 0.0
    for pid in times:
        up, seen = parents.get(pid), 0
        while up not in (None, 0, 1, root) and seen < 64:
            up, seen = parents.get(up), seen + 1
        if up == root:
            total += times[pid]
    return total


def quiet():
    from rich.console import Console

    return Console(file=io.StringIO())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--type", default="v4-512")
    parser.add_argument("--grace", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("bench/kill.py needs root (the simulated pod uses namespaces)", file=sys.stderr)
        return 2

    from tpufab.cloud import lifecycle
    from tpufab.config import load_settings
    from tpufab.hosts import connect as pods
    from tpufab.sim.daemon import down, up
    from tpufab.steps.host import killing

    base = Path(tempfile.mkdtemp(prefix="tpufab-bench-kill-"))
    info = up(base / "sim", port=0, timeout=120)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TPUFAB_")}
    env.update(info.env(), TPUFAB_USER_CONFIG=str(base / "none.yaml"),
               TPUFAB_KEEP_ALIVE="0",  # every command connects itself (cold), as before keepers
               TPUFAB_SSH_USER="root",
               TPUFAB_SSH_KEY=str(base / "key" / "tpufab_ed25519"),
               TPUFAB_KNOWN_HOSTS=str(base / "known_hosts"), TPUFAB_NAME="bench-kill",
               COLUMNS="200")
    settings = load_settings(env=env, cwd=base)
    rows = []
    try:
        started = time.perf_counter()
        lifecycle.create(load_settings({"type": args.type}, env=env, cwd=base), console=quiet())
        pod = pods.connect(settings, console=quiet())
        workers = pod.workers
        print(f"{args.type}: {len(workers)} workers up in {time.perf_counter() - started:.1f} s")
        for n in range(args.rounds):
            for mode in ("cold", "warm"):
                made = killing.make_zombies(pod.fanout, workers)
                assert all(r.report for r in made.values()), made
                cpu0 = tree_cpu(info.pid)
                if mode == "cold":
                    t0 = time.perf_counter()
                    proc = subprocess.run([sys.executable, "-c", CALL, "kill",
                                           json.dumps({"grace": args.grace})], env=env, cwd=base,
                                          capture_output=True, text=True, timeout=300)
                    seconds = time.perf_counter() - t0
                    assert proc.returncode == 0, proc.stdout + proc.stderr
                    last = proc.stdout.strip().splitlines()[-1]
                    worker_max = None
                else:
                    t0 = time.perf_counter()
                    result = killing.kill(pod.fanout, workers, grace=args.grace)
                    seconds = time.perf_counter() - t0
                    assert result.ok, killing.summary(result)
                    last = killing.summary(result)
                    worker_max = max(r["elapsed_s"] for r in result.reports.values())
                worker_cpu = tree_cpu(info.pid) - cpu0
                assert f"Killed {3 * len(workers) - len(workers)} processes" in last, last
                rows.append((mode, seconds, worker_max, worker_cpu))
                extra = f", slowest worker's tpukill {worker_max:.2f} s" if worker_max else ""
                print(f"round {n + 1} {mode}: {seconds:.2f} s{extra}, CPU of all 64 workers "
                      f"{worker_cpu:.2f} s")
        noop_t0 = time.perf_counter()
        noop = killing.kill(pod.fanout, workers, grace=args.grace)
        noop_s = time.perf_counter() - noop_t0
        assert all(r.get("noop") for r in noop.reports.values())
        pod.close()
        lifecycle.delete(settings, yes=True, console=quiet())
    finally:
        down(base / "sim")
        shutil.rmtree(base, ignore_errors=True)

    target = args.grace + 2
    print()
    print(f"machine: {platform.node()} {os.cpu_count()} cores, {platform.python_version()}, "
          f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(f"grace {args.grace:g} s, target {target:g} s (grace + 2 s)")
    for mode in ("cold", "warm"):
        times = [s for m, s, _, _ in rows if m == mode]
        cpu = [c for m, _, _, c in rows if m == mode]
        print(f"{mode}: median {statistics.median(times):.2f} s, max {max(times):.2f} s "
              f"({'within' if max(times) <= target else 'OVER'} target); workers' CPU, summed, "
              f"median {statistics.median(cpu):.2f} s")
    worker = [w for _, _, w, _ in rows if w is not None]
    print(f"slowest worker's own tpukill (warm): median {statistics.median(worker):.2f} s")
    print(f"nothing to kill (warm): {noop_s:.2f} s")
    return 0 if max(s for _, s, _, _ in rows) <= target else 1


if __name__ == "__main__":
    sys.exit(main())
