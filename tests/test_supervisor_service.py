"""The supervisor's service without a pod, against the simulated Cloud Storage: the process
writes its heartbeat and stops on SIGTERM; a job's code is a clone of its exact commit (from
its bundle in the bucket), reused while it is there; a git token reaches git through the
environment, never argv; secrets handed over in a file are read once, the file deleted, and a
job waits until it has them all; the hand-over finds whether a commit is on the remote
without pushing; `tpufab jobs secrets JOB` (handover.hand_secrets) hands a job's values from
the laptop's environment to the service here (its heartbeat names its folder) or, as data, the
VM's command line (the values on stdin), and says in one sentence what it cannot do."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import storage_emulator, wait_for

from tpufab.cloud.storage import Storage
from tpufab.config import Settings
from tpufab.flows.supervisor import handover, service
from tpufab.flows.supervisor import state as st


def git(cwd: Path, *args: str) -> str:
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t", "PATH": "/usr/bin:/bin", "HOME": str(cwd)}
    return subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True,
                          text=True).stdout.strip()


@pytest.fixture()
def gcs():
    with storage_emulator("sup-svc") as emulator:
        yield emulator


@pytest.fixture()
def recs(gcs) -> st.Records:
    return st.Records(Storage(gcs.url), "sup-svc")


@pytest.fixture()
def repo(tmp_path) -> Path:
    root = tmp_path / "model"
    root.mkdir()
    git(root, "init", "-q", "-b", "main")
    (root / "train.sh").write_text("echo v1\n")
    git(root, "add", ".")
    git(root, "commit", "-q", "-m", "v1")
    return root


def test_the_service_process_beats_and_stops_on_sigterm(gcs, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TPUFAB_")}
    env.update(TPUFAB_STORAGE_ENDPOINT=gcs.url, TPUFAB_PROJECT="p",
               TPUFAB_STATE_DIR=str(tmp_path / "state"), HOME=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-m", "tpufab.flows.supervisor", "serve",
                             "--bucket", "gs://sup-svc", "--name", "sup-one", "--poll", "0.2",
                             "--workdir", str(tmp_path / "work")],
                            env=env, stderr=subprocess.PIPE, text=True)
    try:
        store = Storage(gcs.url)
        beat = wait_for(lambda: store.read_json("sup-svc", st.heartbeat_name("sup-one")), 20,
                        what="the heartbeat")[0]
        assert beat["name"] == "sup-one" and beat["pid"] == proc.pid and beat["jobs"] == []
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
        assert "supervisor sup-one stopped" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_bad_supervisor_name_is_one_sentence(tmp_path):
    out = subprocess.run([sys.executable, "-m", "tpufab.flows.supervisor", "serve", "--bucket",
                          "b", "--name", "Not_A_Name", "--workdir", str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "is not a Compute Engine instance name" in out.stderr
    assert "Traceback" not in out.stderr


def test_a_jobs_code_is_a_clone_of_its_commit_from_the_bundle(recs, repo, tmp_path):
    from tpufab.steps.code import gitops

    commit = git(repo, "rev-parse", "HEAD")
    job = st.new_job_id()
    bundle = gitops.bundle(repo, commit, tmp_path / "b.bundle")
    recs.store.put(recs.bucket, st.bundle_name(job), bundle.read_bytes())
    (repo / "train.sh").write_text("echo v2\n")        # later work is not the job's
    git(repo, "commit", "-qam", "v2")
    spec = st.JobSpec(job=job, pod=st.PodRef("p", "z"), recipe="train.sh",
                      code=st.Code.of(commit, bundle=st.bundle_name(job), name="model"))
    got = service.checkout(recs, spec, tmp_path / "code")
    assert got == tmp_path / "code" / job / "model"
    assert (got / "train.sh").read_text() == "echo v1\n"
    assert git(got, "rev-parse", "HEAD") == commit
    (got / "marker").write_text("kept")
    assert service.checkout(recs, spec, tmp_path / "code") == got   # reused
    assert (got / "marker").exists()


def test_a_git_token_goes_to_git_through_the_environment():
    env = service.token_env("ghp_secret")
    assert env["GIT_CONFIG_KEY_0"] == "http.extraHeader"
    assert "ghp_secret" not in env["GIT_CONFIG_VALUE_0"]       # base64, and not in argv
    assert service.token_env(None) == {}


def test_secrets_handed_in_a_file_are_read_once_and_the_job_waits_for_all(recs, tmp_path):
    folder = tmp_path / "secrets"
    folder.mkdir(mode=0o700)
    svc = service.Service(Settings(project="p"), recs.bucket, "sup-one", store=recs.store,
                          workdir=tmp_path, options=service.Options(secrets_dir=folder))
    spec = st.JobSpec(job=st.new_job_id(), pod=st.PodRef("p", "z"), recipe="r",
                      code=st.Code.of("c"), secrets=("HF_TOKEN", "WANDB_API_KEY"))
    assert svc.secrets_for(spec) is None
    handed = folder / f"{spec.job}.json"
    handed.write_text(json.dumps({"HF_TOKEN": "hf_x"}))
    assert svc.secrets_for(spec) is None and not handed.exists()   # read once, deleted
    handed.write_text(json.dumps({"HF_TOKEN": "hf_x", "WANDB_API_KEY": "w"}))
    assert svc.secrets_for(spec) == {"HF_TOKEN": "hf_x", "WANDB_API_KEY": "w"}
    assert not handed.exists()
    # the job's secret names are secrets to babysit whatever they look like
    odd = st.JobSpec(job=st.new_job_id(), pod=st.PodRef("p", "z"), recipe="r",
                     code=st.Code.of("c"), secrets=("MY_PLAIN_NAME",))
    assert "MY_PLAIN_NAME" in svc.settings_for(odd).secrets


def test_the_hand_over_knows_whether_a_commit_is_on_the_remote(repo, tmp_path):
    origin = tmp_path / "origin.git"
    git(tmp_path, "init", "-q", "--bare", str(origin))
    git(repo, "remote", "add", "origin", str(origin))
    git(repo, "push", "-q", "origin", "main")
    first = git(repo, "rev-parse", "HEAD")
    assert handover._on_remote(repo, first, "origin")
    (repo / "train.sh").write_text("echo v2\n")
    git(repo, "commit", "-qam", "v2")
    second = git(repo, "rev-parse", "HEAD")
    assert not handover._on_remote(repo, second, "origin")     # not pushed yet
    git(repo, "push", "-q", "origin", "main")
    assert handover._on_remote(repo, second, "origin")
    assert handover._on_remote(repo, first, "origin")          # an ancestor of main there


@pytest.fixture()
def laptop(gcs, repo, tmp_path, monkeypatch):
    """The hand-over's world without a pod: the checkout here, the pod's lookup answered."""
    from tpufab.cloud.nodes import Node
    from tpufab.steps.health import status

    monkeypatch.chdir(repo)
    monkeypatch.setattr(status, "find_nodes", lambda control, name: ([Node(
        name=name, project="p", zone="z", accelerator_type="v4-8", state="READY",
        runtime_version="rt")], None))
    return Settings(name="pod-a", project="p", zone="us-central2-b", supervisor_bucket="sup-svc",
                    supervisor_vm=False, storage_endpoint=gcs.url,
                    state_dir=str(tmp_path / "state"))


def test_the_hand_over_writes_the_bundle_the_spec_and_the_state(laptop, recs, repo):
    done = handover.hand_over(laptop, "train.sh", args=["lr=3"], env=["BATCH=64"],
                              options={"max_restarts": 7})
    spec = recs.spec(done.job)
    assert (spec.recipe, spec.args, spec.env["BATCH"]) == ("train.sh", ("lr=3",), "64")
    assert spec.code.commit == git(repo, "rev-parse", "HEAD") and spec.code.name == "model"
    assert spec.option("max_restarts") == 7 and spec.option("direct") is True  # no origin
    assert recs.store.stat(recs.bucket, spec.code.bundle) is not None
    assert recs.state(done.job)[0].state == "queued"
    assert done.supervisor is None           # no supervisor module here: the bucket has it
    assert (done.follow, done.cancel) == (f"tpufab jobs logs {done.job} --follow",
                                          f"tpufab jobs cancel {done.job}")


def test_the_job_carries_the_environment_as_the_laptop_read_it_and_its_runs_use_it(
        laptop, recs, repo, tmp_path):
    """`environment:` is the laptop's setting, not the supervisor's: the spec carries the
    files as read at the hand-over; the service's settings for the job name that path (its
    runs' VIRTUAL_ENV), and its babysitter builds exactly that after a recovery."""
    from dataclasses import replace

    from tpufab.errors import ConfigError
    from tpufab.steps.runs.env import virtual_env

    configured = replace(laptop, environment={"requirements": "requirements.txt",
                                              "path": "~/envs/train"})
    (repo / "requirements.txt").write_text("-r base.txt\ntfa-alpha\n")
    (repo / "base.txt").write_text("tfa-beta\n")
    git(repo, "add", ".")
    git(repo, "commit", "-qm", "env")
    done = handover.hand_over(configured, "train.sh")
    spec = recs.spec(done.job)
    assert spec.version == 2 and spec.environment["path"] == "~/envs/train"
    assert {k: v.decode() for k, v in spec.env_spec().files.items()} == {
        "requirements.txt": "-r base.txt\ntfa-alpha\n", "base.txt": "tfa-beta\n"}
    svc = service.Service(laptop, recs.bucket, "sup-env", store=recs.store,
                          workdir=tmp_path / "work")
    assert not laptop.environment                          # the supervisor configures none
    assert virtual_env(svc.settings_for(spec)) == "~/envs/train"
    assert virtual_env(svc.settings_for(recs.spec(handover.hand_over(laptop, "train.sh").job))) \
        is None
    (repo / "base.txt").unlink()
    git(repo, "commit", "-qam", "no base")
    before = recs.store.list(recs.bucket, st.JOBS).blobs
    with pytest.raises(ConfigError, match="which does not exist at"):
        handover.hand_over(configured, "train.sh")
    assert recs.store.list(recs.bucket, st.JOBS).blobs == before


def test_a_failed_hand_over_leaves_nothing_in_the_bucket(laptop, recs, monkeypatch):
    from tpufab.cloud.storage import StorageError

    def broken(self, spec):
        self.store.put_json(self.bucket, st.spec_name(spec.job), spec.to_record(),
                            if_generation_match=0)
        raise StorageError("quota exceeded")

    monkeypatch.setattr(st.Records, "create", broken)
    with pytest.raises(StorageError, match="quota"):
        handover.hand_over(laptop, "train.sh")
    assert recs.store.list(recs.bucket, st.JOBS).blobs == []


def test_the_hand_over_refuses_before_anything_is_made(laptop, recs, repo):
    from tpufab.errors import ConfigError

    with pytest.raises(ConfigError, match="--max-restarts must be 0 or more"):
        handover.hand_over(laptop, "train.sh", options={"max_restarts": -1})
    with pytest.raises(ConfigError, match="does not take --ray"):
        handover.hand_over(laptop, "train.sh", options={"ray": True})
    outside = repo.parent / "elsewhere.sh"
    outside.write_text("echo\n")
    with pytest.raises(ConfigError, match="outside the repository"):
        handover.hand_over(laptop, str(outside))
    (repo / "wip.txt").write_text("x")
    with pytest.raises(ConfigError, match=r"uncommitted changes \(wip.txt\)"):
        handover.hand_over(laptop, "train.sh")
    (repo / "wip.txt").unlink()
    origin = repo.parent / "origin.git"
    git(repo.parent, "init", "-q", "--bare", str(origin))
    git(repo, "remote", "add", "origin", str(origin))
    with pytest.raises(ConfigError, match="is not on the git remote origin"):
        handover.hand_over(laptop, "train.sh")
    assert recs.store.list(recs.bucket, st.JOBS).blobs == []


# -- `tpufab jobs secrets JOB`: the values handed again to a supervisor that restarted --------


def secret_job(recs: st.Records, *names: str) -> st.JobSpec:
    spec = st.JobSpec(job=st.new_job_id(), pod=st.PodRef("p", "z"), recipe="r",
                      code=st.Code.of("c"), secrets=names)
    recs.create(spec)
    return spec


@pytest.fixture()
def served(gcs, recs, tmp_path):
    """A service of this machine (supervisor_vm false) with its secrets folder, its heartbeat
    in the bucket, and the laptop's settings for the same bucket."""
    folder = tmp_path / "secrets"
    svc = service.Service(Settings(project="p"), recs.bucket, "sup-one", store=recs.store,
                          workdir=tmp_path, options=service.Options(secrets_dir=folder))
    svc.heartbeat()
    laptop = Settings(project="p", supervisor_bucket=recs.bucket, supervisor_vm=False,
                      storage_endpoint=gcs.url, state_dir=str(tmp_path / "state"))
    return svc, laptop, folder


def every_object(recs: st.Records) -> bytes:
    return b"".join(recs.store.read(recs.bucket, b.name)[0]
                    for b in recs.store.list(recs.bucket, "").blobs)


def test_jobs_secrets_hands_the_values_to_the_service_here_which_reads_them_once(recs, served):
    svc, laptop, folder = served
    spec = secret_job(recs, "HF_TOKEN", "WANDB_API_KEY")
    assert svc.secrets_for(spec) is None                       # restarted: it holds none
    environ = {"HF_TOKEN": "hf_handed_again", "WANDB_API_KEY": "wandb_again", "OTHER": "x"}
    done = handover.hand_secrets(laptop, spec.job[-4:], environ=environ)   # the id's end
    text = done.summary()
    assert text == (f"Handed HF_TOKEN, WANDB_API_KEY of job {spec.job} to supervisor sup-one "
                    "on this machine, which keeps them in memory only; a job waiting for them "
                    "goes on at its next look.")
    handed = folder / f"{spec.job}.json"
    assert handed.stat().st_mode & 0o777 == 0o600 and folder.stat().st_mode & 0o777 == 0o700
    assert svc.secrets_for(spec) == {"HF_TOKEN": "hf_handed_again",
                                     "WANDB_API_KEY": "wandb_again"}
    assert not handed.exists() and list(folder.iterdir()) == []   # read once, nothing left
    data = every_object(recs)
    assert b"hf_handed_again" not in data and b"wandb_again" not in data


def test_jobs_secrets_says_in_one_sentence_what_it_cannot_do(recs, served, tmp_path):
    from tpufab.errors import ConfigError, TpufabError

    svc, laptop, folder = served
    spec = secret_job(recs, "HF_TOKEN", "WANDB_API_KEY")
    with pytest.raises(ConfigError, match=(
            rf"^Job {spec.job} needs HF_TOKEN, WANDB_API_KEY from this machine's environment, "
            r"and WANDB_API_KEY is not set: export WANDB_API_KEY here, then run `tpufab jobs "
            rf"secrets {spec.job}` again\.$")):
        handover.hand_secrets(laptop, spec.job, environ={"HF_TOKEN": "hf_x"})
    assert not folder.exists()                                  # nothing handed by halves
    with pytest.raises(st.UnknownJob, match="No job zz99 in gs://sup-svc"):
        handover.hand_secrets(laptop, "zz99", environ={})
    plain = secret_job(recs)
    assert handover.hand_secrets(laptop, plain.job, environ={}).summary() == (
        f"Job {plain.job} needs no secrets (its spec names none), so there is nothing to hand.")
    recs.update(spec.job, lambda s: st.finish(s, "cancelled", recs.now(), "cancelled"))
    assert handover.hand_secrets(laptop, spec.job, environ={}).summary() == (
        f"Job {spec.job} is cancelled, so it needs no secrets any more.")
    # a supervisor on another machine, then none at all
    other = secret_job(recs, "HF_TOKEN")
    beat = recs.store.read_json(recs.bucket, st.heartbeat_name("sup-one"))[0]
    recs.store.put_json(recs.bucket, st.heartbeat_name("sup-one"),
                        {**beat, "host": "server-elsewhere"})
    with pytest.raises(TpufabError, match=r"runs on server-elsewhere, not on this machine.*"
                                          rf"run `tpufab jobs secrets {other.job}` there"):
        handover.hand_secrets(laptop, other.job, environ={"HF_TOKEN": "hf_x"})
    recs.store.put_json(recs.bucket, st.heartbeat_name("sup-one"),
                        {**beat, "at": beat["at"] - 3600})
    with pytest.raises(TpufabError, match=r"No supervisor service runs for gs://sup-svc .*"
                                          r"python -m tpufab.flows.supervisor serve"):
        handover.hand_secrets(laptop, other.job, environ={"HF_TOKEN": "hf_x"})
    assert not folder.exists()


def test_the_vm_gets_the_values_on_stdin_never_in_argv():
    line = handover.secrets_command("job-20261202-041500-ab12", "/run/tpufab-supervisor/secrets")
    assert line == (
        "sudo -n install -d -m 0700 -o tpufab-supervisor -g tpufab-supervisor "
        "/run/tpufab-supervisor/secrets && sudo -n -u tpufab-supervisor sh -c "
        "'umask 077 && cat > \"$1/.$2.part\" && mv -f \"$1/.$2.part\" \"$1/$2.json\"' sh "
        "/run/tpufab-supervisor/secrets job-20261202-041500-ab12")
    from tpufab.errors import ConfigError

    with pytest.raises(ConfigError, match="is not a job id"):
        handover.secrets_command("job-1; rm -rf /", "/run/x")


def test_the_hand_over_gives_the_secrets_to_the_service_here_or_says_how_to_later(
        laptop, recs, tmp_path, monkeypatch):
    from dataclasses import replace

    laptop = replace(laptop, secrets=["MY_PLAIN_NAME"])
    monkeypatch.setenv("MY_PLAIN_NAME", "plain_value_secret")
    alone = handover.hand_over(laptop, "train.sh", env=["MY_PLAIN_NAME"])
    assert alone.spec.secrets == ("MY_PLAIN_NAME",) and not alone.secrets_handed
    assert "No supervisor service runs" in alone.secrets_why
    folder = tmp_path / "secrets"
    svc = service.Service(Settings(project="p"), recs.bucket, "sup-one", store=recs.store,
                          workdir=tmp_path, options=service.Options(secrets_dir=folder))
    svc.heartbeat()
    done = handover.hand_over(laptop, "train.sh", env=["MY_PLAIN_NAME"])
    assert done.secrets_handed and done.secrets_why is None
    assert svc.secrets_for(recs.spec(done.job)) == {"MY_PLAIN_NAME": "plain_value_secret"}
    assert b"plain_value_secret" not in every_object(recs)
