"""Run commands on many workers at once over SSH, with one result per worker.

One connection per worker (libssh2 where it can be, else paramiko: tpufab.ssh.connections),
on a socket we open ourselves (the seam a jump host replaces), cheapest key exchange first.
Each connection starts one small agent (``tpufab/remote/agent.py``) on one channel the first
time a command needs it, and every command is a frame on that channel
(tpufab.ssh.channels.agent_protocol): no new sshd session per command, stdout/stderr read as
they arrive (no polling), secrets sent on stdin, and every remote process killed when a
command is cancelled or the channel closes. A one-shot command on a fresh connection
(``run(one_shot=True)``, what ``exec`` does) runs on a plain exec channel instead
(tpufab.ssh.channels.oneshot), which still stops everything on Ctrl-C, timeout or
disconnect. Large pods spread their connections over client processes (tpufab.ssh.shards),
and a pod's connections may be kept between commands by its keeper (tpufab.ssh.keeper).
What a run returns is tpufab.ssh.results. See docs/fanout.md.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from tpufab import nodeset, quoting
from tpufab.errors import TpufabError
from tpufab.quoting import Secret
from tpufab.ssh.channels.agent_protocol import Agent, Task, encode_request
from tpufab.ssh.channels.oneshot import Crew, Plain, Slots, oneshot_line
from tpufab.ssh.connections import Connector, Link, Target, describe
from tpufab.ssh.limits import (
    WORKERS_PER_LIBSSH2_PROCESS,
    WORKERS_PER_PROCESS,
    auto_processes,
    ensure_fds,
    fd_budget,
    shard_of,
)
from tpufab.ssh.results import FanoutInterrupted, GroupResult, LineCallback, OutputSink
from tpufab.ssh.transport import (
    ConnectError,
    Libssh2Connection,
    libssh2_available,
    quiet_paramiko,
)

DEFAULT_CONCURRENCY = 64
KILL_GRACE = 2.0
# How long past a command's timeout, the kill grace and a connect the worker's answer may take
# before the worker counts as not answering (the agent's SIGKILL is answered within ms).
ANSWER_MARGIN = 2.0
TRANSPORTS = ("auto", "libssh2", "paramiko")  # ssh_transport: auto is libssh2 where it can be
KEEPER = -1  # the owner of every worker while the pod's connection keeper serves them


class Fanout:
    """Holds one connection per worker and runs commands on any selection of them.

    ``known_hosts`` (a :class:`tpufab.ssh.hostkeys.KnownHosts`) checks every worker's host key.
    ``processes``: client processes sharing the connections (None: :func:`auto_processes`);
    each owns a fixed block of workers and streams their frames back (tpufab.ssh.shards).
    """

    def __init__(
        self,
        targets: Sequence[Target],
        *,
        known_hosts=None,
        concurrency: int = DEFAULT_CONCURRENCY,
        connect_timeout: float = 10.0,
        command_timeout: float | None = None,
        connect_attempts: int = 4,
        retry_wait: tuple[float, float] = (0.25, 4.0),
        on_retry: Callable[[Target, int, BaseException], None] | None = None,
        python: str = "python3",
        kill_grace: float = KILL_GRACE,
        processes: int | None = None,
        ssh_transport: str = "auto",
    ):
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        quiet_paramiko()
        if known_hosts is None:
            from tpufab.ssh.hostkeys import KnownHosts

            known_hosts = KnownHosts()
        self.targets = {t.worker: t for t in targets}
        self.links = {t.worker: Link(t) for t in targets}
        self.concurrency = concurrency
        self._timeouts = (connect_timeout, command_timeout)
        self.python = python
        self.kill_grace = kill_grace
        if ssh_transport not in TRANSPORTS:
            raise ValueError(f"ssh_transport must be one of {', '.join(TRANSPORTS)}")
        self.ssh_transport = ssh_transport
        libssh2 = ssh_transport != "paramiko" and libssh2_available()
        if ssh_transport == "libssh2" and not libssh2:
            raise ConnectError("ssh_transport is libssh2 but ssh2-python is not installed for "
                               "this Python (pip install ssh2-python), or this is not Linux; "
                               "set ssh_transport to auto or paramiko.")
        self.connector = Connector(known_hosts, connect_attempts=connect_attempts,
                                   retry_wait=retry_wait, on_retry=on_retry, libssh2=libssh2)
        self.processes = processes or auto_processes(
            len(self.targets),
            per_process=WORKERS_PER_LIBSSH2_PROCESS if libssh2 else WORKERS_PER_PROCESS)
        self.owner = shard_of(self.targets, self.processes)
        self._shards: dict[int, object] = {}
        self._shards_lock = threading.Lock()
        own = sum(1 for p in self.owner.values() if p == 0)
        ensure_fds(fd_budget(own, len(self.targets)))
        self._ids = iter(range(1, 1 << 31))
        self._ids_lock = threading.Lock()
        self.keeper = None  # the pod's connection keeper (tpufab.ssh.keeper.client.Keeper), if kept
        self.in_use = True  # a command holds these connections (a keeper's: only while one does)

    # -- context ----------------------------------------------------------------------------
    def __enter__(self) -> Fanout:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        with self._shards_lock:
            shards, self._shards = list(self._shards.values()), {}
        for shard in shards:
            shard.close()
        for link in self.links.values():
            link.close()

    @property
    def connect_timeout(self) -> float:
        """Seconds a connection attempt may take when a call names none (fixed when built;
        a caller with its own passes it per call, or holds a view: :meth:`bound`)."""
        return self._timeouts[0]

    @property
    def command_timeout(self) -> float | None:
        """Seconds a command may run when a call names none (None: no limit); fixed too."""
        return self._timeouts[1]

    @property
    def workers(self) -> list[int]:
        return sorted(self.targets)

    def select(self, workers=None) -> list[int]:
        """Resolve a selection (``None``, ``"all"``, ``"0,3-5"``, ``[1, 2]``) to worker indexes."""
        count = max(self.targets) + 1 if self.targets else 0
        chosen = nodeset.parse_selection(workers, count)
        missing = [w for w in chosen if w not in self.targets]
        if missing:
            raise TpufabError(f"No connection target for {nodeset.fold(missing)}.")
        return chosen

    # -- connecting (tpufab.ssh.connections.Connector) ---------------------------------------
    @property
    def known_hosts(self):
        return self.connector.known_hosts

    @property
    def connect_attempts(self) -> int:
        return self.connector.connect_attempts

    @property
    def retry_wait(self) -> tuple[float, float]:
        return self.connector.retry_wait

    @property
    def on_retry(self) -> Callable[[Target, int, BaseException], None] | None:
        """Told ``(target, attempt, error)`` before each retry of a connection."""
        return self.connector.on_retry

    @on_retry.setter
    def on_retry(self, value: Callable[[Target, int, BaseException], None] | None) -> None:
        self.connector.on_retry = value

    def _agent(self, link: Link, timeout: float) -> Agent:
        """The worker's agent, started on its open connection by the first command needing it
        (its channel opening within ``timeout`` seconds)."""
        with link.lock:
            if link.agent is None or not link.agent.alive:
                link.agent = Agent(link.conn.transport, link.target.worker, self.python,
                                   timeout)
                if not self.in_use:
                    link.agent.use(False)
            return link.agent

    def set_in_use(self, used: bool) -> None:
        """Whether a command holds these connections: a keeper's are idle between commands,
        and every agent (this process's and its shards') says so on its worker, where
        autostop counts an idle kept connection as no work."""
        self.in_use = used
        for worker, link in list(self.links.items()):
            if self.owner.get(worker, 0):
                continue
            with link.lock:   # not between an agent's start and its first word (_agent)
                if link.agent is not None and link.agent.alive:
                    link.agent.use(used)
        with self._shards_lock:
            shards = [s for owner, s in self._shards.items() if owner != KEEPER and s.alive]
        for shard in shards:
            shard.set_in_use(used)

    def start_agents(self) -> int:
        """Start the agent on every connection this process holds open that has none running
        yet, one after another (each waits for its channel to open, not for the agent to
        answer): a keeper does this once a
        command is done, so the next command finds them started (the first command on a
        connection runs without one). Returns how many were started; a worker where it fails
        is left as it was, and its next command says why."""
        started = 0
        for worker, link in list(self.links.items()):
            if self.owner.get(worker, 0) or not link.ready or \
                    (link.agent is not None and link.agent.alive):
                continue
            try:
                self._agent(link, self.connect_timeout)
                started += 1
            except Exception:  # noqa: BLE001,S112 - the next command meets it and says it
                continue
        return started

    def transport(self, worker: int, *, connect_timeout: float | None = None):
        """An open paramiko Transport to ``worker`` in this process (SFTP, port forwards);
        connects if needed (``connect_timeout`` None: the fan-out's), raising
        :class:`ConnectError` with the reason."""
        link = self.links[worker]
        timeout = self.connect_timeout if connect_timeout is None else connect_timeout
        try:
            if not link.ready:
                self.connector.connect(link, timeout)
            transport = link.conn.transport
            if isinstance(transport, Libssh2Connection):
                # libssh2 runs commands; SFTP and forwards take a paramiko connection of their own
                with link.lock:
                    if link.side is None or not link.side.is_active():
                        link.side = self.connector.handshake(link.target, timeout, paramiko_only=True)
                    transport = link.side
            return transport
        except TpufabError:
            raise
        except Exception as err:  # noqa: BLE001 - one sentence for the caller
            link.close()
            raise ConnectError(f"{nodeset.label(worker)}: {describe(err, link.target)}") from err

    def open(self, workers=None, *, connect_timeout: float | None = None) -> GroupResult:
        """Connect to the selected workers now (else the first run connects lazily)."""
        return self.run(None, workers=workers, connect_timeout=connect_timeout)

    def _route(self) -> None:
        """Send this run's workers to the pod's connection keeper when one serves them
        (tpufab.ssh.keeper), else to this process and its shards as usual."""
        shard = self.keeper.shard(self) if self.keeper is not None else None
        with self._shards_lock:
            if shard is not None:
                self._shards[KEEPER] = shard
                self.owner = dict.fromkeys(self.targets, KEEPER)
            elif KEEPER in self._shards or KEEPER in self.owner.values():
                self._shards.pop(KEEPER, None)
                self.owner = shard_of(self.targets, self.processes)

    def _shard(self, index: int):
        with self._shards_lock:
            shard = self._shards.get(index)
            if index == KEEPER and shard is not None:
                return shard  # one that died fails its run's tasks with the reason
            if shard is None or not shard.alive:
                from tpufab.ssh.shards.parent import Shard

                mine = [self.targets[w] for w, p in self.owner.items() if p == index]
                shard = self._shards[index] = Shard(index, mine, self)
            return shard

    # -- running ----------------------------------------------------------------------------
    def run(
        self,
        command: str | Sequence[str] | None,
        *,
        workers=None,
        env: Mapping[str, str | Secret] | None = None,
        secrets: Mapping[str, str | Secret] | None = None,
        stdin: bytes | str | None = None,
        timeout: float | None = None,
        connect_timeout: float | None = None,
        sink: OutputSink | None = None,
        on_line: Callable[[int, str, str], None] | None = None,
        capture: bool = True,
        cwd: str | None = None,
        check: bool = False,
        one_shot: bool = False,
        cancel: threading.Event | None = None,
        _put: tuple[dict, bytes] | None = None,
        _tasks: dict | None = None,
    ) -> GroupResult:
        """Run ``command`` on the selected workers; one :class:`WorkerResult` each.

        ``command`` is a shell command line (run by the worker user's shell, exactly once, as
        ``ssh`` would) or an argv list (run without a shell). ``timeout`` None means the
        fan-out's ``command_timeout``, ``math.inf`` no limit at all. ``env`` values are plain; any
        :class:`Secret` there or in ``secrets`` travels on stdin, is masked as ``***`` in
        output and results, and never appears in argv on the worker. ``timeout`` is per
        command: the worker kills it (TERM, then KILL) and the result says "timed out".
        ``connect_timeout``: seconds each connection attempt (and an agent's channel) may take
        for this call (None: the fan-out's ``connect_timeout``); timeouts are per call, so two
        callers sharing these connections never see each other's (tpufab.hosts.connect).
        Ctrl-C stops the command on every worker, then raises :class:`FanoutInterrupted`;
        so does ``cancel`` (an event another thread sets: a command held in the background,
        stopped when its caller is done with it).

        ``one_shot``: the caller runs this one command and is done (``tpufab exec``). On a
        connection that ran nothing yet, a shell command line without stdin, environment or
        cwd then runs on a plain exec channel (``remote/oneshot.sh``) instead of starting the
        agent; Ctrl-C, timeouts and a dropped connection still stop it (docs/fanout.md).
        """
        chosen = self.select(workers)
        self._route()
        if connect_timeout is None:
            connect_timeout = self.connect_timeout
        if timeout is None:
            timeout = self.command_timeout
        elif timeout == float("inf"):
            timeout = None  # explicitly unbounded (a log follower), whatever the default
        all_env = dict(env or {})
        all_env.update(secrets or {})
        masked = quoting.secret_bytes(
            [v for v in all_env.values() if isinstance(v, Secret)] + list((secrets or {}).values())
        )
        request: dict = {}
        if command is not None and _put is None:
            if isinstance(command, str):
                request["command"] = str(command)
            else:
                request["argv"] = [str(a) for a in command]
            if all_env:
                request["env"] = quoting.reveal_env(all_env)
            if stdin is not None:
                request["stdin"] = True
            if timeout is not None:
                request["timeout"] = timeout
            if cwd is not None:
                request["cwd"] = cwd
            encode_request(request)  # bad input (a NUL) fails once here, not per worker
        elif _put is not None:
            request = _put[0]
        plain = one_shot and set(request) <= {"command", "timeout"} and "command" in request
        if plain:
            oneshot_line()  # built here once, not by the first connections racing for it
        stdin_bytes = stdin.encode() if isinstance(stdin, str) else stdin
        view = LineCallback(on_line, then=sink) if on_line else sink
        label = command if isinstance(command, str) else " ".join(command or [])

        tasks: dict[int, Task] = {} if _tasks is None else _tasks
        slots = Slots(self.concurrency)
        remaining = [len(chosen)]
        counter = threading.Lock()
        wake = threading.Event()
        cancelled = threading.Event()  # this run's Ctrl-C, not another run's on the same links

        def finished(_task: Task) -> None:
            with counter:
                remaining[0] -= 1
                if remaining[0] == 0:
                    wake.set()

        def submit(task: Task, link: Link, crew: Crew | None = None) -> None:
            if command is None and _put is None:
                task.finish(0)
                return
            if plain and not link.used:  # a cold connection: a crew's thread reads it
                link.used = True
                plain_channel = Plain(link.conn.transport, task, request["command"],
                                       connect_timeout)
                with crew.serving():
                    plain_channel.serve(timeout)
                return
            link.used = True
            self._agent(link, connect_timeout).submit(task, request, stdin_bytes,
                                                      _put[1] if _put else None)

        def cold(task: Task, crew: Crew) -> None:
            link = self.links[task.worker]
            try:
                with slots:  # at most `concurrency` handshakes in flight
                    if task.done.is_set() or cancelled.is_set():
                        return  # interrupted while this worker waited for its turn
                    self.connector.connect(link, connect_timeout, cancelled)
                if task.done.is_set() or cancelled.is_set():
                    return
                submit(task, link, crew)
            except BaseException as err:  # noqa: BLE001 - becomes this worker's result
                link.close()
                task.finish(None, describe(err, link.target))

        crew = Crew(cold, self.concurrency)

        remote: dict[int, list[Task]] = {}
        try:
            for worker in chosen:
                with self._ids_lock:
                    task_id = next(self._ids)
                task = Task(task_id, worker, view, masked, capture)
                task.timeout = timeout
                task.on_done = finished
                tasks[worker] = task
                owner = self.owner.get(worker, 0)
                link = self.links[worker]
                if owner:
                    remote.setdefault(owner, []).append(task)
                elif link.ready and not (plain and not link.used):
                    try:
                        submit(task, link)  # warm: a frame on an open channel, no thread hop
                    except BaseException as err:  # noqa: BLE001 - this worker's result
                        link.close()
                        task.finish(None, describe(err, link.target))
                else:
                    crew.add(task)
            crew.start()
            for owner, owned in remote.items():
                try:
                    shard = self._shard(owner)
                except OSError as err:  # no process to run them in: their result says so
                    for task in owned:
                        task.finish(None, f"could not start fan-out process {owner} ({err})")
                    continue
                shard.run(owned, command, request, stdin_bytes, masked, timeout, one_shot, _put,
                          connect_timeout=connect_timeout)
            self._wait(tasks, timeout, connect_timeout, wake, cancel, list(remote))
        except KeyboardInterrupt:
            cancelled.set()
            silent = self._interrupt(tasks, remote)
            group = GroupResult({w: t.result for w, t in tasks.items()}, label)
            what = label or "the command"
            said = (f"Interrupted: {' and '.join(silent)} did not answer, so tpufab stopped it; "
                    f"its connections closed, so {nodeset.fold(tasks)} stop what it started of "
                    f"{what!r}.") if silent else \
                f"Interrupted: stopped {what!r} on {nodeset.fold(tasks)}."
            raise FanoutInterrupted(said, group, details=group.details()) from None
        group = GroupResult({w: t.result for w, t in tasks.items()}, label)
        return group.check() if check else group

    def _wait(self, tasks: Mapping[int, Task], timeout: float | None, connect_timeout: float,
              wake: threading.Event, cancel: threading.Event | None,
              owners: Sequence[int] = ()) -> None:
        # The worker enforces ``timeout``; this guard only covers a worker that stops answering.
        # The shards (other processes, the keeper) the run waits on are watched each second:
        # one that stops answering is given up on (shards.parent.SILENT), not waited for.
        guard = None if timeout is None else \
            timeout + self.kill_grace + connect_timeout + ANSWER_MARGIN
        while True:
            if cancel is not None and cancel.is_set():
                raise KeyboardInterrupt  # a shard told to stop by its parent
            if wake.wait(1.0 if guard is None else min(1.0, guard)):
                return
            for owner in owners:
                shard = self._shards.get(owner)
                if shard is not None:
                    shard.watch()
            if guard is None:
                continue
            now = time.perf_counter()
            for task in tasks.values():
                if not task.done.is_set() and now - task.started > guard:
                    if task.agent is not None:
                        task.agent.kill(task, "SIGKILL")
                    jump = self.targets[task.worker].jump   # it may be the one that hangs
                    task.finish(None, f"no answer from the worker"
                                      f"{f' (through the jump host {jump})' if jump else ''} "
                                      f"{guard:.0f} s after the command started (its timeout: "
                                      f"{timeout:g} s)")

    def _interrupt(self, tasks: Mapping[int, Task], remote: Mapping[int, list[Task]]) -> list[str]:
        """Stop every running command and wait (bounded) until the workers confirm. A shard
        that says nothing after it was asked is stopped itself (its connections close, and the
        workers stop what they ran): the names of those, for the sentence."""
        running = [t for t in tasks.values() if not t.done.is_set()]
        pings: dict[int, int] = {}   # owner: the number of the ping sent with the interrupt
        for owner in remote:
            shard = self._shards.get(owner)
            if shard is not None:
                shard.interrupt(remote[owner])
                pings[owner] = shard.ping()   # a live one answers at once, whatever its workers do
        silent: list[str] = []
        for task in running:
            if task.agent is not None and not self.owner.get(task.worker, 0):
                task.agent.kill(task, "SIGTERM")
        deadline = time.perf_counter() + self.kill_grace + 3
        for task in running:
            try:
                owner = self.owner.get(task.worker, 0)
                # A shard process runs its own interrupt first: give it its grace too.
                wait = max(0.0, deadline + (2 if owner else 0) - time.perf_counter())
                if (task.agent is None and not owner) or not task.done.wait(wait):
                    # Unconfirmed: closing the channel makes the worker kill everything it runs.
                    shard = self._shards.get(owner) if owner else None
                    if shard is not None and shard.alive and shard.answered < pings.get(owner, 0):
                        silent.append(shard.name)   # no answer to that ping: it hangs
                        shard.give_up("did not answer when asked to stop the command", then="")
                    elif shard is not None:
                        shard.close_worker(task.worker)
                    elif not owner:
                        self.links[task.worker].close()
                    task.finish(None, "interrupted")
            except KeyboardInterrupt:
                self.close()
                break
        for task in tasks.values():
            if not task.done.is_set():
                task.finish(None, "interrupted")
            elif task.result.error is None and task.result.signal:
                task.result.error = "interrupted"
        return silent

    # -- files ------------------------------------------------------------------------------
    def put(self, data: bytes | str | os.PathLike[str], remote_path: str, *, workers=None,
            mode: int = 0o644, check: bool = True) -> GroupResult:
        """Write a file on every selected worker (atomically, ``~`` expanded on the worker).

        ``data`` is the content (bytes) or a local path (str / PathLike).
        """
        if not isinstance(data, bytes):
            with open(data, "rb") as fh:
                data = fh.read()
        request = {"path": remote_path, "mode": mode}
        return self.run(f"put {remote_path}", workers=workers, check=check, _put=(request, data))

    def get(self, remote_path: str, local_dir: str | os.PathLike[str], *, workers=None,
            check: bool = True) -> dict[int, str]:
        """Copy ``remote_path`` from every selected worker to ``local_dir/w{N}-{name}``."""
        result = self.run(["cat", "--", remote_path], workers=workers, check=check)
        os.makedirs(local_dir, exist_ok=True)
        paths = {}
        for worker, r in result.items():
            if not r.ok:
                continue
            path = os.path.join(local_dir, f"{nodeset.label(worker)}-{os.path.basename(remote_path)}")
            with open(path, "wb") as fh:
                for chunk in r.stdout_output.chunks():
                    fh.write(chunk)
            paths[worker] = path
        return paths

    def bound(self, *, connect_timeout: float, command_timeout: float | None) -> FanoutView:
        """This fan-out's connections seen with one caller's timeouts (a :class:`FanoutView`)."""
        return FanoutView(self, connect_timeout=connect_timeout, command_timeout=command_timeout)


class FanoutView:
    """A :class:`Fanout`'s connections with one caller's own timeouts, fixed when it is made.

    Two Pods in one process share a node's warm connections but not their settings: each
    holds a view whose ``run``/``open``/``transport``/``put``/``get`` pass its
    ``connect_timeout`` and ``command_timeout`` (None: no limit) per call; everything else
    (targets, selection, closing) is the fan-out's. A view cannot be changed: the one road
    for a timeout is Settings -> the Pod -> a call (docs/architecture.md)."""

    __slots__ = ("fanout", "connect_timeout", "command_timeout")

    def __init__(self, fanout: Fanout, *, connect_timeout: float,
                 command_timeout: float | None):
        object.__setattr__(self, "fanout", fanout)
        object.__setattr__(self, "connect_timeout", connect_timeout)
        object.__setattr__(self, "command_timeout", command_timeout)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"a FanoutView is read-only ({name}): make a new one with "
                             "Fanout.bound")

    def __getattr__(self, name: str):
        return getattr(self.fanout, name)

    def __repr__(self) -> str:
        return (f"<FanoutView of {len(self.fanout.targets)} workers, connect "
                f"{self.connect_timeout:g} s, command {self.command_timeout} s>")

    def run(self, command, *, timeout: float | None = None,
            connect_timeout: float | None = None, **kwargs) -> GroupResult:
        if timeout is None:
            timeout = float("inf") if self.command_timeout is None else self.command_timeout
        return self.fanout.run(command, timeout=timeout, connect_timeout=(
            self.connect_timeout if connect_timeout is None else connect_timeout), **kwargs)

    def open(self, workers=None, *, connect_timeout: float | None = None) -> GroupResult:
        return self.run(None, workers=workers, connect_timeout=connect_timeout)

    def transport(self, worker: int, *, connect_timeout: float | None = None):
        return self.fanout.transport(worker, connect_timeout=(
            self.connect_timeout if connect_timeout is None else connect_timeout))

    put = Fanout.put  # both only call self.run: this view's timeouts
    get = Fanout.get
