"""The stall watchdog of a followed run (`tpufab run --stall DURATION`, `launch`, `babysit`).

Progress is a new output line from any worker: the follower's view is wrapped
(:class:`StallWatch`), every line that reaches it resets the clock, and a silence is judged
only after asking the workers when they last wrote (:class:`LastOutput`): lines still on their
way are no silence (a client stopped by Ctrl-Z, then ``fg``, or by a debugger, finds its
followers' output waiting, and would otherwise judge before reading it). With a progress file
(``--stall-progress-file PATH``, :class:`ProgressFile`) progress is instead that file's mtime
advancing on any worker, read with one ``stat`` fan-out every few seconds over the open
connections. Where libtpu's metrics answer (:class:`TpuActivity`, one look every few seconds), TPUs at work
count as progress, so a pod busy on its TPUs is never stalled however quiet its output, and a
pod whose TensorCores are all idle for DURATION while the job prints is stalled all the same.
When no progress comes for DURATION, the watchdog takes every worker's stacks
(``Pod.stacks``: py-spy on the run's processes, saved beside the run's logs), prints the folded
summary (the odd workers first) on stderr and then acts: ``wait`` (the default) says so and
keeps following (it fires again only after new progress and another DURATION without),
``kill`` stops the run everywhere and the follow ends with the verdict (:class:`StallError`,
exit status 124, as ``timeout``'s). ``restart`` is babysit's (flows/babysit/): it stops the
attempt and starts the next one.
"""

from __future__ import annotations

import shlex
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from tpufab import nodeset
from tpufab.config import TIMEOUTS, timeout_for
from tpufab.durations import human_duration, parse_duration
from tpufab.errors import ConfigError, TpufabError, shown

FLOOR = 10.0              # seconds: below it, py-spy and the fan-out would be most of the wait
ACTIONS = ("wait", "kill", "restart")
EXIT_STALLED = 124
TICK = 0.5
PROBE_EVERY = (2.0, 30.0)  # seconds between progress-file reads: DURATION/5 within these
RUN_DIR = "$HOME/.tpufab/runs"   # the run's directory on a worker: $TPUFAB_RUN_DIR


class StallError(TpufabError):
    """The run stalled and --stall-action kill stopped it."""


def check_stall(stall: str | float | None, action: str | None, *,
                restart: bool = False) -> float | None:
    """--stall as seconds (None: no watchdog), or ConfigError in one sentence: not a
    duration, below the floor, an unknown action, ``restart`` where nothing restarts (only
    babysit, ``restart=True``, does)."""
    if action == "restart" and not restart:
        raise ConfigError("--stall-action restart needs something to start the next attempt, "
                          "which only babysit does: use `tpufab babysit RECIPE --stall "
                          "DURATION --stall-action restart`, or wait or kill here.")
    if action is not None and action not in ACTIONS:
        takes = "wait, kill or restart" if restart else "wait or kill"
        raise ConfigError(f"--stall-action takes {takes}, not {action!r}.")
    seconds = parse_duration(stall, "--stall")
    if seconds is not None and seconds < FLOOR:
        raise ConfigError(f"--stall {stall} is below the floor of {FLOOR:g} s (taking every "
                          f"worker's stacks takes seconds); use --stall {FLOOR:g}s or more.")
    return seconds


def check_progress_file(path: str | None) -> str | None:
    """--stall-progress-file: the path as given (None: none), or ConfigError in one sentence
    for an empty one or one with a ``..`` part (relative paths are inside the run's
    directory on the worker; ``..`` would leave it)."""
    if path is None:
        return None
    text = str(path)
    if not text.strip() or "\0" in text or "\n" in text:
        raise ConfigError("--stall-progress-file needs a file the recipe touches, such as "
                          "progress (in the run's directory, $TPUFAB_RUN_DIR, on each worker) "
                          "or an absolute path; it was empty.")
    if ".." in text.replace("\\", "/").split("/"):
        raise ConfigError(f"--stall-progress-file {shown(text)} has a '..' part; give a path "
                          "inside the run's directory ($TPUFAB_RUN_DIR), such as progress, or "
                          "an absolute one.")
    return text


def progress_probe_every(seconds: float) -> float:
    """Seconds between two reads of the progress file for a DURATION of ``seconds``."""
    low, high = PROBE_EVERY
    return min(high, max(low, seconds / 5))


class ProgressFile:
    """The progress file of one run on its workers: ``advanced()`` reads every worker's mtime
    in one fan-out (``stat``) and says whether any of them moved since the last read (a file
    that appears counts; a worker that does not answer, or has no file, does not)."""

    def __init__(self, fanout, run_id: str, workers: Sequence[int], path: str, *,
                 timeout: float | None = None):
        self.fanout = fanout
        self.workers = list(workers)
        self.path = path
        self.timeout = timeout_for("run --stall-progress-file", timeout)
        self.seen: dict[int, str] = {}
        self.command = f"stat -c %Y -- {self.where(run_id, path)} 2>/dev/null || true"

    @staticmethod
    def where(run_id: str, path: str) -> str:
        """The path as a shell word on the worker (quoted; $HOME expanded there)."""
        if path.startswith("/"):
            return shlex.quote(path)
        if path == "~" or path.startswith("~/"):
            return '"$HOME"/' + shlex.quote(path[2:] or ".")
        return f'"{RUN_DIR}"/' + shlex.quote(run_id) + "/" + shlex.quote(path)

    def read(self) -> dict[int, str]:
        """worker -> the file's mtime (seconds, as stat prints it) where it exists."""
        got = self.fanout.run(self.command, workers=self.workers, timeout=self.timeout)
        try:
            return {w: r.stdout.strip() for w, r in got.items()
                    if r.ok and r.stdout.strip().isdigit()}
        finally:
            got.close()

    def advanced(self) -> bool:
        now = self.read()
        moved = any(self.seen.get(w) != mtime for w, mtime in now.items())
        self.seen.update(now)
        return moved

    def describe(self) -> str:
        return f"the progress file {self.path}"


class TpuActivity:
    """Whether a run's TPUs work: ``look()`` asks every worker's libtpu metrics service once
    (``top_worker.py --stream`` for one sample, one fan-out) and answers True when some
    host's chips ran a program since the last look (or show a duty cycle), False when every
    host answered and all its TensorCores were idle, None when it cannot say (no metrics
    somewhere: no holder, no gRPC client). A pod where no host answers the first look is not
    asked again."""

    def __init__(self, fanout, run_id: str, workers: Sequence[int], *,
                 timeout: float | None = None):
        self.fanout = fanout
        self.run_id = run_id
        self.workers = list(workers)
        self.timeout = timeout_for("run --stall: TPU activity", timeout)
        self.programs: dict[int, float] = {}
        self.looked = False
        self.enabled = True

    def samples(self) -> dict[int, dict]:
        """worker -> its sample, where it answered one."""
        from tpufab.ssh.remote_files import read_answers, run_script

        got = run_script(self.fanout, "top_worker.py", ["--stream", "--run", self.run_id,
                                                         "--every", "0.25", "--for", "0.01"],
                         self.workers, timeout=self.timeout)
        try:
            found = {}
            for w, r in got.items():
                answers = [a for _, a in read_answers(r.stdout, "sample") if isinstance(a, dict)]
                if answers:
                    found[w] = answers[-1]
            return found
        finally:
            got.close()

    def look(self) -> bool | None:
        if not self.enabled:
            return None
        busy, idle = [], []
        for w, sample in self.samples().items():
            chips = [c for c in sample.get("chips") or () if isinstance(c, dict)]
            if not sample.get("available") or not chips:
                continue
            try:
                programs = sum(float(c.get("programs") or 0) for c in chips)
                duty = max(float(c.get("duty_cycle_percent") or 0) for c in chips)
            except (TypeError, ValueError):
                continue
            ran = w in self.programs and programs > self.programs[w]
            self.programs[w] = programs
            (busy if ran or duty >= 1.0 else idle).append(w)
        first, self.looked = not self.looked, True
        if first and not busy and not idle:
            self.enabled = False
        if busy:
            return True
        return False if len(idle) == len(self.workers) else None


class LastOutput:
    """When one run's workers last wrote output: ``age()`` asks them (``run_worker.py status
    --run``, one fan-out) and answers the seconds since the youngest of their logs grew, on
    their own clocks (None: no worker could say)."""

    def __init__(self, fanout, run_id: str, workers: Sequence[int], *,
                 timeout: float = TIMEOUTS["run --stall: last output"].seconds):
        self.fanout = fanout
        self.run_id = run_id
        self.workers = list(workers)
        self.timeout = timeout

    def age(self) -> float | None:
        from tpufab.steps.runs.running import statuses

        ages = [entry["log_age"] for answer in statuses(
                    self.fanout, self.workers, timeout=self.timeout, runs=[self.run_id]).values()
                for entry in answer.runs
                if entry.get("run") == self.run_id and isinstance(entry.get("log_age"),
                                                                   (int, float))]
        return min(ages, default=None)


class StallWatch:
    """A view (``lines``/``done``/``close``) that passes everything to ``view`` and calls
    ``on_stall(silence_seconds)`` from its own thread when no progress came for ``seconds``:
    once per silence. Progress is a new line, or with ``progress`` (a :class:`ProgressFile`)
    only that file's mtime advancing on some worker (read every ``progress_probe_every``).
    With ``last_output`` (a :class:`LastOutput`), a silence of lines is judged only once the
    workers say they wrote nothing for ``seconds`` either: a worker that wrote since means its
    lines are on their way (the client was paused, or starved), and the clock restarts from
    the moment it wrote."""

    def __init__(self, view, seconds: float, on_stall: Callable[..., None],
                 progress: ProgressFile | None = None, last_output: LastOutput | None = None,
                 tpu: TpuActivity | None = None):
        self.view = view
        self.seconds = seconds
        self.on_stall = on_stall
        self.progress = progress
        self.last_output = last_output
        self.tpu = tpu
        self.tpu_busy: bool | None = None     # the last look's answer
        self.tpu_idle_since: float | None = None
        self.tpu_fired = False
        self.probe_every = progress_probe_every(seconds)
        self.last = time.monotonic()
        self.fired = False
        self.stalls = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="tpufab-stall", daemon=True)
        self._thread.start()
        # the TPU looks in a thread of their own: a slow look never delays a verdict
        self._tpu_thread = None
        if tpu is not None:
            self._tpu_thread = threading.Thread(target=self._watch_tpus, daemon=True,
                                                name="tpufab-stall-tpu")
            self._tpu_thread.start()

    def lines(self, worker: int, stream: str, data: bytes) -> None:
        if data and self.progress is None:
            self._progressed()
        self.view.lines(worker, stream, data)

    def _progressed(self) -> None:
        self.last = time.monotonic()
        self.fired = False

    def done(self, result) -> None:
        self.view.done(result)

    def close(self) -> None:
        self._stop.set()
        for thread in (self._thread, self._tpu_thread):
            if thread is not None and thread is not threading.current_thread():
                thread.join(5)
        close = getattr(self.view, "close", None)
        if close is not None:
            close()

    def _look_at_tpus(self) -> None:
        """TPUs at work are progress; all idle for ``seconds`` while lines come: a stall."""
        try:
            busy = self.tpu.look() if self.tpu is not None else None
        except Exception:  # noqa: BLE001 - no answer: the lines decide
            busy = None
        self.tpu_busy = busy
        if busy:
            self._progressed()
        if busy is not False:
            self.tpu_idle_since, self.tpu_fired = None, False
            return
        now = time.monotonic()
        if self.tpu_idle_since is None:
            self.tpu_idle_since = now
        idle = now - self.tpu_idle_since
        if idle >= self.seconds and not self.tpu_fired and not self.fired and \
                not self._stop.is_set():
            self.tpu_fired = True
            self.stalls += 1
            try:
                self.on_stall(idle, tpu_idle=True)
            except Exception as err:  # noqa: BLE001 - the follow goes on; say why
                self._say(f"The stall watchdog could not take stacks: {err}")

    def _watch_tpus(self) -> None:
        while not self._stop.is_set() and self.tpu is not None and self.tpu.enabled:
            began = time.monotonic()
            self._look_at_tpus()
            self._stop.wait(max(TICK, self.probe_every - (time.monotonic() - began)))

    def _watch(self) -> None:
        probed = 0.0
        while not self._stop.wait(TICK):
            if self.progress is not None and time.monotonic() - probed >= self.probe_every:
                probed = time.monotonic()
                try:
                    if self.progress.advanced():
                        self._progressed()
                except Exception as err:  # noqa: BLE001 - a failed read is no progress; say so
                    if not self._stop.is_set():    # (not when the follow ended meanwhile)
                        self._say(f"The stall watchdog could not read "
                                  f"{self.progress.describe()}: {err}")
                if self._stop.is_set():
                    break
            silence = time.monotonic() - self.last
            if silence >= self.seconds and not self.fired and self._silent_there() and \
                    not self._tpus_at_work():
                self.fired = True
                self.stalls += 1
                try:
                    self.on_stall(silence)
                except Exception as err:  # noqa: BLE001 - the follow goes on; say why
                    self._say(f"The stall watchdog could not take stacks: {err}")

    def _tpus_at_work(self) -> bool:
        """The last look (at most a probe period old) says the TPUs work: no stall."""
        if self.tpu is None or not self.tpu.enabled or not self.tpu_busy:
            return False
        self._progressed()
        return True

    def _silent_there(self) -> bool:
        """The workers wrote nothing for ``seconds`` either (or cannot say); else the clock
        restarts from when one of them last wrote."""
        if self.progress is not None or self.last_output is None:
            return True
        try:
            age = self.last_output.age()
        except Exception:  # noqa: BLE001 - no answer: the silence seen here decides
            return True
        if age is None or age >= self.seconds:
            return True
        self.last = max(self.last, time.monotonic() - age)
        return False

    def _say(self, text: str) -> None:
        import sys

        sys.stderr.write(text + "\n")
        sys.stderr.flush()


class StallHandler:
    """What a stall does to a followed run: stacks, the summary, then wait, kill or (babysit)
    restart. ``take_stacks()`` returns a StacksReport (saved where the run's logs are);
    ``stop()`` stops the run everywhere; ``say(text, style)`` prints tpufab's notes;
    ``show(lines)`` the folded stacks; ``progress``: the ProgressFile watched, if any."""

    def __init__(self, run_id: str, workers: Sequence[int], seconds: float, action: str,
                 say: Callable[..., None], show: Callable[[list[str]], None], *,
                 take_stacks: Callable[[], object], stop: Callable[[], object],
                 progress: ProgressFile | None = None):
        self.run_id = run_id
        self.workers = list(workers)
        self.seconds = seconds
        self.action = action or "wait"
        self.say = say
        self.show = show
        self.take_stacks = take_stacks
        self.stop = stop
        self.progress = progress
        self.killed = False
        self.saved: str | None = None
        self.odd: list[int] = []
        self.tpu_idle = False       # the last stall: every TensorCore idle while it printed

    def signal(self, seconds: float, *, where: str = " from any worker") -> str:
        """Which progress was missing, and for how long (the watched signal, said)."""
        if self.tpu_idle:
            return (f"every host's TensorCores were idle for {human_duration(seconds)} while "
                    "the job printed")
        if self.progress is not None:
            return (f"{self.progress.describe()} did not advance on any worker for "
                    f"{human_duration(seconds)}")
        return f"no new output{where} for {human_duration(seconds)}"

    def __call__(self, silence: float, *, tpu_idle: bool = False) -> None:
        self.tpu_idle = tpu_idle
        flag = f"--stall {human_duration(self.seconds)}"
        if self.progress is not None:
            flag += f" --stall-progress-file {self.progress.path}"
        said = self.signal(silence)
        self.say(f"{said[0].upper()}{said[1:]} ({flag}): taking every worker's stacks ...",
                 "yellow")
        from tpufab.steps.health.stacks import lines
        from tpufab.term.terminal import relative_path

        report: Any = self.take_stacks()
        self.odd = list(report.odd)
        if report.saved:
            self.saved = relative_path(report.saved[0])
        if report.dumped and report.processes:
            self.show(lines(report))
        else:
            for line in lines(report):
                self.say(line, "dim")
        where = f"; stacks saved to {self.saved}" if self.saved else ""
        odd = (f"{nodeset.fold(self.odd)} differ{'s' if len(self.odd) == 1 else ''} from the "
               "others" if self.odd else "every worker is at the same place")
        if self.action in ("kill", "restart"):
            then = " to start the next attempt" if self.action == "restart" else ""
            self.say(f"Run {self.run_id} stalled ({odd}{where}); stopping it on "
                     f"{nodeset.fold(self.workers)}{then} (--stall-action {self.action}) ...",
                     "yellow")
            self.killed = True
            self.stop()
            return
        self.say(f"Run {self.run_id} stalled ({odd}{where}); still waiting for it "
                 "(--stall-action wait, the default; Ctrl-C to stop following or to stop the "
                 "run).", "yellow")

    def reason(self, *, stacks: str = " (stacks: {})") -> str:
        """The stall in a few words: what was missing, who differed, where the stacks are
        (``stacks``: how the path is said)."""
        odd = f"; {nodeset.fold(self.odd)} differed from the others" if self.odd else ""
        where = stacks.format(self.saved) if self.saved else ""
        return f"{self.signal(self.seconds, where='')}{odd}{where}"

    def verdict(self) -> StallError:
        return StallError(f"Run {self.run_id} stalled: {self.reason()}; it was stopped on "
                          f"{nodeset.fold(self.workers)} (--stall-action {self.action}).",
                          exit_code=EXIT_STALLED)

