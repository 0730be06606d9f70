"""Expert parallelism: two all-to-alls per MoE layer, padded to capacity.

Question #41 says expert parallelism (EP) puts different experts on different
devices, so that no device holds them all, and that the price is moving
tokens: each device sends every token to the devices of its k chosen experts
(dispatch) and gets the results back (combine), 2·B·L·d·k elements in all.
This page compiles the MoE layer of `lab.parallel.expert` two ways,

1. hand-written: ``shard_map`` with one ``all_to_all`` over ``expert`` each way;
2. GShard-style: dense dispatch/combine einsums with sharding annotations,
   where XLA's partitioner chooses the collectives;

for several expert counts E, top-k, capacity factors and EP sizes, reads the
collectives and the argument bytes out of the compiled programs and sets them
against theory (`lab.theory.moe_traffic`): padding to capacity, not routing,
decides the bytes. It also checks the numerics (no dropping: the EP layer
equals the single-device MoE), EP combined with data and FSDP axes, what the
TPU compiler does with the same program, and the step time on this target.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, replace
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from matplotlib.figure import Figure

from experiments import kit
from lab import theory
from lab.bench import Timing, time_interleaved
from lab.errors import LabError
from lab.hlo.text import bits
from lab.mesh import MeshSpec
from lab.moe import RouterConfig, parse_capacity_factor
from lab.parallel.expert import MoEConfig, expert_parallel, gshard, init_experts, moe_local, moe_reference
from lab.progress import track
from lab.provenance import Setup
from lab.report import Result, Table
from lab.targets.devices import DEFAULT_TARGET, devices_for
from lab.units import format_bytes
from lab.verdict import Check, Claim, check

QUESTION = "#41"
TOLERANCE = 1e-5  # max |sharded - reference| the numerics must stay within
HAND, GSHARD, ONE_DEVICE = "expert_parallel", "gshard", "one device, all tokens"


@dataclass(frozen=True)
class Config:
    target: str = DEFAULT_TARGET
    """where to run (cpu:N, gpu, tpu)"""
    d_model: int = 64
    """model width d"""
    d_ff: int = 128
    """each expert's hidden width"""
    tokens_per_device: int = 256
    """tokens each device routes (one routing group)"""
    experts: int = 16
    """E of the base case; each sweep below changes one setting of it"""
    top_k: int = 2
    """experts per token in the base case"""
    capacity_factor: float = 1.25
    """capacity factor of the base case: C = ceil(T·k/E · cf)"""
    ep: int = 8
    """expert-parallel size (the expert axis); the other devices go to data"""
    sweep_experts: tuple[int, ...] = (64,)
    """expert counts to try instead of the base case's"""
    sweep_top_k: tuple[int, ...] = (1,)
    """top-k values to try instead of the base case's"""
    sweep_capacity: tuple[str, ...] = ("1.0", "none")
    """capacity factors; none = no dropping (the no-dropping case is also run against the single-device MoE)"""
    sweep_ep: tuple[int, ...] = (4,)
    """expert-parallel sizes to try instead of the base case's"""
    repeats: int = 5
    """timed rounds per program (interleaved), after warm-up"""
    tpu_topology: str = "v5e:2x4"
    """also compile the base case for this TPU topology (compile-only); empty to skip"""


@dataclass(frozen=True)
class Case:
    experts: int
    top_k: int
    capacity_factor: float | None
    ep: int

    @property
    def label(self) -> str:
        factor = "none" if self.capacity_factor is None else f"{self.capacity_factor:g}"
        return f"E={self.experts} k={self.top_k} cf={factor} EP={self.ep}"

    def moe(self, config: Config) -> MoEConfig:
        return MoEConfig(config.d_model, config.d_ff, RouterConfig(self.experts, self.top_k, self.capacity_factor))


@dataclass(frozen=True)
class Op:
    """One collective as compiled: `kit.Seen`'s facts plus the operand shapes and the JAX op this page reads."""

    kind: str
    axes: tuple[str, ...] | None
    dtypes: tuple[str, ...]
    size_bytes: int  # S per device, the nccl-tests convention
    operand_bytes: int
    group_size: int | None
    shapes: tuple[tuple[int, ...], ...]  # operand shapes, per device
    op_name: str

    @classmethod
    def of(cls, c) -> Op:
        return cls(
            c.kind,
            c.axes,
            c.dtypes,
            c.size_bytes,
            c.operand_bytes,
            c.group_size,
            tuple(tuple(s) for s in c.operand_shapes),
            c.op_name or "",
        )

    @property
    def elements(self) -> int:
        return sum(math.prod(s) for s in self.shapes)


@dataclass(frozen=True)
class Compiled:
    """One case's two layers as compiled on this target."""

    case: Case
    hand: tuple[Op, ...]
    gshard: tuple[Op, ...]
    argument_bytes: int  # the hand-written layer's arguments per device, from the compiler's memory analysis
    unannotated: tuple[Op, ...] = ()  # GShard-style with the dispatch masks unannotated (base case only)


@dataclass(frozen=True)
class Ran:
    """One case's layers run on data: how far from the reference, and their forward times."""

    case: Case
    max_error: dict[str, float]  # program -> max |sharded - reference|
    close: dict[str, bool]  # program -> every element within TOLERANCE of the reference
    times: dict[str, Timing]  # program -> forward time (the two layers and one device with all tokens, round-robin)


@dataclass(frozen=True)
class Composed:
    """EP with data and FSDP axes: the collectives of the forward, and of forward + backward."""

    data: int
    fsdp: int
    ep: int
    forward: tuple[Op, ...]
    backward: tuple[Op, ...]

    @property
    def label(self) -> str:
        return f"data={self.data},fsdp={self.fsdp},expert={self.ep}"


@dataclass(frozen=True)
class OnTpu:
    """One layer as the TPU compiler wrote it, under one matmul precision."""

    program: str
    precision: str
    collectives: tuple[Op, ...]


@dataclass(frozen=True)
class Observations:
    setup: Setup
    devices: int
    compiled: tuple[Compiled, ...]  # the base case first
    ran: tuple[Ran, ...]
    composed: Composed
    tpu: tuple[OnTpu, ...] = ()
    tpu_ep: int = 0
    tpu_unavailable: kit.Unavailable | None = None


THEORY = r"""
Each of the N devices of an EP group routes its T tokens to k experts each. Dispatch sends every routed copy to the
device of its expert, combine brings the result back (GShard, Lepikhin et al. 2020, §2.2 and Algorithm 2):

- routed elements, dispatch + combine, over the group: **2 · B·L · d · k** (B·L = N·T tokens, the quick
  reference's count);
- a share **(N-1)/N** of them crosses devices when experts are chosen uniformly (nccl-tests' all-to-all factor);
- static shapes give each expert **C = ceil(T·k/E · cf)** slots per device (Switch Transformer eq. 3), and the
  all-to-all carries the whole padded buffer, **E · C · d** elements per device and direction, however many
  slots the router filled: about cf times the routed elements, E/k times with no dropping (C = T).
- each device holds only its **E/N** experts: 2·(E/N)·d·f weights, next to the replicated router (d·E).

With data or FSDP axes besides `expert`, each EP group runs its own all-to-alls (replica groups over `expert` only),
and FSDP adds an all-gather of the local experts' weights over `fsdp` (reduce-scatter of their gradients in the
backward pass), as for any FSDP weight; the gradients are summed over `data` too, on each device's 1/fsdp shard
if the sum follows the reduce-scatter.
"""


# --------------------------------------------------------------------------- measure


def measure(config: Config) -> Observations:
    devices = devices_for(config.target)
    n = len(devices)
    base = Case(config.experts, config.top_k, config.capacity_factor, config.ep)
    cases = _cases(config, base, n)
    layers, compiled = {}, []
    for case in track(cases, "compile EP layers"):
        built, found = _compile_case(case, config, devices, unannotated=case == base)
        layers[case] = built
        compiled.append(found)
    timed = [c for c in cases if c in (base, replace(base, capacity_factor=None))]
    ran = tuple(_run(case, layers[case], config, devices) for case in track(timed, "run and time EP layers"))
    tpu = kit.tpu_chips(config.tpu_topology)
    on_tpu, tpu_ep = _on_tpu(config, base, tpu) if isinstance(tpu, kit.TpuChips) else ((), 0)
    return Observations(
        setup=Setup.of(config.target, devices, f"data={n // base.ep},expert={base.ep}"),
        devices=n,
        compiled=tuple(compiled),
        ran=ran,
        composed=_with_fsdp(config, base, devices),
        tpu=on_tpu,
        tpu_ep=tpu_ep,
        tpu_unavailable=tpu if isinstance(tpu, kit.Unavailable) else None,
    )


def _cases(config: Config, base: Case, n: int) -> list[Case]:
    """The base case, then one setting changed at a time."""
    factors = [parse_capacity_factor(text) for text in config.sweep_capacity]
    variants = [replace(base, experts=e) for e in config.sweep_experts] + [
        replace(base, top_k=k) for k in config.sweep_top_k
    ]
    variants += [replace(base, capacity_factor=f) for f in factors] + [replace(base, ep=ep) for ep in config.sweep_ep]
    cases = list(dict.fromkeys([base, *variants]))
    for case in cases:
        if n % case.ep:
            raise LabError(
                f"EP size {case.ep} does not divide the {n} devices of {config.target}; choose EP sizes that divide {n}"
            )
    return cases


def _mesh(case: Case, devices):
    return MeshSpec(data=len(devices) // case.ep, expert=case.ep).build(devices)


def _ops(collectives) -> tuple[Op, ...]:
    return tuple(Op.of(c) for c in collectives)


def _inspect(program, layer, tokens: int):
    return kit.compile_and_inspect(program, *layer.abstract(tokens), mesh=layer.mesh)


def _compile_case(case: Case, config: Config, devices, *, unannotated: bool) -> tuple[dict, Compiled]:
    mesh, moe, tokens = _mesh(case, devices), case.moe(config), config.tokens_per_device * len(devices)
    layers = {HAND: expert_parallel(mesh, moe), GSHARD: gshard(mesh, moe)}
    _, hand = _inspect(layers[HAND].fn, layers[HAND], tokens)
    _, xla = _inspect(layers[GSHARD].fn, layers[GSHARD], tokens)
    plain = ()
    if unannotated:
        layer = gshard(mesh, moe, annotate_masks=False)
        plain = _ops(_inspect(layer.fn, layer, tokens)[1].collectives)
    found = Compiled(case, _ops(hand.collectives), _ops(xla.collectives), hand.memory["argument_size"], plain)
    return layers, found


def _run(case: Case, layers: dict, config: Config, devices) -> Ran:
    """Numerics and time of one case's layers: no dropping against one device; dropping against the same groups."""
    moe, tokens = case.moe(config), config.tokens_per_device * len(devices)
    x = jax.random.normal(jax.random.key(1), (tokens, config.d_model))
    params = init_experts(moe, jax.random.key(0))
    params = params.replace(router_DE=params.router_DE * 50)  # a decisive router: capacity really drops tokens
    groups = 1 if case.capacity_factor is None else len(devices)
    reference = np.asarray(jax.jit(moe_reference, static_argnums=(2, 3))(params, x, moe, groups))
    errors, close, calls = {}, {}, {}
    for name, layer in layers.items():
        placed = layer.place(params, x)
        error = np.abs(np.asarray(layer(*placed).y_TD) - reference)
        errors[name], close[name] = float(np.max(error)), bool(np.all(error <= TOLERANCE))
        calls[name] = (layer, placed)
    one_device = jax.jit(lambda p, x: moe_local(p, x, moe).y_TD)
    calls[ONE_DEVICE] = (one_device, (jax.device_put(params, devices[0]), jax.device_put(x, devices[0])))
    return Ran(case, errors, close, time_interleaved(calls, repeats=config.repeats))


def _with_fsdp(config: Config, base: Case, devices) -> Composed:
    """EP over `expert`, experts also split over `fsdp`, tokens over `data` too: collectives with and without grads."""
    data = 2 if len(devices) % 8 == 0 else 1
    case = replace(base, ep=len(devices) // (2 * data))
    mesh = MeshSpec(data=data, fsdp=2, expert=case.ep).build(devices)
    layer = expert_parallel(mesh, case.moe(config))
    tokens = config.tokens_per_device * len(devices)

    def loss(params, x_TD, balance, bias_E):
        return jnp.sum(layer.fn(params, x_TD, balance, bias_E).y_TD ** 2)

    forward = _inspect(layer.fn, layer, tokens)[1].collectives
    backward = _inspect(jax.jit(jax.grad(loss, argnums=(0, 1))), layer, tokens)[1].collectives
    return Composed(data, 2, case.ep, _ops(forward), _ops(backward))


def _on_tpu(config: Config, base: Case, tpu: kit.TpuChips) -> tuple[tuple[OnTpu, ...], int]:
    """The base case's two layers for a TPU topology, under default and highest matmul precision."""
    case = replace(base, ep=min(base.ep, len(tpu)))
    mesh, moe, tokens = _mesh(case, tpu.devices), case.moe(config), config.tokens_per_device * len(tpu)
    found = []
    for precision in ("default", "highest"):
        with jax.default_matmul_precision(precision):
            for name, build in ((HAND, expert_parallel), (GSHARD, gshard)):
                layer = build(mesh, moe)
                found.append(OnTpu(name, precision, _ops(_inspect(layer.fn, layer, tokens)[1].collectives)))
    return tuple(found), case.ep


# --------------------------------------------------------------------------- judge


def judge(obs: Observations, config: Config) -> Result:
    base = obs.compiled[0]
    checks = [
        *_numerics_checks(obs),
        *_traffic_checks(obs, config),
        *_memory_checks(obs, config),
        *_composed_checks(obs.composed, config),
        *_tpu_checks(obs, config),
    ]
    return Result(
        summary=_summary(obs, config),
        theory=THEORY,
        tables=[
            _sweep_table(obs, config),
            _gshard_table(obs),
            _composed_table(obs.composed),
            _timing_table(obs),
            *_tpu_tables(obs, config),
        ],
        checks=checks,
        claims=_claims(obs, config),
        plots={"bytes": partial(_plot, obs, config)},
        notes=_notes(obs, base),
    )


def _traffic(config: Config, case: Case, devices: int | None = None) -> theory.AllToAllTraffic:
    return theory.moe_traffic(
        config.tokens_per_device, config.d_model, case.experts, case.top_k, devices or case.ep, case.capacity_factor
    )


def _all_to_alls(found) -> list[Op]:
    return [c for c in found if c.kind == "all-to-all"]


def _a2a_bytes(found) -> int:
    return sum(c.operand_bytes for c in _all_to_alls(found))


def _axes(c: Op) -> str:
    return ",".join(c.axes) if c.axes else "(groups of 1)" if c.group_size == 1 else "?"


def _expert_weight_bytes(config: Config, experts: int) -> int:
    """w_in and w_out of `experts` experts, f32."""
    return experts * 2 * config.d_model * config.d_ff * 4


def _numerics_checks(obs: Observations) -> list[Check]:
    checks = []
    for ran in obs.ran:
        against = "the single-device MoE" if ran.case.capacity_factor is None else "the reference with the same groups"
        for name in (HAND, GSHARD):
            checks.append(
                check(
                    f"{ran.case.label}, {name}: every output within {TOLERANCE:g} of {against}",
                    "True",
                    str(ran.close[name]),
                    kind="model",
                    basis="float32: the layers add the same products in other orders (dispatch buffers, einsums); "
                    f"outputs of order 1 round at ~1e-7, so {TOLERANCE:g} is a hundredfold margin",
                )
            )
    return checks


def _traffic_checks(obs: Observations, config: Config) -> list[Check]:
    checks = [
        check(
            "every case: the hand-written layer's all-to-alls, over which axes",
            "; ".join("expert, expert" for _ in obs.compiled),
            "; ".join(", ".join(_axes(c) for c in _all_to_alls(found.hand)) for found in obs.compiled),
            kind="exact",
        )
    ]
    for found in obs.compiled:
        padded = _traffic(config, found.case).padded_elements * 4
        checks.append(
            check(
                f"{found.case.label}: hand-written all-to-all bytes per device = 2·E·C·d·4",
                padded,
                _a2a_bytes(found.hand),
                kind="exact",
            )
        )
        checks.append(
            check(
                f"{found.case.label}: GShard-style (XLA-inserted) all-to-all bytes per device = 2·E·C·d·4",
                padded,
                _a2a_bytes(found.gshard),
                kind="exact",
            )
        )
    checks.append(_routed_check(obs.compiled[0], config))
    return checks


def _routed_check(base: Compiled, config: Config) -> Check:
    """The quick reference's 2·B·L·d·k against the compiled bytes over the EP group, refined by the buffers' shapes."""
    case, traffic = base.case, _traffic(config, base.case)
    ep, a2a = case.ep, _all_to_alls(base.hand)
    slots = sum(c.elements for c in a2a) // (2 * config.d_model) if a2a else 0  # per device and direction
    refined = why = None
    if a2a and slots == case.experts * traffic.capacity and all(d == "f32" for c in a2a for d in c.dtypes):
        refined = ep * traffic.padded_elements * 4
        why = (
            f"the compiled all-to-all operands hold {slots} slots of d per device and direction "
            f"({len(a2a[0].shapes)} pieces of {a2a[0].shapes[0]}), E·C with C = ceil(T·k/E·cf) = {traffic.capacity}: "
            f"every expert's buffer padded to capacity, {traffic.padding_factor:.2f}x the "
            f"{traffic.tokens * traffic.top_k} routed copies"
        )
    return check(
        f"{case.label}: dispatch + combine bytes over the EP group, 2·B·L·d·k·4 with B·L = {ep * traffic.tokens}",
        ep * traffic.elements * 4,
        ep * _a2a_bytes(base.hand),
        kind="exact",
        refined=refined,
        why=why or "",
    )


def _memory_checks(obs: Observations, config: Config) -> list[Check]:
    """Each device holds its E/EP experts: the argument bytes grow by that, against the base case."""
    base, checks = obs.compiled[0], []
    for found in obs.compiled[1:]:
        b, c = base.case, found.case
        if (c.experts, c.ep) == (b.experts, b.ep):
            continue
        local = _expert_weight_bytes(config, c.experts // c.ep) - _expert_weight_bytes(config, b.experts // b.ep)
        replicated = (c.experts - b.experts) * (config.d_model + 1) * 4  # the router's columns and the bias
        checks.append(
            check(
                f"{c.label}: argument bytes per device minus the base case's, 2·Δ(E/EP)·d·f·4 + ΔE·(d+1)·4",
                local + replicated,
                found.argument_bytes - base.argument_bytes,
                kind="exact",
            )
        )
    return checks


def _composed_checks(composed: Composed, config: Config) -> list[Check]:
    label, local = composed.label, _expert_weight_bytes(config, config.experts // composed.ep)
    gathers = [c for c in composed.forward if c.kind == "all-gather" and c.axes == ("fsdp",)]
    scatters = [c for c in composed.backward if c.kind == "reduce-scatter" and c.axes == ("fsdp",)]
    checks = [
        check(
            f"{label}: forward all-gathers over fsdp, the local experts' weights whole, 2·(E/EP)·d·f·4",
            local,
            sum(c.size_bytes for c in gathers),
            kind="exact",
        ),
        check(
            f"{label}: forward + backward all-to-alls over expert (dispatch, combine and their transposes)",
            4,
            sum(c.axes == ("expert",) for c in _all_to_alls(composed.backward)),
            kind="exact",
        ),
        check(
            f"{label}: backward reduce-scatters over fsdp, the expert-weight gradients, 2·(E/EP)·d·f·4",
            local,
            sum(c.size_bytes for c in scatters),
            kind="exact",
        ),
    ]
    if composed.data > 1:
        sums = [c for c in composed.backward if c.kind == "all-reduce" and c.axes == ("data",)]
        refined = why = None
        if sums and sum(c.elements for c in sums) * 4 == local:
            refined = local
            why = (
                f"the all-reduce over data sums operands of shapes {', '.join(str(s) for c in sums for s in c.shapes)}"
                f": the whole gathered weights (f = {config.d_ff}), at op `{sums[0].op_name}`, before the "
                "reduce-scatter"
            )
        checks.append(
            check(
                f"{label}: backward all-reduce over data, the expert-weight gradients' 1/fsdp shard, "
                "2·(E/EP)·d·(f/fsdp)·4",
                local // composed.fsdp,
                sum(c.size_bytes for c in sums),
                kind="exact",
                refined=refined,
                why=why or "",
            )
        )
    return checks


def _tpu_checks(obs: Observations, config: Config) -> list[Check]:
    """Both all-to-alls of each layer on TPU: f32 E·C·d·4 each, refined by the element types the compiler wrote."""
    if not obs.tpu:
        return []
    base = obs.compiled[0].case
    elements = _traffic(config, replace(base, ep=obs.tpu_ep)).padded_elements // 2  # E·C·d per direction
    checks = []
    for found in obs.tpu:
        a2a = _all_to_alls(found.collectives)
        dtypes = [c.dtypes[0] for c in a2a]
        refined = why = None
        if len(a2a) == 2 and any(d != "f32" for d in dtypes):
            refined = sum(elements * bits(d) // 8 for d in dtypes)
            why = f"the TPU compiler wrote the two all-to-alls in {', '.join(dtypes)}: E·C·d = {elements} elements each"
        checks.append(
            check(
                f"tpu:{config.tpu_topology} {found.program} ({found.precision} precision): all-to-all bytes per chip, "
                "f32 2·E·C·d·4",
                2 * elements * 4,
                _a2a_bytes(found.collectives),
                kind="exact",
                refined=refined,
                why=why or "",
            )
        )
    return checks


def _claims(obs: Observations, config: Config) -> list[Claim]:
    base, claims = obs.compiled[0], []
    case = base.case
    grown = [f for f in obs.compiled[1:] if f.case.experts != case.experts and f.case.ep == case.ep]
    if grown:
        other = grown[0]
        delta = other.argument_bytes - base.argument_bytes
        sharded = _expert_weight_bytes(config, other.case.experts // case.ep) - _expert_weight_bytes(
            config, case.experts // case.ep
        )
        sharded += (other.case.experts - case.experts) * (config.d_model + 1) * 4
        whole = _expert_weight_bytes(config, other.case.experts - case.experts)
        status = "confirmed" if delta == sharded else "refuted" if delta >= whole else "refined"
        claims.append(
            Claim(
                "EP puts different experts on different devices, so no device holds them all",
                status,
                f"from E = {case.experts} to {other.case.experts} at EP = {case.ep} each device's arguments grew by "
                f"{format_bytes(delta)} (theory, E/EP experts each: {format_bytes(sharded)}; all experts on every "
                f"device would add {format_bytes(whole)} of expert weights)",
            )
        )
    two = all([_axes(c) for c in _all_to_alls(f.hand)] == ["expert", "expert"] for f in obs.compiled)
    gshard_two = all(len(_all_to_alls(f.gshard)) == 2 for f in obs.compiled)
    claims.append(
        Claim(
            "an EP layer moves tokens with two all-to-alls: dispatch, then combine",
            "confirmed" if two and gshard_two else "refuted",
            f"hand-written: {'2 all-to-alls over expert' if two else 'other collectives'} in all "
            f"{len(obs.compiled)} cases; XLA's partitioner (GShard-style): "
            + ", ".join(str(len(_all_to_alls(f.gshard))) for f in obs.compiled),
        )
    )
    traffic = _traffic(config, case)
    routed, compiled = case.ep * traffic.elements * 4, case.ep * _a2a_bytes(base.hand)
    padded = case.ep * traffic.padded_elements * 4
    no_drop = next((f for f in obs.compiled if f.case == replace(case, capacity_factor=None)), None)
    numbers = (
        f"{base.case.label}: 2·B·L·d·k·4 = {format_bytes(routed)} over the group, compiled "
        f"{format_bytes(compiled)} ({compiled / routed:.2f}x: buffers padded to C = {traffic.capacity})"
    )
    if no_drop:
        t = _traffic(config, no_drop.case)
        numbers += f"; with no dropping {case.ep * _a2a_bytes(no_drop.hand) / (case.ep * t.elements * 4):.0f}x (E/k)"
    numbers += f"; a share (N-1)/N = {traffic.cross_device_fraction:.3f} of it leaves the device"
    claims.append(
        Claim(
            "EP's communication is 2·B·L·d·k",
            "confirmed" if compiled == routed else "refined" if compiled == padded else "refuted",
            numbers,
        )
    )
    fixed = all(_a2a_bytes(f.hand) == _traffic(config, f.case).padded_elements * 4 for f in obs.compiled)
    same_e = [f for f in grown if _a2a_bytes(f.hand) == _a2a_bytes(base.hand)]
    claims.append(
        Claim(
            "the all-to-all's volume depends on the routing (which tokens go to which experts)",
            "refined" if fixed else "refuted",
            f"static shapes: compiled from shapes alone, before any token is routed, the all-to-alls carry "
            f"2·E·C·d·4 per device in {'all' if fixed else 'not all'} {len(obs.compiled)} cases"
            + (
                f"; E = {same_e[0].case.experts} carries the same {format_bytes(_a2a_bytes(base.hand))} as "
                f"E = {case.experts} (E·C ≈ T·k·cf)"
                if same_e
                else ""
            )
            + "; only dynamic (ragged) all-to-all, not on this backend, sends what was routed",
        )
    )
    composed = obs.composed
    kinds = Counter((c.kind, _axes(c)) for c in composed.backward)
    wanted = [("all-to-all", "expert"), ("all-gather", "fsdp"), ("reduce-scatter", "fsdp")]
    wanted += [("all-reduce", "data")] if composed.data > 1 else []
    claims.append(
        Claim(
            "EP combines with data parallelism and ZeRO-3/FSDP, at the price of more kinds of communication",
            "confirmed" if all(kinds[w] for w in wanted) else "refuted",
            f"{composed.label}, forward + backward: " + ", ".join(f"{kinds[w]} {w[0]} over {w[1]}" for w in wanted),
        )
    )
    return claims


# --- the page ----------------------------------------------------------------------------


def _sweep_table(obs: Observations, config: Config) -> Table:
    body = []
    for found in obs.compiled:
        t = _traffic(config, found.case)
        body.append(
            [
                found.case.label,
                t.capacity,
                format_bytes(t.elements * 4),
                format_bytes(t.padded_elements * 4),
                f"{t.padding_factor:.2f}x",
                format_bytes(_a2a_bytes(found.hand)),
                format_bytes(t.padded_elements * 4 * t.cross_device_fraction),
                format_bytes(_a2a_bytes(found.gshard)),
                format_bytes(found.argument_bytes),
            ]
        )
    return Table(
        "All-to-all bytes per device, theory against the compiled HLO (dispatch + combine, forward)",
        [
            "case",
            "C",
            "routed 2·T·k·d·4",
            "padded 2·E·C·d·4",
            "padding",
            "hand-written (HLO)",
            "leaves the device (N-1)/N",
            "GShard (HLO)",
            "arguments per device (compiler)",
        ],
        body,
    )


def _describe(found) -> str:
    return "; ".join(f"{c.kind}[{_axes(c)}] {c.dtypes[0]} {format_bytes(c.operand_bytes)}" for c in found) or "none"


def _gshard_table(obs: Observations) -> Table:
    base = obs.compiled[0]
    body = [[base.case.label, "hand-written", _describe(base.hand)]]
    body += [[f.case.label, "GShard-style", _describe(f.gshard)] for f in obs.compiled]
    body.append([base.case.label, "GShard-style, dispatch masks unannotated", _describe(base.unannotated)])
    return Table(
        "Every collective: hand-written against XLA-inserted (GShard-style)",
        ["case", "program", "collectives in the HLO"],
        body,
    )


def _composed_table(composed: Composed) -> Table:
    rows = [
        [program, c.kind, _axes(c), format_bytes(c.size_bytes), c.op_name]
        for program, found in (("forward", composed.forward), ("forward + backward", composed.backward))
        for c in found
    ]
    return Table(
        f"EP with data and FSDP: mesh {composed.label}, base case",
        ["program", "collective", "axes", "size S", "JAX op"],
        rows,
    )


def _timing_table(obs: Observations) -> Table:
    body = [
        [
            ran.case.label,
            name,
            f"{ran.max_error[name]:.1e}" if name in ran.max_error else "",
            str(timing),
            f"{timing.median / ran.times[HAND].median:.2f}x",
        ]
        for ran in obs.ran
        for name, timing in ran.times.items()
    ]
    return Table(
        "Forward time on this target (median [min, max], the programs of a case timed round-robin)",
        ["case", "program", "max |error|", "time", "vs hand-written"],
        body,
    )


def _tpu_tables(obs: Observations, config: Config) -> list[Table]:
    if obs.tpu_unavailable:
        return [obs.tpu_unavailable.table()]
    if not obs.tpu:
        return []
    return [
        Table(
            f"Compiled for tpu:{config.tpu_topology} (compile-only), base case at EP = {obs.tpu_ep}",
            ["program", "matmul precision", "collectives the TPU compiler wrote"],
            [[t.program, t.precision, _describe(t.collectives)] for t in obs.tpu],
        )
    ]


def _plot(obs: Observations, config: Config) -> Figure:
    figure = Figure(figsize=(8, 4.2))
    axes = figure.subplots()
    positions = np.arange(len(obs.compiled))
    routed = [_traffic(config, f.case).elements * 4 for f in obs.compiled]
    axes.bar(positions - 0.2, routed, 0.4, label="routed: 2·T·k·d·4 (theory, no padding)")
    axes.bar(positions + 0.2, [_a2a_bytes(f.hand) for f in obs.compiled], 0.4, label="compiled all-to-alls (padded)")
    axes.set_xticks(positions, [f.case.label.replace(" ", "\n") for f in obs.compiled], fontsize=7)
    axes.set_yscale("log")
    axes.set_ylabel("bytes per device, forward")
    axes.set_title("Padding to capacity, not routing, sets the all-to-all bytes")
    axes.legend(fontsize=8)
    return figure


def _summary(obs: Observations, config: Config) -> str:
    base = obs.compiled[0]
    traffic = _traffic(config, base.case)
    no_drop = next((f for f in obs.compiled if f.case.capacity_factor is None), None)
    times = obs.ran[0].times
    text = (
        f"On {obs.devices} devices the hand-written EP layer ({base.case.label}) compiles to "
        f"{len(_all_to_alls(base.hand))} all-to-alls over the expert axis, {format_bytes(_a2a_bytes(base.hand))} per "
        f"device in all: the padded buffers 2·E·C·d, {traffic.padding_factor:.2f}x the "
        f"{format_bytes(traffic.elements * 4)} that 2·T·k·d predicts from routing alone. "
    )
    if no_drop:
        text += f"Without dropping the padding grows to {_traffic(config, no_drop.case).padding_factor:.0f}x (E/k). "
    same = all(_a2a_bytes(f.gshard) == _a2a_bytes(f.hand) for f in obs.compiled)
    text += (
        "XLA's partitioner gives the GShard-style layer all-to-alls of the same bytes in every case. "
        if same
        else "XLA's partitioner gives the GShard-style layer all-to-alls of other sizes than the hand-written ones "
        "in some cases (see the tables). "
    )
    text += (
        f"Forward time of the base case here (medians): hand-written {times[HAND].median * 1e3:.1f} ms, "
        f"GShard-style {times[GSHARD].median * 1e3:.1f} ms, the same layer on one device "
        f"{times[ONE_DEVICE].median * 1e3:.1f} ms."
    )
    return text


def _notes(obs: Observations, base: Compiled) -> list[str]:
    notes = []
    extra = [c for c in base.gshard if c.kind != "all-to-all" and "top_k" in c.op_name]
    if extra:
        tpu_gshard = [t for t in obs.tpu if t.program == GSHARD and t.precision == "default"]
        tpu_text = ""
        if tpu_gshard:
            gathers = any(c.kind == "all-gather" for c in tpu_gshard[0].collectives)
            tpu_text = f" The TPU compiler {'gathers too' if gathers else 'does not'} (see its table)."
        notes.append(
            f"On CPU the GShard-style program also all-gathers the router logits over all groups before top_k "
            f"({format_bytes(extra[0].operand_bytes)} per device, op `{extra[0].op_name}`): the CPU partitioner does "
            f"not split top_k along its batch dimension.{tpu_text}"
        )
    unannotated = Counter(c.kind for c in base.unannotated)
    if unannotated["all-to-all"] != 2:
        notes.append(
            "Leaving the dispatch and combine masks unannotated (gshard(..., annotate_masks=False)) changes XLA's "
            f"plan: {', '.join(f'{count} {kind}' for kind, count in unannotated.items())} instead of two "
            "all-to-alls (the routing's sharding is lost in propagation, so the partitioner gathers tokens and masks "
            "and reduces the combine)."
        )
    composed = obs.composed
    singletons = [c for c in composed.backward if c.group_size == 1]
    if singletons:
        notes.append(
            "In the backward pass XLA keeps an all-reduce whose replica groups hold one device each "
            f"({format_bytes(singletons[0].operand_bytes)}, op `{singletons[0].op_name}`): shard_map's transpose sums "
            "the expert-weight gradients over the size-1 mesh axes, and the CPU compiler does not remove the no-op."
        )
    sums = [c for c in composed.backward if c.kind == "all-reduce" and c.axes == ("data",)]
    scatters = [c for c in composed.backward if c.kind == "reduce-scatter" and c.axes == ("fsdp",)]
    if sums and scatters and sums[0].size_bytes > sum(c.size_bytes for c in scatters) / composed.fsdp:
        notes.append(
            "The backward pass sums the expert-weight gradients over data first, on the whole gathered weights "
            f"({format_bytes(sums[0].size_bytes)} all-reduce), and reduce-scatters over fsdp after. Reduce-scattering "
            "first would all-reduce only each device's 1/fsdp shard. JAX puts the sum over data at the transpose of "
            "the expert matmul (op `psum_invariant`), before the transpose of the all-gather, and XLA does not swap "
            "them: the check above is refined by the all-reduce's operand shapes."
        )
    hand_default = next((t for t in obs.tpu if t.program == HAND and t.precision == "default"), None)
    if hand_default and any(d == "bf16" for c in _all_to_alls(hand_default.collectives) for d in c.dtypes):
        dtypes = [c.dtypes[0] for c in _all_to_alls(hand_default.collectives)]
        combine = (
            " The combine all-to-all of the hand-written layer stays f32: a gather stands between it and the "
            "gate-weighted sum."
            if dtypes[-1] == "f32"
            else ""
        )
        notes.append(
            "The TPU compiler rounds the dispatch all-to-all to bf16 under default matmul precision: its only "
            f"consumer is a matmul that would round its input anyway.{combine}"
        )
    no_drop = obs.ran[-1]
    ratio = no_drop.times[GSHARD].median / no_drop.times[HAND].median
    notes.append(
        f"In {no_drop.case.label} the GShard-style dense dispatch took {ratio:.1f}x the time of the hand-written "
        "scatter/gather: its einsums cost T·E·C·d, quadratic in the group's tokens when C = T, where a scatter costs "
        "T·k·d."
    )
    notes.append(
        "Times on cpu:N come from emulated devices sharing this machine's cores: they are shown, not judged, and "
        "compared only within this run, as ratios of programs timed round-robin."
    )
    return notes
