"""A slow all-reduce is not always a slow network: the same all-reduce alone and inside a step.

Question #52 says an all-reduce that is slow in training is often fast on its
own (nccl-tests), and that the step, not the library, makes it slow: bucket
size and timing, a collective dragged onto the critical path, other traffic
on the same links. This page measures one all-reduce of the lab transformer's
gradients in isolation, then adds each cause the lab can see, one at a time,
next to what the model says it should cost:

1. **isolation**: one psum of all gradient bytes, nccl-tests style;
2. **inside the step**: the same all-reduce after the backward pass, in one
   program (on a target without asynchronous collectives it is simply added);
3. **bucket size**: the same bytes in small buckets: n launches of alpha_AR;
4. **other traffic on the same axis**: a second all-reduce of the same size on
   the same axis in the same step: the links carry twice the bytes;
5. **exposed position in the schedule** (TPU compiler, compile-only): where the
   gradient all-reduces land in the scheduled step, how much compute sits in
   their windows, and how much the step waits for them, with the default
   compile and with asynchronous collective fusion turned on.

Only after all of these are ruled out is it worth touching library settings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import partial

import jax
import numpy as np
from jax.sharding import PartitionSpec as P
from matplotlib.figure import Figure

from experiments import kit
from lab import hlo, theory
from lab.bench import Timing, time_interleaved
from lab.hlo import schedule
from lab.mesh import MeshSpec, slice_local_shape
from lab.model import preset
from lab.parallel import bucketing
from lab.progress import track
from lab.provenance import Setup
from lab.report import Result, Table
from lab.targets.devices import DEFAULT_TARGET, devices_for, quiet_native_stderr
from lab.units import format_bytes, parse_size
from lab.verdict import Check, Claim, check

QUESTION = "#52"
CHAIN = 64
DEFAULT, FUSED = "default compile", "async collective fusion, one all-reduce per tensor"
# libtpu options that let the gradient all-reduces run asynchronously, overlapped with compute
# (the flags MaxText passes for data parallelism), plus one all-reduce per gradient tensor.
ASYNC_ALL_REDUCE = {
    "xla_tpu_enable_async_collective_fusion": True,
    "xla_tpu_enable_async_collective_fusion_fuse_all_reduce": True,
    "xla_enable_async_all_reduce": True,
    "xla_jf_crs_combiner_threshold_in_bytes": 0,
}
RTOL = 0.3


@dataclass(frozen=True)
class Config:
    target: str = DEFAULT_TARGET
    """where to run (cpu:N, gpu, tpu)"""
    model: str = "small"
    """lab.model preset whose gradients are reduced"""
    seq: int = 16
    """sequence length of the step"""
    small_bucket: str = "256K"
    """the small bucket of cause 3"""
    repeats: int = 7
    """timed rounds, after warm-up (the median is reported)"""
    tpu_topology: str = "v5e:4x4"
    """TPU slice whose compiler schedules the step (compile-only); empty to skip"""
    tpu_sequences_per_chip: int = 4
    """sequences in each chip's batch for the TPU schedule"""


@dataclass(frozen=True)
class Reduction:
    """One all-reduce as compiled: the collective and how many tensors its tuple combines."""

    seen: kit.Seen
    tensors: int


@dataclass(frozen=True)
class Window:
    """One gradient all-reduce in the TPU schedule, as lab.hlo.schedule simulates it on the chip."""

    collective: str  # kind, S and first result shape, as XLA wrote it
    is_async: bool
    compute_s: float  # roofline time of what the schedule runs between its start and done
    comm_s: float  # its transfer on the chip's network (lab.theory)
    runs: int  # runs per step (loop trip counts)


@dataclass(frozen=True)
class TpuSchedule:
    name: str  # DEFAULT or FUSED
    timeline: str  # the entry computation as letters (lab.hlo.schedule.timeline)
    windows: tuple[Window, ...]
    compute_s: float  # the simulated compute of the whole step


@dataclass(frozen=True)
class Tpu:
    topology: str
    chip: str
    chips: int
    mesh_shape: tuple[int, ...]  # the slice-local mesh shape the replica groups were read with
    schedules: tuple[TpuSchedule, ...]

    def schedule(self, name: str) -> TpuSchedule:
        return next(s for s in self.schedules if s.name == name)


@dataclass(frozen=True)
class Observations:
    setup: Setup
    devices: int
    bytes: int  # gradient bytes per device
    small_buckets: int  # buckets of config.small_bucket the gradients fill
    chain_length: int
    timings: dict[str, Timing]  # every program below, timed round-robin
    compiled: dict[str, tuple[Reduction, ...]]  # the all-reduces of isolation, step, same-axis traffic
    tpu: Tpu | None = None
    tpu_unavailable: kit.Unavailable | None = None


# ------------------------------------------------------------------ measure


def measure(config: Config) -> Observations:
    devices = devices_for(config.target)
    mesh = MeshSpec(data=len(devices)).build(devices)
    problem = bucketing.gradient_problem(replace(preset(config.model), seq=config.seq), mesh)
    timings, compiled, small = _measure(problem, parse_size(config.small_bucket), config.repeats)
    tpu = kit.tpu_chips(config.tpu_topology)
    return Observations(
        setup=Setup.of(config.target, devices, f"data={len(devices)}"),
        devices=mesh.shape[problem.axis],
        bytes=sum(leaf.size * leaf.dtype.itemsize for leaf in problem.leaves),
        small_buckets=small,
        chain_length=CHAIN,
        timings=timings,
        compiled=compiled,
        tpu=_tpu(config, problem.config, tpu) if isinstance(tpu, kit.TpuChips) else None,
        tpu_unavailable=tpu if isinstance(tpu, kit.Unavailable) else None,
    )


def _copy_program(mesh, axis: str):
    """Every device's gradients read and written once, no communication: one bucket copy's cost on this target."""
    return jax.jit(jax.shard_map(lambda stacked: [-g for g in stacked], mesh=mesh, in_specs=P(axis), out_specs=P(axis)))


def _measure(problem, small_bucket: int, repeats: int):
    """The same gradient all-reduce (per-tensor psums, combined by XLA) alone, in the step, in buckets, with company;
    and the programs that price its parts: a chain of one-element all-reduces and a copy of the gradients."""
    mesh, axis = problem.mesh, problem.axis
    gradients = bucketing.local_gradient_program(problem).lower(problem.params, problem.tokens).compile()
    stacked = gradients(problem.params, problem.tokens)
    small = bucketing.plan_buckets(problem.leaves, small_bucket)
    twice = [*stacked, *stacked]  # a second all-reduce of as many bytes on the same axis
    calls = {
        "isolation": (bucketing.reduce_program(None, mesh, axis).lower(stacked).compile(), (stacked,)),
        "backward": (gradients, (problem.params, problem.tokens)),
        "step": (
            bucketing.step_program(problem, None).lower(problem.params, problem.tokens).compile(),
            (problem.params, problem.tokens),
        ),
        "small buckets": (bucketing.reduce_program(small, mesh, axis).lower(stacked).compile(), (stacked,)),
        "same-axis traffic": (bucketing.reduce_program(None, mesh, axis).lower(twice).compile(), (twice,)),
        "copy": (_copy_program(mesh, axis).lower(stacked).compile(), (stacked,)),
        **bucketing.launch_cost_programs(mesh, axis, CHAIN),
    }
    compiled = {
        name: tuple(
            Reduction(kit.Seen.of(c), len(c.result_shapes))
            for c in hlo.inspect_compiled(calls[name][0], mesh).collectives
        )
        for name in ("isolation", "step", "same-axis traffic")
    }
    timings = time_interleaved(dict(track(calls.items(), "slow all-reduce programs")), repeats=repeats)
    return timings, compiled, small.count


# ------------------------------------------------------------------ TPU: exposed position in the schedule


def _tpu(config: Config, model_config, tpu: kit.TpuChips) -> Tpu:
    problem = bucketing.gradient_problem(
        model_config, tpu.mesh("data"), sequences_per_device=config.tpu_sequences_per_chip, placed=False
    )
    compiles = {DEFAULT: {}, FUSED: ASYNC_ALL_REDUCE}
    shape = slice_local_shape(problem.mesh)  # what one slice's HLO numbers its replica groups by
    schedules = tuple(
        _tpu_schedule(name, problem, options, tpu, shape) for name, options in track(compiles.items(), "TPU schedules")
    )
    return Tpu(config.tpu_topology, tpu.chip.name, len(tpu), shape, schedules)


def _tpu_schedule(name: str, problem, options: dict, tpu: kit.TpuChips, shape) -> TpuSchedule:
    with quiet_native_stderr():
        compiled = (
            bucketing.step_program(problem, None)
            .lower(problem.params, problem.tokens)
            .compile(compiler_options=options)
        )
    text = compiled.as_text()
    report = schedule.overlap_report(text, tpu.chip, tpu.dims, shape, problem.mesh.axis_names)
    windows = tuple(
        Window(
            f"{w.collective.kind} {format_bytes(w.collective.size_bytes)} {list(w.collective.result_shapes[0])}",
            w.is_async,
            w.compute_s,
            w.comm_s,
            w.runs,
        )
        for w in report.windows
    )
    return TpuSchedule(name, schedule.timeline(text), windows, report.compute_s)


# ------------------------------------------------------------------ judge


@dataclass(frozen=True)
class Model:
    """What one all-reduce costs on this target, from the calibration programs timed with the scenarios."""

    alpha: float  # s: one all-reduce's fixed cost (chain against single)
    beta: float  # bytes/s busbw: the isolated all-reduce's transfer
    copy: float  # s: one copy of every device's gradients, less the call that runs it


def model(obs: Observations) -> Model:
    t = {name: timing.min for name, timing in obs.timings.items()}  # fastest round: load only ever adds time
    alpha = max((t["chain"] - t["single"]) / (obs.chain_length - 1), 0.0)
    transfer = max(t["isolation"] - alpha, 1e-9)
    copy = max(t["copy"] - (t["single"] - alpha), 0.0)  # less one program call (a single all-reduce less alpha)
    return Model(alpha, obs.bytes * theory.bus_bandwidth_factor("all-reduce", obs.devices) / transfer, copy)


@dataclass(frozen=True)
class Scenario:
    name: str
    cause: str
    program: str  # the timing it reads
    allreduce_s: float  # what the all-reduce took in it (fastest round)
    model_s: float


def _scenarios(obs: Observations, m: Model, config: Config) -> list[Scenario]:
    t = {name: timing.min for name, timing in obs.timings.items()}
    iso, n = t["isolation"], obs.devices
    extra = obs.bytes * theory.bus_bandwidth_factor("all-reduce", n) / m.beta
    return [
        Scenario("isolation (nccl-tests style)", "-", "isolation", iso, iso),
        Scenario(
            "inside the step (step - backward: a difference of two times)",
            "none on a synchronous target",
            "step",
            t["step"] - t["backward"],
            iso,
        ),
        Scenario(
            f"{obs.small_buckets} buckets of {format_bytes(parse_size(config.small_bucket))}",
            "bucket size",
            "small buckets",
            t["small buckets"],
            iso + (obs.small_buckets - 1) * m.alpha + 2 * m.copy,  # packed in, unpacked out: two copies
        ),
        Scenario(
            "+ an equal all-reduce on the same axis",
            "other traffic on the axis",
            "same-axis traffic",
            t["same-axis traffic"],
            iso + extra,
        ),
    ]


def judge(obs: Observations, config: Config) -> Result:
    m = model(obs)
    scenarios = _scenarios(obs, m, config)
    checks = _checks(obs, m, scenarios)
    return Result(
        summary=_summary(obs, scenarios),
        theory=THEORY,
        tables=[_scenario_table(obs, m, scenarios), *_tpu_tables(obs)],
        checks=checks,
        claims=_claims(obs, scenarios),
        plots={"slow_allreduce": partial(_plot, obs, scenarios)},
        notes=_notes(obs, m),
    )


def _exposed(w: Window) -> float:
    return w.comm_s - min(w.compute_s, w.comm_s)


def _totals(s: TpuSchedule) -> dict[str, float]:
    comm = sum(w.comm_s * w.runs for w in s.windows)
    exposed = sum(_exposed(w) * w.runs for w in s.windows)
    return {"compute_s": s.compute_s, "comm_s": comm, "exposed_s": exposed, "step_s": s.compute_s + exposed}


def _checks(obs: Observations, m: Model, scenarios: list[Scenario]) -> list[Check]:
    step, buckets, traffic = scenarios[1], scenarios[2], scenarios[3]
    isolation, with_traffic = obs.compiled["isolation"], obs.compiled["same-axis traffic"]
    members = max((r.tensors for r in with_traffic), default=0)
    checks = [
        check(
            "asynchronous collectives in the CPU step",
            0,
            sum(r.seen.is_async for r in obs.compiled["step"]),
            kind="exact",
        ),
        check(
            "the step pays the all-reduce on top of the backward: step - backward against the isolated all-reduce "
            "(ms, at least half)",
            step.model_s * 1e3,
            step.allreduce_s * 1e3,
            kind="timing",
            relation=">=",
            rtol=0.5,
            basis=(
                "on this target every collective is synchronous, so the step cannot hide the all-reduce behind the "
                "backward; half of it is the margin for a difference of two noisy times"
            ),
        ),
        check(
            f"{buckets.name}: all-reduce time against isolation + (n-1)·alpha + two copies (ms)",
            buckets.model_s * 1e3,
            buckets.allreduce_s * 1e3,
            kind="model",
            rtol=RTOL,
            basis=(
                "alpha, the copy and the isolated all-reduce are each the fastest of the same round-robin rounds; "
                "30% for their summed noise on this shared machine, still failing a factor of 1.5"
            ),
        ),
        check(
            f"{traffic.name}: all-reduce time at least isolation + the extra bytes at busbw (ms)",
            traffic.model_s * 1e3,
            traffic.allreduce_s * 1e3,
            kind="model",
            relation=">=",
            rtol=0.2,
            basis=(
                "the other traffic's bytes cross the same bus: the all-reduce cannot take less than both transfers "
                "(contention may add more); 20% for the noise of the two times"
            ),
        ),
        check(
            "gradients and the other traffic on the same axis: all-reduces in HLO",
            2 * len(isolation),
            len(with_traffic),
            kind="exact",
            refined=math.ceil(2 * sum(r.tensors for r in isolation) / members) if members else None,
            why=(
                f"XLA's all-reduce combiner put {members} tensors in one tuple all-reduce; both programs' "
                f"{2 * sum(r.tensors for r in isolation)} gradient tensors fit in "
                f"{math.ceil(2 * sum(r.tensors for r in isolation) / members) if members else 0} such instructions"
            ),
        ),
    ]
    if obs.tpu is not None:
        default = obs.tpu.schedule(DEFAULT)
        checks.append(
            check(
                f"tpu:{obs.tpu.topology} default compile: asynchronous gradient all-reduces in the schedule",
                0,
                sum(w.is_async for w in default.windows),
                kind="exact",
            )
        )
    return checks


def _claims(obs: Observations, scenarios: list[Scenario]) -> list[Claim]:
    iso = scenarios[0].allreduce_s
    slower = {s.cause: s.allreduce_s / iso for s in scenarios[2:]}
    claims = [
        Claim(
            "an all-reduce fast in isolation (nccl-tests) can be slow in training for reasons outside the "
            "collective library: bucket size, other traffic on the same links",
            "confirmed" if all(x > 1.2 for x in slower.values()) else "refuted",
            f"the same {format_bytes(obs.bytes)} took {iso * 1e3:.1f} ms alone; "
            + ", ".join(f"{cause}: {x:.2f}x" for cause, x in slower.items())
            + " (fastest rounds, this target)",
        )
    ]
    if obs.tpu is not None:
        default, fused = (_totals(obs.tpu.schedule(name)) for name in (DEFAULT, FUSED))
        share = default["exposed_s"] / default["step_s"] if default["step_s"] else 0.0
        claims.append(
            Claim(
                "a collective dragged onto the critical path (not overlapped with compute) makes the step slow",
                "confirmed" if default["exposed_s"] > 0 and share > 0.2 else "refuted",
                f"tpu:{obs.tpu.topology} default compile (simulated): {default['exposed_s'] * 1e3:.3f} of "
                f"{default['comm_s'] * 1e3:.3f} ms of gradient all-reduce exposed, {share:.0%} of the "
                f"{default['step_s'] * 1e3:.3f} ms step; with async collective fusion "
                f"{fused['exposed_s'] * 1e3:.3f} ms exposed",
            )
        )
    return claims


# ------------------------------------------------------------------ the page


def _scenario_table(obs: Observations, m: Model, scenarios: list[Scenario]) -> Table:
    iso = scenarios[0].allreduce_s
    rows = [
        [
            s.name,
            s.cause,
            f"{s.allreduce_s * 1e3:.1f}",
            f"{s.allreduce_s / iso:.2f}x",
            f"{s.model_s * 1e3:.1f}",
            str(obs.timings[s.program]),
        ]
        for s in scenarios
    ]
    return Table(
        f"One all-reduce of {format_bytes(obs.bytes)} over data={obs.devices}, alone and in a step",
        [
            "scenario",
            "cause",
            "all-reduce time (ms, fastest round)",
            "vs isolation",
            "model (ms)",
            "program time (median [min, max])",
        ],
        rows,
        note=f"Model from this run's fastest rounds: α_AR = {m.alpha * 1e6:.0f} µs (chain of {obs.chain_length} "
        f"one-element all-reduces), busbw β = {m.beta / 1e9:.2f} GB/s (the isolated all-reduce), one copy of the "
        f"gradients {m.copy * 1e3:.1f} ms. Backward alone: {obs.timings['backward']}.",
    )


def _tpu_tables(obs: Observations) -> list[Table]:
    if obs.tpu_unavailable:
        return [obs.tpu_unavailable.table()]
    if obs.tpu is None:
        return []
    tpu = obs.tpu
    summary = []
    for s in tpu.schedules:
        totals = _totals(s)
        summary.append(
            [s.name, f"`{s.timeline}`"]
            + [f"{totals[key] * 1e3:.3f}" for key in ("compute_s", "comm_s", "exposed_s", "step_s")]
        )
    tables = [
        Table(
            f"The same step scheduled by the TPU compiler, tpu:{tpu.topology} ({tpu.chips} x {tpu.chip}), "
            "compile-only, priced by lab.hlo.schedule",
            ["compile", "schedule", "compute (ms)", "gradient all-reduces (ms)", "exposed (ms)", "step (ms)"],
            summary,
        )
    ]
    for s in tpu.schedules:
        tables.append(
            Table(
                f"Windows, {s.name}",
                ["collective", "async", "compute in window (µs)", "transfer (µs)", "hidden", "exposed (µs)"],
                [
                    [
                        w.collective,
                        w.is_async,
                        f"{w.compute_s * 1e6:.1f}",
                        f"{w.comm_s * 1e6:.1f}",
                        f"{min(w.compute_s, w.comm_s) / w.comm_s if w.comm_s else 1.0:.0%}",
                        f"{_exposed(w) * 1e6:.1f}",
                    ]
                    for w in s.windows
                ],
            )
        )
    return tables


def _summary(obs: Observations, scenarios: list[Scenario]) -> str:
    iso = scenarios[0].allreduce_s
    parts = ", ".join(f"{s.cause} {s.allreduce_s / iso:.2f}x" for s in scenarios[2:])
    text = (
        f"Alone, the all-reduce of {format_bytes(obs.bytes)} took {iso * 1e3:.1f} ms on this target; inside the "
        f"step it added {scenarios[1].allreduce_s * 1e3:.1f} ms to the backward pass (no overlap is possible here). "
        f"The causes the lab can see each made the same bytes slower without any change to the collective itself: "
        f"{parts}."
    )
    if obs.tpu is not None:
        default, fused = (_totals(obs.tpu.schedule(name)) for name in (DEFAULT, FUSED))
        text += (
            f" On tpu:{obs.tpu.topology} the default compile leaves the gradient all-reduce synchronous after the "
            f"whole backward: {default['exposed_s'] * 1e3:.3f} of {default['comm_s'] * 1e3:.3f} ms exposed; with "
            f"asynchronous collective fusion {fused['exposed_s'] * 1e3:.3f} of {fused['comm_s'] * 1e3:.3f} ms stay "
            "exposed."
        )
    return text


def _shapes(reductions) -> str:
    return str([(r.seen.kind, r.tensors) for r in reductions])


def _notes(obs: Observations, m: Model) -> list[str]:
    notes = [
        f"The gradients' per-tensor psums compiled to {_shapes(obs.compiled['isolation'])} (kind, tensors) alone "
        f"and to {_shapes(obs.compiled['step'])} in the step: the same collective, so isolation and step compare "
        f"like for like. With the other traffic: {_shapes(obs.compiled['same-axis traffic'])}: XLA combined both "
        "into one collective, whose bytes simply add.",
        f"Buckets are packed and unpacked: on this target that is two copies of the gradients on every device "
        f"through one memory bus, timed here as a copy program ({m.copy * 1e3:.1f} ms), part of the bucket "
        "scenario's model.",
        "On XLA:CPU the step's all-reduce runs after the backward, never during it: the benchmark's time is what the "
        "step pays. Whether a collective can hide behind compute is a property of the schedule, so the TPU rows "
        "read it from the TPU compiler's schedule (simulated, compile-only), not from this machine's clock.",
    ]
    if obs.tpu is not None:
        fused = obs.tpu.schedule(FUSED)
        hidden = [w for w in fused.windows if w.is_async]
        notes.append(
            f"With asynchronous collective fusion only {len(hidden)} of {len(fused.windows)} gradient all-reduces "
            f"became asynchronous ({', '.join(w.collective for w in hidden)}), and their windows hold "
            f"{sum(w.compute_s for w in hidden) * 1e6:.1f} µs of compute. The stacked block weights' gradients leave "
            "the backward scan loop together when it ends, so nothing is left to hide their all-reduces behind: the "
            "flag does not move an all-reduce that has no compute after it."
        )
    return notes


def _plot(obs: Observations, scenarios: list[Scenario]):
    panels = 2 if obs.tpu is not None else 1
    figure = Figure(figsize=(5.5 * panels, 3.8))
    axes = figure.subplots(1, panels, squeeze=False)
    left = axes[0][0]
    y = np.arange(len(scenarios))
    left.barh(y - 0.2, [s.allreduce_s * 1e3 for s in scenarios], 0.4, label="measured (fastest round)")
    left.barh(y + 0.2, [s.model_s * 1e3 for s in scenarios], 0.4, label="model")
    left.set(
        yticks=y,
        yticklabels=["isolation", "in the step", "small buckets", "+ same-axis traffic"][: len(scenarios)],
        xlabel="ms",
        title="the same bytes, alone and in a step",
    )
    left.invert_yaxis()
    left.legend(fontsize=8)
    if panels == 2:
        right = axes[0][1]
        totals = [_totals(s) for s in obs.tpu.schedules]
        labels = ["default", "async collective fusion"][: len(totals)]
        compute = [t["compute_s"] * 1e3 for t in totals]
        right.barh(labels, compute, label="compute")
        right.barh(labels, [t["exposed_s"] * 1e3 for t in totals], left=compute, label="exposed all-reduce")
        right.set(xlabel="ms (simulated)", title=f"tpu:{obs.tpu.topology} step")
        right.legend(fontsize=8)
    figure.tight_layout()
    return figure


# a markdown table keeps each row on one line
THEORY = r"""
One ring all-reduce of S bytes on N devices costs α_AR + S·2(N-1)/N/β (Patarasuk & Yuan 2009; nccl-tests
PERFORMANCE.md for busbw = algbw·2(N-1)/N). What a benchmark measures is that number. In a step, the same bytes can
cost more for reasons outside the collective library (Li et al. 2020, "PyTorch Distributed", Section 3.2.3 and 5):

| cause | model of the extra time |
|---|---|
| small buckets | (n - 1)·α_AR for n buckets instead of one, plus packing each bucket (a copy in, a copy out) |
| other traffic on the same axis | the links carry S + S' bytes: + S'·2(N-1)/N/β |
| exposed position | an all-reduce that is synchronous, or whose window holds less compute than its transfer, adds max(0, T - C_window) to the step |

On XLA:CPU every collective is synchronous, so the step is always backward + all-reduce; the last row needs a
compiler with asynchronous collectives, here the TPU compiler (compile-only), read through the overlap windows of
lab.hlo.schedule.
"""  # noqa: E501
