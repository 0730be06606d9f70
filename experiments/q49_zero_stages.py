"""ZeRO stages on a real transformer: memory, bytes and step time against the ZeRO paper.

Question #49 asks how ZeRO-3 and FSDP differ; first one must know what each
ZeRO stage buys. The lab trains the same transformer with the same step
function under five rules tables (DDP, ZeRO-1, ZeRO-2, ZeRO-3 resharding after
the forward pass, ZeRO-3 keeping the gathered weights) and puts the ZeRO
paper's accounting next to what XLA compiled: memory per device from XLA's
memory analysis, collectives and their bytes from the optimized HLO, and the
step time on this target. With a TPU topology it compiles the same steps for
the TPU (compile-only) as well.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace

import jax.numpy as jnp
from matplotlib.figure import Figure

from experiments import kit
from lab import theory
from lab.bench import Timing
from lab.devices import DEFAULT_TARGET, devices_for, parse_target
from lab.mesh import MeshSpec
from lab.model import ModelConfig, preset
from lab.progress import track
from lab.report import Result, Table, provenance
from lab.rules import STRATEGIES
from lab.training.step import TrainConfig, Trainer
from lab.units import format_bytes
from lab.verdict import check

QUESTION = "#49"
STAGE = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "zero3-keep": 3}
SCALAR_BYTES = 8  # the loss all-reduce: not part of any ZeRO formula
HLO_DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}


@dataclass(frozen=True)
class Config:
    target: str = DEFAULT_TARGET
    """where to run: cpu:N, gpu, tpu, or tpu:<gen>:<topology> (compile-only: memory and bytes, no times)"""
    model: str = "tiny"
    """model preset (lab.model.PRESETS) for memory and bytes"""
    global_batch: int = 16
    """sequences per step, split over all devices"""
    precision: str = "bfloat16"
    """working weights and gradients; bfloat16 is the ZeRO paper's mixed precision (with fp32 master weights)"""
    tpu_topology: str = "v5e:2x4"
    """also compile every strategy for this TPU topology (compile-only, bytes only); empty to skip"""
    timing_model: str = "small"
    """preset for the goal ratio: the ZeRO-3 step on all devices over the step on one device"""
    repeats: int = 3
    """timed steps per measurement, after one warm-up step"""


@dataclass(frozen=True)
class Measured:
    """One strategy compiled (and on real devices, timed) on one target."""

    strategy: str
    target: str
    devices: int
    state_bytes: int  # XLA arguments of the step minus the batch: weights, master weights, Adam moments
    grad_bytes: int | None  # XLA output of the gradients program minus the loss (None: not compiled)
    step_bytes: int  # the whole step: arguments, temporaries, outputs not aliased (or the compiler's peak)
    moved: dict[str, float]  # S per collective kind per step over the data-parallel axis, as compiled
    moved_in_working_dtype: dict[str, float]  # the same, had every collective carried the working dtype
    sent: float  # bytes each device sends per step on a ring, as compiled
    rows: tuple[tuple, ...]  # (kind, axes, runs, S) per collective kind and axes
    dtypes: tuple[str, ...]  # the element types the collectives carry
    all_reduced: tuple[tuple[int, ...], ...]  # operand shapes that crossed the data axis by all-reduce
    assumed_loops: int  # collectives in loops whose trip count the HLO did not give (counted once per layer)
    arguments: int  # XLA's argument bytes of the step
    declared_arguments: int  # the entry parameters' bytes as declared in the HLO
    padded_arguments: int  # the same with their layout tiles filled
    step: Timing | None = None


@dataclass(frozen=True)
class Expected:
    """The ZeRO paper's numbers for one strategy."""

    states: theory.ModelStateBytes
    moved: dict[str, float]
    sent: float
    itemsize: int  # bytes per working weight


def run(config: Config) -> Result:
    devices = devices_for(config.target)
    model = preset(config.model)
    timed = not parse_target(config.target).compile_only
    trainers = {s: _trainer(model, s, devices, config.precision) for s in STRATEGIES}
    measured = [
        _measure(t, config.global_batch, config.target)
        for t in track(trainers.values(), f"compile every strategy for {config.target}")
    ]
    if timed:
        start = _host_state(
            trainers["ddp"]
        )  # every strategy starts from the same weights: one initializer compiled, not five
        measured = [
            replace(
                m,
                step=trainers[m.strategy].time_step(config.global_batch, repeats=config.repeats, warmup=1, start=start),
            )
            for m in track(measured, "step time per strategy")
        ]
    chips = kit.tpu_chips(config.tpu_topology) if timed else None
    tpu = _on_tpu(config, model, chips) if isinstance(chips, kit.TpuChips) else []
    ratio = _goal_ratio(config, devices) if timed else None
    everything = measured + tpu
    expected = {(m.target, m.strategy): _expected(m.strategy, model, m.devices, config.precision) for m in everything}
    checks = [c for m in everything for c in _checks(m, expected[m.target, m.strategy])] + _ratio_checks(
        everything, expected
    )
    return Result(
        summary=_summary(measured, tpu, expected, ratio, model),
        theory=THEORY,
        tables=[
            *_tables(everything, expected, ratio),
            *([chips.table()] if isinstance(chips, kit.Unavailable) else []),
        ],
        checks=checks,
        plots={"zero_stages": _plot(everything, expected)},
        notes=_notes(measured, tpu, expected, model),
        provenance=provenance(target=config.target, devices=devices, mesh=f"fsdp={len(devices)}"),
        data={
            "model": config.model,
            "parameters": model.parameters,
            "measured": [_as_data(m) for m in everything],
            "goal_ratio": _ratio_data(ratio),
        },
    )


# --- measuring ----------------------------------------------------------------------------


def _trainer(model: ModelConfig, strategy: str, devices, precision: str) -> Trainer:
    mesh = MeshSpec(fsdp=len(devices)).build(devices)
    return Trainer(model, TrainConfig(strategy=strategy, param_dtype=precision, compute_dtype=precision), mesh)


def _measure(trainer: Trainer, global_batch: int, target: str, *, gradients: bool = True) -> Measured:
    step = trainer.inspect_step(global_batch)
    devices = trainer.mesh.devices.size
    found = [c for c in step.collectives if c.size_bytes > SCALAR_BYTES and c.axes]
    rows, moved, sent, assumed = _tally(found, trainer.model.layers)
    working = jnp.dtype(trainer.layout.param_dtype).itemsize
    return Measured(
        strategy=trainer.config.strategy,
        target=target,
        devices=devices,
        state_bytes=step.memory["argument_size"] - global_batch * (trainer.model.seq + 1) * 4 // devices,
        grad_bytes=trainer.inspect_gradients(global_batch).memory["output_size"] - 4
        if gradients
        else None,  # minus the f32 loss
        step_bytes=_step_bytes(step.memory),
        moved=moved,
        moved_in_working_dtype=_tally(found, trainer.model.layers, itemsize=working)[1],
        sent=sent,
        rows=rows,
        dtypes=tuple(sorted({d for c in found for d in c.dtypes})),
        all_reduced=tuple(shape for c in found if c.kind == "all-reduce" for shape in c.operand_shapes),
        assumed_loops=assumed,
        arguments=step.memory["argument_size"],
        declared_arguments=_padded_arguments(step.optimized_hlo)[0],
        padded_arguments=_padded_arguments(step.optimized_hlo)[1],
    )


def _tally(found, layers: int, itemsize: int | None = None):
    """Per (kind, axes): runs and S per step; S per kind; ring bytes sent. With `itemsize`, S carried in that width."""
    totals: dict[tuple, list] = {}
    moved: dict[str, float] = {}
    sent, assumed = 0.0, 0
    for c in found:
        runs = (
            c.repeats if c.repeats is not None else layers
        )  # the TPU HLO prints no trip count: the layer scan runs `layers` times
        assumed += c.repeats is None
        size = (
            c.size_bytes if itemsize is None else c.size_bytes * itemsize / jnp.dtype(HLO_DTYPES[c.dtypes[0]]).itemsize
        )
        row = totals.setdefault((c.kind, c.axes), [0, 0])
        row[0] += runs
        row[1] += runs * size
        moved[c.kind] = moved.get(c.kind, 0) + runs * size
        sent += runs * size * theory.bus_bandwidth_factor(c.kind, c.group_size)
    return tuple((kind, axes, runs, size) for (kind, axes), (runs, size) in totals.items()), moved, sent, assumed


def _step_bytes(memory: dict[str, int]) -> int:
    """All the step holds at once: XLA:CPU reports buffers (its peak: arguments only), the TPU compiler a peak."""
    buffers = memory["argument_size"] + memory["temp_size"] + memory["output_size"] - memory["alias_size"]
    return max(buffers, memory.get("peak_memory", 0))


def _padded_arguments(optimized_hlo: str) -> tuple[int, int]:
    """Bytes of the entry computation's parameters as declared, and with their layouts' tiles filled.

    TPU layouts tile small dimensions, e.g. ``{1,0:T(8,128)}``.

    A layout lists dimensions minor first; a tile T(x,y) covers the two most minor dimensions, padding them
    up to multiples of x and y. On layouts without tiles this is simply the parameters' bytes.
    """
    entry = optimized_hlo[optimized_hlo.find("\nENTRY") :]
    entry = entry[: entry.find("\n}")]
    declared = padded = 0
    for dtype, dims, layout in re.findall(r"= ([a-z]+\d*)\[([\d,]*)\]\{([^}]*)\} parameter\(", entry):
        sizes = [int(d) for d in dims.split(",") if d]
        itemsize = jnp.dtype(HLO_DTYPES.get(dtype, jnp.int32)).itemsize
        elements = math.prod(sizes)
        declared += elements * itemsize
        tile = re.match(r"([\d,]+):T\((\d+),(\d+)\)", layout)
        if tile and len(sizes) >= 2:
            minor = [int(i) for i in tile.group(1).split(",")]
            rows, lanes = int(tile.group(2)), int(tile.group(3))
            inner, outer = sizes[minor[0]], sizes[minor[1]]
            elements = elements // (inner * outer) * math.ceil(outer / rows) * rows * math.ceil(inner / lanes) * lanes
        padded += elements * itemsize
    return declared, padded


def _host_state(trainer: Trainer):
    """The initial state as numpy: every timed trainer starts from it (one initializer compiled, not one each)."""
    import jax
    import numpy as np

    return jax.tree.map(np.asarray, trainer.init())


def _goal_ratio(config: Config, devices) -> dict:
    """The ZeRO-3 step on all devices over the same step on one device: same model, same global batch, same start."""
    model = preset(config.timing_model)
    single_trainer = _trainer(model, "zero3", devices[:1], config.precision)
    start = _host_state(single_trainer)
    single = single_trainer.time_step(config.global_batch, repeats=config.repeats, warmup=1, start=start)
    sharded = _trainer(model, "zero3", devices, config.precision).time_step(
        config.global_batch, repeats=config.repeats, warmup=1, start=start
    )
    return {
        "model": config.timing_model,
        "devices": len(devices),
        "sharded": sharded,
        "single": single,
        "ratio": sharded.median / single.median,
    }


def _on_tpu(config: Config, model: ModelConfig, chips: kit.TpuChips) -> list[Measured]:
    trainers = [_trainer(model, s, chips.devices, config.precision) for s in STRATEGIES]
    return [
        _measure(t, config.global_batch, chips.target, gradients=False)
        for t in track(trainers, f"compile every strategy for {chips.target}")
    ]


# --- theory -------------------------------------------------------------------------------


def _expected(strategy: str, model: ModelConfig, devices: int, precision: str) -> Expected:
    """The paper's accounting for this model: Ψ parameters in b-byte working weights, N = devices."""
    psi, b = model.parameters, jnp.dtype(precision).itemsize
    # with fp32 working weights the optimizer uses them as its master copy: 8 bytes of moments, no extra 4
    states = theory.zero_model_states(
        STAGE[strategy], psi, devices, param_bytes=b, grad_bytes=b, optimizer_bytes=12 if b == 2 else 8
    )
    regathered = {"zero3": model.block_parameters * b, "zero3-keep": 0}.get(
        strategy
    )  # the blocks are rematerialized, the root is not
    moved = theory.zero_step_collectives(STAGE[strategy], psi * b, regathered_bytes=regathered)
    return Expected(states, moved, theory.step_wire_bytes(moved, devices), b)


def _explanation(expected: Expected, m: Measured) -> str | None:
    """Why XLA's bytes differ from the paper's, when the HLO shows a known reason; None when nothing explains it.

    Two known refinements: the collectives carry another element type than the working weights (S scales
    by the width), and part of a reduce-scatter or all-gather is done by an all-reduce (the same S, but an
    all-reduce sends 2(N-1)/N·S, twice). The difference counts as explained only if, with both undone,
    every byte is gathered or reduced exactly as often as the paper says.
    """
    if not math.isclose(sum(m.moved_in_working_dtype.values()), sum(expected.moved.values()), rel_tol=0.02):
        return None
    reasons = []
    width = sum(m.moved.values()) / sum(m.moved_in_working_dtype.values())
    if not math.isclose(width, 1.0, rel_tol=0.02):
        reasons.append(
            f"the collectives carry {'/'.join(m.dtypes)} where the working "
            f"weights are {'bf16' if expected.itemsize == 2 else 'f32'}: S "
            f"is {width:.2g}x"
        )
    extra = m.moved_in_working_dtype.get("all-reduce", 0) - expected.moved.get("all-reduce", 0)
    if extra > 0.01 * sum(expected.moved.values()):
        shapes = ", ".join(dict.fromkeys(str(list(s)) for s in m.all_reduced))
        reasons.append(
            f"{format_bytes(extra)} of reduce-scatter or all-gather was done "
            f"by all-reduce (operands {shapes}), which sends 2(N-1)/N·S instead "
            "of (N-1)/N·S"
        )
    return "; ".join(reasons) or None


def _padding(m: Measured) -> str | None:
    """The known refinement of memory: layout tiles pad small dimensions; padded, the parameters add up to XLA's."""
    tiled = m.padded_arguments > 1.01 * m.declared_arguments
    if not tiled or abs(m.padded_arguments - m.arguments) > 0.01 * m.arguments:
        return None
    return (
        "the layouts tile the two minor dimensions of every array and this "
        "model's small head and shard dimensions fill the tiles only partly: "
        f"the step's parameters take {format_bytes(m.declared_arguments)} "
        f"as declared and {format_bytes(m.padded_arguments)} with their tiles "
        f"filled; XLA reports {format_bytes(m.arguments)}"
    )


def _checks(m: Measured, expected: Expected) -> list:
    label = f"{m.target} {m.strategy}"
    state = expected.states.params + expected.states.optimizer
    padded = _padding(m) if not math.isclose(state, m.state_bytes, rel_tol=0.01) else None
    rows = [
        check(
            f"{label}: persistent state per device (params + optimizer), bytes",
            state,
            m.state_bytes,
            rtol=0.01,
            explained=padded,
        ),
        check(
            f"{label}: bytes sent per device per step (ring)",
            expected.sent,
            m.sent,
            rtol=0.02,
            explained=_explanation(expected, m),
        ),
    ]
    if m.grad_bytes is not None:  # the secondary TPU compile skips the gradients program
        rows.insert(1, check(f"{label}: gradients per device, bytes", expected.states.grads, m.grad_bytes, rtol=0.01))
    return rows


def _ratio_checks(everything: list[Measured], expected: dict) -> list:
    rows = []
    for target in dict.fromkeys(m.target for m in everything):
        by = {m.strategy: m for m in everything if m.target == target}
        want = expected[target, "zero3"].sent / expected[target, "ddp"].sent
        why = (
            "; ".join(f"{s}: {e}" for s in ("zero3", "ddp") if (e := _explanation(expected[target, s], by[s]))) or None
        )
        rows.append(
            check(
                f"{target}: ZeRO-3 bytes sent / DDP bytes sent",
                want,
                by["zero3"].sent / by["ddp"].sent,
                rtol=0.02,
                explained=why,
            )
        )
    return rows


THEORY = r"""
Ψ parameters, N data-parallel devices, mixed-precision Adam (Rajbhandari, Rasley, Ruwase & He 2020,
"ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", SC20, arXiv:1910.02054, Section 5, Figure 1):
bf16 working weights 2Ψ, bf16 gradients 2Ψ, and K = 12 bytes per parameter of optimizer state (fp32 master
weights, momentum, variance). Each stage divides one more term by N:

| stage | params | grads | optimizer | total |
|---|---|---|---|---|
| DDP | 2Ψ | 2Ψ | 12Ψ | 16Ψ |
| ZeRO-1 | 2Ψ | 2Ψ | 12Ψ/N | 4Ψ + 12Ψ/N |
| ZeRO-2 | 2Ψ | 2Ψ/N | 12Ψ/N | 2Ψ + 14Ψ/N |
| ZeRO-3 | 2Ψ/N | 2Ψ/N | 12Ψ/N | 16Ψ/N |

In the compiled step the weights and the optimizer state persist (XLA's arguments); the gradients live inside
the step, so the lab measures them as the outputs of the forward-and-backward program alone.

Communication per step (paper Section 7; S is the nccl-tests size; a device sends 2(N-1)/N·S for a ring
all-reduce and (N-1)/N·S for an all-gather or a reduce-scatter):

- DDP: all-reduce of the gradients, S = 2Ψ bytes: 2(N-1)/N · 2Ψ.
- ZeRO-1 and ZeRO-2: reduce-scatter of the gradients, all-gather of the updated weights: the two halves of the
  same all-reduce, the same bytes as DDP (7.2.1).
- ZeRO-3: all-gather of the weights for the forward pass, again for the backward pass, and reduce-scatter of the
  gradients: 3(N-1)/N · 2Ψ, **1.5x DDP** (7.2.2). The textbook pairing "all-reduce = reduce-scatter + all-gather,
  the same 2Ψ" holds for ZeRO-1/2; ZeRO-3 adds the second all-gather.
- ZeRO-3 keeping the gathered weights from forward to backward (PyTorch FSDP `reshard_after_forward=False`) skips
  that second all-gather: DDP's bytes, with whole weights held through the backward pass.

In this lab the weights outside the layer scan (embedding, unembedding, final norm) are not rematerialized, so only
the blocks are gathered twice, as PyTorch FSDP2 does for its root module; the expected bytes use this model's
block fraction f: ZeRO-3 sends (2 + f)/2 of DDP's bytes.
"""


# --- the page -----------------------------------------------------------------------------


def _tables(everything: list[Measured], expected: dict, ratio: dict | None) -> list[Table]:
    def shown(n):
        return "-" if n is None else format_bytes(n)

    memory = Table(
        "Memory per device: the ZeRO paper against XLA's memory analysis",
        [
            "target",
            "strategy",
            "paper: params",
            "paper: grads",
            "paper: optimizer",
            "paper: total",
            "XLA: state (arguments - batch)",
            "XLA: gradients",
            "XLA: whole step",
        ],
        [
            [
                m.target,
                m.strategy,
                *(format_bytes(x) for x in (e.states.params, e.states.grads, e.states.optimizer, e.states.total)),
                shown(m.state_bytes),
                shown(m.grad_bytes),
                shown(m.step_bytes),
            ]
            for m in everything
            for e in [expected[m.target, m.strategy]]
        ],
        note="XLA's whole step adds what the paper leaves out: activations, "
        "each layer's gathered weights, and the whole-size partial-sum "
        "gradient a device computes before the reduction.",
    )
    traffic = Table(
        "Bytes per device per step: S per collective kind, and bytes sent on a ring",
        [
            "target",
            "strategy",
            "paper: S per kind",
            "XLA: S per kind (element type)",
            "paper: bytes sent",
            "XLA: bytes sent",
        ],
        [
            [
                m.target,
                m.strategy,
                _kinds(e.moved),
                f"{_kinds(m.moved)} ({'/'.join(m.dtypes)})",
                format_bytes(e.sent),
                format_bytes(m.sent),
            ]
            for m in everything
            for e in [expected[m.target, m.strategy]]
        ],
    )
    per_axis = Table(
        "Collectives per axis in the compiled step (loops counted by trip count)",
        ["target", "strategy", "kind", "axes", "runs per step", "S per step"],
        [
            [m.target, m.strategy, kind, ",".join(axes), runs, format_bytes(size)]
            for m in everything
            for kind, axes, runs, size in m.rows
        ],
    )
    tables = [memory, traffic, per_axis]
    timed = [m for m in everything if m.step is not None]
    if timed:
        rows = [[m.strategy, f"{m.devices} devices", str(m.step)] for m in timed]
        if ratio:
            rows += [
                [f"zero3 ({ratio['model']} model)", f"{ratio['devices']} devices", str(ratio["sharded"])],
                [f"zero3 ({ratio['model']} model)", "1 device", str(ratio["single"])],
                [f"goal: {ratio['devices']}-device step / 1-device step ≤ 1.25", "medians", f"{ratio['ratio']:.2f}"],
                ["the same, fastest steps", "minima", f"{ratio['sharded'].min / ratio['single'].min:.2f}"],
            ]
        tables.append(Table("Step time on this target (median [min, max])", ["strategy", "devices", "time"], rows))
    return tables


def _kinds(moved: dict[str, float]) -> str:
    return ", ".join(f"{kind} {format_bytes(size)}" for kind, size in sorted(moved.items())) or "none"


def _plot(everything: list[Measured], expected: dict):
    targets = list(dict.fromkeys(m.target for m in everything))
    strategies, x = list(STRATEGIES), range(len(STRATEGIES))
    by = {(m.target, m.strategy): m for m in everything}
    timed = [by[targets[0], s] for s in strategies if by[targets[0], s].step is not None]
    figure = Figure(figsize=(16 if timed else 11, 4.2))
    axes = figure.subplots(1, 3 if timed else 2)
    width = 0.25
    main = targets[0]
    axes[0].bar(
        [i - width for i in x],
        [expected[main, s].states.total / 1024 for s in strategies],
        width,
        label="paper: model states (16Ψ ... 16Ψ/N)",
    )
    axes[0].bar(
        list(x),
        [(by[main, s].state_bytes + (by[main, s].grad_bytes or 0)) / 1024 for s in strategies],
        width,
        label=f"{main}: state + gradients",
    )
    axes[0].bar(
        [i + width for i in x],
        [by[main, s].step_bytes / 1024 for s in strategies],
        width,
        label=f"{main}: whole step",
        alpha=0.6,
    )
    axes[0].set(title="memory per device", ylabel="KiB", xticks=list(x), xticklabels=strategies)
    bar = 0.8 / (1 + len(targets))
    axes[1].bar([i - 0.4 + bar / 2 for i in x], [expected[main, s].sent / 1024 for s in strategies], bar, label="paper")
    for k, target in enumerate(targets, 1):
        axes[1].bar(
            [i - 0.4 + bar / 2 + k * bar for i in x],
            [by[target, s].sent / 1024 for s in strategies],
            bar,
            label=f"{target}: HLO",
        )
    axes[1].set(title="bytes sent per device per step (ring)", ylabel="KiB", xticks=list(x), xticklabels=strategies)
    if timed:
        medians = [m.step.median * 1e3 for m in timed]
        spread = [
            [(m.step.median - m.step.min) * 1e3 for m in timed],
            [(m.step.max - m.step.median) * 1e3 for m in timed],
        ]
        axes[2].bar(list(x), medians, yerr=spread, capsize=3)
        axes[2].set(
            title=f"step time on {main}", ylabel="ms (median, min to max)", xticks=list(x), xticklabels=strategies
        )
    for ax in axes[:2]:
        ax.legend(fontsize=7)
    for ax in axes:
        ax.tick_params(axis="x", labelsize=8)
    figure.tight_layout()
    return figure


def _summary(
    measured: list[Measured], tpu: list[Measured], expected: dict, ratio: dict | None, model: ModelConfig
) -> str:
    by = {m.strategy: m for m in measured}
    target, n = measured[0].target, measured[0].devices

    def paper(s):
        e = expected[target, s].states
        return format_bytes(e.params + e.optimizer)

    text = (
        f"On {target} ({n} devices, Ψ = {model.parameters:,} parameters, "
        f"{'bf16' if expected[target, 'ddp'].itemsize == 2 else 'f32'} working "
        "weights) "
        f"XLA's persistent state per device is {format_bytes(by['ddp'].state_bytes)} "
        f"for DDP, {format_bytes(by['zero1'].state_bytes)} for ZeRO-1 and "
        f"{format_bytes(by['zero3'].state_bytes)} for ZeRO-3 (the paper: "
        f"{paper('ddp')}, {paper('zero1')}, {paper('zero3')}), and the gradients "
        f"{format_bytes(by['ddp'].grad_bytes)} for DDP against {format_bytes(by['zero2'].grad_bytes)} "
        "for ZeRO-2 (the paper: "
        f"{format_bytes(expected[target, 'ddp'].states.grads)}, "
        f"{format_bytes(expected[target, 'zero2'].states.grads)}). "
        f"ZeRO-3 sends {by['zero3'].sent / by['ddp'].sent:.2f}x DDP's bytes "
        f"per step here, and {by['zero3-keep'].sent / by['ddp'].sent:.2f}x "
        "when it keeps the "
        f"gathered weights; the paper says 1.5x when every weight is gathered twice, "
        f"{expected[target, 'zero3'].sent / expected[target, 'ddp'].sent:.2f}x "
        "for this model, whose embeddings stay gathered through the backward."
    )
    if tpu:
        tb = {m.strategy: m for m in tpu}
        text += f" Compiled for {tpu[0].target}, ZeRO-3 sends {tb['zero3'].sent / tb['ddp'].sent:.2f}x DDP's bytes."
    if ratio:
        text += (
            f" The {ratio['devices']}-device ZeRO-3 step of the {ratio['model']} "
            f"model took {ratio['ratio']:.2f}x the 1-device step "
            f"({ratio['sharded'].median * 1e3:.1f} ms against {ratio['single'].median * 1e3:.1f} "
            f"ms; {ratio['sharded'].min / ratio['single'].min:.2f}x comparing "
            "the fastest steps; "
            f"the goal is at most 1.25)."
        )
    return text


def _notes(measured: list[Measured], tpu: list[Measured], expected: dict, model: ModelConfig) -> list[str]:
    by = {m.strategy: m for m in measured}
    target, notes = measured[0].target, []
    for m in (by["ddp"], by["zero3"]):
        reason = _explanation(expected[target, m.strategy], m)
        if reason:
            notes.append(f"{target} {m.strategy}: {reason}.")
    if tpu:
        tb = {m.strategy: m for m in tpu}
        notes.append(
            f"{tpu[0].target}: the same ZeRO-3 program reduce-scatters "
            f"{format_bytes(tb['zero3'].moved.get('reduce-scatter', 0))} and "
            "all-reduces "
            f"{format_bytes(tb['zero3'].moved.get('all-reduce', 0))} per step, "
            "and ZeRO-1 (whole gradients, then a slice) reduce-scatters "
            f"{format_bytes(tb['zero1'].moved.get('reduce-scatter', 0))}: "
            "the TPU compiler turns an all-reduce whose result is only sliced "
            "into a reduce-scatter, "
            f"where the {target} compiler keeps the all-reduce and the slice."
        )
        if any(m.assumed_loops for m in tpu):
            notes.append(
                f"{tpu[0].target}: the TPU HLO prints no trip count for the "
                f"layer loop; its collectives are counted {model.layers} times "
                "(the scan's length)."
            )
    notes.append(
        f"ZeRO-2's saving is the gradient *buffer* ({format_bytes(by['zero2'].grad_bytes)} "
        f"against ZeRO-1's {format_bytes(by['zero1'].grad_bytes)}); "
        "inside one step XLA still computes each device's whole-size partial-sum "
        "gradient before reducing it, so the whole step holds "
        f"{format_bytes(by['zero2'].step_bytes)} against {format_bytes(by['zero1'].step_bytes)}. "
        "With micro-batches the buffer is what persists between them."
    )
    notes.append(
        "Keeping the gathered weights (zero3-keep) saves the second all-gather "
        f"({format_bytes(by['zero3'].moved.get('all-gather', 0) - by['zero3-keep'].moved.get('all-gather', 0))} "
        f"of S per step) and costs whole-step memory: {format_bytes(by['zero3-keep'].step_bytes)} "
        f"against {format_bytes(by['zero3'].step_bytes)}."
    )
    return notes


def _as_data(m: Measured) -> dict:
    return {
        "strategy": m.strategy,
        "target": m.target,
        "devices": m.devices,
        "state_bytes": m.state_bytes,
        "grad_bytes": m.grad_bytes,
        "step_bytes": m.step_bytes,
        "moved": m.moved,
        "moved_in_working_dtype": m.moved_in_working_dtype,
        "sent": m.sent,
        "dtypes": m.dtypes,
        "rows": [list(r) for r in m.rows],
        "step_s": None if m.step is None else {"median": m.step.median, "min": m.step.min, "max": m.step.max},
    }


def _ratio_data(ratio: dict | None) -> dict | None:
    if ratio is None:
        return None
    return {
        "model": ratio["model"],
        "devices": ratio["devices"],
        "ratio": ratio["ratio"],
        "sharded_s": ratio["sharded"].median,
        "single_s": ratio["single"].median,
    }
