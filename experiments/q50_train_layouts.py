"""One model, every layout: loss parity with one device, the collectives each layout adds, and tokens per second.

Question #50 weighs TP × FSDP against an ever larger FSDP. Before any of that
is worth timing, each layout must train *the same model*: torchtitan's parity
test holds every layout's loss curve to one control, the 1-device run of the
same global batch. This page trains the lab's dense transformer with ZeRO-3 on
every way of cutting 8 devices into data, fsdp and tensor (and the MoE model
with experts over the ``expert`` axis), then reads three things per layout:

1. **parity**: the largest relative difference of its losses from the
   1-device control, step by step (fp32: the sums only change order);
2. **what XLA inserted**: the collectives of the compiled step by kind and
   mesh axis. ZeRO-3 gathers weights and reduce-scatters gradients over
   ``fsdp``; DDP-style data axes all-reduce gradients; Megatron TP adds
   all-reduces of activations over ``tensor`` (two per layer forward, two
   backward); expert parallelism adds all-to-alls over ``expert``; a GPipe
   pipeline over ``stage`` adds a collective-permute of one micro-batch's
   activation per tick, M + P - 1 ticks forward and as many backward;
3. **tokens/s**: the median over the timed steps with its p10–p90 spread,
   as a ratio to the 1-device run of the same model in the same session.

On ``cpu:8`` the eight devices are emulated on the host's cores, so a layout
cannot be faster than one device in total work: the ratios measure what each
layout's communication and per-device overhead cost, not the speed-up it buys
on real chips (for that, see `tp_fsdp_vs_fsdp` and `scaling_thresholds`).
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from lab import hlo
from lab.mesh import MeshSpec
from lab.model import preset
from lab.progress import track
from lab.provenance import Setup
from lab.report import Result, Table
from lab.rules import DATA_AXES
from lab.targets.devices import DEFAULT_TARGET, devices_for
from lab.training import run as training_run
from lab.training.run import WARMUP_STEPS, RunConfig
from lab.units import format_bytes
from lab.verdict import Check, Claim, check

QUESTION = "#50"
PARITY_RTOL = 1e-4  # fp32 losses of a tiny model: only the order of the sums differs
CONTROL = "data=1"


@dataclass(frozen=True)
class Config:
    target: str = DEFAULT_TARGET
    """where to train (cpu:N, gpu, tpu)"""
    dense_layouts: tuple[str, ...] = (
        "data=8",
        "fsdp=8",
        "data=2,fsdp=4",
        "fsdp=4,tensor=2",
        "data=2,fsdp=2,tensor=2",
        "fsdp=2,tensor=4",
        "data=2,tensor=4",
        "stage=2,fsdp=4",
        "stage=2,fsdp=2,tensor=2",
    )
    """meshes for the dense model"""
    moe_layouts: tuple[str, ...] = (
        "expert=8",
        "fsdp=2,expert=4",
        "data=2,fsdp=2,expert=2",
        "fsdp=2,expert=2,tensor=2",
        "stage=2,fsdp=2,expert=2",
    )
    """meshes for the MoE model (experts over `expert`)"""
    dense_model: str = "tiny"
    """lab.model preset of the dense runs"""
    moe_model: str = "tiny-moe"
    """lab.model preset of the MoE runs"""
    strategy: str = "zero3"
    """the data-parallel strategy every layout uses"""
    steps: int = 12
    """steps per run (the first two are warm-up for tokens/s)"""
    pipeline_micro_batches: int = 4
    """M: micro-batches of the layouts with a stage axis (GPipe bubble (P-1)/(M+P-1)); the others take one"""
    global_batch: int = 16
    """sequences per step, the same for every layout"""


@dataclass(frozen=True)
class AllReduce:
    """One all-reduce of the compiled step as XLA wrote it: the arrays it carries, and how often it runs."""

    axes: tuple[str, ...] | None
    operands: int  # arrays in the instruction: more than one when XLA combined them into a tuple
    size_bytes: int  # S per device, all operands together
    repeats: int | None  # runs per step (loop trip counts); None when unknown
    op_name: str  # JAX op name from the metadata ("" when none)


@dataclass(frozen=True)
class Layout:
    """One layout's run and the collectives of its compiled step."""

    model: str
    mesh: str
    losses: tuple[float, ...]  # per step
    tokens_per_s: tuple[float, ...]  # per timed step (after the warm-up)
    totals: dict[str, hlo.CollectiveTotal]  # "all-gather over fsdp" -> count per step and S summed
    all_reduces: dict[str, AllReduce]  # by HLO instruction name


@dataclass(frozen=True)
class Observations:
    setup: Setup
    layouts: dict[str, Layout]  # "tiny fsdp=8" -> its run; each model's 1-device control (mesh "data=1") first


# --------------------------------------------------------------------------- measure


def measure(config: Config) -> Observations:
    devices = devices_for(config.target)
    runs = [(config.dense_model, CONTROL)] + [(config.dense_model, m) for m in config.dense_layouts]
    runs += [(config.moe_model, CONTROL)] + [(config.moe_model, m) for m in config.moe_layouts]
    with tempfile.TemporaryDirectory() as scratch:
        layouts = {
            f"{model} {mesh}": _train(config, model, mesh, devices, Path(scratch))
            for model, mesh in track(runs, "layouts")
        }
    return Observations(Setup.of(config.target, devices, ", ".join(m for _, m in runs)), layouts)


def _train(config: Config, model: str, mesh: str, devices, scratch: Path) -> Layout:
    run_config = RunConfig(
        target=config.target,
        mesh=mesh,
        model=model,
        strategy=config.strategy,
        steps=config.steps,
        global_batch=config.global_batch,
        micro_batches=_micro_batches(config, mesh),
        results=scratch,
        page=False,
    )
    chosen = devices[:1] if mesh == CONTROL else devices
    log = training_run.run(run_config, chosen)
    collectives = training_run.trainer_for(run_config, chosen).inspect_step(config.global_batch).collectives
    all_reduces = {
        c.name: AllReduce(c.axes, len(c.operand_shapes), c.size_bytes, c.repeats, c.op_name or "")
        for c in collectives
        if c.kind == "all-reduce"
    }
    return Layout(
        model,
        mesh,
        tuple(float(x) for x in log.losses),
        tuple(float(s.tokens_per_s) for s in log.timed_steps),
        {f"{t.kind} over {','.join(t.axes or ('?',))}": t for t in hlo.summarize(collectives)},
        all_reduces,
    )


def _micro_batches(config: Config, mesh: str) -> int:
    return config.pipeline_micro_batches if MeshSpec.parse(mesh).sizes.get("stage", 1) > 1 else 1


# --------------------------------------------------------------------------- judge


def judge(obs: Observations, config: Config) -> Result:
    layouts = tuple(obs.layouts.values())
    checks = [c for m in layouts if m.mesh != CONTROL for c in _checks(config, m, _control(layouts, m.model))]
    return Result(
        summary=_summary(config, layouts),
        theory=THEORY,
        tables=[_table(config, layouts)],
        checks=checks,
        claims=_claims(config, layouts),
        plots={"tokens_per_s": partial(_plot, layouts)},
        notes=_notes(config, layouts),
    )


THEORY = (
    "The parity test (torchtitan): one control, many layouts. Every "
    "layout computes the same mathematical step, so its losses equal "
    "the 1-device run's up to the order of floating-point sums. Per "
    "layout, ZeRO-3 all-gathers each weight over fsdp and "
    "reduce-scatters its gradient (Rajbhandari et al. 2020); the "
    "data axis all-reduces the gradient shards; Megatron TP "
    "(Shoeybi et al. 2019) adds an all-reduce of the [b, s, d] activations "
    "after each row-parallel matmul (2 per layer forward) and of the input gradients of the column-parallel "
    "ones (2 backward), one activation each: 4 activations per layer; "
    "expert parallelism (Lepikhin et al. 2020, GShard) adds two all-to-alls "
    "per MoE layer forward and two backward; "
    "a GPipe pipeline (Huang et al. 2019) written as one SPMD loop "
    "runs M + P - 1 ticks, each shifting one [b, S, D] activation "
    "to the next stage (a collective-permute over stage) and, in "
    "the backward, its gradient back: 2(M+P-1) per step. Every stage "
    "computes on every tick, bubble ticks included (on zeros): that "
    "is the bubble (P-1)/(M+P-1), visible in the HLO as work."
)


def _control(layouts, model: str) -> Layout:
    return next(m for m in layouts if m.model == model and m.mesh == CONTROL)


def _parity(m: Layout, control: Layout) -> float:
    """Largest relative difference of its losses from the control's, step by step."""
    got, want = np.array(m.losses), np.array(control.losses)
    if got.shape != want.shape:
        return math.inf
    return float(np.max(np.abs(got - want) / np.abs(want)))


def _has(m: Layout, kind: str, axis: str) -> str:
    """Whether the step holds a `kind` over `axis` alone (one over several axes, the other's included, is not it)."""
    return "yes" if any(t.kind == kind and t.axes == (axis,) for t in m.totals.values()) else "no"


def _sizes(m: Layout) -> dict[str, int]:
    return MeshSpec.parse(m.mesh).sizes


def _checks(config: Config, m: Layout, control: Layout) -> list[Check]:
    label, sizes = f"{m.model} on {m.mesh}", _sizes(m)
    checks = [
        check(
            f"{label}: largest relative loss difference from the 1-device run",
            PARITY_RTOL,
            _parity(m, control),
            kind="model",
            relation="<=",
            basis="fp32 losses of one mathematical step, summed in another order: about 1e-7 apart per step; "
            "1e-4 bounds the drift of every step with a margin of 100",
        )
    ]
    if sizes.get("fsdp", 1) > 1:
        checks.append(
            check(f"{label}: ZeRO-3 gathers weights over fsdp", "yes", _has(m, "all-gather", "fsdp"), kind="exact")
        )
    if sizes.get("tensor", 1) > 1 and m.model == config.dense_model:
        checks.extend(_megatron_checks(config, m, sizes))
    elif sizes.get("tensor", 1) > 1:
        checks.append(
            check(
                f"{label}: Megatron TP all-reduces activations over tensor",
                "yes",
                _has(m, "all-reduce", "tensor"),
                kind="exact",
            )
        )
    if sizes.get("expert", 1) > 1:
        checks.append(
            check(
                f"{label}: expert parallelism dispatches with all-to-all over expert",
                "yes",
                _has(m, "all-to-all", "expert"),
                kind="exact",
            )
        )
    if sizes.get("stage", 1) > 1:
        checks.extend(_pipeline_checks(config, m, sizes))
    return checks


def _activation_bytes(config: Config, m: Layout, sizes: dict[str, int]) -> int:
    """One [b, S, D] fp32 activation per device: b = the global batch over the batch axes and the micro-batches."""
    model = preset(m.model)
    local_batch = config.global_batch // (
        math.prod(sizes.get(a, 1) for a in DATA_AXES) * _micro_batches(config, m.mesh)
    )
    return local_batch * model.seq * model.embed * 4


def _pipeline_checks(config: Config, m: Layout, sizes: dict[str, int]) -> list[Check]:
    """GPipe as one SPMD loop: M + P - 1 ticks, each shifting one activation down the pipe, and its transpose back."""
    stages, micro_batches = sizes["stage"], _micro_batches(config, m.mesh)
    permutes = next((t for t in m.totals.values() if t.kind == "collective-permute" and t.axes == ("stage",)), None)
    ticks = micro_batches + stages - 1
    label = f"{m.model} on {m.mesh}, M={micro_batches}"
    return [
        check(
            f"{label}: collective-permutes over stage per step = 2(M+P-1)",
            2 * ticks,
            permutes.count if permutes else 0,
            kind="exact",
        ),
        check(
            f"{label}: bytes they carry = 2(M+P-1) x b·S·D",
            2 * ticks * _activation_bytes(config, m, sizes),
            permutes.total_bytes if permutes else 0,
            kind="exact",
        ),
    ]


def _activation_all_reduces(m: Layout) -> tuple[AllReduce, ...]:
    """The all-reduces over tensor that carry activations: all but the optimizer's (the gradient norm)."""
    return tuple(a for a in m.all_reduces.values() if a.axes == ("tensor",) and "optimizer" not in a.op_name)


def _tp_counts(m: Layout) -> tuple[int, int, int, int]:
    """(instructions, arrays, bytes, widest tuple) per step of the activation all-reduces over tensor."""
    found = _activation_all_reduces(m)
    runs = [a.repeats or 1 for a in found]
    return (
        sum(runs),
        sum(r * a.operands for r, a in zip(runs, found)),
        sum(r * a.size_bytes for r, a in zip(runs, found)),
        max((a.operands for a in found), default=0),
    )


def _megatron_checks(config: Config, m: Layout, sizes: dict[str, int]) -> list[Check]:
    """Megatron TP: per layer applied, an all-reduce of one [b, s, d] activation after each row-parallel matmul,
    forward (2) and for the input gradients of the column-parallel ones, backward (2). A pipeline applies its L/P
    layers on every one of its M+P-1 ticks, bubble ticks included (they compute on zeros).

    XLA may carry more arrays per instruction than Megatron's one: where it keeps the q, k and v input gradients
    apart (no fused QKV weight to sum them locally) it all-reduces them as one 3-array tuple. The corrected bytes
    count the arrays the instructions carry, one activation each."""
    layers, stages = preset(m.model).layers, sizes.get("stage", 1)
    applied = layers // stages * (_micro_batches(config, m.mesh) + stages - 1)
    instructions, arrays, nbytes, widest = _tp_counts(m)
    activation = _activation_bytes(config, m, sizes)
    label = f"{m.model} on {m.mesh}"
    textbook = 4 * applied
    refined = why = None
    if arrays != textbook:
        refined = arrays * activation
        why = (
            f"the {instructions} all-reduces carry {arrays} arrays, not {textbook} (widest: a {widest}-array tuple), "
            f"one [b, s, d] activation of {format_bytes(activation)} each"
        )
    return [
        check(
            f"{label}: activation all-reduces over tensor per step (4 per layer applied)",
            textbook,
            instructions,
            kind="exact",
        ),
        check(
            f"{label}: bytes they carry per step (4 activations of b·s·d per layer applied)",
            textbook * activation,
            nbytes,
            kind="exact",
            refined=refined,
            why=why or "",
        ),
    ]


def _fsdp_against_tp(m: Layout) -> tuple[int, int, int, int]:
    """(FSDP collectives, their bytes, TP activation all-reduces, their bytes) per step: all-gathers and
    reduce-scatters over fsdp alone, the tensor all-reduces that carry activations."""
    fsdp = [t for t in m.totals.values() if t.axes == ("fsdp",) and t.kind in ("all-gather", "reduce-scatter")]
    instructions, _, tp_bytes, _ = _tp_counts(m)
    return sum(t.count for t in fsdp), sum(t.total_bytes for t in fsdp), instructions, tp_bytes


def _claims(config: Config, layouts) -> list[Claim]:
    both = next(
        (
            m
            for m in layouts
            if m.model == config.dense_model and _sizes(m).get("fsdp", 1) > 1 and _sizes(m).get("tensor", 1) > 1
        ),
        None,
    )
    if both is None:
        return []
    fsdp_n, fsdp_b, tp_n, tp_b = _fsdp_against_tp(both)
    fsdp_mean, tp_mean = fsdp_b / max(fsdp_n, 1), tp_b / max(tp_n, 1)
    more_often, coarser = tp_n > fsdp_n, fsdp_mean > tp_mean
    status = "confirmed" if more_often and coarser else "refined" if more_often or coarser else "refuted"
    return [
        Claim(
            "TP all-reduces every layer (high frequency); FSDP's all-gathers and reduce-scatters are fewer and coarser",
            status,
            f"{both.model} on {both.mesh}, per step: {tp_n} TP all-reduces over tensor of {format_bytes(tp_mean)} "
            f"on average, against {fsdp_n} all-gathers and reduce-scatters over fsdp of {format_bytes(fsdp_mean)}",
        )
    ]


def _plot(layouts) -> Figure:
    figure = Figure(figsize=(8, 4))
    axes = figure.subplots()
    labels, medians, low, high = [], [], [], []
    for m in layouts:
        tokens = np.array(m.tokens_per_s) / np.median(_control(layouts, m.model).tokens_per_s)
        p10, p50, p90 = np.percentile(tokens, [10, 50, 90])
        labels.append(f"{m.model}\n{m.mesh}")
        medians.append(p50)
        low.append(p50 - p10)
        high.append(p90 - p50)
    colors = ["tab:blue" if m.model == layouts[0].model else "tab:orange" for m in layouts]
    axes.bar(range(len(layouts)), medians, yerr=[low, high], color=colors, capsize=3)
    axes.axhline(1.0, color="grey", linestyle="--", linewidth=0.8)
    axes.set_xticks(range(len(layouts)), labels, rotation=60, ha="right", fontsize=7)
    axes.set(
        ylabel="tokens/s / the 1-device run's",
        title="tokens per second by layout (median, p10-p90), relative to one device",
    )
    figure.tight_layout()
    return figure


def _collectives(m: Layout) -> str:
    return (
        "; ".join(
            f"{t.kind} over {','.join(t.axes) if t.axes else '-'} x{t.count} ({format_bytes(t.total_bytes)})"
            for t in m.totals.values()
        )
        or "none"
    )


def _speed(m: Layout, layouts) -> float:
    return float(np.median(m.tokens_per_s) / np.median(_control(layouts, m.model).tokens_per_s))


def _table(config: Config, layouts) -> Table:
    rows = []
    for m in layouts:
        tokens = np.array(m.tokens_per_s)
        rows.append(
            [
                m.model,
                m.mesh,
                f"{_parity(m, _control(layouts, m.model)):.1e}",
                float(np.median(tokens)),
                f"{np.percentile(tokens, 10):,.0f}-{np.percentile(tokens, 90):,.0f}",
                _speed(m, layouts),
                _collectives(m),
            ]
        )
    return Table(
        f"each layout: parity, tokens/s over steps {WARMUP_STEPS}-{config.steps - 1}, "
        "and the collectives of one compiled step",
        [
            "model",
            "mesh",
            "max rel. loss diff",
            "tokens/s (median)",
            "p10-p90",
            "/ 1 device",
            "collectives (count per step, bytes S)",
        ],
        rows,
    )


def _summary(config: Config, layouts) -> str:
    dense = [m for m in layouts if m.model == config.dense_model and m.mesh != CONTROL]
    best = max(dense, key=lambda m: _speed(m, layouts))
    worst = min(dense, key=lambda m: _speed(m, layouts))
    parity = max(_parity(m, _control(layouts, m.model)) for m in layouts)
    return (
        f"Every layout trains the same model: across {len(layouts) - 2} "
        f"layouts of {config.dense_model} and {config.moe_model}, the largest "
        f"relative loss difference from the 1-device control is {parity:.1e} "
        f"over {config.steps} steps. What each layout costs shows in "
        f"the collectives XLA inserted (table) and in tokens/s: on {config.target} "
        f"the fastest dense layout, {best.mesh}, runs at {_speed(best, layouts):.2f}x "
        f"one device and the slowest, {worst.mesh}, at {_speed(worst, layouts):.2f}x: "
        "emulated devices share the host's cores, so these ratios "
        "price communication and per-device overhead, not the speed-up of real chips."
    )


def _notes(config: Config, layouts) -> list[str]:
    notes = []
    tuples = sorted(
        {
            a.operands
            for m in layouts
            if m.model == config.dense_model
            for a in _activation_all_reduces(m)
            if a.operands > 1
        }
    )
    if tuples:
        notes.append(
            "Megatron's TP all-reduces one activation per instruction, 4 per layer. XLA writes the same number of "
            f"instructions, but one per layer carries a {' or '.join(map(str, tuples))}-array tuple: the q, k and v "
            "input gradients, which Megatron sums locally first through one fused QKV weight and the lab's model "
            "keeps as three weights. The bytes checks are refined by the arrays counted in the HLO."
        )
    notes += [
        "Tokens/s are per step of the whole loop (placing the batch included) and compared only within this run; "
        "the machine is shared, so the p10-p90 spread is part of the answer. No check is made on them: emulated "
        "devices share the host's cores, so a clock here is no evidence of what a layout buys on real chips.",
        "Collective counts come from the compiled step's HLO with loop trip counts applied (the layers are a scan: "
        "one body, L trips).",
    ]
    return notes
