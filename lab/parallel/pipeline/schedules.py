"""Pipeline schedules as data, and a simulator that times them.

A pipeline cuts the model's layers into P stages on P devices and the batch
into m micro-batches. A *schedule* is, for each stage, the order in which it
runs its actions on micro-batches:

* ``F`` forward; ``B`` the whole backward;
* ``I`` and ``W``: the backward split into its input-gradient half (the next
  stage down the pipe waits for it) and its weight-gradient half (nobody waits
  for it, so it can fill a bubble). Zero-bubble schedules use them.

With interleaving each device holds v chunks (virtual stages): virtual stage
``c·P + d`` is chunk c of device d (Narayanan et al. 2021, "Efficient
Large-Scale Language Model Training on GPU Clusters Using Megatron-LM",
Sec. 2.2.2). An action names its chunk.

The order alone does not fix the timing: data does. F of a virtual stage needs
the previous one's F (its input, sent from the device before); a backward needs
the next one's backward (the gradient of its output, sent back) and its own F;
W needs I. Sends and receives are exactly the dependencies that cross devices
(`transfers`). Given a cost per action, each action starts when its device is
free and its inputs have arrived; `simulate` computes those times (a longest
path through the dependency graph) and `Timeline` reads off the makespan, the
idle time per stage, the bubble fraction and the peak number of micro-batches
whose activations are alive on each stage. `Schedule.grid` is the table of
the textbook figures: one tick per action.

Generators: GPipe (Huang et al. 2019), 1F1B (PipeDream-flush; Narayanan et
al. 2021, "Memory-Efficient Pipeline-Parallel DNN Training"), interleaved 1F1B
(Megatron-LM's order, as above) and ZB-H1 (Qi et al. 2024, "Zero Bubble
Pipeline Parallelism", Sec. 3.1).
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from lab.errors import LabError

FORWARD, BACKWARD, INPUT_GRAD, WEIGHT_GRAD = "F", "B", "I", "W"
KINDS = (FORWARD, BACKWARD, INPUT_GRAD, WEIGHT_GRAD)


@dataclass(frozen=True, order=True)
class Action:
    """One unit of work on one stage: a kind (F, B, I, W), a micro-batch, a chunk."""

    kind: str
    micro_batch: int
    chunk: int = 0

    def label(self, chunks: int = 1) -> str:
        """``F3``, or ``F3.1`` for chunk 1 when the device holds several chunks."""
        return f"{self.kind}{self.micro_batch}" + (f".{self.chunk}" if chunks > 1 else "")


@dataclass(frozen=True)
class Schedule:
    """Per-stage action orders for P stages, m micro-batches and v chunks per stage."""

    name: str
    stages: int
    micro_batches: int
    chunks: int
    orders: tuple[tuple[Action, ...], ...]  # orders[stage] = actions in the order that stage runs them

    def __post_init__(self) -> None:
        if len(self.orders) != self.stages:
            raise LabError(
                f"schedule {self.name!r} gives orders for {len(self.orders)} "
                f"stages but has {self.stages}; give one order per stage"
            )
        for stage, order in enumerate(self.orders):
            missing = Counter(self._expected_actions()) - Counter(order)
            extra = Counter(order) - Counter(self._expected_actions())
            if missing or extra:
                wrong = ", ".join(a.label(self.chunks) for a in [*missing, *extra][:3])
                raise LabError(
                    f"schedule {self.name!r}: stage {stage} must run every action exactly once; check {wrong}"
                )

    @property
    def split_backward(self) -> bool:
        """True when the backward is split into I and W (zero-bubble schedules)."""
        return any(a.kind == INPUT_GRAD for a in self.orders[0])

    @property
    def virtual_stages(self) -> int:
        return self.stages * self.chunks

    def _expected_actions(self) -> list[Action]:
        kinds = (FORWARD, INPUT_GRAD, WEIGHT_GRAD) if self.split_backward else (FORWARD, BACKWARD)
        return [Action(k, i, c) for k in kinds for i in range(self.micro_batches) for c in range(self.chunks)]

    def grid(self) -> tuple[tuple[Action | None, ...], ...]:
        """The textbook table: grid[stage][tick] with one tick per action (None: idle)."""
        timeline = simulate(self, Costs.ticks(self))
        grid = [[None] * round(timeline.makespan) for _ in range(self.stages)]
        for span in timeline.spans:
            grid[span.stage][round(span.start)] = span.action
        return tuple(tuple(row) for row in grid)


# --- costs and the simulator ---------------------------------------------------------


@dataclass(frozen=True)
class Costs:
    """Time of each action, per stage: forward and whole backward of the stage's layers.

    A chunk runs 1/v of its stage's layers, so its actions cost 1/v. A split
    backward costs ``(1 - weight_fraction)`` of the backward for I and
    ``weight_fraction`` for W. `send` is the time between a stage finishing an
    action and the next device being able to use its output.
    """

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    weight_fraction: float = 0.5
    send: float = 0.0

    def __post_init__(self) -> None:
        if len(self.forward) != len(self.backward):
            raise LabError(
                f"costs: {len(self.forward)} forward times but {len(self.backward)} "
                "backward times; give one of each per stage"
            )
        if min(self.forward + self.backward) < 0 or self.send < 0 or not 0 <= self.weight_fraction <= 1:
            raise LabError("costs: times must be >= 0 and weight_fraction between 0 and 1")

    @classmethod
    def uniform(cls, stages: int, forward: float = 1.0, backward: float = 1.0, **kwargs) -> Costs:
        """The same forward and backward time on every stage."""
        return cls((forward,) * stages, (backward,) * stages, **kwargs)

    @classmethod
    def ticks(cls, schedule: Schedule) -> Costs:
        """One tick per action: F = B = 1, or F = I = W = 1 for a split backward; chunks scaled up to match."""
        v = schedule.chunks
        backward = 2.0 if schedule.split_backward else 1.0
        return cls.uniform(schedule.stages, float(v), backward * v)

    def of(self, stage: int, action: Action, chunks: int) -> float:
        share = {
            FORWARD: self.forward[stage],
            BACKWARD: self.backward[stage],
            INPUT_GRAD: (1 - self.weight_fraction) * self.backward[stage],
            WEIGHT_GRAD: self.weight_fraction * self.backward[stage],
        }
        return share[action.kind] / chunks


@dataclass(frozen=True)
class Span:
    """When one action ran."""

    stage: int
    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class Timeline:
    """A simulated schedule: every action's start and end."""

    schedule: Schedule
    costs: Costs
    spans: tuple[Span, ...]

    @property
    def makespan(self) -> float:
        return max(s.end for s in self.spans)

    @property
    def busy(self) -> tuple[float, ...]:
        return tuple(sum(s.end - s.start for s in self.spans if s.stage == p) for p in range(self.schedule.stages))

    @property
    def idle(self) -> tuple[float, ...]:
        """Time each stage spends waiting within the step."""
        return tuple(self.makespan - b for b in self.busy)

    @property
    def bubble_fraction(self) -> float:
        """Idle share of all stages' time: 1 - sum(busy) / (P · makespan)."""
        return 1 - sum(self.busy) / (self.schedule.stages * self.makespan)

    @property
    def peak_in_flight(self) -> tuple[float, ...]:
        """Per stage, the most micro-batches whose activations are alive at once (a chunk counts 1/v).

        A micro-batch's activations on a chunk live from its F's start to the
        end of its last backward action there (B, or W when split).
        """
        peaks = []
        for stage in range(self.schedule.stages):
            events = []  # (time, +1 allocate / -1 free); frees first at equal times
            for span in self.spans:
                if span.stage != stage:
                    continue
                if span.action.kind == FORWARD:
                    events.append((span.start, 1))
                elif span.action.kind in (BACKWARD, WEIGHT_GRAD):
                    events.append((span.end, -1))
            alive = list(itertools.accumulate(delta for _, delta in sorted(events)))
            peaks.append(max(alive) / self.schedule.chunks)
        return tuple(peaks)

    def span_of(self, stage: int, action: Action) -> Span:
        return next(s for s in self.spans if s.stage == stage and s.action == action)


def device_of(virtual_stage: int, stages: int) -> tuple[int, int]:
    """(device, chunk) holding a virtual stage: c·P + d lives on device d as chunk c."""
    return virtual_stage % stages, virtual_stage // stages


def dependencies(schedule: Schedule, stage: int, action: Action) -> list[tuple[int, Action]]:
    """The (stage, action) pairs whose results `action` on `stage` needs."""
    p, i = schedule.stages, action.micro_batch
    virtual = action.chunk * p + stage
    backward = INPUT_GRAD if schedule.split_backward else BACKWARD
    if action.kind == FORWARD:
        return [] if virtual == 0 else [_at(virtual - 1, FORWARD, i, p)]
    if action.kind == WEIGHT_GRAD:
        return [(stage, Action(INPUT_GRAD, i, action.chunk))]
    own_forward = (stage, Action(FORWARD, i, action.chunk))
    if virtual == schedule.virtual_stages - 1:
        return [own_forward]  # the loss's gradient is computed right here
    return [own_forward, _at(virtual + 1, backward, i, p)]


def _at(virtual: int, kind: str, micro_batch: int, stages: int) -> tuple[int, Action]:
    device, chunk = device_of(virtual, stages)
    return device, Action(kind, micro_batch, chunk)


@dataclass(frozen=True)
class Transfer:
    """An activation (forward) or gradient (backward) sent between devices."""

    source: int
    target: int
    action: Action  # the action that produced it on `source`
    consumer: Action  # the action that uses it on `target`


def transfers(schedule: Schedule) -> list[Transfer]:
    """Every send/receive pair the schedule implies: the dependencies that cross devices."""
    found = []
    for stage, order in enumerate(schedule.orders):
        for action in order:
            for source, needed in dependencies(schedule, stage, action):
                if source != stage:
                    found.append(Transfer(source, stage, needed, action))
    return found


def simulate(schedule: Schedule, costs: Costs) -> Timeline:
    """Start every action as soon as its stage is free and its inputs have arrived (asynchronous sends)."""
    if len(costs.forward) != schedule.stages:
        raise LabError(
            f"costs are given for {len(costs.forward)} stages but schedule {schedule.name!r} has {schedule.stages}"
        )
    ends: dict[tuple[int, Action], float] = {}
    spans: list[Span] = []
    position = [0] * schedule.stages
    free_at = [0.0] * schedule.stages
    remaining = sum(len(o) for o in schedule.orders)
    while remaining:
        progressed = False
        for stage, order in enumerate(schedule.orders):
            if position[stage] == len(order):
                continue
            action = order[position[stage]]
            needs = dependencies(schedule, stage, action)
            if any(n not in ends for n in needs):
                continue
            ready = max([free_at[stage], *(ends[n] + (costs.send if n[0] != stage else 0.0) for n in needs)])
            end = ready + costs.of(stage, action, schedule.chunks)
            spans.append(Span(stage, action, ready, end))
            ends[stage, action], free_at[stage] = end, end
            position[stage] += 1
            remaining -= 1
            progressed = True
        if not progressed:
            waiting = ", ".join(
                f"stage {s} at {schedule.orders[s][position[s]].label(schedule.chunks)}"
                for s in range(schedule.stages)
                if position[s] < len(schedule.orders[s])
            )
            raise LabError(
                f"schedule {schedule.name!r} deadlocks ({waiting}): every stage "
                "waits for an action ordered after it; reorder the actions"
            )
    return Timeline(schedule, costs, tuple(sorted(spans, key=lambda s: (s.start, s.stage))))


def lockstep_makespan(grid, tick: Callable[[list[tuple[int, Action]]], float]) -> float:
    """The step time when all devices advance through a grid[stage][tick] together, one tick at a time.

    That is how an SPMD program runs a schedule when it exchanges activations
    with a collective every tick: a tick lasts `tick(busy)`, a function of the
    (stage, action) pairs working in it; `slowest_action(costs, v)` makes it
    the slowest one's cost, which is what devices with their own cores see.
    """
    return sum(tick([(s, a) for s, a in enumerate(column) if a is not None]) for column in zip(*grid))


def slowest_action(costs: Costs, chunks: int = 1) -> Callable[[list[tuple[int, Action]]], float]:
    """A tick lasts as long as its slowest action (0 when nobody works)."""
    return lambda busy: max((costs.of(s, a, chunks) for s, a in busy), default=0.0)


def dependency_violations(schedule: Schedule, starts: dict[tuple[int, Action], float], costs: Costs) -> list[str]:
    """Actions in a hand-drawn timeline starting before an input they need exists (empty: the timeline is possible)."""
    problems = []
    for (stage, action), start in sorted(starts.items(), key=lambda item: (item[1], item[0][0])):
        for needed in dependencies(schedule, stage, action):
            ready = starts[needed] + costs.of(needed[0], needed[1], schedule.chunks)
            if start < ready:
                problems.append(
                    f"{action.label(schedule.chunks)} on stage {stage} starts "
                    f"at {start:g}, but {needed[1].label(schedule.chunks)} on "
                    f"stage {needed[0]} ends at {ready:g}"
                )
    return problems


# --- generators -------------------------------------------------------------------------


def _check_sizes(stages: int, micro_batches: int) -> None:
    for name, value in (("stages", stages), ("micro_batches", micro_batches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise LabError(f"{name}={value!r}: a pipeline needs a positive whole number of {name.replace('_', '-')}")


def gpipe(stages: int, micro_batches: int) -> Schedule:
    """GPipe (Huang et al. 2019): every forward, then every backward; all m micro-batches in flight."""
    _check_sizes(stages, micro_batches)
    order = tuple(Action(FORWARD, i) for i in range(micro_batches)) + tuple(
        Action(BACKWARD, i) for i in range(micro_batches)
    )
    return Schedule("gpipe", stages, micro_batches, 1, (order,) * stages)


def one_f_one_b(stages: int, micro_batches: int) -> Schedule:
    """1F1B / PipeDream-flush: stage s runs P-1-s forwards, then alternates one forward, one backward.

    At most P - s micro-batches are in flight on stage s (Narayanan et al. 2021, Sec. 3).
    """
    _check_sizes(stages, micro_batches)
    orders = []
    for stage in range(stages):
        warmup = min(stages - 1 - stage, micro_batches)
        order = [Action(FORWARD, i) for i in range(warmup)]
        for i in range(micro_batches - warmup):
            order += [Action(FORWARD, warmup + i), Action(BACKWARD, i)]
        order += [Action(BACKWARD, i) for i in range(micro_batches - warmup, micro_batches)]
        orders.append(tuple(order))
    return Schedule("1f1b", stages, micro_batches, 1, tuple(orders))


def interleaved(stages: int, micro_batches: int, chunks: int) -> Schedule:
    """Interleaved 1F1B with v chunks per device, in Megatron-LM's order.

    The m·v forwards of a device run in groups of P micro-batches per chunk
    (chunk 0, 1, ..., v-1, then the next P micro-batches); backwards the same
    with the chunks reversed. Device d warms up with 2(P-1-d) + (v-1)P forwards
    (Megatron-LM, ``forward_backward_pipelining_with_interleaving``), which
    needs m to be a multiple of P.
    """
    _check_sizes(stages, micro_batches)
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 2:
        raise LabError(
            f"interleaved schedule with chunks={chunks!r}: use 2 or more chunks per device (one chunk is plain 1f1b)"
        )
    if micro_batches % stages:
        raise LabError(
            f"interleaved schedule: m={micro_batches} micro-batches must be "
            f"a multiple of P={stages} stages (Megatron-LM's constraint); "
            f"use m={stages * -(-micro_batches // stages)}"
        )
    total, group = micro_batches * chunks, stages * chunks

    def nth(k: int, kind: str) -> Action:
        chunk = (k % group) // stages
        return Action(kind, (k // group) * stages + k % stages, chunk if kind == FORWARD else chunks - 1 - chunk)

    orders = []
    for stage in range(stages):
        warmup = min(2 * (stages - 1 - stage) + (chunks - 1) * stages, total)
        order = [nth(k, FORWARD) for k in range(warmup)]
        for k in range(total - warmup):
            order += [nth(warmup + k, FORWARD), nth(k, BACKWARD)]
        order += [nth(k, BACKWARD) for k in range(total - warmup, total)]
        orders.append(tuple(order))
    return Schedule("interleaved", stages, micro_batches, chunks, tuple(orders))


def zb_h1(stages: int, micro_batches: int) -> Schedule:
    """ZB-H1 (Qi et al. 2024, Sec. 3.1): 1F1B with the backward split into I and W, and W held back.

    Stage s runs 1F1B's order with each B replaced by I, and delays each W by
    s micro-batches (the first s steady-state iterations run no W; all W
    left over run at the end), as PyTorch's ``ScheduleInterleavedZeroBubble``
    does with ``num_1f1b_microbatches = rank``. Stage s already holds only
    P - s micro-batches under 1F1B; the s held-back W bring it to P, so the
    peak is still 1F1B's. The W fill the cool-down's idle ticks, which cuts
    each stage's idle time from (P-1)(F+B) to (P-1)(F+I-W).
    """
    _check_sizes(stages, micro_batches)
    orders = []
    for stage in range(stages):
        warmup = min(stages - 1 - stage, micro_batches)
        order = [Action(FORWARD, i) for i in range(warmup)]
        weights_done = 0
        for i in range(micro_batches):
            if warmup + i < micro_batches:
                order.append(Action(FORWARD, warmup + i))
            order.append(Action(INPUT_GRAD, i))
            if i + 1 - weights_done > stage:  # keep `stage` weight gradients pending
                order.append(Action(WEIGHT_GRAD, weights_done))
                weights_done += 1
        order += [Action(WEIGHT_GRAD, i) for i in range(weights_done, micro_batches)]
        orders.append(tuple(order))
    return Schedule("zb-h1", stages, micro_batches, 1, tuple(orders))


GENERATORS: dict[str, Callable[..., Schedule]] = {
    "gpipe": lambda p, m, v=1: gpipe(p, m),
    "1f1b": lambda p, m, v=1: one_f_one_b(p, m),
    "interleaved": interleaved,
    "zb-h1": lambda p, m, v=1: zb_h1(p, m),
}


def make_schedule(name: str, stages: int, micro_batches: int, chunks: int = 1) -> Schedule:
    """A schedule by name: gpipe, 1f1b, interleaved (with `chunks`) or zb-h1."""
    if name not in GENERATORS:
        raise LabError(f"unknown pipeline schedule {name!r}; use one of {', '.join(GENERATORS)}")
    if name != "interleaved" and chunks != 1:
        raise LabError(
            f"schedule {name!r} has one chunk per stage, not {chunks}; use the interleaved schedule for chunks > 1"
        )
    return GENERATORS[name](stages, micro_batches, chunks)
