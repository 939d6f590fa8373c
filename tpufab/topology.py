"""Accelerator types -> pod shape (pure; no I/O).

`TYPE-N` counts TensorCores for v2, v3, v4 and v5p (two cores per chip) and chips for
v5litepod (v5e) and v6e (one core per chip). See ../shared/REFERENCE.md.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass

from tpufab.errors import ConfigError


@dataclass(frozen=True)
class Generation:
    name: str
    sizes: tuple[int, ...]          # the valid N of TYPE-N
    cores_per_chip: int
    default_runtime: str
    device_family: str              # "accel" (/dev/accel*) or "vfio" (/dev/vfio/*)
    single_host_max_chips: int      # up to this many chips fit on one host
    aliases: tuple[str, ...] = ()


GENERATIONS: dict[str, Generation] = {
    g.name: g
    for g in (
        Generation("v2", (8, 32, 128, 256, 512), 2, "tpu-ubuntu2204-base", "accel", 4),
        Generation("v3", (8, 32, 64, 128, 256, 512, 1024, 2048), 2, "tpu-ubuntu2204-base",
                   "accel", 4),
        Generation("v4", (8, 16, 32, 64, 128, 256, 512, 1024, 1536, 2048, 4096), 2,
                   "tpu-ubuntu2204-base", "accel", 4),
        Generation("v5litepod", (1, 4, 8, 16, 32, 64, 128, 256), 1, "v2-alpha-tpuv5-lite",
                   "vfio", 8, aliases=("v5e",)),
        Generation("v5p", (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 6144, 8192, 12288),
                   2, "v2-alpha-tpuv5", "vfio", 4),
        Generation("v6e", (1, 4, 8, 16, 32, 64, 128, 256), 1, "v2-alpha-tpuv6e", "vfio", 8),
    )
}

# Every device-file family, whatever the generation: a kill must look at both.
DEVICE_GLOBS = ("/dev/accel*", "/dev/vfio/[0-9]*")

_TYPE_RE = re.compile(r"^(?:tpu-)?(v[0-9a-z]+)-([0-9]+)$")


@dataclass(frozen=True)
class Topology:
    name: str                 # canonical API spelling, e.g. "v4-32"
    generation: str           # "v2", "v3", "v4", "v5litepod", "v5p", "v6e"
    chips: int
    cores: int
    hosts: int
    chips_per_host: int
    default_runtime: str
    device_family: str        # "accel" or "vfio"

    @property
    def device_files(self) -> tuple[str, ...]:
        """The TPU device files on each host of this type."""
        if self.device_family == "accel":
            return tuple(f"/dev/accel{i}" for i in range(self.chips_per_host))
        return tuple(f"/dev/vfio/{i}" for i in range(self.chips_per_host))


def _shape(gen: Generation, size: int) -> Topology:
    chips = size // gen.cores_per_chip
    hosts = 1 if chips <= gen.single_host_max_chips else -(-chips // 4)
    return Topology(
        name=f"{gen.name}-{size}",
        generation=gen.name,
        chips=chips,
        cores=chips * gen.cores_per_chip,
        hosts=hosts,
        chips_per_host=chips // hosts,
        default_runtime=gen.default_runtime,
        device_family=gen.device_family,
    )


def all_accelerator_types() -> list[str]:
    """Every accelerator type tpufab knows, in the API's spelling."""
    return [f"{g.name}-{n}" for g in GENERATIONS.values() for n in g.sizes]


def _generation(name: str) -> Generation | None:
    for gen in GENERATIONS.values():
        if name == gen.name or name in gen.aliases:
            return gen
    return None


def _nearest_sizes(gen: Generation, size: int) -> list[str]:
    if size in gen.sizes:
        return [f"{gen.name}-{size}"]
    ranked = sorted(gen.sizes, key=lambda n: (abs(n - size), n))[:2]
    return [f"{gen.name}-{n}" for n in sorted(ranked)]


def _suggestions(text: str) -> list[str]:
    """The valid types nearest to an invalid one."""
    lowered = text.strip().lower()
    lowered = lowered.removeprefix("tpu-")
    m = re.match(r"^(v[0-9]+[a-z]*)-?([0-9]+)", lowered)
    if m:
        gen = _generation(m.group(1))
        size = int(m.group(2))
        if gen is not None:
            return _nearest_sizes(gen, size)
        same_size = [f"{g.name}-{size}" for g in GENERATIONS.values() if size in g.sizes]
        if same_size:
            return same_size[-3:]
    close = difflib.get_close_matches(lowered, all_accelerator_types(), n=3, cutoff=0.5)
    return close or ["v4-8", "v5p-8", "v6e-8"]


def parse_accelerator_type(text: str) -> Topology:
    """Parse `v4-32`, `tpu-v6e-8`, `v5e-16` ... into a Topology.

    Unknown or malformed types raise ConfigError naming the nearest valid types.
    """
    raw = (text or "").strip()
    m = _TYPE_RE.match(raw.lower())
    gen = _generation(m.group(1)) if m else None
    if m and gen is not None and int(m.group(2)) in gen.sizes:
        return _shape(gen, int(m.group(2)))
    options = _suggestions(raw)
    nearest = " or ".join(options) if len(options) < 3 else (
        ", ".join(options[:-1]) + " or " + options[-1])
    what = f"Unknown TPU accelerator type {raw!r}" if raw else "No TPU accelerator type given"
    raise ConfigError(f"{what}; did you mean {nearest}? (see `tpufab types` for the full list)")
