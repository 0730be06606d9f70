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
collectives out of the optimized HLO and sets them against theory
(`lab.theory.moe_traffic`): padding to capacity, not routing, decides the
bytes. It also checks the numerics (no dropping: the EP layer equals the
single-device MoE), EP combined with data and FSDP axes, what the TPU
compiler does with the same program, and the step time on this target.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, replace

import jax
import jax.numpy as jnp
import numpy as np
from matplotlib.figure import Figure

from experiments import kit
from lab import hlo, theory
from lab.bench import Timing, time_fn
from lab.devices import DEFAULT_TARGET, devices_for
from lab.errors import LabError
from lab.mesh import MeshSpec
from lab.moe import RouterConfig
from lab.parallel.expert import MoEConfig, expert_parallel, gshard, init_experts, moe_local, moe_reference
from lab.progress import track
from lab.report import Result, Table, provenance
from lab.units import format_bytes
from lab.verdict import Check, check

QUESTION = "#41"


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
    """timed calls per program, after warm-up"""
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
class Timed:
    """One case's compiled layers run: their error against the reference, and their forward times."""

    case: Case
    times: dict[str, Timing]  # program -> forward time
    errors: dict[str, float]  # program -> max |sharded - reference|
    checks: tuple[Check, ...]


@dataclass(frozen=True)
class Composed:
    """EP with data and FSDP axes: its collectives' table, and the ones the notes explain."""

    table: Table
    singletons: tuple[hlo.Collective, ...]  # backward all-reduces over groups of one device
    data_sums: tuple[hlo.Collective, ...]  # expert-weight gradients summed over data
    scatters: tuple[hlo.Collective, ...]  # expert-weight gradients reduce-scattered over fsdp
    checks: tuple[Check, ...]


THEORY = r"""
Each of the N devices of an EP group routes its T tokens to k experts each. Dispatch sends every routed copy to the
device of its expert, combine brings the result back (GShard, Lepikhin et al. 2020, §2.2 and Algorithm 2):

- routed elements, dispatch + combine, over the group: **2 · B·L · d · k** (B·L = N·T tokens, the quick
  reference's count);
- a share **(N-1)/N** of them crosses devices when experts are chosen uniformly (nccl-tests' all-to-all factor);
- static shapes give each expert **C = ceil(T·k/E · cf)** slots per device (Switch Transformer eq. 3), and the
  all-to-all carries the whole padded buffer, **E · C · d** elements per device and direction, however many
  slots the router filled: about cf times the routed elements, E/k times with no dropping (C = T).

With data or FSDP axes besides `expert`, each EP group runs its own all-to-alls (replica groups over `expert` only),
and FSDP adds an all-gather of the local experts' weights over `fsdp` (reduce-scatter of their gradients in the
backward pass), as for any FSDP weight.
"""


def run(config: Config) -> Result:
    devices = devices_for(config.target)
    n = len(devices)
    base = Case(config.experts, config.top_k, config.capacity_factor, config.ep)
    cases = _cases(config, base, n)
    rows = [
        _compile_case(case, config, devices, unannotated=case == base) for case in track(cases, "compile EP layers")
    ]
    timed = [r for r in rows if r["case"] in (base, replace(base, capacity_factor=None))]
    timings = [_run(row, config, devices) for row in track(timed, "run and time EP layers")]
    composed = _with_fsdp(config, base, devices)
    tpu_tables, tpu_rows, tpu_checks = _on_tpu(config, base)
    base_row = rows[0]
    checks = [
        *(c for t in timings for c in t.checks),
        *_traffic_checks(rows, base_row),
        *composed.checks,
        *tpu_checks,
    ]
    return Result(
        summary=_summary(base_row, rows, timings, n),
        theory=THEORY,
        tables=[
            _sweep_table(rows),
            _gshard_table(rows, base_row),
            composed.table,
            _timing_table(timings),
            *tpu_tables,
        ],
        checks=checks,
        plots={"bytes": _plot(rows)},
        notes=_notes(base_row, composed, tpu_rows, timings),
        provenance=provenance(target=config.target, devices=devices, mesh=f"data={n // base.ep},expert={base.ep}"),
        data={
            "rows": [
                {
                    "label": r["label"],
                    **asdict(r["traffic"]),
                    **{
                        k: r[k]
                        for k in ("routed_bytes", "padded_bytes", "hand_all_to_all_bytes", "gshard_all_to_all_bytes")
                    },
                }
                for r in rows
            ],
            "timings_ms": [{"case": t.case.label, **{k: v.median * 1e3 for k, v in t.times.items()}} for t in timings],
        },
    )


def _cases(config: Config, base: Case, n: int) -> list[Case]:
    """The base case, then one setting changed at a time."""
    factors = [_capacity_factor(text) for text in config.sweep_capacity]
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


def _capacity_factor(text: str) -> float | None:
    if text.strip().lower() == "none":
        return None
    try:
        return float(text)
    except ValueError:
        raise LabError(f"capacity factor {text!r}: write a number such as 1.25, or none for no dropping") from None


def _mesh(case: Case, devices):
    return MeshSpec(data=len(devices) // case.ep, expert=case.ep).build(devices)


def _collectives(layer, tokens: int, program=None) -> tuple[hlo.Collective, ...]:
    return hlo.inspect(program or layer.fn, *layer.abstract(tokens), mesh=layer.mesh).collectives


def _all_to_alls(found) -> list[hlo.Collective]:
    return [c for c in found if c.kind == "all-to-all"]


def _compile_case(case: Case, config: Config, devices, *, unannotated: bool = False) -> dict:
    mesh, moe, tokens = _mesh(case, devices), case.moe(config), config.tokens_per_device * len(devices)
    layers = {"expert_parallel": expert_parallel(mesh, moe), "gshard": gshard(mesh, moe)}
    traffic = theory.moe_traffic(
        config.tokens_per_device, config.d_model, case.experts, case.top_k, case.ep, case.capacity_factor
    )
    hand, xla = (_collectives(layer, tokens) for layer in layers.values())
    return {
        "case": case,
        "label": case.label,
        "traffic": traffic,
        "hand": hand,
        "gshard": xla,
        "layers": layers,
        "unannotated": _collectives(gshard(mesh, moe, annotate_masks=False), tokens) if unannotated else (),
        "routed_bytes": traffic.elements * 4,
        "padded_bytes": traffic.padded_elements * 4,
        "cross_device_bytes": traffic.padded_elements * 4 * traffic.cross_device_fraction,
        "hand_all_to_all_bytes": sum(c.operand_bytes for c in _all_to_alls(hand)),
        "gshard_all_to_all_bytes": sum(c.operand_bytes for c in _all_to_alls(xla)),
        "hand_shape_ok": [c.axes for c in _all_to_alls(hand)] == [("expert",)] * 2,
    }


def _traffic_checks(rows: list[dict], base: dict) -> list:
    checks = [
        check(
            "every case: the hand-written layer compiles to exactly 2 all-to-alls, both over expert",
            True,
            all(r["hand_shape_ok"] for r in rows),
        )
    ]
    checks += [
        check(
            f"{r['label']}: all-to-all bytes per device = 2·E·C·d·4",
            r["padded_bytes"],
            r["hand_all_to_all_bytes"],
            rtol=1e-9,
        )
        for r in rows
    ]
    checks += [
        check(
            f"{r['label']}: GShard's all-to-alls carry the same bytes as the hand-written ones",
            r["hand_all_to_all_bytes"],
            r["gshard_all_to_all_bytes"],
            rtol=1e-9,
        )
        for r in rows
    ]
    traffic, ep = base["traffic"], base["case"].ep
    checks.append(
        check(
            f"{base['label']}: dispatch + combine bytes over the EP group, "
            f"2·B·L·d·k·4 with B·L = {ep * traffic.tokens}",
            ep * base["routed_bytes"],
            ep * base["hand_all_to_all_bytes"],
            rtol=0.01,
            explained=f"padding: each all-to-all carries all E·C = {traffic.experts * traffic.capacity} "
            "slots per device, "
            f"{traffic.padding_factor:.2f}x the {traffic.tokens * traffic.top_k} routed copies",
        )
    )
    return checks


def _run(row: dict, config: Config, devices) -> Timed:
    """Numerics and time of one case's compiled layers.

    Without dropping they must equal one device; with dropping, the reference with the same groups.
    """
    case, moe, tokens = row["case"], row["case"].moe(config), config.tokens_per_device * len(devices)
    x = jax.random.normal(jax.random.key(1), (tokens, config.d_model))
    params = init_experts(moe, jax.random.key(0))
    params = params.replace(router_DE=params.router_DE * 50)  # a decisive router: capacity really drops tokens
    groups = 1 if case.capacity_factor is None else len(devices)
    reference = np.asarray(jax.jit(moe_reference, static_argnums=(2, 3))(params, x, moe, groups))
    errors, times = {}, {}
    for name, layer in row["layers"].items():
        placed = layer.place(params, x)
        errors[name] = float(np.max(np.abs(np.asarray(layer(*placed).y_TD) - reference)))
        times[name] = time_fn(layer, *placed, repeats=config.repeats)
    one_device = jax.jit(lambda p, x: moe_local(p, x, moe).y_TD)
    times["one device, all tokens"] = time_fn(
        one_device, jax.device_put(params, devices[0]), jax.device_put(x, devices[0]), repeats=config.repeats
    )
    against = "the single-device MoE" if groups == 1 else "the reference with the same groups"
    checks = tuple(
        check(f"{case.label}, {name}: max |sharded - {against}| <= 1e-5 (got {err:.1e})", True, err <= 1e-5)
        for name, err in errors.items()
    )
    return Timed(case, times, errors, checks)


def _with_fsdp(config: Config, base: Case, devices) -> Composed:
    """EP over `expert`, experts also split over `fsdp`, tokens over `data` too: collectives with and without grads."""
    data = 2 if len(devices) % 8 == 0 else 1
    case = replace(base, ep=len(devices) // (2 * data))
    mesh = MeshSpec(data=data, fsdp=2, expert=case.ep).build(devices)
    layer = expert_parallel(mesh, case.moe(config))
    tokens = config.tokens_per_device * len(devices)

    def loss(params, x_TD, balance, bias_E):
        return jnp.sum(layer.fn(params, x_TD, balance, bias_E).y_TD ** 2)

    forward = _collectives(layer, tokens)
    backward = _collectives(layer, tokens, jax.jit(jax.grad(loss, argnums=(0, 1))))
    whole_expert_bytes = base.experts // case.ep * config.d_model * config.d_ff * 4
    gathers = [c for c in forward if c.kind == "all-gather"]
    label = f"data={data},fsdp=2,expert={case.ep}"
    checks = [
        check(
            f"{label}: forward all-gathers the local experts' weights over fsdp, (E/N)·d·f·4 each",
            whole_expert_bytes,
            int(np.mean([c.size_bytes for c in gathers])) if gathers else 0,
            rtol=1e-9,
        ),
        check(
            f"{label}: forward + backward all-to-alls over expert (dispatch, combine and their transposes)",
            4,
            len(_all_to_alls(backward)),
        ),
        check(
            f"{label}: expert-weight gradients are reduce-scattered over fsdp",
            True,
            any(c.kind == "reduce-scatter" and c.axes == ("fsdp",) for c in backward),
        ),
    ]
    if data > 1:
        checks.append(
            check(
                f"{label}: expert-weight gradients are summed over data (all-reduce)",
                True,
                any(c.kind == "all-reduce" and c.axes == ("data",) for c in backward),
            )
        )
    rows = [
        [
            program,
            c.kind,
            ",".join(c.axes) if c.axes else "(groups of 1)" if c.group_size == 1 else "?",
            format_bytes(c.size_bytes),
            c.op_name or "",
        ]
        for program, found in (("forward", forward), ("forward + backward", backward))
        for c in found
    ]
    table = Table(
        f"EP with data and FSDP: mesh {label}, base case", ["program", "collective", "axes", "size S", "JAX op"], rows
    )
    singletons = tuple(c for c in backward if c.group_size == 1)
    data_sums = tuple(c for c in backward if c.kind == "all-reduce" and c.axes == ("data",))
    scatters = tuple(c for c in backward if c.kind == "reduce-scatter" and c.axes == ("fsdp",))
    return Composed(table, singletons, data_sums, scatters, tuple(checks))


def _on_tpu(config: Config, base: Case) -> tuple[list[Table], list, list]:
    """The base case for a TPU topology: which collectives, and in which dtype (its table, rows and checks)."""
    tpu = kit.tpu_chips(config.tpu_topology)
    if not isinstance(tpu, kit.TpuChips):
        return [tpu.table()] if tpu else [], [], []
    case = replace(base, ep=min(base.ep, len(tpu)))
    mesh, moe, tokens = _mesh(case, tpu.devices), case.moe(config), config.tokens_per_device * len(tpu)
    rows, dispatch = [], {}
    for precision, builds in (("default", (expert_parallel, gshard)), ("highest", (expert_parallel,))):
        with jax.default_matmul_precision(precision):
            for build in builds:
                found = _collectives(build(mesh, moe), tokens)
                rows.append(
                    [
                        build.__name__,
                        precision,
                        "; ".join(
                            f"{c.kind}[{','.join(c.axes or ())}] {c.dtypes[0]} {format_bytes(c.operand_bytes)}"
                            for c in found
                        ),
                    ]
                )
                if build is expert_parallel:
                    dispatch[precision] = _all_to_alls(found)[0] if _all_to_alls(found) else None
    f32_bytes = (
        theory.moe_traffic(
            config.tokens_per_device, config.d_model, case.experts, case.top_k, case.ep, case.capacity_factor
        ).padded_elements
        // 2
        * 4
    )
    checks = []
    for precision, found in dispatch.items():
        observed = found.operand_bytes if found else 0
        explained = None
        if found and found.dtypes[0] == "bf16" and precision == "default":
            explained = (
                "the TPU compiler moved the bf16 rounding of the default-precision expert matmul ahead of the dispatch "
                "all-to-all, halving its bytes; at 'highest' precision it stays f32"
            )
        checks.append(
            check(
                f"tpu:{config.tpu_topology} ({precision} precision): dispatch all-to-all bytes, f32 E·C·d·4",
                f32_bytes,
                observed,
                rtol=1e-9,
                explained=explained,
            )
        )
    table = Table(
        f"Compiled for {tpu.target} (compile-only), base case",
        ["program", "matmul precision", "collectives the TPU compiler wrote"],
        rows,
    )
    return [table], rows, checks


# --- the page ----------------------------------------------------------------------------


def _sweep_table(rows: list[dict]) -> Table:
    body = [
        [
            r["label"],
            r["traffic"].capacity,
            format_bytes(r["routed_bytes"]),
            format_bytes(r["padded_bytes"]),
            f"{r['traffic'].padding_factor:.2f}x",
            format_bytes(r["hand_all_to_all_bytes"]),
            format_bytes(r["cross_device_bytes"]),
            format_bytes(r["gshard_all_to_all_bytes"]),
        ]
        for r in rows
    ]
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
        ],
        body,
    )


def _gshard_table(rows: list[dict], base: dict) -> Table:
    body = [[r["label"], "hand-written", _describe(r["hand"])] for r in rows[:1]]
    body += [[r["label"], "GShard-style", _describe(r["gshard"])] for r in rows]
    body.append([base["label"], "GShard-style, dispatch masks unannotated", _describe(base["unannotated"])])
    return Table(
        "Every collective: hand-written against XLA-inserted (GShard-style)",
        ["case", "program", "collectives in the HLO"],
        body,
    )


def _describe(found) -> str:
    return "; ".join(f"{c.kind}[{','.join(c.axes) if c.axes else '-'}] {format_bytes(c.operand_bytes)}" for c in found)


def _timing_table(timings: list[Timed]) -> Table:
    body = [
        [t.case.label, name, str(timing), f"{timing.median / t.times['expert_parallel'].median:.2f}x"]
        for t in timings
        for name, timing in t.times.items()
    ]
    return Table(
        "Forward time on this target (median [min, max])", ["case", "program", "time", "vs hand-written"], body
    )


def _plot(rows: list[dict]):
    figure = Figure(figsize=(8, 4.2))
    axes = figure.subplots()
    positions = np.arange(len(rows))
    axes.bar(positions - 0.2, [r["routed_bytes"] for r in rows], 0.4, label="routed: 2·T·k·d·4 (theory, no padding)")
    axes.bar(
        positions + 0.2, [r["hand_all_to_all_bytes"] for r in rows], 0.4, label="compiled all-to-alls (HLO, padded)"
    )
    axes.set_xticks(positions, [r["label"].replace(" ", "\n") for r in rows], fontsize=7)
    axes.set_yscale("log")
    axes.set_ylabel("bytes per device, forward")
    axes.set_title("Padding to capacity, not routing, sets the all-to-all bytes")
    axes.legend(fontsize=8)
    return figure


def _summary(base: dict, rows: list[dict], timings: list[Timed], n: int) -> str:
    no_drop = next((r for r in rows if r["case"].capacity_factor is None), None)
    times = timings[0].times
    text = (
        f"On {n} devices the hand-written EP layer ({base['label']}) compiles "
        "to exactly two all-to-alls over the expert axis, "
        f"{format_bytes(base['hand_all_to_all_bytes'])} per device in all: "
        f"the padded buffers 2·E·C·d, {base['traffic'].padding_factor:.2f}x "
        "the "
        f"{format_bytes(base['routed_bytes'])} that 2·T·k·d predicts from routing alone. "
    )
    if no_drop:
        text += f"Without dropping the padding grows to {no_drop['traffic'].padding_factor:.0f}x (E/k). "
    same = all(r["gshard_all_to_all_bytes"] == r["hand_all_to_all_bytes"] for r in rows)
    text += (
        "XLA's partitioner gives the GShard-style layer all-to-alls of the same bytes in every case. "
        if same
        else "XLA's partitioner gives the GShard-style layer all-to-alls of "
        "other sizes than the hand-written ones (see the tables). "
    )
    text += (
        f"Forward time of the base case here (medians): hand-written {times['expert_parallel'].median * 1e3:.1f} ms, "
        f"GShard-style {times['gshard'].median * 1e3:.1f} ms, the same layer "
        f"on one device {times['one device, all tokens'].median * 1e3:.1f} "
        "ms."
    )
    return text


def _notes(base: dict, composed: Composed, tpu_rows: list, timings: list[Timed]) -> list[str]:
    notes = []
    extra = [c for c in base["gshard"] if c.kind != "all-to-all" and "top_k" in (c.op_name or "")]
    if extra:
        tpu_gathers = any("all-gather" in row[2] for row in tpu_rows if row[0] == "gshard")
        tpu_text = (
            {
                True: " The TPU compiler gathers too (see its table).",
                False: " The TPU compiler does not (see its table).",
            }.get(tpu_gathers)
            if tpu_rows
            else ""
        )
        notes.append(
            f"On CPU the GShard-style program also all-gathers the router logits over all groups before top_k "
            f"({format_bytes(extra[0].operand_bytes)} per device, op `{extra[0].op_name}`): "
            "the CPU partitioner does not split top_k "
            f"along its batch dimension.{tpu_text}"
        )
    unannotated = Counter(c.kind for c in base["unannotated"])
    if unannotated["all-to-all"] != 2:
        notes.append(
            "Leaving the dispatch and combine masks unannotated (gshard(..., "
            "annotate_masks=False)) changes XLA's plan: "
            f"{', '.join(f'{count} {kind}' for kind, count in unannotated.items())} instead of two all-to-alls "
            "(the routing's sharding is lost in propagation, so the partitioner "
            "gathers tokens and masks and reduces the combine)."
        )
    if composed.singletons:
        c = composed.singletons[0]
        notes.append(
            "In the backward pass XLA keeps an all-reduce whose replica groups "
            f"hold one device each ({format_bytes(c.operand_bytes)}, "
            f"op `{c.op_name}`): shard_map's transpose sums the expert-weight "
            "gradients over the size-1 mesh axes, and the CPU compiler "
            "does not remove the no-op collective."
        )
    if (
        composed.data_sums
        and composed.scatters
        and composed.data_sums[0].size_bytes > sum(c.size_bytes for c in composed.scatters) / 2
    ):
        notes.append(
            f"The backward pass sums the expert-weight gradients over data first, on the whole gathered weights "
            f"({format_bytes(composed.data_sums[0].size_bytes)} all-reduce), "
            "and reduce-scatters over fsdp after. Reduce-scattering first "
            "would all-reduce only each device's 1/fsdp shard. JAX puts the "
            "sum over data at the transpose of the expert matmul "
            "(op `psum_invariant`), before the transpose of the all-gather, and XLA does not swap them."
        )
    hand_default = next((row[2] for row in tpu_rows if row[:2] == ["expert_parallel", "default"]), "")
    if "bf16" in hand_default:
        combine = (
            " The combine all-to-all of the hand-written layer stays f32: "
            "a gather stands between it and the gate-weighted sum."
            if "all-to-all[expert] f32" in hand_default
            else ""
        )
        notes.append(
            "The TPU compiler rounds the dispatch all-to-all to bf16 under "
            "default matmul precision: its only consumer is a "
            f"matmul that would round its input anyway.{combine}"
        )
    no_drop = timings[-1].times
    ratio = no_drop["gshard"].median / no_drop["expert_parallel"].median
    if ratio > 1:
        notes.append(
            f"Without dropping (C = T) the GShard-style dense dispatch takes {ratio:.1f}x the time of the hand-written "
            "scatter/gather: its einsums cost T·E·C·d, quadratic in the group's tokens, where a scatter costs T·k·d."
        )
    notes.append(
        "Times on cpu:N come from emulated devices sharing this machine's "
        "cores: compare them only within this run, as ratios."
    )
    return notes
