"""The keeper process (``python -m tpufab.ssh.keeper.server SOCKET``, tpufab.ssh.keeper): a
detached background server on a private unix socket that holds a pod's connections between
commands and runs each client's fan-out work over them as a long-lived shard
(tpufab.ssh.shards.child.serve); ``listen`` and ``detach`` serve the resident command server
too (tpufab.resident)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import pickle
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from tpufab.ssh.keeper.protocol import (
    API_BEAT,
    API_READS,
    CONNECT_WAIT,
    PRESTART_WAIT,
    PROTOCOL,
    version,
)
from tpufab.ssh.keeper.sockets import api_env, peer
from tpufab.ssh.shards.frames import read_frame, write_frame

TICK = 0.5           # s: how often an idle keeper looks at its clock and its socket


class Server:
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
        self.users = 0                     # clients running commands over the connections
        self.last = time.monotonic()
        self.stopping = threading.Event()
        self.ids = iter(range(1, 1 << 62))
        self.controls: dict[bytes, Any] = {}   # the control planes API reads were asked of
        self.controls_lock = threading.Lock()
        self.asking = threading.local()         # the client a retry note goes to

    def on_retry(self, target, attempt, error) -> None:
        from tpufab.ssh.shards.child import retry_message

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
                    uid = peer(conn)[1]
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
        from tpufab.ssh.shards.child import fanout_from_init, serve

        lock = threading.Lock()
        inbox, outbox = conn.makefile("rb"), conn.makefile("wb")

        def send(message: tuple) -> None:
            try:
                write_frame(outbox, lock, message)
            except (OSError, ValueError):
                pass

        me = next(self.ids)
        user = False
        with self.clients_lock:
            self.clients[me] = None  # busy: not idle; retries go to it once it is ready
        try:
            conn.settimeout(CONNECT_WAIT * 5)
            first = read_frame(inbox)
            conn.settimeout(None)
            if not isinstance(first, tuple) or not first:
                return
            if first[0] == "stop":   # ("stop", why): the commands under way are told why
                why = first[1] if len(first) > 1 and isinstance(first[1], str) else \
                    "tpufab was told to stop it"
                with self.clients_lock:
                    sends = [s for s in self.clients.values() if s is not None]
                for tell in sends:
                    tell(("closing", why))
                send(("stopping",))
                self.stopping.set()
                return
            if first[0] == "status":
                send(("status", self.status()))
                return
            if first[0] == "lookup":
                with self.init_lock:
                    record, init = self.record, self.init
                send(("pod", PROTOCOL, version(), record, init, self.all_connected()))
                return
            if first[0] == "api":
                self.api(first, send)
                return
            if first[0] != "hello":
                return
            _, protocol, theirs, keep_alive, init, record = first
            if protocol != PROTOCOL or theirs != version():
                send(("refused", f"keeper of tpufab {version()} (protocol {PROTOCOL})"))
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
                self.users += 1
                user = True
                if self.users == 1:
                    self.fanout.set_in_use(True)
            serve(self.fanout, inbox, send, stop_at_end=True)
            # the next command finds every worker's agent running (the first ran without)
            threading.Thread(target=self.fanout.start_agents, daemon=True).start()
        except (OSError, EOFError, ValueError, TypeError):
            pass
        finally:
            with self.clients_lock:
                self.clients.pop(me, None)
                self.last = time.monotonic()
                if user:
                    self.users -= 1
                    if self.users == 0 and self.fanout is not None:
                        self.fanout.set_in_use(False)   # kept idle: no work for autostop
            for stream in (inbox, outbox):
                with contextlib.suppress(OSError):
                    stream.close()
            conn.close()

    def api(self, message: tuple, send) -> None:
        """One control-plane read for a command (ask_api): its value, the command's error
        as a sentence (the error's class by name), or "failed" (the command asks itself)."""
        from tpufab.errors import TpufabError

        if len(message) != 8:
            return
        _, protocol, theirs, settings, method, args, kwargs, environment = message
        if protocol != PROTOCOL or theirs != version() or method not in API_READS:
            send(("refused", f"keeper of tpufab {version()} (protocol {PROTOCOL})"))
            return
        if environment != api_env(os.environ):   # its credentials, proxies: not ours to use
            send(("failed", "the command's cloud API environment is not the keeper's"))
            return
        asked = threading.Event()

        def beat() -> None:   # the command waits on a frozen keeper API_SILENT at most
            while not asked.wait(API_BEAT):
                send(("alive",))

        threading.Thread(target=beat, daemon=True).start()
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
            asked.set()
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
        leave(self.path, self.inode)
        self.listener.close()
        if self.fanout is not None:
            self.fanout.close()  # every worker's agent stops what it still runs


def _told_path(folder: Path) -> Path | None:
    """A keeper started ahead (``FOLDER/-``): load what serving needs, then read the socket
    path in ``folder`` its command writes on stdin (None: never told, within PRESTART_WAIT).
    It logs beside it."""
    import select

    from tpufab.ssh import fanout, hostkeys  # noqa: F401 - loaded while waiting
    from tpufab.ssh.shards import child  # noqa: F401

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
    lock is ours, before the socket appears (what must be loaded before serving). What servers
    that are gone left in the directory goes first (``prune``)."""
    lock = _lock(path.with_suffix(".lock"))
    if lock is None:
        return None
    HELD.append(lock)
    prune(path.parent)
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


def _lock(path: Path):
    """``path`` opened and flocked by us, or None when another process holds it. A lock file
    removed (pruned) between our open and our flock is not the one others see: try again."""
    for _ in range(3):
        lock = open(path, "a+")  # noqa: SIM115 - held for our whole life
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            lock.close()
            return None
        try:
            if os.stat(path).st_ino == os.fstat(lock.fileno()).st_ino:
                return lock
        except FileNotFoundError:
            pass
        lock.close()
    return None


PRUNE_LOGS = 86400.0   # s: a gone server's log stays this long beside where it served


def prune(folder: Path) -> int:
    """Remove what servers (keepers, resident command servers) that are gone left in
    ``folder``: a socket and lock that nobody holds, a half-made socket of a process that is
    gone, and their logs once older than PRUNE_LOGS (kept a day for a look at why one ended).
    Returns how many files it removed."""
    removed = 0
    try:
        entries = {e.name: e for e in os.scandir(folder)}
    except OSError:
        return 0
    now = time.time()
    # the logs last: a gone server's log goes with its lock, which this same pass may remove
    # (the directory's order is the filesystem's, so a log may come before its lock)
    for name, entry in sorted(entries.items(), key=lambda item: item[0].endswith(".log")):
        stem, _, ext = name.rpartition(".")
        try:
            if ext == "lock" and _unheld(Path(entry.path)):
                removed += 1 + _remove(folder / f"{stem}.sock", socket_only=True)
            elif ext == "sock" and f"{stem}.lock" not in entries:
                removed += _remove(Path(entry.path), socket_only=True)
            elif ext == "new" and stem.startswith(".") and stem[1:].isdigit() and \
                    not os.path.exists(f"/proc/{stem[1:]}"):
                removed += _remove(Path(entry.path), socket_only=True)
            elif ext == "log" and not os.path.exists(folder / f"{stem}.lock") and \
                    now - entry.stat().st_mtime > PRUNE_LOGS:
                removed += _remove(Path(entry.path))
        except OSError:
            continue
    return removed


def _unheld(lock: Path) -> bool:
    """Take ``lock`` if nobody holds it, and remove it while we do (True): its server is
    gone. A server that opened it meanwhile sees it removed and opens a new one (_lock)."""
    try:
        fd = os.open(lock, os.O_RDWR | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.unlink(lock)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _remove(path: Path, *, socket_only: bool = False) -> int:
    """Remove ``path`` (ours; a socket only, if ``socket_only``): 1 if it went."""
    import stat

    try:
        st = os.lstat(path)
        if st.st_uid != os.getuid() or (socket_only and not stat.S_ISSOCK(st.st_mode)):
            return 0
        os.unlink(path)
        return 1
    except OSError:
        return 0


def leave(path: Path, inode: int) -> None:
    """A server that ends removes its socket (if it is still the one it made), its lock, and
    its log if nothing was written there."""
    with contextlib.suppress(OSError):
        if os.stat(path).st_ino == inode:
            path.unlink()
    for lock in HELD:
        with contextlib.suppress(OSError, ValueError):
            if lock.name == str(path.with_suffix(".lock")) and \
                    os.stat(lock.name).st_ino == os.fstat(lock.fileno()).st_ino:
                os.unlink(lock.name)   # still ours (held): removed while held
    with contextlib.suppress(OSError):
        log = path.with_suffix(".log")
        if log.stat().st_size == 0:
            log.unlink()


HELD: list = []   # the locks of the sockets this process serves


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
    server = Server(path, listener)
    signal.signal(signal.SIGTERM, lambda *_: server.stopping.set())
    try:
        server.loop()
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
