"""The Python API: a TPU pod as one machine, in the spirit of Fabric's `Group`.

    from tpufab import Pod

    pod = Pod.current()                      # or Pod("my-v4-32"), or tpufab.create(type=...)
    result = pod.run("hostname")             # {0: Result, 1: Result, ...}
    result[0].stdout, result.succeeded, result.failed
    pod.deploy(); pod.mount("gs://data"); run = pod.start("recipes/train.sh")
    pod.kill(); pod.status()

One method per operation on the workers; the verbs of the `tpufab` command and the invoke
tasks take their flags from these signatures (tpufab.verbs.declare). `run` raises one
`PodError` carrying every worker's result when any worker failed (unless `warn=True`).
Every ``timeout=None`` means the same: the ``command_timeout`` setting, else the timeout
table's default (tpufab.config.TIMEOUTS, resolved by ``timeout_for``). Importing this module
imports neither paramiko nor google-cloud-tpu: they load on the first call that needs them.
The pod's cloud verbs are tpufab.pod.pods, `launch` is tpufab.pod.launched, a started run
tpufab.pod.run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tpufab.config import GENERIC, TIMEOUTS, Settings, load_settings, timeout_for
from tpufab.errors import ConfigError, TpufabError
from tpufab.pod.environment import PodEnvironment
from tpufab.pod.ray import PodRay

if TYPE_CHECKING:
    from fabric import Config as FabricConfig
    from fabric import Connection, Group

    from tpufab.cloud.nodes import Node
    from tpufab.flows.babysit.records import BabysitResult
    from tpufab.hosts.connect import Hosts
    from tpufab.pod.run import Run
    from tpufab.ssh.fanout import Fanout
    from tpufab.ssh.forward import Forwarder
    from tpufab.ssh.results import GroupResult as PodResult
    from tpufab.ssh.results import OutputSink
    from tpufab.ssh.transfer import Progress as BytesProgress
    from tpufab.ssh.transfer import TransferReport
    from tpufab.steps.code.deploy import DeployReport
    from tpufab.steps.health.check import CheckReport
    from tpufab.steps.health.stacks import StacksReport
    from tpufab.steps.health.status import StatusReport
    from tpufab.steps.health.top import TopReport
    from tpufab.steps.host.autostop import AutostopReport
    from tpufab.steps.host.environment import EnvReport, EnvStatusReport  # noqa: F401 (PodEnvironment's)
    from tpufab.steps.host.images import ImageReport
    from tpufab.steps.host.killing import KillReport
    from tpufab.steps.host.mount import MountReport, MountSpec
    from tpufab.steps.host.profiling import ProfileReport
    from tpufab.steps.host.setup import SetupReport
    from tpufab.steps.runs.history import LogsReport, RunsReport
    from tpufab.steps.runs.steptable import StragglersReport
    from tpufab.steps.start.localrun import LocalRunResult
    from tpufab.steps.start.raycluster import (  # noqa: F401 (PodRay's)
        RayDown,
        RayStatusReport,
        RayUp,
        Submitted,
    )

Progress = Callable[..., None]          # progress(text, style=None): a step's notes

__all__ = ["Pod"]


class Pod(PodEnvironment, PodRay):
    """The workers of one TPU node (or multislice queued resource), reached over SSH.
    ``Pod(name)`` names it; ``Pod()`` takes the name as the command line does (TPUFAB_NAME,
    tpufab.yaml, this project's current pod). Connections open on first use and stay open
    (``close()``, or ``with Pod(...) as pod``)."""

    def __init__(self, name: str | None = None, *, zone: str | None = None,
                 project: str | None = None, **settings: Any):
        self.settings = load_settings({"name": name, "zone": zone, "project": project,
                                       **settings})
        self._hosts: Hosts | None = None

    @classmethod
    def from_settings(cls, settings: Settings) -> Pod:
        """The pod ``settings.name`` names, with exactly these settings."""
        pod = cls.__new__(cls)
        pod.settings, pod._hosts = settings, None
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
        from tpufab.cloud.names import validate_name

        return validate_name(self.settings.name)

    def __repr__(self) -> str:
        return f"<Pod {self.settings.name} in {self.settings.zone}>"

    # -- connections ---------------------------------------------------------------------
    @property
    def hosts(self) -> Hosts:
        """The pod's connected hosts (nodes, fan-out, slices): connects on first use."""
        if self._hosts is None:
            from tpufab.hosts import connect

            self._hosts = connect.shared(self.settings)
        return self._hosts

    @property
    def workers(self) -> list[int]:
        return self.hosts.workers

    @property
    def fanout(self) -> Fanout:
        """The fan-out over the workers' SSH connections."""
        return self.hosts.fanout

    @property
    def nodes(self) -> list[Node]:
        return self.hosts.nodes

    @property
    def slices(self) -> list[list[int]]:
        """Global worker indexes per slice (one slice unless multislice)."""
        return self.hosts.slices

    def internal_ips(self) -> list[str]:
        return self.hosts.internal_ips()

    def connections(self, *, workers: str | Iterable[int] = "all",
                    config: FabricConfig | None = None) -> list[Connection]:
        """A ``fabric.Connection`` per worker, made as tpufab connects (docs/api.md)."""
        from tpufab.pod import fabric

        return fabric.connections(self, workers, config=config)

    def group(self, *, workers: str | Iterable[int] = "all") -> Group:
        """Fabric's Group API on tpufab's fan-out (docs/api.md; `pip install tpufab[fabric]`)."""
        from tpufab.pod import fabric

        return fabric.group(self, workers)

    def device_globs(self) -> tuple[str, ...]:
        return self.hosts.device_globs()

    def select(self, workers: str | Iterable[int] | None = "all") -> list[int]:
        """``"all"``, ``"0,3-5"``, ``"w[0-3]"`` or worker indexes -> the workers, checked."""
        return self.hosts.fanout.select(workers)

    def close(self) -> None:
        if self._hosts is not None:
            from tpufab.hosts import connect

            connect.forget(self.settings)
            self._hosts = None

    def __enter__(self) -> Pod:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _connected_within(self, timeout: float | None) -> Hosts:
        """The open pod as one call sees it when ``timeout`` bounds its connecting too: a
        view with connect_timeout at most ``timeout`` (this Pod's settings stay as they are)."""
        if timeout is None or timeout >= self.settings.connect_timeout:
            return self.hosts
        import copy

        from tpufab.hosts import connect

        settings = copy.copy(self.settings)
        settings.connect_timeout = timeout
        view = connect.shared(settings)  # connects (within ``timeout``) if nothing is open yet
        if self._hosts is None:
            self._hosts = connect.shared(self.settings)
        return view

    def _timeout(self, name: str, timeout: float | None, *, plus: float = 0.0) -> float:
        """``timeout`` through the one resolver (config.timeout_for): the one given, else the
        command_timeout setting, else TIMEOUTS[name] (or its "worker verb" row)."""
        return timeout_for(name if name in TIMEOUTS else GENERIC, timeout,
                           self.settings.command_timeout, plus=plus)

    def _forwarded(self, env: Mapping[str, str] | Sequence[str] | None,
                   secret: Sequence[str] | None) -> tuple[dict | None, dict | None]:
        """``env``/``secret`` as `exec --env`/`--secret` forward them: (public, secrets)."""
        from tpufab.quoting import Secret
        from tpufab.steps.runs.env import forwarded_for

        if isinstance(env, Mapping):
            specs = [f"{k}={v.reveal() if isinstance(v, Secret) else v}" for k, v in env.items()]
        else:
            specs = list(env or ())
        if not specs and not secret:
            return None, None
        forwarded = forwarded_for(self.settings, specs, secret)
        return dict(forwarded.public), {k: Secret(v) for k, v in forwarded.secrets.items()}

    # -- commands ------------------------------------------------------------------------

    def run(self, command: str | Sequence[str], *, workers: str | Iterable[int] = "all",
            env: Mapping[str, str] | Sequence[str] | None = None, warn: bool = False,
            timeout: float | None = None, sink: OutputSink | None = None,
            cwd: str | None = None, one_shot: bool = False,
            secret: Sequence[str] | None = None) -> PodResult:
        """Run ``command`` (a shell line, or an argv list) on the workers at once; returns
        ``{worker: result}`` (``.succeeded``, ``.failed``, ``.ok``). ``env``: ``{NAME: value}``
        or `exec --env` specs (``"K=V"``, ``"K"``: the local value), forwarded as `exec --env`
        does (the ``env`` setting too; secrets by name, or ``secret`` specs, on stdin and
        masked). ``timeout``: seconds the command may run on each worker (TIMEOUTS["exec"]).
        ``one_shot``: on fresh connections a plain exec channel, no agent. Raises PodError
        naming every failed worker (``.result`` holds every worker's) unless ``warn``."""
        public, secrets = self._forwarded(env, secret)
        result = self.hosts.fanout.run(
            command, workers=self.select(workers), env=public, secrets=secrets,
            timeout=self._timeout("exec", timeout), sink=sink, cwd=cwd, one_shot=one_shot)
        if not warn:
            result.check()
        return result

    def setup(self, script: str | Path = "scripts/setup.sh", *, force: bool = False,
              workers: str | Iterable[int] = "all", timeout: float | None = None,
              sink: OutputSink | None = None, env: Mapping[str, str] | Sequence[str] | None = None,
              secret: Sequence[str] | None = None, image: str | None = None) -> SetupReport:
        """The configured environment (``env_build``), then a setup script on every worker
        once per script content, seeing that environment: a SetupReport (``.by_worker``
        {worker: outcome}, each ``.status`` ran/skipped/incomplete, ``.log`` on the worker;
        ``.environment``). ``env``/``secret`` as for ``run`` (secrets also masked in the
        worker's log; neither counts as content). Raises PodError if any worker failed,
        naming the log and, where known, the failed command. ``image``: pulled after it."""
        from tpufab.steps.host.setup import SetupReport, run_setup

        path = self.setup_script(script)
        if (built := self._environment_first(workers, timeout)) and path is None:
            pulled = image and self.image_pull(image, workers=workers).check()
            # the environment is the whole setup
            return SetupReport(script="", rows=[], environment=built, image=pulled)
        public, secrets = self._forwarded(env, secret)
        result, outcomes = run_setup(self.hosts.fanout, path, workers=self.select(workers),
                                     force=force, sink=sink, name=f"Setup {path.name}",
                                     timeout=self._timeout("setup", timeout),
                                     env=self._with_venv(public), secrets=secrets)
        result.close()
        pulled = image and self.image_pull(image, workers=workers).check()
        return SetupReport(script=path.name, rows=list(outcomes.values()), environment=built,
                           image=pulled)

    def setup_script(self, script: str | Path) -> Path | None:
        """The setup script ``script`` names, checked here (before connecting); None: the
        default is missing and an environment is configured (then it is the whole setup)."""
        path = Path(script)
        if not path.is_file() and self._environment_only(script):
            return None
        if not path.is_file():
            raise ConfigError(f"Setup script {script} does not exist; pass --script PATH "
                              "(default scripts/setup.sh).")
        return path

    def ssh(self, workers: int | str = 0, command: Sequence[str] | None = None,
            forward: Sequence[str] | None = None, *, replace: bool = False) -> int:
        """The system ``ssh`` to one worker, with tpufab's key, its pinned host key and the
        jump host; ``command`` (an argv) or else an interactive shell; ``forward``: ``-L``
        port forwards (``PORT``, ``LOCAL:REMOTE``, ``LOCAL:HOST:REMOTE``, on 127.0.0.1).
        Returns ssh's exit status; ``replace``: become ssh (os.execv), as `tpufab ssh` does."""
        from tpufab.hosts import connect
        from tpufab.ssh.forward import parse_forward

        forwards = [parse_forward(spec) for spec in forward or ()]
        if isinstance(workers, int) or str(workers).isdigit():
            worker = int(workers)
        elif len(chosen := self.select(workers)) == 1:
            worker = chosen[0]
        else:
            raise ConfigError(f"ssh goes to one worker, not {len(chosen)}; pass one index, "
                              "e.g. --worker 0.")
        return connect.ssh_session(self.hosts, worker, command=command, forwards=forwards,
                                   replace=replace, before_exec=self.close)

    def deploy(self, ref: str = "HEAD", *, remote: str = "origin", dir: str | None = None,
               direct: bool = False, wip: bool = False, timeout: float | None = None,
               cwd: str | Path | None = None, progress: Progress | None = None,
               sink: OutputSink | None = None) -> DeployReport:
        """Put one commit of the git repository at ``cwd`` (default: here) on every worker
        (`tpufab deploy`); returns the per-worker report (DeployReport: commit, action,
        seconds). ``timeout``: seconds each step on the workers may take (TIMEOUTS["deploy"]).
        Raises DeployError naming every failed worker."""
        from tpufab.steps.code import deploy as deploying

        return deploying.deploy_checkout(self, cwd=cwd, ref=ref, remote=remote,
                                         dir=dir or self.settings.remote_dir, direct=direct,
                                         wip=wip, progress=progress, sink=sink,
                                         timeout=self._timeout("deploy", timeout))

    def mount_spec(self, bucket: str, *, at: str | None = None, driver: str | None = None,
                   options: Iterable[str] | None = None) -> MountSpec:
        """What ``mount`` would mount where (MountSpec: ``.url``, ``.at``, ``.driver``,
        ``.endpoint``), checked without connecting; raises ConfigError."""
        from tpufab.steps.host import mount as mounting

        return mounting.mount_spec(bucket, at=at, driver=driver or self.settings.mount_driver,
                                   options=mounting.driver_options(options),
                                   endpoint=self.settings.storage_endpoint)

    def mount(self, bucket: str, *, at: str | None = None, driver: str | None = None,
              options: Iterable[str] | None = None, install: bool = False,
              timeout: float | None = None, sink: OutputSink | None = None) -> MountReport:
        """Mount gs://BUCKET[/PREFIX] on every worker, verified (`tpufab mount`): ``at``
        (default /mnt/gcs/BUCKET), ``driver`` (default: the mount_driver setting),
        ``options`` extra driver flags, each a string split as a shell would
        (``["--dir-cache-time 10s"]``), ``install`` a missing driver. ``timeout``: seconds
        each step on the workers may take (TIMEOUTS["mount"]).
        Returns the per-worker MountReport; raises MountError naming every failed worker."""
        from tpufab.steps.host import mount as mounting

        spec = self.mount_spec(bucket, at=at, driver=driver, options=options)
        return mounting.apply_mount(self.hosts.fanout, spec, install=install, sink=sink,
                                    timeout=self._timeout("mount", timeout))

    def umount(self, at: str | None = None, *, lazy: bool = False,
               timeout: float | None = None) -> MountReport:
        """Unmount ``at`` (default: every mount tpufab made) on every worker (`tpufab
        umount`); ``lazy``: detach even if files are open there. ``timeout`` as for mount.
        Returns the per-worker MountReport; raises MountError (a bad ``at``: ConfigError,
        before connecting)."""
        from tpufab.steps.host import mount as mounting

        mounting.umount_args(at, lazy=lazy)
        return mounting.umount(self.hosts.fanout, at, lazy=lazy,
                               timeout=self._timeout("umount", timeout))

    # -- files, ports, profiles ------------------------------------------------------------
    def put(self, local: str | Path, remote: str | None = None, *,
            workers: str | Iterable[int] = "all", no_relay: bool = False,
            timeout: float | None = None, progress: BytesProgress | None = None,
            relay: bool | None = None) -> TransferReport:
        """Copy a local file or directory to the workers (`tpufab put`): verified, atomic,
        identical files skipped; one upload a worker relays to the others unless ``no_relay``
        (``relay=False``, the 0.1 spelling, says the same until 0.2). ``timeout``: seconds a
        worker may go without answering (TIMEOUTS["put"]). Returns the TransferReport; raises
        ConfigError for a missing local path (before connecting), TransferError naming every
        failed worker (``.report``)."""
        from tpufab.ssh import transfer

        if not Path(local).expanduser().exists():
            raise ConfigError(f"{local} does not exist here; check the local path (put copies a "
                              "file or directory from this machine).")
        if relay is not None:
            no_relay = not relay
        peers = None if no_relay else dict(enumerate(self.internal_ips()))
        return transfer.put(self.hosts.fanout, local, remote, workers=self.select(workers),
                            peers=peers, progress=progress,
                            timeout=self._timeout("put", timeout)).check()

    def get(self, remote: str, local: str | Path, *, workers: str | Iterable[int] = "all",
            timeout: float | None = None, progress: BytesProgress | None = None) -> TransferReport:
        """Copy a file or directory from the workers into ``local/w0/...`` (one worker:
        ``local``) (`tpufab get`). ``timeout`` as for put. Returns the per-worker
        TransferReport; raises ConfigError for an empty ``remote``, TransferError on
        failures."""
        from tpufab.ssh import transfer

        if not remote or not remote.strip():
            raise ConfigError("No remote path given: tpufab get REMOTE LOCAL.")
        return transfer.get(self.hosts.fanout, remote, local, workers=self.select(workers),
                            progress=progress, timeout=self._timeout("get", timeout)).check()

    def forward(self, *ports: str, workers: int = 0,
                on_event: Callable[[str], None] | None = None, worker: int | None = None,
                timeout: float | None = None) -> Forwarder:
        """Listen on 127.0.0.1 ports here and tunnel them to worker ``workers`` (one index;
        ``worker=``, the 0.1 spelling, until 0.2) over SSH (``"8080"``, ``"8080:6006"``)
        (`tpufab forward`); returns the started Forwarder (``.forwards``; ``close()`` it, or
        use it in a ``with``). ``timeout``: TIMEOUTS["forward"]. Raises ConfigError for a bad
        spec (before connecting) or worker."""
        from tpufab.ssh import forward as forwarding

        forwards = forwarding.parse_forwards(ports)
        connected = self._connected_within(self._timeout("forward", timeout))
        return forwarding.forward(connected.fanout, forwards,
                                  worker=int(workers if worker is None else worker),
                                  on_event=on_event)

    def profile(self, *, workers: str | Iterable[int] = "0", duration: str | float = "5s",
                run: str | None = None, port: int | None = None, to: str | None = None,
                max_size: str | None = None, seconds: float | None = None,
                progress: Callable[[str], None] | None = None) -> ProfileReport:
        """Capture ``duration`` (``"5s"``, ``"500ms"``, ``"1m"``; or ``seconds``) of profiler
        trace from the running JAX job (`tpufab profile`): ``.local_dir``, ``.files`` per
        worker; ``to`` (``gs://BUCKET/PREFIX``): the logdir copied there too (``.uploaded``);
        a host's trace above ``max_size`` (``"2GiB"`` when None) stays on it (its row says so).
        Raises ConfigError for a bad duration or destination (before connecting) or no run
        running."""
        from tpufab.steps.host import profiling

        if seconds is None:
            seconds = profiling.parse_duration(duration)
        destination = None if to is None else profiling.check_destination(to)
        report = profiling.capture(self.hosts.fanout, workers=self.select(workers), run=run,
                                   port=port, seconds=seconds, progress=progress,
                                   max_bytes=None if max_size is None
                                   else profiling.parse_size(max_size))
        if destination is not None:
            from tpufab.cloud.storage import Storage, StorageError

            try:
                where, count, size = profiling.upload(Storage.from_settings(self.settings),
                                                      *destination, report.local_dir)
            except StorageError as err:
                raise TpufabError(f"{err} The traces are here, under {report.local_dir}; copy "
                                  "them with `gcloud storage cp -r` or run profile --to "
                                  "again.") from None
            report.uploaded = where
            report.notes.append(f"Copied {count} file{'s' if count != 1 else ''} "
                                f"({size / 1024:.0f} KiB) to {where}: `xprof --logdir "
                                f"{where}`.")
        return report

    # -- jobs ----------------------------------------------------------------------------
    def start(self, recipe: str | Path, args: str | Sequence[str] = "",
              extra: Sequence[str] = (), *, env: Mapping[str, str] | Sequence[str] | None = None,
              secret: Sequence[str] | None = None, no_deploy: bool = False,
              direct: bool = False, wip: bool = False, local: bool = False,
              workers: int | None = None, spmd: bool = False, check: bool = False,
              wait_port: int | None = None, wait_timeout: float | None = None,
              timeout: float | None = None, progress: Progress | None = None,
              deploy: bool = True, image: str | None = None) -> Run | LocalRunResult:
        """`tpufab run` without following: the same checks, deploy, one-job-at-a-time
        refusal and start on every worker at once; returns the Run (follow it with
        ``.wait()``). See docs/api.md for each parameter; ``deploy=False`` is the 0.1
        spelling of ``no_deploy=True`` (until 0.2). With ``local``, runs the recipe as
        ``workers`` processes here and returns their LocalRunResult. ``image``: in it."""
        from tpufab.pod.run import Run
        from tpufab.steps.start import starting

        started = starting.start_run(
            self, self.settings, recipe, args=args, extra=extra, env=env, secret=secret,
            no_deploy=no_deploy or not deploy, direct=direct, wip=wip, local=local,
            workers=workers, spmd=spmd, check=check, wait_port=wait_port,
            wait_timeout=timeout_for("run --wait-port", wait_timeout),
            timeout=self._timeout("run", timeout), progress=progress, image=image)
        if local:
            return started      # the LocalRunResult
        return Run(self, started.plan.run_id, started.plan.workers, started=started)

    def kill(self, *, run: str | None = None, grace: float = 5.0, dry_run: bool = False,
             force: bool = False, workers: str | Iterable[int] = "all",
             timeout: float | None = None) -> KillReport:
        """Free the TPU on every worker: stop runs (only ``run``, if given) and stale
        holders, then remove the lockfile. ``timeout``: TIMEOUTS["kill"] (the grace period
        plus 34 s). Returns the KillReport (``.ok``, ``.rows``, ``.summary``); raises
        ConfigError for a negative grace or a malformed run id."""
        from tpufab.steps.host import killing

        killing.check_options(run=run, grace=grace)
        return killing.kill(self.hosts.fanout, self.select(workers), run=run, grace=grace,
                            dry_run=dry_run, force=force, device_globs=self.hosts.device_globs(),
                            timeout=self._timeout("kill", timeout, plus=grace))

    def logs(self, *, run: str | None = None, follow: bool = False,
             workers: str | Iterable[int] = "all", timeout: float | None = None,
             sink: OutputSink | Callable[[list[int]], OutputSink] | None = None,
             progress: Progress | None = None) -> LogsReport:
        """A run's logs (``run``, default: the latest) on the chosen workers that have it,
        masked with the secrets this machine would forward: a LogsReport (``.logs`` each
        worker's output so far; ``close()`` it; ``.states``; ``.check()`` raises RunError when
        a worker did not answer, or, followed, when the run failed or ``timeout`` passed).
        ``follow`` streams into ``sink`` (or ``sink(workers)``) until the run ends there.
        ``timeout``: TIMEOUTS["logs"], following TIMEOUTS["logs --follow"]. Raises
        ConfigError for a malformed run id, RunError when there is no such run."""
        from tpufab.steps.runs import history
        from tpufab.steps.runs.env import forwarded_for

        try:
            secrets = list(forwarded_for(self.settings, None).secrets.values())
        except ConfigError:
            secrets = []
        return history.run_logs(self.hosts.fanout, self.select(workers), run,
                                timeout=self._timeout("logs", timeout),
                                follow=follow, sink=sink, secrets=secrets, progress=progress,
                                follow_timeout=timeout_for("logs --follow", timeout))

    def runs(self, *, workers: str | Iterable[int] = "all",
             timeout: float | None = None) -> RunsReport:
        """The runs the workers know: a RunsReport (``.rows`` newest first, each with every
        worker's state; ``.unreachable``; ``.to_json()``; ``.check()`` raises RunError naming
        the workers that did not answer). ``timeout``: seconds for every worker to answer
        (default: the command_timeout setting, else 60)."""
        from tpufab.steps.runs import history

        return history.list_runs(self.hosts.fanout, self.select(workers),
                                 timeout=self._timeout("runs", timeout))

    def stragglers(self, *, run: str | None = None, step_pattern: str | None = None,
                   workers: str | Iterable[int] = "all",
                   timeout: float | None = None) -> StragglersReport:
        """`tpufab stragglers`: the step table of ``run`` (default: the latest), slowest
        first, from every worker's log (``logs``; steps/runs/steptable.py)."""
        from tpufab.steps.runs import steptable

        return steptable.of_logs(steptable.checked(step_pattern), lambda: self.logs(
            run=run, workers=workers, timeout=self._timeout("stragglers", timeout)))

    # -- health: status, check, babysit, autostop --------------------------------------------
    def status(self, *, timeout: float | None = None) -> StatusReport:
        """`tpufab status`: the node's API state and every worker's facts, and worker 0's
        autostop view when one is armed: a StatusReport (``.rows`` every worker's facts,
        ``.folded`` the table's rows, ``.healthy``, ``.autostop``). ``timeout``:
        TIMEOUTS["status"]. Raises ApiError when there is no such node."""
        from tpufab.steps.health import status

        return status.pod_status(self.settings, timeout=self._timeout("status", timeout),
                                 pod=self._hosts)

    def autostop(self, *, idle: str | float | None = None, ttl: str | float | None = None,
                 cancel: bool = False, timeout: float | None = None) -> AutostopReport:
        """`tpufab autostop`: arm the watchdog on the workers that deletes this pod after
        ``idle`` with no run and no TPU holder (or at ``ttl``): seconds or a duration such as
        ``"30m"``; ``cancel`` removes it. ``timeout``: seconds every worker has to answer
        (TIMEOUTS["autostop"]). Returns an AutostopReport (a Report: ``.armed``, the policy
        armed, or with cancel what was armed, None if nothing; ``.summary`` says it in
        words). Raises ConfigError (one sentence) before touching a worker when neither or
        both of (idle/ttl, cancel) are given, AutostopError naming the workers that failed."""
        from tpufab.steps.host import autostop

        return autostop.configure(self, self.settings, idle=idle, ttl=ttl, cancel=cancel,
                                  timeout=self._timeout("autostop", timeout))

    def babysit(self, recipe: str | Path, *, max_restarts: int = 3,
                args: str | Sequence[str] = "", restart_on_failure: bool = False,
                max_restarts_on_errors: int = 0, restart_on_exit: str | Sequence[int] = "",
                before_maintenance: str | None = None, maintenance_margin: str | float = "10m",
                env: Sequence[str] | None = None, setup_script: str | Path | None = None,
                no_deploy: bool = False, direct: bool = False, poll: float | None = None,
                timeout: float | None = None, stall: str | float | None = None,
                stall_action: str = "wait",
                stall_progress_file: str | None = None, ray: bool = False,
                ray_options: str | Sequence[str] = "", remote: bool = False,
                console: Any = None, view: Any = None, out: Any = None,
                step_pattern: str | None = None) -> BabysitResult:
        """`tpufab babysit`: run ``recipe`` and keep it running through preemptions
        (recreate the node, set it up, restore the commit and mounts, restart); ``ray``: as a
        Ray job on the pod's Ray cluster, brought up before each attempt. Each parameter is
        the flag of `tpufab babysit --help` of that name (docs/api.md); ``timeout``: seconds
        each step on the workers may take (TIMEOUTS["babysit"]), never the follow. What is
        shown goes to the sinks given, nowhere else: ``console`` (babysit's notes),
        ``view(workers)`` (each attempt's live view, e.g. views.runlogs.follow_view),
        ``out(line)`` (a Ray job's lines). Returns the BabysitResult (``.exit_code``,
        ``.attempts``, ``.restart_counts``) when the recipe finished on every worker; raises
        BabysitError saying why otherwise (ConfigError, one sentence, for a bad budget).
        ``remote``: hand it to the supervisor instead (docs/supervisor.md): a HandedOver."""
        from tpufab.flows.babysit import loop as babysitting
        from tpufab.steps.start.starting import recipe_args

        args = recipe_args(args)    # (--ray-options without --ray: the flow's one sentence)
        if remote:   # the options as given, from the signature (state.BABYSIT_OPTIONS)
            from tpufab.flows.supervisor.handover import hand_over_call
            return hand_over_call(self.settings, recipe, args, env, console, locals())
        timeout = self._timeout("babysit", timeout)
        settings = self.settings.bounded(timeout)   # this call's timeouts, not the pod's
        options = {} if poll is None else {"poll": poll}
        return babysitting.babysit(settings, recipe, args=list(args),
                                   max_restarts=max_restarts,
                                   restart_on_failure=restart_on_failure,
                                   max_restarts_on_errors=max_restarts_on_errors,
                                   restart_on_exit=restart_on_exit,
                                   before_maintenance=before_maintenance,
                                   maintenance_margin=maintenance_margin, env=list(env or ()),
                                   setup_script=setup_script, no_deploy=no_deploy,
                                   direct=direct, timeout=timeout, stall=stall,
                                   stall_action=stall_action,
                                   stall_progress_file=stall_progress_file, ray=ray,
                                   ray_options=list(recipe_args(ray_options)),
                                   console=console, view=view, out=out,
                                   step_pattern=step_pattern, **options)

    def check(self, *, quick: bool = False, timeout: float | None = None,
              progress: Callable[[str], None] | None = None) -> CheckReport:
        """`tpufab check`: every worker compared, then (unless ``quick``) a collective across
        every host (``timeout``: TIMEOUTS["check"]); a CheckReport (``.rows`` one per check,
        ``.ok``, ``.problems``, ``.summary``). ``progress(message)`` hears the steps. Raises
        ConfigError for a timeout that is not above 0."""
        from tpufab.steps.health import check
        from tpufab.steps.start.collective import run_collective

        timeout = self._timeout("check", timeout)
        check.refuse_timeout(timeout)  # before connecting
        # the timeout bounds connecting too: a frozen worker is named
        connected = self._connected_within(timeout)
        return check.run_check(connected.settings, connected, quick=quick, timeout=timeout,
                               progress=progress, collective=run_collective)

    def image_pull(self, image: str, *, if_missing: bool = False, workers: str | Iterable[int]
                   = "all", timeout: float | None = None) -> ImageReport:
        """`tpufab image pull` (docs/images.md): every host's digest, an ImageReport."""
        from tpufab.steps.host.images import pull, registry_login
        login = registry_login(self.settings.registry_login)
        return pull(self.hosts.fanout, self.select(workers), image, if_missing=if_missing,
                    timeout=self._timeout("image pull", timeout), login=login)

    def stacks(self, *, run: str | None = None, native: bool = False,
               workers: str | Iterable[int] = "all", timeout: float | None = None,
               save: bool = True, progress: Progress | None = None) -> StacksReport:
        """`tpufab stacks`: py-spy on every chosen worker at once, against ``run``'s Python
        processes (default: the latest run, while it runs; else every Python process holding
        the TPU); ``native`` adds C/C++ frames. A StacksReport (a row per worker, ``.odd``;
        ``.check()``: StacksError in one sentence: no such run, nothing to dump, no py-spy);
        with ``save`` beside the run's local logs (``.saved``: ./.tpufab/runs/ID/stacks-TIME
        .txt and .json). ``timeout``: TIMEOUTS["stacks"]. ConfigError: a malformed run id."""
        from tpufab.steps.health import stacks

        stacks.check_run(run)
        report = stacks.capture(self.hosts.fanout, self.select(workers), run=run,
                                native=native, device_globs=self.hosts.device_globs(),
                                timeout=self._timeout("stacks", timeout),
                                progress=progress)
        if save:
            stacks.save_beside_logs(report, keep_runs=self.settings.keep_runs,
                                    keep_gib=self.settings.keep_logs_gib)
        return report

    def top(self, *, once: bool = False, every: float = 3.0, interval: float = 1.0,
            workers: str | Iterable[int] = "all", timeout: float | None = None,
            on_frame: Callable[[TopReport], None] | None = None) -> TopReport:
        """`tpufab top`: every worker's CPU, memory, load, run processes and TPU use, sampled
        over ``interval`` seconds in one fan-out a frame, folded where workers agree (a
        TopReport). ``once``: one frame, returned; otherwise a frame every ``every`` seconds
        goes to ``on_frame(frame)`` until Ctrl-C (KeyboardInterrupt, left to the caller) and
        the last is returned. ``timeout``: TIMEOUTS["top"]. ConfigError (one sentence) for an
        interval outside (0, 30] or ``every`` below 1 s, before connecting."""
        from tpufab.steps.health import top

        top.check_every(every, interval)
        timeout = self._timeout("top", timeout)
        chosen = self.select(workers)
        if once or on_frame is None:
            return top.frame(self.hosts, workers=chosen, interval=interval,
                             timeout=timeout)
        return top.watch(self.hosts, on_frame=on_frame, every=every, interval=interval,
                         workers=chosen, timeout=timeout)

    # -- kept connections, Ray -------------------------------------------------------------
    def disconnect(self) -> int:
        """`tpufab disconnect`: close the pod's connections here and stop the keeper holding
        them between commands (tpufab.ssh.keeper); how many keepers were stopped."""
        from tpufab.hosts import connect

        self.close()
        return connect.disconnect(self.settings)
