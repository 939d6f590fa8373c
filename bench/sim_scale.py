"""What a big simulated node costs: start-up time, memory per worker, the emulator's share.

    sudo .venv/bin/python bench/sim_scale.py [--type v4-2048 --type v5p-8192 ...] [--sessions 16]

For each accelerator type, one at a time: starts a simulated pod in a temporary state dir,
creates the node through the official google-cloud-tpu client (as users do) and times it until
READY, then sums PSS (``/proc/PID/smaps_rollup``) over every process of every worker (its PID 1,
its sshd, and the process that holds its namespaces), reads the emulator daemon's PSS, threads
and open files before and after, opens ``--sessions`` ssh sessions (to as many workers) to
measure what a logged-in session adds, times a stop and a start (restart with disks kept),
and tears everything down. Prints one Markdown row per type.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import tempfile
import time
from pathlib import Path

DEFAULT_TYPES = ("v4-2048", "v5p-8192", "v5p-12288")  # 256, 1,024 and 1,536 workers


def kib(pid: int, field: str = "Pss:") -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rpartition(")")[2].split()[1])


def threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def worker_pids(pool, node_id: str, hosts: int) -> tuple[list[int], list[int]]:
    """(processes inside the workers, their parents outside: one per worker where an
    `unshare` holds each namespace, or the one spawner that forked them all)."""
    inside, parents = [], set()
    for w in range(hosts):
        pids = pool.pids(node_id, w)
        if pids:
            inside += pids
            parents.add(ppid(pids[0]))
    return inside, sorted(parents)


def measure(type_name: str, sessions: int) -> dict[str, object]:
    from google.api_core.client_options import ClientOptions
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import tpu_v2

    from tpufab.sim.daemon import WORKERS_DIR, down, up
    from tpufab.sim.workers import WorkerPool

    base = Path(tempfile.mkdtemp(prefix="bench-sim-scale-"))
    key = base / "key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    row: dict[str, object] = {"type": type_name}
    info = up(base / "state", port=0)
    opened: list[subprocess.Popen] = []
    try:
        client = tpu_v2.TpuClient(credentials=AnonymousCredentials(), transport="rest",
                                  client_options=ClientOptions(api_endpoint=info.endpoint))
        parent = f"projects/{info.project}/locations/{info.zone}"
        name = f"{parent}/nodes/bench"
        daemon_before = (kib(info.pid), threads(info.pid), fds(info.pid))
        load = os.getloadavg()[0]
        start = time.monotonic()
        node = client.create_node(
            parent=parent, node_id="bench",
            node=tpu_v2.Node(accelerator_type=type_name, runtime_version="v2-alpha-tpuv5",
                             metadata={"ssh-keys": f"alice:{key.with_suffix('.pub').read_text()}"})
        ).result(timeout=1800)
        row["create s"] = time.monotonic() - start
        hosts = len(node.network_endpoints)
        row["workers"] = hosts
        row["load"] = load
        pool = WorkerPool(base / "state" / WORKERS_DIR)
        inside, holders = worker_pids(pool, str(node.id), hosts)
        pss_inside = sum(kib(p) for p in inside) / 1024
        pss_holders = sum(kib(p) for p in holders) / 1024
        row["processes"] = len(inside) + len(holders)
        row["worker PSS MiB"] = pss_inside + pss_holders
        row["per worker MiB"] = (pss_inside + pss_holders) / hosts
        after = (kib(info.pid), threads(info.pid), fds(info.pid))
        row["emulator MiB"] = (after[0] - daemon_before[0]) / 1024
        row["emulator KiB/worker"] = (after[0] - daemon_before[0]) / hosts
        row["emulator threads"] = f"{daemon_before[1]}->{after[1]}"
        row["emulator fds"] = f"{daemon_before[2]}->{after[2]}"
        if sessions:
            ips = [e.ip_address for e in node.network_endpoints[:sessions]]
            before = {p for p in os.listdir("/proc") if p.isdigit()}
            for ip in ips:
                opened.append(subprocess.Popen(
                    ["ssh", "-i", str(key), "-o", "BatchMode=yes", "-o",
                     "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null", "-o",
                     "LogLevel=ERROR", f"alice@{ip}", "echo up; exec sleep 600"],
                    stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True))
            for proc in opened:
                proc.stdout.readline()  # the session is up on the worker
            inside_now, _ = worker_pids(pool, str(node.id), hosts)
            new = [p for p in inside_now if str(p) not in before]
            row["session MiB"] = sum(kib(p) for p in new) / 1024 / len(ips)
            for proc in opened:
                proc.terminate()
                proc.wait(timeout=30)
            opened.clear()
        start = time.monotonic()
        client.stop_node(request={"name": name}).result(timeout=600)
        row["stop s"] = time.monotonic() - start
        start = time.monotonic()
        client.start_node(request={"name": name}).result(timeout=1800)
        row["restart s"] = time.monotonic() - start
        start = time.monotonic()
        client.delete_node(name=name).result(timeout=600)
        row["delete s"] = time.monotonic() - start
    finally:
        for proc in opened:
            proc.kill()
        down(base / "state", timeout=120)
        subprocess.run(["rm", "-rf", str(base)], check=False)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--type", action="append", dest="types")
    parser.add_argument("--sessions", type=int, default=16)
    args = parser.parse_args()
    rows = []
    for type_name in args.types or DEFAULT_TYPES:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        row = measure(type_name, args.sessions)
        rows.append(row)
        print({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()},
              flush=True)
        del before
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for row in rows:
        print("| " + " | ".join(f"{row.get(k, ''):.2f}" if isinstance(row.get(k), float)
                                else str(row.get(k, "")) for k in keys) + " |")


if __name__ == "__main__":
    main()
