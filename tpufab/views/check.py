"""How `tpufab check` shows (the view ``check`` of tpufab.views.report.show): one line per
check (``ok``/``FAIL``/``skip``, its name, what it found), then one line per problem with its
fix, on stdout; the summary sentence on stderr (bold red when a check failed). ``--json`` is
the shape docs/check.md gives: every check with its data, and the problems."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tpufab import nodeset
from tpufab.term.terminal import neutralise_text

if TYPE_CHECKING:
    from rich.console import Console

    from tpufab.steps.health.check import CheckReport, Problem, Result


def report_lines(report: CheckReport) -> list[str]:
    """The check table and one line per problem (pure)."""
    width = max(len(r.check) for r in report.rows) if report.rows else 5
    lines = [f"{r.status:<4}  {r.check:<{width}}  {r.detail}" for r in report.rows]
    problems = report.problems
    if problems:
        lines += ["", f"{len(problems)} problem{'s' if len(problems) != 1 else ''}:"]
        lines += [f"  {p.line()}" for p in problems]
    return lines


def problem_json(problem: Problem) -> dict[str, Any]:
    return {"check": problem.check, "workers": nodeset.fold(problem.workers),
            "worker_ids": list(problem.workers), "problem": problem.text, "fix": problem.fix}


def result_json(result: Result) -> dict[str, Any]:
    return {"check": result.check, "status": result.status, "detail": result.detail,
            "problems": [problem_json(p) for p in result.problems], **result.data}


def to_json(report: CheckReport) -> dict[str, Any]:
    return {"name": report.name, "accelerator_type": report.accelerator,
            "workers": nodeset.fold(report.workers), "ok": report.ok,
            "seconds": round(report.seconds, 3),
            "checks": [result_json(r) for r in report.rows],
            "problems": [problem_json(p) for p in report.problems]}


def show(report: CheckReport, *, as_json: bool, console: Console, errors: Console) -> None:
    """The check lines on ``console`` and the summary on ``errors``; or the JSON."""
    from tpufab.term.console import print_json

    if as_json:
        print_json(to_json(report), console)
        return
    for line in report_lines(report):
        console.print(neutralise_text(line), markup=False)
    errors.print(neutralise_text(report.summary), markup=False,
                 style=None if report.ok else "bold red")
