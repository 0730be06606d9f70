"""When does sharded training stop being compute-bound? Theory against the TPU compiler.

Question #50 asks why TP + FSDP beats making FSDP ever larger. The scaling
book's answer is a threshold: data parallelism and FSDP stay compute-bound
only while each chip has enough tokens, B/N > alpha / M_X (alpha = C / W_ici,
2550 on TPU v5p; M_X the torus axes the data axis spans), tensor parallelism
only while Y < M_Y·F / alpha, and FSDP x TP down to B/N > 4·alpha² / (M_X·M_Y·F).

Here a transformer MLP block's training step (y = relu(x·W_in)·W_out, the
gradients of both weights and of the input) at realistic sizes is compiled by the TPU compiler for a
v5p slice, compile-only, under each strategy and a sweep of per-chip batch.
Compute time comes from XLA's cost analysis and the chip's peak FLOP/s,
communication time from the collectives in the compiled HLO and the links
their mesh axes use (lab.roofline). Where the two cross is the threshold XLA's
own program has, next to the book's.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import matplotlib
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from matplotlib.figure import Figure

from lab import hlo, theory
from lab.bench import crossover
from lab.devices import parse_target, topology_devices
from lab.hardware import profile_for_device_kind
from lab.mesh import MeshSpec
from lab.progress import track
from lab.report import Result, Table, provenance
from lab.roofline import roofline
from lab.topology import placement
from lab.units import format_bytes
from lab.verdict import check

QUESTION = "#50"
COMPILE_ONLY = True  # runs on a TPU topology through libtpu, whatever target `lab report` uses

# strategy -> (mesh spec, where each array lives and how it is used); axis names from lab.mesh
STRATEGIES = {
    "data parallel": "data=-1",
    "FSDP": "fsdp=-1",
    "FSDP x TP": "fsdp=-1,tensor=4",
}


@dataclass(frozen=True)
class Config:
    target: str = "tpu:v5p:4x4x4"
    """a TPU topology to compile for (compile-only); CPU targets fall back to this default"""
    embed: int = 8192
    """D, the model width"""
    mlp: int = 32768
    """F, the MLP width (the book's example uses 32768)"""
    batch_per_chip: tuple[int, ...] = (128, 256, 512, 1024, 2048, 4096)
    """tokens per chip, B/N"""
    tensor_ways: tuple[int, ...] = (4, 16, 64)
    """tensor-parallel degrees Y to check against Y < M_Y F / alpha"""
    benchmark_preset: str = "1b"
    """model preset whose ZeRO-3 training step is compiled and analysed for `benchmark_topology` (empty to skip)"""
    benchmark_topology: str = "v5p:8x8x16"
    pod_topologies: tuple[str, ...] = ("v5p:8x8x4",)
    """larger slices for the FSDP step at a fixed B/N (compile time grows with chips: v5p:8x8x16 takes ~10 s more)"""


def run(config: Config) -> Result:
    target = parse_target(config.target)
    topology = target.topology if target.compile_only else Config.target.split(":", 1)[1]
    chips = topology_devices(topology)
    chip = profile_for_device_kind(chips[0].device_kind)
    sweep = {
        name: [_step(spec, chips, config, b) for b in track(config.batch_per_chip, f"{name} on {topology}")]
        for name, spec in STRATEGIES.items()
    }
    tensor = [
        _step(f"data=-1,tensor={y}", chips, config, config.batch_per_chip[-1])
        for y in track(config.tensor_ways, "tensor parallel degrees")
    ]
    pods = [
        _step("fsdp=-1", topology_devices(t), config, 2048) | {"topology": t}
        for t in track(config.pod_topologies, "pod sizes")
    ]
    thresholds = _thresholds(sweep, chip, config)
    benchmark = (
        _compile_benchmark(config.benchmark_preset, config.benchmark_topology) if config.benchmark_preset else None
    )
    checks = _checks(sweep, thresholds, tensor, chip, config)
    return Result(
        summary=_summary(thresholds, topology, chip),
        theory=THEORY,
        tables=[
            _sweep_table(sweep),
            _threshold_table(thresholds),
            _tensor_table(tensor, chip, config),
            _pod_table(pods, sweep["FSDP"], config),
            _collectives_table(sweep),
            *([_benchmark_table(benchmark)] if benchmark else []),
        ],
        checks=checks,
        plots={"ratio": _plot(sweep, thresholds, topology)},
        notes=_notes(sweep),
        provenance=provenance(
            target=f"tpu:{topology}", devices=chips, mesh=", ".join(f"{k}: {v}" for k, v in STRATEGIES.items())
        ),
        data={
            "sweep": {k: [_plain(r) for r in v] for k, v in sweep.items()},
            "tensor": [_plain(r) for r in tensor],
            "pods": [_plain(r) for r in pods],
            "thresholds": thresholds,
            "benchmark": benchmark,
        },
    )


THEORY = r"""
Per chip and per step of an MLP block with B tokens, width D and MLP width F on N chips (the scaling book, Part 5):
compute is 12·B·D·F / N FLOPs (two matmuls forward, four backward), at C FLOP/s;
data parallelism all-reduces the 2·D·F weight gradients; FSDP gathers the weights and reduce-scatters their
gradients; tensor parallelism moves activations of size B·D / X instead. With α = C / W_ici (W_ici: both directions
of one torus axis; 2550 on v5p) and M the torus axes a mesh axis spans:

| strategy | compute-bound while | v5p, 3 axes |
|---|---|---|
| data parallel, FSDP | B/N > α / M_X | 850 tokens per chip |
| tensor parallel over Y | Y < M_Y · F / α | 12.8·M_Y for F = 32768 |
| FSDP × TP | B/N > 4α² / (M_X · M_Y · F) | ≈ 400 for M_X M_Y = 2 |

Over DCN the same ratio uses the data-centre bandwidth per chip instead of W_ici: α_DCN = C / W_dcn.
"""


def _mlp_step(mesh, strategy_axes: dict):
    """jit(grad) of an MLP block with sharding annotations only: XLA inserts the collectives.

    The mesh uses Auto axis types on purpose: the program states where arrays
    live (in/out shardings, sharding constraints) and leaves the partitioning
    to GSPMD, as production JAX training code does.
    """
    batch, stored_in, stored_out, used_in, used_out, hidden = (
        strategy_axes[k] for k in ("batch", "w_in", "w_out", "use_in", "use_out", "hidden")
    )

    def loss(w_in_DF, w_out_FD, x_BD):
        w_in_DF = jax.lax.with_sharding_constraint(w_in_DF, NamedSharding(mesh, used_in))
        w_out_FD = jax.lax.with_sharding_constraint(w_out_FD, NamedSharding(mesh, used_out))
        h_BF = jax.lax.with_sharding_constraint(jax.nn.relu(x_BD @ w_in_DF), NamedSharding(mesh, hidden))
        # the block's output feeds the next layer whole: this is where tensor parallelism all-reduces
        y_BD = jax.lax.with_sharding_constraint(h_BF @ w_out_FD, NamedSharding(mesh, batch))
        return jnp.sum((y_BD * x_BD).astype(jnp.float32))  # a loss that needs every backward matmul

    shardings = (NamedSharding(mesh, stored_in), NamedSharding(mesh, stored_out))
    # value_and_grad: the loss keeps the forward's second matmul alive (grad alone lets XLA drop it);
    # the input's gradient too, as for any layer but the first (tensor parallelism reduces it in the backward)
    batch_sharding = NamedSharding(mesh, batch)
    step = jax.jit(
        jax.value_and_grad(loss, argnums=(0, 1, 2)),
        out_shardings=(NamedSharding(mesh, P()), (*shardings, batch_sharding)),
    )
    return step, shardings, batch_sharding


def _axes_for(mesh) -> dict:
    """Where each array lives and is used, from which of data / fsdp / tensor the mesh has."""
    sizes = dict(zip(mesh.axis_names, mesh.devices.shape))
    batch_axes = tuple(a for a in ("data", "fsdp") if sizes[a] > 1) or None
    fsdp = "fsdp" if sizes["fsdp"] > 1 else None
    tp = "tensor" if sizes["tensor"] > 1 else None
    return {
        "batch": P(batch_axes, None),
        "w_in": P(fsdp, tp),
        "w_out": P(tp, fsdp),  # stored: sharded over fsdp (and tensor)
        "use_in": P(None, tp),
        "use_out": P(tp, None),  # used: gathered over fsdp, still split over tensor
        "hidden": P(batch_axes, tp),
    }


def _step(spec: str, chips, config: Config, batch_per_chip: int) -> dict:
    mesh = MeshSpec.parse(spec).build(chips, explicit=False)
    n = mesh.devices.size
    step, (w_in, w_out), batch = _mlp_step(mesh, _axes_for(mesh))
    args = (
        jax.ShapeDtypeStruct((config.embed, config.mlp), jnp.bfloat16, sharding=w_in),
        jax.ShapeDtypeStruct((config.mlp, config.embed), jnp.bfloat16, sharding=w_out),
        jax.ShapeDtypeStruct((batch_per_chip * n, config.embed), jnp.bfloat16, sharding=batch),
    )
    inspection = hlo.inspect(step, *args, mesh=mesh)
    roof = roofline(inspection, mesh)
    return {
        "spec": spec,
        "mesh": mesh,
        "chips": n,
        "batch_per_chip": batch_per_chip,
        "roofline": roof,
        "ratio": roof.communication_s / roof.compute_s,
        "expected_flops": 12 * batch_per_chip * config.embed * config.mlp,
    }


def _plain(row: dict) -> dict:
    roof = row["roofline"]
    return {
        "spec": row["spec"],
        "chips": row["chips"],
        "batch_per_chip": row["batch_per_chip"],
        "compute_s": roof.compute_s,
        "memory_s": roof.memory_s,
        "communication_s": roof.communication_s,
        "flops": roof.flops,
        "collectives": [
            (c.collective.kind, c.collective.axes, c.collective.size_bytes, str(c.where), c.seconds)
            for c in roof.collectives
        ],
    }


def _axes_spanned(mesh, axis: str) -> int:
    return len(placement(mesh, (axis,)).torus_dims)


def _thresholds(sweep, chip, config: Config) -> dict:
    """Theory's threshold and the XLA program's crossover, per strategy (tokens per chip)."""
    out = {}
    for name, rows in sweep.items():
        mesh = rows[0]["mesh"]
        if name == "FSDP x TP":
            predicted = theory.fsdp_tp_min_batch_per_chip(
                chip, config.mlp, _axes_spanned(mesh, "fsdp"), _axes_spanned(mesh, "tensor")
            )
        else:
            predicted = theory.data_parallel_min_batch_per_chip(
                chip, _axes_spanned(mesh, "data" if name == "data parallel" else "fsdp")
            )
        out[name] = {
            "theory": predicted,
            "xla": crossover([r["batch_per_chip"] for r in rows], [r["ratio"] for r in rows]),
        }
    return out


def _checks(sweep, thresholds, tensor, chip, config: Config) -> list:
    checks = []
    for name, rows in sweep.items():
        row = rows[-1]
        checks.append(
            check(
                f"{name}: FLOPs per chip at B/N={row['batch_per_chip']} (12·B·D·F/N)",
                row["expected_flops"],
                row["roofline"].flops,
                rtol=0.05,
            )
        )
        t = thresholds[name]
        checks.append(
            check(
                f"{name}: tokens per chip where compute = communication (within 2x)",
                round(t["theory"]),
                round(t["xla"]) if t["xla"] else "no crossing in the sweep",
                rtol=0.5,
                explained=_why_refined(name, rows),
            )
        )
    alpha = theory.ici_arithmetic_intensity(chip)
    for row in tensor:
        mesh = row["mesh"]
        y = dict(zip(mesh.axis_names, mesh.devices.shape))["tensor"]
        limit = theory.tensor_parallel_max_ways(chip, config.mlp, _axes_spanned(mesh, "tensor"))
        tp_comm = sum(
            c.seconds for c in row["roofline"].collectives if c.collective.axes and "tensor" in c.collective.axes
        )
        checks.append(
            check(
                f"tensor parallel Y={y}: compute-bound on the tensor axis (theory: "
                f"Y < {limit:.1f} = M_Y·F/α, α={alpha:.0f})",
                y < limit,
                tp_comm < row["roofline"].compute_s,
            )
        )
    return checks


def _why_refined(name: str, rows) -> str | None:
    """Explain a crossover that moved, from the collectives XLA actually wrote."""
    kinds = [c.collective.kind for c in rows[-1]["roofline"].collectives]
    if name == "FSDP" and "all-gather" not in kinds and kinds.count("all-reduce") >= 2:
        return (
            "the TPU compiler gathered the weights with all-reduces (each "
            "chip contributes its shard of a zero buffer) and reduced the "
            "gradients "
            "with all-reduces too: 2(N-1)/N·S per collective instead of (N-1)/N·S, "
            "so communication doubles and the threshold moves up"
        )
    return None


def _compile_benchmark(preset_name: str, topology: str) -> dict:
    """Seconds to compile a whole ZeRO-3 training step for a pod, and to analyse it (parse, map, predict)."""
    from time import perf_counter

    from lab.model import preset
    from lab.training.step import TrainConfig, Trainer

    model = preset(preset_name)
    mesh = MeshSpec(fsdp=-1).build(topology_devices(topology))
    trainer = Trainer(model, TrainConfig(strategy="zero3", param_dtype="bfloat16", compute_dtype="bfloat16"), mesh)
    started = perf_counter()
    compiled = trainer.compiled_step(mesh.devices.size)  # one sequence per chip
    compiled_at = perf_counter()
    inspection = hlo.inspect_compiled(compiled, mesh)
    roof = roofline(inspection, mesh)
    found = inspection.collectives
    return {
        "preset": preset_name,
        "parameters": model.parameters,
        "topology": topology,
        "chips": mesh.devices.size,
        "compile_s": compiled_at - started,
        "analysis_s": perf_counter() - compiled_at,
        "collectives": len(found),
        "bound": roof.bound,
    }


def _benchmark_table(b: dict) -> Table:
    rows = [
        [
            f"compile one ZeRO-3 training step of the {b['preset']} preset "
            f"({b['parameters'] / 1e9:.2f} B parameters) for tpu:{b['topology']} "
            f"({b['chips']} chips)",
            f"{b['compile_s']:.1f} s",
            "under 60 s",
        ],
        [
            f"analyse it: parse {b['collectives']} collectives, map them to "
            f"axes, predict the roofline ({b['bound']}-bound)",
            f"{b['analysis_s']:.2f} s",
            "under 2 s",
        ],
    ]
    return Table("Performance: pod-scale compile on this machine", ["what", "measured", "goal"], rows)


def _sweep_table(sweep) -> Table:
    rows = []
    for name, points in sweep.items():
        for r in points:
            roof = r["roofline"]
            rows.append(
                [
                    name,
                    r["spec"].replace("-1", str(r["chips"] // (4 if "tensor=4" in r["spec"] else 1))),
                    r["batch_per_chip"],
                    f"{roof.compute_s * 1e3:.2f}",
                    f"{roof.memory_s * 1e3:.2f}",
                    f"{roof.communication_s * 1e3:.2f}",
                    f"{r['ratio']:.2f}",
                    roof.bound,
                ]
            )
    return Table(
        "Predicted time per step (ms) of the compiled MLP step",
        ["strategy", "mesh", "tokens per chip", "compute", "HBM", "communication", "comm / compute", "bound by"],
        rows,
    )


def _threshold_table(thresholds) -> Table:
    rows = [
        [name, f"{t['theory']:.0f}", f"{t['xla']:.0f}" if t["xla"] else "none in the sweep"]
        for name, t in thresholds.items()
    ]
    return Table(
        "Tokens per chip needed to be compute-bound", ["strategy", "theory (book)", "XLA's program (crossover)"], rows
    )


def _tensor_table(tensor, chip, config: Config) -> Table:
    rows = []
    for row in tensor:
        mesh = row["mesh"]
        y = dict(zip(mesh.axis_names, mesh.devices.shape))["tensor"]
        tp = sum(c.seconds for c in row["roofline"].collectives if c.collective.axes and "tensor" in c.collective.axes)
        rows.append(
            [
                y,
                str(placement(mesh, ("tensor",))),
                f"{theory.tensor_parallel_max_ways(chip, config.mlp, _axes_spanned(mesh, 'tensor')):.1f}",
                f"{row['roofline'].compute_s * 1e3:.2f}",
                f"{tp * 1e3:.2f}",
            ]
        )
    return Table(
        f"Tensor parallelism at {tensor[0]['batch_per_chip']} tokens per chip",
        ["Y", "tensor axis on", "theory: Y must stay below", "compute (ms)", "tensor-axis communication (ms)"],
        rows,
    )


def _pod_table(pods, fsdp64, config: Config) -> Table:
    base = next((r for r in fsdp64 if r["batch_per_chip"] == 2048), None)
    rows = (
        [
            [
                f"tpu:{Config.target.split(':', 1)[1]}",
                base["chips"],
                f"{base['roofline'].compute_s * 1e3:.2f}",
                f"{base['roofline'].communication_s * 1e3:.2f}",
                str(placement(base["mesh"], ("fsdp",))),
            ]
        ]
        if base
        else []
    )
    for r in pods:
        rows.append(
            [
                f"tpu:{r['topology']}",
                r["chips"],
                f"{r['roofline'].compute_s * 1e3:.2f}",
                f"{r['roofline'].communication_s * 1e3:.2f}",
                str(placement(r["mesh"], ("fsdp",))),
            ]
        )
    return Table(
        "FSDP at 2048 tokens per chip on larger slices",
        ["target", "chips", "compute (ms)", "communication (ms)", "fsdp axis on"],
        rows,
    )


def _collectives_table(sweep) -> Table:
    rows = []
    for name, points in sweep.items():
        for c in points[-1]["roofline"].collectives:
            col = c.collective
            rows.append(
                [
                    name,
                    col.kind,
                    col.form,
                    ",".join(col.axes or ("?",)),
                    ",".join(col.dtypes),
                    format_bytes(col.size_bytes),
                    str(c.where),
                    f"{c.seconds * 1e6:.0f}",
                ]
            )
    return Table(
        "What the TPU compiler wrote (largest batch)",
        ["strategy", "kind", "as written", "axes", "dtype", "S per chip", "on", "predicted us"],
        rows,
    )


def _plot(sweep, thresholds, topology):
    figure = Figure(figsize=(7.5, 4.5))
    axes = figure.subplots()
    colors = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    for color, (name, rows) in zip(colors, sweep.items()):
        axes.plot(
            [r["batch_per_chip"] for r in rows],
            [r["ratio"] for r in rows],
            marker="o",
            color=color,
            label=f"{name} (XLA's program)",
        )
        axes.axvline(thresholds[name]["theory"], color=color, linestyle=":", alpha=0.8, label=f"{name}: book threshold")
    axes.axhline(1.0, color="black", linewidth=0.8)
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    axes.set_xlabel("tokens per chip (B/N)")
    axes.set_ylabel("communication / compute time")
    axes.set_title(f"MLP step compiled for tpu:{topology}: below 1 is compute-bound")
    axes.legend(fontsize=7)
    axes.grid(alpha=0.3)
    return figure


def _summary(thresholds, topology, chip) -> str:
    alpha = theory.ici_arithmetic_intensity(chip)
    parts = [f"On tpu:{topology} (α = C/W_ici = {alpha:.0f})"]
    for name, t in thresholds.items():
        xla = f"{t['xla']:.0f}" if t["xla"] else "no crossing in the sweep"
        parts.append(
            f"{name} needs B/N > {t['theory']:.0f} tokens per chip by the book and {xla} in the compiled program"
        )
    text = "; ".join(parts) + "."
    fsdp, mixed = thresholds["FSDP"]["xla"], thresholds["FSDP x TP"]["xla"]
    if fsdp and mixed:
        text += (
            " In XLA's own program adding 4-way tensor parallelism cut the "
            f"tokens each chip needs by {fsdp / mixed:.1f}x: "
            "that is why TP inside the fast domain with FSDP across it keeps "
            "a pod compute-bound at batch sizes where a very large FSDP is "
            "not."
        )
    return text


def _notes(sweep) -> list[str]:
    notes = [why for name, rows in sweep.items() if (why := _why_refined(name, rows))]
    for name, rows in sweep.items():
        kinds = [c.collective.kind for c in rows[-1]["roofline"].collectives]
        notes.append(
            f"{name}: the compiled step holds "
            f"{', '.join(f'{kinds.count(k)} {k}' for k in dict.fromkeys(kinds)) or 'no collectives'}."
        )
    notes.append(
        "HBM time is listed but not part of the threshold: at these sizes the matmuls are compute-bound on HBM as well."
    )
    return notes
