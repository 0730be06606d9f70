"""Stage imbalance: the slowest stage sets the pace, and moving layers fixes it.

Question #43's follow-up asks what happens when stages are unequal (stage 0
takes 2 s, stage 1 takes 1 s). Every micro-batch passes through every stage,
so in steady state the pipe moves at the pace of its slowest stage and the
others wait for it; the bubble is no longer (P-1)/(m+P-1). For GPipe, each
phase is a flow shop of m identical jobs: with F_s and B_s the times of stage
s, the step takes

    sum_s (F_s + B_s) + (m - 1)(max_s F_s + max_s B_s),

and rebalancing layers until every stage takes the same time brings back the
formula. This page cuts a transformer unevenly over the ``stage`` axis (one
stage twice as slow: twice the blocks), executes GPipe and 1F1B, measures each
stage's forward and backward, simulates with them, and then moves layers so
the stages are even again.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from experiments import kit
from lab import theory
from lab.devices import DEFAULT_TARGET, devices_for
from lab.errors import LabError
from lab.model import preset
from lab.parallel.pipeline import loop
from lab.parallel.pipeline.render import timeline_figure
from lab.parallel.pipeline.schedules import Costs, lockstep_makespan, make_schedule, simulate
from lab.parallel.pipeline.stages import (
    StageSplit,
    Workload,
    balanced_split,
    example_batch,
    init_weights,
    reference_loss_and_grads,
    staged_weights,
)
from lab.parallel.pipeline.timing import calibration_tables, ideal_tables, load_note, stage_times, time_round_robin
from lab.progress import track
from lab.report import Result, Table, provenance
from lab.verdict import Check, check

QUESTION = "#43"
SCHEDULES = ("gpipe", "1f1b")


@dataclass(frozen=True)
class Config:
    target: str = DEFAULT_TARGET
    """where to run (cpu:N, gpu, tpu)"""
    split: str = "4,2"
    """transformer blocks per stage; twice the blocks make a stage twice as slow (the quick-reference's 2 s and 1 s)"""
    micro_batches: int = 8
    micro_batch_size: int = 2
    """sequences per micro-batch"""
    model: str = "tiny"
    """block sizes, a lab.model preset"""
    repeats: int = 5


@dataclass(frozen=True)
class Textbook:
    """The quick-reference's case, stage 0 taking 2 s and stage 1 taking 1 s, simulated per schedule."""

    makespan: dict[str, float]  # schedule -> step (s)
    bubble: dict[str, float]
    idle: dict[str, tuple[float, ...]]  # schedule -> idle time per stage (s)
    formula: float  # GPipe's flow-shop step (s)
    checks: tuple[Check, ...]


def run(config: Config) -> Result:
    devices = devices_for(config.target)
    uneven = _parse(config, len(devices))
    even = balanced_split(uneven.total, len(uneven.layers))
    textbook = _textbook_case(config.micro_batches)
    executed = [_execute(config, split, devices) for split in track((uneven, even), "imbalanced, then rebalanced")]
    runs = [numbers for numbers, _ in executed]
    checks = [*textbook.checks, *(c for _, found in executed for c in found), *_comparison_checks(runs)]
    return Result(
        summary=_summary(runs, textbook, config),
        theory=THEORY,
        tables=[_table(runs), _textbook_table(textbook)],
        checks=checks,
        plots={"imbalance": _plot(runs, config)},
        notes=_notes(runs),
        provenance=provenance(target=config.target, devices=devices, mesh=f"stage={len(uneven.layers)}"),
        data={"runs": runs, "textbook": kit.numbers(textbook)},
    )


THEORY = r"""
With per-stage forward and backward times F_s, B_s and m micro-batches, GPipe runs two flow shops (every forward,
then every backward), each of m identical jobs through the stages in order. Such a flow shop takes the sum of the
stage times plus m - 1 times the slowest one (Johnson 1954; Pinedo, *Scheduling*, Sec. 6.1):

T_GPipe = sum_s (F_s + B_s) + (m - 1)(max_s F_s + max_s B_s)   (lab.theory.imbalanced_step_time)

so every stage but the slowest idles (m - 1)(max - its own) per phase, on top of the fill and drain. With equal
stages this is (m + P - 1)(F + B) and the bubble (P-1)/(m+P-1). 1F1B is no slower, and with unequal stages it can
be a little faster (its slow stage starts backwards while later forwards are still arriving); the simulator, not
the formula, times it. The fix is the one the quick-reference gives: move layers from the slow stage to the others
until their times match.

One thing the formula does not see: in SPMD every device runs the same program, so an uneven split pads the light
stages to the widest one (their extra layers are skipped with a `lax.cond`, but their buffers and bookkeeping are the
widest stage's). Part of a stage's time therefore follows the widest stage, not its own blocks.
"""


def _parse(config: Config, device_count: int) -> StageSplit:
    split = StageSplit.parse(config.split)
    if len(split.layers) > device_count:
        raise LabError(
            f"a {len(split.layers)}-stage pipeline needs a stage axis of {len(split.layers)} "
            f"devices, but {config.target} has {device_count}; name at most "
            f"{device_count} stages"
        )
    if len(split.layers) < 2:
        raise LabError(f"split {config.split!r} names one stage; a pipeline needs two or more, e.g. 4,2 or 2,2,4,2")
    return split


def _textbook_case(m: int) -> Textbook:
    """The quick-reference's example: stage 0 takes 2 s, stage 1 takes 1 s (forward and backward alike)."""
    costs = Costs((2.0, 1.0), (2.0, 1.0))
    timelines = {name: simulate(make_schedule(name, 2, m), costs) for name in SCHEDULES}
    gpipe = timelines["gpipe"]
    formula = theory.imbalanced_step_time(costs.forward, costs.backward, m)
    waits = gpipe.idle[1] / m
    checks = (
        check(
            f"2 stages of 2 s and 1 s, m={m}: GPipe step, flow-shop formula against the simulator (s)",
            formula,
            gpipe.makespan,
            rtol=1e-9,
        ),
        check(
            f"2 stages of 2 s and 1 s, m={m}: the faster stage's idle time per micro-batch, forward and backward (s)",
            2.0,
            waits,
            rtol=0.3,
            explained=f"the fill and drain add {gpipe.idle[1] - 2 * (m - 1):g} "
            "s to the (m-1) x 2 s of waiting in steady state",
        ),
        check(
            f"2 stages of 2 s and 1 s, m={m}: bubble against (P-1)/(m+P-1) for equal stages",
            theory.pipeline_bubble_fraction(2, m),
            gpipe.bubble_fraction,
            explained="the fast stage waits for the slow one on every micro-batch, not only while the pipe fills",
        ),
    )
    return Textbook(
        makespan={n: t.makespan for n, t in timelines.items()},
        bubble={n: t.bubble_fraction for n, t in timelines.items()},
        idle={n: t.idle for n, t in timelines.items()},
        formula=formula,
        checks=checks,
    )


def _execute(config: Config, split: StageSplit, devices) -> tuple[dict, list]:
    """Run GPipe and 1F1B with this split, measure every stage, and predict the steps from the measurements.

    Returns the run's numbers and its checks.
    """
    p, m = len(split.layers), config.micro_batches
    workload = Workload(preset(config.model), split, config.micro_batch_size * m, m)
    schedules = {name: make_schedule(name, p, m) for name in SCHEDULES}
    runs = {name: loop.schedule_tables(s) for name, s in schedules.items()} | {"ideal": ideal_tables(p, m)}
    calibration = calibration_tables(p, m)
    program = loop.build(workload, loop.pipeline_mesh(devices, p), [*runs.values(), *calibration.values()])
    weights = init_weights(workload)
    inputs, targets = example_batch(workload)
    placed = program.place(staged_weights(workload, weights, p), inputs, targets)
    timings = time_round_robin({k: program.runner(placed, t) for k, t in (runs | calibration).items()}, config.repeats)
    times = stage_times(timings, calibration, p)
    costs = times.costs()
    result = {
        "split": split.layers,
        "micro_batches": m,
        "stage_times": dataclasses.asdict(times),
        "sharing": times.sharing,
        "ideal_s": timings.timing("ideal").median,
        "formula_gpipe_s": theory.imbalanced_step_time(costs.forward, costs.backward, m) + times.call,
    }
    for name, schedule in schedules.items():
        result[name] = {
            "time_s": timings.timing(name).median,
            "spread": timings.timing(name).spread,
            "simulated_s": simulate(schedule, costs).makespan + times.call,
            "host_s": lockstep_makespan(schedule.grid(), times.tick) + times.call,
            "simulated_bubble": simulate(schedule, costs).bubble_fraction,
        }
    loss, _ = program.run(placed, runs["1f1b"])
    reference, _ = reference_loss_and_grads(workload, weights, inputs, targets) if split.uneven else (loss, None)
    label = ",".join(map(str, split.layers))
    checks = [
        check(
            f"split {label}: GPipe step simulated with the measured stage times against the flow-shop formula (s)",
            result["formula_gpipe_s"],
            result["gpipe"]["simulated_s"],
            rtol=1e-9,
        ),
        check(
            f"split {label}: executed 1F1B loss against the same model without a pipeline",
            float(reference),
            float(loss),
            rtol=1e-5,
        ),
    ]
    return result, checks


def _comparison_checks(runs: list[dict]) -> list:
    uneven, even = runs
    label = ",".join(map(str, uneven["split"]))
    padding = uneven["stage_times"]["idle"] / even["stage_times"]["idle"]
    padded = padding > 1.3
    why_padding = (
        "SPMD stages share one program, so every stage's buffers and bookkeeping "
        "are sized for the widest stage: an idle tick costs "
        f"{padding:.1f}x the even split's, and starting a step "
        f"{uneven['stage_times']['call'] / max(even['stage_times']['call'], 1e-9):.1f}x"
    )
    per_stage = [f + b for f, b in zip(uneven["stage_times"]["forward"], uneven["stage_times"]["backward"])]
    heavy = uneven["split"].index(max(uneven["split"]))
    ratio = per_stage[heavy] / float(
        np.median([t for s, t in enumerate(per_stage) if s != heavy])
    )  # the stage with most blocks, against the others
    expected = max(uneven["split"]) / min(uneven["split"])
    m = uneven["micro_batches"]
    by_blocks = theory.imbalanced_step_time(
        uneven["split"], [2 * b for b in uneven["split"]], m
    ) / theory.imbalanced_step_time(even["split"], [2 * b for b in even["split"]], m)
    measured = uneven["gpipe"]["time_s"] / even["gpipe"]["time_s"]
    predicted = uneven["gpipe"]["simulated_s"] / even["gpipe"]["simulated_s"]
    host = uneven["gpipe"]["host_s"] / even["gpipe"]["host_s"]
    sharing = max(r["sharing"] for r in runs)
    why_sharing = (
        "the emulated stages share this host's cores (a tick with every "
        f"stage busy takes {sharing:.2f}x one with a single stage), "
        "and the shared-host model accounts for it"
    )
    return [
        check(
            f"split {label}: F+B of the stage with the most blocks against "
            f"the others' (measured alone), blocks {expected:g}x",
            expected,
            ratio,
            rtol=0.25,
            explained=why_padding if padded else None,
        ),
        check(
            "GPipe step, imbalanced / rebalanced: flow-shop formula with "
            "stage times in proportion to their blocks, against measured",
            by_blocks,
            measured,
            rtol=0.15,
            explained=why_padding if padded else None,
        ),
        check(
            "GPipe step, imbalanced / rebalanced: simulator with measured stage times against measured",
            predicted,
            measured,
            rtol=0.15,
            explained=why_sharing if sharing > 1.15 and abs(measured - host) <= 0.15 * max(measured, host) else None,
        ),
        check(
            "GPipe step, imbalanced / rebalanced: shared-host lockstep model against measured",
            host,
            measured,
            rtol=0.15,
        ),
    ]


def _table(runs: list[dict]) -> Table:
    body = []
    for r in runs:
        t = r["stage_times"]
        per_stage = " / ".join(f"{(f + b) * 1e3:.1f}" for f, b in zip(t["forward"], t["backward"]))
        for name in SCHEDULES:
            x = r[name]
            body.append(
                [
                    ",".join(map(str, r["split"])),
                    name,
                    per_stage,
                    f"{x['time_s'] * 1e3:.1f}",
                    f"{r['ideal_s'] * 1e3:.1f}",
                    f"{x['simulated_s'] * 1e3:.1f}",
                    f"{r['formula_gpipe_s'] * 1e3:.1f}" if name == "gpipe" else "",
                    f"{x['host_s'] * 1e3:.1f}",
                    f"{x['simulated_bubble']:.3f}",
                ]
            )
    return Table(
        "Executed with an uneven and an even split of the same blocks",
        [
            "blocks per stage",
            "schedule",
            "F+B per stage, alone (ms)",
            "step, measured (ms)",
            "no bubble (ms)",
            "simulated (ms)",
            "flow-shop formula (ms)",
            "shared-host model (ms)",
            "bubble, simulated",
        ],
        body,
        note="Stage times are ticks with that stage working alone, measured "
        "in the same round robin as the steps. Simulated = lab.parallel.pipeline.schedules.simulate "
        "with those times (a device per stage); shared-host model = tick "
        "by tick on this host (see the pipeline_bubble page).",
    )


def _textbook_table(textbook: Textbook) -> Table:
    body = [
        [
            name,
            f"{textbook.makespan[name]:g}",
            " / ".join(f"{i:g}" for i in textbook.idle[name]),
            f"{textbook.bubble[name]:.3f}",
        ]
        for name in SCHEDULES
    ]
    return Table(
        "The quick-reference's case: stage 0 takes 2 s, stage 1 takes 1 s (simulated)",
        ["schedule", "step (s)", "idle per stage (s)", "bubble"],
        body,
        note=f"GPipe flow-shop formula: {textbook.formula:g} s.",
    )


def _plot(runs: list[dict], config: Config):
    timelines, titles = [], []
    for r in runs:
        in_ms = Costs(
            tuple(f * 1e3 for f in r["stage_times"]["forward"]), tuple(b * 1e3 for b in r["stage_times"]["backward"])
        )
        for name in SCHEDULES:
            timelines.append(simulate(make_schedule(name, len(r["split"]), config.micro_batches), in_ms))
            titles.append(
                f"{name}, blocks {','.join(map(str, r['split']))}, simulated with the stage times measured here"
            )
    return timeline_figure(timelines, titles=titles, unit="ms")


def _summary(runs: list[dict], textbook: Textbook, config: Config) -> str:
    uneven, even = runs
    return (
        "The slowest stage sets the pace. In the quick-reference's case "
        f"(2 s and 1 s, m = {config.micro_batches}) GPipe takes {textbook.makespan['gpipe']:g} "
        "s "
        f"and the fast stage idles {textbook.idle['gpipe'][1]:g} s: its "
        f"bubble is {textbook.bubble['gpipe']:.0%}, not the "
        f"{theory.pipeline_bubble_fraction(2, config.micro_batches):.0%} "
        f"of equal stages. Executed with blocks {','.join(map(str, uneven['split']))}, "
        "the "
        f"simulator predicts GPipe at {uneven['gpipe']['simulated_s'] * 1e3:.0f} "
        "ms from the measured stage times against "
        f"{even['gpipe']['simulated_s'] * 1e3:.0f} ms after moving blocks "
        f"to {','.join(map(str, even['split']))}; measured here "
        f"{uneven['gpipe']['time_s'] * 1e3:.0f} ms against {even['gpipe']['time_s'] * 1e3:.0f} "
        f"ms (1F1B {uneven['1f1b']['time_s'] * 1e3:.0f} against "
        f"{even['1f1b']['time_s'] * 1e3:.0f} ms)."
    )


def _notes(runs: list[dict]) -> list[str]:
    uneven, even = runs
    notes = [
        (
            "Stages run the same SPMD program, so an uneven split pads every "
            "stage's weights to the widest stage and skips the padding layers "
            "with a lax.cond: a stage computes only its own blocks, but its "
            "buffers and bookkeeping are the widest stage's: an idle tick "
            "took "
            f"{uneven['stage_times']['idle'] * 1e3:.2f} ms with blocks {','.join(map(str, uneven['split']))} against "
            f"{even['stage_times']['idle'] * 1e3:.2f} ms with {','.join(map(str, even['split']))}."
        )
    ]
    for r in runs:
        notes.append(
            f"blocks {','.join(map(str, r['split']))}: host sharing {r['sharing']:.2f} "
            "(a tick with every stage busy over a tick with one)."
        )
    return [*notes, load_note()]
