"""Why overlap matters: max(compute, communication) instead of their sum, and collective matmul.

Question #45 says overlapping communication with compute does not send fewer
bytes but shortens the step: C + T becomes max(C, T), and communication is
hidden only when the compute is at least as long. This page checks that claim
where it can be checked:

1. the arithmetic, on the quick-reference's own example (100 ms of compute,
   40 ms of communication) and on the reverse case;
2. a collective matmul written by hand (lab.parallel.collective_matmul): ``all_gather(X) @ W`` as
   a ring of N-1 ``ppermute`` s, each block's product computed while the next
   block travels; the bidirectional ring; and ``reduce_scatter(X @ W)`` the
   same way. Same numbers as the plain program, and on this target, timed
   against it;
3. the TPU compiler's schedule of the same programs (compile-only): which
   instructions sit between each permute's start and done, how much of each
   transfer they hide, and the step that leaves, against the theory.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np
from matplotlib.figure import Figure

from experiments import kit
from lab import hlo, theory
from lab.bench import time_interleaved
from lab.devices import DEFAULT_TARGET, devices_for
from lab.hlo import schedule
from lab.mesh import MeshSpec
from lab.parallel import collective_matmul
from lab.progress import track
from lab.report import Result, Table, provenance
from lab.units import format_bytes
from lab.verdict import check

QUESTION = "#45"
RING_VARIANTS = ("ring all-gather matmul", "bidirectional all-gather matmul", "ring matmul reduce-scatter")


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


def run(config: Config) -> Result:
    devices = devices_for(config.target)
    mesh = MeshSpec(tensor=len(devices)).build(devices)
    measured = _measure(mesh, config.shape, config.repeats)
    tpu = _tpu(config.tpu_topology, config.tpu_shape)
    examples = [
        theory.overlap_time(config.compute_ms / 1e3, config.comm_ms / 1e3),
        theory.overlap_time(config.comm_ms / 1e3, config.compute_ms / 1e3),
    ]
    return Result(
        summary=_summary(examples[0], measured, tpu, len(devices)),
        theory=THEORY,
        tables=[_example_table(examples), _measured_table(measured, len(devices)), *_tpu_tables(tpu)],
        checks=_checks(examples[0], measured, tpu, len(devices)),
        plots={"overlap": _plot(examples, measured, tpu)},
        notes=_notes(measured, tpu),
        provenance=provenance(target=config.target, devices=devices, mesh=f"tensor={len(devices)}"),
        data={
            "examples": [vars(e) for e in examples],
            "measured": {k: {n: str(v) for n, v in r.items()} for k, r in measured.items()},
            "tpu": {
                k: {n: v for n, v in r.items() if n != "report"}
                for k, r in (tpu["variants"] if isinstance(tpu, dict) else {}).items()
            },
        },
    )


THEORY = r"""
A step that computes for C and communicates for T costs **C + T** when one waits for the other and **max(C, T)** when
they run at once (Narayanan et al. 2019, PipeDream, Section 2; the scaling book, Part 3): overlap hides min(C, T), and
it hides everything only when C ≥ T. No byte is saved.

**Collective matmul** (Wang et al. 2023, "Overlap Communication with Dependent Computation via Decomposition in Large
Deep Learning Models", ASPLOS; the scaling book, Part 3). Y = all_gather(X) @ W has to wait for the whole gather.
Split it into the N block products X_i @ W: on a ring, step s multiplies the block a device holds while the next block
travels (one `ppermute`). With c = C/N per block and t per transfer

    T_ring = c + (N-1)·max(c, t)        against        T_plain = C + T_all-gather,

so the ring hides all but the first block's product once c ≥ t, i.e. once the local output width F/N gives each byte
moved more FLOPs than the chip can move bytes: F/N ≳ peak FLOP/s / link bandwidth (about 4,400 for a TPU v5e link).
Sending blocks both ways round the ring needs floor(N/2) steps of two blocks. Y = reduce_scatter(X @ W) runs the same
ring backwards: a partial sum travels and each device adds the product its next step needs.
"""


# ------------------------------------------------------------------ this target


def _measure(mesh, shape, repeats: int) -> dict:
    """Every variant compiled, checked against its plain twin, read from the HLO, then timed round-robin."""
    rows, calls, outputs = {}, {}, {}
    for name in track(collective_matmul.VARIANTS, "collective matmul variants"):
        program = collective_matmul.build_matmul(name, mesh, "tensor", _shape_for(name, shape))
        inputs = program.example_inputs()
        compiled, inspection = kit.compile_and_inspect(program.fn, *program.abstract_inputs(), mesh=mesh)
        outputs[name] = np.asarray(compiled(*inputs))
        calls[name] = (compiled, inputs)
        rows[name] = {
            "collectives": [c.kind for c in inspection.collectives],
            "async": sum(c.is_async for c in inspection.collectives),
            "timeline": schedule.timeline(inspection.optimized_hlo),
        }
    for name, row in rows.items():
        reference = outputs[collective_matmul.VARIANTS[name].plain]
        row["max_abs_diff"] = float(np.max(np.abs(outputs[name] - reference)))
        row["close"] = bool(np.allclose(outputs[name], reference, rtol=1e-5, atol=1e-4))
    for name, timing in time_interleaved(calls, repeats=repeats).items():
        rows[name]["time"] = timing
    return rows


def _shape_for(name: str, shape_MKF) -> tuple[int, int, int]:
    """The reduce-scatter variants get K and F swapped: the same arithmetic per byte moved as the all-gather ones."""
    m, k, f = shape_MKF
    return (m, f, k) if "reduce-scatter" in name else (m, k, f)


# ------------------------------------------------------------------ the TPU compiler's schedule


def _tpu(topology: str, shape) -> dict | kit.Unavailable | None:
    tpu = kit.tpu_chips(topology)
    if not isinstance(tpu, kit.TpuChips):
        return tpu  # not asked for, or libtpu cannot build it here
    mesh = tpu.mesh("tensor")
    variants = {
        name: _tpu_variant(name, mesh, _shape_for(name, shape), tpu.chip, tpu.dims)
        for name in track(collective_matmul.VARIANTS, f"{tpu.target} schedules")
    }
    return {"topology": topology, "chip": tpu.chip, "chips": len(tpu), "variants": variants}


def _tpu_variant(name: str, mesh, shape, chip, dims) -> dict:
    program = collective_matmul.build_matmul(name, mesh, "tensor", shape, jnp.bfloat16)
    inspection = hlo.inspect(program.fn, *program.abstract_inputs(), mesh=mesh)
    report = schedule.overlap_report(inspection.optimized_hlo, chip, dims, inspection.mesh_shape, inspection.axis_names)
    n = mesh.shape["tensor"]
    matmul_s = program.flops / n / chip.peak_bf16_flops
    permutes = [w for w in report.windows if w.collective.kind == "collective-permute"]
    if name in RING_VARIANTS:
        modelled = theory.collective_matmul_time(
            matmul_s, permutes[0].comm_s, n, bidirectional=name.startswith("bidirectional")
        )
    else:  # gather (or reduce) first, multiply after: nothing to overlap
        modelled = matmul_s + report.communication_s
    return {
        "report": report,
        "timeline": schedule.timeline(inspection.optimized_hlo),
        "matmul_s": matmul_s,
        "modelled_s": modelled,
        "compute_s": report.compute_s,
        "comm_s": report.communication_s,
        "hidden_s": report.hidden_s,
        "exposed_s": report.exposed_s,
        "step_s": report.step_s,
        "xla_optimal_s": inspection.cost.get("optimal_seconds"),
        "temp_bytes": inspection.memory.get("temp_size", 0),
        "hidden_fractions": [w.hidden_fraction for w in permutes],
    }


# ------------------------------------------------------------------ the page


def _checks(example, measured, tpu, n: int) -> list:
    checks = [
        check("quick-reference example: step without overlap (ms)", 140.0, example.serial_s * 1e3, rtol=1e-9),
        check(
            "quick-reference example: step with overlap = max(C, T) (ms)", 100.0, example.overlapped_s * 1e3, rtol=1e-9
        ),
    ]
    for name, row in measured.items():
        twin = collective_matmul.VARIANTS[name].plain
        checks.append(check(f"{name}: same result as {twin} (rtol 1e-5)", True, row["close"]))
    for name in RING_VARIANTS:
        checks.append(
            check(
                f"{name}: collective-permutes in HLO", n - 1, measured[name]["collectives"].count("collective-permute")
            )
        )
    checks.append(
        check("asynchronous collectives on this target (XLA:CPU)", 0, sum(r["async"] for r in measured.values()))
    )
    plain, ring = measured["all-gather then matmul"]["time"], measured["ring all-gather matmul"]["time"]
    checks.append(
        check(
            "this target: ring / plain time, no overlap possible (same bytes, same FLOPs)",
            1.0,
            ring.median / plain.median,
            rtol=0.5,
        )
    )
    if isinstance(tpu, dict):
        for name, row in tpu["variants"].items():
            checks.append(
                check(
                    f"tpu:{tpu['topology']} {name}: step from the schedule vs theory (ms)",
                    row["modelled_s"] * 1e3,
                    row["step_s"] * 1e3,
                    rtol=0.25,
                    explained="the schedule also prices the ring's zero-filled output "
                    "buffer and index arithmetic, which theory leaves out"
                    if name in RING_VARIANTS
                    else None,
                )
            )
        ring_timeline = tpu["variants"]["ring all-gather matmul"]["timeline"]
        checks.append(
            check(
                f"tpu:{tpu['topology']} ring all-gather matmul: permutes with a matmul between start and done",
                n - 1,
                ring_timeline.count("[M]"),
            )
        )
    return checks


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
        "C + T against max(C, T)",
        ["compute C", "communication T", "serial C + T", "overlapped max(C, T)", "hidden", "still exposed", "speed-up"],
        rows,
        note="The first row is the quick-reference's example; the second swaps "
        "the two: communication-bound, overlap cannot hide 60 ms.",
    )


def _measured_table(measured, n: int) -> Table:
    rows = []
    for name, row in measured.items():
        plain = measured[collective_matmul.VARIANTS[name].plain]["time"].median
        rows.append(
            [
                name,
                ", ".join(sorted(set(row["collectives"]))) + f" x{len(row['collectives'])}",
                f"`{row['timeline']}`",
                f"{row['max_abs_diff']:.2g}",
                str(row["time"]),
                f"{row['time'].median / plain:.2f}x",
            ]
        )
    return Table(
        f"On this target (tensor={n}), float32",
        [
            "variant",
            "collectives in HLO",
            "schedule (C collective, M matmul)",
            "max |Y - Y_plain|",
            "time (median [min, max])",
            "vs plain",
        ],
        rows,
        note="Schedule letters: C a synchronous collective, M an instruction "
        "with a matmul, [ and ] the start and done of an asynchronous "
        "one.",
    )


def _tpu_tables(tpu) -> list[Table]:
    if not isinstance(tpu, dict):
        return [tpu.table()] if tpu else []
    rows = []
    for name, row in tpu["variants"].items():
        hidden = row["hidden_s"] / row["comm_s"] if row["comm_s"] else 1.0
        rows.append(
            [
                name,
                f"`{row['timeline']}`",
                f"{row['compute_s'] * 1e3:.2f}",
                f"{row['comm_s'] * 1e3:.2f}",
                f"{hidden:.0%}",
                f"{row['exposed_s'] * 1e3:.2f}",
                f"{row['step_s'] * 1e3:.2f}",
                f"{row['modelled_s'] * 1e3:.2f}",
                f"{row['xla_optimal_s'] * 1e3:.2f}" if row["xla_optimal_s"] else "-",
                format_bytes(row["temp_bytes"]),
            ]
        )
    return [
        Table(
            f"Scheduled by the TPU compiler for tpu:{tpu['topology']} ({tpu['chips']} "
            f"x {tpu['chip'].name}), bf16, compile-only",
            [
                "variant",
                "schedule",
                "compute (ms)",
                "communication (ms)",
                "hidden",
                "exposed (ms)",
                "step = compute + exposed (ms)",
                "theory (ms)",
                "XLA optimal_seconds (ms)",
                "temp memory",
            ],
            rows,
            note="Compute: roofline of each scheduled instruction on the chip "
            "profile; communication: lab.theory on the torus; hidden: "
            "compute inside each collective's start..done window, at most "
            "its transfer.",
        )
    ]


def _summary(example, measured, tpu, n: int) -> str:
    plain, ring = measured["all-gather then matmul"]["time"].median, measured["ring all-gather matmul"]["time"].median
    bidi = measured["bidirectional all-gather matmul"]["time"].median
    text = (
        "Overlap turns C + T into max(C, T): the quick-reference's 100 ms "
        f"of compute and 40 ms of communication take {example.serial_s * 1e3:.0f} "
        "ms "
        f"one after the other and {example.overlapped_s * 1e3:.0f} ms overlapped, "
        f"{example.speedup:.2f}x faster with the same bytes. "
        "The hand-written collective matmul gives the plain program's numbers "
        f"with {n - 1} permutes interleaved with its block products; "
        f"on this target, whose collectives are synchronous, it took {ring / plain:.2f}x "
        f"(ring) and {bidi / plain:.2f}x (bidirectional) the plain all-gather-then-matmul's "
        "time."
    )
    if isinstance(tpu, dict):
        v = tpu["variants"]
        text += (
            f" Compiled for tpu:{tpu['topology']}, the TPU scheduler puts "
            "each block product inside a permute's window: the ring hides "
            f"{v['ring all-gather matmul']['hidden_s'] / v['ring all-gather matmul']['comm_s']:.0%} "
            "of its transfers and the predicted step is "
            f"{v['ring all-gather matmul']['step_s'] * 1e3:.2f} ms against "
            f"{v['all-gather then matmul']['step_s'] * 1e3:.2f} ms for the "
            "plain program, whose all-gather is synchronous."
        )
    return text


def _notes(measured, tpu) -> list[str]:
    notes = [
        (
            "On XLA:CPU every collective is synchronous: the ring's permutes "
            "alternate with the block products (`CM` in the schedule) but "
            "never run alongside them, "
            "so this target can show the decomposition's cost (more, smaller "
            "collectives and matmuls) but not its benefit."
        )
    ]
    if isinstance(tpu, dict):
        v = tpu["variants"]
        ring = v["ring all-gather matmul"]
        notes.append(
            "The TPU compiler made every hand-written permute asynchronous "
            "and scheduled a block product inside each window (`[M]`); the "
            "plain program's all-gather "
            f"stays synchronous (`CM`): {v['all-gather then matmul']['comm_s'] * 1e3:.2f} ms exposed."
        )
        notes.append(
            f"The plain reduce-scatter compiled to `{v['matmul then reduce-scatter']['timeline']}`: "
            "the TPU writes it as an all-reduce-scatter fusion (all-reduce "
            "+ dynamic-slice) "
            "plus a small permute, both with nothing to hide behind. In the "
            "hand-written ring the scheduler left the first transfer empty "
            "too (`[]`)."
        )
        notes.append(
            f"The ring never holds the gathered X: its temp memory is {format_bytes(ring['temp_bytes'])} "
            f"against {format_bytes(v['all-gather then matmul']['temp_bytes'])} "
            "for the plain program. What it adds is a zero-filled output "
            "buffer written block by block, whose broadcast the roofline "
            "prices."
        )
        if ring["xla_optimal_s"] and v["all-gather then matmul"]["xla_optimal_s"]:
            notes.append(
                "XLA's own cost analysis (`optimal_seconds`) rates the ring "
                f"slower than the plain program ({ring['xla_optimal_s'] * 1e3:.2f} "
                "against "
                f"{v['all-gather then matmul']['xla_optimal_s'] * 1e3:.2f} ms): it does not credit overlap."
            )
    return notes


def _plot(examples, measured, tpu):
    panels = 3 if isinstance(tpu, dict) else 2
    figure = Figure(figsize=(5.2 * panels, 4.2))
    axes = figure.subplots(1, panels)
    labels = [f"C={e.compute_s * 1e3:.0f}, T={e.comm_s * 1e3:.0f}" for e in examples]
    x = np.arange(len(examples))
    axes[0].bar(x - 0.2, [e.serial_s * 1e3 for e in examples], 0.4, label="C + T")
    axes[0].bar(x + 0.2, [e.overlapped_s * 1e3 for e in examples], 0.4, label="max(C, T)")
    axes[0].set(xticks=x, xticklabels=labels, ylabel="ms", title="serial against overlapped")
    axes[0].legend()
    names = list(measured)
    axes[1].barh(
        names,
        [measured[n]["time"].median * 1e3 for n in names],
        xerr=[
            [(measured[n]["time"].median - measured[n]["time"].min) * 1e3 for n in names],
            [(measured[n]["time"].max - measured[n]["time"].median) * 1e3 for n in names],
        ],
    )
    axes[1].set(xlabel="ms (median, min-max)", title="this target, measured")
    if panels == 3:
        v = tpu["variants"]
        axes[2].barh(names, [v[n]["compute_s"] * 1e3 for n in names], label="compute")
        axes[2].barh(
            names,
            [v[n]["exposed_s"] * 1e3 for n in names],
            left=[v[n]["compute_s"] * 1e3 for n in names],
            label="exposed communication",
        )
        axes[2].set(xlabel="ms (predicted)", title=f"tpu:{tpu['topology']} schedule")
        axes[2].set_yticklabels([])
        axes[2].legend(fontsize=8)
    figure.tight_layout()
    return figure
