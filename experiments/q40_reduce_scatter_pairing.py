"""Why reduce-scatter and all-gather pair up in sharded training: the update needs only its shard.

Question #40 asks why reduce-scatter and all-gather so often appear together.
The allreduce_equivalence page shows that together they are an all-reduce.
This page shows why sharded training splits that all-reduce in two and puts
the optimizer step in the middle: after the reduce-scatter each device holds
the summed gradient of exactly the shard of the weights (and of Adam's
moments) it owns, so the update runs on that shard with no communication,
and only the updated weights are all-gathered. The evidence is the compiled
HLO: no collective sits between the reduce-scatter and the all-gather, and
every array in between is shard-sized. Shown twice: a hand-written sharded
AdamW step (``shard_map``), and this lab's ZeRO-2 training step, where XLA
inserted the collectives.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from experiments import kit
from lab.errors import LabError
from lab.hlo.text import arrays, computations, parse_instruction
from lab.mesh import MeshSpec
from lab.model import preset
from lab.provenance import Setup
from lab.report import Result, Table
from lab.targets.devices import DEFAULT_TARGET, devices_for, parse_target
from lab.training.step import TrainConfig, Trainer
from lab.verdict import Check, Claim, check

QUESTION = "#40"
UNTIMED = True  # reads what XLA compiled, no clock: lab report may measure it beside another page
REDUCTIONS = ("reduce-scatter", "all-reduce")


@dataclass(frozen=True)
class Config:
    target: str = DEFAULT_TARGET
    """where to run: cpu:N, gpu, tpu (tpu:<gen>:<topology> compiles without running)"""
    elements: int = 4096
    """elements of the weight vector in the hand-written step"""
    model: str = "tiny"
    """model preset for the ZeRO-2 and ZeRO-3 training steps"""
    global_batch: int = 16
    """sequences per training step"""
    tpu_topology: str = "v5e:2x4"
    """also compile both programs for this TPU topology (compile-only); empty to skip"""


@dataclass(frozen=True)
class Node:
    opcode: str
    shape: str
    operands: tuple[str, ...]


@dataclass(frozen=True)
class Pairing:
    """One program's evidence, read from its compiled HLO: the collectives and what lies between gradient
    reduction and weight gathering."""

    program: str
    strategy: str  # "manual" (the hand-written step), "zero2", "zero3"
    target: str
    devices: int
    order: tuple[str, ...]  # collective kinds in the entry computation's order
    gathers: int  # all-gathers of updated weights
    clean: int  # of which the nearest collectives upstream are all gradient reductions
    feeding: tuple[str, ...]  # the kinds of those nearest reductions, one per distinct reduction
    between: int  # collectives strictly between a reduction and a gather
    largest_between: int  # elements of the largest array between them (0 if none)
    forward_gathers: int  # all-gathers anywhere in the program made by the forward pass (jvp)
    sample: tuple[str, ...]  # the instructions on one reduction-to-gather path


@dataclass(frozen=True)
class Numerics:
    """The hand-written step run once, against unsharded AdamW on the summed gradient."""

    max_difference: float  # max |sharded - reference| over every device's updated weight
    max_ulps: float  # the same in float32 spacings of max(|w|, |w'|), element by element


@dataclass(frozen=True)
class Observations:
    setup: Setup
    devices: int
    elements: int
    numerics: Numerics | None  # None on a compile-only target
    pairings: tuple[Pairing, ...]
    tpu_unavailable: kit.Unavailable | None = None


def measure(config: Config) -> Observations:
    devices = devices_for(config.target)
    n = len(devices)
    if config.elements % n:
        raise LabError(f"elements={config.elements} is not divisible by the {n} devices; use a multiple of {n}")
    compile_only = parse_target(config.target).compile_only
    numerics, manual = _manual(devices, config.elements, config.target, run=not compile_only)
    pairings = [manual, _training(devices, config, "zero2"), _training(devices, config, "zero3")]
    tpu = None if compile_only else kit.tpu_chips(config.tpu_topology)
    if isinstance(tpu, kit.TpuChips):
        pairings += [
            _manual(tpu.devices, config.elements, tpu.target, run=False)[1],
            _training(tpu.devices, config, "zero2", target=tpu.target),
            _training(tpu.devices, config, "zero3", target=tpu.target),
        ]
    return Observations(
        setup=Setup.of(config.target, devices, f"fsdp={n}"),
        devices=n,
        elements=config.elements,
        numerics=numerics,
        pairings=tuple(pairings),
        tpu_unavailable=tpu if isinstance(tpu, kit.Unavailable) else None,
    )


# --- the hand-written sharded AdamW step ----------------------------------------------------


def sharded_adamw_step(mesh, optimizer: optax.GradientTransformation, opt_specs):
    """Per device: reduce-scatter the gradient, AdamW on the owned shard, all-gather the updated weights."""

    @partial(
        jax.shard_map,
        mesh=mesh,
        in_specs=(P("fsdp"), P("fsdp"), opt_specs),
        out_specs=(P("fsdp"), opt_specs, P("fsdp")),
    )
    def step(local_grad_1D, shard_D, opt_state):
        assert (
            local_grad_1D.shape[0] == 1 and shard_D.shape[0] * jax.lax.axis_size("fsdp") == local_grad_1D.shape[1]
        )  # the local view
        grad_shard_D = jax.lax.psum_scatter(local_grad_1D[0], "fsdp", scatter_dimension=0, tiled=True)
        updates, opt_state = optimizer.update(
            grad_shard_D, opt_state, shard_D
        )  # only this device's shard: no communication
        shard_D = optax.apply_updates(shard_D, updates)
        return (
            shard_D,
            opt_state,
            jax.lax.all_gather(shard_D, "fsdp", axis=0, tiled=True)[None],
        )  # every device: the whole weight

    return jax.jit(step)


def _manual(devices, elements: int, target: str, run: bool = True) -> tuple[Numerics | None, Pairing]:
    n = len(devices)
    mesh = MeshSpec(fsdp=n).build(devices)
    optimizer = optax.adamw(1e-2)
    abstract_opt = jax.eval_shape(optimizer.init, jax.ShapeDtypeStruct((elements,), jnp.float32))
    opt_specs = jax.tree.map(lambda a: P("fsdp") if a.ndim else P(), abstract_opt)
    step = sharded_adamw_step(mesh, optimizer, opt_specs)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), (P("fsdp"), P("fsdp"), opt_specs))
    abstract = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        (
            jax.ShapeDtypeStruct((n, elements), jnp.float32),
            jax.ShapeDtypeStruct((elements,), jnp.float32),
            abstract_opt,
        ),
        shardings,
    )
    compiled, inspection = kit.compile_and_inspect(step, *abstract, mesh=mesh)
    pairing = _pairing(
        "hand-written sharded AdamW (shard_map)",
        "manual",
        target,
        n,
        inspection.optimized_hlo,
        inspection.collectives,
        lambda c: c.kind == "all-gather",
    )
    if not run:
        return None, pairing
    rng = np.random.default_rng(0)
    grads, weights = rng.normal(size=(n, elements)).astype(np.float32), rng.normal(size=(elements,)).astype(np.float32)
    _, _, whole_ND = compiled(*jax.device_put((grads, weights, optimizer.init(jnp.asarray(weights))), shardings))
    updates, _ = optimizer.update(jnp.asarray(grads.sum(0)), optimizer.init(jnp.asarray(weights)), jnp.asarray(weights))
    reference = np.asarray(optax.apply_updates(jnp.asarray(weights), updates))
    difference = np.abs(np.asarray(whole_ND) - reference[None])
    scale = np.maximum(np.abs(weights), np.abs(reference))  # the larger of w and w' sets the last rounding's size
    ulps = difference / np.spacing(scale)[None]
    return Numerics(float(difference.max()), float(ulps.max())), pairing


# --- the lab's training step, collectives inserted by XLA -----------------------------------------


def _training(devices, config: Config, strategy: str, target: str | None = None) -> Pairing:
    trainer = Trainer(preset(config.model), TrainConfig(strategy=strategy), MeshSpec(fsdp=len(devices)).build(devices))
    step = trainer.inspect_step(config.global_batch, to_read=True)

    def is_weight_gather(c) -> bool:
        """The updated weights' all-gathers: entry computation, outside the forward (jvp) and backward (transpose)."""
        return c.kind == "all-gather" and "jvp" not in (c.op_name or "") and "transpose" not in (c.op_name or "")

    return _pairing(
        f"lab {strategy} training step (XLA-inserted)",
        strategy,
        target or config.target,
        len(devices),
        step.optimized_hlo,
        step.collectives,
        is_weight_gather,
    )


# --- reading the HLO's data flow (through lab.hlo.text, the one instruction reader) -----------------


def _entry(optimized_hlo: str) -> tuple[str, dict[str, Node]]:
    """The entry computation: its name and, per instruction, opcode, shape and operand names."""
    entry = next(c for c in computations(optimized_hlo) if c.is_entry)
    nodes = {}
    for number, line in entry.instruction_lines():
        instruction = parse_instruction(line, entry.name, number)
        if instruction is not None:
            nodes[instruction.name] = Node(instruction.opcode, instruction.shape, instruction.operands)
    return entry.name, nodes


def _upstream(nodes: dict[str, Node], start: str) -> set[str]:
    seen, todo = set(), list(nodes[start].operands)
    while todo:
        name = todo.pop()
        if name in seen or name not in nodes:
            continue
        seen.add(name)
        todo.extend(nodes[name].operands)
    return seen


def _pairing(
    program: str, strategy: str, target: str, devices: int, optimized_hlo: str, collectives, is_gather
) -> Pairing:
    """Which collectives feed each weight all-gather, and what runs between the gradient reduction and it."""
    entry, nodes = _entry(optimized_hlo)
    mine = [c for c in collectives if c.computation == entry and c.name in nodes]
    names = {c.name: c for c in mine}
    gathers = [c for c in mine if is_gather(c)]
    clean, between, largest, sample, feeding = 0, 0, 0, (), {}
    for gather in gathers:
        above = _upstream(nodes, gather.name)
        feeders = [names[n] for n in above if n in names]
        nearest = [
            c for c in feeders if not any(c.name in _upstream(nodes, other.name) for other in feeders if other is not c)
        ]
        reductions = [c for c in nearest if c.kind in REDUCTIONS]
        clean += bool(reductions) and len(reductions) == len(nearest)
        for reduction in reductions:
            feeding[reduction.name] = reduction.kind
            path = {n for n in above if reduction.name in _upstream(nodes, n) | {n}} - {reduction.name}
            between += sum(n in names for n in path)
            largest = max(
                [largest]
                + [
                    _largest_array(nodes[n].shape)
                    for n in path
                    if nodes[n].opcode not in ("get-tuple-element", "tuple")
                ]
            )
            if not sample:
                sample = tuple(
                    f"{nodes[n].opcode} {nodes[n].shape}" for n in _ordered(nodes, path | {reduction.name, gather.name})
                )
    order = tuple(c.kind for c in sorted(mine, key=lambda c: list(nodes).index(c.name)))
    forward = sum(c.kind == "all-gather" and "jvp" in (c.op_name or "") for c in collectives)
    return Pairing(
        program,
        strategy,
        target,
        devices,
        order,
        len(gathers),
        clean,
        tuple(sorted(feeding.values())),
        between,
        largest,
        forward,
        sample,
    )


def _ordered(nodes: dict[str, Node], names: set[str]) -> list[str]:
    return [n for n in nodes if n in names]


def _largest_array(shape: str) -> int:
    """Elements of the largest array in an HLO shape (tuples included)."""
    return max((int(np.prod(dims)) for _, dims in arrays(shape)), default=0)


# --------------------------------------------------------------------------- judge


def judge(obs: Observations, config: Config) -> Result:
    checks = _checks(obs)
    return Result(
        summary=_summary(obs),
        theory=THEORY,
        tables=[
            _table(obs.pairings),
            _path_table(obs.pairings),
            *([obs.tpu_unavailable.table()] if obs.tpu_unavailable else []),
        ],
        checks=checks,
        claims=_claims(obs),
        notes=_notes(obs.pairings),
    )


THEORY = r"""
N devices each hold a local gradient g_i of the whole weight w (D elements) and own the shard w^(i) (D/N elements)
together with the optimizer state of that shard (Rajbhandari et al. 2020, ZeRO, Section 5: each process updates
only its partition). The update of shard i needs exactly

    (Σ_j g_j)^(i)   — the i-th piece of the summed gradient,

which is what a reduce-scatter leaves on device i. AdamW is elementwise, so the step on the shard needs nothing
else: no collective between the reduce-scatter and the update. Afterwards every device needs the whole updated
weight for the next forward pass, which is an all-gather of the updated shards. Together:

    reduce-scatter → update on the shard → all-gather

has the bytes of one all-reduce, 2(N-1)/N·D (allreduce_equivalence page), but each device keeps and updates
only 1/N of the optimizer state (ZeRO-1/2). ZeRO-3 keeps the weights sharded after the update: its all-gather
moves to the next step's forward pass (and again to the backward), so within one step no all-gather follows
the update.

Numerics: the sharded step and unsharded AdamW differ only in the order the N gradients are summed. At AdamW's
first step the update is lr·m̂/(√v̂ + ε) = lr·g/(|g| + ε), which that order does not move, so the two weights can
differ only in the last rounding of w + Δ: at most 1 ulp, one float32 spacing of max(|w|, |w'|), per element.
"""


def _checks(obs: Observations) -> list[Check]:
    rows = []
    if obs.numerics is not None:
        rows.append(
            check(
                "hand-written step: every device's updated weight against AdamW on the summed gradient "
                "(largest difference, float32 ulps of max(|w|, |w'|))",
                1.0,
                obs.numerics.max_ulps,
                kind="model",
                relation="<=",
                basis=(
                    "the summation order changes g by a few ulps, which lr·g/(|g| + ε) does not pass on: only the "
                    "final rounding of w, 1 ulp, is left"
                ),
            )
        )
    for p in obs.pairings:
        label = f"{p.target} {p.program}"
        if p.strategy == "zero3":
            rows.append(check(f"{label}: all-gathers of updated weights in the step", 0, p.gathers, kind="exact"))
            continue
        rows.append(
            check(f"{label}: weight all-gathers fed directly by a gradient reduction", p.gathers, p.clean, kind="exact")
        )
        rows.append(check(f"{label}: collectives between the reduction and the all-gather", 0, p.between, kind="exact"))
        if p.strategy == "manual":
            rows.append(
                check(
                    f"{label}: largest array between them (elements) = one shard, D/N",
                    obs.elements // p.devices,
                    p.largest_between,
                    kind="exact",
                )
            )
    return rows


def _claims(obs: Observations) -> list[Claim]:
    manual = [p for p in obs.pairings if p.strategy == "manual"]
    numerics = obs.numerics
    shard_only = all(p.between == 0 and p.largest_between == obs.elements // p.devices for p in manual)
    exact = numerics is None or numerics.max_ulps <= 1
    claims = [
        Claim(
            "after the reduce-scatter each device holds its shard's summed gradient and updates that shard with no "
            "further communication",
            "confirmed" if shard_only and exact else "refuted",
            "; ".join(
                f"{p.target}: {p.between} collectives between reduction and all-gather, largest array "
                f"{p.largest_between} elements (D/N = {obs.elements // p.devices})"
                for p in manual
            )
            + (f"; weights within {numerics.max_ulps:.0f} ulp of unsharded AdamW" if numerics else ""),
        )
    ]
    steps = [p for p in obs.pairings if p.strategy == "zero2"]
    paired = all(p.gathers and p.clean == p.gathers and p.between == 0 for p in steps)
    scattered = all(set(p.feeding) == {"reduce-scatter"} for p in steps)
    claims.append(
        Claim(
            "sharded training reduce-scatters the gradients in the backward and all-gathers the parameters again",
            "confirmed" if paired and scattered else "refined" if paired else "refuted",
            "; ".join(
                f"{p.target} ZeRO-2: {p.clean} of {p.gathers} weight all-gathers fed directly by "
                f"{', '.join(sorted(set(p.feeding))) or 'nothing'}, {p.between} collectives between"
                for p in steps
            )
            + (
                " (the compiler wrote an all-reduce and a slice where a reduce-scatter was meant: the same pairing, "
                "with twice a reduce-scatter's bytes)"
                if paired and not scattered
                else ""
            ),
        )
    )
    zero3 = [p for p in obs.pairings if p.strategy == "zero3"]
    claims.append(
        Claim(
            "ZeRO-3/FSDP all-gathers the parameters for the forward pass, not after the update",
            "confirmed" if all(p.gathers == 0 and p.forward_gathers > 0 for p in zero3) else "refuted",
            "; ".join(
                f"{p.target} ZeRO-3: {p.gathers} all-gathers after the update, {p.forward_gathers} in the forward"
                for p in zero3
            ),
        )
    )
    return claims


def _table(pairings) -> Table:
    return Table(
        "Collectives and the data flow between them",
        [
            "target",
            "program",
            "collectives (entry computation, in order)",
            "weight all-gathers",
            "fed directly by a reduction",
            "the reductions feeding them",
            "collectives between",
            "largest array between (elements)",
            "all-gathers in the forward",
        ],
        [
            [
                p.target,
                p.program,
                ", ".join(p.order) or "none",
                p.gathers,
                p.clean,
                ", ".join(p.feeding) or "-",
                p.between,
                p.largest_between,
                p.forward_gathers,
            ]
            for p in pairings
        ],
    )


def _path_table(pairings) -> Table:
    rows = [[p.target, p.program, i, step] for p in pairings for i, step in enumerate(p.sample)]
    return Table(
        "One path from the gradient reduction to the weight all-gather, instruction by instruction",
        ["target", "program", "#", "opcode and shape"],
        rows,
    )


def _summary(obs: Observations) -> str:
    manual = next(p for p in obs.pairings if p.strategy == "manual")
    zero2 = next(p for p in obs.pairings if p.strategy == "zero2")
    text = (
        f"On {obs.devices} devices the hand-written step compiles to {', '.join(manual.order)}: "
        f"the AdamW update between them runs on arrays of at most {manual.largest_between} elements, one shard of "
        f"{obs.elements}, with {manual.between} collectives in between"
    )
    text += (
        f", and every device ends with the same weights as unsharded AdamW to {obs.numerics.max_ulps:.0f} ulp "
        f"(max difference {obs.numerics.max_difference:.1e})."
        if obs.numerics is not None
        else "."
    )
    text += (
        f" In the lab's ZeRO-2 training step, where XLA placed the collectives, {zero2.clean} of {zero2.gathers} "
        f"weight all-gathers are fed directly by the gradient reduction ({', '.join(sorted(set(zero2.feeding)))}), "
        f"with {zero2.between} collectives between. That is why the pair travels together: the reduction's output "
        "is exactly what the shard's update needs, and the all-gather's input is exactly what it produces."
    )
    return text


def _notes(pairings) -> list[str]:
    notes = []
    for p in pairings:
        if p.strategy == "zero2" and "all-reduce" in p.feeding:
            notes.append(
                f"{p.target}: XLA reduces {'all' if set(p.feeding) == {'all-reduce'} else 'some'} of ZeRO-2's "
                "gradients with an all-reduce and slices the shard "
                "(dynamic-slice) instead of a reduce-scatter; the update still starts from the slice, with no "
                "collective before the all-gather."
            )
        if p.strategy == "manual" and "all-reduce" in p.feeding:
            notes.append(
                f"{p.target}: the compiler replaced the hand-written reduce-scatter by an all-reduce and a slice."
            )
    return notes
