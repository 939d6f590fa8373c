"""A Compute Engine TPU slice beside a Cloud TPU API node of the same size, on one simulated
pod in one run: create-to-READY (lifecycle.create, in-process) and fan-out (connect, then
`true` on every worker, median of N; and `tpufab exec -- true` as a user types it, a new
process each time, median of --cli-runs). ``TYPExN`` is a multislice of N slices (a queued
resource on the TPU API, N labelled MIGs on Compute Engine).

    .venv/bin/python bench/compute_plane.py [--pairs v4-16:tpu7x-16,v4-16x2:tpu7x-16x2]
                                            [--runs 10] [--cli-runs 3]

Needs root (the simulated pod's workers). Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", default="v4-16:tpu7x-16,v4-8:tpu7x-8")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--cli-runs", type=int, default=3)
    args = parser.parse_args()
    import subprocess

    from rich.console import Console

    from tpufab.cloud import lifecycle
    from tpufab.config import load_settings
    from tpufab.hosts import connect as connection
    from tpufab.sim.daemon import down, up

    state = Path(tempfile.mkdtemp(prefix="tpufab-bench-compute-"))
    info = up(state, port=0, timeout=60)
    home = Path(tempfile.mkdtemp(prefix="tpufab-bench-home-"))
    env = {**info.env(), "TPUFAB_USER_CONFIG": str(home / "none.yaml"), "TPUFAB_KEEP_ALIVE": "0",
           "TPUFAB_SSH_KEY": str(home / "key"), "TPUFAB_KNOWN_HOSTS": str(home / "kh"),
           "TPUFAB_STATE_DIR": str(home / "state")}
    quiet = Console(file=open(os.devnull, "w"))  # noqa: SIM115
    rows = []
    try:
        for pair in args.pairs.split(","):
            for spec in pair.split(":"):
                multi = re.fullmatch(r"(.+-\d+)x(\d+)", spec)   # v4-16x2: 2 slices
                type_name, slices = (multi[1], int(multi[2])) if multi else (spec, 1)
                name = f"b-{spec.replace('.', '-')}"
                settings = load_settings({"name": name, "type": type_name}, env=env, cwd=home)
                started = time.perf_counter()
                nodes = lifecycle.create(settings, num_slices=slices, console=quiet)
                ready = time.perf_counter() - started
                node = nodes[0]
                plain = load_settings({"name": name}, env=env, cwd=home)
                started = time.perf_counter()
                pod = connection.connect(plain, console=quiet)
                connect = time.perf_counter() - started
                fan = []
                for _ in range(args.runs):
                    started = time.perf_counter()
                    result = pod.fanout.run("true")
                    fan.append(time.perf_counter() - started)
                    assert result.ok, result
                workers = len(pod.workers)
                pod.close()
                cli = []
                for _ in range(args.cli_runs):
                    started = time.perf_counter()
                    subprocess.run([str(Path(sys.executable).parent / "tpufab"), "exec",
                                    "--name", name, "--", "true"], env={**os.environ, **env},
                                   cwd=home, check=True, capture_output=True, timeout=600)
                    cli.append(time.perf_counter() - started)
                started = time.perf_counter()
                lifecycle.delete(plain, yes=True, console=quiet)
                gone = time.perf_counter() - started
                rows.append((spec, node.plane_text, workers, ready, connect,
                             statistics.median(fan), statistics.median(cli), gone))
    finally:
        down(state)
    print(f"load average: {os.getloadavg()[0]:.1f}; fan-out median of {args.runs}, "
          f"`tpufab exec` median of {args.cli_runs}")
    print("| type | plane | VMs | create to READY s | connect s | `true` on all s | "
          "`tpufab exec -- true` s | delete s |")
    print("|---|---|--:|--:|--:|--:|--:|--:|")
    for spec, plane, hosts, ready, connect, fan, cli, gone in rows:
        print(f"| {spec} | {plane} | {hosts} | {ready:.1f} | {connect:.2f} | {fan:.3f} | "
              f"{cli:.2f} | {gone:.1f} |")


if __name__ == "__main__":
    main()
