"""Collectives in the alpha-beta model: what one all-reduce, all-gather, ... should cost.

1. The alpha-beta (latency-bandwidth) model of Hockney (1994) and Thakur,
   Rabenseifner & Gropp (2005), "Optimization of Collective Communication
   Operations in MPICH" (TRG). A message of n bytes on one link costs
   alpha + n/beta. An algorithm is a sequence of passes: `steps` rounds of
   concurrent messages, and `bytes_sent`, the bytes one device puts on its
   links over the whole collective (forwarded bytes included), over `links`
   links driven at once:  t = steps * alpha + bytes_sent / (links * beta).
   Sizes follow nccl-tests (doc/PERFORMANCE.md): S is the all-reduce buffer,
   the all-gather *output*, the reduce-scatter *input*, the all-to-all
   per-device buffer, and the permute, broadcast or reduce buffer. The
   reduction arithmetic (TRG's gamma term, `bytes_reduced` * gamma seconds
   per byte) is 0 unless `gamma` is given: accelerators overlap it with the
   transfers, but a target that runs it between the sends (emulated CPU
   devices) pays it in full.
2. nccl-tests bandwidths (NVIDIA/nccl-tests doc/PERFORMANCE.md):
   algbw = S/t and busbw = algbw * factor(kind, N).
3. The crossover: the size below which a few-step algorithm beats a
   bandwidth-optimal one.

The same collectives priced on a real chip's network (a TPU torus, NVLink,
DCN) are in `lab.theory.network`, which reuses the byte counts here.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass

from lab.collectives import KINDS
from lab.errors import LabError

# The kinds XLA emits (lab.collectives.KINDS) plus the two MPI collectives TRG
# prices, which XLA has no instruction for.
ALPHA_BETA_KINDS = (*KINDS, "broadcast", "reduce")


@dataclass(frozen=True)
class CollectiveCost:
    """The predicted cost of one collective on N devices.

    `seconds` combines the two terms as its producer's model says: their sum in
    the alpha-beta model (this module), their maximum in the scaling book's model
    where hops overlap the transfer (`lab.theory.network`).
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
    bytes_reduced: float = 0.0  # bytes of S one device adds into a partial sum (TRG's gamma term)
    reduction_s: float = 0.0  # bytes_reduced * gamma


# --- 1. Collectives in the alpha-beta model ---------------------------------


@dataclass(frozen=True)
class _Pass:
    """An algorithm's passes over the data, combined: rounds on the critical path, bytes per byte of S, links,
    and bytes reduced per byte of S (TRG's gamma term)."""

    steps: int
    bytes_per_size: float  # bytes_sent / S
    links: int = 1
    reduced_per_size: float = 0.0  # bytes_reduced / S


def _exact_log2(n: int) -> int:
    if n & (n - 1):
        raise LabError(
            "halving-doubling and recursive-doubling need a power-of-two "
            f"device count, not {n}; use ring (or pad the group)"
        )
    return n.bit_length() - 1


def _ceil_log2(n: int) -> int:
    return (n - 1).bit_length()


def _ring_pass(n: int) -> _Pass:
    """One pass around a ring: N-1 steps, each shard S/N (TRG ring all-gather: (p-1)a + (p-1)/p nb)."""
    return _Pass(n - 1, (n - 1) / n)


def _bidirectional_pass(n: int) -> _Pass:
    """Half the data each way round the ring: every shard goes the short way, floor(N/2) steps on 2 links."""
    return _Pass(n // 2, (n - 1) / n, links=2)


def _halving_doubling_pass(n: int) -> _Pass:
    """Recursive halving (reduce-scatter) or doubling (all-gather): TRG lg(p) a + (p-1)/p n b."""
    return _Pass(_exact_log2(n), (n - 1) / n)


def _reducing(one: _Pass) -> _Pass:
    """A reduce-scatter pass: every byte it receives is added to a partial sum (TRG: (p-1)/p n gamma)."""
    return _Pass(one.steps, one.bytes_per_size, one.links, one.bytes_per_size)


def _twice(one: _Pass) -> _Pass:
    """All-reduce = reduce-scatter then all-gather (TRG, Rabenseifner's algorithm; scaling book Part 3): the
    reduce-scatter pass reduces what it receives, the all-gather pass only copies."""
    return _Pass(2 * one.steps, 2 * one.bytes_per_size, one.links, one.bytes_per_size)


# (kind, algorithm) -> N -> its passes. Each line cites its formula.
_PASSES: dict[tuple[str, str], Callable[[int], _Pass]] = {
    # Ring all-reduce (Patarasuk & Yuan 2009; nccl-tests): 2(N-1) steps, 2(N-1)/N * S.
    ("all-reduce", "ring"): lambda n: _twice(_ring_pass(n)),
    ("all-reduce", "bidirectional-ring"): lambda n: _twice(_bidirectional_pass(n)),
    # Rabenseifner (TRG): 2 lg(p) a + 2 (p-1)/p n b.
    ("all-reduce", "halving-doubling"): lambda n: _twice(_halving_doubling_pass(n)),
    # Recursive doubling (TRG): lg(p) (a + n b + n g): the whole buffer sent and added at every step.
    ("all-reduce", "recursive-doubling"): lambda n: _Pass(_exact_log2(n), _exact_log2(n), 1, _exact_log2(n)),
    # Binomial reduce then binomial broadcast (TRG): 2 ceil(lg p) (a + n b) + ceil(lg p) n g.
    ("all-reduce", "binomial-tree"): lambda n: _Pass(2 * _ceil_log2(n), 2 * _ceil_log2(n), 1, _ceil_log2(n)),
    ("all-gather", "ring"): _ring_pass,
    ("all-gather", "bidirectional-ring"): _bidirectional_pass,
    ("all-gather", "halving-doubling"): _halving_doubling_pass,
    ("reduce-scatter", "ring"): lambda n: _reducing(_ring_pass(n)),
    ("reduce-scatter", "bidirectional-ring"): lambda n: _reducing(_bidirectional_pass(n)),
    ("reduce-scatter", "halving-doubling"): lambda n: _reducing(_halving_doubling_pass(n)),
    # Pairwise exchange (TRG): N-1 steps, one S/N block to each peer.
    ("all-to-all", "direct"): lambda n: _Pass(n - 1, (n - 1) / n),
    # On a ring each block is forwarded hop by hop: S/N * (1 + 2 + ... + N-1) = S (N-1)/2.
    ("all-to-all", "ring"): lambda n: _Pass(n - 1, (n - 1) / 2),
    # Each block goes the short way: S/N * sum_d min(d, N-d) = S/N * floor(N^2/4) (scaling book Part 3 footnote).
    ("all-to-all", "bidirectional-ring"): lambda n: _Pass(n // 2, (n * n // 4) / n, links=2),
    ("collective-permute", "direct"): lambda n: _Pass(1, 1.0) if n > 1 else _Pass(0, 0.0),
    # Binomial tree (TRG): ceil(lg p) (a + n b); the root sends the whole buffer at every step.
    ("broadcast", "binomial-tree"): lambda n: _Pass(_ceil_log2(n), _ceil_log2(n)),
    # van de Geijn, binomial scatter + ring all-gather (TRG): (lg p + p - 1) a + 2 (p-1)/p n b.
    ("broadcast", "scatter-allgather"): lambda n: _Pass(_ceil_log2(n) + n - 1, 2 * (n - 1) / n),
    ("reduce", "binomial-tree"): lambda n: _Pass(_ceil_log2(n), _ceil_log2(n), 1, _ceil_log2(n)),
    # Rabenseifner reduce, recursive-halving reduce-scatter + binomial gather (TRG): 2 lg p a + 2 (p-1)/p n b.
    ("reduce", "halving-doubling"): lambda n: _twice(_halving_doubling_pass(n)),
}


def algorithms_for(kind: str) -> tuple[str, ...]:
    """The algorithms this module knows for a collective kind."""
    _check_kind(kind)
    return tuple(algorithm for known_kind, algorithm in _PASSES if known_kind == kind)


def collective_cost(
    kind: str, size_bytes: float, devices: int, *, algorithm: str, alpha: float, beta: float, gamma: float = 0.0
) -> CollectiveCost:
    """Alpha-beta cost of `kind` on `devices` devices: steps * alpha + bytes_sent / (links * beta), plus
    bytes_reduced * gamma when the reduction arithmetic is not overlapped.

    `size_bytes` is the nccl-tests size S; `alpha` is seconds per message,
    `beta` bytes/s per link per direction, `gamma` seconds per byte added into
    a partial sum (TRG's gamma; 0: hidden behind the transfers).
    """
    _check_kind(kind)
    _check_count_and_size(devices, size_bytes)
    if alpha < 0 or beta <= 0 or gamma < 0:
        raise LabError(
            f"alpha must be >= 0 seconds, beta > 0 bytes/s and gamma >= 0 s/byte, got alpha={alpha}, beta={beta}, "
            f"gamma={gamma}"
        )
    if (kind, algorithm) not in _PASSES:
        raise LabError(f"no algorithm {algorithm!r} for {kind}; use one of {', '.join(algorithms_for(kind))}")
    passes = _PASSES[kind, algorithm](devices)
    bytes_sent, bytes_reduced = passes.bytes_per_size * size_bytes, passes.reduced_per_size * size_bytes
    latency_s, transfer_s = passes.steps * alpha, bytes_sent / (passes.links * beta)
    return CollectiveCost(
        kind,
        algorithm,
        devices,
        size_bytes,
        passes.steps,
        bytes_sent,
        passes.links,
        latency_s,
        transfer_s,
        latency_s + transfer_s + bytes_reduced * gamma,
        bytes_reduced,
        bytes_reduced * gamma,
    )


def _check_kind(kind: str) -> None:
    if kind not in ALPHA_BETA_KINDS:
        raise LabError(f"unknown collective kind {kind!r}; use one of {', '.join(ALPHA_BETA_KINDS)}")


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
    kind: str, few_steps: str, bandwidth_optimal: str, devices: int, *, alpha: float, beta: float, gamma: float = 0.0
) -> float:
    """The size S* below which algorithm `few_steps` is faster than `bandwidth_optimal`.

    Both costs are lines in S: k*alpha + c*S/beta, with c = bytes_per_size / links.
    They cross at S* = alpha * beta * (k_b - k_f) / (c_f - c_b). For all-reduce,
    recursive doubling (k = log2 N, c = log2 N) against the ring
    (k = 2(N-1), c = 2(N-1)/N) gives
        S* = alpha * beta * (2(N-1) - log2 N) / (log2 N - 2(N-1)/N),
    which is why MPICH uses recursive doubling only for short messages (TRG).
    With `gamma`, the per-byte costs include the reduction: c/beta + r*gamma.
    Returns inf when `few_steps` is never slower (e.g. Rabenseifner's
    halving-doubling against the ring: fewer steps, the same bytes; in practice
    link contention on a ring or torus, which this model leaves out, is what
    makes the ring win for large sizes), and 0 when it is never faster.
    """
    _check_count_and_size(devices, 0)
    few = collective_cost(kind, 1.0, devices, algorithm=few_steps, alpha=alpha, beta=beta, gamma=gamma)
    wide = collective_cost(kind, 1.0, devices, algorithm=bandwidth_optimal, alpha=alpha, beta=beta, gamma=gamma)
    latency_saved = wide.latency_s - few.latency_s
    transfer_lost_per_byte = (few.transfer_s + few.reduction_s) - (wide.transfer_s + wide.reduction_s)  # S = 1 byte
    if transfer_lost_per_byte <= 0:  # never slower per byte: faster everywhere if it also saves steps
        return math.inf if latency_saved > 0 or (latency_saved == 0 and transfer_lost_per_byte < 0) else 0.0
    return max(latency_saved, 0.0) / transfer_lost_per_byte
