"""`tpufab babysit --remote` through the real supervisor VM on a simulated pod of its own:

- **cold**: a project with no supervisor: the command makes the VM (e2-small unless
  ``--machine-type``), installs the laptop's own tpufab on it from its wheel (and its
  dependencies from the package index) and hands the job over;
- **warm**: the same, the supervisor VM up with this tpufab (``--warm`` times);
- **preemption to relaunch**: the pod under the job's first attempt preempted; the time to
  the relaunched attempt planned, its run started on the recreated pod, and its first
  output line in the bucket (what `tpufab jobs logs` shows; the service uploads a worker's
  output every 2 s), beside the pod's own create time measured here on its own.

Each command's wall time and the client's CPU (user + system of the `tpufab` process and its
children) are printed side by side. The simulated pod is its own (``TPUFAB_SIM_DIR``-style
state dir under /tmp, a free port) and is stopped at the end. Needs root.

    .venv/bin/python bench/supervisor_handover.py --warm 3
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TPUFAB = str(Path(sys.executable).with_name("tpufab"))
RECIPE = """#!/bin/sh
echo "attempt $TPUFAB_RESTART_COUNT of $JOB_TAG"
if [ "$HOLD" = 1 ] && [ "$TPUFAB_RESTART_COUNT" = 0 ]; then sleep 900; fi
echo "done $JOB_TAG"
"""


def git(cwd: Path, *args: str) -> None:
    env = {"GIT_AUTHOR_NAME": "b", "GIT_AUTHOR_EMAIL": "b@b", "GIT_COMMITTER_NAME": "b",
           "GIT_COMMITTER_EMAIL": "b@b", "PATH": "/usr/bin:/bin", "HOME": str(cwd)}
    subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True)


def timed(argv: list[str], env: dict, cwd: Path, timeout: float = 900) -> tuple[float, float,
                                                                                 str, str]:
    """(wall s, client CPU s, stdout, stderr) of one command."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    proc = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)
    wall = time.monotonic() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({proc.returncode}):\n{proc.stderr}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, proc.stdout, proc.stderr


def wait(condition, timeout: float, what: str, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--machine-type", default="e2-small")
    parser.add_argument("--warm", type=int, default=3, help="warm hand-overs measured")
    args = parser.parse_args()

    from tpufab.cloud import lifecycle
    from tpufab.cloud.storage import Storage, chunks
    from tpufab.config import load_settings
    from tpufab.flows.supervisor import state as st
    from tpufab.flows.supervisor import vm
    from tpufab.sim.admin import SimAdmin
    from tpufab.sim.daemon import down, up

    tmp = Path(tempfile.mkdtemp(prefix="bench-handover-", dir="/tmp"))
    info = up(tmp / "sim", port=0, timeout=120)
    rows: list[tuple[str, float, float | None]] = []
    settings = None
    try:
        home = tmp / "home"
        home.mkdir()
        env = {k: v for k, v in os.environ.items() if not k.startswith("TPUFAB_")}
        env.update(info.env(), HOME=str(home), TPUFAB_USER_CONFIG=str(home / "none.yaml"),
                   TPUFAB_SSH_KEY=str(home / "tpufab_ed25519"),
                   TPUFAB_KNOWN_HOSTS=str(home / "known_hosts"),
                   TPUFAB_STATE_DIR=str(home / "state"), TPUFAB_KEEP_ALIVE="0",
                   TPUFAB_NAME="bench-pod", TPUFAB_TYPE="v4-8",
                   TPUFAB_SUPERVISOR_BUCKET="bench-handover",
                   TPUFAB_SUPERVISOR_MACHINE_TYPE=args.machine_type)
        settings = load_settings({}, env=env, cwd=home)
        start = time.monotonic()
        lifecycle.create(settings)
        create_s = time.monotonic() - start
        rows.append(("the pod's own create (v4-8, for reference)", create_s, None))
        repo = home / "model"
        repo.mkdir()
        git(repo, "init", "-q", "-b", "main")
        (repo / "train.sh").write_text(RECIPE)
        (repo / "train.sh").chmod(0o755)
        git(repo, "add", ".")
        git(repo, "commit", "-q", "-m", "bench")
        records = st.Records(Storage(info.storage_endpoint), "bench-handover")

        def hand_over(tag: str, hold: str) -> tuple[float, float, str]:
            wall, cpu, out, _ = timed([TPUFAB, "babysit", "train.sh", "--remote", "--env",
                                       f"JOB_TAG={tag}", "--env", f"HOLD={hold}"], env, repo)
            return wall, cpu, out.strip().splitlines()[-1]

        wall, cpu, job = hand_over("cold", "1")
        rows.append((f"babysit --remote, cold (VM {args.machine_type} made, tpufab "
                     "installed)", wall, cpu))
        install = records.store.read_json("bench-handover",
                                          vm.install_record_name(settings.supervisor_name))
        steps = install[0].get("seconds") if install else None

        def line_in(number: int, text: str) -> bool:
            data = b"".join(d for _, d in chunks(records.store, records.bucket,
                                                 st.logs_prefix(job, number, 0)))
            return text.encode() in data

        wait(lambda: line_in(1, "attempt 0 of cold"), 300, "attempt 1's first line")
        admin = SimAdmin.from_info(info)
        preempted = time.monotonic()
        admin.preempt("bench-pod")
        wait(lambda: len(records.state(job)[0].attempts) == 2, 300, "attempt 2 planned")
        planned = time.monotonic() - preempted
        wait(lambda: records.state(job)[0].attempts[-1].phase != "planned", 300,
             "attempt 2 started")
        started = time.monotonic() - preempted
        wait(lambda: line_in(2, "attempt 1 of cold"), 300, "attempt 2's first line")
        first_line = time.monotonic() - preempted
        rows.append(("preemption -> relaunched attempt planned", planned, None))
        rows.append(("preemption -> its run started (pod recreated, code deployed)",
                     started, None))
        rows.append(("preemption -> its first output line in the bucket", first_line, None))
        wait(lambda: records.state(job)[0].terminal, 120, "the job to finish")

        for i in range(args.warm):
            wall, cpu, warm_job = hand_over(f"warm{i}", "0")
            rows.append((f"babysit --remote, warm #{i + 1}", wall, cpu))
            wait(lambda j=warm_job: records.state(j)[0].terminal, 180, "the warm job to end")
        print(f"machine: {os.cpu_count()} cores, load average "
              f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}; VM install steps (s): "
              f"{json.dumps(steps)}")
        print("| what | wall | client CPU |")
        print("|---|--:|--:|")
        for what, wall, cpu in rows:
            print(f"| {what} | {wall:.1f} s | {'' if cpu is None else f'{cpu:.2f} s'} |")
    finally:
        if settings is not None:
            try:
                vm.down(settings, force=True)
                lifecycle.delete(settings, yes=True)
            except Exception as err:  # noqa: BLE001 - the pod goes down below anyway
                print(f"cleanup: {err}", file=sys.stderr)
        down(tmp / "sim")
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
