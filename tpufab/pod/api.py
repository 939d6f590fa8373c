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
from tpufab.errors import ConfigError

if TYPE_CHECKING:
    from tpufab.hosts.connect import Hosts
    from tpufab.ssh.fanout import FanoutError as PodError
    from tpufab.ssh.fanout import GroupResult as PodResult
    from tpufab.ssh.fanout import OutputSink

__all__ = ["Pod", "PodError", "PodResult", "Run", "create", "delete", "gc", "launch"]


def __getattr__(name: str) -> Any:
    """``PodResult`` and ``PodError`` load with the fan-out, on first use (``tpufab --help``
    stays instant); they ARE the fan-out's GroupResult and FanoutError: one result type, one
    exception carrying every worker's result (Fabric's GroupResult and GroupException)."""
    if name == "PodResult":
        from tpufab.ssh.fanout import GroupResult

        return GroupResult
    if name == "PodError":
        from tpufab.ssh.fanout import FanoutError

        return FanoutError
    # the views a caller hands to run/setup as ``sink=`` (the verbs' live and gathered views)
    if name in ("LiveView", "Tee", "print_gathered"):
        from tpufab.ssh import fanout

        return getattr(fanout, name)
    if name == "TransferError":  # a failed put/get: ``.report`` has every worker's row
        from tpufab.ssh.transfer import TransferError

        return TransferError
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _settings(name: str | None, zone: str | None, project: str | None,
              overrides: Mapping[str, Any]) -> Settings:
    return load_settings({"name": name, "zone": zone, "project": project, **overrides})


class Pod:
    """The workers of one TPU node (or multislice queued resource), reached over SSH.

    ``Pod(name)`` names it; ``Pod()`` takes the name from TPUFAB_NAME, tpufab.yaml or this
    project's current pod, like the command line does. Connections open on first use and
    stay open (``close()``, or use ``with Pod(...) as pod``).
    """

    def __init__(self, name: str | None = None, *, zone: str | None = None,
                 project: str | None = None, **settings: Any):
        self.settings = _settings(name, zone, project, settings)
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
        from tpufab.cloud.lifecycle import validate_name

        return validate_name(self.settings.name)

    def __repr__(self) -> str:
        return f"<Pod {self.settings.name} in {self.settings.zone}>"

    # -- connections ---------------------------------------------------------------------
    @property
    def hosts(self) -> Hosts:
        """The pod's connected hosts (nodes, fan-out, slices): connects on first use."""
        if self._hosts is None:
            from tpufab.hosts import connect as pod

            self._hosts = pod.shared(self.settings)
        return self._hosts

    @property
    def workers(self) -> list[int]:
        return self.hosts.workers

    @property
    def fanout(self) -> Any:
        """The fan-out over the workers' SSH connections (tpufab.ssh.fanout.Fanout)."""
        return self.hosts.fanout

    @property
    def nodes(self) -> list:
        return self.hosts.nodes

    @property
    def slices(self) -> list[list[int]]:
        """Global worker indexes per slice (one slice unless multislice)."""
        return self.hosts.slices

    def internal_ips(self) -> list[str]:
        return self.hosts.internal_ips()

    def device_globs(self) -> tuple[str, ...]:
        return self.hosts.device_globs()

    def select(self, workers: str | Iterable[int] | None = "all") -> list[int]:
        """``"all"``, ``"0,3-5"``, ``"w[0-3]"`` or worker indexes -> the workers, checked."""
        return self.hosts.fanout.select(workers)

    def close(self) -> None:
        if self._hosts is not None:
            from tpufab.hosts import connect as pod

            pod.forget(self.settings)
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

        from tpufab.hosts import connect as pod

        settings = copy.copy(self.settings)
        settings.connect_timeout = timeout
        view = pod.shared(settings)  # connects (within ``timeout``) if nothing is open yet
        if self._hosts is None:
            self._hosts = pod.shared(self.settings)
        return view

    # -- commands ------------------------------------------------------------------------
    def _command_timeout(self, timeout: float | None) -> float:
        """A method's ``timeout`` (None: the command_timeout setting), as the fan-out takes it
        explicitly (``math.inf``: no limit)."""
        if timeout is None:
            timeout = self.settings.command_timeout
        return float("inf") if timeout is None else timeout

    def run(self, command: str | Sequence[str], *, workers: str | Iterable[int] = "all",
            env: Mapping[str, str] | Sequence[str] | None = None, warn: bool = False,
            timeout: float | None = None, sink: OutputSink | None = None,
            cwd: str | None = None, one_shot: bool = False,
            secret: Sequence[str] | None = None) -> PodResult:
        """Run ``command`` (a shell line, or an argv list) on the workers at once; returns
        ``{worker: result}`` (``.succeeded``, ``.failed``, ``.ok``).

        ``env``: ``{NAME: value}``, or `tpufab exec --env` specs (``"K=V"``, or ``"K"`` for
        the local value of K); forwarded as `exec --env` does (tpufab.steps.runs.env.forwarded_for:
        the ``env`` setting too, and values whose names are secrets (the ``secrets`` setting,
        or names like ``*TOKEN*``) travel on stdin and are masked). ``timeout``: seconds the
        command may run on each worker (default: the command_timeout setting). ``one_shot``:
        on fresh connections a plain exec channel, no agent (what `tpufab exec` does).
        ``secret``: more ``K=V``/``K`` specs that are secrets whatever their names (`--secret`).
        Raises PodError naming every failed worker (``.result`` holds every worker's) unless
        ``warn``.
        """
        from tpufab.quoting import Secret
        from tpufab.steps.runs.env import forwarded_for

        if isinstance(env, Mapping):
            specs = [f"{k}={v.reveal() if isinstance(v, Secret) else v}" for k, v in env.items()]
        else:
            specs = list(env or ())
        forwarded = forwarded_for(self.settings, specs, secret) if specs or secret else None
        result = self.hosts.fanout.run(
            command, workers=self.select(workers),
            env=dict(forwarded.public) if forwarded else None,
            secrets={k: Secret(v) for k, v in forwarded.secrets.items()} if forwarded else None,
            timeout=self._command_timeout(timeout), sink=sink, cwd=cwd, one_shot=one_shot)
        if not warn:
            result.check()
        return result

    def setup(self, script: str | Path = "scripts/setup.sh", *, force: bool = False,
              workers: str | Iterable[int] = "all", timeout: float | None = None,
              sink: OutputSink | None = None,
              env: Mapping[str, str] | Sequence[str] | None = None,
              secret: Sequence[str] | None = None) -> Any:
        """Run a setup script on every worker once per script content: a SetupReport (a
        ``tpufab.reports.Report``: ``.by_worker`` {worker: outcome}, each with ``.status``
        ran/skipped/incomplete and ``.log`` on the worker). ``env`` and ``secret``
        as for ``run``: secrets (by name, or ``secret``) only on stdin and masked in the output
        and the worker's log; neither counts as content. Raises PodError if any worker
        failed, naming the log and, where known, the failed command."""
        from tpufab.quoting import Secret
        from tpufab.steps.host.setup import SetupReport, run_setup
        from tpufab.steps.runs.env import forwarded_for

        path = self.setup_script(script)
        if isinstance(env, Mapping):
            specs = [f"{k}={v.reveal() if isinstance(v, Secret) else v}" for k, v in env.items()]
        else:
            specs = list(env or ())
        forwarded = forwarded_for(self.settings, specs, secret) if specs or secret else None
        result, outcomes = run_setup(self.hosts.fanout, path, workers=self.select(workers),
                                     force=force, sink=sink, name=f"Setup {path.name}",
                                     timeout=self._command_timeout(timeout),
                                     env=dict(forwarded.public) if forwarded else None,
                                     secrets={k: Secret(v) for k, v in
                                              forwarded.secrets.items()} if forwarded else None)
        result.close()
        return SetupReport(script=path.name, rows=list(outcomes.values()))

    @staticmethod
    def setup_script(script: str | Path) -> Path:
        """The setup script ``script`` names, checked here (before connecting)."""
        path = Path(script)
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
        import os
        import subprocess
        import sys

        from tpufab.hosts import connect as connection
        from tpufab.ssh.forward import parse_forward

        forwards = [parse_forward(spec) for spec in forward or ()]
        connected = self.hosts
        if isinstance(workers, int) or str(workers).isdigit():
            worker = int(workers)
        else:
            chosen = self.select(workers)
            if len(chosen) != 1:
                raise ConfigError(f"ssh goes to one worker, not {len(chosen)}; pass one index, "
                                  "e.g. --worker 0.")
            worker = chosen[0]
        binary, argv = connection.system_ssh(connected, worker, command=command,
                                             forwards=forwards, tty=sys.stdin.isatty())
        sys.stdout.flush()
        if replace:
            self.close()
            os.execv(binary, argv)
        return subprocess.call(argv, executable=binary)

    def deploy(self, ref: str = "HEAD", *, remote: str = "origin", dir: str | None = None,
               direct: bool = False, wip: bool = False, timeout: float | None = 600.0,
               cwd: str | Path | None = None, progress: Any = None,
               sink: OutputSink | None = None) -> Any:
        """Put one commit of the git repository at ``cwd`` (default: here) on every worker
        (`tpufab deploy`); returns the per-worker report (DeployReport: commit, action,
        seconds). ``timeout``: seconds each step on the workers may take (default 600; None:
        the command_timeout setting). Raises DeployError naming every failed worker."""
        from tpufab.steps.code import deploy as deploying

        return deploying.deploy_checkout(self, cwd=cwd, ref=ref, remote=remote,
                                         dir=dir or self.settings.remote_dir, direct=direct,
                                         wip=wip, progress=progress, sink=sink,
                                         timeout=self._command_timeout(timeout))

    def mount_spec(self, bucket: str, *, at: str | None = None, driver: str | None = None,
                   options: Iterable[str] | None = None) -> Any:
        """What ``mount`` would mount where (MountSpec: ``.url``, ``.at``, ``.driver``,
        ``.endpoint``), checked without connecting; raises ConfigError."""
        from tpufab.steps.host import mount as mounting

        return mounting.mount_spec(bucket, at=at, driver=driver or self.settings.mount_driver,
                                   options=mounting.driver_options(options),
                                   endpoint=self.settings.storage_endpoint)

    def mount(self, bucket: str, *, at: str | None = None, driver: str | None = None,
              options: Iterable[str] | None = None, install: bool = False,
              timeout: float | None = 300.0, sink: OutputSink | None = None) -> Any:
        """Mount gs://BUCKET[/PREFIX] on every worker, verified (`tpufab mount`): ``at``
        (default /mnt/gcs/BUCKET), ``driver`` (default: the mount_driver setting),
        ``options`` extra driver flags, each a string split as a shell would
        (``["--dir-cache-time 10s"]``), ``install`` a missing driver. ``timeout``: seconds
        each step on the workers may take (default 300; None: the command_timeout setting).
        Returns the per-worker MountReport; raises MountError naming every failed worker."""
        from tpufab.steps.host import mount as mounting

        spec = self.mount_spec(bucket, at=at, driver=driver, options=options)
        return mounting.apply_mount(self.hosts.fanout, spec, install=install, sink=sink,
                                    timeout=self._command_timeout(timeout))

    def umount(self, at: str | None = None, *, lazy: bool = False,
               timeout: float | None = 300.0) -> Any:
        """Unmount ``at`` (default: every mount tpufab made) on every worker (`tpufab
        umount`); ``lazy``: detach even if files are open there. ``timeout`` as for mount.
        Returns the per-worker MountReport; raises MountError (a bad ``at``: ConfigError,
        before connecting)."""
        from tpufab.steps.host import mount as mounting

        mounting.umount_args(at, lazy=lazy)
        return mounting.umount(self.hosts.fanout, at, lazy=lazy,
                               timeout=self._command_timeout(timeout))

    # -- files, ports, profiles ------------------------------------------------------------
    def put(self, local: str | Path, remote: str | None = None, *,
            workers: str | Iterable[int] = "all", no_relay: bool = False,
            timeout: float | None = 300.0, progress: Any = None,
            relay: bool | None = None) -> Any:
        """Copy a local file or directory to the workers (`tpufab put`): verified, atomic,
        identical files skipped; one upload that a worker relays to the others unless
        ``no_relay`` (``relay=False`` says the same). ``timeout``: seconds a worker may go
        without answering (default 300; None: the command_timeout setting). Returns the
        per-worker TransferReport (a Report: ``.rows``, ``.ok``); raises ConfigError for a
        missing local path (before connecting), TransferError naming every failed worker
        (``.report``)."""
        from tpufab.ssh import transfer

        if not Path(local).expanduser().exists():
            raise ConfigError(f"{local} does not exist here; check the local path (put copies a "
                              "file or directory from this machine).")
        if relay is not None:
            no_relay = not relay
        peers = None if no_relay else dict(enumerate(self.internal_ips()))
        return transfer.put(self.hosts.fanout, local, remote, workers=self.select(workers),
                            peers=peers, progress=progress,
                            timeout=self._command_timeout(timeout)).check()

    def get(self, remote: str, local: str | Path, *, workers: str | Iterable[int] = "all",
            timeout: float | None = 300.0, progress: Any = None) -> Any:
        """Copy a file or directory from the workers into ``local/w0/...`` (one worker:
        ``local``) (`tpufab get`). ``timeout`` as for put. Returns the per-worker
        TransferReport; raises ConfigError for an empty ``remote``, TransferError on
        failures."""
        from tpufab.ssh import transfer

        if not remote or not remote.strip():
            raise ConfigError("No remote path given: tpufab get REMOTE LOCAL.")
        return transfer.get(self.hosts.fanout, remote, local, workers=self.select(workers),
                            progress=progress, timeout=self._command_timeout(timeout)).check()

    def forward(self, *ports: str, workers: int = 0, on_event: Any = None,
                worker: int | None = None, timeout: float | None = 20.0) -> Any:
        """Listen on 127.0.0.1 ports here and tunnel them to worker ``workers`` (one index;
        ``worker=`` says the same) over SSH (``"8080"``, ``"8080:6006"``) (`tpufab forward`);
        returns the started Forwarder (``.forwards``; ``close()`` it, or use it in a
        ``with``). ``timeout``: seconds to wait for the worker when connecting (a worker
        that does not answer is named in one sentence). Raises ConfigError for a bad spec
        (before connecting) or worker."""
        from tpufab.ssh import forward as forwarding

        forwards = forwarding.parse_forwards(ports)
        return forwarding.forward(self._connected_within(timeout).fanout, forwards,
                                  worker=int(workers if worker is None else worker),
                                  on_event=on_event)

    def profile(self, *, workers: str | Iterable[int] = "0", duration: str | float = "5s",
                run: str | None = None, port: int | None = None,
                seconds: float | None = None, progress: Any = None) -> Any:
        """Capture ``duration`` (``"5s"``, ``"500ms"``, ``"1m"``; or ``seconds``) of profiler
        trace from the running JAX job (`tpufab profile`); returns where it was copied
        (``.local_dir``) and the files per worker (``.files``). Raises ConfigError for a
        bad duration (before connecting) or when no run is running."""
        from tpufab.steps.host import profiling

        if seconds is None:
            seconds = profiling.parse_duration(duration)
        return profiling.capture(self.hosts.fanout, workers=self.select(workers), run=run,
                                 port=port, seconds=seconds, progress=progress)

    # -- jobs ----------------------------------------------------------------------------
    def start(self, recipe: str | Path, args: str | Sequence[str] = "",
              extra: Sequence[str] = (), *,
              env: Mapping[str, str] | Sequence[str] | None = None,
              secret: Sequence[str] | None = None, no_deploy: bool = False,
              direct: bool = False, wip: bool = False, local: bool = False,
              workers: int | None = None, spmd: bool = False, check: bool = False,
              wait_port: int | None = None, wait_timeout: float = 600.0,
              timeout: float | None = None, progress: Any = None,
              deploy: bool = True) -> Any:
        """`tpufab run` without following: the same checks, deploy, one-job-at-a-time
        refusal and start on every worker at once; returns the Run (follow it with
        ``.wait()``). See docs/api.md for each parameter; ``deploy=False`` is the older
        spelling of ``no_deploy=True``. With ``local``, runs the recipe as ``workers``
        processes here and returns their LocalRunResult."""
        from tpufab.steps.start import starting

        started = starting.start_run(
            self, self.settings, recipe, args=args, extra=extra, env=env, secret=secret,
            no_deploy=no_deploy or not deploy, direct=direct, wip=wip, local=local,
            workers=workers, spmd=spmd, check=check, wait_port=wait_port,
            wait_timeout=wait_timeout, timeout=self._timeout(timeout, starting.RUN_TIMEOUT),
            progress=progress)
        if local:
            return started      # the LocalRunResult
        return Run(self, started.plan.run_id, started.plan.workers, started=started)

    def kill(self, *, run: str | None = None, grace: float = 5.0, dry_run: bool = False,
             force: bool = False, workers: str | Iterable[int] = "all",
             timeout: float | None = None) -> Any:
        """Free the TPU on every worker: stop runs (only ``run``, if given) and stale
        holders, then remove the lockfile. ``timeout``: seconds the kill may take on each
        worker (default: the command_timeout setting, else the grace period plus 34 s).
        Returns the kill result (a Report: ``.ok``, ``.rows``, ``.summary``, ``.workers``);
        raises ConfigError for a negative grace or a malformed run id."""
        from tpufab.steps.host import killing

        killing.check_options(run=run, grace=grace)
        return killing.kill(self.hosts.fanout, self.select(workers), run=run, grace=grace,
                            dry_run=dry_run, force=force,
                            device_globs=self.hosts.device_globs(),
                            timeout=self._timeout(timeout, None))

    def logs(self, *, run: str | None = None, follow: bool = False,
             workers: str | Iterable[int] = "all", timeout: float | None = None,
             sink: Any = None, progress: Any = None) -> Any:
        """A run's logs (``run``, default: the latest) on the chosen workers that have it,
        masked with the secrets this machine would forward: a LogsReport (``.logs``: each
        worker's output so far, ``.chunks()``; ``close()`` it; ``.states``; ``.check()``
        raises RunError when a worker did not answer, or, followed, when the run failed or
        ``timeout`` passed). With ``follow``, streams into ``sink`` (a sink, or a function of
        the followed workers returning one) until the run ends there. ``timeout``: seconds
        for the workers (default: the command_timeout setting, else 300; following has no
        limit unless given). ``progress(text, style)`` hears which run it is. Raises
        ConfigError for a malformed run id, RunError when there is no such run."""
        from tpufab.steps.runs import history
        from tpufab.steps.runs.env import forwarded_for

        try:
            secrets = list(forwarded_for(self.settings, None).secrets.values())
        except ConfigError:
            secrets = []
        return history.run_logs(self.hosts.fanout, self.select(workers), run,
                                timeout=self._timeout(timeout, history.LOGS_TIMEOUT),
                                follow=follow, sink=sink, secrets=secrets, progress=progress,
                                follow_timeout=float("inf") if timeout is None else timeout)

    def runs(self, *, workers: str | Iterable[int] = "all",
             timeout: float | None = None) -> Any:
        """The runs the workers know: a RunsReport (``.rows`` newest first, each with every
        worker's state; ``.unreachable``; ``.to_json()``; ``.check()`` raises RunError naming
        the workers that did not answer). ``timeout``: seconds for every worker to answer
        (default: the command_timeout setting, else 60)."""
        from tpufab.steps.runs import history

        return history.list_runs(self.hosts.fanout, self.select(workers),
                                 timeout=self._timeout(timeout, history.LIST_TIMEOUT))

    def _timeout(self, timeout: float | None, default: float | None) -> float | None:
        """A jobs method's timeout: the one given, else the command_timeout setting, else
        the verb's default."""
        if timeout is not None:
            return timeout
        return self.settings.command_timeout if self.settings.command_timeout is not None \
            else default

    # -- health: status, check, babysit, autostop --------------------------------------------
    def status(self, *, timeout: float | None = 60.0) -> Any:
        """`tpufab status`: the node's API state and every worker's facts, and worker 0's
        autostop view when one is armed. Returns a PodStatus (a Report: ``.rows`` every
        worker's facts, ``.folded`` the table's rows, ``.healthy``, ``.autostop``; shown by
        tpufab.views.report.show). ``timeout``: seconds each
        worker has to answer (default 60, as the verb; None: the ``command_timeout``
        setting). Raises ApiError when there is no such node."""
        from tpufab.steps.health import status

        if timeout is None:
            timeout = self.settings.command_timeout
        return status.pod_status(self.settings, timeout=timeout, pod=self._hosts)

    def autostop(self, *, idle: float | str | None = None, ttl: float | str | None = None,
                 cancel: bool = False, timeout: float | None = 60.0) -> Any:
        """`tpufab autostop`: arm the watchdog on the workers that deletes this pod after
        ``idle`` with no run and no TPU holder (or at ``ttl``): seconds or a duration such as
        ``"30m"``; ``cancel`` removes it. ``timeout``: seconds every worker has to answer
        (None: the ``command_timeout`` setting). Returns an AutostopReport (a Report:
        ``.armed``, the policy armed, or with cancel what was armed, None if nothing;
        ``.summary`` says it in words). Raises ConfigError (one sentence) before touching a worker when neither
        or both of (idle/ttl, cancel) are given, AutostopError naming the workers that
        failed."""
        from tpufab.steps.host import autostop

        if timeout is None:
            timeout = self.settings.command_timeout
        return autostop.configure(self, self.settings, idle=idle, ttl=ttl, cancel=cancel,
                                  timeout=timeout)

    def babysit(self, recipe: str | Path, *, max_restarts: int = 3,
                args: str | Sequence[str] = "", restart_on_failure: bool = False,
                max_restarts_on_errors: int = 0, restart_on_exit: str | Sequence[int] = "",
                before_maintenance: str | None = None, maintenance_margin: str | float = "10m",
                env: Sequence[str] | None = None, setup_script: str | Path | None = None,
                no_deploy: bool = False, direct: bool = False, poll: float | None = None,
                timeout: float | None = 600.0, stall: str | float | None = None,
                stall_action: str = "wait",
                stall_progress_file: str | None = None, ray: bool = False,
                ray_options: str | Sequence[str] = "", console: Any = None,
                view: Any = None, out: Any = None) -> Any:
        """`tpufab babysit`: run ``recipe`` and keep it running through preemptions
        (recreate the node, set it up, restore the commit and mounts, restart).
        ``ray``: run it as a Ray job (`tpufab ray submit`'s path) on the pod's Ray cluster,
        brought up before each attempt (`tpufab ray up`, with ``ray_options`` for every `ray
        start`: a list or one string split like a shell would), so a recreated node gets a
        new cluster before the job is submitted again.

        ``args``: the recipe's arguments, a list or one string split like a shell would;
        ``env``: ``K=V`` or ``K`` (forward the local value); ``timeout``: seconds each step on
        the workers may take (None: the ``command_timeout`` setting); following the logs has
        no limit. ``max_restarts_on_errors``: restarts allowed when the recipe exits non-zero
        by itself (default 0; preemption, maintenance and host failure never use them);
        ``restart_on_exit``: exit codes ("42,143" or a list) always restarted without using
        that budget. ``before_maintenance``: a signal ("USR1") sent to the recipe
        ``maintenance_margin`` (a duration) before a node's announced maintenance window; the
        attempt that ends after it is restarted as for maintenance. ``stall`` (a duration, at
        least 10 s): the stall watchdog on every attempt (as `run --stall`; the stacks go
        into the attempt's logs), then ``stall_action``: wait (default), kill (babysit ends,
        exit 124) or restart (the next attempt, counted as "stalled"; not the error budget's);
        ``stall_progress_file``: progress is that file's mtime advancing instead of output
        lines (relative to $TPUFAB_RUN_DIR, or absolute). What is shown goes to the sinks
        given, nowhere else: ``console`` (a rich Console) hears babysit's notes, ``view(workers)``
        returns the live view each attempt's lines are fed to (a sink with ``lines``/``done``,
        e.g. ``tpufab.views.runlogs.follow_view``), ``out(line)`` hears a Ray job's lines;
        the logs are copied under ./.tpufab/runs/ either way. Returns the BabysitResult (``.exit_code``, ``.attempts``,
        ``.restart_counts``) when the recipe finished on every worker; raises BabysitError
        saying why otherwise (ConfigError, one sentence, for a bad budget or code)."""
        import copy

        from tpufab.flows.babysit import loop as babysitting
        from tpufab.steps.start.starting import recipe_args

        args = recipe_args(args)
        settings = copy.copy(self.settings)  # this call's timeouts, not the pod's
        if timeout is not None:
            settings.command_timeout = timeout
            settings.connect_timeout = min(settings.connect_timeout, timeout)
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
                                   console=console, view=view, out=out, **options)

    def check(self, *, quick: bool = False, timeout: float = 120.0,
              progress: Any = None) -> Any:
        """`tpufab check`: every worker compared, then (unless ``quick``) a collective across
        every host (``timeout``: seconds it may take); a CheckReport (a Report: ``.rows`` one
        per check, ``.ok``, ``.problems``, ``.summary``). ``progress(message)`` hears the
        steps. Raises ConfigError for a timeout that is not above 0."""
        from tpufab.steps.health import check
        from tpufab.steps.start.collective import run_collective

        check.refuse_timeout(timeout)  # before connecting
        # the timeout bounds connecting too: a frozen worker is named
        connected = self._connected_within(timeout)
        return check.run_check(connected.settings, connected, quick=quick, timeout=timeout,
                               progress=progress, collective=run_collective)

    # --- issue 27: stacks and stall
    def stacks(self, *, run: str | None = None, native: bool = False,
               workers: str | Iterable[int] = "all", timeout: float | None = None,
               save: bool = True, progress: Any = None) -> Any:
        """`tpufab stacks`: py-spy on every chosen worker at once, against ``run``'s Python
        processes (default: the latest run, while it runs; otherwise every Python process
        holding the TPU); ``native`` adds C/C++ frames. Returns a StacksReport (a Report,
        a row per worker; display.report.show prints it folded as `logs` folds, the odd
        workers first; ``.odd``; ``.check()``
        raises StacksError in one sentence: no such run, nothing to dump, py-spy missing and
        not installable). With ``save``, the folded text and the JSON go beside the run's
        local logs (./.tpufab/runs/ID/stacks-TIME.txt and .json; ./.tpufab/stacks/ without a
        run): ``.saved``. ``timeout``: seconds each worker may take (default: the
        command_timeout setting, else 60). Raises ConfigError for a malformed run id."""
        from tpufab.steps.health import stacks

        stacks.check_run(run)
        report = stacks.capture(self.hosts.fanout, self.select(workers), run=run,
                                native=native, device_globs=self.hosts.device_globs(),
                                timeout=self._timeout(timeout, stacks.TIMEOUT),
                                progress=progress)
        if save and report.dumped and report.processes:
            from tpufab.steps.runs import running as jobs

            settings = self.settings
            try:
                folder = jobs.local_log_dir(report.run, keep_runs=settings.keep_runs,
                                            keep_gib=settings.keep_logs_gib) \
                    if report.run else jobs.private_dir(Path.cwd() / ".tpufab" / "stacks")
                report.save(folder)
            except OSError:
                pass
        return report

    # --- issue 27: budgets, maintenance, top
    def top(self, *, once: bool = False, every: float = 3.0, interval: float = 1.0,
            workers: str | Iterable[int] = "all", timeout: float | None = 30.0,
            on_frame: Any = None) -> Any:
        """`tpufab top`: every worker's CPU, memory, load, run processes and TPU use, sampled
        over ``interval`` seconds in one fan-out a frame, folded where workers agree
        (a TopFrame, a Report: ``.rows`` every worker's load, ``.folded`` the table's rows;
        display.report.show prints it, display.top.follow draws them live). ``once``: one
        frame, returned.
        Otherwise a frame every ``every`` seconds goes to ``on_frame(frame)`` until Ctrl-C
        (KeyboardInterrupt, left to the caller) and the last is returned. ``timeout``: seconds
        each worker has to answer. ConfigError (one sentence) for an interval outside (0, 30]
        or ``every`` below 1 s, before connecting."""
        from tpufab.steps.health import top

        top.check_every(every, interval)
        chosen = self.select(workers)
        if once or on_frame is None:
            return top.frame(self.hosts, workers=chosen, interval=interval,
                             timeout=timeout)
        return top.watch(self.hosts, on_frame=on_frame, every=every, interval=interval,
                         workers=chosen, timeout=timeout)

    # --- issue 28: kept connections
    def disconnect(self) -> int:
        """`tpufab disconnect`: close this process's connections to the pod and stop the
        background process keeping them between commands (tpufab.ssh.keeper); how many such
        processes were stopped. The next command connects again (and keeps them again unless
        keep_alive is 0)."""
        from tpufab.hosts import connect as connection

        self.close()
        return connection.stop_keepers(self.settings)

    # --- issue 29: Ray
    def ray_up(self, *, options: Sequence[str] | None = None, timeout: float | None = None,
               progress: Any = None, join_batch: int = 0) -> Any:
        """`tpufab ray up`: Ray's head on worker 0 of slice 0, every other host joined (one
        fan-out), each with the TPU environment Ray labels its node from; Ray is installed
        where missing. A quick no-op when Ray is up everywhere; a host where Ray died is
        rejoined. ``options``: more ``ray start`` options for every host. ``join_batch``:
        hosts joined at a time (0: all at once), each batch seen by the head before the next
        (for machines where many simultaneous joins miss Ray's 30 s wait). ``timeout``:
        seconds per step on the workers (default 300). Returns a RayUp (``.address``,
        ``.already``, ``.started``; ``tpufab.reports.up_sentence`` says it); raises RayError saying where and
        why it could not."""
        from tpufab.steps.start import raycluster

        return raycluster.up(self, extra=list(options or ()),
                             timeout=self._timeout(timeout, raycluster.STEP_TIMEOUT),
                             progress=progress or raycluster.silent,
                             join_batch=join_batch)

    def ray_status(self, *, timeout: float | None = 60.0) -> Any:
        """`tpufab ray status`: whether Ray is up, the nodes the head sees (TPU resources,
        the head resource, slice labels), the hosts not joined and the jobs: a RayStatus, a
        Report whose rows are the hosts (``.up``, ``.healthy``, ``.missing``; printed by
        ``tpufab.views.report.show``)."""
        from tpufab.steps.start import raycluster

        return raycluster.status(self, timeout=self._timeout(timeout, 60.0))

    def ray_submit(self, recipe: str | Path, extra: Sequence[str] = (), *,
                   env: Sequence[str] | None = None, secret: Sequence[str] | None = None,
                   no_deploy: bool = False, direct: bool = False,
                   timeout: float | None = None, out: Any = None, progress: Any = None) -> Any:
        """`tpufab ray submit`: deploy the commit (as `run` does), submit ``recipe`` with
        ``extra`` as its arguments through Ray's Job API (over a port forwarded to the head's
        127.0.0.1), follow its logs (``out(line)``, secrets masked) until it ends. Returns a
        Submitted (``.job``, ``.status``, ``.exit_code``); raises RayError when Ray is not
        up."""
        from tpufab.steps.start import raycluster

        return raycluster.submit(self, self.settings, recipe, list(extra), env=env,
                                 secret=secret, no_deploy=no_deploy, direct=direct,
                                 timeout=self._timeout(timeout, raycluster.STEP_TIMEOUT),
                                 out=out, progress=progress or raycluster.silent)

    def ray_down(self, *, grace: float = 10.0, timeout: float | None = None) -> Any:
        """`tpufab ray down`: `ray stop` on every host (then forced) until no Ray process is
        left; a RayDown (``.answers`` per worker; ``tpufab.reports.down_sentence`` says
        it); raises RayError naming hosts where Ray processes are left."""
        from tpufab.steps.start import raycluster

        return raycluster.down(self, grace=grace,
                               timeout=self._timeout(timeout, raycluster.STEP_TIMEOUT))


class _Silent:
    """A view that shows nothing (the logs stay on the workers)."""

    def lines(self, worker: int, stream: str, data: bytes) -> None:
        pass

    def done(self, result: Any) -> None:
        pass


class Run:
    """A run started with `Pod.start`: ``.id``, ``.workers``, ``.plan`` (the recipe, commit,
    environment), ``.started`` (each worker's start report)."""

    def __init__(self, pod: Pod, run_id: str, workers: Sequence[int], *,
                 started: Any = None):
        self.pod, self.id, self.workers = pod, run_id, list(workers)
        self.plan = started.plan if started is not None else None
        self.started = started.started if started is not None else {}
        self.output_dir = started.output_dir if started is not None else None
        self.profile_dir = started.profile_dir if started is not None else None

    @property
    def secrets(self) -> list[str]:
        """The values this run was given as secrets (masked wherever its logs are shown)."""
        return list(self.plan.secrets.values()) if self.plan is not None else []

    def finished(self, states: Mapping[int, Any], *, seconds: float, kept: str = "") -> str:
        """How the followed run ended (``states`` from ``follow``), in one sentence when it
        ended well everywhere; else RunError naming the failed and lost workers, with the
        workers' exit status. ``kept``: where the local copy of the logs is, as shown."""
        from tpufab.steps.start import starting

        hint = (starting.shipped_note(self.plan, self.started)
                if self.plan is not None and self.started else None)
        return starting.finished(self.id, states, seconds, kept, hint)

    def log_copy_dir(self) -> Path:
        """Where the local copy of this run's logs goes (~/.tpufab/runs/ID; older copies
        pruned to the keep_runs and keep_logs_gib settings); OSError when it cannot be made."""
        from tpufab.steps.runs import running as jobs

        settings = self.pod.settings
        return jobs.local_log_dir(self.id, keep_runs=settings.keep_runs,
                                  keep_gib=settings.keep_logs_gib)

    def follow(self, sink: OutputSink, *, copy_dir: Path | None = None, on_end: Any = None,
               timeout: float = float("inf")) -> dict | None:
        """Stream the run's log from every worker into ``sink`` (masked; a copy per worker in
        ``copy_dir``; ``on_end(worker, state)`` as each one ends) until it ends everywhere:
        {worker: state}; None when Ctrl-C stopped following (the run goes on)."""
        from tpufab.ssh.fanout import FanoutInterrupted
        from tpufab.steps.runs import running as jobs

        follower = jobs.FollowSink(sink, secrets=self.secrets, copy_dir=copy_dir,
                                   on_end=on_end)
        try:
            return jobs.follow(self.pod.hosts.fanout, self.id, self.workers, follower,
                               timeout=timeout)
        except FanoutInterrupted:
            return None
        finally:
            follower.close()

    def __repr__(self) -> str:
        return f"<Run {self.id} on {len(self.workers)} workers>"

    def wait(self, sink: OutputSink | None = None) -> dict:
        """Follow it to the end: {worker: state} (``.ok``, ``.exit_status``)."""
        from tpufab.steps.runs import running as jobs

        return jobs.follow(self.pod.hosts.fanout, self.id, self.workers,
                           jobs.FollowSink(sink or _Silent()))

    def logs(self) -> dict[int, str]:
        """Each worker's log so far."""
        from tpufab.steps.runs import running as jobs

        logs, _states = jobs.fetch_logs(self.pod.hosts.fanout, self.id, self.workers)
        try:
            return {w: output.read().decode("utf-8", "replace") for w, output in logs.items()}
        finally:
            for output in logs.values():
                output.close()

    def kill(self, grace: float = 5.0) -> dict:
        from tpufab.steps.runs import running as jobs

        return jobs.stop(self.pod.hosts.fanout, self.id, self.workers, grace=grace)

    # --- issue 27: stacks and stall
    @staticmethod
    def check_stall(stall: str | float | None, action: str | None = None, *,
                    progress_file: str | None = None, restart: bool = False) -> float | None:
        """``--stall`` in seconds (None: no watchdog); ConfigError in one sentence for a bad
        duration, one below the floor (10 s), an action other than wait or kill (or restart,
        with ``restart``: babysit's), a ``progress_file`` that is empty, has a ``..`` part or
        comes without ``stall``."""
        from tpufab.steps.start import stall as stalls

        seconds = stalls.check_stall(stall, action, restart=restart)
        if stalls.check_progress_file(progress_file) is not None and seconds is None:
            raise ConfigError("--stall-progress-file says what progress means for the stall "
                              "watchdog, which only --stall DURATION starts; add --stall "
                              "(e.g. --stall 15m).")
        return seconds

    def watch_stall(self, view: Any, *, seconds: float, action: str = "wait",
                    say: Any = None, show: Any = None,
                    progress_file: str | None = None) -> tuple[Any, Any]:
        """``view`` wrapped in the stall watchdog (steps/start/stall.py): after ``seconds`` with no
        new line from any worker (with ``progress_file``: instead, without that file's mtime
        advancing on any worker; relative to the run's directory there, $TPUFAB_RUN_DIR),
        every worker's stacks (``Pod.stacks``, saved beside the logs), the folded summary
        through ``show(lines)``, then ``action``: wait, or kill the run. Returns (the view to
        follow with, the handler: ``.killed``, ``.verdict()``)."""
        from tpufab.steps.start import stall as stalls

        progress = None if progress_file is None else stalls.ProgressFile(
            self.pod.hosts.fanout, self.id, self.workers, progress_file)
        handler = stalls.StallHandler(
            self.id, self.workers, seconds, action, say or (lambda *a: None),
            show or (lambda lines: None), progress=progress,
            take_stacks=lambda: self.pod.stacks(run=self.id, workers=self.workers),
            stop=self.kill)
        last_output = stalls.LastOutput(self.pod.hosts.fanout, self.id, self.workers)
        return stalls.StallWatch(view, seconds, handler, progress=progress,
                                 last_output=last_output), handler


class Launched:
    """What `launch` did: ``.plan`` (``.steps``, ``.settings``), ``.pod`` and ``.run`` (the
    started Run; None for a dry run). With ``down``, call ``.down()`` once the run is over
    (launch calls it itself when a step fails)."""

    def __init__(self, state: Any, *, console: Any = None, progress: Any = None):
        self._state, self._console, self._progress = state, console, progress
        self.plan = state.plan
        self.pod = state.pod
        self.run = (Run(state.pod, state.run.plan.run_id, state.run.plan.workers,
                        started=state.run) if state.run is not None else None)

    def ray_job(self, *, out: Any = None) -> int:
        """``ray=True``: submit the task's ``run`` as a Ray job on the head (Ray is up: the
        launch brought it up), follow it (``out(line)``; default: print) and return its exit
        code."""
        from tpufab.flows import launch as launching

        return launching.ray_job(self.plan, self.pod, out=out, progress=self._progress)

    def down(self) -> None:
        """Save every run's logs locally, then delete the node (``--down``)."""
        from tpufab.flows import launch as launching

        launching.down(self.plan, self._state.started, Pod.from_settings,
                       console=self._console, progress=self._progress)


def launch(task: str | Path, *, name: str | None = None, type: str | None = None,
           zone: str | None = None, project: str | None = None, spot: bool = False,
           version: str | None = None, env: Sequence[str] | None = None,
           secret: Sequence[str] | None = None, down: bool = False,
           detach: bool = False, idle: str | float | None = None, dry_run: bool = False,
           direct: bool = False, zones: str | Sequence[str] | None = None,
           retry_for: str | float | None = None, console: Any = None, progress: Any = None,
           setup_view: Any = None, force_setup: bool = False, ray: bool = False) -> Launched:
    """`tpufab launch` up to the start of the run (``ray``: up to Ray brought up on the pod;
    ``Launched.ray_job()`` then submits the task's run as a Ray job and follows it): create (or reuse) the pod of TASK.yaml
    (tpufab's schema or a SkyPilot task), arm autostop after ``idle``, deploy, mount, put,
    set up (``force_setup``: even where that setup is recorded as done), start the run.
    Returns Launched (``.plan``, ``.pod``, ``.run``); with
    ``dry_run``, only the plan. ``zones`` are tried in order on a stockout, for
    ``retry_for``; ``progress(text, style)`` hears each step, ``console`` the creation,
    ``setup_view(workers)`` (a context manager) gives the setup's sink. Raises ConfigError
    for a task or flags that do not make sense, StepFailed naming the step that failed."""
    from tpufab import durations
    from tpufab.flows import launch as launching
    from tpufab.flows.taskfile import load_task

    idle_s = durations.parse_duration(idle, "--idle")
    retry_s = durations.parse_duration(retry_for, "--retry-for")
    if isinstance(zones, str) or zones is None:
        zone_list = [z.strip() for z in (zones or "").split(",") if z.strip()]
    else:
        zone_list = [str(z).strip() for z in zones if str(z).strip()]
    if zone_list and zone and zone_list[0] != zone:
        raise ConfigError("--zone and --zones disagree; give the zones to try in order with "
                          "--zones only.")
    task_file = load_task(str(task))
    base = _settings(None, None, project, {})

    def find_node(node: str) -> Any:   # a read: `sky exec`-style tasks name no type
        from dataclasses import replace

        from tpufab.cloud import lifecycle

        chosen = replace(base, zone=zone or (zone_list[0] if zone_list else None)
                         or task_file.zone or base.zone)
        return lifecycle.control_plane(chosen).find_node(node)

    plan = launching.plan(task_file, settings=base, name=name,
                          type=type, zone=zone or (zone_list[0] if zone_list else None),
                          spot=spot, version=version, env=env or (), secret=secret or (),
                          down=down, detach=detach, idle=idle_s, direct=direct,
                          force_setup=force_setup, find_node=find_node, ray=ray)
    state = launching.Launch(plan)
    if dry_run:
        return Launched(state)
    if progress is not None:
        kind = "SkyPilot task" if task_file.source == "skypilot" else "task"
        progress(f"Launching {task} ({kind}) on {plan.settings.name}: {len(plan.steps)} "
                 "steps.")
    try:
        launching.execute(plan, state, Pod.from_settings, zones=zone_list or None,
                          retry_for=retry_s, console=console, progress=progress,
                          setup_view=setup_view)
    except BaseException:
        if down and state.created:   # as `tpufab launch --down`: whatever failed after
            Launched(state, console=console, progress=progress).down()
        raise
    return Launched(state, console=console, progress=progress)


def create(name: str | None = None, *, type: str | None = None, zone: str | None = None,
           project: str | None = None, queued: bool = False, num_slices: int = 1,
           **settings: Any) -> Pod:
    """Create a TPU VM node (idempotent for an existing READY node of the same type), wait
    until it is READY, and return it as a Pod."""
    from tpufab.cloud import lifecycle

    chosen = _settings(name, zone, project, {"type": type, **settings})
    lifecycle.create(chosen, queued=queued, num_slices=num_slices)
    return Pod(chosen.name, zone=chosen.zone, project=chosen.project, **settings)


def gc(*, zone: str | None = None, project: str | None = None, all_zones: bool = False,
       yes: bool = True, console: Any = None, **settings: Any) -> list:
    """`tpufab gc`: delete preempted, terminated and failed nodes and suspended and failed
    queued resources (in the zone, or every zone); ``yes=False`` asks first (on a terminal),
    ``console`` hears what is found and deleted. Returns what was deleted."""
    from tpufab.cloud import lifecycle

    return lifecycle.gc(_settings(None, zone, project, settings), yes=yes, all_zones=all_zones,
                        console=console)


def delete(name: str | None = None, *, zone: str | None = None,
           project: str | None = None, yes: bool = True, console: Any = None) -> bool:
    """`tpufab delete`: delete a TPU node (or its queued resource) and wait until it is gone
    (a no-op if there is none); ``yes=False`` asks first on a terminal. Returns whether
    something was deleted."""
    from tpufab.cloud import lifecycle
    from tpufab.hosts import connect as pods

    chosen = _settings(name, zone, project, {})
    pods.forget(chosen)
    pods.stop_keepers(chosen)  # its kept connections go with it
    return lifecycle.delete(chosen, yes=yes, console=console)


# -- the cloud: what the node verbs (create, delete, list, describe, ...) call -----------------
def create_node(settings: Settings, *, queued: bool = False, num_slices: int = 1,
                async_: bool = False, zones: Sequence[str] | None = None,
                retry_for: float | None = None, reservation: str | None = None,
                topology: str | None = None, console: Any = None) -> list:
    """`tpufab create` with exactly these settings (name, type, tier, labels ...): create the
    node (or queued resource), trying ``zones`` in order on a stockout and retrying for
    ``retry_for`` seconds, and wait until READY (unless ``async_``). Returns the nodes;
    raises ApiError (quota, stockout, bad request) or ConfigError in one sentence."""
    from tpufab.cloud import lifecycle

    return lifecycle.create(settings, queued=queued, num_slices=num_slices, async_=async_,
                            zones=zones, retry_for=retry_for, reservation=reservation,
                            topology=topology, console=console)


def list_pods(*, zone: str | None = None, project: str | None = None, waiting: bool = True,
              **settings: Any) -> Any:
    """`tpufab list`: the zone's TPU nodes (``.nodes``) and, with ``waiting``, its queued
    resources that have no nodes yet (``.waiting``); ``.to_json()``, ``.render(console)``."""
    from tpufab.cloud import lifecycle

    return lifecycle.listing(_settings(None, zone, project, settings), waiting=waiting)


def describe(name: str | None = None, *, zone: str | None = None, project: str | None = None,
             **settings: Any) -> Any:
    """`tpufab describe`: the node called ``name`` (a Node: state, health, workers and their
    IPs), or the queued resource of that name if no node has it, or the Compute Engine
    multislice of that name (a MultisliceInfo: ``.slices``); ``.to_json()``. Raises ApiError
    when there is none, ConfigError when the name is both a node and a multislice."""
    from tpufab.cloud import lifecycle

    return lifecycle.describe(_settings(name, zone, project, settings))


def render_details(item: Any, console: Any) -> None:
    """Print what `describe` returned as `tpufab describe` does."""
    from tpufab.cloud import lifecycle

    lifecycle.render_details(item, console)


def valid_name(name: str | None) -> str:
    """``name`` if it is a valid node name, else ConfigError saying what is wrong with it."""
    from tpufab.cloud import lifecycle

    return lifecycle.validate_name(name)


def default_name(user: str, accelerator_type: str) -> str:
    """The name `tpufab create` gives a node when none is given: `alice-v4-512`."""
    from tpufab.cloud import lifecycle

    return lifecycle.default_name(user, accelerator_type)


def forget_host_keys(node: str, *, zone: str | None = None, project: str | None = None,
                     **settings: Any) -> int:
    """`tpufab known-hosts forget`: drop the pinned host keys of ``node`` (a name, or the
    node id an error named); how many were removed."""
    from tpufab.hosts import connect as connection

    return connection.forget_host_keys(_settings(None, zone, project, settings), node)


# -- the simulated pod's verbs (tpufab sim ...) ------------------------------------------------
def make_zombies(pod: Pod, workers: str | Iterable[int] = "all") -> dict:
    """`tpufab sim zombie`: leave a crashed job's mess on the workers of a simulated pod (TPU
    holders, one ignoring SIGTERM, the libtpu lockfile held, a protected holder);
    {worker: report}, each ``.report`` (None if it failed) and ``.error``."""
    from tpufab.steps.host import killing

    return killing.make_zombies(pod.fanout, pod.select(workers),
                                device_globs=pod.device_globs())


def zombie_lines(reports: Mapping[int, Any]) -> list[str]:
    """What `make_zombies` left, one line per worker and process."""
    from tpufab.steps.host import killing

    return killing.zombie_lines(reports)


def parse_bucket(text: str) -> tuple[str, str]:
    """``gs://bucket/some/prefix/`` (or ``bucket/some/prefix``) -> ("bucket", "some/prefix");
    ConfigError for what is not a bucket."""
    from tpufab.steps.host import mount

    return mount.parse_bucket(text)
