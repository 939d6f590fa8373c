"""stacks: every worker's Python stacks in one fan-out, folded like `tpufab logs`.

The worker side is ``tpufab/remote/stacks_worker.py`` (py-spy ``dump --json`` on a run's
Python processes, or on the TPU's Python holders; one JSON answer per worker), run as root
through ``sudo -n`` where the login user may (py-spy must attach to processes it did not
start). Here: the command (pure), the fan-out, a second try where py-spy was missing (a
``pip install py-spy`` in the workers' venv), and the fold (pure): a thread whose stack is the
same on several workers is shown once under their folded label (``w[0-62]``); the workers
whose stacks differ from the rest are shown first, each differing stack on its own with the
frame where it leaves the others' stack marked.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from tpufab import nodeset
from tpufab.config import TIMEOUTS, timeout_for
from tpufab.errors import ConfigError, TpufabError
from tpufab.quoting import Command, Raw
from tpufab.reports import Report, last_line
from tpufab.ssh.remote_files import (
    RemoteFile,
    python_command,
    read_answer,
    run_with_files,
)
from tpufab.topology import DEVICE_GLOBS

STACKS_WORKER = "stacks_worker.py"
TIMEOUT = TIMEOUTS["stacks"].seconds   # seconds a worker has to dump every process
# What tpufab reads of one worker's answer: the worker keeps its own under 6 MiB
# (stacks_worker.MAX_ANSWER); past this a worker (or its py-spy) is not what it claims, and
# is stopped rather than read on. The saved text and JSON of a capture are bounded by it too.
MAX_ANSWER_BYTES = 8 << 20
# A name py-spy reports (a frame's function or file, a thread's name) holding one of these
# could forge the lines around it (a newline makes a block header of its own): refused.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


class StacksError(TpufabError):
    """No stacks could be taken (no such run, nothing running, py-spy missing)."""


# -- the command (pure) ---------------------------------------------------------------------------


def stacks_command(*, run: str | None = None, native: bool = False,
                   device_globs: Sequence[str] = DEVICE_GLOBS, install: bool = False) -> Command:
    """The stacks worker's command line (``install``: put py-spy where it runs it: root's,
    hashed, when it runs as root)."""
    # the login user's home (its runs, its venv's py-spy), also when sudo makes it root
    args: list = [Raw('--home="$HOME"')]
    if install:
        return python_command(RemoteFile.bundled(STACKS_WORKER), [*args, "--install"],
                              as_root=True)
    args += ["--run", run] if run else ["--latest"]
    if native:
        args.append("--native")
    for pattern in device_globs:
        args += ["--devices-glob", pattern]
    return python_command(RemoteFile.bundled(STACKS_WORKER), args, as_root=True)


def check_run(run: str | None) -> None:
    from tpufab.steps.runs.env import is_run_id

    if run is not None and not is_run_id(run):
        raise ConfigError(f"{run!r} is not a run id (they look like 20261122-104455-ab12); "
                          "`tpufab runs` lists them.")


# -- the fold (pure) --------------------------------------------------------------------------------


def frame_text(frame: Mapping) -> str:
    """``function (file:line)``; a native frame without a symbol is ``? (library)`` (its
    address differs from process to process, so it never splits a fold)."""
    name = str(frame.get("function") or "?")
    where = str(frame.get("file") or "")
    if name.startswith("0x"):
        return f"? ({where})" if where else "?"
    line = frame.get("line")
    if line:
        return f"{name} ({where}:{line})"
    return f"{name} ({where})" if where else name


_RECIPE_COPY = re.compile(r"\S*/\.tpufab/runs/[^/\s]+/recipe/")


def short_command(command) -> str:
    """A run's command as the user wrote it: the run's copy of the recipe
    (``~/.tpufab/runs/ID/recipe/train.py``) named by its file name."""
    return _RECIPE_COPY.sub("", str(command or ""))


@dataclass(frozen=True)
class StackKey:
    """What makes two threads "the same stack": the process's command, the thread's name and
    every frame (pids and thread ids differ from worker to worker and are left out)."""

    command: str
    thread: str
    frames: tuple[str, ...]


@dataclass
class Folded:
    """One stack and the workers where a thread has it (``pids``: worker -> pid)."""

    key: StackKey
    workers: list[int]
    pids: dict[int, int]
    odd: bool = False
    differs_at: int | None = None     # index in frames of the first frame unlike the others'
    others: str = ""                  # the others' label
    others_frame: str = ""            # their frame at that depth

    @property
    def label(self) -> str:
        return nodeset.fold(self.workers)


@dataclass
class Unattached:
    """Processes py-spy could not read, with the same reason, on ``workers``."""

    command: str
    reason: str
    fix: str
    pids: dict[int, int]

    @property
    def workers(self) -> list[int]:
        return sorted(self.pids)


def fold_stacks(answers: Mapping[int, Mapping]) -> tuple[list[Folded], list[int]]:
    """The stacks of every worker's answer folded: (entries in the order shown, odd workers).

    Threads are compared by process command and thread name: where they have more than one
    stack, the stack most workers share is the others' (ties: the one with the lowest
    worker) and every other is odd, marked at the frame where it leaves that stack. Odd
    stacks come first, then the rest, the most widespread first. A thread only some workers
    have (a server thread on worker 0) is shown under its workers and makes none of them odd.
    """
    where: dict[StackKey, dict[int, int]] = {}
    for w in sorted(answers):
        for proc in answers[w].get("processes") or ():
            for thread in proc.get("threads") or ():
                key = StackKey(short_command(proc.get("command")),
                               str(thread.get("name") or "(unnamed)"),
                               tuple(frame_text(f) for f in thread.get("frames") or ()))
                where.setdefault(key, {}).setdefault(w, int(proc.get("pid") or 0))
    entries = [Folded(key, sorted(pids), dict(sorted(pids.items())))
               for key, pids in where.items()]
    threads: dict[tuple[str, str], list[Folded]] = {}
    for entry in entries:
        threads.setdefault((entry.key.command, entry.key.thread), []).append(entry)
    odd: set[int] = set()
    for same in threads.values():
        if len(same) < 2:
            continue
        common = max(same, key=lambda e: (len(e.workers), -min(e.workers)))
        for entry in same:
            if entry is not common:
                entry.odd = True
                odd.update(entry.workers)
                _mark(entry, [common])
    entries.sort(key=lambda e: (not e.odd, 0 if e.odd else -len(e.workers), min(e.workers),
                                e.key.command, e.key.thread))
    return entries, sorted(odd)


def _mark(entry: Folded, others: list[Folded]) -> None:
    """Where ``entry`` leaves the most widespread of ``others``: its outermost frame that
    the other stack does not have at the same depth (frames run innermost first)."""
    if not others:
        return
    other = max(others, key=lambda e: (len(e.workers), -min(e.workers)))
    mine, theirs = entry.key.frames, other.key.frames
    # by function first: "main (x.py:50)" vs "main (x.py:48)" calls on into different
    # functions, and the function it calls is the news; by the whole frame when only lines differ
    shared = _shared_outer([_function(f) for f in mine], [_function(f) for f in theirs])
    if shared == len(mine) or shared == len(theirs):
        shared = _shared_outer(list(mine), list(theirs))
    if shared == len(mine):
        return
    entry.differs_at = len(mine) - 1 - shared
    entry.others = other.label
    entry.others_frame = theirs[len(theirs) - 1 - shared] if shared < len(theirs) else \
        "(returned here)"


def _function(frame: str) -> str:
    return frame.split(" (", 1)[0]


def _shared_outer(mine: list[str], theirs: list[str]) -> int:
    """How many outermost frames (the ends of the lists) the two stacks share."""
    shared = 0
    while shared < min(len(mine), len(theirs)) and mine[-1 - shared] == theirs[-1 - shared]:
        shared += 1
    return shared


def unattached(answers: Mapping[int, Mapping]) -> list[Unattached]:
    found: dict[tuple[str, str, str], Unattached] = {}
    for w in sorted(answers):
        for proc in answers[w].get("processes") or ():
            if proc.get("threads") is not None:
                continue
            key = (short_command(proc.get("command")), str(proc.get("reason") or proc.get("error")),
                   str(proc.get("fix") or ""))
            found.setdefault(key, Unattached(*key, {})).pids[w] = int(proc.get("pid") or 0)
    return list(found.values())


# -- the report ------------------------------------------------------------------------------------


@dataclass
class StacksRow:
    """One worker's row: what its stacks worker answered (``answer``; ``ok`` when it dumped
    its processes), or why it answered nothing (``error``)."""

    worker: int
    ok: bool
    answer: dict | None = None
    error: str | None = None


@dataclass
class StacksReport(Report):
    """Every chosen worker's row (``.answers`` what they answered, ``.errors`` why the others
    did not), as a ``tpufab.reports.Report``; printed by tpufab.views.stacks (the view
    ``stacks``), which also writes the saved text and JSON."""

    workers: list[int]
    native: bool = False
    taken_at: float = field(default_factory=time.time)
    install_errors: dict[int, str] = field(default_factory=dict)
    saved: list[Path] = field(default_factory=list)
    step: str = field(default="stacks", kw_only=True)

    view: ClassVar[str] = "stacks"

    @property
    def answers(self) -> dict[int, dict]:
        return {r.worker: r.answer for r in sorted(self.rows, key=lambda r: r.worker)
                if r.answer is not None}

    @property
    def errors(self) -> dict[int, str]:
        return {r.worker: r.error or "no answer"
                for r in sorted(self.rows, key=lambda r: r.worker) if r.answer is None}

    @property
    def dumped(self) -> dict[int, dict]:
        return {w: a for w, a in self.answers.items() if a.get("ok")}

    @property
    def run(self) -> str | None:
        runs = {a.get("run") for a in self.dumped.values() if a.get("source") == "run"}
        return runs.pop() if len(runs) == 1 else None

    @property
    def source(self) -> str:
        sources = {a.get("source") for a in self.dumped.values()}
        return "run" if "run" in sources else "tpu holders"

    def fold(self) -> tuple[list[Folded], list[int]]:
        return fold_stacks(self.dumped)

    @property
    def odd(self) -> list[int]:
        return self.fold()[1]

    @property
    def unattached(self) -> list[Unattached]:
        """The processes py-spy could not read, folded by reason."""
        return unattached(self.dumped)

    @property
    def errors_by_reason(self) -> dict[str, list[int]]:
        return _by_text(self.errors)

    @property
    def missing_py_spy(self) -> list[int]:
        return sorted(w for w, a in self.answers.items() if a.get("missing_py_spy"))

    @property
    def processes(self) -> int:
        return sum(len(a.get("processes") or ()) for a in self.dumped.values())

    def nothing_text(self, workers: Iterable[int]) -> str:
        """Why ``workers`` had nothing to dump, in words."""
        states = {self.answers[w].get("run_state") for w in workers}
        source = {self.answers[w].get("source") for w in workers}
        run = {self.answers[w].get("run") for w in workers}
        if source == {"run"} and len(run) == 1:
            state = states.pop() if len(states) == 1 else None
            return f"no Python process of run {run.pop()} is running" + \
                (f" (it is {state} there)" if state and state != "running" else "")
        return "no run is running and no Python process holds the TPU"

    def save(self, folder: Path) -> list[Path]:
        """``stacks-<time>.txt`` (the folded view) and ``.json`` (everything) in ``folder``
        (private files, as the run's logs beside them): the lines and JSON below."""
        from tpufab.steps.runs.running import open_private, private_dir

        private_dir(folder)
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(self.taken_at))
        text, data = folder / f"stacks-{stamp}.txt", folder / f"stacks-{stamp}.json"
        self.saved = [text, data]
        limit = MAX_ANSWER_BYTES * max(1, len(self.rows))    # what was read, at most
        body = ("\n".join(lines(self)) + "\n").encode()
        if len(body) > limit:
            body = body[:limit] + f"\n(cut at {limit >> 20} MiB)\n".encode()
        with open_private(text, "wb") as fh:
            fh.write(body)
        with open_private(data, "wb") as fh:
            fh.write(json.dumps(to_json(self), indent=1, sort_keys=True).encode() + b"\n")
        return self.saved

    def check(self) -> StacksReport:
        """This report, or StacksError in one sentence: no such run, py-spy missing and not
        installable, nothing to dump anywhere, a worker that did not answer."""
        asked_run = {a.get("error") for a in self.answers.values() if not a.get("ok")
                     and not a.get("missing_py_spy")}
        if self.missing_py_spy:
            why = "; ".join(f"{nodeset.fold(ws)}: {text}" for text, ws in
                            _by_text({w: self.install_errors.get(w, "not tried")
                                      for w in self.missing_py_spy}).items())
            raise StacksError(
                f"py-spy is missing on {nodeset.fold(self.missing_py_spy)} and could not be "
                f"installed there ({why}); install it (`tpufab setup` does, or `tpufab exec -- "
                "~/.venv/bin/python -m pip install py-spy`) and run `tpufab stacks` again.")
        no_run = sorted(w for w, a in self.answers.items()
                        if str(a.get("error") or "").startswith("no run "))
        if no_run and not self.dumped:
            run = str(self.answers[no_run[0]].get("error"))[len("no run "):].split()[0]
            raise StacksError(f"No run {run} on {nodeset.fold(no_run)}; `tpufab runs` lists "
                              "the runs there.")
        if self.errors:
            detail = "; ".join(f"{nodeset.fold(ws)}: {why}"
                               for why, ws in _by_text(self.errors).items())
            raise StacksError(f"No stacks from {nodeset.fold(self.errors)} ({detail}); check "
                              "them with `tpufab status` and run `tpufab stacks` again.")
        if asked_run - {None} and not self.dumped:
            raise StacksError("; ".join(sorted(str(e) for e in asked_run if e)) + ".")
        if self.dumped and not self.processes:
            raise StacksError(f"Nothing to dump on {nodeset.fold(self.dumped)}: "
                              f"{self.nothing_text(self.dumped)}.")
        missed = self.unattached
        if missed:
            count = sum(len(item.pids) for item in missed)
            where = nodeset.fold({w for item in missed for w in item.workers})
            raise StacksError(f"py-spy could not read {count} process{'es' if count > 1 else ''}"
                              f" on {where} (why and the fix above); the stacks above miss "
                              f"{'them' if count > 1 else 'it'}.")
        return self


def _by_text(reasons: Mapping[int, str]) -> dict[str, list[int]]:
    found: dict[str, list[int]] = {}
    for w, why in sorted(reasons.items()):
        found.setdefault(why, []).append(w)
    return found


# -- the fan-out --------------------------------------------------------------------------------


def save_beside_logs(report: StacksReport, *, keep_runs: int, keep_gib: float) -> None:
    """The folded text and the JSON of what was dumped beside the run's local logs
    (./.tpufab/runs/ID/stacks-TIME.txt and .json; ./.tpufab/stacks/ without a run):
    ``report.saved``; nothing where that cannot be written."""
    from tpufab.steps.runs import running as jobs

    if not (report.dumped and report.processes):
        return
    try:
        folder = jobs.local_log_dir(report.run, keep_runs=keep_runs, keep_gib=keep_gib) \
            if report.run else jobs.private_dir(Path.cwd() / ".tpufab" / "stacks")
        report.save(folder)
    except OSError:
        pass


def capture(fanout, workers: Sequence[int], *, run: str | None = None, native: bool = False,
            device_globs: Sequence[str] = DEVICE_GLOBS, timeout: float | None = None,
            install: bool = True, progress=None) -> StacksReport:
    """py-spy on every chosen worker at once; where py-spy is missing, one ``pip install
    py-spy`` there (``install``) and one more try. ``timeout``: seconds a worker may take."""
    check_run(run)
    timeout = timeout_for("stacks", timeout)
    line = stacks_command(run=run, native=native, device_globs=device_globs)
    files = [RemoteFile.bundled(STACKS_WORKER)]
    report = StacksReport(list(workers), native=native)
    _read(report, run_with_files(fanout, files, line, workers, timeout=timeout,
                                 sink=CappedAnswers()))
    missing = report.missing_py_spy
    if missing and install:
        if progress is not None:
            progress(f"py-spy is missing on {nodeset.fold(missing)}; installing it there ...",
                     "dim")
        installed = run_with_files(fanout, files, stacks_command(install=True), missing,
                                   timeout=timeout_for("stacks: install py-spy"), sink=CappedAnswers())
        again = []
        for w, r in installed.items():
            answer = read_answer(getattr(r, "stdout", "") or "") if getattr(r, "ok", False) \
                else None
            if answer is not None and answer.get("ok"):
                again.append(w)
            else:
                report.install_errors[w] = str((answer or {}).get("error") or _pip_error(r))
        if again:
            _read(report, run_with_files(fanout, files, line, again, timeout=timeout,
                                         sink=CappedAnswers()))
            for w in report.missing_py_spy:
                report.install_errors.setdefault(w, "installed, but py-spy is still not found")
    return report


class AnswerTooLarge(Exception):
    """A worker's answer went past MAX_ANSWER_BYTES (its command is stopped)."""


class CappedAnswers:
    """A fan-out sink that stops a worker's command once its output passes
    ``MAX_ANSWER_BYTES`` (the fan-out then stops it and names the sink's error)."""

    exact = True

    def __init__(self, limit: int = MAX_ANSWER_BYTES):
        self.limit = limit
        self.seen: dict[int, int] = {}

    def lines(self, worker: int, stream: str, data: bytes) -> None:
        self.seen[worker] = self.seen.get(worker, 0) + len(data)
        if self.seen[worker] > self.limit:
            raise AnswerTooLarge(f"more than {self.limit >> 20} MiB")

    def done(self, result) -> None:
        pass


def refuse_control_characters(answer: dict) -> dict:
    """A worker's answer with every process whose stacks name a thread, function or file
    holding a control character (a newline would forge a header of the folded view), or are
    not the shape py-spy's are, replaced by a process py-spy could not read, saying why; a
    command holding one is shown escaped."""
    for proc in answer.get("processes") or ():
        if not isinstance(proc, dict):
            continue
        command = str(proc.get("command") or "")
        proc["command"] = _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", command)
        threads = proc.get("threads")
        if threads is None:
            continue
        if _stack_names(threads) is None:
            proc.pop("threads")
            proc["error"] = ("py-spy's answer names a thread, function or file with control "
                             "characters")
            proc["reason"] = ("its stacks hold names with control characters (a newline, an "
                              "escape) or are not py-spy's shape, which tpufab does not show: a "
                              "forged py-spy or a hostile process")
            proc["fix"] = f"look at it on the worker: `sudo py-spy dump --pid {proc.get('pid')}`"
    return answer


def _stack_names(threads) -> list[str] | None:
    """Every name in ``threads`` (py-spy's shape), or None when one holds a control
    character or the shape is not py-spy's."""
    if not isinstance(threads, list):
        return None
    names = []
    for thread in threads:
        if not isinstance(thread, dict) or not isinstance(thread.get("frames") or [], list):
            return None
        names.append(str(thread.get("name") or ""))
        for frame in thread.get("frames") or ():
            if not isinstance(frame, dict):
                return None
            names += [str(frame.get("function") or ""), str(frame.get("file") or "")]
    return None if any(_CONTROL.search(n) for n in names) else names


def _pip_error(result) -> str:
    """pip's own error line (``error: externally-managed-environment``), else its last."""
    if result.error:
        return str(result.error)[:200]
    lines = [line.strip() for line in (result.stderr or "").splitlines() if line.strip()]
    errors = [line for line in lines if line.lower().startswith(("error", "ERROR"))]
    return ((errors or lines or [f"pip exited {result.exit_code}"])[0])[:200]


def _read(report: StacksReport, results: Mapping[int, object]) -> None:
    """Each worker's answer (or why none) as its row, in place of any row it had."""
    rows = {r.worker: r for r in report.rows}
    for w, r in sorted(results.items()):
        data = read_answer(getattr(r, "stdout", "")) if getattr(r, "ok", False) else None
        if data is None:
            error = getattr(r, "error", None) or last_line(getattr(r, "stderr", "")) \
                or f"exit status {getattr(r, 'exit_code', '?')}"
            if "AnswerTooLarge" in str(error):
                error = (f"its answer went past {MAX_ANSWER_BYTES >> 20} MiB (a forged py-spy "
                         "or a tampered worker?), so tpufab stopped it and kept none of it")
            rows[w] = StacksRow(w, False, error=str(error)[:200])
        else:
            rows[w] = StacksRow(w, bool(data.get("ok")), answer=refuse_control_characters(
                data))
    report.rows = [rows[w] for w in sorted(rows)]


# -- the report's pure text: the folded stacks as lines and as JSON (tpufab.views.stacks shows
# them; the saved copies and the stall watchdog's summary are the same) -------------------------
MARK = "<-- differs"


def _short(command: str, width: int = 70) -> str:
    """What names the command, within ``width`` (tpufab.term.commands; --json has it whole)."""
    from tpufab.term.commands import short_command as named

    return named(command, width)


def render(entries: Sequence[Folded], odd: Sequence[int], *, total: int) -> list[str]:
    """The folded stacks as text lines (``total``: how many workers answered with stacks)."""
    lines: list[str] = []
    for entry in entries:
        head = entry.label
        if entry.odd:
            head += " (differs)"
        if len(entry.workers) == 1:
            [pid] = entry.pids.values()
            head += f" · pid {pid}"
        head += f" · `{_short(entry.key.command)}` · thread {entry.key.thread}"
        lines.append(head)
        for i, frame in enumerate(entry.key.frames or ("(no Python frames)",)):
            text = f"    {frame}"
            if entry.differs_at == i:
                text += f"   {MARK}: {entry.others} are in {entry.others_frame}"
            lines.append(text)
        lines.append("")
    return lines


def headline(report: StacksReport) -> str:
    entries, odd = report.fold()
    what = f"run {report.run}" if report.run else (
        "the runs" if report.source == "run" else "the TPU's Python holders")
    there = nodeset.fold(report.dumped) or "no worker"
    text = (f"Stacks of {what} on {there}: {report.processes} process"
            f"{'es' if report.processes != 1 else ''}, {len(entries)} distinct "
            f"stack{'s' if len(entries) != 1 else ''}")
    if odd:
        text += f"; {nodeset.fold(odd)} differ{'s' if len(odd) == 1 else ''} (shown first)"
    elif entries and len(report.dumped) > 1:
        text += "; no worker differs"
    return text + "."


def lines(report: StacksReport) -> list[str]:
    """The folded view: a headline, odd workers' stacks first, then the rest, then the
    processes py-spy could not read and the workers with nothing to read (pure)."""
    entries, odd = report.fold()
    out = [headline(report), ""]
    out += render(entries, odd, total=len(report.dumped))
    for item in report.unattached:
        pids = ", ".join(str(p) for p in item.pids.values())
        out.append(f"{nodeset.fold(item.workers)} · pid {pids} `{_short(item.command)}`: "
                   f"py-spy cannot attach: {item.reason}; fix: {item.fix}.")
    idle = [w for w, a in report.dumped.items() if not a.get("processes")]
    if idle:
        out.append(f"{nodeset.fold(idle)}: {report.nothing_text(idle)}.")
    for why, ws in report.errors_by_reason.items():
        out.append(f"{nodeset.fold(ws)}: no stacks ({why}).")
    return out


def folded_json(entry: Folded) -> dict[str, Any]:
    return {"workers": entry.workers, "label": entry.label, "odd": entry.odd,
            "command": entry.key.command, "thread": entry.key.thread,
            "frames": list(entry.key.frames), "pids": {str(w): p for w, p in entry.pids.items()},
            "differs_at": entry.differs_at, "others": entry.others or None,
            "others_frame": entry.others_frame or None}


def to_json(report: StacksReport) -> dict[str, Any]:
    entries, odd = report.fold()
    return {"run": report.run, "source": report.source, "native": report.native,
            "taken_at": report.taken_at, "odd_workers": odd,
            "stacks": [folded_json(e) for e in entries],
            "unattached": [{"workers": u.workers, "command": u.command, "reason": u.reason,
                            "fix": u.fix, "pids": {str(w): p for w, p in u.pids.items()}}
                           for u in report.unattached],
            "workers": {str(w): a for w, a in report.answers.items()},
            "errors": {str(w): e for w, e in report.errors.items()},
            "saved": [str(p) for p in report.saved]}
