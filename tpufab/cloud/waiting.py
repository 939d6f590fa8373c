"""Waiting on the cloud with a live status line: a poll until done, each state change a line of
its own, bounded by ``wait_timeout``; and a countdown between retries. What create, delete and
gc share (the console is the caller's sink: ``console(None)`` is stdout)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from tpufab.durations import human_duration
from tpufab.errors import ApiError

if TYPE_CHECKING:
    from rich.console import Console


def console_or_stdout(console: Console | None) -> Console:
    if console is not None:
        return console
    from tpufab.term.console import stdout

    return stdout()


def escape(text: object) -> str:
    from rich.markup import escape as rich_escape

    return rich_escape(str(text))


def elapsed(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def wait_for(probe: Callable[[], tuple[str, bool]], *, what: str, timeout: float,
             console: Console, check_hint: str = "",
             clock: Callable[[], float] = time.monotonic,
             sleep: Callable[[float], None] = time.sleep) -> str:
    """Poll ``probe() -> (state, done)`` until done, showing a live status line.

    Each state change is printed as a line of its own (`CREATING -> READY after 12s`); the
    poll interval grows from 0.25 s to 5 s. Past ``timeout`` seconds raise an ApiError that says
    the operation goes on in the background.
    """
    started = clock()
    state, done = probe()
    console.print(f"{escape(what)}: {escape(state)}")
    interval = 0.25
    with console.status(f"{escape(what)}: {escape(state)}") as status:
        while not done:
            spent = clock() - started
            if spent > timeout:
                raise ApiError(f"Gave up waiting after {elapsed(spent)}: {what} is still "
                               f"{state} and carries on in the background; {check_hint}or raise "
                               "TPUFAB_WAIT_TIMEOUT.")
            sleep(min(interval, max(0.0, timeout - spent) + 0.01))
            interval = min(interval * 1.5, 5.0)
            new_state, done = probe()
            spent = clock() - started
            if new_state != state:
                console.print(f"{escape(what)}: {escape(state)} -> {escape(new_state)} "
                              f"after {elapsed(spent)}")
                state, interval = new_state, 0.25
            status.update(f"{escape(what)}: {escape(state)} ({elapsed(spent)})")
    return state


def wait_retry(console: Console, delay: float, *, line: str, deadline: float,
               clock: Callable[[], float], sleep: Callable[[float], None]) -> None:
    """Sleep ``delay`` seconds behind a live status line that counts down (``line`` has
    ``{rest}`` and ``{left}``: until the next try, until the deadline)."""
    end = clock() + delay

    def text() -> str:
        now = clock()
        return escape(line.replace("{rest}", human_duration(max(0.0, end - now)))
                      .replace("{left}", human_duration(max(0.0, deadline - now))))

    console.print(f"[yellow]{text()}.[/yellow]")
    with console.status(text()) as status:
        while (rest := end - clock()) > 0:
            sleep(min(1.0, rest))
            status.update(text())
