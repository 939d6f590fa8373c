"""The ``tpufab`` command's entry: the resident command server when one runs, else the CLI.

A command over kept connections spends most of its time importing the CLI (typer, rich, the
verbs: ~0.3 s of CPU) before it sends one message to the pod's keeper. So, like Mercurial's
chg, a command that kept connections leaves a *resident* command server (tpufab.resident)
with the CLI loaded; the next ``tpufab`` finds it here, with nothing loaded but the standard
library, and hands it the command: its arguments, working directory, environment, umask, its
file descriptors (stdin, stdout, stderr and every other one it inherited, the descriptors
themselves over the unix socket) and what else a process inherits (niceness, rlimits,
cgroup, groups, CPU affinity, OOM score, ignored and blocked signals). The server forks a
child that becomes this process (or says it cannot: then the command runs here) and runs the
command exactly as the CLI would; this process forwards its signals to that child (Ctrl-C
stops the workers' commands as ever) and ends as it ends: the same exit code, or the same
signal. A server that stops answering is not waited for: a child that does not start within
START_WAIT is stopped and the command runs here, and a command that ended without the
server saying how is said to have ended so.

It is not used (the command runs here, as before) when kept connections are off
(``TPUFAB_KEEP_ALIVE=0`` or ``--keep-alive 0``) or ``TPUFAB_RESIDENT=0``, for shell
completion, when there is no server for this very tpufab (its files, Python and sys.path: a
changed checkout gets a new one), when its socket or directory is not private (said once),
when it does not answer within CONNECT_WAIT, or for ``tpufab ssh`` (a terminal of its own).
"""

from __future__ import annotations

import fcntl
import json
import os
import select
import signal
import socket
import sys

from tpufab.ssh.keeper.sockets import (
    SUPPORTED,
    peer,
    resident_path,
    server_env,
    serving,
    socket_dir,
    unsafe,
)

CONNECT_WAIT = 1.0      # s: the server's "ready" (else the command runs here)
START_WAIT = 5.0        # s: its child's "started" after our "go" (else it is stopped)
ENDED_WAIT = 3.0        # s: the server's word on how the command ended, once it has ended
MAX_FDS = 64            # descriptors handed over (stdio included); more: the command runs here
FORWARDED = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGWINCH",
             "SIGALRM")


def _zero(text: str) -> bool:
    """A keep-alive of 0 (``0``, ``0s``, ``0.0m`` ...): nothing is kept."""
    try:
        return float(text.strip().rstrip("smhd") or "nan") == 0
    except ValueError:
        return False


def wanted(argv: list[str]) -> bool:
    """Whether to look for a resident server at all."""
    if not SUPPORTED or os.environ.get("TPUFAB_RESIDENT", "1") == "0":
        return False
    if _zero(os.environ.get("TPUFAB_KEEP_ALIVE", "")):
        return False
    if any(key.startswith("_TPUFAB_COMPLETE") for key in os.environ):
        return False
    words = iter(argv)
    for word in words:   # --keep-alive 0 before the verb: nothing kept, nothing resident
        if word.startswith("--keep-alive"):
            value = word.split("=", 1)[1] if "=" in word else next(words, "")
            if _zero(value):
                return False
        elif not word.startswith("-"):
            return word != "ssh"
    return True


def _stdio() -> dict:
    """How this process's stdio is set up (encoding, buffering): the child does the same."""
    out = {}
    for name in ("stdin", "stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is None:
            return {}
        out[name] = {"encoding": stream.encoding, "errors": stream.errors,
                     "line_buffering": stream.line_buffering,
                     "write_through": getattr(stream, "write_through", False)}
    return out


def _descriptors() -> list[int] | None:
    """This process's descriptors a command would use: stdio and every other one it inherited
    (not close-on-exec: the ones Python opens itself are); None when there are too many."""
    fds = [0, 1, 2]
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return fds
    for fd in sorted(int(name) for name in names):
        if fd > 2:
            try:
                if not fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC:
                    fds.append(fd)
            except OSError:
                continue   # the listing's own
    return fds if len(fds) <= MAX_FDS else None


def _process() -> dict:
    """What the command's process inherits besides its descriptors (tpufab.resident.become
    takes each, or says it cannot)."""
    import resource

    def read(path: str) -> str | None:
        try:
            with open(path) as fh:
                return fh.read().strip()
        except OSError:
            return None

    ignored = []
    for signum in signal.valid_signals():
        try:
            if signal.getsignal(signum) == signal.SIG_IGN:
                ignored.append(int(signum))
        except (OSError, ValueError):
            continue
    return {"nice": os.getpriority(os.PRIO_PROCESS, 0),
            "limits": {name: list(resource.getrlimit(getattr(resource, name)))
                       for name in dir(resource) if name.startswith("RLIMIT_")},
            "cgroup": read("/proc/self/cgroup"), "oom": read("/proc/self/oom_score_adj"),
            "groups": os.getgroups(), "gid": os.getgid(), "egid": os.getegid(),
            "affinity": sorted(os.sched_getaffinity(0)), "ignored": ignored,
            "blocked": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, []))}


def _say(text: str) -> None:
    print(f"tpufab: {text}", file=sys.stderr, flush=True)


class _Lines:
    """Newline-ended JSON messages read from a socket."""

    def __init__(self, sock: socket.socket):
        self.sock, self.buffer = sock, b""

    def read(self) -> dict | None:
        while b"\n" not in self.buffer:
            chunk = self.sock.recv(4096)
            if not chunk:
                return None
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)


def served(argv: list[str]) -> int | None:
    """Run the command in the resident server: its exit code (this process may also end by
    the signal that ended the command), or None when there is none to use (run it here)."""
    if not wanted(argv):
        return None
    folder = socket_dir()
    path = resident_path()
    if not os.path.lexists(path):
        return None
    if unsafe(folder, "directory"):
        return None    # the command, run here, says so (its kept connections are there too)
    reason = unsafe(path, "socket")
    if reason:
        _say(f"not using the resident command server at {path}: {reason}; remove it "
             "(tpufab makes a private one) — running the command here.")
        return None
    fds = _descriptors()
    if fds is None:
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        hello = {"argv": argv, "argv0": sys.argv[0], "cwd": os.getcwd(),
                 "env": dict(os.environ), "umask": _umask(), "stdio": _stdio(), "fds": fds,
                 **_process()}
        sock.settimeout(CONNECT_WAIT)
        sock.connect(path)
        server = peer(sock)
        if server[1] != os.getuid():
            return None
        socket.send_fds(sock, [json.dumps(hello).encode() + b"\n"], fds)
        lines = _Lines(sock)
        answer = lines.read()
        if not answer or not answer.get("ready"):
            return None          # the server says: run it here (or it went away)
        child = int(answer["pid"])
        sock.sendall(b"go\n")    # from here on the command is the server's: never run twice
    except (OSError, ValueError, KeyError, TypeError):
        sock.close()
        return None
    return _follow(sock, lines, child, server[0], ignored=hello["ignored"])


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _started(sock: socket.socket, lines: _Lines, child: int) -> bool | None:
    """Whether the server's child started the command (True), did not and never will (None:
    it did not within START_WAIT and is stopped, so the command may run here), or went away
    before it said (False)."""
    sock.settimeout(START_WAIT)
    try:
        started = lines.read()
    except TimeoutError:
        started = None
        _kill_child(child)
        sock.settimeout(0.5)   # what it said before it was stopped is read still
        try:
            started = lines.read()
        except (OSError, ValueError):
            return None
    except (OSError, ValueError):
        return False
    return bool(started and started.get("started"))


def _kill_child(pid: int) -> None:
    """SIGKILL the resident server's child ``pid`` (ours, and a tpufab resident server's)."""
    try:
        if os.stat(f"/proc/{pid}").st_uid != os.getuid():
            return
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            if b"tpufab.resident" not in fh.read():
                return
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


def _follow(sock: socket.socket, lines: _Lines, pid: int, server: int, *,
            ignored=()) -> int | None:
    """Forward signals to the command's process until it ends; end as it ended."""
    started = _started(sock, lines, pid)
    if started is None:
        sock.close()
        return None      # stopped before it started: the command runs here
    if not started:
        _say("the resident command server ended before it started the command; run it again "
             "(TPUFAB_RESIDENT=0 runs commands without it).")
        return 1

    def forward(signum, _frame):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    def stop(_signum, _frame):   # Ctrl-Z: stop the command (its group is not the terminal's)
        try:
            os.kill(pid, signal.SIGSTOP)
        except ProcessLookupError:
            pass
        signal.signal(signal.SIGTSTP, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTSTP)

    def resume(_signum, _frame):
        signal.signal(signal.SIGTSTP, stop)
        forward(signal.SIGCONT, None)

    for name in FORWARDED:
        if getattr(signal, name) not in ignored:   # ignored here: ignored there too
            signal.signal(getattr(signal, name), forward)
    if signal.SIGTSTP not in ignored:
        signal.signal(signal.SIGTSTP, stop)
    signal.signal(signal.SIGCONT, resume)
    try:
        ended = _ended(sock, lines, pid)
    except (OSError, ValueError):
        ended = None
    if ended == "unsaid":
        _say(f"the command's process (pid {pid}) ended, but the resident command server (pid "
             f"{server}) did not say how (it does not answer): its exit status is unknown "
             "(TPUFAB_RESIDENT=0 runs commands without it).")
        return 1
    if not ended:
        _say(f"lost the command's process (pid {pid}) in the resident command server; its "
             "outcome is unknown (TPUFAB_RESIDENT=0 runs commands without it).")
        return 1
    if "signal" in ended:
        signum = int(ended["signal"])
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return 128 + signum
    return int(ended.get("exit", 1))


def _ended(sock: socket.socket, lines: _Lines, pid: int):
    """How the command ended, as the server says; "unsaid" when its process is gone and the
    server says nothing within ENDED_WAIT (a frozen server)."""
    sock.settimeout(None)
    if b"\n" in lines.buffer:
        return lines.read()
    try:
        watched = os.pidfd_open(pid)
    except (AttributeError, OSError):
        return lines.read()   # no pidfd here: the server's word, however long it takes
    try:
        ready, _, _ = select.select([sock, watched], [], [])
        if sock not in ready:   # it ended: the server, which waits on it too, says how at once
            ready, _, _ = select.select([sock], [], [], ENDED_WAIT)
            if not ready:
                return "unsaid"
        return lines.read()
    finally:
        os.close(watched)


def main() -> None:
    code = served(sys.argv[1:])
    if code is None:
        from tpufab.cli import main as cli_main

        try:
            cli_main()
        finally:
            _leave_resident()
        return
    sys.exit(code)


# the interpreter a resident server runs in takes the client's sys.path before importing tpufab
BOOT = ("import json, sys; sys.path[:] = json.loads(sys.argv[1]); "
        "from tpufab.resident import main; sys.exit(main(sys.argv[2:]))")
SOCKET_MAX = 100      # bytes: sun_path holds 108


def _leave_resident() -> None:
    """A command that kept a pod's connections (tpufab.ssh.keeper) leaves the resident command
    server for the next one, unless one serves already; it detaches itself."""
    keeper = sys.modules.get("tpufab.ssh.keeper.client")
    kept = getattr(keeper, "KEPT", None)
    if not kept or os.environ.get("TPUFAB_RESIDENT", "1") == "0":
        return
    folder = socket_dir()
    path = resident_path()
    if len(path) > SOCKET_MAX or unsafe(folder, "directory") or not os.path.isdir(folder) \
            or serving(path):
        return
    import subprocess

    try:
        log = os.open(path[:-len(".sock")] + ".log", os.O_WRONLY | os.O_CREAT | os.O_APPEND,
                      0o600)
    except OSError:
        return
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", BOOT, json.dumps(sys.path), path, repr(float(max(kept)))],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log,
            start_new_session=True, cwd="/", close_fds=True, env=server_env(os.environ))
        proc.wait(5)   # the first fork exits at once
    except (OSError, subprocess.TimeoutExpired):
        pass
    finally:
        os.close(log)


if __name__ == "__main__":
    main()
