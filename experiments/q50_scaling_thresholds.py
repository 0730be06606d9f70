"""When does sharded training stop being compute-bound? Theory against the TPU compiler.

Question #50 asks why TP + FSDP beats making FSDP ever larger. The scaling
book's answer is a threshold: data parallelism and FSDP stay compute-bound
only while each chip has enough tokens, B/N > alpha / M_X (alpha = C / W_ici,
2550 on TPU v5p; M_X the torus axes the data axis spans), tensor parallelism
only while Y < M_Y·F / alpha, and FSDP x TP down to B/N > 4·alpha² / (M_X·M_Y·F)
with the best Y.

Here a transformer MLP block's training step (y = relu(x·W_in)·W_out, the
gradients of both weights and of the input) at realistic sizes is compiled by
the TPU compiler for a v5p slice, compile-only, under each strategy and a
sweep of per-chip batch. What is observed is the program the compiler wrote:
its FLOPs (XLA's cost analysis) and its collectives (kinds, bytes, the mesh
axes and so the torus links they use). Its compute time is those FLOPs at the
chip's peak, its communication time those collectives priced on their links
(`lab.targets.topology`, with hop latency); where the two cross is the threshold XLA's
own program has, next to the book's. Nothing here runs on a TPU: every time on
this page is a model of the compiled program, and the page says so.

`compile_mlp_step` and the pricing helpers below are shared with
`tp_fsdp_vs_fsdp`, which holds the global batch fixed and grows the slice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache, partial
from time import perf_counter

import jax
import jax.numpy as jnp
import matplotlib
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from matplotlib.figure import Figure

from experiments import kit
from lab import hlo, theory
from lab.mesh import MeshSpec
from lab.progress import track
from lab.provenance import Setup
from lab.report import Result, Table
from lab.targets.devices import parse_target, topology_devices
from lab.targets.hardware import ChipProfile, profile_for_device_kind
from lab.targets.topology import Placement, placement, predict
from lab.theory.scaling import fsdp_tp_comm_to_compute, fsdp_tp_min_batch_per_chip_at
from lab.units import format_bytes
from lab.verdict import Check, Claim, check

QUESTION = "#50"
COMPILE_ONLY = True  # runs on a TPU topology through libtpu, whatever target `lab report` uses

# strategy -> mesh spec; axis names from lab.mesh
STRATEGIES = {
    "data parallel": "data=-1",
    "FSDP": "fsdp=-1",
    "FSDP x TP": "fsdp=-1,tensor=4",
}
CROSSOVER_RTOL = 0.01
CROSSOVER_BASIS = (
    "the crossing is interpolated linearly in 1/(B/N), exact for a step whose weights' traffic is fixed and whose "
    "activations and FLOPs grow with B/N; the roofline adds the hop latency the bandwidth rule leaves out "
    "(under 0.5% of the communication at these sizes): 1%"
)
RATIO_RTOL = 0.02
RATIO_BASIS = (
    "the roofline prices each collective as max(hop latency, bytes / bandwidth), the bandwidth rule bytes over "
    "bandwidth alone; hop latency (1 us a hop) is under 2% of the communication at these sizes"
)


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
    benchmark_preset: str = ""
    """model preset whose ZeRO-3 training step is compiled and analysed for `benchmark_topology` (a clock of
    this machine, shown and not judged; empty to skip, as the report does: pod_predictions shows the compile
    seconds of full-size steps), e.g. 1b"""
    benchmark_topology: str = "v5p:8x8x16"
    pod_topologies: tuple[str, ...] = ("v5p:8x8x4",)
    """larger slices for the FSDP step at a fixed B/N (compile time grows with chips: v5p:8x8x16 takes ~10 s more)"""


# --------------------------------------------------------------------------- the compiled MLP step (shared)


@dataclass(frozen=True)
class MlpStep:
    """The MLP block's training step as the TPU compiler wrote it, for one mesh and batch (compile-only)."""

    spec: str  # as asked, "fsdp=-1,tensor=4"
    mesh: str  # as built, "fsdp=16,tensor=4"
    topology: str  # "v5p:4x4x4", with " x2 slices" across DCN
    chips: int
    batch_per_chip: int
    device_kind: str
    flops: float  # per chip, XLA's cost analysis of the partitioned module
    bytes_accessed: float  # per chip, the same
    collectives: tuple[kit.Seen, ...]
    placements: tuple[Placement, ...]  # where each mesh axis of size > 1, and each set a collective spans, sits

    @property
    def sizes(self) -> dict[str, int]:
        return MeshSpec.parse(self.mesh).sizes

    def where(self, axes) -> Placement | None:
        axes = tuple(axes or ())
        return next((p for p in self.placements if p.axes == axes), None)


@cache
def compile_mlp_step(spec: str, chips, *, embed: int, mlp: int, batch_per_chip: int, topology: str = "") -> MlpStep:
    """Compile the MLP block's training step over `spec` on `chips` (compile-only) and read what XLA wrote.

    Cached: a report compiles each program once (tp_fsdp_vs_fsdp's v5p:4x4x4 pair is a point of this sweep)."""
    mesh = MeshSpec.parse(spec).build(chips, explicit=False)
    n = mesh.devices.size
    step, (w_in, w_out), batch = _mlp_step(mesh, _axes_for(mesh))
    args = (
        jax.ShapeDtypeStruct((embed, mlp), jnp.bfloat16, sharding=w_in),
        jax.ShapeDtypeStruct((mlp, embed), jnp.bfloat16, sharding=w_out),
        jax.ShapeDtypeStruct((batch_per_chip * n, embed), jnp.bfloat16, sharding=batch),
    )
    inspection = hlo.inspect(step, *args, mesh=mesh)
    found = inspection.collectives
    sizes = dict(zip(mesh.axis_names, mesh.devices.shape))
    wanted = [(a,) for a, size in sizes.items() if size > 1] + [c.axes for c in found if c.axes]
    return MlpStep(
        spec=spec,
        mesh=",".join(f"{a}={s}" for a, s in sizes.items() if s > 1),
        topology=topology,
        chips=n,
        batch_per_chip=batch_per_chip,
        device_kind=mesh.devices.flat[0].device_kind,
        flops=float(inspection.cost.get("flops", 0.0)),
        bytes_accessed=float(inspection.cost.get("bytes accessed", 0.0)),
        collectives=kit.seen(found),
        placements=tuple(placement(mesh, axes) for axes in dict.fromkeys(wanted)),
    )


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


# --------------------------------------------------------------------------- pricing a compiled step (shared, pure)


def chip_of(step: MlpStep) -> ChipProfile:
    return profile_for_device_kind(step.device_kind)


def compute_s(step: MlpStep) -> float:
    """XLA's FLOPs at the chip's peak."""
    return step.flops / chip_of(step).peak_bf16_flops


def memory_s(step: MlpStep) -> float:
    return step.bytes_accessed / chip_of(step).hbm_bandwidth


def collective_costs(step: MlpStep) -> tuple[theory.CollectiveCost | None, ...]:
    """Each collective's cost on the links its mesh axes use (`lab.targets.topology.predict`); None within a chip."""
    chip = chip_of(step)
    out = []
    for c in step.collectives:
        where = step.where(c.axes) if c.axes else None
        out.append(predict(c.kind, c.size_bytes, where, chip) if where else None)
    return tuple(out)


def collective_seconds(step: MlpStep) -> tuple[float, ...]:
    """Each collective's predicted seconds per step (its runs per step included)."""
    return tuple(
        (c.repeats or 1) * (cost.seconds if cost else 0.0) for c, cost in zip(step.collectives, collective_costs(step))
    )


def communication_s(step: MlpStep, axis: str | None = None) -> float:
    """The collectives' predicted seconds, all of them or those spanning `axis`."""
    return sum(
        s for c, s in zip(step.collectives, collective_seconds(step)) if axis is None or (c.axes and axis in c.axes)
    )


def latency_share(step: MlpStep, axis: str | None = None) -> float:
    """How much of the communication time is hop latency rather than bytes over bandwidth."""
    total = latency = 0.0
    for c, cost in zip(step.collectives, collective_costs(step)):
        if cost and (axis is None or (c.axes and axis in c.axes)):
            total += (c.repeats or 1) * cost.seconds
            latency += (c.repeats or 1) * min(cost.latency_s, cost.seconds)
    return latency / total if total else 0.0


def ratio(step: MlpStep) -> float:
    """Communication over compute: above 1, communication-bound."""
    return communication_s(step) / compute_s(step)


def bound(step: MlpStep) -> str:
    terms = {"compute": compute_s(step), "memory": memory_s(step), "communication": communication_s(step)}
    return max(terms, key=terms.get)


def overlapped_s(step: MlpStep) -> float:
    """The step if everything overlapped perfectly: its largest term."""
    return max(compute_s(step), memory_s(step), communication_s(step))


def torus_axes(where: Placement | None) -> float:
    """The book's M for a set of mesh axes: the torus dimensions it spans, a line (no wraparound) counting half."""
    if where is None or where.network != "ici":
        return 1.0
    return sum(1.0 if wraps else 0.5 for wraps in where.wraps) or 1.0


def _bandwidth(step: MlpStep, c: kit.Seen) -> float | None:
    """Bytes per second a chip gets for `c` by the book's rule: M · W_ici on a torus (a collective-permute, a shift
    to a neighbour, one link one way: W_ici / 2), W_dcn across slices."""
    where, chip = step.where(c.axes), chip_of(step)
    if where is None or where.network == "chip":
        return None
    if where.network == "dcn":
        return chip.dcn_bandwidth
    if c.kind == "collective-permute":
        return chip.link_bandwidth
    return torus_axes(where) * 2 * chip.link_bandwidth


def bus_bytes(c: kit.Seen) -> float:
    """Bytes one chip sends for `c` per step: nccl-tests' bus factor of its group times S, times its runs."""
    group = c.group_size or 1
    factor = theory.bus_bandwidth_factor(c.kind, group) if group > 1 else 0.0
    return (c.repeats or 1) * factor * c.size_bytes


def group_mismatches(step: MlpStep) -> tuple[tuple[kit.Seen, int], ...]:
    """The collectives whose groups in the HLO are not the chips of the mesh axes they span, with that count.

    The bandwidth rule reads (N-1)/N from the HLO's groups and the roofline from the mesh: where the two disagree
    (a multi-slice program's groups hold one slice's share of the axis), the rule prices another collective than
    the roofline, and no refinement is made from it.
    """
    sizes = step.sizes
    out = []
    for c in step.collectives:
        if c.axes and c.kind != "collective-permute":
            chips = math.prod(sizes.get(a, 1) for a in c.axes)
            if c.group_size != chips:
                out.append((c, chips))
    return tuple(out)


def bandwidth_rule_s(step: MlpStep, activations: bool | None = None) -> float:
    """The book's rule applied to what XLA wrote: each collective's bytes over M · W_ici (W_dcn across slices), no
    latency. `activations`: only those over tensor (True), only the others (False), or all (None)."""
    total = 0.0
    for c in step.collectives:
        over_tensor = bool(c.axes and "tensor" in c.axes)
        bandwidth = _bandwidth(step, c)
        if bandwidth and (activations is None or activations == over_tensor):
            total += bus_bytes(c) / bandwidth
    return total


def bandwidth_rule_threshold(step: MlpStep) -> float:
    """Tokens per chip where XLA's program, priced by the book's rule, turns compute-bound: its weights' collectives
    cost the same at any B/N, its tensor collectives (activations) and its FLOPs grow with B/N."""
    b = step.batch_per_chip
    per_token = compute_s(step) / b - bandwidth_rule_s(step, activations=True) / b
    return bandwidth_rule_s(step, activations=False) / per_token if per_token > 0 else math.inf


def crossing(batches, ratios) -> float | None:
    """The B/N where communication / compute first falls from >= 1 to < 1, interpolated linearly in 1/(B/N).

    Per step the weights' collectives cost the same at any B/N while the activations' and the FLOPs grow with it,
    so the ratio is a + b/(B/N): a straight line in 1/(B/N), which this interpolation follows exactly.
    """
    for (b0, r0), (b1, r1) in zip(zip(batches, ratios), zip(batches[1:], ratios[1:])):
        if r0 >= 1 > r1:
            u0, u1 = 1 / b0, 1 / b1
            return 1 / (u0 + (1 - r0) / (r1 - r0) * (u1 - u0))
    return None


def expected_flops(step: MlpStep, embed: int, mlp: int) -> float:
    """The six matmuls of the block's step, 2·B·D·F each per chip: 12·(B/N)·D·F."""
    return 12 * step.batch_per_chip * embed * mlp


def flops_check(label: str, step: MlpStep, embed: int, mlp: int) -> Check:
    """XLA's FLOPs against the matmuls': a model, since XLA also counts the elementwise work around them."""
    return check(
        f"{label}: FLOPs per chip at B/N={step.batch_per_chip} (12·B·D·F/N)",
        expected_flops(step, embed, mlp),
        step.flops,
        kind="model",
        rtol=2 / embed + 1 / step.batch_per_chip,
        basis="12·B·D·F/N counts the matmuls; XLA also counts the elementwise ops (relu, its mask, the loss: "
        "under 24 per hidden element, 2/D of the matmuls') and the sums of the weight gradients' reductions "
        "(under 12 per weight element, 1/(B/N)): rtol 2/D + 1/(B/N)",
    )


# --------------------------------------------------------------------------- measure


@dataclass(frozen=True)
class Benchmark:
    """Seconds to compile a whole ZeRO-3 training step for a pod on this machine, and to read its HLO."""

    preset: str
    parameters: int
    topology: str
    chips: int
    compile_s: float
    analysis_s: float
    collectives: int


@dataclass(frozen=True)
class Observations:
    setup: Setup
    topology: str
    sweep: dict[str, tuple[MlpStep, ...]]  # strategy -> one step per batch per chip
    tensor: tuple[MlpStep, ...]  # data x tensor at the largest batch, one per tensor degree
    pods: tuple[MlpStep, ...]  # FSDP at 2048 tokens per chip on larger slices
    benchmark: Benchmark | None = None


def _topology(config: Config) -> str:
    target = parse_target(config.target)
    return target.topology if target.compile_only else Config.target.split(":", 1)[1]


def measure(config: Config) -> Observations:
    topology = _topology(config)
    chips = topology_devices(topology)
    shapes = {"embed": config.embed, "mlp": config.mlp}
    sweep = {
        name: tuple(
            compile_mlp_step(spec, chips, batch_per_chip=b, topology=topology, **shapes)
            for b in track(config.batch_per_chip, f"{name} on {topology}")
        )
        for name, spec in STRATEGIES.items()
    }
    tensor = tuple(
        compile_mlp_step(
            f"data=-1,tensor={y}", chips, batch_per_chip=config.batch_per_chip[-1], topology=topology, **shapes
        )
        for y in track(config.tensor_ways, "tensor parallel degrees")
    )
    pods = tuple(
        compile_mlp_step("fsdp=-1", topology_devices(t), batch_per_chip=2048, topology=t, **shapes)
        for t in track(config.pod_topologies, "pod sizes")
    )
    benchmark = (
        _compile_benchmark(config.benchmark_preset, config.benchmark_topology) if config.benchmark_preset else None
    )
    return Observations(
        setup=Setup.of(f"tpu:{topology}", chips, ", ".join(f"{k}: {v}" for k, v in STRATEGIES.items())),
        topology=topology,
        sweep=sweep,
        tensor=tensor,
        pods=pods,
        benchmark=benchmark,
    )


def _compile_benchmark(preset_name: str, topology: str) -> Benchmark:
    """Seconds to compile a whole ZeRO-3 training step for a pod, and to read its collectives."""
    from lab.model import preset
    from lab.training.step import TrainConfig, Trainer

    model = preset(preset_name)
    mesh = MeshSpec(fsdp=-1).build(topology_devices(topology))
    trainer = Trainer(model, TrainConfig(strategy="zero3", param_dtype="bfloat16", compute_dtype="bfloat16"), mesh)
    started = perf_counter()
    compiled = trainer.compiled_step(mesh.devices.size)  # one sequence per chip
    compiled_at = perf_counter()
    found = hlo.inspect_compiled(compiled, mesh).collectives
    return Benchmark(
        preset_name,
        int(model.parameters),
        topology,
        int(mesh.devices.size),
        compiled_at - started,
        perf_counter() - compiled_at,
        len(found),
    )


# --------------------------------------------------------------------------- judge


def judge(obs: Observations, config: Config) -> Result:
    thresholds = {name: _threshold(name, steps, config) for name, steps in obs.sweep.items()}
    checks = _checks(obs, thresholds, config)
    return Result(
        summary=_summary(obs, thresholds),
        theory=THEORY,
        tables=[
            _sweep_table(obs),
            _threshold_table(thresholds),
            _tensor_table(obs, config),
            _pod_table(obs),
            _collectives_table(obs),
            *([_benchmark_table(obs.benchmark)] if obs.benchmark else []),
        ],
        checks=checks,
        claims=_claims(thresholds),
        plots={"ratio": partial(_plot, obs, thresholds)},
        notes=_notes(obs, thresholds),
    )


THEORY = r"""
Per chip and per step of an MLP block with B tokens, width D and MLP width F on N chips (the scaling book, Part 5):
compute is 12·B·D·F / N FLOPs (two matmuls forward, four backward), at C FLOP/s;
data parallelism all-reduces the 2·D·F weight gradients; FSDP gathers the weights and reduce-scatters their
gradients; tensor parallelism moves activations of size B·D / X instead. With α = C / W_ici (W_ici: both directions
of one torus axis; 2550 on v5p) and M the torus axes a mesh axis spans, per pass over the layer the weights cost
4DF / (Y·W_ici·M_X), the activations 4BD / (X·W_ici·M_Y) and the matmuls 4BDF / (N·C), so

    T_comm / T_math = α / (Y · M_X · B/N) + α · Y / (M_Y · F)        (`lab.theory.scaling.fsdp_tp_comm_to_compute`)

| strategy | compute-bound while | v5p, 3 axes |
|---|---|---|
| data parallel, FSDP (Y = 1) | B/N > α / M_X | 850 tokens per chip |
| tensor parallel over Y | Y < M_Y · F / α | 12.8·M_Y for F = 32768 |
| FSDP × TP over Y | B/N > α / (Y·M_X·(1 - α·Y/(M_Y·F))) | 463 for Y = 4, M_X = 2 |
| FSDP × TP, best Y = M_Y·F/(2α) | B/N > 4α² / (M_X · M_Y · F) | ≈ 400 for M_X M_Y = 2 |

Over DCN the same ratio uses the data-centre bandwidth per chip instead of W_ici: α_DCN = C / W_dcn.

The compiled program is judged against the book where the two can differ: XLA's FLOPs against 12·B·D·F/N, and the
tokens per chip at which its communication (its collectives priced on their links, hop latency included) falls
below its compute (its FLOPs at peak). Where the book's threshold misses, the *refined* value is the book's own rule
(bytes over M · W_ici, against FLOPs at peak) applied to the collectives XLA wrote and the FLOPs it counted: the
kinds, group sizes and bytes read from the HLO.
"""


def _threshold(name: str, steps: tuple[MlpStep, ...], config: Config) -> dict:
    """The book's threshold for the program's strategy, the compiled program's crossing, and the book's rule
    applied to what XLA wrote (tokens per chip)."""
    last = steps[-1]
    chip, sizes = chip_of(last), last.sizes
    y = sizes.get("tensor", 1)
    weights_axis = "fsdp" if sizes.get("fsdp", 1) > 1 else "data"
    m_x, m_y = torus_axes(last.where((weights_axis,))), torus_axes(last.where(("tensor",)))
    book = fsdp_tp_min_batch_per_chip_at(chip, config.mlp, y, m_x, m_y)
    best = theory.fsdp_tp_min_batch_per_chip(chip, config.mlp, m_x, m_y) if y > 1 else book
    return {
        "book": book,
        "book_best_y": best,
        "xla": crossing([s.batch_per_chip for s in steps], [ratio(s) for s in steps]),
        "rule": bandwidth_rule_threshold(last),
        "tensor": y,
        "m_x": m_x,
        "m_y": m_y,
    }


def _checks(obs: Observations, thresholds: dict, config: Config) -> list[Check]:
    checks = []
    for name, steps in obs.sweep.items():
        checks.append(flops_check(name, steps[-1], config.embed, config.mlp))
        checks.append(_crossover_check(name, steps, thresholds[name], config))
    for step in obs.tensor:
        checks.append(_tensor_check(step, config))
    return checks


def _crossover_check(name: str, steps: tuple[MlpStep, ...], t: dict, config: Config) -> Check:
    observed = round(t["xla"], 1) if t["xla"] else "no crossing in the sweep"
    refined = why = None
    if t["xla"] and math.isfinite(t["rule"]) and not group_mismatches(steps[-1]):
        refined, why = round(t["rule"], 1), _why_rule(steps[-1], config)
    return check(
        f"{name}: tokens per chip where compute = communication"
        + (f" (Y={t['tensor']}: α/(Y·M_X·(1-α·Y/(M_Y·F))))" if t["tensor"] > 1 else " (α/M_X)"),
        round(t["book"], 1),
        observed,
        kind="model",
        rtol=CROSSOVER_RTOL,
        refined=refined,
        why=why or "",
        basis=CROSSOVER_BASIS,
    )


def _why_rule(step: MlpStep, config: Config) -> str:
    """The evidence behind the bandwidth rule's value: what XLA wrote, and the FLOPs it counted per token."""
    big = [c for c in step.collectives if c.size_bytes > 4]  # the 4-byte loss all-reduce aside
    kinds = "; ".join(
        f"{k} x{sum(c.repeats or 1 for c in big if (c.kind, c.axes) == (k, a))} over {','.join(a or ('?',))}"
        for k, a in dict.fromkeys((c.kind, c.axes) for c in big)
    )
    groups = sorted({c.group_size for c in big if c.group_size})
    per_token = step.flops / step.batch_per_chip / (config.embed * config.mlp)
    return (
        f"XLA wrote {kinds} (groups of {', '.join(map(str, groups))}: (N-1)/N of the large-N bytes), "
        f"{format_bytes(sum(bus_bytes(c) for c in step.collectives))} sent per chip at B/N={step.batch_per_chip}, "
        f"against {per_token:.4g}·D·F FLOPs per token (the book: one pass of the weights, 4·D·F bytes, per 4·D·F "
        "FLOPs a token)"
    )


def _tensor_check(step: MlpStep, config: Config) -> Check:
    """TP's share: its activations' communication over the compute, against the book's α·Y/(M_Y·F)."""
    chip, y = chip_of(step), step.sizes.get("tensor", 1)
    m_y = torus_axes(step.where(("tensor",)))
    # the activations' term of the book's ratio alone: the weights' term is the data axis's, not TP's
    book = fsdp_tp_comm_to_compute(chip, math.inf, config.mlp, tensor_ways=y, tp_axes=m_y)
    observed = communication_s(step, "tensor") / compute_s(step)
    refined = bandwidth_rule_s(step, activations=True) / compute_s(step)
    tensor_ars = [c for c in step.collectives if c.axes and "tensor" in c.axes]
    consistent = not group_mismatches(step)
    return check(
        f"tensor parallel Y={y}: tensor-axis communication / compute (α·Y/(M_Y·F), compute-bound below 1)",
        round(book, 4),
        round(observed, 4),
        kind="model",
        rtol=RATIO_RTOL,
        refined=round(refined, 4) if consistent else None,
        why=(
            f"XLA wrote {len(tensor_ars)} {'/'.join(sorted({c.kind for c in tensor_ars}))} over tensor "
            f"(group {tensor_ars[0].group_size if tensor_ars else '?'}), "
            f"{format_bytes(sum(bus_bytes(c) for c in tensor_ars))} sent per chip, against "
            f"{step.flops / step.batch_per_chip / (config.embed * config.mlp):.4g}·D·F FLOPs per token (the book: "
            "4·B·D bytes of activations per pass of 4·B·D·F FLOPs)"
        )
        if consistent
        else "",
        basis=RATIO_BASIS,
    )


def _claims(thresholds: dict) -> list[Claim]:
    fsdp, mixed = thresholds.get("FSDP", {}).get("xla"), thresholds.get("FSDP x TP", {}).get("xla")
    if not fsdp or not mixed:
        return []
    return [
        Claim(
            "TP + FSDP keeps the step compute-bound where an ever larger FSDP does not",
            "confirmed" if mixed < fsdp else "refuted",
            f"tokens per chip where XLA's program turns compute-bound: FSDP {fsdp:.0f}, FSDP x TP "
            f"(Y={thresholds['FSDP x TP']['tensor']}) {mixed:.0f} ({fsdp / mixed:.1f}x fewer)",
        )
    ]


def _sweep_table(obs: Observations) -> Table:
    rows = []
    for name, steps in obs.sweep.items():
        for s in steps:
            rows.append(
                [
                    name,
                    s.mesh,
                    s.batch_per_chip,
                    f"{compute_s(s) * 1e3:.2f}",
                    f"{memory_s(s) * 1e3:.2f}",
                    f"{communication_s(s) * 1e3:.2f}",
                    f"{ratio(s):.2f}",
                    bound(s),
                ]
            )
    return Table(
        "Predicted time per step (ms) of the compiled MLP step",
        ["strategy", "mesh", "tokens per chip", "compute", "HBM", "communication", "comm / compute", "bound by"],
        rows,
    )


def _threshold_table(thresholds: dict) -> Table:
    rows = [
        [
            name,
            f"{t['book']:.0f}",
            f"{t['book_best_y']:.0f}" if t["tensor"] > 1 else "-",
            f"{t['xla']:.0f}" if t["xla"] else "none in the sweep",
            f"{t['rule']:.0f}",
        ]
        for name, t in thresholds.items()
    ]
    return Table(
        "Tokens per chip needed to be compute-bound",
        [
            "strategy",
            "book, for the program's Y",
            "book, best Y",
            "XLA's program (crossover)",
            "book's rule on XLA's collectives",
        ],
        rows,
    )


def _tensor_table(obs: Observations, config: Config) -> Table:
    rows = []
    for s in obs.tensor:
        y = s.sizes.get("tensor", 1)
        where = s.where(("tensor",))
        limit = theory.tensor_parallel_max_ways(chip_of(s), config.mlp, torus_axes(where))
        rows.append(
            [
                y,
                str(where),
                f"{limit:.1f}",
                "yes" if y < limit else "no",
                f"{compute_s(s) * 1e3:.2f}",
                f"{communication_s(s, 'tensor') * 1e3:.2f}",
                "yes" if communication_s(s, "tensor") < compute_s(s) else "no",
            ]
        )
    return Table(
        f"Tensor parallelism at {obs.tensor[0].batch_per_chip if obs.tensor else '-'} tokens per chip",
        [
            "Y",
            "tensor axis on",
            "book: Y must stay below",
            "book: compute-bound",
            "compute (ms)",
            "tensor-axis communication (ms)",
            "XLA's program: compute-bound",
        ],
        rows,
    )


def _pod_table(obs: Observations) -> Table:
    base = next((s for s in obs.sweep.get("FSDP", ()) if s.batch_per_chip == 2048), None)
    rows = [
        [
            f"tpu:{s.topology}",
            s.chips,
            f"{compute_s(s) * 1e3:.2f}",
            f"{communication_s(s) * 1e3:.2f}",
            str(s.where(("fsdp",))),
        ]
        for s in ([base] if base else []) + list(obs.pods)
    ]
    return Table(
        "FSDP at 2048 tokens per chip on larger slices",
        ["target", "chips", "compute (ms)", "communication (ms)", "fsdp axis on"],
        rows,
    )


def _collectives_table(obs: Observations) -> Table:
    rows = []
    for name, steps in obs.sweep.items():
        step = steps[-1]
        for c, seconds in zip(step.collectives, collective_seconds(step)):
            rows.append(
                [
                    name,
                    c.kind,
                    c.form,
                    ",".join(c.axes or ("?",)),
                    ",".join(c.dtypes),
                    format_bytes(c.size_bytes),
                    str(step.where(c.axes) if c.axes else "?"),
                    f"{seconds * 1e6:.0f}",
                ]
            )
    return Table(
        "What the TPU compiler wrote (largest batch)",
        ["strategy", "kind", "as written", "axes", "dtype", "S per chip", "on", "predicted us"],
        rows,
    )


def _benchmark_table(b: Benchmark) -> Table:
    rows = [
        [
            f"compile one ZeRO-3 training step of the {b.preset} preset "
            f"({b.parameters / 1e9:.2f} B parameters) for tpu:{b.topology} ({b.chips} chips)",
            f"{b.compile_s:.1f} s",
            "under 60 s",
        ],
        [
            f"read its HLO: parse {b.collectives} collectives and map them to mesh axes",
            f"{b.analysis_s:.2f} s",
            "under 2 s",
        ],
    ]
    return Table(
        "Performance: pod-scale compile on this machine (a clock on a shared host: shown, not judged)",
        ["what", "measured", "goal"],
        rows,
    )


def _plot(obs: Observations, thresholds: dict) -> Figure:
    figure = Figure(figsize=(7.5, 4.5))
    axes = figure.subplots()
    colors = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    for color, (name, steps) in zip(colors, obs.sweep.items()):
        axes.plot(
            [s.batch_per_chip for s in steps],
            [ratio(s) for s in steps],
            marker="o",
            color=color,
            label=f"{name} (XLA's program)",
        )
        book = thresholds[name]["book"]
        if math.isfinite(book):
            axes.axvline(book, color=color, linestyle=":", alpha=0.8, label=f"{name}: book threshold")
    axes.axhline(1.0, color="black", linewidth=0.8)
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    axes.set_xlabel("tokens per chip (B/N)")
    axes.set_ylabel("communication / compute time")
    axes.set_title(f"MLP step compiled for tpu:{obs.topology}: below 1 is compute-bound")
    axes.legend(fontsize=7)
    axes.grid(alpha=0.3)
    return figure


def _summary(obs: Observations, thresholds: dict) -> str:
    any_step = next(iter(obs.sweep.values()))[-1]
    alpha = theory.ici_arithmetic_intensity(chip_of(any_step))
    parts = [f"On tpu:{obs.topology} (α = C/W_ici = {alpha:.0f})"]
    for name, t in thresholds.items():
        xla = f"{t['xla']:.0f}" if t["xla"] else "no crossing in the sweep"
        parts.append(
            f"{name} needs B/N > {t['book']:.0f} tokens per chip by the book and {xla} in the compiled program "
            f"({t['rule']:.0f} by the book's rule applied to the collectives XLA wrote)"
        )
    text = "; ".join(parts) + "."
    fsdp, mixed = thresholds.get("FSDP", {}).get("xla"), thresholds.get("FSDP x TP", {}).get("xla")
    if fsdp and mixed:
        text += (
            f" In XLA's own program adding {thresholds['FSDP x TP']['tensor']}-way tensor parallelism cut the "
            f"tokens each chip needs by {fsdp / mixed:.1f}x: "
            "that is why TP inside the fast domain with FSDP across it keeps "
            "a pod compute-bound at batch sizes where a very large FSDP is "
            "not. Every time here is a model of the compiled program (no TPU ran)."
        )
    return text


def _notes(obs: Observations, thresholds: dict) -> list[str]:
    notes = []
    fsdp = obs.sweep.get("FSDP")
    if fsdp:
        kinds = [c.kind for c in fsdp[-1].collectives if c.axes and "fsdp" in c.axes and c.size_bytes > 4]
        if "all-gather" not in kinds and kinds.count("all-reduce") >= 2:
            notes.append(
                "FSDP: the TPU compiler gathered the weights with all-reduces (each chip contributes its shard of a "
                "zero buffer) and reduced the gradients with all-reduces too: 2(N-1)/N·S per collective instead "
                "of (N-1)/N·S, so the program's threshold sits above the book's."
            )
    dp = thresholds.get("data parallel")
    if dp and dp["xla"]:
        notes.append(
            "Data parallelism: the book's α/M_X hides the gradient all-reduce behind the backward pass alone "
            "(8·B·D·F FLOPs, 2 passes of the weights); the roofline here sets it against the whole step's FLOPs "
            f"(12·B·D·F), so the compiled program's crossing is {dp['xla'] / dp['book']:.3f}x the book's: "
            "2/3 times the ring's (N-1)/N."
        )
    for name, steps in obs.sweep.items():
        kinds = [c.kind for c in steps[-1].collectives]
        notes.append(
            f"{name}: the compiled step holds "
            f"{', '.join(f'{kinds.count(k)} {k}' for k in dict.fromkeys(kinds)) or 'no collectives'}."
        )
    notes.append(
        "HBM time is listed but not part of the threshold: at these sizes the matmuls are compute-bound on HBM as well."
    )
    return notes
