"""The environment built once (docs/environment.md) beside the per-host setup.sh way of today,
on simulated pods, in one run: for each size, a package index on loopback (tests/pyindex.py)
with ``--wheels`` wheels of ``--wheel-mb`` MB each, then

- **env**: `Pod.setup()` with `environment: {requirements: ...}` (worker 0 builds with uv,
  every other host copies that build from it): the index's downloads per wheel, and the
  time to ready on one host (``--worker 0``, uv's cache warm, a forced build) against every
  host (forced build, then every copy). What this machine sends is not measured here
  (socket sends are no part of /proc/self/io's counts);
- **setup.sh**: a setup script that makes a venv and pip-installs the same requirements on
  every host (the way of today), its downloads per wheel and its time.

    .venv/bin/python bench/env_build.py [--types v4-32,v4-128] [--wheels 4] [--wheel-mb 8]

Needs root (the simulated pod's workers). Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "tests"))


def per_wheel(served: dict[str, int], before: dict[str, int]) -> str:
    counts = [served.get(n, 0) - before.get(n, 0) for n in served if n.endswith(".whl")]
    return f"{min(counts)}-{max(counts)}" if counts and min(counts) != max(counts) else \
        str(counts[0] if counts else 0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--types", default="v4-32,v4-128")
    parser.add_argument("--wheels", type=int, default=4)
    parser.add_argument("--wheel-mb", type=float, default=8.0)
    args = parser.parse_args()
    from pyindex import PackageIndex
    from rich.console import Console

    from tpufab.cloud import lifecycle
    from tpufab.config import load_settings
    from tpufab.pod.api import Pod
    from tpufab.sim.daemon import down, up

    state = Path(tempfile.mkdtemp(prefix="tpufab-bench-env-"))
    info = up(state, port=0, timeout=60)
    home = Path(tempfile.mkdtemp(prefix="tpufab-bench-home-"))
    env = {**info.env(), "TPUFAB_USER_CONFIG": str(home / "none.yaml"), "TPUFAB_KEEP_ALIVE": "0",
           "TPUFAB_SSH_KEY": str(home / "key"), "TPUFAB_KNOWN_HOSTS": str(home / "kh"),
           "TPUFAB_STATE_DIR": str(home / "state")}
    quiet = Console(file=open(os.devnull, "w"))  # noqa: SIM115
    rows = []
    try:
        with PackageIndex(home / "wheels") as index:
            names = [f"tfa-w{i}" for i in range(args.wheels)]
            for name in names:
                index.add(name, "1.0", payload=int(args.wheel_mb * 1e6))
            requirements = f"--index-url {index.url}\n" + "".join(f"{n}\n" for n in names)
            for type_name in args.types.split(","):
                name = f"benv-{type_name}"
                project = home / name
                outside = home / f"{name}-plain"          # no tpufab.yaml above it
                outside.mkdir(parents=True)
                project.mkdir()
                (project / "requirements.txt").write_text(requirements)
                (project / "tpufab.yaml").write_text(
                    "environment: {requirements: requirements.txt}\n")
                settings = load_settings({"name": name, "type": type_name}, env=env,
                                         cwd=project)
                lifecycle.create(settings, console=quiet)
                pod = Pod.from_settings(settings)
                hosts = len(pod.select("all"))
                before = index.served()
                pod.env_build(workers="0")              # the first build (uv shipped, cache)
                first = per_wheel(index.served(), before)
                started = time.perf_counter()
                pod.env_build(workers="0", force=True)
                one = time.perf_counter() - started
                before = index.served()
                started = time.perf_counter()
                pod.env_build(force=True)
                every = time.perf_counter() - started
                env_per_wheel = per_wheel(index.served(), before)
                # the way of today: every host resolves and downloads for itself
                script = outside / "setup.sh"
                script.write_text("#!/bin/sh\nset -e\nrm -rf ~/.venv-pip\n"
                                  "python3 -m venv ~/.venv-pip\n"
                                  "~/.venv-pip/bin/pip install -q --disable-pip-version-check "
                                  f"--index-url {index.url} {' '.join(names)}\n")
                plain = Pod.from_settings(load_settings({"name": name}, env=env,
                                                        cwd=outside))
                before = index.served()
                started = time.perf_counter()
                plain.setup(script, force=True)
                pip = time.perf_counter() - started
                pip_per_wheel = per_wheel(index.served(), before)
                pod.close()
                plain.close()
                lifecycle.delete(settings, yes=True, console=quiet)
                rows.append((type_name, hosts, first, env_per_wheel, one, every, pip_per_wheel,
                             pip))
    finally:
        down(state)
    print(f"load average: {os.getloadavg()[0]:.1f}; {args.wheels} wheels of "
          f"{args.wheel_mb:g} MB; spec file {len(requirements)} B")
    print("| type | hosts | env: downloads per wheel (first build; forced, all hosts) | "
          "env: 1 host s | env: all hosts s | ratio | setup.sh: downloads per wheel | "
          "setup.sh: all hosts s | setup.sh / env |")
    print("|---|--:|--:|--:|--:|--:|--:|--:|--:|")
    for type_name, hosts, first, env_pw, one, every, pip_pw, pip in rows:
        print(f"| {type_name} | {hosts} | {first}; {env_pw} | {one:.1f} | {every:.1f} | "
              f"{every / one:.2f}x | {pip_pw} | {pip:.1f} | {pip / every:.1f}x |")


if __name__ == "__main__":
    main()
