"""The official google-cloud-tpu v2 client (REST, anonymous) against the emulator."""

from __future__ import annotations

import subprocess

import pytest
from google.api_core import exceptions as gexc
from google.cloud import tpu_v2
from google.protobuf import empty_pb2, field_mask_pb2
from helpers import (
    create_node,
    metadata_keys,
    port_open,
    ssh_run,
    unique_name,
    wait_for,
    wait_node_state,
)

pytestmark = pytest.mark.sim

QR = tpu_v2.QueuedResource
NodeSpec = QR.Tpu.NodeSpec


def test_create_v4_32_has_four_workers_with_loopback_endpoints(make_node, sim_admin):
    node = make_node(
        "v4-32", labels={"team": "infra"},
        scheduling_config=tpu_v2.SchedulingConfig(spot=True),
        data_disks=[tpu_v2.AttachedDisk(source_disk="projects/p/zones/z/disks/d",
                                        mode=tpu_v2.AttachedDisk.DiskMode.READ_ONLY)])
    assert node.state == tpu_v2.Node.State.READY
    assert node.health == tpu_v2.Node.Health.HEALTHY
    assert node.api_version == tpu_v2.Node.ApiVersion.V2
    assert node.accelerator_type == "v4-32"
    assert node.accelerator_config.topology == "2x2x4"
    assert node.id > 0 and node.create_time
    ips = [e.ip_address for e in node.network_endpoints]
    assert len(ips) == 4 and len(set(ips)) == 4
    assert all(ip.startswith("127.") for ip in ips)
    assert [e.access_config.external_ip for e in node.network_endpoints] == ips
    assert {e.port for e in node.network_endpoints} == {22}
    assert node.labels["team"] == "infra"
    assert node.scheduling_config.spot
    assert node.data_disks[0].mode == tpu_v2.AttachedDisk.DiskMode.READ_ONLY  # sent as int
    workers = sim_admin.node(node.name.rsplit("/", 1)[1])["workers"]
    assert [w["running"] for w in workers] == [True] * 4
    assert all(port_open(ip) for ip in ips)


def test_get_and_list_nodes_with_paging(tpu_client, make_node, sim_parent):
    first = make_node("v4-8")
    second = make_node("v5litepod-4")
    assert tpu_client.get_node(name=first.name) == first
    names = [n.name for n in tpu_client.list_nodes(parent=sim_parent)]
    assert {first.name, second.name} <= set(names)
    everywhere = tpu_client.list_nodes(parent=sim_parent.rsplit("/", 1)[0] + "/-")
    assert {first.name, second.name} <= {n.name for n in everywhere}
    pager = tpu_client.list_nodes(request={"parent": sim_parent, "page_size": 1})
    pages = list(pager.pages)
    assert len(pages) >= 2 and all(len(p.nodes) == 1 for p in pages)
    assert second.accelerator_type == "v5litepod-4" and len(second.network_endpoints) == 1


def test_update_metadata_syncs_ssh_keys_into_every_worker(tpu_client, make_node, ssh_key):
    node = make_node("v4-16", metadata={"startup": "x"})
    ip = node.network_endpoints[1].ip_address
    assert ssh_run(ip, ssh_key, "alice", "true").returncode == 255  # no key yet
    node.metadata["ssh-keys"] = metadata_keys("alice", ssh_key)
    node.labels["updated"] = "yes"
    updated = tpu_client.update_node(
        node=node, update_mask=field_mask_pb2.FieldMask(paths=["metadata", "labels"])
    ).result(timeout=30)
    assert updated.metadata["ssh-keys"].startswith("alice:ssh-ed25519 ")
    assert updated.metadata["startup"] == "x"
    assert updated.labels["updated"] == "yes"
    for endpoint in updated.network_endpoints:  # keys are in place once the operation is done
        result = ssh_run(endpoint.ip_address, ssh_key, "alice", "whoami; hostname")
        assert result.returncode == 0, result.stderr
        assert result.stdout.split()[0] == "alice"


def test_update_rejects_unknown_mask_field(tpu_client, make_node):
    node = make_node("v4-8")
    with pytest.raises(gexc.BadRequest, match="cannot be updated"):
        tpu_client.update_node(node=node,
                               update_mask=field_mask_pb2.FieldMask(paths=["accelerator_type"]))


def test_guest_attributes_carry_each_workers_real_host_key(tpu_client, make_node):
    node = make_node("v4-32")
    response = tpu_client.get_guest_attributes(request={"name": node.name})
    assert len(response.guest_attributes) == 4
    for worker, attrs in enumerate(response.guest_attributes):
        items = {(i.namespace, i.key): i.value for i in attrs.query_value.items}
        offered = subprocess.run(
            ["ssh-keyscan", "-t", "ed25519", node.network_endpoints[worker].ip_address],
            capture_output=True, text=True, timeout=20).stdout.split()
        assert items[("hostkeys", "ssh-ed25519")] == offered[-1]
        assert items[("", "hostname")].endswith(f"-w-{worker}")
    one = tpu_client.get_guest_attributes(request={"name": node.name, "worker_ids": ["2"]})
    assert len(one.guest_attributes) == 1
    assert one.guest_attributes[0].query_value.items[0].value == \
        response.guest_attributes[2].query_value.items[0].value
    with pytest.raises(gexc.BadRequest, match="out of range"):
        tpu_client.get_guest_attributes(request={"name": node.name, "worker_ids": ["4"]})


def test_stop_and_start_stop_and_restart_workers(tpu_client, make_node, ssh_key):
    node = make_node("v4-16", metadata={"ssh-keys": metadata_keys("bob", ssh_key)})
    ips = [e.ip_address for e in node.network_endpoints]
    stopped = tpu_client.stop_node(request={"name": node.name}).result(timeout=60)
    assert stopped.state == tpu_v2.Node.State.STOPPED
    assert not any(port_open(ip) for ip in ips)
    with pytest.raises(gexc.BadRequest, match="only a READY node can be stopped"):
        tpu_client.stop_node(request={"name": node.name})
    started = tpu_client.start_node(request={"name": node.name}).result(timeout=60)
    assert started.state == tpu_v2.Node.State.READY
    assert [e.ip_address for e in started.network_endpoints] == ips
    result = ssh_run(ips[1], ssh_key, "bob", "hostname")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("-w-1")


def test_delete_removes_node_and_workers(tpu_client, sim_parent, sim_admin):
    name = f"{sim_parent}/nodes/{unique_name('del')}"
    node = create_node(tpu_client, sim_parent, name.rsplit("/", 1)[1], "v4-16")
    ips = [e.ip_address for e in node.network_endpoints]
    assert tpu_client.delete_node(name=name).result(timeout=60) == empty_pb2.Empty()
    with pytest.raises(gexc.NotFound, match="was not found"):
        tpu_client.get_node(name=name)
    assert name not in [n["name"] for n in sim_admin.state()["nodes"]]
    assert not any(port_open(ip) for ip in ips)
    with pytest.raises(gexc.NotFound):
        tpu_client.delete_node(name=name)


def test_accelerator_types_and_runtime_versions(tpu_client, sim_parent):
    types = {t.type_ for t in tpu_client.list_accelerator_types(parent=sim_parent)}
    assert {"v2-8", "v3-32", "v4-8", "v4-32", "v5litepod-16", "v5p-8", "v6e-256"} <= types
    assert {"v4-4096", "v5p-12288"} <= types  # nodes of more than 254 hosts are addressable
    v6e = tpu_client.get_accelerator_type(name=f"{sim_parent}/acceleratorTypes/v6e-8")
    assert (v6e.accelerator_configs[0].type_, v6e.accelerator_configs[0].topology) == \
        (tpu_v2.AcceleratorConfig.Type.V6E, "2x4")
    with pytest.raises(gexc.NotFound):
        tpu_client.get_accelerator_type(name=f"{sim_parent}/acceleratorTypes/v4-31")
    versions = {v.version for v in tpu_client.list_runtime_versions(parent=sim_parent)}
    assert {"tpu-ubuntu2204-base", "v2-alpha-tpuv5-lite", "v2-alpha-tpuv6e"} <= versions
    got = tpu_client.get_runtime_version(
        name=f"{sim_parent}/runtimeVersions/tpu-ubuntu2204-base")
    assert got.version == "tpu-ubuntu2204-base"


def test_locations_operations_and_service_identity(tpu_client, sim, sim_parent, make_node):
    zones = {loc.location_id for loc in tpu_client.list_locations(
        request={"name": f"projects/{sim.project}"}).locations}
    assert sim.zone in zones
    assert tpu_client.get_location(request={"name": sim_parent}).location_id == sim.zone
    node = make_node("v4-8")
    ops = list(tpu_client.list_operations(request={"name": sim_parent}).operations)
    created = [op for op in ops if node.name in op.metadata.value.decode(errors="ignore")]
    assert created and all(op.done for op in created)
    again = tpu_client.get_operation(request={"name": created[0].name})
    assert again.name == created[0].name and again.done
    identity = tpu_client.generate_service_identity(request={"parent": sim_parent})
    assert identity.identity.email.endswith("iam.gserviceaccount.com")


def test_create_by_accelerator_config(make_node):
    node = make_node(accelerator_type="", accelerator_config=tpu_v2.AcceleratorConfig(
        type_=tpu_v2.AcceleratorConfig.Type.V5LITE_POD, topology="4x4"))
    assert node.accelerator_type == "v5litepod-16"
    assert len(node.network_endpoints) == 4


def test_queued_resource_multislice_creates_prefixed_slices(tpu_client, sim_parent):
    qr_id = unique_name("qr")
    prefix = unique_name("slice")
    request = QR(
        tpu=QR.Tpu(node_spec=[NodeSpec(
            parent=sim_parent,
            node=tpu_v2.Node(accelerator_type="v4-16", runtime_version="tpu-ubuntu2204-base"),
            multislice_params=NodeSpec.MultisliceParams(node_count=2, node_id_prefix=prefix))]),
        spot=QR.Spot())
    accepted = tpu_client.create_queued_resource(
        parent=sim_parent, queued_resource_id=qr_id, queued_resource=request).result(timeout=30)
    name = f"{sim_parent}/queuedResources/{qr_id}"
    assert accepted.name == name

    def active():
        qr = tpu_client.get_queued_resource(name=name)
        return qr if qr.state.state == tpu_v2.QueuedResourceState.State.ACTIVE else None

    wait_for(active, 60, 0.1, "the queued resource to be ACTIVE")
    slices = [tpu_client.get_node(name=f"{sim_parent}/nodes/{prefix}-{i}") for i in range(2)]
    for node in slices:
        assert node.state == tpu_v2.Node.State.READY
        assert node.queued_resource == name and node.multislice_node
        assert node.scheduling_config.spot
        assert len(node.network_endpoints) == 2
    assert name in [q.name for q in tpu_client.list_queued_resources(parent=sim_parent)]
    with pytest.raises(gexc.BadRequest, match="force"):
        tpu_client.delete_queued_resource(name=name)
    tpu_client.delete_queued_resource(request={"name": name, "force": True}).result(timeout=60)
    with pytest.raises(gexc.NotFound):
        tpu_client.get_queued_resource(name=name)
    for node in slices:
        with pytest.raises(gexc.NotFound):
            tpu_client.get_node(name=node.name)
        assert not port_open(node.network_endpoints[0].ip_address)


def test_queued_resource_single_node_reset(tpu_client, sim_parent):
    qr_id, node_id = unique_name("qr"), unique_name("qn")
    request = QR(tpu=QR.Tpu(node_spec=[NodeSpec(
        parent=sim_parent, node_id=node_id,
        node=tpu_v2.Node(accelerator_type="v5litepod-8", runtime_version="v2-alpha-tpuv5-lite"))]),
        guaranteed=QR.Guaranteed())
    tpu_client.create_queued_resource(parent=sim_parent, queued_resource_id=qr_id,
                                      queued_resource=request).result(timeout=30)
    name = f"{sim_parent}/queuedResources/{qr_id}"
    node_name = f"{sim_parent}/nodes/{node_id}"
    first = wait_node_state(tpu_client, node_name, "READY")
    reset = tpu_client.reset_queued_resource(request={"name": name}).result(timeout=60)
    assert reset.name == name
    second = wait_node_state(tpu_client, node_name, "READY")
    assert second.id != first.id  # a new node from the same spec
    tpu_client.delete_queued_resource(request={"name": name, "force": True}).result(timeout=60)


@pytest.mark.parametrize(("node_id", "node", "match"), [
    ("Bad_Name", {"accelerator_type": "v4-8", "runtime_version": "r"}, "Invalid node id"),
    ("x" * 64, {"accelerator_type": "v4-8", "runtime_version": "r"}, "1-63 characters"),
    ("ok", {"accelerator_type": "v4-31", "runtime_version": "r"}, "is not available in zone"),
    ("ok", {"accelerator_type": "tpu-v6e-8", "runtime_version": "r"}, 'spells it "v6e-8"'),
    ("ok", {"accelerator_type": "v4-8"}, "runtimeVersion is required"),
    ("ok", {"runtime_version": "r"}, "acceleratorType or acceleratorConfig"),
])
def test_invalid_creates_are_bad_requests(tpu_client, sim_parent, node_id, node, match):
    with pytest.raises(gexc.BadRequest, match=match) as caught:
        tpu_client.create_node(parent=sim_parent, node_id=node_id, node=tpu_v2.Node(**node))
    assert caught.value.response.json()["error"]["status"] == "INVALID_ARGUMENT"


def test_duplicate_node_is_already_exists(tpu_client, sim_parent, make_node):
    node = make_node("v4-8")
    with pytest.raises(gexc.Conflict, match="already exists") as caught:
        create_node(tpu_client, sim_parent, node.name.rsplit("/", 1)[1])
    assert caught.value.response.json()["error"]["status"] == "ALREADY_EXISTS"


def test_unknown_node_is_not_found(tpu_client, sim_parent):
    with pytest.raises(gexc.NotFound) as caught:
        tpu_client.get_node(name=f"{sim_parent}/nodes/nope")
    error = caught.value.response.json()["error"]
    assert error == {"code": 404, "status": "NOT_FOUND",
                     "message": f"Resource '{sim_parent}/nodes/nope' was not found"}
