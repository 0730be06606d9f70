"""The device mesh: five named axes, always all five.

Every mesh in the lab carries the canonical axes ``data, stage, fsdp, expert,
tensor`` in that order, size 1 where unused, so any PartitionSpec may name any
of them and a strategy is only a choice of sizes. ``tensor`` is innermost:
devices that differ only in their tensor index are neighbours in the device
order, which on real hardware puts the most frequent collectives (tensor
parallel all-reduces, every layer) on the fastest links; ``data`` is outermost
and goes across slices (DCN) first.

A spec is written ``"data=2,fsdp=2,tensor=2"``; one axis may be ``-1`` to take
the devices the others leave. Meshes use Explicit axis types by default
(sharding is part of the type and visible in ``jax.typeof``); note that
``jax.sharding.Mesh(...)`` alone would default to Auto.

Replica groups in compiled HLO name devices by their *position in the mesh's
device order* (the flat index into ``mesh.devices``), not by ``device.id``;
`device_groups` gives, for a set of axes, the groups of positions a collective
over those axes uses, which is how the HLO inspector maps groups back to axes.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from lab.errors import LabError

AXES: tuple[str, ...] = ("data", "stage", "fsdp", "expert", "tensor")


@dataclass(frozen=True)
class MeshSpec:
    """Sizes of the five canonical axes; ``-1`` on one axis means "the rest"."""

    data: int = 1
    stage: int = 1
    fsdp: int = 1
    expert: int = 1
    tensor: int = 1

    def __post_init__(self) -> None:
        sizes = self.sizes
        for axis, size in sizes.items():
            if not isinstance(size, (int, np.integer)) or isinstance(size, bool):
                raise LabError(f"mesh axis {axis}={size!r}: sizes must be integers")
            if size == 0 or size < -1:
                raise LabError(f"mesh axis {axis}={size}: sizes must be positive (or -1 for 'the remaining devices')")
        if list(sizes.values()).count(-1) > 1:
            raise LabError("mesh spec: at most one axis may be -1 (it takes the devices the others leave)")

    @classmethod
    def parse(cls, spec: str | Mapping[str, int] | MeshSpec) -> MeshSpec:
        """Read ``"data=2,fsdp=4"``, ``{"data": 2, "fsdp": 4}`` or a MeshSpec."""
        if isinstance(spec, MeshSpec):
            return spec
        if isinstance(spec, Mapping):
            return cls._from_mapping(dict(spec), repr(dict(spec)))
        text = spec.strip()
        if text in ("", "1", "single device"):
            return cls()
        pairs: dict[str, int] = {}
        for part in text.split(","):
            name, sep, value = part.partition("=")
            name, value = name.strip(), value.strip()
            if not sep or not name:
                raise LabError(
                    f"mesh spec {spec!r}: write axis=size pairs separated by commas, e.g. data=2,fsdp=2,tensor=2"
                )
            if name in pairs:
                raise LabError(f"mesh spec {spec!r}: axis {name!r} is given twice")
            try:
                pairs[name] = int(value)
            except ValueError:
                raise LabError(f"mesh spec {spec!r}: size of {name!r} must be an integer, not {value!r}") from None
        return cls._from_mapping(pairs, repr(spec))

    @classmethod
    def _from_mapping(cls, pairs: dict, shown: str) -> MeshSpec:
        unknown = sorted(set(pairs) - set(AXES))
        if unknown:
            raise LabError(f"mesh spec {shown}: unknown axis {unknown[0]!r}; the axes are {', '.join(AXES)}")
        return cls(**pairs)

    @property
    def sizes(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.sizes.values())

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def resolve(self, device_count: int) -> MeshSpec:
        """Fill a ``-1`` axis and check that the sizes use exactly `device_count` devices."""
        sizes = self.sizes
        known = math.prod(s for s in sizes.values() if s != -1)
        if -1 in sizes.values():
            if device_count % known:
                raise LabError(
                    f"mesh {self}: the other axes use {known} devices, which does "
                    f"not divide the {device_count} available"
                )
            sizes = {a: (device_count // known if s == -1 else s) for a, s in sizes.items()}
        resolved = MeshSpec(**sizes)
        if resolved.size != device_count:
            uses = f"uses {resolved.size} device{'s' * (resolved.size != 1)}"
            raise LabError(
                f"mesh {self} {uses} but the target has {device_count}; make the sizes multiply to {device_count} "
                "(or give one axis as -1, e.g. fsdp=-1)"
            )
        return resolved

    def build(self, devices: Sequence | None = None, *, explicit: bool = True):
        """A `jax.sharding.Mesh` over `devices` (default: all of JAX's) with all five axes."""

        devices = list(jax.devices() if devices is None else devices)
        spec = self.resolve(len(devices))
        kind = AxisType.Explicit if explicit else AxisType.Auto
        return Mesh(_arrange(spec.shape, devices), AXES, axis_types=(kind,) * len(AXES))

    def __str__(self) -> str:
        used = [f"{a}={s}" for a, s in self.sizes.items() if s != 1]
        return ",".join(used) if used else "single device"


def _arrange(shape: tuple[int, ...], devices: list) -> np.ndarray:
    """Place devices in the mesh: physical torus order on TPUs, given order elsewhere."""
    if getattr(devices[0], "platform", "") != "tpu":
        return np.asarray(devices, dtype=object).reshape(shape)

    slices = len({getattr(d, "slice_index", 0) for d in devices})
    if slices > 1:
        dcn = _dcn_shape(shape, slices)
        ici = tuple(s // d for s, d in zip(shape, dcn))
        return mesh_utils.create_hybrid_device_mesh(ici, dcn, devices, allow_split_physical_axes=True)
    return mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)


def _dcn_shape(shape: tuple[int, ...], slices: int) -> tuple[int, ...]:
    """Give the slices to the outermost axes (data first): they cross DCN."""
    remaining, dcn = slices, []
    for size in shape:
        factor = math.gcd(size, remaining)
        dcn.append(factor)
        remaining //= factor
    if remaining != 1:
        raise LabError(
            f"mesh shape {dict(zip(AXES, shape))} cannot spread over {slices} "
            "slices; make the outer axes (data, stage, ...) a multiple of "
            f"{slices}"
        )
    return tuple(dcn)


def slice_local_shape(mesh) -> tuple[int, ...]:
    """The mesh shape one TPU slice sees: each axis divided by the slices it spans.

    For a multi-slice mesh libtpu compiles the program of one slice: its HLO
    has num_partitions = the devices of a slice, and its replica groups number
    positions within that slice. An axis spans as many slices as its line of
    devices through the mesh's first device meets (the axis across slices may
    be any, `data` or the one ``--dcn-axis`` names). Single-slice meshes are
    returned unchanged.
    """
    return tuple(size // n for size, n in zip(mesh.devices.shape, _slice_spans(mesh)))


def _slice_spans(mesh) -> tuple[int, ...]:
    """For each axis, how many slices its line of devices through the mesh's first device meets."""
    grid = np.vectorize(lambda d: getattr(d, "slice_index", None) or 0, otypes=[int])(mesh.devices)
    lines = [np.moveaxis(grid, axis, 0)[(slice(None), *(0,) * (grid.ndim - 1))] for axis in range(grid.ndim)]
    return tuple(len(set(line.tolist())) for line in lines)


def axes_across_slices(mesh) -> tuple[str, ...]:
    """The mesh axes whose devices lie in more than one slice (none on a single slice)."""
    return tuple(a for a, n in zip(mesh.axis_names, _slice_spans(mesh)) if n > 1)


def one_slice(mesh) -> Mesh:
    """The first slice's part of a multi-slice mesh, as a mesh of `slice_local_shape` (the mesh itself on one slice).

    A hybrid mesh (`jax.experimental.mesh_utils.create_hybrid_device_mesh`) gives each axis's slices the outer
    factor of its index, so the first slice holds the first `slice_local_shape` positions of every axis."""
    local = slice_local_shape(mesh)
    if local == tuple(mesh.devices.shape):
        return mesh
    return Mesh(mesh.devices[tuple(slice(0, n) for n in local)], mesh.axis_names)


def device_groups(shape: Sequence[int], axes: Sequence[int]) -> list[tuple[int, ...]]:
    """Groups of flat mesh positions that a collective over the axis indices `axes` uses.

    Each group varies the given axes (in row-major order) with the others fixed,
    exactly as ``shard_map`` lays out replica groups.
    """
    shape = tuple(shape)
    others = [i for i in range(len(shape)) if i not in axes]
    positions = np.arange(math.prod(shape)).reshape(shape)
    moved = np.transpose(positions, others + list(axes))
    group_size = math.prod(shape[i] for i in axes)
    return [tuple(int(p) for p in row) for row in moved.reshape(-1, group_size)]


def axes_of_groups(
    shape: Sequence[int], names: Sequence[str], groups: Sequence[Sequence[int]]
) -> tuple[str, ...] | None:
    """The mesh axes whose `device_groups` equal `groups`, or None if no set of axes does.

    Groups are compared as sets (XLA may list a group's members in another
    order when the axes were named in another order). Size-1 axes are ignored:
    a collective never needs them.
    """
    target = {frozenset(g) for g in groups}
    live = [i for i, s in enumerate(shape) if s > 1]
    if all(len(g) == 1 for g in target):
        return ()
    for r in range(1, len(live) + 1):
        for combo in itertools.combinations(live, r):
            if {frozenset(g) for g in device_groups(shape, combo)} == target:
                return tuple(names[i] for i in combo)
    return None


def describe(mesh) -> str:
    """A readable description: axis sizes, then which device positions form each group."""
    shape = tuple(mesh.devices.shape)
    lines = [
        " x ".join(f"{a}={s}" for a, s in zip(mesh.axis_names, shape))
        + f"  ({mesh.devices.size} devices, {mesh.devices.flat[0].device_kind})"
    ]
    for index, (axis, size) in enumerate(zip(mesh.axis_names, shape)):
        if size == 1:
            continue
        groups = device_groups(shape, [index])
        shown = " ".join("{" + ",".join(map(str, g)) + "}" for g in groups[:8])
        more = f" ... ({len(groups)} groups)" if len(groups) > 8 else ""
        lines.append(f"  {axis:<6} size {size}: groups {shown}{more}")
    return "\n".join(lines)
