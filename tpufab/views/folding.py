"""The folded log view, live: what `tpufab logs` shows (``runs.env.fold_logs``), as lines come.

``FoldingView`` is the sink a followed run's lines go to (``lines``/``done``/``close``): it
decides when a line can be shown and shows it; ``Alignment``, its half below, keeps where each
worker's lines stand against the common stream (the matching, waiting and placing of lines).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import IO

from tpufab import nodeset
from tpufab.steps.runs.env import paired_by_shape
from tpufab.term.fields import merge as merge_fields
from tpufab.term.fields import shape
from tpufab.term.terminal import neutralise_text

# What the live fold may hold (queued, not yet shown, shown later under their workers): this
# many lines and bytes, plus as many per worker; past that the oldest are placed and shown as
# if their ``delay`` had passed, so memory is bounded whatever the rate of output.
HOLD_LINES = 32768
HOLD_LINES_PER_WORKER = 256
HOLD_BYTES = 8 << 20
HOLD_BYTES_PER_WORKER = 128 << 10
RIPE_REACH = 4   # a line that waited its delay is paired up to this many look-aheads on


class Alignment:
    """Where each worker's lines stand against the common stream: the half of the live fold
    that matches, queues and places lines (FoldingView's docstring says how); what it settles
    is shown by the subclass (``_write``, and ``_late_delay``: how soon a late worker's
    variant of a line already shown is shown)."""

    def __init__(self, workers: Iterable[int], *, delay: float, lookahead: int,
                 clock: Callable[[], float]):
        self.workers = frozenset(workers)
        self.held_lines = 0             # lines queued, common but not shown, or own ones placed
        self.held_bytes = 0             # and their text (characters)
        self.delay = delay
        self.lookahead = lookahead
        self.clock = clock
        self.base = 0                                   # index of canon[0] in the stream
        self.canon: list[str] = []
        self.texts: list[str] = []      # canon's texts (searched in C: list.index)
        self.holders: list[dict[int, str]] = []     # per common line: worker -> its text
        self.arrived: list[float] = []                  # when a copy of it first arrived
        self.shown: dict[int, set[str]] = {}     # per common line shown: the texts shown there
        self.extras: dict[int, dict[str, list[_Own]]] = {}   # anchor -> text -> lines there
        self.emitted = 0
        self.cursor = {w: 0 for w in self.workers}
        self.queue: dict[int, deque[tuple[str, float]]] = {}  # lines that match nothing yet
        self.exact: dict[str, dict[int, int]] = {}      # text -> {worker: copies queued}
        self.finished: set[int] = set()
        self.live = set(self.workers)                   # the workers whose follower runs
        self.reference = min(self.workers, default=None)
        self._due = float("inf")                        # when a queued line may be ripe
        self.late: dict[int, dict[int, str]] = {}   # shown line -> late variants, until shown
        self._late_due = float("inf")

    def _write(self, text: str) -> None:
        raise NotImplementedError

    def _late_delay(self) -> float:
        return 0.0

    @property
    def _end(self) -> int:
        return self.base + len(self.canon)

    def _match(self, cursor: int, line: _Line, *, variant: bool = True) -> int | None:
        """The common line ``line`` is a copy of: the same text within the look-ahead, else
        (a field variant: tpufab.term.fields) the one at the cursor if of its shape, as
        ``logs`` pairs lines (``runs.fold_logs``)."""
        base, end, reach = self.base, self.base + len(self.canon), cursor + self.lookahead
        start = (cursor if cursor > base else base) - base
        stop = (reach if reach < end else end) - base
        window = self.texts[start:stop] if start < stop else ()
        text = line.text
        if text in window:
            return window.index(text) + start + base
        # a field variant only once no copy of the same text can still come in the window
        # (and so not the same text: its shape)
        if variant and base <= cursor and reach <= end:
            common = self.canon[cursor - base]
            if (common._shape or common.shape) == line.shape:
                return cursor
        return None

    def _copy_at(self, worker: int, queued, j: int) -> int | None:
        """Which of a worker's waiting lines is its copy of common line ``j``: the first of
        the same text."""
        common = self.canon[j - self.base]
        if worker not in self.exact.get(common.text, ()):
            return None
        for n, (text, _) in enumerate(queued):
            if text.text == common.text:
                return n
        return None

    def _variant_at(self, worker: int, now: float | None = None, force: bool = False) -> bool:
        """Its waiting lines hold one of the shape of the common line at its cursor (and no
        copy of a common line in its window): that one is a field variant of it, the lines
        before it the worker's own (as logs pairs them). Else its oldest waiting line may have
        the shape of a common line further on in its window: it is a variant of that one,
        and the worker did not print the common lines before it (rank 0 often prints lines
        of its own first: `GPU available: ...`, then `Initializing distributed: GLOBAL_RANK:
        0` where the others start). Settles it; True if it did.

        With ``now`` (from ``_ripen``), while its next waiting line is ripe too (``force``:
        all are) and a variant of the common line its cursor then stands at, that one
        settles as well, in this same pass: what a run of ``_ripen_one`` calls would do,
        with the window checked once and then only the line that enters it a step."""
        cursor = self.cursor[worker]
        queued = self.queue.get(worker)
        base, end, canon, exact = self.base, self._end, self.canon, self.exact
        if not queued or not base <= cursor < end:
            return False
        lookahead = self.lookahead
        window = range(cursor - base, min(cursor + lookahead, end) - base)
        for j in window:
            if worker in exact.get(canon[j].text, ()):
                return False
        common = canon[cursor - base]
        head, at = queued[0]
        if head == common:
            # the common case: its oldest line is the variant, no lines of its own before it
            # (the _dequeue/_pop/_settle/_rematch below, for i == 0, inline)
            delay, holders, arrived = self.delay, self.holders, self.arrived
            while True:
                queued.popleft()
                text = head.text
                self.held_lines -= 1                # _unwait, inline
                self.held_bytes -= len(text)
                copies = exact[text]
                left = copies[worker] - 1
                if left:
                    copies[worker] = left
                else:
                    del copies[worker]
                    if not copies:
                        del exact[text]
                if cursor < self.emitted:
                    self._variant(worker, cursor, text)
                else:
                    holders[cursor - base][worker] = text
                if at < arrived[cursor - base]:
                    arrived[cursor - base] = at
                cursor += 1
                self.cursor[worker] = cursor
                if not queued:
                    del self.queue[worker]
                    return True
                # its window gained one common line (none before it has a copy waiting)
                j = cursor + lookahead - 1
                if j < end and worker in exact.get(canon[j - base].text, ()):
                    self._rematch(worker, j)
                    return True
                if now is None or cursor >= end:
                    return True
                head, at = queued[0]
                # (not the same text: a copy of a line in its window would be in ``exact``)
                if not (force or at + delay <= now) or \
                        head.shape != canon[cursor - base].shape:
                    return True
        i = next((n for n, (text, _) in enumerate(queued) if text == common), None)
        if i is not None:
            own = self._dequeue(worker, i)
            copy, at = self._pop(worker)
            self._settle(worker, own, cursor, at, line=copy)
            self._rematch(worker, cursor + 1)
            return True
        # its oldest line: a variant of a common line in its window, else a copy or a variant
        # of one further on (up to RIPE_REACH windows: rank 0 may print a page of its own
        # first); only a line that waited its delay looks that far
        oldest = queued[0][0]
        j = next((j for j in window if canon[j] == oldest), None)
        if j is None:
            far = range(window.stop, min(cursor + RIPE_REACH * self.lookahead, end) - base)
            j = next((j for j in far if canon[j] == oldest), None)
        if j is None:
            return False
        copy, at = self._pop(worker)
        self._settle(worker, [], base + j, at, line=copy)
        self._rematch(worker, base + j + 1)
        return True

    def _add(self, worker: int, line: str, now: float) -> None:
        cursor = self.cursor.setdefault(worker, self.base)
        queued = self.queue.get(worker)
        at, known = cursor - self.base, len(self.canon)
        if at >= known:                             # past the last common line
            if not queued and worker == self.reference:
                self._append(worker, line, now)
            else:
                self._enqueue(worker, line, now)
            return
        if not queued and at >= 0 and self.canon[at].text == line.text:
            self.holders[at][worker] = line.text     # the common case: the next common line
            self.cursor[worker] = cursor + 1
            return
        j = self._match(cursor, line, variant=not queued)
        if j is not None and not queued and j >= self.emitted:
            # a copy or a field variant of a common line not shown yet, nothing of its own
            # before it: _settle's part for that, inline (every line of a field log is one)
            self.holders[j - self.base][worker] = line.text
            if now < self.arrived[j - self.base]:
                self.arrived[j - self.base] = now
            self.cursor[worker] = j + 1
        elif j is not None:
            self._settle(worker, self._dequeue(worker, len(queued)) if queued else [], j, now,
                         line=line)
        else:
            # It may match a common line still on its way: it waits (see _ripen).
            self._enqueue(worker, line, now)

    def _settle(self, worker: int, own: list[tuple[str, float]], j: int, when: float, *,
                shown: bool = True, line: _Line | None = None) -> None:
        """``worker`` printed common line ``j`` (its copy ``line``, arrived at ``when``) after
        its lines ``own``; with ``shown=False`` it did not print line ``j``: ``own`` replaced
        it."""
        anchor = j if shown else j + 1
        if own and shown:
            # as logs pairs them: its lines of the shape of a common line it skipped are that
            # line (a field variant); the others are its own, before the next one it printed
            start = max(self.cursor.get(worker, self.base), self.base)
            skipped = list(range(start, j))
            pairs = paired_by_shape([self.canon[k - self.base] for k in skipped],
                                    [text for text, _ in own]) if skipped else {}
            if pairs:
                for a, b in pairs.items():
                    self._variant(worker, skipped[a], own[b][0].text)
                after = sorted((b, skipped[a]) for a, b in pairs.items())
                rest: dict[int, list[tuple[str, float]]] = {}
                for b, entry in enumerate(own):
                    if all(b != pb for pb, _ in after):
                        at = next((k for pb, k in after if pb > b), j)
                        rest.setdefault(at, []).append(entry)
                for at, entries in rest.items():
                    self._own(worker, entries, at)
                own = []
        if own:
            self._own(worker, own, anchor)
        if shown and j >= self.base:
            self._variant(worker, j, line.text if line is not None else
                          self.canon[j - self.base].text)
            self.arrived[j - self.base] = min(self.arrived[j - self.base], when)
        self.cursor[worker] = j + 1

    def _variant(self, worker: int, k: int, text: str) -> None:
        """``worker`` printed ``text`` as common line ``k``. Once ``k`` is shown, a copy of a
        text shown there is not shown again; a field variant that is not is shown on its own
        (``w3: ...``), so a late worker's own values are never lost."""
        if k < self.emitted:
            seen = self.shown.setdefault(k, set())
            if text not in seen:   # a set: a late worker's line costs O(1), not O(workers)
                seen.add(text)
                # live, shown a moment later, folded with the other late workers' variants
                # of it (a thousand workers a delay late are one line, not a thousand)
                if not self.late:
                    self._late_due = self.clock() + self._late_delay()
                self.late.setdefault(k, {})[worker] = text
        self.holders[k - self.base][worker] = text

    def _own(self, worker: int, own: list[tuple[str, float]], anchor: int) -> None:
        """``worker``'s own lines, shown just before common line ``anchor``."""
        if anchor < self.emitted:
            for text, _ in own:
                self._write(f"{nodeset.label(worker)}: {text.text}")
            return
        entries = self.extras.setdefault(anchor, {})
        for offset, (text, _) in enumerate(own):
            if _place(entries, text, worker, offset):
                self._hold(text)

    def _append(self, worker: int, line: str, when: float) -> None:
        """A new common line; the workers whose lines waited for it move on."""
        e = self._end
        self.canon.append(line)
        self.texts.append(line.text)
        self.holders.append({worker: line.text})
        self.arrived.append(when)
        self._hold(line)
        self.cursor[worker] = e + 1
        waiting = self.exact.get(line.text)       # workers with a copy of it waiting
        for other in list(waiting) if waiting else ():
            cursor = self.cursor[other]
            if other == worker or not cursor <= e < cursor + self.lookahead:
                continue
            queued = self.queue[other]
            if queued[0][0].text == line.text:
                copy, at = self._pop(other)          # the common case: the next one waiting
                self.holders[-1][other] = copy.text
                if at < self.arrived[-1]:
                    self.arrived[-1] = at
                self.cursor[other] = e + 1
            else:
                i = self._copy_at(other, queued, e)
                if i is None:
                    continue
                own = self._dequeue(other, i)
                copy, at = self._pop(other)
                self._settle(other, own, e, at, line=copy)
            if queued:
                due = queued[0][1] + self.delay
                if due < self._due:
                    self._due = due
        if self.reference != worker and self.reference in self.queue:
            self._extend(self.reference)

    def _extend(self, worker: int) -> None:
        """``worker``'s waiting lines become common lines while it is at the end of them."""
        while self.queue.get(worker) and self.cursor[worker] >= self._end:
            line, at = self._pop(worker)
            self._append(worker, line, at)

    def _ripen(self, now: float, force: bool) -> None:
        """Lines that waited ``delay`` (or every line, at the end) are placed as they stand,
        the lowest worker's first: at the end of the common lines they become common lines
        (the reference said nothing in time); elsewhere they are the worker's own, in place
        of the common line at its cursor."""
        if not force and now < self._due:
            return

        def ripe(w: int) -> bool:
            q = self.queue.get(w)
            return bool(q) and (force or q[0][1] + self.delay <= now)

        # Placing a line only removes waiting lines (a queue's head becomes a later line), so
        # no worker that is not ripe now becomes ripe: one pass, the lowest worker first, in
        # O(workers + lines placed) rather than a scan of every queue per line placed.
        for worker in sorted(w for w in self.queue if ripe(w)):
            while ripe(worker):
                self._ripen_one(worker, now, force)
        self._due = min((q[0][1] + self.delay for q in self.queue.values()),
                        default=float("inf"))

    def _ripen_one(self, worker: int, now: float | None = None, force: bool = False) -> None:
        """``worker``'s oldest waiting line is placed where the worker stands (with the lines
        up to a field variant of the common line there, if it waits for one; with ``now``,
        the ripe variants after it too: ``_variant_at``)."""
        if self._variant_at(worker, now, force):
            return
        cursor = self.cursor[worker]
        line, at = self._pop(worker)
        if cursor >= self._end or worker in self.finished:
            self._append(worker, line, at)      # a finished worker's last word: at the end
            return
        self._settle(worker, [(line, at)], cursor, at, shown=False)
        self._rematch(worker, cursor + self.lookahead)
        if worker == self.reference:
            self._extend(worker)

    def _rematch(self, worker: int, start: int) -> None:
        """``worker``'s window gained the common lines from ``start`` on: the first of its
        waiting lines that is a copy of one of them (``_copy_at``) settles there."""
        while self.queue.get(worker):
            cursor = self.cursor[worker]
            queued = self.queue[worker]
            found = []
            base, canon, exact = self.base, self.canon, self.exact
            for j in range(max(start, cursor, base), min(cursor + self.lookahead, self._end)):
                if worker in exact.get(canon[j - base].text, ()):
                    i = self._copy_at(worker, queued, j)
                    if i is not None:
                        found.append((i, j))
            if not found:
                return
            i, j = min(found)
            own = self._dequeue(worker, i)
            copy, at = self._pop(worker)
            self._settle(worker, own, j, at, line=copy)
            start = cursor + self.lookahead

    def _enqueue(self, worker: int, line: str, now: float) -> None:
        queued = self.queue.get(worker)
        if queued is None:
            queued = self.queue[worker] = deque()
            if now + self.delay < self._due:
                self._due = now + self.delay
        queued.append((line, now))
        self._hold(line)
        copies = self.exact.get(line.text)
        if copies is None:
            self.exact[line.text] = {worker: 1}
        else:
            copies[worker] = copies.get(worker, 0) + 1

    def _pop(self, worker: int) -> tuple[str, float]:
        queued = self.queue[worker]
        line, at = queued.popleft()
        self._unwait(worker, line)
        if not queued:
            del self.queue[worker]
        return line, at

    def _dequeue(self, worker: int, count: int) -> list[tuple[str, float]]:
        queued = self.queue[worker]
        taken = [queued.popleft() for _ in range(min(count, len(queued)))]
        for line, _ in taken:
            self._unwait(worker, line)
        if not queued:
            del self.queue[worker]
        return taken

    def _unwait(self, worker: int, line: str) -> None:
        """One copy of ``line`` fewer waiting from ``worker`` (the text index of _enqueue)."""
        self._release(line)
        copies = self.exact[line.text]
        left = copies[worker] - 1
        if left:
            copies[worker] = left
        else:
            del copies[worker]
            if not copies:
                del self.exact[line.text]

    def _hold(self, line: _Line) -> None:
        self.held_lines += 1
        self.held_bytes += len(line.text)

    def _release(self, line: _Line) -> None:
        self.held_lines -= 1
        self.held_bytes -= len(line.text)


class FoldingView(Alignment):
    """The folded log view, live: what ``logs`` shows (``runs.fold_logs``), as lines come.

    The lowest worker still running is the reference: its lines make the common stream, each
    shown once, with the workers that printed it when they are not all of them. Every other
    worker has a cursor into that stream: a line of its that matches one of the next
    ``lookahead`` common lines moves its cursor there, and the lines it printed before it
    (which replaced the common lines it skipped) are shown under their workers
    (``w[1-3]: text``) just before that line, in the order ``logs`` gives them. A line that
    matches nothing yet waits: the common line it will match may still be on its way, since
    each worker's lines reach the view through its own follower, and a worker's common lines
    often arrive before the reference's own copy of them.

    The bound (``delay``, 3 s): a common line is shown once every live worker got past it, or
    ``delay`` seconds after its first copy arrived; a line that waited ``delay`` seconds
    without matching is placed where its worker stands: at the end of the common lines it
    becomes one (the reference is silent or dead: the lowest waiting worker stands in for it),
    elsewhere it is the worker's own line, in place of the common line at its cursor. So a
    dead or lagging worker, the reference included, delays the view by at most ``delay``, and
    what a worker says later than that is shown on its own (a late copy of a line already
    shown is not shown again).

    Memory: a line is held at most ``delay`` seconds, and at most ``hold_lines`` lines and
    ``hold_bytes`` bytes of text are held at once (by default HOLD_LINES + HOLD_LINES_PER_WORKER
    per worker, HOLD_BYTES + HOLD_BYTES_PER_WORKER per worker): past that, the oldest held
    lines are placed and shown as if their delay had passed. So what the view keeps is
    bounded by the delay and the number of workers, never by the rate or size of the output
    (``held_lines`` and ``held_bytes`` count it). Live (``start()``), while the workers' lines
    fold and the view holds more than half of that, a worker ahead of the slowest one waits
    (its follower stops reading, for ``delay`` at most) rather than have lines shown before
    the others got to them: a big log streamed fast still folds, at the slowest's pace.

    Cost per line: O(1) to place a line (waiting lines are indexed by text), O(workers) at
    most to decide whether a common line can be shown.
    """

    def __init__(self, workers: Iterable[int], out: IO[str] | None = None, *,
                 delay: float = 3.0, lookahead: int = 8,
                 clock: Callable[[], float] = time.monotonic, color: bool = False,
                 hold_lines: int | None = None, hold_bytes: int | None = None):
        super().__init__(workers, delay=delay, lookahead=lookahead, clock=clock)
        n = len(self.workers)
        self.hold_lines = hold_lines if hold_lines is not None else \
            HOLD_LINES + HOLD_LINES_PER_WORKER * n
        self.hold_bytes = hold_bytes if hold_bytes is not None else \
            HOLD_BYTES + HOLD_BYTES_PER_WORKER * n
        self._slack = 1.0               # the share of the bound that counts as over
        self.color = color
        self.out = out
        self.errors: dict[str, set[int]] = {}        # outcome -> workers, until shown
        self._errors_due = 0.0
        self._lock = threading.RLock()
        self._room = threading.Condition(self._lock)    # the hold went down (see _wait_room)
        self._waiters = 0
        self._patient = True    # False after a wait that did not help, until the view drains
        self.waits_run_out = 0  # how many times a worker ahead waited its whole delay
        self._folds = 1.0       # how much recent lines fold (moving average of 1: shown once
        # for several workers, 0: for one), so that waiting can help
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None

    def lines(self, worker: int, stream: str, data: bytes) -> None:
        text = data.decode("utf-8", "replace")
        with self._lock:
            if stream == "stderr":
                for line in text.split("\n")[:-1]:
                    self._write(f"{nodeset.label(worker)}: {line}")
                return
            if self._ticker is not None and self._full and self._patient:
                self._wait_room(worker)
            now = self.clock()
            for line in text.split("\n")[:-1]:
                self._add(worker, _Line(line), now)
                if self.held_lines > self.hold_lines or self.held_bytes > self.hold_bytes:
                    self._emit()        # the bound holds line by line, whatever the chunk
            self._emit()

    def done(self, result) -> None:
        with self._lock:
            self.finished.add(result.worker)
            self.live.discard(result.worker)
            if result.error:
                # Folded: a thousand refused connections are one line (shown at the next tick).
                if not self.errors:
                    self._errors_due = self.clock() + (self.delay / 4 if self._ticker else 0)
                self.errors.setdefault(result.error, set()).add(result.worker)
            if result.worker == self.reference:
                self.reference = min(self.live, default=None)
                if self.reference is not None:
                    self._extend(self.reference)
            self._emit()

    # -- lifecycle
    def start(self) -> FoldingView:
        """Emit lines held for a lagging worker on time, even when nothing else arrives."""
        def tick():
            while not self._stop.wait(max(0.05, self.delay / 4)):
                with self._lock:
                    self._emit()

        self._ticker = threading.Thread(target=tick, name="tpufab-fold", daemon=True)
        self._ticker.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join(timeout=2)
        with self._lock:
            self._emit(final=True)

    # -- alignment

    def _late_delay(self) -> float:
        return self.delay / 4 if self._ticker else 0.0

    def _emit(self, final: bool = False) -> None:
        now = self.clock()
        if self.errors and (final or now >= self._errors_due):
            for error, who in sorted(self.errors.items(), key=lambda kv: min(kv[1])):
                self._write(f"{nodeset.fold(who)}: {error}")
            self.errors.clear()
        self._ripen(now, force=final or not self.live)
        self._show_ready(now, final)
        if self.late and (final or now >= self._late_due):
            for k in sorted(self.late):
                who = self.late[k]
                self._write(f"{nodeset.fold(who)}: {merge_fields(who)}")
            self.late.clear()
        if self._over:
            self._squeeze(now)
        self._trim()
        if not self._patient and self.held_lines * 4 < self.hold_lines and \
                self.held_bytes * 4 < self.hold_bytes:
            self._patient = True
        if self._waiters:
            self._room.notify_all()

    def _show_ready(self, now: float, final: bool) -> None:
        """Show the common lines that are ready (every live worker got past them, or they
        waited ``delay``, or the view holds more than its bound), with the lines shown
        before them."""
        live = self.live
        while self.emitted < self._end:
            k = self.emitted
            passed = all(self.cursor.get(w, 0) > k for w in live)
            ready = final or passed or now - self.arrived[k - self.base] >= self.delay or \
                self._over
            if not ready:
                break
            if not passed:   # its delay: the field variants waiting at it join it first
                for w in sorted(w for w in self.queue if self.cursor.get(w, 0) == k):
                    self._variant_at(w)
            if k in self.extras:
                self._show(self.extras.pop(k))
            who = self.holders[k - self.base]
            self._release(self.canon[k - self.base])
            self._folds += ((len(who) > 1) - self._folds) / 64
            text = merge_fields(who)     # fields that differ between workers in braces
            self.shown[k] = set(who.values())
            self._write(text if who.keys() == self.workers else f"{nodeset.fold(who)}: {text}")
            self.emitted += 1
        if self.emitted == self._end and self.emitted in self.extras:
            # a worker's own lines after the last common line (they waited ``delay``)
            self._show(self.extras.pop(self.emitted))

    def _show(self, anchor: Mapping[str, list[_Own]]) -> None:
        for own in sorted((o for entries in anchor.values() for o in entries),
                          key=lambda o: o.order):
            self._release(own.text)
            self._folds += ((len(own.who) > 1) - self._folds) / 64
            self._write(f"{nodeset.fold(own.who)}: {merge_fields(own.who)}")

    @property
    def _over(self) -> bool:
        return (self.held_lines > self.hold_lines * self._slack
                or self.held_bytes > self.hold_bytes * self._slack)

    @property
    def _full(self) -> bool:
        """Holding more than half the bound: a worker ahead waits, if lines fold."""
        return self.held_lines * 2 > self.hold_lines or self.held_bytes * 2 > self.hold_bytes

    def _ahead(self, worker: int) -> bool:
        """``worker`` is past the slowest live worker that still folds (is within its
        look-ahead of what was shown)."""
        floor = self.emitted - self.lookahead
        at = {w: self.cursor.get(w, 0) + len(self.queue.get(w, ())) for w in self.live}
        folding = [p for w, p in at.items() if self.cursor.get(w, 0) >= floor]
        return worker in at and bool(folding) and at[worker] > min(folding)

    def _wait_room(self, worker: int) -> None:
        """Hold ``worker``'s follower (for ``delay`` at most) while the view is full and the
        slowest worker can still fold what is held."""
        deadline = time.monotonic() + self.delay
        self._waiters += 1
        try:
            while (self._full and self._folds > 0.5 and not self._stop.is_set()
                   and self._ahead(worker)):
                left = deadline - time.monotonic()
                if left <= 0:
                    # The slowest did not catch up within the delay (it is stuck, or its
                    # lines come through this same thread): no more waiting until the view
                    # has drained to a quarter, so a stall costs one delay, not one a chunk.
                    self._patient = False
                    self.waits_run_out += 1
                    break
                self._room.wait(left)
        finally:
            self._waiters -= 1

    def _squeeze(self, now: float) -> None:
        """Over the hold: the oldest waiting line is placed (as if its delay had passed), so
        that what is placed can be shown, until the view holds no more than its bound."""
        self._slack = 0.875         # down to 7/8 of the bound: not again at the next line
        try:
            self._show_ready(now, final=False)
            while self._over and self.queue:
                worker = min(self.queue, key=lambda w: (self.queue[w][0][1], w))
                self._ripen_one(worker)
                self._show_ready(now, final=False)
        finally:
            self._slack = 1.0
        self._due = min((q[0][1] + self.delay for q in self.queue.values()),
                        default=float("inf"))

    def _trim(self) -> None:
        # A worker more than ``lookahead`` lines behind what was shown can only match lines
        # already shown: it does not hold them in memory (its lines show as its own).
        if self.emitted - self.base <= 256:
            return          # nothing worth dropping: no look at every worker's cursor
        live = self.live
        floor = self.emitted - self.lookahead
        keep_from = min([self.emitted, *(c for c in (self.cursor.get(w, 0) for w in live)
                                         if c >= floor)])
        drop = keep_from - self.base
        if drop > 256:
            del self.canon[:drop], self.texts[:drop], self.holders[:drop], self.arrived[:drop]
            for k in [k for k in self.shown if k < keep_from]:
                del self.shown[k]
            self.base = keep_from

    def _write(self, text: str) -> None:
        import sys

        out = self.out if self.out is not None else sys.stdout
        out.write(neutralise_text(text, color=self.color) + "\n")
        out.flush()


class _Line:
    """A line as the live fold compares it: by its shape (tpufab.term.fields: fields such as
    a rank, an address, a loss as placeholders), with the text the worker printed in
    ``.text``. Lines of one shape fold; the view shows their texts merged. The shape is found
    only when a comparison needs it: lines identical on every worker (most of a log) match by
    their text and never pay for it."""

    __slots__ = ("text", "_shape")

    def __init__(self, text: str):
        self.text = text
        self._shape: str | None = None

    @property
    def shape(self) -> str:
        found = self._shape
        if found is None:
            found = self._shape = shape(self.text)
        return found

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Line):
            return NotImplemented
        return self.text == other.text or self.shape == other.shape

    def __hash__(self) -> int:
        return hash(self.shape)

    def __repr__(self) -> str:
        return f"_Line({self.text!r})"


@dataclass
class _Own:
    """Lines only some workers printed at one place in the folded view."""

    text: _Line
    who: dict[int, str]             # worker -> its text
    order: tuple[int, int]          # (offset in its lowest worker's run of them, that worker)


def _place(anchor: dict[str, list[_Own]], text: _Line, worker: int, offset: int) -> bool:
    """Add ``worker``'s line at ``anchor``, merged with the lines of that shape of other
    workers; True when it is a new entry (False: merged into one already there)."""
    entries = anchor.setdefault(text, [])
    for own in entries:
        if worker not in own.who:
            own.who[worker] = text.text
            if worker < own.order[1]:
                own.order = (offset, worker)     # as logs orders them: by its lowest worker
            return False
    entries.append(_Own(text, {worker: text.text}, (offset, worker)))
    return True
