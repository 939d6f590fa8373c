"""Table-driven tests for accelerator type parsing (the whole REFERENCE.md table)."""

import pytest

from tpufab.errors import ConfigError
from tpufab.topology import all_accelerator_types, parse_accelerator_type

# (type, chips, cores, hosts, chips/host, runtime, first device file)
TABLE = [
    ("v2-8", 4, 8, 1, 4, "tpu-ubuntu2204-base", "/dev/accel0"),
    ("v2-32", 16, 32, 4, 4, "tpu-ubuntu2204-base", "/dev/accel0"),
    ("v2-512", 256, 512, 64, 4, "tpu-ubuntu2204-base", "/dev/accel0"),
    ("v3-8", 4, 8, 1, 4, "tpu-ubuntu2204-base", "/dev/accel0"),
    ("v3-2048", 1024, 2048, 256, 4, "tpu-ubuntu2204-base", "/dev/accel0"),
    ("v4-8", 4, 8, 1, 4, "tpu-ubuntu2204-base", "/dev/accel0"),
    ("v4-16", 8, 16, 2, 4, "tpu-ubuntu2204-base", "/dev/accel0"),
    ("v4-32", 16, 32, 4, 4, "tpu-ubuntu2204-base", "/dev/accel0"),
    ("v4-512", 256, 512, 64, 4, "tpu-ubuntu2204-base", "/dev/accel0"),
    ("v4-4096", 2048, 4096, 512, 4, "tpu-ubuntu2204-base", "/dev/accel0"),
    ("v5litepod-1", 1, 1, 1, 1, "v2-alpha-tpuv5-lite", "/dev/vfio/0"),
    ("v5litepod-4", 4, 4, 1, 4, "v2-alpha-tpuv5-lite", "/dev/vfio/0"),
    ("v5litepod-8", 8, 8, 1, 8, "v2-alpha-tpuv5-lite", "/dev/vfio/0"),
    ("v5litepod-16", 16, 16, 4, 4, "v2-alpha-tpuv5-lite", "/dev/vfio/0"),
    ("v5litepod-256", 256, 256, 64, 4, "v2-alpha-tpuv5-lite", "/dev/vfio/0"),
    ("v5p-8", 4, 8, 1, 4, "v2-alpha-tpuv5", "/dev/vfio/0"),
    ("v5p-128", 64, 128, 16, 4, "v2-alpha-tpuv5", "/dev/vfio/0"),
    ("v5p-12288", 6144, 12288, 1536, 4, "v2-alpha-tpuv5", "/dev/vfio/0"),
    ("v6e-1", 1, 1, 1, 1, "v2-alpha-tpuv6e", "/dev/vfio/0"),
    ("v6e-4", 4, 4, 1, 4, "v2-alpha-tpuv6e", "/dev/vfio/0"),
    ("v6e-8", 8, 8, 1, 8, "v2-alpha-tpuv6e", "/dev/vfio/0"),
    ("v6e-16", 16, 16, 4, 4, "v2-alpha-tpuv6e", "/dev/vfio/0"),
    ("v6e-256", 256, 256, 64, 4, "v2-alpha-tpuv6e", "/dev/vfio/0"),
]


@pytest.mark.parametrize("name,chips,cores,hosts,per_host,runtime,device", TABLE)
def test_table(name, chips, cores, hosts, per_host, runtime, device):
    for spelling in (name, f"tpu-{name}", name.upper()):
        topo = parse_accelerator_type(spelling)
        assert topo.name == name
        assert (topo.chips, topo.cores, topo.hosts, topo.chips_per_host) == (
            chips, cores, hosts, per_host)
        assert topo.default_runtime == runtime
        assert topo.device_files[0] == device
        assert len(topo.device_files) == per_host


def test_every_known_type_is_consistent():
    for name in all_accelerator_types():
        topo = parse_accelerator_type(name)
        assert topo.hosts * topo.chips_per_host == topo.chips
        assert topo.name == name
        family = "/dev/accel" if topo.generation in ("v2", "v3", "v4") else "/dev/vfio/"
        assert all(f.startswith(family) for f in topo.device_files)


def test_v5e_alias():
    assert parse_accelerator_type("v5e-16").name == "v5litepod-16"


@pytest.mark.parametrize("bad,suggested", [
    ("v4-7", ["v4-8"]),
    ("v9-8", ["v5p-8", "v6e-8"]),
    ("v4-512x", ["v4-512"]),
    ("tpu-v6e-12", ["v6e-8", "v6e-16"]),
    ("", ["v4-8"]),
    ("banana", []),
])
def test_bad_types_name_nearest(bad, suggested):
    with pytest.raises(ConfigError) as info:
        parse_accelerator_type(bad)
    message = str(info.value)
    assert "did you mean" in message
    assert "\n" not in message
    for s in suggested:
        assert s in message


# ---------------------------------------------------------------------------------------------
# physical shapes, custom topologies, model-parallel submeshes

from tpufab.topology import check_topology, slice_shape, submeshes  # noqa: E402

# (type, chip shape, host block, host grid, jax.device_count(), wraparound axes)
SHAPES = [
    ("v2-8", "2x2", (2, 2), (1, 1), 8, ""),
    ("v2-32", "4x4", (2, 2), (2, 2), 32, ""),
    ("v2-512", "16x16", (2, 2), (8, 8), 512, "xy"),
    ("v3-8", "2x2", (2, 2), (1, 1), 8, ""),
    ("v3-64", "4x8", (2, 2), (2, 4), 64, ""),
    ("v3-2048", "32x32", (2, 2), (16, 16), 2048, "xy"),
    ("v4-8", "2x2x1", (2, 2, 1), (1, 1, 1), 4, ""),
    ("v4-16", "2x2x2", (2, 2, 1), (1, 1, 2), 8, ""),
    ("v4-32", "2x2x4", (2, 2, 1), (1, 1, 4), 16, ""),
    ("v4-64", "2x4x4", (2, 2, 1), (1, 2, 4), 32, ""),
    ("v4-128", "4x4x4", (2, 2, 1), (2, 2, 4), 64, "xyz"),
    ("v4-512", "4x8x8", (2, 2, 1), (2, 4, 8), 256, "xyz"),
    ("v4-1536", "8x8x12", (2, 2, 1), (4, 4, 12), 768, "xyz"),
    ("v4-4096", "8x16x16", (2, 2, 1), (4, 8, 16), 2048, "xyz"),
    ("v5litepod-1", "1x1", (1, 1), (1, 1), 1, ""),
    ("v5litepod-8", "2x4", (2, 4), (1, 1), 8, ""),
    ("v5litepod-16", "4x4", (2, 2), (2, 2), 16, ""),
    ("v5litepod-256", "16x16", (2, 2), (8, 8), 256, "xy"),
    ("v5p-8", "2x2x1", (2, 2, 1), (1, 1, 1), 4, ""),
    ("v5p-64", "2x4x4", (2, 2, 1), (1, 2, 4), 32, ""),
    ("v5p-128", "4x4x4", (2, 2, 1), (2, 2, 4), 64, "xyz"),
    ("v5p-2048", "8x8x16", (2, 2, 1), (4, 4, 16), 1024, "xyz"),
    ("v5p-12288", "16x16x24", (2, 2, 1), (8, 8, 24), 6144, "xyz"),
    ("v6e-1", "1x1", (1, 1), (1, 1), 1, ""),
    ("v6e-4", "2x2", (2, 2), (1, 1), 4, ""),
    ("v6e-8", "2x4", (2, 4), (1, 1), 8, ""),
    ("v6e-16", "4x4", (2, 2), (2, 2), 16, ""),
    ("v6e-256", "16x16", (2, 2), (8, 8), 256, "xy"),
]


@pytest.mark.parametrize("name,dims,block,grid,devices,wraps", SHAPES)
def test_physical_shapes(name, dims, block, grid, devices, wraps):
    shape = slice_shape(name)
    assert (shape.text, shape.host_block, shape.host_grid) == (dims, block, grid)
    assert shape.jax_device_count == devices and shape.wrap_axes == wraps
    topo = parse_accelerator_type(name)
    assert _product(shape.host_grid) == topo.hosts
    assert _product(shape.dims) == topo.chips and not shape.custom


def _product(values):
    out = 1
    for v in values:
        out *= v
    return out


def test_every_type_has_a_shape_its_hosts_tile():
    for name in all_accelerator_types():
        shape = slice_shape(name)
        topo = shape.topology
        assert _product(shape.dims) == topo.chips, name
        assert _product(shape.host_grid) == topo.hosts, name
        assert _product(shape.host_block) == topo.chips_per_host, name
        per_device = 2 if topo.generation in ("v2", "v3") else 1
        assert shape.jax_device_count == topo.chips * per_device, name


def test_seed_v4_512():
    shape = slice_shape("v4-512")
    assert shape.text == "4x8x8" and shape.topology.hosts == 64
    assert shape.jax_device_count == 256 and shape.twisted
    ranked = [s.t5x for s in submeshes(shape, 16)]
    assert ranked[0] == (4, 2, 2, 1)
    assert ranked.index((4, 2, 2, 1)) < ranked.index((2, 2, 4, 1))
    best = submeshes(shape, 16)[0]
    assert best.mesh_shape == (16, 16) and best.whole_wrapping_axes == 1
    assert best.hosts_per_tile == 4 and not best.direct_mesh


@pytest.mark.parametrize("name,m,best", [
    ("v4-32", 2, (2, 1, 1, 1)),        # t5x's default_mesh picks the same on 2x2x4
    ("v4-32", 4, (2, 2, 1, 1)),        # one host
    ("v3-32", 2, (1, 1, 1, 2)),        # both cores of a chip first, as t5x advises
    ("v3-32", 8, (2, 2, 1, 2)),        # one host (t5x's default too)
    ("v6e-256", 16, (16, 1, 1, 1)),    # a whole wrapping axis of the 16x16 torus
    ("v4-128", 64, (4, 4, 4, 1)),
])
def test_best_submesh(name, m, best):
    assert submeshes(slice_shape(name), m)[0].t5x == best


def test_submeshes_realise_contiguous_tiles():
    np = pytest.importorskip("numpy")
    for name, m in (("v4-512", 16), ("v4-32", 4), ("v3-32", 8), ("v6e-256", 32)):
        shape = slice_shape(name)
        for sub in submeshes(shape, m):
            bounds = shape.dims + ((shape.core_axis,) if shape.core_axis > 1 else ())
            coords = np.array(list(np.ndindex(*bounds))).reshape(*bounds, len(bounds))
            reshape, transpose = sub.reshape_recipe()
            mesh = coords.reshape(*reshape, len(bounds)).transpose(*transpose, len(reshape)) \
                .reshape(*sub.mesh_shape, len(bounds))
            for row in mesh:                      # one model-parallel group per row
                lo, hi = row.min(axis=0), row.max(axis=0)
                assert tuple(hi - lo + 1) == sub.tile and len({tuple(c) for c in row}) == m


def test_model_parallel_that_does_not_tile_is_refused():
    with pytest.raises(ConfigError) as info:
        submeshes(slice_shape("v4-512"), 3)
    assert "does not divide the 256 JAX devices of v4-512" in str(info.value)
    assert "16" in str(info.value)


@pytest.mark.parametrize("name,topology,custom", [
    ("v4-128", "4x4x4", False),
    ("v4-512", "4x4x16", True),
    ("v4-512", "4x8x8", False),
    ("v5p-256", "4x4x8", False),
    ("v4-32", "2x2x4", False),
    ("v6e-16", "4x4", False),
])
def test_custom_topologies_accepted(name, topology, custom):
    shape = slice_shape(name, topology)
    assert shape.text == topology and shape.custom is custom
    assert _product(shape.host_grid) == shape.topology.hosts


@pytest.mark.parametrize("name,topology,said", [
    ("v4-128", "4x4x8", "is 128 chips, but v4-128 has 64; valid shapes for v4-128: 4x4x4"),
    ("v4-256", "2x8x8", "all be at most 4 or all be multiples of 4); valid shapes for v4-256: "
                        "4x4x8"),
    ("v4-512", "8x4x8", "ascending order; write --topology 4x8x8"),
    ("v4-32", "4x4", "has 2 dimensions, but v4 slices are 3D"),
    ("v6e-16", "2x8", "v5e and v6e have no custom shapes); valid shapes for v6e-16: 4x4"),
    ("v3-32", "4x4", "--topology is for v4, v5p, v5e (v5litepod), v6e and TPU7x"),
    ("v4-128", "4by4", "is not a chip shape; write it AxBxC"),
])
def test_custom_topologies_refused_in_one_sentence(name, topology, said):
    with pytest.raises(ConfigError) as info:
        slice_shape(name, topology)
    assert said in str(info.value) and "\n" not in str(info.value)


def test_check_topology_lists_every_valid_shape():
    with pytest.raises(ConfigError) as info:
        check_topology(parse_accelerator_type("v4-512"), (2, 8, 16))
    assert "4x8x8, 4x4x16" in str(info.value)


def test_topology_report_reads_as_the_user_sees_it(capsys):
    from tpufab.verbs.nodes import topology

    topology("v4-512", model_parallel=16, limit=3)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == ("v4-512: 4x8x8 chips, 3D, wraparound (torus) on x, y, z; a twisted "
                      "torus can be asked for")
    assert "  hosts:              64 (2x4x8 hosts of 2x2x1 chips each)" in out
    assert "  jax.device_count(): 256 (one per chip, megacore); jax.process_count(): 64" in out
    rows = [line.split() for line in out if line.startswith("  1 ") or line.startswith("  2 ")]
    assert rows[0][:5] == ["1", "(4,", "2,", "2,", "1)"]
    assert "  ... 7 more (--limit N, or --json for all)" in out
    assert "In t5x: model_parallel_submesh=(4, 2, 2, 1)." in out


@pytest.mark.parametrize("name,m,t5x_default", [
    ("v3-32", 2, (1, 1, 1, 2)), ("v3-32", 4, (2, 1, 1, 2)), ("v3-32", 8, (2, 2, 1, 2)),
    ("v3-32", 16, (4, 2, 1, 2)), ("v4-128", 4, (4, 1, 1, 1)), ("v4-128", 8, (4, 2, 1, 1)),
    ("v4-128", 16, (4, 4, 1, 1)),
])
def test_rank_one_agrees_with_t5x_defaults_where_the_docs_say_so(name, m, t5x_default):
    assert submeshes(slice_shape(name), m)[0].t5x == t5x_default
