"""Pipeline bubbles: GPipe, 1F1B, interleaved and ZB-H1, simulated and executed.

Question #43 asks what a pipeline bubble is. A pipeline cuts the layers into P
stages on P devices and the batch into m micro-batches; a stage can only work
on a micro-batch once the stage before has finished it (forward) or the stage
after has sent its gradient back (backward). While the pipe fills and drains,
stages wait: with equal stages that idle share is (P-1)/(m+P-1).

Schedules are data here (lab.parallel.pipeline.schedules): per-stage action orders that
a simulator times, drawn as the textbook grid and as timelines. This page

1. simulates GPipe, 1F1B, interleaved 1F1B and ZB-H1 for P in {2, 4, 8} and
   m = 1..32, next to the formulas: 1F1B has exactly GPipe's bubble (it bounds
   the micro-batches in flight to about P instead of m); interleaving v
   chunks is what shrinks it, to (P-1)/(v·m+P-1); ZB-H1 fills it with weight
   gradients;
2. redraws the quick-reference's 4-stage, 4-micro-batch figure, checks it
   against the simulator and the data dependencies, and its arithmetic;
3. executes GPipe, 1F1B and interleaved 1F1B (lab.parallel.pipeline.loop:
   shard_map over ``stage``, ppermute, a hand-made vjp per micro-batch),
   checks loss and gradients against the model without a pipeline, and
   measures the bubble against the same work with no bubble.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass

import jax
import numpy as np
from matplotlib.figure import Figure

from experiments import kit
from lab import hlo, theory
from lab.devices import DEFAULT_TARGET, devices_for
from lab.errors import LabError
from lab.model import preset
from lab.parallel.pipeline import loop
from lab.parallel.pipeline.render import ascii_grid, chrome_trace, timeline_figure
from lab.parallel.pipeline.schedules import (
    Action,
    Costs,
    dependency_violations,
    gpipe,
    lockstep_makespan,
    make_schedule,
    simulate,
)
from lab.parallel.pipeline.stages import (
    StageSplit,
    Workload,
    example_batch,
    init_weights,
    reference_loss_and_grads,
    staged_weights,
    unstage_weights,
)
from lab.parallel.pipeline.timing import (
    calibration_grid,
    calibration_tables,
    ideal_tables,
    load_note,
    stage_times,
    time_round_robin,
)
from lab.progress import track
from lab.report import Result, Table, provenance
from lab.verdict import Check, check

QUESTION = "#43"

# The quick-reference's figure and total for P = 4, m = 4, quoted as printed.
TEXTBOOK_FIGURE = """\
Stage0: [F0][F1][F2][F3][B0][B1][B2][B3]
Stage1:     [F0][F1][F2][F3]    [B0][B1][B2][B3]
Stage2:         [F0][F1][F2][F3]    [B0][B1][B2][B3]
Stage3:             [F0][F1][F2][F3]    [B0][B1][B2][B3]"""
TEXTBOOK_TOTAL = "总时间 = 4 + 4 + 4 - 1 = 11 (理想 4×4=16，实际 11，有 bubble)"

SIMULATED_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")


@dataclass(frozen=True)
class Config:
    target: str = DEFAULT_TARGET
    """where to run (cpu:N, gpu, tpu)"""
    stages: tuple[int, ...] = (2, 4, 8)
    """P for the simulated bubble table"""
    micro_batches: int = 32
    """simulate m = 1 .. this"""
    measured_stages: tuple[int, ...] = (4,)
    """P to execute on the target (each needs P devices)"""
    measured_micro_batches: tuple[int, ...] = (1, 4, 8)
    """m to execute for each measured P"""
    chunks: int = 2
    """v, chunks per device for the interleaved schedule"""
    micro_batch_size: int = 4
    """sequences per micro-batch in the executed pipeline"""
    layers_per_stage: int = 2
    """transformer blocks per stage (per chunk: this divided by v)"""
    model: str = "tiny"
    """block sizes, a lab.model preset"""
    repeats: int = 5


@dataclass(frozen=True)
class WorkedExample:
    """The quick-reference's P = 4, m = 4 figure and arithmetic against the simulator (F = B = 1 tick)."""

    grid: str  # the simulated schedule, drawn as the textbook grid
    makespan: float  # ticks
    bubble: float
    idle_per_stage: tuple[float, ...]
    textbook_total: int
    textbook_ideal: int
    textbook_figure_span: float  # ticks the quoted figure spans
    violations: tuple[str, ...]  # the figure's actions that start before their input exists
    ideal: float  # one stage's own work, m(F+B)
    checks: tuple[Check, ...]


@dataclass(frozen=True)
class Executed:
    """GPipe and 1F1B executed on P stages for each measured m, with the per-stage times behind the models."""

    P: int
    rows: list[dict]  # per m: the ideal, the formula, and per schedule time, bubble and both predictions
    stage_times: dict
    sharing: float  # a tick with every stage busy over a tick with one
    reference_loss: float | None  # the unpipelined loss, for the largest P
    checks: tuple[Check, ...]


@dataclass(frozen=True)
class Interleaved:
    """Interleaved 1F1B executed on the same layers, weights and data."""

    P: int
    m: int
    v: int
    time_s: float
    ideal_s: float
    bubble: float
    formula: float
    checks: tuple[Check, ...]


def run(config: Config) -> Result:
    devices = devices_for(config.target)
    _check(config, len(devices))
    simulated = _simulate_sweep(config)
    example = _worked_example()
    executed = [_execute(config, p, devices) for p in track(config.measured_stages, "executing pipelines")]
    interleaved = _execute_interleaved(config, max(config.measured_stages), devices, executed[-1].reference_loss)
    checks = [
        *_simulation_checks(simulated, config),
        *example.checks,
        *(c for e in executed for c in e.checks),
        *(interleaved.checks if isinstance(interleaved, Interleaved) else ()),
    ]
    return Result(
        summary=_summary(simulated, example, executed, interleaved, config),
        theory=_theory(example),
        tables=[
            _bubble_table(simulated, executed, config),
            _executed_table(executed, interleaved),
            _memory_table(simulated, config),
        ],
        checks=checks,
        plots={"bubble": _bubble_plot(simulated, executed, config), "timelines": _timelines_plot(config)},
        notes=_notes(executed, interleaved),
        provenance=provenance(target=config.target, devices=devices, mesh=f"stage={max(config.measured_stages)}"),
        data={
            "simulated": simulated,
            "worked_example": kit.numbers(example),
            "executed": [kit.numbers(e) for e in executed],
            "interleaved": kit.numbers(interleaved),
        },
        # Chrome trace-event files: open them in Perfetto (ui.perfetto.dev) or chrome://tracing
        files={
            f"trace_{name}.json": chrome_trace(
                simulate(
                    make_schedule(name, 4, 8, config.chunks if name == "interleaved" else 1), Costs.uniform(4, 1.0, 2.0)
                )
            )
            for name in SIMULATED_SCHEDULES
        },
    )


def _check(config: Config, device_count: int) -> None:
    if config.micro_batches < 1 or not config.measured_micro_batches or min(config.measured_micro_batches) < 1:
        raise LabError("micro-batch counts must be positive; e.g. --micro-batches 32 --measured-micro-batches 1 4 8")
    if config.layers_per_stage % config.chunks:
        raise LabError(
            f"{config.layers_per_stage} layers per stage do not split into "
            f"v={config.chunks} chunks; use a multiple of {config.chunks}"
        )
    for p in (*config.measured_stages, *config.stages):
        if p < 1:
            raise LabError(f"P={p}: a pipeline needs at least one stage")
    if max(config.measured_stages) > device_count:
        p = max(config.measured_stages)
        raise LabError(
            f"a {p}-stage pipeline needs a stage axis of {p} devices, but "
            f"{config.target} has {device_count}; measure at most {device_count} "
            "stages"
        )


# --- 1. simulation ---------------------------------------------------------------------------


def _simulate_sweep(config: Config) -> list[dict]:
    """Every schedule for every (P, m), with F = B (the formulas' assumption)."""
    rows = []
    for p in config.stages:
        for m in range(1, config.micro_batches + 1):
            row = {
                "P": p,
                "m": m,
                "formula": theory.pipeline_bubble_fraction(p, m),
                "formula_interleaved": theory.pipeline_bubble_fraction(p, m, config.chunks),
            }
            for name in SIMULATED_SCHEDULES:
                if name == "interleaved" and m % p:
                    continue
                schedule = make_schedule(name, p, m, config.chunks if name == "interleaved" else 1)
                # ZB-H1 splits B into I and W of equal cost: F = I = W, i.e. B = 2F; the others use F = B
                timeline = simulate(schedule, Costs.uniform(p, 1.0, 2.0 if name == "zb-h1" else 1.0))
                row[name] = {
                    "bubble": timeline.bubble_fraction,
                    "makespan": timeline.makespan,
                    "peak_in_flight": timeline.peak_in_flight[0],
                }
            rows.append(row)
    return rows


def _simulation_checks(rows: list[dict], config: Config) -> list:
    worst = {
        name: max(
            abs(r[name]["bubble"] - r["formula" if name != "interleaved" else "formula_interleaved"])
            for r in rows
            if name in r
        )
        for name in ("gpipe", "1f1b", "interleaved")
    }
    span = f"P in {sorted(config.stages)}, m = 1..{config.micro_batches}"
    checks = [
        check(f"GPipe bubble = (P-1)/(m+P-1), largest deviation ({span})", 0.0, worst["gpipe"], rtol=1e-9),
        check(f"1F1B bubble = GPipe's (P-1)/(m+P-1), largest deviation ({span})", 0.0, worst["1f1b"], rtol=1e-9),
        check(
            f"interleaved v={config.chunks} bubble = (P-1)/(v·m+P-1), largest deviation (m a multiple of P)",
            0.0,
            worst["interleaved"],
            rtol=1e-9,
        ),
    ]
    big = [r for r in rows if r["m"] >= r["P"]]
    checks.append(
        check(
            "1F1B peak micro-batches in flight on stage 0 (m >= P), largest / P",
            1.0,
            max(r["1f1b"]["peak_in_flight"] / r["P"] for r in big),
            rtol=1e-9,
        )
    )
    checks.append(
        check(
            "GPipe peak micro-batches in flight on stage 0, smallest / m",
            1.0,
            min(r["gpipe"]["peak_in_flight"] / r["m"] for r in rows),
            rtol=1e-9,
        )
    )
    zb = [r for r in big if "zb-h1" in r]
    zb_formula = max(abs(r["zb-h1"]["makespan"] - theory.zero_bubble_h1_step_time(r["P"], r["m"], 1, 1, 1)) for r in zb)
    checks.append(
        check(
            "ZB-H1 makespan = m(F+I+W) + (P-1)(F+I-W) with F=I=W (m >= P), largest deviation",
            0.0,
            zb_formula,
            rtol=1e-9,
        )
    )
    return checks


# --- 2. the worked example -------------------------------------------------------------------


def _parse_textbook_figure(text: str) -> dict[tuple[int, Action], int]:
    """The quoted figure as (stage, action) -> start tick: every 4-character cell is one tick."""
    starts = {}
    for line in text.splitlines():
        label, _, cells = line.partition(": ")
        stage = int(label.removeprefix("Stage"))
        for tick in range(len(cells) // 4 + 1):
            cell = cells[4 * tick : 4 * tick + 4]
            if match := re.fullmatch(r"\[([FB])(\d+)\]", cell):
                starts[stage, Action(match[1], int(match[2]))] = tick
    return starts


def _worked_example() -> WorkedExample:
    """P = 4, m = 4, F = B = 1 tick: the simulator against the quick-reference's figure and arithmetic."""
    schedule = gpipe(4, 4)
    timeline = simulate(schedule, Costs.uniform(4))
    drawn = _parse_textbook_figure(TEXTBOOK_FIGURE)
    unit = Costs.uniform(4)
    drawn_span = max(start + unit.of(s, a, 1) for (s, a), start in drawn.items())
    violations = dependency_violations(schedule, drawn, unit)
    claimed_total = int(re.search(r"=\s*(\d+)\s*\(", TEXTBOOK_TOTAL)[1])
    claimed_ideal = int(re.search(r"(\d+)×(\d+)=(\d+)", TEXTBOOK_TOTAL)[3])
    ideal = max(timeline.busy)
    why_total = (
        "the backward of a micro-batch runs through stages 3, 2, 1, 0 in "
        "turn, after the forward has run through 0..3: "
        f"(m+P-1)(F+B) = {timeline.makespan:g} ticks; 4+4+4-1 counts one "
        "pass of the backward as if it overlapped the forward"
    )
    checks = (
        check(
            "P=4, m=4 GPipe makespan: (m+P-1)(F+B) against the simulator (ticks)",
            theory.pipeline_step_time(4, 4, 1, 1),
            timeline.makespan,
            rtol=1e-9,
        ),
        check(
            "P=4, m=4 GPipe makespan: the quick-reference's total against the simulator (ticks)",
            claimed_total,
            timeline.makespan,
            explained=why_total,
        ),
        check(
            "P=4, m=4: the quick-reference's 'ideal' against the work per stage m(F+B) (ticks)",
            claimed_ideal,
            ideal,
            explained=f"the ideal is one stage's own work, m(F+B) = {ideal:g} "
            "ticks; 4x4 = 16 is the forward work of all four stages, "
            "which run in parallel, and an ideal above the real time "
            "cannot be right",
        ),
        check(
            "P=4, m=4: actions in the quick-reference's figure that start before their input exists",
            0,
            len(violations),
            explained=f"{len(violations)} backward actions in the figure run before "
            "the gradient they need: the figure sends the backward "
            "from stage 0 to 3, the wrong way",
        ),
        check(
            "P=4, m=4 bubble: simulator against (P-1)/(m+P-1)",
            theory.pipeline_bubble_fraction(4, 4),
            timeline.bubble_fraction,
            rtol=1e-9,
        ),
    )
    return WorkedExample(
        grid=ascii_grid(schedule),
        makespan=timeline.makespan,
        bubble=timeline.bubble_fraction,
        idle_per_stage=tuple(timeline.idle),
        textbook_total=claimed_total,
        textbook_ideal=claimed_ideal,
        textbook_figure_span=drawn_span,
        violations=tuple(violations),
        ideal=ideal,
        checks=checks,
    )


# --- 3. the executed pipelines ---------------------------------------------------------------


def _workload(config: Config, stages: int, micro_batches: int, chunks: int = 1) -> Workload:
    layers = config.layers_per_stage * stages
    block = preset(config.model)
    return Workload(
        block, StageSplit.even(layers, stages * chunks), config.micro_batch_size * micro_batches, micro_batches
    )


def _execute(config: Config, stages: int, devices) -> Executed:
    """GPipe and 1F1B for each measured m on one program, against the ideal and the simulator."""
    m_max = max(config.measured_micro_batches)
    workload = _workload(config, stages, m_max)
    runs = {
        (name, m): loop.schedule_tables(make_schedule(name, stages, m))
        for name in ("gpipe", "1f1b")
        for m in config.measured_micro_batches
    }
    ideals = {("ideal", m): ideal_tables(stages, m) for m in config.measured_micro_batches}
    calibration = calibration_tables(stages, min(4, m_max))  # per-tick times: a few ticks each suffice
    program = loop.build(
        workload, loop.pipeline_mesh(devices, stages), [*runs.values(), *ideals.values(), *calibration.values()]
    )
    weights = init_weights(workload)
    inputs, targets = example_batch(workload)
    placed = program.place(staged_weights(workload, weights, stages), inputs, targets)
    # one round robin for the runs and the calibration grids, so that both see the same load
    timings = time_round_robin(
        {key: program.runner(placed, t) for key, t in (runs | ideals | calibration).items()}, config.repeats
    )
    times = stage_times(timings, calibration, stages)
    rows, checks = [], []
    for m in config.measured_micro_batches:
        row, row_checks = _executed_row(stages, m, timings, times, perf=m == m_max)
        rows.append(row)
        checks += row_checks
    reference_loss = None
    if stages == max(config.measured_stages):
        reference_loss, numerics = _numerics_checks(program, placed, workload, weights, inputs, targets, runs, m_max)
        checks += numerics + _collective_checks(program, workload)
    return Executed(stages, rows, dataclasses.asdict(times), times.sharing, reference_loss, tuple(checks))


def _executed_row(stages: int, m: int, timings: dict, times, *, perf: bool) -> tuple[dict, list]:
    """One measured m: the row of numbers, and its checks (for the largest m only)."""
    ideal_grid = calibration_grid(stages, m, 1, tuple(range(stages)))
    host_ideal = lockstep_makespan(ideal_grid, times.tick) + times.call
    row = {
        "P": stages,
        "m": m,
        "ideal_s": timings.timing(("ideal", m)).median,
        "formula": theory.pipeline_bubble_fraction(stages, m),
    }
    checks = []
    for name in ("gpipe", "1f1b"):
        schedule = make_schedule(name, stages, m)
        measured = timings.timing((name, m)).median
        simulated = simulate(schedule, times.costs()).makespan + times.call
        host = lockstep_makespan(schedule.grid(), times.tick) + times.call
        row[name] = {
            "time_s": measured,
            "spread": timings.timing((name, m)).spread,
            "bubble": 1 - timings.ratio(("ideal", m), (name, m)),
            "simulated_s": simulated,
            "host_s": host,
            "host_bubble": 1 - host_ideal / host,
        }
        if not perf:
            continue
        shared = times.sharing > 1.15
        why = (
            f"P={stages} emulated devices share this host's cores (a tick "
            f"with every stage busy takes {times.sharing:.2f}x one with a "
            "single stage): "
            "stages idle in the bubble lend their cores to the busy ones, "
            f"and the shared-host model predicts {row[name]['host_bubble']:.1%}"
        )
        accounted = abs(row[name]["bubble"] - row[name]["host_bubble"]) <= 0.08
        checks.append(
            check(
                f"executed {name} P={stages} m={m}: bubble, measured against (P-1)/(m+P-1)",
                row["formula"],
                row[name]["bubble"],
                rtol=0.25,
                explained=why if shared and accounted else None,
            )
        )
        if name == "1f1b":
            checks.append(
                check(
                    f"executed 1f1b P={stages} m={m}: step time, simulator from per-stage F and B measured alone (s)",
                    simulated,
                    measured,
                    rtol=0.15,
                    explained=why.split(":")[0] + "; the simulator assumes a device per stage" if shared else None,
                )
            )
            checks.append(
                check(
                    f"executed 1f1b P={stages} m={m}: step time, shared-host lockstep model (s)",
                    host,
                    measured,
                    rtol=0.15,
                )
            )
    return row, checks


def _numerics_checks(program, placed, workload, weights, inputs, targets, runs, m: int) -> list:
    reference_loss, reference_grads = reference_loss_and_grads(workload, weights, inputs, targets)
    reference = np.concatenate([np.ravel(g) for g in jax.tree.leaves(reference_grads)])
    checks = []
    for name in ("gpipe", "1f1b"):
        loss, grads = program.run(placed, runs[name, m])
        ours = np.concatenate(
            [
                np.ravel(g)
                for g in jax.tree.leaves(
                    unstage_weights(jax.device_get(grads)["blocks"], workload.split, program.stages)
                )
            ]
        )
        error = float(np.max(np.abs(ours - reference)) / np.max(np.abs(reference)))
        checks.append(
            check(
                f"executed {name} P={program.stages} m={m}: loss against the same model without a pipeline",
                float(reference_loss),
                float(loss),
                rtol=1e-5,
            )
        )
        checks.append(
            check(
                f"executed {name} P={program.stages} m={m}: gradients equal "
                "the unpipelined model's (largest difference below 1e-5 of "
                "the largest gradient)",
                True,
                error < 1e-5,
            )
        )
    return float(reference_loss), checks


def _collective_checks(program, workload: Workload) -> list:
    """What XLA compiled for the exchange: per tick, one activation down and one gradient up the stage axis."""
    found = hlo.inspect_compiled(program.compiled, program.mesh).collectives
    permutes = [c for c in found if c.kind == "collective-permute"]
    activation = math.prod(workload.activation_shape) * 4
    label = f"executed step P={program.stages}"
    return [
        check(f"{label}: collective-permutes in the tick loop (one forward, one backward)", 2, len(permutes)),
        check(
            f"{label}: mesh axes of the permutes",
            "stage",
            ",".join(sorted({",".join(c.axes or ("?",)) for c in permutes})),
        ),
        check(
            f"{label}: bytes per permute = one micro-batch's activation b·S·D·4",
            activation,
            max((c.operand_bytes for c in permutes), default=0),
        ),
        check(
            f"{label}: other collectives (the loss, summed over stages once)",
            "all-reduce",
            ", ".join(c.kind for c in found if c.kind != "collective-permute"),
        ),
    ]


def _execute_interleaved(config: Config, stages: int, devices, reference_loss: float) -> Interleaved | kit.Unavailable:
    """Interleaved 1F1B on the same layers, weights and data as the P-stage run (unpipelined loss `reference_loss`)."""
    m = max(config.measured_micro_batches)
    if m % stages:
        return kit.Unavailable(f"interleaved 1F1B on P={stages}", f"m={m} is not a multiple of P={stages}")
    v = config.chunks
    workload = _workload(config, stages, m, v)
    schedule = make_schedule("interleaved", stages, m, v)
    runs = {"interleaved": loop.schedule_tables(schedule), "ideal": ideal_tables(stages, m, v)}
    program = loop.build(workload, loop.pipeline_mesh(devices, stages), list(runs.values()), v)
    weights = init_weights(workload)
    inputs, targets = example_batch(workload)
    placed = program.place(staged_weights(workload, weights, stages), inputs, targets)
    timings = time_round_robin({k: program.runner(placed, t) for k, t in runs.items()}, config.repeats)
    loss, _ = program.run(placed, runs["interleaved"])
    bubble = 1 - timings.ratio("ideal", "interleaved")
    formula = theory.pipeline_bubble_fraction(stages, m, v)
    checks = (
        check(
            f"executed interleaved P={stages} m={m} v={v}: loss against the same model without a pipeline",
            reference_loss,
            float(loss),
            rtol=1e-5,
        ),
    )
    return Interleaved(
        stages, m, v, timings.timing("interleaved").median, timings.timing("ideal").median, bubble, formula, checks
    )


# --- the page --------------------------------------------------------------------------------


def _theory(example: WorkedExample) -> str:
    violations = "\n".join(f"- {v}" for v in example.violations[:4]) + (
        f"\n- ... ({len(example.violations)} in all)" if len(example.violations) > 4 else ""
    )
    return f"""
With P equal stages, m micro-batches, F and B the time of one micro-batch's forward and backward on one stage:

- **GPipe** (Huang et al. 2019) runs every forward, then every backward. The step takes (m + P - 1)(F + B): each stage
  works m(F + B) and waits (P - 1)(F + B) while the pipe fills and drains. Bubble = **(P - 1)/(m + P - 1)**.
- **1F1B** (PipeDream-flush, Narayanan et al. 2021) starts each micro-batch's backward as soon as it can and then
  alternates one forward, one backward. With F and B equal on every stage this only *reorders* each stage's work:
  the step is the same (m + P - 1)(F + B), the bubble the same (P-1)/(m+P-1) (Narayanan et al. 2021, Sec. 2.2.1).
  What changes is memory: stage s holds at most P - s micro-batches' activations instead of all m.
- **Interleaved 1F1B** (Megatron-LM, ibid. Sec. 2.2.2) gives each device v chunks of layers; a fill or drain step
  then costs (F + B)/v, so the bubble *time* is (P - 1)(F + B)/v and the bubble **(P - 1)/(v·m + P - 1)** ≈ (P-1)/(v·m),
  for v times more sends and about (P - 1)/v more micro-batches in flight on the first stage.
- **ZB-H1** (Qi et al. 2024) splits the backward into the input gradient I (which the previous stage waits for) and
  the weight gradient W (which nobody waits for) and runs W in what would be bubbles: the step is
  m(F + I + W) + (P - 1)(F + I - W), a third of 1F1B's bubble when F = I = W, with 1F1B's peak memory.

### The worked example: P = 4, m = 4

The quick-reference draws this figure and writes `{TEXTBOOK_TOTAL}`:

```
{TEXTBOOK_FIGURE}
```

The simulator (one tick per action, F = B = 1) gives:

```
{example.grid}
```

Makespan {example.makespan:g} ticks, not {example.textbook_total}: each stage works {example.ideal:g} ticks
(m(F+B), the real ideal, not {example.textbook_ideal}) and idles {example.idle_per_stage[0]:g}: bubble
{example.bubble:.4f} = 3/7 = (P-1)/(m+P-1). The figure itself spans {example.textbook_figure_span:g} ticks, not 11,
and it cannot run: its backward goes from stage 0 to stage 3, so stage 0 starts B0 before any gradient exists.
Dependencies it breaks (lab.parallel.pipeline.schedules.dependency_violations):

{violations}
"""


def _bubble_table(rows: list[dict], executed: list[Executed], config: Config) -> Table:
    measured = {(e.P, r["m"]): r for e in executed for r in e.rows}
    body = []
    for r in rows:
        if r["m"] & (r["m"] - 1):  # powers of two in the table; the plot has every m
            continue
        cell = measured.get((r["P"], r["m"]))
        interleaved = r.get("interleaved", {}).get("bubble")
        body.append(
            [
                r["P"],
                r["m"],
                f"{r['formula']:.3f}",
                f"{r['gpipe']['bubble']:.3f}",
                f"{r['1f1b']['bubble']:.3f}",
                f"{cell['gpipe']['bubble']:.3f} / {cell['1f1b']['bubble']:.3f}" if cell else "not run",
                f"{r['formula_interleaved']:.3f}",
                f"{interleaved:.3f}" if interleaved is not None else "m not a multiple of P",
                f"{r['zb-h1']['bubble']:.3f}",
            ]
        )
    return Table(
        "Bubble fraction: formula, simulated (every row) and measured (executed rows)",
        [
            "P",
            "m",
            "(P-1)/(m+P-1)",
            "GPipe, simulated",
            "1F1B, simulated",
            "GPipe / 1F1B, measured",
            f"(P-1)/(v·m+P-1), v={config.chunks}",
            f"interleaved v={config.chunks}, simulated",
            "ZB-H1, simulated (F=I=W)",
        ],
        body,
        note="Simulated with F = B (ZB-H1: F = I = W). Measured = 1 - (the "
        "same work with no bubble) / (the step), on this target; "
        f"measured for P in {sorted(config.measured_stages)} and m in {sorted(config.measured_micro_batches)}, "
        "simulated everywhere.",
    )


def _executed_table(executed: list[Executed], interleaved: Interleaved | kit.Unavailable) -> Table:
    body = []
    for e in executed:
        for r in e.rows:
            for name in ("gpipe", "1f1b"):
                x = r[name]
                body.append(
                    [
                        name,
                        e.P,
                        r["m"],
                        f"{x['time_s'] * 1e3:.1f}",
                        f"{r['ideal_s'] * 1e3:.1f}",
                        f"{x['bubble']:.3f}",
                        f"{r['formula']:.3f}",
                        f"{x['simulated_s'] * 1e3:.1f}",
                        f"{x['host_s'] * 1e3:.1f}",
                        f"{e.sharing:.2f}",
                    ]
                )
    if isinstance(interleaved, Interleaved):
        i = interleaved
        body.append(
            [
                f"interleaved v={i.v}",
                i.P,
                i.m,
                f"{i.time_s * 1e3:.1f}",
                f"{i.ideal_s * 1e3:.1f}",
                f"{i.bubble:.3f}",
                f"{i.formula:.3f}",
                "",
                "",
                "",
            ]
        )
    return Table(
        "Executed on this target: step time against the ideal and two predictions",
        [
            "schedule",
            "P",
            "m",
            "step (ms)",
            "ideal, no bubble (ms)",
            "bubble measured",
            "formula",
            "simulator, per-stage F/B alone (ms)",
            "shared-host lockstep model (ms)",
            "host sharing",
        ],
        body,
        note="Medians of round-robin repeats. The simulator times each action "
        "with its stage's F or B measured alone (a device per stage); "
        "the shared-host model runs the grid tick by tick, each tick costing "
        "its slowest action alone plus what each other busy stage added "
        "in the calibration (lab.parallel.pipeline.timing). "
        "Host sharing = a tick with every stage busy over a tick with one (1.0 on real devices).",
    )


def _memory_table(rows: list[dict], config: Config) -> Table:
    body = [
        [
            r["P"],
            r["m"],
            r["gpipe"]["peak_in_flight"],
            r["1f1b"]["peak_in_flight"],
            r["interleaved"]["peak_in_flight"] if "interleaved" in r else "-",
            r["zb-h1"]["peak_in_flight"],
        ]
        for r in rows
        if r["m"] in (r["P"], 4 * r["P"]) or r["m"] == config.micro_batches
    ]
    return Table(
        "Micro-batches whose activations stage 0 holds at once (simulated; a chunk counts 1/v)",
        ["P", "m", "GPipe", "1F1B", f"interleaved v={config.chunks}", "ZB-H1"],
        body,
        note="1F1B's gain is here, not in the bubble: P instead of m. XLA's "
        "memory analysis of the compiled steps is on the microbatches "
        "page.",
    )


def _bubble_plot(rows: list[dict], executed: list[Executed], config: Config):
    figure = Figure(figsize=(4.2 * len(config.stages), 3.6))
    axes = figure.subplots(1, len(config.stages), sharey=True, squeeze=False)
    for axis, p in zip(axes[0], config.stages):
        mine = [r for r in rows if r["P"] == p]
        ms = [r["m"] for r in mine]
        axis.plot(ms, [r["formula"] for r in mine], "-", color="black", lw=1, label="(P-1)/(m+P-1)")
        axis.plot(
            ms, [r["gpipe"]["bubble"] for r in mine], "o", ms=5, mfc="none", color="#4C78A8", label="GPipe, simulated"
        )
        axis.plot(ms, [r["1f1b"]["bubble"] for r in mine], "x", ms=4, color="#F58518", label="1F1B, simulated")
        axis.plot(
            ms,
            [r["formula_interleaved"] for r in mine],
            "--",
            color="gray",
            lw=1,
            label=f"(P-1)/(v·m+P-1), v={config.chunks}",
        )
        inter = [r for r in mine if "interleaved" in r]
        axis.plot(
            [r["m"] for r in inter],
            [r["interleaved"]["bubble"] for r in inter],
            "s",
            ms=4,
            color="#72B7B2",
            label="interleaved, simulated",
        )
        axis.plot(ms, [r["zb-h1"]["bubble"] for r in mine], ".", color="#54A24B", label="ZB-H1, simulated (F=I=W)")
        for e in executed:
            if p == e.P:
                axis.plot(
                    [r["m"] for r in e.rows],
                    [r["1f1b"]["bubble"] for r in e.rows],
                    "*",
                    ms=11,
                    color="#E45756",
                    label="1F1B, measured here",
                )
                axis.plot(
                    [r["m"] for r in e.rows],
                    [r["1f1b"]["host_bubble"] for r in e.rows],
                    "*",
                    ms=11,
                    mfc="none",
                    color="#E45756",
                    label="1F1B, shared-host model",
                )
        axis.set_xscale("log", base=2)
        axis.set_title(f"P = {p}", fontsize=10)
        axis.set_xlabel("micro-batches m")
        axis.grid(alpha=0.3)
    axes[0, 0].set_ylabel("bubble fraction")
    handles = {label: handle for axis in axes[0] for handle, label in zip(*axis.get_legend_handles_labels())}
    axes[0, -1].legend(handles.values(), handles.keys(), fontsize=7)
    figure.tight_layout()
    return figure


def _timelines_plot(config: Config):
    p, m = 4, 8
    costs = Costs.uniform(p, 1.0, 2.0)
    timelines = [
        simulate(make_schedule(name, p, m, config.chunks if name == "interleaved" else 1), costs)
        for name in SIMULATED_SCHEDULES
    ]
    titles = [
        f"{name} (P={p}, m={m}, F=1, B=2"
        + (f", v={config.chunks})" if name == "interleaved" else ", I=W=1)" if name == "zb-h1" else ")")
        for name in SIMULATED_SCHEDULES
    ]
    return timeline_figure(timelines, titles=titles)


def _summary(rows, example, executed, interleaved, config: Config) -> str:
    at = (
        next(r for r in rows if r["P"] == 4 and r["m"] == 8)
        if any(r["P"] == 4 and r["m"] == 8 for r in rows)
        else rows[-1]
    )
    last = executed[-1].rows[-1]
    text = (
        "A bubble is the time stages wait while the pipe fills and drains: "
        f"(P-1)/(m+P-1) of the step. Simulated for P = {at['P']}, m = {at['m']}: "
        f"GPipe {at['gpipe']['bubble']:.1%}, 1F1B {at['1f1b']['bubble']:.1%} "
        f"(the same: 1F1B keeps {at['1f1b']['peak_in_flight']:g} micro-batches "
        "in flight "
        f"instead of {at['gpipe']['peak_in_flight']:g}, it does not shrink the bubble), interleaved v={config.chunks} "
        f"{at['interleaved']['bubble']:.1%}, ZB-H1 {at['zb-h1']['bubble']:.1%}. "
        "The quick-reference's 4-stage, 4-micro-batch example takes "
        f"{example.makespan:g} ticks, not {example.textbook_total}, "
        "and its figure runs the backward the wrong way. "
        f"Executed here (P = {last['P']}, m = {last['m']}), GPipe and 1F1B "
        "match the unpipelined loss and gradients and measured bubbles of "
        f"{last['gpipe']['bubble']:.1%} and {last['1f1b']['bubble']:.1%} against {last['formula']:.1%}"
    )
    if executed[-1].sharing > 1.15:
        text += (
            ": smaller, because the emulated stages share the host's cores (a busy tick with every stage working "
            f"is {executed[-1].sharing:.2f}x one with a single stage)"
        )
    if isinstance(interleaved, Interleaved):
        text += (
            f"; interleaving (v={interleaved.v}) measured {interleaved.bubble:.1%} against {interleaved.formula:.1%}"
        )
    return text + "."


def _notes(executed: list[Executed], interleaved: Interleaved | kit.Unavailable) -> list[str]:
    notes = [
        (
            "Each executed step is one SPMD program: every device runs the "
            "same loop over the schedule's ticks, picks its action from the "
            "schedule's table (lax.switch), and exchanges activations and "
            "gradients with two collective-permutes per tick. Because the "
            "exchange is a "
            "collective, devices advance in lockstep: a tick lasts as long "
            "as its slowest action, where a GPU pipeline with point-to-point "
            "sends would "
            "let stages run ahead (lab.parallel.pipeline.schedules.simulate)."
        ),
        (
            "The backward is a hand-made vjp per micro-batch: the forward "
            "stores the pullback's residuals in a slot of a buffer sized "
            "to what the "
            "schedule keeps alive (m slots for GPipe, about P for 1F1B), "
            "and the backward rebuilds the pullback from its slot."
        ),
        "GPipe, 1F1B and the calibration grids of one P share one compiled "
        "program: the schedule's tables are arguments of the step, not constants.",
        load_note(),
    ]
    for e in executed:
        t = e.stage_times
        notes.append(
            f"P={e.P}: a forward tick alone {np.mean(t['forward']) * 1e3:.2f} "
            f"ms, a backward tick alone {np.mean(t['backward']) * 1e3:.2f} "
            "ms, "
            f"an idle tick {t['idle'] * 1e3:.2f} ms (the exchange and the "
            f"bookkeeping), with every stage busy {t['forward_all'] * 1e3:.2f} "
            "/ "
            f"{t['backward_all'] * 1e3:.2f} ms: host sharing {e.sharing:.2f}."
        )
    return notes
