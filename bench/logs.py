"""Benchmark: `logs` on big runs (4 workers x N MB), peak RSS, wall and client CPU per view.

    sudo .venv/bin/python bench/logs.py [--type v4-32] [--mb 12,50] [--differ 4]
                                        [--before DIR] [--before-timeout 300]

A recipe prints N MB of training-like lines on every worker (with --differ K, one line in K
names its worker, so the fold has work to do; 0: every worker prints the same); then each
view runs in a fresh process, as `tpufab logs` does: plain (folded), `--raw`, `--follow`
(folded), `--follow --raw`, stdout to /dev/null. For each: wall time, the client's CPU
(user+sys) and peak RSS (from wait4). `--before DIR` runs the same views with the tpufab in
DIR (e.g. `git archive` of the code before the change) side by side, each given at most
--before-timeout seconds. Runs its own simulated pod in a temporary state dir and stops it.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CALL = ("import json, sys\n"
        "from tpufab.verbs import jobs\n"
        "from tpufab.term.console import run\n"
        "sys.exit(run(jobs.logs, **json.loads(sys.argv[1])))\n")
RECIPE = """#!/usr/bin/env python3
import os, sys
w = os.environ["TPUFAB_WORKER_ID"]
target, differ = int(sys.argv[1]) << 20, int(sys.argv[2])
out, size, i = sys.stdout, 0, 0
while size < target:
    block = "".join(
        (f"step {j} loss {1.0 / (j + 1):.6f} lr 3e-4 tokens/s 98765 on worker {w}\\n"
         if differ and j % differ == 0
         else f"step {j} loss {1.0 / (j + 1):.6f} lr 3e-4 grad norm 0.125 all good\\n")
        for j in range(i, i + 1000))
    out.write(block)
    size += len(block)
    i += 1000
"""
VIEWS = {"plain": {}, "raw": {"raw": True}, "follow": {"follow": True},
         "follow raw": {"follow": True, "raw": True}}


def quiet():
    from rich.console import Console

    return Console(file=io.StringIO())


def measure(env, cwd, flags, pythonpath=None, timeout=None):
    """(wall s, client CPU s, peak RSS MiB) of one `logs` in a fresh process; wall None when
    it was stopped at ``timeout``."""
    if pythonpath:
        env = {**env, "PYTHONPATH": pythonpath}
    t0 = time.perf_counter()
    with open(os.devnull, "wb") as null, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen([sys.executable, "-c", CALL, json.dumps(flags)], env=env,
                                cwd=cwd, stdout=null, stderr=err)
        stopped = False
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if timeout is not None and time.perf_counter() - t0 > timeout:
                proc.kill()
                stopped = True
            time.sleep(0.05)      # polling a child we started; the bench's own pace
        seconds = time.perf_counter() - t0
        err.seek(0)
        text = err.read().decode(errors="replace")
    proc.returncode = os.waitstatus_to_exitcode(status)
    assert stopped or proc.returncode == 0, text
    return (None if stopped else seconds), usage.ru_utime + usage.ru_stime, \
        usage.ru_maxrss / 1024


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--type", default="v4-32")
    parser.add_argument("--mb", default="12,50", help="MB of log per worker, comma-separated")
    parser.add_argument("--differ", type=int, default=4,
                        help="one line in K names its worker (0: all workers print the same)")
    parser.add_argument("--before", help="a tpufab checkout to compare with (PYTHONPATH)")
    parser.add_argument("--before-timeout", type=float, default=300.0)
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("bench/logs.py needs root (the simulated pod uses namespaces)", file=sys.stderr)
        return 2

    from tpufab.cloud import lifecycle
    from tpufab.config import load_settings
    from tpufab.hosts import connect as pods
    from tpufab.sim.daemon import down, up
    from tpufab.ssh.remote_files import RemoteFile
    from tpufab.steps.runs import running as jobs
    from tpufab.steps.start import plan as plans
    from tpufab.steps.start.starting import start_on_workers

    base = Path(tempfile.mkdtemp(prefix="tpufab-bench-logs-"))
    info = up(base / "sim", port=0, timeout=120)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TPUFAB_")}
    env.update(info.env(), TPUFAB_USER_CONFIG=str(base / "none.yaml"),
               TPUFAB_KEEP_ALIVE="0",  # every command connects itself (cold), as before keepers
               TPUFAB_SSH_USER="root",
               TPUFAB_SSH_KEY=str(base / "key" / "tpufab_ed25519"),
               TPUFAB_KNOWN_HOSTS=str(base / "known_hosts"), TPUFAB_NAME="bench-logs",
               COLUMNS="200")
    env.pop("PYTHONPATH", None)
    settings = load_settings(env=env, cwd=base)
    recipe = base / "spew.py"
    recipe.write_text(RECIPE)
    rows = []
    try:
        lifecycle.create(load_settings({"type": args.type}, env=env, cwd=base), console=quiet())
        pod = pods.connect(settings, console=quiet())
        workers = pod.workers
        for mb in (int(x) for x in args.mb.split(",")):
            plan = plans.plan_run(RemoteFile.from_path(recipe), slices=pod.slices,
                                  ips=pod.internal_ips(), args=[str(mb), str(args.differ)])
            start_on_workers(pod.fanout, plan)
            states = jobs.follow(pod.fanout, plan.run_id, workers, None)
            assert all(s.ok for s in states.values()), states
            for view, flags in VIEWS.items():
                for label, path in (("after", None), ("before", args.before)):
                    if label == "before" and not path:
                        continue
                    seconds, cpu, rss = measure(env, base, {"run": plan.run_id, **flags}, path,
                                                args.before_timeout if path else None)
                    rows.append((mb, view, label, seconds, cpu, rss))
                    wall = f"{seconds:6.2f} s" if seconds is not None else \
                        f"> {args.before_timeout:g} s (stopped)"
                    print(f"{len(workers)} x {mb} MB (differ {args.differ}), logs {view:<10} "
                          f"{label:<6}: {wall} wall, {cpu:6.2f} s CPU, {rss:7.1f} MiB RSS",
                          flush=True)
        pod.close()
        lifecycle.delete(settings, yes=True, console=quiet())
    finally:
        down(base / "sim")
        shutil.rmtree(base, ignore_errors=True)
    print()
    print(f"machine: {platform.node()} {os.cpu_count()} cores, {platform.python_version()}, "
          f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
