"""Straggler detection as data (tpufab/steps/runs/stragglers.py): a synchronous job's steps
with jitter name nobody; one host slowed names it within 3 steps, once."""

from __future__ import annotations

import random
import re

import pytest

from tpufab.errors import ConfigError
from tpufab.steps.runs import stragglers as s


def synchronous(steps, hosts=4, *, slow=None, by=0.15, from_step=20, jitter=0.01, seed=1,
                base=0.5, collective=0.05, metrics=True):
    """Steps of a job with a barrier each step: every host's line appears when the slowest
    host's work is done; ``slow`` works ``by`` longer from ``from_step`` on."""
    rng = random.Random(seed)
    at = 0.0
    out = []
    for n in range(steps):
        work = {h: base * (1 + rng.gauss(0, jitter)) * (1 + by if h == slow and n >= from_step
                                                          else 1) for h in range(hosts)}
        at += max(work.values()) + collective
        for h in range(hosts):
            out.append(s.Step(h, n, at + rng.uniform(0, 0.005),
                              work[h] if metrics else None,
                              100 * work[h] / (max(work.values()) + collective) if metrics
                              else None))
    return out


def test_no_false_alarm_over_50_steps_with_normal_jitter():
    for seed in range(20):
        assert s.detect(synchronous(50, seed=seed, jitter=0.02), range(4)) == [], seed


def test_a_host_slowed_15_percent_is_named_within_3_steps_once():
    for seed in range(20):
        verdicts = s.detect(synchronous(60, slow=2, seed=seed), range(4))
        assert [v.worker for v in verdicts] == [2], (seed, verdicts)
        v = verdicts[0]
        assert v.last <= 22 and v.first >= 20, v
        assert 10 <= v.percent <= 25, v
        text = v.sentence()
        assert re.match(r"w2 is 1\d% slower than the median over steps 2\d-2\d: time outside "
                        r"collectives 0\.\d\d s a step against a median of 0\.\d\d s; its chips' "
                        r"duty cycle \d+% against \d+%\.", text), text


def test_the_barrier_hides_a_straggler_from_step_times_alone():
    # without metrics a synchronous job's step times are the same on every host: nobody named
    assert s.detect(synchronous(60, slow=2, metrics=False), range(4)) == []


def test_step_times_name_a_host_that_is_not_held_back_by_a_barrier():
    steps, at = [], {h: 0.0 for h in range(4)}
    for n in range(30):
        for h in range(4):
            at[h] += 0.5 * (1.2 if h == 3 and n >= 10 else 1.0)
            steps.append(s.Step(h, n, at[h]))
    steps.sort(key=lambda x: x.at)
    verdicts = s.detect(steps, range(4))
    assert [v.worker for v in verdicts] == [3] and verdicts[0].last <= 12, verdicts
    assert "step time 0.60 s a step" in verdicts[0].sentence()


def test_said_again_only_when_it_changes():
    steps = synchronous(40, slow=1, from_step=5)
    steps = [x for x in steps if x.n < 25] + [
        s.Step(x.worker, x.n, x.at, 0.5, 90.0) for x in synchronous(40) if x.n >= 25]
    verdicts = s.detect(steps, range(4))
    assert [v.worker for v in verdicts] == [1, None], verdicts
    assert verdicts[1].sentence().startswith("No straggler any more")


def test_the_table_puts_the_slowest_first():
    rows = s.table(synchronous(40, slow=3, from_step=0), range(4))
    assert rows[0].worker == 3 and rows[0].vs_median > 10 and rows[0].steps == 40
    assert all(abs(r.vs_median) < 5 for r in rows[1:])


@pytest.mark.parametrize("line,n", [("step 120", "120"), ("Step 120/1000 loss 2.3", "120"),
                                    ("[step=7] loss", "7"), ("train: 12.5 it/s", None)])
def test_the_default_pattern_knows_the_common_forms(line, n):
    m = re.search(s.DEFAULT_PATTERN, line)
    assert m is not None and m.group("step") == n


def test_a_bad_pattern_is_one_sentence():
    with pytest.raises(ConfigError, match=r"--step-pattern \( is no regular expression"):
        s.check_pattern("(")
