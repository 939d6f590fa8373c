"""The metadata server's answers and tpu-env as data (no pod needed)."""

from __future__ import annotations

import json

import pytest

from tpufab.flows.babysit.records import notices_in
from tpufab.remote.run_worker import notice_of
from tpufab.sim.guest import host_bounds, tpu_env
from tpufab.sim.metadata import JsonLeaf, lookup, render

NODE = {"name": "projects/p/locations/us-central2-b/nodes/pod", "id": "1234",
        "acceleratorType": "v4-32", "runtimeVersion": "tpu-ubuntu2204-base",
        "acceleratorConfig": {"type": "V4", "topology": "2x2x4"}}


@pytest.mark.parametrize(("topology", "per_host", "hosts", "expected"), [
    ("2x2x4", 4, 4, ("2,2,1", "1,1,4")),     # v4-32
    ("2x2x1", 4, 1, ("2,2,1", "1,1,1")),     # v4-8
    ("4x4", 4, 4, ("2,2,1", "2,2,1")),       # v5litepod-16
    ("2x4", 8, 1, ("2,4,1", "1,1,1")),       # v6e-8
])
def test_host_bounds(topology, per_host, hosts, expected):
    assert host_bounds(topology, per_host, hosts) == expected


def test_tpu_env_lines_are_what_libtpu_and_jax_parse():
    lines = tpu_env(NODE, 2, None).splitlines()
    assert "WORKER_ID: '2'" in lines and "ACCELERATOR_TYPE: 'v4-32'" in lines
    assert "HOST_BOUNDS: '1,1,4'" in lines and "NODE_ID: 'pod'" in lines
    assert not any(line.startswith("MEGASCALE") for line in lines)
    multi = tpu_env(NODE, 0, {"id": 1, "count": 2, "coordinator": "10.0.0.2"}).splitlines()
    assert {"MEGASCALE_COORDINATOR_ADDRESS: '10.0.0.2:8080'", "MEGASCALE_NUM_SLICES: '2'",
            "MEGASCALE_SLICE_ID: '1'", "MEGASCALE_PORT: '8080'"} <= set(multi)


TREE = {"instance": {"attributes": {"a": "1", "tpu-env": "X: 'y'\n"}, "preempted": "FALSE",
                     "network-interfaces": [{"ip": "10.0.0.2"}], "scopes": ["s1", "s2"],
                     "token": lambda: JsonLeaf('{"access_token": "t"}')}}


def test_directories_list_leaves_and_subdirectories_as_gce_does():
    assert render(lookup(TREE, ["instance"]), directory=True, recursive=False, alt="text") == \
        ("application/text", "attributes/\npreempted\nnetwork-interfaces/\nscopes/\ntoken\n")
    assert render(lookup(TREE, ["instance", "network-interfaces"]), directory=True,
                  recursive=False, alt="text")[1] == "0/\n"
    assert lookup(TREE, ["instance", "network-interfaces", "0", "ip"]) == "10.0.0.2"


def test_recursive_answers_are_json_without_minting_tokens():
    kind, body = render(lookup(TREE, ["instance"]), directory=True, recursive=True, alt="text")
    assert kind == "application/json"
    assert json.loads(body)["attributes"] == {"a": "1", "tpu-env": "X: 'y'\n"}
    assert "token" not in json.loads(body)
    assert render(lookup(TREE, ["instance", "token"]), directory=False, recursive=False,
                  alt="text") == ("application/json", '{"access_token": "t"}')
    with pytest.raises(KeyError):
        lookup(TREE, ["instance", "nope"])


def test_notices_the_supervisor_relays():
    assert notice_of("preempted", "FALSE") is None
    assert notice_of("preempted", "TRUE").startswith("preempted:")
    assert notice_of("maintenance-event", "NONE") is None
    assert notice_of("maintenance-event", "TERMINATE_ON_HOST_MAINTENANCE") == \
        "maintenance: TERMINATE_ON_HOST_MAINTENANCE (instance/maintenance-event)"


def test_babysit_finds_the_notice_in_each_workers_log_copy(tmp_path):
    (tmp_path / "w0.log").write_text("step 1\ntpufab: notice: preempted: x; sent SIGTERM to "
                                     "the recipe\nsaved\n")
    (tmp_path / "w1.log").write_text("step 1\n")
    assert notices_in(tmp_path) == {0: "preempted: x; sent SIGTERM to the recipe"}
