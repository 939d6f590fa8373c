"""The emulator where the API versions differ (issue 25, 7): maintenance events as gcloud and
the API describe them, perform-maintenance (v2alpha1), and what a v2 client reads of
resources a v2alpha1 client (gcloud alpha) made."""

from __future__ import annotations

import json
import subprocess
import urllib.error
import urllib.request

import pytest
from helpers import unique_name, wait_for, wait_node_state

pytestmark = pytest.mark.sim


def notice(node, worker: int) -> str:
    """The worker's metadata server, as a process on it reads it."""
    ip = node.network_endpoints[worker].ip_address
    request = urllib.request.Request(
        f"http://{ip}/computeMetadata/v1/instance/maintenance-event",
        headers={"Metadata-Flavor": "Google"})
    with urllib.request.urlopen(request, timeout=10) as answer:
        return answer.read().decode()


def call(sim, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(f"{sim.endpoint}{path}", data=data, method=method,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, json.loads(answer.read() or b"{}")
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


@pytest.mark.gcloud
def test_gcloud_maintenance_without_workers_is_worker_0_and_perform_maintenance_is_served(
        make_node, sim, sim_admin, gcloud_env):
    sim_admin.settings(maintenance_notice=30.0)
    node = make_node("v4-16")
    name = node.name.rsplit("/", 1)[1]
    done = subprocess.run(["gcloud", "alpha", "compute", "tpus", "tpu-vm",
                           "simulate-maintenance-event", name], env=gcloud_env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert [notice(node, 0), notice(node, 1)] == ["TERMINATE_ON_HOST_MAINTENANCE", "NONE"]

    done = subprocess.run(["gcloud", "alpha", "compute", "tpus", "tpu-vm", "perform-maintenance",
                           name], env=gcloud_env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert notice(node, 1) == "TERMINATE_ON_HOST_MAINTENANCE"  # every worker this time
    # Not part of API v2, as on Google's side.
    code, answer = call(sim, "POST", f"/v2/{node.name}:performMaintenance", {})
    assert code == 404 and answer["error"]["status"] == "NOT_FOUND"
    wait_for(lambda: notice(node, 0) == notice(node, 1) == "NONE", 90,
             what="the maintenance to end")


def test_a_v2_client_reads_what_a_v2alpha1_client_made(tpu_client, sim, sim_parent):
    node_id = unique_name("alpha")
    name = f"{sim_parent}/nodes/{node_id}"
    code, op = call(sim, "POST", f"/v2alpha1/{sim_parent}/nodes?nodeId={node_id}", {
        "acceleratorType": "v4-8", "runtimeVersion": "tpu-ubuntu2204-base",
        # only fields v2alpha1 has (its SchedulingConfig has no provisioningModel, its
        # BootDiskConfig no diskSizeGb: the conformance check holds the test to that too)
        "schedulingConfig": {"spot": True}})
    assert code == 200, op
    try:
        node = wait_node_state(tpu_client, name, "READY")
        assert node.scheduling_config.spot
        listed = list(tpu_client.list_operations(request={"name": sim_parent}).operations)
        mine = [o for o in listed if node_id in o.metadata.value.decode(errors="ignore")]
        assert mine and all(o.done for o in mine)
        assert tpu_client.get_operation(request={"name": op["name"]}).done
        assert node_id in [n.name.rsplit("/", 1)[1]
                           for n in tpu_client.list_nodes(parent=sim_parent)]
        # v2alpha1 still shows it in its own shape
        code, alpha = call(sim, "GET", f"/v2alpha1/{name}")
        assert code == 200 and alpha["schedulingConfig"] == {"spot": True}, alpha
    finally:
        tpu_client.delete_node(name=name).result(timeout=120)


def test_perform_maintenance_queued_resource_is_served_for_its_nodes(tpu_client, sim,
                                                                      sim_parent, sim_admin):
    """v2alpha1's queuedResources:performMaintenanceQueuedResource ({"nodeNames": [...]}, as
    the API's PerformMaintenanceQueuedResourceRequest): maintenance on the named nodes'
    workers, an operation whose response is the QueuedResource; not part of v2."""
    from google.cloud import tpu_v2

    sim_admin.settings(maintenance_notice=30.0)
    qr_id, node_id = unique_name("qrm"), unique_name("qmn")
    name = f"{sim_parent}/queuedResources/{qr_id}"
    QR, NodeSpec = tpu_v2.QueuedResource, tpu_v2.QueuedResource.Tpu.NodeSpec
    request = QR(tpu=QR.Tpu(node_spec=[NodeSpec(
        parent=sim_parent, node_id=node_id,
        node=tpu_v2.Node(accelerator_type="v4-8", runtime_version="tpu-ubuntu2204-base"))]))
    tpu_client.create_queued_resource(parent=sim_parent, queued_resource_id=qr_id,
                                      queued_resource=request).result(timeout=30)
    try:
        node = wait_node_state(tpu_client, f"{sim_parent}/nodes/{node_id}", "READY")
        wait_for(lambda: tpu_client.get_queued_resource(name=name).state.state ==
                 tpu_v2.QueuedResourceState.State.ACTIVE, 60, 0.1, "the queued resource")
        code, answer = call(sim, "POST", f"/v2/{name}:performMaintenanceQueuedResource",
                            {"nodeNames": [node_id]})
        assert code == 404 and answer["error"]["status"] == "NOT_FOUND"
        code, op = call(sim, "POST", f"/v2alpha1/{name}:performMaintenanceQueuedResource",
                        {"nodeNames": [node_id]})
        assert code == 200, op
        assert op["done"] and op["response"]["name"] == name
        assert op["response"]["@type"].endswith(".QueuedResource")
        assert notice(node, 0) == "TERMINATE_ON_HOST_MAINTENANCE"
        code, answer = call(sim, "POST", f"/v2alpha1/{name}:performMaintenanceQueuedResource",
                            {"nodeNames": ["not-a-node-of-it"]})
        assert code == 400 and "not part of queued resource" in answer["error"]["message"]
    finally:
        tpu_client.delete_queued_resource(request={"name": name, "force": True}).result(
            timeout=60)
