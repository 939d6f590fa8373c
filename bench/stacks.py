"""Benchmark: `stacks` on every worker of a large simulated pod, a Python job on each.

    sudo .venv/bin/python bench/stacks.py [--type v4-512] [--type v4-4096] [--rounds 3]
                                          [--site DIR]

For each size: a simulated pod (its own state dir; the workers' shared site, with py-spy, is
hard-linked from --site: the tests' cache, built by scripts/sim-wheels.sh), a detached run of
a small Python job (every worker waits in one function, worker 7 in another, so the fold has
an odd worker to show first), then `stacks`:

- "cold": a new `tpufab stacks` process (interpreter start, imports, TPU API lookup, one SSH
  connection per worker, stacks_worker.py shipped and run on every worker: py-spy once per
  process there), wall time and the client's CPU (user + sys of it and its children);
- "warm": ``Pod.stacks`` on connections this process opened before the rounds (wall; the
  client's CPU of this process).

Prints each round and the medians. Stops its simulated pod at the end.
"""

from __future__ import annotations

import argparse
import io
import json
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

REPO = Path(__file__).resolve().parent.parent
CALL = ("import json, sys\n"
        "from tpufab.verbs import jobs\n"
        "from tpufab.term.console import run\n"
        "sys.exit(run(getattr(jobs, sys.argv[1]), **json.loads(sys.argv[2])))\n")
JOB = '''\
import os, time


def wait_for_the_data():
    time.sleep(3600)


def stuck_elsewhere():
    time.sleep(3600)


print("started", flush=True)
if os.environ["TPUFAB_WORKER_ID"] == "7":
    stuck_elsewhere()
else:
    wait_for_the_data()
'''


def quiet():
    from rich.console import Console

    return Console(file=io.StringIO())


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def verb(name: str, env: dict, cwd: Path, **kwargs) -> tuple[subprocess.CompletedProcess, float,
                                                              float]:
    cpu0, t0 = children_cpu(), time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", CALL, name, json.dumps(kwargs)], env=env,
                          cwd=cwd, capture_output=True, text=True, timeout=1800)
    return proc, time.perf_counter() - t0, children_cpu() - cpu0


def bench(kind: str, rounds: int, site: Path) -> dict:
    from tpufab.cloud import lifecycle
    from tpufab.config import load_settings
    from tpufab.pod.api import Pod
    from tpufab.sim.daemon import down, up

    base = Path(tempfile.mkdtemp(prefix="tpufab-bench-stacks-"))
    share = base / "sim" / "share"
    share.mkdir(parents=True)
    subprocess.run(["cp", "-al", str(site), str(share / "site")], check=True)
    info = up(base / "sim", port=0, timeout=120)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TPUFAB_")}
    env.update(info.env(), TPUFAB_USER_CONFIG=str(base / "none.yaml"),
               TPUFAB_KEEP_ALIVE="0",  # every command connects itself (cold), as before keepers
               TPUFAB_SSH_USER="root",
               TPUFAB_SSH_KEY=str(base / "key" / "tpufab_ed25519"),
               TPUFAB_KNOWN_HOSTS=str(base / "known_hosts"), TPUFAB_NAME="bench-stacks",
               COLUMNS="200")
    (base / "job.py").write_text(JOB)
    settings = load_settings(env=env, cwd=base)
    result: dict = {"type": kind, "cold": [], "warm": []}
    try:
        t0 = time.perf_counter()
        lifecycle.create(load_settings({"type": kind}, env=env, cwd=base), console=quiet())
        pod = Pod.from_settings(settings)
        workers = pod.workers
        result["workers"] = len(workers)
        print(f"{kind}: {len(workers)} workers up in {time.perf_counter() - t0:.1f} s",
              flush=True)
        started, took, _ = verb("run", env, base, recipe="job.py", detach=True, no_deploy=True)
        assert started.returncode == 0, started.stdout + started.stderr
        print(f"  run started in {took:.1f} s", flush=True)
        t0 = time.perf_counter()
        pod.run("true", timeout=600).check()     # "warm" means open connections
        print(f"  this process connected in {time.perf_counter() - t0:.1f} s", flush=True)
        for n in range(rounds):
            proc, wall, cpu = verb("stacks", env, base)
            assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
            head = proc.stdout.splitlines()[0]
            assert "w7 differs" in head, head
            result["cold"].append((wall, cpu))
            cpu0, t0 = own_cpu(), time.perf_counter()
            report = pod.stacks(save=False)
            warm = time.perf_counter() - t0
            warm_cpu = own_cpu() - cpu0
            assert report.odd == [7], report.headline()
            result["warm"].append((warm, warm_cpu))
            print(f"  round {n + 1}: cold {wall:.2f} s (client CPU {cpu:.2f} s), warm "
                  f"{warm:.2f} s (client CPU {warm_cpu:.2f} s)", flush=True)
        result["headline"] = head
        pod.close()
        lifecycle.delete(settings, yes=True, console=quiet())
    finally:
        down(base / "sim")
        shutil.rmtree(base, ignore_errors=True)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--type", action="append", dest="types")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--site", type=Path, default=Path(os.environ.get(
        "TPUFAB_TEST_SIM_CACHE", Path.home() / ".cache" / "tpufab" / "test-sim")) / "share"
        / "site")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("bench/stacks.py needs root (the simulated pod uses namespaces)", file=sys.stderr)
        return 2
    if not (args.site / "bin" / "py-spy").exists():
        print(f"no py-spy in {args.site}: run scripts/sim-wheels.sh --sim-dir "
              f"{args.site.parent.parent}", file=sys.stderr)
        return 2
    results = [bench(kind, args.rounds, args.site) for kind in args.types or ["v4-512"]]
    print()
    print(f"machine: {platform.node()} {os.cpu_count()} cores, {platform.python_version()}, "
          f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    for r in results:
        cold_wall = statistics.median(w for w, _ in r["cold"])
        cold_cpu = statistics.median(c for _, c in r["cold"])
        warm_wall = statistics.median(w for w, _ in r["warm"])
        warm_cpu = statistics.median(c for _, c in r["warm"])
        print(f"{r['type']} ({r['workers']} workers): cold median {cold_wall:.2f} s wall, "
              f"{cold_cpu:.2f} s client CPU; warm median {warm_wall:.2f} s wall, "
              f"{warm_cpu:.2f} s client CPU")
        print(f"  {r['headline']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
