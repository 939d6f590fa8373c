"""The rich consoles tpufab prints to, and the one place errors become output and exit codes.

Expected failures (TpufabError) print as one red sentence on stderr, then their details;
anything else prints a short message and a hint to rerun with --debug. `--debug` or
`TPUFAB_DEBUG=1` shows tracebacks.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from functools import cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console


def _make_console(stderr: bool) -> Console:
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    # Off a terminal rich assumes 80 columns and wraps; logs and pipes read better wide.
    width = None if stream.isatty() or os.environ.get("COLUMNS") else 160
    return Console(stderr=stderr, width=width, highlight=False, soft_wrap=True)


@cache
def stdout() -> Console:
    return _make_console(stderr=False)


@cache
def stderr() -> Console:
    return _make_console(stderr=True)


def print_json(data: Any, console: Console) -> None:
    """``data`` as indented JSON on ``console``, as it is (no markup, no wrapping); what a
    value JSON does not know (a datetime) as its text."""
    import json

    console.print(json.dumps(data, indent=2, default=str), markup=False, highlight=False,
                  emoji=False, soft_wrap=True)


def debug_enabled(flag: bool = False) -> bool:
    return flag or os.environ.get("TPUFAB_DEBUG", "").strip().lower() in ("1", "true", "yes", "on")


def report_error(exc: BaseException, *, debug: bool = False, console: Console | None = None) -> int:
    """Print ``exc`` the tpufab way; returns the exit code to leave with."""
    from rich.text import Text

    from tpufab.errors import TpufabError
    from tpufab.term.terminal import neutralise_text as safe

    console = console or stderr()
    if debug:
        from rich.traceback import Traceback

        console.print(Traceback.from_exception(type(exc), exc, exc.__traceback__))
    if isinstance(exc, TpufabError):
        # Errors quote what workers said: shown as data, never as terminal controls.
        console.print(Text(safe(exc.message), style="bold red"), soft_wrap=True)
        if exc.details:
            console.print(Text(safe(exc.details)), soft_wrap=True)
        return exc.exit_code
    if isinstance(exc, KeyboardInterrupt):
        console.print(Text("Interrupted.", style="bold red"))
        return 130
    console.print(Text(safe(f"Unexpected error: {type(exc).__name__}: {exc}"), style="bold red"),
                  soft_wrap=True)
    if not debug:
        console.print(Text("This is a bug in tpufab or an unexpected answer; rerun with --debug "
                           "(or TPUFAB_DEBUG=1) to see the traceback.", style="dim"), soft_wrap=True)
    return 1


# google-api-core warns on every import under a Python it no longer updates (3.10): advice
# for tpufab's maintainers, not for someone running a verb; it would precede every answer.
QUIET_WARNINGS = (r"google\.api_core\._python_version_support",)


def run(fn: Callable[..., Any], /, *args: Any, debug: bool = False, **kwargs: Any) -> int:
    """Call a verb; returns its exit code (0, or the error's) after printing any failure."""
    import warnings

    debug = debug_enabled(debug)
    if not debug:
        for module in QUIET_WARNINGS:
            warnings.filterwarnings("ignore", category=FutureWarning, module=module)
    try:
        result = fn(*args, **kwargs)
    except (Exception, KeyboardInterrupt) as exc:
        return report_error(exc, debug=debug)
    return result if isinstance(result, int) and not isinstance(result, bool) else 0
