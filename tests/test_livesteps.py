"""The live straggler detector as data (tpufab/steps/runs/livesteps.py): followed lines and
metrics samples in, the sentences a run says out; and `tpufab stragglers`' table
(tpufab/steps/runs/steptable.py): workers' logs and the steps timed while following in, the
table slowest first out. No pod."""

from __future__ import annotations

import json
import random
import re
import time

import pytest

from tpufab.errors import ConfigError
from tpufab.remote.workerlib import answer
from tpufab.steps.runs import livesteps as live
from tpufab.steps.runs import steptable


class Clock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


class View:
    def __init__(self):
        self.got: list[tuple[int, bytes]] = []
        self.closed = False

    def lines(self, worker, stream, data):
        self.got.append((worker, data))

    def done(self, result):
        pass

    def close(self):
        self.closed = True


def sample_line(at: float, programs: float, seconds: float, duty: float) -> str:
    import io

    out = io.StringIO()
    answer("sample", {"at": at, "available": True, "chips": [
        {"chip": c, "duty_cycle_percent": duty, "programs": programs,
         "programs_seconds": seconds} for c in range(4)]}, stream=out)
    return out.getvalue().strip()


def synchronous_run(watch, clock, steps, *, slow=None, by=0.15, from_step=0, hosts=4,
                    jitter=0.01, seed=1, base=0.3, collective=0.03, metrics=True):
    """A barrier each step: every host's line arrives when the slowest is done; each host's
    sampler answers after every step with its chips' cumulative programs and their time."""
    rng = random.Random(seed)
    programs = {h: 0 for h in range(hosts)}
    busy = {h: 0.0 for h in range(hosts)}
    for n in range(1, steps + 1):
        work = {h: base * (1 + rng.gauss(0, jitter)) * (1 + by if h == slow and n >= from_step
                                                          else 1) for h in range(hosts)}
        clock.now += max(work.values()) + collective
        for h in range(hosts):
            programs[h] += 1
            busy[h] += work[h]
        for h in rng.sample(range(hosts), hosts):
            watch.lines(h, "stdout", f"step {n} loss 2.{n}\n".encode())
        clock.now += 0.01
        if metrics:
            for h in range(hosts):
                watch.sampled(h, sample_line(clock.now, programs[h], busy[h],
                                             100 * work[h] / (max(work.values()) + collective)))


def watch_of(clock, pattern=None, hosts=4, metrics=True):
    said: list[str] = []
    watch = live.StragglerWatch(View(), range(hosts), pattern=pattern, say=said.append,
                                clock=clock)
    watch.metrics = metrics          # samples are fed by hand (no fan-out)
    return watch, said


@pytest.mark.parametrize("text,expected", [
    ("2026-12-02 01:02:03,500 step 5", (2026, 12, 2, 1, 2, 3.5, None)),
    ("[2026-12-02T01:02:03.25Z] step 5", (2026, 12, 2, 1, 2, 3.25, "Z")),
    ("I1202 01:02:03.125000 140 train.py:10] step 5", (None, 12, 2, 1, 2, 3.125, None)),
])
def test_a_line_says_when_it_was_written(text, expected):
    got = live.line_time(text, now=time.mktime((2026, 6, 1, 0, 0, 0, 0, 0, -1)))
    year, month, day, hour, minute, second, zone = expected
    want = (time.mktime((year or 2026, month, day, hour, minute, 0, 0, 0, -1)) if zone is None
            else __import__("calendar").timegm((year, month, day, hour, minute, 0, 0, 0, 0)))
    assert got == pytest.approx(want + second)


def test_a_line_without_a_time_has_none():
    assert live.line_time("step 5 at 01:02:03") is None
    assert live.line_time("2026-99-99 01:02:03 step") is None


def test_step_lines_are_cut_per_worker_and_numbered():
    tap = live.StepLines(live.stragglers.DEFAULT_PATTERN)
    assert tap.feed(0, b"loading\nstep 1 lo", 1.0) == []
    assert tap.feed(1, b"step 1\n", 1.5) == [(1, 1, 1.5, False)]
    assert tap.feed(0, b"ss 2.3\nstep 1 eval\nStep 2/10\n", 2.0) == [(0, 1, 2.0, False),
                                                                   (0, 2, 2.0, False)]
    tqdm = live.StepLines(live.stragglers.DEFAULT_PATTERN)
    assert [s[1] for s in tqdm.feed(0, b"3.1 it/s\n3.2 it/s\n", 1.0)] == [1, 2]
    own = tap.feed(0, b"2026-12-02 01:02:03,500 step 3\n", 9.0)[0]
    assert own[3] is True and own[2] != 9.0


def test_the_barrier_plus_metrics_names_the_slow_host_within_3_steps_once():
    for seed in range(10):
        clock = Clock()
        watch, said = watch_of(clock)
        synchronous_run(watch, clock, 40, slow=2, from_step=10, seed=seed)
        watch.close()
        assert len(said) == 1, (seed, said)
        first, last = map(int, said[0].split("over steps ")[1].split(":")[0].split("-"))
        assert said[0].startswith("w2 is 1") and 10 <= first and last <= 12, said
        assert re.search(r"time outside collectives 0\.3[3-6] s a step against a median of "
                         r"0\.30 s", said[0]), said
        assert "duty cycle" in said[0]


def test_no_false_alarm_over_50_steps_with_jitter():
    for seed in range(10):
        clock = Clock()
        watch, said = watch_of(clock)
        synchronous_run(watch, clock, 50, jitter=0.02, seed=seed)
        watch.close()
        assert said == [], (seed, said)


def test_without_metrics_a_barrier_hides_the_slow_host():
    clock = Clock()
    watch, said = watch_of(clock, metrics=False)
    synchronous_run(watch, clock, 40, slow=2, metrics=False)
    watch.close()
    assert said == []


def test_step_times_name_a_host_that_no_barrier_holds_back():
    clock = Clock()
    watch, said = watch_of(clock, metrics=False)
    at = {h: 0.0 for h in range(4)}
    events = []
    for n in range(1, 31):
        for h in range(4):
            at[h] += 0.5 * (1.2 if h == 3 and n >= 10 else 1.0)
            events.append((at[h], h, n))
    for t, h, n in sorted(events):
        clock.now = 1000 + t
        watch.lines(h, "stdout", f"step {n}\n".encode())
    watch.close()
    assert len(said) == 1 and said[0].startswith("w3 is 20% slower"), said
    assert "step time 0.60 s a step against a median of 0.50 s" in said[0]


def test_hosts_that_print_no_steps_are_left_out():
    clock = Clock()
    watch, said = watch_of(clock, metrics=False)
    for n in range(1, 8):
        clock.now += 1
        watch.lines(0, "stdout", f"step {n}\n".encode())
        watch.lines(1, "stdout", f"step {n}\n".encode())
    assert watch.expected == [0, 1] and watch.judged >= 5


def test_a_sample_that_is_garbage_or_unavailable_means_step_times():
    clock = Clock()
    watch, said = watch_of(clock)
    for h in range(4):
        watch.sampled(h, '@tpufab-answer sample {"available": false, "why": "UNAVAILABLE"}')
        watch.sampled(h, "@tpufab-answer sample [1, 2]")
        watch.sampled(h, "not an answer")
    synchronous_run(watch, clock, 10, slow=1, metrics=False)
    watch.close()
    assert said == [] and watch.judged == 10
    assert all(s["work"] is None for s in watch.records()["1"])


def test_a_pattern_that_matches_nothing_is_said_once_at_the_end(tmp_path):
    clock = Clock()
    watch, said = watch_of(clock, pattern=r"iteration (\d+)")
    synchronous_run(watch, clock, 5, metrics=False)
    assert said == []
    watch.save_to = tmp_path
    watch.close()
    watch.close()
    assert len(said) == 1 and said[0].startswith("--step-pattern 'iteration (\\d+)' matched no "
                                                 "line of the run"), said
    saved = json.loads((tmp_path / "steps.json").read_text())
    assert saved["workers"] == {"0": [], "1": [], "2": [], "3": []}


def test_the_default_pattern_matching_nothing_says_nothing():
    clock = Clock()
    watch, said = watch_of(clock)
    watch.lines(0, "stdout", b"hello\n")
    watch.close()
    assert said == [] and watch.view.closed


def test_a_bad_pattern_is_one_sentence():
    with pytest.raises(ConfigError, match="is no regular expression"):
        live.StragglerWatch(View(), [0], pattern="(", say=print)


def test_steps_saved_are_what_the_table_reads(tmp_path):
    clock = Clock()
    watch, said = watch_of(clock)
    watch.save_to = tmp_path
    synchronous_run(watch, clock, 20, slow=3)
    watch.close()
    saved = json.loads((tmp_path / "steps.json").read_text())
    rows = live.stragglers.table(live.stragglers.parse_steps(saved["workers"]), range(4))
    assert rows[0].worker == 3 and rows[0].vs_median > 10, rows
    assert saved["verdicts"] == said


def test_the_worker_sampler_answers_and_ends_with_the_run(tmp_path):
    """top_worker.py --stream, as shipped, alone: a sample (no service here: why not), then it
    ends by itself, since the run's directory says the run is over."""
    import subprocess
    import sys

    from helpers import shipped

    (tmp_path / "20261202-010203-abcd").mkdir()
    (tmp_path / "20261202-010203-abcd" / "end.json").write_text('{"exit_code": 0}')
    got = subprocess.run([sys.executable, "-I", "-S", str(shipped("top_worker.py")),
                          "--stream", "--run", "20261202-010203-abcd", "--run-dir",
                          str(tmp_path), "--every", "0.25"],
                         capture_output=True, text=True, timeout=60)
    assert got.returncode == 0, got.stderr
    from tpufab.remote.workerlib import read_answers

    samples = [payload for _, payload in read_answers(got.stdout, "sample")]
    assert len(samples) == 1 and samples[0]["available"] is False and samples[0]["why"], got
    assert isinstance(samples[0]["at"], float)


# -- tpufab stragglers' table --------------------------------------------------------------


class Log:
    def __init__(self, text: str):
        self.data = text.encode()

    def chunks(self):
        yield self.data[:7]
        yield self.data[7:]


def test_the_steps_timed_while_following_make_the_table(tmp_path):
    clock = Clock()
    watch, said = watch_of(clock)
    run_dir = tmp_path / ".tpufab" / "runs" / "20261202-010203-abcd"
    run_dir.mkdir(parents=True)
    watch.save_to = run_dir
    synchronous_run(watch, clock, 20, slow=1)
    watch.close()
    logs = {w: Log("".join(f"step {n} loss 2.{n}\n" for n in range(1, 21))) for w in range(4)}
    report = steptable.table_of("20261202-010203-abcd", logs, base=tmp_path)
    assert [r.worker for r in report.rows][0] == 1 and report.rows[0].vs_median_percent > 10
    assert report.measure == "time outside collectives"
    assert report.summary.startswith("Run 20261202-010203-abcd: w1 is the slowest, its median "
                                     "time outside collectives 0.3"), report.summary
    assert all(r.steps == 20 and r.last_step == 20 for r in report.rows)
    from tpufab.reports import to_json

    data = json.loads(json.dumps(to_json(report)))
    assert data["rows"][0]["worker"] == 1 and data["measure"] == "time outside collectives"


def test_timestamps_in_the_lines_make_step_times(tmp_path):
    logs = {0: Log("".join(f"2026-12-02 01:00:{n * 2:02d} step {n}\n" for n in range(1, 11))),
            1: Log("".join(f"2026-12-02 01:00:{n * 2:02d} step {n}\n" for n in range(1, 11))),
            2: Log("".join(f"2026-12-02 01:00:{n * 3:02d} step {n}\n" for n in range(1, 11)))}
    report = steptable.table_of("20261202-010203-abcd", logs, base=tmp_path)
    assert report.measure == "step time" and report.rows[0].worker == 2
    assert report.rows[0].median_seconds == 3.0 and report.rows[1].median_seconds == 2.0
    assert "the timestamps of the step lines" in report.summary


def test_without_times_the_host_furthest_behind_comes_first(tmp_path):
    logs = {0: Log("step 1\nstep 2\nstep 3\n"), 1: Log("step 1\n"), 2: Log("step 1\nstep 2\n")}
    report = steptable.table_of("20261202-010203-abcd", logs, base=tmp_path, missing=[3])
    assert [r.worker for r in report.rows] == [1, 2, 0]
    assert report.measure is None and "furthest behind: w1 at step 1" in report.summary
    assert report.notes == ["No log from w3 (unreachable): the table is the other hosts'."]


def test_a_pattern_that_matches_no_line_says_so(tmp_path):
    logs = {0: Log("hello\n"), 1: Log("hello\n")}
    report = steptable.table_of("20261202-010203-abcd", logs, r"iter (\d+)", base=tmp_path)
    assert report.summary.startswith("No line of run 20261202-010203-abcd matched the step "
                                     "pattern 'iter (\\\\d+)'"), report.summary


def test_a_worker_whose_sampler_ended_holds_no_step_back():
    clock = Clock()
    watch, said = watch_of(clock)
    for h in range(4):
        watch.lines(h, "stdout", b"step 1\n")
    clock.now += 1
    for h in range(4):
        watch.lines(h, "stdout", b"step 2\n")
    assert watch.judged == -1                   # waiting for samples that cover the steps
    for h in range(4):
        watch.sampler_ended(h)                  # e.g. no gRPC client there
    assert watch.judged == 2


def test_no_log_at_all_says_so(tmp_path):
    report = steptable.table_of("20261202-010203-abcd", {}, base=tmp_path, missing=[0, 1])
    assert report.rows == [] and report.summary.startswith("No worker's log of run ")
