"""Fan-out benchmark: tpufab vs clush vs parallel-ssh vs a sequential ssh loop.

    sudo .venv/bin/python bench/fanout.py [--sizes 4,16,64] [--reps 5] [--json out.json]

Starts one plain sshd per worker on 127.57.0.{1..N}:2222 (each in its own mount namespace
with a private tmpfs /root, so no host dotfiles run), then measures, for every size:
cold fan-out of ``true`` (a fresh process each time, so new connections), warm fan-out
(connections open; tpufab in-process, and OpenSSH ControlMaster through clush), and
streaming (every worker prints 100,000 lines; zero loss and per-worker order verified).
Prints a markdown table; all sshds are stopped at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SUBNET = "127.57.0"  # plain sshds; the simulated pod picks a free 127.19.x subnet
PORT = 2222
LINES = 100_000
ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable


def host(i: int) -> str:
    return f"{SUBNET}.{i + 1}"


def _ssh_configs(pod) -> None:
    """OpenSSH client configs for clush/pssh/ssh: as a user gets them, and with curve25519."""
    pod.ssh_config = pod.root / "ssh_config"
    pod.ssh_config.write_text(
        f"Host *\n  User {pod.user}\n  Port {pod.port}\n  IdentityFile {pod.root}/client\n"
        "  IdentitiesOnly yes\n  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n"
        "  BatchMode yes\n  LogLevel ERROR\n"
    )
    # Same, with the kex paramiko negotiates (OpenSSH 9's default sntrup761 hybrid costs
    # tens of ms of CPU per handshake on both ends).
    pod.ssh_config_fast = pod.root / "ssh_config_curve25519"
    pod.ssh_config_fast.write_text(pod.ssh_config.read_text() + "  KexAlgorithms curve25519-sha256\n")
    (pod.root / "pod.json").write_text(json.dumps(
        {"hosts": pod.hosts, "user": pod.user, "port": pod.port, "node_id": pod.node_id}))


class SimPod:
    """``count`` simulated workers (tpufab.sim.workers): sshd in its own PID/mount/UTS namespace."""

    kind = "simulated pod workers (tpufab.sim.workers.WorkerPool)"

    def __init__(self, root: Path, count: int):
        from tpufab.sim.workers import WorkerPool, WorkerSpec

        self.root, self.user, self.port, self.node_id = root, "tpu", 22, "4200000000000000042"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(root / "client")],
                       check=True)
        subnet = next((f"127.19.{third}" for third in range(200, 256)
                       if not any(_listening(f"127.19.{third}.{i}", 22) for i in (1, 2, count))), None)
        if subnet is None:
            raise SystemExit("no free 127.19.x subnet for the simulated workers")
        self.hosts = [f"{subnet}.{i + 1}" for i in range(count)]
        self.subnet = subnet
        self.pool = WorkerPool(root / "sim-state")
        specs = [WorkerSpec(self.node_id, i, ip, f"t1v-n-{self.node_id[:8]}-w-{i}",
                            ("/dev/accel0", "/dev/accel1", "/dev/accel2", "/dev/accel3"))
                 for i, ip in enumerate(self.hosts)]
        self.pool.start_node(self.node_id, specs, f"{self.user}:{(root / 'client.pub').read_text()}")
        self.pool.wait_listening(self.node_id, timeout=120)
        (root / "host_keys.json").write_text(json.dumps(self.pool.host_keys(self.node_id)))
        _ssh_configs(self)

    def stop(self) -> None:
        self.pool.delete_node(self.node_id)


class Sshds:
    """``count`` plain sshds on 127.57.0.{1..N}:2222, each with a private tmpfs /root."""

    kind = "plain sshds (one per worker, private tmpfs /root)"

    def __init__(self, root: Path, count: int):
        self.root = root
        self.user, self.port, self.node_id = "root", PORT, "bench"
        self.hosts = [host(i) for i in range(count)]
        self.procs: list[subprocess.Popen] = []
        keygen = ["ssh-keygen", "-q", "-t", "ed25519", "-N", ""]
        subprocess.run([*keygen, "-f", str(root / "client")], check=True)
        subprocess.run([*keygen, "-f", str(root / "hostkey")], check=True)
        (root / "authorized_keys").write_text((root / "client.pub").read_text())
        Path("/run/sshd").mkdir(exist_ok=True)
        config = root / "sshd_config"
        config.write_text(
            f"HostKey {root}/hostkey\nPidFile none\nUsePAM no\nPermitRootLogin prohibit-password\n"
            f"AuthorizedKeysFile {root}/authorized_keys\nStrictModes no\nPasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\nUseDNS no\nPrintMotd no\nPrintLastLog no\n"
            "MaxStartups 1000:30:1000\nMaxSessions 1000\nLogLevel ERROR\n"
        )
        for i in range(count):
            script = (f"mount -t tmpfs tmpfs /root && exec /usr/sbin/sshd -D -f {config} "
                      f"-o ListenAddress={host(i)}:{PORT}")
            self.procs.append(subprocess.Popen(
                ["unshare", "-m", "--propagation", "private", "sh", "-c", script],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            ))
        deadline = time.monotonic() + 30
        for i in range(count):
            while not _listening(host(i)):
                if time.monotonic() > deadline:
                    raise SystemExit(f"sshd on {host(i)} did not start")
                time.sleep(0.02)
        _ssh_configs(self)

    def stop(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


def _listening(address: str, port: int = PORT) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.2)
        return sock.connect_ex((address, port)) == 0


CLIENT_CPU: dict[str, list[float]] = {}


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (usage.ru_utime + usage.ru_stime) * 1e3


def timed(argv, cpu_key: str | None = None, **kwargs) -> float:
    """Wall ms of one run; with ``cpu_key``, also record the CPU of the client side (the
    process and every child it waited for: clush's and pssh's ssh processes included)."""
    cpu = _children_cpu()
    start = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **kwargs)
    elapsed = (time.perf_counter() - start) * 1e3
    if cpu_key:
        CLIENT_CPU.setdefault(cpu_key, []).append(_children_cpu() - cpu)
    return elapsed


def median(values) -> float:
    return statistics.median(values)


# --------------------------------------------------------------------------------------------
# tpufab drivers (run in a fresh interpreter for cold numbers)
# --------------------------------------------------------------------------------------------


def _fanout(root: Path, count: int, **kwargs):
    from tpufab.fanout import Fanout, Target
    from tpufab.hostkeys import KnownHosts, alias

    pod = json.loads((root / "pod.json").read_text())
    known = KnownHosts(root / "known_hosts")
    keys = root / "host_keys.json"
    if keys.exists():  # pinned up front, as from the API's guest attributes
        known.pin(pod["node_id"], {int(w): k for w, k in json.loads(keys.read_text()).items()})
    targets = [Target(i, pod["hosts"][i], pod["user"], str(root / "client"), pod["port"],
                      alias(pod["node_id"], i)) for i in range(count)]
    return Fanout(targets, known_hosts=known, **kwargs)


def driver_cold(root: Path, count: int) -> None:
    start = time.perf_counter()
    with _fanout(root, count) as fan:
        result = fan.run("true")
    elapsed = (time.perf_counter() - start) * 1e3
    print(json.dumps({"inproc_ms": elapsed, "ok": result.ok, "summary": result.summary()}))


def driver_warm(root: Path, count: int, reps: int) -> None:
    with _fanout(root, count) as fan:
        fan.run("true").check()
        fan.run("true").check()
        shell, argv = [], []
        for _ in range(reps):
            start = time.perf_counter()
            fan.run("true").check()
            shell.append((time.perf_counter() - start) * 1e3)
            start = time.perf_counter()
            fan.run(["true"]).check()
            argv.append((time.perf_counter() - start) * 1e3)
    print(json.dumps({"shell_ms": median(shell), "argv_ms": median(argv)}))


def driver_stream(root: Path, count: int, out_path: str) -> None:
    from tpufab.fanout import LiveView

    with _fanout(root, count) as fan:
        fan.run("true").check()
        with open(out_path, "wb") as out:
            view = LiveView(out, out, color=False, workers=fan.workers)
            start = time.perf_counter()
            result = fan.run(f"seq {LINES}", sink=view)
            elapsed = time.perf_counter() - start
        result.check()
    print(json.dumps({"seconds": elapsed}))


def verify_stream(path: str, count: int) -> int:
    """Lines lost or out of order across all workers (0 = every line, in order, attributed)."""
    expected = {w: 1 for w in range(count)}
    bad = 0
    pattern = re.compile(rb"^w(\d+) +\xe2\x94\x82 (\d+)$")
    with open(path, "rb") as fh:
        for line in fh:
            match = pattern.match(line.rstrip(b"\n"))
            if not match:
                bad += 1
                continue
            worker, value = int(match.group(1)), int(match.group(2))
            if expected.get(worker) != value:
                bad += 1
            expected[worker] = value + 1
    return bad + sum(abs(LINES + 1 - nxt) for nxt in expected.values())


def run_driver(*args) -> dict:
    out = subprocess.run([PYTHON, __file__, *map(str, args)], capture_output=True,
                         text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if out.returncode:
        raise SystemExit(f"driver {args[0]} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------------------------
# Measurements
# --------------------------------------------------------------------------------------------


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    import paramiko

    return {
        "nproc": os.cpu_count(),
        "memory": subprocess.run(["free", "-h"], capture_output=True, text=True).stdout.splitlines()[1].split()[1],
        "cpu": cpu,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "paramiko": paramiko.__version__,
        "openssh": subprocess.run(["ssh", "-V"], capture_output=True, text=True).stderr.strip(),
        "clush": subprocess.run(["clush", "--version"], capture_output=True, text=True).stdout.strip(),
        "pssh": "parallel-ssh " + subprocess.run(["parallel-ssh", "--version"], capture_output=True,
                                                 text=True).stdout.strip(),
    }


def bench_size(sshds, count: int, reps: int) -> dict:
    root = sshds.root
    hosts = sshds.hosts[:count]
    hosts_file = root / f"hosts{count}"
    hosts_file.write_text("".join(f"{h}\n" for h in hosts))
    nodes = ",".join(hosts)
    row: dict = {"workers": count}

    row["loadavg_before"] = os.getloadavg()[0]
    cold_wall, cold_inproc = [], []
    for _ in range(reps):
        start = time.perf_counter()
        cpu = _children_cpu()
        result = run_driver("_cold", root, count)
        CLIENT_CPU.setdefault(f"tpufab{count}", []).append(_children_cpu() - cpu)
        cold_wall.append((time.perf_counter() - start) * 1e3)
        cold_inproc.append(result["inproc_ms"])
        if not result["ok"]:
            row.setdefault("tpufab_cold_failures", []).append(result["summary"])
            print(f"cold fan-out to {count} had failures: {result['summary']}", file=sys.stderr)
    row["tpufab_cold_ms"] = median(cold_wall)
    row["tpufab_cold_inproc_ms"] = median(cold_inproc)

    for name, config in (("", sshds.ssh_config), ("_curve25519", sshds.ssh_config_fast)):
        clush = ["clush", "-f", "64", "-w", nodes, "-o", f"-F {config}", "-b", "true"]
        pssh = ["parallel-ssh", "-h", str(hosts_file), "-p", "64", "-x", f"-F {config}", "true"]
        row[f"clush{name}_cold_ms"] = median(timed(clush, f"clush{name}{count}") for _ in range(reps))
        row[f"pssh{name}_cold_ms"] = median(timed(pssh, f"pssh{name}{count}") for _ in range(reps))
    for tool in ("tpufab", "clush", "pssh", "clush_curve25519", "pssh_curve25519"):
        row[f"{tool}_client_cpu_ms"] = median(CLIENT_CPU[f"{tool}{count}"])

    loop = "for h in " + " ".join(hosts) + f"; do ssh -F {sshds.ssh_config} $h true; done"
    row["ssh_loop_cold_ms"] = median(timed(["sh", "-c", loop]) for _ in range(max(1, min(reps, 3))))

    warm = run_driver("_warm", root, count, 20)
    row["tpufab_warm_ms"] = warm["shell_ms"]
    row["tpufab_warm_argv_ms"] = warm["argv_ms"]

    # OpenSSH ControlMaster (connections kept open by master processes), driven by clush.
    control = root / f"cm{count}"
    control.mkdir(exist_ok=True)
    cm_opts = f"-F {sshds.ssh_config} -o ControlPath={control}/%h -o ControlMaster=no"
    masters = [subprocess.Popen(["ssh", "-F", str(sshds.ssh_config), "-o", f"ControlPath={control}/%h",
                                 "-o", "ControlMaster=yes", "-N", h]) for h in hosts]
    try:
        deadline = time.monotonic() + 60
        while len(list(control.iterdir())) < count and time.monotonic() < deadline:
            time.sleep(0.05)
        # clush reads -o through configparser: a literal % is written %%.
        clush_cm = ["clush", "-f", "64", "-w", nodes, "-o", cm_opts.replace("%", "%%"), "-b", "true"]
        row["clush_controlmaster_warm_ms"] = median(timed(clush_cm) for _ in range(reps))

        # Streaming: raw ssh (through the masters, so warm like tpufab) as the reference rate.
        raw = []
        for _ in range(max(1, min(reps, 3))):
            start = time.perf_counter()
            procs = [subprocess.Popen(["ssh", *cm_opts.split(), h, f"seq {LINES}"],
                                      stdout=subprocess.PIPE) for h in hosts]
            lines = sum(p.communicate()[0].count(b"\n") for p in procs)
            raw.append(time.perf_counter() - start)
            assert lines == LINES * count, lines
        row["raw_ssh_lines_per_s"] = LINES * count / median(raw)
    finally:
        for proc in masters:
            proc.terminate()
        for proc in masters:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)

    rates, lost = [], 0
    for _ in range(max(1, min(reps, 3))):
        with tempfile.NamedTemporaryFile(dir=root, suffix=".out", delete=False) as tmp:
            path = tmp.name
        seconds = run_driver("_stream", root, count, path)["seconds"]
        lost += verify_stream(path, count)
        os.unlink(path)
        rates.append(LINES * count / seconds)
    row["tpufab_lines_per_s"] = median(rates)
    row["tpufab_stream_lost"] = lost
    row["loadavg_after"] = os.getloadavg()[0]
    return row


def import_cost(reps: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    base = median(timed([PYTHON, "-c", "pass"], env=env) for _ in range(reps * 2))
    fan = median(timed([PYTHON, "-c", "import tpufab.fanout"], env=env) for _ in range(reps * 2))
    full = median(timed([PYTHON, "-c", "import tpufab.fanout, fabric, paramiko"], env=env)
                  for _ in range(reps * 2))
    return {"python_ms": base, "import_fanout_ms": fan, "import_with_fabric_ms": full}


def table(rows: list[dict]) -> str:
    cols = [
        ("workers", "workers", "{:d}"),
        ("tpufab_cold_ms", "tpufab cold (process)", "{:.0f}"),
        ("tpufab_cold_inproc_ms", "tpufab cold (in-process)", "{:.0f}"),
        ("clush_cold_ms", "clush cold", "{:.0f}"),
        ("pssh_cold_ms", "pssh cold", "{:.0f}"),
        ("clush_curve25519_cold_ms", "clush cold, curve25519", "{:.0f}"),
        ("pssh_curve25519_cold_ms", "pssh cold, curve25519", "{:.0f}"),
        ("ssh_loop_cold_ms", "ssh loop cold", "{:.0f}"),
        ("tpufab_client_cpu_ms", "tpufab cold, client CPU", "{:.0f}"),
        ("clush_client_cpu_ms", "clush cold, client CPU", "{:.0f}"),
        ("pssh_client_cpu_ms", "pssh cold, client CPU", "{:.0f}"),
        ("clush_curve25519_client_cpu_ms", "clush curve25519, client CPU", "{:.0f}"),
        ("pssh_curve25519_client_cpu_ms", "pssh curve25519, client CPU", "{:.0f}"),
        ("tpufab_warm_ms", "tpufab warm (shell)", "{:.1f}"),
        ("tpufab_warm_argv_ms", "tpufab warm (argv)", "{:.1f}"),
        ("clush_controlmaster_warm_ms", "clush + ControlMaster warm", "{:.0f}"),
        ("tpufab_lines_per_s", "tpufab lines/s", "{:,.0f}"),
        ("raw_ssh_lines_per_s", "raw ssh lines/s", "{:,.0f}"),
        ("tpufab_stream_lost", "lost/misordered", "{:d}"),
        ("loadavg_before", "load average before", "{:.1f}"),
        ("loadavg_after", "load average after", "{:.1f}"),
    ]
    out = ["| metric | " + " | ".join(str(r["workers"]) for r in rows) + " |",
           "|---|" + "---:|" * len(rows)]
    for key, title, fmt in cols[1:]:
        out.append(f"| {title} | " + " | ".join(fmt.format(r[key]) for r in rows) + " |")
    return "\n".join(out)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1].startswith("_"):
        mode, root, count, *rest = sys.argv[1:]
        {"_cold": driver_cold, "_warm": lambda r, c, n: driver_warm(r, c, int(n)),
         "_stream": driver_stream}[mode](Path(root), int(count), *rest)
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4,16,64")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", help="also write the raw numbers here")
    parser.add_argument("--pod", choices=["sim", "plain"], default="sim",
                        help="simulated pod workers (default) or plain sshds")
    args = parser.parse_args()
    for tool in ("clush", "parallel-ssh", "ssh", "unshare"):
        if not shutil.which(tool):
            raise SystemExit(f"{tool} is not installed (apt-get install clustershell pssh openssh-client)")
    sizes = [int(s) for s in args.sizes.split(",")]
    with tempfile.TemporaryDirectory(prefix="tpufab-bench-") as tmp:
        sshds = (SimPod if args.pod == "sim" else Sshds)(Path(tmp), max(sizes))
        try:
            rows = [bench_size(sshds, n, args.reps) for n in sizes]
        finally:
            sshds.stop()
    report = {"machine": machine(), "workers": sshds.kind, "imports": import_cost(args.reps),
              "rows": rows}
    print(f"workers: {sshds.kind}")
    print(json.dumps(report["machine"], indent=1))
    print(json.dumps(report["imports"], indent=1))
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
