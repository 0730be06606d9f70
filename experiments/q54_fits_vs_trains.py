"""It fits versus it trains: rematerialization, micro-batching and host offload as memory against step time.

Question #54: why are "it fits" and "it trains" different problems? Every way
of making a step fit in less device memory (recomputing activations instead
of keeping them, splitting the batch into micro-batches, moving saved
activations to host memory) costs time. The page compiles the same ZeRO-3
step under each combination, reads the memory XLA needs per device and the
FLOPs its cost model counts, times each step, and plots memory against time:
the cheapest configuration in memory is rarely the one worth training with.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from matplotlib.figure import Figure

from lab.bench import Timing
from lab.devices import DEFAULT_TARGET, devices_for, parse_target
from lab.mesh import MeshSpec
from lab.model import ModelConfig, preset
from lab.progress import track
from lab.report import Result, Table, provenance
from lab.training.step import TrainConfig, Trainer
from lab.units import format_bytes
from lab.verdict import check

QUESTION = "#54"


@dataclass(frozen=True)
class Config:
    target: str = DEFAULT_TARGET
    """where to run: cpu:N, gpu, tpu, or tpu:<gen>:<topology> (compile-only: memory, no times)"""
    model: str = "tiny"
    """model preset (lab.model.PRESETS)"""
    strategy: str = "zero3"
    """data-parallel strategy (lab.rules.STRATEGIES)"""
    global_batch: int = 64
    """sequences per step"""
    remat: tuple[str, ...] = ("none", "dots", "full")
    """rematerialization policies: save everything, save matmul outputs, save only each block's input"""
    micro_batches: tuple[int, ...] = (1, 2, 4)
    """micro-batch counts (gradient accumulation) to combine with each policy"""
    offload: bool = True
    """also offload the weight-matmul outputs to host memory (remat policy "offload") where devices have pinned_host"""
    repeats: int = 3
    """timed steps per configuration, after one warm-up step"""


@dataclass(frozen=True)
class Point:
    remat: str
    micro_batches: int
    device_bytes: int  # arguments + temporaries + unaliased outputs (or the compiler's peak)
    temp_bytes: int
    host_bytes: int  # host-memory temporaries and arguments, where the compiler reports them
    flops: float  # XLA's cost analysis (a loop body counted once)
    step: Timing | None

    @property
    def label(self) -> str:
        return f"{self.remat}, M={self.micro_batches}"


def run(config: Config) -> Result:
    devices = devices_for(config.target)
    model = preset(config.model)
    mesh = MeshSpec(fsdp=len(devices)).build(devices)
    timed = not parse_target(config.target).compile_only
    grid = list(itertools.product(config.remat, config.micro_batches))
    if config.offload and _has_host_memory(devices):
        grid.append(("offload", 1))
    start = _host_state(model, config, mesh) if timed else None
    points = [_point(model, config, mesh, remat, m, start) for remat, m in track(grid, "remat x micro-batches")]
    checks = _checks(points, model, config, len(devices))
    return Result(
        summary=_summary(points, config),
        theory=THEORY,
        tables=[_table(points)],
        checks=checks,
        plots={"fits_vs_trains": _plot(points, config)} if timed else {},
        notes=_notes(points, model, config),
        provenance=provenance(target=config.target, devices=devices, mesh=f"fsdp={len(devices)}"),
        data={"points": [{**p.__dict__, "step": None if p.step is None else p.step.median} for p in points]},
    )


def _has_host_memory(devices) -> bool:
    return any(getattr(m, "kind", "") == "pinned_host" for m in devices[0].addressable_memories())


def _host_state(model: ModelConfig, config: Config, mesh):
    """One initial state for every configuration: remat and micro-batching change the program, not the state."""
    import jax
    import numpy as np

    return jax.tree.map(np.asarray, Trainer(model, TrainConfig(strategy=config.strategy), mesh).init())


def _point(model: ModelConfig, config: Config, mesh, remat: str, micro: int, start) -> Point:
    trainer = Trainer(model, TrainConfig(strategy=config.strategy, remat=remat, micro_batches=micro), mesh)
    step = trainer.inspect_step(config.global_batch)
    memory = step.memory
    device = max(
        memory["argument_size"] + memory["temp_size"] + memory["output_size"] - memory["alias_size"],
        memory.get("peak_memory", 0),
    )
    return Point(
        remat=remat,
        micro_batches=micro,
        device_bytes=device,
        temp_bytes=memory["temp_size"],
        host_bytes=memory.get("host_temp_size", 0) + memory.get("host_argument_size", 0),
        flops=step.cost.get("flops", 0.0),
        step=trainer.time_step(config.global_batch, repeats=config.repeats, warmup=1, start=start)
        if start is not None
        else None,
    )


def frontier(points: list[Point]) -> list[Point]:
    """The Pareto frontier: points no other point beats in both memory and step time, by memory."""
    timed = sorted((p for p in points if p.step is not None), key=lambda p: (p.device_bytes, p.step.median))
    best, out = math.inf, []
    for p in timed:
        if p.step.median < best:
            out.append(p)
            best = p.step.median
    return out


# --- theory -----------------------------------------------------------------------------

THEORY = r"""
Per device, a training step holds the model states (weights, gradients, optimizer: 16Ψ/N under ZeRO-3) plus
what the backward pass needs from the forward: the *residuals*. Korthikanti et al. (2022), "Reducing Activation
Recomputation in Large Transformer Models", Section 4: per layer the residuals grow with the micro-batch's tokens
b·s (and with s² for attention scores), so

- **micro-batching** (gradient accumulation over M micro-batches) divides the residuals by M at the same global
  batch: memory ≈ a + r/M, where a does not depend on M; time grows once the per-micro-batch matmuls are too
  small to keep the device busy, and ZeRO-3 gathers the weights again for every micro-batch.
- **rematerialization** (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost"; `jax.checkpoint`):
  *full* keeps only each block's input and recomputes the block in the backward pass; *dots* keeps the matmul
  outputs and recomputes the cheap elementwise work. Full recompute adds the forward FLOPs of every matmul whose
  output the backward needs: per token and layer, the q, k, v projections (3·2DHK), the attention scores and
  their mix (2·2SHK) and the first MLP matmul (2DF); the output projections feed only the residual stream and
  are not recomputed:  ΔFLOPs = tokens · (6DHK + 4SHK + 2DF) per layer.
- **host offload** moves saved residuals to host memory and back over PCIe: device memory for transfer time.

XLA's cost analysis counts the body of a `while` loop once, whatever its trip count (the layer scan and the
micro-batch scan are loops), so FLOPs are compared per loop body: one layer, one micro-batch.
"""


def _recompute_flops(model: ModelConfig, config: Config, devices: int) -> float:
    """ΔFLOPs of full remat for one layer and one micro-batch on one device (see the theory)."""
    tokens = config.global_batch // devices * model.seq  # micro-batches = 1
    d, hk, s, f = model.embed, model.heads * model.head_dim, model.seq, model.mlp
    return tokens * (6 * d * hk + 4 * s * hk + 2 * d * f)


def _checks(points: list[Point], model: ModelConfig, config: Config, devices: int) -> list:
    at = {(p.remat, p.micro_batches): p for p in points}
    rows = []
    if {("none", 1), ("dots", 1), ("full", 1)} <= set(at):
        order = sorted(("none", "dots", "full"), key=lambda r: -at[r, 1].temp_bytes)
        rows.append(check("temporaries per device, largest first (M=1)", "none, dots, full", ", ".join(order)))
        rows.append(
            check(
                "full remat: extra FLOPs per layer and micro-batch",
                _recompute_flops(model, config, devices),
                at["full", 1].flops - at["none", 1].flops,
                rtol=0.15,
                explained=None,
            )
        )
    for remat in config.remat:
        ms = sorted(m for r, m in at if r == remat)
        if len(ms) >= 3:
            first, middle, last = (at[remat, m] for m in (ms[0], ms[1], ms[-1]))
            residuals = (first.temp_bytes - last.temp_bytes) / (1 / ms[0] - 1 / ms[-1])
            predicted = last.temp_bytes - residuals / ms[-1] + residuals / ms[1]
            rows.append(
                check(
                    f"{remat}: temporaries at M={ms[1]} from a + r/M fitted at M={ms[0]} and M={ms[-1]}, bytes",
                    predicted,
                    middle.temp_bytes,
                    rtol=0.1,
                )
            )
    return rows


# --- the page ------------------------------------------------------------------------------


def _table(points: list[Point]) -> Table:
    on_frontier = {p.label for p in frontier(points)}
    return Table(
        "Each configuration: memory per device (XLA's memory analysis), "
        "FLOPs (XLA's cost analysis, loop bodies once) and step time",
        [
            "remat",
            "micro-batches",
            "device memory",
            "of which temporaries",
            "host memory",
            "FLOPs",
            "step time",
            "on the frontier",
        ],
        [
            [
                p.remat,
                p.micro_batches,
                format_bytes(p.device_bytes),
                format_bytes(p.temp_bytes),
                format_bytes(p.host_bytes),
                f"{p.flops:.4g}",
                str(p.step) if p.step else "-",
                "yes" if p.label in on_frontier else "",
            ]
            for p in points
        ],
    )


def _plot(points: list[Point], config: Config):
    figure = Figure(figsize=(7.5, 4.8))
    ax = figure.subplots()
    markers = {"none": "o", "dots": "s", "full": "^", "offload": "D"}
    for p in points:
        ax.scatter(
            p.device_bytes / 2**20,
            p.step.median * 1e3,
            marker=markers.get(p.remat, "x"),
            s=30 + 25 * p.micro_batches,
            label=p.label,
        )
        ax.annotate(
            p.label,
            (p.device_bytes / 2**20, p.step.median * 1e3),
            fontsize=7,
            xytext=(4, 3),
            textcoords="offset points",
        )
    line = frontier(points)
    ax.plot(
        [p.device_bytes / 2**20 for p in line],
        [p.step.median * 1e3 for p in line],
        "k--",
        linewidth=1,
        label="frontier",
    )
    ax.set(
        xlabel="memory per device (MiB, XLA)",
        ylabel="step time (ms, median)",
        title=f"{config.strategy}, global batch {config.global_batch}: fits against trains",
    )
    ax.legend(fontsize=6, ncol=2)
    figure.tight_layout()
    return figure


def _summary(points: list[Point], config: Config) -> str:
    smallest = min(points, key=lambda p: p.device_bytes)
    largest = max(points, key=lambda p: p.device_bytes)
    text = (
        f"Under {config.strategy} with a global batch of {config.global_batch}, "
        f"the step needs from {format_bytes(smallest.device_bytes)} per device "
        f"({smallest.label}) to {format_bytes(largest.device_bytes)} ({largest.label}): "
        f"{largest.device_bytes / smallest.device_bytes:.1f}x."
    )
    timed = [p for p in points if p.step is not None]
    if timed:
        fastest = min(timed, key=lambda p: p.step.median)
        text += (
            f" The smallest configuration steps in {smallest.step.median * 1e3:.1f} "
            f"ms, {smallest.step.median / fastest.step.median:.2f}x the fastest "
            f"({fastest.label}, {fastest.step.median * 1e3:.1f} ms, {format_bytes(fastest.device_bytes)}). "
            "Fitting is a memory question; training is the "
            "step time at the memory you can afford, which the frontier below "
            f"answers: {len(frontier(points))} of {len(timed)} configurations "
            "are on it."
        )
    return text


def _notes(points: list[Point], model: ModelConfig, config: Config) -> list[str]:
    notes = []
    at = {(p.remat, p.micro_batches): p for p in points}
    if ("offload", 1) in at and ("none", 1) in at:
        off = at["offload", 1]
        notes.append(
            f"offload: XLA reports {format_bytes(off.host_bytes)} of host "
            f"memory and {format_bytes(off.temp_bytes)} of device temporaries "
            f"(none: {format_bytes(at['none', 1].temp_bytes)})"
            + (
                "; on this CPU target the 'host' is the same memory, so offload can only cost time here."
                if config.target.startswith("cpu")
                else "."
            )
        )
    ms = sorted(m for r, m in at if r == "none")
    if len(ms) > 1:
        notes.append(
            "XLA's cost analysis counts a loop body once: the same global "
            f"batch counts {at['none', ms[0]].flops:.4g} FLOPs with {ms[0]} "
            "micro-batch(es) "
            f"and {at['none', ms[-1]].flops:.4g} with {ms[-1]}, though the "
            "work is the same; hence the per-layer, per-micro-batch comparison."
        )
    if (
        ("full", 1) in at
        and ("none", 1) in at
        and at["full", 1].step
        and at["full", 1].step.median < at["none", 1].step.median
    ):
        notes.append(
            "On this target full recompute is faster than saving everything "
            f"({at['full', 1].step.median * 1e3:.1f} ms against {at['none', 1].step.median * 1e3:.1f} "
            "ms) "
            "although it recomputes each block's forward: writing and reading "
            f"back {format_bytes(at['none', 1].temp_bytes)} of temporaries "
            "instead of "
            f"{format_bytes(at['full', 1].temp_bytes)} costs this CPU more "
            "than the extra arithmetic of so small a model."
        )
    return notes
