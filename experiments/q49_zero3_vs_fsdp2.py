"""ZeRO-3 and FSDP2 knobs in JAX terms: which sharding, which collective, where, shown in the HLO.

Question #49: ZeRO-3 and FSDP2 both "fully shard"; how do they differ? Both
keep 1/N of the weights, gradients and optimizer state per device and gather
each layer's weights just before use; they differ in vocabulary and in which
knobs they expose. This page maps each knob of DeepSpeed ZeRO-3 and PyTorch
FSDP2 onto this lab's JAX program (a rules table, a remat policy, a dtype, or
a compiler decision) and shows, for each, what the compiled HLO does, on this
target and on a TPU topology (compile-only).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from experiments import kit
from lab import hlo
from lab.errors import LabError
from lab.hlo.text import bits
from lab.mesh import MeshSpec
from lab.model import ModelConfig, preset
from lab.progress import track
from lab.provenance import Setup
from lab.report import Result, Table
from lab.targets.devices import DEFAULT_TARGET, devices_for, parse_target
from lab.training.step import TrainConfig, Trainer
from lab.units import format_bytes
from lab.verdict import Check, Claim, check

QUESTION = "#49"
UNTIMED = True  # reads what XLA compiled, no clock: lab report may measure it beside another page
BF16 = {"param_dtype": "bfloat16", "compute_dtype": "bfloat16"}


@dataclass(frozen=True)
class Config:
    target: str = DEFAULT_TARGET
    """where to compile: cpu:N, gpu, tpu, or tpu:<gen>:<topology> (this page only reads compiled programs)"""
    model: str = "tiny"
    """model preset (lab.model.PRESETS)"""
    global_batch: int = 16
    """sequences per step"""
    persistence_threshold: int = 1024
    """the lab's stage3_param_persistence_threshold: parameters with fewer elements stay whole on every device"""
    deepspeed_default_threshold: int = 100_000
    """DeepSpeed's default stage3_param_persistence_threshold (elements), tried on the sufficiently-sharded guard"""
    tpu_topology: str = "v5e:2x4"
    """also compile for this TPU topology (compile-only); empty to skip"""


VARIANTS = {  # name -> (TrainConfig options, what it stands for)
    "zero3": (
        dict(strategy="zero3", **BF16),
        "FSDP2 fully_shard with reshard_after_forward=True and MixedPrecisionPolicy(param_dtype=bf16); "
        "DeepSpeed ZeRO-3 with bf16",
    ),
    "zero3-keep": (
        dict(strategy="zero3-keep", **BF16),
        "FSDP2 reshard_after_forward=False (FSDP1 SHARD_GRAD_OP); DeepSpeed: a large stage3_max_reuse_distance",
    ),
    "zero3-persist": (
        dict(strategy="zero3", **BF16),
        "DeepSpeed stage3_param_persistence_threshold; FSDP2: leave small modules out of fully_shard",
    ),
    "zero3-f32-gather": (
        {"strategy": "zero3", "param_dtype": "float32", "compute_dtype": "bfloat16"},
        "fp32 sharded weights cast after the gather (autocast); FSDP2 without param_dtype",
    ),
}
ROLES = ("forward all-gather", "backward all-gather", "gradient reduction")


@dataclass(frozen=True)
class Wire:
    """One collective of the step over a mesh axis, as compiled, and the JAX op that made it."""

    seen: kit.Seen
    arrays: int  # arrays it carries (more than one: XLA's combiner)
    op_name: str  # from the HLO metadata; a ``transpose(`` in it marks the backward pass


@dataclass(frozen=True)
class Program:
    """What one variant compiled to on one target."""

    variant: str
    target: str
    collectives: tuple[Wire, ...]
    memory: dict[str, int]  # XLA's memory analysis of the step, per device
    lines: dict[str, str]  # the first HLO instruction of each role (ROLES)


@dataclass(frozen=True)
class Probe:
    """Two one-line programs compiled on a target to read its compiler's element-type rules."""

    target: str
    bf16_gather: tuple[str, ...]  # the element types an all-gather of a bf16 array carries
    cast_after_gather: tuple[str, ...]  # the same for an f32 array gathered, then cast to bf16 for a matmul


@dataclass(frozen=True)
class Observations:
    setup: Setup
    programs: tuple[Program, ...]
    probes: tuple[Probe, ...]
    block_weights: dict[str, int]  # elements of each weight inside the layer scan, stacked over the layers
    guard: str  # what the sufficiently-sharded guard says of DeepSpeed's default threshold ("accepted" or why not)
    tpu_unavailable: kit.Unavailable | None = None


# --------------------------------------------------------------------------- measure


def measure(config: Config) -> Observations:
    model = preset(config.model)
    devices_seen = {config.target: devices_for(config.target)}  # first: the emulated device count is fixed then
    tpu = None if parse_target(config.target).compile_only else kit.tpu_chips(config.tpu_topology)
    if isinstance(tpu, kit.TpuChips):
        devices_seen[tpu.target] = tpu.devices
    programs = tuple(
        _compile(model, config, name, target, devices)
        for target, devices in devices_seen.items()
        for name in track(VARIANTS, f"knobs compiled for {target}")
    )
    main = devices_seen[config.target]
    return Observations(
        setup=Setup.of(config.target, main, f"fsdp={len(main)}"),
        programs=programs,
        probes=tuple(_probe(target, devices) for target, devices in devices_seen.items()),
        block_weights=_block_weights(model),
        guard=_guard(model, config, main),
        tpu_unavailable=tpu if isinstance(tpu, kit.Unavailable) else None,
    )


def _trainer(model: ModelConfig, config: Config, variant: str, devices) -> Trainer:
    options, _ = VARIANTS[variant]
    persist = config.persistence_threshold if variant == "zero3-persist" else 0
    return Trainer(model, TrainConfig(**options, persist_below=persist), MeshSpec(fsdp=len(devices)).build(devices))


def _compile(model: ModelConfig, config: Config, variant: str, target: str, devices) -> Program:
    step = _trainer(model, config, variant, devices).inspect_step(config.global_batch, to_read=True)
    found = [c for c in step.collectives if c.axes]
    roles = {
        "forward all-gather": [c for c in found if c.kind == "all-gather" and "transpose(" not in (c.op_name or "")],
        "backward all-gather": [c for c in found if c.kind == "all-gather" and "transpose(" in (c.op_name or "")],
        "gradient reduction": [c for c in found if c.kind in ("reduce-scatter", "all-reduce") and c.size_bytes > 8],
    }
    return Program(
        variant=variant,
        target=target,
        collectives=tuple(Wire(kit.Seen.of(c), len(c.result_shapes), c.op_name or "") for c in found),
        memory={k: int(v) for k, v in step.memory.items()},
        lines={role: _line(step.optimized_hlo, cs[0].name) for role, cs in roles.items() if cs},
    )


def _line(optimized_hlo: str, name: str) -> str:
    """The instruction defining `name`, without its metadata and backend config."""
    match = re.search(rf"^\s*(?:ROOT )?%{re.escape(name)} = .*$", optimized_hlo, flags=re.MULTILINE)
    text = match.group().strip() if match else ""
    return re.sub(r",\s*(metadata|backend_config|frontend_attributes)=.*$", "", text)[:220]


def _probe(target: str, devices) -> Probe:
    """A bf16 array gathered whole, and an f32 one gathered then cast to bf16 for a matmul, as `Layout.use` does."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = MeshSpec(fsdp=len(devices)).build(devices)
    n = len(devices)
    split, whole = NamedSharding(mesh, P("fsdp")), NamedSharding(mesh, P())
    weight = {dtype: jax.ShapeDtypeStruct((8 * n, 128), dtype, sharding=split) for dtype in (jnp.bfloat16, jnp.float32)}
    x = jax.ShapeDtypeStruct((16, 8 * n), jnp.bfloat16, sharding=whole)

    def gathered(found) -> tuple[str, ...]:
        return tuple(sorted({d for c in found if c.kind == "all-gather" for d in c.dtypes}))

    with jax.set_mesh(mesh):
        plain = hlo.inspect(jax.jit(lambda w: jax.reshard(w, whole)), weight[jnp.bfloat16], mesh=mesh)
        cast = hlo.inspect(
            jax.jit(lambda w, x: x @ jax.reshard(w, whole).astype(jnp.bfloat16)), weight[jnp.float32], x, mesh=mesh
        )
    return Probe(target, gathered(plain.collectives), gathered(cast.collectives))


def _block_weights(model: ModelConfig) -> dict[str, int]:
    from flax import nnx

    from lab.model import abstract_model

    _, params = abstract_model(model)
    return {"/".join(map(str, path)): int(v.size) for path, v in nnx.to_flat_state(params) if path[0] == "blocks"}


def _guard(model: ModelConfig, config: Config, devices) -> str:
    """What the sufficiently-sharded guard says about DeepSpeed's default persistence threshold on this model."""
    mesh = MeshSpec(fsdp=len(devices)).build(devices)
    try:
        Trainer(model, TrainConfig(strategy="zero3", persist_below=config.deepspeed_default_threshold, **BF16), mesh)
    except LabError as refused:
        return str(refused)
    return "accepted"


# --------------------------------------------------------------------------- reading a program


def _runs(w: Wire, layers: int) -> int:
    """Runs per step: the loop trip count; the TPU HLO prints none for the layer scan, which runs `layers` times."""
    return w.seen.repeats if w.seen.repeats is not None else layers


def _moving(p: Program) -> list[Wire]:
    """The collectives that move more than a scalar or two (the loss and its partial sums are no weights)."""
    return [w for w in p.collectives if w.seen.size_bytes > 8]


def _gathers(p: Program, backward: bool | None = None) -> list[Wire]:
    return [
        w
        for w in _moving(p)
        if w.seen.kind == "all-gather" and (backward is None or ("transpose(" in w.op_name) == backward)
    ]


def _reductions(p: Program) -> list[Wire]:
    return [w for w in _moving(p) if w.seen.kind in ("reduce-scatter", "all-reduce")]


def _count(wires: list[Wire], layers: int) -> int:
    return sum(_runs(w, layers) for w in wires)


def _bytes(wires: list[Wire], layers: int) -> float:
    return sum(_runs(w, layers) * w.seen.size_bytes for w in wires)


def _types(wires: list[Wire]) -> tuple[str, ...]:
    return tuple(sorted({d for w in wires for d in w.seen.dtypes}))


def _step_bytes(p: Program) -> int:
    """All the step holds at once: the TPU compiler reports its peak; XLA:CPU's peak counts the arguments only, so
    there it is the buffers: arguments, temporaries and outputs not aliased to an argument."""
    m = p.memory
    if p.target.startswith("tpu") and m.get("peak_memory"):
        return m["peak_memory"]
    return m["argument_size"] + m["temp_size"] + m["output_size"] - m["alias_size"]


# --------------------------------------------------------------------------- judge


def judge(obs: Observations, config: Config) -> Result:
    model = preset(config.model)
    by = {(p.target, p.variant): p for p in obs.programs}
    probes = {p.target: p for p in obs.probes}
    targets = list(dict.fromkeys(p.target for p in obs.programs))
    persisted = _persisted_gather_bytes(obs.block_weights, config.persistence_threshold)
    checks = [c for target in targets for c in _checks(by, target, model, persisted, probes.get(target))]
    skipped = [obs.tpu_unavailable.table()] if obs.tpu_unavailable else []
    return Result(
        summary=_summary(by, targets, obs.guard, config, model.layers),
        theory=THEORY,
        tables=[
            _mapping(by, targets, obs.guard, config, model.layers),
            _measured(list(obs.programs), model.layers),
            _lines(list(obs.programs)),
            _probes_table(list(obs.probes)),
            *skipped,
        ],
        checks=checks,
        claims=_claims(by, targets, model.layers),
        notes=_notes(by, targets, probes, model.layers),
    )


def _persisted_gather_bytes(block_weights: dict[str, int], threshold: int) -> float:
    """S of all-gathers that persistence saves per step, in bf16 bytes.

    A persisted weight is no longer gathered before use (twice for the rematerialized blocks, once for the
    root), but its optimizer state is still sharded, so the updated weight is all-gathered once after the step,
    as in DeepSpeed. Net: one gather per step saved for a block weight, none for a root weight.
    """
    return sum(size * 2 for size in block_weights.values() if size < threshold)


def _width(gather_types: tuple[str, ...]) -> float | None:
    """How many times the bf16 bytes a gather of this element type moves (None: mixed types)."""
    return bits(gather_types[0]) / 16 if len(gather_types) == 1 else None


def _checks(by: dict, target: str, model: ModelConfig, persisted: float, probe: Probe | None) -> list[Check]:
    layers = model.layers
    z3, keep, persist, f32 = (by[target, v] for v in VARIANTS)
    gathered = _types(_gathers(z3))
    width = _width(gathered)
    widened = (
        f"the all-gathers carry {'/'.join(gathered)}: S is {width:g}x the bf16 bytes" if width not in (None, 1) else ""
    )

    def bf16_bytes(quantity: str, theory: float, observed: float) -> Check:
        return check(
            f"{target}: {quantity}",
            theory,
            observed,
            kind="exact",
            refined=theory * width if widened else None,
            why=widened,
        )

    def probed(quantity: str, theory: str, observed: tuple[str, ...], rule: tuple[str, ...] | None, what: str):
        refined = "/".join(rule) if rule and "/".join(rule) != theory else None
        return check(
            f"{target}: {quantity}",
            theory,
            "/".join(observed),
            kind="exact",
            refined=refined,
            why=f"the probe program ({what}) compiles to an all-gather of {refined} on this compiler"
            if refined
            else "",
        )

    return [
        bf16_bytes(
            "reshard after forward: S per step beyond keeping the gathered weights = the block weights, bytes",
            model.block_parameters * 2,
            _bytes(_moving(z3), layers) - _bytes(_moving(keep), layers),
        ),
        check(
            f"{target}: reshard_after_forward=False: all-gathers in the backward",
            0,
            _count(_gathers(keep, backward=True), layers),
            kind="exact",
        ),
        bf16_bytes(
            "persistence threshold: S saved per step, bytes",
            persisted,
            _bytes(_moving(z3), layers) - _bytes(_moving(persist), layers),
        ),
        probed(
            "param_dtype=bf16: all-gather element type",
            "bf16",
            gathered,
            probe.bf16_gather if probe else None,
            "a bf16 array resharded whole",
        ),
        check(
            f"{target}: gradient reductions carry the gather's element type",
            "/".join(gathered),
            "/".join(_types(_reductions(z3))),
            kind="exact",
        ),
        probed(
            "fp32 weights cast after the gather: all-gather element type",
            "f32",
            _types(_gathers(f32)),
            probe.cast_after_gather if probe else None,
            "an f32 array resharded whole, then cast to bf16 for a matmul",
        ),
    ]


def _claims(by: dict, targets: list[str], layers: int) -> list[Claim]:
    forward = {t: _count(_gathers(by[t, "zero3"], backward=False), layers) for t in targets}
    backward = {t: _count(_gathers(by[t, "zero3"], backward=True), layers) for t in targets}
    kept = {t: _count(_gathers(by[t, "zero3-keep"], backward=True), layers) for t in targets}
    both = all(forward[t] > 0 and backward[t] > 0 for t in targets)
    memory = {t: (_step_bytes(by[t, "zero3-keep"]), _step_bytes(by[t, "zero3"])) for t in targets}
    traded = all(kept[t] == 0 and backward[t] > 0 and memory[t][0] > memory[t][1] for t in targets)
    return [
        Claim(
            "ZeRO-3 and FSDP2 are the same full sharding: each layer's weights gathered on demand in the forward "
            "and again in the backward",
            "confirmed" if both else "refuted",
            "; ".join(f"{t}: {forward[t]} all-gathers in the forward, {backward[t]} in the backward" for t in targets),
        ),
        Claim(
            "FSDP2's finer control of a parameter's lifecycle (reshard_after_forward) trades the backward's "
            "gathers for memory",
            "confirmed" if traded else "refuted",
            "; ".join(
                f"{t}: keeping the gathered weights leaves {kept[t]} backward all-gathers (of {backward[t]}) and "
                f"holds {format_bytes(memory[t][0])} against {format_bytes(memory[t][1])}"
                for t in targets
            ),
        ),
    ]


THEORY = r"""
Both DeepSpeed ZeRO-3 (Rajbhandari et al. 2020; `deepspeed.runtime.zero.stage3`) and PyTorch FSDP2
(`torch.distributed.fsdp.fully_shard`, Zhao et al. 2023 for FSDP; FSDP2 rewrites it on DTensor) keep each
parameter as 1/N shards, all-gather a layer's shards just before its forward and backward, and reduce-scatter its
gradient after the backward; both give 16Ψ/N of model states (see the zero_stages page). They differ in who
decides the schedule: ZeRO-3 traces module order at run time and prefetches by byte budgets; FSDP2 groups
parameters per `fully_shard` call into one all-gather and lets the user set prefetch and resharding per module.

In this lab (JAX, Explicit sharding) the same decisions sit in three places:

- **where an array lives**: a rules table (`lab.rules`): the weights split over `fsdp` between steps;
- **when a weight is whole**: `Layout.use` reshards it whole just before each matmul (the all-gather); autodiff
  transposes that into the gradient's reduce-scatter; the block's remat policy decides whether the whole weight
  is kept for the backward or gathered again;
- **how the collectives are scheduled**: XLA, not the program: async collectives and the latency-hiding
  scheduler (prefetch, overlap), the collective combiners (buckets), the convert mover (which dtype crosses the wire).

Where a compiler changes the element type on the wire, the page compiles two one-line probes on the same target
(a bf16 array gathered whole; an f32 array gathered, then cast to bf16 for a matmul) and takes what they carry as
that compiler's rule: a corrected prediction that must then agree with the full program.
"""


# --------------------------------------------------------------------------- the page


def _mapping(by: dict, targets: list[str], guard: str, config: Config, layers: int) -> Table:
    main, last = targets[0], targets[-1]
    z3, keep, persist, f32 = (by[main, v] for v in VARIANTS)
    tz3 = by[last, "zero3"]

    def gathers(p):
        return "/".join(_types(_gathers(p)))

    def combined(p):
        wires = [w for w in _moving(p) if w.seen.combined]
        return f"{len(wires)} combined collectives carrying {sum(w.arrays for w in wires)} arrays"

    rows = [
        [
            "reshard after forward",
            "always (re-gathers in the backward); stage3_max_reuse_distance keeps a weight if reused soon",
            "reshard_after_forward=True (default)",
            "`zero3`: remat policy refuses to save `reshard` outputs",
            f"{_count(_gathers(z3, False), layers)} all-gathers in the forward, "
            f"{_count(_gathers(z3, True), layers)} again in the backward",
        ],
        [
            "keep gathered weights",
            "large stage3_max_reuse_distance / stage3_max_live_parameters",
            "reshard_after_forward=False",
            "`zero3-keep`: the gathered weights are saved residuals",
            f"{_count(_gathers(keep, True), layers)} backward all-gathers; whole step "
            f"{format_bytes(_step_bytes(keep))} against {format_bytes(_step_bytes(z3))}",
        ],
        [
            "persistence threshold",
            f"stage3_param_persistence_threshold (default {config.deepspeed_default_threshold:,} elements)",
            "leave small modules out of fully_shard",
            f"`persist_below={config.persistence_threshold}`: small weights stay whole (replicated rules)",
            f"S per step {format_bytes(_bytes(_moving(persist), layers))} against "
            f"{format_bytes(_bytes(_moving(z3), layers))}; DeepSpeed's default here: {guard[:160]}",
        ],
        [
            "mixed precision",
            "bf16.enabled: bf16 weights, fp32 master weights in the optimizer",
            "MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype)",
            "`param_dtype=bfloat16`: bf16 working weights, fp32 master weights sharded with Adam",
            f"all-gathers carry {gathers(z3)}, reductions {'/'.join(_types(_reductions(z3)))} on {main}; "
            f"{gathers(tz3)} on {last}",
        ],
        [
            "reduce dtype",
            "communication_data_type",
            "MixedPrecisionPolicy(reduce_dtype=fp32)",
            "follows the gather: the reduce-scatter is the all-gather's transpose, so it carries the gathered "
            "dtype (a custom_vjp would be needed to differ)",
            f"gathers {gathers(z3)} → reductions {'/'.join(_types(_reductions(z3)))}",
        ],
        [
            "cast before or after the gather",
            "(bf16 weights are gathered in bf16)",
            "param_dtype=None with autocast gathers fp32",
            "`param_dtype=float32, compute_dtype=bfloat16`: gather fp32, then cast",
            f"all-gathers carry {gathers(f32)} on {main}, {gathers(by[last, 'zero3-f32-gather'])} on {last}",
        ],
        [
            "prefetch and overlap",
            "stage3_prefetch_bucket_size, overlap_comm",
            "implicit prefetch; set_modules_to_forward_prefetch / backward_prefetch",
            "XLA: async collectives and the latency-hiding scheduler",
            f"async all-gathers: {sum(w.seen.is_async for w in _gathers(z3))} on {main}, "
            f"{sum(w.seen.is_async for w in _gathers(tz3))} on {last}",
        ],
        [
            "buckets",
            "reduce_bucket_size, allgather_bucket_size",
            "one all-gather per fully_shard group",
            "XLA's collective combiners (tuple collectives)",
            f"{combined(z3)} on {main}; {combined(tz3)} on {last}",
        ],
        [
            "offload",
            "offload_optimizer / offload_param (ZeRO-Offload, ZeRO-Infinity)",
            "CPUOffloadPolicy",
            "memory kinds (`pinned_host`); remat policy `offload` for activations",
            "see the fits_vs_trains page",
        ],
    ]
    return Table(
        "Knobs: DeepSpeed ZeRO-3, PyTorch FSDP2, and what they are in this lab",
        ["knob", "DeepSpeed ZeRO-3", "PyTorch FSDP2", "this lab (JAX)", "what the HLO shows"],
        rows,
    )


def _measured(programs: list[Program], layers: int) -> Table:
    return Table(
        "Each variant as compiled",
        [
            "target",
            "variant",
            "forward all-gathers",
            "backward all-gathers",
            "all-gather S",
            "all collectives S",
            "gather / reduce types",
            "reductions",
            "async all-gathers",
            "combined collectives",
            "whole step",
        ],
        [
            [
                p.target,
                p.variant,
                _count(_gathers(p, False), layers),
                _count(_gathers(p, True), layers),
                format_bytes(_bytes(_gathers(p), layers)),
                format_bytes(_bytes(_moving(p), layers)),
                f"{'/'.join(_types(_gathers(p)))} / {'/'.join(_types(_reductions(p)))}",
                ", ".join(sorted({w.seen.kind for w in _reductions(p)})),
                sum(w.seen.is_async for w in _gathers(p)),
                f"{sum(w.seen.combined for w in _moving(p))} "
                f"({sum(w.arrays for w in _moving(p) if w.seen.combined)} arrays)",
                format_bytes(_step_bytes(p)),
            ]
            for p in programs
        ],
        note="Loops are counted by trip count; the TPU HLO prints none for the layer loop, so its collectives are "
        "counted once per layer. Collectives of 8 bytes or less (the loss and its partial sums) are left out.",
    )


def _lines(programs: list[Program]) -> Table:
    rows = [[p.target, p.variant, role, f"`{p.lines[role]}`"] for p in programs for role in ROLES if p.lines.get(role)]
    return Table(
        "The HLO behind each mapping (first instruction of each role)",
        ["target", "variant", "role", "optimized HLO"],
        rows,
    )


def _probes_table(probes: list[Probe]) -> Table:
    return Table(
        "Probes: what each compiler puts on the wire",
        ["target", "a bf16 array resharded whole", "an f32 array resharded whole, then cast to bf16 for a matmul"],
        [[p.target, "/".join(p.bf16_gather), "/".join(p.cast_after_gather)] for p in probes],
    )


def _summary(by: dict, targets: list[str], guard: str, config: Config, layers: int) -> str:
    main = targets[0]
    z3, keep, persist = by[main, "zero3"], by[main, "zero3-keep"], by[main, "zero3-persist"]
    text = (
        "In JAX terms ZeRO-3 and FSDP2 are one program: weights split over fsdp, on "
        f"{main} {_count(_gathers(z3, False), layers)} all-gathers in the forward pass of a step and "
        f"{_count(_gathers(z3, True), layers)} again in the backward (reshard after forward, both systems' "
        f"default), gradient reductions of the gathered element type ({'/'.join(_types(_reductions(z3)))}). "
        "Their knobs are lab settings: keeping the gathered weights (FSDP2 reshard_after_forward=False) leaves "
        f"{_count(_gathers(keep, True), layers)} backward all-gathers and raises the whole step from "
        f"{format_bytes(_step_bytes(z3))} to {format_bytes(_step_bytes(keep))}; a persistence threshold of "
        f"{config.persistence_threshold} elements saves "
        f"{format_bytes(_bytes(_moving(z3), layers) - _bytes(_moving(persist), layers))} of S per step. "
    )
    text += (
        "DeepSpeed's default threshold would leave this small model mostly unsharded, and the lab's "
        "sufficiently-sharded guard refuses it."
        if guard != "accepted"
        else "DeepSpeed's default threshold passes the sufficiently-sharded guard for this model."
    )
    if len(targets) > 1:
        t = by[targets[-1], "zero3"]
        text += (
            f" Prefetch and overlap are XLA's: {sum(w.seen.is_async for w in _gathers(t))} of the all-gathers "
            f"compiled for {targets[-1]} are asynchronous, {sum(w.seen.is_async for w in _gathers(z3))} on {main}."
        )
    return text


def _notes(by: dict, targets: list[str], probes: dict, layers: int) -> list[str]:
    notes = []
    most = max(_count(_gathers(by[t, "zero3"], False), layers) for t in targets)
    for target in targets:
        z3 = by[target, "zero3"]
        fewer = most - _count(_gathers(z3, False), layers)
        if fewer:
            notes.append(
                f"{target}: {fewer} fewer forward all-gathers than the other target for the same weights: this "
                "compiler gathers the smallest weights (the norm scales) by all-reduce of a zero-padded buffer; "
                "the bytes are the same, which is why the checks compare all collectives' S."
            )
    for target in targets:
        z3, f32, probe = by[target, "zero3"], by[target, "zero3-f32-gather"], probes.get(target)
        if probe and probe.bf16_gather == ("f32",):
            notes.append(
                f"{target}: even a lone bf16 array is gathered as f32 on this compiler (the probe): XLA:CPU widens "
                f"bf16 collectives, doubling their bytes; the ZeRO-3 step gathers {'/'.join(_types(_gathers(z3)))}."
            )
        if _types(_gathers(f32)) == ("bf16",):
            notes.append(
                f"{target}: with fp32 weights and bf16 matmuls the compiler gathers bf16: it moved the cast before "
                "the all-gather, doing FSDP2's param_dtype=bf16 on its own (the probe does the same)."
            )
    return notes
