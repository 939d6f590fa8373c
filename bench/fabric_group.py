"""`Pod.group().run("true")` beside `tpufab exec true` and beside Fabric's own ThreadingGroup.

    sudo .venv/bin/python bench/fabric_group.py [--size 64 --size 1024] [--reps 3]
        [--big-reps 1]

For each size, one after the other: a simulated pod in a temporary state dir and a node of that
many workers made with `tpufab create` (bench/scale.py's types: 64: v4-512, 1,024: v5p-8192),
then ``--reps`` rounds (``--big-reps`` from 1,024 workers: the machine is shared; the order
rotated each round) of, each in a fresh process on cold
connections (keep_alive 0):

- ``tpufab exec true``: the command;
- ``Pod.group().run("true")``: ``python -c`` importing tpufab and fabric, the pod looked up
  in the API, then Fabric's Group API on tpufab's fan-out (tpufab.pod.fabric);
- ``fabric ThreadingGroup``: ``python -c`` with Fabric alone, as a Fabric user writes it:
  ``ThreadingGroup(*ips, user=..., connect_kwargs={"key_filename": key}).run("true")``, the
  same workers' external IPs, key and user (Fabric checks no host key: AutoAddPolicy), its
  file-descriptor limit raised to the hard limit as tpufab raises its own.

Client CPU is user + system of the process and its children (getrusage), wall its run's.
Then, in one process whose connections a first call opened, 5 more calls each of
``Pod.run("true")`` and ``Pod.group().run("true")`` (process CPU and wall per call): what the
Group API adds to a call. Prints the medians, the ratios to `tpufab exec`, and each run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scale import BIN, TYPES, project, timed  # noqa: E402

GROUP = """
from tpufab import Pod
result = Pod().group().run("true", hide=True)
assert len(result) == int({count}) and not result.failed
"""
THREADING = """
import json, os, resource
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
from fabric import ThreadingGroup
spec = json.loads(os.environ["BENCH_HOSTS"])
group = ThreadingGroup(*spec["ips"], user=spec["user"],
                       connect_kwargs={{"key_filename": spec["key"]}})
result = group.run("true", hide=True)
assert len(result) == int({count}) and not result.failed
"""
ROWS = ("tpufab exec true", "Pod.group().run(\"true\")", "fabric ThreadingGroup")
# one process, its connections open (and agents started) by a first call: each call's own cost
WARM = """
import json, time
from tpufab import Pod
pod = Pod()
group = pod.group()
pod.run("true"); pod.run("true")
took = {{}}
for name, call in (("Pod.run", lambda: pod.run("true")),
                   ("group.run", lambda: group.run("true", hide=True))):
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range({calls}):
        call()
    took[name] = ((time.perf_counter() - wall) / {calls}, (time.process_time() - cpu) / {calls})
print(json.dumps(took))
"""


def one_size(size: int, reps: int) -> dict:
    from tpufab.sim.daemon import down, up

    base = Path(tempfile.mkdtemp(prefix=f"bench-fabric-{size}-"))
    home = base / "home"
    home.mkdir()
    info = up(base / "state", port=0, timeout=120)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TPUFAB_")}
    env.update(info.env(), HOME=str(home), COLUMNS="200", TPUFAB_NAME=f"fab{size}",
               TPUFAB_USER_CONFIG=str(home / "none.yaml"), TPUFAB_WAIT_TIMEOUT="1800",
               TPUFAB_KEEP_ALIVE="0")
    repo = project(base)
    tpufab = str(BIN / "tpufab")
    runs: dict = {row: [] for row in ROWS}
    try:
        wall, cpu, code, tail = timed([tpufab, "create", "--type", TYPES[size]], env, repo, 3600)
        print(f"{size} create: {wall:.1f} s wall, exit {code}", flush=True)
        if code != 0:
            print(tail)
            return runs
        described = json.loads(subprocess.run([tpufab, "describe", "--json"], env=env, cwd=repo,
                                              capture_output=True, text=True, check=True).stdout)
        from tpufab.config import load_settings

        settings = load_settings(env=env, cwd=repo)
        spec = {"ips": [w["external_ip"] for w in described["workers"]],
                "user": settings.ssh_user, "key": str(home / ".ssh" / "tpufab_ed25519")}
        argv = {ROWS[0]: [tpufab, "exec", "true"],
                ROWS[1]: [sys.executable, "-c", GROUP.format(count=size)],
                ROWS[2]: [sys.executable, "-c", THREADING.format(count=size)]}
        row_env = {**env, "BENCH_HOSTS": json.dumps(spec)}
        warm = subprocess.run([sys.executable, "-c", WARM.format(calls=5)], env=row_env,
                              cwd=repo, capture_output=True, text=True, timeout=1800)
        if warm.returncode == 0:
            runs["warm"] = json.loads(warm.stdout.strip().splitlines()[-1])
            print(f"{size} warm, per call: {runs['warm']}", flush=True)
        else:
            print(f"{size} warm calls failed: {warm.stderr[-2000:]}", flush=True)
        for rep in range(reps):
            order = ROWS[rep % 3:] + ROWS[:rep % 3]
            for row in order:
                wall, cpu, code, tail = timed(argv[row], row_env, repo, 1800)
                runs[row].append((wall, cpu, code))
                print(f"{size} {row}: {wall:.2f} s wall, {cpu:.2f} s CPU, exit {code} "
                      f"(load {os.getloadavg()[0]:.1f})", flush=True)
                if code != 0:
                    print("   " + tail.replace("\n", "\n   "), flush=True)
    finally:
        subprocess.run([tpufab, "delete", "--yes"], env=env, cwd=repo, capture_output=True,
                       timeout=900)
        down(base / "state", timeout=300)
        shutil.rmtree(base, ignore_errors=True)
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, action="append", choices=sorted(TYPES))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--big-reps", type=int, default=1)
    args = parser.parse_args()
    results = {size: one_size(size, args.reps if size < 1024 else args.big_reps)
               for size in args.size or [64, 1024]}
    print(f"\nmachine: {os.cpu_count()} cores; load average at the end "
          f"{os.getloadavg()[0]:.1f}")
    print("| workers | client | wall s | client CPU s | wall / exec | CPU / exec | runs |")
    print("|--:|---|--:|--:|--:|--:|--:|")
    for size, runs in results.items():
        base = runs[ROWS[0]]
        if not base:
            continue
        base_wall = statistics.median(w for w, _c, _code in base)
        base_cpu = statistics.median(c for _w, c, _code in base)
        for row in ROWS:
            done = [(w, c) for w, c, code in runs[row] if code == 0]
            if not done:
                print(f"| {size:,} | {row} | failed | | | | {len(runs[row])} |")
                continue
            wall = statistics.median(w for w, _c in done)
            cpu = statistics.median(c for _w, c in done)
            print(f"| {size:,} | {row} | {wall:.2f} | {cpu:.2f} | {wall / base_wall:.2f}x | "
                  f"{cpu / base_cpu:.2f}x | {len(done)} |")
    print("\nA further call in one process, its connections open (ms a call, mean of 5):")
    print("| workers | call | wall ms | client CPU ms | ratio (CPU) |")
    print("|--:|---|--:|--:|--:|")
    for size, runs in results.items():
        warm = runs.get("warm")
        if not warm:
            continue
        base = warm["Pod.run"][1]
        for name, (wall, cpu) in warm.items():
            print(f"| {size:,} | {name}(\"true\") | {wall * 1e3:.0f} | {cpu * 1e3:.0f} | "
                  f"{cpu / base:.2f}x |")


if __name__ == "__main__":
    main()
