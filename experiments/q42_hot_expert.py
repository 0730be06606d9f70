"""What a hot expert costs: dropped tokens, not time, and what capacity or replication buys back.

Question #42 lists what an overloaded ("hot") expert does: it overflows, the
others idle, throughput suffers. Under XLA the shapes are static: every
expert's buffer has the same C = ceil(T·k/E · cf) slots whatever the router
does, so the program, its all-to-alls and its time are the same for any
routing. A hot expert costs *dropped tokens*; buying them back costs capacity
for every expert (cf must reach h·E for a share h), or slots spent on copies
of the hot expert (replication: the hot expert's tokens split over r
replicas, each with its own C).

The experiment routes a controlled share h of each device's tokens to one
expert of the expert-parallel layer (`lab.parallel.expert`, 8 devices, 2
expert slots each), the rest evenly to the others, and measures the dropped
share and the forward time for several capacity factors and replica counts,
against `lab.theory.dropped_share` and `capacity_factor_to_drop_nothing`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
from matplotlib.figure import Figure

from experiments import kit
from lab import theory
from lab.bench import Timing, time_interleaved
from lab.errors import LabError
from lab.mesh import MeshSpec
from lab.moe import RouterConfig, parse_capacity_factor
from lab.parallel.expert import MoEConfig, expert_parallel, init_experts
from lab.progress import track
from lab.provenance import Setup
from lab.report import Result, Table
from lab.targets.devices import DEFAULT_TARGET, devices_for
from lab.units import format_bytes
from lab.verdict import Check, Claim, check

QUESTION = "#42"
SAME_PROGRAM_BAND = 1 / 3  # hot ÷ cold time of one compiled program within [2/3, 1.5]: noise on a shared machine
CAPACITY_BOUND = 2.0  # no dropping (C = T) takes at least this many times cf=1's forward time


@dataclass(frozen=True)
class Config:
    target: str = DEFAULT_TARGET
    """where to run (cpu:N, gpu, tpu)"""
    slots: int = 16
    """expert slots (physical experts) over the whole expert axis"""
    tokens_per_device: int = 256
    """tokens each device routes (one group), top-1"""
    d_model: int = 64
    """model width (at least `slots`: the routing is steered through the first features)"""
    d_ff: int = 256
    """each expert's hidden width"""
    hot_shares: tuple[float, ...] = (0.0625, 0.125, 0.25, 0.5, 0.75)
    """share h of each group's tokens routed to the hot expert"""
    capacity_factors: tuple[str, ...] = ("1.0", "1.25", "2.0", "4.0", "none")
    """none = no dropping (C = all the group's tokens)"""
    replicas: tuple[int, ...] = (1, 2, 4)
    """copies of the hot expert, each in its own slot, at capacity factor `replicated_at`"""
    replicated_at: float = 1.25
    """capacity factor of the replication runs (one of `capacity_factors`)"""
    repeats: int = 15
    """timed rounds per program (interleaved), after warm-up"""


@dataclass(frozen=True)
class Routed:
    """One routing through one compiled layer: what the layer's own load counts said (summed over devices)."""

    hot_share: float
    capacity_factor: float | None
    replicas: int
    dropped: int  # assignments that found their slot full
    chosen: int  # assignments the router made
    tokens_per_slot: tuple[int, ...]  # assignments each slot was chosen for, before dropping


@dataclass(frozen=True)
class Program:
    """One capacity factor's compiled layer: its collectives, and its forward time at the coldest and hottest share."""

    capacity_factor: float | None
    collectives: tuple[kit.Seen, ...]
    cold: Timing
    hot: Timing


@dataclass(frozen=True)
class Observations:
    setup: Setup
    devices: int
    runs: tuple[Routed, ...]
    programs: tuple[Program, ...]

    def run(self, hot_share: float, factor: float | None, replicas: int = 1) -> Routed:
        return next(
            r for r in self.runs if r.hot_share == hot_share and r.capacity_factor == factor and r.replicas == replicas
        )

    def program(self, factor: float | None) -> Program:
        return next(p for p in self.programs if p.capacity_factor == factor)


THEORY = r"""
Top-1 routing, T tokens per device, S expert slots, capacity C = ceil(T/S · cf) per slot (Switch Transformer eq. 3).
A hot expert with a share h of the tokens, spread over r replica slots, receives h·T/r per replica; the other
S - r slots share the rest evenly. Assignments beyond C are dropped, slot by slot (idle slots do not absorb an
overflow):

  dropped share = [ r · max(0, h·T/r − C) + (S−r) · max(0, (1−h)·T/(S−r) − C) ] / T  (`lab.theory.dropped_share`)

Nothing drops once C ≥ h·T/r, i.e. cf ≥ h·S/r (`lab.theory.capacity_factor_to_drop_nothing`). Capacity is one
number for all slots, so raising cf for the hot expert raises every buffer, every all-to-all (2·S·C·d per device)
and every expert matmul with it; replication raises only the hot expert's share of the slots.
"""


# --------------------------------------------------------------------------- measure


def measure(config: Config) -> Observations:
    devices = devices_for(config.target)
    factors = [parse_capacity_factor(text) for text in config.capacity_factors]
    _validate(config, devices, factors)
    mesh = MeshSpec(expert=len(devices)).build(devices)
    compiled, collectives = {}, {}
    for factor in track(factors, "compile one layer per capacity factor"):
        layer = _layer(config, mesh, factor)
        compiled[factor] = layer
        _, inspection = kit.compile_and_inspect(
            layer.fn, *layer.abstract(config.tokens_per_device * len(devices)), mesh=mesh
        )
        collectives[factor] = kit.seen(inspection.collectives)
    runs = [_route(config, compiled[f], h, 1) for f in factors for h in config.hot_shares]
    runs += [
        _route(config, compiled[config.replicated_at], h, r)
        for r in config.replicas
        if r != 1
        for h in config.hot_shares
    ]
    timings = _time(config, compiled)
    programs = tuple(Program(f, collectives[f], timings[_key(f, "cold")], timings[_key(f, "hot")]) for f in factors)
    return Observations(Setup.of(config.target, devices, f"expert={len(devices)}"), len(devices), tuple(runs), programs)


def _validate(config: Config, devices, factors) -> None:
    if config.slots % len(devices):
        raise LabError(
            f"{config.slots} expert slots do not split over {len(devices)} devices; use a multiple of {len(devices)}"
        )
    if config.d_model < config.slots:
        raise LabError(
            f"d_model={config.d_model} must be >= slots={config.slots}: the "
            f"routing is steered through the first {config.slots} features"
        )
    if max(config.replicas) >= config.slots or min(config.replicas) < 1:
        raise LabError(f"replicas {config.replicas}: each must be between 1 and slots-1 = {config.slots - 1}")
    if config.replicated_at not in factors:
        raise LabError(
            f"replicated_at={config.replicated_at} must be one of the capacity factors {config.capacity_factors}"
        )
    if any(not 0 < h < 1 for h in config.hot_shares):
        raise LabError(f"hot shares {config.hot_shares}: each must be strictly between 0 and 1")


def _layer(config: Config, mesh, factor: float | None):
    moe = MoEConfig(config.d_model, config.d_ff, RouterConfig(experts=config.slots, top_k=1, capacity_factor=factor))
    return expert_parallel(mesh, moe)


def _targets(config: Config, hot_share: float, replicas: int) -> np.ndarray:
    """Each token's slot in one group: the first h·T round-robin over the hot expert's replicas, the rest elsewhere."""
    tokens = config.tokens_per_device
    hot = round(hot_share * tokens)
    index = np.arange(tokens)
    cold_slots = config.slots - replicas
    return np.where(index < hot, index % replicas, replicas + (index - hot) % cold_slots)


def _inputs(config: Config, layer, hot_share: float, replicas: int):
    """Tokens whose first `slots` features point at their target, a router that reads them, replicas sharing weights."""
    devices = layer.mesh.devices.size
    target_T = np.tile(_targets(config, hot_share, replicas), devices)
    x_TD = np.array(jax.random.normal(jax.random.key(1), (target_T.size, config.d_model)))
    x_TD[:, : config.slots] = 8.0 * np.eye(config.slots)[target_T]  # softmax over 8·one-hot: the target wins, p > 0.99
    params = init_experts(layer.config, jax.random.key(0))

    def replicated(w):
        return w.at[1:replicas].set(w[0])

    params = params.replace(
        router_DE=jnp.eye(config.d_model, config.slots),
        w_in_EDF=replicated(params.w_in_EDF),
        w_out_EFD=replicated(params.w_out_EFD),
    )
    return layer.place(params, jnp.asarray(x_TD))


def _route(config: Config, layer, hot_share: float, replicas: int) -> Routed:
    counts = layer(*_inputs(config, layer, hot_share, replicas)).counts
    return Routed(
        hot_share,
        layer.config.router.capacity_factor,
        replicas,
        round(float(counts.dropped)),
        round(float(counts.chosen)),
        tuple(round(float(n)) for n in np.asarray(counts.tokens_per_expert)),
    )


def _key(factor: float | None, which: str) -> str:
    return f"cf={_label(factor)} {which}"


def _time(config: Config, layers: dict) -> dict[str, Timing]:
    """Forward time at the coldest and the hottest share of every layer, round-robin: one compiled program each."""
    shares = {"cold": min(config.hot_shares), "hot": max(config.hot_shares)}
    calls = {
        _key(factor, which): (layer, _inputs(config, layer, h, 1))
        for factor, layer in layers.items()
        for which, h in shares.items()
    }
    return time_interleaved(calls, repeats=config.repeats)


# --------------------------------------------------------------------------- judge


def judge(obs: Observations, config: Config) -> Result:
    factors = [parse_capacity_factor(text) for text in config.capacity_factors]
    checks = _checks(obs, config, factors)
    return Result(
        summary=_summary(obs, config, factors),
        theory=THEORY,
        tables=[_grid_table(obs, config, factors), _replica_table(obs, config), _time_table(obs, config, factors)],
        checks=checks,
        claims=_claims(obs, config, factors),
        plots={"dropped": partial(_plot, obs, config, factors)},
        notes=_notes(),
    )


def _capacity(config: Config, devices: int, factor: float | None) -> int:
    """C per slot and group: Switch eq. 3, T when nothing may drop (`lab.theory.moe_traffic`)."""
    return theory.moe_traffic(config.tokens_per_device, config.d_model, config.slots, 1, devices, factor).capacity


def _theory_share(config: Config, devices: int, hot_share: float, factor: float | None, replicas: int) -> float:
    tokens, cold = config.tokens_per_device, config.slots - replicas
    loads = [hot_share * tokens / replicas] * replicas + [(1 - hot_share) * tokens / cold] * cold
    return theory.dropped_share(loads, _capacity(config, devices, factor))


def _measured_share(run: Routed) -> float:
    return run.dropped / run.chosen if run.chosen else float("nan")


def _row(shares) -> str:
    return ", ".join(_percent(s) for s in shares)


def _all_to_all_bytes(program: Program) -> int:
    return sum(c.size_bytes for c in program.collectives if c.kind == "all-to-all")


def _ratio(numerator: Timing, denominator: Timing) -> float:
    return numerator.median / denominator.median


def _checks(obs: Observations, config: Config, factors) -> list[Check]:
    n, shares = obs.devices, config.hot_shares
    checks = [
        check(
            f"cf={_label(f)}: dropped share at h = {', '.join(f'{h:g}' for h in shares)}",
            _row(_theory_share(config, n, h, f, 1) for h in shares),
            _row(_measured_share(obs.run(h, f)) for h in shares),
            kind="exact",
        )
        for f in factors
    ]
    checks += [
        check(
            f"{r} replicas at cf={config.replicated_at:g}: dropped share at the same h",
            _row(_theory_share(config, n, h, config.replicated_at, r) for h in shares),
            _row(_measured_share(obs.run(h, config.replicated_at, r)) for h in shares),
            kind="exact",
        )
        for r in config.replicas
        if r != 1
    ]
    for f in factors:
        capacity = _capacity(config, n, f)
        checks.append(
            check(
                f"cf={_label(f)}: all-to-all bytes per device, 2·S·C·d·4 with C = {capacity}, whatever the routing",
                2 * config.slots * capacity * config.d_model * 4,
                _all_to_all_bytes(obs.program(f)),
                kind="exact",
            )
        )
    base = obs.program(config.replicated_at)
    checks.append(
        check(
            f"cf={config.replicated_at:g}: forward time at h={max(shares):g} ÷ at h={min(shares):g}",
            1.0,
            _ratio(base.hot, base.cold),
            kind="timing",
            rtol=SAME_PROGRAM_BAND,
            basis="on this target one compiled program, static shapes, runs for any routing: the ratio stays within "
            "[2/3, 1.5], a band wide enough for the shared machine's noise",
        )
    )
    if (
        None in factors
        and factors[0] is not None
        and _capacity(config, n, None) >= 8 * _capacity(config, n, factors[0])
    ):
        checks.append(
            check(
                f"forward time, cf=none ÷ cf={_label(factors[0])}, at h={min(shares):g}",
                CAPACITY_BOUND,
                _ratio(obs.program(None).cold, obs.program(factors[0]).cold),
                kind="timing",
                relation=">=",
                basis=f"on this target raising C from {_capacity(config, n, factors[0])} to "
                f"{_capacity(config, n, None)} slots grows every buffer, all-to-all and expert matmul with it: at "
                "least 2x the time, a bound with margin for noise",
            )
        )
    return checks


def _claims(obs: Observations, config: Config, factors) -> list[Claim]:
    n, hottest, coldest = obs.devices, max(config.hot_shares), min(config.hot_shares)
    base = config.replicated_at
    hot_run = obs.run(hottest, base)
    exact_drops = all(
        _percent(_measured_share(r)) == _percent(_theory_share(config, n, r.hot_share, r.capacity_factor, r.replicas))
        for r in obs.runs
    )
    claims = [
        Claim(
            "capacity = tokens/E × capacity factor caps each expert; what overflows is dropped",
            "confirmed" if exact_drops else "refuted",
            f"the dropped share {'equals' if exact_drops else 'differs from'} Σ max(0, n_i − C)/T with "
            f"C = ceil(T/E·cf) in all {len(obs.runs)} runs; at h = {hottest:g}, cf = {base:g} "
            f"(C = {_capacity(config, n, base)}): {_percent(_measured_share(hot_run))} dropped",
        )
    ]
    program = obs.program(base)
    ratio = _ratio(program.hot, program.cold)
    dropped = _measured_share(hot_run) > 0
    same_time = abs(ratio - 1) <= SAME_PROGRAM_BAND * max(ratio, 1)
    claims.append(
        Claim(
            "a hot expert lowers throughput",
            "refined" if same_time and dropped else "confirmed" if ratio > 1 + SAME_PROGRAM_BAND else "refuted",
            f"static shapes: at cf = {base:g} the forward at h = {hottest:g} took {ratio:.2f}x the time at "
            f"h = {coldest:g} (one compiled program, {format_bytes(_all_to_all_bytes(program))} of all-to-all per "
            f"device either way); the cost was {_percent(_measured_share(hot_run))} of the tokens dropped",
        )
    )
    most = max(config.replicas)
    if most > 1:
        replicated = obs.run(hottest, base, most)
        fewer = _measured_share(replicated) < _measured_share(hot_run)
        claims.append(
            Claim(
                "more replicas of the hot expert relieve it",
                "confirmed" if fewer else "refuted",
                f"at h = {hottest:g}, cf = {base:g}: {_percent(_measured_share(hot_run))} dropped with one copy, "
                f"{_percent(_measured_share(replicated))} with {most}, at the price of {most - 1} slot(s) of "
                f"{config.slots} spent on copies",
            )
        )
    if None in factors and factors[0] is not None:
        first, none = obs.program(factors[0]), obs.program(None)
        capped = _measured_share(obs.run(hottest, factors[0]))
        caps = capped > 0 and _measured_share(obs.run(hottest, None)) == 0
        claims.append(
            Claim(
                "a capacity factor keeps a hot expert in check",
                "refined" if caps else "refuted",
                f"it caps the hot expert by dropping its overflow ({_percent(capped)} "
                f"at h = {hottest:g}, cf = {_label(factors[0])}); nothing drops only from cf = h·E = "
                f"{hottest * config.slots:g}, and capacity is one "
                f"number for all experts, so cf = none moves {_all_to_all_bytes(none) / _all_to_all_bytes(first):.0f}x "
                f"cf = {_label(factors[0])}'s all-to-all bytes and took {_ratio(none.cold, first.cold):.1f}x its time",
            )
        )
    return claims


def _percent(share: float) -> str:
    """Rounded first, so that float noise cannot flip the last digit."""
    return f"{round(share, 6):.2%}"


def _label(factor: float | None) -> str:
    return "none" if factor is None else f"{factor:g}"


def _grid_table(obs: Observations, config: Config, factors) -> Table:
    tokens, n = config.tokens_per_device, obs.devices
    rows = [
        [
            f"{h:g}",
            obs.run(h, factors[0]).tokens_per_slot[0] // n,
            f"{theory.capacity_factor_to_drop_nothing(h * tokens, tokens, config.slots, 1):g}",
            *(
                f"{_percent(_measured_share(obs.run(h, f)))} ({_percent(_theory_share(config, n, h, f, 1))})"
                for f in factors
            ),
        ]
        for h in config.hot_shares
    ]
    return Table(
        f"Dropped share, measured (theory), {tokens} tokens per device, {config.slots} slots, top-1",
        [
            "hot share h",
            "tokens to the hot expert per device (measured)",
            "cf to drop nothing (h·S)",
            *(f"cf={_label(f)} (C={_capacity(config, n, f)})" for f in factors),
        ],
        rows,
    )


def _replica_table(obs: Observations, config: Config) -> Table:
    rows = [
        [
            f"{h:g}",
            *(
                f"{_percent(_measured_share(obs.run(h, config.replicated_at, r)))} "
                f"({_percent(_theory_share(config, obs.devices, h, config.replicated_at, r))})"
                for r in config.replicas
            ),
        ]
        for h in config.hot_shares
    ]
    return Table(
        f"Replicating the hot expert, cf={config.replicated_at:g}: dropped share, measured (theory)",
        ["hot share h", *(f"{r} replica{'s' if r > 1 else ''}" for r in config.replicas)],
        rows,
    )


def _time_table(obs: Observations, config: Config, factors) -> Table:
    coldest, hottest = min(config.hot_shares), max(config.hot_shares)
    first = obs.program(factors[0]).cold
    rows = [
        [
            _label(f),
            _capacity(config, obs.devices, f),
            format_bytes(_all_to_all_bytes(p)),
            str(p.cold),
            str(p.hot),
            f"{_ratio(p.hot, p.cold):.2f}",
            f"{_ratio(p.cold, first):.2f}x",
        ]
        for f in factors
        for p in [obs.program(f)]
    ]
    return Table(
        "Forward time: set by capacity, not by routing (median [min, max], all programs timed round-robin)",
        [
            "cf",
            "C",
            "all-to-all bytes per device (HLO)",
            f"time, h={coldest:g}",
            f"time, h={hottest:g}",
            "hot ÷ cold",
            f"vs cf={_label(factors[0])}",
        ],
        rows,
    )


def _plot(obs: Observations, config: Config, factors) -> Figure:
    figure = Figure(figsize=(11, 4))
    left, right = figure.subplots(1, 2)
    shares, colors = list(config.hot_shares), matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    n = obs.devices
    for color, f in zip(colors, factors):
        left.plot(shares, [_measured_share(obs.run(h, f)) for h in shares], "o-", color=color, label=f"cf={_label(f)}")
        left.plot(shares, [_theory_share(config, n, h, f, 1) for h in shares], "--", color=color, alpha=0.5)
    for color, r in zip(colors[len(factors) :], [r for r in config.replicas if r != 1]):
        left.plot(
            shares,
            [_measured_share(obs.run(h, config.replicated_at, r)) for h in shares],
            "s:",
            color=color,
            label=f"{r} replicas, cf={config.replicated_at:g}",
        )
    left.set(
        xlabel="share of tokens to the hot expert", ylabel="share of tokens dropped", title="Dropped (dashed: theory)"
    )
    left.legend(fontsize=7)
    labels = [_label(f) for f in factors]
    right.plot(labels, [obs.program(f).cold.median * 1e3 for f in factors], "o-", label=f"hot share {min(shares):g}")
    right.plot(labels, [obs.program(f).hot.median * 1e3 for f in factors], "o-", label=f"hot share {max(shares):g}")
    right.set(xlabel="capacity factor", ylabel="forward time, ms (median)", title="Time follows capacity, not routing")
    right.legend(fontsize=8)
    return figure


def _summary(obs: Observations, config: Config, factors) -> str:
    hottest, coldest, base = max(config.hot_shares), min(config.hot_shares), config.replicated_at
    program, hot_run = obs.program(base), obs.run(hottest, base)
    most = max(config.replicas)
    no_drop = None if None in factors else factors[-1]
    text = (
        f"With {hottest:.0%} of the tokens on one of {config.slots} expert slots and capacity factor {base:g}, "
        f"{_measured_share(hot_run):.0%} of the tokens were dropped (theory "
        f"{_theory_share(config, obs.devices, hottest, base, 1):.0%}), and the forward took "
        f"{_ratio(program.hot, program.cold):.2f}x the time at h = {coldest:g}: the same compiled program, with the "
        f"same all-to-alls and matmuls, runs whatever the routing. Dropping nothing at that share takes "
        f"cf = {hottest * config.slots:g}, which grows every buffer: cf={_label(no_drop)} took "
        f"{_ratio(obs.program(no_drop).cold, obs.program(factors[0]).cold):.1f}x the time of cf={_label(factors[0])}."
    )
    if most > 1:
        text += (
            f" {most} replicas of the hot expert cut the drop from {_measured_share(hot_run):.0%} to "
            f"{_measured_share(obs.run(hottest, base, most)):.0%} at the same capacity, at the price of slots (and "
            "weights) spent on copies."
        )
    return text


def _notes() -> list[str]:
    return [
        "On a GPU with dynamic (ragged) dispatch the cost of a hot expert shows up the other way round: no token is "
        "dropped, but the device holding the hot expert computes longest and the whole step waits for it. Static "
        "shapes trade that straggler for dropped tokens.",
        "The routing here is steered, not learned: each token's first features point at its target slot and the "
        "router reads them, so the loads are exact and the theory has no randomness to average over.",
        "Times on cpu:N come from emulated devices sharing this machine's cores: they are compared only within this "
        "run, as ratios of programs timed round-robin, and judged against bands wide enough for that noise.",
    ]
