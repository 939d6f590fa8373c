"""create --topology: validated before any API call, sent as acceleratorConfig, reported back."""

from __future__ import annotations

import io

import pytest
from helpers import unique_name
from rich.console import Console

from tpufab.cloud import lifecycle
from tpufab.cloud.bodies import node_body, queued_resource_body
from tpufab.config import load_settings
from tpufab.errors import ConfigError
from tpufab.sim._model import ApiFailure, accelerator_type_of
from tpufab.views import nodes as node_views


def quiet() -> Console:
    return Console(file=io.StringIO(), width=200, soft_wrap=True, highlight=False)


def settings(tmp_path, **flags):
    base = {"project": "p", "zone": "us-central2-b", "name": "t",
            "ssh_key": str(tmp_path / "keys" / "tpufab_ed25519"), "ssh_user": "alice"}
    return load_settings({**base, **flags}, cwd=tmp_path, env={})


def test_node_body_asks_for_accelerator_config_instead_of_a_type(tmp_path):
    body = node_body(settings(tmp_path, type="v4-512"), chip_topology="4x4x16")
    assert "accelerator_type" not in body
    assert body["accelerator_config"] == {"type_": "V4", "topology": "4x4x16"}
    plain = node_body(settings(tmp_path, type="v4-512"))
    assert plain["accelerator_type"] == "v4-512" and "accelerator_config" not in plain
    qr = queued_resource_body(settings(tmp_path, type="v6e-16", spot=True), chip_topology="4x4")
    assert qr["tpu"]["node_spec"][0]["node"]["accelerator_config"] == {"type_": "V6E",
                                                                       "topology": "4x4"}


@pytest.mark.parametrize("type_,topology,said", [
    ("v4-128", "4x4x8", "is 128 chips, but v4-128 has 64"),
    ("v4-256", "2x8x8", "valid shapes for v4-256: 4x4x8"),
    ("v3-32", "4x4", "--topology is for v4, v5p, v5e (v5litepod), v6e and TPU7x"),
])
def test_bad_topology_is_refused_before_any_api_call(tmp_path, type_, topology, said):
    # nothing listens on this endpoint: reaching the API would be a different error
    s = settings(tmp_path, type=type_, name="t", api_endpoint="http://127.0.0.1:9")
    with pytest.raises(ConfigError) as info:
        lifecycle.create(s, topology=topology, console=quiet())
    assert said in str(info.value)


def test_emulator_takes_valid_configs_and_refuses_the_rest():
    assert accelerator_type_of({"acceleratorConfig": {"type": "V4", "topology": "4x4x16"}},
                               "z").name == "v4-512"
    assert accelerator_type_of({"acceleratorConfig": {"type": "V5P", "topology": "2x4x4"}},
                               "z").name == "v5p-64"
    with pytest.raises(ApiFailure) as info:
        accelerator_type_of({"acceleratorConfig": {"type": "V4", "topology": "2x8x8"}}, "z")
    assert "valid shapes for v4-256: 4x4x8" in str(info.value)


@pytest.mark.sim
def test_create_with_topology_on_the_simulated_pod(sim, tmp_path, tpu_client):
    name = unique_name("topo")
    s = load_settings({"api_endpoint": sim.endpoint, "project": sim.project, "zone": sim.zone,
                       "ssh_key": str(tmp_path / "keys" / "tpufab_ed25519"),
                       "ssh_user": "alice", "name": name, "type": "v4-32",
                       "wait_timeout": 120}, cwd=tmp_path, env={})
    console = quiet()
    try:
        [node] = lifecycle.create(s, topology="2x2x4", console=console)
        assert f"Creating TPU node {name} (v4-32 as 2x2x4, 4 hosts" in console.file.getvalue()
        assert node.accelerator_type == "v4-32" and node.chip_topology == "2x2x4"
        proto = tpu_client.get_node(name=f"projects/{sim.project}/locations/{sim.zone}/"
                                         f"nodes/{name}")
        assert proto.accelerator_config.topology == "2x2x4"
        assert proto.accelerator_config.type_.name == "V4"
        shown = quiet()
        shown.print(node_views.details_table(lifecycle.describe(s)))
        assert any(line.split()[:2] == ["topology", "2x2x4"]
                   for line in shown.file.getvalue().splitlines())
        # asking again for the same shape is a no-op
        again = quiet()
        lifecycle.create(s, topology="2x2x4", console=again)
        assert "already exists and is READY" in again.file.getvalue()
    finally:
        lifecycle.delete(s, yes=True, console=quiet())
