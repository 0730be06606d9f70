"""Timing the executed pipeline, and a model of the host it runs on.

A pipeline's step time is compared with the ideal (the same work with no
bubble) and with the simulator's prediction. Both need times measured on the
program itself, which `calibration_grid` provides: grids that make chosen
stages run their forwards or backwards back to back, without waiting. Run
through the same compiled step as the real schedule, they measure

* each stage's forward and backward tick when it works alone (as in a bubble),
* the same tick when every stage works at once (as in the steady state),
* an idle tick: the loop's own cost (the exchange and the bookkeeping),
* and, with every stage doing everything, the ideal step.

On real devices, a tick alone and a tick with everyone busy take the same
time. Emulated CPU devices share the host's cores, so with every stage busy a
tick is slower (`StageTimes.sharing`), and a bubble tick, where idle stages
lend their cores to the busy ones, is cheaper than the formula assumes.
`StageTimes.tick` prices a tick on this host: its slowest action alone, plus
what each other busy stage added in the calibration; run over a schedule's
grid (`lab.parallel.pipeline.schedules.lockstep_makespan`) it is the shared-host
estimate that explains what the host measured.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import jax

from lab.bench import Timing
from lab.parallel.pipeline.loop import PipelineProgram, Tables, lower_grid
from lab.parallel.pipeline.schedules import BACKWARD, FORWARD, Action, Costs


def calibration_grid(stages: int, micro_batches: int, chunks: int, busy: tuple[int, ...], kinds: str = "FB"):
    """Stages in `busy` run the `kinds` ("F", "B" or "FB") of every (micro-batch, chunk) back to back; the rest idle.

    With every stage busy and "FB" this is the step's work without its
    bubble: the ideal a pipeline is measured against. With one stage and one
    kind it is that stage's own forward or backward time; with none, the cost
    of the ticks themselves. Nothing waits for its inputs, so the numbers
    computed are meaningless; only the time is.
    """
    work = [Action(FORWARD, i, c) for c in range(chunks) for i in range(micro_batches)] if FORWARD in kinds else []
    work += (
        [Action(BACKWARD, i, c) for c in reversed(range(chunks)) for i in range(micro_batches)]
        if BACKWARD in kinds
        else []
    )
    return tuple(tuple(work) if device in busy else (None,) * len(work) for device in range(stages))


@dataclass(frozen=True)
class StageTimes:
    """Seconds per tick measured on an executed program, from its calibration grids.

    `forward[s]` and `backward[s]` are ticks in which stage s alone works (the
    others idle, as in a bubble); `*_all` are ticks in which every stage works
    at once (as in the steady state).
    """

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    idle: float  # a tick in which no stage works: the loop's own cost
    forward_all: float
    backward_all: float
    call: float  # the step's cost outside its ticks (launch, arguments, results): added once per step
    floored: tuple[str, ...] = ()  # grids no slower than the empty step: floored at the clock's resolution

    def costs(self, chunks: int = 1) -> Costs:
        """The simulator's costs: per stage, its forward and backward alone (v chunk ticks make a whole stage)."""
        return Costs(tuple(f * chunks for f in self.forward), tuple(b * chunks for b in self.backward))

    @property
    def sharing(self) -> float:
        """How much longer a tick takes when every stage works than when one does (1.0: nothing shared)."""
        alone = (sum(self.forward) + sum(self.backward)) / len(self.forward)
        return (self.forward_all + self.backward_all) / alone

    def tick(self, busy: list[tuple[int, Action]]) -> float:
        """A lockstep tick on this host: its slowest action alone, plus what each other busy stage adds.

        What one more busy stage adds is read off the calibration, (all busy -
        alone) / (P - 1) per kind: zero on devices with their own cores. The
        model is exact at both calibration points, one stage and all stages.
        """
        if not busy:
            return self.idle
        stages = len(self.forward)
        alone = {FORWARD: self.forward, BACKWARD: self.backward}
        extra = {
            FORWARD: self.forward_all - statistics.mean(self.forward),
            BACKWARD: self.backward_all - statistics.mean(self.backward),
        }
        slowest = max(busy, key=lambda sa: alone[sa[1].kind][sa[0]])
        others = [a for s, a in busy if (s, a) != slowest]
        return alone[slowest[1].kind][slowest[0]] + sum(extra[a.kind] / max(stages - 1, 1) for a in others)


@dataclass(frozen=True)
class RoundRobin:
    """Samples of several calls timed in turns: round r of every call ran under the same load."""

    samples: dict

    def timing(self, name) -> Timing:
        s = self.samples[name]
        return Timing(statistics.median(s), min(s), max(s), len(s))

    def ratio(self, numerator, denominator) -> float:
        """The median over rounds of numerator / denominator: a ratio whose two sides saw the same load."""
        return statistics.median(a / b for a, b in zip(self.samples[numerator], self.samples[denominator]))


def host_load() -> tuple[float, int]:
    """(the 1-minute load average, the cores this process may use): how busy the host was, to store beside timings."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return os.getloadavg()[0], cores


def load_note(load: float | None = None, cores: int | None = None) -> str:
    """One line on how busy the host was (now, or as `host_load` read it): other processes' work shows in timings."""
    if load is None or cores is None:
        load, cores = host_load()
    return (
        f"The host's load average was {load:.1f} on {cores} cores when the timings finished; "
        "other processes' work shows in every one."
    )


def time_round_robin(calls: dict[str, Callable], repeats: int, warmup: int = 1) -> RoundRobin:
    """Time several calls in turns, so a change in the machine's load hits all of them alike."""
    for call in calls.values():
        for _ in range(warmup):
            jax.block_until_ready(call())
    samples: dict = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            begin = time.perf_counter()
            jax.block_until_ready(call())
            samples[name].append(time.perf_counter() - begin)
    return RoundRobin(samples)


def _timing_only(grid, stages: int, chunks: int) -> Tables:
    """Tables for a grid whose numbers nobody reads: one buffer slot, so it fits any program's buffers.

    Micro-batches then share a slot and overwrite each other, which changes
    the numbers computed but not the work done.
    """
    return dataclasses.replace(lower_grid(grid, stages, chunks), depth=1)


def ideal_tables(stages: int, micro_batches: int, chunks: int = 1) -> Tables:
    """The step's work with no bubble: every stage runs all its forwards, then all its backwards, without waiting."""
    return _timing_only(calibration_grid(stages, micro_batches, chunks, tuple(range(stages)), "FB"), stages, chunks)


def calibration_tables(stages: int, micro_batches: int, chunks: int = 1) -> dict[str, Tables]:
    """The grids `stage_times` reads, lowered.

    Each stage alone per kind, every stage per kind, none, and no ticks at all.
    """
    everyone = tuple(range(stages))
    grids = {
        f"{kind} on stage {s}": calibration_grid(stages, micro_batches, chunks, (s,), kind)
        for s in range(stages)
        for kind in "FB"
    }
    grids |= {
        f"{kind} on every stage": calibration_grid(stages, micro_batches, chunks, everyone, kind) for kind in "FB"
    }
    grids["idle"] = calibration_grid(stages, micro_batches, chunks, (), "F")
    grids["no ticks"] = tuple(() for _ in range(stages))
    return {name: _timing_only(grid, stages, chunks) for name, grid in grids.items()}


RESOLUTION = time.get_clock_info("perf_counter").resolution  # the smallest difference the timing clock can tell


def stage_times(timings: RoundRobin, tables: dict[str, Tables | int], stages: int) -> StageTimes:
    """Per-tick times from timed `calibration_tables` (or their tick counts); the timings may hold other calls too.

    On a busy host a grid's median can come out no slower than the empty
    step's. Such a grid's ticks cost less than the clock can resolve, not
    nothing and not less than nothing: its time over the empty step is floored
    at the clock's resolution (`RESOLUTION`) and its name listed in
    `StageTimes.floored`, so that every tick time is positive and a ratio of
    them (`StageTimes.sharing`) is defined.
    """
    call = timings.timing("no ticks").median
    ticks = {name: t if isinstance(t, int) else t.ticks for name, t in tables.items()}
    per_tick, floored = {}, []
    for name, count in ticks.items():
        if not count:
            continue
        excess = timings.timing(name).median - call
        if excess < RESOLUTION:
            floored.append(name)
            excess = RESOLUTION
        per_tick[name] = excess / count
    return StageTimes(
        tuple(per_tick[f"F on stage {s}"] for s in range(stages)),
        tuple(per_tick[f"B on stage {s}"] for s in range(stages)),
        per_tick["idle"],
        per_tick["F on every stage"],
        per_tick["B on every stage"],
        call,
        tuple(floored),
    )


def measure_stage_times(program: PipelineProgram, placed: tuple, repeats: int, ticks: int = 8) -> StageTimes:
    """Per-stage forward and backward tick times of `program`, and the cost of an idle tick.

    Timed on grids of `ticks` actions.
    """
    tables = calibration_tables(program.stages, min(ticks, program.workload.micro_batches), program.chunks)
    timings = time_round_robin({name: program.runner(placed, t) for name, t in tables.items()}, repeats)
    return stage_times(timings, tables, program.stages)
