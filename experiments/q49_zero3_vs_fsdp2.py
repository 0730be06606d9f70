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
from lab.devices import DEFAULT_TARGET, devices_for, parse_target
from lab.errors import LabError
from lab.mesh import MeshSpec
from lab.model import ModelConfig, preset
from lab.progress import track
from lab.report import Result, Table, provenance
from lab.training.step import TrainConfig, Trainer
from lab.units import format_bytes
from lab.verdict import check

QUESTION = "#49"
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


@dataclass(frozen=True)
class Program:
    """What one variant compiled to on one target."""

    variant: str
    target: str
    forward_gathers: int  # all-gathers in the forward pass, per step (loops counted)
    backward_gathers: int  # all-gathers in the backward pass: the re-gathers of reshard-after-forward
    gathered_bytes: float  # S of all all-gathers per step
    total_bytes: float  # S of every collective per step (a compiler may gather a small weight by all-reduce)
    gather_types: tuple[str, ...]
    reduce_types: tuple[str, ...]  # element types of the gradient reductions (reduce-scatter or all-reduce)
    reductions: tuple[str, ...]  # kinds of the gradient reductions
    async_gathers: int
    combined: int  # collectives carrying several arrays (XLA's combiner: buckets)
    combined_arrays: int
    step_bytes: int
    lines: dict[str, str]  # an HLO line per role: forward gather, backward gather, gradient reduction


def run(config: Config) -> Result:
    model = preset(config.model)
    devices_seen = {config.target: devices_for(config.target)}  # first: the emulated device count is fixed then
    tpu = None if parse_target(config.target).compile_only else kit.tpu_chips(config.tpu_topology)
    if isinstance(tpu, kit.TpuChips):
        devices_seen[tpu.target] = tpu.devices
    programs = [
        _compile(model, config, name, target, devices)
        for target, devices in devices_seen.items()
        for name in track(VARIANTS, f"knobs compiled for {target}")
    ]
    guard = _guard(model, config, devices_seen[config.target])
    by = {(p.target, p.variant): p for p in programs}
    persisted = _persisted_gather_bytes(model, config.persistence_threshold)
    checks = [c for target in devices_seen for c in _checks(by, target, model, persisted)]
    skipped = [tpu.table()] if isinstance(tpu, kit.Unavailable) else []
    return Result(
        summary=_summary(by, list(devices_seen), guard, config),
        theory=THEORY,
        tables=[_mapping(by, list(devices_seen), guard, config), _measured(programs), _lines(programs), *skipped],
        checks=checks,
        notes=_notes(by, list(devices_seen)),
        provenance=provenance(
            target=config.target, devices=devices_seen[config.target], mesh=f"fsdp={len(devices_seen[config.target])}"
        ),
        data={"programs": [p.__dict__ for p in programs], "guard": guard},
    )


# --- compiling and reading --------------------------------------------------------------


def _trainer(model: ModelConfig, config: Config, variant: str, devices) -> Trainer:
    options, _ = VARIANTS[variant]
    persist = config.persistence_threshold if variant == "zero3-persist" else 0
    return Trainer(model, TrainConfig(**options, persist_below=persist), MeshSpec(fsdp=len(devices)).build(devices))


def _compile(model: ModelConfig, config: Config, variant: str, target: str, devices) -> Program:
    trainer = _trainer(model, config, variant, devices)
    step = trainer.inspect_step(config.global_batch, to_read=True)
    found = [c for c in step.collectives if c.size_bytes > 8 and c.axes]

    def runs(c) -> int:
        return c.repeats if c.repeats is not None else model.layers

    gathers = [c for c in found if c.kind == "all-gather"]
    backward = [c for c in gathers if "transpose(" in (c.op_name or "")]
    forward = [c for c in gathers if c not in backward]
    reductions = [c for c in found if c.kind in ("reduce-scatter", "all-reduce")]
    return Program(
        variant=variant,
        target=target,
        forward_gathers=sum(runs(c) for c in forward),
        backward_gathers=sum(runs(c) for c in backward),
        gathered_bytes=sum(runs(c) * c.size_bytes for c in gathers),
        total_bytes=sum(runs(c) * c.size_bytes for c in found),
        gather_types=tuple(sorted({d for c in gathers for d in c.dtypes})),
        reduce_types=tuple(sorted({d for c in reductions for d in c.dtypes})),
        reductions=tuple(sorted({c.kind for c in reductions})),
        async_gathers=sum(c.is_async for c in gathers),
        combined=sum(c.combined for c in found),
        combined_arrays=sum(len(c.result_shapes) for c in found if c.combined),
        step_bytes=max(
            step.memory["argument_size"]
            + step.memory["temp_size"]
            + step.memory["output_size"]
            - step.memory["alias_size"],
            step.memory.get("peak_memory", 0),
        ),
        lines={
            role: _line(step.optimized_hlo, c.name)
            for role, c in (
                ("forward all-gather", forward[:1]),
                ("backward all-gather", backward[:1]),
                ("gradient reduction", reductions[:1]),
            )
            for c in c
        },
    )


def _line(optimized_hlo: str, name: str) -> str:
    """The instruction defining `name`, without its metadata and backend config."""
    match = re.search(rf"^\s*(?:ROOT )?%{re.escape(name)} = .*$", optimized_hlo, flags=re.MULTILINE)
    text = match.group().strip() if match else ""
    return re.sub(r",\s*(metadata|backend_config|frontend_attributes)=.*$", "", text)[:220]


def _guard(model: ModelConfig, config: Config, devices) -> str:
    """What the sufficiently-sharded guard says about DeepSpeed's default persistence threshold on this model."""
    mesh = MeshSpec(fsdp=len(devices)).build(devices)
    try:
        Trainer(model, TrainConfig(strategy="zero3", persist_below=config.deepspeed_default_threshold, **BF16), mesh)
    except LabError as refused:
        return str(refused)
    return "accepted"


def _persisted_gather_bytes(model: ModelConfig, threshold: int) -> float:
    """S of all-gathers that persistence saves per step, in bf16 bytes.

    A persisted weight is no longer gathered before use (twice for the rematerialized blocks, once for the
    root), but its optimizer state is still sharded, so the updated weight is all-gathered once after the step,
    as in DeepSpeed. Net: one gather per step saved for a block weight, none for a root weight.
    """
    from flax import nnx

    from lab.model import abstract_model

    _, params = abstract_model(model)
    return sum(v.size * 2 for path, v in nnx.to_flat_state(params) if v.size < threshold and path[0] == "blocks")


# --- theory against the HLO ---------------------------------------------------------------


def _checks(by: dict, target: str, model: ModelConfig, persisted: float) -> list:
    z3, keep, persist, f32 = (by[target, v] for v in VARIANTS)
    widened = None
    if parse_target(target).platform == "cpu" and z3.gather_types == ("f32",):
        widened = (
            "XLA:CPU carries bf16 collectives as f32 (the HLO all-gathers f32 copies of the bf16 weights), "
            "so every S is twice the bf16 bytes"
        )
    narrowed = None
    if f32.gather_types == ("bf16",):
        narrowed = (
            f"the {target} compiler moved the cast to bf16 before the all-gather (the HLO gathers bf16): "
            "FSDP2's param_dtype=bf16, chosen by the compiler"
        )

    def bf16_bytes(quantity: str, theory: float, observed: float):
        doubled = widened if widened and abs(observed - 2 * theory) <= 0.01 * theory else None
        return check(f"{target}: {quantity}", theory, observed, rtol=0.01, explained=doubled)

    return [
        bf16_bytes(
            "reshard after forward: S per step beyond keeping the gathered weights = the block weights, bytes",
            model.block_parameters * 2,
            z3.total_bytes - keep.total_bytes,
        ),
        check(f"{target}: reshard_after_forward=False: all-gathers in the backward", 0, keep.backward_gathers),
        bf16_bytes("persistence threshold: S saved per step, bytes", persisted, z3.total_bytes - persist.total_bytes),
        check(
            f"{target}: param_dtype=bf16: all-gather element type", "bf16", "/".join(z3.gather_types), explained=widened
        ),
        check(
            f"{target}: gradient reductions carry the gather's element type",
            "/".join(z3.gather_types),
            "/".join(z3.reduce_types),
        ),
        check(
            f"{target}: fp32 weights cast after the gather: all-gather element type",
            "f32",
            "/".join(f32.gather_types),
            explained=narrowed,
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
"""


# --- the page -----------------------------------------------------------------------------


def _mapping(by: dict, targets: list[str], guard: str, config: Config) -> Table:
    main, last = targets[0], targets[-1]
    z3, keep, persist, f32 = (by[main, v] for v in VARIANTS)
    tz3 = by[last, "zero3"]
    rows = [
        [
            "reshard after forward",
            "always (re-gathers in the backward); stage3_max_reuse_distance keeps a weight if reused soon",
            "reshard_after_forward=True (default)",
            "`zero3`: remat policy refuses to save `reshard` outputs",
            f"{z3.forward_gathers} all-gathers in the forward, {z3.backward_gathers} again in the backward",
        ],
        [
            "keep gathered weights",
            "large stage3_max_reuse_distance / stage3_max_live_parameters",
            "reshard_after_forward=False",
            "`zero3-keep`: the gathered weights are saved residuals",
            f"{keep.backward_gathers} backward all-gathers; whole step {format_bytes(keep.step_bytes)} "
            f"against {format_bytes(z3.step_bytes)}",
        ],
        [
            "persistence threshold",
            f"stage3_param_persistence_threshold (default {config.deepspeed_default_threshold:,} elements)",
            "leave small modules out of fully_shard",
            f"`persist_below={config.persistence_threshold}`: small weights stay whole (replicated rules)",
            f"S per step {format_bytes(persist.total_bytes)} against {format_bytes(z3.total_bytes)}; "
            f"DeepSpeed's default here: {guard[:160]}",
        ],
        [
            "mixed precision",
            "bf16.enabled: bf16 weights, fp32 master weights in the optimizer",
            "MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype)",
            "`param_dtype=bfloat16`: bf16 working weights, fp32 master weights sharded with Adam",
            f"all-gathers carry {'/'.join(z3.gather_types)}, reductions {'/'.join(z3.reduce_types)} "
            f"on {main}; {'/'.join(tz3.gather_types)} on {last}",
        ],
        [
            "reduce dtype",
            "communication_data_type",
            "MixedPrecisionPolicy(reduce_dtype=fp32)",
            "follows the gather: the reduce-scatter is the all-gather's transpose, "
            "so it carries the gathered dtype (a custom_vjp would be needed "
            "to differ)",
            f"gathers {'/'.join(z3.gather_types)} → reductions {'/'.join(z3.reduce_types)}",
        ],
        [
            "cast before or after the gather",
            "(bf16 weights are gathered in bf16)",
            "param_dtype=None with autocast gathers fp32",
            "`param_dtype=float32, compute_dtype=bfloat16`: gather fp32, then cast",
            f"all-gathers carry {'/'.join(f32.gather_types)} on {main}, "
            f"{'/'.join(by[last, 'zero3-f32-gather'].gather_types)} on {last}",
        ],
        [
            "prefetch and overlap",
            "stage3_prefetch_bucket_size, overlap_comm",
            "implicit prefetch; set_modules_to_forward_prefetch / backward_prefetch",
            "XLA: async collectives and the latency-hiding scheduler",
            f"async all-gathers: {z3.async_gathers} on {main}, {tz3.async_gathers} on {last}",
        ],
        [
            "buckets",
            "reduce_bucket_size, allgather_bucket_size",
            "one all-gather per fully_shard group",
            "XLA's collective combiners (tuple collectives)",
            f"{z3.combined} combined collectives carrying {z3.combined_arrays} "
            f"arrays on {main}; {tz3.combined} carrying {tz3.combined_arrays} "
            f"on {last}",
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


def _measured(programs: list[Program]) -> Table:
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
                p.forward_gathers,
                p.backward_gathers,
                format_bytes(p.gathered_bytes),
                format_bytes(p.total_bytes),
                f"{'/'.join(p.gather_types)} / {'/'.join(p.reduce_types)}",
                ", ".join(p.reductions),
                p.async_gathers,
                f"{p.combined} ({p.combined_arrays} arrays)",
                format_bytes(p.step_bytes),
            ]
            for p in programs
        ],
        note="Loops are counted by trip count; the TPU HLO prints none for "
        "the layer loop, so its collectives are counted once per layer.",
    )


def _lines(programs: list[Program]) -> Table:
    rows = [[p.target, p.variant, role, f"`{line}`"] for p in programs for role, line in p.lines.items() if line]
    return Table(
        "The HLO behind each mapping (first instruction of each role)",
        ["target", "variant", "role", "optimized HLO"],
        rows,
    )


def _summary(by: dict, targets: list[str], guard: str, config: Config) -> str:
    main = targets[0]
    z3, keep, persist = by[main, "zero3"], by[main, "zero3-keep"], by[main, "zero3-persist"]
    text = (
        "In JAX terms ZeRO-3 and FSDP2 are one program: weights split over "
        f"fsdp, on {main} {z3.forward_gathers} all-gathers in the forward "
        "pass of a step and "
        f"{z3.backward_gathers} again in the backward (reshard after forward, "
        "both systems' default), gradient reductions of the gathered element "
        "type "
        f"({'/'.join(z3.reduce_types)}). Their knobs are lab settings: keeping "
        "the gathered weights (FSDP2 reshard_after_forward=False) leaves "
        f"{keep.backward_gathers} backward all-gathers and raises the whole "
        f"step from {format_bytes(z3.step_bytes)} to {format_bytes(keep.step_bytes)}; "
        f"a persistence threshold of {config.persistence_threshold} elements "
        f"saves {format_bytes(z3.total_bytes - persist.total_bytes)} of S "
        "per step. "
    )
    text += (
        "DeepSpeed's default threshold would leave this small model mostly "
        "unsharded, and the lab's sufficiently-sharded guard refuses it."
        if guard != "accepted"
        else "DeepSpeed's default threshold passes the sufficiently-sharded guard for this model."
    )
    if len(targets) > 1:
        t = by[targets[-1], "zero3"]
        text += (
            f" Prefetch and overlap are XLA's: {t.async_gathers} of the all-gathers compiled for {targets[-1]} "
            f"are asynchronous, {z3.async_gathers} on {main}."
        )
    return text


def _notes(by: dict, targets: list[str]) -> list[str]:
    notes = []
    most = max(by[t, "zero3"].forward_gathers for t in targets)
    for target in targets:
        z3 = by[target, "zero3"]
        if z3.forward_gathers < most:
            notes.append(
                f"{target}: {most - z3.forward_gathers} fewer forward all-gathers "
                "than the other target for the same weights: this compiler "
                "gathers "
                "the smallest weights (the norm scales) by all-reduce of a "
                "zero-padded buffer; the bytes are the same, which is why the "
                "checks compare all collectives' S."
            )
    for target in targets:
        z3, f32 = by[target, "zero3"], by[target, "zero3-f32-gather"]
        if parse_target(target).platform == "cpu" and z3.gather_types == ("f32",):
            notes.append(
                f"{target}: the bf16 weights travel as f32: XLA:CPU widens bf16 collectives, doubling their bytes."
            )
        if f32.gather_types == ("bf16",):
            notes.append(
                f"{target}: with fp32 weights and bf16 matmuls the compiler "
                "gathers bf16: it moved the cast before the all-gather, doing "
                "FSDP2's param_dtype=bf16 on its own."
            )
    return notes
