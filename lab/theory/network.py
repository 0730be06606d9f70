"""Collectives on a chip's network: a TPU torus axis, NVLink in a node, DCN between slices.

After "How to Scale Your Model" (the scaling book, jax-ml/scaling-book),
Part 3 ("Sharded Matrices") for a TPU torus axis, with or without
wraparound, and Part 12 ("Intra-node collectives") for a switched network
(NVLink, DCN, InfiniBand). The byte counts are the
alpha-beta model's (`lab.theory.collectives`); what changes is the network
under them. On ICI the hops overlap the transfer, so the time is the larger
of the two bounds, not their sum:

    T = max(T_hop * longest path, bytes_sent / (links * W))

A wrapped torus dimension is a ring with two directions (2 links of W); a
dimension without wraparound is a line (1 link, "typically doubles the
time", Part 2); bandwidth adds over the dimensions a group spans. Only the
kinds XLA emits (`lab.collectives.KINDS`) have a formula here: broadcast and
reduce stay in the alpha-beta model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from lab.collectives import KINDS
from lab.errors import LabError
from lab.targets.hardware import ChipProfile
from lab.theory.collectives import _PASSES, CollectiveCost, _check_count_and_size, _check_kind


def predict_on_torus(
    kind: str, size_bytes: float, chip: ChipProfile, topology: Sequence[int], dims: Sequence[int]
) -> CollectiveCost:
    """A collective over torus dimensions `dims` of a TPU slice `topology`, e.g. (4, 4, 4) and (0,).

    After the scaling book, Part 3 ("Sharded Matrices"): a dimension that wraps
    is a ring whose two directions both carry data, 2 links of W each; one that
    does not is a line whose end chips feed only one direction, 1 link, which
    "typically doubles the time" (Part 2). Bandwidth adds over the dimensions
    spanned (Part 3: "increases the available bandwidth by a factor of
    n_axes"). Bytes follow the bidirectional ring with N = the chips spanned,
    so an all-gather moves (N-1)/N * S, which tends to the book's V / W_ici for
    large N. Hops overlap the transfer, so the time is the larger bound
    (Part 3, "A note on ICI latency"):
        T = max(T_hop * longest path, bytes_sent / (links * W)).
    A collective-permute is taken as a shift to a neighbour: 1 hop, S bytes.
    All-to-all over more than one dimension applies the ring formula to the
    flattened group, an approximation the book does not make.
    """
    extents, wraps = _torus_span(kind, chip, topology, dims)
    return predict_on_rings(kind, size_bytes, chip, extents, wraps)


def predict_on_rings(
    kind: str, size_bytes: float, chip: ChipProfile, extents: Sequence[int], wraps: Sequence[bool]
) -> CollectiveCost:
    """The same, for a group spanning `extents` chips along torus dimensions that wrap or not.

    A group covering part of a dimension (2 of its 4 chips, say) is a line
    however the slice is wired: `lab.targets.topology.placement` gives extents and wraps.
    """
    _check_network_kind(kind)
    devices = math.prod(extents)
    _check_count_and_size(devices, size_bytes)
    if kind == "collective-permute":
        algorithm, steps, links = "direct", int(devices > 1), 1
    else:
        algorithm, links = "bidirectional-ring", sum(2 if wrap else 1 for wrap in wraps)
        longest_path = sum(extent // 2 if wrap else extent - 1 for extent, wrap in zip(extents, wraps))
        steps = longest_path * (2 if kind == "all-reduce" else 1)  # all-reduce: reduce-scatter, then all-gather
    bytes_sent = _PASSES[kind, algorithm](devices).bytes_per_size * size_bytes
    return _overlapped(
        kind,
        f"torus {algorithm}",
        devices,
        size_bytes,
        steps,
        bytes_sent,
        links,
        chip.hop_latency_s,
        chip.link_bandwidth,
    )


def predict_on_switch(
    kind: str, size_bytes: float, chip: ChipProfile, devices: int, *, network: str = "link"
) -> CollectiveCost:
    """A collective among `devices` chips through a switch: NVLink in a node, or DCN / InfiniBand.

    `network="link"` uses the chip's own link (a GPU's NVLink egress; the CPU's
    memory bus); `network="dcn"` the data-centre network between TPU slices or
    GPU nodes, one chip's share of it. After the scaling book, Part 12
    ("Intra-node collectives"): rings for all-gather, reduce-scatter and
    all-reduce, T = (N-1)/N * S / W per pass; direct sends for all-to-all,
    (N-1)/N * S / W. The DCN term is bandwidth only: the book gives no DCN
    latency.
    """
    _check_network_kind(kind)
    _check_count_and_size(devices, size_bytes)
    if network not in ("link", "dcn"):
        raise LabError(
            f"unknown network {network!r}; use 'link' (NVLink, ICI, memory bus) or 'dcn' (between slices or nodes)"
        )
    bandwidth = chip.link_bandwidth if network == "link" else chip.dcn_bandwidth
    if bandwidth is None:
        raise LabError(f"{chip.name} has no data-centre network; use network='link'")
    hop_latency = chip.hop_latency_s if network == "link" else 0.0
    algorithm = "ring" if kind in ("all-reduce", "all-gather", "reduce-scatter") else "direct"
    passes = _PASSES[kind, algorithm](devices)
    return _overlapped(
        kind,
        algorithm,
        devices,
        size_bytes,
        passes.steps,
        passes.bytes_per_size * size_bytes,
        1,
        hop_latency,
        bandwidth,
    )


def _overlapped(
    kind, algorithm, devices, size_bytes, steps, bytes_sent, links, hop_latency, bandwidth
) -> CollectiveCost:
    latency_s, transfer_s = steps * hop_latency, bytes_sent / (links * bandwidth)
    return CollectiveCost(
        kind,
        algorithm,
        devices,
        size_bytes,
        steps,
        bytes_sent,
        links,
        latency_s,
        transfer_s,
        max(latency_s, transfer_s),
    )


def _torus_span(
    kind: str, chip: ChipProfile, topology: Sequence[int], dims: Sequence[int]
) -> tuple[list[int], list[bool]]:
    _check_network_kind(kind)
    if not chip.torus_dims:
        raise LabError(f"{chip.name} has no torus; use predict_on_switch for a switched network")
    wraps = chip.wraparound(topology)
    if not dims or len(set(dims)) != len(dims) or any(not 0 <= dim < len(topology) for dim in dims):
        raise LabError(f"dims {tuple(dims)} must be distinct indices into topology {'x'.join(map(str, topology))}")
    return [topology[dim] for dim in dims], [wraps[dim] for dim in dims]


def _check_network_kind(kind: str) -> None:
    _check_kind(kind)
    if kind not in KINDS:
        raise LabError(
            f"no network formula for {kind} (XLA emits none); use collective_cost, or one of {', '.join(KINDS)}"
        )
