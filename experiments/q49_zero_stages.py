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
from functools import partial

from matplotlib.figure import Figure

from experiments import kit
from lab import theory
from lab.bench import Timing
from lab.hlo.text import bits
from lab.mesh import MeshSpec
from lab.model import ModelConfig, preset
from lab.progress import track
from lab.provenance import Setup
from lab.report import Result, Table
from lab.rules import STRATEGIES
from lab.targets.devices import DEFAULT_TARGET, devices_for, parse_target
from lab.training.step import TrainConfig, Trainer
from lab.units import format_bytes
from lab.verdict import Check, Claim, check

QUESTION = "#49"
STAGE = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "zero3-keep": 3}
WORKING_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
POINTER_BYTES = 8  # an output tuple's index table holds one 64-bit pointer per array (XLA's buffer assignment)


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
class Wire:
    """One collective of the step over a mesh axis, as compiled, with the shapes of the arrays it carries."""

    seen: kit.Seen
    operands: tuple[tuple[int, ...], ...]  # one shape per array (a combined collective carries several)

    @property
    def scalars(self) -> int:
        """Rank-0 arrays among its operands (a loss, a norm's partial sum)."""
        return sum(1 for shape in self.operands if not shape)

    @property
    def tensor(self) -> bool:
        """Whether it carries anything but scalars: the loss all-reduce is no part of any ZeRO formula."""
        return self.scalars < len(self.operands)


@dataclass(frozen=True)
class Parameter:
    """One entry parameter of the compiled step as the HLO declares it: element type, dimensions, layout."""

    dtype: str
    dims: tuple[int, ...]
    layout: str  # "1,0" or with tiles "1,0:T(8,128)(2,1)"


@dataclass(frozen=True)
class Compiled:
    """One strategy compiled (and on real devices timed) on one target."""

    strategy: str
    target: str
    devices: int
    memory: dict[str, int]  # the step's memory analysis per device
    parameters: tuple[Parameter, ...]  # the step's entry parameters: state and batch
    collectives: tuple[Wire, ...]  # over the data axis
    gradients_memory: dict[str, int] | None = None  # the forward-and-backward program alone (None: not compiled)
    gradients_outputs: int | None = None  # arrays it returns: the gradients and the loss
    step: Timing | None = None


@dataclass(frozen=True)
class Goal:
    """The ZeRO-3 step of `model` on all devices and on one, from the same weights."""

    model: str
    devices: int
    sharded: Timing
    single: Timing


@dataclass(frozen=True)
class Observations:
    setup: Setup
    compiled: tuple[Compiled, ...]  # each strategy on the config's target
    tpu: tuple[Compiled, ...] = ()  # each strategy compiled for the TPU topology
    goal: Goal | None = None
    tpu_unavailable: kit.Unavailable | None = None


# --------------------------------------------------------------------------- measure


def measure(config: Config) -> Observations:
    devices = devices_for(config.target)
    model = preset(config.model)
    timed = not parse_target(config.target).compile_only
    trainers = {s: _trainer(model, s, devices, config.precision) for s in STRATEGIES}
    compiled = [
        _compile(t, config.global_batch, config.target)
        for t in track(trainers.values(), f"compile every strategy for {config.target}")
    ]
    goal = None
    if timed:
        start = _host_state(trainers["ddp"])  # every strategy starts from the same weights: one initializer compiled
        compiled = [
            replace(
                c,
                step=trainers[c.strategy].time_step(config.global_batch, repeats=config.repeats, warmup=1, start=start),
            )
            for c in track(compiled, "step time per strategy")
        ]
        goal = _goal(config, devices)
    chips = kit.tpu_chips(config.tpu_topology) if timed else None
    tpu = []
    if isinstance(chips, kit.TpuChips):
        tpu = [
            _compile(
                _trainer(model, s, chips.devices, config.precision), config.global_batch, chips.target, gradients=False
            )
            for s in track(STRATEGIES, f"compile every strategy for {chips.target}")
        ]
    return Observations(
        setup=Setup.of(config.target, devices, f"fsdp={len(devices)}"),
        compiled=tuple(compiled),
        tpu=tuple(tpu),
        goal=goal,
        tpu_unavailable=chips if isinstance(chips, kit.Unavailable) else None,
    )


def _trainer(model: ModelConfig, strategy: str, devices, precision: str) -> Trainer:
    mesh = MeshSpec(fsdp=len(devices)).build(devices)
    return Trainer(model, TrainConfig(strategy=strategy, param_dtype=precision, compute_dtype=precision), mesh)


def _compile(trainer: Trainer, global_batch: int, target: str, *, gradients: bool = True) -> Compiled:
    step = trainer.inspect_step(global_batch)
    grads = trainer.inspect_gradients(global_batch) if gradients else None
    outputs = None
    if gradients:
        import jax

        outputs = len(jax.tree.leaves(trainer.compiled_gradients(global_batch).out_info))
    return Compiled(
        strategy=trainer.config.strategy,
        target=target,
        devices=trainer.mesh.devices.size,
        memory={k: int(v) for k, v in step.memory.items()},
        parameters=_parameters(step.optimized_hlo),
        collectives=tuple(Wire(kit.Seen.of(c), tuple(c.operand_shapes)) for c in step.collectives if c.axes),
        gradients_memory=None if grads is None else {k: int(v) for k, v in grads.memory.items()},
        gradients_outputs=outputs,
    )


def _parameters(optimized_hlo: str) -> tuple[Parameter, ...]:
    """The entry computation's parameters as declared: ``%p = bf16[2,64]{1,0:T(2,128)(2,1)} parameter(3)``; a
    scalar may print no layout (``s32[] parameter(22)``)."""
    entry = optimized_hlo[optimized_hlo.find("\nENTRY") :]
    entry = entry[: entry.find("\n}")]
    return tuple(
        Parameter(dtype, tuple(int(d) for d in dims.split(",") if d), layout)
        for dtype, dims, layout in re.findall(r"= ([a-z]+\d*)\[([\d,]*)\](?:\{([^}]*)\})? parameter\(", entry)
    )


def _host_state(trainer: Trainer):
    """The initial state as numpy: every timed trainer starts from it (one initializer compiled, not one each)."""
    import jax
    import numpy as np

    return jax.tree.map(np.asarray, trainer.init())


def _goal(config: Config, devices) -> Goal:
    """The ZeRO-3 step on all devices over the same step on one device: same model, same global batch, same start."""
    model = preset(config.timing_model)
    single_trainer = _trainer(model, "zero3", devices[:1], config.precision)
    start = _host_state(single_trainer)
    single = single_trainer.time_step(config.global_batch, repeats=config.repeats, warmup=1, start=start)
    sharded = _trainer(model, "zero3", devices, config.precision).time_step(
        config.global_batch, repeats=config.repeats, warmup=1, start=start
    )
    return Goal(config.timing_model, len(devices), sharded, single)


# --------------------------------------------------------------------------- theory


@dataclass(frozen=True)
class Expected:
    """The ZeRO paper's numbers for one strategy."""

    states: theory.ModelStateBytes
    moved: dict[str, float]  # S per collective kind per step
    sent: float  # bytes each device sends per step on a ring
    itemsize: int  # bytes per working weight


def _expected(strategy: str, model: ModelConfig, devices: int, precision: str) -> Expected:
    """The paper's accounting for this model: Ψ parameters in b-byte working weights, N = devices."""
    psi, b = model.parameters, WORKING_BYTES[precision]
    # with fp32 working weights the optimizer uses them as its master copy: 8 bytes of moments, no extra 4
    states = theory.zero_model_states(
        STAGE[strategy], psi, devices, param_bytes=b, grad_bytes=b, optimizer_bytes=12 if b == 2 else 8
    )
    # the blocks are rematerialized (gathered again in the backward), the embeddings and final norm are not
    regathered = {"zero3": model.block_parameters * b, "zero3-keep": 0}.get(strategy)
    moved = theory.zero_step_collectives(STAGE[strategy], psi * b, regathered_bytes=regathered)
    return Expected(states, moved, theory.step_wire_bytes(moved, devices), b)


def _batch_bytes(model: ModelConfig, config: Config, devices: int) -> int:
    """The step's other argument: B/N sequences of S+1 int32 tokens."""
    return config.global_batch // devices * (model.seq + 1) * 4


# --------------------------------------------------------------------------- reading the compiled step


def _runs(w: Wire, layers: int) -> int:
    """Runs per step: its loop trip count; the TPU HLO prints none for the layer scan, which runs `layers` times."""
    return w.seen.repeats if w.seen.repeats is not None else layers


def _moved(c: Compiled, layers: int) -> dict[str, float]:
    """S per step per collective kind, of the collectives that carry arrays (the loss's scalars left out)."""
    moved: dict[str, float] = {}
    for w in c.collectives:
        if w.tensor:
            moved[w.seen.kind] = moved.get(w.seen.kind, 0) + _runs(w, layers) * w.seen.size_bytes
    return moved


def _sent(c: Compiled, layers: int) -> float:
    """Bytes each device sends per step on a ring, as compiled: S times its bus factor."""
    return sum(
        _runs(w, layers) * w.seen.size_bytes * theory.bus_bandwidth_factor(w.seen.kind, w.seen.group_size)
        for w in c.collectives
        if w.tensor
    )


def _dtypes(c: Compiled) -> tuple[str, ...]:
    return tuple(sorted({d for w in c.collectives if w.tensor for d in w.seen.dtypes}))


def _refined_sent(e: Expected, c: Compiled, layers: int) -> tuple[float | None, str]:
    """The paper's bytes sent, corrected by what the HLO shows, and the evidence.

    Three corrections, each read from the compiled collectives:

    * width: the collectives carry another element type than the working weights: every S scales by the ratio;
    * scalars: rank-0 arrays (the loss) combined into a collective that carries gradients add their bytes;
    * kinds: what XLA all-reduced beyond the paper's all-reduce is a reduce-scatter or all-gather written as an
      all-reduce (then sliced): the same S, priced at 2(N-1)/N instead of (N-1)/N.

    The corrected value equals the compiled one only if, with these undone, every byte is gathered or reduced
    exactly as often as the paper says; the HLO's own S totals are not read except through the third correction.
    """
    dtypes = _dtypes(c)
    if len(dtypes) != 1:
        return None, ""
    width = bits(dtypes[0]) // 8 / e.itemsize
    n = c.devices
    ar, rs = (theory.bus_bandwidth_factor(k, n) for k in ("all-reduce", "reduce-scatter"))
    scalars = sum(_runs(w, layers) * w.scalars * bits(w.seen.dtypes[0]) // 8 for w in c.collectives if w.tensor)
    scalar_sent = sum(
        _runs(w, layers) * w.scalars * bits(w.seen.dtypes[0]) // 8 * theory.bus_bandwidth_factor(w.seen.kind, n)
        for w in c.collectives
        if w.tensor
    )
    reduced_scalars = sum(
        _runs(w, layers) * w.scalars * bits(w.seen.dtypes[0]) // 8
        for w in c.collectives
        if w.tensor and w.seen.kind == "all-reduce"
    )
    swapped = _moved(c, layers).get("all-reduce", 0) - width * e.moved.get("all-reduce", 0) - reduced_scalars
    refined = width * e.sent + scalar_sent + (ar - rs) * swapped
    why = []
    if width != 1:
        why.append(f"the collectives carry {dtypes[0]}: S is {width:g}x the paper's {e.itemsize}-byte weights")
    if scalars:
        why.append(f"{format_bytes(scalars)} of scalars (the loss) combined into the gradient collectives")
    if swapped:
        shapes = ", ".join(
            dict.fromkeys(
                str(list(s)) for w in c.collectives if w.tensor and w.seen.kind == "all-reduce" for s in w.operands
            )
        )
        why.append(
            f"{format_bytes(swapped)} of reduce-scatter or all-gather written as all-reduce (operands {shapes}), "
            "which sends 2(N-1)/N·S instead of (N-1)/N·S"
        )
    return refined, "; ".join(why)


def _padded(p: Parameter) -> int:
    """Bytes of a parameter with its layout's first tile filled: T(8,128) pads the two most minor dimensions (in
    the layout's minor-to-major order) up to multiples of 8 and 128; a scalar or vector is padded as a row."""
    itemsize = max(bits(p.dtype), 8) // 8
    tiled = re.match(r"([\d,]*):T\(([\d,]+)\)", p.layout)
    if not tiled:
        return math.prod(p.dims) * itemsize
    minor_to_major = [int(i) for i in tiled.group(1).split(",") if i]
    tile = [int(t) for t in tiled.group(2).split(",")]
    physical = [p.dims[i] for i in reversed(minor_to_major)]  # major to minor
    physical = [1] * max(0, len(tile) - len(physical)) + physical
    inner = [math.ceil(d / t) * t for d, t in zip(physical[-len(tile) :], tile)]
    return math.prod(physical[: -len(tile)] + inner) * itemsize


def _declared(p: Parameter) -> int:
    return math.prod(p.dims) * max(bits(p.dtype), 8) // 8


# --------------------------------------------------------------------------- judge


def judge(obs: Observations, config: Config) -> Result:
    model = preset(config.model)
    everything = [*obs.compiled, *obs.tpu]
    expected = {(c.target, c.strategy): _expected(c.strategy, model, c.devices, config.precision) for c in everything}
    checks = [c for m in everything for c in _checks(m, expected[m.target, m.strategy], model, config)]
    checks += _ratio_checks(everything, expected, model.layers)
    main, tpu = list(obs.compiled), list(obs.tpu)
    return Result(
        summary=_summary(main, tpu, expected, obs.goal, model),
        theory=THEORY,
        tables=[
            *_tables(everything, expected, obs.goal, model, config),
            *([obs.tpu_unavailable.table()] if obs.tpu_unavailable else []),
        ],
        checks=checks,
        claims=_claims(everything, expected, model),
        plots={"zero_stages": partial(_plot, everything, expected, model.layers)},
        notes=_notes(main, tpu, expected, model),
    )


def _checks(m: Compiled, e: Expected, model: ModelConfig, config: Config) -> list[Check]:
    label = f"{m.target} {m.strategy}"
    rows = [_state_check(m, e, model, config, label)]
    if m.gradients_memory is not None:
        rows.append(_gradients_check(m, e, label))
    refined, why = _refined_sent(e, m, model.layers)
    sent = _sent(m, model.layers)
    rows.append(
        check(
            f"{label}: bytes sent per device per step (ring)",
            e.sent,
            sent,
            kind="exact",
            rtol=1e-9,
            refined=refined if why else None,
            why=why,
        )
    )
    return rows


def _state_check(m: Compiled, e: Expected, model: ModelConfig, config: Config, label: str) -> Check:
    """XLA's argument bytes against the paper's persistent state (weights and optimizer) plus the batch.

    Corrected by the entry parameters as the HLO declares them: rank-0 state the paper does not count (the
    optimizer's step count) and the padding of the layouts' tiles.
    """
    state = e.states.params + e.states.optimizer + _batch_bytes(model, config, m.devices)
    scalars = sum(_declared(p) for p in m.parameters if not p.dims)
    padding = sum(_padded(p) - _declared(p) for p in m.parameters)
    why = []
    if scalars:
        count = sum(1 for p in m.parameters if not p.dims)
        why.append(
            f"{count} rank-0 parameter(s) the paper does not count (the optimizer's step count), "
            f"{format_bytes(scalars)}"
        )
    if padding:
        why.append(
            f"the layouts' tiles pad the arrays by {format_bytes(padding)} "
            f"({format_bytes(sum(_declared(p) for p in m.parameters))} declared, "
            f"{format_bytes(sum(_padded(p) for p in m.parameters))} with their tiles filled)"
        )
    return check(
        f"{label}: arguments per device = params + optimizer + batch, bytes",
        state,
        m.memory["argument_size"],
        kind="exact",
        refined=state + scalars + padding if why else None,
        why="; ".join(why),
    )


def _gradients_check(m: Compiled, e: Expected, label: str) -> Check:
    """The forward-and-backward program's outputs: the reduced gradients in their layout and the f32 loss."""
    theory_bytes = e.states.grads + 4
    table = POINTER_BYTES * (m.gradients_outputs or 0)
    return check(
        f"{label}: gradients program's outputs per device = gradients + the f32 loss, bytes",
        theory_bytes,
        m.gradients_memory["output_size"],
        kind="exact",
        refined=theory_bytes + table if table else None,
        why=f"XLA counts the output tuple's index table: {m.gradients_outputs} arrays x {POINTER_BYTES}-byte pointers"
        if table
        else "",
    )


def _ratio_checks(everything: list[Compiled], expected: dict, layers: int) -> list[Check]:
    rows = []
    for target in dict.fromkeys(m.target for m in everything):
        by = {m.strategy: m for m in everything if m.target == target}
        if not {"zero3", "ddp"} <= set(by):
            continue
        want = expected[target, "zero3"].sent / expected[target, "ddp"].sent
        corrected = {s: _refined_sent(expected[target, s], by[s], layers) for s in ("zero3", "ddp")}
        values = {s: (refined if why else expected[target, s].sent) for s, (refined, why) in corrected.items()}
        whys = "; ".join(f"{s}: {why}" for s, (_, why) in corrected.items() if why)
        usable = all(v is not None for v in values.values()) and whys
        rows.append(
            check(
                f"{target}: ZeRO-3 bytes sent / DDP bytes sent",
                want,
                _sent(by["zero3"], layers) / _sent(by["ddp"], layers),
                kind="exact",
                rtol=1e-9,
                refined=values["zero3"] / values["ddp"] if usable else None,
                why=whys if usable else "",
            )
        )
    return rows


def _claims(everything: list[Compiled], expected: dict, model: ModelConfig) -> list[Claim]:
    targets = list(dict.fromkeys(m.target for m in everything))
    by = {(m.target, m.strategy): m for m in everything}
    layers = model.layers
    claims = []

    def ratio(target, a, b):
        return _sent(by[target, a], layers) / _sent(by[target, b], layers)

    zero3 = {t: ratio(t, "zero3", "ddp") for t in targets}
    paper = expected[targets[0], "zero3"].sent / expected[targets[0], "ddp"].sent
    same = all(abs(r - 1) <= 0.02 for r in zero3.values())
    more = all(r >= 1.25 for r in zero3.values())
    claims.append(
        Claim(
            "ZeRO-3 / FSDP moves the same bytes as DDP (reduce-scatter + all-gather = all-reduce, ~2Ψ)",
            "confirmed" if same else "refuted" if more else "refined",
            "ZeRO-3 sends "
            + ", ".join(f"{r:.3f}x DDP's bytes on {t}" for t, r in zero3.items())
            + f"; the paper's 3Ψ against 2Ψ is 1.5x, {paper:.3f}x for this model (its embeddings are gathered "
            "once, not again for the backward)",
        )
    )
    staged = {t: (ratio(t, "zero1", "ddp"), ratio(t, "zero2", "ddp")) for t in targets}
    conserved = all(
        math.isclose(
            sum(_moved(by[t, s], layers).values()),
            _width(by[t, s], expected[t, s]) * sum(expected[t, s].moved.values()),
            rel_tol=1e-9,
        )
        for t in targets
        for s in ("zero1", "zero2")
    )
    equal = all(abs(r - 1) <= 0.02 for pair in staged.values() for r in pair)
    claims.append(
        Claim(
            "ZeRO-1/2's reduce-scatter + all-gather moves the same bytes as DDP's all-reduce",
            "confirmed" if equal else "refined" if conserved else "refuted",
            "; ".join(f"{t}: ZeRO-1 {a:.3f}x, ZeRO-2 {b:.3f}x DDP's bytes sent" for t, (a, b) in staged.items())
            + (
                "; every byte is gathered and reduced once, as the paper says, but XLA writes part of the "
                "reduce-scatter as an all-reduce (then a slice)"
                if conserved and not equal
                else ""
            ),
        )
    )
    shrink = {t: by[t, "zero3"].memory["argument_size"] / by[t, "ddp"].memory["argument_size"] for t in targets}
    n = {t: by[t, "ddp"].devices for t in targets}
    claims.append(
        Claim(
            "Sharding weights, gradients and optimizer state cuts the memory each device holds",
            "confirmed"
            if all(shrink[t] <= 1.1 / n[t] for t in targets)
            else "refined"
            if all(s < 1 for s in shrink.values())
            else "refuted",
            "; ".join(f"{t}: ZeRO-3's arguments are {shrink[t]:.3f}x DDP's (1/N = {1 / n[t]:.3f})" for t in targets),
        )
    )
    return claims


def _width(c: Compiled, e: Expected) -> float:
    dtypes = _dtypes(c)
    return bits(dtypes[0]) // 8 / e.itemsize if len(dtypes) == 1 else math.nan


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

In the compiled step the weights and the optimizer state persist (XLA's arguments, with the batch); the gradients
live inside the step, so the lab measures them as the outputs of the forward-and-backward program alone (with
its f32 loss).

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

Where the compiled numbers differ, a corrected prediction is computed from the HLO alone: the element type the
collectives carry (S scales with its width), scalars combined into the gradient collectives, the part of a
reduce-scatter or all-gather that XLA wrote as an all-reduce (same S, twice the bus factor), the rank-0 state
and the tile padding of the entry parameters as declared, the index table of an output tuple. It counts only
if it then agrees to the byte.
"""


# --------------------------------------------------------------------------- the page


def _tables(
    everything: list[Compiled], expected: dict, goal: Goal | None, model: ModelConfig, config: Config
) -> list[Table]:
    layers = model.layers
    batch = _batch_bytes(model, config, everything[0].devices)

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
            "XLA: arguments (state + batch)",
            "XLA: gradients program outputs",
            "XLA: whole step",
        ],
        [
            [
                m.target,
                m.strategy,
                *(format_bytes(x) for x in (e.states.params, e.states.grads, e.states.optimizer, e.states.total)),
                format_bytes(m.memory["argument_size"]),
                shown(None if m.gradients_memory is None else m.gradients_memory["output_size"]),
                format_bytes(_step_bytes(m)),
            ]
            for m in everything
            for e in [expected[m.target, m.strategy]]
        ],
        note="XLA's whole step adds what the paper leaves out: activations, "
        "each layer's gathered weights, and the whole-size partial-sum "
        f"gradient a device computes before the reduction. The batch is {format_bytes(batch)} per device on "
        f"{everything[0].devices} devices.",
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
                f"{_kinds(_moved(m, layers))} ({'/'.join(_dtypes(m))})",
                format_bytes(e.sent),
                format_bytes(_sent(m, layers)),
            ]
            for m in everything
            for e in [expected[m.target, m.strategy]]
        ],
        note="Collectives that carry only scalars (the loss and its partial sums) are left out.",
    )
    per_axis = Table(
        "Collectives per axis in the compiled step (loops counted by trip count)",
        ["target", "strategy", "kind", "axes", "arrays", "runs per step", "S per step"],
        [
            [m.target, m.strategy, kind, axes, arrays, runs, format_bytes(size)]
            for m in everything
            for (kind, axes, arrays), (runs, size) in _rows(m, layers).items()
        ],
    )
    tables = [memory, traffic, per_axis]
    timed = [m for m in everything if m.step is not None]
    if timed:
        rows = [[m.strategy, f"{m.devices} devices", str(m.step)] for m in timed]
        if goal:
            rows += [
                [f"zero3 ({goal.model} model)", f"{goal.devices} devices", str(goal.sharded)],
                [f"zero3 ({goal.model} model)", "1 device", str(goal.single)],
                [
                    f"goal: {goal.devices}-device step / 1-device step ≤ 1.25",
                    "medians",
                    f"{goal.sharded.median / goal.single.median:.2f}",
                ],
                ["the same, fastest steps", "minima", f"{goal.sharded.min / goal.single.min:.2f}"],
            ]
        tables.append(
            Table(
                "Step time on this target (median [min, max])",
                ["strategy", "devices", "time"],
                rows,
                note="Shown, not judged: emulated devices share this machine's cores.",
            )
        )
    return tables


def _rows(m: Compiled, layers: int) -> dict[tuple, list]:
    rows: dict[tuple, list] = {}
    for w in m.collectives:
        key = (w.seen.kind, ",".join(w.seen.axes or ()), "scalars" if not w.tensor else "arrays")
        row = rows.setdefault(key, [0, 0])
        row[0] += _runs(w, layers)
        row[1] += _runs(w, layers) * w.seen.size_bytes
    return rows


def _step_bytes(m: Compiled) -> int:
    """All the step holds at once: the TPU compiler reports its peak; XLA:CPU's peak counts the arguments only, so
    there it is the buffers: arguments, temporaries and outputs not aliased to an argument."""
    memory = m.memory
    if m.target.startswith("tpu") and memory.get("peak_memory"):
        return memory["peak_memory"]
    return memory["argument_size"] + memory["temp_size"] + memory["output_size"] - memory["alias_size"]


def _kinds(moved: dict[str, float]) -> str:
    return ", ".join(f"{kind} {format_bytes(size)}" for kind, size in sorted(moved.items())) or "none"


def _plot(everything: list[Compiled], expected: dict, layers: int) -> Figure:
    targets = list(dict.fromkeys(m.target for m in everything))
    strategies, x = list(STRATEGIES), range(len(STRATEGIES))
    by = {(m.target, m.strategy): m for m in everything}
    main = targets[0]
    timed = [by[main, s] for s in strategies if by[main, s].step is not None]
    figure = Figure(figsize=(16 if timed else 11, 4.2))
    axes = figure.subplots(1, 3 if timed else 2)
    width = 0.25
    axes[0].bar(
        [i - width for i in x],
        [expected[main, s].states.total / 1024 for s in strategies],
        width,
        label="paper: model states (16Ψ ... 16Ψ/N)",
    )
    axes[0].bar(
        list(x),
        [
            (by[main, s].memory["argument_size"] + (by[main, s].gradients_memory or {}).get("output_size", 0)) / 1024
            for s in strategies
        ],
        width,
        label=f"{main}: arguments + gradients",
    )
    axes[0].bar(
        [i + width for i in x],
        [_step_bytes(by[main, s]) / 1024 for s in strategies],
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
            [_sent(by[target, s], layers) / 1024 for s in strategies],
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


def _summary(main: list[Compiled], tpu: list[Compiled], expected: dict, goal: Goal | None, model: ModelConfig) -> str:
    by = {m.strategy: m for m in main}
    target, n, layers = main[0].target, main[0].devices, model.layers

    def paper(s):
        e = expected[target, s].states
        return format_bytes(e.params + e.optimizer)

    def args(s):
        return format_bytes(by[s].memory["argument_size"])

    text = (
        f"On {target} ({n} devices, Ψ = {model.parameters:,} parameters, "
        f"{'bf16' if expected[target, 'ddp'].itemsize == 2 else 'f32'} working weights) XLA's arguments per "
        f"device (state and batch) are {args('ddp')} for DDP, {args('zero1')} for ZeRO-1 and {args('zero3')} "
        f"for ZeRO-3 (the paper's state: {paper('ddp')}, {paper('zero1')}, {paper('zero3')}). "
        f"ZeRO-3 sends {_sent(by['zero3'], layers) / _sent(by['ddp'], layers):.2f}x DDP's bytes per step here, "
        f"and {_sent(by['zero3-keep'], layers) / _sent(by['ddp'], layers):.2f}x when it keeps the gathered "
        "weights; the paper says 1.5x when every weight is gathered twice, "
        f"{expected[target, 'zero3'].sent / expected[target, 'ddp'].sent:.2f}x for this model, whose embeddings "
        "stay gathered through the backward."
    )
    if tpu:
        tb = {m.strategy: m for m in tpu}
        text += (
            f" Compiled for {tpu[0].target}, ZeRO-3 sends {_sent(tb['zero3'], layers) / _sent(tb['ddp'], layers):.2f}x "
            "DDP's bytes."
        )
    if goal:
        text += (
            f" The {goal.devices}-device ZeRO-3 step of the {goal.model} model took "
            f"{goal.sharded.median / goal.single.median:.2f}x the 1-device step "
            f"({goal.sharded.median * 1e3:.1f} ms against {goal.single.median * 1e3:.1f} ms; "
            f"{goal.sharded.min / goal.single.min:.2f}x comparing the fastest steps; the goal is at most 1.25, "
            "a real-accelerator goal that emulated devices sharing this machine's cores do not test)."
        )
    return text


def _notes(main: list[Compiled], tpu: list[Compiled], expected: dict, model: ModelConfig) -> list[str]:
    by = {m.strategy: m for m in main}
    target, notes, layers = main[0].target, [], model.layers
    for m in (by["ddp"], by["zero3"]):
        _, why = _refined_sent(expected[target, m.strategy], m, layers)
        if why:
            notes.append(f"{target} {m.strategy}: {why}.")
    if tpu:
        tb = {m.strategy: m for m in tpu}
        moved3, moved1 = _moved(tb["zero3"], layers), _moved(tb["zero1"], layers)
        notes.append(
            f"{tpu[0].target}: the same ZeRO-3 program reduce-scatters {format_bytes(moved3.get('reduce-scatter', 0))} "
            f"and all-reduces {format_bytes(moved3.get('all-reduce', 0))} per step, and ZeRO-1 (whole gradients, "
            f"then a slice) reduce-scatters {format_bytes(moved1.get('reduce-scatter', 0))}: the TPU compiler turns "
            "some all-reduces whose result is only sliced into reduce-scatters, and gathers the smallest weights "
            f"(norm scales) by all-reduce; the {target} compiler keeps every such all-reduce and its slice."
        )
        if any(w.seen.repeats is None for m in tpu for w in m.collectives):
            notes.append(
                f"{tpu[0].target}: the TPU HLO prints no trip count for the layer loop; its collectives are counted "
                f"{layers} times (the scan's length)."
            )
    if by["zero2"].gradients_memory and by["zero1"].gradients_memory:
        notes.append(
            f"ZeRO-2's saving is the gradient *buffer* ({format_bytes(by['zero2'].gradients_memory['output_size'])} "
            f"against ZeRO-1's {format_bytes(by['zero1'].gradients_memory['output_size'])}); inside one step XLA "
            "still computes each device's whole-size partial-sum gradient before reducing it, so the whole step "
            f"holds {format_bytes(_step_bytes(by['zero2']))} against {format_bytes(_step_bytes(by['zero1']))}. "
            "With micro-batches the buffer is what persists between them."
        )
    z3, keep = _moved(by["zero3"], layers), _moved(by["zero3-keep"], layers)
    notes.append(
        "Keeping the gathered weights (zero3-keep) saves the second all-gather "
        f"({format_bytes(z3.get('all-gather', 0) - keep.get('all-gather', 0))} of S per step) and costs whole-step "
        f"memory: {format_bytes(_step_bytes(by['zero3-keep']))} against {format_bytes(_step_bytes(by['zero3']))}."
    )
    return notes
