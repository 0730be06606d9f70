"""Micro-batches: why more of them shrink the bubble, and why not without limit.

Question #44 asks why more micro-batches reduce the pipeline bubble but cannot
grow without limit. Splitting a fixed batch into m micro-batches shrinks the
bubble, (P-1)/(m+P-1), because the fill and drain take P-1 ticks whatever m
is while the useful ticks grow with m. But every micro-batch pays costs that
do not shrink with it: a tick's fixed work (launch, send, bookkeeping), and
smaller matrix products that use the hardware less well. With work W per
stage and a fixed cost c per micro-batch, the step is (m + P - 1)(W/m + c),
smallest at m* = sqrt((P-1) W / c).

Memory is where the quick-reference's answer needs care: "more micro-batches
usually mean more activation memory" holds for GPipe at a fixed micro-batch
size. For a fixed batch, GPipe keeps the whole batch's activations whatever m
is, and 1F1B keeps only P micro-batches, P/m of the batch: more micro-batches
*save* memory there. This page measures it in XLA's memory analysis of each
compiled step (lab.parallel.pipeline.loop), and checks the rule of thumb
m between 2(P-1) and 4(P-1) against the measured step times.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from matplotlib.figure import Figure

from lab import theory
from lab.devices import DEFAULT_TARGET, devices_for
from lab.errors import LabError
from lab.model import preset
from lab.parallel.pipeline import loop
from lab.parallel.pipeline.schedules import make_schedule
from lab.parallel.pipeline.stages import StageSplit, Workload, example_batch, init_weights, staged_weights
from lab.parallel.pipeline.timing import calibration_tables, ideal_tables, load_note, time_round_robin
from lab.progress import track
from lab.report import Result, Table, provenance
from lab.units import format_bytes
from lab.verdict import check

QUESTION = "#44"

FLAT = 0.10  # "returns flatten": within this fraction of the best measured step time


@dataclass(frozen=True)
class Config:
    target: str = DEFAULT_TARGET
    """where to run (cpu:N, gpu, tpu)"""
    stages: int = 4
    """P, pipeline stages (devices on the stage axis)"""
    batch: int = 32
    """sequences per step, split into m micro-batches"""
    micro_batches: tuple[int, ...] = (1, 8, 32)
    """m to compile and run with 1F1B"""
    gpipe_micro_batches: tuple[int, ...] = (32,)
    """m to also compile with GPipe's buffers (for m <= P they are 1F1B's)"""
    layers_per_stage: int = 2
    model: str = "tiny"
    """block sizes, a lab.model preset"""
    repeats: int = 5


def run(config: Config) -> Result:
    devices = devices_for(config.target)
    _check(config, len(devices))
    rows = [_measure(config, m, devices) for m in track(config.micro_batches, "1F1B against m")]
    gpipe_rows = {m: _gpipe_memory(config, m, devices) for m in track(config.gpipe_micro_batches, "GPipe buffers")}
    fit = _fit(rows, config.stages)
    return Result(
        summary=_summary(rows, gpipe_rows, fit, config),
        theory=THEORY,
        tables=[_table(rows, gpipe_rows, config), _bubble_table(config)],
        checks=_checks(rows, gpipe_rows, fit, config),
        plots={"microbatches": _plot(rows, gpipe_rows, fit, config)},
        notes=_notes(rows, fit, config),
        provenance=provenance(target=config.target, devices=devices, mesh=f"stage={config.stages}"),
        data={"rows": rows, "gpipe": gpipe_rows, "fit": fit},
    )


THEORY = r"""
P stages, a batch of B sequences split into m micro-batches (Huang et al. 2019; Narayanan et al. 2021):

- **bubble**: (P-1)/(m+P-1) for GPipe and 1F1B alike; it falls like 1/m, so each doubling of m buys less;
- **step time**, with W the forward and backward of the whole batch on one stage and c a fixed cost per micro-batch
  per stage (a tick's launch, exchange and bookkeeping, and what smaller products lose in efficiency):
  T(m) = (m + P - 1)(W/m + c) = W + (P-1)W/m + (m+P-1)c, shortest at **m\* = sqrt((P-1) W / c)**
  (lab.theory.optimal_micro_batches): the bubble term (P-1)W/m against the overhead term m·c. Both are measured
  on the executed step: c is a forward and a backward tick in which nobody works (the loop's own cost), W the
  same batch's work with no bubble, less those ticks;
- **activation memory** per stage: GPipe keeps every micro-batch until the backward starts, m·(B/m) = the whole
  batch whatever m is; 1F1B keeps at most P (Narayanan et al. 2021, Sec. 3.2), min(P, m)·B/m. At a fixed
  micro-batch size GPipe's memory grows with m and 1F1B's stops at P; at a fixed batch, as here, 1F1B's *falls*.
  The executed step (lab.parallel.pipeline.loop) keeps each micro-batch's residuals, input and gradient in a slot;
  it needs (depth + 3) slots per device: depth kept, one scratch, and two live within a tick (the action's output
  before it is stored, the slot the backward reads), which XLA's memory analysis can confirm;
- the quick-reference's rule of thumb **m between 2(P-1) and 4(P-1)** leaves a bubble of 1/3 to 1/5 of the step:
  (P-1)/(3(P-1)) and (P-1)/(5(P-1)).
"""


def _check(config: Config, device_count: int) -> None:
    if config.stages > device_count:
        raise LabError(
            f"a {config.stages}-stage pipeline needs a stage axis of {config.stages} "
            f"devices, but {config.target} has {device_count}; use at most "
            f"{device_count} stages"
        )
    for m in (*config.micro_batches, *config.gpipe_micro_batches):
        if m < 1 or config.batch % m:
            raise LabError(
                f"a batch of {config.batch} sequences does not split into m={m} "
                f"equal micro-batches; use divisors of {config.batch}"
            )
    if len(config.micro_batches) < 2:
        raise LabError("give at least two micro-batch counts to compare, e.g. --micro-batches 1 2 4 8 16")


def _workload(config: Config, m: int) -> Workload:
    layers = config.layers_per_stage * config.stages
    return Workload(preset(config.model), StageSplit.even(layers, config.stages), config.batch, m)


def _memory(program: loop.PipelineProgram) -> dict:
    stats = program.compiled.memory_analysis()
    return {
        "temp": int(stats.temp_size_in_bytes),
        "argument": int(stats.argument_size_in_bytes),
        "output": int(stats.output_size_in_bytes),
    }


def _measure(config: Config, m: int, devices) -> dict:
    """1F1B with m micro-batches: XLA's memory analysis, step time, the same work without a bubble."""
    workload = _workload(config, m)
    runs = {
        "1f1b": loop.schedule_tables(make_schedule("1f1b", config.stages, m)),
        "ideal": ideal_tables(config.stages, m),
    }
    calibration = calibration_tables(config.stages, m)
    runs |= {name: calibration[name] for name in ("idle", "no ticks")}
    program = loop.build(workload, loop.pipeline_mesh(devices, config.stages), list(runs.values()))
    inputs, targets = example_batch(workload)
    placed = program.place(staged_weights(workload, init_weights(workload), config.stages), inputs, targets)
    timings = time_round_robin({name: program.runner(placed, t) for name, t in runs.items()}, config.repeats)
    median = {name: timings.timing(name).median for name in runs}
    tick_cost = max(median["idle"] - median["no ticks"], 0.0) / runs["idle"].ticks
    return {
        "m": m,
        "micro_batch_size": workload.micro_batch_size,
        "depth": program.depth,
        **_memory(program),
        "buffers_theory": loop.activation_bytes(workload, runs["1f1b"].depth),
        "gpipe_theory": loop.activation_bytes(workload, m),
        "in_flight": theory.peak_micro_batches_in_flight("1f1b", config.stages, m),
        "time_s": median["1f1b"],
        "spread": timings.timing("1f1b").spread,
        "ideal_s": median["ideal"],
        "bubble": 1 - timings.ratio("ideal", "1f1b"),
        "formula": theory.pipeline_bubble_fraction(config.stages, m),
        # per micro-batch and stage: a forward tick and a backward tick of fixed cost; the rest of the ideal is the work
        "overhead_s": 2 * tick_cost,
        "work_s": median["ideal"] - median["no ticks"] - 2 * m * tick_cost,
    }


def _gpipe_memory(config: Config, m: int, devices) -> dict:
    """GPipe's buffers for m micro-batches, from XLA's memory analysis (compiled, not run)."""
    workload = _workload(config, m)
    tables = loop.schedule_tables(make_schedule("gpipe", config.stages, m))
    program = loop.build(workload, loop.pipeline_mesh(devices, config.stages), [tables])
    return {
        "m": m,
        "depth": program.depth,
        **_memory(program),
        "buffers_theory": loop.activation_bytes(workload, tables.depth),
        "in_flight": theory.peak_micro_batches_in_flight("gpipe", config.stages, m),
    }


def _fit(rows: list[dict], stages: int) -> dict:
    """The optimum the formula gives from the measured work W and per-micro-batch cost c, against the measured one.

    W and c are measured at the best m (W: the batch's forward and backward
    on one stage, c: a forward and a backward tick of nothing).
    """
    best = min(rows, key=lambda r: r["time_s"])
    flat = [r["m"] for r in rows if r["time_s"] <= (1 + FLAT) * best["time_s"]]
    work, overhead = best["work_s"], best["overhead_s"]
    optimum = theory.optimal_micro_batches(stages, work, overhead) if work > 0 and overhead > 0 else float("nan")
    return {
        "work_s": work,
        "overhead_s": overhead,
        "m_star": optimum,
        "best_m": best["m"],
        "flat": flat,
        "work_range_s": (min(r["work_s"] for r in rows), max(r["work_s"] for r in rows)),
        "rule_of_thumb": (2 * (stages - 1), 4 * (stages - 1)),
    }


def _checks(rows: list[dict], gpipe_rows: dict, fit: dict, config: Config) -> list:
    p = config.stages
    checks = []
    for r in rows:
        checks.append(
            check(f"1F1B m={r['m']}: buffer depth (micro-batches kept) against min(P, m)", r["in_flight"], r["depth"])
        )
        checks.append(
            check(
                f"1F1B m={r['m']}: XLA temp memory against (depth + 3) micro-batch slots",
                r["buffers_theory"],
                r["temp"],
                rtol=0.15,
            )
        )
    for m, g in gpipe_rows.items():
        checks.append(check(f"GPipe m={m}: buffer depth against m", g["in_flight"], g["depth"]))
        checks.append(
            check(
                f"GPipe m={m}: XLA temp memory against (depth + 3) micro-batch slots",
                g["buffers_theory"],
                g["temp"],
                rtol=0.15,
            )
        )
    beyond = [r for r in rows if r["m"] > p]
    if beyond and gpipe_rows:
        last = max(beyond, key=lambda r: r["m"])
        if last["m"] in gpipe_rows:
            m = last["m"]
            checks.append(
                check(
                    f"m={m}: 1F1B temp / GPipe temp against (P+3)/(m+3) (fixed batch; P/m for large m)",
                    (p + 3) / (m + 3),
                    last["temp"] / gpipe_rows[m]["temp"],
                    rtol=0.15,
                )
            )
    low, high = fit["rule_of_thumb"]
    fewest, most = fit["work_range_s"]
    cache = (
        (
            f"on this target the batch's work itself depends on m, from {fewest * 1e3:.1f} to {most * 1e3:.1f} ms "
            "(smaller micro-batches keep their working set in cache), which the formula's fixed W leaves out"
        )
        if most > 1.3 * fewest
        else None
    )
    checks.append(
        check(
            "best measured m against m* = sqrt((P-1) W / c), W and c measured at that m",
            round(fit["m_star"], 1),
            fit["best_m"],
            rtol=0.5,
            explained=cache,
        )
    )
    inside = low <= fit["best_m"] <= high
    checks.append(
        check(
            f"rule of thumb: the best measured m lies in [2(P-1), 4(P-1)] = [{low}, {high}]",
            True,
            inside,
            explained=None
            if inside
            else f"the optimum follows W/c, sqrt((P-1)W/c) = {fit['m_star']:.1f} here, which the rule of thumb ignores",
        )
    )
    return checks


def _table(rows: list[dict], gpipe_rows: dict, config: Config) -> Table:
    body = []
    for r in rows:
        g = gpipe_rows.get(r["m"])
        gpipe_temp = (
            format_bytes(g["temp"]) if g else ("same as 1F1B (m <= P)" if r["m"] <= config.stages else "not compiled")
        )
        body.append(
            [
                r["m"],
                r["micro_batch_size"],
                f"{r['formula']:.3f}",
                f"{r['bubble']:.3f}",
                f"{r['time_s'] * 1e3:.1f}",
                f"{r['ideal_s'] * 1e3:.1f}",
                r["depth"],
                format_bytes(r["buffers_theory"]),
                format_bytes(r["temp"]),
                gpipe_temp,
            ]
        )
    return Table(
        f"P = {config.stages}, a batch of {config.batch} sequences split into m micro-batches, 1F1B",
        [
            "m",
            "micro-batch",
            "bubble (formula)",
            "bubble measured",
            "step (ms)",
            "no bubble (ms)",
            "1F1B buffer depth",
            "1F1B activations (theory)",
            "1F1B XLA temp",
            "GPipe XLA temp",
        ],
        body,
        note="Temp = XLA's memory analysis of the compiled step (per device). "
        "Theory: (depth + 3) slots of one micro-batch's residuals, input "
        "and "
        "gradient: depth kept, one scratch, two within a tick (the action's "
        "output before it is stored, the slot the backward reads). "
        "Bubble measured = 1 - median over rounds of (the same work with no bubble) / (the step).",
    )


def _bubble_table(config: Config) -> Table:
    p = config.stages
    ms = sorted({1, 2, 4, 2 * (p - 1), 4 * (p - 1), 8 * (p - 1), 32, 100})
    body = [
        [
            m,
            f"{theory.pipeline_bubble_fraction(p, m):.3f}",
            f"{theory.pipeline_bubble_fraction(p, m) - theory.pipeline_bubble_fraction(p, 2 * m):.3f}",
        ]
        for m in ms
    ]
    return Table(
        f"Bubble against m for P = {p}: what each doubling of m buys",
        ["m", "(P-1)/(m+P-1)", "saved by doubling m"],
        body,
        note="The quick-reference: 'at m = 10 the bubble may already be below "
        f"10%'. For P = {p} it is {theory.pipeline_bubble_fraction(p, 10):.1%}; "
        f"below 10% needs m >= {_m_for(p, 0.10)}.",
    )


def _m_for(stages: int, bubble: float) -> int:
    return next(m for m in range(1, 10_000) if theory.pipeline_bubble_fraction(stages, m) < bubble)


def _plot(rows: list[dict], gpipe_rows: dict, fit: dict, config: Config):
    p = config.stages
    figure = Figure(figsize=(14, 3.8))
    left, middle, right = figure.subplots(1, 3)
    ms = np.array([r["m"] for r in rows])
    dense = np.arange(1, max(64, ms.max()) + 1)
    left.plot(
        dense, [theory.pipeline_bubble_fraction(p, m) for m in dense], "-", color="black", lw=1, label="(P-1)/(m+P-1)"
    )
    left.plot(ms, [r["bubble"] for r in rows], "*", ms=10, color="#E45756", label="1F1B, measured here")
    left.set(xscale="log", xlabel="micro-batches m", ylabel="bubble fraction", title=f"bubble, P={p}")
    low, high = fit["rule_of_thumb"]
    for axis in (left, right):
        axis.axvspan(low, high, color="#54A24B", alpha=0.12, label="2(P-1)..4(P-1)")
    middle.plot(ms, [r["temp"] / 2**20 for r in rows], "o-", color="#F58518", label="1F1B, XLA temp")
    middle.plot(ms, [r["buffers_theory"] / 2**20 for r in rows], ":", color="#F58518", label="1F1B, (depth+3) slots")
    gm = sorted({m for m in ms if m <= p} | set(gpipe_rows))
    gpipe_temp = [
        gpipe_rows[m]["temp"] if m in gpipe_rows else next(r["temp"] for r in rows if r["m"] == m) for m in gm
    ]
    middle.plot(gm, np.array(gpipe_temp) / 2**20, "s", color="#4C78A8", label="GPipe, XLA temp")
    middle.plot(ms, [r["gpipe_theory"] / 2**20 for r in rows], ":", color="#4C78A8", label="GPipe, (m+3) slots")
    middle.set(
        xscale="log",
        xlabel="micro-batches m",
        ylabel="MiB per device",
        title=f"activation memory, fixed batch of {config.batch}",
    )
    right.plot(ms, [r["time_s"] * 1e3 for r in rows], "o-", color="#E45756", label="1F1B step, measured")
    model = (dense + p - 1) * (fit["work_s"] / dense + fit["overhead_s"])
    right.plot(dense, model * 1e3, "--", color="gray", label=f"(m+P-1)(W/m+c), W and c at m={fit['best_m']}")
    flat = [r for r in rows if r["m"] in fit["flat"]]
    right.plot(
        [r["m"] for r in flat],
        [r["time_s"] * 1e3 for r in flat],
        "o",
        ms=12,
        mfc="none",
        color="black",
        label=f"within {FLAT:.0%} of best",
    )
    right.set(xscale="log", xlabel="micro-batches m", ylabel="ms", title="step time, fixed batch")
    for axis in (left, middle, right):
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7)
    figure.tight_layout()
    return figure


def _summary(rows, gpipe_rows, fit, config: Config) -> str:
    p = config.stages
    first, last = rows[0], rows[-1]
    gpipe_last = gpipe_rows.get(last["m"])
    memory = (
        f"GPipe keeps the whole batch whatever m is (XLA temp {format_bytes(gpipe_last['temp'])} "
        f"at m = {last['m']}) while 1F1B keeps P = {p} "
        f"micro-batches: {format_bytes(last['temp'])} at m = {last['m']}, "
        f"{last['temp'] / gpipe_last['temp']:.0%} of GPipe's"
        if gpipe_last
        else ""
    )
    fewest, most = fit["work_range_s"]
    return (
        "More micro-batches shrink the bubble because filling and draining "
        f"the pipe costs P-1 ticks whatever m is: for P = {p}, from "
        f"{first['formula']:.0%} at m = {first['m']} to {last['formula']:.0%} "
        f"at m = {last['m']}. Not without limit, because each micro-batch "
        "pays a fixed "
        f"cost, measured here as c = {fit['overhead_s'] * 1e3:.2f} ms per "
        f"micro-batch and stage: with W = {fit['work_s'] * 1e3:.1f} ms of "
        "work the formula's "
        f"optimum is m* = sqrt((P-1)W/c) = {fit['m_star']:.1f}; the measured "
        f"step was shortest at m = {fit['best_m']} (within {FLAT:.0%}: m "
        f"in {fit['flat']}; "
        f"the rule of thumb says {fit['rule_of_thumb'][0]}..{fit['rule_of_thumb'][1]}), "
        f"and the batch's work itself ranged from {fewest * 1e3:.1f} to "
        f"{most * 1e3:.1f} ms over m on this target. Memory is no argument "
        f"against more micro-batches at a fixed batch: {memory}."
    )


def _notes(rows: list[dict], fit: dict, config: Config) -> list[str]:
    saved = theory.pipeline_bubble_fraction(config.stages, 10) - theory.pipeline_bubble_fraction(config.stages, 100)
    return [
        load_note(),
        (
            "Each m is its own compiled program (a micro-batch's shape is "
            "part of the program); it runs 1F1B's schedule and, in the same "
            "round robin, the same work with no bubble and ticks in which nobody works."
        ),
        "At m <= P 1F1B's warm-up already runs every forward before the "
        "first backward on stage 0, so its buffers are GPipe's.",
        (
            "The quick-reference's 'm = 100 may be worse than m = 10' is "
            f"the m·c term: at c = {fit['overhead_s'] * 1e3:.2f} ms, going "
            "from 10 to 100 "
            f"micro-batches adds {90 * fit['overhead_s'] * 1e3:.0f} ms per stage of fixed cost to save "
            f"{saved:.0%} "
            "of the step in bubble."
        ),
    ]
