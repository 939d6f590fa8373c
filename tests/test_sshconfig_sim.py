"""`tpufab config-ssh` on the simulated pod, as a user meets it: then the plain OpenSSH
`ssh`, `scp` and `rsync` reach a worker by its alias, with tpufab's key and pinned host key
(StrictHostKeyChecking yes), through a jump host too, and as the OS Login user; delete and
create keep the entries current, `--remove` takes them out, and the user's own entries are
never touched.

Every test has a HOME of its own (so ~/.ssh/config is never this machine's): OpenSSH takes
``~`` from the passwd entry, not $HOME, so the commands here name the file with ``-F``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import OS_LOGIN_USER as OSL_USER
from helpers import (
    POD_USER,
    Running,
    cli_env,
    create_node,
    ok,
    one_sentence,
    os_login_on,
    tpufab,
    unique_name,
    wait_for,
)

from tpufab.hosts import sshconfig as files

pytestmark = pytest.mark.sim

OWN = ("# mine\nServerAliveCountMax 4\n\nHost mybox\n    HostName 192.0.2.10\n"
       "    User me\n")
OSL_PROJECT = "sshconfig-oslogin"
# Fabric's own objects through the same bastion (tpufab.pod.fabric): one gateway Connection
THROUGH = """
from tpufab import Pod
pod = Pod()
conns = pod.connections()
gateway = conns[1].gateway
print(gateway.host, gateway is conns[0].gateway, conns[1].host)
print(conns[1].run("hostname", hide=True, in_stream=False).stdout.strip())
print(" ".join(r.stdout.strip() for r in pod.group().run("hostname", hide=True).values()))
"""


def ssh(config: Path, *argv: str, tool: str = "ssh", timeout: float = 60
        ) -> subprocess.CompletedProcess:
    """The system's `ssh` (or `scp`) reading only ``config``, never asking anything."""
    return subprocess.run([tool, "-F", str(config), "-o", "BatchMode=yes", *argv],
                          capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def config_of(env: dict) -> Path:
    return Path(env["HOME"]) / ".ssh" / "config"


def pod_block(text: str, name: str) -> str:
    """Pod ``name``'s part of tpufab's section."""
    start = text.index(f"# tpufab pod {name} ")
    ends = [i for i in (text.find("# tpufab pod", start + 1), text.find(files.END, start))
            if i >= 0]
    return text[start:min(ends)]


@pytest.fixture(scope="module")
def plain(sim, tmp_path_factory):
    """A v4-16 (2 workers) created with `tpufab create`, in a HOME whose ~/.ssh/config holds
    the user's own entries."""
    home = tmp_path_factory.mktemp("sshcfg-home")
    name = unique_name("scfg")
    env = cli_env(sim, home, name)
    ok(tpufab("create", "--type", "v4-16", env=env, cwd=home))
    (home / ".ssh").mkdir(mode=0o700)
    config_of(env).write_text(OWN)
    yield {"env": env, "home": home, "name": name}
    tpufab("delete", "--yes", env=env, cwd=home)


def test_without_a_terminal_it_asks_for_yes_and_writes_nothing(plain):
    result = tpufab("config-ssh", "--name", plain["name"], env=plain["env"], cwd=plain["home"])
    one_sentence(result, "stdin is not a terminal", "--yes")
    assert config_of(plain["env"]).read_text() == OWN


def test_config_ssh_then_ssh_scp_and_rsync_by_alias(plain):
    env, name, home = plain["env"], plain["name"], plain["home"]
    out = ok(tpufab("config-ssh", "--yes", env=env, cwd=home))  # every READY pod in the zone
    assert f"{name}: {name} {name}-w0 {name}-w1 (2 workers)" in out
    config = config_of(env)
    text = config.read_text()
    assert text.startswith("# mine\nServerAliveCountMax 4\n\n" + files.BEGIN)
    assert text.endswith(OWN.split("\n\n", 1)[1])     # the user's entry as it was
    assert config.stat().st_mode & 0o777 == 0o644 or config.stat().st_mode & 0o777 == 0o600
    described = json.loads(ok(tpufab("describe", "--json", env=env, cwd=home)))
    hostnames = {w: ssh(config, f"{name}-w{w}", "hostname").stdout.strip() for w in (0, 1)}
    assert hostnames[0] != hostnames[1] and all(hostnames.values()), hostnames
    assert ssh(config, name, "hostname").stdout.strip() == hostnames[0]  # the pod: worker 0
    who = ssh(config, f"{name}-w1", "id -un; sudo -n id -un")
    assert who.stdout.split() == [POD_USER, "root"], who.stderr
    (home / "f.txt").write_text("scp me\n")
    copied = ssh(config, str(home / "f.txt"), f"{name}-w1:", tool="scp")
    assert copied.returncode == 0, copied.stderr
    assert ssh(config, f"{name}-w1", "cat f.txt").stdout == "scp me\n"
    tree = home / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "sub" / "a.txt").write_text("rsync me\n")
    synced = subprocess.run(["rsync", "-a", "-e", f"ssh -F {config} -o BatchMode=yes",
                             f"{tree}/", f"{name}-w0:tree/"], capture_output=True, text=True,
                            timeout=60, stdin=subprocess.DEVNULL)
    assert synced.returncode == 0, synced.stderr
    assert ssh(config, f"{name}-w0", "cat tree/sub/a.txt").stdout == "rsync me\n"
    # the pinned key is what makes it work: StrictHostKeyChecking yes refuses any other
    pins = Path(env["TPUFAB_KNOWN_HOSTS"])
    saved = pins.read_text()
    try:
        pins.write_text("\n".join(line for line in saved.splitlines()
                                  if not line.endswith("-w1") and "-w1 " not in line) + "\n")
        refused = ssh(config, f"{name}-w1", "true")
        assert refused.returncode == 255 and "Host key verification failed" in refused.stderr
    finally:
        pins.write_text(saved)
    assert described["workers"][1]["external_ip"] in text


def test_delete_and_create_keep_the_entries_current_and_remove_takes_them_out(plain):
    env, name, home = plain["env"], plain["name"], plain["home"]
    config = config_of(env)
    ok(tpufab("config-ssh", "--yes", "--name", name, env=env, cwd=home))
    other = unique_name("scfg2")
    created = tpufab("create", "--name", other, "--type", "v4-8", env=env, cwd=home)
    assert f"Updated {other}'s SSH entries in {config}" in ok(created) + created.stderr
    first = pod_block(config.read_text(), other)
    [old_alias] = [line.split()[1] for line in first.splitlines() if "HostKeyAlias" in line]
    assert ssh(config, other, "true").returncode == 0
    deleted = tpufab("delete", "--name", other, "--yes", env=env, cwd=home)
    assert f"Removed {other}'s SSH entries from {config}" in ok(deleted) + deleted.stderr
    assert f"Host {other}" not in config.read_text()
    recreated = tpufab("create", "--name", other, "--type", "v4-8", env=env, cwd=home)
    ok(recreated)
    pod = pod_block(config.read_text(), other)
    assert f"Host {other} {other}-w0" in pod and old_alias not in pod  # the new node's pin
    assert "HostKeyAlias tpufab-" in pod
    assert ssh(config, other, "true").returncode == 0   # the new host key, pinned afresh
    ok(tpufab("delete", "--name", other, "--yes", env=env, cwd=home))
    removed = ok(tpufab("config-ssh", "--remove", "--name", name, env=env, cwd=home))
    assert f"Removed {name}'s entries" in removed
    assert config.read_text() == OWN                    # exactly the user's file again


def test_ssh_config_off_leaves_the_file_alone(plain):
    env, home = {**plain["env"], "TPUFAB_SSH_CONFIG": "off"}, plain["home"]
    config = config_of(env)
    ok(tpufab("config-ssh", "--yes", "--name", plain["name"], env=env, cwd=home))
    before = config.read_text()
    other = unique_name("scfg3")
    ok(tpufab("create", "--name", other, "--type", "v4-8", env=env, cwd=home))
    try:
        assert config.read_text() == before
    finally:
        ok(tpufab("delete", "--name", other, "--yes", env=env, cwd=home))
    ok(tpufab("config-ssh", "--remove", env=env, cwd=home))
    assert config.read_text() == OWN


def test_a_file_tpufab_cannot_write_into_is_one_sentence(plain, tmp_path):
    env = {**plain["env"], "HOME": str(tmp_path)}
    (tmp_path / ".ssh").mkdir()
    (tmp_path / "dotfiles").mkdir()
    (tmp_path / "dotfiles" / "config").write_text("Host a\n")
    config_of(env).symlink_to(tmp_path / "dotfiles" / "config")
    one_sentence(tpufab("config-ssh", "--yes", "--name", plain["name"], env=env,
                        cwd=tmp_path), "is a symlink", "ssh_config: off")
    config_of(env).unlink()
    config_of(env).write_text(f"{files.BEGIN}\nHost x\n")
    one_sentence(tpufab("config-ssh", "--yes", env=env, cwd=tmp_path),
                 "begin marker has no end marker")


def test_a_pod_that_is_not_ready_is_one_sentence_and_gc_takes_its_entries(plain, sim_admin):
    other = unique_name("scfg4")
    env, home = plain["env"], plain["home"]
    config = config_of(env)
    ok(tpufab("config-ssh", "--yes", "--name", plain["name"], env=env, cwd=home))
    ok(tpufab("create", "--name", other, "--type", "v4-8", env=env, cwd=home))
    try:
        assert f"Host {other} {other}-w0" in config.read_text()
        sim_admin.preempt(other)
        one_sentence(tpufab("config-ssh", "--yes", "--name", other, env=env, cwd=home),
                     f"TPU node {other} was preempted")
        collected = tpufab("gc", "--yes", env=env, cwd=home)
        assert f"Removed {other}'s SSH entries from {config}" in ok(collected) + collected.stderr
        assert f"Host {other}" not in config.read_text()
    finally:
        tpufab("delete", "--name", other, "--yes", env=env, cwd=home)
    ok(tpufab("config-ssh", "--remove", env=env, cwd=home))
    assert config.read_text() == OWN


LOOPS_ONCE = """#!/bin/sh
echo "attempt $TPUFAB_RESTART_COUNT on $(hostname)"
if [ "$TPUFAB_RESTART_COUNT" = 0 ]; then while true; do sleep 0.2; done; fi
"""


def test_babysits_recreate_updates_the_entries(plain, sim_admin, tmp_path):
    """A preempted node that babysit deletes and creates again: new IPs, a new node id and
    new host keys, and its entries follow."""
    env, home = plain["env"], plain["home"]
    config = config_of(env)
    other = unique_name("scfgb")
    ok(tpufab("config-ssh", "--yes", "--name", plain["name"], env=env, cwd=home))
    ok(tpufab("create", "--name", other, "--type", "v4-8", env=env, cwd=home))
    project = tmp_path / "project"
    project.mkdir()
    (project / "loop.sh").write_text(LOOPS_ONCE)
    (project / "loop.sh").chmod(0o755)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t.invalid"]
    for argv in (["init", "-q", "-b", "main"], ["add", "-A"], ["commit", "-qm", "loop"]):
        subprocess.run([*git, *argv], cwd=project, check=True, capture_output=True)
    before = pod_block(config.read_text(), other)
    sitter = Running([str(Path(sys.executable).parent / "tpufab"), "babysit", "loop.sh",
                      "--name", other, "--direct", "--max-restarts", "1"],
                     env, cwd=project)
    try:
        wait_for(lambda: sitter.saw("attempt 0 on"), 120, what="attempt 0 to run")
        sim_admin.preempt(other)
        done = sitter.wait(300)
        assert done.returncode == 0, done.stdout + done.stderr
        assert f"Updated {other}'s SSH entries in {config}" in done.stdout + done.stderr
        after = pod_block(config.read_text(), other)
        alias = [line for line in after.splitlines() if "HostKeyAlias" in line]
        assert alias and alias[0] not in before     # the new node's pin
        assert ssh(config, other, "true").returncode == 0
    finally:
        sitter.kill()
        tpufab("delete", "--name", other, "--yes", env=env, cwd=home)
    ok(tpufab("config-ssh", "--remove", env=env, cwd=home))
    assert config.read_text() == OWN


def test_through_a_jump_host(sim, tmp_path):
    """A pod without external IPs: the workers' entries jump through the bastion's own."""
    name = unique_name("scfgj")
    env = cli_env(sim, tmp_path, name)
    ok(tpufab("create", "--type", "v4-16", "--internal-ips", env=env, cwd=tmp_path))
    try:
        status = json.loads(ok(tpufab("sim", "status", "--json", "--state-dir",
                                      str(sim.state_dir), env=env, cwd=tmp_path)))
        bastion = next(n["bastion"] for n in status["nodes"] if n["name"].endswith("/" + name))
        jump = f"{POD_USER}@{bastion}"
        out = ok(tpufab("config-ssh", "--yes", "--name", name, "--jump", jump, env=env,
                        cwd=tmp_path))
        assert f"through {name}-jump" in out
        config = config_of(env)
        said = ssh(config, f"{name}-w1", "hostname -I 2>/dev/null || hostname")
        assert said.returncode == 0, said.stderr
        internal = json.loads(ok(tpufab("describe", "--json", env=env, cwd=tmp_path)))
        assert internal["workers"][1]["external_ip"] is None
        assert f"ProxyJump {name}-jump" in config.read_text()
        (tmp_path / "j.txt").write_text("through the bastion\n")
        assert ssh(config, str(tmp_path / "j.txt"), f"{name}-w1:", tool="scp").returncode == 0
        assert ssh(config, f"{name}-w1", "cat j.txt").stdout == "through the bastion\n"
        names = [ssh(config, f"{name}-w{w}", "hostname").stdout.strip() for w in (0, 1)]
        probe = subprocess.run([sys.executable, "-c", THROUGH], env={**env, "TPUFAB_JUMP": jump},
                               cwd=tmp_path, capture_output=True, text=True, timeout=120,
                               stdin=subprocess.DEVNULL)
        assert probe.returncode == 0, probe.stderr
        assert probe.stdout.splitlines() == [
            f"{bastion} True {internal['workers'][1]['internal_ip']}", names[1], " ".join(names)]
    finally:
        tpufab("delete", "--yes", env=env, cwd=tmp_path)


def test_with_os_login_the_entries_log_in_as_the_profiles_user(sim, tpu_client, tmp_path):
    with os_login_on(sim, OSL_PROJECT):
        node = create_node(tpu_client, f"projects/{OSL_PROJECT}/locations/{sim.zone}",
                           unique_name("scfgo"), "v4-8")
        name = node.name.rsplit("/", 1)[1]
        env = {**cli_env(sim, tmp_path, name), "TPUFAB_PROJECT": OSL_PROJECT,
               "TPUFAB_CONNECT_TIMEOUT": "30"}
        try:
            ok(tpufab("config-ssh", "--yes", "--name", name, env=env, cwd=tmp_path))
            config = config_of(env)
            assert f"    User {OSL_USER}" in config.read_text()
            said = ssh(config, name, "id -un")
            assert said.stdout.strip() == OSL_USER, said.stderr
        finally:
            tpu_client.delete_node(name=node.name).result(timeout=60)
