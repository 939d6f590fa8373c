"""Fabric's own API on a pod: ``Pod.connections()`` and ``Pod.group()`` (the fabric extra).

``connections`` returns one ``fabric.Connection`` per worker, made as tpufab connects (the
worker's address, login user, tpufab's key and nothing else, the host key pinned for that
worker, the bastion as the gateway, no ~/.ssh/config in the way), so code written for
Fabric runs against a pod unchanged past that line. ``group`` gives Fabric's ``Group``
interface (``run``, ``sudo``, ``put``, ``get``, ``local``; a ``GroupResult``, and a
``GroupException`` carrying every worker's result when one fails) on tpufab's own fan-out:
its connections (kept ones too), its speed, its masking. Fabric is imported on the first
call only (``pip install 'tpufab[fabric]'``).
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import IO, Any

from tpufab.config import timeout_for
from tpufab.errors import ConfigError

RUN_KWARGS = frozenset({"warn", "hide", "echo", "env", "timeout", "out_stream", "err_stream",
                        "encoding", "sink"})
_SUDO_PASSWORD = "TPUFAB_SUDO_PASSWORD"


def require_fabric():
    """The fabric package, or one sentence saying how to install it."""
    try:
        import fabric
    except ImportError:
        raise ConfigError("Fabric is not installed here: pip install 'tpufab[fabric]' (Pod."
                          "connections() and Pod.group() hand out Fabric's own objects).") from None
    return fabric


def connections(pod: Any, workers: str | Iterable[int] = "all", *, config: Any = None) -> list:
    """One ``fabric.Connection`` per chosen worker of ``pod``, in worker order (each knows
    its ``.worker``); a ``config`` (a fabric.Config) gives their run/sudo settings, never
    where or how they connect."""
    fabric = require_fabric()
    from paramiko import SSHConfig

    from tpufab.ssh.hostkeys import KnownHosts

    hosts = pod.hosts
    chosen = pod.select(workers)
    if config is None:
        config = fabric.Config(ssh_config=SSHConfig())  # not the user's ~/.ssh/config
    else:
        config = config.clone(into=fabric.Config)
        config._set(base_ssh_config=SSHConfig())
    known = KnownHosts(pod.settings.known_hosts_path)
    timeout = max(1, int(pod.settings.connect_timeout))
    key = str(pod.settings.ssh_key_path)
    gateways: dict[Any, Any] = {}

    def connection(host: str, user: str, port: int, key_file: str | None, alias: str,
                   gateway: Any):
        conn = fabric.Connection(host, user=user, port=port, config=config, gateway=gateway,
                                 connect_timeout=timeout, forward_agent=False,
                                 connect_kwargs={"key_filename": [key_file or key],
                                                 "look_for_keys": False, "allow_agent": False})
        # the client's own host-key table stays empty: every connection asks the pin
        conn.client.set_missing_host_key_policy(known.policy(alias))
        return conn

    out = []
    for worker in chosen:
        target = hosts.fanout.targets[worker]
        gateway: Any = False   # False: no gateway, whatever a config says
        if target.jump is not None:
            jump = target.jump
            if jump not in gateways:
                gateways[jump] = connection(jump.host, jump.user, jump.port, jump.key_filename,
                                            jump.key_alias, False)
            gateway = gateways[jump]
        conn = connection(target.host, target.user, target.port, target.key_filename,
                          target.key_alias, gateway)
        conn._set(worker=worker)
        out.append(conn)
    return out


def group(pod: Any, workers: str | Iterable[int] = "all") -> Any:
    """Fabric's Group interface on the chosen workers of ``pod`` (a ``fabric.Group``)."""
    require_fabric()
    return _classes().PodGroup(pod, pod.select(workers))


class Worker(int):
    """A worker as a key of a group's results: its index (``results[0]``) that also says
    where it is, as a Fabric Connection would (``.host``, ``.user``, ``.port``)."""

    def __new__(cls, index: int, host: str = "", user: str = "", port: int = 22) -> Worker:
        worker = int.__new__(cls, index)
        worker.host, worker.user, worker.port = host, user, port
        return worker

    @property
    def label(self) -> str:
        return f"w{int(self)}"

    def __repr__(self) -> str:
        return f"<Worker w{int(self)} {self.user}@{self.host}>"

    def __str__(self) -> str:
        return str(int(self))


class WorkerUnreachable(ConnectionError):
    """A worker that never ran the command (not reached, refused, its connection lost): a
    group result's value where Fabric would hold paramiko's or the socket's exception."""

    def __init__(self, worker: int, error: str):
        super().__init__(f"w{worker}: {error}")
        self.worker, self.error = worker, error


class _Streams:
    """A fan-out sink that prints what each worker prints, as Fabric does (no prefix), to
    ``out``/``err`` unless hidden."""

    def __init__(self, out: IO | None, err: IO | None, hidden: tuple[str, ...], encoding: str):
        self.out = None if "stdout" in hidden else (out or sys.stdout)
        self.err = None if "stderr" in hidden else (err or sys.stderr)
        self.encoding = encoding
        self.lock = threading.Lock()

    def lines(self, worker: int, stream: str, data: bytes) -> None:
        target = self.out if stream == "stdout" else self.err
        if target is not None:
            with self.lock:
                target.write(data.decode(self.encoding, "replace"))
                target.flush()

    def done(self, result: Any) -> None:
        pass


def _hidden(hide: Any) -> tuple[str, ...]:
    """invoke's ``hide``: None/False, True/"both", "out"/"stdout", "err"/"stderr"."""
    if hide in (None, False):
        return ()
    if hide in (True, "both"):
        return ("stdout", "stderr")
    if hide in ("out", "stdout"):
        return ("stdout",)
    if hide in ("err", "stderr"):
        return ("stderr",)
    raise ConfigError(f"hide takes True, False, 'both', 'out' or 'err', not {hide!r}.")


def _sudo_line(command: str, user: str | None, env: Mapping[str, str] | None,
               password: bool) -> str:
    """``command`` run by a root (or ``user``) shell through sudo: the whole line, not only
    its first word; ``env`` names kept across sudo; the password (when there is one) read
    from a masked variable on stdin, never argv."""
    from tpufab.quoting import Raw
    from tpufab.quoting import command as quoted

    flags = ["-S", "-p", ""] if password else ["-n"]
    if user:
        flags += ["-H", "-u", user]
    if env:
        flags.append("--preserve-env=" + ",".join(sorted(env)))
    line = quoted("sudo", *flags, "--", "/bin/sh", "-c", command)
    if password:
        return str(quoted("printf", "%s\\n", Raw(f'"${_SUDO_PASSWORD}"'), Raw("|"), Raw(line)))
    return str(line)


@functools.cache
def _classes():
    """The Fabric subclasses, made once fabric is imported."""
    import invoke
    from fabric.exceptions import GroupException
    from fabric.group import Group, GroupResult
    from fabric.runners import Result
    from fabric.transfer import Result as TransferResult
    from invoke.exceptions import CommandTimedOut, UnexpectedExit

    from tpufab import nodeset

    class PodGroupException(GroupException):
        """Fabric's GroupException (``.result``: every worker's result, the failed ones as
        their exceptions) that says which workers failed and how."""

        def __init__(self, result: GroupResult, message: str):
            super().__init__(result)
            self.message = message
            self.args = (message,)

        def __str__(self) -> str:
            return self.message

    def failed_on(what: str, results: GroupResult) -> PodGroupException:
        failed = {w: v for w, v in results.items() if isinstance(v, BaseException)}
        groups: dict[str, list[int]] = {}
        for w, value in failed.items():
            if isinstance(value, CommandTimedOut):
                why = f"timed out after {value.timeout:g} s"
            elif isinstance(value, UnexpectedExit):
                why = f"exit {value.result.exited}"
            else:
                why = getattr(value, "error", None) or str(value)
            groups.setdefault(why, []).append(int(w))
        said = "; ".join(f"{nodeset.fold(ws)} {why}" for why, ws in
                         sorted(groups.items(), key=lambda kv: kv[1][0]))
        return PodGroupException(results, f"{what} failed on {len(failed)} of {len(results)} "
                                          f"workers: {said}.")

    class PodGroup(Group):
        """A pod's workers with Fabric's Group API, run by tpufab's fan-out. Iterating it
        gives the workers' ``fabric.Connection`` objects (made on first use)."""

        def __init__(self, pod: Any, workers: list[int]):
            list.__init__(self)
            self.pod, self.workers = pod, list(workers)
            targets = pod.hosts.fanout.targets
            self.keys = {w: Worker(w, targets[w].host, targets[w].user, targets[w].port)
                         for w in self.workers}
            self._made = False

        # -- the Connections, for code that walks the group ------------------------------------
        def _connections(self) -> None:
            if not self._made:
                list.extend(self, connections(self.pod, self.workers))
                self._made = True

        def __iter__(self):
            self._connections()
            return list.__iter__(self)

        def __getitem__(self, index):
            self._connections()
            return list.__getitem__(self, index)

        def __len__(self) -> int:
            return len(self.workers)

        def __bool__(self) -> bool:
            return bool(self.workers)

        def __repr__(self) -> str:
            return f"<PodGroup {self.pod.settings.name} {nodeset.fold(self.workers)}>"

        def __eq__(self, other: object) -> bool:
            return self is other

        __hash__ = object.__hash__

        def close(self) -> None:
            """Close the Connections handed out; the pod's own stay as the Pod keeps them
            (``Pod.close()``)."""
            for conn in list.__iter__(self):
                conn.close()

        # -- commands ---------------------------------------------------------------------
        def run(self, command: str, **kwargs: Any) -> GroupResult:
            """``command`` on every worker at once: a GroupResult of fabric Results keyed by
            worker; GroupException unless every worker ran it (and, without ``warn``,
            exited 0). Takes invoke's ``warn``, ``hide``, ``echo``, ``env``, ``timeout``,
            ``out_stream``, ``err_stream``, ``encoding``, and ``sink`` (a tpufab output
            sink, e.g. ``tpufab.pod.api.LiveView()``, instead of Fabric's printing)."""
            return self._run(command, command, kwargs, "run")

        def sudo(self, command: str, *, user: str | None = None,
                 password: str | None = None, **kwargs: Any) -> GroupResult:
            """``command`` as root (or ``user``) on every worker: the whole line runs in a
            shell under ``sudo -n`` (TPU VMs' sudo needs no password; a ``password`` goes
            to ``sudo -S`` through a masked variable, never argv)."""
            line = _sudo_line(command, user, kwargs.get("env"), password is not None)
            secret = [f"{_SUDO_PASSWORD}={password}"] if password is not None else None
            return self._run(command, line, kwargs, "sudo", secret=secret)

        def _run(self, command: str, line: str, kwargs: dict, method: str, *,
                 secret: list[str] | None = None) -> GroupResult:
            unknown = sorted(set(kwargs) - RUN_KWARGS)
            if unknown:
                raise ConfigError(
                    f"Pod.group().{method}() does not take {', '.join(unknown)}: tpufab's "
                    "fan-out runs commands without a terminal or input; use "
                    "Pod.connections() (a fabric.Connection per worker) for those.")
            hidden = _hidden(kwargs.get("hide"))
            encoding = kwargs.get("encoding") or "utf-8"
            sink = kwargs.get("sink") or _Streams(kwargs.get("out_stream"),
                                                  kwargs.get("err_stream"), hidden, encoding)
            if kwargs.get("echo"):
                out = kwargs.get("out_stream") or sys.stdout
                out.write(f"\033[1;37m{command}\033[0m\n")
                out.flush()
            env = dict(kwargs.get("env") or {})
            # the limit a timed-out command met (none given: the command_timeout setting)
            timeout = timeout_for("exec", kwargs.get("timeout"), self.pod.settings.command_timeout)
            # one_shot: a cold connection runs it on a plain exec channel, as `tpufab exec`
            # does (no agent to start); a later call starts the agent where it needs one
            done = self.pod.run(line, workers=self.workers, env=env or None, warn=True,
                                timeout=timeout, sink=sink, secret=secret, one_shot=True)
            results = GroupResult()
            try:
                for w, r in done.items():
                    key = self.keys[w]
                    if r.exit_code is None and not (r.error or "").startswith("timed out"):
                        results[key] = WorkerUnreachable(w, r.error or "no answer")
                        continue
                    result = Result(connection=key, stdout=r.stdout, stderr=r.stderr,
                                    encoding=encoding, command=command, shell="/bin/sh",
                                    env=env, exited=-1 if r.exit_code is None else r.exit_code,
                                    pty=False, hide=hidden)
                    if (r.error or "").startswith("timed out"):
                        results[key] = CommandTimedOut(result, timeout)
                    elif r.exit_code != 0 and not kwargs.get("warn"):
                        results[key] = UnexpectedExit(result)
                    else:
                        results[key] = result
            finally:
                done.close()
            if results.failed:
                raise failed_on(f"`{_short(command)}`", results)
            return results

        def local(self, *args: Any, **kwargs: Any) -> Any:
            """A command here, as ``Connection.local`` (invoke's ``Context.run``)."""
            return invoke.Context().run(*args, **kwargs)

        # -- files ------------------------------------------------------------------------
        def put(self, local: Any, remote: str | None = None, preserve_mode: bool = True
                ) -> GroupResult:
            """Copy a local file (or directory, or file-like object) to every worker at once:
            ``remote`` None or "" is the home directory, one ending in ``/`` or naming a
            directory takes the file inside it, relative paths are from the home directory
            (as Fabric's put). tpufab's transfer: verified, atomic, one upload relayed by the
            workers. A GroupResult of fabric.transfer Results keyed by worker."""
            from tpufab.ssh import transfer

            results = GroupResult()
            if hasattr(local, "read"):
                if not remote or remote.endswith("/"):
                    raise ConfigError("put() of a file-like object needs the remote file's "
                                      "path (not a directory).")
                data = local.read()
                done = self.pod.fanout.put(data.encode() if isinstance(data, str) else data,
                                           remote, workers=self.workers, check=False)
                for w, r in done.items():
                    results[self.keys[w]] = TransferResult(
                        local=None, orig_local=local, remote=remote, orig_remote=remote,
                        connection=self.keys[w]) if r.ok else WorkerUnreachable(w, r.outcome)
            else:
                path = Path(local).expanduser()
                if not path.exists():
                    raise ConfigError(f"{local} does not exist here; put() copies a local file "
                                      "or directory.")
                peers = None if len(self.workers) < 2 else dict(
                    enumerate(self.pod.internal_ips()))
                report = transfer.put(self.pod.fanout, str(path), remote or None,
                                      workers=self.workers, peers=peers)
                for row in report.rows:
                    key = self.keys[row.worker]
                    results[key] = WorkerUnreachable(row.worker, row.error) if row.error else \
                        TransferResult(local=str(path.absolute()), orig_local=local,
                                       remote=row.paths[0] if len(row.paths) == 1 else
                                       (remote or ""), orig_remote=remote, connection=key)
            if results.failed:
                raise failed_on(f"put {local}", results)
            return results

        def get(self, remote: str, local: str | None = None, preserve_mode: bool = True
                ) -> GroupResult:
            """Copy ``remote`` from every worker at once into ``local``, a path in which
            ``{worker}`` (w0, w1, ...), ``{host}``, ``{user}``, ``{port}``, ``{basename}`` and
            ``{dirname}`` are each worker's (default ``{worker}/``: w0/NAME, w1/NAME; Fabric's
            own default is ``{host}/``); one ending in ``/`` is a directory the file goes into.
            tpufab's transfer: verified, atomic. A GroupResult of fabric.transfer Results."""
            import shutil
            import tempfile

            from tpufab.ssh import transfer

            if not remote or not str(remote).strip():
                raise ConfigError("get() needs the remote path to copy.")
            local = "{worker}/" if local is None else str(local)
            name = os.path.basename(remote.rstrip("/"))
            try:  # beside where the files go (a rename), else wherever temporary files go
                staging = Path(tempfile.mkdtemp(prefix=".tpufab-get-", dir="."))
            except OSError:
                staging = Path(tempfile.mkdtemp(prefix="tpufab-get-"))
            results = GroupResult()
            try:
                report = transfer.get(self.pod.fanout, remote, staging, workers=self.workers)
                for row in report.rows:
                    key = self.keys[row.worker]
                    if row.error:
                        results[key] = WorkerUnreachable(row.worker, row.error)
                        continue
                    got = staging / key.label / name if len(self.workers) > 1 else \
                        staging / name
                    dest = local.format(worker=key.label, host=key.host, user=key.user,
                                        port=key.port, basename=name,
                                        dirname=os.path.dirname(remote))
                    if dest.endswith(("/", os.sep)) or Path(dest).is_dir():
                        dest = os.path.join(dest, name)
                    Path(dest).parent.mkdir(parents=True, exist_ok=True)
                    shutil.move(str(got), dest)
                    results[key] = TransferResult(local=str(Path(dest).absolute()),
                                                  orig_local=local, remote=remote,
                                                  orig_remote=remote, connection=key)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
            if results.failed:
                raise failed_on(f"get {remote}", results)
            return results

    PodGroupException.__qualname__ = "PodGroupException"
    PodGroup.__qualname__ = "PodGroup"
    return _Classes(PodGroup, PodGroupException)


class _Classes:
    def __init__(self, group, exception):
        self.PodGroup, self.PodGroupException = group, exception


def _short(command: str) -> str:
    first = command.strip().splitlines()[0] if command.strip() else command
    return first if len(first) <= 60 else first[:57] + "..."
