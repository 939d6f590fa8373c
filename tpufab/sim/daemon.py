"""`tpufab sim up|down|status`: the TPU API emulator, its workers and its Cloud Storage in the
background.

`serve()` runs them in the foreground until SIGTERM. `up()` starts `serve` detached (own
session, log in the state dir), waits for its health check and returns a `SimInfo`;
`down()` stops it; `status()` reports. The state dir keeps nodes across down/up.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.error import URLError
from urllib.request import ProxyHandler, build_opener

from tpufab.errors import SimError
from tpufab.sim._model import DEFAULT_PROJECT, DEFAULT_ZONE

DEFAULT_PORT = 8475
INFO_FILE = "daemon.json"
LOG_FILE = "daemon.log"
WORKERS_DIR = "workers"
STORAGE_DIR = "gcs"            # the Cloud Storage emulator's buckets and objects
REGISTRY_DIR = "registry"       # the Artifact Registry: docker-registry's data, port, push token
STORAGE_PORT_FILE = "port"     # in STORAGE_DIR: reused next time, so exports stay valid
_DIRECT = build_opener(ProxyHandler({}))  # loopback only: never through a proxy


@dataclass(frozen=True)
class SimInfo:
    """A running simulated pod: where its API answers and what to export."""

    endpoint: str                   # http://127.0.0.1:PORT
    pid: int
    state_dir: Path
    port: int
    project: str = DEFAULT_PROJECT  # any project and zone work; these are suggestions
    zone: str = DEFAULT_ZONE
    log_file: Path | None = None
    already_running: bool = False
    storage_endpoint: str | None = None  # http://127.0.0.1:PORT2, its Cloud Storage (JSON API)
    registry: str | None = None     # 127.0.0.1:PORT3, its Artifact Registry (tpufab.sim.registry)

    def env(self) -> dict[str, str]:
        """Environment that points tpufab at this pod (and at its Cloud Storage)."""
        from tpufab.sim.oslogin import DEFAULT_ACCOUNT

        env = {"TPUFAB_API_ENDPOINT": self.endpoint, "TPUFAB_PROJECT": self.project,
               "TPUFAB_ZONE": self.zone, "TPUFAB_OS_LOGIN_ACCOUNT": DEFAULT_ACCOUNT}
        if self.storage_endpoint:
            env["TPUFAB_STORAGE_ENDPOINT"] = self.storage_endpoint
        return env

    def exports(self) -> str:
        """`export K=V` lines for a shell."""
        return "\n".join(f"export {k}={shlex.quote(v)}" for k, v in self.env().items())

    def gcloud_env(self, config_dir: Path, home: Path) -> dict[str, str]:
        """Variables that point gcloud at this pod (config_dir and home: fresh temp dirs)."""
        return {
            "CLOUDSDK_CONFIG": str(config_dir),
            "HOME": str(home),
            "CLOUDSDK_CORE_PROJECT": self.project,
            "CLOUDSDK_COMPUTE_ZONE": self.zone,
            "CLOUDSDK_CORE_DISABLE_PROMPTS": "1",
            "CLOUDSDK_AUTH_DISABLE_CREDENTIALS": "true",
            "CLOUDSDK_CORE_CHECK_GCE_METADATA": "false",
            "CLOUDSDK_API_ENDPOINT_OVERRIDES_TPU": f"{self.endpoint}/",
            "CLOUDSDK_API_ENDPOINT_OVERRIDES_COMPUTE": f"{self.endpoint}/compute/v1/",
            "CLOUDSDK_API_ENDPOINT_OVERRIDES_OSLOGIN": f"{self.endpoint}/",
        }


@dataclass(frozen=True)
class SimStatus:
    running: bool
    state_dir: Path
    info: SimInfo | None
    nodes: list[dict[str, Any]] = field(default_factory=list)
    queued_resources: list[dict[str, Any]] = field(default_factory=list)


def default_state_dir() -> Path:
    return Path(os.environ.get("TPUFAB_SIM_DIR") or Path.home() / ".tpufab" / "sim")


def default_port() -> int:
    raw = os.environ.get("TPUFAB_SIM_PORT")
    if not raw:
        return DEFAULT_PORT
    try:
        return int(raw)
    except ValueError:
        raise SimError(f"TPUFAB_SIM_PORT={raw!r} is not a port number; set it to e.g. "
                       f"{DEFAULT_PORT}.") from None


def require_root() -> None:
    if os.geteuid() != 0:
        raise SimError(
            "The simulated pod needs root: each worker is an sshd in its own PID, mount and "
            "UTS namespace on a 127.x loopback address; run it as root (e.g. `sudo tpufab sim "
            "up`).")


# ---------------------------------------------------------------------- foreground


def serve(state_dir: Path | None = None, port: int | None = None, *, workers: bool = True,
          settings: dict[str, Any] | None = None) -> None:
    """Run the emulator and its workers in the foreground until SIGTERM or SIGINT."""
    from tpufab.sim.emulator import Emulator, SimSettings, make_server

    state_dir = Path(state_dir or default_state_dir()).resolve()
    port = default_port() if port is None else port
    if workers:
        require_root()
    state_dir.mkdir(parents=True, exist_ok=True)
    if workers:
        from tpufab.sim.capacity import raise_fd_limit
        from tpufab.sim.workers import WorkerPool

        raise_fd_limit()  # a metadata listener per worker: 1,536 of them for a v5p-12288

        # <state>/share is what scripts/sim-wheels.sh fills ($TPUFAB_SIM_DIR/share/site)
        pool: Any = WorkerPool(state_dir / WORKERS_DIR, share_dir=state_dir / "share")
    else:
        from tpufab.sim._fakepool import PaperWorkers

        pool = PaperWorkers()
    sim_settings = SimSettings()
    if settings:
        sim_settings.update(settings)
    emulator = Emulator(state_dir, pool, settings=sim_settings)
    if workers:  # each worker's metadata server, on its own address (port 80 needs root)
        from tpufab.sim.metadata import MetadataServer

        emulator.metadata = MetadataServer(emulator.guest)
    try:
        server = make_server(emulator, port)
    except OSError as exc:
        raise SimError(_port_busy_sentence(port, exc)) from None
    storage = _start_storage(state_dir / STORAGE_DIR)
    registry = None
    if workers:  # the pod's Artifact Registry; workers' registries.conf route pkg.dev to it
        from tpufab.sim.registry import start_registry

        registry = start_registry(state_dir / REGISTRY_DIR, emulator.tokens)
        emulator.registry = registry
        pool.registry = registry.address if registry else None
    actual_port = server.server_address[1]
    if workers:  # internal-IP nodes: a namespace each, the API and storage relayed into it
        from tpufab.sim.network import NodeNetworks

        emulator.network = NodeNetworks(pool, host_ports=[actual_port] + (
            [storage.port] if storage is not None else []))
    endpoint = f"http://127.0.0.1:{actual_port}"
    info_path = state_dir / INFO_FILE
    _write_json(info_path, {"pid": os.getpid(), "port": actual_port, "endpoint": endpoint,
                            "storageEndpoint": storage.url if storage else None,
                            "registry": registry.address if registry else None,
                            "stateDir": str(state_dir), "workers": workers,
                            "started": time.time()})

    def stop(signum: int, frame: Any) -> None:
        logging.getLogger("tpufab.sim").info("signal %d: shutting down", signum)
        threading.Thread(target=server.shutdown, daemon=True).start()

    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    logging.getLogger("tpufab.sim").info("serving %s (state %s)", endpoint, state_dir)
    try:
        emulator.resume()
        server.serve_forever(poll_interval=0.2)
    finally:
        server.server_close()
        if storage is not None:
            storage.stop()
        if registry is not None:
            registry.stop()
        emulator.shutdown()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        try:
            if json.loads(info_path.read_text()).get("pid") == os.getpid():
                info_path.unlink()
        except (OSError, ValueError):
            pass
        logging.getLogger("tpufab.sim").info("stopped")


def _start_storage(data_dir: Path) -> Any:
    """The pod's Cloud Storage on a free loopback port (the previous one if it is free), or
    None when the emulator package is missing (the TPU API and workers still run)."""
    from tpufab.sim.storage import StorageEmulator

    log = logging.getLogger("tpufab.sim")
    port_file = data_dir / STORAGE_PORT_FILE
    try:
        previous = int(port_file.read_text())
    except (OSError, ValueError):
        previous = 0
    try:
        try:
            storage = StorageEmulator(data_dir, port=previous)
        except OSError:  # the previous port is taken now
            storage = StorageEmulator(data_dir, port=0)
    except (SimError, OSError, ValueError) as exc:  # the TPU API and workers run regardless
        log.warning("no Cloud Storage (%s): %s", data_dir, exc)
        return None
    port_file.write_text(str(storage.port))
    storage.start()
    log.info("Cloud Storage at %s (buckets in %s)", storage.url, data_dir)
    return storage


# ---------------------------------------------------------------------- background


def up(state_dir: Path | None = None, port: int | None = None, *, timeout: float = 60.0,
       workers: bool = True) -> SimInfo:
    """Start the simulated pod in the background (or return the one already running)."""
    if workers:
        require_root()
    state_dir = Path(state_dir or default_state_dir()).resolve()
    port = default_port() if port is None else port
    deadline = time.monotonic() + timeout
    running = _running(state_dir)
    if running is not None:
        while time.monotonic() < deadline:  # its workers may still be coming back
            health = _health(running.endpoint)
            if health is None or health.get("resuming", 0) == 0:
                break
            time.sleep(0.05)
        return running
    state_dir.mkdir(parents=True, exist_ok=True)
    if port:
        _check_port_free(port)
    log_path = state_dir / LOG_FILE
    argv = [sys.executable, "-m", "tpufab.sim.daemon", "serve", "--state-dir", str(state_dir),
            "--port", str(port)]
    if not workers:
        argv.append("--no-workers")
    env = dict(os.environ)
    package_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    with open(log_path, "ab") as log:
        log.write(f"--- tpufab sim up {time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode())
        log.flush()
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                start_new_session=True, close_fds=True, cwd="/", env=env)
    while time.monotonic() < deadline:
        code = proc.poll()
        if code is not None:
            raise SimError(f"The simulated pod exited during start-up (exit code {code}): "
                           f"{_last_log_line(log_path)} (full log: {log_path}).")
        info = _read_info(state_dir)
        if info and info.get("pid") == proc.pid:
            health = _health(info["endpoint"])
            if health and health.get("resuming", 0) == 0:
                return _info(state_dir, info)
        time.sleep(0.05)
    proc.terminate()
    raise SimError(f"The simulated pod did not answer within {timeout:.0f} s; see {log_path}.")


def down(state_dir: Path | None = None, *, timeout: float = 30.0) -> str:
    """Stop the simulated pod and its workers; nodes stay in the state dir. Returns a sentence."""
    state_dir = Path(state_dir or default_state_dir()).resolve()
    info = _read_info(state_dir)
    if info is None:
        return f"The simulated pod is not running (state dir {state_dir})."
    pid = int(info.get("pid") or 0)
    if not _is_daemon(pid):
        (state_dir / INFO_FILE).unlink(missing_ok=True)
        _stop_orphan_workers(state_dir)
        return (f"The simulated pod is not running (state dir {state_dir}); removed a stale "
                "pid file.")
    os.kill(pid, signal.SIGTERM)
    if _wait_gone(pid, timeout):
        return f"Stopped the simulated pod (pid {pid}); its nodes are kept in {state_dir}."
    os.kill(pid, signal.SIGKILL)
    _wait_gone(pid, 5.0)
    (state_dir / INFO_FILE).unlink(missing_ok=True)
    _stop_orphan_workers(state_dir)
    return (f"The simulated pod (pid {pid}) did not stop within {timeout:.0f} s and was "
            f"killed; its workers were stopped. Nodes are kept in {state_dir}.")


def status(state_dir: Path | None = None) -> SimStatus:
    """Whether the pod runs, where, and its nodes (read from the state file when down)."""
    state_dir = Path(state_dir or default_state_dir()).resolve()
    running = _running(state_dir)
    if running is not None:
        try:
            state = _get_json(f"{running.endpoint}/sim/v1/state")
            return SimStatus(True, state_dir, running, state.get("nodes", []),
                             state.get("queuedResources", []))
        except (OSError, ValueError):
            pass
    nodes, qrs = [], []
    state_file = state_dir / "api-state.json"
    if state_file.exists():
        try:
            state = json.loads(state_file.read_text())
            nodes = [{"name": n, "id": r["node"]["id"], "state": r["node"]["state"],
                      "acceleratorType": r["node"]["acceleratorType"]}
                     for n, r in state.get("nodes", {}).items()]
            qrs = [{"name": n, "state": r["qr"]["state"]["state"]}
                   for n, r in state.get("queuedResources", {}).items()]
        except (OSError, ValueError, KeyError):
            pass
    return SimStatus(running is not None, state_dir, running, nodes, qrs)


# ---------------------------------------------------------------------- helpers


def _info(state_dir: Path, raw: dict[str, Any], *, already: bool = False) -> SimInfo:
    return SimInfo(endpoint=raw["endpoint"], pid=int(raw["pid"]), state_dir=state_dir,
                   port=int(raw["port"]), log_file=state_dir / LOG_FILE,
                   already_running=already, storage_endpoint=raw.get("storageEndpoint"),
                   registry=raw.get("registry"))


def _running(state_dir: Path) -> SimInfo | None:
    raw = _read_info(state_dir)
    if raw and _is_daemon(int(raw.get("pid") or 0)) and _health(raw["endpoint"]):
        return _info(state_dir, raw, already=True)
    return None


def _read_info(state_dir: Path) -> dict[str, Any] | None:
    try:
        raw = json.loads((state_dir / INFO_FILE).read_text())
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) and raw.get("endpoint") else None


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def _get_json(url: str, timeout: float = 2.0) -> dict[str, Any]:
    with _DIRECT.open(url, timeout=timeout) as resp:
        return json.loads(resp.read())


def _health(endpoint: str) -> dict[str, Any] | None:
    try:
        health = _get_json(f"{endpoint}/sim/v1/health")
    except (OSError, ValueError, URLError):
        return None
    return health if health.get("ok") else None


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.waitpid(pid, os.WNOHANG)  # reap it if it is our own child
    except ChildProcessError:
        pass
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def _is_daemon(pid: int) -> bool:
    if not _alive(pid):
        return False
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"tpufab.sim.daemon" in cmdline and b"serve" in cmdline


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return not _alive(pid)


def _check_port_free(port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # As the server binds: connections of the last run in TIME_WAIT do not count, a
        # listener does (without this, `sim down; sim up` failed for a minute after traffic).
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError as exc:
            other = _health(f"http://127.0.0.1:{port}")
            if other:
                raise SimError(
                    f"Port {port} on 127.0.0.1 is used by another simulated pod (state dir "
                    f"{other.get('stateDir')}); stop it with `TPUFAB_SIM_DIR="
                    f"{other.get('stateDir')} tpufab sim down` or pick another port with "
                    "TPUFAB_SIM_PORT=PORT (or --port).") from None
            raise SimError(_port_busy_sentence(port, exc)) from None


def _port_busy_sentence(port: int, exc: OSError) -> str:
    return (f"Port {port} on 127.0.0.1 is not available ({exc.strerror or exc}); stop what "
            "uses it or pick another port with TPUFAB_SIM_PORT=PORT (or --port).")


def _last_log_line(log_path: Path) -> str:
    try:
        lines = [ln for ln in log_path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "no log"
    return lines[-1].strip() if lines else "no log output"


def _stop_orphan_workers(state_dir: Path) -> None:
    """Workers left by a daemon that died without cleaning up."""
    if not (state_dir / WORKERS_DIR).exists() or os.geteuid() != 0:
        return
    try:
        from tpufab.sim.workers import WorkerPool

        WorkerPool(state_dir / WORKERS_DIR).stop_all()
    except Exception as exc:  # best effort: report, do not fail `down`
        logging.getLogger("tpufab.sim").warning("could not stop leftover workers: %s", exc)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tpufab.sim.daemon")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("serve", help="run the simulated pod in the foreground")
    run.add_argument("--state-dir", type=Path, default=None)
    run.add_argument("--port", type=int, default=None)
    run.add_argument("--no-workers", action="store_true",
                     help="emulate the API only (no sshd workers, no root needed)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        serve(args.state_dir, args.port, workers=not args.no_workers)
    except SimError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
