"""tpufab worker agent: runs commands for one SSH connection. Stdlib only, Python 3.6+.

Started once per connection on one SSH channel (``python3 -I -S -c <loader>``; the source
arrives on stdin). Each command then costs a spawn of the user's shell instead of a new sshd
session, its environment (secrets included) arrives on stdin instead of argv, and when the
channel closes for any reason every command still running is killed, with its process group,
every process that carries its TPUFAB_TASK marker (setsid/nohup descendants too) and, at the
SIGKILL, whatever is left in its session (what it ran under sudo too: ``kill_session``).

One thread, one poll loop, and only built-in modules: this file is started on every worker
of a cold fan-out, so its start-up CPU is multiplied by the number of workers.

Frames, both directions: ``>BII`` (kind, task id, payload length) then the payload. Fields
inside a payload are NUL-separated, each a one-letter tag then the value (no value can hold
a NUL: execve forbids it).
client -> agent:
  R run: ``c<command>`` or ``a<arg>``..., ``e<NAME>=<value>``..., ``t<timeout s>``,
         ``d<cwd>``, ``s`` (stdin follows as I/E frames)
  I stdin data, E stdin EOF, K kill (signal name), P put (``p<path>``, ``m<mode>``, ``\\0\\0``, bytes)
  U in use: ``1`` while a command holds this connection (the default), ``0`` while it is kept
    between commands: the agent then names itself IDLE_AGENT_NAME, which autostop does not
    count as work (a command run through it counts by its marker)
agent -> client:
  H hello ``<pid> <python version>``, O stdout, X stderr, F failed to start ``<message>``
  D done ``<exit code> <signal or 0> <timed out 0/1>``
"""

import os
import select
import signal
import struct
import sys
import time

from tpufab.remote.workerlib import IDLE_AGENT_NAME, all_pids, proc_stat

HEADER = struct.Struct(">BII")
MARKER = "TPUFAB_TASK"
KILL_GRACE = 2.0
CHUNK = 1 << 16


class Channel:
    """Frames to the client over fd 1; a vanished client is remembered, not raised."""

    def __init__(self):
        self.closed = False

    def send(self, kind, task_id, payload=b""):
        if self.closed:
            return
        view = memoryview(HEADER.pack(ord(kind), task_id, len(payload)) + payload)
        try:
            while view:
                view = view[os.write(1, view):]
        except OSError:
            self.closed = True


def marked_pids(marker):
    """Pids whose environment carries ``marker``."""
    needle = b"\0" + marker.encode() + b"\0"
    me = os.getpid()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open("/proc/" + name + "/environ", "rb") as fh:
                env = fh.read()
        except OSError:
            continue
        if needle in b"\0" + env:
            found.append(int(name))
    return found


def kill_session(sid):
    """SIGKILL what is left of the session ``sid`` (a task's: it was spawned with setsid).

    What the task started under sudo runs as root, where this user's signals do not reach:
    sudo relays a SIGTERM but never a SIGKILL, and drops a SIGTERM that arrives while it is
    still starting its command, so a root process can outlive its sudo. Those are killed by
    ``sudo -n pkill -s`` (matched by session where they run, never by a pid read here).
    Returns the pid of that pkill, or None."""
    denied = False
    for pid in all_pids():
        proc = proc_stat(pid)
        if proc is None or proc.sid != sid or proc.exited:
            continue
        try:
            os.kill(pid, signal.SIGKILL)
        except PermissionError:
            denied = True
        except OSError:
            pass
    if not denied or os.geteuid() == 0:
        return None
    try:
        with open(os.devnull, "r+b") as null:
            return spawn(["sudo", "-n", "pkill", "-KILL", "-s", str(sid)], dict(os.environ),
                         null.fileno(), null.fileno(), null.fileno())
    except OSError:
        return None


def read_comm():
    try:
        with open("/proc/self/comm") as fh:
            return fh.read().strip() or "python3"
    except OSError:
        return "python3"


def parse_fields(payload):
    fields = {"a": [], "e": []}
    for raw in payload.decode("utf-8", "surrogateescape").split("\0"):
        if not raw:
            continue
        tag, value = raw[0], raw[1:]
        if tag in ("a", "e"):
            fields[tag].append(value)
        else:
            fields[tag] = value
    return fields


def spawn(argv, env, stdin_fd, stdout_fd, stderr_fd):
    """Start ``argv`` in a new session with the given fds (posix_spawn where available)."""
    if hasattr(os, "posix_spawnp"):
        actions = [
            (os.POSIX_SPAWN_DUP2, stdin_fd, 0),
            (os.POSIX_SPAWN_DUP2, stdout_fd, 1),
            (os.POSIX_SPAWN_DUP2, stderr_fd, 2),
        ]
        return os.posix_spawnp(argv[0], argv, env, file_actions=actions, setsid=True,
                               setsigdef=(signal.SIGPIPE, signal.SIGCHLD), setsigmask=())
    pid = os.fork()
    if pid == 0:  # pragma: no cover - Python < 3.8 only
        try:
            os.setsid()
            for fd, target in ((stdin_fd, 0), (stdout_fd, 1), (stderr_fd, 2)):
                os.dup2(fd, target)
            signal.signal(signal.SIGPIPE, signal.SIG_DFL)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            os.execvpe(argv[0], argv, env)
        finally:
            os._exit(127)
    return pid


class Task:
    def __init__(self, agent, task_id, fields):
        self.agent = agent
        self.id = task_id
        self.marker = f"{MARKER}={os.getpid()}.{task_id}"
        env = dict(os.environ)
        # sshd starts the login shell with SHLVL unset; restore that so the user's shell
        # behaves as under plain ssh (Debian's bash then reads ~/.bashrc, as ssh would).
        if env.get("SHLVL") == "1":
            del env["SHLVL"]
        for item in fields["e"]:
            name, _, value = item.partition("=")
            env[name] = value
        env[MARKER] = self.marker.split("=", 1)[1]
        if fields["a"]:
            argv = fields["a"]
        else:
            argv = [env.get("SHELL") or "/bin/sh", "-c", fields.get("c", "")]
        if fields.get("d"):
            argv = ["/bin/sh", "-c", 'cd "$1" && shift && exec "$@"', "sh", fields["d"]] + argv
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        self.pending = bytearray()
        self.stdin_eof = False
        self.stdin_watched = False
        if "s" in fields:
            in_r, self.stdin = os.pipe()
            os.set_blocking(self.stdin, False)
        else:
            in_r, self.stdin = os.open(os.devnull, os.O_RDONLY), None
        try:
            self.pid = spawn(argv, env, in_r, out_w, err_w)
        except OSError:
            for fd in (out_r, err_r, self.stdin):
                if fd is not None:
                    os.close(fd)
            raise
        finally:
            for fd in (in_r, out_w, err_w):
                os.close(fd)
        self.streams = {out_r: "O", err_r: "X"}
        self.status = None
        self.timed_out = False
        timeout = float(fields["t"]) if fields.get("t") else None
        self.deadline = time.monotonic() + timeout if timeout else None
        self.kill_at = None

    def write_stdin(self, data):
        """Queue stdin; written as the command reads it (never blocks the loop)."""
        if self.stdin is None:
            return
        self.pending += data
        self.flush_stdin()

    def flush_stdin(self):
        try:
            while self.pending:
                del self.pending[:os.write(self.stdin, self.pending)]
        except BlockingIOError:
            pass
        except OSError:
            self.pending = bytearray()
            self.stdin_eof = True
        if self.stdin is not None:
            if self.pending:
                self.agent.watch_stdin(self, True)
            else:
                self.agent.watch_stdin(self, False)
                if self.stdin_eof:
                    self.close_stdin()

    def close_stdin(self):
        if self.stdin is not None:
            self.agent.watch_stdin(self, False)
            os.close(self.stdin)
            self.stdin = None

    def kill(self, signum=signal.SIGTERM):
        self.signal(signum)
        if signum != signal.SIGKILL and self.kill_at is None:
            self.kill_at = time.monotonic() + KILL_GRACE

    def signal(self, signum):
        try:
            os.killpg(self.pid, signum)
        except OSError:
            pass
        for pid in marked_pids(self.marker):
            try:
                os.kill(pid, signum)
            except OSError:
                pass
        if signum == signal.SIGKILL:
            helper = kill_session(self.pid)
            if helper is not None:
                self.agent.helpers.append(helper)

    @property
    def finished(self):
        return self.status is not None and not self.streams

    def result(self):
        if os.WIFSIGNALED(self.status):
            sig = os.WTERMSIG(self.status)
            code = 128 + sig
        else:
            sig, code = 0, os.WEXITSTATUS(self.status)
        return f"{code} {sig} {int(self.timed_out)}".encode()


class Agent:
    def __init__(self):
        self.channel = Channel()
        self.tasks = {}
        self.by_fd = {}
        self.by_stdin = {}
        self.poller = select.poll()
        self.inbox = bytearray()
        self.stdin_open = True
        self.helpers = []  # pids of the sudo pkills kill_session started, reaped here
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        os.set_blocking(wake_r, False)
        self.wake_r = wake_r
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        self.poller.register(0, select.POLLIN)
        self.poller.register(wake_r, select.POLLIN)
        self.comm = None   # its own name, read the first time it is renamed

    def use(self, used):
        """Held by a command, or kept idle between commands (the process's name says which)."""
        if self.comm is None:
            self.comm = read_comm()
        try:
            with open("/proc/self/comm", "w") as fh:
                fh.write(self.comm if used else IDLE_AGENT_NAME)
        except OSError:
            pass

    # -- requests ------------------------------------------------------------------------
    def handle(self, kind, task_id, payload):
        if kind == "R":
            try:
                task = Task(self, task_id, parse_fields(payload))
            except (OSError, ValueError) as err:
                self.channel.send("F", task_id, f"{type(err).__name__}: {err}".encode())
                return
            self.tasks[task_id] = task
            for fd in task.streams:
                self.by_fd[fd] = task
                self.poller.register(fd, select.POLLIN)
        elif kind == "U":
            self.use(payload == b"1")
        elif kind == "P":
            head, _, data = payload.partition(b"\0\0")
            fields = parse_fields(head)
            try:
                put(fields["p"], int(fields.get("m", "384")), data)
                self.channel.send("D", task_id, b"0 0 0")
            except OSError as err:
                self.channel.send("F", task_id, f"{type(err).__name__}: {err}".encode())
        else:
            task = self.tasks.get(task_id)
            if task is None:
                return
            if kind == "I":
                task.write_stdin(payload)
            elif kind == "E":
                task.stdin_eof = True
                task.flush_stdin()
            elif kind == "K":
                task.kill(getattr(signal, payload.decode() or "SIGTERM", signal.SIGTERM))

    def watch_stdin(self, task, wanted):
        if wanted and not task.stdin_watched:
            self.poller.register(task.stdin, select.POLLOUT)
            self.by_stdin[task.stdin] = task
        elif not wanted and task.stdin_watched:
            self.poller.unregister(task.stdin)
            del self.by_stdin[task.stdin]
        task.stdin_watched = wanted

    def read_requests(self):
        data = os.read(0, 1 << 18)
        if not data:
            self.stdin_open = False
            self.poller.unregister(0)
            return
        self.feed(data)

    def take_read_ahead(self):
        """Frames the loader's buffered stdin already read past the source (pipelined)."""
        os.set_blocking(0, False)
        try:
            data = sys.stdin.buffer.read1(1 << 20) or b""
        except BlockingIOError:
            data = b""
        finally:
            os.set_blocking(0, True)
        if data:
            self.feed(data)

    def feed(self, data):
        inbox = self.inbox
        inbox += data
        pos, size = 0, HEADER.size
        while len(inbox) - pos >= size:
            kind, task_id, length = HEADER.unpack_from(inbox, pos)
            if len(inbox) - pos - size < length:
                break
            payload = bytes(inbox[pos + size:pos + size + length])
            pos += size + length
            self.handle(chr(kind), task_id, payload)
        del inbox[:pos]

    # -- processes -----------------------------------------------------------------------
    def read_output(self, fd):
        task = self.by_fd[fd]
        data = os.read(fd, CHUNK)
        if data:
            self.channel.send(task.streams[fd], task.id, data)
            return
        self.poller.unregister(fd)
        del self.by_fd[fd]
        del task.streams[fd]
        os.close(fd)
        self.maybe_done(task)

    def reap(self):
        try:
            while os.read(self.wake_r, 512):
                pass
        except OSError:
            pass
        for task in list(self.tasks.values()):
            if task.status is None:
                try:
                    pid, status = os.waitpid(task.pid, os.WNOHANG)
                except ChildProcessError:
                    pid, status = task.pid, 0
                if pid:
                    task.status = status
                    self.maybe_done(task)
        for pid in list(self.helpers):
            try:
                done = os.waitpid(pid, os.WNOHANG)[0]
            except ChildProcessError:
                done = pid
            if done:
                self.helpers.remove(pid)

    def maybe_done(self, task):
        if task.finished and self.tasks.pop(task.id, None) is not None:
            task.close_stdin()
            self.channel.send("D", task.id, task.result())

    def timers(self):
        """Fire due timeouts and SIGKILLs; return the poll timeout in ms (None: no timer)."""
        now = time.monotonic()
        nearest = None
        for task in self.tasks.values():
            if task.deadline is not None and task.status is None:
                if now >= task.deadline:
                    task.timed_out = True
                    task.deadline = None
                    task.kill()
                else:
                    nearest = min(nearest or task.deadline, task.deadline)
            if task.kill_at is not None:
                if now >= task.kill_at:
                    task.kill_at = None
                    task.signal(signal.SIGKILL)
                else:
                    nearest = min(nearest or task.kill_at, task.kill_at)
        return None if nearest is None else max(0, int((nearest - now) * 1000) + 1)

    def run(self):
        self.channel.send("H", 0, f"{os.getpid()} {sys.version.split()[0]}".encode())
        self.take_read_ahead()
        shutdown_at = None
        while self.stdin_open or self.tasks:
            if not self.stdin_open and shutdown_at is None:
                # The channel is gone (Ctrl-C, client exit, dropped connection): leave nothing.
                shutdown_at = time.monotonic() + KILL_GRACE + 1
                for task in self.tasks.values():
                    task.kill()
            if shutdown_at is not None and time.monotonic() > shutdown_at:
                break
            timeout = self.timers()
            if shutdown_at is not None:
                timeout = min(timeout if timeout is not None else 200, 200)
            try:
                events = self.poller.poll(timeout)
            except InterruptedError:
                continue
            for fd, _ in events:
                if fd == 0:
                    self.read_requests()
                elif fd == self.wake_r:
                    self.reap()
                elif fd in self.by_fd:
                    self.read_output(fd)
                elif fd in self.by_stdin:
                    self.by_stdin[fd].flush_stdin()
            if not events:
                self.reap()  # a SIGCHLD can race the wakeup fd; reaping is cheap
        for task in self.tasks.values():
            task.signal(signal.SIGKILL)


def put(path, mode, data):
    """Write ``data`` to ``path`` atomically with ``mode``."""
    path = os.path.expanduser(path)
    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tpufab-{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fchmod(fd, mode)
    finally:
        os.close(fd)
    os.replace(tmp, path)


if __name__ == "__main__":
    Agent().run()
