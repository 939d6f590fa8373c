"""The fan-out's pieces for large pods, as data: client-process shares, the fd budget and its
sentence, the kex order, folded failure details and folded errors in the live fold."""

from __future__ import annotations

import io
import resource

import pytest

from tpufab.errors import ConfigError
from tpufab.ssh.connections import kex_preference
from tpufab.ssh.limits import (
    WORKERS_PER_LIBSSH2_PROCESS,
    auto_processes,
    ensure_fds,
    fd_budget,
    shard_of,
)
from tpufab.ssh.results import GroupResult, WorkerResult
from tpufab.views.folding import FoldingView


def test_each_worker_belongs_to_one_process_in_contiguous_blocks():
    owner = shard_of(range(1024), 8)
    assert set(owner.values()) == set(range(8))
    sizes = [sum(1 for p in owner.values() if p == i) for i in range(8)]
    assert sizes == [128] * 8
    assert all(owner[w] <= owner[w + 1] for w in range(1023))  # blocks, not interleaved
    assert shard_of([5, 1, 9], 2) == {1: 0, 5: 0, 9: 1}
    assert shard_of([0, 1], 8) == {0: 0, 1: 1}  # never more processes than workers
    assert shard_of([], 4) == {}


@pytest.mark.parametrize(("workers", "cpus", "expected"), [
    (4, 8, 1), (255, 8, 1), (512, 8, 2), (1024, 8, 4), (4096, 8, 8), (1024, 2, 2), (64, 1, 1),
])
def test_automatic_processes_follow_size_and_cores(workers, cpus, expected):
    assert auto_processes(workers, cpus) == expected


@pytest.mark.parametrize(("workers", "cpus", "expected"), [
    (1024, 8, 1), (2047, 8, 1), (2048, 8, 2), (8192, 2, 2), (64, 1, 1),
])
def test_libssh2_keeps_a_thousand_workers_in_one_process(workers, cpus, expected):
    assert auto_processes(workers, cpus, WORKERS_PER_LIBSSH2_PROCESS) == expected


def test_the_cheapest_key_exchange_comes_first():
    offered = ("mlkem768x25519-sha256", "curve25519-sha256@libssh.org", "ecdh-sha2-nistp256",
               "diffie-hellman-group16-sha512")
    assert kex_preference(offered) == ("curve25519-sha256@libssh.org", "ecdh-sha2-nistp256",
                                       "mlkem768x25519-sha256", "diffie-hellman-group16-sha512")
    assert kex_preference(("diffie-hellman-group14-sha256",)) == ("diffie-hellman-group14-sha256",)


def test_fd_budget_raises_the_soft_limit_up_to_what_is_needed():
    set_to = []
    needed = fd_budget(1024, 1024)
    assert needed > 1024 * 3
    assert ensure_fds(needed, limits=(1024, 1 << 20),
                      setter=lambda which, pair: set_to.append((which, pair))) == needed
    assert set_to == [(resource.RLIMIT_NOFILE, (needed, 1 << 20))]
    assert ensure_fds(100, limits=(1024, 4096), setter=set_to.append) == 1024  # enough already
    assert len(set_to) == 1


def test_fd_budget_above_the_hard_limit_is_one_sentence_with_the_fix():
    with pytest.raises(ConfigError) as err:
        ensure_fds(5000, limits=(1024, 4096), setter=lambda *a: pytest.fail("raised anyway"))
    text = str(err.value)
    assert "5000" in text and "4096" in text and "ulimit -Hn 5000" in text
    assert "fanout_processes" in text and text.endswith(".") and "\n" not in text


def _results(outcomes):
    made = {}
    for w, (code, error) in enumerate(outcomes):
        made[w] = WorkerResult(w, exit_code=code, error=error, duration=0.01 * (w % 3 + 1))
    return GroupResult(made, "true")


def test_failure_details_fold_past_sixteen_workers():
    small = _results([(0, None), (1, None)])
    assert small.details().count("\n") == 1 and "w1" in small.details()
    many = _results([(0, None)] * 1000 + [(None, "connection refused")] * 24)
    rows = many.details().splitlines()
    assert len(rows) == 2
    assert rows[0].split()[0] == "w[0-999]" and "exit 0" in rows[0] and "median" in rows[0]
    assert rows[1].split()[0] == "w[1000-1023]" and "connection refused" in rows[1]
    assert many.summary() == "w[0-999] exit 0; w[1000-1023] connection refused"


def test_the_live_fold_shows_many_workers_errors_as_one_line():
    out = io.StringIO()
    now = [0.0]
    view = FoldingView(range(1024), out, clock=lambda: now[0]).start()
    for w in range(1024):
        view.lines(w, "stdout", b"same\n")
    for w in range(1000, 1024):
        view.done(WorkerResult(w, error="connection refused"))
    for w in range(1000):
        view.done(WorkerResult(w, exit_code=0))
    view.close()
    assert out.getvalue().splitlines() == ["same", "w[1000-1023]: connection refused"]


def test_a_fanout_too_big_for_the_fd_limit_says_so_before_connecting(tmp_path):
    import subprocess
    import sys

    script = (
        "import resource\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, 1024))\n"
        "from tpufab.ssh.fanout import Fanout, Target\n"
        "from tpufab.ssh.hostkeys import KnownHosts\n"
        "targets = [Target(i, '192.0.2.1', 'u') for i in range(2000)]\n"
        f"Fanout(targets, known_hosts=KnownHosts({str(tmp_path / 'kh')!r}), processes=1)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("tpufab.errors.ConfigError: Fanning out needs about")
    assert "hard limit is 1024" in last and "fanout_processes" in last
    small = script.replace("range(2000)", "range(100)")
    raised = subprocess.run([sys.executable, "-c", small + "print(resource.getrlimit("
                             "resource.RLIMIT_NOFILE)[0])"], capture_output=True, text=True,
                            timeout=60)
    assert raised.stdout.strip() == str(100 * 4 + 64)  # socket, eventfd, 2 spools: raised up front
