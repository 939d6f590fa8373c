"""Fan-out over real SSH, on simulated pod workers (tpufab.sim.workers.WorkerPool).

Each worker is a real sshd in its own PID/mount/UTS namespace with its own home, host key and
hostname; "ps on a worker" is the command lines of the processes in its namespace.
"""

from __future__ import annotations

import gc
import io
import os
import re
import shutil
import signal
import subprocess
import threading
from pathlib import Path

import pytest
from harness import SimPod, needs_root
from helpers import wait_for

from tpufab.errors import TpufabError
from tpufab.quoting import Secret, command
from tpufab.ssh.fanout import Fanout
from tpufab.ssh.hostkeys import HostKeyChanged, KnownHosts, alias
from tpufab.ssh.results import FanoutError, FanoutInterrupted, LineCallback
from tpufab.ssh.transfer import _sftp
from tpufab.steps.host.setup import run_setup
from tpufab.views.live import LiveView, print_gathered

pytestmark = [pytest.mark.sim, pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("unshare") or not os.path.exists("/usr/sbin/sshd"),
    reason="needs root, unshare and sshd for the simulated workers",
)]
WORKERS = 4
USER = "tpu"



@pytest.fixture(scope="module")
@needs_root
def pod(tmp_path_factory):
    pod = SimPod(tmp_path_factory.mktemp("pod"), WORKERS, "7700000000000000001", user=USER,
                 accelerators=("/dev/accel0",), connect=False)
    try:
        yield pod
    finally:
        pod.close()


@pytest.fixture
def fanout(pod, tmp_path):
    with Fanout(pod.targets(), known_hosts=KnownHosts(tmp_path / "known_hosts")) as fan:
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


def test_failing_and_unreachable_workers_reported_while_others_complete(pod, tmp_path):
    fail_third = 'set -- $SSH_CONNECTION; case $3 in *.3) echo bad >&2; exit 3;; esac; echo fine'
    with Fanout(
        pod.targets(extra=[f"{pod.subnet}.99"]), known_hosts=KnownHosts(tmp_path / "kh"),
        connect_attempts=2, retry_wait=(0.01, 0.02),
    ) as fan:
        result = fan.run(fail_third)
        assert sorted(result.failed) == [2, 4] and sorted(result.succeeded) == [0, 1, 3]
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


def test_transient_connection_failure_is_retried(pod, tmp_path):
    pod.pool.set_reachable(pod.node_id, 1, False)  # nothing listens: connection refused
    attempts = []

    def reopen_after_first_failure(target, attempt, error):
        attempts.append((target.worker, attempt, type(error).__name__))
        pod.pool.set_reachable(pod.node_id, 1, True)  # returns once sshd listens again

    try:
        with Fanout(pod.targets(), known_hosts=KnownHosts(tmp_path / "kh"),
                    retry_wait=(0.01, 0.05), on_retry=reopen_after_first_failure) as fan:
            result = fan.run("echo up", workers="1")
        assert result[1].ok and result[1].stdout == "up\n"
        assert attempts == [(1, 1, "ConnectionRefusedError")]
    finally:
        pod.pool.set_reachable(pod.node_id, 1, True)


def test_ctrl_c_of_one_run_does_not_cancel_another_runs_connects(pod, tmp_path):
    """Two commands on one set of connections (as a connection keeper serves them): the
    first one's Ctrl-C stops its own connect retries, not the second's."""
    pod.pool.set_reachable(pod.node_id, 1, False)  # nothing listens: connection refused
    retries = []
    results: dict[str, object] = {}

    def run(label: str, fan: Fanout, cancel=None) -> None:
        try:
            results[label] = fan.run("echo up", workers="1", cancel=cancel)
        except FanoutInterrupted as err:
            results[label] = err

    try:
        with Fanout(pod.targets(), known_hosts=KnownHosts(tmp_path / "kh"), connect_attempts=30,
                    retry_wait=(0.05, 0.2),
                    on_retry=lambda target, attempt, error: retries.append(attempt)) as fan:
            ctrl_c = threading.Event()
            first = threading.Thread(target=run, args=("first", fan, ctrl_c), daemon=True)
            second = threading.Thread(target=run, args=("second", fan), daemon=True)
            first.start()
            second.start()
            wait_for(lambda: retries, 30, 0.02, "a connect retry")
            ctrl_c.set()
            first.join(30)
            assert isinstance(results["first"], FanoutInterrupted)
            seen = len(retries)
            # the second command keeps retrying (it is not interrupted) ...
            wait_for(lambda: len(retries) > seen + 1 or "second" in results, 30, 0.02,
                     "the second command's next retry")
            assert "second" not in results, results["second"][1].error
            pod.pool.set_reachable(pod.node_id, 1, True)
            second.join(60)
        # ... and gets its worker's result once the worker listens again
        assert results["second"][1].ok and results["second"][1].stdout == "up\n"
    finally:
        pod.pool.set_reachable(pod.node_id, 1, True)


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


def test_ctrl_c_leaves_no_remote_process(pod, fanout, sigint_raises):
    token = "1234.25"

    def interrupt_when_running():
        wait_for(lambda: all(n >= 2 for n in pod.running(f"sleep {token}").values()),
                 what="two sleeps on every worker")
        os.kill(os.getpid(), signal.SIGINT)

    interrupter = threading.Thread(target=interrupt_when_running, daemon=True)
    interrupter.start()
    # Per worker: a sleep in the foreground, and one setsid'ed out of the process group.
    with pytest.raises(FanoutInterrupted) as err:
        fanout.run(f"setsid sleep {token} & sleep {token}; echo never")
    interrupter.join()
    assert err.value.exit_code == 130
    assert isinstance(err.value, TpufabError)
    assert all(r.error == "interrupted" for r in err.value.result.values())
    # The run returns only after every worker confirmed: ps on each worker shows nothing left.
    assert pod.running(f"sleep {token}") == {w: 0 for w in range(WORKERS)}
    assert fanout.run("echo still here").ok  # the connections survive


def test_closing_connections_kills_remote_commands(pod, fanout):
    token = "1234.5"
    runner = threading.Thread(target=lambda: fanout.run(f"sleep {token}"), daemon=True)
    runner.start()
    wait_for(lambda: all(pod.running(f"sleep {token}").values()), what="a sleep on every worker")
    fanout.close()
    wait_for(lambda: not any(pod.running(f"sleep {token}").values()), timeout=30,
             what="no sleeps left")
    runner.join(5)


def test_timeout_kills_the_command(pod, fanout):
    result = fanout.run("sleep 1234.75", timeout=0.3, workers="0,1")
    assert [r.error for r in result.values()] == ["timed out after 0.3 s"] * 2
    assert not result.ok
    assert not any(pod.running("sleep 1234.75").values())


def test_shell_metacharacters_run_literally(fanout):
    text = "printf '%s|' \"it's\" 'a \"b\"' \"$(echo sub)\" 'x;y'; echo; echo one; echo 'two\nlines'"
    local = subprocess.run(["bash", "-c", text], capture_output=True, text=True, check=True).stdout
    result = fanout.run(text)
    assert {r.stdout for r in result.values()} == {local}
    built = command("printf", "%s\n", "$(id)", "a;b", "'q'", "new\nline")
    assert fanout.run(built, workers="0")[0].stdout == "$(id)\na;b\n'q'\nnew\nline\n"


def test_secret_never_in_output_or_argv(pod, fanout):
    value = "s3cr3t-v4lue-9f8e"
    gate = "/tmp/tpufab-test-go"  # each worker has its own /tmp
    seen: dict[str, object] = {}

    def run():
        seen["result"] = fanout.run(
            f'echo "token=$TOKEN plain=$PLAIN"; while [ ! -e {gate} ]; do sleep 0.02; done; '
            'printf "%s" "$TOKEN" | wc -c',
            env={"PLAIN": "visible"}, secrets={"TOKEN": Secret(value)},
        )

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    wait_for(lambda: all(pod.running(gate).values()), what="the command on every worker")
    for worker in range(WORKERS):
        assert not any(value in line for line in pod.ps(worker)), f"secret in ps on w{worker}"
    for worker in range(WORKERS):
        pod.pool.exec_in(pod.node_id, worker, ["touch", gate])
    runner.join(10)
    result = seen["result"]
    assert all(r.stdout == f"token=*** plain=visible\n{len(value)}\n" for r in result.values())
    assert value not in result.details()


def test_put_and_get(fanout, tmp_path):
    fanout.put(b"payload\n", "~/shipped/file.txt", mode=0o600)
    assert {r.stdout for r in fanout.run("stat -c %a ~/shipped/file.txt").values()} == {"600\n"}
    paths = fanout.get(f"/home/{USER}/shipped/file.txt", tmp_path / "got", workers="0,3")
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


def test_host_key_pinning(pod, tmp_path):
    known = KnownHosts(tmp_path / "kh")
    other = tmp_path / "other"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    wrong = " ".join(other.with_suffix(".pub").read_text().split()[:2])
    real = pod.pool.host_keys(pod.node_id)
    assert real[0] != real[1], "every worker has its own host key"
    known.pin("node-p", {0: wrong, 1: real[1]})  # as if from the API's guest attributes
    with Fanout(pod.targets("node-p")[:3], known_hosts=known) as fan:
        result = fan.run("true")
    assert result[1].ok and result[2].ok  # pinned from the API, and trusted on first use
    assert "differs from the one the cloud API published for it" in result[0].error
    assert "tpufab known-hosts forget node-p" in result[0].error
    assert known.lookup(alias("node-p", 2)) == [tuple(real[2].split())]
    # A recreated node has a new id: it starts fresh, with no error.
    with Fanout(pod.targets("node-q")[:1], known_hosts=known) as fan:
        assert fan.run("true").ok
    assert known.forget("node-p") == 3
    with Fanout(pod.targets("node-p")[:1], known_hosts=known) as fan:
        assert fan.run("true").ok


def test_known_hosts_file_rules(tmp_path):
    known = KnownHosts(tmp_path / "kh")
    key = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl"
    known.pin("n1", {0: key})
    known.pin("n1", {0: key})  # same key again: a no-op
    # a pin is what the API published: the line says so (the sentence of a change names it)
    assert (tmp_path / "kh").read_text() == f"{alias('n1', 0)} {key} from-cloud-api\n"
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


def test_a_failing_output_sink_stops_the_command(pod, fanout):
    class ClosedPipe:
        def lines(self, worker, stream, data):
            raise BrokenPipeError(32, "Broken pipe")

        def done(self, result):
            pass

    result = fanout.run("echo first; exec sleep 1234.875", sink=ClosedPipe(), workers="0,1")
    assert all(r.error.startswith("stopped: writing its output failed (BrokenPipeError")
               for r in result.values())
    assert not any(pod.running("sleep 1234.875").values())
    assert fanout.run("echo fine", workers="0,1").ok


def test_open_first_then_run(pod, tmp_path):
    with Fanout(pod.targets(), known_hosts=KnownHosts(tmp_path / "kh")) as fan:
        opened = fan.open(workers="0,1")
        assert opened.ok and list(opened) == [0, 1]
        assert fan.links[0].ready and not fan.links[2].ready
        assert {r.stdout for r in fan.run("echo ok").values()} == {"ok\n"}


def test_system_ssh_shares_the_pins(pod, tmp_path):
    known = KnownHosts(tmp_path / "kh")
    name = alias("node-s", 0)
    real = pod.pool.host_keys(pod.node_id)

    def ssh(worker):
        argv = ["ssh", "-F", "/dev/null", *known.ssh_options(alias("node-s", worker)),
                "-i", str(pod.key), "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes",
                f"{USER}@{pod.specs[worker].ip}", "echo", "hi"]
        return subprocess.run(argv, capture_output=True, text=True, timeout=30)

    assert ssh(0).stdout == "hi\n"  # first use pins, in tpufab's file, under the alias
    assert known.lookup(name) == [tuple(real[0].split())]
    with Fanout(pod.targets("node-s")[:1], known_hosts=known) as fan:
        assert fan.run("true").ok  # the fan-out accepts what ssh pinned
    known.pin("node-s", {1: real[0]})  # a wrong key for worker 1
    refused = ssh(1)
    assert refused.returncode != 0 and "hi" not in refused.stdout


# --- the engine at scale, small: 16 workers over 2 client processes ------------------------

SPREAD = 16


@pytest.fixture(scope="module")
@needs_root
def spread_pod(tmp_path_factory):
    pod = SimPod(tmp_path_factory.mktemp("spread"), SPREAD, "7700000000000000016", user=USER,
                 accelerators=("/dev/accel0",), connect=False)
    try:
        yield pod
    finally:
        pod.close()


@pytest.fixture
def spread(spread_pod, tmp_path):
    with Fanout(spread_pod.targets(), known_hosts=KnownHosts(tmp_path / "kh"),
                processes=2) as fan:
        assert set(fan.owner.values()) == {0, 1}
        yield fan


def test_two_processes_give_every_worker_its_result_and_order(spread):
    out = io.BytesIO()
    result = spread.run("seq 1 2000; echo done >&2", one_shot=True,
                        sink=LiveView(out, io.BytesIO(), color=False, workers=spread.workers))
    assert sorted(result) == list(range(SPREAD)) and result.ok
    assert {r.stdout for r in result.values()} == {"".join(f"{i}\n" for i in range(1, 2001))}
    assert {r.stderr for r in result.values()} == {"done\n"}
    per_worker: dict[int, list[int]] = {}
    for line in out.getvalue().decode().splitlines():
        match = re.fullmatch(r"w(\d+) +│ (\d+)", line)
        assert match, line
        per_worker.setdefault(int(match.group(1)), []).append(int(match.group(2)))
    assert per_worker == {w: list(range(1, 2001)) for w in range(SPREAD)}
    # warm now: the agent path, through the child process too
    again = spread.run(["printf", "%s", "$x"], workers="0,15")
    assert {w: r.stdout for w, r in again.items()} == {0: "$x", 15: "$x"}


def test_two_processes_mask_secrets_and_keep_them_off_argv(spread_pod, spread):
    value = "s3cr3t-spread-1a2b"
    seen: dict[str, object] = {}
    gate = "/tmp/tpufab-spread-go"

    def run():
        seen["result"] = spread.run(
            f'echo "token=$TOKEN"; while [ ! -e {gate} ]; do sleep 0.02; done',
            secrets={"TOKEN": Secret(value)}, workers="7-8")

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    wait_for(lambda: all(spread_pod.running(gate)[w] for w in (7, 8)), what="both commands")
    assert not any(value in line for w in (7, 8) for line in spread_pod.ps(w))
    for w in (7, 8):
        spread_pod.pool.exec_in(spread_pod.node_id, w, ["touch", gate])
    runner.join(10)
    result = seen["result"]
    assert {w: r.stdout for w, r in result.items()} == {7: "token=***\n", 8: "token=***\n"}


def test_two_processes_ctrl_c_leaves_nothing(spread_pod, spread, sigint_raises):
    token = "4321.25"

    def interrupt_when_running():
        wait_for(lambda: all(n >= 2 for n in spread_pod.running(f"sleep {token}").values()),
                 what="two sleeps on every worker")
        os.kill(os.getpid(), signal.SIGINT)

    interrupter = threading.Thread(target=interrupt_when_running, daemon=True)
    interrupter.start()
    with pytest.raises(FanoutInterrupted) as err:   # cold: the one-shot path everywhere
        spread.run(f"setsid sleep {token} & sleep {token}; echo never", one_shot=True)
    interrupter.join()
    assert err.value.exit_code == 130
    assert {r.error for r in err.value.result.values()} == {"interrupted"}
    assert spread_pod.running(f"sleep {token}") == {w: 0 for w in range(SPREAD)}
    assert spread.run("echo still here").ok


def test_two_processes_enforce_timeouts_on_both_paths(spread_pod, spread):
    cold = spread.run("sleep 4321.5", timeout=0.5, one_shot=True, workers="0,15")
    warm = spread.run("sleep 4321.5", timeout=0.5, workers="0,15")
    for result in (cold, warm):
        assert [r.error for r in result.values()] == ["timed out after 0.5 s"] * 2
    assert not any(spread_pod.running("sleep 4321.5").values())


@pytest.mark.parametrize("transport", ["libssh2", "paramiko"])
def test_both_ssh_transports_give_the_same_results(pod, tmp_path, transport):
    """libssh2 (the default where ssh2-python imports) and paramiko: the one-shot path, the
    agent with stdin larger than a window, a timeout's kill, and SFTP (paramiko's, beside a
    libssh2 connection)."""
    with Fanout(pod.targets(), known_hosts=KnownHosts(tmp_path / "kh"),
                ssh_transport=transport) as fan:
        one = fan.run("echo out $((6*7)); echo err >&2; exit 3", one_shot=True)
        assert {(r.exit_code, r.stdout, r.stderr) for r in one.values()} == {(3, "out 42\n", "err\n")}
        used = type(fan.links[0].conn.transport).__module__
        assert used == ("tpufab.ssh.transport" if transport == "libssh2" else "paramiko.transport")
        big = fan.run("cat | wc -c; seq 200000 | tail -1", stdin=b"x" * 3_000_000)
        assert {r.stdout for r in big.values()} == {"3000000\n200000\n"}
        timed = fan.run("sleep 30; echo never", timeout=1, workers="0")
        assert timed[0].error == "timed out after 1 s" and "never" not in timed[0].stdout
        fan.put(b"both ways\n", "/tmp/transport-check", workers="1")
        sftp = _sftp(fan, 1)  # what tpufab put/get of trees use
        with sftp.open("/tmp/transport-check") as fh:
            assert fh.read() == b"both ways\n"
        sftp.close()
        assert type(fan.transport(1)).__module__ == "paramiko.transport"


@pytest.mark.parametrize("transport", ["libssh2", "paramiko"])
def test_one_shot_commands_start_everywhere_one_handshake_at_a_time(pod, tmp_path, transport):
    """``concurrency`` bounds handshakes, not running commands: with one handshake at a time a
    long one-shot command still runs on every worker at once (the thread that reads it hands
    the next workers on). A command that outlives libssh2's wait in C (``settle``) is read to
    its end as any other."""
    def fanout():
        return Fanout(pod.targets(), known_hosts=KnownHosts(tmp_path / "kh"), concurrency=1,
                      ssh_transport=transport)

    with fanout() as fan:
        late = fan.run("echo first; sleep 0.3; echo second >&2; exit 4", one_shot=True)
        assert {(r.exit_code, r.stdout, r.stderr) for r in late.values()} == \
            {(4, "first\n", "second\n")}
    with fanout() as fan:  # more output at once than the channel's window (2 MiB in libssh2)
        big = fan.run("head -c 5000000 /dev/zero | tr '\\0' x; echo end >&2", one_shot=True)
        assert {(r.exit_code, len(r.stdout), r.stdout.strip("x"), r.stderr)
                for r in big.values()} == {(0, 5_000_000, "", "end\n")}
    token = "4321.25"
    with fanout() as fan:  # fresh connections: the one-shot path is a connection's first command
        runner = threading.Thread(target=lambda: fan.run(f"sleep {token}", one_shot=True),
                                  daemon=True)
        runner.start()
        wait_for(lambda: all(pod.running(f"sleep {token}").values()),
                 what="the sleep running on every worker at once")
    # Closing the connections ends each wrapper's stdin: it stops its sleep.
    wait_for(lambda: not any(pod.running(f"sleep {token}").values()), timeout=30,
             what="no sleep left")
    runner.join(10)
    assert not runner.is_alive()


@pytest.mark.parametrize("transport", ["libssh2", "paramiko"])
def test_a_one_shot_command_s_first_lines_stream_while_it_runs_on(pod, tmp_path, transport):
    """libssh2 waits for a fresh one-shot command in C for its first 0.1 s (``settle``): a
    line printed after that is shown at once, not when the command ends, and a Ctrl-C (here:
    closing the fan-out) still stops it."""
    seen: list[tuple[int, str]] = []
    token = "4321.375"
    fan = Fanout(pod.targets(), known_hosts=KnownHosts(tmp_path / "kh"), ssh_transport=transport)
    runner = threading.Thread(target=lambda: fan.run(
        f"sleep 0.3; echo first; exec sleep {token}", one_shot=True,
        sink=LineCallback(lambda w, _stream, line: seen.append((w, line)))), daemon=True)
    runner.start()
    try:
        wait_for(lambda: sorted(seen) == [(w, "first") for w in range(len(pod.targets()))], 30,
                 what=lambda: f"every worker's first line while its sleep runs (seen {seen})")
        assert all(pod.running(f"sleep {token}").values())
    finally:
        fan.close()
    wait_for(lambda: not any(pod.running(f"sleep {token}").values()), timeout=30,
             what="no sleep left")
    runner.join(10)
    assert not runner.is_alive()


class _EarlyDrive:
    """A one-shot channel whose ``drive`` comes back before the exit status, as libssh2's does
    after any read of the socket (the exit status read, the worker's close not yet): a race
    a 1,024-worker benchmark met once. Counts the EOFs the fan-out sent it (its stop)."""

    def __init__(self, early: int):
        from tpufab.ssh.transport import _Stream

        self.early = early  # drives of the status that come back without it
        self.in_buffer, self.in_stderr_buffer = _Stream(), _Stream()
        self.status_event = threading.Event()
        self.eof_received, self.closed, self.exit_status = True, False, -1
        self.shut = 0

    def open_session(self, timeout=None):
        return self

    def exec_command(self, line):
        pass

    def sendall(self, data):
        pass

    def settle(self, seconds):
        return False

    def recv_ready(self):
        return False

    recv_stderr_ready = recv_ready

    def close(self):
        self.closed = True

    def shutdown_write(self):
        self.shut += 1

    def drive(self, event, timeout):
        if event is self.status_event:
            if self.early:
                self.early -= 1
                return False
            self.exit_status = 0
            event.set()
        return True


@pytest.mark.parametrize("timeout", [None, 30.0])
def test_a_one_shot_command_is_not_stopped_when_the_wait_for_its_status_comes_back_early(timeout):
    """Only the deadline stops a one-shot command: a wait that comes back before the exit
    status (libssh2's) must neither kill it nor report it timed out (with no timeout set it
    was reported as "connection failed: unsupported format string ...")."""
    from tpufab.ssh.channels.agent_protocol import Task
    from tpufab.ssh.channels.oneshot import Plain

    chan = _EarlyDrive(early=3)
    task = Task(1, 0, None, [])
    Plain(chan, task, "true", 5).serve(timeout)
    assert (task.result.exit_code, task.result.error, chan.shut) == (0, None, 0)


def _libssh2_channels() -> int:
    """libssh2 channels alive in this process (ssh2-python's Channel objects)."""
    return sum(1 for o in gc.get_objects() if type(o).__module__ == "ssh2.channel")


def test_a_libssh2_channel_is_freed_when_it_ends_not_by_the_garbage_collector(pod, tmp_path):
    """libssh2 sessions are not thread-safe: a channel freed by the garbage collector, in
    whatever thread runs it, would change its session while the connection's pump reads it.
    So an ended channel is freed at once, under the connection's lock, even while the objects
    that used it wait in a reference cycle."""
    gc.collect()
    before = _libssh2_channels()
    gc.disable()
    try:
        with Fanout(pod.targets(), known_hosts=KnownHosts(tmp_path / "kh"),
                    ssh_transport="libssh2") as fan:
            assert fan.run("true", one_shot=True).ok
            assert _libssh2_channels() == before      # one-shot: ended, gone
            assert fan.run(["printf", "%s", "a"]).ok  # the agent's channel stays, one a worker
            assert _libssh2_channels() == before + len(pod.targets())
        # closed: each connection's pump ends its channels as it stops
        wait_for(lambda: _libssh2_channels() == before, timeout=30, what="the agents' channels freed")
    finally:
        gc.enable()


def test_an_unknown_ssh_transport_is_refused(pod, tmp_path):
    with pytest.raises(ValueError, match="ssh_transport must be one of auto, libssh2, paramiko"):
        Fanout(pod.targets(), known_hosts=KnownHosts(tmp_path / "kh"), ssh_transport="openssh")


def test_libssh2_asks_for_the_pinned_host_key_type_first():
    from tpufab.ssh.transport import hostkey_preference

    assert hostkey_preference(("ssh-rsa",)).split(",")[:3] == ["rsa-sha2-512", "rsa-sha2-256",
                                                              "ssh-rsa"]
    assert hostkey_preference(()).split(",")[0] == "ssh-ed25519"
    assert hostkey_preference(("ecdsa-sha2-nistp256", "ssh-ed25519")).split(",")[:2] == \
        ["ecdsa-sha2-nistp256", "ssh-ed25519"]
