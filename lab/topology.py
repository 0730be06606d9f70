"""Mesh axes on a TPU torus: which physical links a collective uses, and how long it takes.

A mesh axis is a logical name; what a collective over it costs depends on
where its devices sit. Every TPU device (real or compile-only) knows its
``coords`` in its slice's torus and, across slices, its ``slice_index``. For
an axis, the groups of devices that differ only along it either

* vary along one or more torus dimensions of one slice: the collective runs on
  ICI, as a ring per dimension, with both directions used when that dimension
  wraps around (the scaling book, Part 2 "TPU networking"; Part 3 "Sharded
  matrices"); a group that covers only part of a dimension is a line, not a
  ring, whatever the slice does;
* or sit in different slices: the collective crosses the data-centre network
  (DCN), orders of magnitude slower per chip than ICI;
* or share a chip (TPU v4's two TensorCores appear as two devices): no link.

`placement` finds which case holds for a set of mesh axes; `predict` turns a
`lab.hlo.Collective` into a `lab.theory.CollectiveCost` on a chip profile.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from lab import theory
from lab.hardware import ChipProfile, profile_for_device_kind
from lab.mesh import device_groups

DIMENSION_NAMES = "xyz"


@dataclass(frozen=True)
class Placement:
    """Where the devices of a collective over `axes` sit on the machine."""

    axes: tuple[str, ...]
    devices: int  # N: devices in each group
    network: str  # "ici", "dcn" or "chip" (same chip)
    torus_dims: tuple[int, ...] = ()  # ICI: the torus dimensions the group varies along
    extents: tuple[int, ...] = ()  # chips the group spans along each of them
    wraps: tuple[bool, ...] = ()  # whether each is a full ring with wraparound

    def __str__(self) -> str:
        if self.network == "dcn":
            return f"DCN across {self.devices} slices" if self.devices else "DCN"
        if self.network == "chip":
            return "within one chip"
        spans = [
            f"{DIMENSION_NAMES[d]}:{e}{' ring' if w else ' line'}"
            for d, e, w in zip(self.torus_dims, self.extents, self.wraps)
        ]
        return "ICI " + " x ".join(spans)


def slice_shape(devices: Sequence) -> tuple[int, ...]:
    """Chips along each torus dimension of one slice, from the devices' coords."""
    coords = np.asarray([d.coords for d in devices])
    return tuple(int(c) for c in coords.max(axis=0) + 1)


def placement(mesh, axes: Sequence[str], chip: ChipProfile | None = None) -> Placement:
    """Where a collective over mesh `axes` runs: ICI dimensions, DCN, or one chip."""
    axes = tuple(axes)
    flat = list(mesh.devices.flat)
    chip = chip or profile_for_device_kind(flat[0].device_kind)
    indices = [mesh.axis_names.index(a) for a in axes]
    group = [flat[p] for p in device_groups(mesh.devices.shape, indices)[0]]
    n = len(group)
    if len({getattr(d, "slice_index", None) or 0 for d in group}) > 1:
        return Placement(axes, n, "dcn")
    coords = np.asarray([d.coords for d in group])
    varying = tuple(int(i) for i in np.flatnonzero(coords.max(axis=0) != coords.min(axis=0)))
    if not varying:
        return Placement(axes, n, "chip")
    shape = slice_shape(flat)
    full_wraps = chip.wraparound(shape[: chip.torus_dims])
    extents = tuple(len(set(coords[:, d])) for d in varying)
    wraps = tuple(full_wraps[d] and extent == shape[d] for d, extent in zip(varying, extents))
    return Placement(axes, n, "ici", varying, extents, wraps)


def predict(kind: str, size_bytes: float, where: Placement, chip: ChipProfile) -> theory.CollectiveCost | None:
    """Predicted time of a collective of nccl-tests size S placed as `where`; None within one chip."""
    if where.network == "chip" or where.devices < 2:
        return None
    if where.network == "dcn":
        return theory.predict_on_switch(kind, size_bytes, chip, where.devices, network="dcn")
    return theory.predict_on_rings(kind, size_bytes, chip, where.extents, where.wraps)


def describe_axes(mesh, chip: ChipProfile | None = None) -> str:
    """One line per mesh axis of size > 1: where its collectives run."""
    lines = []
    for axis, size in zip(mesh.axis_names, mesh.devices.shape):
        if size > 1:
            lines.append(f"  {axis:<6} size {size}: {placement(mesh, (axis,), chip)}")
    return "\n".join(lines)
