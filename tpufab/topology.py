"""Accelerator types -> pod shape (pure; no I/O).

`TYPE-N` counts TensorCores for v2, v3, v4, v5p and TPU7x (two cores per chip) and chips for
v5litepod (v5e) and v6e (one core per chip). See ../shared/REFERENCE.md and docs/topology.md.

Which control plane offers a type: the Cloud TPU API ("tpu": v2 to v6e) and Compute Engine
("compute": v5p, v6e and TPU7x, as VM instances of a TPU machine type; TPU7x and later only
there). ``Topology.machine_type`` is the Compute Engine machine type of one host.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field

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
    planes: tuple[str, ...] = ("tpu",)          # control planes that offer it
    machine_types: tuple[tuple[int, str], ...] = ()  # (chips per host, Compute Engine type)


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
                   2, "v2-alpha-tpuv5", "vfio", 4, planes=("tpu", "compute"),
                   machine_types=((4, "ct5p-hightpu-4t"),)),
        Generation("v6e", (1, 4, 8, 16, 32, 64, 128, 256), 1, "v2-alpha-tpuv6e", "vfio", 8,
                   planes=("tpu", "compute"),
                   machine_types=((1, "ct6e-standard-1t"), (4, "ct6e-standard-4t"),
                                  (8, "ct6e-standard-8t"))),
        # TPU7x (Ironwood): Compute Engine only. N counts TensorCores (2 per chip), as xpk and
        # GKE write it: tpu7x-8 is one 4-chip VM, tpu7x-128 one 4x4x4 cube of 16 VMs, up to
        # 144 cubes (tpu7x-18432: 9,216 chips, 2,304 VMs). The boot image is the VM's, so there
        # is no runtime version.
        Generation("tpu7x", (2, 8, 16, 32, 64, *(128 * k for k in range(1, 145))), 2, "",
                   "vfio", 4, planes=("compute",),
                   machine_types=((1, "tpu7x-standard-1t"), (4, "tpu7x-standard-4t"))),
    )
}
CONTROL_PLANES = {"tpu": "the Cloud TPU API", "compute": "Compute Engine"}
MAX_TPU7X_CUBES = 144

# Every device-file family, whatever the generation: a kill must look at both.
DEVICE_GLOBS = ("/dev/accel*", "/dev/vfio/[0-9]*")

_TYPE_RE = re.compile(r"^(?:tpu-)?(v[0-9a-z]+|tpu7x?)-([0-9]+)$")


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
    planes: tuple[str, ...] = ("tpu",)   # control planes that offer it ("tpu", "compute")
    machine_type: str | None = None      # Compute Engine machine type of one host

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
        planes=gen.planes,
        machine_type=dict(gen.machine_types).get(chips // hosts),
    )


def all_accelerator_types(plane: str | None = None) -> list[str]:
    """Every accelerator type tpufab knows (that ``plane`` offers), in the API's spelling."""
    return [f"{g.name}-{n}" for g in GENERATIONS.values() for n in g.sizes
            if plane is None or plane in g.planes]


def _generation(name: str) -> Generation | None:
    for gen in GENERATIONS.values():
        if name == gen.name or name in gen.aliases:
            return gen
    if name in ("tpu7", "v7x", "v7"):   # how people write Ironwood; the API says tpu7x
        return GENERATIONS["tpu7x"]
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
    m = re.match(r"^(v[0-9]+[a-z]*|tpu7x?)-?([0-9]+)", lowered)
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


# ---------------------------------------------------------------------------------------------
# The physical shape of a slice, custom topologies, model-parallel submeshes (pure).
# Rules and sources: docs/topology.md.

THREE_D = ("v4", "v5p", "tpu7x")  # 3D chip meshes (tori once made of whole 4x4x4 cubes)
# generations that take a shape (TPU API acceleratorConfig; TPU7x: the workload policy's
# accelerator topology on Compute Engine)
CUSTOM_TOPOLOGY = ("v4", "v5p", "v5litepod", "v6e", "tpu7x")
TPU7X_SMALL = ((1, 1, 1), (2, 2, 1), (2, 2, 2), (2, 2, 4), (2, 4, 4))
AXES = "xyz"
# 2D generations whose full pod is a 2D torus: (pod shape).
FULL_POD_2D = {"v2": (16, 16), "v3": (32, 32), "v5litepod": (16, 16), "v6e": (16, 16)}
# acceleratorConfig.type of each generation that takes a custom topology (Cloud TPU API v2).
ACCELERATOR_CONFIG_TYPE = {"v4": "V4", "v5p": "V5P", "v5litepod": "V5LITE_POD", "v6e": "V6E"}


def _prod(values) -> int:
    out = 1
    for v in values:
        out *= v
    return out


def format_dims(dims: tuple[int, ...]) -> str:
    return "x".join(str(d) for d in dims)


def parse_topology_text(text: str) -> tuple[int, ...]:
    """``"4x4x8"`` -> (4, 4, 8); anything else is one sentence saying how to write it."""
    raw = (text or "").strip().lower()
    parts = raw.split("x")
    if not raw or not all(p.isdigit() and 0 < int(p) < 100000 for p in parts) or len(parts) > 3:
        raise ConfigError(f"--topology {text!r} is not a chip shape; write it AxBxC (v4, v5p) "
                          "or AxB (v5e, v6e), e.g. --topology 4x4x8.")
    return tuple(int(p) for p in parts)


def _three_d_ok(dims: tuple[int, ...], generation: str = "v4") -> bool:
    """v4/v5p shapes the API takes: 2x2x1 (one host), else A<=B<=C, all <= 4 or all multiples
    of 4; TPU7x: 1x1x1, 2x2x1, 2x2x2, 2x2x4, 2x4x4, else whole 4x4x4 cubes, A<=B<=C, at most
    144 of them (docs/topology.md)."""
    if generation == "tpu7x":
        return dims in TPU7X_SMALL or (
            len(dims) == 3 and list(dims) == sorted(dims) and all(d % 4 == 0 for d in dims)
            and _prod(dims) // 64 <= MAX_TPU7X_CUBES)
    if dims == (2, 2, 1):
        return True
    if len(dims) != 3 or list(dims) != sorted(dims) or dims[0] < 2:
        return False
    return all(d <= 4 for d in dims) or all(d % 4 == 0 for d in dims)


def _doubling_dims(chips: int, rank: int) -> tuple[int, ...] | None:
    dims = [1] * rank
    while _prod(dims) < chips:
        smallest = min(dims)
        dims[max(i for i, d in enumerate(dims) if d == smallest)] *= 2
    return tuple(dims) if _prod(dims) == chips else None


def valid_topologies(topo: Topology) -> list[tuple[int, ...]]:
    """Every chip shape the API takes for ``topo``'s chip count, most cube-like first."""
    if topo.generation not in THREE_D:
        dims = _doubling_dims(topo.chips, 2)
        return [dims] if dims else []
    if topo.chips in (1, 4):
        return [(2, 2, 1)] if topo.chips == 4 else [(1, 1, 1)]
    found = []
    n = topo.chips
    for a in range(1, n + 1):
        if n % a or a * a * a > n:
            continue
        for b in range(a, n // a + 1):
            if (n // a) % b:
                continue
            c = n // a // b
            if c >= b and _three_d_ok((a, b, c), topo.generation):
                found.append((a, b, c))
    return sorted(found, key=lambda d: (d[-1] / d[0], sum(d), d))


def default_dims(topo: Topology) -> tuple[int, ...]:
    """The chip shape a type gets without --topology: the most cube-like valid shape."""
    shapes = valid_topologies(topo)
    if shapes:
        return shapes[0]
    return _doubling_dims(topo.chips, 3 if topo.generation in THREE_D else 2) or (topo.chips, 1)


def _shape_list(shapes: list[tuple[int, ...]], limit: int = 6) -> str:
    texts = [format_dims(s) for s in shapes[:limit]]
    more = f" (and {len(shapes) - limit} more)" if len(shapes) > limit else ""
    return (", ".join(texts) or "none") + more


def check_topology(topo: Topology, dims: tuple[int, ...]) -> tuple[int, ...]:
    """``dims`` if the API takes it for ``topo``; else one sentence naming the valid shapes."""
    valid = valid_topologies(topo)
    if topo.generation not in CUSTOM_TOPOLOGY:
        raise ConfigError(f"--topology is for v4, v5p, v5e (v5litepod), v6e and TPU7x; a {topo.name} "
                          f"always has its fixed shape {format_dims(default_dims(topo))}, so "
                          "drop --topology.")
    rank = 3 if topo.generation in THREE_D else 2
    given = format_dims(dims)
    if len(dims) != rank:
        raise ConfigError(f"--topology {given} has {len(dims)} dimensions, but {topo.generation} "
                          f"slices are {rank}D; valid shapes for {topo.name}: "
                          f"{_shape_list(valid)}.")
    if _prod(dims) != topo.chips:
        raise ConfigError(f"--topology {given} is {_prod(dims)} chips, but {topo.name} has "
                          f"{topo.chips}; valid shapes for {topo.name}: {_shape_list(valid)} "
                          "(or change --type to match the shape).")
    if dims in valid:
        return dims
    if rank == 3 and tuple(sorted(dims)) in valid:
        raise ConfigError(f"--topology {given}: the API wants the dimensions in ascending "
                          f"order; write --topology {format_dims(tuple(sorted(dims)))}.")
    why = ("v5e and v6e have no custom shapes" if rank == 2 else
           "TPU7x slices beyond 2x4x4 are whole 4x4x4 cubes, each dimension a multiple of 4"
           if topo.generation == "tpu7x" else
           "v4 and v5p dimensions must all be at most 4 or all be multiples of 4")
    raise ConfigError(f"--topology {given} is not a shape {topo.name} comes in ({why}); valid "
                      f"shapes for {topo.name}: {_shape_list(valid)}.")


def accelerator_config(type_text: str, topology: str) -> dict[str, str]:
    """The API's ``acceleratorConfig`` for a custom shape, validated first (pure)."""
    shape = slice_shape(type_text, topology)
    return {"type": ACCELERATOR_CONFIG_TYPE[shape.topology.generation], "topology": shape.text}


@dataclass(frozen=True)
class SliceShape:
    """Where a slice's chips sit: the physical mesh, its hosts, and what JAX sees."""

    topology: Topology
    dims: tuple[int, ...]            # chips along x, y[, z]
    host_block: tuple[int, ...]      # chips of one host along each axis
    wraps: tuple[bool, ...]          # wraparound (torus) links along each axis
    twisted: bool = False            # a twisted torus can be asked for
    custom: bool = False             # not the type's default shape

    @property
    def text(self) -> str:
        return format_dims(self.dims)

    @property
    def host_grid(self) -> tuple[int, ...]:
        return tuple(d // h for d, h in zip(self.dims, self.host_block, strict=True))

    @property
    def cores_per_chip(self) -> int:
        return self.topology.cores // self.topology.chips

    @property
    def jax_device_count(self) -> int:
        """One JAX device per chip on v4 and later (megacore), per TensorCore on v2/v3."""
        return self.topology.cores if self.topology.generation in ("v2", "v3") \
            else self.topology.chips

    @property
    def core_axis(self) -> int:
        """The TensorCores of a chip as their own mesh axis (2 on v2/v3, else 1)."""
        return self.cores_per_chip if self.topology.generation in ("v2", "v3") else 1

    @property
    def wrap_axes(self) -> str:
        return "".join(AXES[i] for i, w in enumerate(self.wraps) if w)

    def to_json(self) -> dict:
        t = self.topology
        return {"type": t.name, "generation": t.generation, "topology": self.text,
                "custom": self.custom, "dims": list(self.dims), "chips": t.chips,
                "tensorcores": t.cores, "hosts": t.hosts, "chips_per_host": t.chips_per_host,
                "host_block": list(self.host_block), "host_grid": list(self.host_grid),
                "jax_device_count": self.jax_device_count, "wraparound_axes": self.wrap_axes,
                "twisted_torus_available": self.twisted, "cubes": self.cubes,
                "control_planes": list(t.planes), "machine_type": t.machine_type}

    @property
    def cubes(self) -> int:
        """Whole 4x4x4 cubes (64 chips) the slice is made of (0 if it is smaller or 2D)."""
        return self.topology.chips // 64 if self.wraps and len(self.dims) == 3 else 0


def _wraps(generation: str, dims: tuple[int, ...]) -> tuple[bool, ...]:
    if generation in THREE_D:
        whole_cubes = len(dims) == 3 and all(d % 4 == 0 for d in dims)
        return tuple(whole_cubes for _ in dims)
    full = FULL_POD_2D.get(generation)
    return tuple(dims == full for _ in dims)


def _host_block(topo: Topology, dims: tuple[int, ...]) -> tuple[int, ...]:
    if topo.hosts == 1:
        return dims
    if topo.generation in THREE_D:
        return (2, 2, 1)
    return (2, 2)


def slice_shape(type_text: str, topology: str | None = None) -> SliceShape:
    """The physical shape of ``type_text`` (or of the custom ``topology`` for it)."""
    topo = parse_accelerator_type(type_text)
    dims = default_dims(topo)
    custom = False
    if topology:
        wanted = check_topology(topo, parse_topology_text(topology))
        custom = wanted != dims
        dims = wanted
    block = _host_block(topo, dims)
    if any(d % b for d, b in zip(dims, block, strict=True)):
        raise ConfigError(f"--topology {format_dims(dims)} cannot be split into "
                          f"{format_dims(block)} hosts; valid shapes for {topo.name}: "
                          f"{_shape_list(valid_topologies(topo))}.")
    sorted_dims = sorted(dims)
    twisted = (topo.generation in THREE_D and len(dims) == 3 and all(d % 4 == 0 for d in dims)
               and (2 * sorted_dims[0] == sorted_dims[1] == sorted_dims[2]
                    or 2 * sorted_dims[0] == 2 * sorted_dims[1] == sorted_dims[2]))
    return SliceShape(topo, dims, block, _wraps(topo.generation, dims), twisted, custom)


@dataclass(frozen=True)
class Submesh:
    """One model-parallel replica's tile of the physical mesh, and how it ranks."""

    tile: tuple[int, ...]             # along x, y[, z] (and the cores of a chip on v2/v3)
    shape: SliceShape = field(repr=False, compare=False)

    @property
    def _bounds(self) -> tuple[int, ...]:
        s = self.shape
        return s.dims + ((s.core_axis,) if s.core_axis > 1 else ())

    @property
    def _wraps(self) -> tuple[bool, ...]:
        return self.shape.wraps + ((False,) if self.shape.core_axis > 1 else ())

    @property
    def _host_block(self) -> tuple[int, ...]:
        s = self.shape
        return s.host_block + ((s.core_axis,) if s.core_axis > 1 else ())

    @property
    def size(self) -> int:
        return _prod(self.tile)

    @property
    def whole_wrapping_axes(self) -> int:
        """Physical axes with wraparound links that the tile spans end to end."""
        return sum(1 for m, g, w in zip(self.tile, self._bounds, self._wraps, strict=True)
                   if w and m == g > 1)

    @property
    def whole_axes(self) -> int:
        return sum(1 for m, g in zip(self.tile, self._bounds, strict=True) if m == g > 1)

    @property
    def hosts_per_tile(self) -> int:
        return _prod(-(-m // h) for m, h in zip(self.tile, self._host_block, strict=True))

    @property
    def axes_used(self) -> int:
        return sum(1 for m in self.tile if m > 1)

    def rank_key(self) -> tuple:
        """Smaller sorts first (the rule, and why, in docs/topology.md): whole wrapping axes,
        then fewest hosts per tile, then whole axes, then more axes used, then x before y."""
        return (-self.whole_wrapping_axes, self.hosts_per_tile, -self.whole_axes,
                -self.axes_used, tuple(-m for m in self.tile))

    @property
    def t5x(self) -> tuple[int, int, int, int]:
        """t5x's ``model_parallel_submesh``: (x, y, z, cores of a chip)."""
        dims = len(self.shape.dims)
        spatial = list(self.tile[:dims]) + [1] * (3 - dims)
        core = self.tile[dims] if len(self.tile) > dims else 1
        return (spatial[0], spatial[1], spatial[2], core)

    @property
    def data(self) -> int:
        return self.shape.jax_device_count // self.size

    @property
    def mesh_shape(self) -> tuple[int, int]:
        """The JAX mesh ('data', 'model')."""
        return (self.data, self.size)

    @property
    def direct_mesh(self) -> bool:
        """Each axis is whole or untouched, so ``create_device_mesh((data, model))`` itself
        maps 'model' onto this tile (up to swapping equal-length axes)."""
        return all(m in (1, g) for m, g in zip(self.tile, self._bounds, strict=True))

    def reshape_recipe(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(reshape, transpose) that turn the physical device array (indexed by x, y[, z][,
        core]) into the ('data', 'model') mesh, as t5x's get_mesh does."""
        pairs = [(g // m, m) for g, m in zip(self._bounds, self.tile, strict=True)]
        reshape = tuple(v for pair in pairs for v in pair)
        n = len(pairs)
        transpose = tuple(2 * i for i in range(n)) + tuple(2 * i + 1 for i in range(n))
        return reshape, transpose

    def to_json(self) -> dict:
        reshape, transpose = self.reshape_recipe()
        return {"t5x_model_parallel_submesh": list(self.t5x), "tile": list(self.tile),
                "jax_mesh_shape": list(self.mesh_shape), "direct_create_device_mesh":
                self.direct_mesh, "reshape": list(reshape), "transpose": list(transpose),
                "hosts_per_tile": self.hosts_per_tile,
                "whole_wrapping_axes": self.whole_wrapping_axes,
                "whole_axes": self.whole_axes, "axes_used": self.axes_used}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def submeshes(shape: SliceShape, model_parallel: int) -> list[Submesh]:
    """Every contiguous tile of ``model_parallel`` devices that tiles ``shape``, best first."""
    bounds = shape.dims + ((shape.core_axis,) if shape.core_axis > 1 else ())
    if model_parallel < 1 or shape.jax_device_count % model_parallel:
        raise ConfigError(f"--model-parallel {model_parallel} does not divide the "
                          f"{shape.jax_device_count} JAX devices of {shape.topology.name}; "
                          f"pick one of {_possible(shape, bounds)}.")
    tiles: list[tuple[int, ...]] = [()]
    for g in bounds:
        tiles = [t + (d,) for t in tiles for d in _divisors(g)]
    found = [Submesh(t, shape) for t in tiles if _prod(t) == model_parallel]
    if not found:
        raise ConfigError(f"--model-parallel {model_parallel} cannot be a block of the "
                          f"{format_dims(bounds)} mesh of {shape.topology.name}; pick one of "
                          f"{_possible(shape, bounds)}.")
    return sorted(found, key=Submesh.rank_key)


def _possible(shape: SliceShape, bounds: tuple[int, ...]) -> str:
    sizes = {1}
    for g in bounds:
        sizes = {s * d for s in sizes for d in _divisors(g)}
    return ", ".join(str(s) for s in sorted(sizes))
