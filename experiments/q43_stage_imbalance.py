"""Stage imbalance: the slowest stage sets the pace, and moving layers fixes it.

Question #43's follow-up asks what happens when stages are unequal (stage 0
takes 2 s, stage 1 takes 1 s). Every micro-batch passes through every stage,
so in steady state the pipe moves at the pace of its slowest stage and the
others wait for it; the bubble is no longer (P-1)/(m+P-1). For GPipe, each
phase is a flow shop of m identical jobs: with F_s and B_s the times of stage
s, the step takes

    sum_s (F_s + B_s) + (m - 1)(max_s F_s + max_s B_s),

and rebalancing layers until every stage takes the same time brings back the
formula. This page simulates the quick-reference's case, then cuts a
transformer unevenly over the ``stage`` axis (one stage with twice the
blocks), executes GPipe and 1F1B, checks them against the model without a
pipeline, reads what XLA allocates for each device's weights, times each
stage alone and both steps in one round robin, and moves layers so the stages
are even again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import jax
import numpy as np

from lab import theory
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
    unstage_weights,
)
from lab.parallel.pipeline.timing import (
    RoundRobin,
    StageTimes,
    calibration_tables,
    host_load,
    ideal_tables,
    load_note,
    stage_times,
    time_round_robin,
)
from lab.progress import track
from lab.provenance import Setup
from lab.report import Result, Table
from lab.targets.devices import DEFAULT_TARGET, devices_for
from lab.verdict import Check, Claim, check

QUESTION = "#43"
SCHEDULES = ("gpipe", "1f1b")
TEXTBOOK_COSTS = (2.0, 1.0)  # the quick-reference's stage times (s), forward and backward alike
TEXTBOOK_WAIT = 1.0  # "Stage 1 每步要等 1s": what the quick-reference says the fast stage waits
GRAD_RTOL = 1e-5  # a gradient element "differs" from the unpipelined model's beyond this share of the largest one
LOSS_RTOL = 1e-5
LOSS_BASIS = (
    "the pipeline sums the loss per micro-batch on the last stage, then over stages (psum), the reference in one "
    "vmap: float32 additions in another order, ~100 ulps"
)


@dataclass(frozen=True)
class Config:
    target: str = DEFAULT_TARGET
    """where to run (cpu:N, gpu, tpu)"""
    split: str = "4,2"
    """transformer blocks per stage; twice the blocks: the quick-reference's 2 s and 1 s, on a device per stage"""
    micro_batches: int = 8
    micro_batch_size: int = 2
    """sequences per micro-batch"""
    model: str = "tiny"
    """block sizes, a lab.model preset"""
    repeats: int = 5


@dataclass(frozen=True)
class Simulated:
    """One schedule simulated with the quick-reference's stage times."""

    schedule: str
    makespan: float  # s
    busy: tuple[float, ...]  # per stage (s)
    bubble: float


@dataclass(frozen=True)
class Numerics:
    """What one executed schedule computed, against the same model without a pipeline."""

    schedule: str
    loss: float
    grads_off: int  # gradient elements beyond GRAD_RTOL of the largest reference gradient


@dataclass(frozen=True)
class SplitRun:
    """One split of the blocks, compiled once and run by GPipe, 1F1B, the ideal and the calibration grids."""

    split: tuple[int, ...]
    reference_loss: float  # the same weights and data through every block in order, on one device
    numerics: tuple[Numerics, ...]
    argument_bytes: int  # XLA's memory analysis of the compiled step, per device
    max_ticks: int  # the step's table length (its table arguments are [max_ticks, P, 3|2|2] int32)
    calibration_ticks: dict[str, int]


@dataclass(frozen=True)
class Observations:
    setup: Setup
    textbook: tuple[Simulated, ...]
    runs: tuple[SplitRun, ...]  # the uneven split, then the even one
    samples: dict[str, tuple[float, ...]]  # seconds per call, both splits in one round robin: "4,2 gpipe", ...
    load: float
    cores: int


# --------------------------------------------------------------------------- measure


def measure(config: Config) -> Observations:
    devices = devices_for(config.target)
    uneven = _parse(config, len(devices))
    even = balanced_split(uneven.total, len(uneven.layers))
    built = [_build(config, split, devices) for split in track((uneven, even), "imbalanced, then rebalanced")]
    # both splits in one round robin, so that the ratio of their steps saw the same load
    calls = {f"{_label(run.split)} {name}": call for run, runner in built for name, call in runner.items()}
    timings = time_round_robin(calls, config.repeats)
    load, cores = host_load()
    return Observations(
        setup=Setup.of(config.target, devices, f"stage={len(uneven.layers)}"),
        textbook=_textbook(config.micro_batches),
        runs=tuple(run for run, _ in built),
        samples={k: tuple(float(x) for x in v) for k, v in timings.samples.items()},
        load=load,
        cores=cores,
    )


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


def _label(split) -> str:
    return ",".join(map(str, split))


def _textbook(m: int) -> tuple[Simulated, ...]:
    """The quick-reference's example, simulated: stage 0 takes 2 s, stage 1 takes 1 s (forward and backward alike)."""
    costs = Costs(TEXTBOOK_COSTS, TEXTBOOK_COSTS)
    found = []
    for name in SCHEDULES:
        t = simulate(make_schedule(name, len(TEXTBOOK_COSTS), m), costs)
        found.append(Simulated(name, t.makespan, tuple(t.busy), t.bubble_fraction))
    return tuple(found)


def _build(config: Config, split: StageSplit, devices) -> tuple[SplitRun, dict]:
    """Compile one split, check what it computes, and hand back its calls for the shared round robin."""
    p, m = len(split.layers), config.micro_batches
    workload = Workload(preset(config.model), split, config.micro_batch_size * m, m)
    runs = {name: loop.schedule_tables(make_schedule(name, p, m)) for name in SCHEDULES} | {"ideal": ideal_tables(p, m)}
    calibration = calibration_tables(p, m)
    program = loop.build(workload, loop.pipeline_mesh(devices, p), [*runs.values(), *calibration.values()])
    weights = init_weights(workload)
    inputs, targets = example_batch(workload)
    placed = program.place(staged_weights(workload, weights, p), inputs, targets)
    reference_loss, reference_grads = reference_loss_and_grads(workload, weights, inputs, targets)
    reference = np.concatenate([np.ravel(g) for g in jax.tree.leaves(reference_grads)])
    numerics = []
    for name in SCHEDULES:
        loss, grads = program.run(placed, runs[name])
        ours = np.concatenate(
            [np.ravel(g) for g in jax.tree.leaves(unstage_weights(jax.device_get(grads)["blocks"], split, p))]
        )
        off = int(np.sum(np.abs(ours - reference) > GRAD_RTOL * np.max(np.abs(reference))))
        numerics.append(Numerics(name, float(loss), off))
    run = SplitRun(
        split=split.layers,
        reference_loss=float(reference_loss),
        numerics=tuple(numerics),
        argument_bytes=int(program.compiled.memory_analysis().argument_size_in_bytes),
        max_ticks=int(program.max_ticks),
        calibration_ticks={name: int(t.ticks) for name, t in calibration.items()},
    )
    return run, {name: program.runner(placed, t) for name, t in (runs | calibration).items()}


# --------------------------------------------------------------------------- judge


def judge(obs: Observations, config: Config) -> Result:
    checks = [
        *_textbook_checks(obs, config),
        *(c for run in obs.runs for c in _run_checks(run, config)),
        *_timing_checks(obs),
    ]
    return Result(
        summary=_summary(obs, config),
        theory=THEORY,
        tables=[_table(obs, config), _textbook_table(obs, config)],
        checks=checks,
        claims=_claims(obs, config),
        plots={"imbalance": partial(_plot, obs, config)},
        notes=_notes(obs),
    )


THEORY = r"""
With per-stage forward and backward times F_s, B_s and m micro-batches, GPipe runs two flow shops (every forward,
then every backward), each of m identical jobs through the stages in order. Such a flow shop takes the sum of the
stage times plus m - 1 times the slowest one (Johnson 1954; Pinedo, *Scheduling*, Sec. 6.1):

T_GPipe = sum_s (F_s + B_s) + (m - 1)(max_s F_s + max_s B_s)   (lab.theory.imbalanced_step_time)

so every stage but the slowest idles (m - 1)(max - its own) per phase, on top of the fill and drain: stage s idles
T_GPipe - m(F_s + B_s) in all. With equal stages this is (m + P - 1)(F + B) and the bubble (P-1)/(m+P-1). 1F1B is no
slower, and with unequal stages it can be a little faster (its slow stage starts backwards while later forwards are
still arriving); the simulator, not the formula, times it. The fix is the one the quick-reference gives: move layers
from the slow stage to the others until their times match.

One thing the formula does not see: in SPMD every device runs the same program, so an uneven split pads the light
stages to the widest one. Each device holds the widest stage's weights (XLA's argument bytes show it: widest x a
block's weights, plus the active-layer mask, the data and the tables), and the padding layers are skipped with a
`lax.cond`, so their buffers and bookkeeping are the widest stage's. Part of a stage's time therefore follows the
widest stage, not its own blocks.
"""


def _simulated(obs: Observations, name: str) -> Simulated:
    return next(s for s in obs.textbook if s.schedule == name)


def _textbook_theory(m: int) -> dict:
    """The flow-shop formula for the quick-reference's case: step, the fast stage's idle time, the bubble."""
    f = b = TEXTBOOK_COSTS
    step = theory.imbalanced_step_time(f, b, m)
    own = [m * (fs + bs) for fs, bs in zip(f, b)]
    return {"step": step, "idle_fast": step - own[-1], "bubble": 1 - sum(own) / (len(own) * step)}


def _textbook_checks(obs: Observations, config: Config) -> list[Check]:
    m, g, expected = config.micro_batches, _simulated(obs, "gpipe"), _textbook_theory(config.micro_batches)
    label = f"2 stages of 2 s and 1 s, m={m}"
    return [
        check(
            f"{label}: GPipe step, flow-shop formula against the simulator (s)",
            expected["step"],
            g.makespan,
            kind="exact",
            rtol=1e-9,
        ),
        check(
            f"{label}: the fast stage's idle time, T - m(F_1+B_1), against the simulator (s)",
            expected["idle_fast"],
            g.makespan - g.busy[-1],
            kind="exact",
            rtol=1e-9,
        ),
        check(
            f"{label}: GPipe bubble, 1 - sum_s m(F_s+B_s) / (P·T), against the simulator",
            expected["bubble"],
            g.bubble,
            kind="exact",
            rtol=1e-9,
        ),
        check(
            f"{label}: 1F1B step at most GPipe's flow-shop step (s)",
            expected["step"],
            _simulated(obs, "1f1b").makespan,
            kind="exact",
            relation="<=",
        ),
    ]


def _argument_bytes(run: SplitRun, config: Config) -> int:
    """What each device's step takes as arguments: the widest stage's blocks and mask, every micro-batch, the tables."""
    block = preset(config.model)
    block_weights = 4 * block.block_parameters // block.layers  # float32
    widest, p, m = max(run.split), len(run.split), config.micro_batches
    data = 2 * m * config.micro_batch_size * block.seq * block.embed * 4  # inputs and targets, on every device
    tables = run.max_ticks * p * (3 + 2 + 2) * 4 + 4  # action, two receive tables, the tick count (int32)
    return widest * (block_weights + 4) + data + tables


def _run_checks(run: SplitRun, config: Config) -> list[Check]:
    label = f"split {_label(run.split)}"
    checks = [
        check(
            f"{label}: XLA's argument bytes per device = widest stage x (a block's weights + its mask) + data + tables",
            _argument_bytes(run, config),
            run.argument_bytes,
            kind="exact",
        )
    ]
    for n in run.numerics:
        checks += [
            check(
                f"{label}: executed {n.schedule} loss against the same model without a pipeline",
                run.reference_loss,
                n.loss,
                kind="model",
                rtol=LOSS_RTOL,
                basis=LOSS_BASIS,
            ),
            check(
                f"{label}: executed {n.schedule} gradient elements off the unpipelined model's by more than "
                f"{GRAD_RTOL:g} of the largest",
                0,
                n.grads_off,
                kind="exact",
            ),
        ]
    return checks


# --- the clock ------------------------------------------------------------------------------------


def _rr(obs: Observations) -> RoundRobin:
    return RoundRobin(dict(obs.samples))


def _times(obs: Observations, run: SplitRun) -> StageTimes:
    """Per-tick times of one split, from its calibration grids in the shared round robin."""
    prefix = f"{_label(run.split)} "
    samples = {k.removeprefix(prefix): v for k, v in obs.samples.items() if k.startswith(prefix)}
    return stage_times(RoundRobin(samples), dict(run.calibration_ticks), len(run.split))


def _per_stage(times: StageTimes) -> list[float]:
    return [f + b for f, b in zip(times.forward, times.backward)]


def _heavy_ratio(obs: Observations) -> tuple[float | str, float]:
    """(measured, by blocks): F+B alone of the stage with the most blocks over the median of the others'.

    "not resolved" when a stage's grid was no slower than the empty step (floored at the clock's resolution):
    a ratio of floors says nothing about the stages.
    """
    uneven = obs.runs[0]
    times = _times(obs, uneven)
    per_stage = _per_stage(times)
    heavy = uneven.split.index(max(uneven.split))
    others = [t for s, t in enumerate(per_stage) if s != heavy]
    others_blocks = [b for s, b in enumerate(uneven.split) if s != heavy]
    by_blocks = max(uneven.split) / float(np.median(others_blocks))
    if any(name.endswith(f"stage {s}") for name in times.floored for s in range(len(uneven.split))):
        return UNRESOLVED, by_blocks
    return per_stage[heavy] / float(np.median(others)), by_blocks


UNRESOLVED = "not resolved (a stage's grid no slower than the empty step)"


def _step_ratio(obs: Observations, name: str = "gpipe") -> float:
    uneven, even = (_label(r.split) for r in obs.runs)
    return _rr(obs).ratio(f"{uneven} {name}", f"{even} {name}")


def _timing_checks(obs: Observations) -> list[Check]:
    """The one thing this host's clock resolves run after run: the uneven split is slower.

    How a stage's tick follows its blocks (each stage timed alone) is shown, not judged: it read 1.10x, 1.26x and
    1.75x for twice the blocks in successive runs, and nothing at all (every grid no slower than the empty step)
    on a busier host.
    """
    uneven, even = obs.runs
    return [
        check(
            f"GPipe step, split {_label(uneven.split)} over split {_label(even.split)} (at least)",
            1.0,
            _step_ratio(obs),
            kind="timing",
            relation=">=",
            basis="claim tested here: moving blocks until the stages are even shortens the step; both splits in "
            "one round robin, median over rounds of their ratio",
        ),
    ]


# --- claims ---------------------------------------------------------------------------------------


def _claims(obs: Observations, config: Config) -> list[Claim]:
    m, g, o = config.micro_batches, _simulated(obs, "gpipe"), _simulated(obs, "1f1b")
    slow, fast = TEXTBOOK_COSTS
    equal = theory.pipeline_bubble_fraction(2, m)
    pace = (m - 1) * 2 * slow  # the slow stage's steady state: m - 1 forwards and backwards after the fill
    steady_wait = slow - fast  # per micro-batch and phase, in steady state
    idle = g.makespan - g.busy[-1]
    per_micro_batch = idle / m
    wait_status = (
        "refuted"
        if steady_wait != TEXTBOOK_WAIT
        else "confirmed"
        if math.isclose(per_micro_batch, 2 * TEXTBOOK_WAIT)
        else "refined"
    )
    ratio = _step_ratio(obs)
    return [
        Claim(
            "the pipeline's time is set by its slowest stage",
            "confirmed" if math.isclose(g.makespan, pace + sum(TEXTBOOK_COSTS) * 2) else "refuted",
            f"2 s and 1 s, m={m}: GPipe {g.makespan:g} s = (m-1)(2+2) = {pace:g} s of the slow stage's pace plus "
            f"{g.makespan - pace:g} s of fill and drain; 1F1B {o.makespan:g} s",
        ),
        Claim(
            "the fast stage waits 1 s per step",
            wait_status,
            f"in steady state {steady_wait:g} s per micro-batch and phase, but with the fill and drain it idles "
            f"{idle:g} s of the {g.makespan:g} s step: {per_micro_batch:g} s per micro-batch, not "
            f"{2 * TEXTBOOK_WAIT:g}",
        ),
        Claim(
            "with unequal stages the bubble is no longer (P-1)/(m+P-1)",
            "confirmed" if not math.isclose(g.bubble, equal) else "refuted",
            f"simulated {g.bubble:.3f} against {equal:.3f} for equal stages",
        ),
        Claim(
            "moving layers from the slow stage to the fast one fixes it",
            "confirmed" if ratio > 1 else "refuted",
            f"executed here, GPipe with blocks {_label(obs.runs[0].split)} takes {ratio:.2f}x the step with "
            f"{_label(obs.runs[1].split)} (median over rounds of one round robin)",
        ),
    ]


# --- the page -------------------------------------------------------------------------------------


def _predictions(obs: Observations, run: SplitRun, m: int) -> dict:
    times = _times(obs, run)
    costs = times.costs()
    found = {"formula_gpipe_s": theory.imbalanced_step_time(costs.forward, costs.backward, m) + times.call}
    for name in SCHEDULES:
        schedule = make_schedule(name, len(run.split), m)
        timeline = simulate(schedule, costs)
        found[name] = {
            "simulated_s": timeline.makespan + times.call,
            "simulated_bubble": timeline.bubble_fraction,
            "host_s": lockstep_makespan(schedule.grid(), times.tick) + times.call,
        }
    return found


def _table(obs: Observations, config: Config) -> Table:
    body, rr = [], _rr(obs)
    for r in obs.runs:
        times, predicted = _times(obs, r), _predictions(obs, r, config.micro_batches)
        per_stage = " / ".join(f"{t * 1e3:.2f}" for t in _per_stage(times))
        for name in SCHEDULES:
            x = predicted[name]
            body.append(
                [
                    _label(r.split),
                    name,
                    per_stage,
                    str(rr.timing(f"{_label(r.split)} {name}")),
                    f"{rr.timing(f'{_label(r.split)} ideal').median * 1e3:.1f}",
                    f"{x['simulated_s'] * 1e3:.1f}",
                    f"{predicted['formula_gpipe_s'] * 1e3:.1f}" if name == "gpipe" else "",
                    f"{x['host_s'] * 1e3:.1f}",
                    f"{x['simulated_bubble']:.3f}",
                ]
            )
    uneven, even = obs.runs
    by_blocks = theory.imbalanced_step_time(
        uneven.split, [2 * b for b in uneven.split], config.micro_batches
    ) / theory.imbalanced_step_time(even.split, [2 * b for b in even.split], config.micro_batches)
    up, ep = _predictions(obs, uneven, config.micro_batches), _predictions(obs, even, config.micro_batches)
    return Table(
        "Executed with an uneven and an even split of the same blocks",
        [
            "blocks per stage",
            "schedule",
            "F+B per stage, alone (ms)",
            "step, measured (median [min, max])",
            "no bubble (ms)",
            "simulated (ms)",
            "flow-shop formula (ms)",
            "shared-host model (ms)",
            "bubble, simulated",
        ],
        body,
        note="Stage times are ticks with that stage working alone, measured in the same round robin as the steps "
        "of both splits. Simulated = lab.parallel.pipeline.schedules.simulate with those times (a device per "
        "stage); shared-host model = tick by tick on this host (see the pipeline_bubble page). GPipe step, uneven "
        f"over even: measured {_step_ratio(obs):.2f}x; the flow-shop formula with stage times in proportion to "
        f"the blocks predicts {by_blocks:.2f}x, the simulator with the measured stage times "
        f"{up['gpipe']['simulated_s'] / ep['gpipe']['simulated_s']:.2f}x, the shared-host model "
        f"{up['gpipe']['host_s'] / ep['gpipe']['host_s']:.2f}x. None of these is a check: the first two assume a "
        "device per stage, which this host is not, and the third is fitted to this host's calibration ticks.",
    )


def _textbook_table(obs: Observations, config: Config) -> Table:
    body = [
        [s.schedule, f"{s.makespan:g}", " / ".join(f"{s.makespan - b:g}" for b in s.busy), f"{s.bubble:.3f}"]
        for s in obs.textbook
    ]
    return Table(
        "The quick-reference's case: stage 0 takes 2 s, stage 1 takes 1 s (simulated)",
        ["schedule", "step (s)", "idle per stage (s)", "bubble"],
        body,
        note=f"GPipe flow-shop formula: {_textbook_theory(config.micro_batches)['step']:g} s.",
    )


def _plot(obs: Observations, config: Config):
    timelines, titles = [], []
    for r in obs.runs:
        t = _times(obs, r)
        in_ms = Costs(tuple(f * 1e3 for f in t.forward), tuple(b * 1e3 for b in t.backward))
        for name in SCHEDULES:
            timelines.append(simulate(make_schedule(name, len(r.split), config.micro_batches), in_ms))
            titles.append(f"{name}, blocks {_label(r.split)}, simulated with the stage times measured here")
    return timeline_figure(timelines, titles=titles, unit="ms")


def _summary(obs: Observations, config: Config) -> str:
    uneven, even = obs.runs
    g = _simulated(obs, "gpipe")
    up, ep = _predictions(obs, uneven, config.micro_batches), _predictions(obs, even, config.micro_batches)
    rr = _rr(obs)
    measured, by_blocks = _heavy_ratio(obs)
    u, e = _label(uneven.split), _label(even.split)
    return (
        "The slowest stage sets the pace. In the quick-reference's case "
        f"(2 s and 1 s, m = {config.micro_batches}) GPipe takes {g.makespan:g} s and the fast stage idles "
        f"{g.makespan - g.busy[-1]:g} s: its bubble is {g.bubble:.0%}, not the "
        f"{theory.pipeline_bubble_fraction(2, config.micro_batches):.0%} of equal stages. Executed with blocks {u}, "
        f"the simulator predicts GPipe at {up['gpipe']['simulated_s'] * 1e3:.0f} ms from the measured stage times "
        f"against {ep['gpipe']['simulated_s'] * 1e3:.0f} ms after moving blocks to {e}; measured here "
        f"{rr.timing(f'{u} gpipe').median * 1e3:.0f} ms against {rr.timing(f'{e} gpipe').median * 1e3:.0f} ms "
        f"({_step_ratio(obs):.2f}x; 1F1B {_step_ratio(obs, '1f1b'):.2f}x). Every device holds the widest stage's "
        "blocks (XLA's argument bytes show the padding), and a stage's tick alone does not follow its blocks "
        f"reliably here: the stage with {by_blocks:g}x the blocks took {_times_text(measured)} the others' time "
        "(not judged: that ratio moves with the host's load)."
    )


def _times_text(ratio: float | str) -> str:
    return (
        f"{ratio:.2f}x"
        if isinstance(ratio, float)
        else "an unresolved multiple of (its grids no slower than the empty step)"
    )


def _notes(obs: Observations) -> list[str]:
    uneven, even = obs.runs
    tu, te = _times(obs, uneven), _times(obs, even)
    notes = [
        "Stages run the same SPMD program, so an uneven split pads every stage's weights to the widest stage (the "
        "argument-bytes checks) and skips the padding layers with a lax.cond: a stage computes only its own blocks, "
        f"but its buffers and bookkeeping are the widest stage's: an idle tick took {tu.idle * 1e3:.3f} ms with "
        f"blocks {_label(uneven.split)} against {te.idle * 1e3:.3f} ms with {_label(even.split)}, and the step "
        f"outside its ticks {tu.call * 1e3:.2f} ms against {te.call * 1e3:.2f} ms.",
        "The emulated stages share this host's cores, so the clock is not evidence for the flow-shop pace: while "
        "the fast stage waits, the slow one gets its cores. The simulator (a device per stage) judges the pace; "
        "the clock is asked only what this host can show: that the uneven split is slower, and how a stage's "
        "tick time follows its blocks when it works alone.",
    ]
    for r, t in ((uneven, tu), (even, te)):
        notes.append(
            f"blocks {_label(r.split)}: host sharing {t.sharing:.2f} (a tick with every stage busy over a tick "
            "with one)"
            + (
                f"; no slower than the empty step, floored at the clock's resolution: {', '.join(t.floored)}"
                if t.floored
                else ""
            )
            + "."
        )
    return [*notes, load_note(obs.load, obs.cores)]
