"""tpufab's entries in ~/.ssh/config as data (tpufab.hosts.sshconfig): the blocks built from
the targets tpufab connects to, the user's own text kept byte for byte, and every file tpufab
cannot safely write into refused in one sentence. No pod: the scenarios are
tests/test_sshconfig_sim.py."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tpufab.config import Jump
from tpufab.errors import ConfigError
from tpufab.hosts import sshconfig as files
from tpufab.ssh.fanout import Target

USER_TEXT = ("# my own settings\r\n"
             "ServerAliveCountMax 5\n"
             "\n"
             "# the build box\n"
             "Host build\n"
             "    HostName build.example.com\n"
             "    User me\n"
             "\n"
             "Host *\n"
             "    User everyone\n")


def targets(jump: Jump | None = None, user: str = "tpufab") -> list[Target]:
    return [Target(worker=w, host=f"10.0.0.{w + 1}", user=user, key_filename="/k/tpufab_ed25519",
                   host_key_alias=f"tpufab-99-w{w}", jump=jump) for w in (1, 0)]


def entries(name: str = "pod", **kw) -> files.PodEntries:
    return files.pod_entries(name, "proj", "zone-a", targets(**kw),
                             known_hosts=Path("/k/known_hosts"))


def test_one_block_per_worker_in_worker_order_and_the_pod_name_for_worker_0():
    pod = entries()
    assert pod.aliases == ["pod", "pod-w0", "pod-w1"]
    assert files.block_lines(pod) == [
        "# tpufab pod pod project=proj zone=zone-a: 2 workers",
        "Host pod pod-w0", "    HostName 10.0.0.1", "    Port 22", "    User tpufab",
        "    IdentityFile /k/tpufab_ed25519", "    IdentitiesOnly yes",
        "    HostKeyAlias tpufab-99-w0", "    UserKnownHostsFile /k/known_hosts",
        "    StrictHostKeyChecking yes", "    ServerAliveInterval 30",
        "Host pod-w1", "    HostName 10.0.0.2", "    Port 22", "    User tpufab",
        "    IdentityFile /k/tpufab_ed25519", "    IdentitiesOnly yes",
        "    HostKeyAlias tpufab-99-w1", "    UserKnownHostsFile /k/known_hosts",
        "    StrictHostKeyChecking yes", "    ServerAliveInterval 30"]


def test_a_jump_host_is_a_block_of_its_own_that_every_worker_jumps_through():
    pod = entries(jump=Jump(user="alice", host="bastion.example.com", port=2222,
                            key_filename="/k/tpufab_ed25519"), user="alice_example_com")
    lines = files.block_lines(pod)
    assert lines[1:5] == ["Host pod-jump", "    HostName bastion.example.com", "    Port 2222",
                          "    User alice"]
    assert "HostKeyAlias" not in "".join(lines[1:10])  # [host]:port is its own known_hosts name
    assert lines.count("    ProxyJump pod-jump") == 2
    assert lines.count("    User alice_example_com") == 2  # the OS Login user on the workers


def test_paths_are_absolute_percent_doubled_and_quoted_when_they_hold_a_space(monkeypatch,
                                                                             tmp_path):
    monkeypatch.chdir(tmp_path)
    odd = [Target(worker=0, host="10.0.0.1", user="u", key_filename="my keys/k%1",
                  host_key_alias="tpufab-1-w0")]
    pod = files.pod_entries("p", "proj", "z", odd, known_hosts=Path("kh"))
    lines = files.block_lines(pod)
    assert f'    IdentityFile "{tmp_path}/my keys/k%%1"' in lines
    assert f"    UserKnownHostsFile {tmp_path}/kh" in lines
    bad = [Target(worker=0, host="10.0.0.1", user="u", key_filename='/k/"q"')]
    with pytest.raises(ConfigError, match="cannot be written into ~/.ssh/config"):
        files.block_lines(files.pod_entries("p", "proj", "z", bad, known_hosts=Path("/kh")))


def test_the_section_goes_after_the_global_lines_before_the_first_host_and_its_comment():
    layout = files.parse(USER_TEXT)
    assert not layout.present
    text = files.rewrite(layout, {"pod": entries()})
    head, rest = text.split(files.BEGIN)
    assert head == "# my own settings\r\nServerAliveCountMax 5\n\n"
    section, tail = rest.split(files.END + "\n")
    assert tail == "\n# the build box\n" + USER_TEXT.split("# the build box\n")[1]
    assert "Host pod pod-w0" in section


def test_the_users_text_is_kept_byte_for_byte_through_add_update_and_remove():
    first = files.rewrite(files.parse(USER_TEXT), {"pod": entries()})
    second = files.rewrite(files.parse(first), {"other": entries("other")})
    assert second.index("# tpufab pod other") < second.index("# tpufab pod pod")  # by name
    moved = files.rewrite(files.parse(second), {"pod": files.pod_entries(
        "pod", "proj", "zone-a", [Target(worker=0, host="10.9.9.9", user="tpufab",
                                         key_filename="/k/k", host_key_alias="tpufab-100-w0")],
        known_hosts=Path("/k/kh"))})
    pod = moved[moved.index("# tpufab pod pod "):moved.index(files.END)]
    assert "10.9.9.9" in pod and "tpufab-100-w0" in pod and "tpufab-99" not in pod
    assert "Host other other-w0" in moved
    assert moved.replace(moved[moved.index(files.BEGIN):moved.index(files.END)], "") == \
        first.replace(first[first.index(files.BEGIN):first.index(files.END)], "")
    one_left = files.rewrite(files.parse(moved), {"pod": None})
    assert "# tpufab pod pod " not in one_left and "Host other" in one_left
    assert files.rewrite(files.parse(one_left), {"other": None}) == USER_TEXT
    assert files.rewrite(files.parse(second), {}, remove_all=True) == USER_TEXT


def test_removing_everything_gives_back_exactly_the_users_file():
    for original, back in ((USER_TEXT, USER_TEXT), ("", ""), ("Host a\n  User b\n", None),
                           ("User x", "User x\n"), ("User x\n\n", "User x\n")):
        written = files.rewrite(files.parse(original), {"pod": entries()})
        assert files.rewrite(files.parse(written), {}, remove_all=True) == (back or original)


def test_stale_pods_can_be_dropped_and_clashing_names_are_refused():
    text = files.rewrite(files.parse(""), {"pod": entries(), "old": entries("old")})
    assert "old-w0" not in files.rewrite(files.parse(text), {}, drop=["old"])
    with pytest.raises(ConfigError, match="would both be `ssh pod-w1`"):
        files.rewrite(files.parse(text), {"pod-w1": entries("pod-w1")})


@pytest.mark.parametrize("text, says", [
    (f"{files.BEGIN}\nHost a\n", "begin marker has no end marker (line 1)"),
    (f"Host a\n{files.END}\n", "end marker has no begin marker (line 2)"),
    (f"{files.END}\n{files.BEGIN}\n", "end marker (line 1) comes before its begin marker"),
    (f"{files.BEGIN}\n{files.END}\n{files.BEGIN}\n{files.END}\n", "begin marker more than once"),
    (f"{files.BEGIN}\n{files.END}\nForwardAgent yes\nHost x\n",
     "Line 3 of cfg ('ForwardAgent yes') follows tpufab's section without a Host line"),
])
def test_markers_broken_by_hand_are_one_sentence(text, says):
    with pytest.raises(ConfigError) as err:
        files.parse(text, "cfg")
    assert says in str(err.value) and "\n" not in str(err.value)


def test_a_file_tpufab_cannot_safely_write_into_is_one_sentence(tmp_path):
    ssh = tmp_path / ".ssh"
    ssh.mkdir()
    elsewhere = tmp_path / "dotfiles" / "ssh_config"
    elsewhere.parent.mkdir()
    elsewhere.write_text("Host a\n")
    config = ssh / "config"
    config.symlink_to(elsewhere)
    with pytest.raises(ConfigError, match=f"is a symlink \\(to {elsewhere}\\)"):
        files.read_config(config)
    config.unlink()
    config.mkdir()
    with pytest.raises(ConfigError, match="is not a regular file"):
        files.read_config(config)
    config.rmdir()
    config.write_bytes(b"Host \xff\n")
    with pytest.raises(ConfigError, match="is not UTF-8"):
        files.read_config(config)
    included = ssh / "config.d" / "tpufab"
    included.parent.mkdir()
    included.write_text(f"{files.BEGIN}\nHost pod\n{files.END}\n")
    config.write_text("Include config.d/*\nHost mine\n")
    with pytest.raises(ConfigError, match="which .* Includes, and paramiko"):
        files.read_config(config)
    assert files.read_config(ssh / "missing") == ""


@pytest.mark.skipif(os.geteuid() == 0, reason="uid 0 reads every file")
def test_an_unreadable_file_is_one_sentence(tmp_path):
    config = tmp_path / "config"
    config.write_text("Host a\n")
    config.chmod(0)
    with pytest.raises(ConfigError, match="cannot be read"):
        files.read_config(config)


def test_the_write_is_whole_and_keeps_the_files_mode(tmp_path):
    config = tmp_path / "new" / "config"
    files.write_config(config, "Host a\n")
    assert config.read_text() == "Host a\n"
    assert config.stat().st_mode & 0o777 == 0o600
    assert config.parent.stat().st_mode & 0o777 == 0o700
    config.chmod(0o644)
    files.write_config(config, "Host b\n")
    assert config.stat().st_mode & 0o777 == 0o644
    assert sorted(p.name for p in config.parent.iterdir()) == ["config"]  # no temporary left


@pytest.mark.skipif(not os.path.exists("/usr/bin/ssh"), reason="needs OpenSSH's client")
def test_openssh_reads_the_blocks_as_written(tmp_path):
    config = tmp_path / "config"
    pod = entries(jump=Jump(user="alice", host="bastion", port=2222, key_filename="/k/j"))
    config.write_text(files.rewrite(files.parse(USER_TEXT), {"pod": pod}))
    said = subprocess.run(["ssh", "-G", "-F", str(config), "pod-w1"], capture_output=True,
                          text=True, check=True).stdout.splitlines()
    for line in ("hostname 10.0.0.2", "user tpufab", "port 22", "hostkeyalias tpufab-99-w1",
                 "userknownhostsfile /k/known_hosts", "stricthostkeychecking true",
                 "proxyjump pod-jump", "serveraliveinterval 30", "identitiesonly yes",
                 "serveralivecountmax 5"):  # the user's global line still applies
        assert line in said, line
    build = subprocess.run(["ssh", "-G", "-F", str(config), "build"], capture_output=True,
                           text=True, check=True).stdout.splitlines()
    assert "user me" in build and "hostname build.example.com" in build


def test_paramiko_reads_the_blocks_as_written():
    from paramiko import SSHConfig

    text = files.rewrite(files.parse(USER_TEXT), {"pod": entries()})
    found = SSHConfig.from_text(text).lookup("pod")
    assert found["hostname"] == "10.0.0.1" and found["user"] == "tpufab"
    assert found["identityfile"] == ["/k/tpufab_ed25519"]


def test_without_fabric_installed_connections_and_group_are_one_sentence(monkeypatch):
    import sys

    from tpufab import Pod

    monkeypatch.setitem(sys.modules, "fabric", None)   # as if it were not installed
    pod = Pod("some-pod")
    for call in (pod.connections, pod.group):
        with pytest.raises(ConfigError, match=r"pip install 'tpufab\[fabric\]'"):
            call()


def test_the_hooks_of_delete_follow_the_section_and_never_fail_the_delete(monkeypatch,
                                                                          tmp_path):
    import io

    from rich.console import Console

    from tpufab.config import load_settings
    from tpufab.steps.host.sshconfig import keep_current

    monkeypatch.setenv("HOME", str(tmp_path))
    config = tmp_path / ".ssh" / "config"
    settings = load_settings({"name": "pod", "state_dir": str(tmp_path / "state")},
                             env={}, cwd=tmp_path)
    said = io.StringIO()
    console = Console(file=said, width=1000)
    keep_current(settings, console, gone=True)           # no file: nothing, silently
    assert not config.exists() and said.getvalue() == ""
    files.write_config(config, files.rewrite(files.parse(USER_TEXT),
                                             {"pod": entries(), "other": entries("other")}))
    settings.ssh_config = "off"
    keep_current(settings, console, gone=True)           # off: the file is config-ssh's alone
    assert "Host pod pod-w0" in config.read_text()
    settings.ssh_config = "auto"
    keep_current(settings, console, gone=True)
    assert "Host pod " not in config.read_text() and "Host other other-w0" in config.read_text()
    assert f"Removed pod's SSH entries from {config}." in said.getvalue()
    config.write_text(config.read_text() + f"{files.BEGIN}\n")   # broken by hand
    keep_current(load_settings({"name": "other", "state_dir": str(tmp_path / "state")},
                               env={}, cwd=tmp_path), console, gone=True)
    assert "Did not update" in said.getvalue() and "begin marker more than once" in said.getvalue()
