"""Supervised jobs on the terminal (docs/supervisor.md): `tpufab jobs` as a table or as JSON,
and the line that opens each attempt's output in `tpufab jobs logs`."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

COLUMNS = ("JOB", "POD", "RECIPE", "STATE", "ATTEMPTS", "PREEMPTIONS", "ERRORS", "SUPERVISOR",
           "LAST EVENT")


def job_json(row: Any) -> dict:
    """One job for scripts: at least id, pod, recipe, state, attempts, preemptions, errors."""
    spec, state = row.spec, row.state
    attempts = state.attempts if state else ()
    return {
        "id": row.job,
        "pod": spec.pod.name if spec else None,
        "zone": spec.pod.zone if spec else None,
        "project": spec.pod.project if spec else None,
        "recipe": spec.recipe if spec else None,
        "args": list(spec.args) if spec else [],
        "state": row.state_name,
        "attempts": len(attempts),
        "preemptions": state.preemptions if state else 0,
        "errors": state.errors if state else 0,
        "restarts": state.restarts if state else {},
        "cancel_requested": bool(state and state.cancel_requested),
        "supervisor": row.holder,
        "lease_expires_at": row.lease.expires_at if row.lease else None,
        "last_event": ({"at": state.last_event.at, "text": state.last_event.text}
                       if state and state.last_event else None),
        "created_at": spec.created_at if spec else None,
        "user": spec.user if spec else None,
        "runs": [{"attempt": a.number, "run_id": a.run_id, "reason": a.reason,
                  "phase": a.phase, "started_at": a.started_at, "ended_at": a.ended_at,
                  "outcome": a.outcome, "exit": a.exit} for a in attempts],
    }


def _ago(at: str, now: datetime) -> str:
    from tpufab.durations import human_duration

    try:
        when = datetime.strptime(at, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)
    except ValueError:
        return at
    return human_duration(max(0.0, (now - when).total_seconds())) + " ago"


def table_rows(rows: Sequence[Any], now: datetime) -> list[tuple[str, ...]]:
    out = []
    for row in rows:
        spec, state = row.spec, row.state
        shown = row.state_name
        if state is not None and state.cancel_requested and not state.terminal:
            shown += " (cancel asked)"
        event = state.last_event if state else None
        out.append((row.job, spec.pod.name if spec else "-", spec.recipe if spec else "-",
                    shown, str(len(state.attempts)) if state else "0",
                    str(state.preemptions) if state else "0",
                    str(state.errors) if state else "0", row.holder or "-",
                    f"{_ago(event.at, now)}: {event.text}" if event else "-"))
    return out


def show_jobs(rows: Sequence[Any], *, as_json: bool = False,
              now: datetime | None = None) -> None:
    """The jobs as a table (a count on stderr), or as a JSON list on stdout."""
    from tpufab.term.console import stderr, stdout
    from tpufab.term.tables import fitted
    from tpufab.term.terminal import neutralise_text

    if as_json:
        print(json.dumps([job_json(row) for row in rows], indent=2))
        return
    if not rows:
        stderr().print("No supervised jobs in this bucket.", markup=False)
        return
    console = stdout()
    lines = [[neutralise_text(cell) for cell in line]
             for line in table_rows(rows, now or datetime.now(timezone.utc))]
    console.print(fitted(COLUMNS, lines, console, markup=False))
    live = sum(row.live for row in rows)
    stderr().print(f"{len(rows)} job{'s' if len(rows) != 1 else ''}, {live} live.",
                   markup=False, style="dim")
    sys.stdout.flush()


def attempt_header(number: int, attempt: Any) -> str:
    """``attempt 2: run 20261201-221000-ab12 (preempted; running)``."""
    if attempt is None:
        return f"attempt {number}"
    how = attempt.outcome or attempt.phase
    if attempt.exit is not None:
        how += f", exit {attempt.exit}"
    return f"attempt {number}: run {attempt.run_id} ({attempt.reason}; {how})"


def show_handed_over(result: Any) -> None:
    """`babysit --remote`'s answer: the job id on stdout (for scripts), then what happens and
    the two commands that follow it or cancel it."""
    from tpufab.term.console import stderr

    print(result.job, flush=True)
    spec = result.spec
    where = (f"supervisor {result.supervisor}" if result.supervisor else
             f"the bucket gs://{result.bucket}")
    code = spec.code.commit[:12] + (" (bundled in the bucket)" if spec.code.bundle else "")
    err = stderr()
    err.print(f"Handed job {result.job} over to {where}: it babysits {spec.recipe} on pod "
              f"{spec.pod.name} from commit {code}; the laptop can be closed.", markup=False)
    if result.supervisor is None:
        err.print("No supervisor VM is made for it (supervisor_vm is false): a service you "
                  "run (`python -m tpufab.flows.supervisor serve --bucket "
                  f"{result.bucket} --name NAME`) picks the job up from the bucket.",
                  markup=False)
    if spec.secrets and not result.secrets_handed:
        err.print(f"Its secrets ({', '.join(spec.secrets)}) were not handed to a supervisor: "
                  f"the job waits (needs secrets) until `tpufab jobs secrets {result.job}` "
                  "hands them (docs/supervisor.md, Secrets).", markup=False)
        if result.secrets_why:
            err.print(result.secrets_why, markup=False)
    elif spec.secrets:
        err.print(f"Its secrets ({', '.join(spec.secrets)}) went to the supervisor, which keeps "
                  "them in memory only; after a supervisor restart hand them again with "
                  f"`tpufab jobs secrets {result.job}`.", markup=False)
    err.print(f"Follow it:  {result.follow}", markup=False)
    err.print(f"Cancel it:  {result.cancel}", markup=False)


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d {hours}h"
    if hours:
        return f"{hours}h {minutes}m"
    return f"{minutes}m {secs}s" if minutes else f"{secs}s"


def supervisor_json(found: Any) -> dict:
    """`tpufab supervisor status --json`."""
    vm = found.vm
    return {
        "vm": None if vm is None else {
            "name": vm.name, "zone": vm.zone, "project": vm.project,
            "machine_type": vm.machine_type, "status": vm.status, "since": vm.since,
            "ip": vm.ip, "version": vm.version, "code_id": vm.code_id},
        "bucket": found.bucket, "uptime_seconds": found.uptime,
        "hourly_usd": found.hourly_usd,
        "jobs": len(found.jobs), "live_jobs": [r.job for r in found.live],
        "heartbeat": found.heartbeat, "install": found.install}


def show_supervisor(found: Any, *, as_json: bool = False) -> None:
    """The supervisor VM: machine type, uptime, jobs and hourly cost, or that there is none."""
    if as_json:
        print(json.dumps(supervisor_json(found), indent=2))
        return
    vm = found.vm
    if vm is None:
        print(f"No supervisor VM is running (the bucket gs://{found.bucket} keeps "
              f"{len(found.jobs)} job(s)); `tpufab supervisor up` or `babysit --remote` makes "
              "one.")
        return
    cost = "not in the price table" if found.hourly_usd is None else \
        f"${found.hourly_usd:.4f}/h (~${found.hourly_usd * 730:.2f}/month, list price)"
    live = found.live
    lines = [
        f"supervisor  {vm.name} ({vm.status}) in {vm.zone}, project {vm.project}",
        f"machine     {vm.machine_type}, {cost}",
        f"uptime      {_duration(found.uptime)} (made {vm.since})",
        f"tpufab      {vm.version or 'not installed yet'}"
        + (f" (code {vm.code_id})" if vm.code_id else ""),
        f"jobs        {len(live)} live of {len(found.jobs)} in gs://{found.bucket}"
        + (f": {', '.join(r.job for r in live[:5])}" if live else ""),
    ]
    print("\n".join(lines))
