"""The live folded view (`jobs.FoldingView`) against what `tpufab logs` shows (`runs.fold_logs`).

Pure: lines are fed with the view's injectable clock, in the orders they were measured to reach
the client in `scripts/demo.sh` (each worker's log comes through its own follower, so a
worker's copy of a common line often arrives before the reference worker's own copy).
"""

from __future__ import annotations

import io

from hypothesis import given
from hypothesis import strategies as st

from tpufab.ssh.results import WorkerResult
from tpufab.steps.runs.env import fold_logs, render_folded
from tpufab.views.folding import FoldingView

HELLO = "jax_hello: jax 0.10.2 backend=cpu processes=4 devices=4 local_devices=1"
GATHER = "jax_hello: all-gather of process ids = [0, 1, 2, 3]"
SUM = "jax_hello: sum of (process index + 1) over all devices = 10 (expected 10)"
OK = "jax_hello: OK"


def gloo(rank: int) -> str:
    return (f"[Gloo] Rank {rank} is connected to 3 peer ranks. Expected number of connected "
            "peer ranks is : 3")


DEMO_LOGS = {w: [HELLO, gloo(w), GATHER, SUM, OK] for w in range(4)}

# What `tpufab logs` prints after the demo's run, and what the live view must print too: the
# lines that differ only in the rank fold into one (tpufab.term.fields).
GLOO_FOLDED = ("[Gloo] Rank {0..3} is connected to 3 peer ranks. Expected number of connected "
               "peer ranks is : 3")
DEMO_FOLDED = [HELLO, GLOO_FOLDED, GATHER, SUM, OK]

# (seconds since the run started, worker, lines in that chunk) as they reached the view in two
# runs of the demo's `run recipes/hello.sh` on a simulated v4-32 (all within 0.16 s: no worker
# lagged; the view before this fix still showed w1's common lines on their own, and w0's).
MEASURED = {
    "w2-first": [(2.172, 2, [HELLO]), (2.176, 3, [HELLO]), (2.196, 0, [HELLO]), (2.197, 1, [HELLO]),
                 (2.247, 0, [gloo(0)]), (2.248, 1, [gloo(1)]), (2.272, 2, [gloo(2), GATHER]),
                 (2.275, 3, [gloo(3), GATHER]), (2.302, 1, [GATHER, SUM, OK]),
                 (2.304, 0, [GATHER, SUM, OK]), (2.325, 2, [SUM, OK]), (2.327, 3, [SUM, OK])],
    "w0-first": [(6.365, 0, [HELLO]), (6.376, 2, [HELLO]), (6.400, 1, [HELLO]),
                 (6.403, 3, [HELLO]), (6.426, 2, [gloo(2)]), (6.450, 1, [gloo(1), GATHER]),
                 (6.454, 3, [gloo(3), GATHER]), (6.466, 0, [gloo(0), GATHER]),
                 (6.476, 2, [GATHER, SUM, OK]), (6.503, 1, [SUM, OK]), (6.504, 3, [SUM, OK]),
                 (6.520, 0, [SUM, OK])],
}


class Clock:
    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def feed(view: FoldingView, clock: Clock, arrivals, out: io.StringIO | None = None) -> None:
    for at, worker, lines in arrivals:
        clock.now = at
        view.lines(worker, "stdout", "".join(line + "\n" for line in lines).encode())


def finish(view: FoldingView, clock: Clock, workers, at: float) -> None:
    clock.now = at
    for w in workers:
        view.done(WorkerResult(w, exit_code=0))
    view.close()


def test_the_demo_logs_fold_as_logs_shows_them():
    assert render_folded(fold_logs(DEMO_LOGS), range(4)) == DEMO_FOLDED


def test_the_demo_run_folds_live_as_logs_does_in_the_orders_measured():
    for name, arrivals in MEASURED.items():
        out, clock = io.StringIO(), Clock()
        view = FoldingView(range(4), out, clock=clock)
        feed(view, clock, arrivals)
        finish(view, clock, [2, 0, 3, 1], at=arrivals[-1][0] + 0.5)
        assert out.getvalue().splitlines() == DEMO_FOLDED, name


def test_each_line_is_shown_as_soon_as_every_worker_got_past_it():
    out, clock = io.StringIO(), Clock()
    view = FoldingView(range(4), out, clock=clock)
    arrivals = MEASURED["w2-first"]
    feed(view, clock, arrivals[:4])
    assert out.getvalue().splitlines() == [HELLO]
    feed(view, clock, arrivals[4:9])
    # w0 has not sent the all-gather yet: the others' rank lines may still be copies of lines
    # of its to come, so nothing is shown before it is known where (the rank lines fold
    # once w0's all-gather places them).
    assert out.getvalue().splitlines() == [HELLO]
    feed(view, clock, arrivals[9:10])
    assert out.getvalue().splitlines() == DEMO_FOLDED[:-2]
    feed(view, clock, arrivals[10:])
    assert out.getvalue().splitlines() == DEMO_FOLDED  # before any follower ended


def test_a_reference_heard_from_late_within_the_delay_is_folded_in():
    # w0's follower delivers everything 2.5 s after the others (delay: 3 s).
    out, clock = io.StringIO(), Clock()
    view = FoldingView(range(4), out, clock=clock, delay=3.0)
    feed(view, clock, [(0.1 * w, w, DEMO_LOGS[w]) for w in (1, 2, 3)])
    clock.now = 2.4
    view._emit()
    assert out.getvalue() == ""                    # waiting for w0, not yet for too long
    feed(view, clock, [(2.5, 0, DEMO_LOGS[0])])
    assert out.getvalue().splitlines() == DEMO_FOLDED


def three_of_four_at_the_delay(speakers: tuple[int, int, int]):
    """The demo's logs from three workers at once, the fourth silent; the view at its 3 s
    delay (nothing shown a moment before), and what it then shows: those three folded."""
    out, clock = io.StringIO(), Clock()
    view = FoldingView(range(4), out, clock=clock, delay=3.0)
    feed(view, clock, [(0.0, w, DEMO_LOGS[w]) for w in speakers])
    clock.now = 2.9
    view._emit()
    assert out.getvalue() == ""
    clock.now = 3.0
    view._emit()                                   # what the ticker does
    group = f"w[{speakers[0]}-{speakers[-1]}]"
    ranks = f"{{{speakers[0]}..{speakers[-1]}}}"
    assert out.getvalue().splitlines() == [
        f"{group}: {HELLO}", f"{group}: {gloo(0).replace('Rank 0', 'Rank ' + ranks)}",
        f"{group}: {GATHER}", f"{group}: {SUM}", f"{group}: {OK}"]
    return view, out, clock


def test_a_silent_reference_holds_the_view_at_most_the_delay():
    view, out, clock = three_of_four_at_the_delay((1, 2, 3))
    # w0 speaks at last: its copies of lines already shown are not shown again, its own line is,
    # within the delay again, and nothing is lost or left held when the followers end.
    # (its rank line has the shape of the one shown, but its own rank: shown on its own.)
    feed(view, clock, [(4.0, 0, DEMO_LOGS[0])])
    clock.now = 7.0
    view._emit()
    assert out.getvalue().splitlines()[5:] == [f"w0: {gloo(0)}"]
    finish(view, clock, range(4), at=7.5)
    assert len(out.getvalue().splitlines()) == 6


def test_a_worker_that_lags_past_the_delay_is_shown_on_its_own_then():
    view, out, clock = three_of_four_at_the_delay((0, 1, 2))
    feed(view, clock, [(5.0, 3, DEMO_LOGS[3][:2])])
    clock.now = 7.9
    view._emit()
    assert len(out.getvalue().splitlines()) == 5     # its line may still find its place
    clock.now = 8.0
    view._emit()
    assert out.getvalue().splitlines()[5:] == [f"w3: {gloo(3)}"]
    feed(view, clock, [(8.2, 3, DEMO_LOGS[3][2:])])  # copies of lines shown: not again
    finish(view, clock, range(4), at=8.5)
    assert len(out.getvalue().splitlines()) == 6


def test_lines_after_the_reference_ended_are_folded_too():
    logs = {0: ["a", "b"], 1: ["a", "b", "c", "d"], 2: ["a", "b", "c", "d"]}
    out, clock = io.StringIO(), Clock()
    view = FoldingView(range(3), out, clock=clock)
    feed(view, clock, [(0.0, 1, logs[1]), (0.1, 2, logs[2]), (0.2, 0, logs[0])])
    view.done(WorkerResult(0, exit_code=0))
    assert out.getvalue().splitlines() == ["a", "b", "w[1-2]: c", "w[1-2]: d"]
    finish(view, clock, [1, 2], at=0.3)
    assert out.getvalue().splitlines() == render_folded(fold_logs(logs), range(3))


# Logs shaped like a job's: common lines, a rank's own line where each rank prints one, a
# warning only some workers print, a common last line (what comes after the last common line
# is placed by difflib in `logs`, by arrival here); any interleaving of their chunks within
# the delay.
@st.composite
def jobs_and_arrivals(draw):
    workers = draw(st.integers(min_value=2, max_value=6))
    steps = draw(st.integers(min_value=1, max_value=8))
    ranked = draw(st.sets(st.integers(min_value=0, max_value=steps - 1), max_size=2))
    logs = {}
    for w in range(workers):
        lines = []
        for i in range(steps):
            lines.append(f"rank {w} at {i}" if i in ranked else f"step {i}")
            if draw(st.integers(min_value=0, max_value=9)) == 0:
                lines.append(f"warning at {i}")
        logs[w] = [*lines, "done"]
    left = {w: list(lines) for w, lines in logs.items()}
    arrivals, now = [], 0.0
    while any(left.values()):
        w = draw(st.sampled_from(sorted(w for w in left if left[w])))
        n = draw(st.integers(min_value=1, max_value=3))
        now += draw(st.floats(min_value=0.0, max_value=0.05))
        arrivals.append((now, w, left[w][:n]))
        del left[w][:n]
    ends = draw(st.permutations(range(workers)))
    return logs, arrivals, ends


@given(jobs_and_arrivals())
def test_any_order_within_the_delay_folds_as_logs_does(case):
    logs, arrivals, ends = case
    out, clock = io.StringIO(), Clock()
    view = FoldingView(logs, out, clock=clock, delay=3.0)
    feed(view, clock, arrivals)
    finish(view, clock, ends, at=arrivals[-1][0] + 0.1)
    assert out.getvalue().splitlines() == render_folded(fold_logs(logs), logs)


# ---------------------------------------------------------------------------------------------
# Memory (issue 23, finding 10): bounded by the delay and the number of workers, not by output


class Counting(io.TextIOBase):
    """An output that keeps only how many lines it was given."""

    def __init__(self):
        self.count = 0

    def write(self, text: str) -> int:
        self.count += text.count("\n")
        return len(text)


def held(view: FoldingView) -> tuple[int, int]:
    """Lines and characters the view holds, counted in its own structures: lines waiting for a
    match, common lines not shown yet, own lines placed ahead of what was shown."""
    queued = [line for q in view.queue.values() for line, _ in q]
    pending = view.canon[view.emitted - view.base:]
    own = [o.text for anchor in view.extras.values() for entries in anchor.values()
           for o in entries]
    lines = [*queued, *pending, *own]
    return len(lines), sum(len(line.text) for line in lines)   # as printed, not by shape


BOUND = (33_792, 8_912_896)   # jobs.HOLD_* for 4 workers: 32768 + 4 x 256 lines, 8 MiB + 4 x 128 KiB


def test_four_workers_printing_100k_distinct_lines_hold_a_bounded_view():
    """Every line arrives within the delay (a fast stream: nothing ripens by time), each
    worker's lines its own: the view holds at most its bound, not the whole output."""
    workers, per_worker, chunk = 4, 100_000, 2_000
    out, clock = Counting(), Clock()
    view = FoldingView(range(workers), out, clock=clock, delay=3.0)
    most = (0, 0)
    for start in range(0, per_worker, chunk):
        clock.now = start / per_worker       # 100k lines a second: all within the delay
        for w in range(workers):
            view.lines(w, "stdout", "".join(f"{'abcd'[w] * 2} step {i} loss {i * 7 % 1000}\n"
                                            for i in range(start, start + chunk)).encode())
            if w == 0 and start % (5 * chunk) == 0:
                now = held(view)
                most = max(most[0], now[0]), max(most[1], now[1])
    assert most[0] <= BOUND[0] and most[1] <= BOUND[1], (most, BOUND)
    assert (view.hold_lines, view.hold_bytes) == BOUND
    assert held(view) == (view.held_lines, view.held_bytes)     # its own count agrees
    finish(view, clock, range(workers), at=clock.now + 0.1)
    assert out.count == workers * per_worker         # nothing lost: every line shown once
    assert held(view) == (0, 0) == (view.held_lines, view.held_bytes)


def test_a_fast_big_log_still_folds_live_in_a_bounded_view():
    """Live (followers on their own threads), a worker ahead of the others waits for them
    once the view is half full, so the same 100k lines streamed as fast as possible by four
    workers fold (each shown once, not four times) within the bound."""
    import threading

    from tpufab.ssh.results import WorkerResult

    workers, per_worker, chunk = 4, 100_000, 1000
    out = Counting()
    view = FoldingView(range(workers), out).start()
    most = [0]

    def follower(w: int) -> None:
        for start in range(0, per_worker, chunk):
            view.lines(w, "stdout", "".join(f"step {i} loss {i * 7 % 1000}\n"
                                            for i in range(start, start + chunk)).encode())
            with view._lock:
                most[0] = max(most[0], held(view)[0])
        view.done(WorkerResult(w, exit_code=0))

    threads = [threading.Thread(target=follower, args=(w,)) for w in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    view.close()
    assert most[0] <= BOUND[0], most
    assert out.count < 1.5 * per_worker, out.count      # folded (unfolded: 4 x 100k)


def test_a_stuck_slowest_worker_costs_one_delay_not_one_per_chunk():
    """w0 says nothing (stuck, or its lines come through the thread that is waiting): w1,
    ahead and holding the view half full, waits one delay, then goes on without waiting
    again until the view has drained."""
    view = FoldingView(range(2), Counting(), delay=0.5, hold_lines=2_000).start()
    for start in range(0, 20_000, 1000):
        view.lines(1, "stdout", "".join(f"step {i}\n" for i in range(start, start + 1000))
                   .encode())
    view.close()
    assert view.waits_run_out <= 1       # at most one wait of 0.5 s, not one per chunk (20)
    assert held(view) == (0, 0)


def test_workers_a_delay_late_fold_among_themselves_live():
    """Half of a 64-worker pod prints its step line more than the delay after the other half
    (a slow storage read, a client too busy to read them in time): the line was shown for
    the first half at its delay; live, the late half's variants come a moment later as one
    line, not as one line per worker."""
    def line(w: int) -> str:
        return f"step 0 loss {2.31 + w / 10000:.4f} host t1v-n-17ffbce8-w-{w}"

    out, clock = io.StringIO(), Clock()
    view = FoldingView(range(64), out, delay=3.0, clock=clock).start()
    try:
        feed(view, clock, [(0.0, w, [line(w)]) for w in range(32)])
        clock.now = 3.0
        view._emit()
        assert out.getvalue().splitlines() == \
            ["w[0-31]: step 0 loss {2.3100..2.3131} host t1v-n-17ffbce8-w-{0..31}"]
        feed(view, clock, [(5.0 + w / 1000, w, [line(w)]) for w in range(32, 64)])
        clock.now = 8.1          # their lines waited their own delay: placed, not yet shown
        view._emit()
        assert len(out.getvalue().splitlines()) == 1
        clock.now = 8.1 + 3.0 / 4
        view._emit()
        assert out.getvalue().splitlines()[1:] == \
            ["w[32-63]: step 0 loss {2.3132..2.3163} host t1v-n-17ffbce8-w-{32..63}"]
    finally:
        finish(view, clock, range(64), at=9.0)
    assert len(out.getvalue().splitlines()) == 2
