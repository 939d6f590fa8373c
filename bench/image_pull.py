"""Image pulls across simulated hosts, with and without injected auth failures, and the cost
a run with an image adds over one without.

    .venv/bin/python bench/image_pull.py [--hosts 4,16,64] [--fail 0,0.1] [--runs 3]
                                         [--cache ~/.cache/tpufab/test-sim/share]

For each pod size (v4-32: 4 hosts, v4-128: 16, v4-512: 64) and auth-failure share (`sim
registry --fail-auth`, each chosen host refused twice): a small image (one layer of a few
files: the pull's mechanics, not bandwidth) removed from every host, then `Pod.image_pull`:
wall time, hosts that came up, retries, against the same pull on one host; then a present
image re-checked (the registry asked) and looked at (`--if-missing`), per host. Last, on a
v4-16 (2 hosts), `Pod.start(...).wait()` of a recipe that exits at once, without and with
`image=` the slim base image (already on the hosts), median of --runs. Needs root. Prints
Markdown tables.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TYPES = {2: "v4-16", 4: "v4-32", 16: "v4-128", 64: "v4-512"}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hosts", default="4,16,64")
    parser.add_argument("--fail", default="0,0.1")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--cache", default=str(Path.home() / ".cache/tpufab/test-sim/share"))
    args = parser.parse_args()
    from rich.console import Console

    from tpufab.cloud import lifecycle
    from tpufab.config import load_settings
    from tpufab.hosts import connect as connection
    from tpufab.pod.api import Pod
    from tpufab.sim.admin import SimAdmin
    from tpufab.sim.daemon import down, up
    from tpufab.sim.image import publish, push_layout, tiny
    from tpufab.steps.host import images

    state = Path(tempfile.mkdtemp(prefix="tpufab-bench-image-"))
    info = up(state, port=0, timeout=60)
    home = Path(tempfile.mkdtemp(prefix="tpufab-bench-home-"))
    env = {**info.env(), "TPUFAB_USER_CONFIG": str(home / "none.yaml"), "TPUFAB_KEEP_ALIVE": "0",
           "TPUFAB_SSH_KEY": str(home / "key"), "TPUFAB_KNOWN_HOSTS": str(home / "kh"),
           "TPUFAB_STATE_DIR": str(home / "state")}
    quiet = Console(file=open(os.devnull, "w"))  # noqa: SIM115
    admin = SimAdmin.from_info(info)
    registry = admin.registry()
    small, _ = push_layout(registry, tiny(state / "tiny", {"/hello.txt": b"hello\n"}),
                           project=info.project, name="tiny", tag="v1")
    pulls, runs = [], []
    try:
        for hosts in [int(h) for h in args.hosts.split(",")]:
            name = f"b-img-{hosts}"
            settings = load_settings({"name": name, "type": TYPES[hosts]}, env=env, cwd=home)
            lifecycle.create(settings, console=quiet)
            pod = connection.connect(settings, console=quiet)
            workers = pod.workers
            try:
                for share in [float(f) for f in args.fail.split(",")]:
                    pod.fanout.run(f"sudo -n docker rmi -f {small} >/dev/null 2>&1; true")
                    admin.registry(failAuth=share, failTimes=2)
                    cpu0 = time.process_time()
                    started = time.perf_counter()
                    report = images.pull(pod.fanout, workers, small)
                    wall = time.perf_counter() - started
                    cpu = time.process_time() - cpu0
                    admin.registry(failAuth=0)
                    pod.fanout.run(f"sudo -n docker rmi -f {small} >/dev/null 2>&1; true",
                                   workers=[0])
                    one0 = time.perf_counter()
                    images.pull(pod.fanout, [0], small)
                    one = time.perf_counter() - one0
                    check0 = time.perf_counter()
                    images.pull(pod.fanout, workers, small)
                    check = time.perf_counter() - check0
                    look0 = time.perf_counter()
                    images.pull(pod.fanout, workers, small, if_missing=True)
                    look = time.perf_counter() - look0
                    ready = sum(1 for r in report.rows if r.ok)
                    retries = sum(len(r.retries) for r in report.rows)
                    pulls.append((hosts, share, ready, retries, wall, one, cpu, check, look))
            finally:
                pod.close()
                lifecycle.delete(settings, yes=True, console=quiet)
        reference, _ = publish(registry, Path(args.cache), project=info.project, name="slim",
                               jax=False)
        settings = load_settings({"name": "b-img-run", "type": "v4-16"}, env=env, cwd=home)
        lifecycle.create(settings, console=quiet)
        recipe = home / "quick.sh"
        recipe.write_text("#!/bin/sh\necho done\n")
        recipe.chmod(0o755)
        try:
            pod = Pod.from_settings(settings)
            pod.image_pull(reference).check()
            for label, image in (("without an image", None), ("with --image", reference)):
                times = []
                for _ in range(args.runs):
                    t0 = time.perf_counter()
                    run = pod.start(recipe, no_deploy=True, image=image)
                    run.wait()
                    times.append(time.perf_counter() - t0)
                runs.append((label, statistics.median(times)))
            pod.close()
        finally:
            lifecycle.delete(settings, yes=True, console=quiet)
    finally:
        down(state)
    print("| hosts | auth failures | hosts up | retries | pull, all hosts | pull, one host | "
          "client CPU (this process) | present: re-check | present: --if-missing |")
    print("|---|---|---|---|---|---|---|---|---|")
    for hosts, share, ready, retries, wall, one, cpu, check, look in pulls:
        print(f"| {hosts} | {share:.0%} | {ready}/{hosts} | {retries} | {wall:.2f} s "
              f"({wall / one:.1f}x one) | {one:.2f} s | {cpu:.2f} s | {check:.2f} s "
              f"({check / hosts:.3f} s a host) | {look:.2f} s ({look / hosts:.3f} s a host) |")
    print()
    print("| run of a recipe that exits at once (2 hosts) | median wall |")
    print("|---|---|")
    base = runs[0][1]
    for label, seconds in runs:
        print(f"| {label} | {seconds:.2f} s (+{seconds - base:.2f} s) |")


if __name__ == "__main__":
    main()
