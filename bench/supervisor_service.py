"""The supervisor service's own cost per held job: its RSS and CPU with 1, 10 and 50 jobs held
(issue 38's target: RSS <= 150 MB with 50 jobs).

The service runs as the VM runs it (`python -m tpufab.flows.supervisor serve`, a process of
its own) against the simulated Cloud Storage (in this process). Its jobs name a secret it is
never handed, so each one is taken (its lease, its ownership written), held (its thread, its
lease renewed every ttl/3) and waits: what the service carries per job besides babysit's SSH
connections to the job's pod, which this does not measure (docs/benchmarks.md says so).

    .venv/bin/python bench/supervisor_service.py --jobs 1,10,50 --hold 30
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(count: int, hold: float, ttl: float) -> dict:
    from tpufab.cloud.storage import Storage
    from tpufab.flows.supervisor import state as st
    from tpufab.sim.storage import StorageEmulator

    with StorageEmulator() as gcs, tempfile.TemporaryDirectory() as tmp:
        bucket = f"bench-{count}"
        gcs.create_bucket(bucket)
        records = st.Records(Storage(gcs.url), bucket)
        jobs = []
        for i in range(count):
            spec = st.JobSpec(job=f"job-20261202-0100{i // 60:02d}-{i:04x}"[:24],
                              pod=st.PodRef(f"pod-{i}", "us-central2-b"), recipe="train.sh",
                              code=st.Code.of("0" * 40, bundle="b"), secrets=("HF_TOKEN",))
            records.create(spec)
            jobs.append(spec.job)
        env = {k: v for k, v in os.environ.items() if not k.startswith("TPUFAB_")}
        env.update(TPUFAB_STORAGE_ENDPOINT=gcs.url, TPUFAB_PROJECT="bench",
                   TPUFAB_STATE_DIR=f"{tmp}/state", HOME=tmp)
        proc = subprocess.Popen(
            [sys.executable, "-m", "tpufab.flows.supervisor", "serve", "--bucket", bucket,
             "--name", "bench-sup", "--workdir", f"{tmp}/work", "--poll", "5",
             "--lease-ttl", str(ttl), "--lease-margin", str(ttl / 6),
             "--secrets-dir", f"{tmp}/secrets"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            start = time.monotonic()
            while True:
                found = records.store.read_json(bucket, st.heartbeat_name("bench-sup"))
                if found and len(found[0]["jobs"]) == count:
                    break
                if time.monotonic() - start > 120:
                    raise SystemExit(f"the service did not hold {count} jobs in 120 s")
                time.sleep(0.2)
            held_after = time.monotonic() - start
            cpu0, t0 = cpu_seconds(proc.pid), time.monotonic()
            peak = 0.0
            while time.monotonic() - t0 < hold:
                peak = max(peak, rss_mb(proc.pid))
                time.sleep(0.5)
            cpu = (cpu_seconds(proc.pid) - cpu0) / (time.monotonic() - t0)
            return {"jobs": count, "held_after_s": held_after, "rss_mb": peak,
                    "cpu_percent": 100 * cpu}
        finally:
            proc.terminate()
            proc.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", default="1,10,50")
    parser.add_argument("--hold", type=float, default=30.0,
                        help="seconds measured once every job is held")
    parser.add_argument("--ttl", type=float, default=60.0)
    args = parser.parse_args()
    print("| jobs held | all held after | peak RSS | CPU while holding |")
    print("|--:|--:|--:|--:|")
    for count in (int(n) for n in args.jobs.split(",")):
        row = run(count, args.hold, args.ttl)
        print(f"| {row['jobs']} | {row['held_after_s']:.1f} s | {row['rss_mb']:.0f} MB | "
              f"{row['cpu_percent']:.1f} % |", flush=True)


if __name__ == "__main__":
    main()
