"""`tpufab launch` as the Python API: a task file up to the start of its run (`launch`), and
what it did (`Launched`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from tpufab.config import load_settings, parse_zones
from tpufab.errors import ConfigError
from tpufab.pod.api import Pod
from tpufab.pod.run import Run

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from rich.console import Console

    from tpufab.cloud.nodes import Node
    from tpufab.flows.launch import Launch
    from tpufab.ssh.results import OutputSink


class Launched:
    """What `launch` did: ``.plan`` (``.steps``, ``.settings``), ``.pod`` and ``.run`` (the
    started Run; None for a dry run). With ``down``, call ``.down()`` once the run is over
    (launch calls it itself when a step fails)."""

    def __init__(self, state: Launch, *, console: Console | None = None,
                 progress: Callable[..., None] | None = None):
        self._state, self._console, self._progress = state, console, progress
        self.plan = state.plan
        self.pod = state.pod
        self.run = (Run(state.pod, state.run.plan.run_id, state.run.plan.workers,
                        started=state.run) if state.run is not None else None)

    def ray_job(self, *, out: Callable[[str], None] | None = None) -> int:
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
           retry_for: str | float | None = None, console: Console | None = None,
           progress: Callable[..., None] | None = None,
           setup_view: Callable[[list[int]], AbstractContextManager[OutputSink]] | None = None,
           force_setup: bool = False, ray: bool = False,
           allow_file: Sequence[str] | None = None) -> Launched:
    """`tpufab launch` up to the start of the run (``ray``: up to Ray brought up on the pod;
    ``Launched.ray_job()`` then submits the task's run as a Ray job and follows it): create
    (or reuse) the pod of TASK.yaml (tpufab's schema or a SkyPilot task), arm autostop after
    ``idle``, deploy, mount, put, set up (``force_setup``: even where that setup is recorded
    as done), start the run. Returns Launched (``.plan``, ``.pod``, ``.run``); with
    ``dry_run``, only the plan. ``zones`` are tried in order on a stockout, for
    ``retry_for``; ``progress(text, style)`` hears each step, ``console`` the creation,
    ``setup_view(workers)`` (a context manager) gives the setup's sink; ``allow_file``: the
    private or credential files of the task that may be copied (by name). Raises ConfigError
    for a task or flags that do not make sense, StepFailed naming the step that failed."""
    from tpufab import durations
    from tpufab.flows import launch as launching
    from tpufab.flows.taskfile import load_task

    idle_s = durations.parse_duration(idle, "--idle")
    retry_s = durations.parse_duration(retry_for, "--retry-for")
    zone_list = parse_zones(zones)
    if zone_list and zone and zone_list[0] != zone:
        raise ConfigError("--zone and --zones disagree; give the zones to try in order with "
                          "--zones only.")
    task_file = load_task(str(task))
    base = load_settings({"project": project})

    def find_node(node: str) -> Node | None:   # a read: `sky exec`-style tasks name no type
        from dataclasses import replace

        from tpufab.cloud import planes

        chosen = replace(base, zone=zone or (zone_list[0] if zone_list else None)
                         or task_file.zone or base.zone)
        return planes.control_plane(chosen).find_node(node)

    plan = launching.plan(task_file, settings=base, name=name,
                          type=type, zone=zone or (zone_list[0] if zone_list else None),
                          spot=spot, version=version, env=env or (), secret=secret or (),
                          down=down, detach=detach, idle=idle_s, direct=direct,
                          force_setup=force_setup, find_node=find_node, ray=ray,
                          allow_files=allow_file or ())
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
