"""A frozen worker is given up on within the timeout, named, without tracebacks; every verb
that waits takes a --timeout (issue 11, finding 8; `exec --timeout -1` of finding 12)."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
import time
from contextlib import contextmanager

import pytest
from harness import sim_node
from helpers import in_worker, tpufab, wait_for

# A verb as the CLI calls it (for flags the front doors do not declare yet).
CALL = ("import json, sys\n"
        "from tpufab.verbs import jobs, workers, data, status\n"
        "from tpufab.term.console import run\n"
        "family, verb = sys.argv[1].split('.')\n"
        "fn = getattr(globals()[family], verb)\n"
        "kw = json.loads(sys.argv[2])\n"
        "sys.exit(run(fn, *kw.pop('_args', []), **kw))\n")

SSHD_LISTENER = "ps -eo pid=,ppid=,comm= | awk '$2 == 1 && $3 == \"sshd\" {print $1}'"


def call(verb: str, env: dict, *args, **kwargs):
    kwargs["_args"] = list(args)
    return subprocess.run([sys.executable, "-c", CALL, verb, json.dumps(kwargs)], env=env,
                          capture_output=True, text=True, timeout=180,
                          stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def pod4(sim, tmp_path_factory):
    with sim_node(sim, tmp_path_factory, "frz", "v4-32") as pod:
        # the default connect timeout, as a user has it (the suite's 5 s would hide retries)
        pod.env["TPUFAB_CONNECT_TIMEOUT"] = "20"
        yield pod


@contextmanager
def frozen_sshd(sim, node, worker: int):
    """The worker's sshd listener stopped: TCP connections are accepted, never answered."""
    pid = in_worker(sim, node, worker, SSHD_LISTENER).split()[0]
    in_worker(sim, node, worker, f"kill -STOP {pid}")
    try:
        yield
    finally:
        in_worker(sim, node, worker, f"kill -CONT {pid}")


def no_traceback(result) -> None:
    text = result.stdout + result.stderr
    assert "Traceback" not in text and "paramiko" not in text, text


@pytest.mark.sim
def test_exec_gives_up_on_a_frozen_worker_within_its_timeout(sim, pod4):
    with frozen_sshd(sim, pod4.node, 2):
        began = time.monotonic()
        result = tpufab("exec", "--timeout", "5", "echo alive", env=pod4.env)
        took = time.monotonic() - began
    # before: 4 connection attempts of 20 s each (82 s), 8 paramiko tracebacks
    assert took < 25, took
    assert result.returncode != 0
    no_traceback(result)
    assert result.stdout.count("alive") == 3, result.stdout
    assert "w2" in result.stderr and "does not respond" in result.stderr, result.stderr


@pytest.mark.sim
def test_status_names_a_frozen_worker_within_its_timeout(sim, pod4):
    with frozen_sshd(sim, pod4.node, 1):
        began = time.monotonic()
        result = call("status.status", pod4.env, timeout=4)
        took = time.monotonic() - began
    assert took < 25, took
    assert result.returncode == 1, result.stdout + result.stderr
    no_traceback(result)
    row = next(line for line in result.stdout.splitlines() if line.startswith("w1 "))
    assert "does not respond" in row or "no answer" in row, result.stdout


SSHD_ALL = "ps -eo pid=,comm= | awk '$2 == \"sshd\" {print $1}'"


@pytest.mark.sim
def test_pod_status_honours_its_timeout_on_a_connection_already_open(sim, pod4):
    """Pod.status(timeout=...) reaches the fan-out call itself: a pod connected without any
    command timeout still gives up on a worker that froze mid-connection (issue 22, point 3)."""
    import dataclasses

    from tpufab import Pod

    settings = dataclasses.replace(pod4.settings, command_timeout=None)
    with Pod.from_settings(settings) as pod:
        assert pod.hosts.workers == [0, 1, 2, 3]   # the connections are open now
        assert pod.status(timeout=30).healthy
        pids = " ".join(in_worker(sim, pod4.node, 1, SSHD_ALL).split())
        in_worker(sim, pod4.node, 1, f"kill -STOP {pids}")
        try:
            began = time.monotonic()
            found = pod.status(timeout=3)
            took = time.monotonic() - began
        finally:
            in_worker(sim, pod4.node, 1, f"kill -CONT {pids}")
    # before: Pod.status took no timeout, and the open fan-out had none: it waited for ever
    assert took < 25, took
    assert found.unreachable == [1] and not found.healthy
    assert [r.label for r in found.folded] == ["w[0,2-3]", "w1"]
    assert "no answer" in found.folded[1].state or "timed out" in found.folded[1].state, \
        found.folded[1].state


@pytest.mark.sim
def test_waiting_for_a_port_gives_up_on_a_worker_that_froze_mid_probe(sim, pod4):
    """`run --wait-port`'s rounds (a port probe, then the run's status) each have a bound: a
    worker whose sshd freezes while the probe runs there ends the wait soon after
    --wait-timeout instead of holding it for ever (no command timeout set, as a user has it
    by default)."""
    import dataclasses
    import threading

    from tpufab import Pod
    from tpufab.steps.start import starting

    settings = dataclasses.replace(pod4.settings, command_timeout=None)
    answer: list = []
    with Pod.from_settings(settings) as pod:
        assert pod.hosts.workers == [0, 1, 2, 3]
        began = time.monotonic()
        waiting = threading.Thread(target=lambda: answer.append(starting.wait_port(
            pod.fanout, "no-such-run", 9, worker=1, timeout=3, probe=2, slack=1)), daemon=True)
        waiting.start()
        probing = "pgrep -f 'ports[.]py wait'"   # [.]: not this pgrep's own sh
        wait_for(lambda: in_worker(sim, pod4.node, 1, probing, check=False).strip(),
                 timeout=30)
        pids = " ".join(in_worker(sim, pod4.node, 1, SSHD_ALL).split())
        in_worker(sim, pod4.node, 1, f"kill -STOP {pids}")
        try:
            waiting.join(60)   # before: the probe had no bound, the wait never ended
            took = time.monotonic() - began
        finally:
            in_worker(sim, pod4.node, 1, f"kill -CONT {pids}")
    assert answer, f"wait_port still waiting after {took:.0f} s on a frozen worker"
    ok, why = answer[0]
    # its bound (wait_port's docstring: 3 + 2 + 4 * 1 + 8 = 17 s), and a margin
    assert not ok and took < 17 + 5, (took, why)
    assert why.startswith("port 9 did not answer on w1 within 3 s"), why


@pytest.mark.sim
def test_a_hung_command_is_stopped_at_the_timeout_and_named(sim, pod4):
    hang = 'case "$(hostname)" in *-w-3) kill -STOP $$ ;; esac; echo fine'
    began = time.monotonic()
    result = tpufab("exec", "--timeout", "3", hang, env=pod4.env)
    assert time.monotonic() - began < 25
    assert result.returncode != 0
    no_traceback(result)
    assert "w3 timed out after 3 s" in result.stderr, result.stderr
    assert result.stdout.count("fine") == 3
    # the next command works on every worker
    again = tpufab("exec", "echo again", env=pod4.env)
    assert again.returncode == 0 and again.stdout.count("again") == 4


STUCK = "~/.cache/tpufab/mounts/stuck.json"   # a FIFO: reading the mount records hangs there
UMOUNT_API = """
import sys, time
from tpufab import Pod
from tpufab.errors import TpufabError
began = time.monotonic()
try:
    Pod().umount(timeout=3)
except TpufabError as err:
    print(round(time.monotonic() - began), err.message, " ".join(err.details.split()))
"""


@pytest.mark.sim
def test_umount_honours_its_timeout_from_the_verb_and_the_api(sim, pod4):
    made = tpufab("exec", "-w", "1", f"mkdir -p ~/.cache/tpufab/mounts && mkfifo {STUCK}",
                  env=pod4.env)
    assert made.returncode == 0, made.stderr
    try:
        began = time.monotonic()
        result = tpufab("umount", "--timeout", "3", env=pod4.env)
        assert time.monotonic() - began < 25
        assert result.returncode != 0
        no_traceback(result)
        assert "w1" in result.stderr and "timed out" in result.stderr, result.stderr
        # the Python API takes the same timeout, under the same name (Pod.umount(timeout=))
        api = subprocess.run([sys.executable, "-c", UMOUNT_API], env=pod4.env,
                             capture_output=True, text=True, timeout=120,
                             stdin=subprocess.DEVNULL)
        no_traceback(api)
        took, _, message = api.stdout.partition(" ")
        assert int(took) < 20 and "w1" in message and "timed out" in message, api.stdout
    finally:
        tpufab("exec", "-w", "1", f"rm -f {STUCK}", env=pod4.env)


@pytest.mark.parametrize("value", ["-1", "0", "nan"])
def test_a_timeout_that_is_not_positive_is_refused(value, tmp_path):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "TPUFAB_PROJECT": "p",
           "TPUFAB_NAME": "pod"}
    result = tpufab("exec", "--timeout", value, "true", env=env)
    # before: accepted. Negative and NaN stop at the front door (its usage error), 0 at the verb
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert "Invalid value for '--timeout'" in result.stderr \
        or "--timeout takes a number of seconds above 0" in result.stderr, result.stderr


def test_the_verb_refuses_a_timeout_that_is_not_positive_in_one_sentence():
    from tpufab.errors import ConfigError
    from tpufab.verbs.common import check_timeout

    for value in (-1, 0, float("nan"), "soon"):
        with pytest.raises(ConfigError, match=r"^--timeout takes a number of seconds above 0"):
            check_timeout(value)
    assert check_timeout(None) is None and check_timeout("2.5") == 2.5


def test_every_verb_that_waits_has_a_timeout_with_a_default():
    from tpufab.verbs import data, files, jobs, launch, status, workers

    for fn in (workers.exec_, workers.setup, data.deploy, data.mount, data.umount, jobs.run,
               jobs.logs, jobs.runs, jobs.kill, status.status, status.babysit, files.put,
               files.get, files.forward, launch.autostop):
        parameter = inspect.signature(fn).parameters.get("timeout")
        assert parameter is not None, fn.__name__
        assert parameter.kind is inspect.Parameter.KEYWORD_ONLY
        assert "timeout" in (fn.__doc__ or ""), f"{fn.__name__} does not document --timeout"


@pytest.mark.sim
def test_check_quick_gives_up_on_a_frozen_worker_within_its_timeout(sim, pod4):
    with frozen_sshd(sim, pod4.node, 2):
        began = time.monotonic()
        result = tpufab("check", "--quick", "--timeout", "2", env=pod4.env)
        took = time.monotonic() - began
    # before: 20 s and more (the default connect timeout, whatever --timeout said); now 2 s
    # and the start of the process (seconds on this busy machine)
    assert took < 18, (took, result.stdout + result.stderr)
    assert result.returncode == 1, result.stdout + result.stderr
    no_traceback(result)
    assert "w2" in result.stdout + result.stderr, result.stdout + result.stderr


@pytest.mark.sim
def test_forward_names_a_frozen_worker_within_its_timeout(sim, pod4):
    with frozen_sshd(sim, pod4.node, 1):
        began = time.monotonic()
        result = tpufab("forward", "18080", "-w", "1", "--timeout", "2", env=pod4.env)
        took = time.monotonic() - began
    # before: 20 s and more (there was no --timeout), and a sentence without the worker
    assert took < 18, (took, result.stderr)
    assert result.returncode != 0, result.stdout + result.stderr
    no_traceback(result)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "w1" in lines[0], result.stderr


def test_two_pods_sharing_connections_keep_their_own_timeouts(monkeypatch, tmp_path):
    """Two Pods of one node in one process share its connections (pod.connection.shared),
    not their timeouts: the second one's settings never change how long the first waits
    for a worker, nor its command timeout (issue 22: one road for each setting)."""
    import socket

    from tpufab.config import Settings
    from tpufab.hosts import connect as connection
    from tpufab.pod.api import Pod
    from tpufab.ssh.connections import Target
    from tpufab.ssh.fanout import Fanout
    from tpufab.ssh.hostkeys import KnownHosts

    silent = socket.create_server(("127.0.0.1", 0))  # a worker that never speaks SSH
    port = silent.getsockname()[1]
    fanout = Fanout([Target(0, "127.0.0.1", "user", port=port)], processes=1,
                    known_hosts=KnownHosts(tmp_path / "known_hosts"), connect_timeout=20.0,
                    connect_attempts=1)
    opened = connection.Hosts(settings=Settings(name="twin"), nodes=[], fanout=fanout)
    monkeypatch.setattr(connection, "_OPEN", {})
    monkeypatch.setattr(connection, "connect", lambda settings, **kw: opened)
    try:
        fast = Pod.from_settings(Settings(name="twin", project="p", connect_timeout=0.6))
        slow = Pod.from_settings(Settings(name="twin", project="p", connect_timeout=2.5,
                                          command_timeout=30.0))
        assert fast.hosts.nodes is slow.hosts.nodes  # one open pod, shared
        started = time.monotonic()
        result = fast.run("true", warn=True)
        took = time.monotonic() - started
        assert "no answer within 0.6 s" in result[0].error
        assert took < 2.4, f"the first Pod waited {took:.1f} s: the second Pod's timeout"
        assert "no answer within 2.5 s" in slow.run("true", warn=True)[0].error
        assert (fast.fanout.command_timeout, slow.fanout.command_timeout) == (None, 30.0)
        with pytest.raises(AttributeError):
            fast.fanout.connect_timeout = 5.0  # a Pod's view is its own, and fixed
    finally:
        fanout.close()
        silent.close()
