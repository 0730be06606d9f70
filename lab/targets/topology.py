"""Mesh axes on a TPU torus or a GPU cluster: which physical links a collective uses, and how long it takes.

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
  (DCN), orders of magnitude slower per chip than ICI. A group with k chips in
  each of M slices runs in two tiers, one after the other, as the multi-slice
  collectives do: its ICI part within each slice, then the M-slice part on DCN
  of the S / k each chip holds (permutes and all-to-alls are priced flat on DCN);
* or share a chip (TPU7x's two chiplets appear as two devices): no link.

A chip's links are the chip's, not its devices': where each group holds one
of a chip's two devices (``data=2`` inside the chip, ``fsdp`` across chips),
the sibling groups run the same collective at the same time over the same
ports, each at half the chip's bandwidth (``Placement.sharers``).

On a GPU cluster (`gpu:<chip>:<nodes>x<gpus>`) the GPUs of a node meet
through NVSwitches, all one hop apart, and nodes meet over InfiniBand, one NIC
per GPU (a "rail"). Each GPU device names its node by ``process_index`` (the
host; compile-only devices report it too, see `lab.targets.gpu`), so for an
axis's groups

* all in one node: the collective runs on NVLink (``"nvlink"``), a ring at one
  GPU's NVLink egress (scaling book Part 12; NCCL's ring all-reduce moves
  2(N-1)/N·S per GPU);
* across nodes: on InfiniBand (``"infiniband"``). A group with k GPUs in each
  of M nodes runs hierarchically (NCCL: reduce-scatter inside the node, the
  M-node collective of S/k on each GPU's own NIC, all-gather inside), both
  tiers pipelined, so the slower tier bounds it: max(NVLink part over k,
  IB part over M of S/k). All-to-all and permutes are priced flat on IB.

Devices without a network model (this host's emulated CPU devices) get
``"host"``: the placement exists, and nothing is predicted for it.

`placement` finds which case holds for a set of mesh axes, `program_placement`
for a collective of a compiled (one slice's) program; `predict` turns a
`lab.hlo.Collective` into a `lab.theory.CollectiveCost` on a chip profile.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from lab import theory
from lab.mesh import axes_across_slices, device_groups, one_slice
from lab.targets.hardware import ChipProfile, profile_for_device_kind

DIMENSION_NAMES = "xyz"


@dataclass(frozen=True)
class Placement:
    """Where the devices of a collective over `axes` sit on the machine."""

    axes: tuple[str, ...]
    devices: int  # N: devices in each group
    network: str  # "ici", "dcn" or "chip" (same chip); GPUs: "nvlink", "infiniband"; CPU devices: "host"
    torus_dims: tuple[int, ...] = ()  # ICI: the torus dimensions the group varies along
    extents: tuple[int, ...] = ()  # chips the group spans along each of them
    wraps: tuple[bool, ...] = ()  # whether each is a full ring with wraparound
    nodes: int = 1  # GPU nodes or TPU slices each group spans (M); a TPU group's ICI fields: one slice's part
    sharers: int = 1  # groups of this collective whose devices share each chip's links (TPU7x: 2 with an axis inside)

    @property
    def per_node(self) -> int:
        """Devices of each group inside one node or slice (k = N / M)."""
        return self.devices // self.nodes

    def __str__(self) -> str:
        if self.network == "nvlink":
            return f"NVLink within one node ({self.devices} GPUs)"
        if self.network == "infiniband":
            each = f"{self.per_node} GPUs each, NVLink among them" if self.per_node > 1 else "1 GPU each"
            return f"InfiniBand across {self.nodes} nodes ({each})"
        if self.network == "host":
            return f"this host's memory ({self.devices} emulated devices)"
        if self.network == "chip":
            return "within one chip"
        shared = f", each chip's links shared by {self.sharers} groups" if self.sharers > 1 else ""
        if self.network == "dcn":
            within = f", {self._ici()} within each" if self.torus_dims else ""
            return f"DCN across {self.nodes} slices{within}{shared}"
        return self._ici() + shared

    def _ici(self) -> str:
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
    """Where a collective over mesh `axes` runs: ICI dimensions, DCN, one chip; NVLink or InfiniBand; the host."""
    return _placement(mesh, tuple(axes), chip)


@functools.lru_cache(maxsize=4096)  # a program asks for the same few groups once per collective (DeepSeek-V3: 439)
def _placement(mesh, axes: tuple[str, ...], chip: ChipProfile | None) -> Placement:
    flat = list(mesh.devices.flat)
    indices = [mesh.axis_names.index(a) for a in axes]
    group = [flat[p] for p in device_groups(mesh.devices.shape, indices)[0]]
    n = len(group)
    if flat[0].platform == "cpu":
        return Placement(axes, n, "host")
    if flat[0].platform == "gpu":
        nodes = len({d.process_index for d in group})
        return Placement(axes, n, "nvlink" if nodes == 1 else "infiniband", nodes=nodes)
    chip = chip or profile_for_device_kind(flat[0].device_kind)
    slices = sorted({_slice(d) for d in group})
    if len(slices) > 1:
        local = [d for d in group if _slice(d) == slices[0]]
        within = _torus_part(local, [d for d in flat if _slice(d) == slices[0]], chip)
        return Placement(axes, n, "dcn", *within, nodes=len(slices), sharers=_sharers(group, flat))
    varying, extents, wraps = _torus_part(group, flat, chip)
    if not varying:
        return Placement(axes, n, "chip")
    return Placement(axes, n, "ici", varying, extents, wraps, sharers=_sharers(group, flat))


def _sharers(group: Sequence, devices: Sequence) -> int:
    """How many groups run a collective at once on each chip's links: the chip's devices over the group's own."""

    def chip(d) -> tuple:
        return _slice(d), tuple(d.coords)

    first = chip(group[0])
    return sum(chip(d) == first for d in devices) // sum(chip(d) == first for d in group)


def _slice(device) -> int:
    return getattr(device, "slice_index", None) or 0


def _torus_part(group: Sequence, slice_devices: Sequence, chip: ChipProfile) -> tuple[tuple, tuple, tuple]:
    """The torus dimensions a group of one slice's chips varies along, its extent on each, and which wrap."""
    coords = np.asarray([d.coords for d in group])
    varying = tuple(int(i) for i in np.flatnonzero(coords.max(axis=0) != coords.min(axis=0)))
    shape = slice_shape(slice_devices)
    full_wraps = chip.wraparound(shape[: chip.torus_dims])
    extents = tuple(len(set(coords[:, d])) for d in varying)
    wraps = tuple(bool(full_wraps[d]) and extent == shape[d] for d, extent in zip(varying, extents))
    return varying, extents, wraps


def program_placement(mesh, collective, chip: ChipProfile | None = None) -> Placement:
    """Where a `lab.hlo.Collective` of a compiled program runs on `mesh`.

    On several slices libtpu compiles one slice's program: its own collectives run within the slice (`placement`
    on `lab.mesh.one_slice`), and what crosses the slices is a megascale transfer (``across_slices``), run on DCN
    by one chip of each slice over the axes that span them."""
    if collective.across_slices:
        slices = len({_slice(d) for d in mesh.devices.flat})
        return Placement(axes_across_slices(mesh), slices, "dcn", nodes=slices)
    return placement(one_slice(mesh), collective.axes, chip)


def predict(kind: str, size_bytes: float, where: Placement, chip: ChipProfile) -> theory.CollectiveCost | None:
    """Predicted time of a collective of nccl-tests size S placed as `where`; None within one chip or on the host."""
    if where.network in ("chip", "host") or where.devices < 2:
        return None
    if where.sharers > 1:  # the sibling groups on each chip split its ports and its share of DCN
        dcn = chip.dcn_bandwidth and chip.dcn_bandwidth / where.sharers
        chip = replace(chip, link_bandwidth=chip.link_bandwidth / where.sharers, dcn_bandwidth=dcn)
    if where.network == "nvlink":
        return theory.predict_on_switch(kind, size_bytes, chip, where.devices, network="link")
    if where.network == "infiniband":
        return _across_nodes(kind, size_bytes, where, chip)
    if where.network == "dcn":
        return _across_slices(kind, size_bytes, where, chip)
    return theory.predict_on_rings(kind, size_bytes, chip, where.extents, where.wraps)


def _across_slices(kind: str, size_bytes: float, where: Placement, chip: ChipProfile) -> theory.CollectiveCost:
    """A collective over M slices with k chips each: the ICI tier within each slice, then DCN on S / k."""
    k = where.per_node
    if k == 1 or kind not in ("all-reduce", "all-gather", "reduce-scatter"):
        return theory.predict_on_switch(kind, size_bytes, chip, where.devices, network="dcn")
    dcn = theory.predict_on_switch(kind, size_bytes / k, chip, where.nodes, network="dcn")
    if not where.torus_dims:  # each slice's k devices are one chip's (TPU7x's chiplets): die to die, no link
        algorithm = f"{dcn.algorithm} on DCN (the {k} devices of each slice on one chip)"
        return replace(dcn, algorithm=algorithm, devices=where.devices, size_bytes=size_bytes)
    ici = theory.predict_on_rings(kind, size_bytes, chip, where.extents, where.wraps)
    return replace(
        dcn,
        algorithm=f"two tiers: {ici.algorithm} within each slice, then {dcn.algorithm} on DCN",
        devices=where.devices,
        size_bytes=size_bytes,
        steps=ici.steps + dcn.steps,
        bytes_sent=ici.bytes_sent + dcn.bytes_sent,
        latency_s=ici.latency_s + dcn.latency_s,
        transfer_s=ici.transfer_s + dcn.transfer_s,
        seconds=ici.seconds + dcn.seconds,
    )


def _across_nodes(kind: str, size_bytes: float, where: Placement, chip: ChipProfile) -> theory.CollectiveCost:
    """A collective over M nodes with k GPUs each: the slower of the NVLink tier and the IB tier (rails)."""
    k = where.per_node
    if kind not in ("all-reduce", "all-gather", "reduce-scatter"):
        return theory.predict_on_switch(kind, size_bytes, chip, where.devices, network="dcn")
    infiniband = theory.predict_on_switch(kind, size_bytes / k, chip, where.nodes, network="dcn")
    if k == 1:
        return infiniband
    nvlink = theory.predict_on_switch(kind, size_bytes, chip, k, network="link")
    slower = infiniband if infiniband.seconds >= nvlink.seconds else nvlink
    tier = "IB" if slower is infiniband else "NVLink"
    return replace(slower, algorithm=f"hierarchical ring ({tier} tier bounds)", devices=where.devices)


def describe_axes(mesh, chip: ChipProfile | None = None) -> str:
    """One line per mesh axis of size > 1: where its collectives run."""
    lines = []
    for axis, size in zip(mesh.axis_names, mesh.devices.shape):
        if size > 1:
            lines.append(f"  {axis:<6} size {size}: {placement(mesh, (axis,), chip)}")
    return "\n".join(lines)
