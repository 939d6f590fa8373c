"""Workers without external IPs, reached through a jump host, on one simulated v4-32.

`tpufab create --internal-ips` puts the node's workers in a network namespace of their own;
from this machine only its bastion answers (`tpufab sim status` names it). Every verb then
works through `--jump` (or `jump:` in tpufab.yaml), over one SSH connection to the bastion,
and says so; without it, every verb stops with one sentence naming --jump.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
from helpers import (
    POD_USER,
    SESSION,
    build_shared_site,
    cli_env,
    no_traceback,
    one_sentence,
    quiet_console,
    same_twice,
    sessions_in,
    sim_pool,
    sim_settings,
    tpufab,
    unique_name,
    workers_printing,
)

pytestmark = pytest.mark.sim
REPO = Path(__file__).resolve().parents[1]

RECIPE = """#!/bin/sh
echo "worker $TPUFAB_WORKER_ID of $TPUFAB_NUM_WORKERS on $(hostname)"
"""
SETUP = """#!/bin/sh
echo "set up on $(hostname)" > ~/jump-setup.txt
"""


@pytest.fixture(scope="module")
def pod(sim, tmp_path_factory):
    """An internal-IP v4-32, its bastion, and a git project whose tpufab.yaml names the jump."""
    home = tmp_path_factory.mktemp("jump-home")
    build_shared_site([Path(sim.state_dir) / "share"])  # JAX for the collective
    name = unique_name("jump")
    env = cli_env(sim, home, name)
    outside = home / "outside"  # not a project: flags only
    outside.mkdir()
    created = tpufab("create", "--type", "v4-32", "--internal-ips", env=env, cwd=outside)
    assert created.returncode == 0, created.stderr
    status = tpufab("sim", "status", "--json", "--state-dir", str(sim.state_dir), env=env,
                    cwd=outside)
    node = next(n for n in json.loads(status.stdout)["nodes"] if n["name"].endswith("/" + name))
    described = json.loads(tpufab("describe", "--json", env=env, cwd=outside).stdout)
    project = home / "project"
    (project / "scripts").mkdir(parents=True)
    (project / "recipes").mkdir()
    (project / "recipes" / "hello.sh").write_text(RECIPE)
    (project / "scripts" / "setup.sh").write_text(SETUP)
    shutil.copy(REPO / "recipes" / "jax_hello.sh", project / "recipes" / "jax_hello.sh")
    jump = f"{POD_USER}@{node['bastion']}"
    (project / "tpufab.yaml").write_text(f"jump: {jump}\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t.invalid"]
    for argv in (["init", "-q", "-b", "main"], ["add", "-A"], ["commit", "-qm", "code"]):
        subprocess.run([*git, *argv], cwd=project, check=True, capture_output=True)
    yield {"env": env, "home": home, "outside": outside, "project": project, "name": name,
           "jump": jump, "bastion": node["bastion"], "id": node["id"],
           "ips": [w["internal_ip"] for w in described["workers"]], "described": described}
    tpufab("delete", "--yes", env=env, cwd=outside)


def test_the_node_has_no_external_ips_and_its_workers_are_walled_off(pod):
    assert [w["external_ip"] for w in pod["described"]["workers"]] == [None] * 4
    for ip in pod["ips"]:  # sshd and the metadata server listen, but only inside the namespace
        for port in (22, 80):
            with pytest.raises(ConnectionRefusedError), socket.create_connection((ip, port), 5):
                pass
    with socket.create_connection((pod["bastion"], 22), 5) as bastion:
        assert bastion.recv(64).startswith(b"SSH-2.0-OpenSSH")


def test_without_a_jump_every_verb_names_jump_before_connecting(pod):
    env = {**pod["env"], "TPUFAB_JUMP": ""}  # over tpufab.yaml's jump:
    for argv in (["exec", "true"], ["setup"], ["deploy", "--direct"], ["run", "--direct", "recipes/hello.sh"],
                 ["kill"], ["ssh", "--", "true"]):
        result = tpufab(*argv, env=env, cwd=pod["project"])
        one_sentence(result, "no external IPs", "--jump", "IAP")


def test_exec_and_setup_through_the_jump_flag(pod):
    env, cwd = pod["env"], pod["outside"]
    result = tpufab("exec", "--jump", pod["jump"], "hostname; curl -sf -H Metadata-Flavor:Google "
                    "http://metadata.google.internal/computeMetadata/v1/instance/attributes/"
                    "agent-worker-number", env=env, cwd=cwd)
    assert result.returncode == 0, result.stderr
    no_traceback(result)
    assert f"via bastion {pod['jump']}" in result.stderr
    lines = dict(line.split(" │ ", 1) for line in result.stdout.splitlines()
                 if not line.split(" │ ", 1)[1].isdigit())
    assert len(set(lines.values())) == 4  # four distinct workers
    numbers = sorted(line.rsplit(" ", 1)[-1] for line in result.stdout.splitlines()
                     if line.split(" │ ", 1)[1].isdigit())
    assert numbers == ["0", "1", "2", "3"]  # each worker's metadata server answers inside
    setup = tpufab("setup", "--jump", pod["jump"], "--script",
                   str(pod["project"] / "scripts" / "setup.sh"), env=env, cwd=cwd)
    assert setup.returncode == 0, setup.stderr
    check = tpufab("exec", "--jump", pod["jump"], "--gather", "cut -c1-6 ~/jump-setup.txt",
                   env=env, cwd=cwd)
    assert "w[0-3] (exit 0)" in check.stdout and "set up" in check.stdout, check.stdout


def test_deploy_run_and_kill_through_jump_in_tpufab_yaml(pod):
    env, cwd = pod["env"], pod["project"]
    deployed = tpufab("deploy", "--direct", env=env, cwd=cwd)
    assert deployed.returncode == 0, deployed.stderr
    assert f"via bastion {pod['jump']}" in deployed.stderr
    ran = tpufab("run", "recipes/hello.sh", env=env, cwd=cwd)
    assert ran.returncode == 0, ran.stderr + ran.stdout
    # each worker's line, however the live fold grouped them (w0 alone, w[1-3] together)
    assert workers_printing(ran.stdout, r"^worker \S+ of 4 on ", 4) == {0, 1, 2, 3}, ran.stdout
    # A JAX collective across the node's workers: they share its namespace, and its metadata
    # servers and coordinator answer there.
    setup = tpufab("setup", "--script", str(REPO / "scripts" / "setup-sim.sh"), env=env, cwd=cwd,
                   timeout=600)  # a bound for a machine under heavy load, not a duration
    assert setup.returncode == 0, setup.stderr + setup.stdout
    jax = tpufab("run", "--raw", "recipes/jax_hello.sh", env=env, cwd=cwd, timeout=600)
    assert jax.returncode == 0, jax.stderr + jax.stdout
    for w in range(4):
        assert f"w{w} │ jax_hello: all-gather of process ids = [0, 1, 2, 3]" in jax.stdout
        assert f"w{w} │ jax_hello: OK" in jax.stdout
    killed = tpufab("kill", env=env, cwd=cwd)
    assert killed.returncode == 0, killed.stderr + killed.stdout
    shell = tpufab("ssh", "-w", "3", "--", "hostname", env=env, cwd=cwd)  # the system ssh
    assert shell.returncode == 0 and shell.stdout.strip().endswith("-w-3"), shell.stderr


def _bastion_connections(bastion: str) -> int:
    """Established TCP connections from this machine to the bastion's port 22."""
    want = (socket.inet_aton(bastion)[::-1].hex().upper(), "0016")
    count = 0
    with open("/proc/net/tcp") as f:
        next(f)
        for line in f:
            fields = line.split()
            if tuple(fields[2].split(":")) == want and fields[3] == "01":
                count += 1
    return count


def test_one_bastion_connection_carries_every_worker_at_once(pod, sim):
    from tpufab.hosts.connect import connect

    settings = sim_settings(sim, pod["home"], name=pod["name"], jump=pod["jump"])
    before = _bastion_connections(pod["bastion"])
    with connect(settings, console=quiet_console()) as p:
        result = p.fanout.run("date +%s.%N; sleep 1; date +%s.%N")
        assert result.ok, result.summary()
        spans = [tuple(map(float, r.stdout.split())) for r in result.values()]
        assert max(start for start, _ in spans) < min(end for _, end in spans)  # overlapping
        assert {t.host for t in p.fanout.targets.values()} == set(pod["ips"])
        assert _bastion_connections(pod["bastion"]) - before == 1  # one, for four workers
        result.close()


def test_a_worker_connection_closes_quietly_while_the_bastion_connection_dies(pod, monkeypatch):
    """A full CI run once ended an `exec` through a bastion with "Exception in thread": the
    worker's connection closed its channel (a message on the bastion's connection) just as the
    bastion's connection closed at exit, and paramiko re-raises what that close raises. Here the
    bastion's connection can no longer send (its socket gone) when the worker's is closed."""
    import errno
    import threading

    import paramiko

    from tpufab.config import parse_jump
    from tpufab.ssh import jump as jumps

    raised = []
    monkeypatch.setattr(threading, "excepthook", lambda args: raised.append(args.exc_value))
    bastion = paramiko.SSHClient()
    bastion.set_missing_host_key_policy(paramiko.AutoAddPolicy())
    bastion.connect(pod["bastion"], username=POD_USER, look_for_keys=False, allow_agent=False,
                    pkey=paramiko.PKey.from_path(pod["home"] / "tpufab_ed25519"), timeout=10)
    try:
        sock = jumps.open_channel(parse_jump(pod["jump"]), None, pod["ips"][0], 22, 10,
                                  connect=lambda *_: bastion)
        worker = paramiko.Transport(sock)
        worker.start_client(timeout=10)
        assert worker.is_active()

        def dead_socket(*_):
            raise OSError(errno.EBADF, "Bad file descriptor")

        monkeypatch.setattr(bastion.get_transport().packetizer, "send_message", dead_socket)
        worker.close()  # raised OSError here (and in the transport's thread) before the fix
        worker.join(10)
        assert not worker.is_alive() and raised == []
    finally:
        bastion.close()


def test_bastion_host_key_is_pinned_and_a_changed_one_is_refused(pod, sim):
    env, cwd = pod["env"], pod["outside"]
    known = Path(env["TPUFAB_KNOWN_HOSTS"])
    tpufab("exec", "--jump", pod["jump"], "true", env=env, cwd=cwd)
    real = sim_pool(sim).host_keys(pod["id"] + "-bastion")[0]
    pinned = [line for line in known.read_text().splitlines()
              if line.split()[0] == pod["bastion"]]
    assert pinned == [f"{pod['bastion']} {real}"]
    # first use pins it and shows its fingerprint, as ssh does (issue 23)
    fresh = pod["home"] / "fresh_known_hosts"
    first = tpufab("exec", "--jump", pod["jump"], "true",
                   env={**env, "TPUFAB_KNOWN_HOSTS": str(fresh)}, cwd=cwd)
    assert first.returncode == 0, first.stderr
    from tpufab.ssh.hostkeys import fingerprint

    assert (f"Pinned the {real.split()[0]} host key of the jump host {pod['bastion']} "
            f"({fingerprint(real.split()[1])}) in {fresh}") in first.stderr
    again = tpufab("exec", "--jump", pod["jump"], "true",
                   env={**env, "TPUFAB_KNOWN_HOSTS": str(fresh)}, cwd=cwd)
    assert again.returncode == 0 and "Pinned the" not in again.stderr
    original = known.read_text()
    forged = "AAAAC3NzaC1lZDI1NTE5AAAAIC81zMXQ2MNi74LMPRc+zpeG4keseH+21UmpkK6nBFRn"
    known.write_text(original.replace(real.split()[1], forged))
    try:
        result = tpufab("exec", "--jump", pod["jump"], "true", env=env, cwd=cwd)
        one_sentence(result, f"jump host {pod['jump']}", "differs", "ssh-keygen")
    finally:
        known.write_text(original)


def test_a_worker_down_behind_the_bastion_and_the_bastion_down(pod, sim):
    env, cwd = {**pod["env"], "TPUFAB_CONNECT_TIMEOUT": "3"}, pod["outside"]
    pool = sim_pool(sim)
    pool.set_reachable(pod["id"], 1, False)
    try:
        result = tpufab("exec", "--jump", pod["jump"], "true", env=env, cwd=cwd)
        assert result.returncode != 0
        no_traceback(result)
        assert "failed on 1 of 4 workers: w1 connection refused" in result.stderr, result.stderr
    finally:
        pool.set_reachable(pod["id"], 1, True)
    pool.set_reachable(pod["id"] + "-bastion", 0, False)
    try:
        started = time.monotonic()
        result = tpufab("exec", "--jump", pod["jump"], "true", env=env, cwd=cwd)
        line = one_sentence(result, f"Cannot reach the jump host {pod['jump']}")
        assert "closed before an SSH server answered" in line, line
        assert time.monotonic() - started < 30
    finally:
        pool.set_reachable(pod["id"] + "-bastion", 0, True)
    again = tpufab("exec", "--jump", pod["jump"], "true", env=env, cwd=cwd)
    assert again.returncode == 0, again.stderr


def test_kept_connections_through_the_bastion_need_no_new_login_there(pod, sim):
    """Kept connections (issue 28) through --jump: once the pod's keeper holds the workers'
    connections (over its own bastion connection), a command asks neither the TPU API nor the
    bastion. It works while the bastion takes no new connection at all, over the same
    connections; a command that connects itself (keeping off) cannot."""
    import tempfile

    runtime = Path(tempfile.mkdtemp(prefix="kj", dir="/tmp"))
    env = {k: v for k, v in pod["env"].items() if k != "TPUFAB_KEEP_ALIVE"}  # the default: 5m
    env.update(XDG_RUNTIME_DIR=str(runtime), TPUFAB_CONNECT_TIMEOUT="3")
    cwd, pool = pod["project"], sim_pool(sim)

    def sessions() -> dict[int, int]:
        result = tpufab("exec", SESSION, env=env, cwd=cwd, timeout=120)
        assert result.returncode == 0, result.stdout + result.stderr
        assert f"via bastion {pod['jump']}" in result.stderr   # said kept or not
        return sessions_in(result.stdout)

    try:
        held = same_twice(sessions)   # the keeper holds the connections now
        assert sorted(held) == [0, 1, 2, 3], held
        pool.set_reachable(pod["id"] + "-bastion", 0, False)
        try:
            assert sessions() == held   # before: every command logged into the bastion first
            cold = tpufab("--keep-alive", "0", "exec", "true", env=env, cwd=cwd)
            one_sentence(cold, f"Cannot reach the jump host {pod['jump']}")
        finally:
            pool.set_reachable(pod["id"] + "-bastion", 0, True)
    finally:
        tpufab("disconnect", env=env, cwd=cwd, timeout=60)
        shutil.rmtree(runtime, ignore_errors=True)


def _holders_of(netns: str) -> list[int]:
    """Processes on this machine in the network namespace ``netns`` (``net:[4026...]``)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "ns" / "net").readlink().name == netns:
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def test_delete_takes_the_namespace_and_the_bastion_with_it(pod, sim):
    """Last in this module: deletes the node."""
    pool = sim_pool(sim)
    netns = Path(f"/proc/{pool.pids(pod['id'], 0)[0]}/ns/net").readlink().name
    assert netns != Path("/proc/self/ns/net").readlink().name
    assert len(_holders_of(netns)) > 4  # workers, their sshd, the bastion, the holder
    known = Path(pod["env"]["TPUFAB_KNOWN_HOSTS"])
    assert any(line.split()[0] == pod["bastion"] for line in known.read_text().splitlines())
    # from the project, whose tpufab.yaml names the jump: the bastion went with the node, so
    # its pinned key (and the workers') go too (issue 23)
    deleted = tpufab("delete", "--yes", "--name", pod["name"], env=pod["env"],
                     cwd=pod["project"])
    assert deleted.returncode == 0, deleted.stderr
    assert f"The jump host {pod['bastion']} went with it: forgot its pinned host key" in \
        deleted.stdout + deleted.stderr
    assert not any(line.split()[0] == pod["bastion"] or pod["id"] in line.split()[0]
                   for line in known.read_text().splitlines())
    assert _holders_of(netns) == []  # nothing left in it: the kernel frees the namespace
    with pytest.raises(ConnectionRefusedError), socket.create_connection((pod["bastion"], 22), 5):
        pass
    assert not (Path(sim.state_dir) / "workers" / "nodes" / (pod["id"] + "-bastion")).exists()
