"""Timing: warm up, block until ready, report the median with its spread.

Emulated CPU devices share this machine's cores, and the machines are shared
and noisy: a single timing means little. Every timing here is the median of
several repeats after warm-up, reported with min and max, and compared with
others only as a ratio measured in the same run. Tests never assert timings;
benchmarks measure them.

Sizes for sweeps are read by `lab.units` (nccl-tests' ``-b 1K -e 64M -f 2``).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import jax
import numpy as np

from lab import hlo, theory
from lab.collectives import build_program
from lab.mesh import AXES


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


def time_interleaved(
    calls: dict[str, tuple[Callable, tuple]], *, repeats: int = 5, warmup: int = 1, min_seconds: float = 0.0
) -> dict[str, Timing]:
    """Time several programs round-robin: one call of each per round, `repeats` rounds.

    On a shared machine the load drifts during a measurement; taking turns
    spreads the drift over every variant alike, so their ratios stay fair,
    which timing each variant in one block does not. With `min_seconds`, keeps
    going round until that much time was spent, so microsecond-scale programs
    get enough rounds.
    """
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for fn, args in calls.values():
        time_fn(fn, *args, warmup=warmup, repeats=1)
    started = time.perf_counter()
    rounds = 0
    while rounds < repeats or time.perf_counter() - started < min_seconds:
        rounds += 1
        for name, (fn, args) in calls.items():
            samples[name].append(time_fn(fn, *args, warmup=0, repeats=1).median)
    return {name: Timing(statistics.median(s), min(s), max(s), len(s)) for name, s in samples.items()}


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


def measure_collective(
    op: str, mesh, axes, size: int, *, dtype: str = "float32", warmup: int = 1, repeats: int = 5
) -> SweepPoint:
    """Compile collective `op` over `axes` for S = `size` bytes, check every element, time it."""
    program = build_program(op, mesh, axes)
    compiled = program.fn.lower(program.abstract_input(size, np.dtype(dtype))).compile()
    found, _ = hlo.parse_collectives(compiled.as_text(), mesh.devices.shape, mesh.axis_names)
    x = program.example_input(size, np.dtype(dtype))
    placed = program.place(x)
    wrong = int(np.sum(np.asarray(compiled(placed)) != program.reference(x)))
    timing = time_fn(compiled, placed, warmup=warmup, repeats=repeats, min_seconds=0.02)
    n = program.group_size
    return SweepPoint(
        op,
        size,
        size // np.dtype(dtype).itemsize,
        dtype,
        n,
        timing,
        theory.algorithm_bandwidth(size, timing.median),
        theory.bus_bandwidth(op, size, timing.median, n),
        wrong,
        found,
    )


def crossover(xs, ratios) -> float | None:
    """The x (interpolated on log scales) where a ratio first falls from >= 1 to < 1; None if it never does.

    The crossover of two measured curves a(x), b(x) is ``crossover(xs, a / b)``:
    where b overtakes a.
    """
    logs = np.log(np.asarray(ratios, dtype=float))
    for i in range(1, len(xs)):
        if logs[i - 1] >= 0 > logs[i]:
            w = logs[i - 1] / (logs[i - 1] - logs[i])
            return float(math.exp(math.log(xs[i - 1]) + w * (math.log(xs[i]) - math.log(xs[i - 1]))))
    return None


def parse_benchmark(lines: int = 100_000) -> float:
    """Seconds `parse_collectives` takes on a synthetic TPU-like module of about `lines` lines."""
    block = [
        "  %fusion.{i} = bf16[64,2048]{{1,0:T(8,128)(2,1)}} fusion(%copy-done.{i}, "
        "%all-gather.{i}), kind=kOutput, calls=%fused_computation.{i}, "
        'metadata={{op_name="jit(step)/dot_general"}}',
        "  %all-gather.{i} = bf16[1024,2048]{{1,0:T(8,128)(2,1)}} all-gather(%param.{i}), "
        "channel_id={i}, replica_groups=[4,2]<=[4,2]T(1,0), dimensions={{0}}, "
        'use_global_device_ids=true, metadata={{op_name="jit(step)/all_gather"}}',
        "  %copy-start.{i} = (bf16[64,1024]{{1,0}}, bf16[64,1024]{{1,0}}, u32[]{{:S(2)}}) copy-start(%param.{i})",
        "  %copy-done.{i} = bf16[64,1024]{{1,0}} copy-done(%copy-start.{i})",
        "  %all-reduce.{i} = (bf16[2048,512]{{1,0}}, bf16[512,2048]{{1,0}}) "
        "all-reduce(%fusion.{i}, %copy-done.{i}), channel_id={i}, replica_groups=mesh['axis_0'=4,'axis_1'=2] "
        "{{'axis_1'}}, use_global_device_ids=true, to_apply=%add",
    ] + [
        "  %add.{i}" + f"_{k}" + ' = f32[128,128]{{1,0}} add(%p.{i}, %q.{i}), metadata={{op_name="jit(step)/add"}}'
        for k in range(15)
    ]
    body = "\n".join(line.format(i=i) for i in range(max(1, lines // len(block))) for line in block)
    text = f"HloModule bench, num_partitions=8\n\nENTRY %main (p: f32[8]) -> f32[8] {{\n{body}\n}}\n"
    start = time.perf_counter()
    hlo.parse_collectives(text, (2, 1, 2, 1, 2), AXES)
    return time.perf_counter() - start
