"""Fault injection on the simulated pod, and its daemon: each fault's documented behaviour;
nodes survive `down` then `up`."""

from __future__ import annotations

import socket
import subprocess

import pytest
from google.api_core import exceptions as gexc
from google.api_core.client_options import ClientOptions
from google.auth.credentials import AnonymousCredentials
from google.cloud import tpu_v2
from helpers import (
    create_node,
    metadata_keys,
    port_open,
    ssh_run,
    unique_name,
    wait_for,
    wait_node_state,
)

from tpufab.errors import SimError
from tpufab.sim import daemon
from tpufab.sim.admin import SimAdmin

pytestmark = pytest.mark.sim


def client_for(info: daemon.SimInfo) -> tpu_v2.TpuClient:
    return tpu_v2.TpuClient(credentials=AnonymousCredentials(), transport="rest",
                            client_options=ClientOptions(api_endpoint=info.endpoint))


def short(node: tpu_v2.Node) -> str:
    return node.name.rsplit("/", 1)[1]


def test_preempted_node_stops_its_workers_and_stays_until_deleted(
        tpu_client, sim_admin, make_node, sim_parent):
    node = make_node("v4-16")
    ips = [e.ip_address for e in node.network_endpoints]
    shown = sim_admin.preempt(short(node))
    assert shown["state"] == "PREEMPTED"
    assert tpu_client.get_node(name=node.name).state == tpu_v2.Node.State.PREEMPTED
    assert [w["running"] for w in sim_admin.node(short(node))["workers"]] == [False, False]
    assert not any(port_open(ip) for ip in ips)
    assert node.name in [n.name for n in tpu_client.list_nodes(parent=sim_parent)]
    with pytest.raises(gexc.BadRequest, match="only a STOPPED node can be started"):
        tpu_client.start_node(request={"name": node.name})
    with pytest.raises(SimError, match="only a running node can be preempted"):
        sim_admin.preempt(short(node))
    tpu_client.delete_node(name=node.name).result(timeout=60)
    with pytest.raises(gexc.NotFound):
        tpu_client.get_node(name=node.name)


def test_preempting_a_queued_resource_node_suspends_it(tpu_client, sim_admin, sim_parent):
    qr_id, node_id = unique_name("pq"), unique_name("pn")
    spec = tpu_v2.QueuedResource.Tpu.NodeSpec(
        parent=sim_parent, node_id=node_id,
        node=tpu_v2.Node(accelerator_type="v4-8", runtime_version="tpu-ubuntu2204-base"))
    tpu_client.create_queued_resource(
        parent=sim_parent, queued_resource_id=qr_id,
        queued_resource=tpu_v2.QueuedResource(tpu=tpu_v2.QueuedResource.Tpu(node_spec=[spec]),
                                              spot=tpu_v2.QueuedResource.Spot()),
    ).result(timeout=30)
    name = f"{sim_parent}/queuedResources/{qr_id}"
    wait_node_state(tpu_client, f"{sim_parent}/nodes/{node_id}", "READY")
    sim_admin.preempt(node_id)
    state = tpu_client.get_queued_resource(name=name).state
    assert state.state == tpu_v2.QueuedResourceState.State.SUSPENDED
    assert state.state_initiator == tpu_v2.QueuedResourceState.StateInitiator.SERVICE
    tpu_client.delete_queued_resource(request={"name": name, "force": True}).result(timeout=60)


def test_unreachable_worker_refuses_connections_until_reachable(
        sim_admin, make_node, ssh_key):
    node = make_node("v4-16", metadata={"ssh-keys": metadata_keys("carol", ssh_key)})
    ip0, ip1 = (e.ip_address for e in node.network_endpoints)
    sim_admin.set_reachable(short(node), 1, False)
    assert not port_open(ip1)
    assert ssh_run(ip1, ssh_key, "carol", "true").returncode == 255
    assert ssh_run(ip0, ssh_key, "carol", "true").returncode == 0
    sim_admin.set_reachable(short(node), 1, True)
    wait_for(lambda: port_open(ip1), 30, what="worker 1 to listen again")
    result = ssh_run(ip1, ssh_key, "carol", "hostname")
    assert result.returncode == 0 and result.stdout.strip().endswith("-w-1")
    with pytest.raises(SimError, match="out of range"):
        sim_admin.set_reachable(short(node), 2, False)


def test_killed_sshd_ends_sessions_and_comes_back(sim_admin, make_node, ssh_key):
    node = make_node("v4-8", metadata={"ssh-keys": metadata_keys("dave", ssh_key)})
    ip = node.network_endpoints[0].ip_address
    session = subprocess.Popen(
        ["ssh", "-i", str(ssh_key.path), "-o", "BatchMode=yes", "-o", "LogLevel=ERROR",
         "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
         f"dave@{ip}", "echo started; sleep 60"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    try:
        assert session.stdout.readline().strip() == "started"
        sim_admin.kill_sshd(short(node), 0)
        assert session.wait(timeout=15) == 255  # the connection died mid-command
    finally:
        session.kill()
        session.wait()
    wait_for(lambda: port_open(ip), 30, what="a new sshd listener")
    assert ssh_run(ip, ssh_key, "dave", "true").returncode == 0


def test_next_create_fails_with_a_stockout(tpu_client, sim_admin, sim_parent, make_node):
    sim_admin.fail_next_create("stockout")
    node_id = unique_name("so")
    with pytest.raises(gexc.ResourceExhausted, match="There is no more capacity in the zone"):
        create_node(tpu_client, sim_parent, node_id, "v4-8")
    with pytest.raises(gexc.NotFound):
        tpu_client.get_node(name=f"{sim_parent}/nodes/{node_id}")
    assert make_node("v4-8").state == tpu_v2.Node.State.READY  # the fault fired once


def test_quota_failure_immediate_is_http_429(tpu_client, sim_admin, sim_parent):
    sim_admin.fail_next_create("quota", immediate=True)
    with pytest.raises(gexc.TooManyRequests, match="Quota limit 'TPUV4sPodPerProjectPerZone"
                                                   "ForTPUAPI' has been exceeded") as caught:
        tpu_client.create_node(parent=sim_parent, node_id=unique_name("q"), node=tpu_v2.Node(
            accelerator_type="v4-8", runtime_version="tpu-ubuntu2204-base"))
    assert caught.value.response.json()["error"]["status"] == "RESOURCE_EXHAUSTED"


def test_quota_counts_preempted_nodes_until_deleted(tpu_client, sim_admin):
    parent = "projects/quota-project/locations/us-east5-a"  # nothing else lives here
    sim_admin.settings(quota_chips=8)
    first = create_node(tpu_client, parent, unique_name("qa"), "v4-8")  # 4 chips
    sim_admin.preempt(first.name)
    with pytest.raises(gexc.ResourceExhausted, match="Limit: 8 in zone us-east5-a"):
        create_node(tpu_client, parent, unique_name("qb"), "v4-16")  # 4 + 8 > 8
    tpu_client.delete_node(name=first.name).result(timeout=60)
    second = create_node(tpu_client, parent, unique_name("qc"), "v4-16")
    assert second.state == tpu_v2.Node.State.READY
    tpu_client.delete_node(name=second.name).result(timeout=60)


def test_error_burst_then_recovery(tpu_client, sim_admin, make_node):
    node = make_node("v4-8")
    sim_admin.error_burst(2, code=503)
    for _ in range(2):
        with pytest.raises(gexc.ServiceUnavailable, match="currently unavailable"):
            tpu_client.get_node(name=node.name)
    assert tpu_client.get_node(name=node.name).name == node.name
    sim_admin.error_burst(1, code=429, match="/acceleratorTypes")
    assert tpu_client.get_node(name=node.name).name == node.name  # not matched
    parent = node.name.rsplit("/nodes/", 1)[0]
    with pytest.raises(gexc.TooManyRequests, match="Quota exceeded for quota metric"):
        list(tpu_client.list_accelerator_types(parent=parent))
    assert list(tpu_client.list_accelerator_types(parent=parent))


def test_create_delay_knob_shows_creating_first(tpu_client, sim_admin, sim_parent):
    sim_admin.settings(create_delay=1.5)
    node_id = unique_name("slow")
    operation = tpu_client.create_node(parent=sim_parent, node_id=node_id, node=tpu_v2.Node(
        accelerator_type="v4-8", runtime_version="tpu-ubuntu2204-base"))
    creating = tpu_client.get_node(name=f"{sim_parent}/nodes/{node_id}")
    assert creating.state == tpu_v2.Node.State.CREATING
    assert not operation.done()
    assert operation.result(timeout=60).state == tpu_v2.Node.State.READY
    tpu_client.delete_node(name=creating.name).result(timeout=60)


def test_state_survives_daemon_down_and_up(tmp_path, ssh_key):
    state_dir = tmp_path / "pod"
    info = daemon.up(state_dir, port=0)
    try:
        assert daemon.up(state_dir, port=0).pid == info.pid  # idempotent
        assert daemon.up(state_dir).already_running
        client = client_for(info)
        parent = f"projects/{info.project}/locations/{info.zone}"
        node = create_node(client, parent, "keeper", "v4-16",
                           metadata={"ssh-keys": metadata_keys("erin", ssh_key)})
        keys = client.get_guest_attributes(request={"name": node.name}).guest_attributes
        ips = [e.ip_address for e in node.network_endpoints]
        message = daemon.down(state_dir)
        assert "Stopped the simulated pod" in message
        assert not any(port_open(ip) for ip in ips)
        offline = daemon.status(state_dir)
        assert not offline.running
        assert [(n["name"], n["state"]) for n in offline.nodes] == [(node.name, "READY")]
        assert "not running" in daemon.down(state_dir)

        info = daemon.up(state_dir, port=0)
        assert not info.already_running
        client = client_for(info)
        again = client.get_node(name=node.name)
        assert (again.id, again.state, [e.ip_address for e in again.network_endpoints]) == \
            (node.id, tpu_v2.Node.State.READY, ips)
        assert client.get_guest_attributes(request={"name": node.name}).guest_attributes == keys
        result = ssh_run(ips[1], ssh_key, "erin", "hostname")
        assert result.returncode == 0, result.stderr
        assert daemon.status(state_dir).running
        client.delete_node(name=node.name).result(timeout=60)
    finally:
        daemon.down(state_dir)
    assert daemon.status(state_dir).nodes == []


def test_up_says_when_the_port_is_taken(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(SimError, match=f"Port {port} on 127.0.0.1 is not available"):
            daemon.up(tmp_path / "pod", port=port)


def test_up_names_the_pod_that_holds_the_port(tmp_path, sim):
    with pytest.raises(SimError, match=f"used by another simulated pod \\(state dir "
                                       f"{sim.state_dir}\\)"):
        daemon.up(tmp_path / "other", port=sim.port)


def test_up_needs_root(tmp_path, monkeypatch):
    monkeypatch.setattr(daemon.os, "geteuid", lambda: 1000)
    with pytest.raises(SimError, match="needs root"):
        daemon.up(tmp_path / "pod", port=0)


def test_admin_reports_unknown_nodes_and_bad_faults(sim_admin):
    with pytest.raises(SimError, match="was not found"):
        sim_admin.preempt("no-such-node")
    with pytest.raises(SimError, match='reason must be "stockout" or "quota"'):
        sim_admin.fail_next_create("meteor")
    with pytest.raises(SimError, match="code must be 503 or 429"):
        sim_admin.error_burst(1, code=500)
    unreachable = SimAdmin("http://127.0.0.1:9")
    with pytest.raises(SimError, match="does not answer"):
        unreachable.health()
