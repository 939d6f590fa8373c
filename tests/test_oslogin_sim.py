"""OS Login on the simulated pod, as a user meets it: the project has enable-oslogin=TRUE, so
the workers accept only keys registered with the OS Login API for the profile's POSIX user.

One v4-8 node (one worker) in a project of its own (OS Login there does not touch the other
modules' pods), driven through the `tpufab` command and the system ssh; gcloud last.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from helpers import (
    GIT_ENV,
    SshKey,
    cli_env,
    create_node,
    ok,
    one_sentence,
    os_login_on,
    sh,
    ssh_run,
    tpufab,
    unique_name,
    wait_for,
)
from helpers import OS_LOGIN_ACCOUNT as ACCOUNT
from helpers import OS_LOGIN_USER as USER

pytestmark = pytest.mark.sim

PROJECT = "oslogin-project"


@pytest.fixture(scope="module")
def admin(sim):
    with os_login_on(sim, PROJECT) as admin:
        yield admin


@pytest.fixture(scope="module")
def node(admin, tpu_client, sim):
    parent = f"projects/{PROJECT}/locations/{sim.zone}"
    name = unique_name("osl")
    created = create_node(tpu_client, parent, name, "v4-8")
    yield created
    tpu_client.delete_node(name=created.name).result(timeout=60)


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("oslogin-home")


@pytest.fixture(scope="module")
def env(sim, node, home) -> dict[str, str]:
    env = cli_env(sim, home, node.name.rsplit("/", 1)[1])
    # sshd runs a Python AuthorizedKeysCommand per login here: more than 5 s on a loaded machine
    env.update(TPUFAB_PROJECT=PROJECT, TPUFAB_CONNECT_TIMEOUT="30", **GIT_ENV)
    assert env["TPUFAB_OS_LOGIN_ACCOUNT"] == ACCOUNT
    return env


@pytest.fixture(scope="module")
def worker_ip(node) -> str:
    return node.network_endpoints[0].access_config.external_ip


def test_verbs_work_as_the_profile_user(env, home, node, worker_ip):
    project = home / "project"
    project.mkdir()
    sh(project, "git", "init", "-q", "-b", "main")
    (project / "setup.sh").write_text("#!/bin/sh\nid -un > ~/setup-ran\n")
    (project / "job.sh").write_text("#!/bin/sh\necho job as $(id -un)\nsleep 300\n")
    sh(project, "git", "add", "-A")
    sh(project, "git", "commit", "-qm", "start")

    first = tpufab("exec", "id -un; sudo -n true && echo sudo-ok", env=env, cwd=project)
    out = ok(first)
    assert f"w0 │ {USER}" in out and "sudo-ok" in out, out
    assert (f"OS Login is on for node {node.name.rsplit('/', 1)[1]}: logging in as {USER} with tpufab's key "
            "registered for 24 h.") in first.stderr, first.stderr
    # registered once: the next verb finds the key in the profile and says nothing about it
    again = tpufab("exec", "echo $HOME", env=env, cwd=project)
    assert f"/home/{USER}" in ok(again) and "OS Login is on" not in again.stderr
    assert ok(tpufab("ssh", "--", "id", "-un", env=env, cwd=project)).strip() == USER

    ok(tpufab("setup", "--script", "setup.sh", env=env, cwd=project))
    assert USER in ok(tpufab("exec", "cat ~/setup-ran", env=env, cwd=project))
    ok(tpufab("deploy", "--direct", env=env, cwd=project))
    commit = sh(project, "git", "rev-parse", "HEAD")
    assert commit in ok(tpufab("exec", "git -C ~/project rev-parse HEAD", env=env, cwd=project))
    started = tpufab("run", "job.sh", "--no-deploy", "--detach", env=env, cwd=project)
    ok(started)
    wait_for(lambda: f"job as {USER}" in tpufab("logs", env=env, cwd=project).stdout, 60, 0.5,
             "the job's first line")
    ok(tpufab("kill", env=env, cwd=project))
    left = tpufab("exec", "pgrep -x sleep || echo none", env=env, cwd=project)
    assert "none" in ok(left)


def test_metadata_keys_are_refused(env, home, node, worker_ip, tpu_client, ssh_key):
    from google.cloud import tpu_v2
    from google.protobuf import field_mask_pb2


    def set_metadata(**changes: str | None) -> None:
        metadata = dict(tpu_client.get_node(name=node.name).metadata)
        for key, value in changes.items():
            metadata.pop(key, None) if value is None else metadata.__setitem__(key, value)
        tpu_client.update_node(node=tpu_v2.Node(name=node.name, metadata=metadata),
                               update_mask=field_mask_pb2.FieldMask(paths=["metadata"])
                               ).result(timeout=60)

    # OS Login is on, so tpufab only registered its key: none went into ssh-keys
    tpufab_key = (home / "tpufab_ed25519.pub").read_text().split()[1]
    assert tpufab_key not in tpu_client.get_node(name=node.name).metadata.get("ssh-keys", "")
    ours = SshKey(home / "tpufab_ed25519", "")
    # the node's own enable-oslogin=FALSE overrides the project's: metadata keys work again
    set_metadata(**{"ssh-keys": f"bob:{ssh_key.public}", "enable-oslogin": "FALSE"})
    wait_for(lambda: ssh_run(worker_ip, ssh_key, "bob", "id -un").stdout.strip() == "bob", 30,
             0.2, "bob's metadata key to work with OS Login off for the node")
    assert ssh_run(worker_ip, ours, USER, "true").returncode == 255  # no profile keys now
    # back to the project's TRUE: bob's key (only in ssh-keys) is refused, the profile's works
    set_metadata(**{"enable-oslogin": None})
    wait_for(lambda: ssh_run(worker_ip, ours, USER, "id -un").stdout.strip() == USER, 30, 0.2,
             "the profile's key to work again")
    refused = ssh_run(worker_ip, ssh_key, "bob", "true")
    assert refused.returncode == 255 and "Permission denied" in refused.stderr, refused.stderr
    assert ssh_run(worker_ip, ours, "tpufab", "true").returncode == 255


def test_roles_decide_login_and_sudo(env, admin, home, worker_ip):
    # roles/compute.osLogin only: logs in, no sudo (decided at each login, as on a real VM)
    changed = tpufab("sim", "os-login", "--role", "login", env=env, cwd=home)
    assert (f"OS Login in project {PROJECT}: enable-oslogin=TRUE; roles: {ACCOUNT}: login."
            in ok(changed)), changed.stdout
    try:
        result = tpufab("exec", "sudo -n true 2>/dev/null && echo sudo-ok || echo no-sudo",
                        env=env, cwd=home)
        assert "no-sudo" in ok(result)
        # neither role: a new key is refused by the API, in one sentence naming the role
        admin.os_login(role="none", account=ACCOUNT)
        fresh = {**env, "TPUFAB_SSH_KEY": str(home / "other_ed25519")}
        refused = tpufab("exec", "true", env=fresh, cwd=home)
        one_sentence(refused, "roles/compute.osAdminLogin", ACCOUNT, PROJECT)
        # and the key registered earlier no longer logs in either (authorize?policy=login):
        # the refusal names the roles too
        key_path = home / "tpufab_ed25519"
        assert ssh_run(worker_ip, SshKey(key_path, ""), USER, "true").returncode == 255
        stale = tpufab("exec", "true", env=env, cwd=home)
        assert stale.returncode != 0 and "Traceback" not in stale.stderr
        assert (f"authentication failed (OS Login refused {USER}: does {ACCOUNT} hold "
                "roles/compute.osAdminLogin") in stale.stderr, stale.stderr
    finally:
        admin.os_login(role="admin", account=ACCOUNT)


def test_no_os_login_is_refused_with_the_reason(env, home):
    result = tpufab("exec", "--no-os-login", "true", env=env, cwd=home)
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    assert "OS Login is on for" in result.stderr and "--no-os-login" in result.stderr
    assert "authentication failed (OS Login is on for" in result.stderr, result.stderr


@pytest.mark.gcloud
def test_gcloud_tpu_vm_ssh_logs_in_through_os_login(gcloud_env, node, tpu_client):
    env = {**gcloud_env, "CLOUDSDK_CORE_PROJECT": PROJECT, "CLOUDSDK_CORE_ACCOUNT": ACCOUNT}
    result = subprocess.run(
        ["gcloud", "compute", "tpus", "tpu-vm", "ssh", node.name.rsplit("/", 1)[1],
         "--worker=0", "--command", "id -un", "--strict-host-key-checking=no"],
        env=env, capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr
    assert re.search(rf"^{USER}$", result.stdout, re.MULTILINE), result.stdout
    # gcloud registered its own key with OS Login (it also adds it to ssh-keys, ignored here)
    gcloud_key = Path(env["HOME"], ".ssh", "google_compute_engine.pub").read_text().split()[1]
    assert os.path.exists(Path(env["HOME"], ".ssh", "google_compute_engine"))
    assert f"{USER}:ssh-rsa {gcloud_key}" in tpu_client.get_node(name=node.name).metadata[
        "ssh-keys"]
    described = subprocess.run(["gcloud", "compute", "os-login", "describe-profile",
                                "--format=json"], env=env, capture_output=True, text=True,
                               timeout=120, stdin=subprocess.DEVNULL)
    assert described.returncode == 0, described.stderr
    profile = json.loads(described.stdout)
    assert profile["name"] == ACCOUNT and profile["posixAccounts"][0]["username"] == USER
    assert any(gcloud_key in k["key"] for k in profile["sshPublicKeys"].values())
