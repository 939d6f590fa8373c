"""The client side of kept connections (tpufab.ssh.keeper): find the pod's keeper, or start
one, and hand it this command's fan-out work (``Keeper.shard``); stop a pod's keepers; say
whether they run; ask one which pod it holds, or a cloud API read."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from tpufab.ssh.keeper.protocol import (
    API_READS,
    API_SILENT,
    API_WAIT,
    CONNECT_WAIT,
    LOOKUP_WAIT,
    PROTOCOL,
    SPAWN_WAIT,
    version,
)
from tpufab.ssh.keeper.sockets import (
    SUPPORTED,
    api_env,
    peer,
    resident_pid,
    server_env,
    socket_dir,
    unsafe,
)
from tpufab.ssh.shards.frames import read_frame, write_frame
from tpufab.ssh.shards.parent import Shard

SOCKET_MAX = 100     # bytes: sun_path holds 108
STOPPED = "another tpufab closed the pod's kept connections"   # what a stopped keeper's commands hear
_WARNED: set[str] = set()


# ---------------------------------------------------------------------------------------------
# Where: the private directory and the socket's name
# ---------------------------------------------------------------------------------------------


def keeper_dir() -> Path:
    return Path(socket_dir())


def _warn(path: Path, reason: str) -> None:
    """One sentence, once per process: why the kept connections are not used."""
    if str(path) in _WARNED:
        return
    _WARNED.add(str(path))
    print(f"tpufab: not using kept connections at {path}: {reason}; remove it (tpufab makes "
          "a private one) — connecting directly.", file=sys.stderr)


def private_dir() -> Path | None:
    """The keepers' directory (made 0700 if missing), or None (said once) when it is not ours
    and private."""
    if not SUPPORTED:
        return None
    path = keeper_dir()
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        path.mkdir(mode=0o700, exist_ok=True)
    except OSError as err:
        _warn(path, f"it cannot be made ({err.strerror})")
        return None
    reason = unsafe(path, "directory")
    if reason:
        _warn(path, reason)
        return None
    return path


def pod_prefix(project: str | None, zone: str | None, name: str | None) -> str:
    """The first part of a pod's socket names: every keeper of one pod shares it."""
    return hashlib.sha256(f"{project}\0{zone}\0{name}".encode()).hexdigest()[:12]


def connection_key(fanout) -> str:
    """The hash of everything the kept connections depend on (see the module's docstring)."""
    parts = [version(), str(PROTOCOL), str(Path(fanout.known_hosts.path).absolute()),
             str(fanout.python), str(fanout.concurrency)]
    for worker in sorted(fanout.targets):
        t = fanout.targets[worker]
        key = os.path.abspath(os.path.expanduser(t.key_filename)) if t.key_filename else ""
        pinned = sorted(fanout.known_hosts.lookup(t.key_alias))
        parts.append(repr((worker, t.host, t.port, t.user, key, t.key_alias, pinned,
                           repr(t.jump), t.auth_hint)))
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:20]


def _dial(path: Path, deadline: float) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(max(0.05, deadline - time.monotonic()))
        sock.connect(str(path))
        return sock
    except BaseException:
        sock.close()
        raise


def _ask(sock: socket.socket, message: tuple, deadline: float) -> Any:
    """Send ``message``, read the one answer before ``deadline`` (None: no answer)."""
    sock.settimeout(max(0.05, deadline - time.monotonic()))
    with sock.makefile("wb") as out:
        write_frame(out, threading.Lock(), message)
    with sock.makefile("rb") as inbox:
        return read_frame(inbox)


def is_keeper(pid: int) -> bool:
    """Whether ``pid`` is a keeper process of this user (its command line says so)."""
    try:
        if os.stat(f"/proc/{pid}").st_uid != os.getuid():
            return False
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return b"tpufab.ssh.keeper.server" in fh.read()
    except OSError:
        return False


def _kill(sock: socket.socket) -> None:
    """Stop the keeper on the other end of ``sock`` (one of ours: it hangs or is stale)."""
    try:
        pid, uid, _gid = peer(sock)
        if uid == os.getuid() and pid > 1 and pid != os.getpid():
            os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


class KeeperShard(Shard):
    """The client's end of a keeper: a fan-out shard over the unix socket (tpufab.ssh.shards.parent)."""

    what = "the connection keeper"

    def __init__(self, sock: socket.socket, fanout, pid: int):
        self.index, self.pid, self.sock = 0, pid, sock
        self.workers = set(fanout.targets)
        self.fanout = fanout
        self.tasks = {}
        self.lock = threading.Lock()
        self.send_lock = threading.Lock()
        sock.settimeout(None)
        self.inbox, self.outbox = sock.makefile("rb"), sock.makefile("wb")
        self.alive = True
        self.heard = time.monotonic()
        self.reader = threading.Thread(target=self._read_loop, daemon=True,
                                       name="tpufab-keeper")
        self.reader.start()

    @property
    def name(self) -> str:
        return f"{self.what} (pid {self.pid})"

    def _dispatch(self, message: tuple) -> None:
        if message[0] == "closing":   # told to stop (a delete, a disconnect): it says why
            self.ending = f"{self.name} was stopped: {message[1]}"
            self._lost(self.ending, said=True)
        else:
            super()._dispatch(message)

    def _stop_process(self) -> None:
        """SIGKILL the keeper (it does not answer: a TERM would wait on it too), if that pid is
        still a keeper of ours; its connections close with it."""
        self.alive = False
        if is_keeper(self.pid):
            with contextlib.suppress(OSError):
                os.kill(self.pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def _lost(self, reason: str, *, said: bool = False) -> None:
        super()._lost(reason if said else f"{self.name} stopped mid-command; run the command "
                      "again", said=True)

    def close(self) -> None:
        """This command is done with the keeper; its connections stay open."""
        self.alive = False
        with self.lock:
            self.tasks.clear()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the reader (a close would wait for it)
        self.reader.join(5)
        for stream in (self.outbox, self.inbox):
            with contextlib.suppress(OSError, ValueError):
                stream.close()
        self.sock.close()


class Keeper:
    """A pod's keeper, as its commands see it: ``shard(fanout)`` is the live connection to it
    (started if need be), or None when this command connects itself."""

    def __init__(self, prefix: str, keep_alive: float, record: dict | None = None,
                 pending: Prestarted | None = None):
        self.prefix, self.keep_alive, self.record = prefix, keep_alive, record
        self.pending = pending   # a keeper started ahead (prestart), waiting for its socket
        self._shard: KeeperShard | None = None
        self._lock = threading.Lock()

    def shard(self, fanout) -> KeeperShard | None:
        with self._lock:
            if self._shard is not None and self._shard.alive:
                return self._shard
            self._shard = None
            try:
                self._shard = self._attach(fanout)
            except Exception:  # noqa: BLE001 - never worse than connecting ourselves
                self._shard = None
            return self._shard

    def _attach(self, fanout) -> KeeperShard | None:
        folder = private_dir()
        if folder is None:
            return None
        path = folder / f"{self.prefix}-{connection_key(fanout)}.sock"
        if len(str(path)) > SOCKET_MAX:
            return None
        stop_others(folder, self.prefix, keep=path)
        hello = ("hello", PROTOCOL, version(), self.keep_alive, _init(fanout), self.record)
        if os.path.lexists(path):
            reason = unsafe(path, "socket")
            if reason:
                _warn(path, reason)
                return None
            found = self._handshake(path, hello, time.monotonic() + CONNECT_WAIT)
            if found is not None:
                if self.pending is not None:   # not needed: it exits now
                    self.pending.discard()
                    self.pending = None
                return _shard(found, fanout, self.keep_alive)
        # None there (or it was stale and is stopped now): start one (or give the one started
        # ahead its socket), wait a bounded time.
        deadline = time.monotonic() + SPAWN_WAIT
        pending, self.pending = self.pending, None
        if not (pending is not None and pending.serve(path)) and not _spawn(path, deadline):
            return None
        while time.monotonic() < deadline:
            if path.exists():
                reason = unsafe(path, "socket")
                if reason:
                    _warn(path, reason)
                    return None
                found = self._handshake(path, hello, deadline, replace=False)
                if found is not None:
                    return _shard(found, fanout, self.keep_alive)
            time.sleep(0.02)
        return None

    def _handshake(self, path: Path, hello: tuple, deadline: float, *, replace: bool = True):
        """(socket, keeper pid) of a keeper that said ready, else None. A stale one is
        stopped so that the next keeper can take its place (``replace``: not one this
        command just started, which may only be slow to start: it serves the next one)."""
        try:
            sock = _dial(path, deadline)
        except OSError as err:
            if replace and err.errno == errno.ECONNREFUSED:
                with contextlib.suppress(OSError):
                    path.unlink()  # nobody listens: a keeper that died
            return None
        try:
            pid, uid, _gid = peer(sock)
            if uid != os.getuid():
                _warn(path, f"the process serving it runs as uid {uid}, not you")
                sock.close()
                return None
            answer = _ask(sock, hello, deadline)
            if isinstance(answer, tuple) and answer[:1] == ("ready",):
                return sock, pid
            if not replace and answer is None:
                sock.close()
                return None
            _kill(sock)  # refused (another version) or no answer: replaced
        except (OSError, EOFError, ValueError):
            if not replace:
                sock.close()
                return None
            _kill(sock)  # hangs: replaced
        sock.close()
        with contextlib.suppress(OSError):
            path.unlink()
        return None


def _shard(found: tuple[socket.socket, int], fanout, keep_alive: float) -> KeeperShard:
    sock, pid = found
    KEPT.append(keep_alive)
    return KeeperShard(sock, fanout, pid)


KEPT: list[float] = []   # this process's kept connections' keep_alive (tpufab.resident)


def _init(fanout) -> dict:
    """The "init" message of a shard (tpufab.ssh.shards.parent), for the whole pod."""
    from dataclasses import replace

    targets = [replace(t, key_filename=os.path.abspath(os.path.expanduser(t.key_filename)))
               if t.key_filename else t for t in fanout.targets.values()]
    known = fanout.known_hosts
    return {"targets": targets, "known_hosts": str(Path(known.path).absolute()),
            "forget_hint": known.forget_hint, "concurrency": fanout.concurrency,
            "connect_attempts": fanout.connect_attempts, "retry_wait": fanout.retry_wait,
            "python": fanout.python, "kill_grace": fanout.kill_grace,
            "processes": fanout.processes, "ssh_transport": fanout.ssh_transport}


class Prestarted:
    """A keeper started ahead (``prestart``): its interpreter and SSH modules load while the
    command asks the cloud API; ``serve(path)`` tells it its socket. Never told (the command
    found a keeper, failed, or ended), it exits: its stdin closes with this process."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc

    def serve(self, path: Path) -> bool:
        """Give it its socket (it logs beside it); False when it is gone already."""
        try:
            self.proc.stdin.write(f"{path}\n".encode())
            self.proc.stdin.close()
            return True
        except (OSError, ValueError):
            return False

    def discard(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.proc.stdin.close()


def prestart() -> Prestarted | None:
    """Start a keeper ahead of knowing its socket (the first command to a pod: the keeper's
    start then overlaps the cloud API lookup instead of following it); None when keepers
    cannot be kept here (no private directory)."""
    folder = private_dir()
    if folder is None:
        return None
    try:   # "FOLDER/-": a socket in FOLDER, named on stdin (ps shows where)
        proc = subprocess.Popen(
            [sys.executable, "-m", "tpufab.ssh.keeper.server", str(folder / "-")],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
            cwd="/", close_fds=True, env=server_env(os.environ))
    except OSError:
        return None
    threading.Thread(target=proc.wait, daemon=True).start()  # the first fork exits at once
    return Prestarted(proc)


def _spawn(path: Path, deadline: float) -> bool:
    """Start a keeper for ``path`` (it detaches itself); False when it could not start."""
    log = path.with_suffix(".log")
    try:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    except OSError:
        return False
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tpufab.ssh.keeper.server", str(path)], stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=fd, start_new_session=True, cwd="/",
            close_fds=True, env=server_env(os.environ))
    except OSError:
        return False
    finally:
        os.close(fd)
    try:
        return proc.wait(max(0.05, deadline - time.monotonic())) == 0  # the first fork's exit
    except subprocess.TimeoutExpired:
        threading.Thread(target=proc.wait, daemon=True).start()  # reaped when it gets there
        return True


def _sockets(folder: Path, prefix: str) -> list[Path]:
    try:
        return sorted(folder.glob(f"{prefix}-*.sock"))
    except OSError:
        return []


def _stop_one(path: Path, why: str) -> bool:
    """Tell the keeper at ``path`` to stop, and the commands under way over it ``why`` (a hung
    one is killed); True if one was there."""
    if unsafe(path, "socket"):
        return False
    deadline = time.monotonic() + CONNECT_WAIT
    try:
        sock = _dial(path, deadline)
    except OSError:
        with contextlib.suppress(OSError):
            path.unlink()
        return False
    try:
        if peer(sock)[1] != os.getuid():
            return False
        answer = _ask(sock, ("stop", why), deadline)
        if not (isinstance(answer, tuple) and answer[:1] == ("stopping",)):
            _kill(sock)
    except (OSError, EOFError, ValueError):
        _kill(sock)
    finally:
        sock.close()
    with contextlib.suppress(OSError):
        path.unlink()
    return True


def stop_others(folder: Path, prefix: str, keep: Path) -> None:
    """Stop the pod's keepers for other connections (a recreated node, new host keys)."""
    for path in _sockets(folder, prefix):
        if path != keep:
            _stop_one(path, f"a newer command found the pod's workers changed (a recreated "
                            f"node, or new host keys) (from pid {os.getpid()})")


def stop(project: str | None, zone: str | None, name: str | None, why: str | None = None) -> int:
    """Stop every keeper of the pod (`tpufab disconnect`, a delete): how many there were.
    ``why``: what the commands under way over them are told (their workers' results say it)."""
    folder = keeper_dir()
    if unsafe(folder, "directory") or not folder.is_dir():
        return 0
    why = f"{why or STOPPED} (from pid {os.getpid()})"
    return sum(_stop_one(p, why) for p in _sockets(folder, pod_prefix(project, zone, name)))


def describe(project: str | None, zone: str | None, name: str | None,
             keep_alive: float) -> str | None:
    """One line for `tpufab status`: whether the pod's connections are kept (None when
    keep_alive is 0: status looks as it did before kept connections)."""
    from tpufab.durations import human_duration

    if keep_alive <= 0 or not SUPPORTED:
        return None
    folder = keeper_dir()
    live = []
    if not unsafe(folder, "directory") and folder.is_dir():
        for path in _sockets(folder, pod_prefix(project, zone, name)):
            deadline = time.monotonic() + CONNECT_WAIT
            try:
                with _dial(path, deadline) as sock:
                    if peer(sock)[1] != os.getuid():
                        continue
                    answer = _ask(sock, ("status",), deadline)
            except (OSError, EOFError, ValueError):
                continue
            if isinstance(answer, tuple) and answer[:1] == ("status",):
                live.append(answer[1])
    if not live:
        return (f"Connections: not kept (the next command keeps them for "
                f"{human_duration(keep_alive)}).")
    info = live[0]
    resident = resident_pid()
    served = f" Commands are run by the resident server (pid {resident})." if resident else ""
    return (f"Connections: kept by pid {info['pid']} ({info['connected']} of {info['workers']} "
            f"workers connected; kept {human_duration(info['keep_alive'])} after the last "
            f"command; socket {info['socket']}).{served}")


def attach(fanout, settings, record: dict | None = None,
           pending: Prestarted | None = None) -> None:
    """Let ``fanout`` send its runs to the pod's keeper (if keep_alive is on); ``record``:
    the pod as the cloud API described it (``nodes``, ``slices``, ``settings``: see
    :func:`lookup`), kept by the keeper for the next command; ``pending``: a keeper started
    ahead (``prestart``), used if this command must start one."""
    seconds = settings.keep_alive_seconds
    if seconds > 0 and SUPPORTED:
        fanout.keeper = Keeper(pod_prefix(settings.project, settings.zone, settings.name),
                               seconds, record, pending)
    elif pending is not None:
        pending.discard()


def lookup(project: str | None, zone: str | None, name: str | None,
           fingerprint: tuple) -> tuple[Path, dict, dict] | None:
    """(socket, record, init) of a keeper of the pod that holds a connection to every worker,
    made with the settings ``fingerprint``; None (then the command asks the cloud API) when
    there is none, it is not private, another version, or slow to answer (LOOKUP_WAIT)."""
    folder = keeper_dir()
    if not SUPPORTED or unsafe(folder, "directory") or not folder.is_dir():
        return None
    for path in _sockets(folder, pod_prefix(project, zone, name)):
        if unsafe(path, "socket"):
            continue
        deadline = time.monotonic() + LOOKUP_WAIT
        try:
            with _dial(path, deadline) as sock:
                if peer(sock)[1] != os.getuid():
                    continue
                answer = _ask(sock, ("lookup",), deadline)
        except (OSError, EOFError, ValueError):
            continue
        if not (isinstance(answer, tuple) and len(answer) == 6 and answer[0] == "pod"):
            continue
        _, protocol, theirs, record, init, connected = answer
        if protocol != PROTOCOL or theirs != version() or not connected or \
                not isinstance(record, dict) or record.get("settings") != fingerprint:
            continue
        return path, record, init
    return None


class KeeperGone(Exception):
    """The keeper did not answer an API read (then the command asks the API itself)."""


def ask_api(path: Path, settings, method: str, args: tuple = (), kwargs: dict | None = None,
            *, on_note=None, wait: float = API_WAIT) -> Any:
    """``control.method(*args, **kwargs)`` of the control plane ``settings`` call for, asked
    by the keeper at ``path`` (a fresh API answer; only the client is the keeper's, loaded
    already). ``on_note(text)`` gets each retry line. Raises the API's error as the command
    would have, or KeeperGone when the keeper did not answer (bounded by CONNECT_WAIT to
    reach it, ``wait`` for the answer, API_SILENT without a word from it: a frozen keeper)."""
    if method not in API_READS:
        raise KeeperGone(f"{method} is not a read")
    from tpufab import errors

    deadline = time.monotonic() + wait
    try:
        with _dial(path, time.monotonic() + CONNECT_WAIT) as sock:
            if peer(sock)[1] != os.getuid():
                raise KeeperGone("not ours")
            sock.settimeout(min(wait, API_SILENT))
            with sock.makefile("wb") as out:
                write_frame(out, threading.Lock(), ("api", PROTOCOL, version(), settings, method,
                                                    tuple(args), dict(kwargs or {}),
                                                    api_env(os.environ)))
            with sock.makefile("rb") as inbox:
                while True:
                    if time.monotonic() > deadline:
                        raise KeeperGone(f"no answer within {wait:g} s")
                    answer = read_frame(inbox)
                    if not isinstance(answer, tuple) or not answer:
                        raise KeeperGone("no answer")
                    if answer[0] == "alive":
                        continue
                    if answer[0] == "note" and on_note is not None:
                        on_note(answer[1])
                    elif answer[0] == "value":
                        return answer[1]
                    elif answer[0] == "error":
                        kind = getattr(errors, answer[1], None)
                        if not (isinstance(kind, type) and issubclass(kind, errors.TpufabError)):
                            kind = errors.ApiError
                        raise kind(answer[2])
                    elif answer[0] != "note":
                        raise KeeperGone(f"answered {answer[0]!r}")
    except (OSError, EOFError, ValueError, pickle.UnpicklingError) as err:
        raise KeeperGone(str(err)) from None


def matches(path: Path, fanout) -> bool:
    """Whether the keeper at ``path`` holds exactly ``fanout``'s connections (its name is
    their hash: workers, keys, node id, the host keys pinned now, version)."""
    return path.name.endswith(f"-{connection_key(fanout)}.sock")
