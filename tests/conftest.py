"""Shared fixtures: the simulated pod (`sim`), clients for it, gcloud's environment.

- `sim` (session): a daemon on a free port with a temporary state dir; yields its SimInfo and
  stops every process at the end, then checks a sample of the API answers the tests saw
  against Google's schemas (tests/conformance.py). Tests that use it are skipped, with the
  reason, unless root.
- `sim_admin`: fault injection for it (faults and settings are reset after each test).
- `tpu_client` (session): the official google-cloud-tpu v2 client against it.
- `sim_parent`: "projects/<p>/locations/<zone>" of the suggested project and zone.
- `make_node`: create a node (unique name) and wait until READY; deleted after the test.
- `gcloud_env`: env for running gcloud against it, with a fresh CLOUDSDK_CONFIG and HOME.
- `ssh_key` (session): an ed25519 key pair (helpers.SshKey).

Plain helpers (functions, classes) live in helpers.py and the simulated-pod harness in
harness.py; test modules import those, never this file (see tests/README.md).

Mark tests that need the pod with `pytest.mark.sim` (and gcloud ones with `pytest.mark.gcloud`).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import NO_GCLOUD, NOT_ROOT, SshKey, create_node, unique_name
from hypothesis import settings

# No per-example deadline (hypothesis's default is 200 ms): on a busy 2-core machine that only
# measures the machine. Example counts stay bounded per test.
settings.register_profile("tpufab", deadline=None)
settings.load_profile("tpufab")

# The suite starts from a clean environment, whatever the caller's shell holds (issue 37, 16):
# no TPUFAB_* setting (the simulated pod's lines a user pasted, as the README says to) but the
# suite's own TPUFAB_TEST_*, and no other active virtualenv (`run --local` takes the active
# one's Python, which need not have JAX): the venv running the suite is the one in PATH.
# scripts/test.sh does the same before it starts anything.
for _name in [n for n in os.environ if n.startswith("TPUFAB_")
              and not n.startswith("TPUFAB_TEST_")]:
    del os.environ[_name]
_foreign_venv = os.environ.pop("VIRTUAL_ENV", None)
_own_bin = os.path.dirname(sys.executable)
os.environ["PATH"] = os.pathsep.join(
    [_own_bin] + [p for p in os.environ.get("PATH", "").split(os.pathsep)
                  if p and p != _own_bin and not (_foreign_venv and p.rstrip("/") == os.path.join(
                      _foreign_venv, "bin"))])
for _name in ("PYTHONHOME", "CONDA_PREFIX", "PIP_REQUIRE_VIRTUALENV"):
    os.environ.pop(_name, None)

# Kept connections (tpufab.ssh.keeper) are off in every test's environment: no test changes
# behaviour or leaves a background process behind; tests/test_keeper_sim.py turns them on.
os.environ["TPUFAB_KEEP_ALIVE"] = "0"

# A shell without job control starts background commands with SIGINT ignored (POSIX), and
# exec keeps an ignored signal ignored: scripts/test.sh runs its pytest groups that way, and
# every `tpufab` a test then sends Ctrl-C to would not see it. Python installs its
# KeyboardInterrupt handler only where SIGINT was at its default, so put it back here: a
# handler (not SIG_IGN) is reset to the default in every child this process starts.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


CURRENT_POD = Path(__file__).resolve().parents[1] / ".tpufab" / "current-pod.json"


@pytest.fixture(autouse=True, scope="session")
def checkout_is_not_a_test_project():
    """No test may leave a current pod in tpufab's own checkout (it would name the node for
    every later test that loads settings there)."""
    before = CURRENT_POD.read_bytes() if CURRENT_POD.exists() else None
    yield
    after = CURRENT_POD.read_bytes() if CURRENT_POD.exists() else None
    assert after == before, f"a test wrote {CURRENT_POD}; run verbs that create from a tmp dir"


def needs_root(item: pytest.Item) -> bool:
    """The test uses the `sim` fixture, a fixture marked with harness.needs_root (directly or
    through other fixtures), or is skipped unless root (a skipif whose reason says so)."""
    if "sim" in item.fixturenames:
        return True
    info = getattr(item, "_fixtureinfo", None)
    for defs in (info.name2fixturedefs.values() if info else ()):
        if any(getattr(d.func, "needs_root", False) for d in defs):
            return True
    return any("root" in str(m.kwargs.get("reason", "")) for m in item.iter_markers("skipif"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    unmarked = [item.nodeid for item in items if "sim" not in item.keywords and needs_root(item)]
    if unmarked:
        raise pytest.UsageError(
            "these tests need root (the simulated pod) but lack the `sim` marker, so "
            "`-m 'not sim'` would still run them; add @pytest.mark.sim (or a module "
            "pytestmark): " + ", ".join(unmarked))
    root = os.geteuid() == 0
    gcloud = shutil.which("gcloud") is not None
    for item in items:
        if "sim" in item.keywords and not root:
            item.add_marker(pytest.mark.skip(reason=NOT_ROOT))
        if "gcloud" in item.keywords and not gcloud:
            item.add_marker(pytest.mark.skip(reason=NO_GCLOUD))


def _keepers_off_class():
    from tpufab.sim.daemon import SimInfo

    class KeepersOff(SimInfo):
        """The sim's SimInfo whose env() (every test's TPUFAB_* base) keeps no connections."""

        def env(self) -> dict[str, str]:
            return {**super().env(), "TPUFAB_KEEP_ALIVE": "0"}

    return KeepersOff


def _KeepersOff(**fields):  # noqa: N802 - builds the class lazily (tpufab.sim imports late)
    return _keepers_off_class()(**fields)


@pytest.fixture(scope="session")
def sim(tmp_path_factory: pytest.TempPathFactory):
    """A running simulated pod (SimInfo); everything it started is stopped at the end."""
    if os.geteuid() != 0:
        pytest.skip(NOT_ROOT)
    from tpufab.sim.daemon import down, up

    state_dir = tmp_path_factory.mktemp("sim-state")
    answers = state_dir / "answers.jsonl"  # a sample of what the tests see, checked at the end
    os.environ["TPUFAB_SIM_RECORD"] = str(answers)
    try:
        info = up(state_dir, port=0, timeout=60.0)
    finally:
        os.environ.pop("TPUFAB_SIM_RECORD", None)
    try:
        yield _KeepersOff(**{f.name: getattr(info, f.name) for f in dataclasses.fields(info)})
    finally:
        down(state_dir)
    from conformance import recorded, violations

    found, checked, _ = violations(recorded(answers))
    assert not found, (f"{len(found)} of the {checked} answers the tests saw break Google's "
                       "schemas (tests/conformance.py):\n" + "\n".join(found[:20]))


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


@pytest.fixture(scope="session")
def ssh_key(tmp_path_factory: pytest.TempPathFactory) -> SshKey:
    path = tmp_path_factory.mktemp("ssh-key") / "id_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "tpufab-test",
                    "-f", str(path)], check=True)
    return SshKey(path, path.with_suffix(".pub").read_text().strip())
