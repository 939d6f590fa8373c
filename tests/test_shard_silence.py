"""Ctrl-C over a shard (the pod's connection keeper, a fan-out child): whether it answered is
judged by its answer to the ping sent with the interrupt, not by when its last frame was read.

The peer here is the client's own end of the protocol (tpufab.ssh.shards.frames) played by a
thread over a socketpair, so the order of frames is exact: under CI's load a keeper frozen
right after it spoke had that last frame read only after Ctrl-C, and tpufab said "Interrupted:
stopped 'CMD' on w[0-1]." while the command ran on (test_fault_matrix's frozen-keeper case).
"""

from __future__ import annotations

import socket
import subprocess
import threading
import types

import pytest

from tpufab.ssh.connections import Target
from tpufab.ssh.fanout import KEEPER, Fanout
from tpufab.ssh.hostkeys import KnownHosts
from tpufab.ssh.keeper.client import KeeperShard
from tpufab.ssh.results import FanoutInterrupted
from tpufab.ssh.shards import frames


class Peer(threading.Thread):
    """The keeper's side: takes the run; when interrupted, writes a frame that is no answer
    (one it wrote before it froze) and, if ``answers``, the pong for each ping; never
    confirms the workers' commands stopped. ``got`` lists the kinds of what it read."""

    def __init__(self, sock: socket.socket, answers: bool, cancel: threading.Event):
        super().__init__(daemon=True)
        self.sock, self.answers, self.cancel = sock, answers, cancel
        self.got: list[str] = []

    def run(self) -> None:
        inbox, outbox, lock = self.sock.makefile("rb"), self.sock.makefile("wb"), threading.Lock()
        run_id = None
        while (message := frames.read_frame(inbox)) is not None:
            self.got.append(message[0])
            if message[0] == "run":
                run_id = message[1]
                self.cancel.set()    # the caller's Ctrl-C, once the run is on the workers
            elif message[0] == "interrupt":
                frames.write_frame(outbox, lock, ("lines", run_id, 0, "stdout", b"said before\n"))
            elif message[0] == "ping" and self.answers:
                frames.write_frame(outbox, lock, ("pong", *message[1:]))


@pytest.fixture
def keeper_pid():
    """A live process standing for the keeper: not one of ours, so giving up on it kills
    nothing (KeeperShard checks the pid is a keeper)."""
    proc = subprocess.Popen(["sleep", "300"])
    try:
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


def interrupted(tmp_path, pid: int, answers: bool) -> tuple[str, Peer]:
    ours, theirs = socket.socketpair()
    cancel = threading.Event()
    peer = Peer(theirs, answers, cancel)
    peer.start()
    targets = [Target(w, "192.0.2.1", "tpu") for w in (0, 1)]
    with Fanout(targets, known_hosts=KnownHosts(tmp_path / "kh"), kill_grace=0.5) as fan:
        shard = KeeperShard(ours, fan, pid)
        fan.keeper = types.SimpleNamespace(shard=lambda _fan: shard)
        with pytest.raises(FanoutInterrupted) as caught:
            fan.run("sleep 300", cancel=cancel)
        assert fan._shards.get(KEEPER) is shard
    theirs.close()
    peer.join(10)
    return str(caught.value), peer


def test_a_keeper_silent_to_the_interrupt_s_ping_is_named_though_a_frame_came_after(
        tmp_path, keeper_pid):
    said, peer = interrupted(tmp_path, keeper_pid, answers=False)
    assert said.startswith(f"Interrupted: the connection keeper (pid {keeper_pid}) did not "
                           "answer, so tpufab stopped it; its connections closed, so w[0-1] "
                           "stop what it started of 'sleep 300'."), said
    assert peer.got[:3] == ["run", "interrupt", "ping"], peer.got


def test_a_keeper_that_answers_the_ping_is_asked_to_close_the_workers_connections(
        tmp_path, keeper_pid):
    said, peer = interrupted(tmp_path, keeper_pid, answers=True)
    assert said.startswith("Interrupted: stopped 'sleep 300' on w[0-1]."), said
    assert peer.got.count("close_worker") == 2, peer.got
