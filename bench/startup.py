"""Start-up time of `tpufab --help` and `invoke --list`, side by side with what they avoid.

`invoke --list` runs twice: in tpufab's checkout and in a fresh project made by `tpufab init`
(a user's tasks.py importing tpufab's collection and adding its own task).

    .venv/bin/python bench/startup.py [--runs 15]

Prints a Markdown table of medians (ms) and ratios to a bare `python -c pass`. Runs every
command alternately, so load on this noisy machine hits all of them alike.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

COMMANDS = {
    "python -c pass": [sys.executable, "-c", "pass"],
    "tpufab --help": [str(BIN / "tpufab"), "--help"],
    "invoke --list": [str(BIN / "invoke"), "--list"],
    "invoke --list (a `tpufab init` project)": [str(BIN / "invoke"), "--list"],
    "python -c 'import paramiko'": [sys.executable, "-c", "import paramiko"],
    "python -c 'import google.cloud.tpu_v2'": [sys.executable, "-c", "import google.cloud.tpu_v2"],
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TPUFAB_")}
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    project = Path(tempfile.mkdtemp(prefix="tpufab-bench-project-"))
    subprocess.run([str(BIN / "tpufab"), "init", "--dir", str(project)], env=env, check=True,
                   stdout=subprocess.DEVNULL)
    for _ in range(args.runs):
        for name, argv in COMMANDS.items():
            cwd = project if "tpufab init" in name else REPO
            start = time.perf_counter()
            subprocess.run(argv, cwd=cwd, env=env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, check=True)
            times[name].append(time.perf_counter() - start)
    subprocess.run(["rm", "-rf", str(project)], check=True)
    base = statistics.median(times["python -c pass"])
    print(f"runs: {args.runs}; load average: {os.getloadavg()[0]:.1f}")
    print("| command | median ms | vs python -c pass |")
    print("|---|--:|--:|")
    for name, samples in times.items():
        median = statistics.median(samples)
        print(f"| `{name}` | {median * 1e3:.0f} | {median / base:.1f}x |")


if __name__ == "__main__":
    main()
