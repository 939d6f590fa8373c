"""Lines that differ only in their fields fold into one (tpufab.term.fields), in `logs`
(runs.fold_logs) as live (FoldingView): recorded multi-host output as data, and the property
that folding never loses a line (unfolding gives every worker's lines back, in order)."""

from __future__ import annotations

import io
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tpufab.ssh.results import WorkerResult
from tpufab.steps.runs.env import fold_logs, render_folded, unfold
from tpufab.term.fields import FIELD, PLACEHOLDER, fields, merge, shape, show_values
from tpufab.views.folding import FoldingView


@pytest.mark.parametrize("values,shown", [
    ([str(r) for r in range(64)], "{0..63}"),                        # a rank
    (["0", "1", "2", "3", "8", "9", "10", "11"], "{0..3,8..11}"),    # two runs of ranks
    ([str(2 * r) for r in range(64)], "{0..126..2}"),                # a progression
    (["2.31", "2.34", "2.32", "2.33", "2.31", "2.30"], "{2.30..2.34}"),  # a loss: its span
    (["1.0", "9.9"], "{1.0,9.9}"),                                   # a few: the set
    (["05", "07"], "{05,07}"),                                       # as printed
    (["1", "2", "03"], "{1..03}"),                  # 03 is not an integer as printed: a span
    ([f"{n:08x}" for n in range(0xa0000000, 0xa0000008)],
     "{a0000000,a0000001,a0000002,...} (8 distinct)"),               # hashes: some, and a count
    (["7", "7", "7"], "7"),
])
def test_how_a_varying_field_is_shown(values, shown):
    assert show_values(values) == shown


@given(st.lists(st.sampled_from(["0", "1", "2", "3", "5", "8", "05", "2.31", "2.4", "1e1000",
                                  "2e1000", "17ffbce8", "a3f9e01c", "0x1f"]), min_size=1,
                max_size=12).flatmap(lambda values: st.permutations(values).map(
                    lambda shuffled: (values, shuffled))))
def test_a_field_shows_the_same_whatever_the_order_of_its_values(case):
    # merge() reads each distinct text once, in no particular order: that must not show
    values, shuffled = case
    assert show_values(shuffled) == show_values(values)


def test_the_issues_examples_fold_as_a_person_would_write_them():
    gloo = {w: f"[Gloo] Rank {w} is connected to 63 peer ranks. Expected number of connected "
               "peer ranks is : 63" for w in range(64)}
    assert merge(gloo) == ("[Gloo] Rank {0..63} is connected to 63 peer ranks. Expected number "
                           "of connected peer ranks is : 63")
    assert merge({w: f"host t1v-n-17ffbce8-w-{w}" for w in range(64)}) == \
        "host t1v-n-17ffbce8-w-{0..63}"
    assert merge({w: f"ip 127.16.4.{w + 1}" for w in range(64)}) == "ip 127.16.4.{1..64}"
    assert merge({0: "step 100 loss 2.31", 1: "step 100 loss 2.34", 2: "step 100 loss 2.33",
                  3: "step 100 loss 2.32", 4: "step 100 loss 2.31"}) == \
        "step 100 loss {2.31..2.34}"


def test_what_is_a_field_and_what_is_not():
    # a mask, a path's names and words are text: they must match for lines to fold
    assert shape("HF_TOKEN=*** ok") == "HF_TOKEN=*** ok"
    assert shape("/ckpt/run-a/step_100") != shape("/ckpt/run-b/step_100")
    assert shape("Traceback (most recent call last):") != shape("Epoch 3 done")
    # a hex word with a digit is one field (a commit, a hash), a date splits at its dashes
    assert shape("commit 3f2a9c1e on main") == shape("commit 0b7d44aa on main")
    assert shape("2026-11-24 23:13:05.123 up") == shape("2026-11-25 00:01:59.999 up")
    assert shape("deadbeef") == "deadbeef"          # no digit: a word


@given(st.lists(st.sampled_from(["0x", "0", "7", "3", "12", "2.31", "127.16.4.1", "ff", "17ffbce8",
                                  "X", "g", ".", "-", "_", " ", "/", "\u0663", "é", "\ud800"]),
                max_size=12).map("".join))
def test_a_lines_fields_are_where_the_rule_puts_them(line):
    # shape() and fields() run the rule (FIELD) once per line with its digits made alike and
    # remember it: they must give what the rule gives on the line itself, whatever its digits
    # (0 is not like the others: ``0x1f`` is an address, ``1x1f`` is not)
    assert shape(line) == (FIELD.sub(PLACEHOLDER, line) if re.search(r"\d", line) else line)
    assert fields(line) == FIELD.findall(line)


def jax_hello(workers: int) -> dict[int, list[str]]:
    """What the `tpufab init --framework jax` hello recipe prints on every host (recorded on
    the simulated pod), rank by rank."""
    n = workers
    return {w: [f"jax_hello: jax 0.10.2 backend=cpu processes={n} devices={n} local_devices=1",
                f"[Gloo] Rank {w} is connected to {n - 1} peer ranks. Expected number of "
                f"connected peer ranks is : {n - 1}",
                f"jax_hello: process {w} of {n} on t1v-n-17ffbce8-w-{w} (127.16.1.{w + 1})",
                f"jax_hello: all-gather of process ids = [0, 1, ..., {n - 1}]",
                f"jax_hello: step 0 loss {2.31 + (w % 4) / 100:.2f} took {0.5 + w % 3 / 10:.1f}s",
                "jax_hello: OK"] for w in range(workers)}


@pytest.mark.parametrize("workers", [64, 1024])
def test_a_hello_world_on_a_big_pod_reads_like_one_host(workers):
    logs = jax_hello(workers)
    logs[17] = logs[17][:4] + ["Traceback (most recent call last):", "  RuntimeError: boom"] + \
        logs[17][4:]
    shown = render_folded(fold_logs(logs), logs)
    assert len(shown) <= 12, shown
    assert shown[1].startswith(f"[Gloo] Rank {{0..{workers - 1}}} is connected")
    assert f"process {{0..{workers - 1}}} of {workers} on t1v-n-17ffbce8-w-{{0..{workers - 1}}} " \
           f"(127.16.1.{{1..{workers}}})" in shown[2]
    # the line that genuinely differs stands out, on its own worker
    assert "w17: Traceback (most recent call last):" in shown
    assert "loss {2.31..2.34}" in "\n".join(shown)


def test_the_live_view_folds_the_rank_lines_as_logs_does():
    logs = jax_hello(64)
    out = io.StringIO()
    view = FoldingView(range(64), out, delay=3.0)
    for w in reversed(range(64)):              # any order: the highest rank's first
        view.lines(w, "stdout", "".join(f"{line}\n" for line in logs[w]).encode())
    for w in range(64):
        view.done(WorkerResult(w, exit_code=0))
    view.close()
    assert out.getvalue().splitlines() == render_folded(fold_logs(logs), logs)
    assert len(out.getvalue().splitlines()) == 6


class _Counted:
    """The field rule, counting how often it runs."""

    def __init__(self, pattern):
        self.pattern, self.runs = pattern, 0

    def __getattr__(self, name):
        self.runs += 1
        return getattr(self.pattern, name)


def test_the_field_rule_runs_once_per_kind_of_line_not_once_per_line(monkeypatch):
    # a training log on 64 workers whose loss and tokens/s differ per worker: 1,280 lines of
    # a few keys (the rule is the fold's dearest step; it ran twice a line)
    import tpufab.term.fields as fields_module

    counted = _Counted(FIELD)
    monkeypatch.setattr(fields_module, "FIELD", counted)
    monkeypatch.setattr(fields_module, "_PARSED", {}, raising=False)
    logs = {w: [f"step {i} loss {2.31 + i / 1000 + (w % 7) / 10000:.4f} tokens/s {123000 + w}"
                for i in range(20)] for w in range(64)}
    out = io.StringIO()
    view = FoldingView(range(64), out, delay=3.0, clock=lambda: 0.0)
    for w in reversed(range(64)):       # the reference's lines last: every line waits
        view.lines(w, "stdout", "".join(f"{line}\n" for line in logs[w]).encode())
    for w in range(64):
        view.done(WorkerResult(w, exit_code=0))
    view.close()
    shown = out.getvalue().splitlines()
    assert shown[0] == "step 0 loss {2.3100..2.3106} tokens/s {123000..123063}"
    assert len(shown) == 20
    # once per key (a line with its digits 2-9 made 1: here ~24 of them, 0 stays 0) and one
    # split per line shown; it was twice per line (2,560)
    assert counted.runs <= 64 * 20 // 16


LINES = st.sampled_from(["step {n}", "loss {n}.5", "rank {w} ok", "warning", "host-{w}",
                         "done {n}", "saved ckpt-{n}"])


@given(st.integers(min_value=1, max_value=5).flatmap(
    lambda workers: st.lists(st.lists(st.tuples(LINES, st.integers(0, 3)), max_size=12),
                             min_size=workers, max_size=workers)))
def test_folding_never_loses_a_line(per_worker):
    logs = {w: [template.format(n=n, w=w) for template, n in lines]
            for w, lines in enumerate(per_worker)}
    folded = fold_logs(logs)
    for w, lines in logs.items():
        assert unfold(folded, w) == lines
