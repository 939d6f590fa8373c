"""A run started with `Pod.start`: follow it, wait for it, read its logs, stop it, watch it
for stalls. The pod it runs on is what `Pod` is to it: connected hosts, settings, stacks."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from tpufab.errors import ConfigError

if TYPE_CHECKING:
    from tpufab.config import Settings
    from tpufab.hosts.connect import Hosts
    from tpufab.ssh.results import OutputSink
    from tpufab.steps.health.stacks import StacksReport
    from tpufab.steps.runs.livesteps import StragglerWatch
    from tpufab.steps.start.stall import StallHandler, StallWatch
    from tpufab.steps.start.starting import Started


class RunsOn(Protocol):
    """What a Run needs of its pod (a tpufab.Pod)."""

    settings: Settings

    @property
    def hosts(self) -> Hosts: ...

    def stacks(self, *, run: str | None = None, workers: Any = "all") -> StacksReport: ...


class _NoView:
    """A view that shows nothing (the logs stay on the workers)."""

    def lines(self, worker: int, stream: str, data: bytes) -> None:
        pass

    def done(self, result: Any) -> None:
        pass


class Run:
    """A run started with `Pod.start`: ``.id``, ``.workers``, ``.plan`` (the recipe, commit,
    environment), ``.started`` (each worker's start report)."""

    def __init__(self, pod: RunsOn, run_id: str, workers: Sequence[int], *,
                 started: Started | None = None):
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

    def follow(self, sink: OutputSink, *, copy_dir: Path | None = None,
               on_end: Callable[[int, Any], None] | None = None,
               timeout: float = float("inf")) -> dict | None:
        """Stream the run's log from every worker into ``sink`` (masked; a copy per worker in
        ``copy_dir``; ``on_end(worker, state)`` as each one ends) until it ends everywhere:
        {worker: state}; None when Ctrl-C stopped following (the run goes on)."""
        from tpufab.ssh.results import FanoutInterrupted
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
                           jobs.FollowSink(sink or _NoView()))

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

    @staticmethod
    def check_step_pattern(pattern: str | None) -> str | None:
        """``--step-pattern`` as given (None: the default), or ConfigError in one sentence
        when it is no regular expression."""
        from tpufab.steps.runs.stragglers import check_pattern

        if pattern is not None:
            check_pattern(pattern)
        return pattern

    def watch_stragglers(self, view: OutputSink, *, pattern: str | None = None,
                         say: Callable[[str], None], save_to: Path | None = None,
                         metrics: bool = True) -> StragglerWatch:
        """``view`` wrapped in the live straggler detector (steps/runs/livesteps.py): every
        followed line that matches ``pattern`` (the default step pattern when None) is a
        step; with ``metrics``, each worker's TPU metrics are sampled too; ``say(sentence)``
        hears each verdict; ``save_to``: where steps.json goes at the end. ConfigError for a
        pattern that is no regular expression."""
        from tpufab.steps.runs.livesteps import StragglerWatch

        return StragglerWatch(view, self.workers, pattern=pattern, say=say,
                              fanout=self.pod.hosts.fanout if metrics else None,
                              run_id=self.id, save_to=save_to)

    # -- the stall watchdog (`run --stall`) ------------------------------------------------
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

    def watch_stall(self, view: OutputSink, *, seconds: float, action: str = "wait",
                    say: Callable[..., None] | None = None,
                    show: Callable[[list[str]], None] | None = None,
                    progress_file: str | None = None) -> tuple[StallWatch, StallHandler]:
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
        fanout = self.pod.hosts.fanout
        tpu = stalls.TpuActivity(fanout, self.id, self.workers)
        # a silence is judged only once the workers say they wrote nothing for that long
        # either: output already on its way (a client paused, then resumed) is no stall
        last_output = stalls.LastOutput(fanout, self.id, self.workers)
        return stalls.StallWatch(view, seconds, handler, progress=progress, tpu=tpu,
                                 last_output=last_output), handler
