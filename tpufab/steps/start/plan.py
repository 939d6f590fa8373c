"""What starts where (pure): a run's plan, each worker's environment, the start command.

``plan_run`` decides everything a run needs before a worker is touched: its id, the recipe,
its arguments, each worker's environment (its rank and the job's layout, from
``tpufab.steps.runs.env``); ``start_command`` is what ``run_worker.py start`` is given on
every worker (tpufab.steps.start.starting starts it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tpufab.quoting import Command
from tpufab.ssh.remote_files import RemoteFile, python_command
from tpufab.steps.runs.env import (
    RESERVED,
    Forwarded,
    JobEnvironment,
    JobLayout,
    SliceFacts,
    job_environments,
    new_run_id,
)
from tpufab.steps.runs.running import launch_file

ENV_FILE = ".tpufab/runs/.{run_id}.env.json"     # relative to the worker's home


@dataclass(frozen=True)
class RunPlan:
    """Everything that decides what starts where."""

    run_id: str
    recipe: RemoteFile
    args: tuple[str, ...]
    environments: Mapping[int, JobEnvironment]        # worker -> its environment
    cwd: str | None = None
    commit: str | None = None
    # the recipe's own path in the deployed checkout (`run` runs it there when it holds the
    # same bytes, so `$(dirname "$0")` is the checkout's folder); None: the shipped copy
    in_checkout: str | None = None
    # the image the recipe runs in on every host, pinned by digest (`run --image`); None: none
    image: str | None = None

    @property
    def workers(self) -> list[int]:
        return sorted(self.environments)

    @property
    def secrets(self) -> dict[str, str]:
        """The same on every worker; they travel on stdin only."""
        first = self.environments[self.workers[0]]
        return dict(first.secrets)

    def env_file(self) -> str:
        return ENV_FILE.format(run_id=self.run_id)


def slice_facts(nodes: Sequence) -> list[SliceFacts]:
    """Each slice's name, type and chip shape (tpufab.cloud.nodes.Node, one per slice)."""
    from tpufab.topology import default_dims, format_dims

    out = []
    for node in nodes:
        topo = node.topology
        shape = node.chip_topology or (format_dims(default_dims(topo)) if topo else "")
        out.append(SliceFacts(node.name, node.accelerator_type, shape))
    return out


def plan_run(recipe: RemoteFile, *, slices: Sequence[Sequence[int]], ips: Sequence[str],
             run_id: str | None = None, args: Sequence[str] = (), cwd: str | None = None,
             commit: str | None = None, forwarded: Forwarded | None = None,
             spmd: bool = False, tpu: Sequence[SliceFacts] = (),
             virtual_env: str | None = None) -> RunPlan:
    """Each worker's environment, for a pod whose global worker ids per slice are ``slices``
    (slice 0's workers first, so a worker's id is its rank) and whose internal IPs, indexed
    by worker id, are ``ips``; ``tpu``: each slice's facts (``slice_facts(pod.nodes)``);
    ``virtual_env``: the environment's path (``environment.virtual_env(settings)``)."""
    run_id = run_id or new_run_id()
    layout = JobLayout.multislice([[ips[w] for w in ids] for ids in slices], tpu)
    ranks = [w for ids in slices for w in ids]
    envs = job_environments(run_id, layout, spmd=spmd, forwarded=forwarded,
                            virtual_env=virtual_env)
    return RunPlan(run_id, recipe, tuple(args), dict(zip(ranks, envs, strict=True)), cwd, commit)


def start_command(plan: RunPlan) -> Command:
    from tpufab.remote.workerlib import MOUNTS_DIR

    args: list = ["start", "--run", plan.run_id, "--recipe", plan.recipe.path,
                  "--recipe-sha256", plan.recipe.sha256, "--env-file", plan.env_file(),
                  "--mounts-dir", MOUNTS_DIR]
    if plan.cwd:
        args += ["--cwd", plan.cwd]
    if plan.commit:
        args += ["--commit", plan.commit]
    if plan.in_checkout:
        args += ["--in-checkout", plan.in_checkout]
    if plan.image:
        args += ["--image", plan.image]
    if plan.secrets:
        args.append("--env-stdin")
    return python_command(launch_file(), [*args, "--", *plan.args], needs=[plan.recipe])


def environment_summary(plan: RunPlan) -> str:
    """The forwarded and framework variables of a run, secrets masked (for display)."""
    first = plan.environments[plan.workers[0]]
    shown = {k: v for k, v in first.masked().items()
             if not k.startswith(("TPUFAB_", "SKYPILOT_")) and k not in RESERVED
             and k not in ("TPU_WORKER_ID", "MASTER_PORT")}
    return " ".join(f"{k}={v}" for k, v in sorted(shown.items()))
