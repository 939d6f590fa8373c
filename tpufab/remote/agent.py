"""tpufab worker agent: runs commands for one SSH connection, stdlib only (Python 3.6+).

Started once per connection on one SSH channel (``python3 -I -S -c <loader>``, the source
arrives on stdin). Each command then costs a fork/exec of the user's shell instead of a new
sshd session, the environment (including secrets) arrives on stdin instead of argv, and when
the channel closes for any reason every command still running is killed, with its whole
process group and any descendant that carries its TPUFAB_TASK marker.

Frames, both directions: ``>BII`` (kind, task id, payload length) then the payload.
client -> agent: R run (JSON), I stdin data, E stdin EOF, K kill (signal name),
                 P put (4-byte JSON length, JSON {path, mode}, file bytes)
agent -> client: H hello (JSON), O stdout, X stderr, D done (JSON), F failed to start (JSON)
"""

import json
import os
import select
import signal
import struct
import subprocess
import sys
import threading

HEADER = struct.Struct(">BII")
MARKER = "TPUFAB_TASK"
KILL_GRACE = 2.0

_out_lock = threading.Lock()
_tasks = {}
_tasks_lock = threading.Lock()


_closed = []


def send(kind, task_id, payload=b""):
    data = HEADER.pack(kind, task_id, len(payload)) + payload
    with _out_lock:
        if _closed:
            return
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(1, view):]
        except OSError:
            _closed.append(True)


def send_json(kind, task_id, obj):
    send(kind, task_id, json.dumps(obj).encode())


def read_exact(stream, size):
    data = stream.read(size)
    if data is None or len(data) < size:
        return None
    return data


def marked_pids(marker):
    """Pids whose environment carries ``marker`` (catches setsid/daemonized descendants)."""
    needle = marker.encode() + b"\0"
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as fh:
                env = fh.read()
        except OSError:
            continue
        if (b"\0" + needle) in (b"\0" + env):
            found.append(int(name))
    return found


class Task:
    def __init__(self, task_id, request):
        self.id = task_id
        self.marker = f"{MARKER}={os.getpid()}.{task_id}"
        env = dict(os.environ)
        # A login shell started by sshd sees SHLVL unset; restore that so the user's shell
        # behaves as under plain ssh (Debian bash then reads ~/.bashrc, as ssh would).
        if env.get("SHLVL") == "1":
            del env["SHLVL"]
        env.update(request.get("env") or {})
        env[MARKER] = self.marker.split("=", 1)[1]
        shell = request.get("shell") or env.get("SHELL") or "/bin/sh"
        if "argv" in request:
            argv = request["argv"]
        else:
            argv = [shell, "-c", request["command"]]
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE if request.get("stdin") else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            cwd=request.get("cwd") or env.get("HOME") or "/",
            start_new_session=True,
            close_fds=True,
        )
        self.killed = False
        self.timeout = request.get("timeout")
        self.timed_out = False
        self.timer = None
        if self.timeout:
            self.timer = threading.Timer(self.timeout, self.expire)
            self.timer.daemon = True
            self.timer.start()
        self.thread = threading.Thread(target=self.pump, daemon=True)
        self.thread.start()

    def expire(self):
        self.timed_out = True
        self.kill()

    def pump(self):
        streams = {self.proc.stdout.fileno(): b"O"[0], self.proc.stderr.fileno(): b"X"[0]}
        poller = select.poll()
        for fd in streams:
            poller.register(fd, select.POLLIN)
        while streams:
            for fd, _ in poller.poll():
                data = os.read(fd, 65536)
                if data:
                    send(streams[fd], self.id, data)
                else:
                    poller.unregister(fd)
                    del streams[fd]
        code = self.proc.wait()
        if self.timer is not None:
            self.timer.cancel()
        with _tasks_lock:
            _tasks.pop(self.id, None)
        result = {"exit_code": code if code >= 0 else 128 - code}
        if code < 0:
            result["signal"] = -code
        if self.timed_out:
            result["timed_out"] = True
            result["timeout"] = self.timeout
        send_json(b"D"[0], self.id, result)

    def write_stdin(self, data):
        try:
            self.proc.stdin.write(data)
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError, OSError):
            pass

    def close_stdin(self):
        try:
            self.proc.stdin.close()
        except (BrokenPipeError, ValueError, OSError, AttributeError):
            pass

    def kill(self, signum=signal.SIGTERM, grace=KILL_GRACE):
        self.killed = True
        self._signal(signum)
        if signum != signal.SIGKILL:
            timer = threading.Timer(grace, self._signal, (signal.SIGKILL,))
            timer.daemon = True
            timer.start()

    def _signal(self, signum):
        try:
            os.killpg(self.proc.pid, signum)
        except OSError:
            pass
        for pid in marked_pids(self.marker):
            try:
                os.kill(pid, signum)
            except OSError:
                pass


def put(request, data):
    """Write ``data`` to ``path`` atomically with ``mode`` (default 0600)."""
    path = os.path.expanduser(request["path"])
    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tpufab-{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fchmod(fd, int(request.get("mode", 0o600)))
    finally:
        os.close(fd)
    os.replace(tmp, path)


def kill_all(signum):
    with _tasks_lock:
        tasks = list(_tasks.values())
    for task in tasks:
        task._signal(signum)
    return tasks


def main():
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    stdin = sys.stdin.buffer
    send_json(b"H"[0], 0, {"pid": os.getpid(), "python": sys.version.split()[0]})
    while True:
        header = read_exact(stdin, HEADER.size)
        if header is None:
            break
        kind, task_id, size = HEADER.unpack(header)
        payload = read_exact(stdin, size) if size else b""
        if payload is None:
            break
        kind = chr(kind)
        if kind == "R":
            request = json.loads(payload.decode())
            try:
                task = Task(task_id, request)
            except OSError as err:
                send_json(b"F"[0], task_id, {"error": f"{type(err).__name__}: {err}"})
                continue
            with _tasks_lock:
                _tasks[task_id] = task
        elif kind == "P":
            (json_size,) = struct.unpack(">I", payload[:4])
            request = json.loads(payload[4 : 4 + json_size].decode())
            data = payload[4 + json_size :]
            try:
                put(request, data)
                send_json(b"D"[0], task_id, {"exit_code": 0})
            except OSError as err:
                send_json(b"F"[0], task_id, {"error": f"{type(err).__name__}: {err}"})
        else:
            with _tasks_lock:
                task = _tasks.get(task_id)
            if task is None:
                continue
            if kind == "I":
                task.write_stdin(payload)
            elif kind == "E":
                task.close_stdin()
            elif kind == "K":
                name = payload.decode() or "SIGTERM"
                task.kill(getattr(signal, name, signal.SIGTERM))
    # The channel is gone (client exit, Ctrl-C, dropped connection): leave nothing behind.
    tasks = kill_all(signal.SIGTERM)
    for task in tasks:
        task.thread.join(KILL_GRACE)
    kill_all(signal.SIGKILL)


if __name__ == "__main__":
    main()
