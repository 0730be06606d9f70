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

from dataclasses import dataclass, replace

import numpy as np
from matplotlib.figure import Figure

from experiments import kit
from lab import hlo, theory
from lab.bench import time_interleaved
from lab.devices import DEFAULT_TARGET, devices_for, quiet_native_stderr
from lab.hardware import profile
from lab.hlo import schedule
from lab.mesh import MeshSpec
from lab.model import preset
from lab.parallel import bucketing
from lab.progress import track
from lab.report import Result, Table, provenance
from lab.units import format_bytes, parse_size
from lab.verdict import check

QUESTION = "#52"
CHAIN = 64
# libtpu options that let the gradient all-reduces run asynchronously, overlapped with compute
# (the flags MaxText passes for data parallelism), plus one all-reduce per gradient tensor.
ASYNC_ALL_REDUCE = {
    "xla_tpu_enable_async_collective_fusion": True,
    "xla_tpu_enable_async_collective_fusion_fuse_all_reduce": True,
    "xla_enable_async_all_reduce": True,
    "xla_jf_crs_combiner_threshold_in_bytes": 0,
}


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


def run(config: Config) -> Result:
    devices = devices_for(config.target)
    mesh = MeshSpec(data=len(devices)).build(devices)
    problem = bucketing.gradient_problem(replace(preset(config.model), seq=config.seq), mesh)
    measured = _measure(problem, parse_size(config.small_bucket), config.repeats)
    tpu = _tpu(config, problem.config)
    scenarios = _scenarios(measured)
    return Result(
        summary=_summary(measured, scenarios, tpu),
        theory=THEORY,
        tables=[_scenario_table(scenarios, measured), *_tpu_tables(tpu)],
        checks=_checks(measured, scenarios, tpu),
        plots={"slow_allreduce": _plot(scenarios, tpu)},
        notes=_notes(measured, tpu),
        provenance=provenance(target=config.target, devices=devices, mesh=f"data={len(devices)}"),
        data={
            "scenarios": [{k: (str(v) if hasattr(v, "median") else v) for k, v in s.items()} for s in scenarios],
            "alpha_AR_s": measured["alpha_AR_s"],
            "beta_Bps": measured["beta_Bps"],
            "tpu": tpu,
        },
    )


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


# ------------------------------------------------------------------ this target


def _measure(problem, small_bucket: int, repeats: int) -> dict:
    """The same gradient all-reduce (per-tensor psums, combined by XLA) alone, in the step, in buckets, with company."""
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
        **bucketing.launch_cost_programs(mesh, axis, CHAIN),
    }
    seen = {
        name: hlo.inspect_compiled(calls[name][0], mesh).collectives
        for name in ("isolation", "step", "same-axis traffic")
    }
    timings = time_interleaved(dict(track(calls.items(), "slow all-reduce programs")), repeats=repeats)
    n, total = mesh.shape[axis], sum(leaf.size * leaf.dtype.itemsize for leaf in problem.leaves)
    alpha = (timings["chain"].median - timings["single"].median) / (CHAIN - 1)
    transfer = max(timings["isolation"].median - alpha, 1e-9)
    return {
        "timings": timings,
        "bytes": total,
        "devices": n,
        "small_buckets": small.count,
        "small_bucket": small_bucket,
        "alpha_AR_s": alpha,
        "beta_Bps": total * theory.bus_bandwidth_factor("all-reduce", n) / transfer,
        "copy_Bps": profile("cpu").hbm_bandwidth,
        "hlo": {name: [(c.kind, len(c.result_shapes)) for c in found] for name, found in seen.items()},
        "step_async": sum(c.is_async for c in seen["step"]),
    }


def _scenarios(measured) -> list[dict]:
    t = measured["timings"]
    iso, alpha, n, total = t["isolation"].median, measured["alpha_AR_s"], measured["devices"], measured["bytes"]
    # a bucket is packed and unpacked: two copies of the gradients on each of the N emulated devices,
    # through one memory bus
    packing = 2 * n * total / measured["copy_Bps"]
    return [
        {
            "scenario": "isolation (nccl-tests style)",
            "cause": "-",
            "allreduce_s": iso,
            "model_s": iso,
            "timing": t["isolation"],
        },
        {
            "scenario": "inside the step (step - backward, noisy: a difference of two medians)",
            "cause": "none on a synchronous target",
            "allreduce_s": t["step"].median - t["backward"].median,
            "model_s": iso,
            "timing": t["step"],
        },
        {
            "scenario": f"{measured['small_buckets']} buckets of {format_bytes(measured['small_bucket'])}",
            "cause": "bucket size",
            "allreduce_s": t["small buckets"].median,
            "model_s": iso + (measured["small_buckets"] - 1) * alpha + packing,
            "timing": t["small buckets"],
        },
        {
            "scenario": "+ an equal all-reduce on the same axis",
            "cause": "other traffic on the axis",
            "allreduce_s": t["same-axis traffic"].median,
            "model_s": iso + total * theory.bus_bandwidth_factor("all-reduce", n) / measured["beta_Bps"],
            "timing": t["same-axis traffic"],
        },
    ]


# ------------------------------------------------------------------ TPU: exposed position in the schedule


def _tpu(config: Config, model_config) -> dict | kit.Unavailable | None:
    tpu = kit.tpu_chips(config.tpu_topology)
    if not isinstance(tpu, kit.TpuChips):
        return tpu  # not asked for, or libtpu cannot build it here
    chip, dims = tpu.chip, tpu.dims
    problem = bucketing.gradient_problem(
        model_config, tpu.mesh("data"), sequences_per_device=config.tpu_sequences_per_chip, placed=False
    )
    compiles = {"default compile": {}, "async collective fusion, one all-reduce per tensor": ASYNC_ALL_REDUCE}
    reports = {
        name: _tpu_schedule(problem, options, chip, dims) for name, options in track(compiles.items(), "TPU schedules")
    }
    return {"topology": config.tpu_topology, "chip": chip.name, "chips": len(tpu), "schedules": reports}


def _tpu_schedule(problem, options: dict, chip, dims) -> dict:
    with quiet_native_stderr():
        compiled = (
            bucketing.step_program(problem, None)
            .lower(problem.params, problem.tokens)
            .compile(compiler_options=options)
        )
    text = compiled.as_text()
    report = schedule.overlap_report(text, chip, dims, problem.mesh.devices.shape, problem.mesh.axis_names)
    windows = [
        {
            "collective": f"{w.collective.kind} {format_bytes(w.collective.size_bytes)} "
            f"{list(w.collective.result_shapes[0])}",
            "async": w.is_async,
            "compute_s": w.compute_s,
            "comm_s": w.comm_s,
            "hidden": w.hidden_fraction,
            "exposed_s": w.exposed_s,
        }
        for w in report.windows
    ]
    return {
        "timeline": schedule.timeline(text),
        "compute_s": report.compute_s,
        "comm_s": report.communication_s,
        "exposed_s": report.exposed_s,
        "step_s": report.step_s,
        "windows": windows,
    }


# ------------------------------------------------------------------ the page


def _checks(measured, scenarios, tpu) -> list:
    t = measured["timings"]
    checks = [
        check(
            "step = backward + the isolated all-reduce, nothing overlaps here (ms)",
            (t["backward"].median + t["isolation"].median) * 1e3,
            t["step"].median * 1e3,
            rtol=0.5,
        )
    ]
    checks += [
        check(f"{s['scenario']}: all-reduce time vs model (ms)", s["model_s"] * 1e3, s["allreduce_s"] * 1e3, rtol=0.5)
        for s in scenarios[2:]
    ]
    checks.append(check("asynchronous collectives in the CPU step", 0, measured["step_async"]))
    checks.append(
        check(
            "gradients and the other traffic on the same axis: all-reduces in HLO",
            len(measured["hlo"]["isolation"]) * 2,
            len(measured["hlo"]["same-axis traffic"]),
            explained="XLA's combiner merged the independent all-reduces into "
            "one tuple all-reduce: the other traffic rides in the same "
            "collective",
        )
    )
    if isinstance(tpu, dict):
        default = tpu["schedules"]["default compile"]
        checks.append(
            check(
                f"tpu:{tpu['topology']} default compile: gradient communication exposed (fraction)",
                1.0,
                default["exposed_s"] / default["comm_s"],
                rtol=0.01,
            )
        )
    return checks


def _scenario_table(scenarios, measured) -> Table:
    iso = scenarios[0]["allreduce_s"]
    rows = [
        [
            s["scenario"],
            s["cause"],
            f"{s['allreduce_s'] * 1e3:.1f}",
            f"{s['allreduce_s'] / iso:.2f}x",
            f"{s['model_s'] * 1e3:.1f}",
            str(s["timing"]),
        ]
        for s in scenarios
    ]
    return Table(
        f"One all-reduce of {format_bytes(measured['bytes'])} over data={measured['devices']}, alone and in a step",
        ["scenario", "cause", "all-reduce time (ms)", "vs isolation", "model (ms)", "program time (median [min, max])"],
        rows,
        note=f"Model from this run: α_AR = {measured['alpha_AR_s'] * 1e6:.0f} "
        f"µs (chain of {CHAIN} one-element all-reduces), "
        f"busbw β = {measured['beta_Bps'] / 1e9:.2f} GB/s (the isolated all-reduce). "
        f"Backward alone: {measured['timings']['backward']}.",
    )


def _tpu_tables(tpu) -> list[Table]:
    if not isinstance(tpu, dict):
        return [tpu.table()] if tpu else []
    summary = [
        [
            name,
            f"`{s['timeline']}`",
            f"{s['compute_s'] * 1e3:.3f}",
            f"{s['comm_s'] * 1e3:.3f}",
            f"{s['exposed_s'] * 1e3:.3f}",
            f"{s['step_s'] * 1e3:.3f}",
        ]
        for name, s in tpu["schedules"].items()
    ]
    tables = [
        Table(
            f"The same step scheduled by the TPU compiler, tpu:{tpu['topology']} "
            f"({tpu['chips']} x {tpu['chip']}), compile-only",
            ["compile", "schedule", "compute (ms)", "gradient all-reduces (ms)", "exposed (ms)", "step (ms)"],
            summary,
        )
    ]
    for name, s in tpu["schedules"].items():
        tables.append(
            Table(
                f"Windows, {name}",
                ["collective", "async", "compute in window (µs)", "transfer (µs)", "hidden", "exposed (µs)"],
                [
                    [
                        w["collective"],
                        w["async"],
                        f"{w['compute_s'] * 1e6:.1f}",
                        f"{w['comm_s'] * 1e6:.1f}",
                        f"{w['hidden']:.0%}",
                        f"{w['exposed_s'] * 1e6:.1f}",
                    ]
                    for w in s["windows"]
                ],
            )
        )
    return tables


def _summary(measured, scenarios, tpu) -> str:
    iso = scenarios[0]["allreduce_s"]
    parts = ", ".join(f"{s['cause']} {s['allreduce_s'] / iso:.2f}x" for s in scenarios[2:])
    text = (
        f"Alone, the all-reduce of {format_bytes(measured['bytes'])} took "
        f"{iso * 1e3:.1f} ms on this target; inside the step it added "
        f"{scenarios[1]['allreduce_s'] * 1e3:.1f} ms to the backward pass "
        "(no overlap is possible here). The causes the lab can see each "
        "made the same bytes slower "
        f"without any change to the collective itself: {parts}."
    )
    if isinstance(tpu, dict):
        default = tpu["schedules"]["default compile"]
        fused = tpu["schedules"]["async collective fusion, one all-reduce per tensor"]
        text += (
            f" On tpu:{tpu['topology']} the default compile leaves the gradient "
            "all-reduce synchronous after the whole backward: all "
            f"{default['comm_s'] * 1e3:.3f} ms exposed; with asynchronous "
            f"collective fusion {fused['exposed_s'] * 1e3:.3f} of {fused['comm_s'] * 1e3:.3f} "
            "ms stay exposed."
        )
    return text


def _notes(measured, tpu) -> list[str]:
    hlo_seen = measured["hlo"]
    notes = [
        (
            f"The gradients' per-tensor psums compiled to {hlo_seen['isolation']} "
            f"(kind, tensors) alone and to {hlo_seen['step']} in the step: "
            "the same collective, "
            "so isolation and step compare like for like. With the other "
            f"traffic: {hlo_seen['same-axis traffic']}: XLA combined both "
            "into one collective, whose bytes simply add."
        ),
        (
            f"Buckets are packed and unpacked: on this target that is {2 * measured['devices']} "
            "copies of the gradients through one memory bus "
            f"(measured copy bandwidth {measured['copy_Bps'] / 1e9:.1f} GB/s), part of the bucket scenario's model."
        ),
        "On XLA:CPU the step's all-reduce runs after the backward, never "
        "during it: the benchmark's time is what the step pays.",
    ]
    if isinstance(tpu, dict):
        fused = tpu["schedules"]["async collective fusion, one all-reduce per tensor"]
        hidden = [w for w in fused["windows"] if w["async"]]
        notes.append(
            f"With asynchronous collective fusion only {len(hidden)} of {len(fused['windows'])} "
            "gradient all-reduces became asynchronous "
            f"({', '.join(w['collective'] for w in hidden)}), and their windows hold "
            f"{sum(w['compute_s'] for w in hidden) * 1e6:.1f} µs of compute. "
            "The stacked block weights' gradients leave the backward scan "
            "loop together when it ends, "
            "so nothing is left to hide their all-reduces behind: the flag "
            "does not move an all-reduce that has no compute after it."
        )
    return notes


def _plot(scenarios, tpu):
    panels = 2 if isinstance(tpu, dict) else 1
    figure = Figure(figsize=(5.5 * panels, 3.8))
    axes = figure.subplots(1, panels, squeeze=False)
    left = axes[0][0]
    y = np.arange(len(scenarios))
    left.barh(y - 0.2, [s["allreduce_s"] * 1e3 for s in scenarios], 0.4, label="measured")
    left.barh(y + 0.2, [s["model_s"] * 1e3 for s in scenarios], 0.4, label="model")
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
        names = list(tpu["schedules"])
        compute = [tpu["schedules"][n]["compute_s"] * 1e3 for n in names]
        labels = ["default", "async collective fusion"][: len(names)]
        right.barh(labels, compute, label="compute")
        right.barh(
            labels, [tpu["schedules"][n]["exposed_s"] * 1e3 for n in names], left=compute, label="exposed all-reduce"
        )
        right.set(xlabel="ms (predicted)", title=f"tpu:{tpu['topology']} step")
        right.legend(fontsize=8)
    figure.tight_layout()
    return figure
