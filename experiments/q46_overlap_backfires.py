"""When overlap backfires: tiny buckets, extra buffers, and compute too short to hide anything.

Question #46 lists why overlapping communication can make training slower:
finer buckets and more launches, extra buffer memory, contention, and compute
too short for there to be anything to hide behind. Each is measured on this
target and predicted for a TPU slice next to its model:

1. **Tiny buckets.** Every all-reduce pays a fixed cost alpha_AR however small
   it is; the lab transformer's gradients in 64 KiB buckets pay it hundreds of
   times. alpha_AR is measured on its own (a chain of one-element all-reduces)
   and predicts the penalty; the TPU model shows the same for a 125M model.
2. **Extra buffers.** A bucket is a packed copy of the gradients it holds:
   XLA's memory analysis shows the temporary memory per bucket size, against
   DDP's own accounting (a second copy of the gradients unless
   ``gradient_as_bucket_view=True``).
3. **Compute too short.** A collective matmul hides a block's transfer behind
   the block's product only when the product takes longer; narrow matrices are
   communication-bound, and the ring's N-1 one-way transfers then cost more
   than the plain all-gather. Shown on the TPU compiler's schedule across
   widths and measured on this target.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import jax.numpy as jnp
from matplotlib.figure import Figure

from experiments import kit
from lab import hlo, theory
from lab.bench import time_interleaved
from lab.devices import DEFAULT_TARGET, devices_for
from lab.hlo import schedule
from lab.mesh import MeshSpec
from lab.model import preset
from lab.parallel import bucketing, collective_matmul
from lab.progress import track
from lab.report import Result, Table, provenance
from lab.units import format_bytes, parse_size
from lab.verdict import check

QUESTION = "#46"
CHAIN = 64  # one-element all-reduces in the chain that measures alpha_AR


@dataclass(frozen=True)
class Config:
    target: str = DEFAULT_TARGET
    """where to run (cpu:N, gpu, tpu)"""
    model: str = "small"
    """lab.model preset whose gradients are bucketed"""
    seq: int = 16
    """sequence length of the gradient step"""
    tiny_bucket: str = "128K"
    """the too-small bucket"""
    baseline_bucket: str = "4M"
    """the bucket the tiny one is compared with (a few all-reduces, each packing a cache-sized piece)"""
    repeats: int = 7
    """timed rounds, after warm-up (the median is reported)"""
    narrow_shape: tuple[int, int, int] = (512, 512, 512)
    """M, K, F of a collective matmul too small to hide its transfers, on this target"""
    tpu_topology: str = "v5e:2x4"
    """TPU slice for the schedules and the predictions (compile-only); empty to skip"""
    tpu_widths: tuple[int, ...] = (4096, 65536)
    """F of the TPU collective matmul (M=8192, K=4096, bf16): narrow to wide"""
    tpu_model: str = "125m"
    """lab.model preset whose gradients the TPU bucket prediction uses"""
    tpu_tokens_per_chip: int = 8192
    """tokens per chip in the TPU bucket prediction's backward pass"""


def run(config: Config) -> Result:
    devices = devices_for(config.target)
    mesh = MeshSpec(data=len(devices)).build(devices)
    buckets = _buckets(config, mesh)
    narrow = _narrow_matmul(devices, config.narrow_shape, config.repeats)
    tpu = _tpu(config)
    checks = _checks(buckets, narrow, tpu)
    return Result(
        summary=_summary(buckets, narrow, tpu),
        theory=THEORY,
        tables=[_bucket_table(buckets), _narrow_table(narrow), *_tpu_tables(tpu)],
        checks=checks,
        plots={"backfires": _plot(buckets, tpu)},
        notes=_notes(buckets, narrow, tpu),
        provenance=provenance(
            target=config.target, devices=devices, mesh=f"data={len(devices)} (buckets), tensor={len(devices)} (matmul)"
        ),
        data={
            "buckets": {
                k: (str(v) if hasattr(v, "median") else v) for k, v in buckets.items() if k not in ("programs", "plans")
            },
            "narrow": {k: str(v) for k, v in narrow.items()},
            "tpu": tpu,
        },
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


# ------------------------------------------------------------------ 1 and 2: buckets on this target


def _buckets(config: Config, mesh) -> dict:
    problem = bucketing.gradient_problem(replace(preset(config.model), seq=config.seq), mesh)
    stacked = bucketing.local_gradient_program(problem)(problem.params, problem.tokens)
    total = sum(leaf.size * leaf.dtype.itemsize for leaf in problem.leaves)
    plans = {
        "per-tensor psums": None,
        "tiny buckets": bucketing.plan_buckets(problem.leaves, parse_size(config.tiny_bucket)),
        "baseline buckets": bucketing.plan_buckets(problem.leaves, parse_size(config.baseline_bucket)),
        "one bucket": bucketing.plan_buckets(problem.leaves, total),
    }
    programs, rows = {}, {}
    for name, plan in track(plans.items(), "bucketings"):
        compiled, inspection = kit.compile_and_inspect(bucketing.reduce_program(plan, mesh, "data"), stacked, mesh=mesh)
        programs[name] = (compiled, (stacked,))
        rows[name] = {
            "buckets": plan.count if plan else len(problem.leaves),
            "all_reduces": len(inspection.collectives),
            "temp_bytes": inspection.memory["temp_size"],
        }
    programs.update(bucketing.launch_cost_programs(mesh, "data", CHAIN))
    timings = time_interleaved(programs, repeats=config.repeats)
    alpha = (timings["chain"].median - timings["single"].median) / (CHAIN - 1)
    for name, row in rows.items():
        row["time"] = timings[name]
    return {
        "rows": rows,
        "gradient_bytes": total,
        "tensors": len(problem.leaves),
        "alpha_AR_s": alpha,
        "tiny_bytes": parse_size(config.tiny_bucket),
        "baseline_bytes": parse_size(config.baseline_bucket),
        "devices": mesh.shape["data"],
    }


# ------------------------------------------------------------------ 3: compute too short, on this target


def _narrow_matmul(devices, shape, repeats: int) -> dict:
    mesh = MeshSpec(tensor=len(devices)).build(devices)
    calls = {}
    for name in ("all-gather then matmul", "ring all-gather matmul"):
        program = collective_matmul.build_matmul(name, mesh, "tensor", shape)
        calls[name] = (program.fn.lower(*program.abstract_inputs()).compile(), program.example_inputs())
    return time_interleaved(calls, repeats=repeats)


# ------------------------------------------------------------------ TPU (compile-only) and its model


def _tpu(config: Config) -> dict | kit.Unavailable | None:
    tpu = kit.tpu_chips(config.tpu_topology)
    if not isinstance(tpu, kit.TpuChips):
        return tpu  # not asked for, or libtpu cannot build it here
    mesh, chip = tpu.mesh("tensor"), tpu.chip
    widths = [_tpu_width(mesh, f, chip, tpu.dims) for f in track(config.tpu_widths, "TPU collective matmul widths")]
    return {
        "topology": config.tpu_topology,
        "chip": chip.name,
        "chips": len(tpu),
        "widths": widths,
        "theory_curve": _theory_curve(widths[0], len(tpu)),
        **_tpu_buckets(config, chip, len(tpu)),
    }


def _theory_curve(measured_width: dict, n: int) -> dict:
    """Ring / plain step in theory across F/N.

    From one width's per-block transfer and the plain all-gather's time, both independent of F.
    """
    per_device = [2.0**k for k in range(7, 15)]
    block_s_per_column = measured_width["block_compute_s"] / (measured_width["F"] // n)
    gather_s = measured_width["all-gather then matmul"]["comm_s"]
    ratios = [
        theory.collective_matmul_time(block_s_per_column * f * n, measured_width["block_comm_s"], n)
        / (block_s_per_column * f * n + gather_s)
        for f in per_device
    ]
    return {"per_device": per_device, "ring_over_plain": ratios}


def _tpu_width(mesh, width: int, chip, dims) -> dict:
    n, row = mesh.shape["tensor"], {"F": width}
    for name in ("all-gather then matmul", "ring all-gather matmul"):
        program = collective_matmul.build_matmul(name, mesh, "tensor", (8192, 4096, width), jnp.bfloat16)
        inspection = hlo.inspect(program.fn, *program.abstract_inputs(), mesh=mesh)
        report = schedule.overlap_report(
            inspection.optimized_hlo, chip, dims, inspection.mesh_shape, inspection.axis_names
        )
        row[name] = {
            "step_s": report.step_s,
            "hidden": report.hidden_s / report.communication_s,
            "timeline": schedule.timeline(inspection.optimized_hlo),
            "temp_bytes": inspection.memory.get("temp_size", 0),
            "comm_s": report.communication_s,
        }
    matmul_s = 2 * 8192 * 4096 * width / n / chip.peak_bf16_flops
    step_comm = row["ring all-gather matmul"]["comm_s"] / (n - 1)
    row["block_compute_s"], row["block_comm_s"] = matmul_s / n, step_comm
    row["modelled_ring_s"] = theory.collective_matmul_time(matmul_s, step_comm, n)
    row["modelled_plain_s"] = matmul_s + row["all-gather then matmul"]["comm_s"]
    return row


def _tpu_buckets(config: Config, chip, chips: int) -> dict:
    """The tiny bucket against DDP's default and one bucket, for the `tpu_model` preset on the slice (overlapped)."""
    model = preset(config.tpu_model)
    grad_bytes, backward_s = (
        4 * model.parameters,
        4 * model.parameters * config.tpu_tokens_per_chip / chip.peak_bf16_flops,
    )
    network = {
        "alpha": chip.hop_latency_s,
        "beta": chip.link_bandwidth,
        "algorithm": "bidirectional-ring",
        "backward_s": backward_s,
    }
    picks = {"tiny": parse_size(config.tiny_bucket), "DDP 25 MiB": bucketing.DDP_BUCKET_BYTES, "one bucket": grad_bytes}
    return {
        "model": config.tpu_model,
        "grad_bytes": grad_bytes,
        "backward_s": backward_s,
        "bucket_steps": {
            name: vars(theory.bucketed_allreduce_time(grad_bytes, size, chips, **network))
            for name, size in picks.items()
        },
    }


# ------------------------------------------------------------------ the page


def _checks(buckets, narrow, tpu) -> list:
    rows, alpha = buckets["rows"], buckets["alpha_AR_s"]
    tiny, base, one = rows["tiny buckets"], rows["baseline buckets"], rows["one bucket"]
    checks = [
        check(
            f"tiny buckets: penalty over {format_bytes(buckets['baseline_bytes'])} buckets = Δn·α_AR (ms)",
            (tiny["buckets"] - base["buckets"]) * alpha * 1e3,
            (tiny["time"].median - base["time"].median) * 1e3,
            rtol=0.5,
        ),
        check("tiny buckets: all-reduces in HLO", tiny["buckets"], tiny["all_reduces"]),
        check(
            "per-tensor psums: all-reduces in HLO",
            rows["per-tensor psums"]["buckets"],
            rows["per-tensor psums"]["all_reduces"],
            explained="XLA:CPU's all-reduce combiner merged the independent per-tensor "
            "psums into tuple all-reduces: the compiler's own bucketing",
        ),
        check(
            "one bucket: temp memory = packed copy + its sum = 2G (MiB)",
            2 * buckets["gradient_bytes"] / 2**20,
            one["temp_bytes"] / 2**20,
            rtol=0.25,
        ),
    ]
    plain, ring = narrow["all-gather then matmul"].median, narrow["ring all-gather matmul"].median
    checks.append(
        check(
            "this target, narrow matmul: ring / plain time (no async collectives: ring >= plain)",
            True,
            ring >= plain * 0.9,
        )
    )
    if isinstance(tpu, dict):
        for row in tpu["widths"]:
            ring_s, plain_s = row["ring all-gather matmul"]["step_s"], row["all-gather then matmul"]["step_s"]
            checks.append(
                check(
                    f"tpu:{tpu['topology']} F={row['F']}: ring step from the schedule vs theory (ms)",
                    row["modelled_ring_s"] * 1e3,
                    ring_s * 1e3,
                    rtol=0.25,
                )
            )
            checks.append(
                check(
                    f"tpu:{tpu['topology']} F={row['F']}: ring faster than plain",
                    row["modelled_ring_s"] < row["modelled_plain_s"],
                    ring_s < plain_s,
                )
            )
    return checks


def _bucket_table(buckets) -> Table:
    rows = buckets["rows"]
    base = rows["baseline buckets"]["time"].median
    labels = {
        "tiny buckets": f"buckets of {format_bytes(buckets['tiny_bytes'])}",
        "baseline buckets": f"buckets of {format_bytes(buckets['baseline_bytes'])}",
    }
    body = [
        [
            labels.get(name, name),
            r["buckets"],
            r["all_reduces"],
            str(r["time"]),
            f"{r['time'].median / base:.2f}x",
            format_bytes(r["temp_bytes"]),
        ]
        for name, r in rows.items()
    ]
    return Table(
        f"The lab transformer's gradients ({format_bytes(buckets['gradient_bytes'])}, "
        f"{buckets['tensors']} tensors) on this target, data={buckets['devices']}",
        [
            "reduction",
            "buckets",
            "all-reduces in HLO",
            "time (median [min, max])",
            f"vs {format_bytes(buckets['baseline_bytes'])} buckets",
            "temp memory",
        ],
        body,
        note=f"α_AR measured on its own: {buckets['alpha_AR_s'] * 1e6:.0f} "
        f"µs per all-reduce (slope of a chain of {CHAIN} one-element all-reduces).",
    )


def _narrow_table(narrow) -> Table:
    plain = narrow["all-gather then matmul"].median
    return Table(
        "A collective matmul too small to hide anything, on this target",
        ["variant", "time (median [min, max])", "vs plain"],
        [[name, str(t), f"{t.median / plain:.2f}x"] for name, t in narrow.items()],
    )


def _tpu_tables(tpu) -> list[Table]:
    if not isinstance(tpu, dict):
        return [tpu.table()] if tpu else []
    widths = []
    for row in tpu["widths"]:
        ring, plain = row["ring all-gather matmul"], row["all-gather then matmul"]
        widths.append(
            [
                row["F"],
                row["F"] // tpu["chips"],
                f"{row['block_compute_s'] * 1e6:.0f} / {row['block_comm_s'] * 1e6:.0f}",
                f"`{ring['timeline']}`",
                f"{ring['hidden']:.0%}",
                f"{ring['step_s'] * 1e3:.2f}",
                f"{plain['step_s'] * 1e3:.2f}",
                f"{row['modelled_ring_s'] * 1e3:.2f} / {row['modelled_plain_s'] * 1e3:.2f}",
                f"{ring['step_s'] / plain['step_s']:.2f}x",
            ]
        )
    width_table = Table(
        f"Collective matmul on tpu:{tpu['topology']} ({tpu['chips']} x {tpu['chip']}), "
        "M=8192, K=4096, bf16: narrow to wide (compile-only)",
        [
            "F",
            "F/N",
            "block product / transfer (µs)",
            "ring schedule",
            "ring hides",
            "ring step (ms)",
            "plain step (ms)",
            "theory ring / plain (ms)",
            "ring vs plain",
        ],
        widths,
    )
    steps = tpu["bucket_steps"]
    bucket_table = Table(
        f"Predicted on tpu:{tpu['topology']}: the {tpu['model']} preset's "
        f"gradients ({format_bytes(tpu['grad_bytes'])}), backward {tpu['backward_s'] * 1e3:.1f} "
        "ms, overlapped",
        ["bucket", "buckets", "launch latency n·α_AR (ms)", "communication (ms)", "exposed (ms)", "step (ms)"],
        [
            [
                name,
                s["buckets"],
                f"{s['latency_s'] * 1e3:.2f}",
                f"{s['comm_s'] * 1e3:.2f}",
                f"{s['exposed_s'] * 1e3:.2f}",
                f"{(s['backward_s'] + s['exposed_s']) * 1e3:.2f}",
            ]
            for name, s in steps.items()
        ],
    )
    return [width_table, bucket_table]


def _summary(buckets, narrow, tpu) -> str:
    rows = buckets["rows"]
    tiny, base, one = rows["tiny buckets"], rows["baseline buckets"], rows["one bucket"]
    extra = tiny["buckets"] - base["buckets"]
    text = (
        f"Cutting {format_bytes(buckets['gradient_bytes'])} of gradients "
        f"into {format_bytes(buckets['tiny_bytes'])} buckets made {tiny['buckets']} "
        "all-reduces and took "
        f"{tiny['time'].median / base['time'].median:.2f}x the time of {format_bytes(buckets['baseline_bytes'])} "
        f"buckets ({base['buckets']} all-reduces) on this target, where each "
        "all-reduce "
        f"costs about {buckets['alpha_AR_s'] * 1e6:.0f} µs on its own (model: "
        f"{extra * buckets['alpha_AR_s'] * 1e3:.1f} ms extra, measured "
        f"{(tiny['time'].median - base['time'].median) * 1e3:.1f} ms). "
        f"One bucket of everything needed {format_bytes(one['temp_bytes'])} "
        "of temporary memory for its packed copy and sum. "
        "A collective matmul too small to hide its transfers took "
        f"{narrow['ring all-gather matmul'].median / narrow['all-gather then matmul'].median:.2f}x "
        "the plain program here."
    )
    if isinstance(tpu, dict):
        narrowest, widest = tpu["widths"][0], tpu["widths"][-1]
        text += (
            f" On tpu:{tpu['topology']} the ring is "
            f"{narrowest['ring all-gather matmul']['step_s'] / narrowest['all-gather then matmul']['step_s']:.2f}x "
            "the plain program's step at "
            f"F/N = {narrowest['F'] // tpu['chips']} (each block's product shorter than its transfer) and "
            f"{widest['ring all-gather matmul']['step_s'] / widest['all-gather then matmul']['step_s']:.2f}x "
            f"at F/N = {widest['F'] // tpu['chips']}."
        )
    return text


def _notes(buckets, narrow, tpu) -> list[str]:
    rows = buckets["rows"]
    notes = [
        (
            f"The {buckets['tensors']} per-tensor psums compiled to {rows['per-tensor psums']['all_reduces']} "
            "all-reduce(s): left alone, XLA buckets for you "
            "(its combiner), and on XLA:CPU without any size limit, which "
            "is why hand-made tiny buckets had to be chained to survive compilation."
        ),
        (
            "Temporary memory grows with the bucket: every bucket in flight "
            "is a packed copy plus its sum. Smaller buckets need less buffer "
            "and more launches; "
            "DDP's `gradient_as_bucket_view=True` removes the copy by making the gradients views into the buckets."
        ),
        (
            f"One bucket of everything took {rows['one bucket']['time'].median * 1e3:.1f} "
            f"ms against {rows['baseline buckets']['time'].median * 1e3:.1f} "
            "ms for "
            f"{format_bytes(buckets['baseline_bytes'])} buckets: packing and "
            f"unpacking all gradients at once is a copy of {2 * buckets['devices']} "
            f"x {format_bytes(buckets['gradient_bytes'])} "
            "through the one memory bus the emulated devices share; a bucket "
            "of a few MiB packs N x b at a time, near this machine's last-level "
            "cache (a likely reason, not measured here). "
            "The per-tensor psums that XLA combines into one tuple all-reduce need no packing at all."
        ),
    ]
    if isinstance(tpu, dict):
        narrowest = tpu["widths"][0]["ring all-gather matmul"]
        notes.append(
            "At the narrowest width the TPU scheduler did not even interleave: "
            f"`{narrowest['timeline']}` runs most transfers back to back before "
            "the products. "
            "With nothing long enough to hide behind, the order barely matters to the step."
        )
        notes.append(
            "The ring holds no gathered copy of X, so it needs less temporary "
            "memory than the plain program at every width here: "
            "collective matmul is an overlap that saves memory; the buffer "
            "cost of overlap shows up in bucketing, not here."
        )
    return notes


def _plot(buckets, tpu):
    panels = 2 if isinstance(tpu, dict) else 1
    figure = Figure(figsize=(6 * panels, 4.2))
    axes = figure.subplots(1, panels, squeeze=False)
    rows = buckets["rows"]
    names = list(rows)
    left = axes[0][0]
    left.bar(names, [rows[n]["time"].median * 1e3 for n in names])
    left.set(ylabel="ms (median)", title="gradient reduction on this target")
    for i, name in enumerate(names):
        left.annotate(
            f"{rows[name]['all_reduces']} AR, {format_bytes(rows[name]['temp_bytes'])}",
            (i, rows[name]["time"].median * 1e3),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    if panels == 2:
        right = axes[0][1]
        per_device = [row["F"] // tpu["chips"] for row in tpu["widths"]]
        right.plot(
            per_device,
            [
                row["ring all-gather matmul"]["step_s"] / row["all-gather then matmul"]["step_s"]
                for row in tpu["widths"]
            ],
            "o-",
            label="schedule",
        )
        right.plot(tpu["theory_curve"]["per_device"], tpu["theory_curve"]["ring_over_plain"], "--", label="theory")
        right.axhline(1.0, color="grey", linestyle=":")
        right.set(
            xscale="log",
            xlabel="F/N (output columns per chip)",
            ylabel="ring step / plain step",
            title=f"tpu:{tpu['topology']} collective matmul",
        )
        right.legend()
    figure.tight_layout()
    return figure
