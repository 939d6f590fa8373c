"""kill: leave the TPU of every worker free, safely; and the simulated mess to practise on.

The worker side is ``tpufab/remote/kill_worker.py`` (one JSON report per worker) and, for the
simulated pod, ``tpufab/remote/zombie_worker.py``. Here: the commands (pure), the fan-out (apply:
one round trip per worker, both scripts shipped once per content hash and run as root, through
``sudo -n`` when the login user is not root), and the reports folded across workers (pure),
so 64 identical workers read as one line each.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from tpufab import nodeset
from tpufab.config import timeout_for
from tpufab.errors import TpufabError
from tpufab.quoting import Command, Raw
from tpufab.reports import Column, Report
from tpufab.ssh.remote_files import RemoteFile, python_command, run_with_files
from tpufab.term.commands import short_command
from tpufab.topology import DEVICE_GLOBS

TPUKILL = "kill_worker.py"
ZOMBIE = "zombie_worker.py"
SETTLE = 2.0          # how long tpukill waits for killed holders to let go of the devices
COMMAND_SHOWN = 60


class KillError(TpufabError):
    """The TPU is still busy (or could not be checked) on some workers."""


# -- commands (pure) ----------------------------------------------------------------------------


# What status and kill say of a protected TPU holder (tpufab.views.status shows it too).
PROTECTED_ADVICE = (" - protected ({name}): `tpufab kill` leaves it running; if it should not "
                    "hold the TPU, stop it with `tpufab kill --force` (or its service)")


def kill_command(*, run: str | None = None, grace: float = 5.0, settle: float = SETTLE,
                 dry_run: bool = False, force: bool = False,
                 device_globs: Sequence[str] = DEVICE_GLOBS, from_stdin: bool = False
                 ) -> Command:
    # The login user's runs, also when sudo makes the script root (whose ~ differs).
    args: list = ["--grace", f"{grace:g}", "--settle", f"{settle:g}",
                  Raw('--run-dir="$HOME/.tpufab/runs"')]
    for pattern in device_globs:
        args += ["--devices-glob", pattern]
    if run:
        args += ["--run", run]
    if dry_run:
        args.append("--dry-run")
    if force:
        args.append("--force")
    return python_command(RemoteFile.bundled(TPUKILL), args, as_root=True,
                          from_stdin=from_stdin)


def zombie_command(*, holders: int = 2, ignore_term: int = 1, lock_holder: bool = False,
                   device_globs: Sequence[str] = DEVICE_GLOBS) -> Command:
    args: list = ["--holders", holders, "--ignore-term", ignore_term]
    for pattern in device_globs:
        args += ["--devices-glob", pattern]
    if lock_holder:
        args.append("--lock-holder")
    return python_command(RemoteFile.bundled(ZOMBIE), args, as_root=True)


# -- results --------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerReport:
    """A worker's JSON report, or why there is none."""

    worker: int
    report: Mapping | None = None
    error: str | None = None

    @property
    def busy(self) -> bool:
        r = self.report
        return r is not None and not r.get("dry_run") and (
            not r.get("device_free", False) or bool(r.get("failed")))

    @property
    def unverified(self) -> bool:
        """Not root: other users' processes could not be inspected, so "free" is a guess."""
        r = self.report
        return r is not None and not r.get("dry_run") and not self.busy and \
            bool(r.get("unreadable_processes"))

    @property
    def protected_holders(self) -> list[str]:
        """Names of protected processes left running that still hold a TPU device: the TPU
        is not free (`tpufab status` says "held by protected ..." about the same ones)."""
        r = self.report
        if r is None or r.get("dry_run"):
            return []
        devices = set(r.get("devices") or ())
        return sorted({str(e.get("name")) for e in r.get("protected", ())
                       if devices & set(e.get("holds") or ())})


@dataclass(frozen=True)
class KillRow:
    """One line of a kill's report: a process (``{pid}`` stands for its pid), a run, a
    lockfile, a note; or (``ok`` False) why the worker could not be checked."""

    worker: int
    text: str = ""
    pid: int | None = None
    ok: bool = True
    message: str | None = None


def _with_pids(lines: list[KillRow]) -> str:
    pids = [e.pid for e in lines if e.pid is not None]
    return lines[0].text.replace("{pid}", _pids(pids) if pids else "")


KILL_COLUMNS = (Column("WHAT", lambda e: e.text, over=_with_pids),)


@dataclass
class KillReport(Report):
    """Every worker's tpukill report (``workers``), as a ``tpufab.reports.Report``: one row
    per process, run or lockfile (folded across workers, one pid or each worker's), then the
    summary (killed, protected survivors, device free, lockfiles)."""

    # every worker's answer; --json has what the rows make of it
    workers: dict[int, WorkerReport] = field(default_factory=dict, metadata={"json": False})
    dry_run: bool = False
    grace: float = 5.0
    step: str = field(default="kill", kw_only=True)
    columns: tuple[Column, ...] = field(default=KILL_COLUMNS, kw_only=True)
    lines: bool = field(default=True, kw_only=True)

    def __post_init__(self) -> None:
        self.rows = kill_entries(self)
        # a TPU left busy is said once, as the error of check() (the verb exits 1 with it)
        self.summary = summary(self) if self.ok else ""
        self.notes = [*self.notes, *supervised_notes(self)]

    @property
    def reports(self) -> dict[int, Mapping]:
        return {w: r.report for w, r in self.workers.items() if r.report is not None}

    @property
    def unreachable(self) -> dict[int, str]:
        return {w: r.error or "no report" for w, r in self.workers.items() if r.report is None}

    @property
    def busy(self) -> list[int]:
        return [w for w, r in self.workers.items() if r.busy]

    @property
    def unverified(self) -> list[int]:
        return [w for w, r in self.workers.items() if r.unverified]

    @property
    def held_by_protected(self) -> dict[int, list[str]]:
        return {w: r.protected_holders for w, r in self.workers.items() if r.protected_holders}

    @property
    def ok(self) -> bool:
        return not self.unreachable and not self.busy and not self.unverified \
            and not self.held_by_protected

    def check(self) -> KillReport:
        """This result, or KillError with its summary when the TPU is not free everywhere."""
        if not self.ok:
            raise KillError(summary(self))
        return self


KillResult = KillReport   # the 0.1 name (docs/api.md), until 0.2


def parse_report(result) -> WorkerReport:
    from tpufab.ssh.remote_files import read_answer
    from tpufab.steps.runs.running import failure_reason

    if result.error:
        return WorkerReport(result.worker, error=result.error)
    data = read_answer(result.stdout)
    if data is None or "error" in data:
        return WorkerReport(result.worker, error=failure_reason(result))
    return WorkerReport(result.worker, data)


def check_options(*, run: str | None, grace: float) -> None:
    """A negative grace or a malformed run id, refused in one sentence before connecting."""
    from tpufab.errors import ConfigError
    from tpufab.steps.runs.env import is_run_id

    if grace < 0:
        raise ConfigError(f"--grace must be 0 or more seconds, not {grace:g}.")
    # a run id, or any name a run directory on a worker may have (what `tpufab runs` lists,
    # a stray ~/.tpufab/runs/NAME included): remote/run_worker.py's RUN_ID
    if run is not None and not (is_run_id(run) or _RUN_NAME.match(run)):
        raise ConfigError(f"{run!r} is not a run id (they look like 20261122-104455-ab12); "
                          "`tpufab runs` lists them.")


_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


# -- the apply steps ------------------------------------------------------------------------------


def kill(fanout, workers: Sequence[int], *, run: str | None = None, grace: float = 5.0,
         dry_run: bool = False, force: bool = False,
         device_globs: Sequence[str] = DEVICE_GLOBS, timeout: float | None = None) -> KillReport:
    """Run tpukill on every worker at once (one shared grace period per worker)."""
    check_options(run=run, grace=grace)
    options = {"run": run, "grace": grace, "dry_run": dry_run, "force": force,
               "device_globs": device_globs}
    files = [RemoteFile.bundled(TPUKILL)]
    timeout = timeout_for("kill", timeout, plus=grace)  # 34 s: 2 * SETTLE, KILL and answers
    # the tool that frees a wedged TPU must not need free disk: where kill_worker.py cannot be
    # shipped for lack of space, it runs from memory
    results = run_with_files(fanout, files, kill_command(**options), workers, timeout=timeout,
                             from_memory=kill_command(**options, from_stdin=True))
    return KillReport({w: parse_report(r) for w, r in sorted(results.items())}, dry_run, grace)


def make_zombies(fanout, workers: Sequence[int], *, holders: int = 2, ignore_term: int = 1,
                 lock_holder: bool = False,
                 device_globs: Sequence[str] = DEVICE_GLOBS) -> dict[int, WorkerReport]:
    """Leave a crashed job's mess on ``workers`` (simulated pod): TPU holders, some ignoring
    SIGTERM, the libtpu lockfile held, and a protected ``tpu-runtime`` holder."""
    line = zombie_command(holders=holders, ignore_term=ignore_term, lock_holder=lock_holder,
                          device_globs=device_globs)
    results = run_with_files(fanout, [RemoteFile.bundled(ZOMBIE)], line, workers, timeout=60)
    return {w: parse_report(r) for w, r in sorted(results.items())}


# -- rendering (pure) ---------------------------------------------------------------------------


_NUMBERED = re.compile(r"^(.*?)(\d+)$")


def fold_paths(paths: Iterable[str]) -> str:
    """``/dev/accel0 .. /dev/accel3, /tmp/libtpu_lockfile`` -> ``/dev/accel[0-3], /tmp/libtpu_lockfile``."""
    groups: dict[str, list[int]] = {}
    order: list[str] = []
    for path in paths:
        match = _NUMBERED.match(path)
        key, number = (match.group(1), int(match.group(2))) if match else (path, None)
        if key not in groups:
            groups[key] = []
            order.append(key)
        if number is not None:
            groups[key].append(number)
    out = []
    for key in order:
        numbers = groups[key]
        if not numbers:
            out.append(key)
        elif len(set(numbers)) == 1:
            out.append(f"{key}{numbers[0]}")
        else:
            out.append(nodeset.fold(numbers, prefix=key))
    return ", ".join(out)


def _short(command: str) -> str:
    """What names the command (tpufab.term.commands), within COMMAND_SHOWN characters."""
    return short_command(command, COMMAND_SHOWN)


def _pids(pids: Sequence[int]) -> str:
    """One pid when every worker agrees, else each worker's, in worker order."""
    if len(set(pids)) == 1:
        return f"pid {pids[0]}"
    shown = ",".join(str(p) for p in pids[:8]) + (",..." if len(pids) > 8 else "")
    return f"pids {shown}"


def fold_entries(entries: Iterable[tuple[int, str, int | None]]) -> list[tuple[str, str]]:
    """``(worker, text with {pid}, pid)`` -> ``(folded workers, text)``: identical texts (pid
    aside) of different workers become one line, in the order they first appear."""
    groups: dict[str, list[tuple[int, int | None]]] = {}
    for worker, text, pid in entries:
        groups.setdefault(text, []).append((worker, pid))
    lines = []
    for text, members in groups.items():
        pids = [p for _, p in members if p is not None]
        lines.append((nodeset.fold(w for w, _ in members),
                      text.replace("{pid}", _pids(pids) if pids else "")))
    return lines


def _signal_note(entry: Mapping, grace: float) -> str:
    sig = entry.get("signal")
    if sig == "KILL":
        return f"needed SIGKILL (still alive {grace:g} s after SIGTERM)"
    if sig == "ray stop":   # a Ray process, stopped by Ray's own `ray stop` first
        return "stopped by `ray stop`"
    if sig:
        return f"stopped by SIG{sig}"
    return ""


def kill_entries(result: KillReport) -> list[KillRow]:
    """The lines of every worker's report, in worker order (pure)."""
    entries: list[KillRow] = []
    for w, report in result.reports.items():
        for c in report.get("containers", ()):
            why = f": {c['error']}" if c.get("error") else ""
            entries.append(KillRow(w, f"container  {c.get('name')} (run {c.get('run')}): "
                                      f"{c.get('action')}{why}", None))
        for run in report.get("runs", ()):
            state = run.get("state")
            if state in ("not running", "ended") and not run.get("stragglers"):
                continue
            entries.append(KillRow(w, f"run        {run.get('run')}: {state}", None))
        verb = "would kill" if result.dry_run else "killed"
        for e in report.get("would_kill" if result.dry_run else "killed", ()):
            note = _signal_note(e, result.grace)
            entries.append(KillRow(w, f"{verb:<10} {{pid}} {e.get('name')} `{_short(e.get('command', ''))}`"
                               f" ({_reason(e.get('reason', ''))}){'; ' + note if note else ''}",
                            e.get("pid")))
        for e in report.get("failed", ()):
            entries.append(KillRow(w, f"NOT KILLED {{pid}} {e.get('name')} `{_short(e.get('command', ''))}`"
                               f": {e.get('error', 'still alive')}", e.get("pid")))
        for e in report.get("protected", ()):
            entries.append(KillRow(w, f"protected  {{pid}} {e.get('name')} holds "
                               f"{fold_paths(e.get('holds', ()))} ({e.get('why')}; left running)",
                            e.get("pid")))
        for e in report.get("holders_left", ()):
            parent = f" (its parent: {e['parent']} pid {e['ppid']})" if e.get("parent") else ""
            entries.append(KillRow(w, f"BUSY       {{pid}} {e.get('name')} still holds "
                               f"{fold_paths(e.get('holds', ()))}{parent}", e.get("pid")))
        for lock in report.get("lockfiles", ()):
            action = lock.get("action")
            if action == "absent":
                continue
            held = lock.get("held_by")
            by = f" (held by pid {', '.join(str(p) for p in held)})" if held and "keep" in action else ""
            entries.append(KillRow(w, f"lockfile   {lock.get('path')} {action}{by}", None))
        if report.get("noop") and not report.get("protected") and not report.get("holders_left"):
            entries.append(KillRow(w, "nothing to kill", None))
        if report.get("unreadable_processes"):
            entries.append(KillRow(w, f"note       {report['unreadable_processes']} processes of other "
                               "users could not be inspected (not root)", None))
    for w, error in result.unreachable.items():
        entries.append(KillRow(w, ok=False, message=error))
    return sorted(entries, key=lambda e: e.worker)


# what kill_worker.py says of a run it signalled (or, --dry-run, would signal)
STOPPED_RUN = ("stopping", "stopped", "still running", "would stop")


def supervised_notes(result: KillReport) -> list[str]:
    """One sentence per supervised job whose run this kill stops (or would stop): its
    supervisor sees the recipe fail and decides, as babysit does, whether to relaunch it, so
    only `tpufab jobs cancel` stops the job (pure)."""
    jobs: dict[str, set[str]] = {}
    for report in result.reports.values():
        for run in report.get("runs", ()):
            if run.get("job") and run.get("state") in STOPPED_RUN:
                jobs.setdefault(str(run["job"]), set()).add(str(run.get("run")))
    verb = "would stop" if result.dry_run else "stopped"
    return [f"{'Runs' if len(runs) > 1 else 'Run'} {', '.join(sorted(runs))} ({verb} here) "
            f"{'are attempts' if len(runs) > 1 else 'is an attempt'} of supervised job {job}: "
            "its supervisor takes the kill for the recipe failing (exit 143) and relaunches "
            "the job if its error budget or --restart-on-exit allows (else the job fails), "
            f"so to stop the job for good cancel it with `tpufab jobs cancel {job}`."
            for job, runs in sorted(jobs.items())]


def _reason(reason: str) -> str:
    """``holds /dev/accel0, /dev/accel1`` -> ``holds /dev/accel[0-1]``."""
    parts = []
    for part in reason.split("; "):
        if part.startswith("holds "):
            part = "holds " + fold_paths(p.strip() for p in part[6:].split(","))
        parts.append(part)
    return "; ".join(parts)


def _first_worker(label: str) -> int:
    match = re.search(r"\d+", label)
    return int(match.group()) if match else 0


def summary(result: KillReport) -> str:
    """One or a few sentences: killed, protected survivors, device free, lockfiles."""
    reports = result.reports
    everyone = sorted(result.workers)
    parts: list[str] = []
    if result.dry_run:
        would = {w: len(r.get("would_kill", ())) for w, r in reports.items()}
        removals = [w for w, r in reports.items()
                    if any(e.get("action") == "would remove" for e in r.get("lockfiles", ()))]
        if not any(would.values()) and not removals:
            parts.append(f"Dry run: nothing to kill on {nodeset.fold(reports)}.")
        else:
            text = f"Dry run: would kill {sum(would.values())} processes on " \
                   f"{nodeset.fold(w for w, n in would.items() if n)}"
            if removals:
                text += f" and remove the lockfile on {nodeset.fold(removals)}"
            parts.append(text + "; nothing was signalled.")
    else:
        killed = {w: r.get("killed", ()) for w, r in reports.items()}
        count = sum(len(k) for k in killed.values())
        if count:
            hard = sum(1 for k in killed.values() for e in k if e.get("signal") == "KILL")
            note = f" ({hard} needed SIGKILL after the {result.grace:g} s grace)" if hard else ""
            parts.append(f"Killed {count} process{'es' if count != 1 else ''} on "
                         f"{nodeset.fold(w for w, k in killed.items() if k)}{note}.")
        elif reports and all(r.get("noop") for r in reports.values()):
            parts.append(f"Nothing to kill on {nodeset.fold(reports)}.")
    protected: dict[str, list[int]] = {}
    for w, r in reports.items():
        for e in r.get("protected", ()):
            protected.setdefault(str(e.get("name")), []).append(w)
    if protected:
        names = ", ".join(f"{name} on {nodeset.fold(ws)}" for name, ws in protected.items())
        parts.append(f"Left running (protected): {names}; --force stops them too.")
    if not result.dry_run and reports:
        busy, unverified = result.busy, result.unverified
        held = {w: names for w, names in result.held_by_protected.items() if w not in busy}
        unverified = [w for w in unverified if w not in held]  # held: surely not free
        free = [w for w in reports if w not in busy and w not in unverified and w not in held]
        if free:
            parts.append(f"TPU free on {nodeset.fold(free)}: yes.")
        if busy:
            parts.append(f"TPU free on {nodeset.fold(busy)}: NO (see the lines above).")
        by_names: dict[str, list[int]] = {}
        for w, names in held.items():
            by_names.setdefault(", ".join(names), []).append(w)
        for names, ws in by_names.items():
            parts.append(f"TPU free on {nodeset.fold(ws)}: NO{PROTECTED_ADVICE.format(name=names)}.")
        if unverified:
            parts.append(f"TPU free on {nodeset.fold(unverified)}: unknown, because processes "
                         "of other users could not be inspected there: log in as root "
                         "(ssh_user: root) or allow passwordless sudo, then kill again.")
        removed: dict[str, list[int]] = {}
        for w, r in reports.items():
            for path in r.get("lockfiles_removed", ()):
                removed.setdefault(path, []).append(w)
        for path, ws in removed.items():
            parts.append(f"Removed {path} on {nodeset.fold(ws)}.")
    if result.unreachable:
        reasons: dict[str, list[int]] = {}
        for w, why in result.unreachable.items():
            reasons.setdefault(why, []).append(w)
        detail = "; ".join(f"{nodeset.fold(ws)}: {why}" for why, ws in reasons.items())
        parts.append(f"Could not check {nodeset.fold(result.unreachable)} ({detail}); run kill "
                     "again once they answer.")
    return " ".join(parts) or f"Nothing to do on {nodeset.fold(everyone)}."


def zombie_lines(reports: Mapping[int, WorkerReport]) -> list[str]:
    entries: list[tuple[int, str, int | None]] = []
    for w, r in reports.items():
        if r.report is None:
            entries.append((w, f"FAILED     {r.error}", None))
            continue
        for z in r.report.get("zombies", ()):
            if "error" in z:
                entries.append((w, f"FAILED     {z.get('role')}: {z['error']}", None))
                continue
            term = "ignores SIGTERM; " if z.get("ignores_term") else ""
            entries.append((w, f"{z.get('role'):<12} {{pid}} {z.get('name')}: {term}holds "
                               f"{fold_paths(z.get('holds', ()))}", z.get("pid")))
    folded = fold_entries(entries)
    width = max((len(who) for who, _ in folded), default=2)
    return [f"{who:<{width}}  {text}" for who, text in sorted(
        folded, key=lambda item: _first_worker(item[0]))]
