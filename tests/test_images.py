"""Images, the pure parts: references, jitter, the folded digests and the refusal sentence,
the simulated registry's auth and fault selection, the worker's `docker run` line (no job
environment in it)."""

from __future__ import annotations

import argparse
import base64
import json

import pytest

from tpufab.errors import ConfigError
from tpufab.reports import text as report_lines
from tpufab.steps.host import images
from tpufab.steps.host.images import HostImage, fold_digests

A = "sha256:" + "a" * 64
B = "sha256:" + "b" * 64
REF = "us-docker.pkg.dev/proj/repo/train:v3"


def test_image_references_are_checked_in_one_sentence():
    assert images.check_image(REF) == REF
    assert images.check_image(f"docker:{REF}") == REF
    assert images.check_image(f"us-docker.pkg.dev/p/r/i@{A}") == f"us-docker.pkg.dev/p/r/i@{A}"
    for bad in ("", "Upper/Case", "a b", "x//y", "repo:tag:tag"):
        with pytest.raises(ConfigError, match="is not an image reference"):
            images.check_image(bad)


def test_the_start_jitter_grows_with_the_host_count_and_is_capped():
    assert images.jitter_for(1) == 0.0
    assert images.jitter_for(2) == pytest.approx(0.04)
    assert images.jitter_for(256) == pytest.approx(5.12)
    assert images.jitter_for(4096) == images.JITTER_CAP == 30.0


def test_digests_fold_and_a_host_that_differs_is_named():
    rows = [HostImage(w, digest=A, pulled=True, seconds=2.0 + w / 10) for w in range(4)]
    rows[2] = HostImage(2, digest=B, present=True, seconds=0.1)
    report = fold_digests(REF, rows)
    assert report.digest == A and report.differing == [2] and not report.ok
    lines = report_lines(report)
    assert any(line.startswith("w[0-1,3]") and "pulled" in line for line in lines)
    assert any(line.startswith("w2") and "(differs)" in line for line in lines)
    with pytest.raises(images.ImageError) as err:
        report.check()
    assert f"w2: {B} (differs)" in str(err.value) and f"w[0-1,3] {A}" in str(err.value)
    assert "tpufab image pull" in str(err.value)


def test_an_agreed_digest_pins_the_image_and_retries_are_noted():
    rows = [HostImage(0, digest=A, pulled=True, seconds=3.0),
            HostImage(1, digest=A, pulled=True, seconds=9.0, attempts=3,
                      retries=("unauthorized: no", "unauthorized: again"))]
    report = fold_digests(REF, rows).check()
    assert report.pinned == f"us-docker.pkg.dev/proj/repo/train@{A}"
    assert report.notes == ["w1: auth and pull retried 2 times before it came up (last: "
                            "unauthorized: again)"]
    assert report.summary.startswith(f"{REF} is {A} on w[0-1] (pulled on w[0-1]")
    failed = fold_digests(REF, [HostImage(0, digest=A), HostImage(1, error="manifest unknown")])
    with pytest.raises(images.ImageError, match="w1 could not get .*: manifest unknown"):
        failed.check()


def test_the_pull_command_runs_as_root_with_the_retry_numbers():
    line = images.pull_command(REF, if_missing=True, jitter=0.04)
    assert "sudo -n" in line and "image_worker.py" in line
    assert "--attempts 8 --backoff 1 --cap 16 --jitter 0.04 --if-missing" in line


class Tokens:
    def holder(self, token):
        return {"node": "n", "worker": int(token[1:])} if token.startswith("w") else None


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def test_the_registry_takes_metadata_tokens_refuses_anonymous_and_fails_chosen_hosts(tmp_path):
    from tpufab.sim.registry import Registry, registries_conf, selected

    assert [w for w in range(4) if selected(w, 0.25)] == [3]
    assert [w for w in range(10) if selected(w, 0.1)] == [9]
    assert sum(selected(w, 0.1) for w in range(64)) == 6
    assert not any(selected(w, 0.0) for w in range(8))
    registry = Registry.__new__(Registry)       # its auth alone: no server, no port
    registry.tokens, registry.push_token = Tokens(), "push"
    registry.fail_auth, registry.fail_times, registry.refused = 0.5, 2, {}
    registry.lock = __import__("threading").Lock()
    assert registry.authorize(None) == (False, "anonymous")
    assert registry.authorize(basic("", "")) == (False, "anonymous")
    assert not registry.authorize(basic("admin", "w0"))[0]
    assert not registry.authorize(basic("oauth2accesstoken", "forged"))[0]
    assert registry.authorize(basic("oauth2accesstoken", "w0")) == (True, "")
    answers = [registry.authorize(basic("oauth2accesstoken", "w1")) for _ in range(3)]
    assert [ok for ok, _ in answers] == [False, False, True]
    assert "simulated auth failure 2 of 2" in answers[1][1]
    assert registry.authorize("Bearer w1") == (True, "")
    conf = registries_conf()
    assert 'location = "us-docker.pkg.dev"' in conf and "insecure = true" in conf
    assert 'location = "europe-west4-docker.pkg.dev"' in conf


def test_the_containers_run_line_holds_no_job_environment(tmp_path, monkeypatch):
    from tpufab.remote import run_worker

    monkeypatch.setattr(run_worker, "memlock_unlimited", lambda prefix: False)
    monkeypatch.setattr(run_worker, "tpu_device_files", lambda: ["/dev/null"])
    args = argparse.Namespace(run="20261202-010000-ab12", image=f"{REF.split(':')[0]}@{A}",
                              hardened=False)
    notes: list[str] = []
    argv = run_worker.container_argv(args, "/home/u/.tpufab/runs/x", "/home/u/proj",
                                     ["/home/u/proj/train.sh", "--steps", "3"], notes)
    joined = json.dumps(argv)
    assert argv[argv.index("--name") + 1] == "tpufab-20261202-010000-ab12"
    assert "tpufab-run=20261202-010000-ab12" in argv and "--privileged" in argv
    assert ["--network", "host"] == argv[argv.index("--network"):argv.index("--network") + 2]
    for mount in ("/tmp:/tmp", "/home/u/proj:/home/u/proj",
                  "/home/u/.tpufab/runs/x:/home/u/.tpufab/runs/x"):
        assert mount in argv
    assert "-e" not in argv and "--env" not in argv and "TPU_WORKER_ID" not in joined
    assert argv[-3:] == ["/home/u/proj/train.sh", "--steps", "3"]
    assert notes and "memlock" in notes[0]
    hardened = run_worker.container_argv(argparse.Namespace(**{**vars(args), "hardened": True}),
                                         "/r", "/c", ["x"], [])
    assert "--privileged" not in hardened and "--device" in hardened


def test_kill_says_which_containers_it_stopped():
    from tpufab.steps.host.killing import KillReport, WorkerReport

    def report(action):
        return {"dry_run": False, "devices": ["/dev/accel0"], "runs": [], "killed": [],
                "failed": [], "protected": [], "holders_left": [], "lockfiles": [],
                "device_free": True, "noop": False,
                "containers": [{"id": "c0", "name": "tpufab-r1", "run": "r1",
                                "action": action}]}

    kill = KillReport(workers={0: WorkerReport(0, report("stopped")),
                               1: WorkerReport(1, report("stopped"))})
    assert report_lines(kill)[0] == "w[0-1]  container  tpufab-r1 (run r1): stopped"
    assert kill.ok


def test_a_skypilot_task_names_its_image_as_docker_image_id():
    from tpufab.flows.taskfile import parse_task

    def task(image_id):
        return parse_task({"resources": {"accelerators": "tpu-v4-16", "image_id": image_id},
                           "run": "python3 train.py"}, "task.yaml")

    assert task(f"docker:{REF}").image == REF
    assert parse_task({"resources": {"accelerators": "tpu-v4-16"}, "run": "x"}).image is None
    with pytest.raises(ConfigError, match=r"^task.yaml: resources.image_id is .*give image_id: "
                                          r"docker:IMAGE"):
        task("projects/deeplearning-platform-release/global/images/tf")
    with pytest.raises(ConfigError, match="resources.image_id: .* is not an image reference"):
        task("docker:Not An Image")


def test_a_skypilot_task_takes_tpufabs_own_spelling_of_a_type():
    from tpufab.flows.taskfile import parse_task

    for acc in ("tpu7x-16", "tpu-v7x-16", "v6e-8"):
        assert parse_task({"resources": {"accelerators": acc}, "run": "x"}).type == acc
    with pytest.raises(ConfigError, match="tpufab launches Cloud TPUs only"):
        parse_task({"resources": {"accelerators": "a100"}, "run": "x"})
