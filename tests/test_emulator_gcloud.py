"""The real gcloud CLI against the emulator (fresh CLOUDSDK_CONFIG and HOME per test)."""

from __future__ import annotations

import json
import re
import subprocess

import pytest
from google.api_core import exceptions as gexc
from helpers import unique_name, wait_for

pytestmark = [pytest.mark.sim, pytest.mark.gcloud]


def gcloud(env: dict[str, str], *args: str, timeout: float = 180.0,
           check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["gcloud", *args], env=env, capture_output=True, text=True,
                            timeout=timeout, stdin=subprocess.DEVNULL)
    if check and result.returncode != 0:
        pytest.fail(f"gcloud {' '.join(args)} exited {result.returncode}:\n{result.stderr}")
    return result


def tpu_vm(env: dict[str, str], *args: str, **kw) -> subprocess.CompletedProcess:
    return gcloud(env, "compute", "tpus", "tpu-vm", *args, **kw)


def test_create_list_describe_delete(gcloud_env, tpu_client, sim_parent):
    name = unique_name("gc")
    tpu_vm(gcloud_env, "create", name, "--accelerator-type=v4-16",
           "--version=tpu-ubuntu2204-base", "--labels=owner=tests", "--metadata=k=v")
    listed = json.loads(tpu_vm(gcloud_env, "list", "--format=json").stdout)
    assert f"{sim_parent}/nodes/{name}" in [n["name"] for n in listed]
    described = json.loads(tpu_vm(gcloud_env, "describe", name, "--format=json").stdout)
    assert described["state"] == "READY" and described["acceleratorType"] == "v4-16"
    assert len(described["networkEndpoints"]) == 2
    assert described["labels"] == {"owner": "tests"} and described["metadata"]["k"] == "v"
    table = tpu_vm(gcloud_env, "list").stdout
    assert name in table and "READY" in table and "2x2x2" in table
    tpu_vm(gcloud_env, "delete", name, "--quiet")
    with pytest.raises(gexc.NotFound):
        tpu_client.get_node(name=f"{sim_parent}/nodes/{name}")


def test_errors_read_like_the_real_api(gcloud_env, sim_admin):
    missing = tpu_vm(gcloud_env, "describe", "no-such-node", check=False)
    assert missing.returncode != 0 and "was not found" in missing.stderr
    bad = tpu_vm(gcloud_env, "create", unique_name("gc"), "--accelerator-type=v4-31",
                 "--version=tpu-ubuntu2204-base", check=False)
    assert bad.returncode != 0 and "is not available in zone" in bad.stderr
    sim_admin.fail_next_create("stockout")
    stockout = tpu_vm(gcloud_env, "create", unique_name("gc"), "--accelerator-type=v4-8",
                      "--version=tpu-ubuntu2204-base", check=False)
    assert stockout.returncode != 0 and "There is no more capacity" in stockout.stderr


def test_queued_resource_create_describe_delete(gcloud_env, tpu_client, sim_parent):
    qr, prefix = unique_name("gq"), unique_name("gs")
    gcloud(gcloud_env, "compute", "tpus", "queued-resources", "create", qr,
           "--accelerator-type=v4-8", "--runtime-version=tpu-ubuntu2204-base",
           "--node-count=2", f"--node-prefix={prefix}", "--spot")

    def active():
        out = gcloud(gcloud_env, "compute", "tpus", "queued-resources", "describe", qr,
                     "--format=json").stdout
        return json.loads(out)["state"]["state"] == "ACTIVE"

    wait_for(active, 60, 0.5, "the queued resource to be ACTIVE")
    for i in range(2):
        node = tpu_client.get_node(name=f"{sim_parent}/nodes/{prefix}-{i}")
        assert node.multislice_node and node.scheduling_config.spot
    gcloud(gcloud_env, "compute", "tpus", "queued-resources", "delete", qr, "--force",
           "--quiet")
    with pytest.raises(gexc.NotFound):
        tpu_client.get_node(name=f"{sim_parent}/nodes/{prefix}-0")


def test_ssh_all_workers_with_strict_host_key_checking(gcloud_env, tpu_client, make_node):
    """gcloud pushes its own key through a metadata PATCH, then ssh's to each external IP.

    gcloud names each worker's host key `tpu.<node id>-<worker>-<last 6 chars of the
    guest-attribute key>` but never writes TPU host keys to known_hosts itself; we write them
    from getGuestAttributes first, so --strict-host-key-checking=yes proves they are the keys
    the workers' sshd really presents.
    """
    node = make_node("v4-32")
    attrs = tpu_client.get_guest_attributes(request={"name": node.name}).guest_attributes
    lines = []
    for worker, entry in enumerate(attrs):
        key = next(i.value for i in entry.query_value.items if i.key == "ssh-ed25519")
        lines.append(f"tpu.{node.id}-{worker}-{key[-6:]} ssh-ed25519 {key}\n")
    ssh_dir = gcloud_env["HOME"] + "/.ssh"
    subprocess.run(["mkdir", "-m", "700", "-p", ssh_dir], check=True)
    with open(f"{ssh_dir}/google_compute_known_hosts", "w") as known:
        known.writelines(lines)
    result = tpu_vm(gcloud_env, "ssh", node.name.rsplit("/", 1)[1], "--worker=all",
                    "--command", "hostname", "--strict-host-key-checking=yes")
    # stdout also carries gcloud's first-run ssh-keygen chatter; hostnames are whole lines
    hostnames = re.findall(r"^t1v-n-[0-9a-f]{8}-w-\d+$", result.stdout, re.MULTILINE)
    assert len(hostnames) == 4 and len(set(hostnames)) == 4
    assert sorted(h.rsplit("-w-", 1)[1] for h in hostnames) == ["0", "1", "2", "3"]
    pushed = tpu_client.get_node(name=node.name).metadata["ssh-keys"]
    assert "root:ssh-rsa " in pushed  # gcloud's own key, synced into every worker
