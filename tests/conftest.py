"""Shared fixtures: the simulated pod (`sim`), clients for it, gcloud's environment.

- `sim` (session): a daemon on a free port with a temporary state dir; yields its SimInfo and
  stops every process at the end. Tests that use it are skipped, with the reason, unless root.
- `sim_admin`: fault injection for it (faults and settings are reset after each test).
- `tpu_client` (session): the official google-cloud-tpu v2 client against it.
- `sim_parent`: "projects/<p>/locations/<zone>" of the suggested project and zone.
- `make_node`: create a node (unique name) and wait until READY; deleted after the test.
- `gcloud_env`: env for running gcloud against it, with a fresh CLOUDSDK_CONFIG and HOME.
- `ssh_key` (session): an ed25519 key pair; `metadata_keys(user, key)` is its `ssh-keys`
  line; `ssh_run(ip, key, user, command)` runs a command on a worker; `port_open(ip)`.

Mark tests that need the pod with `pytest.mark.sim` (and gcloud ones with `pytest.mark.gcloud`).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

# No per-example deadline (hypothesis's default is 200 ms): on a busy 2-core machine that only
# measures the machine. Example counts stay bounded per test.
settings.register_profile("tpufab", deadline=None)
settings.load_profile("tpufab")

NOT_ROOT = "the simulated pod needs root (sshd workers in namespaces on 127.x addresses)"
NO_GCLOUD = "gcloud is not installed"


CURRENT_POD = Path(__file__).resolve().parents[1] / ".tpufab" / "current-pod.json"


@pytest.fixture(autouse=True, scope="session")
def checkout_is_not_a_test_project():
    """No test may leave a current pod in tpufab's own checkout (it would name the node for
    every later test that loads settings there)."""
    before = CURRENT_POD.read_bytes() if CURRENT_POD.exists() else None
    yield
    after = CURRENT_POD.read_bytes() if CURRENT_POD.exists() else None
    assert after == before, f"a test wrote {CURRENT_POD}; run verbs that create from a tmp dir"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    root = os.geteuid() == 0
    gcloud = shutil.which("gcloud") is not None
    for item in items:
        if "sim" in item.keywords and not root:
            item.add_marker(pytest.mark.skip(reason=NOT_ROOT))
        if "gcloud" in item.keywords and not gcloud:
            item.add_marker(pytest.mark.skip(reason=NO_GCLOUD))


def wait_for(condition: Callable[[], Any], timeout: float = 30.0, interval: float = 0.05,
             what: str = "condition") -> Any:
    """Poll until condition() is truthy (returns it); fail the test after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            pytest.fail(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


def unique_name(prefix: str = "t") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="session")
def sim(tmp_path_factory: pytest.TempPathFactory):
    """A running simulated pod (SimInfo); everything it started is stopped at the end."""
    if os.geteuid() != 0:
        pytest.skip(NOT_ROOT)
    from tpufab.sim.daemon import down, up

    state_dir = tmp_path_factory.mktemp("sim-state")
    info = up(state_dir, port=0, timeout=60.0)
    try:
        yield info
    finally:
        down(state_dir)


@pytest.fixture
def sim_admin(sim):
    from tpufab.sim.admin import SimAdmin

    admin = SimAdmin.from_info(sim)
    before = admin.settings()
    yield admin
    admin.clear_faults()
    admin.settings(**before)


@pytest.fixture(scope="session")
def tpu_client(sim):
    """google.cloud.tpu_v2.TpuClient (REST, anonymous credentials) against the pod."""
    from google.api_core.client_options import ClientOptions
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import tpu_v2

    return tpu_v2.TpuClient(credentials=AnonymousCredentials(), transport="rest",
                            client_options=ClientOptions(api_endpoint=sim.endpoint))


@pytest.fixture(scope="session")
def sim_parent(sim) -> str:
    return f"projects/{sim.project}/locations/{sim.zone}"


def create_node(client: Any, parent: str, node_id: str, accelerator_type: str = "v4-8", *,
                runtime_version: str = "tpu-ubuntu2204-base", timeout: float = 60.0,
                **fields: Any) -> Any:
    """Create a node with the official client and wait for its operation (-> READY node)."""
    from google.cloud import tpu_v2

    node = tpu_v2.Node(accelerator_type=accelerator_type, runtime_version=runtime_version,
                       **fields)
    return client.create_node(parent=parent, node_id=node_id, node=node).result(timeout=timeout)


def wait_node_state(client: Any, name: str, state: str, timeout: float = 60.0) -> Any:
    """Poll get_node until the node exists and is in `state` (a Node.State name)."""
    from google.api_core import exceptions as gexc

    def current():
        try:
            node = client.get_node(name=name)
        except gexc.NotFound:
            return None
        return node if node.state.name == state else None

    return wait_for(current, timeout, 0.1, f"{name} to be {state}")


@pytest.fixture
def make_node(tpu_client, sim_parent) -> Iterator[Callable[..., Any]]:
    """make_node("v4-32", **node_fields) -> READY Node with a unique name; deleted afterwards."""
    from google.api_core import exceptions as gexc

    created: list[str] = []
    counter = itertools.count()

    def make(accelerator_type: str = "v4-8", *, node_id: str | None = None, **fields: Any):
        node_id = node_id or unique_name(f"n{next(counter)}")
        created.append(f"{sim_parent}/nodes/{node_id}")
        return create_node(tpu_client, sim_parent, node_id, accelerator_type, **fields)

    yield make
    for name in created:
        try:
            tpu_client.delete_node(name=name).result(timeout=60)
        except (gexc.NotFound, gexc.BadRequest):
            pass


@pytest.fixture
def gcloud_env(sim, tmp_path: Path) -> dict[str, str]:
    """Environment for gcloud against the pod: fresh CLOUDSDK_CONFIG and HOME under tmp_path."""
    if shutil.which("gcloud") is None:
        pytest.skip(NO_GCLOUD)
    config_dir = tmp_path / "gcloud-config"
    home = tmp_path / "home"
    config_dir.mkdir()
    home.mkdir(mode=0o700)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"}
    env.update(sim.gcloud_env(config_dir, home))
    return env


@dataclass(frozen=True)
class SshKey:
    path: Path        # private key
    public: str       # "ssh-ed25519 AAAA... comment"


@pytest.fixture(scope="session")
def ssh_key(tmp_path_factory: pytest.TempPathFactory) -> SshKey:
    path = tmp_path_factory.mktemp("ssh-key") / "id_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "tpufab-test",
                    "-f", str(path)], check=True)
    return SshKey(path, path.with_suffix(".pub").read_text().strip())


def metadata_keys(user: str, key: SshKey) -> str:
    """A metadata `ssh-keys` line giving `user` this key."""
    return f"{user}:{key.public}"


def ssh_run(ip: str, key: SshKey, user: str, command: str, *, timeout: float = 30.0,
            known_hosts: Path | None = None, extra: tuple[str, ...] = ()
            ) -> subprocess.CompletedProcess:
    """Run `command` on a worker over real ssh (host key unchecked unless known_hosts)."""
    checking = ["-o", "StrictHostKeyChecking=yes", "-o", f"UserKnownHostsFile={known_hosts}"] \
        if known_hosts else ["-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null"]
    argv = ["ssh", "-i", str(key.path), "-o", "BatchMode=yes", "-o", "IdentitiesOnly=yes",
            "-o", "ConnectTimeout=5", "-o", "LogLevel=ERROR", *checking, *extra,
            f"{user}@{ip}", command]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def port_open(ip: str, port: int = 22, timeout: float = 1.0) -> bool:
    try:
        with socket.create_connection((ip, port), timeout=timeout):
            return True
    except OSError:
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def git_daemon(base: Path) -> Iterator[str]:
    """`git daemon` serving the repositories under `base` (push allowed) on a free loopback
    port; yields its URL, `git://127.0.0.1:PORT`, and stops it afterwards."""
    port = free_port()
    proc = subprocess.Popen(
        ["git", "daemon", "--export-all", "--enable=receive-pack", f"--base-path={base}",
         "--listen=127.0.0.1", f"--port={port}", "--reuseaddr", str(base)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: port_open("127.0.0.1", port, timeout=0.2), 10, what="git daemon")
        yield f"git://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def build_shared_site(share_dirs: list[Path], *, torch: bool = False) -> Path:
    """The workers' Python packages (JAX; with ``torch``, torch + torch_xla + Lightning too):
    built once per machine into a cache by scripts/sim-wheels.sh (pip: ~20 s for JAX, minutes
    for torch), then hard-linked into each pod's share (a second). A share whose site was
    built for other packages gets the cache's. Returns the cached site."""
    repo = Path(__file__).resolve().parents[1]
    cache = Path(os.environ.get("TPUFAB_TEST_SIM_CACHE",
                                Path.home() / ".cache" / "tpufab" / "test-sim"))
    argv = ["bash", str(repo / "scripts" / "sim-wheels.sh"), "--sim-dir", str(cache)]
    built = subprocess.run(argv + (["--torch"] if torch else []), capture_output=True,
                           text=True, timeout=1800)
    assert built.returncode == 0, built.stdout + built.stderr
    site = cache / "share" / "site"
    stamp = (site / ".tpufab-spec").read_text()
    for share in share_dirs:
        share.mkdir(parents=True, exist_ok=True)
        target = share / "site"
        try:
            if (target / ".tpufab-spec").read_text() == stamp:
                continue
        except OSError:
            pass
        fresh = share / ".site.new"
        shutil.rmtree(fresh, ignore_errors=True)
        linked = subprocess.run(["cp", "-al", str(site), str(fresh)], capture_output=True)
        if linked.returncode != 0:
            shutil.copytree(site, fresh, symlinks=True)
        old = share / ".site.old"
        if target.exists():
            shutil.rmtree(old, ignore_errors=True)
            target.rename(old)
        fresh.rename(target)
        shutil.rmtree(old, ignore_errors=True)
    return site
