"""The child side of a sharded fan-out (``python -m tpufab.ssh.shards.child``, started by
:class:`tpufab.ssh.shards.parent.Shard`): an ordinary Fanout over its block of workers, whose
lines and outcomes go back to the parent as frames (see tpufab.ssh.shards.parent)."""

from __future__ import annotations

import pickle
import sys
import threading

from tpufab.ssh.shards.frames import read_frame, write_frame


class _Forward:
    """The child's sink: every complete line (and a last one as it is) and outcome go back to
    the parent."""

    exact = True

    def __init__(self, send, run_id: int):
        self.send, self.run_id = send, run_id

    def lines(self, worker: int, stream: str, data: bytes) -> None:
        self.send(("lines", self.run_id, worker, stream, data))

    def done(self, result) -> None:
        self.send(("done", self.run_id, result.worker, result.exit_code, result.error,
                   result.signal, result.duration))


def fanout_from_init(init: dict, on_retry):
    """The Fanout an "init" message describes (this child's workers, or a keeper's pod)."""
    from tpufab.ssh.fanout import Fanout
    from tpufab.ssh.hostkeys import KnownHosts

    return Fanout(init["targets"], known_hosts=KnownHosts(init["known_hosts"],
                                                          forget_hint=init["forget_hint"]),
                  concurrency=init["concurrency"], connect_attempts=init["connect_attempts"],
                  retry_wait=init["retry_wait"], python=init["python"],
                  kill_grace=init["kill_grace"], processes=init.get("processes", 1),
                  ssh_transport=init.get("ssh_transport", "auto"),
                  on_retry=on_retry)


def retry_message(target, attempt, error) -> tuple:
    try:
        pickle.dumps(error)
    except Exception:  # noqa: BLE001 - send what can cross
        error = RuntimeError(str(error))
    return ("retry", target.worker, attempt, error)


def serve(fan, inbox, send, *, stop_at_end: bool = False) -> None:
    """Run the parent's "run" / "interrupt" / "kill" / "close_worker" / "ping" / "use" messages from
    ``inbox`` on ``fan`` until it ends; frames go back through ``send`` (also the connection
    keeper's loop for each command: tpufab.ssh.keeper.server). ``stop_at_end``: when ``inbox``
    ends (the parent is gone), stop what it still runs as Ctrl-C would (a keeper's connections
    stay open for other commands; a shard child closes them all instead)."""
    from tpufab.quoting import Secret

    runs: dict[int, tuple[threading.Event, dict]] = {}

    def run(run_id: int, spec: dict) -> None:
        cancel, tasks = runs[run_id]
        try:
            # The revealed values the parent masks are Secrets here too: masked in this
            # process as well, and still sent on the agent's stdin only.
            hidden = set(spec["secrets"])
            env = {k: Secret(v) if v in hidden else v for k, v in (spec["env"] or {}).items()}
            fan.run(spec["command"], workers=spec["workers"], env=env or None,
                    stdin=spec["stdin"], timeout=spec["timeout"] or float("inf"),
                    connect_timeout=spec["connect_timeout"],
                    cwd=spec["cwd"], one_shot=spec["one_shot"], _put=spec["put"],
                    sink=_Forward(send, run_id), capture=False, cancel=cancel, _tasks=tasks)
        except BaseException:  # noqa: BLE001 - every task already sent its outcome
            pass
        finally:
            runs.pop(run_id, None)

    threads = []
    while (message := read_frame(inbox)) is not None:
        kind = message[0]
        if kind == "run":
            runs[message[1]] = (threading.Event(), {})
            thread = threading.Thread(target=run, args=message[1:], daemon=True)
            thread.start()
            threads.append(thread)
        elif kind == "interrupt" and message[1] in runs:
            runs[message[1]][0].set()
        elif kind == "kill" and message[1] in runs:
            task = runs[message[1]][1].get(message[2])
            if task is not None and task.agent is not None:
                task.agent.kill(task, message[3])
        elif kind == "close_worker" and message[1] in fan.links:
            fan.links[message[1]].close()
        elif kind == "ping":   # the parent waits on us: we are here (shards.parent.SILENT)
            send(("pong", *message[1:]))   # its number: which question this answers
        elif kind == "use":    # a keeper's connections, held by a command or idle
            fan.set_in_use(message[1])
    if not stop_at_end:
        return
    for cancel, _tasks in list(runs.values()):
        cancel.set()
    for thread in threads:
        thread.join(fan.kill_grace + 5)


def main() -> None:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides what Ctrl-C stops
    inbox, outbox = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but frames on the pipe
    lock = threading.Lock()

    def send(message: tuple) -> None:
        try:
            write_frame(outbox, lock, message)
        except (OSError, ValueError):
            pass

    first = read_frame(inbox)
    if first is None or first[0] != "init":
        return
    fan = fanout_from_init(first[1], lambda *a: send(retry_message(*a)))
    try:
        serve(fan, inbox, send)
    finally:
        fan.close()


if __name__ == "__main__":
    main()
