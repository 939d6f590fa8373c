"""Multi-host output of real frameworks folds to what a person would write (issue 26).

tests/data/multihost/<job>/wN.log is what each worker printed (tests/data/multihost/README.md
says which were recorded on the simulated pod and which reconstructed); folded.txt is what
`tpufab logs` must show. The live view must show the same whatever order the workers' lines
arrive in, and unfolding gives back every line each worker printed, in order.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from tpufab.ssh.results import WorkerResult
from tpufab.steps.runs.env import fold_logs, render_folded, unfold
from tpufab.views.folding import FoldingView

DATA = Path(__file__).parent / "data" / "multihost"
JOBS = sorted(p.name for p in DATA.iterdir() if p.is_dir())


def logs_of(job: str) -> dict[int, list[str]]:
    return {int(p.stem[1:]): p.read_text().splitlines() for p in sorted((DATA / job).glob("w*.log"))}


def folded_of(job: str) -> list[str]:
    return (DATA / job / "folded.txt").read_text().splitlines()


def live(logs: dict[int, list[str]], order: list[int]) -> list[str]:
    out = io.StringIO()
    view = FoldingView(logs, out, delay=3.0)
    for w in order:
        view.lines(w, "stdout", "".join(f"{line}\n" for line in logs[w]).encode())
    for w in logs:
        view.done(WorkerResult(w, exit_code=0))
    view.close()
    return out.getvalue().splitlines()


def test_every_job_has_its_logs_and_its_folded_view():
    assert set(JOBS) >= {"jax_hello", "lightning_ddp", "torch_xla_hf", "jax_coordination_abort",
                         "maxtext_traceback"}
    for job in JOBS:
        assert len(logs_of(job)) == 4 and folded_of(job), job


@pytest.mark.parametrize("job", JOBS)
def test_logs_fold_as_a_person_would_write_them(job):
    logs = logs_of(job)
    shown = render_folded(fold_logs(logs), logs)
    assert shown == folded_of(job)
    assert len(shown) < sum(map(len, logs.values()))
    for w, lines in logs.items():          # nothing is lost: every worker's lines, in order
        assert unfold(fold_logs(logs), w) == lines


@pytest.mark.parametrize("job", JOBS)
@pytest.mark.parametrize("order", ["lowest first", "highest first", "odd ones first"])
def test_the_live_view_shows_the_same_whatever_order_lines_arrive_in(job, order):
    logs = logs_of(job)
    workers = sorted(logs)
    arrival = {"lowest first": workers, "highest first": workers[::-1],
               "odd ones first": workers[1::2] + workers[::2]}[order]
    assert live(logs, arrival) == folded_of(job)


def test_what_each_job_folds_to():
    # the lines a person would single out, and how the fields read
    hello = folded_of("jax_hello")
    assert hello[1] == ("[Gloo] Rank {0..3} is connected to 3 peer ranks. Expected number of "
                        "connected peer ranks is : 3") and len(hello) == 5
    lightning = "\n".join(folded_of("lightning_ddp"))
    assert "Initializing distributed: GLOBAL_RANK: {0..3}, MEMBER: {1..4}/4" in lightning
    assert "lightning_train: rank {0..3} of 4 (cpu, DDPStrategy) finished fit after 20 steps: " \
           "loss {2.9235..5.2916} -> {0.0219..0.1038}, weights checksum -4.588606" in lightning
    assert "w0: GPU available: False, used: False" in lightning      # rank 0's own lines
    abort = folded_of("jax_coordination_abort")
    # every host's native stack is one stack: the addresses differ, the frames do not
    frames = [line for line in abort if line.lstrip().startswith("@")]
    assert len(frames) == 11 and all(line.count("0x7f") == 4 for line in frames), frames
    maxtext = folded_of("maxtext_traceback")
    assert "\tUsing (GB) 44.63 / 95.74 (46.615835%) on TPU_{0,4,8,12}(process={0..3}," \
           "(0,0,{0..3},0))" in maxtext
    assert "completed step: 2, seconds: {5.665..5.668}, TFLOP/s/device: {134.910..134.981}, " \
           "Tokens/s/device: {8671.842..8676.434}, total_weights: 786432, loss: 11.689" in maxtext
    assert [line for line in maxtext if line.startswith("w2: ")][0] == \
        "w2: Traceback (most recent call last):"
    assert sum(line.startswith("w2: ") for line in maxtext) == 6
