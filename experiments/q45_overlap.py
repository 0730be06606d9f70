"""Why overlap matters: max(compute, communication) instead of their sum, and collective matmul.

Question #45 says overlapping communication with compute does not send fewer
bytes but shortens the step: C + T becomes max(C, T), and communication is
hidden only when the compute is at least as long. This page checks that claim
where it can be checked:

1. a collective matmul written by hand (lab.parallel.collective_matmul): ``all_gather(X) @ W`` as
   a ring of N-1 ``ppermute`` s, each block's product computed while the next
   block travels; the bidirectional ring; and ``reduce_scatter(X @ W)`` the
   same way. Same numbers as the plain program, the same bytes, and on this
   target (whose collectives are synchronous), timed against it;
2. the TPU compiler's schedule of the same programs (compile-only): which
   matmuls it runs while a transfer is in flight, read from the scheduled HLO,
   against the N-1 block products the ring is built to hide; and the step
   lab.hlo.schedule prices from that schedule.

The quick-reference's arithmetic (100 ms of compute and 40 ms of
communication: 140 ms serial, 100 ms overlapped) is a table here; the formula
is unit-tested in tests/theory/test_overlap.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax.numpy as jnp
import numpy as np
from matplotlib.figure import Figure

from experiments import kit
from lab import hlo, theory
from lab.bench import Timing, time_interleaved
from lab.hlo import schedule
from lab.mesh import MeshSpec
from lab.parallel import collective_matmul
from lab.progress import track
from lab.provenance import Setup
from lab.report import Result, Table
from lab.targets.devices import DEFAULT_TARGET, devices_for
from lab.targets.hardware import profile
from lab.units import format_bytes
from lab.verdict import Check, Claim, check

QUESTION = "#45"
PLAIN_GATHER, RING_GATHER = "all-gather then matmul", "ring all-gather matmul"
RING_VARIANTS = (RING_GATHER, "bidirectional all-gather matmul", "ring matmul reduce-scatter")
GATHER_VARIANTS = (PLAIN_GATHER, RING_GATHER, "bidirectional all-gather matmul")
ROUNDOFF = {"rtol": 1e-5, "atol": 1e-4}  # float32: the ring adds the same products in another order
NO_OVERLAP_MARGIN = 0.2  # ring / plain time may read up to 20% below 1 from the clock's noise alone


@dataclass(frozen=True)
class Config:
    target: str = DEFAULT_TARGET
    """where to run (cpu:N, gpu, tpu)"""
    shape: tuple[int, int, int] = (1024, 1024, 1024)
    """M, K, F of Y = X @ W on this target (the reduce-scatter variants swap K and F)"""
    repeats: int = 7
    """timed rounds, after warm-up (the median is reported)"""
    compute_ms: float = 100.0
    """the quick-reference's example: compute per step"""
    comm_ms: float = 40.0
    """the quick-reference's example: communication per step"""
    tpu_topology: str = "v5e:2x4"
    """TPU slice whose compiler schedules the same programs (compile-only); empty to skip"""
    tpu_shape: tuple[int, int, int] = (8192, 4096, 65536)
    """M, K, F on the TPU, in bf16: F/N large enough for each block's product to cover its transfer"""


@dataclass(frozen=True)
class Variant:
    """One matmul variant compiled, run and timed on this target."""

    name: str
    collectives: tuple[kit.Seen, ...]
    timeline: str  # the scheduled entry computation as letters (lab.hlo.schedule.timeline)
    wrong: int  # elements of Y that differ from the plain twin's beyond float32 round-off (ROUNDOFF)
    max_abs_diff: float  # max |Y - Y_plain|
    time: Timing


@dataclass(frozen=True)
class Window:
    """One collective of a TPU schedule and what runs while its bytes travel."""

    kind: str
    is_async: bool
    flops: int  # matmul FLOPs of the instructions scheduled between its start and done
    compute_s: float  # those instructions priced by lab.hlo.schedule's roofline on the chip
    comm_s: float  # the transfer priced by lab.theory on the torus


@dataclass(frozen=True)
class TpuVariant:
    """One matmul variant as the TPU compiler scheduled it (compile-only), priced by lab.hlo.schedule."""

    name: str
    collectives: tuple[kit.Seen, ...]
    timeline: str
    flops: int  # matmul FLOPs per chip in the compiled program
    flops_in_flight: int  # of those, run while at least one transfer is in flight (each instruction once)
    windows: tuple[Window, ...]
    compute_s: float  # roofline of everything the program computes
    step_s: float  # compute + the communication no window hides
    xla_optimal_s: float | None  # XLA's own cost analysis (optimal_seconds)
    temp_bytes: int


@dataclass(frozen=True)
class Observations:
    setup: Setup
    devices: int
    variants: tuple[Variant, ...]
    tpu: tuple[TpuVariant, ...] = ()
    tpu_chip: str = ""
    tpu_chips: int = 0
    tpu_unavailable: kit.Unavailable | None = None


# --------------------------------------------------------------------------- measure


def measure(config: Config) -> Observations:
    devices = devices_for(config.target)
    mesh = MeshSpec(tensor=len(devices)).build(devices)
    tpu = kit.tpu_chips(config.tpu_topology)
    on_tpu = _measure_tpu(tpu, config.tpu_shape) if isinstance(tpu, kit.TpuChips) else ()
    return Observations(
        setup=Setup.of(config.target, devices, f"tensor={len(devices)}"),
        devices=len(devices),
        variants=_measure_here(mesh, config.shape, config.repeats),
        tpu=on_tpu,
        tpu_chip=tpu.chip.name if isinstance(tpu, kit.TpuChips) else "",
        tpu_chips=len(tpu) if isinstance(tpu, kit.TpuChips) else 0,
        tpu_unavailable=tpu if isinstance(tpu, kit.Unavailable) else None,
    )


def _shape_for(name: str, shape_MKF) -> tuple[int, int, int]:
    """The reduce-scatter variants get K and F swapped: the same arithmetic per byte moved as the all-gather ones."""
    m, k, f = shape_MKF
    return (m, f, k) if "reduce-scatter" in name else (m, k, f)


def _measure_here(mesh, shape, repeats: int) -> tuple[Variant, ...]:
    """Every variant compiled, run against its plain twin, read from the HLO, then timed round-robin."""
    calls, outputs, found = {}, {}, {}
    for name in track(collective_matmul.VARIANTS, "collective matmul variants"):
        program = collective_matmul.build_matmul(name, mesh, "tensor", _shape_for(name, shape))
        inputs = program.example_inputs()
        compiled, inspection = kit.compile_and_inspect(program.fn, *program.abstract_inputs(), mesh=mesh)
        outputs[name] = np.asarray(compiled(*inputs))
        calls[name] = (compiled, inputs)
        found[name] = (kit.seen(inspection.collectives), schedule.timeline(inspection.optimized_hlo))
    timings = time_interleaved(calls, repeats=repeats)
    variants = []
    for name, (collectives, timeline) in found.items():
        reference = outputs[collective_matmul.VARIANTS[name].plain]
        off = ~np.isclose(outputs[name], reference, **ROUNDOFF)
        diff = float(np.max(np.abs(outputs[name] - reference)))
        variants.append(Variant(name, collectives, timeline, int(off.sum()), diff, timings[name]))
    return tuple(variants)


def _measure_tpu(tpu: kit.TpuChips, shape) -> tuple[TpuVariant, ...]:
    mesh = tpu.mesh("tensor")
    return tuple(
        tpu_variant(name, mesh, _shape_for(name, shape), tpu.chip, tpu.dims)
        for name in track(collective_matmul.VARIANTS, f"{tpu.target} schedules")
    )


def tpu_variant(name: str, mesh, shape, chip, dims) -> TpuVariant:
    """One variant compiled for the TPU in bf16: what its schedule overlaps, read from the scheduled HLO."""
    program = collective_matmul.build_matmul(name, mesh, "tensor", shape, jnp.bfloat16)
    inspection = hlo.inspect(program.fn, *program.abstract_inputs(), mesh=mesh)
    text = inspection.optimized_hlo
    report = schedule.overlap_report(text, chip, dims, inspection.mesh_shape, inspection.axis_names)
    scheduled = schedule.parse_schedule(text)
    entry = scheduled.computations[scheduled.entry]
    windows = tuple(
        Window(w.collective.kind, w.is_async, int(schedule.window_flops(scheduled, w)), w.compute_s, w.comm_s)
        for w in report.windows
    )
    return TpuVariant(
        name=name,
        collectives=kit.seen(inspection.collectives),
        timeline=schedule.timeline(text),
        flops=int(sum(schedule.flops(scheduled, scheduled.entry, i) for i in entry)),
        flops_in_flight=int(schedule.flops_in_flight(scheduled, report.windows)),
        windows=windows,
        compute_s=report.compute_s,
        step_s=report.step_s,
        xla_optimal_s=inspection.cost.get("optimal_seconds"),
        temp_bytes=int(inspection.memory.get("temp_size", 0)),
    )


# --------------------------------------------------------------------------- judge


def judge(obs: Observations, config: Config) -> Result:
    examples = [
        theory.overlap_time(config.compute_ms / 1e3, config.comm_ms / 1e3),
        theory.overlap_time(config.comm_ms / 1e3, config.compute_ms / 1e3),
    ]
    checks = _checks_here(obs, config)
    if obs.tpu:
        checks += tpu_checks(obs.tpu, f"tpu:{config.tpu_topology}", config.tpu_shape, obs.tpu_chips)
    return Result(
        summary=_summary(obs, config),
        theory=THEORY,
        tables=[_example_table(examples), _here_table(obs), *_tpu_tables(obs, config)],
        checks=checks,
        claims=_claims(obs, config),
        plots={"overlap": partial(_plot, examples, obs, config)},
        notes=_notes(obs, config),
    )


THEORY = r"""
A step that computes for C and communicates for T costs **C + T** when one waits for the other and **max(C, T)** when
they run at once (Narayanan et al. 2019, PipeDream, Section 2; the scaling book, Part 3): overlap hides min(C, T), and
it hides everything only when C ≥ T. No byte is saved.

**Collective matmul** (Wang et al. 2023, "Overlap Communication with Dependent Computation via Decomposition in Large
Deep Learning Models", ASPLOS; the scaling book, Part 3). Y = all_gather(X) @ W has to wait for the whole gather.
Split it into the N block products X_i @ W: on a ring, step s multiplies the block a device holds while the next block
travels (one `ppermute`). The N-1 transfers move (N-1)/N of X, the all-gather's bytes, and N-1 of the N block products
(each 2·(M/N)·K·(F/N) FLOPs) can run while a transfer is in flight: only the last one has nothing left to hide. With
c = C/N per block and t per transfer

    T_ring = c + (N-1)·max(c, t)        against        T_plain = C + T_all-gather,

so the ring hides all but the first block's product once c ≥ t, i.e. once the local output width F/N gives each byte
moved more FLOPs than the chip can move bytes: F/N ≳ peak FLOP/s / link bandwidth (about 4,400 for a TPU v5e link).
Sending blocks both ways round the ring needs floor(N/2) steps of two blocks. Y = reduce_scatter(X @ W) runs the same
ring backwards: a partial sum travels and each device adds the product its next step needs; only the first product,
which the first transfer carries, cannot overlap.
"""


def _ring_bytes(name: str, shape_MKF, n: int, itemsize: int) -> float:
    """The textbook bytes per device of the collective a variant stands for: (N-1)/N of the gathered X (M·K) or of
    the partial product being reduce-scattered (M·F)."""
    m, k, f = shape_MKF
    if "reduce-scatter" in name:
        return theory.bus_bandwidth_factor("reduce-scatter", n) * m * f * itemsize
    return theory.bus_bandwidth_factor("all-gather", n) * m * k * itemsize


def sent(collectives) -> float:
    """Bytes each device sends, read from the compiled collectives: S times its bus factor, times its runs."""
    return sum(c.size_bytes * theory.bus_bandwidth_factor(c.kind, c.group_size) * (c.repeats or 1) for c in collectives)


def _plain_collective(name: str) -> str:
    return "reduce-scatter" if "reduce-scatter" in name else "all-gather"


def _checks_here(obs: Observations, config: Config) -> list[Check]:
    n, by = obs.devices, {v.name: v for v in obs.variants}
    checks = []
    for name in RING_VARIANTS:
        v, twin = by[name], collective_matmul.VARIANTS[name].plain
        shape = _shape_for(name, config.shape)
        checks += [
            check(f"{name}: elements off {twin}'s result (float32 round-off)", 0, v.wrong, kind="exact"),
            check(
                f"{name}: collective-permutes in HLO",
                n - 1,
                sum(c.kind == "collective-permute" for c in v.collectives),
                kind="exact",
            ),
            check(
                f"{name}: bytes sent per device = the {_plain_collective(name)}'s (N-1)/N·D",
                _ring_bytes(name, shape, n, 4),
                sent(v.collectives),
                kind="exact",
                rtol=1e-9,
            ),
        ]
    checks.append(
        check(
            "asynchronous collectives on this target (XLA:CPU)",
            0,
            sum(c.is_async for v in obs.variants for c in v.collectives),
            kind="exact",
        )
    )
    ratio = by[RING_GATHER].time.median / by[PLAIN_GATHER].time.median
    checks.append(
        check(
            "this target: ring / plain all-gather matmul time (synchronous collectives: nothing to gain)",
            1.0,
            ratio,
            kind="timing",
            relation=">=",
            rtol=NO_OVERLAP_MARGIN,
            basis="claim here: with every collective synchronous the ring's N-1 permutes and N block products cannot "
            "beat one all-gather and one matmul; medians of interleaved rounds, 20% margin for the clock's noise "
            "on a shared 2-core host",
        )
    )
    return checks


def tpu_checks(variants, where: str, shape_MKF, n: int) -> list[Check]:
    """What the TPU schedule overlaps, read from its HLO, against what the ring is built to overlap.

    `where` begins each quantity ("tpu:v5e:2x4"); `shape_MKF` is the all-gather variants' shape."""
    checks = []
    for v in variants:
        shape = _shape_for(v.name, shape_MKF)
        m, k, f = shape
        total = 2 * m * k * f // n  # 2MKF/N per chip, however it is cut into blocks
        ring = v.name in RING_VARIANTS
        label = f"{where} {v.name}"
        checks += [
            check(f"{label}: matmul FLOPs per chip = 2MKF/N", total, v.flops, kind="exact"),
            check(
                f"{label}: matmul FLOPs run while a transfer is in flight"
                + (" = (N-1) block products" if ring else " (the matmul waits for it)"),
                (n - 1) * total // n if ring else 0,
                v.flops_in_flight,
                kind="exact",
            ),
        ]
        if ring:
            checks += [
                check(
                    f"{label}: transfers with a block product in their window",
                    n - 1,
                    sum(w.is_async and w.flops > 0 for w in v.windows),
                    kind="exact",
                ),
                check(
                    f"{label}: bytes sent per chip = the {_plain_collective(v.name)}'s (N-1)/N·D",
                    _ring_bytes(v.name, shape, n, 2),
                    sent(v.collectives),
                    kind="exact",
                    rtol=1e-9,
                ),
            ]
    return checks


def _hidden(v: TpuVariant) -> float:
    comm = sum(w.comm_s for w in v.windows)
    return sum(min(w.compute_s, w.comm_s) for w in v.windows if w.is_async) / comm if comm else 1.0


def closed_form_s(v: TpuVariant, shape_MKF, n: int, chip) -> float:
    """T_ring = c + (N-1)·max(c, t) (lab.theory), or C + T for a plain variant, from c = block FLOPs / peak and the
    transfer times lab.theory gave the schedule's collectives."""
    m, k, f = _shape_for(v.name, shape_MKF)
    compute_s = 2 * m * k * f / n / chip.peak_bf16_flops
    if v.name in RING_VARIANTS:
        step = max(w.comm_s for w in v.windows if w.kind == "collective-permute")
        return theory.collective_matmul_time(compute_s, step, n, bidirectional=v.name.startswith("bidirectional"))
    return compute_s + sum(w.comm_s for w in v.windows)


def _claims(obs: Observations, config: Config) -> list[Claim]:
    by = {v.name: v for v in obs.variants}
    here = {name: sent(by[name].collectives) for name in GATHER_VARIANTS}
    on_tpu = {v.name: sent(v.collectives) for v in obs.tpu if v.name in GATHER_VARIANTS}
    same = len(set(here.values())) == 1 and len(set(on_tpu.values())) <= 1
    numbers = "this target: " + ", ".join(f"{name} {format_bytes(b)}" for name, b in here.items()) + " per device"
    if on_tpu:
        numbers += "; TPU compiler: " + ", ".join(f"{name} {format_bytes(b)}" for name, b in on_tpu.items())
    claims = [Claim("Overlap does not reduce the bytes communicated", "confirmed" if same else "refuted", numbers)]
    ratio = by[RING_GATHER].time.median / by[PLAIN_GATHER].time.median
    if obs.tpu:
        tpu = {v.name: v for v in obs.tpu}
        ring, plain = tpu[RING_GATHER], tpu[PLAIN_GATHER]
        shorter = ring.step_s < plain.step_s and ring.flops_in_flight > 0
        claims.append(
            Claim(
                "Overlap shortens the step (wall-clock) by running communication under compute",
                "confirmed" if shorter else "refuted",
                f"tpu:{config.tpu_topology} schedule: {ring.flops_in_flight / ring.flops:.0%} of the ring's FLOPs run "
                f"under a transfer, priced step {ring.step_s * 1e3:.2f} ms against {plain.step_s * 1e3:.2f} ms for "
                f"the plain program; on this target, where no collective is asynchronous, the ring took "
                f"{ratio:.2f}x the plain time",
            )
        )
    return claims


def _example_table(examples) -> Table:
    rows = [
        [
            f"{e.compute_s * 1e3:.0f} ms",
            f"{e.comm_s * 1e3:.0f} ms",
            f"{e.serial_s * 1e3:.0f} ms",
            f"{e.overlapped_s * 1e3:.0f} ms",
            f"{e.hidden_s * 1e3:.0f} ms",
            f"{e.exposed_s * 1e3:.0f} ms",
            f"{e.speedup:.2f}x",
        ]
        for e in examples
    ]
    return Table(
        "C + T against max(C, T): the arithmetic",
        ["compute C", "communication T", "serial C + T", "overlapped max(C, T)", "hidden", "still exposed", "speed-up"],
        rows,
        note="The first row is the quick-reference's example; the second swaps the two: communication-bound, overlap "
        "cannot hide 60 ms. Arithmetic, not a measurement (unit-tested in tests/theory/test_overlap.py).",
    )


def _here_table(obs: Observations) -> Table:
    by = {v.name: v for v in obs.variants}
    rows = []
    for v in obs.variants:
        plain = by[collective_matmul.VARIANTS[v.name].plain].time.median
        kinds = sorted({c.kind for c in v.collectives})
        rows.append(
            [
                v.name,
                ", ".join(kinds) + f" x{len(v.collectives)}",
                f"`{v.timeline}`",
                format_bytes(sent(v.collectives)),
                f"{v.max_abs_diff:.2g}",
                str(v.time),
                f"{v.time.median / plain:.2f}x",
            ]
        )
    return Table(
        f"On this target (tensor={obs.devices}), float32",
        [
            "variant",
            "collectives in HLO",
            "schedule (C collective, M matmul)",
            "bytes sent per device",
            "max |Y - Y_plain|",
            "time (median [min, max])",
            "vs plain",
        ],
        rows,
        note="Schedule letters: C a synchronous collective, M an instruction with a matmul, [ and ] the start and done "
        "of an asynchronous one.",
    )


def _tpu_tables(obs: Observations, config: Config) -> list[Table]:
    if obs.tpu_unavailable:
        return [obs.tpu_unavailable.table()]
    if not obs.tpu:
        return []
    chip, n = profile(obs.tpu_chip), obs.tpu_chips
    rows = []
    for v in obs.tpu:
        comm = sum(w.comm_s for w in v.windows)
        exposed = v.step_s - v.compute_s
        rows.append(
            [
                v.name,
                f"`{v.timeline}`",
                f"{v.flops_in_flight / v.flops:.0%}",
                f"{v.compute_s * 1e3:.2f}",
                f"{comm * 1e3:.2f}",
                f"{_hidden(v):.0%}",
                f"{exposed * 1e3:.2f}",
                f"{v.step_s * 1e3:.2f}",
                f"{closed_form_s(v, config.tpu_shape, n, chip) * 1e3:.2f}",
                f"{v.xla_optimal_s * 1e3:.2f}" if v.xla_optimal_s else "-",
                format_bytes(v.temp_bytes),
            ]
        )
    return [
        Table(
            f"Scheduled by the TPU compiler for tpu:{config.tpu_topology} ({n} x {obs.tpu_chip}), bf16, compile-only",
            [
                "variant",
                "schedule",
                "FLOPs under a transfer",
                "compute (ms)",
                "communication (ms)",
                "hidden",
                "exposed (ms)",
                "priced step (ms)",
                "closed form (ms)",
                "XLA optimal_seconds (ms)",
                "temp memory",
            ],
            rows,
            note="FLOPs under a transfer: read from the scheduled HLO. Compute: roofline of each scheduled instruction "
            "on the chip profile; communication: lab.theory on the torus; hidden: compute inside each collective's "
            "start..done window, at most its transfer. The priced step and the closed form share that pricing: "
            "they are a model of the schedule, not a measurement, and are not judged against each other.",
        )
    ]


def _summary(obs: Observations, config: Config) -> str:
    by = {v.name: v for v in obs.variants}
    plain, ring = by[PLAIN_GATHER].time.median, by[RING_GATHER].time.median
    bidi = by["bidirectional all-gather matmul"].time.median
    text = (
        "Overlap turns C + T into max(C, T) and sends the same bytes: the hand-written ring all-gather matmul sends "
        f"{format_bytes(sent(by[RING_GATHER].collectives))} per device in {obs.devices - 1} permutes, exactly the "
        f"all-gather's (N-1)/N of X, and gives the plain program's numbers. On this target, whose collectives are "
        f"synchronous, it took {ring / plain:.2f}x (ring) and {bidi / plain:.2f}x (bidirectional) the plain "
        "all-gather-then-matmul's time: nothing overlaps, so decomposing only costs."
    )
    if obs.tpu:
        tpu = {v.name: v for v in obs.tpu}
        r, p = tpu[RING_GATHER], tpu[PLAIN_GATHER]
        text += (
            f" Compiled for tpu:{config.tpu_topology}, the scheduler runs {r.flops_in_flight / r.flops:.0%} of the "
            f"ring's matmul FLOPs while a transfer is in flight (theory: (N-1)/N), which prices its step at "
            f"{r.step_s * 1e3:.2f} ms against {p.step_s * 1e3:.2f} ms for the plain program, whose all-gather runs "
            "alone."
        )
    return text


def _notes(obs: Observations, config: Config) -> list[str]:
    notes = [
        "On XLA:CPU every collective is synchronous: the ring's permutes alternate with the block products (`CM` in "
        "the schedule) but never run alongside them, so this target can show the decomposition's cost (more, "
        "smaller collectives and matmuls) but not its benefit. That is why the claims about wall-clock time are "
        "judged on the TPU compiler's schedule, and the clock here only bounds the ring from below.",
        "That communication is hidden completely only when the compute is at least as long (the quick-reference's "
        "key condition) is the pricing rule of the schedule model itself (hidden = min(C, T) per window), so it is "
        "not listed as a claim this page tests: emulated devices cannot time it, and a priced schedule assumes it. "
        "The #46 page shows what a schedule whose block products are shorter than their transfers is priced at.",
    ]
    if not obs.tpu:
        return notes
    tpu = {v.name: v for v in obs.tpu}
    ring, plain = tpu[RING_GATHER], tpu[PLAIN_GATHER]
    scatter = tpu["ring matmul reduce-scatter"]
    empty = sum(w.is_async and not w.flops for w in scatter.windows)
    notes.append(
        "The TPU compiler made every hand-written permute asynchronous and scheduled a block product inside each "
        f"window of the all-gather rings (`{ring.timeline}`); the plain program's all-gather stays synchronous "
        f"(`{plain.timeline}`)."
    )
    if empty:
        notes.append(
            f"In the ring reduce-scatter (`{scatter.timeline}`) the scheduler left {empty} transfer(s) with no product "
            "in the window: the product the first step could hide (the block the next partial sum needs) was "
            "scheduled after the transfer finished. The ring is built so that N-1 of its N block products can "
            f"overlap; the compiled schedule overlaps {scatter.flops_in_flight * obs.tpu_chips // scatter.flops} of "
            f"{obs.tpu_chips} (theory: {obs.tpu_chips - 1}). A finding about the scheduler, shown as 'differs'."
        )
    notes.append(
        f"The ring never holds the gathered X: its temp memory is {format_bytes(ring.temp_bytes)} against "
        f"{format_bytes(plain.temp_bytes)} for the plain program. What it adds is a zero-filled output buffer "
        "written block by block, whose broadcast the roofline prices: the reason the priced step exceeds the "
        "closed form."
    )
    if ring.xla_optimal_s and plain.xla_optimal_s:
        notes.append(
            f"XLA's own cost analysis (`optimal_seconds`) rates the ring slower than the plain program "
            f"({ring.xla_optimal_s * 1e3:.2f} against {plain.xla_optimal_s * 1e3:.2f} ms): it does not credit overlap."
        )
    return notes


def _plot(examples, obs: Observations, config: Config) -> Figure:
    panels = 3 if obs.tpu else 2
    figure = Figure(figsize=(5.2 * panels, 4.2))
    axes = figure.subplots(1, panels)
    labels = [f"C={e.compute_s * 1e3:.0f}, T={e.comm_s * 1e3:.0f}" for e in examples]
    x = np.arange(len(examples))
    axes[0].bar(x - 0.2, [e.serial_s * 1e3 for e in examples], 0.4, label="C + T")
    axes[0].bar(x + 0.2, [e.overlapped_s * 1e3 for e in examples], 0.4, label="max(C, T)")
    axes[0].set(xticks=x, xticklabels=labels, ylabel="ms", title="serial against overlapped")
    axes[0].legend()
    names = [v.name for v in obs.variants]
    times = [v.time for v in obs.variants]
    axes[1].barh(
        names,
        [t.median * 1e3 for t in times],
        xerr=[[(t.median - t.min) * 1e3 for t in times], [(t.max - t.median) * 1e3 for t in times]],
    )
    axes[1].set(xlabel="ms (median, min-max)", title="this target, measured")
    if obs.tpu:
        tpu = {v.name: v for v in obs.tpu}
        axes[2].barh(names, [tpu[n].compute_s * 1e3 for n in names], label="compute")
        axes[2].barh(
            names,
            [(tpu[n].step_s - tpu[n].compute_s) * 1e3 for n in names],
            left=[tpu[n].compute_s * 1e3 for n in names],
            label="exposed communication",
        )
        axes[2].set(xlabel="ms (priced schedule)", title=f"tpu:{config.tpu_topology} schedule")
        axes[2].set_yticklabels([])
        axes[2].legend(fontsize=8)
    figure.tight_layout()
    return figure
