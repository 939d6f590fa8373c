"""The pure parts of --jump: parsing, the setting's validation, the ProxyCommand, the check that
a node without external IPs has a way in (the scenarios are in test_jump_sim.py)."""

from __future__ import annotations

import pickle
import shlex

import pytest

from tpufab.cloud.nodes import Node, WorkerEndpoint
from tpufab.config import Jump, load_settings, parse_jump
from tpufab.errors import ConfigError
from tpufab.hosts.connect import check_reachable
from tpufab.ssh.connections import Target
from tpufab.ssh.jump import proxy_command


@pytest.mark.parametrize("text,user,host,port,alias", [
    ("alice@bastion.example.com", "alice", "bastion.example.com", 22, "bastion.example.com"),
    ("alice@10.0.0.5:2222", "alice", "10.0.0.5", 2222, "[10.0.0.5]:2222"),
    (" tpufab@127.16.3.255 ", "tpufab", "127.16.3.255", 22, "127.16.3.255"),
    ("bob@[::1]:22", "bob", "::1", 22, "::1"),
    ("bastion.example.com", "", "bastion.example.com", 22, "bastion.example.com"),
    ("10.0.0.5:2222", "", "10.0.0.5", 2222, "[10.0.0.5]:2222"),
])
def test_parse_jump(text, user, host, port, alias):
    jump = parse_jump(text)
    assert (jump.user, jump.host, jump.port, jump.key_alias) == (user, host, port, alias)
    assert str(jump) == (f"{user}@" if user else "") + host + ("" if port == 22 else f":{port}")


def test_a_jump_without_a_user_logs_in_as_the_login_user():
    # the login user tpufab uses on the workers: the OS Login POSIX name where OS Login is on
    assert str(parse_jump("bastion:2222").for_user("alice_example_com")) == \
        "alice_example_com@bastion:2222"
    assert parse_jump("bob@bastion").for_user("alice_example_com").user == "bob"  # named: kept


@pytest.mark.parametrize("text", ["alice@", "@host", "alice@host:0", "host:0",
                                  "alice@host:99999", "a b@host", "alice@host;rm -rf /",
                                  "-oProxyCommand=x", "alice@-oProxyCommand=x", ""])
def test_a_bad_jump_is_one_sentence_with_the_form(text):
    with pytest.raises(ConfigError, match=r"host, user@host or user@host:port"):
        parse_jump(text, "--jump")


def test_the_jump_setting_is_checked_where_it_comes_from(tmp_path):
    env = {"TPUFAB_USER_CONFIG": str(tmp_path / "none.yaml"), "TPUFAB_JUMP": "bastion;x"}
    with pytest.raises(ConfigError, match=r"^TPUFAB_JUMP: jump must be"):
        load_settings(env=env, cwd=tmp_path)
    (tmp_path / "tpufab.yaml").write_text("jump: alice@bastion:2200\n")
    settings = load_settings(env={"TPUFAB_USER_CONFIG": str(tmp_path / "none.yaml")},
                             cwd=tmp_path)
    assert settings.jump == "alice@bastion:2200"
    assert settings.source_of("jump") == str(tmp_path / "tpufab.yaml")


def test_proxy_command_quotes_and_escapes_percent():
    jump = Jump("alice", "bastion", 2200)
    command = proxy_command(jump, ["-o", "UserKnownHostsFile=/home/a b/known_hosts"],
                            "/keys/100%/id")
    argv = shlex.split(command)
    assert argv[:3] == ["ssh", "-i", "/keys/100%%/id"]  # ssh turns %% back into %
    assert "UserKnownHostsFile=/home/a b/known_hosts" in argv
    assert argv[-4:] == ["2200", "-W", "%h:%p", "alice@bastion"]


def test_a_target_with_its_jump_crosses_processes():
    target = Target(worker=3, host="10.0.0.4", user="alice", key_filename="/k",
                    host_key_alias="tpufab-1-w3", jump=Jump("alice", "bastion", 22, "/k"))
    assert pickle.loads(pickle.dumps(target)) == target


def _node(external: str | None) -> Node:
    return Node(name="demo", project="p", zone="z", accelerator_type="v4-16", state="READY",
                workers=[WorkerEndpoint(i, f"10.0.0.{i}", external and f"{external}.{i}")
                         for i in range(2)])


def test_a_node_without_external_ips_needs_a_jump_or_internal_ip(tmp_path):
    env = {"TPUFAB_USER_CONFIG": str(tmp_path / "none.yaml")}
    plain = load_settings(env=env, cwd=tmp_path)
    check_reachable([_node("34.1.2")], plain)  # external IPs: nothing to say
    with pytest.raises(ConfigError) as err:
        check_reachable([_node(None)], plain)
    assert "demo has no external IPs" in str(err.value) and "--jump" in str(err.value)
    check_reachable([_node(None)], load_settings({"jump": "a@b"}, env=env, cwd=tmp_path))
    check_reachable([_node(None)], load_settings({"internal_ip": True}, env=env, cwd=tmp_path))


class _Transport:
    """A bastion transport whose channel opens fail as paramiko's do."""

    def __init__(self, error: Exception):
        self.error = error
        self.opened: list[tuple] = []

    def open_channel(self, kind, dest, src, timeout):
        self.opened.append((kind, dest, timeout))
        raise self.error

    def is_active(self) -> bool:
        return True


class _Client:
    def __init__(self, transport):
        self.transport = transport

    def get_transport(self):
        return self.transport


def test_channel_failures_read_like_direct_ones():
    import paramiko

    from tpufab.ssh import jump, transport

    bastion = Jump("alice", "bastion")
    refused = _Transport(paramiko.ChannelException(2, "Connect failed"))
    with pytest.raises(ConnectionRefusedError):  # retried by the fan-out, then "refused"
        jump.open_channel(bastion, None, "10.0.0.3", 22, 5.0,
                          connect=lambda *a: _Client(refused))
    assert refused.opened == [("direct-tcpip", ("10.0.0.3", 22), 5.0)]
    hung = _Transport(paramiko.SSHException("Timeout opening channel."))
    with pytest.raises(transport.ConnectError, match=r"^connection timed out: .*within 5 s .*"
                                                  r"firewall rule"):
        jump.open_channel(bastion, None, "10.0.0.3", 22, 5.0, connect=lambda *a: _Client(hung))
    prohibited = _Transport(paramiko.ChannelException(1, "Administratively prohibited"))
    with pytest.raises(jump.JumpError, match="AllowTcpForwarding"):
        jump.open_channel(bastion, None, "10.0.0.3", 22, 5.0,
                          connect=lambda *a: _Client(prohibited))
