"""It fits versus it trains: rematerialization, micro-batching and host offload as memory against step time.

Question #54: why are "it fits" and "it trains" different problems? Every way
of making a step fit in less device memory (recomputing activations instead
of keeping them, splitting the batch into micro-batches, moving saved
activations to host memory) costs time. The page compiles the same ZeRO-3
step under each combination, reads the memory XLA needs per device and the
matmul FLOPs of the compiled HLO, times each step, and plots memory against
time: the cheapest configuration in memory is rarely the one worth training
with.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from functools import partial

from matplotlib.figure import Figure

from lab.bench import Timing
from lab.hlo.schedule import flops, parse_schedule
from lab.mesh import MeshSpec
from lab.model import ModelConfig, preset
from lab.progress import track
from lab.provenance import Setup
from lab.report import Result, Table
from lab.targets.devices import DEFAULT_TARGET, devices_for, parse_target
from lab.training.step import TrainConfig, Trainer
from lab.units import format_bytes
from lab.verdict import Check, Claim, check

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
    """One configuration as XLA compiled it (and, on real devices, as it ran)."""

    remat: str
    micro_batches: int
    memory: dict[str, int]  # XLA's memory analysis per device (argument_size, temp_size, ..., peak_memory)
    cost_flops: float  # XLA's cost analysis: a loop body counted once, whatever its trip count
    matmul_flops: float  # dots and convolutions of the optimized HLO, a loop body times its trip count
    step: Timing | None = None

    @property
    def label(self) -> str:
        return f"{self.remat}, M={self.micro_batches}"

    @property
    def device_bytes(self) -> int:
        """Arguments + temporaries + outputs not aliased to an argument, or the compiler's peak where larger."""
        m = self.memory
        return max(m["argument_size"] + m["temp_size"] + m["output_size"] - m["alias_size"], m.get("peak_memory", 0))

    @property
    def temp_bytes(self) -> int:
        return self.memory["temp_size"]

    @property
    def host_bytes(self) -> int:
        return self.memory.get("host_temp_size", 0) + self.memory.get("host_argument_size", 0)


@dataclass(frozen=True)
class Observations:
    setup: Setup
    devices: int
    points: dict[str, tuple[Point, ...]]  # remat policy -> its configurations, in micro-batch order

    def all_points(self) -> list[Point]:
        return [p for points in self.points.values() for p in points]


# --------------------------------------------------------------------------- measure


def measure(config: Config) -> Observations:
    devices = devices_for(config.target)
    model = preset(config.model)
    mesh = MeshSpec(fsdp=len(devices)).build(devices)
    timed = not parse_target(config.target).compile_only
    grid = list(itertools.product(config.remat, config.micro_batches))
    if config.offload and _has_host_memory(devices):
        grid.append(("offload", 1))
    start = _host_state(model, config, mesh) if timed else None
    points: dict[str, tuple[Point, ...]] = {}
    for remat, m in track(grid, "remat x micro-batches"):
        points[remat] = (*points.get(remat, ()), _point(model, config, mesh, remat, m, start))
    return Observations(
        setup=Setup.of(config.target, devices, f"fsdp={len(devices)}"), devices=len(devices), points=points
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
    schedule = parse_schedule(step.optimized_hlo)
    return Point(
        remat=remat,
        micro_batches=micro,
        memory={k: int(v) for k, v in step.memory.items()},
        cost_flops=float(step.cost.get("flops", 0.0)),
        matmul_flops=float(sum(flops(schedule, schedule.entry, i) for i in schedule.computations[schedule.entry])),
        step=trainer.time_step(config.global_batch, repeats=config.repeats, warmup=1, start=start)
        if start is not None
        else None,
    )


# --------------------------------------------------------------------------- judge


def judge(obs: Observations, config: Config) -> Result:
    model = preset(config.model)
    points = obs.all_points()
    timed = any(p.step is not None for p in points)
    checks = _checks(points, model, config, obs.devices)
    return Result(
        summary=_summary(points, config),
        theory=THEORY,
        tables=[_table(points, model, config, obs.devices)],
        checks=checks,
        claims=_claims(points),
        plots={"fits_vs_trains": partial(_plot, points, config)} if timed else {},
        notes=_notes(points, model, config),
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


THEORY = r"""
Per device, a training step holds the model states (weights, gradients, optimizer: 16Ψ/N under ZeRO-3) plus
what the backward pass needs from the forward: the *residuals*. Korthikanti et al. (2022), "Reducing Activation
Recomputation in Large Transformer Models", Section 4: per layer the residuals grow with the micro-batch's tokens
b·s (and with s² for attention scores), so

- **micro-batching** (gradient accumulation over M micro-batches) divides the residuals by M at the same global
  batch: memory ≈ a + r/M, where a does not depend on M; the matmul work per step stays the same, spread over
  M smaller matmuls, and ZeRO-3 gathers the weights again for every micro-batch.
- **rematerialization** (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost"; `jax.checkpoint`):
  *full* keeps only each block's input and recomputes the block in the backward pass; *dots* keeps the weight
  matmuls' outputs (MaxText's *minimal*) and recomputes the attention's scores and the cheap elementwise work;
  *offload* keeps the weight matmuls' outputs in host memory and recomputes the rest.
- **host offload** moves saved residuals to host memory and back over PCIe: device memory for transfer time.

**Matmul FLOPs per step** (T tokens per device, L layers, vocabulary V, width D, H·K attention width, sequence
S, MLP width F; a matmul of an [m, k] by a [k, n] costs 2mkn, its backward twice that): the forward per token
is the one-hot embedding 2VD, per layer the projections q, k, v, o 8DHK, the scores and their mix 4SHK, the MLP
4DF, and the unembedding 2DV; the backward doubles every matmul except the embedding's (its input, a one-hot of
integers, needs no gradient):

    FLOPs = T · (10VD + 3L(8DHK + 4SHK + 4DF))

Recomputation adds, per token and layer, the forward of every matmul whose output the backward reads:

- *full*: q, k, v (6DHK), the scores and their mix (4SHK), the attention output projection (2DHK: its output
  is the input of the MLP's norm, which the backward differentiates) and the MLP's first matmul (2DF); the
  MLP's second matmul only adds to the block's output, which nothing in the block's backward reads:
  ΔFLOPs = T·L·(8DHK + 4SHK + 2DF);
- *dots* and *offload*: the scores and their mix, the two matmuls with a batch dimension (4SHK), which
  `checkpoint_dots_with_no_batch_dims` does not save and `offload_dot_with_no_batch_dims` neither saves nor
  offloads: ΔFLOPs = T·L·4SHK.

XLA's own cost analysis counts the body of a `while` loop once, whatever its trip count (the layer scan and the
micro-batch scan are loops), so its FLOPs are not the step's; the page counts the dots of the compiled HLO with
each loop's trip count (`lab.hlo.schedule.flops`) and shows XLA's number beside them.
"""

_EXTRA = {  # recomputed matmuls per token and layer, in units of (DHK, SHK, DF)
    "none": (0, 0, 0),
    "dots": (0, 4, 0),
    "full": (8, 4, 2),
    "offload": (0, 4, 0),
}


def matmul_flops(model: ModelConfig, remat: str, tokens: int) -> float | None:
    """The theory's matmul FLOPs of one training step on `tokens` tokens (None: a remat policy it does not price)."""
    if remat not in _EXTRA:
        return None
    v, d, hk, s, f, layers = model.vocab, model.embed, model.heads * model.head_dim, model.seq, model.mlp, model.layers
    a, b, c = _EXTRA[remat]
    per_layer = 3 * (8 * d * hk + 4 * s * hk + 4 * d * f) + a * d * hk + b * s * hk + c * d * f
    return float(tokens * (10 * v * d + layers * per_layer))


def _tokens(model: ModelConfig, config: Config, devices: int) -> int:
    return config.global_batch // devices * model.seq


def _checks(points: list[Point], model: ModelConfig, config: Config, devices: int) -> list[Check]:
    at = {(p.remat, p.micro_batches): p for p in points}
    rows = []
    if not model.experts:  # the closed form is a dense transformer's
        tokens = _tokens(model, config, devices)
        for p in points:
            theory = matmul_flops(model, p.remat, tokens)
            if theory is not None:
                rows.append(
                    check(
                        f"{p.label}: matmul FLOPs per step (HLO dots, loops by trip count)",
                        theory,
                        p.matmul_flops,
                        kind="exact",
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
                    kind="model",
                    rtol=0.1,
                    basis="a two-term memory model fitted on two points and judged on a third; XLA's buffer "
                    "assignment reuses and aligns buffers, which a + r/M does not model: 10%",
                )
            )
    return rows


def _claims(points: list[Point]) -> list[Claim]:
    claims = []
    at = {(p.remat, p.micro_batches): p for p in points}
    timed = [p for p in points if p.step is not None]
    if timed:
        smallest = min(timed, key=lambda p: p.device_bytes)
        fastest = min(timed, key=lambda p: p.step.median)
        ratio = smallest.step.median / fastest.step.median
        status = "confirmed" if ratio >= 1.25 else "refuted" if ratio < 1.05 else "refined"
        claims.append(
            Claim(
                "Fitting is not training: the configuration that needs the least memory is not the one that "
                "trains fastest",
                status,
                f"least memory: {smallest.label} ({format_bytes(smallest.device_bytes)}) steps in "
                f"{smallest.step.median * 1e3:.1f} ms, {ratio:.2f}x the fastest ({fastest.label}: "
                f"{fastest.step.median * 1e3:.1f} ms, {format_bytes(fastest.device_bytes)}); confirmed from 1.25x",
            )
        )
    if ("none", 1) in at and ("full", 1) in at:
        none, full = at["none", 1], at["full", 1]
        memory, work = full.temp_bytes / none.temp_bytes, full.matmul_flops / none.matmul_flops
        saved = [r for r in ("none", "dots", "full") if (r, 1) in at]
        ordered = saved == sorted(saved, key=lambda r: -at[r, 1].temp_bytes)
        status = "confirmed" if memory < 1 and work > 1 and ordered else "refuted"
        numbers = (
            f"full remat at M=1: {memory:.2f}x the temporaries ({format_bytes(full.temp_bytes)} against "
            f"{format_bytes(none.temp_bytes)}) for {work:.2f}x the matmul FLOPs; temporaries "
            + " > ".join(f"{r} {format_bytes(at[r, 1].temp_bytes)}" for r in saved)
            + ("" if ordered else " is not the order saving less predicts")
        )
        if none.step and full.step:
            numbers += f"; step time {full.step.median / none.step.median:.2f}x on this target (not judged)"
        claims.append(Claim("Recomputation buys memory with compute", status, numbers))
    ms = sorted(m for r, m in at if r == "none")
    if len(ms) > 1:
        one, many = at["none", ms[0]], at["none", ms[-1]]
        status = "confirmed" if many.temp_bytes < one.temp_bytes else "refuted"
        numbers = (
            f"no remat: M={ms[-1]} needs {format_bytes(many.temp_bytes)} of temporaries against "
            f"{format_bytes(one.temp_bytes)} at M={ms[0]}, for the same global batch"
        )
        if one.step and many.step:
            numbers += f"; step time {many.step.median / one.step.median:.2f}x on this target (not judged)"
        claims.append(
            Claim("Smaller micro-batches (gradient accumulation) make a step fit in less memory", status, numbers)
        )
    return claims


# --------------------------------------------------------------------------- the page


def _table(points: list[Point], model: ModelConfig, config: Config, devices: int) -> Table:
    on_frontier = {p.label for p in frontier(points)}
    tokens = _tokens(model, config, devices)

    def theory(p: Point) -> str:
        value = None if model.experts else matmul_flops(model, p.remat, tokens)
        return "-" if value is None else f"{value:.4g}"

    return Table(
        "Each configuration: memory per device (XLA's memory analysis), matmul FLOPs per step (theory and the "
        "compiled HLO), XLA's cost-analysis FLOPs (loop bodies once) and step time",
        [
            "remat",
            "micro-batches",
            "device memory",
            "of which temporaries",
            "host memory",
            "matmul FLOPs: theory",
            "matmul FLOPs: HLO",
            "XLA cost analysis FLOPs",
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
                theory(p),
                f"{p.matmul_flops:.4g}",
                f"{p.cost_flops:.4g}",
                str(p.step) if p.step else "-",
                "yes" if p.label in on_frontier else "",
            ]
            for p in points
        ],
    )


def _plot(points: list[Point], config: Config) -> Figure:
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
    if timed and smallest.step is not None:
        fastest = min(timed, key=lambda p: p.step.median)
        text += (
            f" The smallest configuration steps in {smallest.step.median * 1e3:.1f} "
            f"ms, {smallest.step.median / fastest.step.median:.2f}x the fastest "
            f"({fastest.label}, {fastest.step.median * 1e3:.1f} ms, {format_bytes(fastest.device_bytes)}). "
            "Fitting is a memory question; training is the step time at the memory you can afford, which the "
            f"frontier below answers: {len(frontier(points))} of {len(timed)} configurations are on it."
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
        one, many = at["none", ms[0]], at["none", ms[-1]]
        notes.append(
            f"XLA's cost analysis counts a loop body once: the same global batch counts {one.cost_flops:.4g} FLOPs "
            f"with {ms[0]} micro-batch(es) and {many.cost_flops:.4g} with {ms[-1]}, where the compiled HLO's "
            f"matmuls, each loop counted by its trip count, are {one.matmul_flops:.4g} and "
            f"{many.matmul_flops:.4g}: the work is the same, so the FLOPs checks count the HLO's dots."
        )
    if model.experts:
        notes.append("The matmul-FLOPs closed form is a dense transformer's: this MoE model's FLOPs are not checked.")
    if ("full", 1) in at and ("none", 1) in at and at["full", 1].step and at["none", 1].step:
        full, none = at["full", 1], at["none", 1]
        notes.append(
            f"On this target full recompute stepped in {full.step.median * 1e3:.1f} ms against "
            f"{none.step.median * 1e3:.1f} ms for saving everything, for "
            f"{full.matmul_flops / none.matmul_flops:.2f}x the matmul FLOPs: writing and reading back "
            f"{format_bytes(none.temp_bytes)} of temporaries instead of {format_bytes(full.temp_bytes)} weighs "
            "against the extra arithmetic of so small a model on a CPU (one run's clock, not a check)."
        )
    return notes
