"""KnownHosts: pinned keys, looked up once per worker, from a file parsed once per version."""

import base64
import os

import pytest

from tpufab.ssh.hostkeys import HostKeyChanged, KnownHosts, alias


def key(n: int) -> str:
    return "ssh-ed25519 " + base64.b64encode(n.to_bytes(4, "big") * 8).decode()


def test_lookups_see_pins_forgets_and_changes_made_by_another_process(tmp_path):
    path = tmp_path / "known_hosts"
    hosts = KnownHosts(path)
    hosts.pin("7", {w: key(w) for w in range(1024)})
    assert [hosts.lookup(alias("7", w)) for w in (0, 1023)] == \
        [[tuple(key(0).split())], [tuple(key(1023).split())]]
    assert hosts.lookup(alias("7", 1024)) == []
    # another process (another KnownHosts) changes the file: this one sees it at once
    other = KnownHosts(path)
    assert other.forget("7") == 1024
    assert hosts.lookup(alias("7", 0)) == []
    with open(path, "a") as f:  # by hand, in place
        f.write(f"{alias('8', 0)} {key(5)}\n")
    os.utime(path, ns=(1, 1))  # even with an old time, the size differs
    assert hosts.lookup(alias("8", 0)) == [tuple(key(5).split())]


def test_a_thousand_workers_are_checked_against_one_read_of_the_file(tmp_path, monkeypatch):
    path = tmp_path / "known_hosts"
    hosts = KnownHosts(path)
    hosts.pin("9", {w: key(w) for w in range(1024)})
    reads = []
    real = type(path).read_text

    def counting(self, *args, **kwargs):
        reads.append(self)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(type(path), "read_text", counting)
    for w in range(1024):
        assert hosts.lookup(alias("9", w)) == [tuple(key(w).split())]
    assert len(reads) <= 1


def test_a_migs_vms_are_pinned_by_instance_id_and_forgotten_with_their_group(tmp_path):
    hosts = KnownHosts(tmp_path / "known_hosts")
    vm = alias("77", 0, "123")
    assert vm == "tpufab-77-vm123" and alias("77", 0) == "tpufab-77-w0"
    hosts.pin_aliases({vm: key(1), alias("77", 1, "456"): key(2), alias("777", 0): key(3)})
    assert hosts.lookup(vm) == [tuple(key(1).split())]
    with pytest.raises(HostKeyChanged, match="host key of VM 123 of node 77 differs") as err:
        hosts.pin_aliases({vm: key(4)})  # another key for the same VM: refused
    assert "tpufab known-hosts forget 77" in str(err.value)
    assert hosts.forget("77") == 2  # the group's VMs go with it; node 777's stays
    assert hosts.lookup(alias("777", 0)) == [tuple(key(3).split())]


def test_a_key_that_differs_from_the_apis_says_so(tmp_path):
    """issue 37, 15: a fresh laptop pins the keys the API publishes, then meets a worker
    whose key differs: the sentence named "the one pinned in known_hosts", which this
    laptop never pinned by hand. It now says where the key came from (the line keeps it)."""
    path = tmp_path / "known_hosts"
    hosts = KnownHosts(path)
    hosts.pin("9", {0: key(1)})
    offered_type, offered = key(2).split()
    with pytest.raises(HostKeyChanged) as err:
        KnownHosts(path).verify_blob(alias("9", 0), offered_type, offered)
    assert "differs from the one the cloud API published for it (its guest attributes), " \
        f"pinned in {path} " in str(err.value)
    # a key pinned on first use is the one pinned in the file, as before
    hosts.verify_blob(alias("9", 1), *key(3).split())
    with pytest.raises(HostKeyChanged, match=f"differs from the one pinned in {path} "):
        hosts.verify_blob(alias("9", 1), *key(4).split())
    hosts.forget_alias(alias("9", 1))        # a rewrite keeps how the others were learned
    with pytest.raises(HostKeyChanged, match="the cloud API published"):
        KnownHosts(path).verify_blob(alias("9", 0), offered_type, offered)
