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
