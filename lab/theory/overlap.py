"""Overlapping communication with compute: serial against overlapped, collective matmuls, gradient buckets.

Compute and communication that wait for each other cost C + T; run at once
they cost max(C, T) (Narayanan et al. 2019, PipeDream, SOSP, Section 2; the
scaling book, Part 3, "overlapping communication"): overlap hides min(C, T)
and removes no bytes. Two ways to get there: decompose a collective and the
matmul that consumes it into blocks on a ring (Wang et al. 2023, ASPLOS),
and cut the gradient all-reduce into buckets that start while the backward
pass is still running (Li et al. 2020, "PyTorch Distributed", VLDB). Each
bucket is one all-reduce priced by `lab.theory.collectives.collective_cost`.
The collective matmul itself is in `lab.parallel.collective_matmul`, and what a compiled schedule hides in
`lab.hlo.schedule`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lab.errors import LabError
from lab.theory.collectives import _check_count_and_size, collective_cost


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
    priced = {
        s: collective_cost("all-reduce", s, devices, algorithm=algorithm, alpha=alpha, beta=beta) for s in set(sizes)
    }
    costs = [priced[s] for s in sizes]  # every bucket but the last has one size: price each size once
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
