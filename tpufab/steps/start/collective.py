"""`tpufab check`'s collective: a real job across every host (``remote/check_collective.sh``),
started the one way every job starts (``starting.start_job``: under the pod's code lease,
never beside a running run), followed to its end and judged (``tpufab.steps.health.check``:
its answers are parsed and judged purely there)."""

from __future__ import annotations

from typing import Any

from tpufab.steps.health.check import (
    COLLECTIVE,
    Problem,
    Promise,
    Result,
    collective_args,
    judge_collective,
    parse_collective,
)


class _Collect:
    """A view for jobs.FollowSink that keeps each worker's output."""

    def __init__(self) -> None:
        self.out: dict[int, list[bytes]] = {}

    def lines(self, worker: int, stream: str, data: bytes) -> None:
        if stream == "stdout":
            self.out.setdefault(worker, []).append(data)

    def done(self, result: Any) -> None:
        pass

    def text(self, worker: int) -> str:
        return b"".join(self.out.get(worker, [])).decode("utf-8", "replace")


def run_collective(pod: Any, promise: Promise, *, timeout: float) -> Result:
    """Start the collective on every worker (tpufab's run machinery), wait, judge it."""
    from tpufab.ssh.remote_files import RemoteFile
    from tpufab.steps.runs import running as jobs
    from tpufab.steps.runs.env import Forwarded, virtual_env
    from tpufab.steps.start import plan as plans
    from tpufab.steps.start.starting import start_job, start_plan

    bundled = RemoteFile.bundled(COLLECTIVE)
    program = RemoteFile(bundled.name, bundled.data, 0o755)
    plan = plans.plan_run(program, slices=pod.slices, ips=pod.internal_ips(),
                          args=collective_args(promise, timeout=timeout),
                          forwarded=Forwarded({"TPUFAB_INIT_TIMEOUT": f"{int(timeout)}"}, {}),
                          tpu=plans.slice_facts(pod.nodes),
                          virtual_env=virtual_env(pod.settings))
    try:
        start_job(pod, lambda _report: start_plan(pod, plan), verb="check",
                  what="(the collective)", timeout=timeout)
    except jobs.RunError as err:
        return Result("collective", "could not start", [Problem(
            "collective", (), f"the collective could not start: {err}",
            "see `tpufab status`")], data={"run": plan.run_id})
    view = _Collect()
    states = jobs.follow(pod.fanout, plan.run_id, plan.workers, jobs.FollowSink(view))
    answers = {w: parse_collective(view.text(w)) for w in plan.workers}
    ended = {w: s.label for w, s in states.items()}
    return judge_collective(answers, ended, promise, plan.run_id)
