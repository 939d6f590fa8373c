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
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

TPUFAB = str(Path(sys.executable).parent / "tpufab")
INVOKE = str(Path(sys.executable).parent / "invoke")
REPO = Path(__file__).resolve().parents[1]
NOT_ROOT = "the simulated pod needs root (sshd workers in namespaces on 127.x addresses)"
NO_GCLOUD = "gcloud is not installed"

# The login on the workers where the local user is root (tpufab.config.DEFAULT_REMOTE_USER):
# an ordinary user with passwordless sudo, as on real TPU VMs.
LOGIN = "tpufab"
# Who the scenario tests log in as (one place to change it).
POD_USER = os.environ.get("TPUFAB_TEST_SSH_USER", LOGIN)
# The interpreter worker-side scripts run under in tests, as on a worker: the system's.
WORKER_PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable


# --- waiting, names, the TPU API client, ssh, ports, git, the workers' packages -----------


def wait_for(condition: Callable[[], Any], timeout: float = 30.0, interval: float = 0.05,
             what: str | Callable[[], str] = "condition") -> Any:
    """Poll until condition() is truthy (returns it); fail the test after `timeout` s (``what``
    may be a function: the failure then says what it returns at that moment)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            pytest.fail(f"timed out after {timeout:g} s waiting for "
                        f"{what() if callable(what) else what}")
        time.sleep(interval)


@contextlib.contextmanager
def storage_emulator(*buckets: str) -> Iterator[Any]:
    """The simulated Cloud Storage in this process, in memory, with ``buckets`` made (no pod,
    no root); skips the test without gcp-storage-emulator."""
    pytest.importorskip("gcp_storage_emulator", reason="pip install gcp-storage-emulator")
    from tpufab.sim.storage import StorageEmulator

    with StorageEmulator() as emulator:
        for bucket in buckets:
            emulator.create_bucket(bucket)
        yield emulator


class InThread:
    """``call()`` in a daemon thread (a babysitter, say), its return value or the exception
    it raised kept in ``outcome`` ("value" or "error") for the test to read."""

    def __init__(self, call: Callable[[], Any]):
        self.outcome: dict[str, Any] = {}
        self.thread = threading.Thread(target=self._run, args=(call,), daemon=True)
        self.thread.start()

    def _run(self, call: Callable[[], Any]) -> None:
        try:
            self.outcome["value"] = call()
        except BaseException as err:  # noqa: BLE001 - the test reads it
            self.outcome["error"] = err

    def join(self, timeout: float) -> None:
        self.thread.join(timeout)

    def is_alive(self) -> bool:
        return self.thread.is_alive()


def text_of(path: Path) -> str:
    """A file's text, or "" where it is not (yet) there."""
    try:
        return path.read_text()
    except OSError:
        return ""


def attempt_running(sitter: Any, job: InThread, attempt: int, workers: Sequence[int],
                    timeout: float, what: str) -> None:
    """Wait until ``sitter``'s attempt has printed "attempt N" on each of ``workers`` (its
    recipes say so first), or the babysitter has failed (the test then shows why)."""
    wait_for(lambda: "error" in job.outcome or sitter.log_dir is not None and all(
        f"attempt {attempt}" in text_of(sitter.log_dir / f"attempt-{attempt}" / f"w{w}.log")
        for w in workers), timeout, what=what)
    assert "error" not in job.outcome, job.outcome["error"]


def compute_clients(sim: Any) -> Any:
    """The official google-cloud-compute clients (REST, anonymous) against the simulated pod,
    built as a user builds them (not through tpufab), and a helper that
    waits for an operation (the clients' ExtendedOperation polls compute.googleapis.com
    whatever the endpoint, so the *_unary calls and these operation clients are used)."""
    from google.api_core.client_options import ClientOptions
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import compute_v1

    kw = {"credentials": AnonymousCredentials(), "transport": "rest",
          "client_options": ClientOptions(api_endpoint=sim.endpoint)}

    class Clients:
        v1 = compute_v1
        instances = compute_v1.InstancesClient(**kw)
        groups = compute_v1.InstanceGroupManagersClient(**kw)
        templates = compute_v1.InstanceTemplatesClient(**kw)
        policies = compute_v1.ResourcePoliciesClient(**kw)
        reservations = compute_v1.ReservationsClient(**kw)
        zone_ops = compute_v1.ZoneOperationsClient(**kw)
        region_ops = compute_v1.RegionOperationsClient(**kw)
        global_ops = compute_v1.GlobalOperationsClient(**kw)
        project, zone = sim.project, sim.zone
        region = sim.zone.rsplit("-", 1)[0]

        def wait(self, op, timeout: float = 90.0):
            deadline = time.monotonic() + timeout
            while True:
                if op.zone:
                    op = self.zone_ops.wait(project=self.project, zone=self.zone,
                                            operation=op.name)
                elif op.region:
                    op = self.region_ops.wait(project=self.project, region=self.region,
                                              operation=op.name)
                else:
                    op = self.global_ops.wait(project=self.project, operation=op.name)
                if op.status == compute_v1.Operation.Status.DONE:
                    return op
                assert time.monotonic() < deadline, f"operation {op.name} not done"

    return Clients()


def workers_printing(output: str, pattern: str, count: int) -> set[int]:
    """The workers whose folded lines in ``output`` match ``pattern`` (a regex searched in
    the text): ``w[1-3]: text`` is theirs, a line with no label every worker's. However the
    fold grouped them, each worker's line counts."""
    from tpufab.nodeset import parse_selection

    found: set[int] = set()
    for line in output.splitlines():
        labelled = re.match(r"(w(?:\d+|\[[\d,-]+\])): (.*)", line)
        text = labelled.group(2) if labelled else line
        if re.search(pattern, text):
            found.update(parse_selection(labelled.group(1), count) if labelled
                         else range(count))
    return found


def unique_name(prefix: str = "t") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


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


@dataclass(frozen=True)
class SshKey:
    path: Path        # private key
    public: str       # "ssh-ed25519 AAAA... comment"


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


def build_shared_site(share_dirs: list[Path], *, torch: bool = False, ray: bool = False) -> Path:
    """The workers' Python packages (JAX; with ``torch``, torch + torch_xla + Lightning too):
    built once per machine into a cache by scripts/sim-wheels.sh (pip: ~20 s for JAX, minutes
    for torch), then hard-linked into each pod's share (a second). A share whose site was
    built for other packages gets the cache's. With ``ray``, Ray (``ray[default]``, ~1 min)
    goes beside the site in the share's ``ray`` folder (its own stamp: the site is the same
    with or without it). Returns the cached site."""
    repo = Path(__file__).resolve().parents[1]
    cache = Path(os.environ.get("TPUFAB_TEST_SIM_CACHE",
                                Path.home() / ".cache" / "tpufab" / "test-sim"))
    argv = ["bash", str(repo / "scripts" / "sim-wheels.sh"), "--sim-dir", str(cache)]
    built = subprocess.run(argv + (["--torch"] if torch else []) + (["--ray"] if ray else []),
                           capture_output=True, text=True, timeout=1800)
    assert built.returncode == 0, built.stdout + built.stderr
    site = cache / "share" / "site"
    _link_into_shares(site, share_dirs)
    if ray:
        _link_into_shares(cache / "share" / "ray", share_dirs)
    if (cache / "share" / "tpu-info" / ".tpufab-spec").exists():  # tpu-info, best effort
        _link_into_shares(cache / "share" / "tpu-info", share_dirs)
    return site


def _link_into_shares(site: Path, share_dirs: list[Path]) -> None:
    """The cache's ``site`` (a folder with a .tpufab-spec stamp) hard-linked into each share
    under its own name, unless the share's copy has the same stamp."""
    stamp = (site / ".tpufab-spec").read_text()
    for share in share_dirs:
        share.mkdir(parents=True, exist_ok=True)
        target = share / site.name
        try:
            if (target / ".tpufab-spec").read_text() == stamp:
                continue
        except OSError:
            pass
        fresh = share / f".{site.name}.new"
        shutil.rmtree(fresh, ignore_errors=True)
        linked = subprocess.run(["cp", "-al", str(site), str(fresh)], capture_output=True)
        if linked.returncode != 0:
            shutil.copytree(site, fresh, symlinks=True)
        old = share / f".{site.name}.old"
        if target.exists():
            shutil.rmtree(old, ignore_errors=True)
            target.rename(old)
        fresh.rename(target)
        shutil.rmtree(old, ignore_errors=True)


# --- processes, shipped scripts ---------------------------------------------------------


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
    from tpufab.ssh.remote_files import RemoteFile

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
            "TPUFAB_CONNECT_TIMEOUT": "10"}


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


def tpufab(*args: str, env: dict, cwd: Path | None = None, timeout: float = 300,
           stdin=subprocess.DEVNULL, input: str | bytes | None = None, text: bool = True,
           extra_env: dict | None = None) -> subprocess.CompletedProcess:
    """The installed `tpufab` command in the environment ``env`` (plus ``extra_env``), output
    captured (as text unless ``text=False``); ``input`` is fed to its stdin (default: none).
    The timeout bounds a hung command (pytest-timeout's 300 s bounds the test too)."""
    return subprocess.run([TPUFAB, *args], env={**env, **(extra_env or {})}, cwd=cwd,
                          capture_output=True, text=text, timeout=timeout,
                          **({"input": input} if input is not None else {"stdin": stdin}))


def tpufab_within(seconds: float, *args: str, env: dict, cwd: Path | None = None,
                  extra_env: dict | None = None) -> subprocess.CompletedProcess:
    """:func:`tpufab` for a command that must end within ``seconds``. One still running then
    fails the test with what it was doing: it is stopped with SIGABRT, and faulthandler prints
    every thread's stack (or, when it has exited, the test says what still holds its output)."""
    argv = [TPUFAB, *args]
    proc = subprocess.Popen(argv, env={**env, **(extra_env or {}), "PYTHONFAULTHANDLER": "1"},
                            cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        ended = proc.poll()
        if ended is None:
            proc.send_signal(signal.SIGABRT)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = "", "(its output is still held open by a process it started)"
        state = "still ran" if ended is None else f"had exited ({ended}) but its output was open"
        pytest.fail(f"`tpufab {' '.join(args)}` {state} after {seconds:g} s:\n"
                    f"{err[-8000:]}\n-- stdout --\n{out[-2000:]}")
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def invoke(*args: str, env: dict, cwd: Path | None = None, timeout: float = 180
           ) -> subprocess.CompletedProcess:
    """`invoke` with tpufab's own tasks.py (``-r``), in ``cwd`` (default: the checkout; a
    user's project or a folder outside it keeps their working directory)."""
    return subprocess.run([INVOKE, "-r", str(REPO), *args], env=env, cwd=cwd or REPO,
                          capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


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
    """No traceback and no "unexpected error, a bug in tpufab" report anywhere in the output."""
    out = (result.stdout or "") + (result.stderr or "")
    if isinstance(out, bytes):
        out = out.decode(errors="replace")
    assert "Traceback" not in out and "a bug in tpufab" not in out \
        and "Unexpected error" not in out, out


def ok(result) -> str:
    """A command that worked: exit 0, no traceback; its stdout."""
    assert result.returncode == 0, (result.stdout or "") + (result.stderr or "")
    no_traceback(result)
    return result.stdout


def one_sentence(result, *fragments: str, ignore: tuple[str, ...] = ("TPU API busy",),
                 progress: int = 0, details: bool = False) -> str:
    """The shape of every expected failure: non-zero exit, no traceback (`no_traceback`) and
    one line on stderr (notes holding an ``ignore`` text aside) holding every fragment and
    ending as a sentence does (".", "?" or "!", perhaps followed by a parenthesised hint such
    as "(see `tpufab types` for the full list)"). ``progress``: at most that many progress
    lines come first (launch reports its steps); ``details``: the sentence comes first and a
    per-worker report may follow it (mount). Returns the sentence."""
    assert result.returncode != 0, (result.stdout or "") + (result.stderr or "")
    no_traceback(result)
    lines = [line for line in result.stderr.splitlines()
             if line.strip() and not any(noise in line for noise in ignore)]
    if details:
        assert lines, result.stderr
        sentence = lines[0]
    else:
        assert 1 <= len(lines) <= 1 + progress, result.stderr
        sentence = lines[-1]
    for fragment in fragments:
        assert fragment in sentence, result.stderr
    assert re.search(r"[.?!](\s+\([^()]*\))?$", sentence.rstrip()), sentence
    return sentence


# --- git ------------------------------------------------------------------------------------


GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}


def sh(cwd: Path, *argv: str) -> str:
    return subprocess.run(argv, cwd=cwd, check=True, capture_output=True, text=True,
                          env={**os.environ, **GIT_ENV}).stdout.strip()


# --- `tpufab` verbs from keywords, in the background, interrupted -----------------------------


FLAGS = {"as_json": "--json"}        # keyword -> flag where the names differ


def cli_argv(verb: str, **kwargs) -> list[str]:
    """The `tpufab` command line for a verb function's keywords: ``call(env, "kill",
    dry_run=True)`` runs ``tpufab kill --dry-run``; ``sim_zombie`` is ``tpufab sim zombie``."""
    argv = [TPUFAB, *verb.split("_")]
    recipe = kwargs.pop("recipe", None)
    for key, value in kwargs.items():
        flag = FLAGS.get(key, "--" + key.replace("_", "-"))
        if value is True:
            argv.append(flag)
        elif isinstance(value, (list, tuple)):
            argv += [f"{flag}={item}" for item in value]
        elif value is not None and value is not False:
            argv.append(f"{flag}={value}")
    return [*argv, "--", recipe] if recipe is not None else argv


def call(environ, verb: str, *, cwd: Path, timeout: float = 120, extra_env=None, **kwargs):
    """The verb through the installed `tpufab` command (see cli_argv)."""
    return tpufab(*cli_argv(verb, **kwargs)[1:], env=environ, extra_env=extra_env, cwd=cwd,
                  timeout=timeout)


class Follower:
    """`run` in the background, its output collected line by line as it arrives."""

    def __init__(self, env, cwd: Path, **kwargs):
        self.proc = subprocess.Popen(cli_argv("run", **kwargs),
                                     env=env, cwd=cwd, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True,
                                     stdin=subprocess.DEVNULL)
        self.out: list[str] = []
        self.err: list[str] = []
        self.readers = [threading.Thread(target=self._pump, args=(s, b), daemon=True)
                        for s, b in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))]
        for reader in self.readers:
            reader.start()

    @staticmethod
    def _pump(stream, into):
        for line in stream:
            into.append(line.rstrip("\n"))

    def run_id(self) -> str:
        def started():
            for line in self.err:
                if line.startswith("Run ") and " started on " in line:
                    return line.split()[1].rstrip(":")
            return None

        return wait_for(started, 60, what="the run to start")

    def wait_lines(self, text: str, count: int) -> None:
        wait_for(lambda: sum(text in line for line in self.out) >= count, 60,
                 what=f"{count} lines with {text!r}")

    def finish(self, timeout: float = 60) -> int:
        code = self.proc.wait(timeout)
        for reader in self.readers:
            reader.join(10)
        return code


def on_workers(pod, argv, workers=None, **kw) -> dict[int, str]:
    """Each worker's stdout (stripped) of ``argv`` run through the pod's fan-out (all must
    succeed); ``workers`` picks some."""
    result = pod.fanout.run(argv, workers=workers, **kw)
    assert result.ok, result.details()
    return {w: r.stdout.strip() for w, r in result.items()}


def write_recipe(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.write_text(text)
    path.chmod(0o755)
    return path


class Running:
    """A `tpufab` subprocess whose output lines are collected as they arrive."""

    def __init__(self, argv: list[str], env: dict, cwd: Path | None = None):
        self.proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
        self.out: list[str] = []
        self.err: list[str] = []
        self._readers = [threading.Thread(target=self._read, args=(s, into), daemon=True)
                         for s, into in ((self.proc.stdout, self.out),
                                         (self.proc.stderr, self.err))]
        for reader in self._readers:
            reader.start()

    @staticmethod
    def _read(stream, into: list[str]) -> None:
        for line in stream:
            into.append(line)

    def saw(self, text: str, stream: str = "out") -> bool:
        return any(text in line for line in (self.out if stream == "out" else self.err))

    def interrupt(self) -> None:
        self.proc.send_signal(signal.SIGINT)

    def wait(self, timeout: float = 60) -> SimpleNamespace:
        code = self.proc.wait(timeout=timeout)
        for reader in self._readers:
            reader.join(timeout)
        return SimpleNamespace(returncode=code, stdout="".join(self.out),
                               stderr="".join(self.err))

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def interrupted_when(argv: list[str], env: dict, ready, what: str, timeout: float = 120,
                     cwd: Path | None = None):
    """Run a `tpufab` command, press Ctrl-C once `ready(running)` holds, return its result.

    ``timeout`` bounds the wait for ``ready``: a `create` loads both cloud clients before its
    first line (~3.5 s of CPU on a quiet machine), which took over 30 s on a loaded CI."""
    running = Running(argv, env, cwd=cwd)
    try:
        wait_for(lambda: ready(running), timeout, what=what)
        running.interrupt()
        return running.wait(60)
    finally:
        running.kill()


# --- status: facts_worker.py's answer as data ------------------------------------------------------

GiB = 1 << 30

SAMPLE = {
    "host": "t1v-n-1a2b3c4d-w-0", "uptime_s": 7260.5, "boot_id": "b-1", "load": [0.1, 0.2, 0.3],
    "devices": [{"path": "/dev/accel0", "holders": [{"pid": 812, "command": "python3 train.py"}]},
                {"path": "/dev/accel1", "holders": []}],
    "unreadable_processes": 0,
    "runs": [{"run": "20261122-104455-ab12", "state": "exited", "exit_code": 0,
              "recipe": "jax_hello.sh", "started_at": 1.0, "ended_at": 2.0},
             {"run": "20261122-114455-cd34", "state": "running", "recipe": "jax_train.sh",
              "started_at": 3.0, "ended_at": None}],
    "runs_total": 7,
    "deploys": [{"dir": "/home/u/proj", "exists": True, "commit": "a" * 40, "branch": "main"}],
    "mounts": [{"at": "/mnt/data", "fstype": "fuse.gcsfuse", "source": "bucket",
                "url": "gs://bucket/prefix"}],
    "setup": [{"hash": "0123456789abcdef", "done": True, "mtime": 5.0}],
    "disk": [{"path": "/home/u", "free_bytes": 80 * GiB, "total_bytes": 100 * GiB}],
    "memory": {"total_bytes": 400 * GiB, "available_bytes": 390 * GiB},
    "python": "3.10.12", "time": 10.0,
}


def outcome(stdout: str = "", *, exit_code: int | None = 0, stderr: str = "",
            error: str | None = None):
    return SimpleNamespace(stdout=stdout, stderr=stderr, exit_code=exit_code, error=error)


def facts_of(worker: int, **changes):
    """status.parse_facts of SAMPLE with `changes` (a StatusRow)."""
    from tpufab.steps.health import status as st

    return st.parse_facts(worker, outcome(answered({**json.loads(json.dumps(SAMPLE)),
                                                   **changes})))


def answered(payload: dict, kind: str = "answer") -> str:
    """What a worker script prints for ``payload`` (workerlib.answer: the answer codec)."""
    import io

    from tpufab.remote.workerlib import answer

    out = io.StringIO()
    answer(kind, payload, out)
    return out.getvalue()


# --- kept connections: which SSH connection a command ran over -------------------------------

# A shell line printing the pid of the sshd session process it descends from: one per SSH
# connection, whatever channel runs it (the observable of "the same connection").
SESSION = ("p=$$; while [ \"$p\" -gt 1 ]; do case $(cat /proc/$p/comm) in sshd*) "
           "echo SESSION=$p; break;; esac; p=$(awk '/^PPid/{print $2}' /proc/$p/status); done")


def sessions_in(stdout: str) -> dict[int, int]:
    """{worker: its sshd session pid} from the output of a command that ran SESSION."""
    return {int(w): int(pid) for w, pid in re.findall(r"w(\d+)\W.*SESSION=(\d+)", stdout)}


def same_twice(sessions: Callable[[], dict[int, int]], tries: int = 4) -> dict[int, int]:
    """The sessions of two commands in a row (``sessions()`` runs one) that ran over the same
    (kept) connections. A command may connect itself when the machine is too loaded for a
    keeper to start or answer within its bound (a few attempts); with keeping off, no two
    commands ever do."""
    previous = sessions()
    for _ in range(tries):
        current = sessions()
        if current == previous:
            return current
        previous = current
    pytest.fail(f"no two commands in a row shared their connections (last: {current})")


# --- kept connections (tpufab.ssh.keeper) ----------------------------------------------------

def keepers(env: dict, module: bytes = b"tpufab.ssh.keeper") -> list[int]:
    """Pids of the keepers (``module``'s processes) started under ``env``'s runtime dir."""
    mine = os.path.join(env["XDG_RUNTIME_DIR"], "tpufab", "").encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                argv = fh.read().split(b"\0")
            with open(f"/proc/{entry}/stat", "rb") as fh:
                state = fh.read().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if any(module in a for a in argv) and any(a.startswith(mine) for a in argv) \
                and state != b"Z":
            found.append(int(entry))
    return found


def residents(env: dict) -> list[int]:
    """Pids of the resident command servers started under ``env``'s runtime dir."""
    return keepers(env, b"tpufab.resident")


@contextlib.contextmanager
def kept_connections(env: dict) -> Iterator[dict]:
    """``env`` with kept connections as a user has them by default (no TPUFAB_KEEP_ALIVE: 5m)
    in a private runtime dir of its own; every keeper and resident server started under it is
    stopped afterwards."""
    runtime = Path(tempfile.mkdtemp(prefix="kp", dir="/tmp"))
    kept = {k: v for k, v in env.items() if k != "TPUFAB_KEEP_ALIVE"}
    kept["XDG_RUNTIME_DIR"] = str(runtime)
    try:
        yield kept
    finally:
        tpufab("disconnect", env=kept, timeout=60)
        for pid in keepers(kept) + residents(kept):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not keepers(kept) and not residents(kept), 30, 0.05,
                 "the keepers and resident servers to be gone")
        shutil.rmtree(runtime, ignore_errors=True)

