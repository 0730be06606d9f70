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
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from lab import hlo
from lab.devices import DEFAULT_TARGET, devices_for
from lab.mesh import MeshSpec
from lab.model import preset
from lab.progress import track
from lab.report import Result, Table, provenance
from lab.rules import DATA_AXES
from lab.training import run as training_run
from lab.training.run import WARMUP_STEPS, RunConfig, RunLog
from lab.units import format_bytes
from lab.verdict import at_most, check

QUESTION = "#50"
PARITY_RTOL = 1e-4  # fp32 losses of a tiny model: only the order of the sums differs


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


@dataclass
class Measured:
    """One layout's run, the collectives of its compiled step, and its model's 1-device control."""

    model: str
    mesh: str
    log: RunLog
    totals: tuple[hlo.CollectiveTotal, ...]
    tp_all_reduces: tuple[int, int, int]  # activation all-reduces over tensor per step: instructions, arrays, bytes
    control: Measured | None = None


def run(config: Config = Config()) -> Result:
    devices = devices_for(config.target)
    runs = [(config.dense_model, "data=1")] + [(config.dense_model, m) for m in config.dense_layouts]
    runs += [(config.moe_model, "data=1")] + [(config.moe_model, m) for m in config.moe_layouts]
    with tempfile.TemporaryDirectory() as scratch:
        measured = [_train(config, model, mesh, devices, Path(scratch)) for model, mesh in track(runs, "layouts")]
    for m in measured:
        m.control = _control(measured, m.model)
    return _result(config, measured)


def _train(config: Config, model: str, mesh: str, devices, scratch: Path) -> Measured:
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
    chosen = devices[:1] if mesh == "data=1" else devices
    log = training_run.run(run_config, chosen)
    collectives = training_run.trainer_for(run_config, chosen).inspect_step(config.global_batch).collectives
    return Measured(model, mesh, log, hlo.summarize(collectives), _tp_all_reduces(collectives))


def _micro_batches(config: Config, mesh: str) -> int:
    return config.pipeline_micro_batches if MeshSpec.parse(mesh).sizes.get("stage", 1) > 1 else 1


def _tp_all_reduces(collectives) -> tuple[int, int, int]:
    """(instructions, arrays, bytes) per step of the activation all-reduces over tensor (not the grad norm's)."""
    found = [
        c
        for c in collectives
        if c.kind == "all-reduce" and c.axes == ("tensor",) and "optimizer" not in (c.op_name or "")
    ]
    runs = [c.repeats or 1 for c in found]
    return (
        sum(runs),
        sum(r * len(c.operand_shapes) for r, c in zip(runs, found)),
        sum(r * c.size_bytes for r, c in zip(runs, found)),
    )


def _control(measured: list[Measured], model: str) -> Measured:
    return next(m for m in measured if m.model == model and m.mesh == "data=1")


def _parity(m: Measured) -> float:
    """Largest relative difference of its losses from the control's, step by step."""
    got, want = np.array(m.log.losses), np.array(m.control.log.losses)
    return float(np.max(np.abs(got - want) / np.abs(want)))


def _has(m: Measured, kind: str, axis: str) -> str:
    return "yes" if any(t.kind == kind and t.axes and axis in t.axes for t in m.totals) else "no"


QKV_SEPARATE = (
    "XLA keeps the q, k and v input gradients apart and all-reduces them "
    "as one 3-array tuple, where Megatron sums them "
    "locally first (one fused QKV weight): 2 + 4 = 6 activations per layer "
    "cross the tensor axis, not 4. The instruction "
    "count is the textbook's; the bytes are 1.5x"
)


def _checks(config: Config, measured: list[Measured]) -> list:
    checks = []
    for m in (m for m in measured if m.mesh != "data=1"):
        label = f"{m.model} on {m.mesh}"
        checks.append(
            at_most(f"{label}: largest relative loss difference from the 1-device run", _parity(m), PARITY_RTOL)
        )
        sizes = MeshSpec.parse(m.mesh).sizes
        if sizes.get("fsdp", 1) > 1:
            checks.append(check(f"{label}: ZeRO-3 gathers weights over fsdp", "yes", _has(m, "all-gather", "fsdp")))
        if sizes.get("tensor", 1) > 1 and m.model == config.dense_model:
            checks.extend(_megatron_checks(config, m, sizes))
        elif sizes.get("tensor", 1) > 1:
            checks.append(
                check(
                    f"{label}: Megatron TP all-reduces activations over tensor", "yes", _has(m, "all-reduce", "tensor")
                )
            )
        if sizes.get("expert", 1) > 1:
            checks.append(
                check(
                    f"{label}: expert parallelism dispatches with all-to-all over expert",
                    "yes",
                    _has(m, "all-to-all", "expert"),
                )
            )
        if sizes.get("stage", 1) > 1:
            checks.extend(_pipeline_checks(config, m, sizes))
    return checks


def _activation_bytes(config: Config, m: Measured, sizes: dict[str, int]) -> int:
    """One [b, S, D] fp32 activation per device: b = the global batch over the batch axes and the micro-batches."""
    model = preset(m.model)
    local_batch = config.global_batch // (
        math.prod(sizes.get(a, 1) for a in DATA_AXES) * _micro_batches(config, m.mesh)
    )
    return local_batch * model.seq * model.embed * 4


def _pipeline_checks(config: Config, m: Measured, sizes: dict[str, int]) -> list:
    """GPipe as one SPMD loop: M + P - 1 ticks, each shifting one activation down the pipe, and its transpose back."""
    stages, micro_batches = sizes["stage"], _micro_batches(config, m.mesh)
    permutes = next((t for t in m.totals if t.kind == "collective-permute" and t.axes == ("stage",)), None)
    ticks = micro_batches + stages - 1
    label = f"{m.model} on {m.mesh}, M={micro_batches}"
    return [
        check(
            f"{label}: collective-permutes over stage per step = 2(M+P-1)", 2 * ticks, permutes.count if permutes else 0
        ),
        check(
            f"{label}: bytes they carry = 2(M+P-1) x b·S·D",
            2 * ticks * _activation_bytes(config, m, sizes),
            permutes.total_bytes if permutes else 0,
        ),
    ]


def _megatron_checks(config: Config, m: Measured, sizes: dict[str, int]) -> list:
    """Megatron TP: per layer applied, an all-reduce of the [b, s, d] activations after each row-parallel matmul,
    forward (2) and for the input gradients of the column-parallel ones, backward (2). A pipeline applies its L/P
    layers on every one of its M+P-1 ticks, bubble ticks included (they compute on zeros)."""
    layers, stages = preset(m.model).layers, sizes.get("stage", 1)
    applied = layers // stages * (_micro_batches(config, m.mesh) + stages - 1)
    instructions, arrays, nbytes = m.tp_all_reduces
    label = f"{m.model} on {m.mesh}"
    return [
        check(f"{label}: activation all-reduces over tensor per step (4 per layer applied)", 4 * applied, instructions),
        check(
            f"{label}: bytes they carry per step (4 activations of b·s·d per layer applied)",
            4 * applied * _activation_bytes(config, m, sizes),
            nbytes,
            explained=QKV_SEPARATE if arrays == 6 * applied else None,
        ),
    ]


def _tokens(m: Measured) -> np.ndarray:
    return np.array([s.tokens_per_s for s in m.log.timed_steps])


def _plot(measured: list[Measured]):
    figure = Figure(figsize=(8, 4))
    axes = figure.subplots()
    labels, medians, low, high = [], [], [], []
    for m in measured:
        tokens = _tokens(m) / np.median(_tokens(m.control))
        p10, p50, p90 = np.percentile(tokens, [10, 50, 90])
        labels.append(f"{m.model}\n{m.mesh}")
        medians.append(p50)
        low.append(p50 - p10)
        high.append(p90 - p50)
    colors = ["tab:blue" if m.model == measured[0].model else "tab:orange" for m in measured]
    axes.bar(range(len(measured)), medians, yerr=[low, high], color=colors, capsize=3)
    axes.axhline(1.0, color="grey", linestyle="--", linewidth=0.8)
    axes.set_xticks(range(len(measured)), labels, rotation=60, ha="right", fontsize=7)
    axes.set(
        ylabel="tokens/s / the 1-device run's",
        title="tokens per second by layout (median, p10-p90), relative to one device",
    )
    figure.tight_layout()
    return figure


def _collectives(m: Measured) -> str:
    return (
        "; ".join(
            f"{t.kind} over {','.join(t.axes) if t.axes else '-'} x{t.count} ({format_bytes(t.total_bytes)})"
            for t in m.totals
        )
        or "none"
    )


def _result(config: Config, measured: list[Measured]) -> Result:
    rows = []
    for m in measured:
        tokens = _tokens(m)
        rows.append(
            [
                m.model,
                m.mesh,
                f"{_parity(m):.1e}",
                float(np.median(tokens)),
                f"{np.percentile(tokens, 10):,.0f}-{np.percentile(tokens, 90):,.0f}",
                float(np.median(tokens) / np.median(_tokens(m.control))),
                _collectives(m),
            ]
        )
    dense = [m for m in measured if m.model == config.dense_model and m.mesh != "data=1"]
    best = max(dense, key=lambda m: np.median(_tokens(m)))
    worst = min(dense, key=lambda m: np.median(_tokens(m)))
    checks = _checks(config, measured)
    parity = max(_parity(m) for m in measured)
    summary = (
        f"Every layout trains the same model: across {len(measured) - 2} "
        f"layouts of {config.dense_model} and {config.moe_model}, the largest "
        f"relative loss difference from the 1-device control is {parity:.1e} "
        f"over {config.steps} steps. What each layout costs shows in "
        f"the collectives XLA inserted (table) and in tokens/s: on {config.target} "
        f"the fastest dense layout, {best.mesh}, runs at "
        f"{np.median(_tokens(best)) / np.median(_tokens(best.control)):.2f}x "
        f"one device and the slowest, {worst.mesh}, at "
        f"{np.median(_tokens(worst)) / np.median(_tokens(worst.control)):.2f}x: "
        "emulated devices share the host's cores, so these ratios "
        "price communication and per-device overhead, not the speed-up of real chips."
    )
    return Result(
        summary=summary,
        theory=(
            "The parity test (torchtitan): one control, many layouts. Every "
            "layout computes the same mathematical step, so its losses equal "
            "the 1-device run's up to the order of floating-point sums. Per "
            "layout, ZeRO-3 all-gathers each weight over fsdp and "
            "reduce-scatters its gradient (Rajbhandari et al. 2020); the "
            "data axis all-reduces the gradient shards; Megatron TP "
            "(Shoeybi et al. 2019) adds an all-reduce of the activations "
            "after each row-parallel matmul (2 per layer forward, 2 backward); "
            "expert parallelism (Lepikhin et al. 2020, GShard) adds two all-to-alls "
            "per MoE layer forward and two backward; "
            "a GPipe pipeline (Huang et al. 2019) written as one SPMD loop "
            "runs M + P - 1 ticks, each shifting one [b, S, D] activation "
            "to the next stage (a collective-permute over stage) and, in "
            "the backward, its gradient back: 2(M+P-1) per step. Every stage "
            "computes on every tick, bubble ticks included (on zeros): that "
            "is the bubble (P-1)/(M+P-1), visible in the HLO as work."
        ),
        tables=[
            Table(
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
        ],
        checks=checks,
        plots={"tokens_per_s": _plot(measured)},
        notes=[
            (
                "Tokens/s are per step of the whole loop (placing the batch "
                "included) and compared only within this run; the machine is "
                "shared, "
                "so the p10-p90 spread is part of the answer."
            ),
            "Collective counts come from the compiled step's HLO with loop "
            "trip counts applied (the layers are a scan: one body, L trips).",
        ],
        provenance=provenance(target=config.target, devices=(), mesh=", ".join(m.mesh for m in measured)),
        data={
            f"{m.model} {m.mesh}": {
                "losses": m.log.losses,
                "tokens_per_s": _tokens(m).tolist(),
                "collectives": [
                    {"kind": t.kind, "axes": t.axes, "count": t.count, "bytes": t.total_bytes} for t in m.totals
                ],
            }
            for m in measured
        },
    )
