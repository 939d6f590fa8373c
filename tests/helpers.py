"""Scaffolding shared by the scenario tests (fixtures live in conftest.py).

- `TPUFAB`: the installed console script; `tpufab(*args, env=, cwd=)` runs it.
- `settings_env`, `sim_settings`, `cli_env`, `use_env`: a user's settings and shell
  environment pointing at the simulated pod (own key, known_hosts and state dir).
- `in_worker(sim, node, w, script)`: a shell script as root inside a worker (no SSH).
- `one_sentence(result, *fragments)`: the shape of every expected failure: non-zero exit, one
  sentence on stderr holding each fragment, no traceback. `no_traceback(result)`.
- `POD_USER`: the account tpufab logs in as on the simulated pod's workers.
- `sim_node(sim, tmp_path_factory, prefix, type)`: a READY node for a module's fixture
  (settings, node, home, name, env), deleted afterwards.
- `process_alive(pid)`, `process_start_time(pid)`: /proc read by the tests themselves (an
  oracle independent of the worker-side library they check).
- `shipped(name)`, `shipped_bytes(name)`: worker-side script ``tpufab/remote/NAME`` exactly
  as tpufab ships it (the worker-side library inlined), as a file or as bytes;
  `WORKER_PYTHON` runs it as a worker would.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

TPUFAB = str(Path(sys.executable).parent / "tpufab")
INVOKE = str(Path(sys.executable).parent / "invoke")
REPO = Path(__file__).resolve().parents[1]

# The login on the workers where the local user is root (tpufab.config.DEFAULT_REMOTE_USER):
# an ordinary user with passwordless sudo, as on real TPU VMs.
LOGIN = "tpufab"
# Who the scenario tests log in as (one place to change it).
POD_USER = os.environ.get("TPUFAB_TEST_SSH_USER", LOGIN)
# The interpreter worker-side scripts run under in tests, as on a worker: the system's.
WORKER_PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable


def _stat_fields(pid: int) -> list[bytes] | None:
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    return data[data.rindex(b")") + 2:].split()


def process_alive(pid: int) -> bool:
    """``pid`` exists and has not exited (a zombie is not alive)."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] not in (b"Z", b"X")


def process_start_time(pid: int) -> int:
    """Field 22 of /proc/<pid>/stat: when ``pid`` started, in clock ticks since boot."""
    fields = _stat_fields(pid)
    assert fields is not None, f"no process {pid}"
    return int(fields[19])


@functools.cache
def _shipped_dir() -> Path:
    folder = Path(tempfile.mkdtemp(prefix="tpufab-shipped-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def shipped_bytes(name: str) -> bytes:
    """``tpufab/remote/NAME`` as it is shipped (``RemoteFile.bundled``: the worker-side
    library inlined)."""
    from tpufab.remote_files import RemoteFile

    return RemoteFile.bundled(name).data


@functools.cache
def shipped(name: str) -> Path:
    """``shipped_bytes(name)`` as a file in a folder of its own (nothing beside it to import):
    what tests run by path is what workers run."""
    path = _shipped_dir() / name
    path.write_bytes(shipped_bytes(name))
    return path


def settings_env(sim, home: Path) -> dict[str, str]:
    """TPUFAB_* variables pointing at the simulated pod, with a private key and known_hosts."""
    return {**sim.env(), "TPUFAB_USER_CONFIG": str(home / "none.yaml"),
            "TPUFAB_SSH_KEY": str(home / "tpufab_ed25519"),
            "TPUFAB_KNOWN_HOSTS": str(home / "known_hosts"),
            "TPUFAB_STATE_DIR": str(home / "state"), "TPUFAB_API_RETRIES": "4",
            "TPUFAB_API_RETRY_SECONDS": "20", "TPUFAB_WAIT_TIMEOUT": "120",
            "TPUFAB_CONNECT_TIMEOUT": "5"}


def sim_settings(sim, home: Path, **overrides):
    from tpufab.config import load_settings

    return load_settings(overrides, env=settings_env(sim, home), cwd=home)


def use_env(monkeypatch, sim, home: Path) -> None:
    """Make verbs (which read the process environment) see the simulated pod."""
    for key in [k for k in os.environ if k.startswith("TPUFAB_")]:
        monkeypatch.delenv(key)
    for key, value in settings_env(sim, home).items():
        monkeypatch.setenv(key, value)


def cli_env(sim, home: Path, name: str | None = None) -> dict[str, str]:
    """The environment a user's shell would have for `tpufab` subprocesses (the same key and
    known_hosts as ``sim_settings(sim, home)``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TPUFAB_")}
    env.update(settings_env(sim, home), HOME=str(home), COLUMNS="200")
    if name:
        env["TPUFAB_NAME"] = name
    return env


def tpufab(*args: str, env: dict, cwd: Path | None = None, timeout: float = 180,
           stdin=subprocess.DEVNULL) -> subprocess.CompletedProcess:
    """The installed `tpufab` command, output captured as text."""
    return subprocess.run([TPUFAB, *args], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, stdin=stdin)


def invoke(*args: str, env: dict, cwd: Path | None = None, timeout: float = 180
           ) -> subprocess.CompletedProcess:
    """`invoke` in a project dir whose tasks.py is tpufab's (default: the checkout)."""
    return subprocess.run([INVOKE, *args], env=env, cwd=cwd or REPO, capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)


@contextlib.contextmanager
def sim_node(sim, tmp_path_factory, prefix: str, type: str = "v4-16",
             **overrides) -> Iterator[SimpleNamespace]:
    """A READY node on the simulated pod for one module: ``settings``, ``node``, ``home``
    (the user's), ``name``, ``env`` (a user's shell pointing at it); deleted afterwards."""
    from conftest import unique_name

    from tpufab import lifecycle
    from tpufab import pod as pods

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


def quiet_console():
    from rich.console import Console

    return Console(file=open(os.devnull, "w"), width=200)  # noqa: SIM115


def sim_pool(sim):
    from tpufab.sim.workers import WorkerPool

    return WorkerPool(Path(sim.state_dir) / "workers")


def in_worker(sim, node, worker: int, script: str, check: bool = True,
              user: str | None = None) -> str:
    """Run a shell script inside a worker (no SSH involved): as root, or as ``user`` (with
    that user's HOME, so ``~`` is theirs)."""
    argv, kw = ["sh", "-c", script], {}
    if user:
        argv = ["runuser", "-u", user, "--", *argv]
        kw["env"] = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": f"/home/{user}",
                     "LANG": "C.UTF-8"}
    proc = sim_pool(sim).exec_in(node.id, worker, argv, **kw)
    if check and proc.returncode != 0:
        raise AssertionError(f"w{worker}: {script!r} failed: {proc.stderr}")
    return proc.stdout


OS_LOGIN_ACCOUNT = "alice@example.com"  # tpufab.sim.oslogin.DEFAULT_ACCOUNT, exported by sim.env()
OS_LOGIN_USER = "alice_example_com"     # the POSIX name Google derives from it


@contextlib.contextmanager
def os_login_on(sim, project: str) -> Iterator:
    """The simulated project with OS Login on (its SimAdmin); back to unset, role admin, after."""
    from tpufab.sim.admin import SimAdmin

    admin = SimAdmin.from_info(sim, project=project)
    admin.os_login(enabled=True)
    try:
        yield admin
    finally:
        admin.os_login(enabled=None, role="admin", account=OS_LOGIN_ACCOUNT)


def no_traceback(result) -> None:
    out = (result.stdout or "") + (result.stderr or "")
    assert "Traceback" not in out and "a bug in tpufab" not in out, out


def ok(result) -> str:
    """A command that worked: exit 0, no traceback; its stdout."""
    assert result.returncode == 0, (result.stdout or "") + (result.stderr or "")
    no_traceback(result)
    return result.stdout


def one_sentence(result, *fragments: str, ignore: tuple[str, ...] = ("TPU API busy",)) -> str:
    """Non-zero exit, one line on stderr (notes such as API retries aside) holding every
    fragment, ending with a full stop, no traceback anywhere. Returns the line."""
    assert result.returncode != 0, (result.stdout or "") + (result.stderr or "")
    no_traceback(result)
    lines = [line for line in result.stderr.splitlines()
             if line.strip() and not any(noise in line for noise in ignore)]
    assert len(lines) == 1, result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert lines[0].rstrip().endswith("."), lines[0]
    return lines[0]
