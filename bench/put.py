"""Benchmark: put a 100 MiB file to 1 and to 16 simulated workers; tpufab vs pscp vs scp.

    sudo .venv/bin/python bench/put.py [--sizes 1,16] [--mib 100] [--reps 3]

Workers are simulated pod workers (tests/test_deploy.SimPod: a real sshd per worker in its
own namespaces, private /root and /tmp). Every run starts from nothing on the workers (the
file is removed first, so tpufab's skip-identical never helps it) and opens new
connections: each tool runs in a fresh process. Same key exchange and cipher for all:
OpenSSH is forced to what paramiko negotiates here (printed). Measures wall time and client
CPU (user+system of the process and every child it waited for: ssh/scp included).
Prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from test_deploy import SimPod  # noqa: E402 - the same simulated workers the tests use

DRIVER = r"""
import sys, json
from tpufab.ssh.connections import Target
from tpufab.ssh.fanout import Fanout
from tpufab.ssh.hostkeys import KnownHosts, alias
from tpufab.ssh import transfer
spec = json.loads(sys.argv[1])
known = KnownHosts(spec["known_hosts"])
targets = [Target(i, h, "root", spec["key"], 22, alias(spec["node"], i))
           for i, h in enumerate(spec["hosts"])]
with Fanout(targets, known_hosts=known) as fan:
    peers = dict(enumerate(spec["hosts"])) if spec["relay"] else None
    report = transfer.put(fan, spec["local"], "/tmp/", peers=peers).check()
    link = fan.links[0].conn.transport
    print(json.dumps({"lines": report.lines(), "kex": link.kex_engine.__class__.__name__,
                      "cipher": link.local_cipher, "mac": link.local_mac}))
"""


def child_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed(argv: list[str], **kwargs) -> tuple[float, float, str]:
    cpu0, t0 = child_cpu(), time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, **kwargs)
    wall, cpu = time.perf_counter() - t0, child_cpu() - cpu0
    if done.returncode != 0:
        raise SystemExit(f"{argv[0]} failed ({done.returncode}): {done.stdout}{done.stderr}")
    return wall, cpu, done.stdout


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="1,16")
    parser.add_argument("--mib", type=int, default=100)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    root = Path(tempfile.mkdtemp(prefix="tpufab-bench-put-"))
    local = root / "payload.bin"
    with open(local, "wb") as fh:
        for _ in range(args.mib):
            fh.write(os.urandom(1 << 20))
    pod = SimPod(root, max(sizes), "7501", 65)
    try:
        from tpufab.ssh.hostkeys import KnownHosts

        known = root / "known_hosts"
        KnownHosts(known).pin(pod.node_id, pod.pool.host_keys(pod.node_id))
        hosts = [t.host for t in sorted(pod.fanout.targets.values(), key=lambda t: t.worker)]
        config = root / "ssh_config"
        # paramiko 3+/4+ with OpenSSH 9.2 negotiates curve25519-sha256, aes128-ctr and
        # hmac-sha2-256 (checked by the driver below); OpenSSH is held to the same.
        config.write_text(f"Host *\n  User root\n  IdentityFile {root}/client\n"
                          "  IdentitiesOnly yes\n  StrictHostKeyChecking no\n"
                          "  UserKnownHostsFile /dev/null\n  BatchMode yes\n  LogLevel ERROR\n"
                          "  KexAlgorithms curve25519-sha256\n  Ciphers aes128-ctr\n"
                          "  MACs hmac-sha2-256\n")
        rows = []
        negotiated = None
        for n in sizes:
            chosen = hosts[:n]
            hosts_file = root / f"hosts{n}"
            hosts_file.write_text("\n".join(chosen) + "\n")

            def clean(n=n):
                for w in range(n):
                    pod.sh(w, "rm -f /tmp/payload.bin /tmp/.payload.bin.*")

            def check(n=n):
                want = pod.sh(0, "sha256sum /tmp/payload.bin").split()[0]
                for w in range(n):
                    assert pod.sh(w, "sha256sum /tmp/payload.bin").split()[0] == want

            loop = ("for h in " + " ".join(chosen) +
                    f"; do scp -q -F {config} {local} $h:/tmp/ || exit 1; done")
            tools = {
                "tpufab put (relay)": [sys.executable, "-c", DRIVER, _spec(
                    root, pod, chosen, local, relay=True)],
                "tpufab put (SFTP to each)": [sys.executable, "-c", DRIVER, _spec(
                    root, pod, chosen, local, relay=False)],
                "pscp": ["parallel-scp", "-h", str(hosts_file), "-p", "32", "-x",
                         f"-F {config}", str(local), "/tmp/payload.bin"],
                "scp loop": ["sh", "-c", loop],
            }
            for name, argv in tools.items():
                walls, cpus = [], []
                reps = args.reps if not (name == "scp loop" and n > 4) else max(1, args.reps - 1)
                for _ in range(reps):
                    clean()
                    load = os.getloadavg()[0]
                    wall, cpu, out = timed(argv)
                    check()
                    walls.append(wall)
                    cpus.append(cpu)
                    if name.startswith("tpufab") and negotiated is None:
                        negotiated = out.strip().splitlines()[-1]
                rows.append((n, name, statistics.median(walls), statistics.median(cpus), load))
                print(f"{n:>3} {name:<28} wall {statistics.median(walls):6.2f} s  client CPU "
                      f"{statistics.median(cpus):6.2f} s  (load {load:.1f})", flush=True)
        print()
        print(f"machine: {platform.node()} nproc {os.cpu_count()}, {platform.platform()}, "
              f"python {platform.python_version()}")
        print(f"tpufab negotiated: {negotiated}")
        print()
        print("| workers | tool | wall (s) | client CPU (s) | load before |")
        print("|---:|---|---:|---:|---:|")
        for n, name, wall, cpu, load in rows:
            print(f"| {n} | {name} | {wall:.2f} | {cpu:.2f} | {load:.1f} |")
    finally:
        pod.close()
        shutil.rmtree(root, ignore_errors=True)   # the payload and the workers' copies


def _spec(root: Path, pod, hosts, local: Path, *, relay: bool) -> str:
    import json

    return json.dumps({"known_hosts": str(root / "known_hosts"), "key": str(root / "client"),
                       "node": pod.node_id, "hosts": hosts, "local": str(local),
                       "relay": relay})


if __name__ == "__main__":
    main()
