"""The simulated pod's shared site: how long `scripts/sim-wheels.sh [--torch]` takes to build
it from nothing, how big it is, and how long a worker's Python takes to import from it.

    python bench/sim_site.py [--torch] [--sim-dir DIR] [--keep]

Builds into a fresh directory (default: a temporary one, removed afterwards unless --keep) with
--force, so nothing cached on the machine counts; pip's own cache is whatever the machine has.
Prints wall time and the CPU time of the build's processes, the site's size (du) and, for
torch, the cold and warm `import torch, torch_xla` times of /usr/bin/python3.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed(argv, **kwargs) -> tuple[float, float, subprocess.CompletedProcess]:
    cpu, began = children_cpu(), time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, **kwargs)
    return time.perf_counter() - began, children_cpu() - cpu, done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--torch", action="store_true")
    parser.add_argument("--sim-dir")
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    sim_dir = Path(args.sim_dir or tempfile.mkdtemp(prefix="tpufab-bench-site-"))
    try:
        argv = ["bash", str(REPO / "scripts" / "sim-wheels.sh"), "--sim-dir", str(sim_dir),
                "--force", *(["--torch"] if args.torch else [])]
        wall, cpu, done = timed(argv)
        if done.returncode != 0:
            raise SystemExit(done.stdout + done.stderr)
        site = sim_dir / "share" / "site"
        size = subprocess.run(["du", "-sh", str(site)], capture_output=True,
                              text=True).stdout.split()[0]
        print(f"build: {wall:.0f} s wall, {cpu:.0f} s CPU; site {size} ({site})")
        if args.torch:
            env = {**os.environ, "PYTHONPATH": str(site), "PJRT_DEVICE": "CPU"}
            check = ["/usr/bin/python3", "-c", "import torch, torch_xla"]
            for label in ("first", "second"):
                wall, cpu, done = timed(check, env=env)
                assert done.returncode == 0, done.stderr
                print(f"import torch, torch_xla ({label}): {wall:.1f} s wall, {cpu:.1f} s CPU")
    finally:
        if not args.keep and not args.sim_dir:
            shutil.rmtree(sim_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
