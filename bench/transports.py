"""Cold handshakes: paramiko (tpufab's Fanout) against libssh2 and asyncssh, same guarantees.

    sudo .venv/bin/python bench/transports.py [--sizes 64,256] [--reps 3] [--profile]
        [--only libssh2] [--compare SRC]

Needs ``asyncssh`` in the same Python (measurement only; ``ssh2-python`` is a tpufab
dependency since issue 28), except with ``--only`` naming rows without it (``--only
libssh2``: tpufab's fan-out over libssh2 beside a bare libssh2 loop). Starts the largest size's worth of simulated workers (bench/fanout.py's
SimPod: a real sshd per worker), then for each size, a fresh interpreter per run (new
connections) doing ``exec true`` on every worker, 64 handshakes in flight, each with:

- ``curve25519-sha256`` key exchange (forced for libssh2 and asyncssh; paramiko negotiates it);
- the worker's host key pinned: compared with the ed25519 key the API published, a mismatch
  fails that worker (paramiko: tpufab's KnownHosts; libssh2: ``Session.hostkey()`` against
  the pin before authenticating; asyncssh: a known_hosts of the pins);
- the client's ed25519 key, no agent.

``paramiko`` is tpufab's own Fanout over paramiko (``ssh_transport paramiko``) in one
process (``fanout_processes 1``) and with its automatic processes; ``libssh2 (tpufab's
default)`` is tpufab's Fanout as it runs by default since issue 28 (tpufab.ssh.transport);
``libssh2`` is ssh2-python's blocking Session on a thread per
connection (it releases the GIL during its C calls), as paramiko's; ``asyncssh`` one event
loop. Client CPU is user + system of the run's process and its children (getrusage), wall
the run's, peak RSS the process's own (its children's largest for tpufab's auto mode).
``--compare SRC``: tpufab's libssh2 row again with the tpufab of another source tree (a git
worktree of an earlier commit, first on PYTHONPATH), in the same rounds: an A/B of a change.
``--profile``: cProfile of paramiko's 64-worker run in one process, its top functions by own
time (what a handshake costs there).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fanout import WINDOW, SimPod, _pod, _rss_mib, driver_cold, measure  # noqa: E402


def _pins(root: Path, count: int) -> tuple[dict, list[str]]:
    pod = _pod(root, count)
    keys = json.loads((root / "host_keys.json").read_text())
    return pod, [keys[str(i)] for i in range(count)]


def driver_libssh2(root: Path, count: int) -> None:
    """ssh2-python (libssh2): a thread per connection, at most WINDOW handshakes at once."""
    import base64
    import socket

    from ssh2.session import LIBSSH2_METHOD_KEX, Session

    pod, pins = _pins(root, count)
    gate = threading.BoundedSemaphore(WINDOW)
    codes: list[object] = [None] * count

    def one(i: int, host: str) -> None:
        try:
            with gate:
                sock = socket.create_connection((host, 22), timeout=60)
                session = Session()
                session.method_pref(LIBSSH2_METHOD_KEX, "curve25519-sha256")
                session.handshake(sock)
                key, _kind = session.hostkey()
                if key != base64.b64decode(pins[i].split()[1]):
                    raise RuntimeError(f"{host}: host key does not match the pinned one")
                session.userauth_publickey_fromfile(pod["user"], str(root / "client"))
            channel = session.open_session()
            channel.execute("true")
            channel.wait_eof()
            channel.close()
            channel.wait_closed()
            codes[i] = channel.get_exit_status()
            session.disconnect()
            sock.close()
        except Exception as err:  # noqa: BLE001 - the worker's result
            codes[i] = repr(err)

    threads = [threading.Thread(target=one, args=(i, h)) for i, h in enumerate(pod["hosts"])]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    failed = [c for c in codes if c != 0]
    print(json.dumps({"ok": not failed, "summary": f"{count - len(failed)} ok {failed[:2]}",
                      **_rss_mib()}))


def driver_asyncssh(root: Path, count: int) -> None:
    """asyncssh on one event loop, host keys pinned through a known_hosts of the pins."""
    import asyncio

    import asyncssh

    pod, pins = _pins(root, count)
    key = asyncssh.read_private_key(str(root / "client"))

    async def main():
        gate = asyncio.Semaphore(WINDOW)

        async def one(i: int, host: str):
            known = asyncssh.import_known_hosts(f"{host} {pins[i]}\n")
            async with gate:
                conn = await asyncssh.connect(host, username=pod["user"], client_keys=[key],
                                              known_hosts=known, kex_algs=["curve25519-sha256"],
                                              agent_path=None, connect_timeout=60)
            async with conn:
                return (await conn.run("true")).exit_status

        return await asyncio.gather(*(one(i, h) for i, h in enumerate(pod["hosts"])),
                                    return_exceptions=True)

    codes = asyncio.run(main())
    failed = [repr(c) for c in codes if c != 0]
    print(json.dumps({"ok": not failed, "summary": f"{count - len(failed)} ok {failed[:2]}",
                      **_rss_mib()}))


def driver_profile(root: Path, count: int) -> None:
    """paramiko's cold run in one process, every thread under cProfile (paramiko does its
    key exchange in each Transport's own thread), imports done first: own time by function
    and by file."""
    import cProfile
    import pstats

    import paramiko  # noqa: F401 - imported before measuring

    import tpufab.ssh.fanout  # noqa: F401
    import tpufab.ssh.hostkeys  # noqa: F401

    profiles: list[cProfile.Profile] = []
    lock = threading.Lock()
    plain = threading.Thread._bootstrap_inner  # runs run(), also paramiko's Transport.run

    def profiled(self) -> None:
        profile = cProfile.Profile(time.thread_time)  # CPU, not waiting
        with lock:
            profiles.append(profile)
        profile.runcall(plain, self)

    threading.Thread._bootstrap_inner = profiled
    main = cProfile.Profile(time.thread_time)
    profiles.append(main)
    main.runcall(driver_cold, root, count, "1", "paramiko")
    threading.Thread._bootstrap_inner = plain
    stats = pstats.Stats(profiles[0])
    for profile in profiles[1:]:
        with contextlib.suppress(TypeError):  # a thread still running has no stats
            stats.add(profile)
    waits = ("acquire", "wait", "select", "poll", "sleep", "recv", "join")
    own = {key: v[2] for key, v in stats.stats.items()
           if not any(w in key[2] for w in waits)}  # blocked, not spending CPU
    total = sum(own.values())
    by_file: dict[str, float] = {}
    for (path, _line, name), t in own.items():
        where = path if path != "~" else name.split("'")[1] if "'" in name else name
        by_file[Path(where).name if "/" in where else where] = \
            by_file.get(Path(where).name if "/" in where else where, 0.0) + t
    print(f"# {count} workers: {total * 1e3:.0f} ms own time outside waits "
          f"({total * 1e3 / count:.2f} ms per worker)", file=sys.stderr)
    print("# by file or builtin:", file=sys.stderr)
    for where, t in sorted(by_file.items(), key=lambda kv: kv[1], reverse=True)[:15]:
        print(f"{t * 1e3:8.1f} ms  {where}", file=sys.stderr)
    print("# by function:", file=sys.stderr)
    for (path, line, name), t in sorted(own.items(), key=lambda kv: kv[1], reverse=True)[:20]:
        print(f"{t * 1e3:8.1f} ms  {Path(path).name}:{line}({name})", file=sys.stderr)


def driver_fastmac(root: Path, count: int) -> None:
    """tpufab's Fanout (1 process) with paramiko's per-packet MAC check in C: its
    ``util.constant_time_bytes_eq`` (a Python loop over the MAC's bytes) replaced by
    ``hmac.compare_digest`` (also constant time)."""
    import hmac

    import paramiko.util

    paramiko.util.constant_time_bytes_eq = hmac.compare_digest
    driver_cold(root, count, "1", "paramiko")


def driver_gcm(root: Path, count: int) -> None:
    """As ``driver_fastmac``, and AES-GCM preferred (an AEAD cipher: no separate HMAC)."""
    import paramiko

    paramiko.Transport._preferred_ciphers = (
        "aes128-gcm@openssh.com", *(c for c in paramiko.Transport._preferred_ciphers
                                    if c != "aes128-gcm@openssh.com"))
    driver_fastmac(root, count)


DRIVERS = {"_libssh2": driver_libssh2, "_asyncssh": driver_asyncssh,
           "_profile": driver_profile, "_fastmac": driver_fastmac, "_gcm": driver_gcm}


def runs(root: Path, count: int, reps: int, only: str = "",
         compare: Path | None = None) -> dict[str, dict]:
    """{transport: {wall_ms, cpu_ms, rss_mib}} medians of ``reps`` fresh runs (round robin);
    ``only``: the rows whose name contains it; ``compare``: tpufab's libssh2 row again with
    that source tree's tpufab (first on PYTHONPATH), in the same rounds."""
    me = [sys.executable, str(Path(__file__).resolve())]
    fan = [sys.executable, str(Path(__file__).resolve().parent / "fanout.py")]
    argvs = {"paramiko (tpufab, 1 process)": [*fan, "_cold", root, count, "1", "paramiko"],
             "paramiko (tpufab, auto)": [*fan, "_cold", root, count, "0", "paramiko"],
             "libssh2 (tpufab's default, 1 process)": [*fan, "_cold", root, count, "1",
                                                       "libssh2"],
             "libssh2 (ssh2-python)": [*me, "_libssh2", root, count],
             "asyncssh": [*me, "_asyncssh", root, count],
             "paramiko, MAC compare in C (tpufab, 1 process)": [*me, "_fastmac", root, count],
             "paramiko, MAC in C + AES-GCM (tpufab, 1 process)": [*me, "_gcm", root, count]}
    argvs = {name: argv for name, argv in argvs.items() if only in name}
    envs = {}
    if compare is not None:
        name = f"libssh2 (tpufab's default, 1 process) (compare: {compare})"
        argvs[name] = argvs.get("libssh2 (tpufab's default, 1 process)") or \
            [*fan, "_cold", root, count, "1", "libssh2"]
        envs[name] = {**os.environ, "PYTHONPATH": str(compare)}
    samples: dict[str, list[tuple[float, float, float]]] = {k: [] for k in argvs}
    for _ in range(reps):
        for name, argv in argvs.items():
            wall, cpu, answer = measure(argv, envs.get(name))
            answer = answer or {}
            rss = answer.get("rss_self_mib", 0.0) + (answer.get("processes", 1) - 1) * \
                answer.get("rss_child_max_mib", 0.0)
            samples[name].append((wall, cpu, rss))
            print(f"{count} {name}: {wall:.0f} ms wall, {cpu:.0f} ms CPU, {rss:.0f} MiB",
                  flush=True)
    return {name: {"wall_ms": statistics.median(s[0] for s in rows),
                   "cpu_ms": statistics.median(s[1] for s in rows),
                   "rss_mib": max(s[2] for s in rows)} for name, rows in samples.items()}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in DRIVERS:
        DRIVERS[sys.argv[1]](Path(sys.argv[2]), int(sys.argv[3]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="64,256")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--only", default="", help="only the rows whose name contains this, "
                        "e.g. libssh2: tpufab's fan-out and a bare libssh2 loop")
    parser.add_argument("--compare", type=Path, help="another tpufab source tree (a git "
                        "worktree of an earlier commit): its libssh2 row in the same rounds")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    root = Path(tempfile.mkdtemp(prefix="bench-transports-"))
    pod = SimPod(root, max(sizes))
    results = {}
    try:
        for count in sizes:
            load = os.getloadavg()[0]
            results[count] = runs(root, count, args.reps, args.only, args.compare)
            results[count]["load"] = (load, os.getloadavg()[0])
        if args.profile:
            import subprocess

            out = subprocess.run([sys.executable, __file__, "_profile", root, str(min(sizes))],
                                 capture_output=True, text=True, timeout=900)
            print(out.stderr)
    finally:
        pod.stop()
    print(f"\nmachine: {os.cpu_count()} cores; medians of {args.reps} runs each")
    print("| transport | workers | wall ms | client CPU ms | CPU per worker ms | peak RSS MiB |")
    print("|---|--:|--:|--:|--:|--:|")
    for count, rows in results.items():
        load = rows.pop("load")
        for name, r in rows.items():
            print(f"| {name} | {count:,} | {r['wall_ms']:.0f} | {r['cpu_ms']:.0f} | "
                  f"{r['cpu_ms'] / count:.2f} | {r['rss_mib']:.0f} |")
        print(f"| (load average {load[0]:.1f} -> {load[1]:.1f}) | {count:,} | | | | |")


if __name__ == "__main__":
    main()
