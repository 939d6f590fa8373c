"""Benchmark: `tpufab ray up` (and `ray down`) on a simulated pod of N hosts.

    sudo .venv/bin/python bench/ray_up.py [--type v4-16 --type v4-128] [--join-batch N]

For each type: a simulated pod in a temporary state dir whose workers import Ray from the
shared site (scripts/sim-wheels.sh --ray, cached as the tests cache it), set up with
scripts/setup-sim.sh; then `tpufab ray up -- --num-cpus=1 --object-store-memory=80000000`
timed from the command line (cold: no Ray anywhere), a second `ray up` (the no-op), the
memory (RSS) of every Ray process on the machine while the cluster is up, and `ray down`.
Each command's wall time and the client's CPU (user + system of the `tpufab` process and its
children: SSH included). ``--join-batch N`` passes `ray up --join-batch N`. Prints one Markdown
row per type.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from harness import connected_pod  # noqa: E402 - the same simulated pod the tests use
from helpers import tpufab  # noqa: E402

SMALL = ["--", "--num-cpus=1", "--object-store-memory=80000000"]
RAY_MARKS = ("raylet", "gcs_server", "ray::", "ray-dashboard", "/ray/")


class Factory:
    """What connected_pod needs of pytest's tmp_path_factory."""

    def __init__(self, root: Path):
        self.root = root

    def mktemp(self, name: str) -> Path:
        return Path(tempfile.mkdtemp(prefix=name, dir=self.root))


def ray_rss_mib() -> tuple[int, float]:
    """(how many Ray processes run on this machine, their RSS summed in MiB)."""
    count, kib = 0, 0
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            argv = Path(f"/proc/{name}/cmdline").read_bytes().replace(b"\0", b" ").decode(
                "utf-8", "replace")
            comm = Path(f"/proc/{name}/comm").read_text().strip()
            status = Path(f"/proc/{name}/status").read_text()
        except OSError:
            continue
        if any(m in argv[:200] or m in comm for m in RAY_MARKS):
            count += 1
            kib += next((int(line.split()[1]) for line in status.splitlines()
                         if line.startswith("VmRSS:")), 0)
    return count, kib / 1024


def children_cpu() -> float:
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def timed(*args: str, env: dict) -> tuple[float, float, subprocess.CompletedProcess]:
    """(wall seconds, client CPU seconds, the result) of one tpufab command."""
    began, cpu = time.monotonic(), children_cpu()
    result = tpufab(*args, env=env, timeout=1800)
    if result.returncode != 0:
        raise SystemExit(f"tpufab {' '.join(args)} failed:\n{result.stdout}{result.stderr}")
    print(result.stderr.strip(), file=sys.stderr, flush=True)
    return time.monotonic() - began, children_cpu() - cpu, result


def measure(type_name: str, join_batch: int = 0) -> dict:
    from tpufab.sim.daemon import down, up

    root = Path(tempfile.mkdtemp(prefix="bench-ray-"))
    info = up(root / "state", port=0)
    try:
        with connected_pod(info, Factory(root), "bray", type=type_name, site="ray",
                           setup=True) as pod:
            hosts = len(pod.pod.workers)
            batch = ["--join-batch", str(join_batch)] if join_batch else []
            load_before = os.getloadavg()[0]
            cold, cold_cpu, result = timed("ray", "up", *batch, *SMALL, env=pod.env)
            processes, rss = ray_rss_mib()
            again, again_cpu, _ = timed("ray", "up", *SMALL, env=pod.env)
            stop, _, _ = timed("ray", "down", env=pod.env)
            load = os.getloadavg()[0]
            return {"type": type_name, "hosts": hosts, "up": cold, "up_cpu": cold_cpu,
                    "again": again, "again_cpu": again_cpu, "down": stop,
                    "processes": processes, "rss": rss, "load": f"{load_before:.0f}-{load:.0f}",
                    "said": result.stdout.strip().splitlines()[-1]}
    finally:
        down(state_dir=root / "state")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--type", action="append", default=None)
    parser.add_argument("--join-batch", type=int, default=0)
    args = parser.parse_args()
    print("| type | hosts | join batch | `ray up` (cold): wall, client CPU | `ray up` again | "
          "`ray down` | Ray processes | their RSS | load (1 min, before-after) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for type_name in args.type or ["v4-16"]:
        row = measure(type_name, args.join_batch)
        print(f"| {row['type']} | {row['hosts']} | {args.join_batch or 'all'} | "
              f"{row['up']:.1f} s, {row['up_cpu']:.1f} s | {row['again']:.1f} s, "
              f"{row['again_cpu']:.1f} s | {row['down']:.1f} s | {row['processes']} | "
              f"{row['rss'] / 1024:.1f} GiB | {row['load']} |", flush=True)


if __name__ == "__main__":
    main()
