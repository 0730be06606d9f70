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
2. times the reduction on this target, fits the launch model to the two ends
   of the multi-bucket sweep and shows what it predicts for the sizes between,
   with alpha_AR also measured on its own (a chain of one-element all-reduces);
3. shows XLA's own bucketing: the TPU compiler's all-reduce combiner threshold
   against the number of all-reduces it emits for the same step (compile-only);
4. predicts T(b) for a TPU slice, where the backward can hide buckets, and marks
   the optimum b* = G * sqrt(alpha_AR / backward).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import partial

import numpy as np
from matplotlib.figure import Figure

from experiments import kit
from lab import hlo, theory
from lab.bench import Timing, time_interleaved
from lab.mesh import MeshSpec
from lab.model import preset
from lab.parallel import bucketing
from lab.progress import track
from lab.provenance import Setup
from lab.report import Result, Table
from lab.targets.devices import DEFAULT_TARGET, devices_for, quiet_native_stderr
from lab.targets.hardware import profile
from lab.units import format_bytes, parse_size
from lab.verdict import Check, Claim, check

QUESTION = "#47"
COMBINER_OPTION = "xla_jf_crs_combiner_threshold_in_bytes"  # libtpu's all-reduce ("cross-replica sum") combiner
COMBINER_OPERANDS = 256  # XLA:CPU's all-reduce combiner: no byte threshold, up to 256 operands (cpu_compiler.cc)
CHAIN = 64  # one-element all-reduces in the chain that measures alpha_AR on its own
EVERYTHING = "everything"  # the program of every bucket that holds all gradients


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


@dataclass(frozen=True)
class Point:
    """One bucket size of the sweep, compiled (and, through its program's key, timed)."""

    bytes: int
    label: str  # "DDP default (25 MiB)", or empty
    key: str  # the program it runs: its size, or EVERYTHING when one bucket holds all gradients
    all_reduces: int  # in the compiled HLO
    identical: bool  # every summed gradient bit-identical to the per-tensor psums'
    temp_bytes: int


@dataclass(frozen=True)
class Combined:
    """Buckets written as independent psums: what XLA:CPU's combiner made of them."""

    bytes: int
    collectives: tuple[kit.Seen, ...]
    members: tuple[int, ...]  # arrays each all-reduce carries


@dataclass(frozen=True)
class TpuCount:
    threshold: str  # "compiler default" or the threshold's size
    all_reduces: int
    largest_operands: int
    asynchronous: int


@dataclass(frozen=True)
class Observations:
    setup: Setup
    devices: int
    gradient_bytes: int
    tensors: int
    points: tuple[Point, ...]
    times: dict[str, Timing]  # by program key; also "backward", "fused" (backward and psums) and "per-tensor"
    chain: Timing  # CHAIN dependent one-element all-reduces
    single: Timing  # one all-reduce of CHAIN elements
    fused_async: int  # asynchronous collectives in the one-program step
    fused_all_reduces: int
    combined: Combined
    tpu_counts: tuple[TpuCount, ...] = ()
    tpu_tensors: int = 0
    tpu_chip: str = ""
    tpu_chips: int = 0
    tpu_unavailable: kit.Unavailable | None = None


# --------------------------------------------------------------------------- measure


def measure(config: Config) -> Observations:
    sizes = _sizes(config.bucket_sizes, np.dtype(np.float32).itemsize)  # lab.model keeps float32 gradients
    devices = devices_for(config.target)
    mesh = MeshSpec(data=len(devices)).build(devices)
    problem = bucketing.gradient_problem(replace(preset(config.model), seq=config.seq), mesh)
    gradients = bucketing.local_gradient_program(problem).lower(problem.params, problem.tokens).compile()
    stacked = gradients(problem.params, problem.tokens)
    points, programs = _sweep(problem, stacked, sizes)
    fused, inspection = kit.compile_and_inspect(
        bucketing.step_program(problem, None), problem.params, problem.tokens, mesh=problem.mesh
    )
    calls = {
        "backward": (gradients, (problem.params, problem.tokens)),
        "fused": (fused, (problem.params, problem.tokens)),
        "per-tensor": (bucketing.reduce_program(None, mesh, problem.axis).lower(stacked).compile(), (stacked,)),
        **{key: (program, (stacked,)) for key, program in programs.items()},
        **bucketing.launch_cost_programs(mesh, problem.axis, CHAIN),
    }
    timings = time_interleaved(calls, repeats=config.repeats)
    multi = [p for p in points if p.key != EVERYTHING]
    tpu = kit.tpu_chips(config.tpu_topology)
    counts, tensors = _tpu_counts(tpu, config, problem.config) if isinstance(tpu, kit.TpuChips) else ((), 0)
    return Observations(
        setup=Setup.of(config.target, devices, f"data={len(devices)}"),
        devices=len(devices),
        gradient_bytes=int(sum(leaf.size * leaf.dtype.itemsize for leaf in problem.leaves)),
        tensors=len(problem.leaves),
        points=points,
        times={key: timings[key] for key in ("backward", "fused", "per-tensor", *programs)},
        chain=timings["chain"],
        single=timings["single"],
        fused_async=sum(c.is_async for c in inspection.collectives),
        fused_all_reduces=len(inspection.collectives),
        combined=_combined(problem, stacked, max((p.bytes for p in multi), default=points[0].bytes)),
        tpu_counts=counts,
        tpu_tensors=tensors,
        tpu_chip=tpu.chip.name if isinstance(tpu, kit.TpuChips) else "",
        tpu_chips=len(tpu) if isinstance(tpu, kit.TpuChips) else 0,
        tpu_unavailable=tpu if isinstance(tpu, kit.Unavailable) else None,
    )


def _sizes(texts, itemsize: int) -> list[tuple[int, str]]:
    """(bytes, label): the sweep plus the two frameworks' defaults, smallest first."""
    marked = [
        (bucketing.DDP_BUCKET_BYTES, "DDP default (25 MiB)"),
        (bucketing.DEEPSPEED_BUCKET_ELEMENTS * itemsize, "DeepSpeed default (5e8 elements)"),
    ]
    swept = [(parse_size(t), "") for t in texts]
    return sorted(dict(swept + marked).items())


def _sweep(problem, stacked, sizes) -> tuple[tuple[Point, ...], dict]:
    """Per bucket size: the all-reduces in HLO, exact sums, temp memory; and the compiled programs.

    Plans that hold everything share one program.
    """
    reference = [np.asarray(x) for x in bucketing.reduce_program(None, problem.mesh, problem.axis)(stacked)]
    programs, seen, points = {}, {}, []
    for size, label in track(sizes, "bucket sizes"):
        plan = bucketing.plan_buckets(problem.leaves, size)
        key = EVERYTHING if plan.holds_everything else format_bytes(size)
        if key not in programs:
            program = bucketing.reduce_program(plan, problem.mesh, problem.axis)
            compiled, inspection = kit.compile_and_inspect(program, stacked, mesh=problem.mesh)
            exact = all(np.array_equal(np.asarray(a), b) for a, b in zip(compiled(stacked), reference))
            programs[key] = compiled
            seen[key] = (
                sum(c.kind == "all-reduce" for c in inspection.collectives),
                bool(exact),
                int(inspection.memory["temp_size"]),
            )
        points.append(Point(size, label, key, *seen[key]))
    return tuple(points), programs


def _combined(problem, stacked, size: int) -> Combined:
    """Buckets of `size` written as independent psums: what XLA's combiner makes of them."""
    plan = bucketing.plan_buckets(problem.leaves, size)
    program = bucketing.reduce_program(plan, problem.mesh, problem.axis, keep_apart=False)
    found = hlo.inspect(program, stacked, mesh=problem.mesh).collectives
    return Combined(size, kit.seen(found), tuple(len(c.result_shapes) for c in found))


def _tpu_counts(tpu: kit.TpuChips, config: Config, model_config) -> tuple[tuple[TpuCount, ...], int]:
    problem = bucketing.gradient_problem(model_config, tpu.mesh("data"), placed=False)
    counts = tuple(
        _tpu_count(problem, threshold) for threshold in track([None, *config.tpu_thresholds], "TPU combiner thresholds")
    )
    return counts, len(problem.leaves)


def _tpu_count(problem, threshold: str | None) -> TpuCount:
    options = {} if threshold is None else {COMBINER_OPTION: 0 if threshold == "0" else parse_size(threshold)}
    with quiet_native_stderr():
        compiled = (
            bucketing.step_program(problem, None)
            .lower(problem.params, problem.tokens)
            .compile(compiler_options=options)
        )
    reduces = [c for c in hlo.inspect_compiled(compiled, problem.mesh).collectives if c.kind == "all-reduce"]
    return TpuCount(
        "compiler default" if threshold is None else format_bytes(options[COMBINER_OPTION]),
        len(reduces),
        max((len(c.result_shapes) for c in reduces), default=0),
        sum(c.is_async for c in reduces),
    )


# --------------------------------------------------------------------------- judge


def judge(obs: Observations, config: Config) -> Result:
    fit = _fit(obs)
    tpu = _tpu_prediction(obs, config) if obs.tpu_counts else None
    return Result(
        summary=_summary(obs, fit, tpu, config),
        theory=THEORY,
        tables=[_sweep_table(obs, fit), *_tpu_tables(obs, tpu, config)],
        checks=_checks(obs, config),
        claims=_claims(obs, fit),
        plots={"bucket_size": partial(_plot, obs, fit, tpu, config)},
        notes=_notes(obs, fit, tpu, config),
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


def _buckets(obs: Observations, size: int) -> int:
    return theory.bucket_count(obs.gradient_bytes, size)


def _alpha_chain(obs: Observations) -> float:
    return (obs.chain.median - obs.single.median) / (CHAIN - 1)


def _fit(obs: Observations) -> dict:
    """time = rest + n·α_AR through the two ends of the multi-bucket sweep (most and fewest buckets); the sizes between
    and the single bucket are held out. None when the sweep has fewer than two multi-bucket programs."""
    multi = {p.key: p for p in obs.points if p.key != EVERYTHING}
    if len(multi) < 2:
        return {}
    ends = sorted(multi.values(), key=lambda p: _buckets(obs, p.bytes))
    low, high = ends[0], ends[-1]
    n_low, n_high = _buckets(obs, low.bytes), _buckets(obs, high.bytes)
    slope = (obs.times[high.key].median - obs.times[low.key].median) / (n_high - n_low)
    return {
        "alpha_AR_s": slope,
        "rest_s": obs.times[low.key].median - n_low * slope,
        "fitted": (low.key, high.key),
    }


def _model_s(fit: dict, buckets: int) -> float:
    return fit["rest_s"] + buckets * fit["alpha_AR_s"]


def _checks(obs: Observations, config: Config) -> list[Check]:
    checks = []
    for p in obs.points:
        name = f"b={format_bytes(p.bytes)}"
        checks.append(
            check(f"{name}: all-reduces in HLO = ceil(G/b)", _buckets(obs, p.bytes), p.all_reduces, kind="exact")
        )
        checks.append(
            check(
                f"{name}: every gradient sum bit-identical to per-tensor psums", "True", str(p.identical), kind="exact"
            )
        )
    c = obs.combined
    buckets = _buckets(obs, c.bytes)
    reduces = [(s, m) for s, m in zip(c.collectives, c.members) if s.kind == "all-reduce"]
    carried = sum(m for _, m in reduces)
    refined = (
        math.ceil(buckets / COMBINER_OPERANDS)
        if reduces and all(s.combined for s, _ in reduces) and carried == buckets
        else None
    )
    checks.append(
        check(
            f"b={format_bytes(c.bytes)} written as independent psums: all-reduces in HLO (one per bucket)",
            buckets,
            len(reduces),
            kind="exact",
            refined=refined,
            why=f"the HLO's all-reduce is a tuple carrying all {carried} buckets: XLA:CPU's combiner has no byte "
            f"threshold and takes up to {COMBINER_OPERANDS} operands, so ceil({buckets}/{COMBINER_OPERANDS}) "
            "all-reduce(s)"
            if refined is not None
            else "",
        )
    )
    checks.append(check("asynchronous collectives in the CPU step", 0, obs.fused_async, kind="exact"))
    if obs.tpu_counts:
        by = {t.threshold: t for t in obs.tpu_counts}
        if "0 Bytes" in by:
            checks.append(
                check(
                    f"tpu:{config.tpu_topology}: all-reduces with combiner threshold 0 = gradient tensors",
                    obs.tpu_tensors,
                    by["0 Bytes"].all_reduces,
                    kind="exact",
                )
            )
        checks.append(
            check(
                f"tpu:{config.tpu_topology}: all-reduces with the compiler's default threshold (all in one)",
                1,
                by["compiler default"].all_reduces,
                kind="exact",
            )
        )
        checks.append(
            check(
                f"tpu:{config.tpu_topology}: asynchronous all-reduces, at every combiner threshold",
                0,
                sum(t.asynchronous for t in obs.tpu_counts),
                kind="exact",
            )
        )
    return checks


def _claims(obs: Observations, fit: dict) -> list[Claim]:
    multi = sorted((p for p in obs.points if p.key != EVERYTHING), key=lambda p: p.bytes)
    if len(multi) < 2:
        return []
    small, large = multi[0], multi[-1]
    alpha = _alpha_chain(obs)
    counted = all(p.all_reduces == _buckets(obs, p.bytes) for p in multi)
    return [
        Claim(
            "Too-small buckets fragment communication: the launch overhead grows with the bucket count",
            "confirmed" if counted and small.all_reduces > large.all_reduces and alpha > 0 else "refuted",
            f"{format_bytes(small.bytes)} buckets: {small.all_reduces} all-reduces in HLO against "
            f"{large.all_reduces} at {format_bytes(large.bytes)}; each costs α_AR = {alpha * 1e6:.0f} µs on its own "
            f"(chain of {CHAIN}), {fit['alpha_AR_s'] * 1e6:.0f} µs from the sweep's two ends; reduction "
            f"{obs.times[small.key].median * 1e3:.1f} ms against {obs.times[large.key].median * 1e3:.1f} ms "
            "(timings on a shared host, not judged)",
        )
    ]


def _sweep_table(obs: Observations, fit: dict) -> Table:
    backward = obs.times["backward"]
    body = []
    for p in obs.points:
        time = obs.times[p.key]
        n = _buckets(obs, p.bytes)
        note = p.label or ("holds every gradient: one bucket" if p.key == EVERYTHING else "")
        if fit:
            model = _model_s(fit, n)
            role = "fitted" if p.key in fit["fitted"] else "held out"
            modelled = f"{model * 1e3:.1f} ms ({role}; measured {time.median / model:.2f}x)"
        else:
            modelled = "-"
        body.append(
            [
                format_bytes(p.bytes),
                n,
                p.all_reduces,
                str(time),
                modelled,
                f"{(backward.median + time.median) * 1e3:.1f} ms",
                format_bytes(p.temp_bytes),
                note,
            ]
        )
    body.append(
        [
            "per-tensor psums",
            "-",
            f"{obs.fused_all_reduces} (XLA combined)",
            str(obs.times["per-tensor"]),
            "-",
            f"{(backward.median + obs.times['per-tensor'].median) * 1e3:.1f} ms",
            "-",
            f"in one program with the backward: {obs.times['fused']}",
        ]
    )
    note = f"α_AR measured on its own: {_alpha_chain(obs) * 1e6:.0f} µs (a chain of {CHAIN} one-element all-reduces)."
    if fit:
        note += (
            f" Launch model n·α_AR + rest through the two ends of the multi-bucket sweep ({' and '.join(fit['fitted'])}"
            f"): α_AR = {fit['alpha_AR_s'] * 1e6:.0f} µs, rest {fit['rest_s'] * 1e3:.1f} ms. The held-out sizes are "
            "shown, not judged: the model puts them a few ms above the 4 MiB point, and on this 2-core host, shared "
            "with other work, their spread in this run alone ((max - min) / median: "
            + ", ".join(
                f"{p.key} {obs.times[p.key].spread:.0%}"
                for p in {q.key: q for q in obs.points}.values()
                if p.key not in fit["fitted"]
            )
            + ") is as large as that: a verdict on them would not survive a rerun."
        )
    return Table(
        f"Bucket sweep on this target (backward {backward})",
        [
            "bucket b",
            "ceil(G/b)",
            "all-reduces in HLO",
            "reduction time (median [min, max])",
            "launch model",
            "step = backward + reduction",
            "temp memory",
            "",
        ],
        body,
        note=note,
    )


def _tpu_prediction(obs: Observations, config: Config) -> dict:
    """T(b) of the `tpu_model` preset's fp32 gradients on the slice, with and without overlap (lab.theory)."""
    chip, chips = profile(obs.tpu_chip), obs.tpu_chips
    model = preset(config.tpu_model)
    grad_bytes = 4 * model.parameters
    backward_s = 4 * model.parameters * config.tpu_tokens_per_chip / chip.peak_bf16_flops  # 2x forward's 2 Psi FLOPs
    sizes = [2.0**k for k in range(16, 33)]
    network = {"alpha": chip.hop_latency_s, "beta": chip.link_bandwidth, "algorithm": "bidirectional-ring"}

    def step(b, overlap=True):
        return theory.bucketed_allreduce_time(grad_bytes, b, chips, backward_s=backward_s, overlap=overlap, **network)

    overlapped = [step(b) for b in sizes]
    best = min(overlapped, key=lambda t: t.step_s)
    latency = theory.collective_cost("all-reduce", 1.0, chips, **network).latency_s
    return {
        "grad_bytes": grad_bytes,
        "backward_s": backward_s,
        "sizes": sizes,
        "overlapped_s": [t.step_s for t in overlapped],
        "serial_s": [step(b, overlap=False).step_s for b in sizes],
        "best_bytes": best.bucket_bytes,
        "best_s": best.step_s,
        "b_star": theory.optimal_bucket_bytes(grad_bytes, backward_s, latency),
        "ddp_s": step(bucketing.DDP_BUCKET_BYTES).step_s,
        "single_s": step(grad_bytes).step_s,
    }


def _tpu_tables(obs: Observations, tpu: dict | None, config: Config) -> list[Table]:
    if obs.tpu_unavailable:
        return [obs.tpu_unavailable.table()]
    if tpu is None:
        return []
    counts = Table(
        f"XLA's own bucketing: tpu:{config.tpu_topology} combiner threshold against all-reduces (same step, one psum "
        f"per gradient tensor, {obs.tpu_tensors} tensors)",
        ["combiner threshold", "all-reduces in HLO", "most tensors in one", "asynchronous"],
        [[c.threshold, c.all_reduces, c.largest_operands, c.asynchronous] for c in obs.tpu_counts],
    )
    picks = [
        ("DDP default 25 MiB", bucketing.DDP_BUCKET_BYTES, tpu["ddp_s"]),
        ("best in sweep", tpu["best_bytes"], tpu["best_s"]),
        ("one bucket", tpu["grad_bytes"], tpu["single_s"]),
    ]
    model = Table(
        f"Predicted on tpu:{config.tpu_topology} ({obs.tpu_chips} x {obs.tpu_chip}): the {config.tpu_model} preset's "
        f"fp32 gradients ({format_bytes(tpu['grad_bytes'])}), backward {tpu['backward_s'] * 1e3:.1f} ms "
        "(lab.theory, not measured)",
        ["bucket", "size", "step with overlap"],
        [[name, format_bytes(size), f"{seconds * 1e3:.2f} ms"] for name, size, seconds in picks],
        note=_regime(tpu),
    )
    return [counts, model]


def _regime(tpu: dict) -> str:
    """Which half of the model decides the best bucket on the TPU."""
    comm = tpu["single_s"] - tpu["backward_s"]  # one bucket: all communication after the backward
    if comm > tpu["backward_s"]:
        return (
            f"Communication ({comm * 1e3:.1f} ms) exceeds the backward: the optimum is near "
            f"b* = G·sqrt(α_AR/C) = {format_bytes(tpu['b_star'])}."
        )
    return (
        f"The backward ({tpu['backward_s'] * 1e3:.1f} ms) outlasts the communication ({comm * 1e3:.1f} ms): "
        f"b* = G·sqrt(α_AR/C) = {format_bytes(tpu['b_star'])} is the communication-bound formula and does not apply; "
        "the best bucket is the smallest whose launches still fit under the backward, leaving the shortest tail."
    )


def _summary(obs: Observations, fit: dict, tpu: dict | None, config: Config) -> str:
    backward = obs.times["backward"].median
    best = min(obs.points, key=lambda p: obs.times[p.key].median)
    single = next((p for p in obs.points if p.key == EVERYTHING), obs.points[-1])
    smallest = obs.points[0]
    step_best, step_single = backward + obs.times[best.key].median, backward + obs.times[single.key].median
    text = (
        f"The lab transformer's {obs.tensors} gradient tensors ({format_bytes(obs.gradient_bytes)}) were cut into "
        f"buckets from {format_bytes(smallest.bytes)} ({smallest.all_reduces} all-reduces in the HLO, ceil(G/b) "
        "exactly) to one, every sum bit-identical. On this target collectives are synchronous and nothing overlaps; "
        f"each all-reduce costs about {_alpha_chain(obs) * 1e6:.0f} µs on its own. The fastest measured bucket "
        f"({format_bytes(best.bytes)}, {best.all_reduces} all-reduce(s)) gave a step of {step_best * 1e3:.1f} ms "
        f"against {step_single * 1e3:.1f} ms for one all-reduce of everything; leaving the tensors to XLA's own "
        f"combiner gave {(backward + obs.times['per-tensor'].median) * 1e3:.1f} ms. DDP's 25 MiB default is one "
        "bucket here: the gradients are smaller."
    )
    if tpu is not None:
        text += (
            f" On tpu:{config.tpu_topology}, where a backward can hide buckets, the model puts the best bucket for "
            f"the {config.tpu_model} preset near {format_bytes(tpu['best_bytes'])} ({tpu['best_s'] * 1e3:.2f} ms a "
            f"step against {tpu['single_s'] * 1e3:.2f} ms for one bucket)."
        )
    return text


def _notes(obs: Observations, fit: dict, tpu: dict | None, config: Config) -> list[str]:
    one = [format_bytes(p.bytes) for p in obs.points if p.key == EVERYTHING]
    c = obs.combined
    notes = [
        f"Every bucket of {', '.join(one) or '-'} holds all {format_bytes(obs.gradient_bytes)} of gradients: one "
        "bucket, one all-reduce, one program.",
        f"Written as independent psums, {_buckets(obs, c.bytes)} buckets of {format_bytes(c.bytes)} compiled to "
        f"{sum(s.kind == 'all-reduce' for s in c.collectives)} all-reduce(s) on XLA:CPU: the combiner undoes "
        "hand-made bucketing. Chaining each bucket to the previous one's result (a data dependency) keeps them "
        "apart; `lax.optimization_barrier` does not: XLA:CPU drops it before combining.",
        "Without overlap the model says the fewest buckets win. Measured, the single packed bucket packs and unpacks "
        "every gradient at once, and the per-tensor psums that XLA combines into one tuple all-reduce need no "
        "packing at all; the linear model has no term for packing, and on this machine smaller pieces of N x b stay "
        "near the last-level cache (a likely reason, not measured here).",
        "The step in one program (backward and its psums) is shown next to backward + reduction measured apart but "
        "not judged: the reduction is a small part of the step and the clock here cannot separate 'no overlap' from "
        "a little overlap. That nothing overlaps on XLA:CPU is read from the HLO instead (no asynchronous collective).",
        "The lab transformer stacks its layers in a scan, so the block weights' gradients leave the backward loop "
        "together when it ends: bucketing them in backward order cannot start any of their all-reduces earlier.",
        "That too-large buckets start communicating late is a claim about overlap, which this target cannot show and "
        "the default TPU compile does not do (its all-reduces are synchronous): the TPU table is the model's "
        "prediction, not evidence, and the claim is not listed as tested.",
    ]
    if obs.tpu_counts:
        default = next(t for t in obs.tpu_counts if t.threshold == "compiler default")
        notes.append(
            f"libtpu with its default threshold put all {obs.tpu_tensors} gradient tensors in {default.all_reduces} "
            "all-reduce(s); threshold 0 keeps one per tensor."
        )
    return notes


def _plot(obs: Observations, fit: dict, tpu: dict | None, config: Config) -> Figure:
    panels = 2 if tpu is not None else 1
    figure = Figure(figsize=(6.5 * panels, 4.2))
    axes = figure.subplots(1, panels, squeeze=False)
    left = axes[0][0]
    backward = obs.times["backward"].median
    sizes = [p.bytes for p in obs.points]
    left.plot(sizes, [(backward + obs.times[p.key].median) * 1e3 for p in obs.points], "o-", label="measured step")
    if fit:
        left.plot(
            sizes,
            [(backward + _model_s(fit, _buckets(obs, p.bytes))) * 1e3 for p in obs.points],
            "--",
            label="launch model (fitted at the sweep's ends)",
        )
    left.axvline(bucketing.DDP_BUCKET_BYTES, color="grey", linestyle=":", label="DDP 25 MiB")
    left.axvline(obs.gradient_bytes, color="green", linestyle=":", label="all gradients")
    left.set(xscale="log", xlabel="bucket size (bytes)", ylabel="ms per step", title="this target (no overlap)")
    left.legend(fontsize=8)
    if tpu is not None:
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
            title=f"tpu:{config.tpu_topology} model, {config.tpu_model} gradients",
        )
        right.legend(fontsize=8)
    figure.tight_layout()
    return figure
