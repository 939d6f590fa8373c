"""A run's logs on the terminal: the live views a follower feeds (every line prefixed by its
worker, or folded) and the logs so far, printed folded or prefixed (masked, neutralised)."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence


def follow_view(workers: Sequence[int], *, raw: bool = False, color: bool = False):
    """The live view of a followed run: every line prefixed (raw), else folded, each line
    once (`tpufab logs`'s folding, as lines come)."""
    if raw:
        from tpufab.views.live import LiveView

        return LiveView(workers=workers, worker_colors=color)
    from tpufab.views.folding import FoldingView

    return FoldingView(workers, color=color).start()


def say_straggler(sentence: str) -> None:
    """The live straggler detector's verdict (run, launch), on stderr beside tpufab's notes."""
    from tpufab.term.console import stderr
    from tpufab.term.terminal import neutralise_text

    stderr().print(neutralise_text(sentence), markup=False, style="yellow")


def tee(*sinks):
    """One sink feeding every one of ``sinks`` (a view and a progress line, say)."""
    from tpufab.views.live import Tee

    return Tee(list(sinks))


def print_logs(logs, *, raw: bool, color: bool, secrets: Sequence[str], out=None) -> None:
    """Every worker's log, prefixed (raw) or folded, streamed from the spooled outputs: a
    window of lines per worker in memory at a time (runs.fold_stream)."""
    from tpufab import nodeset
    from tpufab.quoting import mask_bytes, secret_bytes
    from tpufab.steps.runs.env import fold_stream
    from tpufab.term.terminal import Lines, neutralise

    masked = secret_bytes(secrets)

    def blocks(output):
        """Runs of whole lines, masked."""
        cutter = Lines()
        for chunk in output.chunks():
            for block in cutter.feed(chunk):
                yield mask_bytes(block, masked)
        for block in cutter.end():
            yield mask_bytes(block, masked)

    out = out if out is not None else sys.stdout.buffer
    if raw:
        width = max((len(nodeset.label(w)) for w in logs), default=2)
        for w in sorted(logs):
            prefix = f"{nodeset.label(w):<{width}} │ ".encode()
            for block in blocks(logs[w]):
                block = neutralise(block, color=color)
                out.write(prefix + block[:-1].replace(b"\n", b"\n" + prefix) + b"\n")
        out.flush()
        return

    def text(w):
        for block in blocks(logs[w]):
            yield from block.decode("utf-8", "replace").split("\n")[:-1]

    everyone = tuple(sorted(logs))
    for folded in fold_stream({w: text(w) for w in logs}):
        shown = folded.text if folded.workers == everyone else f"{folded.label}: {folded.text}"
        out.write(neutralise(shown.encode("utf-8", "replace") + b"\n", color=color))
    out.flush()


def print_folded(per_worker: Mapping[int, Sequence[str]]) -> None:
    """Some lines of each worker, folded as `tpufab logs` folds them, on stdout."""
    from tpufab.steps.runs.env import fold_logs, render_folded
    from tpufab.term.terminal import neutralise_text

    for line in render_folded(fold_logs(per_worker), per_worker):
        sys.stdout.write(neutralise_text(line) + "\n")
    sys.stdout.flush()


