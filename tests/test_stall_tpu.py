"""The stall watchdog and the TPUs (tpufab/steps/start/stall.py, issue 42): a pod at work on
its TPUs is never stalled however quiet its output; one whose TensorCores are all idle for
the stall time while the job prints is. No pod: the TPU looks are scripted."""

from __future__ import annotations

import threading

from helpers import wait_for

from tpufab.steps.health.stacks import StacksReport
from tpufab.steps.start import stall as stalls


class View:
    def lines(self, worker, stream, data):
        pass

    def done(self, result):
        pass


class Looks:
    """A TpuActivity whose looks say ``answers`` in turn (then the last, again)."""

    def __init__(self, *answers):
        self.answers = list(answers)
        self.looks = 0
        self.enabled = True

    def look(self):
        self.looks += 1
        return self.answers[min(self.looks, len(self.answers)) - 1]


class Fired:
    def __init__(self):
        self.calls: list[tuple[float, bool]] = []

    def __call__(self, silence, *, tpu_idle=False):
        self.calls.append((silence, tpu_idle))


def test_a_quiet_pod_busy_on_its_tpus_is_no_stall():
    fired, looks = Fired(), Looks(True)
    watch = stalls.StallWatch(View(), 1.0, fired, tpu=looks)
    try:
        assert wait_for(lambda: looks.looks >= 4, 30), looks.looks
    finally:
        watch.close()
    assert fired.calls == []


def test_tensorcores_idle_while_the_job_prints_is_a_stall():
    fired, looks = Fired(), Looks(True, False)
    watch = stalls.StallWatch(View(), 1.0, fired, tpu=looks)
    stop = threading.Event()

    def prints():
        while not stop.wait(0.1):
            watch.lines(0, "stdout", b"loss 2.3\n")
    printer = threading.Thread(target=prints, daemon=True)
    printer.start()
    try:
        assert wait_for(lambda: fired.calls, 30), looks.looks
    finally:
        stop.set()
        printer.join(5)
        watch.close()
    assert len(fired.calls) == 1 and fired.calls[0][1] is True and fired.calls[0][0] >= 1.0


def test_without_metrics_a_silence_is_a_stall_as_before():
    fired, looks = Fired(), Looks(None)
    watch = stalls.StallWatch(View(), 1.0, fired, tpu=looks)
    try:
        assert wait_for(lambda: fired.calls, 30)
    finally:
        watch.close()
    assert len(fired.calls) == 1 and fired.calls[0][1] is False


def test_the_handler_says_which_signal_was_missing():
    said = []
    handler = stalls.StallHandler("r1", [0, 1], 900.0, "wait", lambda t, s=None: said.append(t),
                                  lambda lines: None, take_stacks=lambda: StacksReport([0, 1]),
                                  stop=lambda: None)
    handler(900.0, tpu_idle=True)
    assert said[0].startswith("Every host's TensorCores were idle for 15m while the job "
                              "printed (--stall 15m)"), said
    assert handler.reason().startswith("every host's TensorCores were idle for 15m")
    said.clear()
    handler(900.0)
    assert said[0].startswith("No new output from any worker for 15m"), said


class Sampled(stalls.TpuActivity):
    def __init__(self, workers, *answers):
        super().__init__(None, "r1", workers)
        self.answers = list(answers)

    def samples(self):
        return self.answers.pop(0)


def chips(programs, duty=0.0):
    return {"available": True, "chips": [{"programs": programs, "duty_cycle_percent": duty}]}


def test_tpu_activity_is_programs_run_since_the_last_look():
    tpu = Sampled([0, 1], {0: chips(5), 1: chips(7)}, {0: chips(5), 1: chips(8)},
                  {0: chips(5), 1: chips(8)}, {0: chips(5), 1: {"available": False}},
                  {0: chips(5), 1: chips(8, duty=40.0)})
    assert tpu.look() is False          # all answered, nothing ran yet, no duty
    assert tpu.look() is True           # w1 ran a program since
    assert tpu.look() is False
    assert tpu.look() is None           # w1 cannot say
    assert tpu.look() is True           # w1's chips show a duty cycle


def test_a_pod_without_metrics_is_not_asked_again():
    tpu = Sampled([0, 1], {0: {"available": False, "why": "UNAVAILABLE"}})
    assert tpu.look() is None and not tpu.enabled
    assert tpu.look() is None            # (no second fan-out: samples() would fail)
