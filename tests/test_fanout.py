"""Fan-out over real SSH: plain sshd processes on loopback addresses, one per worker.

Each sshd runs in its own mount namespace with a private tmpfs on /root, so a worker's home
(~/.tpufab/...) is its own, like on the simulated pod. Processes are found through /proc by
unique tokens in their command lines.
"""

from __future__ import annotations

import io
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tpufab.errors import TpufabError
from tpufab.fanout import (
    Fanout,
    FanoutError,
    FanoutInterrupted,
    LiveView,
    Target,
    print_gathered,
    run_setup,
)
from tpufab.hostkeys import HostKeyChanged, KnownHosts, alias
from tpufab.quoting import Secret, command

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.exists(SSHD) or not shutil.which("unshare"),
    reason="needs root, sshd and unshare",
)
SUBNET = "127.56.0"
PORT = 2222
WORKERS = 4


def wait_for(condition, timeout=10.0, interval=0.02, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def listening(host, port=PORT):
    with socket.socket() as sock:
        sock.settimeout(0.2)
        return sock.connect_ex((host, port)) == 0


def cmdlines_containing(token: str) -> list[tuple[int, str]]:
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            raw = Path(f"/proc/{name}/cmdline").read_bytes()
        except OSError:
            continue
        line = raw.replace(b"\0", b" ").decode(errors="replace")
        if token in line:
            found.append((int(name), line))
    return found


class SshdPool:
    """Plain sshds on ``SUBNET.{i+1}:PORT``, each with its own host key and private /root."""

    def __init__(self, root: Path):
        self.root = root
        self.procs: dict[str, subprocess.Popen] = {}
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(root / "client")], check=True)
        (root / "authorized_keys").write_text((root / "client.pub").read_text())
        Path("/run/sshd").mkdir(exist_ok=True)

    def host_key(self, host: str) -> Path:
        path = self.root / f"host-{host}"
        if not path.exists():
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)
        return path

    def start(self, host: str) -> None:
        config = self.root / f"sshd-{host}.conf"
        config.write_text(
            f"ListenAddress {host}:{PORT}\nHostKey {self.host_key(host)}\nPidFile none\nUsePAM no\n"
            f"PermitRootLogin prohibit-password\nAuthorizedKeysFile {self.root}/authorized_keys\n"
            "StrictModes no\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
            "UseDNS no\nPrintMotd no\nPrintLastLog no\nMaxStartups 200:30:400\nLogLevel ERROR\n"
        )
        script = f"mount -t tmpfs tmpfs /root && exec {SSHD} -D -e -f {config}"
        self.procs[host] = subprocess.Popen(
            ["unshare", "-m", "--propagation", "private", "sh", "-c", script],
            stdout=subprocess.DEVNULL, stderr=open(self.root / f"sshd-{host}.log", "ab"),
        )
        wait_for(lambda: listening(host), what=f"sshd on {host}")

    def stop(self, host: str) -> None:
        proc = self.procs.pop(host, None)
        if proc is not None:
            proc.terminate()
            proc.wait(10)

    def stop_all(self) -> None:
        for host in list(self.procs):
            self.stop(host)


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    pool = SshdPool(tmp_path_factory.mktemp("sshd"))
    try:
        for i in range(WORKERS):
            pool.start(f"{SUBNET}.{i + 1}")
        yield pool
    finally:
        pool.stop_all()


def targets(pool, node="node-a", count=WORKERS, extra=()):
    made = [
        Target(i, f"{SUBNET}.{i + 1}", "root", str(pool.root / "client"), PORT, alias(node, i))
        for i in range(count)
    ]
    for i, host in enumerate(extra, start=count):
        made.append(Target(i, host, "root", str(pool.root / "client"), PORT, alias(node, i)))
    return made


@pytest.fixture
def fanout(pool, tmp_path):
    with Fanout(targets(pool), known_hosts=KnownHosts(tmp_path / "known_hosts")) as fan:
        yield fan


def test_exec_on_all_one_and_subset(fanout):
    everyone = fanout.run("echo hello; echo oops >&2")
    assert sorted(everyone) == [0, 1, 2, 3]
    assert all(r.ok and r.stdout == "hello\n" and r.stderr == "oops\n" for r in everyone.values())
    assert list(fanout.run("true", workers="1")) == [1]
    subset = fanout.run("exit 0", workers="w[0,2-3]")
    assert list(subset) == [0, 2, 3] and subset.ok
    assert fanout.run(["printf", "%s", "argv $x"]).values().__iter__().__next__().stdout == "argv $x"


def test_gather_folds_identical_output(fanout):
    which = 'set -- $SSH_CONNECTION; case $3 in *.1) echo first;; *) echo rest;; esac'
    result = fanout.run(which)
    out, err = io.StringIO(), io.StringIO()
    print_gathered(result, out, err, color=False)
    text = out.getvalue()
    assert text.count("rest\n") == 1 and text.count("first\n") == 1
    assert "w0 (exit 0)" in text and "w[1-3] (exit 0)" in text
    assert err.getvalue() == ""


def test_live_view_keeps_lines_whole_and_in_order(fanout):
    out = io.BytesIO()
    result = fanout.run("seq 1 3000", sink=LiveView(out, io.BytesIO(), color=False, workers=fanout.workers))
    assert result.ok
    per_worker: dict[int, list[int]] = {}
    for line in out.getvalue().decode().splitlines():
        match = re.fullmatch(r"w(\d) │ (\d+)", line)
        assert match, line
        per_worker.setdefault(int(match.group(1)), []).append(int(match.group(2)))
    assert per_worker == {w: list(range(1, 3001)) for w in range(WORKERS)}


def test_failing_and_unreachable_workers_reported_while_others_complete(pool, tmp_path):
    fail_third = 'set -- $SSH_CONNECTION; case $3 in *.3) echo bad >&2; exit 3;; esac; echo fine'
    with Fanout(
        targets(pool, extra=[f"{SUBNET}.99"]), known_hosts=KnownHosts(tmp_path / "kh"),
        connect_attempts=2, retry_wait=(0.01, 0.02),
    ) as fan:
        result = fan.run(fail_third)
        assert [r.worker for r in result.failed] == [2, 4]
        assert result[2].exit_code == 3 and result[2].error is None
        assert result[4].error == "connection refused" and result[4].exit_code is None
        assert all(result[w].stdout == "fine\n" for w in (0, 1, 3))
        with pytest.raises(FanoutError) as err:
            result.check()
    message = str(err.value)
    assert "failed on 2 of 5 workers" in message
    assert "w2 exit 3" in message and "w4 connection refused" in message
    assert err.value.exit_code == 1 and err.value.result is result
    assert "bad" in err.value.details


def test_transient_connection_failure_is_retried(pool, tmp_path):
    host = f"{SUBNET}.20"
    attempts = []

    def open_port_after_first_failure(target, attempt, error):
        attempts.append((attempt, type(error).__name__))
        pool.start(host)  # waits until sshd listens

    try:
        with Fanout(
            [Target(0, host, "root", str(pool.root / "client"), PORT, alias("node-r", 0))],
            known_hosts=KnownHosts(tmp_path / "kh"), retry_wait=(0.01, 0.05),
            on_retry=open_port_after_first_failure,
        ) as fan:
            result = fan.run("echo up")
        assert result[0].ok and result[0].stdout == "up\n"
        assert attempts == [(1, "ConnectionRefusedError")]
    finally:
        pool.stop(host)


def test_command_failures_are_not_retried(fanout):
    result = fanout.run('echo ran >> "$HOME/retry-count"; exit 1', workers="0")
    assert result[0].exit_code == 1
    assert fanout.run('wc -l < "$HOME/retry-count"', workers="0")[0].stdout.strip() == "1"


@pytest.fixture
def sigint_raises():
    # A shell starting pytest in the background may leave SIGINT ignored; Ctrl-C needs it.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_ctrl_c_leaves_no_remote_process(fanout, sigint_raises):
    token = "1234.25"
    interrupter = threading.Thread(
        target=lambda: (
            wait_for(lambda: len(cmdlines_containing(f"sleep {token}")) >= 2 * WORKERS,
                     what="remote sleeps"),
            os.kill(os.getpid(), signal.SIGINT),
        ),
        daemon=True,
    )
    interrupter.start()
    # Two processes per worker: the sleep in the foreground, one setsid'ed into the background.
    with pytest.raises(FanoutInterrupted) as err:
        fanout.run(f"setsid sleep {token} & sleep {token}; echo never")
    interrupter.join()
    assert err.value.exit_code == 130
    assert isinstance(err.value, TpufabError)
    assert all(r.error == "interrupted" for r in err.value.result.values())
    wait_for(lambda: not cmdlines_containing(f"sleep {token}"), timeout=5, what="no sleeps left")
    # The connections survive and are usable.
    assert fanout.run("echo still here").ok


def test_closing_connections_kills_remote_commands(fanout):
    token = "1234.5"
    runner = threading.Thread(target=lambda: fanout.run(f"sleep {token}"), daemon=True)
    runner.start()
    wait_for(lambda: len(cmdlines_containing(f"sleep {token}")) == WORKERS, what="remote sleeps")
    fanout.close()
    wait_for(lambda: not cmdlines_containing(f"sleep {token}"), timeout=5, what="no sleeps left")
    runner.join(5)


def test_timeout_kills_the_command(fanout):
    result = fanout.run("sleep 1234.75", timeout=0.3, workers="0,1")
    assert [r.error for r in result.values()] == ["timed out after 0.3 s"] * 2
    assert not result.ok
    wait_for(lambda: not cmdlines_containing("sleep 1234.75"), timeout=5, what="no sleeps left")


def test_shell_metacharacters_run_literally(fanout):
    text = "printf '%s|' \"it's\" 'a \"b\"' \"$(echo sub)\" 'x;y'; echo; echo one; echo 'two\nlines'"
    local = subprocess.run(["bash", "-c", text], capture_output=True, text=True, check=True).stdout
    result = fanout.run(text)
    assert {r.stdout for r in result.values()} == {local}
    built = command("printf", "%s\n", "$(id)", "a;b", "'q'", "new\nline")
    assert fanout.run(built, workers="0")[0].stdout == "$(id)\na;b\n'q'\nnew\nline\n"


def test_secret_never_in_output_or_argv(fanout, tmp_path):
    value = "s3cr3t-v4lue-9f8e"
    gate = tmp_path / "go"
    seen: dict[str, object] = {}

    def run():
        seen["result"] = fanout.run(
            f'echo "token=$TOKEN plain=$PLAIN"; while [ ! -e {gate} ]; do sleep 0.02; done; '
            'printf "%s" "$TOKEN" | wc -c',
            env={"PLAIN": "visible"}, secrets={"TOKEN": Secret(value)},
        )

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    wait_for(lambda: len(cmdlines_containing(str(gate))) >= WORKERS, what="commands running")
    assert cmdlines_containing(value) == []
    gate.touch()
    runner.join(10)
    result = seen["result"]
    assert all(r.stdout == f"token=*** plain=visible\n{len(value)}\n" for r in result.values())
    assert value not in result.details()


def test_put_and_get(fanout, tmp_path):
    fanout.put(b"payload\n", "~/shipped/file.txt", mode=0o600)
    assert {r.stdout for r in fanout.run("stat -c %a ~/shipped/file.txt").values()} == {"600\n"}
    paths = fanout.get("~/shipped/file.txt".replace("~", "/root"), tmp_path / "got", workers="0,3")
    assert sorted(paths) == [0, 3]
    assert Path(paths[3]).read_bytes() == b"payload\n"


def test_setup_runs_once_then_skips(fanout, tmp_path):
    script = b"#!/bin/sh\necho setting up\necho run >> \"$HOME/setup-count\"\n"
    first, outcomes = run_setup(fanout, script)
    assert {o.status for o in outcomes.values()} == {"ran"}
    assert all("setting up" in r.stdout for r in first.values())
    _, again = run_setup(fanout, script)
    assert {o.status for o in again.values()} == {"skipped"}
    assert {r.stdout for r in fanout.run("wc -l < ~/setup-count").values()} == {"1\n"}
    _, forced = run_setup(fanout, script, force=True, workers="0")
    assert forced[0].status == "ran"
    logs = fanout.run(f"cat {outcomes[1].log}", workers="1")
    assert "setting up" in logs[1].stdout
    with pytest.raises(FanoutError, match="setup"):
        run_setup(fanout, b"#!/bin/sh\nexit 7\n", workers="0")


def test_host_key_pinning(pool, tmp_path):
    known = KnownHosts(tmp_path / "kh")
    other = tmp_path / "other"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    wrong = " ".join(other.with_suffix(".pub").read_text().split()[:2])
    real = " ".join(Path(f"{pool.host_key(f'{SUBNET}.2')}.pub").read_text().split()[:2])
    known.pin("node-p", {0: wrong, 1: real})
    with Fanout(targets(pool, node="node-p", count=3), known_hosts=known) as fan:
        result = fan.run("true")
    assert result[1].ok and result[2].ok  # pinned from the API, and trusted on first use
    assert "differs from the one pinned" in result[0].error
    assert "tpufab known-hosts forget node-p" in result[0].error
    assert known.lookup(alias("node-p", 2)), "worker 2 was learned on first use"
    # A recreated node has a new id: it starts fresh, with no error.
    with Fanout(targets(pool, node="node-q", count=1), known_hosts=known) as fan:
        assert fan.run("true").ok
    assert known.forget("node-p") == 3
    with Fanout(targets(pool, node="node-p", count=1), known_hosts=known) as fan:
        assert fan.run("true").ok


def test_known_hosts_file_rules(tmp_path):
    known = KnownHosts(tmp_path / "kh")
    key = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl"
    known.pin("n1", {0: key})
    known.pin("n1", {0: key})  # same key again: a no-op
    assert (tmp_path / "kh").read_text() == f"{alias('n1', 0)} {key}\n"
    assert oct((tmp_path / "kh").stat().st_mode & 0o777) == "0o600"
    other = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIBm3b6+2ZgTzGmcsL+6V4C3t8rZ2Yq1Q6ZcK7zqj8wqz"
    with pytest.raises(HostKeyChanged, match=str(tmp_path / "kh")):
        known.pin("n1", {0: other})
    known.pin("n2", {0: other})
    assert known.forget("n1") == 1 and known.forget("n1") == 0
    assert "HostKeyAlias=tpufab-n2-w0" in known.ssh_options(alias("n2", 0))


def test_stdin_larger_than_a_pipe_is_streamed_through(fanout):
    data = bytes(range(256)) * 4096  # 1 MiB: far past the 64 KiB pipe buffer, both ways
    result = fanout.run("cat", stdin=data, workers="0,1")
    assert all(r.ok and r.stdout_bytes == data for r in result.values())
    assert fanout.run("wc -c", stdin="abc", workers="2")[2].stdout.strip() == "3"
