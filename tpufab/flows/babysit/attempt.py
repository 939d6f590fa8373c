"""One attempt of babysit: the recipe started the one way every job starts
(``tpufab.steps.start.starting.start_job``: under the pod's code lease, never beside a
running run), or submitted to Ray (``--ray``), then watched: its followers stream every
worker's lines into the caller's live view (``view``; the flow itself shows nothing) and the
attempt's log copies, while the API is polled, workers nobody follows any more are asked, a
failure's peers are stopped after the grace, the stall watchdog and the maintenance signal do
their part; ``Attempts._watch`` returns how it ended (an ``Attempt``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tpufab import nodeset
from tpufab.config import timeout_for
from tpufab.errors import TpufabError
from tpufab.flows.babysit.hooks import Stopped
from tpufab.flows.babysit.policy import (
    BABYSIT_VARIABLE,
    RESTART_VARIABLE,
    BabysitError,
    Decision,
    decide,
    finished,
    signal_command,
    state_exit_code,
)
from tpufab.flows.babysit.records import Attempt, notices_in, shown_path

if TYPE_CHECKING:
    from tpufab.steps.runs.running import WorkerState


class Silent:
    """The live view when the caller gives none: the lines go to the attempt's copies only."""

    def lines(self, worker: int, stream: str, data: bytes) -> None:
        pass

    def done(self, result: Any) -> None:
        pass


class Attempts:
    """The babysitter's attempts (a part of ``loop.Babysitter``, whose state it uses:
    ``settings``, ``recipe``, ``restore``, the options, ``view`` and ``out``)."""

    def _attempt(self, number: int, restarts: int, run_id: str, *,
                 attach: str | None = None) -> Attempt:
        """Attempt ``number`` as run ``run_id`` (planned by the loop); ``attach``: a run id
        that may be going on the pod already (a resumed babysit): followed if so."""
        from tpufab.ssh.remote_files import RemoteFile
        from tpufab.steps.code.deploy import default_cwd
        from tpufab.steps.runs.env import Forwarded, virtual_env
        from tpufab.steps.runs.running import RunError
        from tpufab.steps.start import plan as plans
        from tpufab.steps.start.starting import start_job, start_plan

        pod = self._pod()
        if self.ray:
            return self._ray_attempt(pod, run_id, number, restarts)
        attempt_dir = self._attempt_dir(run_id, number)
        forwarded = self._forwarded()
        forwarded = Forwarded({**forwarded.public, RESTART_VARIABLE: str(restarts),
                               BABYSIT_VARIABLE: self.base_run_id}, forwarded.secrets)
        cwd = self.restore.deploy_dir or default_cwd(self.settings.remote_dir)
        plan = plans.plan_run(RemoteFile.from_path(self.recipe), slices=pod.slices,
                              ips=pod.internal_ips(), run_id=run_id, args=self.args, cwd=cwd,
                              commit=self.restore.commit, forwarded=forwarded,
                              tpu=plans.slice_facts(pod.nodes),
                              virtual_env=virtual_env(self.settings))
        attached = attach is not None and self._going(pod, attach, plan.workers)
        if not attached:
            self.go_on(f"starting run {run_id}")
            try:   # the one start path: under the code lease, never beside a running run
                start_job(pod, lambda _deployed: start_plan(pod, plan), verb="babysit",
                          what=self.recipe.name, timeout=self.timeout)
            except RunError as err:
                if attach is not None and "already exists" in str(err):
                    attached = True    # started meanwhile: the worker refused a second start
                else:
                    reason = self.api_reason()
                    if reason is None:
                        raise
                    return Attempt(number, run_id, "preempted", reason, attempt_dir)
        self.hooks.started(number, run_id, plan.workers, attached)
        self.note(f"babysit: attempt {number} is run {run_id} ({self.recipe.name}, "
                  f"{RESTART_VARIABLE}={restarts}) on {nodeset.fold(plan.workers)}; logs "
                  f"copied to {shown_path(attempt_dir)}/.")
        return self._watch(pod, plan, number, attempt_dir)

    def _going(self, pod, run_id: str, workers: Sequence[int]) -> bool:
        """Has run ``run_id`` been started on the pod (a record of it on any worker)? Then a
        resumed babysit follows it rather than starting it again."""
        from tpufab.steps.runs import running as jobs

        for answer in jobs.statuses(pod.fanout, list(workers), timeout=self.timeout).values():
            if answer.error is None and any(e.get("run") == run_id for e in answer.runs):
                return True
        return False

    def _attempt_dir(self, run_id: str, number: int) -> Path:
        from tpufab.steps.runs import running as jobs

        if self.log_dir is None:
            if self.base_dir is not None:
                self.base_dir.mkdir(parents=True, exist_ok=True)
            self.log_dir = jobs.local_log_dir(self.base_run_id, self.base_dir,
                                              keep_runs=self.settings.keep_runs,
                                              keep_gib=self.settings.keep_logs_gib)
        assert self.log_dir is not None
        attempt_dir = self.log_dir / f"attempt-{number}"
        jobs.private_dir(attempt_dir)
        return attempt_dir

    def _ray_attempt(self, pod, run_id: str, number: int, restarts: int) -> Attempt:
        """One attempt through Ray (``--ray``): Ray brought up (a no-op where it runs; on a
        recreated node the whole cluster starts again), the recipe submitted as a Ray job
        (`tpufab ray submit`'s path) and followed, while the API is polled; a preemption
        cancels the follow. The job's log is copied to ``attempt-<k>/job.log``."""
        from tpufab.reports import up_sentence
        from tpufab.steps.code.deploy import default_cwd
        from tpufab.steps.runs.running import open_private
        from tpufab.steps.start import raycluster

        attempt_dir = self._attempt_dir(run_id, number)
        head = pod.workers[0]
        self.note(f"babysit: Ray on {self.name} before attempt {number} (`tpufab ray up`) ...")
        try:
            started = raycluster.up(pod, extra=self.ray_options, timeout=self.timeout,
                                    progress=lambda text, style=None: self.note(text, "dim"))
        except raycluster.RayError as err:
            reason = self.api_reason()
            if reason is None:
                raise BabysitError(f"Could not start Ray for attempt {number}: {err}") from None
            return Attempt(number, run_id, "preempted", reason, attempt_dir)
        self.note(f"babysit: {up_sentence(started, self.name)}")
        job = f"tpufab-{run_id}"
        public = {RESTART_VARIABLE: str(restarts), BABYSIT_VARIABLE: self.base_run_id}
        cancel = threading.Event()
        box: dict[str, Any] = {}
        copy = open_private(attempt_dir / "job.log", "ab")

        def line(text: str) -> None:
            if self.out is not None:
                self.out(text)
            copy.write((text + "\n").encode())
            copy.flush()

        def submit() -> None:
            try:
                box["done"] = raycluster.submit(
                    pod, self.settings, self.recipe, self.args, env=self.env,
                    cwd=self.restore.deploy_dir or default_cwd(self.settings.remote_dir),
                    extra_env=public, job_id=job,
                    timeout=self.timeout, out=line, cancel=cancel,
                    progress=lambda text, style=None: self.note(f"babysit: {text}", "dim"))
            except BaseException as err:  # noqa: BLE001 - judged below
                box["error"] = err

        self.note(f"babysit: attempt {number} is Ray job {job} ({self.recipe.name}, "
                  f"{RESTART_VARIABLE}={restarts}); its log copied to "
                  f"{shown_path(attempt_dir)}/job.log.")
        follower = threading.Thread(target=submit, name="tpufab-babysit-ray", daemon=True)
        follower.start()
        reason = None
        try:
            while follower.is_alive():
                follower.join(self.poll)
                if follower.is_alive():
                    reason = self.api_reason()
                    if reason is not None:
                        break
        except KeyboardInterrupt:
            self._stop.set()
            cancel.set()
            follower.join(30)
            copy.close()
            self.attempts.append(Attempt(number, job, "interrupted", "Ctrl-C", attempt_dir))
            self._write_summary()
            raise BabysitError(f"Interrupted: asked Ray to stop job {job}; babysit ended. "
                               f"Logs: {shown_path(attempt_dir)}/.", exit_code=130) from None
        if reason is not None:   # lost under the job: stop following (the head may not answer)
            cancel.set()
            follower.join(10)
            copy.close()
            self.note(f"babysit: {reason} during Ray job {job}.", "yellow")
            return Attempt(number, job, "preempted", reason, attempt_dir, {head: "lost"})
        copy.close()
        if "error" in box:
            reason = self.api_reason()
            if reason is not None:
                return Attempt(number, job, "preempted", reason, attempt_dir, {head: "lost"})
            err = box["error"]
            if isinstance(err, TpufabError):   # Ray failed us, the node is fine: a failure
                return Attempt(number, job, "failed", str(err).rstrip("."), attempt_dir,
                               {head: "lost"})
            raise err
        done = box["done"]
        if done.exit_code == 0:
            return Attempt(number, job, "finished", f"Ray job {job} succeeded", attempt_dir,
                           {head: "exited 0"})
        why = f"Ray job {job} {done.status.lower()}: exit {done.exit_code}" + (
            f" ({done.message})" if done.message else "")
        return Attempt(number, job, "failed", why, attempt_dir,
                       {head: f"exited {done.exit_code}"}, {}, {head: done.exit_code})

    def _forwarded(self):
        from tpufab.steps.runs.env import forwarded_for

        return forwarded_for(self.settings, self.env)

    def _watch(self, pod, plan, number: int, attempt_dir: Path) -> Attempt:
        from tpufab.steps.runs import running as jobs
        from tpufab.steps.runs.livesteps import StragglerWatch

        workers = plan.workers
        ended: dict[int, WorkerState] = {}
        lock = threading.Lock()

        def on_end(worker: int, state: WorkerState) -> None:
            with lock:
                ended[worker] = state

        view = self.hooks.output(number, plan.run_id, workers)
        if view is None:
            view = self.view(workers) if self.view is not None else Silent()
        # stragglers named as this attempt's steps come, in babysit's notes
        view = StragglerWatch(view, workers, pattern=self.step_pattern,
                              say=lambda sentence: self.note(sentence, "yellow"),
                              fanout=pod.fanout, run_id=plan.run_id, save_to=attempt_dir)
        stalled = None
        if self.stall is not None:
            view, stalled = self._stall_watch(pod, plan.run_id, workers, view, attempt_dir)
        sink = jobs.FollowSink(view, secrets=plan.secrets.values(), copy_dir=attempt_dir,
                               on_end=on_end)
        box: dict[str, Any] = {}

        def follow() -> None:
            try:
                jobs.follow(pod.fanout, plan.run_id, workers, sink)
            except BaseException as err:  # noqa: BLE001 - reported by the watcher
                box["error"] = err

        follower = threading.Thread(target=follow, name="tpufab-babysit-follow", daemon=True)
        follower.start()
        states: dict[int, WorkerState] = {}
        followed_end: dict[int, WorkerState] = {}
        confirmed_lost: set[int] = set()
        unreachable_since: dict[int, float] = {}
        first_failure: float | None = None
        own_codes: dict[int, int] = {}
        stopped = False
        signalled: str | None = None      # the maintenance notice sent to this attempt
        looked_at = 0.0                   # when upcomingMaintenance was last read
        decision = Decision("wait")
        try:
            while True:
                follower.join(self.poll)
                why = self.hooks.go_on()
                if why == "lost":          # another holds the job now: touch nothing
                    self._end_follower(pod, follower, sink)
                    raise Stopped("lost", f"following run {plan.run_id}")
                if why is not None:        # asked to stop: the run stopped, the attempt ends
                    self.note(f"babysit: {why}: stopping run {plan.run_id} ...", "yellow")
                    jobs.stop(pod.fanout, plan.run_id, workers, grace=2.0)
                    self._end_follower(pod, follower, sink)
                    self._keep_logs(pod, plan.run_id, states, attempt_dir)
                    return Attempt(number, plan.run_id, "cancelled", why, attempt_dir,
                                   {w: s.label for w, s in sorted(states.items())})
                now = time.monotonic()
                with lock:
                    fresh = {w: s for w, s in ended.items() if w not in followed_end}
                    followed_end.update(fresh)
                states.update(fresh)
                if stalled is not None and stalled.killed:
                    stopped = True             # what ends now was stopped by the watchdog
                # ask again where nobody follows any more, and where a follower said "lost"
                # (it can read the instant between the recipe's exit and its record so)
                unfollowed = [w for w, s in states.items() if not finished(s) or
                              (s.state == "lost" and w not in confirmed_lost)]
                if unfollowed:
                    probed = self._probe(pod, plan.run_id, unfollowed)
                    confirmed_lost.update(w for w, s in probed.items() if s.state == "lost")
                    states.update(probed)
                for w, s in states.items():
                    if s.state == "unreachable":
                        unreachable_since.setdefault(w, now)
                    else:
                        unreachable_since.pop(w, None)
                    if finished(s) and not s.ok and first_failure is None:
                        first_failure = now
                    if finished(s) and not s.ok and not stopped and w not in own_codes:
                        code = state_exit_code(s)   # failed on its own, before babysit stopped
                        if code is not None:        # the others
                            own_codes[w] = code
                if self.before_maintenance and signalled is None and \
                        now - looked_at >= self.maintenance_poll:
                    looked_at = now
                    signalled = self._before_maintenance(pod, plan.run_id, workers)
                decision = decide(workers, states, api=self.api_reason(),
                                  unreachable_since=unreachable_since, now=now,
                                  unreachable_grace=self.unreachable_grace,
                                  first_failure_at=first_failure, failure_grace=self.failure_grace)
                if decision.action == "stop-others" and not stopped:
                    self.go_on(f"stopping run {plan.run_id}'s peers")
                    running = [w for w in workers if not (w in states and finished(states[w]))]
                    self.note(f"babysit: {decision.reason}; stopping the run on "
                              f"{nodeset.fold(running)} (a job without a peer only hangs).",
                              "yellow")
                    jobs.stop(pod.fanout, plan.run_id, running, grace=2.0)
                    stopped = True
                    continue
                if stalled is not None and stalled.killed and \
                        decision.action in ("finished", "failed"):
                    decision = Decision("stalled", stalled.reason(stacks="; stacks: {}"))
                if decision.action not in ("wait", "stop-others"):
                    break
                if not follower.is_alive() and "error" in box:
                    raise box["error"]
        except KeyboardInterrupt:
            self._stop.set()
            self.note(f"babysit: interrupted; stopping run {plan.run_id} ...", "yellow")
            try:
                jobs.stop(pod.fanout, plan.run_id, workers, grace=2.0)
            finally:
                self._end_follower(pod, follower, sink)
                self._keep_logs(pod, plan.run_id, states, attempt_dir)
                self.attempts.append(Attempt(number, plan.run_id, "interrupted", "Ctrl-C",
                                             attempt_dir, {w: s.label for w, s in states.items()}))
                self._write_summary()
            raise BabysitError(f"Interrupted: stopped run {plan.run_id} on "
                               f"{nodeset.fold(workers)}; babysit ended. Logs: "
                               f"{shown_path(attempt_dir)}/.", exit_code=130) from None
        self._end_follower(pod, follower, sink)
        if decision.action in ("preempted", "lost"):
            self.note(f"babysit: {decision.reason}; keeping whatever logs are reachable ...",
                      "yellow")
        self._keep_logs(pod, plan.run_id, states, attempt_dir)
        if signalled is not None and decision.action in ("finished", "failed"):
            # it ended after babysit asked it to checkpoint: a maintenance restart, whatever
            # its exit code (the error budget is for failures of its own)
            decision = Decision("maintenance", f"{signalled}; {decision.reason}")
            own_codes = {}
        return Attempt(number, plan.run_id, decision.action, decision.reason, attempt_dir,
                       {w: s.label for w, s in sorted(states.items())},
                       notices_in(attempt_dir), own_codes)

    def _stall_watch(self, pod, run_id: str, workers: Sequence[int], view, attempt_dir: Path):
        """``view`` under the stall watchdog: on a stall, every worker's stacks saved into
        ``attempt_dir`` and printed folded, then wait, or stop the run (kill, restart: the
        watch loop sees ``.killed`` and ends the attempt as stalled). Returns (the view,
        the handler)."""
        from tpufab.steps.health import stacks
        from tpufab.steps.runs import running as jobs
        from tpufab.steps.start import stall as stalls

        def take_stacks():
            report = stacks.capture(pod.fanout, workers, run=run_id,
                                    device_globs=pod.device_globs(),
                                    timeout=min(timeout_for("stacks", self.timeout),
                                                timeout_for("stacks")),
                                    progress=lambda text, style=None: self.note(
                                        f"babysit: {text}", style))
            if report.dumped and report.processes:
                try:
                    report.save(attempt_dir)
                except OSError as err:
                    self.note(f"babysit: could not save the stacks in {attempt_dir} ({err}).",
                              "yellow")
            return report

        def show(lines: Sequence[str]) -> None:
            for line in lines:
                self.note(line)

        progress = None if self.stall_progress_file is None else stalls.ProgressFile(
            pod.fanout, run_id, workers, self.stall_progress_file,
            timeout=min(timeout_for("run --stall-progress-file", self.timeout),
                        timeout_for("run --stall-progress-file")))
        handler = stalls.StallHandler(
            run_id, workers, self.stall, self.stall_action,
            lambda text, style=None: self.note(f"babysit: {text[:1].lower()}{text[1:]}",
                                               style), show,
            take_stacks=take_stacks, progress=progress,
            stop=lambda: jobs.stop(pod.fanout, run_id, list(workers), grace=2.0))
        last_output = stalls.LastOutput(
            pod.fanout, run_id, workers, timeout=min(timeout_for("run --stall: last output",
                                                                 self.timeout),
                                                     timeout_for("run --stall: last output")))
        tpu = stalls.TpuActivity(pod.fanout, run_id, workers, timeout=min(
            timeout_for("run --stall: TPU activity", self.timeout),
            timeout_for("run --stall: TPU activity")))
        return stalls.StallWatch(view, self.stall, handler, progress=progress,
                                 last_output=last_output, tpu=tpu), handler

    def _before_maintenance(self, pod, run_id: str, workers: Sequence[int]) -> str | None:
        """When a node's announced maintenance window starts within the margin (and this
        window was not signalled yet): send the recipe the checkpoint signal on every worker,
        with the notice in TPUFAB_PREEMPT_NOTICE and its log; the notice, or None."""
        from tpufab.cloud.nodes import _utc
        from tpufab.durations import human_duration

        for node in self._expected():
            try:
                upcoming = self.control.upcoming_maintenance(node)
            except TpufabError as err:
                self.note(f"babysit: could not read {node}'s upcoming maintenance ({err}).",
                          "yellow")
                return None
            if upcoming is None or upcoming.window_start is None:
                continue
            key = (node, upcoming.window_start.isoformat())
            left = upcoming.seconds_to_start() or 0.0
            if key in self._signalled_windows or left > self.maintenance_margin:
                continue
            self._signalled_windows.add(key)
            when = _utc(upcoming.window_start, "%Y-%m-%d %H:%M:%S UTC")
            notice = (f"maintenance: {upcoming.type or 'scheduled'} window on {node} at {when} "
                      f"(babysit --before-maintenance, margin "
                      f"{human_duration(self.maintenance_margin)})")
            got = pod.fanout.run(signal_command(run_id, self.before_maintenance, notice),
                                 workers=list(workers),
                                 timeout=timeout_for("babysit --before-maintenance",
                                                     self.timeout))
            try:
                failed = [w for w, r in got.items() if not r.ok]
            finally:
                got.close()
            where = nodeset.fold(w for w in workers if w not in failed)
            self.note(f"babysit: maintenance window on {node} at {when} "
                      f"(in {human_duration(max(0.0, left))}): sent SIG{self.before_maintenance} "
                      f"to run {run_id} on {where} to checkpoint; it restarts when it ends"
                      + (f" (could not signal {nodeset.fold(failed)})" if failed else "") + ".",
                      "yellow")
            return notice
        return None

    def _probe(self, pod, run_id: str, workers: Sequence[int]) -> dict[int, WorkerState]:
        """Ask workers nobody follows any more (their follower's connection broke) how the run
        stands there, over a fresh connection."""
        from tpufab.steps.runs import running as jobs
        from tpufab.steps.runs.running import WorkerState, state_from_status

        out = {}
        for w, answer in jobs.statuses(pod.fanout, list(workers), timeout=self.timeout).items():
            if answer.error is not None:
                out[w] = WorkerState(w, "unreachable", detail=answer.error)
                continue
            entry = next((e for e in answer.runs if e.get("run") == run_id), None)
            out[w] = state_from_status(w, entry) if entry else WorkerState(w, "no record")
        return out

    def _end_follower(self, pod, follower: threading.Thread, sink) -> None:
        if follower.is_alive():
            follower.join(2.0)
        if follower.is_alive():
            # connections that hang (a vanished VM): closing them ends the followers
            pod.fanout.close()
            follower.join(10.0)
        sink.close()

    def _keep_logs(self, pod, run_id: str, states: Mapping[int, WorkerState],
                   attempt_dir: Path) -> None:
        """The whole log of every worker that still answers (the copy made while following
        stops where a connection broke)."""
        from tpufab.steps.runs import running as jobs

        reachable = [w for w in pod.workers
                     if not (w in states and states[w].state == "unreachable")]
        if not reachable:
            return
        try:
            jobs.save_logs(pod.fanout, run_id, reachable, attempt_dir, self._secret_values())
        except (TpufabError, OSError) as err:
            self.note(f"babysit: could not fetch the logs ({err}).", "yellow")

    def _secret_values(self) -> list[str]:
        return list(self._forwarded().secrets.values())
