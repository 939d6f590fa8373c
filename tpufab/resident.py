"""The resident command server: the CLI loaded once, a forked child per command.

A ``tpufab`` command that kept a pod's connections (tpufab.ssh.keeper) starts one as it ends
(tpufab.entry), unless one serves already. It loads the CLI and every tpufab module a command
may need (not the cloud clients), then listens on ``resident-<fingerprint>.sock`` in the
keepers' private directory (0700; the socket 0600, the peer's uid checked on every
connection). The ``tpufab`` entry (tpufab.entry) sends it a command with its descriptors (its
stdin, stdout, stderr and every other one it inherited: ``put <(echo x)``, ``launch
/dev/fd/5``) and what else a process inherits (niceness, rlimits, cgroup, groups, CPU
affinity, OOM score, ignored and blocked signals). The server forks a child that becomes that
process (:func:`become`); where it cannot (a lower niceness or a higher hard limit than the
server's, a cgroup it may not join, other groups), it says "not ready" and the command runs
in its own process, as without a server. Else it answers "ready" with its pid, and on the
client's "go" takes the command's working directory, environment, umask, arguments and
stdio, says it started (the client forwards its signals to it), runs ``tpufab.cli.main`` and
exits with its code. The server reports how the child ended (its exit code or signal), so the
client ends the same way. A child whose client went away is interrupted (as Ctrl-C would: the
workers' commands are stopped). The server's own environment is the starting command's
without its secrets (tpufab.ssh.keeper.sockets.server_env): a command's own environment
lives in its child only.

It exits after ``keep_alive`` seconds without a command, as soon as no keeper serves in its
directory (``tpufab disconnect``, keepers that timed out), and when its socket is removed or
taken over. Its log is beside the socket (``.log``).
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import socket
import sys
import threading
import time
from pathlib import Path

TICK = 1.0            # s: how often an idle server looks at its clock, socket and keepers
HELLO_WAIT = 5.0      # s: a client's whole request, and its "go" after "ready"
MAX_FDS = 64          # descriptors a command may bring (stdio included); more: it runs itself
NOT_PRELOADED = ("tpufab.sim", "tpufab.remote", "tpufab.templates")


# ---------------------------------------------------------------------------------------------
# The server
# ---------------------------------------------------------------------------------------------


def preload() -> None:
    """Load what commands load: the CLI with every verb's command built, tpufab's modules
    (not the simulated pod's, not the worker-side scripts) and paramiko; not the cloud
    clients (seconds of CPU and ~100 MB: the commands that need them load them)."""
    import importlib
    import pkgutil

    import tpufab
    from tpufab import cli

    for name in [None, *cli.command_names()]:
        cli.app_for(name)
    for module in pkgutil.walk_packages(tpufab.__path__, "tpufab."):
        if not module.name.startswith(NOT_PRELOADED):
            with contextlib.suppress(Exception):
                importlib.import_module(module.name)
    with contextlib.suppress(Exception):
        import paramiko  # noqa: F401
    import gc

    gc.collect()
    gc.freeze()   # what is loaded now is never scanned again: a child's collections would
    #               otherwise walk (and copy, page by page) every object the server holds


def _keepers_left(folder: Path) -> bool:
    """A keeper serves in ``folder`` (holds the lock beside its socket: a socket file that a
    killed keeper left is none)."""
    from tpufab.ssh.keeper.sockets import serving

    try:
        return any(name.endswith(".sock") and not name.startswith("resident-")
                   and serving(os.path.join(folder, name)) for name in os.listdir(folder))
    except OSError:
        return False


class Server:
    def __init__(self, path: Path, listener: socket.socket, keep_alive: float):
        self.path, self.listener, self.keep_alive = path, listener, keep_alive
        self.inode = os.stat(path).st_ino
        self.selector = selectors.DefaultSelector()
        self.selector.register(listener, selectors.EVENT_READ, None)
        self.children: dict[int, tuple[int, socket.socket]] = {}   # pidfd: (pid, client)
        self.last = time.monotonic()

    def loop(self) -> None:
        while True:
            for key, _ in self.selector.select(TICK):
                if key.data is None:
                    self.accept()
                else:
                    self.reap(key.fd)
            if not self.children and self.done():
                return

    def done(self) -> bool:
        """Idle past keep_alive, no keeper left to serve commands for, or our socket gone."""
        if time.monotonic() - self.last > self.keep_alive:
            return True
        if not _keepers_left(self.path.parent):
            return True
        try:
            return os.stat(self.path).st_ino != self.inode
        except OSError:
            return True

    def accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        fds: list[int] = []
        try:
            conn.settimeout(HELLO_WAIT)
            if _peer_uid(conn) != os.getuid():
                return
            hello, fds = _hello(conn)
            if hello is None:
                _send(conn, {"ready": False})
                return
            self.last = time.monotonic()
            pid = os.fork()   # the child answers: the server never waits on a client
            if pid == 0:
                self.child(conn, fds, hello)   # never returns
            pidfd = os.pidfd_open(pid)
            self.children[pidfd] = (pid, conn)
            self.selector.register(pidfd, selectors.EVENT_READ, pid)
            conn = None
        except (OSError, ValueError):
            pass
        finally:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
            if conn is not None:
                conn.close()

    def reap(self, pidfd: int) -> None:
        pid, conn = self.children.pop(pidfd)
        self.selector.unregister(pidfd)
        os.close(pidfd)
        _, status = os.waitpid(pid, 0)
        ended = {"signal": os.WTERMSIG(status)} if os.WIFSIGNALED(status) else \
            {"exit": os.waitstatus_to_exitcode(status)}
        with contextlib.suppress(OSError):
            _send(conn, ended)
        conn.close()
        self.last = time.monotonic()

    def child(self, conn: socket.socket, fds: list[int], hello: dict) -> None:
        """Become the command's process (its session, descriptors, niceness, limits, cgroup,
        signals; then its directory, environment, stdio) and run it; or say "not ready" and
        end, when one of them cannot be the caller's (the command then runs itself)."""
        code = 1
        try:
            os.setsid()
            self.selector.close()
            self.listener.close()
            for pidfd, (_pid, other) in self.children.items():
                os.close(pidfd)
                other.close()
            from tpufab.ssh.keeper.server import HELD

            for lock in HELD:   # the socket's lock is the server's, not its children's
                lock.close()
            conn = _descriptors(conn, fds, hello["fds"])   # first: below the server's limits
            why = become(hello)
            if why is not None:
                _send(conn, {"ready": False, "why": why})
                code = 0
                return
            _send(conn, {"ready": True, "pid": os.getpid()})
            if not _go(conn):
                code = 0
                return
            os.chdir(hello["cwd"])
            os.umask(int(hello["umask"]))
            os.environ.clear()
            os.environ.update(hello["env"])
            import tempfile

            tempfile.tempdir = None
            sys.argv = [hello["argv0"], *hello["argv"]]
            _stdio(hello.get("stdio") or {})
            conn.settimeout(None)
            _send(conn, {"started": True})
            threading.Thread(target=_watch, args=(conn,), daemon=True).start()
            code = _run()
        except BaseException:   # noqa: BLE001 - never back into the server's loop
            pass
        finally:
            os._exit(code)


def become(hello: dict) -> str | None:
    """Take the caller's process attributes (tpufab.entry sends them): None, or why one of
    them cannot be the caller's here."""
    import resource

    if (os.getgid(), os.getegid(), sorted(os.getgroups())) != \
            (hello["gid"], hello["egid"], sorted(hello["groups"])):
        return "its groups are not the server's"
    why = _join_cgroup(hello["cgroup"])
    if why:
        return why
    try:
        if os.getpriority(os.PRIO_PROCESS, 0) != hello["nice"]:
            os.setpriority(os.PRIO_PROCESS, 0, hello["nice"])
    except OSError:
        return f"it runs at niceness {hello['nice']}, lower than the server's"
    for name, (soft, hard) in hello["limits"].items():
        which = getattr(resource, name, None)
        if which is None or resource.getrlimit(which) == (soft, hard):
            continue
        try:
            resource.setrlimit(which, (soft, hard))
        except (OSError, ValueError):
            return f"its {name} ({soft}, {hard}) is above the server's"
    try:
        if hello.get("affinity") and os.sched_getaffinity(0) != set(hello["affinity"]):
            os.sched_setaffinity(0, hello["affinity"])
        if hello.get("oom") is not None and _read("/proc/self/oom_score_adj") != hello["oom"]:
            with open("/proc/self/oom_score_adj", "w") as fh:
                fh.write(hello["oom"])
    except OSError as err:
        return f"its CPU affinity or OOM score cannot be taken ({err.strerror})"
    ignored = set(hello["ignored"])
    for signum in signal.valid_signals():
        if signum in (signal.SIGKILL, signal.SIGSTOP):
            continue
        how = signal.SIG_IGN if signum in ignored else \
            signal.default_int_handler if signum == signal.SIGINT else \
            signal.SIG_IGN if signum == signal.SIGPIPE else signal.SIG_DFL   # as Python sets them
        with contextlib.suppress(OSError, ValueError):
            signal.signal(signum, how)
    signal.pthread_sigmask(signal.SIG_SETMASK, hello["blocked"])
    return None


def _read(path: str) -> str | None:
    try:
        with open(path) as fh:
            return fh.read().strip()
    except OSError:
        return None


def _join_cgroup(theirs: str | None) -> str | None:
    """Move into the caller's cgroups (each hierarchy /proc/self/cgroup names); why not."""
    if theirs is None or _read("/proc/self/cgroup") == theirs:
        return None
    for line in theirs.splitlines():
        number, controllers, where = line.split(":", 2)
        mine = "/sys/fs/cgroup" if number == "0" and "\n" not in theirs.strip() else \
            "/sys/fs/cgroup/unified" if number == "0" else \
            "/sys/fs/cgroup/" + controllers.replace("name=", "")
        with contextlib.suppress(OSError):
            with open(f"{mine}{where}/cgroup.procs", "w") as fh:
                fh.write(str(os.getpid()))
    if _read("/proc/self/cgroup") != theirs:
        return "it runs in a cgroup the server may not join"
    return None


def _descriptors(conn: socket.socket, fds: list[int], targets: list[int]) -> socket.socket:
    """The caller's descriptors at their own numbers, and no other (the server's are not the
    command's); the connection to the client moves above them. The connection, moved."""
    import fcntl

    base = max([*targets, 2]) + 1
    moved = socket.socket(fileno=fcntl.fcntl(conn.fileno(), fcntl.F_DUPFD_CLOEXEC, base))
    moved.settimeout(conn.gettimeout())
    conn.close()
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, base) for fd in fds]
    for fd in fds:
        os.close(fd)
    fds.clear()
    for fd, target in zip(high, targets, strict=True):
        os.dup2(fd, target, inheritable=True)
        os.close(fd)
    keep = {*targets, moved.fileno()}
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd not in keep:
            with contextlib.suppress(OSError):
                os.close(fd)
    return moved


def _peer_uid(conn: socket.socket) -> int:
    from tpufab.ssh.keeper.sockets import peer

    return peer(conn)[1]


def _hello(conn: socket.socket) -> tuple[dict | None, list[int]]:
    """The client's request (one JSON line) and the descriptors that came with it (None when
    the request is not whole, or its descriptors are not the ones it names)."""
    data, fds, _flags, _addr = socket.recv_fds(conn, 1 << 16, MAX_FDS)
    while data and not data.endswith(b"\n"):
        chunk = conn.recv(1 << 16)
        if not chunk:
            return None, fds
        data += chunk
    try:
        hello = json.loads(data)
    except ValueError:
        return None, fds
    needed = {"argv", "argv0", "cwd", "env", "umask", "fds", "nice", "limits", "cgroup",
              "groups", "gid", "egid", "ignored", "blocked"}
    if not isinstance(hello, dict) or not needed <= hello.keys() or \
            len(hello["fds"]) != len(fds) or hello["fds"][:3] != [0, 1, 2]:
        return None, fds
    return hello, fds


def _go(conn: socket.socket) -> bool:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(16)
        if not chunk:
            return False
        data += chunk
    return data == b"go\n"


def _send(conn: socket.socket, message: dict) -> None:
    conn.sendall(json.dumps(message).encode() + b"\n")


def _stdio(how: dict) -> None:
    """stdin, stdout and stderr over the client's descriptors, set up as the client's were."""
    import io

    for fd, name in enumerate(("stdin", "stdout", "stderr")):
        spec = how.get(name) or {}
        encoding, errors = spec.get("encoding") or "utf-8", spec.get("errors") or "strict"
        if fd == 0:
            raw = io.FileIO(0, "r", closefd=False)
            stream = io.TextIOWrapper(io.BufferedReader(raw), encoding=encoding, errors=errors,
                                      line_buffering=bool(spec.get("line_buffering")))
        else:
            raw = io.FileIO(fd, "w", closefd=False)
            through = bool(spec.get("write_through"))
            stream = io.TextIOWrapper(raw if through else io.BufferedWriter(raw),
                                      encoding=encoding, errors=errors,
                                      line_buffering=bool(spec.get("line_buffering")),
                                      write_through=through)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _watch(conn: socket.socket) -> None:
    """The client went away (killed): interrupt the command, as Ctrl-C would."""
    with contextlib.suppress(OSError):
        while conn.recv(64):
            pass
    os.kill(os.getpid(), signal.SIGINT)


def _run() -> int:
    """``tpufab.cli.main`` as the interpreter would run it: its exit code (an uncaught
    KeyboardInterrupt ends the process by SIGINT, as Python's does)."""
    import atexit

    from tpufab import cli

    code = 0
    interrupted = False
    try:
        cli.main()
    except SystemExit as exc:
        if exc.code is None:
            code = 0
        elif isinstance(exc.code, int):
            code = exc.code
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        interrupted = True
    except BaseException:  # noqa: BLE001 - printed as the interpreter prints it
        sys.excepthook(*sys.exc_info())
        code = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code & 0xFF


def main(argv: list[str]) -> int:
    from tpufab.ssh.keeper.server import detach, leave, listen

    detach()
    path, keep_alive = Path(argv[0]), float(argv[1])
    try:
        os.close(os.pidfd_open(os.getpid()))   # how children are waited for (Linux 5.3)
    except (AttributeError, OSError):
        print("no pidfd_open here: no resident command server", file=sys.stderr)
        return 0

    def ready(lock) -> None:
        lock.truncate(0)
        lock.write(str(os.getpid()))    # for `tpufab status` (sockets.resident_pid)
        lock.flush()
        preload()

    listener = listen(path, ready)
    if listener is None:
        return 0   # another server serves this socket
    server = Server(path, listener, keep_alive)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        server.loop()
    finally:
        leave(path, server.inode)
    return 0
