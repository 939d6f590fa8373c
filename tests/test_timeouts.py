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
from helpers import TPUFAB, in_worker, sim_node

# A verb as the CLI calls it (for flags the front doors do not declare yet).
CALL = ("import json, sys\n"
        "from tpufab.verbs import jobs, workers, data, status\n"
        "from tpufab.console import run\n"
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


def tpufab(*args: str, env: dict, timeout: float = 120):
    return subprocess.run([TPUFAB, *args], env=env, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


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
               files.get, launch.autostop):
        parameter = inspect.signature(fn).parameters.get("timeout")
        assert parameter is not None, fn.__name__
        assert parameter.kind is inspect.Parameter.KEYWORD_ONLY
        assert "timeout" in (fn.__doc__ or ""), f"{fn.__name__} does not document --timeout"
