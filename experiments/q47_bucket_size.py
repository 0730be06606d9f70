"""Gradient bucket size: launches against the exposed tail, measured and modelled.

Question #47 says buckets that are too large start communicating late, and
buckets that are too small pay launch overhead many times. Both halves are in
the alpha-beta model of a bucketed all-reduce of G gradient bytes in buckets
of b (Li et al. 2020, "PyTorch Distributed", Section 3.2.3):

    T(b) = backward + exposed,   communication = ceil(G/b) * alpha_AR + G * 2(N-1)/N / beta.

The experiment buckets the real gradients of the lab's transformer (lab.model,
differentiated inside ``shard_map`` on a ``data`` axis) into buckets from
64 KiB to 256 MiB, with PyTorch DDP's 25 MiB default and DeepSpeed's 5e8
elements marked, and

1. counts the all-reduces in the compiled HLO (one per bucket, once XLA's
   combiner is kept from merging them back) and checks every sum exactly;
2. times the step on this target and fits the model to it;
3. shows XLA's own bucketing: the TPU compiler's all-reduce combiner threshold
   against the number of all-reduces it emits for the same step (compile-only);
4. predicts T(b) for a TPU slice, where the backward can hide buckets, and marks
   the optimum b* = G * sqrt(alpha_AR / backward).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
from matplotlib.figure import Figure

from experiments import kit
from lab import hlo, theory
from lab.bench import time_interleaved
from lab.devices import DEFAULT_TARGET, devices_for, quiet_native_stderr
from lab.mesh import MeshSpec
from lab.model import preset
from lab.parallel import bucketing
from lab.progress import track
from lab.report import Result, Table, provenance
from lab.units import format_bytes, parse_size
from lab.verdict import check

QUESTION = "#47"
COMBINER_OPTION = "xla_jf_crs_combiner_threshold_in_bytes"  # libtpu's all-reduce ("cross-replica sum") combiner


@dataclass(frozen=True)
class Config:
    target: str = DEFAULT_TARGET
    """where to run (cpu:N, gpu, tpu)"""
    model: str = "small"
    """lab.model preset whose gradients are bucketed"""
    seq: int = 16
    """sequence length (short: the page is about the gradients, not the compute)"""
    bucket_sizes: tuple[str, ...] = ("64K", "256K", "1M", "4M", "16M", "256M")
    """bucket sizes to sweep; DDP's 25 MiB and DeepSpeed's 5e8 elements are always added"""
    repeats: int = 7
    """timed calls per point, after warm-up (the median is reported)"""
    tpu_topology: str = "v5e:4x4"
    """TPU slice for the compiler's own bucketing and the prediction (compile-only); empty to skip"""
    tpu_thresholds: tuple[str, ...] = ("0", "4M")
    """combiner thresholds to compile with (the compiler's default is added)"""
    tpu_model: str = "125m"
    """lab.model preset whose gradients the TPU prediction buckets"""
    tpu_tokens_per_chip: int = 8192
    """tokens each chip's backward pass processes in the prediction"""


def run(config: Config) -> Result:
    sizes = _sizes(
        config.bucket_sizes, np.dtype(np.float32).itemsize
    )  # lab.model keeps float32 weights, so float32 gradients
    devices = devices_for(config.target)
    mesh = MeshSpec(data=len(devices)).build(devices)
    problem = bucketing.gradient_problem(replace(preset(config.model), seq=config.seq), mesh)
    gradients = bucketing.local_gradient_program(problem).lower(problem.params, problem.tokens).compile()
    stacked = gradients(problem.params, problem.tokens)
    rows, programs = _sweep(problem, stacked, sizes)
    fused = _fused_step(problem)
    calls = {
        "backward": (gradients, (problem.params, problem.tokens)),
        "fused": (fused["program"], (problem.params, problem.tokens)),
        "per-tensor": (bucketing.reduce_program(None, mesh, problem.axis).lower(stacked).compile(), (stacked,)),
        **{key: (program, (stacked,)) for key, program in programs.items()},
    }
    timings = time_interleaved(calls, repeats=config.repeats)
    backward, fused["time"], fused["reduction"] = timings["backward"], timings["fused"], timings["per-tensor"]
    rows = [dict(r, time=timings[r["key"]]) for r in rows]
    fit = _fit(rows)
    combined = _combined_count(
        problem, stacked, min((r for r in rows if r["buckets"] > 1), key=lambda r: r["buckets"])["bytes"]
    )
    tpu = _tpu(config, problem.config)
    checks = _checks(rows, fit, fused, combined, tpu, len(problem.leaves), backward)
    return Result(
        summary=_summary(rows, backward, fit, problem, tpu, fused),
        theory=THEORY,
        tables=[_sweep_table(rows, backward, fit, fused), *_tpu_tables(tpu)],
        checks=checks,
        plots={"bucket_size": _plot(rows, backward, fit, tpu)},
        notes=_notes(rows, combined, fused, tpu, problem),
        provenance=provenance(target=config.target, devices=devices, mesh=f"data={len(devices)}"),
        data={
            "gradient_bytes": rows[0]["plan"].total_bytes,
            "backward_s": backward.median,
            "fit": fit,
            "rows": [{k: (str(v) if k in ("time", "plan") else v) for k, v in r.items()} for r in rows],
            "tpu": tpu,
        },
    )


THEORY = r"""
G gradient bytes on N data-parallel devices, buckets of b bytes, n(b) = ceil(G/b) all-reduces, each a ring
(Patarasuk & Yuan 2009): 2(N-1) steps of α, 2(N-1)/N of its bytes over β. Summed over the buckets
(Li et al. 2020, "PyTorch Distributed: Experiences on Accelerating Data Parallel Training", VLDB, Section 3.2.3):

    T_comm(b) = n(b) · α_AR + G · 2(N-1)/N / β,      α_AR = 2(N-1)·α

- **Without overlap** (every collective synchronous, as on XLA:CPU) the step is backward + T_comm(b): fewer buckets
  are always better, and one all-reduce of everything is the optimum.
- **With overlap** the backward of C seconds makes gradients at an even rate; bucket i is ready at C·(i·b/G) and the
  buckets run one after another, so the step ends at max_i(ready_i + Σ_{j≥i} t_j). Large b: the exposed tail is one
  bucket's all-reduce, which cannot start before the backward ends. Small b: n·α_AR outgrows C. When communication
  dominates, the two balance at **b\* = G·sqrt(α_AR / C)** (this lab's derivation from that model).
- A bucket larger than G is one bucket: DDP's 25 MiB default is a single all-reduce for any model under 25 MiB of
  gradients. DeepSpeed's ZeRO default `reduce_bucket_size` is 5e8 *elements* (2 GB of fp32).

XLA buckets on its own: its all-reduce combiner merges independent all-reduces into one tuple all-reduce up to a byte
threshold (`AllReduceCombiner`, openxla/xla). XLA:CPU combines without a byte limit (up to 256 operands,
`xla/service/cpu/cpu_compiler.cc`), so hand-made buckets are merged straight back unless each depends on the previous
one; libtpu takes the threshold per compile as `xla_jf_crs_combiner_threshold_in_bytes`.
"""


def _sizes(texts, itemsize: int) -> list[tuple[int, str]]:
    """(bytes, label): the sweep plus the two frameworks' defaults, smallest first."""
    marked = [
        (bucketing.DDP_BUCKET_BYTES, "DDP default (25 MiB)"),
        (bucketing.DEEPSPEED_BUCKET_ELEMENTS * itemsize, "DeepSpeed default (5e8 elements)"),
    ]
    swept = [(parse_size(t), "") for t in texts]
    return sorted(dict(swept + marked).items())


def _sweep(problem, stacked, sizes) -> tuple[list[dict], dict]:
    """Per bucket size: the plan, the all-reduces in HLO, exact sums; and the compiled programs.

    Plans that hold everything share one program.
    """
    reference = [np.asarray(x) for x in bucketing.reduce_program(None, problem.mesh, problem.axis)(stacked)]
    programs, seen, rows = {}, {}, []
    for size, label in track(sizes, "bucket sizes"):
        plan = bucketing.plan_buckets(problem.leaves, size)
        key = "everything" if plan.holds_everything else format_bytes(size)
        if key not in programs:
            program = bucketing.reduce_program(plan, problem.mesh, problem.axis)
            compiled, inspection = kit.compile_and_inspect(program, stacked, mesh=problem.mesh)
            exact = all(np.array_equal(np.asarray(a), b) for a, b in zip(compiled(stacked), reference))
            programs[key] = compiled
            seen[key] = {
                "all_reduces": sum(c.kind == "all-reduce" for c in inspection.collectives),
                "exact": exact,
                "temp_bytes": inspection.memory["temp_size"],
            }
        rows.append(
            {
                "bytes": size,
                "label": label,
                "key": key,
                "plan": plan,
                "buckets": plan.count,
                "one_bucket": plan.holds_everything,
                **seen[key],
            }
        )
    return rows, programs


def _fit(rows) -> dict:
    """Least squares of the reduction time against the bucket count, time = n * alpha_AR + rest, multi-bucket points.

    The single bucket is left out of the fit and compared with it: it is the one that packs every gradient at once.
    """
    distinct = {r["buckets"]: r["time"].median for r in rows if r["buckets"] > 1} or {
        r["buckets"]: r["time"].median for r in rows
    }
    counts = np.array(sorted(distinct), dtype=float)
    times = np.array([distinct[n] for n in sorted(distinct)])
    slope, intercept = np.polyfit(counts, times, 1) if len(counts) > 1 else (0.0, float(times[0]))
    return {"alpha_AR_s": float(slope), "transfer_s": float(intercept)}


def _model_reduce_s(fit: dict, buckets: int) -> float:
    return fit["transfer_s"] + buckets * fit["alpha_AR_s"]


def _fused_step(problem) -> dict:
    """Backward and the per-tensor psums (which XLA combines) in one program: without async collectives, their sum."""
    program = bucketing.step_program(problem, None)
    compiled, inspection = kit.compile_and_inspect(program, problem.params, problem.tokens, mesh=problem.mesh)
    found = inspection.collectives
    return {"program": compiled, "async": sum(c.is_async for c in found), "all_reduces": len(found)}


def _combined_count(problem, stacked, size: int) -> dict:
    """Buckets of `size` written as independent psums: what XLA's combiner makes of them."""
    plan = bucketing.plan_buckets(problem.leaves, size)
    program = bucketing.reduce_program(plan, problem.mesh, problem.axis, keep_apart=False)
    found = hlo.inspect(program, stacked, mesh=problem.mesh).collectives
    return {
        "bytes": size,
        "buckets": plan.count,
        "all_reduces": len(found),
        "operands": sum(len(c.result_shapes) for c in found),
    }


# ------------------------------------------------------------------ TPU (compile-only)


def _tpu(config: Config, model_config) -> dict | kit.Unavailable | None:
    tpu = kit.tpu_chips(config.tpu_topology)
    if not isinstance(tpu, kit.TpuChips):
        return tpu  # not asked for, or libtpu cannot build it here
    chip = tpu.chip
    problem = bucketing.gradient_problem(model_config, tpu.mesh("data"), placed=False)
    counts = [
        _tpu_count(problem, threshold) for threshold in track([None, *config.tpu_thresholds], "TPU combiner thresholds")
    ]
    return {
        "topology": config.tpu_topology,
        "chips": len(tpu),
        "chip": chip.name,
        "counts": counts,
        "leaves": len(problem.leaves),
        **_tpu_prediction(config, chip, len(tpu)),
    }


def _tpu_count(problem, threshold: str | None) -> dict:
    options = {} if threshold is None else {COMBINER_OPTION: 0 if threshold == "0" else parse_size(threshold)}
    with quiet_native_stderr():
        compiled = (
            bucketing.step_program(problem, None)
            .lower(problem.params, problem.tokens)
            .compile(compiler_options=options)
        )
    reduces = [c for c in hlo.inspect_compiled(compiled, problem.mesh).collectives if c.kind == "all-reduce"]
    return {
        "threshold": "compiler default" if threshold is None else format_bytes(options[COMBINER_OPTION]),
        "all_reduces": len(reduces),
        "largest_operands": max((len(c.result_shapes) for c in reduces), default=0),
        "async": sum(c.is_async for c in reduces),
    }


def _tpu_prediction(config: Config, chip, chips: int) -> dict:
    """T(b) of the `tpu_model` preset's fp32 gradients on the slice, with and without overlap."""
    model = preset(config.tpu_model)
    grad_bytes = 4 * model.parameters
    backward_s = (
        4 * model.parameters * config.tpu_tokens_per_chip / chip.peak_bf16_flops
    )  # backward = 2x forward's 2 Psi FLOPs per token
    sizes = [2.0**k for k in range(16, 33)]
    network = {"alpha": chip.hop_latency_s, "beta": chip.link_bandwidth, "algorithm": "bidirectional-ring"}
    overlapped = [theory.bucketed_allreduce_time(grad_bytes, b, chips, backward_s=backward_s, **network) for b in sizes]
    serial = [
        theory.bucketed_allreduce_time(grad_bytes, b, chips, backward_s=backward_s, overlap=False, **network)
        for b in sizes
    ]
    latency = theory.collective_cost("all-reduce", 1.0, chips, **network).latency_s
    best = min(overlapped, key=lambda t: t.step_s)
    return {
        "model": config.tpu_model,
        "grad_bytes": grad_bytes,
        "backward_s": backward_s,
        "sizes": sizes,
        "overlapped_s": [t.step_s for t in overlapped],
        "serial_s": [t.step_s for t in serial],
        "best_bytes": best.bucket_bytes,
        "best_s": best.step_s,
        "b_star": theory.optimal_bucket_bytes(grad_bytes, backward_s, latency),
        "ddp_s": theory.bucketed_allreduce_time(
            grad_bytes, bucketing.DDP_BUCKET_BYTES, chips, backward_s=backward_s, **network
        ).step_s,
        "single_s": theory.bucketed_allreduce_time(
            grad_bytes, grad_bytes, chips, backward_s=backward_s, **network
        ).step_s,
    }


# ------------------------------------------------------------------ the page


def _checks(rows, fit, fused, combined, tpu, leaves: int, backward) -> list:
    checks = []
    for r in rows:
        name = f"b={format_bytes(r['bytes'])}"
        checks.append(check(f"{name}: all-reduces in HLO = ceil(G/b)", r["buckets"], r["all_reduces"]))
        checks.append(check(f"{name}: every gradient sum bit-identical to per-tensor psums", True, r["exact"]))
    checks.append(
        check(
            f"b={format_bytes(combined['bytes'])} written as independent psums: all-reduces in HLO",
            combined["buckets"],
            combined["all_reduces"],
            explained=f"XLA:CPU's combiner merged the {combined['buckets']} bucket "
            f"all-reduces into {combined['all_reduces']} tuple all-reduce(s) "
            f"of {combined['operands']} operands: it has no byte threshold, "
            "so buckets survive only when each waits for the previous one",
        )
    )
    for r in {
        r["key"]: r for r in rows
    }.values():  # one row per program: every bucket that holds everything is the same one
        modelled = _model_reduce_s(fit, r["buckets"])
        name = (
            f"b >= {format_bytes(r['plan'].total_bytes)} (one bucket)"
            if r["one_bucket"]
            else f"b={format_bytes(r['bytes'])}"
        )
        checks.append(
            check(f"{name}: reduction time, model n*alpha_AR + rest (s)", modelled, r["time"].median, rtol=0.5)
        )
    checks.append(check("async collectives in the CPU step", 0, fused["async"]))
    checks.append(
        check(
            "step in one program = backward + its all-reduce alone, no overlap on CPU (s)",
            backward.median + fused["reduction"].median,
            fused["time"].median,
            rtol=0.5,
        )
    )
    if isinstance(tpu, dict):
        by = {c["threshold"]: c for c in tpu["counts"]}
        if "0 Bytes" in by:
            checks.append(
                check(
                    f"tpu:{tpu['topology']}: all-reduces with combiner threshold 0 = gradient tensors",
                    leaves,
                    by["0 Bytes"]["all_reduces"],
                )
            )
        checks.append(
            check(
                f"tpu:{tpu['topology']}: all-reduces with the compiler's default threshold",
                1,
                by["compiler default"]["all_reduces"],
            )
        )
    return checks


def _sweep_table(rows, backward, fit, fused) -> Table:
    body = []
    for r in rows:
        note = r["label"] or ("holds every gradient: one bucket" if r["one_bucket"] else "")
        step = backward.median + r["time"].median
        body.append(
            [
                format_bytes(r["bytes"]),
                r["buckets"],
                r["all_reduces"],
                str(r["time"]),
                f"{step * 1e3:.1f} ms",
                f"{(backward.median + _model_reduce_s(fit, r['buckets'])) * 1e3:.1f} ms",
                format_bytes(r["temp_bytes"]),
                note,
            ]
        )
    body.append(
        [
            "per-tensor psums",
            "-",
            f"{fused['all_reduces']} (XLA combined)",
            str(fused["reduction"]),
            f"{(backward.median + fused['reduction'].median) * 1e3:.1f} ms",
            "-",
            "-",
            f"in one program with the backward: {fused['time']}",
        ]
    )
    return Table(
        f"Bucket sweep on this target (backward {backward})",
        [
            "bucket b",
            "buckets n",
            "all-reduces in HLO",
            "reduction time (median [min, max])",
            "step = backward + reduction",
            "model step",
            "temp memory",
            "",
        ],
        body,
        note=f"Model fitted to the multi-bucket points: α_AR = {fit['alpha_AR_s'] * 1e6:.0f} "
        f"µs per all-reduce, {fit['transfer_s'] * 1e3:.1f} ms for the "
        "bytes.",
    )


def _tpu_tables(tpu) -> list[Table]:
    if not isinstance(tpu, dict):
        return [tpu.table()] if tpu else []
    counts = Table(
        f"XLA's own bucketing: tpu:{tpu['topology']} combiner threshold against "
        f"all-reduces (same step, one psum per gradient tensor, {tpu['leaves']} "
        "tensors)",
        ["combiner threshold", "all-reduces in HLO", "most tensors in one", "asynchronous"],
        [[c["threshold"], c["all_reduces"], c["largest_operands"], c["async"]] for c in tpu["counts"]],
    )
    picks = [
        ("DDP default 25 MiB", bucketing.DDP_BUCKET_BYTES, tpu["ddp_s"]),
        ("best in sweep", tpu["best_bytes"], tpu["best_s"]),
        ("one bucket", tpu["grad_bytes"], tpu["single_s"]),
    ]
    model = Table(
        f"Predicted on tpu:{tpu['topology']} ({tpu['chips']} x {tpu['chip']}): "
        f"the {tpu['model']} preset's fp32 gradients ({format_bytes(tpu['grad_bytes'])}), "
        f"backward {tpu['backward_s'] * 1e3:.1f} ms",
        ["bucket", "size", "step with overlap"],
        [[name, format_bytes(size), f"{seconds * 1e3:.2f} ms"] for name, size, seconds in picks],
        note=_regime(tpu),
    )
    return [counts, model]


def _regime(tpu) -> str:
    """Which half of the model decides the best bucket on the TPU."""
    comm = tpu["single_s"] - tpu["backward_s"]  # one bucket: all communication after the backward
    if comm > tpu["backward_s"]:
        return (
            f"Communication ({comm * 1e3:.1f} ms) exceeds the backward: the optimum is near "
            f"b* = G·sqrt(α_AR/C) = {format_bytes(tpu['b_star'])}."
        )
    return (
        f"The backward ({tpu['backward_s'] * 1e3:.1f} ms) outlasts the communication "
        f"({comm * 1e3:.1f} ms): b* = G·sqrt(α_AR/C) = {format_bytes(tpu['b_star'])} "
        "is the communication-bound formula and does not apply; the best "
        "bucket is the smallest whose launches still fit under the backward, "
        "leaving the shortest tail."
    )


def _summary(rows, backward, fit, problem, tpu, fused) -> str:
    best = min(rows, key=lambda r: r["time"].median)
    single = next(r for r in rows if r["one_bucket"])
    smallest = rows[0]
    step_best, step_single = backward.median + best["time"].median, backward.median + single["time"].median
    text = (
        f"The lab transformer's {len(problem.leaves)} gradient tensors "
        f"({format_bytes(single['plan'].total_bytes)}) were cut into buckets "
        "from "
        f"{format_bytes(smallest['bytes'])} ({smallest['buckets']} all-reduces) "
        "to one. On this target collectives are synchronous and nothing "
        "overlaps; "
        f"the fit gives about {fit['alpha_AR_s'] * 1e6:.0f} µs per extra "
        f"all-reduce. The best measured bucket ({format_bytes(best['bytes'])}, "
        f"{best['buckets']} all-reduce(s)) "
        f"gave a step of {step_best * 1e3:.1f} ms against {step_single * 1e3:.1f} "
        f"ms for one all-reduce of everything ({step_best / step_single:.2f}x); "
        f"leaving the tensors to XLA's own combiner gave {(backward.median + fused['reduction'].median) * 1e3:.1f} ms. "
        "DDP's 25 MiB default is one bucket here: the gradients are smaller."
    )
    if isinstance(tpu, dict):
        text += (
            f" On tpu:{tpu['topology']}, where a backward can hide buckets, "
            f"the model puts the best bucket for the {tpu['model']} preset "
            "near "
            f"{format_bytes(tpu['best_bytes'])} ({tpu['best_s'] * 1e3:.2f} "
            f"ms a step against {tpu['single_s'] * 1e3:.2f} ms for one bucket)."
        )
    return text


def _notes(rows, combined, fused, tpu, problem) -> list[str]:
    one = [format_bytes(r["bytes"]) for r in rows if r["one_bucket"]]
    single = next(r for r in rows if r["one_bucket"])
    best = min(rows, key=lambda r: r["time"].median)
    notes = [
        f"Every bucket of {', '.join(one)} or more holds all {format_bytes(rows[0]['plan'].total_bytes)} "
        "of gradients: one bucket, one all-reduce, one program.",
        (
            f"Written as independent psums, {combined['buckets']} buckets "
            f"of {format_bytes(combined['bytes'])} compiled to {combined['all_reduces']} "
            "all-reduce(s) on XLA:CPU: "
            "the combiner undoes hand-made bucketing. Chaining each bucket "
            "to the previous one's result (a data dependency) keeps them "
            "apart; "
            "`lax.optimization_barrier` does not: XLA:CPU drops it before combining."
        ),
        (
            "Without overlap the model says the fewest buckets win. Measured, "
            f"the single packed bucket ({single['time'].median * 1e3:.1f} "
            "ms) lost to "
            f"{format_bytes(best['bytes'])} buckets ({best['time'].median * 1e3:.1f} "
            f"ms): it packs and unpacks every gradient at once ({format_bytes(single['temp_bytes'])} "
            "of temporary memory), "
            "and the per-tensor psums that XLA combines into one tuple all-reduce, "
            f"with no packing at all, took {fused['reduction'].median * 1e3:.1f} "
            "ms. "
            "The linear model has no term for this, so the single bucket "
            "differs from it: the smaller buckets pack the same bytes in "
            "pieces of N x b, "
            "which on this machine stay near its last-level cache (a likely reason, not measured here)."
        ),
        (
            "The lab transformer stacks its layers in a scan, so the block "
            "weights' gradients leave the backward loop together when it "
            "ends: "
            "bucketing them in backward order cannot start any of their all-reduces earlier."
        ),
    ]
    if isinstance(tpu, dict):
        default = next(c for c in tpu["counts"] if c["threshold"] == "compiler default")
        notes.append(
            f"libtpu with its default threshold put all {tpu['leaves']} gradient "
            f"tensors in {default['all_reduces']} all-reduce; threshold 0 "
            "keeps one per tensor. "
            "None of them is asynchronous in the default compile: without "
            "overlap flags the TPU step waits for every all-reduce too."
        )
    return notes


def _plot(rows, backward, fit, tpu):
    panels = 2 if isinstance(tpu, dict) else 1
    figure = Figure(figsize=(6.5 * panels, 4.2))
    axes = figure.subplots(1, panels, squeeze=False)
    left = axes[0][0]
    sizes = [r["bytes"] for r in rows]
    left.plot(sizes, [(backward.median + r["time"].median) * 1e3 for r in rows], "o-", label="measured step")
    left.plot(
        sizes,
        [(backward.median + _model_reduce_s(fit, r["buckets"])) * 1e3 for r in rows],
        "--",
        label="model (fitted α_AR)",
    )
    left.axvline(bucketing.DDP_BUCKET_BYTES, color="grey", linestyle=":", label="DDP 25 MiB")
    left.axvline(rows[0]["plan"].total_bytes, color="green", linestyle=":", label="all gradients")
    left.set(xscale="log", xlabel="bucket size (bytes)", ylabel="ms per step", title="this target (no overlap)")
    left.legend(fontsize=8)
    if panels == 2:
        right = axes[0][1]
        right.plot(tpu["sizes"], np.array(tpu["overlapped_s"]) * 1e3, label="with overlap")
        right.plot(tpu["sizes"], np.array(tpu["serial_s"]) * 1e3, label="without overlap")
        right.axvline(
            tpu["best_bytes"], color="red", linestyle="--", label=f"optimum {format_bytes(tpu['best_bytes'])}"
        )
        right.axvline(bucketing.DDP_BUCKET_BYTES, color="grey", linestyle=":", label="DDP 25 MiB")
        right.axvline(bucketing.DEEPSPEED_BUCKET_ELEMENTS * 4, color="purple", linestyle=":", label="DeepSpeed 5e8 el.")
        right.set(
            xscale="log",
            xlabel="bucket size (bytes)",
            ylabel="ms per step",
            title=f"tpu:{tpu['topology']} model, {tpu['model']} gradients",
        )
        right.legend(fontsize=8)
    figure.tight_layout()
    return figure
