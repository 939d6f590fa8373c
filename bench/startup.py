"""Start-up time of `tpufab --help` and `invoke --list`, side by side with what they avoid.

`invoke --list` runs twice: in tpufab's checkout and in a fresh project made by `tpufab init`
(a user's tasks.py importing tpufab's collection and adding its own task).

    .venv/bin/python bench/startup.py [--runs 15] [--against OTHER_CHECKOUT]

Prints a Markdown table of medians (ms) and ratios to a bare `python -c pass`. Runs every
command alternately, so load on this noisy machine hits all of them alike. ``--against``
adds the tpufab commands of another checkout (its .venv) side by side, with the ratio of
this tree's median to that one's: the tree before a change against the tree after it.
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
# Commands of the tree itself, for --against: the whole help, a worker verb's help (its
# flags read from its Pod method), and a command that runs (no pod needed).
TREE = {"tpufab --help": ["--help"], "tpufab exec --help": ["exec", "--help"],
        "tpufab topology v4-32": ["topology", "v4-32"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--against", type=Path, default=None,
                        help="another checkout whose .venv's tpufab to time side by side")
    args = parser.parse_args()
    if args.against is not None:
        return against(args.runs, args.against)
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


def against(runs: int, other: Path) -> None:
    """TREE's commands of this checkout and of ``other``, alternately, with client CPU."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TPUFAB_")}
    trees = {"this tree": BIN / "tpufab", str(other): other / ".venv" / "bin" / "tpufab"}
    wall: dict[tuple[str, str], list[float]] = {}
    cpu: dict[tuple[str, str], list[float]] = {}
    for _ in range(runs):
        for name, words in TREE.items():
            for tree, binary in trees.items():
                before = os.times()
                start = time.perf_counter()
                subprocess.run([str(binary), *words], cwd=REPO, env=env, check=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                wall.setdefault((name, tree), []).append(time.perf_counter() - start)
                after = os.times()
                cpu.setdefault((name, tree), []).append(
                    after.children_user + after.children_system
                    - before.children_user - before.children_system)
    print(f"runs: {runs}; load average: {os.getloadavg()[0]:.1f}")
    print(f"| command | {' | '.join(f'{t}: wall, CPU ms' for t in trees)} | this / other |")
    print("|---|" + "--:|" * (len(trees) + 1))
    for name in TREE:
        cells = [f"{statistics.median(wall[name, t]) * 1e3:.0f}, "
                 f"{statistics.median(cpu[name, t]) * 1e3:.0f}" for t in trees]
        ratio = statistics.median(wall[name, "this tree"]) / statistics.median(
            wall[name, str(other)])
        print(f"| `{name}` | {' | '.join(cells)} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
