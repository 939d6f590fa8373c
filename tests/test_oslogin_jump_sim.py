"""OS Login and no external IPs together, as an organisation's project has them (org policy
enforces OS Login and forbids external IPs): the workers are reached through the project's
bastion, and the bastion, a VM of the same project, also takes only OS Login keys.

One internal-IP v4-8 (one worker) in a project of its own with OS Login on, driven through the
`tpufab` command; `jump:` in tpufab.yaml names the bastion without a user, so tpufab logs in to
it as the profile's POSIX user, as on the workers.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import (
    GIT_ENV,
    POD_USER,
    SshKey,
    cli_env,
    ok,
    one_sentence,
    os_login_on,
    sh,
    sim_pool,
    ssh_run,
    tpufab,
    unique_name,
    wait_for,
)
from helpers import OS_LOGIN_ACCOUNT as ACCOUNT
from helpers import OS_LOGIN_USER as USER

pytestmark = pytest.mark.sim

PROJECT = "oslogin-jump-project"


@pytest.fixture(scope="module")
def admin(sim):
    with os_login_on(sim, PROJECT) as admin:
        yield admin


@pytest.fixture(scope="module")
def pod(admin, sim, tmp_path_factory):
    """The node, its bastion, and a git project whose tpufab.yaml names the bastion only."""
    home = tmp_path_factory.mktemp("osl-jump-home")
    name = unique_name("oslj")
    env = cli_env(sim, home, name)
    # sshd runs a Python AuthorizedKeysCommand per login (bastion and worker): slow when loaded
    env.update(TPUFAB_PROJECT=PROJECT, TPUFAB_CONNECT_TIMEOUT="30", **GIT_ENV)
    assert env["TPUFAB_OS_LOGIN_ACCOUNT"] == ACCOUNT
    ok(tpufab("create", "--type", "v4-8", "--internal-ips", env=env, cwd=home))
    status = json.loads(tpufab("sim", "status", "--json", "--state-dir", str(sim.state_dir),
                               env=env, cwd=home).stdout)
    node = next(n for n in status["nodes"] if n["name"] == f"projects/{PROJECT}/locations/"
                f"{sim.zone}/nodes/{name}")
    project = home / "project"
    project.mkdir()
    (project / "tpufab.yaml").write_text(f"jump: {node['bastion']}\n")
    (project / "job.sh").write_text("#!/bin/sh\necho job as $(id -un) on $(hostname)\n"
                                    "sleep 300\n")
    sh(project, "git", "init", "-q", "-b", "main")
    sh(project, "git", "add", "-A")
    sh(project, "git", "commit", "-qm", "start")
    yield {"env": env, "home": home, "project": project, "name": name,
           "bastion": node["bastion"], "id": node["id"]}
    tpufab("delete", "--yes", env=env, cwd=home)


def test_exec_run_and_kill_through_the_bastion_as_the_os_login_user(pod):
    env, cwd = pod["env"], pod["project"]
    first = tpufab("exec", "id -un; hostname; sudo -n true && echo sudo-ok", env=env, cwd=cwd)
    out = ok(first)
    assert f"w0 │ {USER}" in out and "-w-0" in out and "sudo-ok" in out, out
    assert f"OS Login is on for node {pod['name']}: logging in as {USER}" in first.stderr
    # the jump named no user: tpufab logged in to the bastion as the profile's POSIX user
    assert f"via bastion {USER}@{pod['bastion']}" in first.stderr, first.stderr
    described = json.loads(ok(tpufab("describe", "--json", env=env, cwd=cwd)))
    assert [w["external_ip"] for w in described["workers"]] == [None]

    ok(tpufab("run", "job.sh", "--direct", "--detach", env=env, cwd=cwd))
    wait_for(lambda: f"job as {USER}" in tpufab("logs", env=env, cwd=cwd).stdout, 90, 0.5,
             "the job's first line through the bastion")
    ok(tpufab("kill", env=env, cwd=cwd))
    assert "none" in ok(tpufab("exec", "pgrep -x sleep || echo none", env=env, cwd=cwd))


def test_the_bastion_takes_os_login_keys_only(pod, admin, ssh_key, tpu_client, sim):
    from google.cloud import tpu_v2
    from google.protobuf import field_mask_pb2

    name = f"projects/{PROJECT}/locations/{sim.zone}/nodes/{pod['name']}"
    metadata = dict(tpu_client.get_node(name=name).metadata)
    # `tpufab create` put its key there for POD_USER; bob's joins it
    assert f"{POD_USER}:" in metadata.get("ssh-keys", ""), metadata
    metadata["ssh-keys"] = metadata["ssh-keys"].rstrip("\n") + f"\nbob:{ssh_key.public}"
    tpu_client.update_node(node=tpu_v2.Node(name=name, metadata=metadata),
                           update_mask=field_mask_pb2.FieldMask(paths=["metadata"])
                           ).result(timeout=60)
    ours = SshKey(pod["home"] / "tpufab_ed25519", "")
    bastion = pod["bastion"]
    # the project's OS Login is on: bob's key, only in metadata, is refused; the profile's works
    assert ssh_run(bastion, ours, USER, "id -un").stdout.strip() == USER
    refused = ssh_run(bastion, ssh_key, "bob", "true")
    assert refused.returncode == 255 and "Permission denied" in refused.stderr, refused.stderr
    assert ssh_run(bastion, ours, POD_USER, "true").returncode == 255  # not an OS Login user
    # a jump naming another user is refused in one sentence that names the OS Login user
    other = tpufab("exec", "--jump", f"bob@{bastion}", "true", env=pod["env"], cwd=pod["home"])
    one_sentence(other, f"jump host bob@{bastion} refused the login", "OS Login", USER)
    # the contrast: with the project's OS Login off, the same metadata key gets in
    admin.os_login(enabled=False)
    try:
        wait_for(lambda: ssh_run(bastion, ssh_key, "bob", "id -un").stdout.strip() == "bob",
                 60, 0.2, "bob's metadata key to work on the bastion with OS Login off")
        assert ssh_run(bastion, ours, POD_USER, "id -un").stdout.strip() == POD_USER
    finally:
        admin.os_login(enabled=True)
    wait_for(lambda: ssh_run(bastion, ssh_key, "bob", "true").returncode == 255, 60, 0.2,
             "bob's metadata key to be refused again")
    assert ssh_run(bastion, ours, USER, "id -un").stdout.strip() == USER


def test_the_bastion_down_is_one_sentence(pod, sim):
    pool = sim_pool(sim)
    pool.set_reachable(pod["id"] + "-bastion", 0, False)
    try:
        result = tpufab("exec", "true", env={**pod["env"], "TPUFAB_CONNECT_TIMEOUT": "5"},
                        cwd=pod["project"])
        one_sentence(result, f"Cannot reach the jump host {USER}@{pod['bastion']}")
    finally:
        pool.set_reachable(pod["id"] + "-bastion", 0, True)
    assert Path(pod["home"], "known_hosts").read_text().count(pod["bastion"]) == 1


def test_babysit_recreates_the_node_without_external_ips_and_with_its_metadata(pod, sim,
                                                                                 tpu_client):
    """Last in this module: the node is recreated. It was made with --internal-ips (the flag:
    the settings below do not say internal_ip) and has metadata of its own."""
    from google.cloud import tpu_v2
    from google.protobuf import field_mask_pb2
    from helpers import quiet_console, sim_settings

    from tpufab.cloud.planes.tpu import TpuApi
    from tpufab.flows.babysit.loop import Babysitter
    from tpufab.flows.babysit.recover import NodeSpec
    from tpufab.sim.admin import SimAdmin

    path = f"projects/{PROJECT}/locations/{sim.zone}/nodes/{pod['name']}"
    metadata = {**tpu_client.get_node(name=path).metadata, "enable-oslogin": "TRUE",
                "startup-script": "#!/bin/sh\necho booted > /tmp/booted\n"}
    tpu_client.update_node(node=tpu_v2.Node(name=path, metadata=metadata),
                           update_mask=field_mask_pb2.FieldMask(paths=["metadata"])
                           ).result(timeout=60)
    settings = sim_settings(sim, pod["home"], name=pod["name"], project=PROJECT)
    assert not settings.internal_ip
    recipe = pod["project"] / "job.sh"
    sitter = Babysitter(settings, recipe, no_deploy=True, console=quiet_console())
    sitter.spec = NodeSpec.from_api(pod["name"], *sitter._api())  # as babysit reads it first
    SimAdmin.from_info(sim, project=PROJECT).preempt(pod["name"])
    sitter._recreate("preempted")
    after = TpuApi(settings).get_node(pod["name"])
    assert after.id != pod["id"] and after.ready
    assert after.external_ips is False and [w.external_ip for w in after.workers] == [None]
    assert after.metadata["enable-oslogin"] == "TRUE"
    assert after.metadata["startup-script"] == metadata["startup-script"]
    # the same bastion (a project's bastion outlives a TPU preemption): its pinned host key
    # still holds, so the verbs go on working through it on the recreated node
    out = ok(tpufab("exec", "id -un; hostname", env=pod["env"], cwd=pod["project"]))
    assert f"w0 │ {USER}" in out and "-w-0" in out, out
