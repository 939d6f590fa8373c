"""The simulated chip's bookkeeping (tpufab/sim/tpumetrics.step_holder), as data: a look at the
holder's main thread every few milliseconds (its run + runqueue seconds, state, voluntary
context switches) and its worker's stops by `tpufab sim slow` (sim/slow.py) make programs.
A stop is part of the program it lands in and costs the process a voluntary switch that is
no wait of its own; a wait of its own ends a program."""

from __future__ import annotations

from tpufab.sim.tpumetrics import Holder, step_holder


def looks(*rows):
    """Feed (t, busy seconds, state, switches, stops, stopped seconds) rows; the programs."""
    h, programs = Holder(pid=1, chips={0}), []
    for t, raw, state, switches, stops, stopped in rows:
        step_holder(h, t, raw, state, switches, programs, (stops, stopped))
    return h, [round(p, 3) for p in programs]


def test_a_stop_inside_a_program_lengthens_it_and_does_not_split_it():
    _, programs = looks(
        (0.00, 0.00, "S", 10, 0, 0.0),
        (0.01, 0.01, "R", 10, 0, 0.0),     # the program begins
        (0.11, 0.11, "R", 10, 0, 0.0),
        (0.13, 0.115, "R", 11, 1, 0.015),  # stopped 15 ms and continued between two looks
        (0.31, 0.295, "R", 11, 1, 0.015),
        (0.32, 0.30, "S", 12, 1, 0.015),   # its own wait (the barrier): the program ends
    )
    assert programs == [0.315]             # 0.30 s on or waiting for a CPU + 15 ms stopped


def test_a_look_between_the_count_and_the_stop_landing_splits_nothing():
    _, programs = looks(
        (0.00, 0.00, "R", 10, 0, 0.0),
        (0.01, 0.01, "R", 10, 0, 0.0),
        (0.02, 0.02, "R", 10, 1, 0.0),     # SIGSTOP counted, not landed yet
        (0.04, 0.025, "R", 11, 1, 0.010),  # landed, continued: its switch arrives now
        (0.10, 0.085, "R", 11, 1, 0.010),
        (0.11, 0.09, "S", 12, 1, 0.010),
    )
    assert programs == [0.1]


def test_a_wait_of_its_own_splits_a_program_even_during_stops():
    _, programs = looks(
        (0.00, 0.00, "R", 10, 0, 0.0),
        (0.01, 0.01, "R", 10, 0, 0.0),
        (0.20, 0.20, "R", 10, 0, 0.0),
        (0.21, 0.205, "R", 12, 1, 0.005),  # a stop and a short wait (the next batch) between
        (0.40, 0.395, "R", 12, 1, 0.005),
        (0.41, 0.40, "S", 13, 1, 0.005),
    )
    assert len(programs) == 2 and abs(sum(programs) - 0.405) < 1e-9, programs


def test_a_stop_while_it_waits_is_no_program_and_no_busy_time():
    h, programs = looks(
        (0.00, 0.00, "S", 10, 0, 0.0),
        (0.01, 0.00, "S", 10, 0, 0.0),
        (0.05, 0.0001, "T", 11, 1, 0.015),   # stopped in the barrier
        (0.09, 0.0002, "S", 12, 1, 0.015),
    )
    assert programs == [] and h.busy < 0.001


def test_a_stop_by_another_hand_counts_as_the_looks_saw_it():
    _, programs = looks(
        (0.00, 0.00, "R", 10, 0, 0.0),
        (0.01, 0.01, "R", 10, 0, 0.0),
        (0.11, 0.01, "T", 11, 0, 0.0),      # SIGSTOP from somebody else: 0.1 s seen stopped
        (0.12, 0.02, "R", 11, 0, 0.0),
        (0.13, 0.03, "S", 12, 0, 0.0),
    )
    assert programs == [0.13]


def test_the_host_s_own_short_work_is_no_program_however_long_it_waited_for_a_cpu():
    """A loop that prints a line and sleeps, its chips held: each turn is 0.3 ms on a CPU and,
    on a busy machine, 20 ms waiting for one. No program, no busy time, the chips idle."""
    h, programs = Holder(pid=1, chips={0}), []
    t, raw, run, switches = 0.0, 0.0, 0.0, 10
    step_holder(h, t, raw, "S", switches, programs, (0, 0.0), run)
    for _ in range(20):
        t += 0.01                                # a look sees it running (waiting for a CPU)
        raw += 0.01
        step_holder(h, t, raw, "R", switches, programs, (0, 0.0), run)
        t += 0.01
        raw, run, switches = raw + 0.0103, run + 0.0003, switches + 1
        step_holder(h, t, raw, "S", switches, programs, (0, 0.0), run)
        t += 0.5
        step_holder(h, t, raw, "S", switches, programs, (0, 0.0), run)
    assert programs == [] and h.busy == 0.0 and not h.in_program
    # while a real program of the same look pattern is one: 0.3 s on a CPU
    step_holder(h, t + 0.01, raw + 0.01, "R", switches, programs, (0, 0.0), run + 0.01)
    step_holder(h, t + 0.31, raw + 0.31, "S", switches + 1, programs, (0, 0.0), run + 0.31)
    assert [round(p, 3) for p in programs] == [0.31]
