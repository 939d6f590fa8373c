"""`profile --workers all` lays every host's trace out as one logdir (steps/host/profiling.py):
as TensorBoard and XProf read a multi-host profile, one file per host. No pod."""

from __future__ import annotations

from tpufab.steps.host.profiling import one_logdir


def test_every_host_s_trace_lands_in_one_logdir(tmp_path):
    stamp = "20261202-011500"
    for w, inner in ((0, "2026_12_02_01_15_00"), (1, "2026_12_02_01_15_01"),
                     (2, "2026_12_02_01_15_01")):
        run = tmp_path / f"w{w}" / stamp / "plugins" / "profile" / inner
        run.mkdir(parents=True)
        host = "t1v-n-abc-w-0" if w == 2 else f"t1v-n-abc-w-{w}"   # w2 shares w0's name
        (run / f"{host}.xplane.pb").write_bytes(b"x" * (w + 1))
        (tmp_path / f"w{w}" / stamp / "notes.txt").write_text("n")
    moved = one_logdir(tmp_path, stamp, [0, 1, 2])
    session = tmp_path / stamp / "plugins" / "profile" / stamp
    assert sorted(p.name for p in session.iterdir()) == [
        "t1v-n-abc-w-0.xplane.pb", "t1v-n-abc-w-1.xplane.pb", "w2.t1v-n-abc-w-0.xplane.pb"]
    assert (session / "w2.t1v-n-abc-w-0.xplane.pb").read_bytes() == b"xxx"
    assert (tmp_path / stamp / "w1" / "notes.txt").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == [stamp]        # w0-w2 are gone
    assert {w: len(files) for w, files in moved.items()} == {0: 2, 1: 2, 2: 2}
    assert all(p.is_file() for files in moved.values() for p in files)


def answers(monkeypatch, answer_of) -> None:
    """Run r1 is running; each worker's capture answers ``answer_of(worker)`` (JSON text)."""
    from types import SimpleNamespace

    from tpufab.steps.host import profiling

    monkeypatch.setattr(profiling, "_running_run", lambda fanout, workers, run: "r1")
    monkeypatch.setattr(profiling, "run_with_files", lambda fanout, files, line, workers,
                        timeout: {workers[0]: SimpleNamespace(
                            ok=True, stdout=f"@tpufab-answer answer {answer_of(workers[0])}\n")})


def test_no_jax_process_anywhere_is_one_sentence(monkeypatch, tmp_path):
    """--workers all on a run with no profiler server: one sentence, the hosts folded."""
    import pytest

    from tpufab.errors import TpufabError
    from tpufab.steps.host import profiling

    answers(monkeypatch, lambda w: '{"error": "no trace from the profiler server on port '
            f'{9012 + w}: UNAVAILABLE"}}')
    with pytest.raises(TpufabError) as err:
        profiling.capture(None, workers=[0, 1, 2, 3], seconds=1, local_base=tmp_path)
    assert str(err.value) == ("No trace captured from run r1: w[0-3]: no trace from the "
                              "profiler server on its port (TPUFAB_PROFILER_PORT): "
                              "UNAVAILABLE.")


def test_a_trace_above_max_size_stays_on_its_host_and_says_so(monkeypatch, tmp_path):
    import pytest

    from tpufab.errors import TpufabError
    from tpufab.steps.host import profiling

    answers(monkeypatch, lambda w: '{"logdir": "x", "files": '
            f'[["plugins/profile/s/h{w}.xplane.pb", {3 << 20}]]}}')
    with pytest.raises(TpufabError) as err:
        profiling.capture(None, workers=[0, 1], seconds=1, local_base=tmp_path,
                          max_bytes=profiling.parse_size("2MiB"))
    said = str(err.value)
    assert said.startswith("No trace captured from run r1: w[0-1]: its trace is 3.0 MiB, above "
                           "--max-size 2.0 MiB: it stays on the worker in ~/.cache/tpufab/"
                           "profiles/r1/"), said
    assert said.endswith("profile again with a larger --max-size or a shorter --duration, or "
                         "copy it with `tpufab get`."), said
    with pytest.raises(profiling.ConfigError, match="--max-size takes a size such as 2GiB"):
        profiling.parse_size("lots")
    assert profiling.parse_size("500MB") == 500 << 20 and profiling.parse_size("3") == 3
