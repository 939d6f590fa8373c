"""Output safety, the pure and worker-side parts: secrets masked where output is captured,
worker output that cannot drive the user's terminal, run state that never calls a finished run
lost, logs folded in bounded memory, local log copies pruned, a full disk named as such.

The same promises on the simulated pod, through the verbs, are in tests/test_output_safety_sim.py.
"""

from __future__ import annotations

import io
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import WORKER_PYTHON, shipped

from tpufab import quoting
from tpufab.remote import facts_worker as facts
from tpufab.remote import run_worker as launch
from tpufab.remote import workerlib
from tpufab.ssh.remote_files import read_answer
from tpufab.ssh.results import WorkerResult
from tpufab.steps.runs.env import fold_logs, fold_stream, render_folded
from tpufab.steps.runs.running import WorkerState, fold_states, prune_local_runs
from tpufab.term.terminal import Lines, lines_of, neutralise, neutralise_text
from tpufab.views.folding import FoldingView
from tpufab.views.live import LiveView, print_gathered

LAUNCH = shipped("run_worker.py")
HF = "hf_Vq3/x+y=z&w-must-not-leak"
WANDB = "wandb-6f1e9a-must-not-leak"


def wait_for(condition, timeout=20.0, what="condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


# -- secret forms and the streaming masker ---------------------------------------------------


def test_secret_forms_cover_url_encoding_and_agree_on_both_sides():
    from urllib.parse import quote, quote_plus

    forms = quoting.secret_forms([HF])
    for form in (HF, quote(HF, safe=""), quote(HF), quote_plus(HF),
                 "hf_Vq3%2fx%2by%3dz%26w-must-not-leak"):
        assert form in forms
    assert forms == sorted(forms, key=lambda f: (-len(f.encode()), f.encode()))
    assert quoting.secret_forms is launch.secret_forms          # one definition, inlined there
    assert quoting.mask(f"GET https://u:{quote(HF, safe='')}@hub/x?t={quote_plus(HF)}",
                        [HF]) == "GET https://u:***@hub/x?t=***"


def forms(values):
    return [f.encode() for f in launch.secret_forms(values)]


@pytest.mark.parametrize("secret", [HF, WANDB, "abcdefgh"])
def test_masker_masks_a_secret_split_at_every_point(secret):
    text = f"a {secret} b {secret}{secret} c\n".encode()
    masker = launch.Masker(forms([secret, WANDB]))
    for cut in range(1, len(text)):
        for second in (cut, min(len(text), cut + 3)):
            out = masker.feed(text[:cut]) + masker.feed(text[cut:second]) + \
                masker.feed(text[second:]) + masker.flush()
            assert out == b"a *** b ****** c\n", (cut, second, out)


def test_masker_holds_back_only_what_could_become_a_secret():
    masker = launch.Masker(forms([HF]))
    assert masker.feed(b"step 1 loss 0.5\n") == b"step 1 loss 0.5\n"
    assert masker.feed(b"token hf_V") == b"token "       # could be the start of the token
    assert masker.feed(b"ery nice\n") == b"hf_Very nice\n"
    assert masker.flush() == b""


# -- the supervisor masks what reaches the log --------------------------------------------------

SET_X = r"""#!/bin/bash
set -x
echo "HF_TOKEN=$HF_TOKEN WANDB_API_KEY=$WANDB_API_KEY"
curl_url="https://user:${HF_TOKEN}@hub.example/x?key=${WANDB_API_KEY}"
echo "$curl_url"
python3 -c 'import os, urllib.parse as u; print(u.quote(os.environ["HF_TOKEN"], safe=""))'
set +x
printf '%s' "${HF_TOKEN:0:7}"; sleep 0.2; printf '%s\n' "${HF_TOKEN:7}"
echo done
"""


def start_run(run_dir: Path, run_id: str, body: str, env: dict, *extra: str) -> dict:
    recipe = run_dir.parent / f"{run_id}.sh"
    recipe.write_text(body)
    recipe.chmod(0o755)
    proc = subprocess.run([WORKER_PYTHON, str(LAUNCH), "start", "--run-dir", str(run_dir),
                           "--run", run_id, "--recipe", str(recipe), "--env-stdin", *extra],
                          input=json.dumps(env), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return read_answer(proc.stdout)


def status_of(run_dir: Path, run_id: str) -> dict:
    proc = subprocess.run([WORKER_PYTHON, str(LAUNCH), "status", "--run-dir", str(run_dir),
                           "--run", run_id], capture_output=True, text=True, timeout=60)
    return read_answer(proc.stdout)["runs"][0]


def test_the_log_on_the_worker_never_holds_a_secret(tmp_path):
    runs = tmp_path / "runs"
    start_run(runs, "sx", SET_X, {"HF_TOKEN": HF, "WANDB_API_KEY": WANDB})
    wait_for(lambda: status_of(runs, "sx")["state"] == "exited", what="the run to end")
    log = (runs / "sx" / "log").read_text()
    assert "+ echo 'HF_TOKEN=*** WANDB_API_KEY=***'" in log
    assert "https://user:***@hub.example/x?key=***" in log
    assert log.splitlines()[-2:] == ["***", "done"]          # split across two writes
    for path in tmp_path.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert HF.encode() not in data and WANDB.encode() not in data, path


# -- run state: a finished run is never lost ---------------------------------------------------


def ended_during_the_liveness_check(monkeypatch, rundir: Path):
    """The race, forced: the recipe and its supervisor are gone by the time their liveness is
    checked, and the supervisor recorded the exit just before it went."""
    def gone(*args, **kwargs):
        if not (rundir / "end.json").read_bytes().strip():
            (rundir / "end.json").write_text(json.dumps({"exit_code": 0, "ended_at": 1.0}))
            (rundir / "exit_code").write_text("0\n")
        return False

    nobody_alive(monkeypatch, gone)


def nobody_alive(monkeypatch, gone=lambda *args: False):
    """Every liveness check of a run says no (after ``gone``)."""
    monkeypatch.setattr(workerlib, "alive", gone)
    monkeypatch.setattr(workerlib, "supervisor_alive", gone)
    monkeypatch.setattr(workerlib, "run_processes",
                        lambda runs: gone() or {name: [] for name in runs})


def fake_rundir(tmp_path: Path, name: str = "race") -> Path:
    """A run whose recipe (pid 4242) and supervisor are gone, with no end recorded."""
    rundir = tmp_path / "runs" / name
    rundir.mkdir(parents=True)
    (rundir / "meta.json").write_text(json.dumps({"run": name, "recipe": "r.sh"}))
    for name, value in (("pid", 4242), ("start_time", 1), ("supervisor", 4243),
                        ("supervisor_start_time", 1)):
        (rundir / name).write_text(f"{value}\n")
    (rundir / "end.json").write_bytes(b" " * 4096)
    return rundir


@pytest.mark.parametrize("read", [launch.run_status, facts.run_state],
                         ids=["launch-status", "facts"])
def test_a_run_that_ends_while_it_is_read_is_exited(tmp_path, monkeypatch, read):
    rundir = fake_rundir(tmp_path)
    ended_during_the_liveness_check(monkeypatch, rundir)
    state = read(str(rundir))
    assert (state["state"], state["exit_code"]) == ("exited", 0)


@pytest.mark.parametrize("read", [launch.run_status, facts.run_state],
                         ids=["launch-status", "facts"])
def test_a_run_whose_supervisor_vanished_without_a_record_is_still_lost(tmp_path, monkeypatch,
                                                                         read):
    rundir = fake_rundir(tmp_path)
    nobody_alive(monkeypatch)
    assert read(str(rundir))["state"] == "lost"


def test_a_run_that_left_a_process_behind_is_running_until_that_ends(tmp_path):
    """Recipe and supervisor gone, no end recorded, but a process of the run lives on (it
    carries the run's TPUFAB_RUN_ID): run_worker.py (shipped) and facts_worker.py both say running; once
    it is gone, lost."""
    name = f"stray-{os.getpid()}-{random.randrange(1 << 30):x}"
    rundir = fake_rundir(tmp_path, name)
    stray = subprocess.Popen(["sleep", "300"], env={**os.environ, "TPUFAB_RUN_ID": name},
                             start_new_session=True)
    try:
        assert status_of(rundir.parent, name)["state"] == "running"
        assert [r["state"] for r in facts.runs(str(rundir.parent), 5)[0]] == ["running"]
    finally:
        stray.kill()
        stray.wait(10)
    assert status_of(rundir.parent, name)["state"] == "lost"
    assert [r["state"] for r in facts.runs(str(rundir.parent), 5)[0]] == ["lost"]


# -- a full disk during a run -------------------------------------------------------------------


@pytest.fixture
def tiny_disk(tmp_path):
    """A 256 KiB tmpfs (needs root, as the simulated pod does)."""
    where = tmp_path / "tiny"
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(where)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    yield where
    subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_disk_that_fills_up_mid_run_is_recorded_as_such(tiny_disk):
    runs = tiny_disk / "runs"
    body = ("#!/bin/sh\necho start\nhead -c 600000 /dev/zero | tr '\\0' 'x' | fold -w 100\n"
            "echo finished\nexit 0\n")
    start_run(runs, "full", body, {})
    state = wait_for(lambda: (s := status_of(runs, "full"))["state"] != "running" and s,
                     what="the run to end")
    assert state["state"] == "exited" and state["exit_code"] == 0     # not "lost"
    full = state["disk_full"]
    assert full["error"] == "no space left on device" and full["lost_bytes"] > 300000
    assert full["dir"] == str(runs / "full")
    worker = WorkerState(1, "exited", 0, info=state)
    assert not worker.ok and worker.exit_status == 1
    assert fold_states([worker]).startswith(
        "w1 exited 0 (disk full: the log stops at ")
    assert "of output lost (no space left on device in " in worker.label
    assert facts.run_state(str(runs / "full"))["disk_full"] == full


# -- terminal safety ----------------------------------------------------------------------------

HOSTILE = (b"title \x1b]0;pwned\x07 clip \x1b]52;c;ZWNobyBwd25lZA==\x07 clear \x1b[2J\x1b[H"
           b" move \x1b[10;1H bell \x07\n"
           b"real\rw9 \xe2\x94\x82 forged\n"
           b"back\x08\x08\x08\x08w9 \xe2\x94\x82 forged\n"
           b"\xe2\x80\xaeevil\xc2\x9b31m \x1b[31mred\x1b[0m tab\tok \xff\xfe\n")


def test_control_sequences_are_made_visible_and_colours_pass_only_when_asked():
    shown = neutralise(HOSTILE).decode()
    assert "\x1b" not in shown and "\x07" not in shown and "\x08" not in shown
    assert "\r" not in shown and "\x9b" not in shown and "\u202e" not in shown
    assert shown.splitlines() == [
        "title ^[]0;pwned^G clip ^[]52;c;ZWNobyBwd25lZA==^G clear ^[[2J^[[H move ^[[10;1H "
        "bell ^G",
        "w9 │ forged",                  # what a terminal shows after the CR: no prefix forged
        "back^H^H^H^Hw9 │ forged",
        "<U+202E>evil<U+009B>31m red tab\tok \ufffd\ufffd"]
    colored = neutralise(HOSTILE, color=True).decode().splitlines()[3]
    assert colored == "<U+202E>evil<U+009B>31m \x1b[31mred\x1b[0m tab\tok \ufffd\ufffd\x1b[0m"
    plain = b"step 1 loss 0.25\tok\n"
    assert neutralise(plain) is plain
    assert neutralise_text("a\x1b[2Jb") == "a^[[2Jb"


def test_live_view_prefixes_every_line_and_no_worker_can_forge_one():
    out = io.BytesIO()
    view = LiveView(out=out, err=io.BytesIO(), color=False, workers=[0, 1])
    view.lines(1, "stdout", HOSTILE)
    lines = out.getvalue().decode().splitlines()
    assert len(lines) == 4 and all(line.startswith("w1 │ ") for line in lines)
    assert lines[1] == "w1 │ w9 │ forged"
    assert b"\x1b" not in out.getvalue()


def test_gathered_output_is_neutralised_and_bounded_by_line():
    result = WorkerResult(0, 0)
    result.stdout_output.write(HOSTILE + b"x" * (3 << 20))       # 3 MiB without a newline
    from tpufab.ssh.results import GroupResult

    out, err = io.BytesIO(), io.BytesIO()
    print_gathered(GroupResult({0: result}), out, err, color=False)
    body = out.getvalue().split(b"\n", 3)[3]       # after the header (rule, workers, rule)
    assert b"\x1b" not in body and b"\r" not in body
    assert max(len(line) for line in body.split(b"\n")) <= 1 << 20
    assert body.count(b"x") == 3 << 20


def test_folding_view_neutralises_what_it_shows():
    out = io.StringIO()
    view = FoldingView([0, 1], out, delay=600.0)
    view.lines(0, "stdout", b"\x1b]0;t\x07same\n")
    view.lines(1, "stdout", b"\x1b]0;t\x07same\n")
    view.close()
    assert out.getvalue() == "^[]0;t^Gsame\n"


def test_lines_bound_a_line_without_newline():
    cutter = Lines(limit=1000)
    pieces = []
    for _ in range(50):
        pieces += list(cutter.feed(b"y" * 333))
    pieces += list(cutter.end())
    assert all(len(p) <= 1001 for p in pieces)
    assert b"".join(p[:-1] for p in pieces) == b"y" * (333 * 50)
    assert list(lines_of([b"a\rb\nc", b"d\n", b"e"])) == [b"a\rb\n", b"cd\n", b"e\n"]


# -- logs folded in bounded memory ---------------------------------------------------------------


def logs_like_a_training_run(workers: int, lines: int, seed: int = 7) -> dict[int, list[str]]:
    rng = random.Random(seed)
    out = {}
    for w in range(workers):
        mine = []
        for i in range(lines):
            mine.append(f"step {i} loss {1.0 / (i + 1):.4f}")
            if rng.random() < 0.01:
                mine.append(f"worker {w} warning {rng.randrange(3)}")
        out[w] = mine
    out[workers - 1] = out[workers - 1][: lines // 2]        # one worker stopped halfway
    return out


@pytest.mark.parametrize("window", [5, 64, 10000])
def test_fold_stream_shows_every_line_with_the_workers_that_printed_it(window):
    logs = logs_like_a_training_run(4, 400)
    folded = list(fold_stream(logs, window=window))
    for w, lines in logs.items():
        assert [f.text for f in folded if w in f.workers] == lines
    if window >= 10000:
        assert folded == fold_logs(logs)          # one window: the same as the whole fold


def test_fold_stream_of_identical_logs_is_each_line_once():
    logs = {w: [f"line {i}" for i in range(3000)] for w in range(8)}
    folded = list(fold_stream(logs, window=100))
    assert [f.text for f in folded] == logs[0] and {f.workers for f in folded} == {tuple(range(8))}



@pytest.mark.parametrize("window", [5, 1000])
def test_a_worker_with_an_extra_line_before_the_last_still_folds_the_last_line(window):
    # Workers that poll print "waiting" a different number of times; their last line, the
    # same for all but the rank, is one line whatever the window (it once split in two).
    logs = {w: [f"worker {w} started", *["waiting"] * (31 + w % 2), f"worker {w} done"]
            for w in range(4)}
    folded = list(fold_stream(logs, window=window))
    assert render_folded(folded, logs)[-2:] == ["w[1,3]: waiting", "worker {0..3} done"]
    for w, lines in logs.items():
        assert [f.text_of(w) for f in folded if w in f.workers] == lines

MEASURE_LOGS = r"""
import resource, sys
from tpufab.ssh.results import Output
from tpufab.verbs import jobs

class Counter:
    lines, leaked = 0, False
    def write(self, data):
        self.lines += data.count(b"\n")
        self.leaked = self.leaked or SECRET.encode() in data
    def flush(self):
        pass

SECRET, raw = sys.argv[1], sys.argv[2] == "raw"
outputs = {}
for w in range(4):
    outputs[w] = Output()          # spooled: in a temp file past 256 KiB, as fetch_logs gets it
    for i in range(0, 120000, 1000):
        outputs[w].write("".join(f"step {j} loss {1.0 / (j + 1):.6f} tokens/s on {'abcd'[w] * 3} and "
                                 f"{SECRET if j == 7 else 'some'} more words to make it long\n"
                                 for j in range(i, i + 1000)).encode())
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = Counter()
jobs._print_logs(outputs, raw=raw, color=False, secrets=[SECRET], out=out)
grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(sum(o.size for o in outputs.values()), grew * 1024, out.lines, out.leaked)
"""


@pytest.mark.parametrize("mode", ["folded", "raw"])
def test_logs_stream_in_bounded_memory(mode):
    """4 workers x ~9 MB of log through `logs`' printing, in a fresh process: its peak RSS
    grows by a fraction of the logs' size (before: every log was read whole, decoded, split
    and diffed: several times their size)."""
    proc = subprocess.run([sys.executable, "-c", MEASURE_LOGS, HF, mode], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    total, grew, lines, leaked = proc.stdout.split()
    assert int(lines) == 480000 and leaked == "False"
    assert int(total) > 35_000_000
    assert int(grew) < int(total) / 4, (int(grew) >> 20, int(total) >> 20)


# -- local copies pruned -------------------------------------------------------------------------


def test_local_run_copies_are_pruned_newest_first(tmp_path):
    runs = tmp_path / "runs"
    names = [f"20261123-10{m:02d}00-abcd" for m in range(25)]
    for n, name in enumerate(names):
        (runs / name).mkdir(parents=True)
        (runs / name / "w0.log").write_bytes(b"x" * (1000 if n < 20 else 10))
    (runs / "notes").mkdir()                               # not a run: never touched
    removed = prune_local_runs(runs, keep_runs=20, keep_bytes=10**9, current=names[-1])
    assert removed == names[:5][::-1]
    assert sorted(p.name for p in runs.iterdir()) == sorted(names[5:] + ["notes"])
    # the size cap: newest first until 2 KB, then everything older goes (never the current)
    removed = prune_local_runs(runs, keep_runs=20, keep_bytes=2000, current=names[-1])
    assert sorted(p.name for p in runs.iterdir()) == sorted(names[-6:] + ["notes"])
    removed = prune_local_runs(runs, keep_runs=1, keep_bytes=0, current=names[-1])
    assert sorted(p.name for p in runs.iterdir()) == [names[-1], "notes"]
