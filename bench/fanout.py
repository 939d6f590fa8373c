"""Fan-out at scale: tpufab against pssh and clush (and candidate engines), one key exchange.

    sudo .venv/bin/python bench/fanout.py --sizes 64,256,1024 --reps 3 [--json out.json]
        [--candidates /path/to/python] [--baseline /path/to/older/src]

Starts the largest size's worth of simulated pod workers (tpufab.sim.workers.WorkerPool: a
real sshd per worker in its own PID/mount/UTS namespace, own home and host key; addresses
127.X.Y.Z beyond 254 per /24), then for each size, on the first N of them: a cold ``exec
true`` (a fresh client process each time, so new connections) by tpufab (its default
client processes, and forced to one), clush and pssh (``KexAlgorithms curve25519-sha256``,
the exchange tpufab negotiates, for all; connect timeouts of 60 s, so a busy machine
slows a run rather than failing it), optionally parallel-ssh's native libssh2 client
and asyncssh (``--candidates``: a Python that has them, e.g. a throwaway venv), ClusterShell's tree
mode (a few workers as gateways, authenticated through an ssh-agent forwarded from the
client; they reach N minus the gateways) and an older
tpufab (``--baseline``: a directory holding its ``tpufab`` package); then a warm ``true``
(connections open). Client CPU is user+system of the client process and every child it
waited for (shard processes, ssh processes), i.e. what stays on the laptop when the workers
are real machines; peak RSS is tpufab's own (its process plus its client processes). Records
the load average around each size and the versions. Prints a markdown table; every worker
is stopped at the end, whatever happens.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
WINDOW = 64   # connections at once, for every tool (clush -f, pssh -p, tpufab concurrency)


def address(second: int, i: int) -> str:
    """Worker ``i``'s loopback address: 250 per /24, as many /24s as needed."""
    return f"127.{second}.{i // 250}.{i % 250 + 1}"


def _listening(host: str, port: int = 22) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.2)
        return sock.connect_ex((host, port)) == 0


class SimPod:
    """``count`` simulated workers, started directly (no API emulator)."""

    def __init__(self, root: Path, count: int):
        from tpufab.sim.worker_files import WorkerSpec
        from tpufab.sim.workers import WorkerPool

        self.root, self.user, self.node_id = root, "tpu", "4200000000000000042"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(root / "client")],
                       check=True)
        second = next((s for s in range(60, 120)
                       if not any(_listening(address(s, i)) for i in (0, 1, count - 1))), None)
        if second is None:
            raise SystemExit("no free 127.X range for the simulated workers")
        self.hosts = [address(second, i) for i in range(count)]
        self.pool = WorkerPool(root / "sim-state")
        specs = [WorkerSpec(self.node_id, i, ip, f"t1v-n-{self.node_id[:8]}-w-{i}",
                            ("/dev/accel0", "/dev/accel1", "/dev/accel2", "/dev/accel3"))
                 for i, ip in enumerate(self.hosts)]
        self.started = time.perf_counter()
        try:
            self.pool.start_node(self.node_id, specs,
                                 f"{self.user}:{(root / 'client.pub').read_text()}")
            self.pool.wait_listening(self.node_id, timeout=60 + count * 0.5)
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.perf_counter() - self.started
        (root / "host_keys.json").write_text(json.dumps(self.pool.host_keys(self.node_id)))
        (root / "pod.json").write_text(json.dumps(
            {"hosts": self.hosts, "user": self.user, "node_id": self.node_id}))
        # OpenSSH clients (clush, pssh) with the kex paramiko negotiates: OpenSSH 9's default
        # sntrup761x25519 hybrid costs tens of ms of CPU per handshake on both ends.
        self.ssh_config = root / "ssh_config"
        self.ssh_config.write_text(
            f"Host *\n  User {self.user}\n  IdentityFile {root}/client\n  IdentitiesOnly yes\n"
            "  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n  BatchMode yes\n"
            "  LogLevel ERROR\n  KexAlgorithms curve25519-sha256\n")
        self.agent_env = self._agent()

    def _agent(self) -> dict | None:
        """An ssh-agent holding the client key, for clush's gateways (None: no ssh-agent)."""
        if not shutil.which("ssh-agent"):
            return None
        sock = self.root / "agent.sock"
        self.agent = subprocess.Popen(["ssh-agent", "-D", "-a", str(sock)],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        env = {**os.environ, "SSH_AUTH_SOCK": str(sock)}
        deadline = time.monotonic() + 10
        while subprocess.run(["ssh-add", "-q", str(self.root / "client")], env=env,
                             capture_output=True).returncode:
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)
        return env

    def stop(self) -> None:
        agent = getattr(self, "agent", None)
        if agent is not None:
            agent.terminate()
            agent.wait(10)
        self.pool.delete_node(self.node_id)


# --------------------------------------------------------------------------------------------
# Drivers: each runs in a fresh interpreter (cold = new connections) and prints one JSON line
# --------------------------------------------------------------------------------------------


def _pod(root: Path, count: int) -> dict:
    pod = json.loads((root / "pod.json").read_text())
    pod["hosts"] = pod["hosts"][:count]
    return pod


def _rss_mib() -> dict:
    me = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return {"rss_self_mib": me, "rss_child_max_mib": kids}


def _fanout(root: Path, count: int, **kwargs):
    from tpufab.ssh.fanout import Fanout
    from tpufab.ssh.hostkeys import KnownHosts, alias

    try:
        from tpufab.ssh.connections import Target
    except ImportError:   # an older tpufab (--compare, --baseline): Target beside Fanout
        from tpufab.ssh.fanout import Target

    pod = _pod(root, count)
    known = KnownHosts(root / f"known_hosts.{os.getpid()}")
    keys = json.loads((root / "host_keys.json").read_text())
    known.pin(pod["node_id"], {int(w): k for w, k in keys.items() if int(w) < count})
    targets = [Target(i, h, pod["user"], str(root / "client"), 22, alias(pod["node_id"], i))
               for i, h in enumerate(pod["hosts"])]
    try:
        return Fanout(targets, known_hosts=known, concurrency=WINDOW, connect_timeout=60, **kwargs)
    except TypeError:  # an older tpufab (--baseline): no client processes
        kwargs.pop("processes", None)
        return Fanout(targets, known_hosts=known, concurrency=WINDOW, connect_timeout=60, **kwargs)


def driver_cold(root: Path, count: int, processes: str, transport: str = "") -> None:
    start = time.perf_counter()
    options = {"ssh_transport": transport} if transport else {}  # an older tpufab has none
    fan = _fanout(root, count, processes=int(processes) or None, **options)
    with fan:
        try:
            result = fan.run("true", one_shot=True)   # what `tpufab exec true` does
        except TypeError:
            result = fan.run("true")                  # an older tpufab (--baseline)
    elapsed = (time.perf_counter() - start) * 1e3
    print(json.dumps({"inproc_ms": elapsed, "ok": result.ok, "summary": result.summary(),
                      "processes": getattr(fan, "processes", 1), **_rss_mib()}))


def driver_warm(root: Path, count: int, reps: str) -> None:
    with _fanout(root, count) as fan:
        fan.run("true").check()
        fan.run("true").check()
        shell, argv = [], []
        for _ in range(int(reps)):
            start = time.perf_counter()
            fan.run("true").check()
            shell.append((time.perf_counter() - start) * 1e3)
            start = time.perf_counter()
            fan.run(["true"]).check()
            argv.append((time.perf_counter() - start) * 1e3)
    print(json.dumps({"shell_ms": statistics.median(shell), "argv_ms": statistics.median(argv),
                      **_rss_mib()}))


def driver_pssh2(root: Path, count: int) -> None:
    """parallel-ssh's native client (libssh2, gevent): no host-key check by default."""
    from pssh.clients import ParallelSSHClient

    pod = _pod(root, count)
    client = ParallelSSHClient(pod["hosts"], user=pod["user"], pkey=str(root / "client"),
                               pool_size=WINDOW, num_retries=1)
    output = client.run_command("true")
    client.join(output)
    codes = [o.exit_code for o in output]
    print(json.dumps({"ok": all(c == 0 for c in codes), "summary": f"{codes.count(0)} ok"}))


def driver_asyncssh(root: Path, count: int) -> None:
    """asyncssh, curve25519, no host-key check (known_hosts=None)."""
    import asyncio

    import asyncssh

    pod = _pod(root, count)
    key = asyncssh.read_private_key(str(root / "client"))

    async def main():
        gate = asyncio.Semaphore(WINDOW)

        async def one(host):
            async with gate:
                async with asyncssh.connect(host, username=pod["user"], client_keys=[key],
                                            known_hosts=None, kex_algs=["curve25519-sha256"],
                                            agent_path=None) as conn:
                    return (await conn.run("true")).exit_status

        return await asyncio.gather(*(one(h) for h in pod["hosts"]), return_exceptions=True)

    codes = asyncio.run(main())
    print(json.dumps({"ok": all(c == 0 for c in codes), "summary": f"{codes.count(0)} ok"}))


DRIVERS = {"_cold": driver_cold, "_warm": driver_warm, "_pssh2": driver_pssh2,
           "_asyncssh": driver_asyncssh}


# --------------------------------------------------------------------------------------------
# Measuring
# --------------------------------------------------------------------------------------------


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (usage.ru_utime + usage.ru_stime) * 1e3


def measure(argv, env=None) -> tuple[float, float, dict | None]:
    """(wall ms, client CPU ms, the driver's JSON line or None) of one client run."""
    argv = [str(a) for a in argv]
    cpu = _children_cpu()
    start = time.perf_counter()
    out = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    wall = (time.perf_counter() - start) * 1e3
    used = _children_cpu() - cpu
    if out.returncode:
        raise RuntimeError(f"{argv[:3]} failed ({out.returncode}): {out.stderr[-1500:]}")
    lines = out.stdout.strip().splitlines()
    answer = None
    if lines and lines[-1].startswith("{"):
        answer = json.loads(lines[-1])
        if not answer.get("ok", True):
            raise RuntimeError(f"{argv[:3]} had failures: {answer.get('summary')}")
    return wall, used, answer


def repeat(name: str, argv, reps: int, row: dict, env=None) -> None:
    walls, cpus, answers = [], [], []
    for _ in range(reps):
        try:
            wall, cpu, answer = measure(argv, env)
        except (RuntimeError, subprocess.TimeoutExpired) as err:
            row.setdefault("errors", []).append(f"{name}: {err}")
            print(f"{name} at {row['workers']}: {err}", file=sys.stderr)
            return
        walls.append(wall)
        cpus.append(cpu)
        answers.append(answer or {})
    row[f"{name}_ms"] = statistics.median(walls)
    row[f"{name}_cpu_ms"] = statistics.median(cpus)
    if answers and "rss_self_mib" in answers[0]:
        processes = answers[0].get("processes", 1)
        # an upper bound: the parent's peak plus the largest child's peak per child
        row[f"{name}_rss_mib"] = max(a["rss_self_mib"] + (processes - 1) * a["rss_child_max_mib"]
                                     for a in answers)
        row[f"{name}_processes"] = processes


def bench_size(pod: SimPod, count: int, reps: int, args) -> dict:
    root = pod.root
    hosts = pod.hosts[:count]
    hosts_file = root / f"hosts{count}"
    hosts_file.write_text("".join(f"{h}\n" for h in hosts))
    row: dict = {"workers": count, "loadavg_before": os.getloadavg()[0]}
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    me = [PYTHON, str(Path(__file__).resolve())]
    repeat("tpufab", [*me, "_cold", root, count, 0], reps, row, env)
    repeat("tpufab_1proc", [*me, "_cold", root, count, 1], reps, row, env)
    repeat("tpufab_paramiko", [*me, "_cold", root, count, 0, "paramiko"], reps, row, env)
    if args.baseline:
        repeat("baseline", [*me, "_cold", root, count, 1], reps, row,
               {**os.environ, "PYTHONPATH": args.baseline})
    repeat("clush", ["clush", "-t", "60", "-f", str(WINDOW), "-w", ",".join(hosts), "-o",
                     f"-F {pod.ssh_config}", "-b", "true"], reps, row)
    repeat("pssh", ["parallel-ssh", "-t", "0", "-h", str(hosts_file), "-p", str(WINDOW), "-x",
                    f"-F {pod.ssh_config}", "true"], reps, row)
    if pod.agent_env is not None:
        # ClusterShell's tree mode: the client reaches a few gateway workers, each of them runs
        # `python3 -m ClusterShell.Gateway` and ssh to its share, authenticating through the
        # client's forwarded ssh-agent (the key itself never leaves the client).
        gateways = max(2, count // 128)
        leaves = hosts[gateways:]
        topology = root / f"topology{count}.conf"
        topology.write_text("[routes]\n" + f"{socket.gethostname()}: {','.join(hosts[:gateways])}\n"
                            + "".join(f"{gw}: {','.join(leaves[i::gateways])}\n"
                                      for i, gw in enumerate(hosts[:gateways])))
        options = (f"-o User={pod.user} -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null"
                   " -o BatchMode=yes -o LogLevel=ERROR -o KexAlgorithms=curve25519-sha256"
                   " -o ForwardAgent=yes")
        repeat("clush_tree", ["clush", "--topology", str(topology), "-t", "60", "-f", str(WINDOW), "-w",
                              ",".join(leaves), "-o", options, "-b", "true"], reps, row,
               {**pod.agent_env, "CLUSTERSHELL_GW_PYTHON_EXECUTABLE": "/usr/bin/python3"})
        row["clush_tree_gateways"] = gateways
    if args.candidates:
        repeat("pssh2", [args.candidates, *me[1:], "_pssh2", root, count], reps, row)
        repeat("asyncssh", [args.candidates, *me[1:], "_asyncssh", root, count], reps, row)
    try:
        _, _, warm = measure([*me, "_warm", root, count, 10], env)
        row["warm_shell_ms"], row["warm_argv_ms"] = warm["shell_ms"], warm["argv_ms"]
    except RuntimeError as err:
        row.setdefault("errors", []).append(f"warm: {err}")
    row["loadavg_after"] = os.getloadavg()[0]
    return row


def _ssh2_version() -> str:
    try:
        import ssh2
    except ImportError:
        return "missing"
    return ssh2.__version__


def versions() -> dict:
    def out(argv, stream="stdout"):
        try:
            done = subprocess.run(argv, capture_output=True, text=True)
            return getattr(done, stream).strip()
        except OSError:
            return "missing"

    import paramiko

    cpu = next((line.split(":", 1)[1].strip() for line in
                Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")),
               platform.processor())
    return {"nproc": os.cpu_count(), "cpu": cpu, "kernel": platform.release(),
            "memory": out(["free", "-h"]).splitlines()[1].split()[1],
            "python": platform.python_version(), "paramiko": paramiko.__version__,
            "ssh2-python": _ssh2_version(),
            "openssh": out(["ssh", "-V"], "stderr"), "clush": out(["clush", "--version"]),
            "pssh": "parallel-ssh " + out(["parallel-ssh", "--version"])}


ROWS = [
    ("tpufab_ms", "tpufab cold `exec true`, wall", "{:.0f}"),
    ("tpufab_cpu_ms", "tpufab cold, client CPU", "{:.0f}"),
    ("tpufab_processes", "tpufab client processes", "{:d}"),
    ("tpufab_rss_mib", "tpufab cold, client peak RSS (MiB)", "{:.0f}"),
    ("tpufab_1proc_ms", "tpufab cold, 1 process, wall", "{:.0f}"),
    ("tpufab_1proc_cpu_ms", "tpufab cold, 1 process, client CPU", "{:.0f}"),
    ("tpufab_paramiko_ms", "tpufab cold over paramiko (ssh_transport paramiko), wall", "{:.0f}"),
    ("tpufab_paramiko_cpu_ms", "tpufab cold over paramiko, client CPU", "{:.0f}"),
    ("baseline_ms", "tpufab before (agent on every worker), wall", "{:.0f}"),
    ("baseline_cpu_ms", "tpufab before, client CPU", "{:.0f}"),
    ("clush_ms", "clush, wall", "{:.0f}"),
    ("clush_cpu_ms", "clush, client CPU", "{:.0f}"),
    ("pssh_ms", "pssh, wall", "{:.0f}"),
    ("pssh_cpu_ms", "pssh, client CPU", "{:.0f}"),
    ("clush_tree_ms", "clush tree mode (gateway workers), wall", "{:.0f}"),
    ("clush_tree_cpu_ms", "clush tree mode, client CPU", "{:.0f}"),
    ("clush_tree_gateways", "clush tree mode, gateways", "{:d}"),
    ("pssh2_ms", "parallel-ssh native (libssh2), wall", "{:.0f}"),
    ("pssh2_cpu_ms", "parallel-ssh native, client CPU", "{:.0f}"),
    ("asyncssh_ms", "asyncssh, wall", "{:.0f}"),
    ("asyncssh_cpu_ms", "asyncssh, client CPU", "{:.0f}"),
    ("cpu_per_worker", "tpufab cold, client CPU per worker (ms)", "{:.2f}"),
    ("cpu_ratio", "tpufab / better of clush, pssh: client CPU", "{:.2f}x"),
    ("paramiko_cpu_ratio", "tpufab over paramiko / better of clush, pssh: client CPU", "{:.2f}x"),
    ("wall_ratio", "tpufab / better of clush, pssh: wall", "{:.2f}x"),
    ("warm_shell_ms", "tpufab warm `true` (shell)", "{:.1f}"),
    ("warm_argv_ms", "tpufab warm `[\"true\"]` (argv)", "{:.1f}"),
    ("loadavg_before", "load average before", "{:.1f}"),
    ("loadavg_after", "load average after", "{:.1f}"),
]


def table(rows: list[dict]) -> str:
    for row in rows:
        others = [row[k] for k in ("clush_cpu_ms", "pssh_cpu_ms") if k in row]
        if others and "tpufab_cpu_ms" in row:
            row["cpu_ratio"] = row["tpufab_cpu_ms"] / min(others)
        if others and "tpufab_paramiko_cpu_ms" in row:
            row["paramiko_cpu_ratio"] = row["tpufab_paramiko_cpu_ms"] / min(others)
        if "tpufab_cpu_ms" in row:
            row["cpu_per_worker"] = row["tpufab_cpu_ms"] / row["workers"]
        walls = [row[k] for k in ("clush_ms", "pssh_ms") if k in row]
        if walls and "tpufab_ms" in row:
            row["wall_ratio"] = row["tpufab_ms"] / min(walls)
    out = ["| metric (ms unless noted) | " + " | ".join(str(r["workers"]) for r in rows) + " |",
           "|---|" + "---:|" * len(rows)]
    for key, title, fmt in ROWS:
        if any(key in r for r in rows):
            out.append(f"| {title} | " + " | ".join(fmt.format(r[key]) if key in r else "-"
                                                    for r in rows) + " |")
    return "\n".join(out)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in DRIVERS:
        mode, root, count, *rest = sys.argv[1:]
        DRIVERS[mode](Path(root), int(count), *rest)
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64,256,1024")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", help="also write the raw numbers here")
    parser.add_argument("--candidates", help="a Python with parallel-ssh and asyncssh")
    parser.add_argument("--baseline", help="a directory holding an older tpufab package")
    args = parser.parse_args()
    for tool in ("clush", "parallel-ssh", "ssh"):
        if not shutil.which(tool):
            raise SystemExit(f"{tool} is not installed (apt-get install clustershell pssh "
                             "openssh-client)")
    sizes = sorted(int(s) for s in args.sizes.split(","))
    resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)
    rows = []
    with tempfile.TemporaryDirectory(prefix="tpufab-bench-") as tmp:
        pod = SimPod(Path(tmp), max(sizes))
        try:
            print(f"{max(sizes)} workers up in {pod.start_seconds:.1f} s", file=sys.stderr)
            for n in sizes:
                rows.append(bench_size(pod, n, args.reps, args))
                print(table(rows), file=sys.stderr)
        finally:
            pod.stop()
    report = {"machine": versions(), "rows": rows,
              "command": " ".join(["bench/fanout.py", *sys.argv[1:]])}
    print(json.dumps(report["machine"], indent=1))
    print(table(rows))
    for row in rows:
        for error in row.get("errors", []):
            print(f"- {row['workers']}: {error}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
