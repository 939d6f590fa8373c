"""Every verb at 64, 256 and 1,024 simulated workers, through the real `tpufab` command.

    sudo .venv/bin/python bench/scale.py [--size 64 --size 256 --size 1024] [--verbs exec,status]

For each size, one after the other: a simulated pod in a temporary state dir, a node of that
many workers made with `tpufab create` (64: v4-512, 256: v4-2048, 512: v4-4096, 1,024:
v5p-8192), a git project with a setup script and a recipe, then each verb once, timed: wall
time and the client's CPU (user + sys of the `tpufab` process and its children, from
getrusage), and whether it exited 0. The node and the pod are torn down after each size
(also on failure). Prints one Markdown row per verb and size, and per-worker figures.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BIN = Path(sys.executable).parent
TYPES = {64: "v4-512", 256: "v4-2048", 512: "v4-4096", 1024: "v5p-8192", 1536: "v5p-12288"}
SETUP = "#!/bin/sh\nset -e\necho set up on $(hostname)\n"
RECIPE = "#!/bin/sh\necho hello from w$TPUFAB_WORKER_ID of $TPUFAB_NUM_WORKERS\n"
VERBS = {  # name -> argv after `tpufab`
    "exec (cold)": ["exec", "--gather", "true"],
    "exec --gather hostname": ["exec", "--gather", "hostname"],
    "setup": ["setup", "--script", "setup.sh", "--force"],
    "deploy": ["deploy", "--direct"],
    "run": ["run", "recipe.sh", "--no-deploy"],
    "logs": ["logs"],
    "status": ["status"],
    "kill": ["kill", "--grace", "1"],
}


def timed(argv: list[str], env: dict[str, str], cwd: Path, timeout: float
          ) -> tuple[float, float, int, str]:
    """(wall s, client CPU s, exit code, last lines of output) of one command."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    try:
        done = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)
        code, out = done.returncode, (done.stdout + done.stderr)
    except subprocess.TimeoutExpired as err:
        code, out = -1, f"timed out after {timeout:g} s: {err.stdout or ''}"
    wall = time.monotonic() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    tail = out if isinstance(out, str) else out.decode(errors="replace")
    return wall, cpu, code, "\n".join(tail.strip().splitlines()[-6:])


def project(base: Path) -> Path:
    repo = base / "proj"
    repo.mkdir()
    for name, text in (("setup.sh", SETUP), ("recipe.sh", RECIPE)):
        (repo / name).write_text(text)
        (repo / name).chmod(0o755)
    git = ["git", "-c", "user.name=b", "-c", "user.email=b@b.invalid"]
    for argv in (["init", "-q", "-b", "main"], ["add", "."], ["commit", "-q", "-m", "one"]):
        subprocess.run([*git, *argv], cwd=repo, check=True, capture_output=True)
    return repo


def command(verb_argv: list[str], profile: Path | None, name: str) -> list[str]:
    """`tpufab ARGS`, or the same under cProfile (its .prof file named after the verb)."""
    if profile is None:
        return [str(BIN / "tpufab"), *verb_argv]
    out = profile / (name.split()[0] + ".prof")
    return [sys.executable, "-m", "cProfile", "-o", str(out), "-m", "tpufab.cli", *verb_argv]


def one_size(size: int, verbs: list[str], show: bool, profile: Path | None = None
             ) -> list[dict[str, object]]:
    from tpufab.sim.daemon import down, up

    base = Path(tempfile.mkdtemp(prefix=f"bench-scale-{size}-"))
    home = base / "home"
    home.mkdir()
    rows: list[dict[str, object]] = []
    info = up(base / "state", port=0, timeout=120)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TPUFAB_")}
    env.update(info.env(), HOME=str(home), COLUMNS="200", TPUFAB_NAME=f"scale{size}",
               TPUFAB_USER_CONFIG=str(home / "none.yaml"), TPUFAB_WAIT_TIMEOUT="1800",
               TPUFAB_KEEP_ALIVE="0")  # cold commands, as pssh and clush are (bench/keeper.py: kept)
    repo = project(base)
    tpufab = str(BIN / "tpufab")
    try:
        wall, cpu, code, tail = timed([tpufab, "create", "--type", TYPES[size]], env, repo,
                                      3600)
        rows.append({"size": size, "verb": "create", "wall": wall, "cpu": cpu, "code": code,
                     "load": os.getloadavg()[0]})
        print(f"{size} create: {wall:.1f} s wall, {cpu:.1f} s CPU, exit {code}", flush=True)
        if code != 0:
            print(tail)
            return rows
        for verb in verbs:
            load = os.getloadavg()[0]
            wall, cpu, code, tail = timed(command(VERBS[verb], profile, f"{size}-{verb}"),
                                          env, repo, 1800)
            rows.append({"size": size, "verb": verb, "wall": wall, "cpu": cpu, "code": code,
                         "load": load})
            print(f"{size} {verb}: {wall:.2f} s wall, {cpu:.2f} s CPU, exit {code}", flush=True)
            if show or code != 0:
                print("   " + tail.replace("\n", "\n   "), flush=True)
    finally:
        subprocess.run([tpufab, "delete", "--yes"], env=env, cwd=repo, capture_output=True,
                       timeout=600)
        down(base / "state", timeout=300)
        shutil.rmtree(base, ignore_errors=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, action="append", choices=sorted(TYPES))
    parser.add_argument("--verbs", default=",".join(VERBS))
    parser.add_argument("--show", action="store_true", help="print each verb's last lines")
    parser.add_argument("--profile", type=Path, help="write a cProfile file per verb here")
    args = parser.parse_args()
    verbs = [v.strip() for v in args.verbs.split(",")]
    unknown = [v for v in verbs if v not in VERBS]
    if unknown:
        parser.error(f"unknown verb(s) {unknown}; known: {', '.join(VERBS)}")
    rows = []
    for size in args.size or [64, 256, 1024]:
        rows += one_size(size, verbs, args.show, args.profile)
    print(f"\nmachine: {os.cpu_count()} cores; load average at the end "
          f"{os.getloadavg()[0]:.1f}")
    print("| verb | workers | wall s | client CPU s | CPU ms per worker | exit |")
    print("|---|--:|--:|--:|--:|--:|")
    for row in rows:
        size = int(row["size"])  # type: ignore[arg-type]
        print(f"| {row['verb']} | {size:,} | {row['wall']:.2f} | {row['cpu']:.2f} | "
              f"{float(row['cpu']) * 1000 / size:.1f} | {row['code']} |")  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
