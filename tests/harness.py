"""The simulated-pod harness: the few shapes of simulated TPU pod the tests use, with their
differences as parameters (fixtures that hold them live in conftest.py or in the test module,
module-scoped so each module pays for its pod once).

- `sim_node(sim, tmp_path_factory, prefix, type, **settings)`: a READY node created through
  the simulated TPU API (the `sim` fixture), with a user's settings and shell environment
  pointing at it; what verbs and the Python API see. ``type`` picks the size (v4-8 = 1 worker,
  v4-16 = 2, v4-32 = 4); settings overrides pick the rest (``ssh_user``, ``project``,
  ``no_os_login``, ``jump``, ...).
- `connected_pod(sim, tmp_path_factory, prefix, ...)`: ``sim_node``'s sibling for the job
  tests: a node, a connected `tpufab.hosts.connect` pod and the environment naming it;
  optionally the workers' Python packages (``site="jax"`` or ``"torch"``) and
  scripts/setup-sim.sh run on every worker.
- `SimPod(root, count, node_id, octet, user=, accelerators=)`: bare workers without the
  TPU API (no root daemon): a WorkerPool node of ``count`` real sshd workers and a Fanout to
  them with host keys pinned; for the workflow tests below the verbs (deploy, mount,
  transfer) and the fan-out itself.

Every shape needs root (namespaces, sshd): a fixture holding one is decorated with
`needs_root` (below `@pytest.fixture`), and every test using it, or the `sim` fixture, carries
``pytest.mark.sim``; conftest.py fails collection otherwise.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

from helpers import (
    NOT_ROOT,
    REPO,
    build_shared_site,
    cli_env,
    quiet_console,
    sim_settings,
    unique_name,
)


def needs_root(fixture):
    """Mark a fixture function as one that starts simulated workers (root): a test using it
    must carry ``pytest.mark.sim`` (conftest.py checks at collection), and it skips, with the
    reason, unless root."""
    import functools
    import inspect

    import pytest

    def check() -> None:
        if os.geteuid() != 0:
            pytest.skip(NOT_ROOT)

    if inspect.isgeneratorfunction(fixture):
        @functools.wraps(fixture)
        def wrapper(*args, **kwargs):
            check()
            yield from fixture(*args, **kwargs)
    else:
        @functools.wraps(fixture)
        def wrapper(*args, **kwargs):
            check()
            return fixture(*args, **kwargs)
    wrapper.needs_root = True
    return wrapper


@contextlib.contextmanager
def sim_node(sim, tmp_path_factory, prefix: str, type: str = "v4-16",
             **overrides) -> Iterator[SimpleNamespace]:
    """A READY node on the simulated pod for one module: ``settings``, ``node``, ``home``
    (the user's), ``name``, ``env`` (a user's shell pointing at it); deleted afterwards."""
    from tpufab.cloud import lifecycle
    from tpufab.hosts import connect as pods

    home = tmp_path_factory.mktemp(f"{prefix}-home")
    name = unique_name(prefix)
    settings = sim_settings(sim, home, name=name, type=type, **overrides)
    [node] = lifecycle.create(settings, console=quiet_console())
    env = cli_env(sim, home, name)
    if "ssh_user" in overrides:
        env["TPUFAB_SSH_USER"] = overrides["ssh_user"]
    try:
        yield SimpleNamespace(sim=sim, settings=settings, node=node, home=home, name=name,
                              env=env)
    finally:
        pods.forget(settings)
        lifecycle.delete(settings, yes=True, console=quiet_console())


ACCEL = tuple(f"/dev/accel{i}" for i in range(4))
USER = "tpufab"  # the login user: not root, passwordless sudo (google-sudoers)


def listening(host: str, port: int = 22) -> bool:
    import socket

    with socket.socket() as sock:
        sock.settimeout(0.2)
        return sock.connect_ex((host, port)) == 0


def free_subnet() -> str:
    """A 127.19.x loopback /24 where nothing listens yet (other pods may run on this host)."""
    for third in range(200, 256):
        subnet = f"127.19.{third}"
        if not any(listening(f"{subnet}.{i}") for i in (1, 2, 3, 4, 5, 6)):
            return subnet
    raise RuntimeError("no free 127.19.x subnet for the test workers")


class SimPod:
    """``count`` simulated workers of one node (own /home, /tmp, /dev, PID and mount
    namespaces; ``accelerators`` as their TPU devices) on 127.<octet>.<pid-based>.N (or, without
    ``octet``, the first free 127.19.x subnet), accepting a client key (``key``) for ``user``
    (default: an ordinary user with sudo, as on a real TPU VM). ``fanout``: a Fanout to them
    with host keys pinned (``connect=False``: none; build one from ``targets()``)."""

    def __init__(self, root: Path, count: int, node_id: str, octet: int | None = None, *,
                 user: str = USER, accelerators: tuple[str, ...] = ACCEL, connect: bool = True):
        from tpufab.sim.workers import WorkerPool
        from tpufab.ssh.fanout import Fanout
        from tpufab.ssh.hostkeys import KnownHosts

        self.root = root
        self.node_id = node_id
        self.user = user
        self.home = "/root" if user == "root" else f"/home/{user}"
        self.accelerators = accelerators
        self.pool = WorkerPool(root / "state")
        self.key = root / "client"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.key)],
                       check=True)
        self.subnet = f"127.{octet}.{20 + os.getpid() % 200}" if octet else free_subnet()
        self.nodes: list[str] = []
        self.fanout = None
        try:
            self.specs = self.start(node_id, count)
            if connect:
                known = KnownHosts(root / "known_hosts")
                known.pin(node_id, self.pool.host_keys(node_id))
                self.fanout = Fanout(self.targets(), known_hosts=known)
        except BaseException:
            self.pool.stop_all()
            raise
        self.commands: list[str] = []

    def start(self, node_id: str, count: int, first: int = 0):
        """Start ``count`` workers of node ``node_id`` at addresses ``first + 1``, ...;
        returns their WorkerSpecs once each listens."""
        from tpufab.sim.worker_files import WorkerSpec

        specs = [WorkerSpec(node_id, w, f"{self.subnet}.{first + w + 1}",
                            f"t1v-n-{int(node_id):08x}-w-{w}", self.accelerators)
                 for w in range(count)]
        self.pool.start_node(node_id, specs,
                             f"{self.user}:{self.key.with_suffix('.pub').read_text().strip()}")
        self.nodes.append(node_id)
        self.pool.wait_listening(node_id, 60)
        return specs

    def targets(self, node_alias: str | None = None, specs=None, extra=()):
        """Fan-out targets for the workers (or ``specs``), under ``node_alias`` (default: the
        node id), plus hosts in ``extra`` (e.g. an address where nothing listens)."""
        from tpufab.ssh.connections import Target
        from tpufab.ssh.hostkeys import alias

        specs = specs or self.specs
        node_alias = node_alias or specs[0].node_id
        made = [Target(s.index, s.ip, self.user, str(self.key), 22, alias(node_alias, s.index))
                for s in specs]
        for i, host in enumerate(extra, start=len(made)):
            made.append(Target(i, host, self.user, str(self.key), 22, alias(node_alias, i)))
        return made

    def ps(self, worker: int, node_id: str | None = None) -> list[str]:
        """Command lines of every process on one worker (its namespace)."""
        lines = []
        for pid in self.pool.pids(node_id or self.node_id, worker):
            try:
                raw = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            lines.append(raw.replace(b"\0", b" ").decode(errors="replace"))
        return lines

    def running(self, token: str) -> dict[int, int]:
        """Worker -> how many of its processes have ``token`` in their command line."""
        return {w: sum(token in line for line in self.ps(w)) for w in range(len(self.specs))}

    # the Workers surface deploy and mount use, recording each command
    @property
    def workers(self) -> list[int]:
        return self.fanout.workers

    def run(self, command, **kw):
        self.commands.append(command)
        return self.fanout.run(command, **kw)

    def put(self, data, remote_path, **kw):
        return self.fanout.put(data, remote_path, **kw)

    # looking inside a worker without SSH, as the login user (or root)
    def sh(self, w: int, script: str, check: bool = True, as_root: bool = False) -> str:
        argv = ["sh", "-c", script]
        env = None
        if not as_root:
            argv = ["runuser", "-u", self.user, "--", *argv]
            env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": self.home,
                   "LANG": "C.UTF-8"}
        proc = self.pool.exec_in(self.node_id, w, argv, **({"env": env} if env else {}))
        if check and proc.returncode != 0:
            raise AssertionError(f"w{w}: {script!r} failed: {proc.stderr}")
        return proc.stdout.strip()

    def read(self, w: int, path: str) -> str:
        return self.sh(w, f"cat {path}")

    def git(self, w: int, dir: str, *args: str) -> str:
        return self.sh(w, "cd " + dir + " && git " + " ".join(args))

    def close(self) -> None:
        if self.fanout is not None:
            self.fanout.close()
        self.pool.stop_all()


@contextlib.contextmanager
def connected_pod(sim, tmp_path_factory, prefix: str, type: str = "v4-32", *,
                  ssh_user: str | None = None, columns: int = 200, drop: tuple[str, ...] = (),
                  site: str | None = None, setup: bool = False,
                  num_slices: int = 1) -> Iterator[SimpleNamespace]:
    """A READY node through the simulated TPU API, connected (``tpufab.hosts.connect``), for
    one module's job tests: ``env`` (a user's shell naming it: own key and known_hosts,
    ``TPUFAB_SSH_USER=ssh_user`` if given, ``COLUMNS=columns``, the names in ``drop``
    removed), ``pod`` (the connection: ``pod.fanout``), ``base`` (a folder for the user's
    files), ``settings``. ``site="jax"``, ``"torch"`` or ``"ray"`` (JAX and Ray) gives the workers
    those Python packages (build_shared_site); ``setup`` runs scripts/setup-sim.sh on every worker;
    ``num_slices`` > 1: a multislice queued resource of that many slices of ``type``.
    The node is deleted afterwards."""
    from tpufab.cloud import lifecycle
    from tpufab.config import load_settings
    from tpufab.hosts import connect as pods
    from tpufab.steps.host.setup import run_setup

    base = tmp_path_factory.mktemp(f"{prefix}-sim")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TPUFAB_")}
    env.update(sim.env(), TPUFAB_USER_CONFIG=str(base / "none.yaml"),
               TPUFAB_SSH_KEY=str(base / "key" / "tpufab_ed25519"),
               TPUFAB_KNOWN_HOSTS=str(base / "known_hosts"), TPUFAB_NAME=unique_name(prefix),
               COLUMNS=str(columns))
    if ssh_user:
        env["TPUFAB_SSH_USER"] = ssh_user
    for name in drop:
        env.pop(name, None)
    settings = load_settings(env=env, cwd=base)
    if site:
        build_shared_site([Path(sim.state_dir) / "share"], torch=site == "torch",
                          ray=site == "ray")
    lifecycle.create(load_settings({"type": type}, env=env, cwd=base), console=quiet_console(),
                     num_slices=num_slices)
    pod = pods.connect(settings, console=quiet_console())
    try:
        if setup:
            run_setup(pod.fanout, REPO / "scripts" / "setup-sim.sh")[0].close()
        yield SimpleNamespace(env=env, pod=pod, base=base, settings=settings)
    finally:
        pod.close()
        lifecycle.delete(settings, yes=True, console=quiet_console())
