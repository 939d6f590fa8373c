"""`tpufab deploy|mount|umount` and `invoke ...` as a user runs them, on the simulated pod: one
v4-32 node (4 workers) for the module, a real git remote behind `git daemon` on loopback, and
the pod's own Cloud Storage (TPUFAB_STORAGE_ENDPOINT) mounted with rclone."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
from helpers import (
    GIT_ENV,
    create_node,
    git_daemon,
    invoke,
    ok,
    one_sentence,
    sh,
    tpufab,
    unique_name,
    wait_for,
)

pytestmark = pytest.mark.sim

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
FAST = "--dir-cache-time 1s --vfs-write-back 0s"  # see other workers' writes within a second


@pytest.fixture(scope="module")
def node(sim, tpu_client, sim_parent):
    name = unique_name("dm")
    create_node(tpu_client, sim_parent, name, "v4-32")
    yield name
    tpu_client.delete_node(name=f"{sim_parent}/nodes/{name}").result(timeout=60)


@pytest.fixture(scope="module")
def env(sim, node, tmp_path_factory):
    """A user's shell: own HOME (a fresh tpufab key), the default login on the workers (an
    ordinary user with sudo, which /mnt needs), the pod's API and Cloud Storage exported, the
    node named once."""
    home = tmp_path_factory.mktemp("home")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TPUFAB_")}
    env.update(sim.env(), HOME=str(home), TPUFAB_USER_CONFIG=str(home / "none.yaml"),
               TPUFAB_NAME=node, COLUMNS="200", **GIT_ENV)
    assert env["TPUFAB_STORAGE_ENDPOINT"] == sim.storage_endpoint
    return env


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    """The user's checkout, whose origin is a bare repository behind `git daemon`."""
    base = tmp_path_factory.mktemp("srv")
    with git_daemon(base) as url:
        sh(base, "git", "init", "-q", "--bare", "-b", "main", "climate.git")
        root = tmp_path_factory.mktemp("user") / "climate"
        root.mkdir()
        sh(root, "git", "init", "-q", "-b", "main")
        (root / "train.py").write_text("print('v1')\n")
        sh(root, "git", "add", ".")
        sh(root, "git", "commit", "-q", "-m", "v1")
        sh(root, "git", "remote", "add", "origin", f"{url}/climate.git")
        yield root


def test_deploy_from_the_command_line(env, node, repo):
    head = sh(repo, "git", "rev-parse", "HEAD")
    out = ok(tpufab("deploy", "--name", node, env=env, cwd=repo))
    assert "w[0-3]" in out and head[:12] in out and "clone" in out
    assert f"Deployed {head[:12]} (main) to 4 workers in ~/climate through origin" in out
    seen = ok(tpufab("exec", "--gather", "git -C ~/climate log -1 --format=%H", env=env,
                     cwd=repo))
    assert head in seen and "w[0-3]" in seen

    (repo / "train.py").write_text("print('edited')\n")  # dirty: refused before any SSH
    one_sentence(tpufab("deploy", env=env, cwd=repo),
                         "Your working tree has uncommitted changes (train.py)", "--wip")
    sh(repo, "git", "commit", "-q", "-am", "v2")
    new = sh(repo, "git", "rev-parse", "HEAD")
    out = ok(invoke("deploy", "--remote", "origin", env=env, cwd=repo))
    assert "update" in out and new[:12] in out and "4 changed" in out
    out = ok(invoke("deploy", env=env, cwd=repo))
    assert "noop" in out and "every worker was already there" in out


@pytest.mark.skipif(shutil.which("rclone") is None, reason="rclone is not installed")
def test_mount_write_on_w0_read_on_w3_then_umount(sim, env, node, tmp_path):
    from tpufab.sim.admin import StorageClient

    bucket = unique_name("data")
    assert f"Created bucket gs://{bucket}" in ok(tpufab("sim", "bucket", bucket, env=env,
                                                        cwd=tmp_path))
    assert "already exists" in ok(invoke("sim.bucket", "--name", bucket, env=env, cwd=tmp_path))

    out = ok(tpufab("mount", bucket, "--driver", "rclone", "--at", "/mnt/data",
                    f"--options={FAST}", env=env, cwd=tmp_path))
    assert "w[0-3]" in out and "mounted" in out
    assert f"gs://{bucket} from {sim.storage_endpoint} is mounted at /mnt/data on 4 workers" in out
    ok(tpufab("exec", "--worker", "0", "echo from w0 > /mnt/data/hello.txt", env=env,
              cwd=tmp_path))
    gcs = StorageClient(sim.storage_endpoint)
    wait_for(lambda: gcs.objects(bucket).get("hello.txt") == b"from w0\n", 30, 0.2,
             "hello.txt in the bucket")
    wait_for(lambda: "from w0" in tpufab("exec", "-w", "3", "cat /mnt/data/hello.txt",
                                         env=env, cwd=tmp_path).stdout,
             30, 0.5, "hello.txt through worker 3's mount")

    again = ok(invoke("mount", bucket, "--driver", "rclone", "--at", "/mnt/data",
                      f"--options={FAST}", env=env, cwd=tmp_path))
    assert "every worker already had it" in again
    assert "Unmounted /mnt/data on 4 workers" in ok(invoke("umount", "--at", "/mnt/data",
                                                           env=env, cwd=tmp_path))
    gone = ok(tpufab("exec", "--gather", "mountpoint -q /mnt/data || echo gone", env=env,
                     cwd=tmp_path))
    assert "gone" in gone and "w[0-3]" in gone
    assert "Nothing tpufab mounted was mounted on 4 workers" in ok(
        tpufab("umount", env=env, cwd=tmp_path))


@pytest.mark.skipif(shutil.which("rclone") is None, reason="rclone is not installed")
def test_mount_of_a_missing_bucket(env, tmp_path):
    one_sentence(
        tpufab("mount", "gs://no-such-bucket", "--driver", "rclone", "--at", "/mnt/x", env=env,
               cwd=tmp_path),
        "Bucket gs://no-such-bucket does not exist (as seen from workers w[0-3])", details=True)
