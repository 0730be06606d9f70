"""Timing: warm up, block until ready, report the median with its spread.

Emulated CPU devices share this machine's cores, and the machines are shared
and noisy: a single timing means little. Every timing here is the median of
several repeats after warm-up, reported with min and max, and compared with
others only as a ratio measured in the same run. Tests never assert timings;
benchmarks measure them.

Sizes for sweeps follow nccl-tests: ``-b 1K -e 64M -f 2`` means from 1 KiB to
64 MiB, each size twice the previous.
"""

from __future__ import annotations

import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import jax

from lab.errors import LabError

_UNITS = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30}


@dataclass(frozen=True)
class Timing:
    """Seconds per call: median and spread over `repeats` timed calls."""

    median: float
    min: float
    max: float
    repeats: int

    @property
    def spread(self) -> float:
        """(max - min) / median: how noisy the measurement was."""
        return (self.max - self.min) / self.median if self.median else 0.0

    def __str__(self) -> str:
        return f"{self.median * 1e3:.3f} ms [{self.min * 1e3:.3f}, {self.max * 1e3:.3f}]"


def time_fn(fn: Callable, *args, warmup: int = 2, repeats: int = 10, min_seconds: float = 0.0) -> Timing:
    """Time ``fn(*args)`` until its outputs are ready; median of `repeats` after `warmup` calls.

    With `min_seconds`, keeps repeating until that much time was spent, so
    microsecond-scale calls get enough samples.
    """
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    samples: list[float] = []
    started = time.perf_counter()
    while len(samples) < repeats or time.perf_counter() - started < min_seconds:
        begin = time.perf_counter()
        jax.block_until_ready(fn(*args))
        samples.append(time.perf_counter() - begin)
    return Timing(statistics.median(samples), min(samples), max(samples), len(samples))


def time_interleaved(calls: dict[str, tuple[Callable, tuple]], *, repeats: int = 5, warmup: int = 1) -> dict[str, Timing]:
    """Time several programs round-robin: one call of each per round, `repeats` rounds.

    On a shared machine the load drifts during a measurement; taking turns
    spreads the drift over every variant alike, so their ratios stay fair,
    which timing each variant in one block does not.
    """
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for name, (fn, args) in calls.items():
        time_fn(fn, *args, warmup=warmup, repeats=1)
    for _ in range(repeats):
        for name, (fn, args) in calls.items():
            samples[name].append(time_fn(fn, *args, warmup=0, repeats=1).median)
    return {name: Timing(statistics.median(s), min(s), max(s), len(s)) for name, s in samples.items()}


def parse_size(text: str | int) -> int:
    """``"64M"`` -> 67108864 bytes (K, M, G are powers of 1024, as in nccl-tests)."""
    if isinstance(text, int):
        value = text
    else:
        match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(?:i?B)?\s*", str(text), flags=re.IGNORECASE)
        if not match:
            raise LabError(f"size {text!r}: write bytes as a number with an optional K, M or G suffix, e.g. 1K or 64M")
        value = int(match[1]) * _UNITS[match[2].upper()]
    if value <= 0:
        raise LabError(f"size {text!r}: sizes must be positive")
    return value


def size_sweep(begin: str | int, end: str | int, factor: int = 2) -> list[int]:
    """Sizes from `begin` to `end` (inclusive), each `factor` times the previous."""
    low, high = parse_size(begin), parse_size(end)
    if factor < 2:
        raise LabError(f"sweep factor {factor}: must be an integer >= 2 (as in nccl-tests -f 2)")
    if low > high:
        raise LabError(f"sweep from {begin} to {end}: the first size must not exceed the last")
    sizes = [low]
    while sizes[-1] * factor <= high:
        sizes.append(sizes[-1] * factor)
    return sizes


def format_bytes(n: float) -> str:
    """Binary units, the way nccl-tests and XLA print sizes: 1.5 MiB."""
    import humanize

    return humanize.naturalsize(n, binary=True, format="%.3g")


@dataclass(frozen=True)
class SweepPoint:
    """One row of an nccl-tests-style sweep, with what XLA compiled for it."""

    op: str
    size: int  # S per device, nccl-tests convention
    count: int  # elements in S
    dtype: str
    group_size: int
    timing: Timing
    algbw: float  # bytes/s
    busbw: float  # bytes/s
    wrong: int  # elements that differ from the numpy reference, over all devices
    collectives: tuple  # lab.hlo.Collective found in the compiled program


def measure_collective(op: str, mesh, axes, size: int, *, dtype: str = "float32", warmup: int = 1, repeats: int = 5) -> SweepPoint:
    """Compile collective `op` over `axes` for S = `size` bytes, check every element, time it."""
    import numpy as np

    from lab import hlo, theory
    from lab.collectives import build_program

    program = build_program(op, mesh, axes)
    compiled = program.fn.lower(program.abstract_input(size, np.dtype(dtype))).compile()
    found, _ = hlo.parse_collectives(compiled.as_text(), mesh.devices.shape, mesh.axis_names)
    x = program.example_input(size, np.dtype(dtype))
    placed = program.place(x)
    wrong = int(np.sum(np.asarray(compiled(placed)) != program.reference(x)))
    timing = time_fn(compiled, placed, warmup=warmup, repeats=repeats, min_seconds=0.02)
    n = program.group_size
    return SweepPoint(
        op, size, size // np.dtype(dtype).itemsize, dtype, n, timing,
        theory.algorithm_bandwidth(size, timing.median), theory.bus_bandwidth(op, size, timing.median, n), wrong, found,
    )


def crossover(xs, ratios) -> float | None:
    """The x (interpolated on log scales) where a ratio first falls from >= 1 to < 1; None if it never does.

    The crossover of two measured curves a(x), b(x) is ``crossover(xs, a / b)``:
    where b overtakes a.
    """
    import math

    import numpy as np

    logs = np.log(np.asarray(ratios, dtype=float))
    for i in range(1, len(xs)):
        if logs[i - 1] >= 0 > logs[i]:
            w = logs[i - 1] / (logs[i - 1] - logs[i])
            return float(math.exp(math.log(xs[i - 1]) + w * (math.log(xs[i]) - math.log(xs[i - 1]))))
    return None
