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
    assert "--attempts 8 --backoff 1 --cap 16 --jitter 0.04 --room-factor 3 --if-missing" in line


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


class ManifestServer:
    """A registry's manifests on loopback: a Bearer challenge (the Registry API's token flow)
    for the credentials ``("u", "p")``, an index whose amd64 entry is a manifest of 3 parts."""

    def __init__(self):
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        outer = self
        self.index = {"manifests": [
            {"digest": "sha256:arm", "platform": {"architecture": "arm64", "os": "linux"}},
            {"digest": "sha256:amd", "platform": {"architecture": "amd64", "os": "linux"}}]}
        self.manifest = {"config": {"size": 1_000}, "layers": [{"size": 40_000_000},
                                                               {"size": 9_000_000}]}
        self.asked: list[str] = []

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                outer.asked.append(self.path)
                if self.path.startswith("/token"):
                    ok = self.headers.get("Authorization") == basic("u", "p")
                    return self.reply(200 if ok else 401, {"token": "T"} if ok else {})
                if self.headers.get("Authorization") != "Bearer T":
                    self.send_response(401)
                    self.send_header("WWW-Authenticate", f'Bearer realm="{outer.url}/token",'
                                     'service="reg",scope="repository:p/r/i:pull"')
                    self.send_header("Content-Length", "0")
                    return self.end_headers()
                body = outer.manifest if self.path.endswith("sha256:amd") else outer.index
                self.reply(200, body)

            def reply(self, code, body):
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.host = f"127.0.0.1:{self.server.server_address[1]}"
        self.url = f"http://{self.host}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def test_the_room_check_reads_the_compressed_size_from_the_manifest_and_refuses(tmp_path,
                                                                                monkeypatch):
    from tpufab.remote import image_worker as worker

    server = ManifestServer()
    try:
        monkeypatch.setattr(worker.platform, "machine", lambda: "x86_64")
        ref = f"{server.host}/p/r/i:v1"
        assert worker.compressed_size(ref, ("u", "p"), insecure={server.host}) == 49_001_000
        assert server.asked == ["/v2/p/r/i/manifests/v1", "/token?service=reg&scope="
                                "repository%3Ap/r/i%3Apull", "/v2/p/r/i/manifests/v1",
                                "/v2/p/r/i/manifests/sha256:amd"]
        with pytest.raises(worker.ImageError, match="401"):
            worker.compressed_size(ref, ("u", "wrong"), insecure={server.host})
        monkeypatch.setattr(worker, "insecure_registries", lambda: {server.host})
        monkeypatch.setattr(worker, "storage_dir", lambda: str(tmp_path / "storage"))
        monkeypatch.setattr(worker, "free_bytes", lambda path: (str(tmp_path), 100_000_000))
        room = worker.room_for(ref, ("u", "p"), 3)
        assert room["need_bytes"] == 147_003_000 and not room.get("ok")
        assert worker.no_room_sentence(ref, room) == (
            f"100.0 MB free in {tmp_path}, and {ref} needs 147.0 MB there (3 x its 49.0 MB "
            "compressed)")
        assert worker.room_for(ref, ("u", "p"), 2)["ok"]
        assert "unchecked" in worker.room_for(ref, None, 3)      # the pull will say why
    finally:
        server.server.shutdown()


def test_the_runtimes_insecure_registries_are_read_from_its_configuration(tmp_path):
    from tpufab.remote.image_worker import insecure_registries
    from tpufab.sim.registry import registries_conf

    conf = tmp_path / "registries.conf"
    conf.write_text(registries_conf() + '[[registry]]\nlocation = "secure.example"\n')
    daemon = tmp_path / "daemon.json"
    daemon.write_text(json.dumps({"insecure-registries": ["10.0.0.5:5000"]}))
    found = insecure_registries(str(daemon), str(conf))
    assert {"us-docker.pkg.dev", "europe-west4-docker.pkg.dev", "10.0.0.5:5000"} <= found
    assert "secure.example" not in found
    assert insecure_registries(str(tmp_path / "none"), str(tmp_path / "none")) == set()


def test_hosts_without_room_are_named_in_one_sentence_before_the_pull():
    room = {"path": "/var/lib/docker", "need_bytes": 6_300_000_000,
            "compressed_bytes": 2_100_000_000, "factor": 3}
    rows = [HostImage(0, digest=A, pulled=True, seconds=3.0),
            HostImage(1, error="x", no_room={**room, "free_bytes": 2_000_000_000}),
            HostImage(3, error="x", no_room={**room, "free_bytes": 1_500_000_000}),
            HostImage(2, digest=A, pulled=True, seconds=3.0)]
    report = fold_digests(REF, rows)
    with pytest.raises(images.ImageError) as err:
        report.check()
    assert str(err.value) == (
        f"w[1,3] have no room for {REF}, refused before the pull: it needs 6.3 GB free in "
        "/var/lib/docker (3 x its 2.1 GB compressed) and they have 1.5 GB-2.0 GB; free space "
        "there or give the host a larger disk.")
    line = images.pull_command(REF)
    assert "--room-factor 3" in line


def test_another_registrys_credentials_are_named_by_environment_variables():
    env = {"REG_USER": "robot", "REG_TOKEN": "tok-9"}
    assert images.registry_login(None, env) is None
    assert images.registry_login("REG_USER:REG_TOKEN", env) == {"username": "robot",
                                                               "password": "tok-9"}
    with pytest.raises(ConfigError, match="names REG_PASS, which is not set here: export"):
        images.registry_login("REG_USER:REG_PASS", env)
    with pytest.raises(ConfigError, match="does not name two environment variables"):
        images.registry_login("robot:tok-9x!", env)


class Recorder:
    """A fan-out that records each command and its stdin, answering a pulled digest."""

    def __init__(self):
        self.calls = []

    def run(self, line, workers, stdin=None, **kwargs):
        from types import SimpleNamespace

        self.calls.append((line, stdin))
        out = "@tpufab-answer answer " + json.dumps({"digest": A, "pulled": True,
                                                     "seconds": 1}) + "\n"
        return {w: SimpleNamespace(stdout=out, stderr="", ok=True, error=None, exit_code=0)
                for w in workers}


def test_the_credentials_go_on_stdin_never_in_the_command_line(monkeypatch):
    from tpufab.ssh import remote_files

    monkeypatch.setattr(remote_files, "missing_files", lambda result: False)
    fanout = Recorder()
    report = images.pull(fanout, [0, 1], REF, login={"username": "robot", "password": "tok-9"})
    assert report.ok and report.digest == A
    [(line, stdin)] = fanout.calls
    assert "--login-stdin" in line and "tok-9" not in line and "robot" not in line
    assert json.loads(stdin) == {"username": "robot", "password": "tok-9"}
    images.pull(fanout, [0], REF)
    assert "--login-stdin" not in fanout.calls[-1][0] and fanout.calls[-1][1] is None


def test_the_simulated_other_registry_takes_its_account_alone():
    from tpufab.sim.registry import OTHER_HOST, Registry, registry_hosts_line

    registry = Registry.__new__(Registry)
    registry.account = ("tpufab-sim", "pw")
    registry.tokens, registry.push_token = Tokens(), "push"
    assert registry.authorize(basic("tpufab-sim", "pw"), OTHER_HOST) == (True, "")
    assert registry.authorize(None, OTHER_HOST) == (False, "authentication required")
    assert registry.authorize(basic("", ""), OTHER_HOST) == (False, "authentication required")
    assert not registry.authorize(basic("oauth2accesstoken", "w0"), OTHER_HOST)[0]
    assert not registry.authorize(basic("tpufab-sim", "pw"), "us-docker.pkg.dev")[0]
    assert OTHER_HOST in registry_hosts_line("127.15.0.1")


def test_status_folds_the_image_settings_digest_and_the_hosts_without_it():
    rows = [HostImage(0, digest=A, present=True), HostImage(1, digest=A, present=True),
            HostImage(2, error=images.NOT_HERE), HostImage(3, digest=B, present=True),
            HostImage(4, digest=A, present=True)]
    report = fold_digests(REF, rows)
    assert images.status_line(report) == (
        f"Image {REF}: sha256:aaaaaaaaaaaa... on w[0-1,4]; not on w2 (`tpufab image pull "
        f"{REF}`); w3: sha256:bbbbbbbbbbbb... (differs).")
    assert not report.ok
    everywhere = fold_digests(REF, [HostImage(w, digest=A, present=True) for w in range(4)])
    assert images.status_line(everywhere) == f"Image {REF}: sha256:aaaaaaaaaaaa... on w[0-3]."
