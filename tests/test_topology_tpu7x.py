"""TPU7x (Ironwood) and the Compute Engine machine types (pure; docs/topology.md cites the
sources: Google's TPU7x and "TPUs on Compute Engine" pages, xpk's system_characteristics)."""

from __future__ import annotations

import pytest

from tpufab.errors import ConfigError
from tpufab.topology import all_accelerator_types, parse_accelerator_type, slice_shape


@pytest.mark.parametrize("name,dims,chips,vms,machine,cubes,wraps", [
    ("tpu7x-2", (1, 1, 1), 1, 1, "tpu7x-standard-1t", 0, ""),
    ("tpu7x-8", (2, 2, 1), 4, 1, "tpu7x-standard-4t", 0, ""),
    ("tpu7x-16", (2, 2, 2), 8, 2, "tpu7x-standard-4t", 0, ""),
    ("tpu7x-32", (2, 2, 4), 16, 4, "tpu7x-standard-4t", 0, ""),
    ("tpu7x-64", (2, 4, 4), 32, 8, "tpu7x-standard-4t", 0, ""),
    ("tpu7x-128", (4, 4, 4), 64, 16, "tpu7x-standard-4t", 1, "xyz"),
    ("tpu7x-256", (4, 4, 8), 128, 32, "tpu7x-standard-4t", 2, "xyz"),
    ("tpu7x-1024", (8, 8, 8), 512, 128, "tpu7x-standard-4t", 8, "xyz"),
    # the largest slice: 144 cubes, 9,216 chips, 2,304 VMs
    ("tpu7x-18432", (16, 24, 24), 9216, 2304, "tpu7x-standard-4t", 144, "xyz"),
])
def test_tpu7x_shapes(name, dims, chips, vms, machine, cubes, wraps):
    shape = slice_shape(name)
    topo = shape.topology
    assert (shape.dims, topo.chips, topo.hosts, topo.machine_type) == (dims, chips, vms, machine)
    assert topo.cores == 2 * chips and shape.jax_device_count == chips
    assert shape.cubes == cubes and shape.wrap_axes == wraps
    assert topo.planes == ("compute",)  # TPU7x exists only on Compute Engine
    assert shape.to_json()["machine_type"] == machine


@pytest.mark.parametrize("spelling", ["tpu7x-128", "v7x-128", "TPU7X-128", "tpu7-128"])
def test_tpu7x_spellings(spelling):
    assert parse_accelerator_type(spelling).name == "tpu7x-128"


def test_machine_types_and_control_planes_of_every_generation():
    planes = {parse_accelerator_type(t).generation: parse_accelerator_type(t).planes
              for t in all_accelerator_types()}
    assert planes["v4"] == ("tpu",) and planes["v5litepod"] == ("tpu",)
    assert planes["v5p"] == planes["v6e"] == ("tpu", "compute")
    assert parse_accelerator_type("v5p-128").machine_type == "ct5p-hightpu-4t"
    assert parse_accelerator_type("v6e-1").machine_type == "ct6e-standard-1t"
    assert parse_accelerator_type("v6e-8").machine_type == "ct6e-standard-8t"
    assert parse_accelerator_type("v6e-16").machine_type == "ct6e-standard-4t"
    assert parse_accelerator_type("v4-32").machine_type is None
    assert "tpu7x-128" not in all_accelerator_types("tpu")
    assert "tpu7x-128" in all_accelerator_types("compute")
    assert "v4-8" not in all_accelerator_types("compute")


@pytest.mark.parametrize("name,topology,fragment", [
    ("tpu7x-128", "2x4x8", "whole 4x4x4 cubes"),
    ("tpu7x-256", "8x4x4", "ascending order; write --topology 4x4x8"),
    ("tpu7x-128", "4x4x8", "is 128 chips, but tpu7x-128 has 64"),
    ("tpu7x-32", "1x4x4", "valid shapes for tpu7x-32: 2x2x4"),
])
def test_tpu7x_topology_refused_in_one_sentence(name, topology, fragment):
    with pytest.raises(ConfigError) as err:
        slice_shape(name, topology)
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_a_custom_tpu7x_shape_of_whole_cubes():
    shape = slice_shape("tpu7x-512", "4x4x16")
    assert shape.custom and shape.cubes == 4 and shape.topology.hosts == 64


@pytest.mark.parametrize("bad,nearest", [("tpu7x-100", "tpu7x-64 or tpu7x-128"),
                                         ("tpu7x-20000", "tpu7x-18432")])
def test_a_tpu7x_size_that_does_not_exist_names_the_nearest(bad, nearest):
    with pytest.raises(ConfigError, match=nearest):
        parse_accelerator_type(bad)


def test_the_tpu_api_emulator_offers_no_tpu7x():
    from tpufab.sim._model import ApiFailure, accelerator_type_of, accelerator_types

    assert "tpu7x-8" not in accelerator_types() and "v6e-8" in accelerator_types()
    with pytest.raises(ApiFailure, match="not available in zone"):
        accelerator_type_of({"acceleratorType": "tpu7x-8"}, "us-central1-a")


def test_create_of_a_tpu7x_type_on_the_tpu_api_is_one_sentence_before_any_api_call(tmp_path):
    import os
    import subprocess

    from helpers import TPUFAB

    env = {k: v for k, v in os.environ.items() if not k.startswith("TPUFAB_")}
    env.update(HOME=str(tmp_path), TPUFAB_API_ENDPOINT="http://127.0.0.1:9",  # nothing there
               TPUFAB_USER_CONFIG=str(tmp_path / "none.yaml"))
    result = subprocess.run([TPUFAB, "create", "--type", "tpu7x-128", "--name", "x", "--project",
                             "p", "--zone", "us-central1-a", "--on", "tpu"], env=env,
                            cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    message = result.stderr.strip()
    assert "\n" not in message and "offered only through Compute Engine" in message
    assert "tpu7x-standard-4t" in message


def test_the_topology_command_shows_the_largest_slice(tmp_path):
    import os

    from helpers import ok, tpufab

    env = {k: v for k, v in os.environ.items() if not k.startswith("TPUFAB_")}
    env.update(HOME=str(tmp_path), TPUFAB_USER_CONFIG=str(tmp_path / "none.yaml"),
               COLUMNS="120")
    out = ok(tpufab("topology", "tpu7x-18432", env=env, cwd=tmp_path, timeout=120))
    assert "tpu7x-18432: 16x24x24 chips" in out
    assert "144 (4x4x4 chips each)" in out and "hosts:              2304" in out
    assert "chips:              9216" in out and "Compute Engine (machine type " \
        "tpu7x-standard-4t)" in out
