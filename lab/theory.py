"""Closed-form costs: what theory says a distributed program should cost.

Every formula cites its source and is tested against the source's own numbers.
The module is organised in sections; collectives come first, and later
sections (memory under ZeRO, pipeline bubbles, MoE traffic, roofline
thresholds) follow the same pattern: a formula, its source, a test.

1. Collectives in the alpha-beta (latency-bandwidth) model of Hockney (1994)
   and Thakur, Rabenseifner & Gropp (2005), "Optimization of Collective
   Communication Operations in MPICH" (TRG). A message of n bytes on one link
   costs alpha + n/beta. An algorithm is a schedule: `steps` rounds of
   concurrent messages, and `bytes_sent`, the bytes one device puts on its
   links over the whole collective (forwarded bytes included), over `links`
   links driven at once:  t = steps * alpha + bytes_sent / (links * beta).
   Sizes follow nccl-tests (doc/PERFORMANCE.md): S is the all-reduce buffer,
   the all-gather *output*, the reduce-scatter *input*, the all-to-all
   per-device buffer, and the permute, broadcast or reduce buffer. The
   reduction arithmetic (TRG's gamma term) is left out: accelerators overlap
   it with the transfers.
2. nccl-tests bandwidths: algbw = S/t and busbw = algbw * factor(kind, N).
3. The crossover: the size below which a few-step algorithm beats a
   bandwidth-optimal one.
4. Collectives on a chip's network, after "How to Scale Your Model" (the
   scaling book), Part 3: a TPU torus axis, with or without wraparound, and a
   switched network (NVLink, DCN, InfiniBand).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lab.errors import LabError
from lab.hardware import ChipProfile

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute", "broadcast", "reduce")


@dataclass(frozen=True)
class CollectiveCost:
    """The predicted cost of one collective on N devices.

    `seconds` combines the two terms as its producer's model says: their sum in
    the alpha-beta model (section 1), their maximum in the scaling book's model
    where hops overlap the transfer (section 4).
    """

    kind: str
    algorithm: str
    devices: int
    size_bytes: float  # S, the nccl-tests size
    steps: int  # rounds of messages on the critical path
    bytes_sent: float  # bytes one device puts on its links, forwarding included
    links: int  # links a device drives at once
    latency_s: float  # steps * alpha
    transfer_s: float  # bytes_sent / (links * beta)
    seconds: float


# --- 1. Collectives in the alpha-beta model ---------------------------------


@dataclass(frozen=True)
class _Schedule:
    steps: int
    bytes_per_size: float  # bytes_sent / S
    links: int = 1


def _exact_log2(n: int) -> int:
    if n & (n - 1):
        raise LabError(
            "halving-doubling and recursive-doubling need a power-of-two "
            f"device count, not {n}; use ring (or pad the group)"
        )
    return n.bit_length() - 1


def _ceil_log2(n: int) -> int:
    return (n - 1).bit_length()


def _ring_pass(n: int) -> _Schedule:
    """One pass around a ring: N-1 steps, each shard S/N (TRG ring all-gather: (p-1)a + (p-1)/p nb)."""
    return _Schedule(n - 1, (n - 1) / n)


def _bidirectional_pass(n: int) -> _Schedule:
    """Half the data each way round the ring: every shard goes the short way, floor(N/2) steps on 2 links."""
    return _Schedule(n // 2, (n - 1) / n, links=2)


def _halving_doubling_pass(n: int) -> _Schedule:
    """Recursive halving (reduce-scatter) or doubling (all-gather): TRG lg(p) a + (p-1)/p n b."""
    return _Schedule(_exact_log2(n), (n - 1) / n)


def _twice(schedule: _Schedule) -> _Schedule:
    """All-reduce = reduce-scatter then all-gather (TRG, Rabenseifner's algorithm; scaling book Part 3)."""
    return _Schedule(2 * schedule.steps, 2 * schedule.bytes_per_size, schedule.links)


# (kind, algorithm) -> N -> schedule. Each line cites its formula.
_SCHEDULES: dict[tuple[str, str], Callable[[int], _Schedule]] = {
    # Ring all-reduce (Patarasuk & Yuan 2009; nccl-tests): 2(N-1) steps, 2(N-1)/N * S.
    ("all-reduce", "ring"): lambda n: _twice(_ring_pass(n)),
    ("all-reduce", "bidirectional-ring"): lambda n: _twice(_bidirectional_pass(n)),
    # Rabenseifner (TRG): 2 lg(p) a + 2 (p-1)/p n b.
    ("all-reduce", "halving-doubling"): lambda n: _twice(_halving_doubling_pass(n)),
    # Recursive doubling (TRG): lg(p) (a + n b): the whole buffer at every step.
    ("all-reduce", "recursive-doubling"): lambda n: _Schedule(_exact_log2(n), _exact_log2(n)),
    # Binomial reduce then binomial broadcast (TRG): 2 ceil(lg p) (a + n b).
    ("all-reduce", "binomial-tree"): lambda n: _Schedule(2 * _ceil_log2(n), 2 * _ceil_log2(n)),
    ("all-gather", "ring"): _ring_pass,
    ("all-gather", "bidirectional-ring"): _bidirectional_pass,
    ("all-gather", "halving-doubling"): _halving_doubling_pass,
    ("reduce-scatter", "ring"): _ring_pass,
    ("reduce-scatter", "bidirectional-ring"): _bidirectional_pass,
    ("reduce-scatter", "halving-doubling"): _halving_doubling_pass,
    # Pairwise exchange (TRG): N-1 steps, one S/N block to each peer.
    ("all-to-all", "direct"): lambda n: _Schedule(n - 1, (n - 1) / n),
    # On a ring each block is forwarded hop by hop: S/N * (1 + 2 + ... + N-1) = S (N-1)/2.
    ("all-to-all", "ring"): lambda n: _Schedule(n - 1, (n - 1) / 2),
    # Each block goes the short way: S/N * sum_d min(d, N-d) = S/N * floor(N^2/4) (scaling book Part 3 footnote).
    ("all-to-all", "bidirectional-ring"): lambda n: _Schedule(n // 2, (n * n // 4) / n, links=2),
    ("collective-permute", "direct"): lambda n: _Schedule(1, 1.0) if n > 1 else _Schedule(0, 0.0),
    # Binomial tree (TRG): ceil(lg p) (a + n b); the root sends the whole buffer at every step.
    ("broadcast", "binomial-tree"): lambda n: _Schedule(_ceil_log2(n), _ceil_log2(n)),
    # van de Geijn, binomial scatter + ring all-gather (TRG): (lg p + p - 1) a + 2 (p-1)/p n b.
    ("broadcast", "scatter-allgather"): lambda n: _Schedule(_ceil_log2(n) + n - 1, 2 * (n - 1) / n),
    ("reduce", "binomial-tree"): lambda n: _Schedule(_ceil_log2(n), _ceil_log2(n)),
    # Rabenseifner reduce, recursive-halving reduce-scatter + binomial gather (TRG): 2 lg p a + 2 (p-1)/p n b.
    ("reduce", "halving-doubling"): lambda n: _twice(_halving_doubling_pass(n)),
}


def algorithms_for(kind: str) -> tuple[str, ...]:
    """The algorithms this module knows for a collective kind."""
    _check_kind(kind)
    return tuple(algorithm for known_kind, algorithm in _SCHEDULES if known_kind == kind)


def collective_cost(
    kind: str, size_bytes: float, devices: int, *, algorithm: str, alpha: float, beta: float
) -> CollectiveCost:
    """Alpha-beta cost of `kind` on `devices` devices: steps * alpha + bytes_sent / (links * beta).

    `size_bytes` is the nccl-tests size S; `alpha` is seconds per message and
    `beta` bytes/s per link per direction.
    """
    _check_kind(kind)
    _check_count_and_size(devices, size_bytes)
    if alpha < 0 or beta <= 0:
        raise LabError(f"alpha must be >= 0 seconds and beta > 0 bytes/s, got alpha={alpha}, beta={beta}")
    if (kind, algorithm) not in _SCHEDULES:
        raise LabError(f"no algorithm {algorithm!r} for {kind}; use one of {', '.join(algorithms_for(kind))}")
    schedule = _SCHEDULES[kind, algorithm](devices)
    bytes_sent = schedule.bytes_per_size * size_bytes
    latency_s, transfer_s = schedule.steps * alpha, bytes_sent / (schedule.links * beta)
    return CollectiveCost(
        kind,
        algorithm,
        devices,
        size_bytes,
        schedule.steps,
        bytes_sent,
        schedule.links,
        latency_s,
        transfer_s,
        latency_s + transfer_s,
    )


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise LabError(f"unknown collective kind {kind!r}; use one of {', '.join(KINDS)}")


def _check_count_and_size(devices: int, size_bytes: float) -> None:
    if isinstance(devices, bool) or not isinstance(devices, numbers.Integral) or devices < 1:
        raise LabError(f"a collective needs a positive whole number of devices, got {devices!r}")
    if size_bytes < 0:
        raise LabError(f"a collective's size must be >= 0 bytes, got {size_bytes}")


# --- 2. nccl-tests bandwidths (NVIDIA/nccl-tests doc/PERFORMANCE.md) ---------

# busbw = algbw * factor: the factor turns algbw into the per-link rate an ideal
# ring achieves, so busbw can be compared with the hardware's link bandwidth
# whatever N is.
_BUS_FACTORS: dict[str, Callable[[int], float]] = {
    "all-reduce": lambda n: 2 * (n - 1) / n,
    "all-gather": lambda n: (n - 1) / n,
    "reduce-scatter": lambda n: (n - 1) / n,
    "all-to-all": lambda n: (n - 1) / n,
    "collective-permute": lambda n: 1.0,  # nccl-tests sendrecv
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
}


def bus_bandwidth_factor(kind: str, devices: int) -> float:
    """nccl-tests' busbw/algbw factor: 2(N-1)/N for all-reduce, (N-1)/N for gather/scatter/all-to-all, else 1."""
    _check_kind(kind)
    _check_count_and_size(devices, 0)
    return _BUS_FACTORS[kind](devices)


def algorithm_bandwidth(size_bytes: float, seconds: float) -> float:
    """nccl-tests algbw = S / t, bytes per second."""
    if seconds <= 0:
        raise LabError(f"a bandwidth needs a positive time, got {seconds} s")
    return size_bytes / seconds


def bus_bandwidth(kind: str, size_bytes: float, seconds: float, devices: int) -> float:
    """nccl-tests busbw = algbw * factor(kind, N), bytes per second."""
    return algorithm_bandwidth(size_bytes, seconds) * bus_bandwidth_factor(kind, devices)


# --- 3. The latency-bandwidth crossover --------------------------------------


def crossover_bytes(
    kind: str, few_steps: str, bandwidth_optimal: str, devices: int, *, alpha: float, beta: float
) -> float:
    """The size S* below which algorithm `few_steps` is faster than `bandwidth_optimal`.

    Both costs are lines in S: k*alpha + c*S/beta, with c = bytes_per_size / links.
    They cross at S* = alpha * beta * (k_b - k_f) / (c_f - c_b). For all-reduce,
    recursive doubling (k = log2 N, c = log2 N) against the ring
    (k = 2(N-1), c = 2(N-1)/N) gives
        S* = alpha * beta * (2(N-1) - log2 N) / (log2 N - 2(N-1)/N),
    which is why MPICH uses recursive doubling only for short messages (TRG).
    Returns inf when `few_steps` is never slower (e.g. Rabenseifner's
    halving-doubling against the ring: fewer steps, the same bytes; in practice
    link contention on a ring or torus, which this model leaves out, is what
    makes the ring win for large sizes), and 0 when it is never faster.
    """
    _check_count_and_size(devices, 0)
    few = collective_cost(kind, 1.0, devices, algorithm=few_steps, alpha=alpha, beta=beta)
    wide = collective_cost(kind, 1.0, devices, algorithm=bandwidth_optimal, alpha=alpha, beta=beta)
    latency_saved = wide.latency_s - few.latency_s
    transfer_lost_per_byte = few.transfer_s - wide.transfer_s  # S = 1 byte above
    if transfer_lost_per_byte <= 0:  # never slower per byte: faster everywhere if it also saves steps
        return math.inf if latency_saved > 0 or (latency_saved == 0 and transfer_lost_per_byte < 0) else 0.0
    return max(latency_saved, 0.0) / transfer_lost_per_byte


# --- 4. Collectives on a chip's network (scaling book, Part 3) ----------------

_NETWORK_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


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
    however the slice is wired: `lab.topology.placement` gives extents and wraps.
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
    bytes_sent = _SCHEDULES[kind, algorithm](devices).bytes_per_size * size_bytes
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
    schedule = _SCHEDULES[kind, algorithm](devices)
    return _overlapped(
        kind,
        algorithm,
        devices,
        size_bytes,
        schedule.steps,
        schedule.bytes_per_size * size_bytes,
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
    if kind not in _NETWORK_KINDS:
        raise LabError(
            f"no network formula for {kind} (XLA emits none); use collective_cost, "
            f"or one of {', '.join(_NETWORK_KINDS)}"
        )


# --- 5. Mixture of experts: capacity, all-to-all traffic, balance loss -------
#
# An MoE layer with E experts split over an expert-parallel (EP) group of N
# devices routes each token to k experts. Each device sends every token's k
# copies to the devices that hold the chosen experts (dispatch) and receives
# the results back (combine): two all-to-alls per layer in the forward pass.


def expert_capacity(tokens: int, experts: int, top_k: int, capacity_factor: float) -> int:
    """Slots in each expert's buffer for one group of `tokens`: ceil(tokens · k / E · capacity_factor).

    Switch Transformer (Fedus et al. 2021, arXiv:2101.03961, eq. 3): expert
    capacity = (tokens per batch / number of experts) · capacity factor, for
    k = 1; GShard (Lepikhin et al. 2020, arXiv:2006.16668, Algorithm 1) uses
    2·S/E for top-2, i.e. the k·S/E generalisation. The Switch example:
    4096 tokens, 64 experts, factor 1.25 -> 80 slots. Tokens beyond an
    expert's capacity are dropped (they skip the layer through the residual).
    """
    _check_moe(tokens, experts, top_k)
    if not capacity_factor > 0:
        raise LabError(
            f"capacity factor {capacity_factor}: must be > 0 (1.0 = exactly "
            "the mean load; use None in the layer for no dropping)"
        )
    return math.ceil(tokens * top_k / experts * capacity_factor)


@dataclass(frozen=True)
class AllToAllTraffic:
    """Elements one device's dispatch + combine move, for `tokens` tokens on that device.

    The quick reference's 2·B·L·d·k is `elements` summed over the EP group
    (B·L = all the group's tokens). A fraction (N-1)/N of it crosses devices
    when experts are chosen uniformly (a token's expert is local with
    probability 1/N). Static shapes pad each expert's buffer to its capacity
    C, so what an XLA all-to-all really carries is E·C·d per device and
    direction: `padded_elements`, larger by E·C / (tokens·k), about the
    capacity factor (E/k with no dropping, when C = tokens).
    """

    tokens: int
    d_model: int
    experts: int
    top_k: int
    devices: int
    capacity: int

    @property
    def elements(self) -> int:
        """2 · tokens · k · d: every routed copy goes out (dispatch) and comes back (combine)."""
        return 2 * self.tokens * self.top_k * self.d_model

    @property
    def padded_elements(self) -> int:
        """2 · E · C · d: the two all-to-all buffers as compiled, padded to capacity."""
        return 2 * self.experts * self.capacity * self.d_model

    @property
    def cross_device_fraction(self) -> float:
        """(N-1)/N: the share of an all-to-all buffer that leaves the device (nccl-tests' all-to-all factor)."""
        return (self.devices - 1) / self.devices

    @property
    def padding_factor(self) -> float:
        return self.padded_elements / self.elements


def moe_traffic(
    tokens: int, d_model: int, experts: int, top_k: int, devices: int, capacity_factor: float | None = None
) -> AllToAllTraffic:
    """Dispatch + combine traffic per device for `tokens` tokens per device on an EP group of `devices`.

    `capacity_factor=None` means no dropping: every expert's buffer must hold
    all of a device's tokens (C = tokens), since any expert may get them all.
    """
    _check_moe(tokens, experts, top_k)
    _check_count_and_size(devices, 0)
    if experts % devices:
        raise LabError(f"{experts} experts do not split over {devices} devices; use a multiple of {devices} experts")
    capacity = (
        tokens if capacity_factor is None else min(tokens, expert_capacity(tokens, experts, top_k, capacity_factor))
    )
    return AllToAllTraffic(tokens, d_model, experts, top_k, devices, capacity)


def switch_aux_loss_range(experts: int, alpha: float = 1.0) -> tuple[float, float]:
    """The Switch load-balancing loss α·N·Σ f_i·P_i at perfect balance and at full collapse: (α, α·N).

    Fedus et al. 2021, eq. 4-6: f_i is the share of tokens sent to expert i,
    P_i the router's mean probability for it. Balanced, f_i = P_i = 1/N and
    α·N·N·(1/N)² = α; collapsed onto one expert, f = P = 1 there and the loss
    is α·N. The sum Σ f_i·P_i alone runs from 1/N to 1 (the quick
    reference's numbers); the factor N keeps the balanced loss at α whatever
    the number of experts.
    """
    _check_moe(1, experts, 1)
    return alpha, alpha * experts


def dropped_share(loads: Sequence[float], capacity: float) -> float:
    """Share of routed assignments that find their expert full: Σ_i max(0, n_i - C) / Σ_i n_i.

    `loads` are the assignments each expert (or expert replica) receives from
    one group; C is its capacity (`expert_capacity`). Dropping is per expert:
    idle slots elsewhere do not absorb an overflow (Switch Transformer §2.2).
    """
    total = sum(loads)
    if total <= 0 or capacity < 0:
        raise LabError(
            f"dropped share needs a positive load and a capacity >= 0, got {total} assignments and capacity {capacity}"
        )
    return sum(max(0.0, n - capacity) for n in loads) / total


def capacity_factor_to_drop_nothing(max_load: float, tokens: int, experts: int, top_k: int) -> float:
    """The capacity factor at which the busiest expert fits: n_max · E / (tokens · k), inverting `expert_capacity`.

    A hot expert with a share h of the tokens (top-1) needs cf = h·E: every
    other expert's buffer grows with it, since capacity is one number for all.
    """
    _check_moe(tokens, experts, top_k)
    return max_load * experts / (tokens * top_k)


def _check_moe(tokens: int, experts: int, top_k: int) -> None:
    if experts < 1 or tokens < 1:
        raise LabError(f"an MoE layer needs at least one expert and one token, got {experts} experts, {tokens} tokens")
    if not 1 <= top_k <= experts:
        raise LabError(f"top-k {top_k} with {experts} experts: k must be between 1 and the number of experts")


# --- 6. When sharded training stays compute-bound (scaling book, Part 5) -----
# Source: "How to Scale Your Model", Part 5 "How to Parallelize a Transformer
# for Training" (jax-ml/scaling-book training.md). alpha = C / W_ici is the
# chip's FLOPs per byte of bidirectional ICI bandwidth on one torus axis
# (2550 on TPU v5p); M_X, M_Y count the torus axes a mesh axis spans.


def ici_arithmetic_intensity(chip: ChipProfile) -> float:
    """alpha = C / W_ici, with W_ici = both directions of one axis's link (v5p: 4.59e14 / 1.8e11 = 2550)."""
    return chip.peak_bf16_flops / (2 * chip.link_bandwidth)


def data_parallel_min_batch_per_chip(chip: ChipProfile, axes_spanned: int = 1) -> float:
    """DP and FSDP are compute-bound while tokens per chip B/N > alpha / M_X (v5p, 3 axes: 850)."""
    return ici_arithmetic_intensity(chip) / axes_spanned


def tensor_parallel_max_ways(chip: ChipProfile, mlp: int, axes_spanned: int = 1) -> float:
    """Tensor parallelism over Y chips stays compute-bound while Y < M_Y * F / alpha."""
    return axes_spanned * mlp / ici_arithmetic_intensity(chip)


def fsdp_tp_min_batch_per_chip(chip: ChipProfile, mlp: int, fsdp_axes: int, tp_axes: int) -> float:
    """FSDP x TP is compute-bound while B/N > 4 alpha^2 / (M_X M_Y F) (about 400 tokens for F = 32k on v5p).

    Earlier versions of the book wrote alpha^2 / (M_X M_Y F); the current one
    carries the factor 4 from counting both the forward and backward gathers.
    """
    alpha = ici_arithmetic_intensity(chip)
    return 4 * alpha**2 / (fsdp_axes * tp_axes * mlp)


def fsdp_tp_optimal_fsdp_ways(batch_tokens: float, mlp: int, chips: int, fsdp_axes: int = 1, tp_axes: int = 1) -> float:
    """The FSDP degree that minimises communication: X_opt = sqrt((B / F) (M_X / M_Y) N)."""
    return math.sqrt(batch_tokens / mlp * fsdp_axes / tp_axes * chips)


# --- ZeRO: model-state memory and data-parallel traffic -----------------------
#
# Rajbhandari, Rasley, Ruwase & He (2020), "ZeRO: Memory Optimizations Toward
# Training Trillion Parameter Models", SC20, arXiv:1910.02054 (the ZeRO paper).

ZERO_STAGES = (0, 1, 2, 3)  # 0 is plain data parallelism (DDP)


@dataclass(frozen=True)
class ModelStateBytes:
    """Bytes per device of the three model states ZeRO partitions."""

    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


def zero_model_states(
    stage: int,
    parameters: float,
    devices: int,
    *,
    param_bytes: float = 2,
    grad_bytes: float = 2,
    optimizer_bytes: float = 12,
) -> ModelStateBytes:
    """Model-state memory per device under ZeRO stage 0-3 (ZeRO paper, Section 5 and Figure 1).

    Mixed-precision Adam keeps bf16/fp16 parameters and gradients (2Ψ + 2Ψ
    bytes) and K = 12 bytes per parameter of optimizer state (fp32 master
    weights, momentum, variance). Each stage divides one more term by the
    data-parallel degree N:
        stage 0: (2 + 2 + K) Ψ          stage 1: 2Ψ + 2Ψ + KΨ/N
        stage 2: 2Ψ + (2 + K) Ψ/N       stage 3: (2 + 2 + K) Ψ/N
    """
    if stage not in ZERO_STAGES:
        raise LabError(f"ZeRO stage {stage!r}: use 0 (DDP), 1, 2 or 3")
    _check_count_and_size(devices, parameters)
    share = lambda partitioned: 1 / devices if partitioned else 1.0
    return ModelStateBytes(
        params=param_bytes * parameters * share(stage >= 3),
        grads=grad_bytes * parameters * share(stage >= 2),
        optimizer=optimizer_bytes * parameters * share(stage >= 1),
    )


def zero_step_collectives(stage: int, model_bytes: float, *, regathered_bytes: float | None = None) -> dict[str, float]:
    """S (nccl-tests size) moved per step by each collective kind, for a model of `model_bytes`.

    ZeRO paper, Section 7: data parallelism all-reduces the gradients (S = Ψ);
    stages 1 and 2 reduce-scatter the gradients and all-gather the updated
    parameters (the two halves of that all-reduce: the same volume, 7.2.1);
    stage 3 all-gathers the parameters before the forward pass and again before
    the backward pass, and reduce-scatters the gradients (7.2.2). Whatever is
    kept gathered from forward to backward (`regathered_bytes` smaller than
    `model_bytes`; 0 for PyTorch FSDP's reshard_after_forward=False) is not
    gathered twice.
    """
    if stage not in ZERO_STAGES:
        raise LabError(f"ZeRO stage {stage!r}: use 0 (DDP), 1, 2 or 3")
    if stage == 0:
        return {"all-reduce": model_bytes}
    if stage in (1, 2):
        return {"reduce-scatter": model_bytes, "all-gather": model_bytes}
    regathered = model_bytes if regathered_bytes is None else regathered_bytes
    return {"all-gather": model_bytes + regathered, "reduce-scatter": model_bytes}


def step_wire_bytes(collectives: dict[str, float], devices: int) -> float:
    """Bytes each device sends per step on a ring: sum of S * busbw factor (2(N-1)/N for all-reduce, (N-1)/N else).

    With it, DDP sends 2(N-1)/N Ψ and ZeRO-3 with the backward re-gather
    3(N-1)/N Ψ: 1.5x, the ZeRO paper's "3Ψ versus 2Ψ" (7.2.2), where the
    textbook pairing all-reduce = reduce-scatter + all-gather gives "the same 2Ψ".
    """
    return sum(size * bus_bandwidth_factor(kind, devices) for kind, size in collectives.items())


# --- Overlapping communication with compute, and gradient buckets -------------
# Compute and communication that wait for each other cost C + T; run at once
# they cost max(C, T) (Narayanan et al. 2019, PipeDream, SOSP, Section 2;
# the scaling book, Part 3, "overlapping communication"): overlap hides
# min(C, T) and removes no bytes.


@dataclass(frozen=True)
class OverlapTime:
    """A step of `compute_s` and `comm_s`, serial against overlapped."""

    compute_s: float
    comm_s: float

    @property
    def serial_s(self) -> float:
        return self.compute_s + self.comm_s

    @property
    def overlapped_s(self) -> float:
        return max(self.compute_s, self.comm_s)

    @property
    def hidden_s(self) -> float:
        return min(self.compute_s, self.comm_s)

    @property
    def exposed_s(self) -> float:
        """Communication still on the critical path once overlapped: max(0, T - C)."""
        return self.overlapped_s - self.compute_s

    @property
    def speedup(self) -> float:
        return self.serial_s / self.overlapped_s if self.overlapped_s else 1.0


def overlap_time(compute_s: float, comm_s: float) -> OverlapTime:
    """T = C + T_comm without overlap, max(C, T_comm) with it."""
    if compute_s < 0 or comm_s < 0:
        raise LabError(f"times must be >= 0 seconds, got compute {compute_s} and communication {comm_s}")
    return OverlapTime(compute_s, comm_s)


def collective_matmul_time(compute_s: float, step_comm_s: float, devices: int, *, bidirectional: bool = False) -> float:
    """all_gather(X) @ W as N block products on a ring, each step's transfer under the previous product.

    After Wang et al. 2023 ("Overlap Communication with Dependent Computation
    via Decomposition", ASPLOS) and the scaling book, Part 3: N blocks of
    c = C/N each; a ring needs N-1 transfers of one block (t each), so
        T = c + (N-1) * max(c, t),
    against C + (N-1) t for gather-then-multiply. Both directions at once move
    two blocks per step for floor(N/2) steps: T = c + sum over steps of
    max(blocks * c, t). When c < t (the matmul too small to cover a block's
    transfer) the ring is communication-bound and overlap buys little.
    """
    _check_count_and_size(devices, 0)
    if compute_s < 0 or step_comm_s < 0:
        raise LabError(f"times must be >= 0 seconds, got compute {compute_s} and step {step_comm_s}")
    block = compute_s / devices
    if not bidirectional:
        return block + (devices - 1) * max(block, step_comm_s)
    steps = [2 if 2 * s != devices else 1 for s in range(1, devices // 2 + 1)]
    return block + sum(max(blocks * block, step_comm_s) for blocks in steps)


def bucket_count(total_bytes: float, bucket_bytes: float) -> int:
    """ceil(G / b): the all-reduces of gradients G cut into buckets of b (one when b >= G)."""
    if bucket_bytes <= 0:
        raise LabError(f"bucket size {bucket_bytes}: a bucket must hold a positive number of bytes")
    if total_bytes < 0:
        raise LabError(f"gradient bytes must be >= 0, got {total_bytes}")
    return max(1, math.ceil(total_bytes / bucket_bytes))


@dataclass(frozen=True)
class BucketedTime:
    """A data-parallel step whose gradient all-reduce is cut into buckets."""

    buckets: int
    bucket_bytes: float
    comm_s: float  # sum over buckets: n * latency + G * factor / beta
    latency_s: float  # the n * alpha part of comm_s
    backward_s: float
    exposed_s: float  # communication left after the backward pass ends

    @property
    def step_s(self) -> float:
        return self.backward_s + self.exposed_s


def bucketed_allreduce_time(
    grad_bytes: float,
    bucket_bytes: float,
    devices: int,
    *,
    alpha: float,
    beta: float,
    backward_s: float = 0.0,
    overlap: bool = True,
    algorithm: str = "ring",
) -> BucketedTime:
    """Gradients of G bytes all-reduced in buckets of b, during a backward pass of `backward_s`.

    Each bucket is one all-reduce (`collective_cost`), so communication is
        T_comm(b) = n(b) * alpha_AR + G * 2(N-1)/N / beta,   n(b) = ceil(G / b)
    (Li et al. 2020, "PyTorch Distributed", VLDB, Section 3.2.3: the bucket
    size trades launch latency against how early the first all-reduce can
    start). With overlap the backward produces gradients at an even rate,
    bucket i is ready at C * (bytes up to i) / G, buckets go one after another
    on one channel, and the step waits for
        end = max_i (ready_i + sum_{j >= i} t_j),   exposed = end - C,
    whose i = last term is the exposed tail: the last bucket's all-reduce
    starts no earlier than the end of the backward. Without overlap every
    byte is exposed.
    """
    count = bucket_count(grad_bytes, bucket_bytes)
    sizes = [min(bucket_bytes, grad_bytes - k * bucket_bytes) for k in range(count)]
    costs = [collective_cost("all-reduce", s, devices, algorithm=algorithm, alpha=alpha, beta=beta) for s in sizes]
    seconds = [c.seconds for c in costs]
    comm_s, latency_s = sum(seconds), sum(c.latency_s for c in costs)
    if not overlap:
        return BucketedTime(count, bucket_bytes, comm_s, latency_s, backward_s, comm_s)
    ready = [
        backward_s * min(1.0, (k + 1) * bucket_bytes / grad_bytes) if grad_bytes else backward_s for k in range(count)
    ]
    end, after = 0.0, 0.0  # after = sum_{j >= i} t_j, built from the last bucket back
    for k in reversed(range(count)):
        after += seconds[k]
        end = max(end, ready[k] + after)
    return BucketedTime(count, bucket_bytes, comm_s, latency_s, backward_s, max(0.0, end - backward_s))


def optimal_bucket_bytes(grad_bytes: float, backward_s: float, bucket_latency_s: float) -> float:
    """b* = G * sqrt(alpha_AR / C): the bucket that balances waiting for the first bucket against launches.

    In the communication-bound regime the step ends at ready_1 + all
    transfers = (b/G) C + (G/b) alpha_AR + G factor/beta; its derivative
    C/G - G alpha_AR / b^2 vanishes at b* (this lab's derivation from the
    model of `bucketed_allreduce_time`). When compute covers the
    communication the tail (one bucket's all-reduce) is what is left, and
    the best bucket is the smallest that keeps n * alpha_AR hidden.
    """
    if grad_bytes <= 0 or backward_s <= 0 or bucket_latency_s <= 0:
        raise LabError("optimal_bucket_bytes needs positive gradient bytes, backward time and per-bucket latency")
    return grad_bytes * math.sqrt(bucket_latency_s / backward_s)


# --- Pipeline parallelism: bubbles, step time, activations in flight ---------
#
# P stages, m micro-batches, v chunks (virtual stages) per device, F and B the
# forward and backward time of one micro-batch on one whole stage. The
# schedules themselves, and a simulator that checks every formula here, are in
# lab.parallel.pipeline.schedules.


def _check_pipeline(stages: int, micro_batches: int, chunks: int = 1) -> None:
    for name, value in (("stages", stages), ("micro_batches", micro_batches), ("chunks", chunks)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise LabError(f"{name}={value!r}: a pipeline needs a positive whole number of {name.replace('_', '-')}")


def pipeline_bubble_fraction(stages: int, micro_batches: int, chunks: int = 1) -> float:
    """Idle share of the step, equal stages and costs: (P-1) / (v·m + P-1).

    v = 1 is GPipe (Huang et al. 2019, Sec. 2.3: bubble O((K-1)/(M+K-1)))
    and equally 1F1B: with F and B the same on every stage both take
    (m + P - 1)(F + B), since 1F1B only reorders each stage's work
    (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on
    GPU Clusters Using Megatron-LM", Sec. 2.2.1: "the bubble time is the same").
    Interleaving v chunks cuts the bubble *time* to (P-1)(F+B)/v (ibid.,
    Sec. 2.2.2), so of the whole step it is (P-1)/(v·m + P-1).
    """
    _check_pipeline(stages, micro_batches, chunks)
    return (stages - 1) / (chunks * micro_batches + stages - 1)


def pipeline_bubble_ratio(stages: int, micro_batches: int, chunks: int = 1) -> float:
    """Megatron-LM's bubble time over ideal time: (P-1) / (v·m) (Narayanan et al. 2021, Sec. 2.2)."""
    _check_pipeline(stages, micro_batches, chunks)
    return (stages - 1) / (chunks * micro_batches)


def pipeline_step_time(stages: int, micro_batches: int, forward: float, backward: float, chunks: int = 1) -> float:
    """m(F+B) + (P-1)(F+B)/v: the ideal work plus the bubble (equal stages; Narayanan et al. 2021, Sec. 2.2)."""
    _check_pipeline(stages, micro_batches, chunks)
    return (micro_batches + (stages - 1) / chunks) * (forward + backward)


def imbalanced_step_time(forward: Sequence[float], backward: Sequence[float], micro_batches: int) -> float:
    """GPipe with a time per stage: sum_s (F_s + B_s) + (m-1)(max_s F_s + max_s B_s).

    Each phase is a flow shop of m identical jobs through the stages in order,
    whose makespan is the sum of the stage times plus m-1 times the slowest
    one (Johnson 1954; Pinedo, "Scheduling", 2016, Sec. 6.1): the slowest
    stage sets the pace, the others wait for it.
    """
    _check_pipeline(len(forward), micro_batches)
    if len(forward) != len(backward):
        raise LabError(f"give one backward time per stage: {len(forward)} forward, {len(backward)} backward")
    return sum(forward) + sum(backward) + (micro_batches - 1) * (max(forward) + max(backward))


def zero_bubble_h1_step_time(
    stages: int, micro_batches: int, forward: float, input_grad: float, weight_grad: float
) -> float:
    """ZB-H1: m(F+I+W) + (P-1)(F+I-W), for m >= P (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", Sec. 3.1).

    I is the input-gradient half of the backward and W the weight-gradient
    half; 1F1B's bubble is (P-1)(F+I+W), so with F = I = W ZB-H1 keeps a third of it.
    """
    _check_pipeline(stages, micro_batches)
    if micro_batches < stages:
        raise LabError(
            f"the ZB-H1 formula assumes m >= P; got m={micro_batches}, P={stages} (simulate the schedule instead)"
        )
    return micro_batches * (forward + input_grad + weight_grad) + (stages - 1) * (forward + input_grad - weight_grad)


def peak_micro_batches_in_flight(
    schedule: str, stages: int, micro_batches: int, stage: int = 0, chunks: int = 1
) -> float:
    """Micro-batches whose activations stage `stage` holds at once, in units of one whole stage's activations.

    * gpipe: all m (every forward runs before the first backward);
    * 1f1b: min(P - s, m): P - 1 - s warm-up forwards plus the one in steady
      state (Narayanan et al. 2021, "Memory-Efficient Pipeline-Parallel DNN
      Training", Sec. 3.2): bounded by P, not m;
    * interleaved: device d warms up with 2(P-1-d) + (v-1)P chunk forwards
      (Megatron-LM's schedule), one more in steady state, each 1/v of a stage:
      min(m, P + (P-1-2d)/v): a little more than 1F1B;
    * zb-h1: P on every stage for m >= P (1F1B's P - s plus the s weight
      gradients held back).
    """
    _check_pipeline(stages, micro_batches, chunks)
    if not 0 <= stage < stages:
        raise LabError(f"stage {stage} is not one of the {stages} stages (0 to {stages - 1})")
    peaks = {
        "gpipe": lambda: float(micro_batches),
        "1f1b": lambda: float(min(stages - stage, micro_batches)),
        "interleaved": lambda: min(float(micro_batches), stages + (stages - 1 - 2 * stage) / chunks),
        "zb-h1": lambda: float(min(stages, micro_batches)),
    }
    if schedule not in peaks:
        raise LabError(f"unknown pipeline schedule {schedule!r}; use one of {', '.join(peaks)}")
    return peaks[schedule]()


def optimal_micro_batches(stages: int, work_s: float, overhead_s: float) -> float:
    """The m that minimises (m + P - 1)(W/m + c): m* = sqrt((P-1) W / c).

    Splitting a fixed batch whose forward and backward take W per stage into m
    micro-batches makes each tick W/m of work plus a fixed cost c (launch,
    send, bookkeeping), over m + P - 1 ticks per direction. More micro-batches
    shrink the bubble (the (P-1) W/m term) but pay c once more each (the m·c
    term); the two balance at m*. The same square root as the gradient-bucket
    optimum above, from the same trade.
    """
    _check_pipeline(stages, 1)
    if work_s <= 0 or overhead_s <= 0:
        raise LabError("optimal_micro_batches needs a positive work time and a positive per-micro-batch overhead")
    return math.sqrt((stages - 1) * work_s / overhead_s)


# --- Activation memory under tensor and sequence parallelism -----------------
# Source: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
# Transformer Models" (arXiv:2205.05198), Section 4, eqs. (1)-(3). Bytes kept for
# the backward pass by one transformer layer, 16-bit activations: s sequence,
# b micro-batch, h hidden, a heads, t tensor-parallel ways. The 34 is
# attention 11sbh + MLP 19sbh + two layer norms 4sbh; 5as^2b is the softmax
# output (2), its dropout mask (1) and dropout output (2). Without dropout the
# three sbh-sized masks-and-outputs vanish: 34 -> 32 (mask bytes sbh in attention
# and in the MLP) and 5 -> 2, and TP's unsplit 10 -> 8.


def activation_bytes_per_layer(
    seq: int,
    batch: int,
    hidden: int,
    heads: int,
    tensor: int = 1,
    *,
    sequence_parallel: bool = False,
    dropout: bool = True,
) -> float:
    """Korthikanti et al. 2022: sbh(34 + 5as/h) alone, sbh(10 + 24/t + 5as/(ht)) with TP, sbh(34 + 5as/h)/t with TP+SP.

    With TP alone the 10sbh of the layer norms, the inputs of the first
    matmuls and the dropout masks stay whole on every device; SP splits them
    along the sequence too, so everything is divided by t.
    """
    if min(seq, batch, hidden, heads, tensor) < 1:
        raise LabError(
            f"activation memory needs positive sizes, got s={seq}, b={batch}, h={hidden}, a={heads}, t={tensor}"
        )
    whole, split, attention = (10, 24, 5) if dropout else (8, 24, 2)
    sbh = seq * batch * hidden
    if sequence_parallel:
        return sbh * (whole + split + attention * heads * seq / hidden) / tensor
    return sbh * (whole + split / tensor + attention * heads * seq / (hidden * tensor))
