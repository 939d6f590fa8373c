"""Kept connections (tpufab.ssh.keeper): a background process per pod holds its SSH connections
between commands. One v4-16 (2 workers) for the module; every test keeps connections as tpufab
does by default, in its own environment (the rest of the suite turns keeping off), and every
keeper it starts is stopped at teardown.

The observable of "the same connection": each command prints, per worker, the pid of the sshd
session process its shell descends from (one per SSH connection, whatever channel runs it).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from harness import needs_root, sim_node
from helpers import (
    SESSION,
    TPUFAB,
    Running,
    in_worker,
    keepers,
    kept_connections,
    residents,
    same_twice,
    sessions_in,
    tpufab,
    unique_name,
    wait_for,
)

from tpufab.cloud import planes


@pytest.fixture(scope="module")
@needs_root
def node(sim, tmp_path_factory):
    with sim_node(sim, tmp_path_factory, "keep", type="v4-16") as found:
        yield found


@pytest.fixture
def kept(node):
    """The node's shell environment with kept connections as a user has them by default (no
    TPUFAB_KEEP_ALIVE: 5m), in a private runtime dir of its own; every keeper started under it
    is stopped afterwards."""
    with kept_connections(node.env) as env:
        yield env


def sockets(env: dict) -> list[Path]:
    """The keepers' sockets."""
    return sorted(p for p in (Path(env["XDG_RUNTIME_DIR"]) / "tpufab").glob("*.sock")
                  if not p.name.startswith("resident-"))


def resident_socket(env: dict) -> Path:
    """The one resident command server's socket, once it listens."""
    folder = Path(env["XDG_RUNTIME_DIR"]) / "tpufab"
    found = wait_for(lambda: sorted(folder.glob("resident-*.sock")), 60, 0.05,
                     "the resident command server to listen")
    assert len(found) == 1 and len(residents(env)) == 1, (found, residents(env))
    return found[0]


def sessions(env: dict, **extra: str) -> tuple[dict[int, int], subprocess.CompletedProcess]:
    """{worker: its sshd session pid} for one `tpufab exec`."""
    result = tpufab("exec", SESSION, env={**env, **extra}, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    found = sessions_in(result.stdout)
    assert sorted(found) == [0, 1], result.stdout
    return found, result


def kept_sessions(env: dict) -> dict[int, int]:
    """The sessions of two commands in a row over the same (kept) connections."""
    return same_twice(lambda: sessions(env)[0])


def one_keeper(env: dict) -> int:
    logs = Path(env["XDG_RUNTIME_DIR"]) / "tpufab"
    wait_for(lambda: len(keepers(env)) == 1, 30, 0.05,
             f"one keeper (now {keepers(env)}; in {logs}: "
             f"{[(p.name, p.read_text()[-2000:] if p.suffix == '.log' else '') for p in logs.iterdir()]})")
    return keepers(env)[0]


def sleeping(sim, node, token: str) -> dict[int, bool]:
    pattern = f"[{token[0]}]{token[1:]}"  # not this shell's own command line
    return {w: bool(in_worker(sim, node.node, w, f"pgrep -f '{pattern}' || true").strip())
            for w in (0, 1)}


@pytest.mark.sim
def test_a_second_command_runs_over_the_kept_connections(node, kept):
    first = kept_sessions(kept)                  # the same SSH connection on every worker
    pid = one_keeper(kept)
    [sock] = sockets(kept)
    assert oct(sock.stat().st_mode & 0o777) == "0o600"
    assert oct(sock.parent.stat().st_mode & 0o777) == "0o700"
    status = tpufab("status", env=kept, timeout=120)
    assert f"Connections: kept by pid {pid} (2 of 2 workers connected" in status.stdout, \
        status.stdout + status.stderr
    # keep_alive 0: every command connects itself (a new sshd session each time)
    off = {**kept, "TPUFAB_KEEP_ALIVE": "0"}
    a, _ = sessions(off)
    b, _ = sessions(off)
    assert a != first and b != a
    assert "Connections:" not in tpufab("status", env=off, timeout=120).stdout  # as before
    # --keep-alive on the command line wins over the environment
    outputs = []
    for _ in range(3):
        again = tpufab("--keep-alive", "5m", "exec", SESSION, env=off, timeout=120)
        outputs.append(again.stdout + again.stderr)
        if f"SESSION={first[0]}" in again.stdout:
            break
    else:
        pytest.fail(f"--keep-alive 5m did not use the kept connections: {outputs}")


def agents(sim, node) -> dict[int, bool]:
    """{worker: tpufab's agent runs there} (`python3 -I -S -c` with the loader)."""
    return {w: bool(in_worker(sim, node.node, w,
                              "pgrep -f -- '[p]ython3 -I -S -c' || true").strip())
            for w in (0, 1)}


@pytest.mark.sim
def test_after_a_command_the_keeper_starts_every_workers_agent(sim, node, kept):
    """The first command on a connection runs on a plain channel, without tpufab's agent;
    the keeper then starts the agents, so the second command finds them running (it no longer
    pays for starting them: docs/benchmarks.md, "Kept connections")."""
    wait_for(lambda: not any(agents(sim, node).values()), 30, 0.1,
             "the agents of earlier commands to end")
    sessions(kept)
    one_keeper(kept)
    wait_for(lambda: all(agents(sim, node).values()), 30, 0.1,
             "the keeper to start both workers' agents")
    off = {**kept, "TPUFAB_KEEP_ALIVE": "0"}      # a command of its own starts none after
    tpufab("disconnect", env=kept, timeout=60)
    wait_for(lambda: not any(agents(sim, node).values()), 30, 0.1,
             "the agents to end with the keeper")
    sessions(off)
    assert not any(agents(sim, node).values())


@pytest.mark.sim
def test_a_warm_command_does_not_ask_the_cloud_api(node, kept):
    first = kept_sessions(kept)
    one_keeper(kept)
    # the API unreachable (nothing listens there): a command through the keeper still runs
    # over the same connections, and never loads a cloud client
    down = {**kept, "TPUFAB_API_ENDPOINT": "http://127.0.0.1:9"}
    for _ in range(5):  # a loaded machine: the keeper may answer too late (see above)
        result = subprocess.run([sys.executable, "-X", "importtime", "-m", "tpufab.cli", "exec",
                                 SESSION], env=down, capture_output=True, text=True, timeout=120)
        if result.returncode == 0 and sessions_in(result.stdout) == first:
            break
    else:
        said = "\n".join(line for line in result.stderr.splitlines()
                         if not line.startswith("import time:"))
        pytest.fail(f"no command ran over the kept connections: {result.stdout}{said[-2000:]}")
    assert "google.cloud" not in result.stderr
    # other settings than the kept connections were made with: it asks the API (down here)
    other = tpufab("exec", SESSION, env={**down, "TPUFAB_SSH_USER": "someone-else"}, timeout=120)
    assert other.returncode != 0 and "SESSION=" not in other.stdout, other.stdout


def cmdline(pid: int) -> list[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as fh:
        return fh.read().decode().split("\0")


@pytest.mark.sim
def test_the_first_command_s_keeper_starts_while_it_asks_the_api_and_none_is_left_behind(
        node, kept):
    """The first command starts its keeper before asking the API (``FOLDER/-``: told its
    socket once the command knows it), so the keeper's start overlaps that lookup. A command
    that never needs it (the pod does not exist) leaves nothing running."""
    first = kept_sessions(kept)
    pid = one_keeper(kept)
    folder = os.path.join(kept["XDG_RUNTIME_DIR"], "tpufab")
    assert cmdline(pid)[-2] == os.path.join(folder, "-"), cmdline(pid)
    assert len(sockets(kept)) == 1 and kept_sessions(kept) == first
    tpufab("disconnect", env=kept, timeout=60)
    wait_for(lambda: not keepers(kept), 30, 0.05, "the keeper to stop")
    missing = tpufab("exec", "true", env={**kept, "TPUFAB_NAME": unique_name("nosuch")},
                     timeout=120)
    assert missing.returncode != 0 and "No TPU node or queued resource named" in \
        missing.stderr, missing.stderr
    wait_for(lambda: not keepers(kept), 30, 0.05, "the keeper started ahead to exit untold")
    assert sockets(kept) == []


@pytest.mark.sim
def test_a_keeper_started_ahead_and_never_told_its_socket_exits(kept, monkeypatch):
    from tpufab.ssh.keeper import client as keeper

    monkeypatch.setenv("XDG_RUNTIME_DIR", kept["XDG_RUNTIME_DIR"])
    ahead = keeper.prestart()
    assert ahead is not None
    wait_for(lambda: len(keepers(kept)) == 1, 30, 0.05, "the keeper started ahead")
    ahead.discard()
    wait_for(lambda: not keepers(kept), 30, 0.05, "the keeper started ahead to exit untold")
    assert sockets(kept) == []


@pytest.mark.sim
def test_a_warm_status_asks_the_api_through_the_keeper(node, kept):
    """`tpufab status` reports the API's state now (not the keeper's record of it), asked by
    the keeper whose client is loaded: the command itself loads no cloud client."""
    kept_sessions(kept)
    pid = one_keeper(kept)
    said = tpufab("sim", "maintenance", node.name, "--in", "2h", env=kept)
    assert said.returncode == 0, said.stderr
    try:
        for _ in range(5):  # a loaded machine: the keeper may answer too late (see above)
            result = subprocess.run([sys.executable, "-X", "importtime", "-m", "tpufab.cli",
                                     "status"], env=kept, capture_output=True, text=True,
                                    timeout=120)
            if "google.cloud" not in result.stderr:
                break
        else:
            pytest.fail(f"every status loaded the API's client: {result.stderr[-2000:]}")
        assert result.returncode == 0, result.stdout + result.stderr[-2000:]
        assert f"Maintenance ahead on {node.name}: SCHEDULED" in result.stdout, result.stdout
        assert f"Connections: kept by pid {pid} (2 of 2 workers connected" in result.stdout
    finally:
        cleared = tpufab("sim", "maintenance", node.name, "--clear", env=kept)
    assert cleared.returncode == 0, cleared.stderr
    # the window taken back: the next status says so (nothing of the last answer is kept)
    result = tpufab("status", env=kept, timeout=120)
    assert result.returncode == 0 and "Maintenance ahead" not in result.stdout, result.stdout


@pytest.mark.sim
def test_an_api_error_through_the_keeper_is_the_one_the_command_would_meet(node, kept,
                                                                         monkeypatch):
    from dataclasses import replace

    from tpufab.errors import NotFound
    from tpufab.hosts import connect as pods

    kept_sessions(kept)
    one_keeper(kept)
    monkeypatch.setenv("XDG_RUNTIME_DIR", kept["XDG_RUNTIME_DIR"])
    settings = replace(node.settings, keep_alive="5m")
    found = pods.kept_api(settings)
    assert found is not None
    pod, control = found
    try:
        assert pod.nodes[0].id == node.node.id
        with pytest.raises(NotFound) as through:
            control.get_node("nosuch-keeper")
        assert control._local is None          # the keeper answered, no client here
        with pytest.raises(NotFound) as direct:
            planes.control_plane(settings).get_node("nosuch-keeper")
        assert str(through.value) == str(direct.value)
        assert control.find_node(node.name).id == node.node.id
    finally:
        pods.forget(settings)


@pytest.mark.sim
def test_a_socket_with_the_wrong_mode_or_owner_is_not_used(node, kept):
    first = kept_sessions(kept)
    one_keeper(kept)
    [sock] = sockets(kept)
    sock.chmod(0o666)
    other, result = sessions(kept)
    assert other != first
    assert f"not using kept connections at {sock}: its mode is 0666, not 0600" in result.stderr
    sock.chmod(0o600)
    os.chown(sock, 65534, 65534)
    other, result = sessions(kept)
    assert other != first
    assert f"it is owned by uid 65534, not you (uid {os.getuid()})" in result.stderr
    os.chown(sock, 0, 0)
    sock.parent.chmod(0o755)
    other, result = sessions(kept)
    assert other != first and "its mode is 0755, not 0700" in result.stderr
    sock.parent.chmod(0o700)
    assert kept_sessions(kept) == first


ASK = """
import pickle, socket, struct, sys
s = socket.socket(socket.AF_UNIX)
s.settimeout(20)
s.connect(sys.argv[1])
data = pickle.dumps(("status",))
try:
    s.sendall(struct.pack(">I", len(data)) + data)
    print("ANSWERED" if s.recv(4) else "CLOSED")
except (ConnectionResetError, BrokenPipeError):
    print("CLOSED")
"""


@pytest.mark.sim
def test_the_keeper_answers_only_its_own_user(node, kept):
    sessions(kept)
    one_keeper(kept)
    [sock] = sockets(kept)
    mine = subprocess.run([sys.executable, "-c", ASK, str(sock)], capture_output=True,
                          text=True, timeout=60)
    assert mine.stdout.strip() == "ANSWERED", mine.stderr
    runtime = sock.parent.parent
    runtime.chmod(0o711)         # let another user reach it: the keeper still refuses them
    sock.parent.chmod(0o711)
    sock.chmod(0o666)
    try:
        other = subprocess.run(["/usr/bin/python3", "-I", "-c", ASK, str(sock)], capture_output=True,
                               text=True, timeout=60, user=65534, group=65534, cwd="/")
    finally:
        sock.chmod(0o600)
        sock.parent.chmod(0o700)
        runtime.chmod(0o700)
    assert other.stdout.strip() == "CLOSED", other.stdout + other.stderr


@pytest.mark.sim
def test_secrets_through_the_keeper_are_masked_and_exit_codes_kept(node, kept):
    first = kept_sessions(kept)
    value = "s3cr3t-keeper-9z"
    for _ in range(3):  # until one ran over the kept connections (a loaded machine: above)
        result = tpufab("exec", "-e", "MYTOKEN", "--secret", "MYTOKEN",
                        f"echo token=$MYTOKEN; {SESSION}; exit 3",
                        env={**kept, "MYTOKEN": value}, timeout=120)
        said = result.stdout + result.stderr
        assert result.returncode == 3, said
        assert value not in said and said.count("token=***") == 2, said
        if sessions_in(result.stdout) == first:
            break
    else:
        pytest.fail(f"no command ran over the kept connections: {said}")


@pytest.mark.sim
def test_the_keeper_exits_after_its_idle_time(node, kept):
    short = {**kept, "TPUFAB_KEEP_ALIVE": "2s"}
    sessions(short)
    pid = one_keeper(short)
    wait_for(lambda: pid not in keepers(short), 30, 0.1, "the idle keeper to exit")
    assert sockets(short) == []


@pytest.mark.sim
def test_a_hung_keeper_is_replaced_without_the_command_failing(node, kept):
    first = kept_sessions(kept)
    pid = one_keeper(kept)
    os.kill(pid, signal.SIGSTOP)                 # it accepts connections and never answers
    try:
        other, result = sessions(kept)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    assert other != first and "Traceback" not in result.stderr
    wait_for(lambda: pid not in keepers(kept), 30, 0.1, "the hung keeper to be stopped")
    kept_sessions(kept)                          # and a new one keeps the connections
    assert one_keeper(kept) != pid


@pytest.mark.sim
def test_ctrl_c_through_the_keeper_stops_the_workers_commands(sim, node, kept):
    kept_sessions(kept)
    pid = one_keeper(kept)
    token = unique_name("kc")
    proc = subprocess.Popen([TPUFAB, "exec", f"sleep 300 && echo {token}"], env=kept,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: all(sleeping(sim, node, token).values()), 60, 0.1,
                 "the command to run on both workers")
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out + err
    assert "Interrupted" in err, err
    assert sleeping(sim, node, token) == {0: False, 1: False}
    assert keepers(kept) == [pid]                # the keeper itself stays


@pytest.mark.sim
def test_killing_the_keeper_mid_command_says_to_run_it_again(sim, node, kept):
    kept_sessions(kept)
    pid = one_keeper(kept)
    token = unique_name("kk")
    proc = subprocess.Popen([TPUFAB, "exec", f"sleep 300 && echo {token}"], env=kept,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: all(sleeping(sim, node, token).values()), 60, 0.1,
                 "the command to run on both workers")
        os.kill(pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert "stopped mid-command; run the command again" in out + err, out + err
    assert "Traceback" not in err
    # its connections died with it, and so did the workers' commands
    wait_for(lambda: sleeping(sim, node, token) == {0: False, 1: False}, 30, 0.2,
             "the workers' commands to stop")
    kept_sessions(kept)                          # the next command starts a new keeper
    assert one_keeper(kept) != pid


# -- the resident command server (tpufab.resident, tpufab.entry) ------------------------------

def imports(result: subprocess.CompletedProcess) -> set[str]:
    """The modules the `tpufab` process itself loaded (PYTHONPROFILEIMPORTTIME's lines)."""
    return {line.rsplit("|", 1)[1].strip() for line in result.stderr.splitlines()
            if line.startswith("import time:") and "|" in line}


@pytest.mark.sim
def test_a_command_after_one_that_kept_connections_is_run_by_the_resident_server(node, kept):
    """The command that kept the connections leaves a resident server (private socket); the
    next `tpufab` hands it the command and loads no CLI itself, with the same output, exit code
    and connections; with TPUFAB_RESIDENT=0 it runs the CLI itself, the same way."""
    first = kept_sessions(kept)
    sock = resident_socket(kept)
    assert oct(sock.stat().st_mode & 0o777) == "0o600"
    said = "echo out; echo err >&2; " + SESSION + "; exit 3"
    results = {}
    for mode in ("1", "0"):
        env = {**kept, "PYTHONPROFILEIMPORTTIME": "1", "TPUFAB_RESIDENT": mode}
        results[mode] = tpufab("exec", said, env=env, timeout=120)
    warm, cold = results["1"], results["0"]
    assert "typer" not in imports(warm) and "tpufab.cli" not in imports(warm), warm.stderr
    assert "typer" in imports(cold), cold.stderr[-2000:]
    assert warm.returncode == cold.returncode == 3, warm.stdout + warm.stderr
    # the same lines (the workers' order is theirs), over the same connections
    # a duration's width moves its column ("7.7 ms" against "15.0 ms"): spaces before it too
    lines = lambda text: sorted(re.sub(r" +[0-9.]+ ms", " T ms", line)  # noqa: E731
                                for line in text.splitlines()
                                if not line.startswith("import time:"))
    assert lines(warm.stdout) == lines(cold.stdout), (warm.stdout, cold.stdout)
    assert sessions_in(warm.stdout) == first, warm.stdout
    assert lines(warm.stderr) == lines(cold.stderr), (warm.stderr, cold.stderr)
    # a relative path resolves in the command's own directory, and its environment is its own
    here = Path(tempfile.mkdtemp(prefix="rs", dir="/tmp"))
    try:
        (here / "note.txt").write_text("from-here\n")
        pushed = subprocess.run([TPUFAB, "put", "note.txt", "/tmp/rs-note.txt"], cwd=here,
                                env=kept, capture_output=True, text=True, timeout=120)
        assert pushed.returncode == 0, pushed.stdout + pushed.stderr
        copied = tpufab("exec", "cat /tmp/rs-note.txt", env=kept, timeout=120)
        assert copied.stdout.count("from-here") == 2, copied.stdout + copied.stderr
    finally:
        shutil.rmtree(here, ignore_errors=True)


@pytest.mark.sim
def test_the_resident_server_is_private_and_ends_with_the_keepers(node, kept):
    """Its socket with a wrong mode is not used (said once; the command runs here); another
    user is refused; `tpufab disconnect` (no keeper left) ends it and removes its socket."""
    first = kept_sessions(kept)
    sock = resident_socket(kept)
    [server] = residents(kept)
    status = tpufab("status", env=kept, timeout=120)
    assert f"Commands are run by the resident server (pid {server})." in status.stdout, \
        status.stdout + status.stderr
    sock.chmod(0o666)
    try:
        result = tpufab("exec", SESSION, env={**kept, "PYTHONPROFILEIMPORTTIME": "1"},
                        timeout=120)
    finally:
        sock.chmod(0o600)
    assert result.returncode == 0 and sessions_in(result.stdout) == first, result.stdout
    assert f"not using the resident command server at {sock}: its mode is 0666, not 0600" \
        in result.stderr and "typer" in imports(result), result.stderr[-2000:]
    runtime = sock.parent.parent
    runtime.chmod(0o711)
    sock.parent.chmod(0o711)
    sock.chmod(0o666)
    try:
        other = subprocess.run(["/usr/bin/python3", "-I", "-c", HELLO, str(sock)],
                               capture_output=True, text=True, timeout=60, user=65534,
                               group=65534, cwd="/")
    finally:
        sock.chmod(0o600)
        sock.parent.chmod(0o700)
        runtime.chmod(0o700)
    assert other.stdout.strip() == "CLOSED", other.stdout + other.stderr
    tpufab("disconnect", env=kept, timeout=60)
    wait_for(lambda: server not in residents(kept) and not sock.exists(), 30, 0.1,
             "the resident server to end with the keepers")


HELLO = """
import socket, sys
s = socket.socket(socket.AF_UNIX)
s.settimeout(20)
s.connect(sys.argv[1])
try:
    socket.send_fds(s, [b'{"argv": ["exec", "true"], "argv0": "tpufab", "cwd": "/", '
                        b'"env": {}, "umask": 18}\\n'], [0, 1, 2])
    print("ANSWERED" if s.recv(64) else "CLOSED")
except (ConnectionResetError, BrokenPipeError):
    print("CLOSED")
"""


@pytest.mark.sim
def test_killing_a_command_run_by_the_resident_server_stops_the_workers_commands(
        sim, node, kept):
    """Ctrl-C (forwarded) ends it as Ctrl-C ends any command; the `tpufab` process killed
    outright leaves nothing running on the workers either."""
    kept_sessions(kept)
    resident_socket(kept)
    for how in (signal.SIGINT, signal.SIGKILL):
        token = unique_name("rk")
        proc = subprocess.Popen([TPUFAB, "exec", f"sleep 300 && echo {token}"], env=kept,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            wait_for(lambda t=token: all(sleeping(sim, node, t).values()), 60, 0.1,
                     "the command to run on both workers")
            proc.send_signal(how)
            out, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
        if how == signal.SIGINT:
            assert proc.returncode == 130 and "Interrupted" in err, out + err
        else:
            assert proc.returncode == -signal.SIGKILL
        wait_for(lambda t=token: sleeping(sim, node, t) == {0: False, 1: False}, 60, 0.2,
                 "the workers' commands to stop")


# -- last: it deletes the module's pod -------------------------------------------------------

@pytest.mark.sim
def test_a_recreated_node_is_never_reached_through_an_old_connection(node, kept):
    from helpers import quiet_console

    from tpufab.cloud import lifecycle

    kept_sessions(kept)
    pid = one_keeper(kept)
    marker = unique_name("old")
    assert tpufab("exec", f"touch ~/{marker}", env=kept).returncode == 0
    # deleted and created again under its name behind tpufab's back: a new id, new host keys
    lifecycle.delete(node.settings, yes=True, console=quiet_console())
    # its connections gone, the keeper exits by itself (no command needed)
    wait_for(lambda: pid not in keepers(kept), 30, 0.1, "the old node's keeper to exit")
    assert sockets(kept) == []
    [new] = lifecycle.create(node.settings, console=quiet_console())
    assert new.id != node.node.id
    node.node = new
    result = tpufab("exec", f"test -e ~/{marker} && echo OLD || echo NEW", env=kept, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("NEW") == 2 and "OLD" not in result.stdout, result.stdout
    assert len(sockets(kept)) == 1
    kept_sessions(kept)
    # `tpufab delete` takes the pod's kept connections with it, and a run followed through
    # them says so (before: "the connection keeper stopped mid-command")
    assert keepers(kept)
    here = Path(tempfile.mkdtemp(prefix="kd", dir="/tmp"))
    (here / "long.sh").write_text("#!/bin/sh\necho long-start\nsleep 300\n")
    follower = Running([TPUFAB, "run", "long.sh", "--no-deploy"], kept, cwd=here)
    try:
        wait_for(lambda: follower.saw("long-start"), 120, what="the run to start")
        deleted = tpufab("delete", "--yes", env=kept, timeout=300)
        assert deleted.returncode == 0, deleted.stdout + deleted.stderr
        result = follower.wait(120)
        said = result.stdout + result.stderr
    finally:
        follower.kill()
        shutil.rmtree(here, ignore_errors=True)
    assert "was stopped: `tpufab delete` is deleting the pod (from pid " in said, said
    assert "stopped mid-command" not in said, said
    assert sockets(kept) == []
    wait_for(lambda: not keepers(kept), 30, 0.1, "the deleted pod's keeper to exit")
