"""The Python API: a TPU pod as one machine, in the spirit of Fabric's `Group`.

    from tpufab import Pod

    pod = Pod.current()                      # or Pod("my-v4-32"), or tpufab.create(type=...)
    result = pod.run("hostname")             # {0: Result, 1: Result, ...}
    result[0].stdout, result.succeeded, result.failed
    pod.deploy(); pod.mount("gs://data"); run = pod.start("recipes/train.sh")
    pod.kill(); pod.status()

`run` raises one `PodError` carrying every worker's result when any worker failed (unless
`warn=True`). The verbs of the `tpufab` command and the invoke tasks are built on these
methods. Importing this module imports neither fabric nor google-cloud-tpu: they load on the
first call that needs them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tpufab.config import Settings, load_settings
from tpufab.errors import ConfigError, TpufabError, shown

if TYPE_CHECKING:
    from tpufab.fanout import OutputSink, WorkerResult
    from tpufab.pod import Pod as Connected

__all__ = ["Pod", "PodError", "PodResult", "Run", "create", "delete", "gc"]


class PodResult(dict):
    """Worker index -> result (``.stdout``, ``.stderr``, ``.exited``, ``.ok``), like Fabric's
    GroupResult; ``.succeeded`` and ``.failed`` are the same mapping split by outcome."""

    @property
    def succeeded(self) -> dict[int, WorkerResult]:
        return {w: r for w, r in self.items() if r.ok}

    @property
    def failed(self) -> dict[int, WorkerResult]:
        return {w: r for w, r in self.items() if not r.ok}

    @property
    def ok(self) -> bool:
        return not self.failed


class PodError(TpufabError):
    """Some workers failed; ``.result`` holds every worker's outcome, not only the failures."""

    def __init__(self, message: str, result: PodResult, **kwargs: Any):
        super().__init__(message, **kwargs)
        self.result = result


def _settings(name: str | None, zone: str | None, project: str | None,
              overrides: Mapping[str, Any]) -> Settings:
    return load_settings({"name": name, "zone": zone, "project": project, **overrides})


class Pod:
    """The workers of one TPU node (or multislice queued resource), reached over SSH.

    ``Pod(name)`` names it; ``Pod()`` takes the name from TPUFAB_NAME, tpufab.yaml or this
    project's current pod, like the command line does. Connections open on first use and
    stay open (``close()``, or use ``with Pod(...) as pod``).
    """

    _leased = False  # True while start() holds the code lease its deploy runs under

    def __init__(self, name: str | None = None, *, zone: str | None = None,
                 project: str | None = None, **settings: Any):
        self.settings = _settings(name, zone, project, settings)
        self._connected: Connected | None = None

    @classmethod
    def from_settings(cls, settings: Settings) -> Pod:
        """The pod ``settings.name`` names, with exactly these settings."""
        pod = cls.__new__(cls)
        pod.settings, pod._connected = settings, None
        return pod

    @classmethod
    def current(cls, **settings: Any) -> Pod:
        """This project's current pod (the one `tpufab create` or `tpufab use` chose)."""
        from tpufab import current

        found = current.read()
        if found is None:
            raise ConfigError("This project has no current pod: `tpufab create --type TYPE` "
                              "makes one, `tpufab use NAME` chooses one.")
        return cls(found.name, zone=found.zone, project=found.project, **settings)

    @property
    def name(self) -> str:
        from tpufab.lifecycle import validate_name

        return validate_name(self.settings.name)

    def __repr__(self) -> str:
        return f"<Pod {self.settings.name} in {self.settings.zone}>"

    # -- connections ---------------------------------------------------------------------
    @property
    def connected(self) -> Connected:
        """The open pod (nodes, fan-out, slices): connects on first use."""
        if self._connected is None:
            from tpufab import pod

            self._connected = pod.shared(self.settings)
        return self._connected

    @property
    def workers(self) -> list[int]:
        return self.connected.workers

    @property
    def fanout(self) -> Any:
        """The fan-out over the workers' SSH connections (tpufab.fanout.Fanout)."""
        return self.connected.fanout

    @property
    def nodes(self) -> list:
        return self.connected.nodes

    @property
    def slices(self) -> list[list[int]]:
        """Global worker indexes per slice (one slice unless multislice)."""
        return self.connected.slices

    def internal_ips(self) -> list[str]:
        return self.connected.internal_ips()

    def device_globs(self) -> tuple[str, ...]:
        return self.connected.device_globs()

    def select(self, workers: str | Iterable[int] | None = "all") -> list[int]:
        """``"all"``, ``"0,3-5"``, ``"w[0-3]"`` or worker indexes -> the workers, checked."""
        return self.connected.fanout.select(workers)

    def close(self) -> None:
        if self._connected is not None:
            from tpufab import pod

            pod.forget(self.settings)
            self._connected = None

    def __enter__(self) -> Pod:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- commands ------------------------------------------------------------------------
    def run(self, command: str | Sequence[str], *, workers: str | Iterable[int] = "all",
            env: Mapping[str, str] | None = None, warn: bool = False,
            timeout: float | None = None, sink: OutputSink | None = None,
            cwd: str | None = None) -> PodResult:
        """Run ``command`` (a shell line, or an argv list) on the workers at once.

        ``env`` values listed in the ``secrets`` setting travel on stdin and are masked.
        Raises PodError naming every failed worker unless ``warn``.
        """
        from tpufab.quoting import Secret

        secret_names = set(self.settings.secrets)
        plain = {k: v for k, v in (env or {}).items() if k not in secret_names}
        hidden = {k: Secret(v) for k, v in (env or {}).items() if k in secret_names}
        raw = self.connected.fanout.run(command, workers=self.select(workers), env=plain,
                                        secrets=hidden, timeout=timeout, sink=sink, cwd=cwd)
        result = PodResult(raw.items())
        if not warn and not raw.ok:
            from tpufab.fanout import GroupResult

            failed = GroupResult(result.failed, command=raw.command)
            raise PodError(f"{raw._what()} failed on {len(failed)} of {len(raw)} workers: "
                           f"{failed.summary()}.", result, details=raw.details(),
                           exit_code=raw.exit_code)
        return result

    def setup(self, script: str | Path = "scripts/setup.sh", *, force: bool = False,
              workers: str | Iterable[int] = "all", timeout: float | None = None,
              sink: OutputSink | None = None) -> dict:
        """Run a setup script on every worker once per script content: {worker: outcome}."""
        from tpufab.fanout import run_setup

        path = Path(script)
        if not path.is_file():
            raise ConfigError(f"Setup script {script} does not exist; pass a path such as "
                              "scripts/setup.sh.")
        result, outcomes = run_setup(self.connected.fanout, path, workers=self.select(workers),
                                     force=force, sink=sink, timeout=timeout)
        result.close()
        return outcomes

    def deploy(self, ref: str = "HEAD", *, direct: bool = False, wip: bool = False,
               remote: str = "origin", dir: str | None = None, cwd: str | Path | None = None,
               progress: Any = None, sink: OutputSink | None = None) -> Any:
        """Put one commit of the git repository at ``cwd`` (default: here) on every worker;
        returns the per-worker report (commit, action, seconds)."""
        import os

        from tpufab import deploy as deploying
        from tpufab import gitops
        from tpufab.quoting import Secret

        root = gitops.repo_root(Path(cwd) if cwd else None)
        if not wip:
            gitops.refuse_dirty(root)
            gitops.resolve(root, ref)
        if not direct:
            gitops.remote_url(root, remote)
        token = os.environ.get(deploying.TOKEN_ENV)
        return deploying.deploy(self.connected.fanout, ref=ref, remote=remote,
                                dir=dir or self.settings.remote_dir, direct=direct, wip=wip,
                                cwd=root, token=Secret(token) if token else None,
                                progress=progress, sink=sink, lease=not self._leased)

    def mount(self, bucket: str, *, at: str | None = None, driver: str | None = None,
              options: Sequence[str] = (), install: bool = False,
              sink: OutputSink | None = None) -> Any:
        """Mount gs://BUCKET[/PREFIX] on every worker, verified; returns the report."""
        from tpufab import mount as mounting

        spec = mounting.mount_spec(bucket, at=at, driver=driver or self.settings.mount_driver,
                                   options=list(options), endpoint=self.settings.storage_endpoint)
        return mounting.apply_mount(self.connected.fanout, spec, install=install, sink=sink)

    def umount(self, at: str | None = None, *, lazy: bool = False) -> Any:
        """Unmount ``at`` (default: every mount tpufab made) on every worker."""
        from tpufab import mount as mounting

        mounting.umount_args(at, lazy=lazy)
        return mounting.umount(self.connected.fanout, at, lazy=lazy)

    # -- files, ports, profiles ------------------------------------------------------------
    def put(self, local: str | Path, remote: str | None = None, *,
            workers: str | Iterable[int] = "all", relay: bool = True,
            progress: Any = None) -> Any:
        """Copy a local file or directory to the workers: verified, atomic, identical files
        skipped; with ``relay`` one upload that a worker serves to the others. Returns the
        per-worker report (``.lines()``); raises TransferError naming every failed worker."""
        from tpufab import transfer

        peers = dict(enumerate(self.internal_ips())) if relay else None
        return transfer.put(self.connected.fanout, local, remote, workers=self.select(workers),
                            peers=peers, progress=progress).check()

    def get(self, remote: str, local: str | Path, *, workers: str | Iterable[int] = "all",
            progress: Any = None) -> Any:
        """Copy a file or directory from the workers into ``local/w0/...`` (one worker:
        ``local``); returns the per-worker report, raises TransferError on failures."""
        from tpufab import transfer

        return transfer.get(self.connected.fanout, remote, local, workers=self.select(workers),
                            progress=progress).check()

    def forward(self, *ports: str, worker: int = 0, on_event: Any = None) -> Any:
        """Listen on 127.0.0.1 ports here and tunnel them to ``worker`` over SSH
        (``"8080"``, ``"8080:6006"``); returns the started Forwarder (``close()`` it, or use
        it in a ``with``)."""
        from tpufab import forward as forwarding

        return forwarding.forward(self.connected.fanout, forwarding.parse_forwards(ports),
                                  worker=worker, on_event=on_event)

    def profile(self, *, workers: str | Iterable[int] = "0", seconds: float = 5.0,
                run: str | None = None, port: int | None = None) -> Any:
        """Capture ``seconds`` of profiler trace from the running JAX job; returns where it
        was copied (``.local_dir``) and the files per worker."""
        from tpufab import profiling

        return profiling.capture(self.connected.fanout, workers=self.select(workers), run=run,
                                 port=port, seconds=seconds)

    # -- jobs ----------------------------------------------------------------------------
    def start(self, recipe: str | Path, args: Sequence[str] = (), *,
              env: Mapping[str, str] | None = None, deploy: bool = True,
              direct: bool = False, spmd: bool = False) -> Run:
        """Start a recipe on every worker at once (after deploying this repository's commit)
        and return without following it."""
        from tpufab import jobs
        from tpufab.remote_files import RemoteFile
        from tpufab.runs import forwarded_for

        path = Path(recipe)
        if not path.is_file():
            raise ConfigError(f"No recipe at {shown(recipe)}: pass an executable file such as "
                              "recipes/hello.sh.")
        specs = [f"{k}={v}" for k, v in (env or {}).items()]
        forwarded = forwarded_for(self.settings, specs)
        from tpufab import codelock

        fanout = self.connected.fanout
        # as `tpufab run`: one writer for the code and one job at a time (docs/reliability.md)
        with codelock.hold(fanout, fanout.workers, purpose=f"run {path.name}") as lease:
            codelock.refuse_a_second_run(fanout, fanout.workers, lease)
            commit = None
            cwd = jobs.default_cwd(self.settings.remote_dir)
            if deploy:
                self._leased = True  # this lease covers the deploy
                try:
                    report = self.deploy(direct=direct)
                finally:
                    self._leased = False
                commit, cwd = report.commit, report.dir
            plan = jobs.plan_run(RemoteFile.from_path(path), slices=self.connected.slices,
                                 ips=self.connected.internal_ips(), args=list(args), cwd=cwd,
                                 commit=commit, forwarded=forwarded, spmd=spmd)
            jobs.start(fanout, plan)
        return Run(self, plan.run_id, plan.workers)

    def kill(self, *, run: str | None = None, grace: float = 5.0, dry_run: bool = False,
             force: bool = False, workers: str | Iterable[int] = "all") -> Any:
        """Free the TPU on every worker; returns the kill result (``.ok``, per worker)."""
        from tpufab import killing

        return killing.kill(self.connected.fanout, self.select(workers), run=run, grace=grace,
                            dry_run=dry_run, force=force,
                            device_globs=self.connected.device_globs())

    def status(self) -> Any:
        """The node's API state and every worker's facts (``.healthy``, ``.to_json()``)."""
        from tpufab import status

        return status.collect(self.settings)

    def autostop(self, *, idle: float | None = None, ttl: float | None = None,
                 cancel: bool = False) -> Any:
        """Arm the watchdog on the workers that deletes this pod after ``idle`` seconds with
        no run and no TPU holder (or at ``ttl`` seconds); ``cancel`` removes it. Returns the
        policy armed (or, with cancel, what was armed)."""
        from tpufab import autostop

        if cancel:
            return autostop.cancel(self, self.settings)
        if idle is None and ttl is None:
            raise ConfigError("Give idle=SECONDS or ttl=SECONDS (or cancel=True).")
        return autostop.arm(self, self.settings, idle=idle, ttl=ttl)

    def check(self, *, quick: bool = False, timeout: float = 120.0) -> Any:
        """`tpufab check`: every worker compared, then (unless ``quick``) a collective across
        every host; a report (``.ok``, ``.problems``, ``.to_json()``)."""
        from tpufab import check

        return check.run_check(self.settings, self.connected, quick=quick, timeout=timeout)


class _Silent:
    """A view that shows nothing (the logs stay on the workers)."""

    def lines(self, worker: int, stream: str, data: bytes) -> None:
        pass

    def done(self, result: Any) -> None:
        pass


class Run:
    """A run started with `Pod.start`."""

    def __init__(self, pod: Pod, run_id: str, workers: Sequence[int]):
        self.pod, self.id, self.workers = pod, run_id, list(workers)

    def __repr__(self) -> str:
        return f"<Run {self.id} on {len(self.workers)} workers>"

    def wait(self, sink: OutputSink | None = None) -> dict:
        """Follow it to the end: {worker: state} (``.ok``, ``.exit_status``)."""
        from tpufab import jobs

        return jobs.follow(self.pod.connected.fanout, self.id, self.workers,
                           jobs.FollowSink(sink or _Silent()))

    def logs(self) -> dict[int, str]:
        """Each worker's log so far."""
        from tpufab import jobs

        logs, _states = jobs.fetch_logs(self.pod.connected.fanout, self.id, self.workers)
        try:
            return {w: output.read().decode("utf-8", "replace") for w, output in logs.items()}
        finally:
            for output in logs.values():
                output.close()

    def kill(self, grace: float = 5.0) -> dict:
        from tpufab import jobs

        return jobs.stop(self.pod.connected.fanout, self.id, self.workers, grace=grace)


def create(name: str | None = None, *, type: str | None = None, zone: str | None = None,
           project: str | None = None, queued: bool = False, num_slices: int = 1,
           **settings: Any) -> Pod:
    """Create a TPU VM node (idempotent for an existing READY node of the same type), wait
    until it is READY, and return it as a Pod."""
    from tpufab import lifecycle

    chosen = _settings(name, zone, project, {"type": type, **settings})
    lifecycle.create(chosen, queued=queued, num_slices=num_slices)
    return Pod(chosen.name, zone=chosen.zone, project=chosen.project, **settings)


def gc(*, zone: str | None = None, project: str | None = None, all_zones: bool = False,
       **settings: Any) -> list:
    """Delete preempted, terminated and failed nodes and suspended and failed queued resources
    (in the zone, or every zone), without asking; returns what was deleted."""
    from tpufab import lifecycle

    return lifecycle.gc(_settings(None, zone, project, settings), yes=True, all_zones=all_zones)


def delete(name: str | None = None, *, zone: str | None = None,
           project: str | None = None) -> None:
    """Delete a TPU node (or queued resource) without asking (a no-op if there is none)."""
    from tpufab import lifecycle
    from tpufab import pod as pods

    chosen = _settings(name, zone, project, {})
    pods.forget(chosen)
    lifecycle.delete(chosen, yes=True)
