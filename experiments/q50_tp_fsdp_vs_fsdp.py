"""FSDP x TP against a very large FSDP: equal chips, 64 to 1024 and across DCN slices.

Question #50: why put tensor parallelism inside the fast domain and FSDP
across it, rather than growing FSDP? At a fixed global batch of B tokens,
FSDP over N chips moves the whole weights through every chip each step (all-
gather forward and backward, reduce-scatter of the gradients) while each chip's
compute shrinks as B/N: past B/N ≈ α/M_X (`scaling_thresholds`) the step is
communication-bound and more chips stop paying. FSDP over X chips x TP over
Y = N/X moves weights X-ways and activations Y-ways; the communication is least
at X_opt = sqrt((B/F)·(M_X/M_Y)·N) (the scaling book, Part 5). Across slices
the FSDP axis crosses the data-centre network and pays far more per byte.

Here the MLP block of `scaling_thresholds` (the same program, through its
`compile_mlp_step`) is compiled by the TPU compiler (compile-only) for v5p
slices from 64 to 1024 chips and for two slices over DCN, as pure FSDP and as
FSDP x TP with TP at N/X_opt. What is observed is the program XLA wrote (its
FLOPs and its collectives per mesh axis); its step is modelled by the roofline
of that program (no TPU ran), and set against the book's ratio of
communication to compute.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from matplotlib.figure import Figure

from experiments.q50_scaling_thresholds import (
    MlpStep,
    bandwidth_rule_s,
    bus_bytes,
    chip_of,
    collective_seconds,
    communication_s,
    compile_mlp_step,
    compute_s,
    flops_check,
    group_mismatches,
    latency_share,
    overlapped_s,
    ratio,
    torus_axes,
)
from lab import theory
from lab.progress import track
from lab.provenance import Setup
from lab.report import Result, Table
from lab.targets.devices import parse_target, topology_devices
from lab.theory.scaling import fsdp_tp_comm_to_compute
from lab.units import format_bytes
from lab.verdict import Check, Claim, check

QUESTION = "#50"
COMPILE_ONLY = True  # runs on TPU topologies through libtpu, whatever target `lab report` uses
RATIO_RTOL = 0.02
RATIO_BASIS = (
    "the roofline prices each collective as max(hop latency, bytes / bandwidth), the bandwidth rule bytes over "
    "bandwidth alone; hop latency is under 2% of the communication at these sizes (the most: the 4-byte loss "
    "all-reduce on 1024 chips, 16 us of 1.2 ms)"
)


@dataclass(frozen=True)
class Config:
    target: str = "tpu:v5p:4x4x4"
    """a TPU generation to compile for (compile-only); the topologies below are of this generation"""
    topologies: tuple[str, ...] = ("4x4x4", "8x8x16")
    """single-slice topologies, 64 to 1024 chips (add 8x8x4 for 256: about 15 s more)"""
    dcn_topology: str = "4x4x4"
    """a slice repeated `dcn_slices` times, FSDP across the slices ('' to skip)"""
    dcn_slices: int = 2
    """slices joined over DCN"""
    global_tokens: int = 131072
    """B, tokens per step (fixed: strong scaling)"""
    embed: int = 8192
    """D, the model width"""
    mlp: int = 32768
    """F, the MLP width"""


@dataclass(frozen=True)
class Machine:
    """One machine's two programs at the same global batch."""

    name: str  # "v5p:4x4x4", "v5p:4x4x4 x2 slices"
    slices: int
    fsdp: MlpStep  # fsdp=N
    mixed: MlpStep  # fsdp=N/Y,tensor=Y with Y = N / X_opt


@dataclass(frozen=True)
class Observations:
    setup: Setup
    machines: tuple[Machine, ...]


# --------------------------------------------------------------------------- measure


def _generation(config: Config) -> str:
    target = parse_target(config.target)
    return target.generation if target.compile_only else parse_target(Config.target).generation


def measure(config: Config) -> Observations:
    generation = _generation(config)
    wanted = [(f"{generation}:{t}", f"{generation}:{t}", 1) for t in config.topologies]
    if config.dcn_topology:
        topology = f"{generation}:{config.dcn_topology}"
        wanted.append((f"{topology} x{config.dcn_slices} slices", topology, config.dcn_slices))
    machines = []
    for name, topology, slices in track(wanted, "topologies"):
        chips = topology_devices(topology, slices) if slices > 1 else topology_devices(topology)
        machines.append(_compare(name, slices, chips, config))
    last = wanted[-1]
    devices = topology_devices(last[1], last[2]) if last[2] > 1 else topology_devices(last[1])
    return Observations(Setup.of(f"tpu:{generation}", devices, "fsdp=N; fsdp=N/Y,tensor=Y"), tuple(machines))


def _tensor_ways(chips: int, config: Config) -> int:
    """Y = N / X_opt, rounded to a power of two (at least 2)."""
    x_opt = theory.fsdp_tp_optimal_fsdp_ways(config.global_tokens, config.mlp, chips)
    y = max(2, round(chips / x_opt))
    return 1 << (y.bit_length() - 1) if y & (y - 1) else y


def _compare(name: str, slices: int, chips, config: Config) -> Machine:
    n = len(chips)
    y = _tensor_ways(n, config)
    shapes = {"embed": config.embed, "mlp": config.mlp, "batch_per_chip": config.global_tokens // n, "topology": name}
    return Machine(
        name,
        slices,
        compile_mlp_step("fsdp=-1", chips, **shapes),
        compile_mlp_step(f"fsdp=-1,tensor={y}", chips, **shapes),
    )


# --------------------------------------------------------------------------- judge


def judge(obs: Observations, config: Config) -> Result:
    return Result(
        summary=_summary(obs, config),
        theory=THEORY,
        tables=[_optimum_table(obs, config), _step_table(obs), _axis_table(obs)],
        checks=[c for m in obs.machines for c in _checks(m, config)],
        claims=_claims(obs, config),
        plots={"crossover": partial(_plot, obs, config)},
        notes=_notes(obs, config),
    )


THEORY = r"""
Per step of an MLP block (the scaling book, Part 5, "How to Parallelize a Transformer for Training"), B tokens,
width D, MLP width F, N chips, α = C / W_ici (2550 on v5p), M_X, M_Y the torus axes the FSDP and TP mesh axes span:

* compute per chip: 12·B·D·F / N FLOPs, whatever the split;
* FSDP over X chips: all-gather the weights forward and backward and reduce-scatter their gradients, 3 collectives of
  2·D·F·bytes / Y per weight pair: **independent of X**, so at fixed B the ratio to compute grows like N;
* TP over Y chips: all-reduce (or reduce-scatter + all-gather) of the B/X·D activations per matmul;
* per pass, T_comm / T_math = α / (Y · M_X · B/N) + α · Y / (M_Y · F) (`lab.theory.scaling.fsdp_tp_comm_to_compute`),
  with α_DCN = C / W_dcn in the first term when the FSDP axis crosses slices;
* the total is least at **X_opt = sqrt((B/F)·(M_X/M_Y)·N)** FSDP ways (`lab.theory.fsdp_tp_optimal_fsdp_ways`),
  i.e. Y = N/X_opt tensor ways; FSDP x TP stays compute-bound down to B/N = 4α²/(M_X·M_Y·F) tokens per chip,
  pure FSDP only down to α/M_X.

Across slices the FSDP axis's collectives run on DCN, whose bandwidth per chip is a small fraction of ICI's.

The checks set the book's ratio against the compiled program's: its collectives priced on their links (hop latency
included) over its FLOPs at peak. Where the book's ratio misses, the *refined* value is the book's rule (bytes over
M · W_ici, or W_dcn) applied to the collectives XLA wrote (kinds, group sizes, bytes) and the FLOPs it counted.
"""


def _book_ratio(step: MlpStep, config: Config) -> float:
    chip, y = chip_of(step), step.sizes.get("tensor", 1)
    fsdp = step.where(("fsdp",))
    return fsdp_tp_comm_to_compute(
        chip,
        step.batch_per_chip,
        config.mlp,
        tensor_ways=y,
        fsdp_axes=torus_axes(fsdp),
        tp_axes=torus_axes(step.where(("tensor",))),
        fsdp_over_dcn=bool(fsdp and fsdp.network == "dcn"),
    )


def _strategy(step: MlpStep) -> str:
    y = step.sizes.get("tensor", 1)
    return f"FSDP x TP (Y={y})" if y > 1 else "FSDP"


def _checks(m: Machine, config: Config) -> list[Check]:
    checks = []
    for step in (m.fsdp, m.mixed):
        label = f"{m.name}: {_strategy(step)}"
        checks.append(flops_check(label, step, config.embed, config.mlp))
        checks.append(_ratio_check(label, step, config))
    return checks


def _ratio_check(label: str, step: MlpStep, config: Config) -> Check:
    observed, rule = ratio(step), bandwidth_rule_s(step) / compute_s(step)
    big = [c for c in step.collectives if c.size_bytes > 4]  # the 4-byte loss all-reduce aside
    wrote = "; ".join(
        f"{k} x{sum(c.repeats or 1 for c in big if (c.kind, c.axes) == (k, a))} over {','.join(a or ('?',))}"
        for k, a in dict.fromkeys((c.kind, c.axes) for c in big)
    )
    per_token = step.flops / step.batch_per_chip / (config.embed * config.mlp)
    consistent = not group_mismatches(step)
    return check(
        f"{label}: communication / compute at B/N={step.batch_per_chip} (book: α/(Y·M_X·B/N) + α·Y/(M_Y·F))",
        round(_book_ratio(step, config), 4),
        round(observed, 4),
        kind="model",
        rtol=RATIO_RTOL,
        refined=round(rule, 4) if consistent else None,
        why=f"XLA wrote {wrote}, {format_bytes(sum(bus_bytes(c) for c in step.collectives))} sent per chip, "
        f"against {per_token:.4g}·D·F FLOPs per token (the book: one pass of the weights, 4·D·F/Y bytes, per "
        "4·D·F FLOPs a token)"
        if consistent
        else "",
        basis=RATIO_BASIS,
    )


def _fsdp_bytes(step: MlpStep) -> float:
    """Bytes one chip sends over the fsdp axis per step."""
    return sum(bus_bytes(c) for c in step.collectives if c.axes and "fsdp" in c.axes)


def _claims(obs: Observations, config: Config) -> list[Claim]:
    single = [m for m in obs.machines if m.slices == 1]
    if len(single) < 2:
        return []
    small, large = single[0].fsdp, single[-1].fsdp
    share, bytes_ratio = latency_share(large, "fsdp"), _fsdp_bytes(large) / _fsdp_bytes(small)
    if ratio(large) <= 1:
        latency = "refuted"
    elif share > 0.5 and bytes_ratio < 0.5:
        latency = "confirmed"
    else:
        latency = "refined"
    chip = chip_of(small)
    n_star = config.global_tokens * torus_axes(small.where(("fsdp",))) / theory.ici_arithmetic_intensity(chip)
    bound = [m for m in obs.machines if ratio(m.fsdp) > 1]
    faster = [m for m in bound if overlapped_s(m.mixed) < overlapped_s(m.fsdp)]
    tp_wins = "confirmed" if bound and len(faster) == len(bound) else "refuted"
    return [
        Claim(
            "A very large FSDP stops scaling because each all-gather's fixed latency dominates while the bytes "
            "per chip shrink",
            latency,
            f"pure FSDP at B = {config.global_tokens} tokens: communication / compute {ratio(small):.2f} on "
            f"{small.chips} chips, {ratio(large):.2f} on {large.chips}; bytes each chip sends over fsdp per step "
            f"{format_bytes(_fsdp_bytes(small))} and {format_bytes(_fsdp_bytes(large))} ({bytes_ratio:.2f}x); "
            f"hop latency is {share:.1%} of FSDP's communication on {large.chips} chips",
        ),
        Claim(
            "Past 64-128 chips, TP inside the fast domain with a smaller FSDP beats growing FSDP",
            tp_wins,
            "; ".join(
                f"{m.name} ({m.fsdp.chips} chips): FSDP comm/compute {ratio(m.fsdp):.2f}, step FSDP / FSDP x TP "
                f"(Y={m.mixed.sizes.get('tensor', 1)}) {overlapped_s(m.fsdp) / overlapped_s(m.mixed):.2f}x"
                for m in obs.machines
            )
            + f"; the book's FSDP limit at this B: N = B·M_X/α = {n_star:.0f} chips",
        ),
    ]


def _optimum_table(obs: Observations, config: Config) -> Table:
    body = []
    for m in obs.machines:
        n = m.mixed.chips
        x_opt = theory.fsdp_tp_optimal_fsdp_ways(config.global_tokens, config.mlp, n)
        y = m.mixed.sizes.get("tensor", 1)
        body.append([m.name, n, f"{x_opt:.1f}", f"{n / x_opt:.1f}", y, n // y])
    return Table(
        "How large TP should be: X_opt = sqrt((B/F)·(M_X/M_Y)·N), with M_X = M_Y",
        ["machine", "chips N", "X_opt (FSDP ways)", "N / X_opt", "TP ways Y used (power of 2)", "FSDP ways used"],
        body,
    )


def _bound(step: MlpStep) -> str:
    return "communication" if communication_s(step) > compute_s(step) else "compute"


def _step_table(obs: Observations) -> Table:
    return Table(
        "Predicted step of the compiled MLP block (roofline of the TPU compiler's program)",
        ["machine", "chips", "strategy", "tokens per chip", "compute", "communication", "step (overlapped)", "bound"],
        [
            [
                m.name,
                s.chips,
                _strategy(s),
                s.batch_per_chip,
                f"{compute_s(s) * 1e3:.2f} ms",
                f"{communication_s(s) * 1e3:.2f} ms",
                f"{overlapped_s(s) * 1e3:.2f} ms",
                _bound(s),
            ]
            for m in obs.machines
            for s in (m.fsdp, m.mixed)
        ],
    )


def _per_axis(step: MlpStep) -> dict[str, tuple[int, int, float]]:
    """mesh axes -> (collectives, bytes per device moved as S, predicted seconds)."""
    out: dict[str, tuple[int, int, float]] = {}
    for c, seconds in zip(step.collectives, collective_seconds(step)):
        axes = ",".join(c.axes or ()) or "none"
        runs = c.repeats or 1
        count, size, total = out.get(axes, (0, 0, 0.0))
        out[axes] = (count + runs, size + runs * c.size_bytes, total + seconds)
    return out


def _axis_table(obs: Observations) -> Table:
    body = []
    for m in obs.machines:
        for s in (m.fsdp, m.mixed):
            for axes, (count, size, seconds) in sorted(_per_axis(s).items()):
                body.append([m.name, _strategy(s), axes, count, format_bytes(size), f"{seconds * 1e3:.2f} ms"])
    return Table(
        "Collectives per mesh axis, from the compiled HLO",
        ["machine", "strategy", "mesh axes", "collectives", "bytes per device (S, summed)", "predicted time"],
        body,
        note="A multi-slice program is compiled per slice; its collectives over fsdp include the DCN hop.",
    )


def _plot(obs: Observations, config: Config) -> Figure:
    fig = Figure(figsize=(6.5, 4))
    ax = fig.subplots()
    for label, style, pick in (("FSDP", "o-", lambda m: m.fsdp), ("FSDP x TP", "s-", lambda m: m.mixed)):
        single = [pick(m) for m in obs.machines if m.slices == 1]
        ax.plot([s.chips for s in single], [ratio(s) for s in single], style, label=f"{label}: comm / compute (ICI)")
        dcn = [(m, pick(m)) for m in obs.machines if m.slices > 1]
        ax.plot(
            [s.chips for _, s in dcn],
            [ratio(s) for _, s in dcn],
            style[0],
            markersize=10,
            fillstyle="none",
            label=f"{label}: {dcn[0][0].slices} slices over DCN" if dcn else f"{label}: DCN",
        )
    single = [m.fsdp for m in obs.machines if m.slices == 1]
    ax.plot(
        [s.chips for s in single],
        [_book_ratio(s, config) for s in single],
        ":",
        color="tab:blue",
        label="FSDP, the book: α / (M_X · B/N)",
    )
    ax.axhline(1.0, color="grey", linestyle="--", label="compute = communication")
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="chips N (fixed global batch)",
        ylabel="communication / compute",
        title=f"B = {config.global_tokens} tokens, D={config.embed}, F={config.mlp}",
    )
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def _summary(obs: Observations, config: Config) -> str:
    single = [m for m in obs.machines if m.slices == 1]
    if not single:
        return "No single-slice machine was compiled."
    fsdp = [m.fsdp for m in single]
    first_bad = next((s for s in fsdp if _bound(s) == "communication"), None)
    biggest = max(single, key=lambda m: m.fsdp.chips)
    chip = chip_of(fsdp[0])
    n_star = config.global_tokens * torus_axes(fsdp[0].where(("fsdp",))) / theory.ici_arithmetic_intensity(chip)
    return (
        f"At a fixed {config.global_tokens} tokens per step, pure FSDP's communication / compute ratio goes from "
        f"{ratio(fsdp[0]):.2f} on {fsdp[0].chips} chips to {ratio(fsdp[-1]):.2f} on {fsdp[-1].chips}"
        + (
            f"; it is communication-bound from {first_bad.chips} chips"
            if first_bad
            else "; it stays compute-bound in this sweep"
        )
        + f" (the book: past N = B·M_X/α = {n_star:.0f} chips). On {biggest.fsdp.chips} chips FSDP x TP with "
        f"Y={biggest.mixed.sizes.get('tensor', 1)} (N/X_opt) predicts {overlapped_s(biggest.mixed) * 1e3:.2f} ms "
        f"against FSDP's {overlapped_s(biggest.fsdp) * 1e3:.2f} ms "
        f"({overlapped_s(biggest.fsdp) / overlapped_s(biggest.mixed):.1f}x). Every time here is the roofline of the "
        "compiled program: no TPU ran."
    )


def _notes(obs: Observations, config: Config) -> list[str]:
    notes = []
    for m in obs.machines:
        for s in (m.fsdp, m.mixed):
            odd = group_mismatches(s)
            if odd:
                groups = sorted({(c.group_size, chips) for c, chips in odd})
                notes.append(
                    f"{m.name}, {_strategy(s)}: the HLO's collectives over fsdp have groups of "
                    + ", ".join(f"{g} chips where the axis has {n}" for g, n in groups)
                    + f" across {m.slices} slices: the groups a multi-slice program's HLO shows hold one slice's "
                    "share of the axis, while the roofline (lab.targets.topology) prices the whole axis as one ring "
                    "over DCN. Which of the two the hardware would run is not settled by this run (compile-only), so "
                    "nothing refines its ratio: "
                    f"{ratio(s):.2f} by the roofline, {bandwidth_rule_s(s) / compute_s(s):.2f} by the bandwidth "
                    f"rule on the HLO's groups, {_book_ratio(s, config):.2f} by the book."
                )
    for m in obs.machines:
        if m.slices > 1:
            for s in (m.fsdp, m.mixed):
                notes.append(
                    f"{m.name}, {_strategy(s)}: predicted {overlapped_s(s) * 1e3:.2f} ms, {_bound(s)}-bound; "
                    "collectives by axes: "
                    + "; ".join(f"{a}: {c} ({format_bytes(b)})" for a, (c, b, _) in sorted(_per_axis(s).items()))
                )
    notes.append(
        "Compared with `scaling_thresholds` (per-chip batch sweep on one "
        "64-chip slice), this page holds B fixed and grows N: "
        "the per-chip batch falls as 1/N, which is what ends FSDP's scaling."
    )
    return notes
