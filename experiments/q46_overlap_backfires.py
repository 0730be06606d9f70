"""When overlap backfires: tiny buckets, extra buffers, and compute too short to hide anything.

Question #46 lists why overlapping communication can make training slower:
finer buckets and more launches, extra buffer memory, contention, and compute
too short for there to be anything to hide behind. Each is measured on this
target and predicted for a TPU slice next to its model:

1. **Tiny buckets.** Every all-reduce pays a fixed cost alpha_AR however small
   it is; the lab transformer's gradients in 64 KiB buckets pay it hundreds of
   times. The HLO counts the launches; alpha_AR is measured on its own (a chain
   of one-element all-reduces) and predicts the penalty, shown next to the
   measured one; the TPU model shows the same for a 125M model.
2. **Extra buffers.** A bucket is a packed copy of the gradients it holds:
   XLA's memory analysis shows the temporary memory per bucket size, against
   DDP's own accounting (a second copy of the gradients unless
   ``gradient_as_bucket_view=True``).
3. **Compute too short.** A collective matmul hides a block's transfer behind
   the block's product only when the product takes longer; narrow matrices are
   communication-bound, and the ring's N-1 one-way transfers then cost more
   than the plain all-gather. Shown on the TPU compiler's schedule across
   widths (what it overlaps, read from the HLO; what that is priced at). This
   target runs every collective synchronously, so its clock cannot show it
   (the #45 page times the ring against the plain program here).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import partial

from matplotlib.figure import Figure

from experiments import kit
from experiments.q45_overlap import TpuVariant, tpu_checks, tpu_variant
from lab import theory
from lab.bench import Timing, time_interleaved
from lab.mesh import MeshSpec
from lab.model import preset
from lab.parallel import bucketing
from lab.progress import track
from lab.provenance import Setup
from lab.report import Result, Table
from lab.targets.devices import DEFAULT_TARGET, devices_for
from lab.targets.hardware import profile
from lab.units import format_bytes, parse_size
from lab.verdict import Check, Claim, check

QUESTION = "#46"
CHAIN = 64  # one-element all-reduces in the chain that measures alpha_AR
COMBINER_OPERANDS = 256  # XLA:CPU's all-reduce combiner: no byte threshold, up to 256 operands (cpu_compiler.cc)
TPU_M, TPU_K = 8192, 4096  # the TPU collective matmul's M and K (bf16); F is swept
PLAIN, RING = "all-gather then matmul", "ring all-gather matmul"
REDUCTIONS = ("per-tensor psums", "tiny buckets", "baseline buckets", "one bucket")


@dataclass(frozen=True)
class Config:
    target: str = DEFAULT_TARGET
    """where to run (cpu:N, gpu, tpu)"""
    model: str = "small"
    """lab.model preset whose gradients are bucketed"""
    seq: int = 16
    """sequence length of the gradient step"""
    tiny_bucket: str = "64K"
    """the too-small bucket"""
    baseline_bucket: str = "4M"
    """the bucket the tiny one is compared with (a few all-reduces, each packing a cache-sized piece)"""
    repeats: int = 7
    """timed rounds, after warm-up (the median is reported)"""
    tpu_topology: str = "v5e:2x4"
    """TPU slice for the schedules and the predictions (compile-only); empty to skip"""
    tpu_widths: tuple[int, ...] = (4096, 65536)
    """F of the TPU collective matmul (M=8192, K=4096, bf16): narrow to wide"""
    tpu_model: str = "125m"
    """lab.model preset whose gradients the TPU bucket prediction uses"""
    tpu_tokens_per_chip: int = 8192
    """tokens per chip in the TPU bucket prediction's backward pass"""


@dataclass(frozen=True)
class Reduction:
    """One way of summing the gradients over the data axis, compiled and timed on this target."""

    name: str  # one of REDUCTIONS
    bucket_bytes: int | None  # None: one psum per tensor, left to XLA
    collectives: tuple[kit.Seen, ...]
    members: tuple[int, ...]  # arrays each all-reduce carries (a combined one is a tuple of several)
    temp_bytes: int  # XLA's memory analysis: temporary buffers
    time: Timing


@dataclass(frozen=True)
class Width:
    """The plain and the ring all-gather matmul at one F, as the TPU compiler scheduled them."""

    F: int
    plain: TpuVariant
    ring: TpuVariant


@dataclass(frozen=True)
class Observations:
    setup: Setup
    devices: int
    gradient_bytes: int  # G: every gradient tensor of the model, float32
    tensors: int
    reductions: tuple[Reduction, ...]
    chain: Timing  # CHAIN dependent one-element all-reduces
    single: Timing  # one one-element all-reduce of CHAIN elements
    widths: tuple[Width, ...] = ()
    tpu_chip: str = ""
    tpu_chips: int = 0
    tpu_unavailable: kit.Unavailable | None = None


# --------------------------------------------------------------------------- measure


def measure(config: Config) -> Observations:
    devices = devices_for(config.target)
    mesh = MeshSpec(data=len(devices)).build(devices)
    problem = bucketing.gradient_problem(replace(preset(config.model), seq=config.seq), mesh)
    stacked = bucketing.local_gradient_program(problem)(problem.params, problem.tokens)
    total = sum(leaf.size * leaf.dtype.itemsize for leaf in problem.leaves)
    sizes = dict(
        zip(REDUCTIONS, (None, parse_size(config.tiny_bucket), parse_size(config.baseline_bucket), int(total)))
    )
    programs, found = {}, {}
    for name, size in track(sizes.items(), "bucketings"):
        plan = bucketing.plan_buckets(problem.leaves, size) if size else None
        compiled, inspection = kit.compile_and_inspect(bucketing.reduce_program(plan, mesh, "data"), stacked, mesh=mesh)
        programs[name] = (compiled, (stacked,))
        found[name] = (
            kit.seen(inspection.collectives),
            tuple(len(c.result_shapes) for c in inspection.collectives),
            int(inspection.memory["temp_size"]),
        )
    programs.update(bucketing.launch_cost_programs(mesh, "data", CHAIN))
    timings = time_interleaved(programs, repeats=config.repeats)
    tpu = kit.tpu_chips(config.tpu_topology)
    return Observations(
        setup=Setup.of(config.target, devices, f"data={len(devices)} (buckets), tensor={len(devices)} (matmul)"),
        devices=len(devices),
        gradient_bytes=int(total),
        tensors=len(problem.leaves),
        reductions=tuple(Reduction(name, sizes[name], *found[name], timings[name]) for name in REDUCTIONS),
        chain=timings["chain"],
        single=timings["single"],
        widths=_tpu_widths(tpu, config.tpu_widths) if isinstance(tpu, kit.TpuChips) else (),
        tpu_chip=tpu.chip.name if isinstance(tpu, kit.TpuChips) else "",
        tpu_chips=len(tpu) if isinstance(tpu, kit.TpuChips) else 0,
        tpu_unavailable=tpu if isinstance(tpu, kit.Unavailable) else None,
    )


def _tpu_widths(tpu: kit.TpuChips, widths) -> tuple[Width, ...]:
    mesh = tpu.mesh("tensor")
    return tuple(
        Width(f, *(tpu_variant(name, mesh, (TPU_M, TPU_K, f), tpu.chip, tpu.dims) for name in (PLAIN, RING)))
        for f in track(widths, "TPU collective matmul widths")
    )


# --------------------------------------------------------------------------- judge


def judge(obs: Observations, config: Config) -> Result:
    checks = _bucket_checks(obs, config)
    if obs.widths:
        for w in obs.widths:
            checks += tpu_checks((w.plain, w.ring), f"tpu:{config.tpu_topology} F={w.F}", _shape(w), obs.tpu_chips)
    return Result(
        summary=_summary(obs, config),
        theory=THEORY,
        tables=[_bucket_table(obs, config), *_tpu_tables(obs, config)],
        checks=checks,
        claims=_claims(obs, config),
        plots={"backfires": partial(_plot, obs, config)},
        notes=_notes(obs, config),
    )


THEORY = r"""
**Launches.** n buckets cost n·α_AR + G·2(N-1)/N/β (Li et al. 2020, "PyTorch Distributed", Section 3.2.3), so going
from one bucket to n adds (n-1)·α_AR whatever else overlaps: the model predicts the penalty from α_AR alone, measured
here as the slope of a chain of dependent one-element all-reduces.

**Buffers.** A bucket is a flat copy of the gradients it packs, and its sum is another: up to 2·b bytes live per
bucket in flight, 2·G for one bucket of everything. PyTorch documents the same cost: DDP's buckets duplicate the
gradients unless `gradient_as_bucket_view=True` ("the saved memory size will be equal to the total gradients size",
torch.nn.parallel.DistributedDataParallel). Overlap keeps buffers alive longer, too: a transfer in flight holds both
its source and its destination.

**Compute too short.** Hiding needs C ≥ T: a collective matmul's block product c = 2·(M/N)·K·(F/N)/peak against one
block's transfer t = (M/N)·K·bytes/β_link (Wang et al. 2023, ASPLOS; the scaling book, Part 3). The ratio c/t grows
with F/N; below F/N ≈ peak·bytes/(2·β_link) the ring is communication-bound,
T_ring = c + (N-1)·t, and its N-1 one-way hops are slower than one bidirectional all-gather: overlap backfires.
"""


def _shape(w: Width) -> tuple[int, int, int]:
    return (TPU_M, TPU_K, w.F)


def _by(obs: Observations) -> dict[str, Reduction]:
    return {r.name: r for r in obs.reductions}


def alpha_s(obs: Observations) -> float:
    """alpha_AR: the chain's extra time over a single all-reduce, per extra all-reduce."""
    return (obs.chain.median - obs.single.median) / (CHAIN - 1)


def _all_reduces(r: Reduction) -> int:
    return sum(c.kind == "all-reduce" for c in r.collectives)


def _penalty(obs: Observations) -> tuple[float, float]:
    """(measured, predicted) extra time of the tiny buckets over the baseline ones."""
    by = _by(obs)
    tiny, base = by["tiny buckets"], by["baseline buckets"]
    extra = _all_reduces(tiny) - _all_reduces(base)
    return tiny.time.median - base.time.median, extra * alpha_s(obs)


def _bucket_checks(obs: Observations, config: Config) -> list[Check]:
    by, g = _by(obs), obs.gradient_bytes
    checks = [
        check(
            f"{name} ({format_bytes(by[name].bucket_bytes)}): all-reduces in HLO = ceil(G/b)",
            theory.bucket_count(g, by[name].bucket_bytes),
            _all_reduces(by[name]),
            kind="exact",
        )
        for name in ("tiny buckets", "baseline buckets")
    ]
    psums = by["per-tensor psums"]
    carried = sum(m for c, m in zip(psums.collectives, psums.members) if c.kind == "all-reduce")
    combined = all(c.combined for c in psums.collectives if c.kind == "all-reduce")
    refined = math.ceil(obs.tensors / COMBINER_OPERANDS) if combined and carried == obs.tensors else None
    checks.append(
        check(
            "per-tensor psums: all-reduces in HLO (one per tensor)",
            obs.tensors,
            _all_reduces(psums),
            kind="exact",
            refined=refined,
            why=f"the HLO's all-reduce is a tuple carrying all {carried} gradient tensors: XLA:CPU's combiner has no "
            f"byte threshold and takes up to {COMBINER_OPERANDS} operands, so ceil({obs.tensors}/"
            f"{COMBINER_OPERANDS}) all-reduce(s)"
            if refined is not None
            else "",
        )
    )
    checks.append(
        check(
            "one bucket: temp memory = packed copy + its sum = 2G (bytes)",
            2 * g,
            by["one bucket"].temp_bytes,
            kind="exact",
        )
    )
    return checks


def _claims(obs: Observations, config: Config) -> list[Claim]:
    by = _by(obs)
    tiny, base, one, psums = by["tiny buckets"], by["baseline buckets"], by["one bucket"], by["per-tensor psums"]
    measured, predicted = _penalty(obs)
    alpha = alpha_s(obs)
    more = _all_reduces(tiny) > _all_reduces(base) and alpha > 0
    claims = [
        Claim(
            "Finer buckets mean more launches, each paying a fixed scheduling cost",
            "confirmed" if more else "refuted",
            f"{format_bytes(tiny.bucket_bytes)} buckets: {_all_reduces(tiny)} all-reduces in HLO against "
            f"{_all_reduces(base)} for {format_bytes(base.bucket_bytes)}; α_AR = {alpha * 1e6:.0f} µs per all-reduce "
            f"(chain of {CHAIN}); penalty measured {measured * 1e3:.1f} ms against Δn·α_AR = {predicted * 1e3:.1f} ms "
            "(a timing on a shared host, not judged)",
        )
    ]
    grows = psums.temp_bytes <= tiny.temp_bytes <= base.temp_bytes <= one.temp_bytes and one.temp_bytes >= (
        obs.gradient_bytes
    )
    claims.append(
        Claim(
            "Bucketing for overlap costs extra buffer memory",
            "confirmed" if grows else "refuted",
            "XLA's temp memory: "
            + ", ".join(f"{r.name} {format_bytes(r.temp_bytes)}" for r in (psums, tiny, base, one))
            + f", for {format_bytes(obs.gradient_bytes)} of gradients",
        )
    )
    if len(obs.widths) >= 2:
        narrow, wide = obs.widths[0], obs.widths[-1]
        r_narrow, r_wide = (w.ring.step_s / w.plain.step_s for w in (narrow, wide))
        claims.append(
            Claim(
                "When compute is too short there is little to hide, and overlap can make the step slower",
                "confirmed" if r_narrow > 1 > r_wide else "refuted",
                f"tpu:{config.tpu_topology} priced schedule: ring / plain step {r_narrow:.2f}x at F/N = "
                f"{narrow.F // obs.tpu_chips} (block product {_block_s(obs, narrow) * 1e6:.0f} µs against a "
                f"{_transfer_s(narrow) * 1e6:.0f} µs transfer), {r_wide:.2f}x at F/N = {wide.F // obs.tpu_chips} "
                f"({_block_s(obs, wide) * 1e6:.0f} against {_transfer_s(wide) * 1e6:.0f} µs)",
            )
        )
    return claims


def _block_s(obs: Observations, w: Width) -> float:
    return 2 * TPU_M * TPU_K * w.F / obs.tpu_chips**2 / profile(obs.tpu_chip).peak_bf16_flops


def _transfer_s(w: Width) -> float:
    return max(x.comm_s for x in w.ring.windows if x.kind == "collective-permute")


def _bucket_table(obs: Observations, config: Config) -> Table:
    by = _by(obs)
    base = by["baseline buckets"].time.median
    body = [
        [
            f"buckets of {format_bytes(r.bucket_bytes)}" if r.name.endswith("buckets") else r.name,
            theory.bucket_count(obs.gradient_bytes, r.bucket_bytes) if r.bucket_bytes else obs.tensors,
            _all_reduces(r),
            sum(r.members),
            str(r.time),
            f"{r.time.median / base:.2f}x",
            format_bytes(r.temp_bytes),
        ]
        for r in obs.reductions
    ]
    measured, predicted = _penalty(obs)
    return Table(
        f"The lab transformer's gradients ({format_bytes(obs.gradient_bytes)}, {obs.tensors} tensors) on this "
        f"target, data={obs.devices}",
        [
            "reduction",
            "buckets (psums)",
            "all-reduces in HLO",
            "arrays they carry",
            "time (median [min, max])",
            f"vs {format_bytes(by['baseline buckets'].bucket_bytes)} buckets",
            "temp memory",
        ],
        body,
        note=f"α_AR measured on its own: {alpha_s(obs) * 1e6:.0f} µs per all-reduce (a chain of {CHAIN} one-element "
        f"all-reduces, {obs.chain}, against one, {obs.single}). Tiny-bucket penalty: measured "
        f"{measured * 1e3:.1f} ms, predicted Δn·α_AR = {predicted * 1e3:.1f} ms. Shown, not judged: on this 2-core "
        "host, shared with other work, the load moves the baseline's median by as much as the penalty between runs "
        f"(spread (max - min) / median in this run: tiny {by['tiny buckets'].time.spread:.0%}, baseline "
        f"{by['baseline buckets'].time.spread:.0%}), and a fresh run has measured it negative.",
    )


def _tpu_bucket_steps(obs: Observations, config: Config) -> tuple[float, float, dict]:
    """The tiny bucket against DDP's default and one bucket, for the `tpu_model` preset on the slice (overlapped)."""
    chip, model = profile(obs.tpu_chip), preset(config.tpu_model)
    grad_bytes = 4 * model.parameters
    backward_s = 4 * model.parameters * config.tpu_tokens_per_chip / chip.peak_bf16_flops
    network = {"alpha": chip.hop_latency_s, "beta": chip.link_bandwidth, "algorithm": "bidirectional-ring"}
    picks = {"tiny": parse_size(config.tiny_bucket), "DDP 25 MiB": bucketing.DDP_BUCKET_BYTES, "one bucket": grad_bytes}
    steps = {
        name: theory.bucketed_allreduce_time(grad_bytes, size, obs.tpu_chips, backward_s=backward_s, **network)
        for name, size in picks.items()
    }
    return grad_bytes, backward_s, steps


def _tpu_tables(obs: Observations, config: Config) -> list[Table]:
    if obs.tpu_unavailable:
        return [obs.tpu_unavailable.table()]
    if not obs.widths:
        return []
    n, rows = obs.tpu_chips, []
    for w in obs.widths:
        windows = sum(x.is_async and x.flops > 0 for x in w.ring.windows)
        rows.append(
            [
                w.F,
                w.F // n,
                f"{_block_s(obs, w) * 1e6:.0f} / {_transfer_s(w) * 1e6:.0f}",
                f"`{w.ring.timeline}`",
                f"{windows} of {sum(x.is_async for x in w.ring.windows)}",
                f"{w.ring.flops_in_flight / w.ring.flops:.0%}",
                f"{w.ring.step_s * 1e3:.2f}",
                f"{w.plain.step_s * 1e3:.2f}",
                f"{w.ring.step_s / w.plain.step_s:.2f}x",
            ]
        )
    width_table = Table(
        f"Collective matmul on tpu:{config.tpu_topology} ({n} x {obs.tpu_chip}), M={TPU_M}, K={TPU_K}, bf16: narrow "
        "to wide (compile-only)",
        [
            "F",
            "F/N",
            "block product / transfer (µs)",
            "ring schedule",
            "transfers with a product inside",
            "ring FLOPs under a transfer",
            "ring priced step (ms)",
            "plain priced step (ms)",
            "ring vs plain",
        ],
        rows,
        note="Read from the scheduled HLO: the schedule, which transfers have a product in their window, the FLOPs "
        "under a transfer. Priced by lab.hlo.schedule (roofline compute, lab.theory transfers): the steps, a model "
        "of the schedule and not a measurement.",
    )
    grad_bytes, backward_s, steps = _tpu_bucket_steps(obs, config)
    bucket_table = Table(
        f"Predicted on tpu:{config.tpu_topology}: the {config.tpu_model} preset's gradients "
        f"({format_bytes(grad_bytes)}), backward {backward_s * 1e3:.1f} ms, overlapped (lab.theory, not measured)",
        ["bucket", "buckets", "launch latency n·α_AR (ms)", "communication (ms)", "exposed (ms)", "step (ms)"],
        [
            [
                name,
                s.buckets,
                f"{s.latency_s * 1e3:.2f}",
                f"{s.comm_s * 1e3:.2f}",
                f"{s.exposed_s * 1e3:.2f}",
                f"{s.step_s * 1e3:.2f}",
            ]
            for name, s in steps.items()
        ],
    )
    return [width_table, bucket_table]


def _summary(obs: Observations, config: Config) -> str:
    by = _by(obs)
    tiny, base, one = by["tiny buckets"], by["baseline buckets"], by["one bucket"]
    measured, predicted = _penalty(obs)
    text = (
        f"Cutting {format_bytes(obs.gradient_bytes)} of gradients into {format_bytes(tiny.bucket_bytes)} buckets "
        f"made {_all_reduces(tiny)} all-reduces in the HLO against {_all_reduces(base)} for "
        f"{format_bytes(base.bucket_bytes)} buckets, each costing about {alpha_s(obs) * 1e6:.0f} µs on its own on "
        f"this target: Δn·α_AR = {predicted * 1e3:.1f} ms predicted, {measured * 1e3:.1f} ms measured "
        f"({tiny.time.median / base.time.median:.2f}x the time). One bucket of everything needed "
        f"{format_bytes(one.temp_bytes)} of temporary memory, exactly its packed copy and its sum (2G)."
    )
    if len(obs.widths) >= 2:
        narrow, wide = obs.widths[0], obs.widths[-1]
        text += (
            f" On tpu:{config.tpu_topology} the priced schedule puts the ring at "
            f"{narrow.ring.step_s / narrow.plain.step_s:.2f}x the plain program's step at F/N = "
            f"{narrow.F // obs.tpu_chips} (each block's product shorter than its transfer) and "
            f"{wide.ring.step_s / wide.plain.step_s:.2f}x at F/N = {wide.F // obs.tpu_chips}."
        )
    return text


def _notes(obs: Observations, config: Config) -> list[str]:
    by = _by(obs)
    notes = [
        f"The {obs.tensors} per-tensor psums compiled to {_all_reduces(by['per-tensor psums'])} all-reduce(s): left "
        "alone, XLA buckets for you (its combiner), and on XLA:CPU without any size limit, which is why hand-made "
        "buckets are chained (each waits for the previous sum) to survive compilation.",
        "Temporary memory grows with the bucket: every bucket in flight is a packed copy plus its sum. Smaller "
        "buckets need less buffer and more launches; DDP's `gradient_as_bucket_view=True` removes the copy by making "
        "the gradients views into the buckets.",
        f"One bucket of everything took {by['one bucket'].time.median * 1e3:.1f} ms against "
        f"{by['baseline buckets'].time.median * 1e3:.1f} ms for {format_bytes(by['baseline buckets'].bucket_bytes)} "
        f"buckets: packing and unpacking all gradients at once is a copy of {2 * obs.devices} x "
        f"{format_bytes(obs.gradient_bytes)} through the one memory bus the emulated devices share (a likely reason, "
        "not measured here).",
        "CUDA-stream contention, the quick-reference's third reason, has no counterpart on this target (no streams, "
        "no asynchronous collectives) and is not tested here.",
    ]
    if obs.widths:
        narrowest = obs.widths[0]
        windows = sum(x.is_async and x.flops > 0 for x in narrowest.ring.windows)
        if windows < obs.tpu_chips - 1:
            notes.append(
                f"At F/N = {narrowest.F // obs.tpu_chips} the TPU scheduler did not interleave: "
                f"`{narrowest.ring.timeline}` runs most transfers back to back and puts the products in {windows} "
                "window(s), so 'transfers with a block product in their window' differs from the ring's one product "
                "per transfer. It costs nothing in the priced step: a product shorter than a transfer hides only "
                "itself, wherever it runs, and the FLOPs under a transfer are the same (N-1)/N."
            )
        notes.append(
            "The ring holds no gathered copy of X: its temporary memory against the plain program's ("
            + ", ".join(
                f"F={w.F}: {format_bytes(w.ring.temp_bytes)} against {format_bytes(w.plain.temp_bytes)}"
                for w in obs.widths
            )
            + "). Collective matmul is an overlap that saves memory; the buffer cost of overlap shows up in "
            "bucketing, not here."
        )
    return notes


def _plot(obs: Observations, config: Config) -> Figure:
    panels = 2 if len(obs.widths) >= 1 else 1
    figure = Figure(figsize=(6 * panels, 4.2))
    axes = figure.subplots(1, panels, squeeze=False)
    left = axes[0][0]
    names = [r.name for r in obs.reductions]
    left.bar(names, [r.time.median * 1e3 for r in obs.reductions])
    left.set(ylabel="ms (median)", title="gradient reduction on this target")
    for i, r in enumerate(obs.reductions):
        left.annotate(
            f"{_all_reduces(r)} AR, {format_bytes(r.temp_bytes)}",
            (i, r.time.median * 1e3),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    if panels == 2:
        right, n = axes[0][1], obs.tpu_chips
        first = obs.widths[0]
        per_column = _block_s(obs, first) / (first.F // n)
        gather = sum(x.comm_s for x in first.plain.windows)
        per_device = [2.0**k for k in range(7, 15)]
        curve = [
            theory.collective_matmul_time(per_column * f * n, _transfer_s(first), n) / (per_column * f * n + gather)
            for f in per_device
        ]
        right.plot(
            [w.F // n for w in obs.widths], [w.ring.step_s / w.plain.step_s for w in obs.widths], "o-", label="schedule"
        )
        right.plot(per_device, curve, "--", label="closed form")
        right.axhline(1.0, color="grey", linestyle=":")
        right.set(
            xscale="log",
            xlabel="F/N (output columns per chip)",
            ylabel="ring step / plain step",
            title=f"tpu:{config.tpu_topology} collective matmul (priced)",
        )
        right.legend()
    figure.tight_layout()
    return figure
