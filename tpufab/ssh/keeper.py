"""Kept connections: one background process per pod holds its SSH connections between commands.

Like OpenSSH's ControlPersist. The first command to a pod starts a *keeper*
(``python -m tpufab.ssh.keeper SOCKET``: double-forked, in its own session, so a terminal's
Ctrl-C or hang-up never reaches it) and hands it the pod's fan-out work; every later command,
``invoke`` task or Pod API call for that pod finds it on its unix socket and runs its commands
over the connections it already holds. The keeper is a long-lived fan-out shard: the client
side is a :class:`tpufab.ssh.fanshard.Shard` over the socket, the keeper runs
``tpufab.ssh.shard_child.serve`` for each client, so output, exit codes, masking, progress and
Ctrl-C (the keeper runs the same interrupt path) are those of a fan-out shard.

Keyed, private, bounded:

- The socket's name is a hash of everything the connections depend on: the pod (project,
  zone, name), every worker's address, login user, key and host-key alias (the node id), the
  host keys pinned for them, the jump host, tpufab's version and PROTOCOL. A recreated node
  (new node id or host key) therefore never reaches an old connection: it gets a new keeper,
  and the pod's other keepers are told to stop.
- The socket lives in a 0700 directory (``$XDG_RUNTIME_DIR/tpufab``, else
  ``~/.cache/tpufab/keepers``) and is 0600; the keeper checks the peer's uid (SO_PEERCRED) on
  every connection, the client checks the directory's and socket's owner and mode and the
  keeper's uid, and connects itself (with a one-sentence warning) when any is wrong.
- A command waits at most CONNECT_WAIT for a running keeper's answer (SPAWN_WAIT for one it
  starts) and otherwise connects itself; a keeper that does not answer in time, belongs to
  another tpufab version or refuses is stopped and replaced by the next command.
- The keeper exits after ``keep_alive`` seconds without a client (``TPUFAB_KEEP_ALIVE``,
  ``--keep-alive``; 0: no keeper), on ``tpufab disconnect``, when the pod is deleted, when
  its socket is removed or taken over, and when every connection it held is gone (a pod
  deleted, stopped or recreated behind tpufab's back, ``tpufab sim down``).

A warm command does not ask the cloud API: the keeper also holds the pod as the last command
that asked the API saw it (its nodes, slices and the settings its connections were made
with: :func:`lookup`). A command whose settings match and whose keeper holds every worker's
connection builds its fan-out from that, checks that the socket's name is the hash of that
fan-out (the same workers, keys, node id and host keys pinned in known_hosts now) and never
imports a cloud client. A keeper missing a connection (a worker that went away: a deleted,
stopped, preempted or recreated VM drops it) is not asked: the command asks the API as before,
and a recreated node's new id and host keys give it a new keeper.

A command that must ask the API (`tpufab status`: the node's state, health and maintenance
now) asks it through the keeper (``ask_api``: the reads in API_READS only), whose client is
loaded already; the answer is the API's, fresh, never the keeper's record. A keeper that does
not answer (CONNECT_WAIT to reach it, API_WAIT for the answer) is not asked again in that
command: it asks the API itself.

If the keeper dies during a command, the workers' commands die with its connections and each
worker's result says to run the command again (it is not rerun: it may have done part of
its work).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
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

from tpufab.ssh.fanshard import Shard, _read, _write
from tpufab.ssh.sockets import SUPPORTED, resident_pid, socket_dir
from tpufab.ssh.sockets import peer as _peer
from tpufab.ssh.sockets import unsafe as _private

PROTOCOL = 3
CONNECT_WAIT = 2.0   # s: a running keeper's answer (connect + handshake)
LOOKUP_WAIT = 1.0    # s: a keeper's answer to "which pod do you hold" (else: the cloud API)
SPAWN_WAIT = 3.0     # s: a keeper this command starts (a Python interpreter starting)
API_WAIT = 60.0      # s: a cloud API read through a keeper (then the command asks itself)
# The control plane's reads a command may ask through the pod's keeper (tpufab status: its
# client is loaded there already); anything else a command does itself.
API_READS = frozenset({"get_node", "find_node", "holds", "list_nodes", "host_keys",
                       "upcoming_maintenance", "get_queued_resource", "find_queued_resource",
                       "list_queued_resources", "list_operations", "zones",
                       "accelerator_types", "multislice", "has_multislice"})
TICK = 0.5           # s: how often an idle keeper looks at its clock and its socket
SOCKET_MAX = 100     # bytes: sun_path holds 108
_WARNED: set[str] = set()


def _version() -> str:
    """tpufab's ``__version__`` (the package is loaded: this module is inside it)."""
    return getattr(sys.modules.get("tpufab"), "__version__", "unknown")


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
    reason = _private(path, "directory")
    if reason:
        _warn(path, reason)
        return None
    return path


def pod_prefix(project: str | None, zone: str | None, name: str | None) -> str:
    """The first part of a pod's socket names: every keeper of one pod shares it."""
    return hashlib.sha256(f"{project}\0{zone}\0{name}".encode()).hexdigest()[:12]


def connection_key(fanout) -> str:
    """The hash of everything the kept connections depend on (see the module's docstring)."""
    parts = [_version(), str(PROTOCOL), str(Path(fanout.known_hosts.path).absolute()),
             str(fanout.python), str(fanout.concurrency)]
    for worker in sorted(fanout.targets):
        t = fanout.targets[worker]
        key = os.path.abspath(os.path.expanduser(t.key_filename)) if t.key_filename else ""
        pinned = sorted(fanout.known_hosts.lookup(t.key_alias))
        parts.append(repr((worker, t.host, t.port, t.user, key, t.key_alias, pinned,
                           repr(t.jump), t.auth_hint)))
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:20]


# ---------------------------------------------------------------------------------------------
# Client side
# ---------------------------------------------------------------------------------------------


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
        _write(out, threading.Lock(), message)
    with sock.makefile("rb") as inbox:
        return _read(inbox)


def _kill(sock: socket.socket) -> None:
    """Stop the keeper on the other end of ``sock`` (one of ours: it hangs or is stale)."""
    try:
        pid, uid, _gid = _peer(sock)
        if uid == os.getuid() and pid > 1 and pid != os.getpid():
            os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


class KeeperShard(Shard):
    """The client's end of a keeper: a fan-out shard over the unix socket (tpufab.ssh.fanshard)."""

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
        self.reader = threading.Thread(target=self._read_loop, daemon=True,
                                       name="tpufab-keeper")
        self.reader.start()

    def _lost(self, reason: str) -> None:
        super()._lost("the connection keeper holding it stopped mid-command; run the command "
                      "again")

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
        hello = ("hello", PROTOCOL, _version(), self.keep_alive, _init(fanout), self.record)
        if os.path.lexists(path):
            reason = _private(path, "socket")
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
                reason = _private(path, "socket")
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
            pid, uid, _gid = _peer(sock)
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
    """The "init" message of a shard (tpufab.ssh.fanshard), for the whole pod."""
    from dataclasses import replace

    targets = [replace(t, key_filename=os.path.abspath(os.path.expanduser(t.key_filename)))
               if t.key_filename else t for t in fanout.targets.values()]
    known = fanout.known_hosts
    return {"targets": targets, "known_hosts": str(Path(known.path).absolute()),
            "forget_hint": known.forget_hint, "concurrency": fanout.concurrency,
            "connect_attempts": fanout.connect_attempts, "retry_wait": fanout.retry_wait,
            "python": fanout.python, "kill_grace": fanout.kill_grace,
            "processes": fanout.processes, "ssh_transport": fanout.ssh_transport}


PRESTART_WAIT = 60.0  # s: how long a keeper started ahead waits to be told its socket


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
            [sys.executable, "-m", "tpufab.ssh.keeper", str(folder / "-")],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
            cwd="/", close_fds=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
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
            [sys.executable, "-m", "tpufab.ssh.keeper", str(path)], stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=fd, start_new_session=True, cwd="/",
            close_fds=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
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


def _stop_one(path: Path) -> bool:
    """Tell the keeper at ``path`` to stop (a hung one is killed); True if one was there."""
    if _private(path, "socket"):
        return False
    deadline = time.monotonic() + CONNECT_WAIT
    try:
        sock = _dial(path, deadline)
    except OSError:
        with contextlib.suppress(OSError):
            path.unlink()
        return False
    try:
        if _peer(sock)[1] != os.getuid():
            return False
        answer = _ask(sock, ("stop",), deadline)
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
            _stop_one(path)


def stop(project: str | None, zone: str | None, name: str | None) -> int:
    """Stop every keeper of the pod (`tpufab disconnect`, a delete): how many there were."""
    folder = keeper_dir()
    if _private(folder, "directory") or not folder.is_dir():
        return 0
    return sum(_stop_one(p) for p in _sockets(folder, pod_prefix(project, zone, name)))


def describe(project: str | None, zone: str | None, name: str | None,
             keep_alive: float) -> str | None:
    """One line for `tpufab status`: whether the pod's connections are kept (None when
    keep_alive is 0: status looks as it did before kept connections)."""
    from tpufab.durations import human_duration

    if keep_alive <= 0 or not SUPPORTED:
        return None
    folder = keeper_dir()
    live = []
    if not _private(folder, "directory") and folder.is_dir():
        for path in _sockets(folder, pod_prefix(project, zone, name)):
            deadline = time.monotonic() + CONNECT_WAIT
            try:
                with _dial(path, deadline) as sock:
                    if _peer(sock)[1] != os.getuid():
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
    if not SUPPORTED or _private(folder, "directory") or not folder.is_dir():
        return None
    for path in _sockets(folder, pod_prefix(project, zone, name)):
        if _private(path, "socket"):
            continue
        deadline = time.monotonic() + LOOKUP_WAIT
        try:
            with _dial(path, deadline) as sock:
                if _peer(sock)[1] != os.getuid():
                    continue
                answer = _ask(sock, ("lookup",), deadline)
        except (OSError, EOFError, ValueError):
            continue
        if not (isinstance(answer, tuple) and len(answer) == 6 and answer[0] == "pod"):
            continue
        _, protocol, version, record, init, connected = answer
        if protocol != PROTOCOL or version != _version() or not connected or \
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
    reach it, ``wait`` for the answer)."""
    if method not in API_READS:
        raise KeeperGone(f"{method} is not a read")
    from tpufab import errors

    try:
        with _dial(path, time.monotonic() + CONNECT_WAIT) as sock:
            if _peer(sock)[1] != os.getuid():
                raise KeeperGone("not ours")
            sock.settimeout(wait)
            with sock.makefile("wb") as out:
                _write(out, threading.Lock(), ("api", PROTOCOL, _version(), settings, method,
                                               tuple(args), dict(kwargs or {})))
            with sock.makefile("rb") as inbox:
                while True:
                    answer = _read(inbox)
                    if not isinstance(answer, tuple) or not answer:
                        raise KeeperGone("no answer")
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


# ---------------------------------------------------------------------------------------------
# The keeper process
# ---------------------------------------------------------------------------------------------


class _Server:
    def __init__(self, path: Path, listener: socket.socket):
        self.path, self.listener = path, listener
        self.inode = os.stat(path).st_ino
        self.fanout = None
        self.init: dict | None = None
        self.record: dict | None = None  # the pod as the API last described it (lookup)
        self.init_lock = threading.Lock()
        self.keep_alive = 300.0
        self.clients: dict[int, Any] = {}  # id -> send
        self.clients_lock = threading.Lock()
        self.last = time.monotonic()
        self.stopping = threading.Event()
        self.ids = iter(range(1, 1 << 62))
        self.controls: dict[bytes, Any] = {}   # the control planes API reads were asked of
        self.controls_lock = threading.Lock()
        self.asking = threading.local()         # the client a retry note goes to

    def on_retry(self, target, attempt, error) -> None:
        from tpufab.ssh.shard_child import retry_message

        message = retry_message(target, attempt, error)
        with self.clients_lock:
            sends = [s for s in self.clients.values() if s is not None]
        for send in sends:
            send(message)

    def loop(self) -> None:
        self.listener.settimeout(TICK)
        while not self.stopping.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                conn = None
            except OSError:
                break
            if conn is not None:
                try:
                    uid = _peer(conn)[1]
                except OSError:
                    uid = -1
                if uid != os.getuid():
                    conn.close()  # only its own user's commands reach a keeper
                    continue
                threading.Thread(target=self.client, args=(conn,), daemon=True).start()
                continue
            with self.clients_lock:
                idle = not self.clients and (time.monotonic() - self.last > self.keep_alive
                                             or self.orphaned())
            try:
                taken = os.stat(self.path).st_ino != self.inode
            except OSError:
                taken = True
            if idle or taken:
                break

    def client(self, conn: socket.socket) -> None:
        from tpufab.ssh.shard_child import fanout_from_init, serve

        lock = threading.Lock()
        inbox, outbox = conn.makefile("rb"), conn.makefile("wb")

        def send(message: tuple) -> None:
            try:
                _write(outbox, lock, message)
            except (OSError, ValueError):
                pass

        me = next(self.ids)
        with self.clients_lock:
            self.clients[me] = None  # busy: not idle; retries go to it once it is ready
        try:
            conn.settimeout(CONNECT_WAIT * 5)
            first = _read(inbox)
            conn.settimeout(None)
            if not isinstance(first, tuple) or not first:
                return
            if first[0] == "stop":
                send(("stopping",))
                self.stopping.set()
                return
            if first[0] == "status":
                send(("status", self.status()))
                return
            if first[0] == "lookup":
                with self.init_lock:
                    record, init = self.record, self.init
                send(("pod", PROTOCOL, _version(), record, init, self.all_connected()))
                return
            if first[0] == "api":
                self.api(first, send)
                return
            if first[0] != "hello":
                return
            _, protocol, version, keep_alive, init, record = first
            if protocol != PROTOCOL or version != _version():
                send(("refused", f"keeper of tpufab {_version()} (protocol {PROTOCOL})"))
                self.stopping.set()
                return
            with self.init_lock:
                if self.init is not None and init != self.init:
                    send(("refused", "another pod's connections"))
                    return
                self.init = init
                if record is not None:
                    self.record = record
            self.keep_alive = keep_alive
            send(("ready", os.getpid()))  # at once: the client waits a bounded time for this
            with self.init_lock:
                if self.fanout is None:
                    self.fanout = fanout_from_init(init, self.on_retry)
            with self.clients_lock:
                self.clients[me] = send
            serve(self.fanout, inbox, send, stop_at_end=True)
            # the next command finds every worker's agent running (the first ran without)
            threading.Thread(target=self.fanout.start_agents, daemon=True).start()
        except (OSError, EOFError, ValueError, TypeError):
            pass
        finally:
            with self.clients_lock:
                self.clients.pop(me, None)
                self.last = time.monotonic()
            for stream in (inbox, outbox):
                with contextlib.suppress(OSError):
                    stream.close()
            conn.close()

    def api(self, message: tuple, send) -> None:
        """One control-plane read for a command (ask_api): its value, the command's error
        as a sentence (the error's class by name), or "failed" (the command asks itself)."""
        from tpufab.errors import TpufabError

        if len(message) != 7:
            return
        _, protocol, version, settings, method, args, kwargs = message
        if protocol != PROTOCOL or version != _version() or method not in API_READS:
            send(("refused", f"keeper of tpufab {_version()} (protocol {PROTOCOL})"))
            return
        self.asking.send = send
        try:
            value = getattr(self.control(settings), method)(*args, **kwargs)
            answer = ("value", value)
            pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL)  # sendable, or "failed"
        except TpufabError as err:
            answer = ("error", type(err).__name__, str(err))
        except Exception as err:  # noqa: BLE001 - the command then asks the API itself
            answer = ("failed", f"{type(err).__name__}: {err}")
        finally:
            self.asking.send = None
        send(answer)

    def control(self, settings):
        """The control plane for ``settings``, made once (its client stays loaded)."""
        from tpufab.cloud import planes

        key = pickle.dumps(settings, protocol=pickle.HIGHEST_PROTOCOL)
        with self.controls_lock:
            control = self.controls.get(key)
            if control is None:
                if len(self.controls) >= 8:   # commands with many settings: keep it bounded
                    self.controls.clear()
                control = self.controls[key] = planes.control_plane(
                    settings, on_retry=self.api_retry)
        return control

    def api_retry(self, exc: BaseException, attempt: int, delay: float) -> None:
        from tpufab.cloud.planes import retry_note

        send = getattr(self.asking, "send", None)
        if send is not None:
            send(("note", retry_note(exc, attempt, delay)))

    def status(self) -> dict:
        fan = self.fanout
        links = fan.links.values() if fan is not None else ()
        return {"pid": os.getpid(), "keep_alive": self.keep_alive, "socket": str(self.path),
                "workers": len(self.init["targets"]) if self.init else 0,
                "connected": sum(1 for link in links if link.ready)}

    def orphaned(self) -> bool:
        """It held connections and every one of them is gone (the pod was deleted, stopped,
        preempted or recreated, or the simulated pod went down): nothing left to keep."""
        fan = self.fanout
        if fan is None:
            return False
        with fan._shards_lock:
            if any(s.alive for s in fan._shards.values()):
                return False
        return not any(link.ready for link in fan.links.values())

    def all_connected(self) -> bool:
        """Every worker's connection is open (those of the keeper's own fan-out shards, if
        any, while their process runs)."""
        fan = self.fanout
        if fan is None or not fan.targets:
            return False
        with fan._shards_lock:
            shards = dict(fan._shards)
        for worker, link in fan.links.items():
            owner = fan.owner.get(worker, 0)
            if owner:
                shard = shards.get(owner)
                if shard is None or not shard.alive:
                    return False
            elif not link.ready:
                return False
        return True

    def close(self) -> None:
        with contextlib.suppress(OSError):
            if os.stat(self.path).st_ino == self.inode:
                self.path.unlink()
        self.listener.close()
        if self.fanout is not None:
            self.fanout.close()  # every worker's agent stops what it still runs


def _told_path(folder: Path) -> Path | None:
    """A keeper started ahead (``FOLDER/-``): load what serving needs, then read the socket
    path in ``folder`` its command writes on stdin (None: never told, within PRESTART_WAIT).
    It logs beside it."""
    import select

    from tpufab.ssh import fanout, hostkeys, shard_child  # noqa: F401 - loaded while waiting

    ready, _, _ = select.select([sys.stdin], [], [], PRESTART_WAIT)
    line = sys.stdin.readline().strip() if ready else ""
    if not line:
        return None
    path = Path(line)
    if path.parent != folder or not path.name.endswith(".sock"):
        return None
    log = os.open(path.with_suffix(".log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(log, 2)
    os.close(log)
    return path


def listen(path: Path, ready=None) -> socket.socket | None:
    """A listening socket at ``path``, 0600, or None when another process serves it (it holds
    ``path``'s .lock for its whole life, as the caller now does). ``ready``: called once the
    lock is ours, before the socket appears (what must be loaded before serving)."""
    lock = open(path.with_suffix(".lock"), "a+")  # noqa: SIM115 - held for our whole life
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lock.close()
        return None
    _HELD.append(lock)
    if ready is not None:
        ready(lock)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()  # left by a server that died (we hold the lock: none serves it)
    # Bound, made 0600 and listening under a private name first: the socket appears under
    # its own name only when it is ready and private.
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    ready = path.with_name(f".{os.getpid()}.new")
    with contextlib.suppress(FileNotFoundError):
        ready.unlink()
    listener.bind(str(ready))
    os.chmod(ready, 0o600)
    listener.listen(128)
    os.rename(ready, path)
    return listener


_HELD: list = []   # the locks of the sockets this process serves


def detach() -> None:
    """Become a background server: the second process of a fork (its command reaps the first
    at once), deaf to a terminal's Ctrl-C and hang-up, making private files."""
    if os.fork():
        os._exit(0)
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_IGN)
    os.umask(0o077)


def main(argv: list[str]) -> int:
    detach()
    path = Path(argv[1])
    if path.name == "-":
        path = _told_path(path.parent)
    if path is None:
        return 0
    listener = listen(path)
    if listener is None:
        return 0  # another keeper serves this socket
    server = _Server(path, listener)
    signal.signal(signal.SIGTERM, lambda *_: server.stopping.set())
    try:
        server.loop()
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
