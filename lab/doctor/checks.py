"""The doctor's checks: each one turns a few measured numbers into a `Finding`.

A check is a pure function of evidence (bytes, seconds, losses), so each
threshold can be tested at its edge with made-up numbers; `lab.doctor.diagnosis` gathers
the evidence from a compiled step and a short run. A finding names its layer
(memory, input, layout, communication, numerics), its verdict in one line, the
numbers behind it with their units, and the fix a careful engineer would try
first. Thresholds are named constants below, each with the reason for its value.

One concept, one module: every check of the doctor is a short pure function
of its evidence, and its threshold is a named constant beside the others, so
the whole rulebook reads, and is tuned, in one place.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from lab.theory import pipeline_bubble_fraction
from lab.training.run import WARMUP_STEPS  # the first steps pay allocation and cache warm-up; medians start after them
from lab.units import format_bytes

LAYERS = ("memory", "input", "layout", "communication", "numerics")  # the careful engineer's order
SEVERITIES = ("problem", "warning", "ok", "not applicable")

# Memory: a step whose compiled peak is above 90 % of the device leaves too little for what the memory analysis
# does not count (the allocator's fragmentation, the runtime's collective scratch buffers, a second program).
MEMORY_HEADROOM = 0.90
# Input: steps waiting for data a fifth of the time or more lose more throughput than any other usual overhead
# (the quick-reference's "is the loader keeping up"); 5 % is measurable and prefetching usually removes it.
INPUT_PROBLEM = 0.20
INPUT_WARNING = 0.05
# Layout: the expert holding the most tokens sets the pace of an expert-parallel layer. Above Switch
# Transformer's default capacity factor 1.25 (Fedus et al. 2021, Section 2.2) tokens start to be dropped; at
# twice the mean the layer runs at half speed.
EXPERT_SKEW_WARNING = 1.25
EXPERT_SKEW_PROBLEM = 2.0
# Layout: GPipe's bubble (P-1)/(M+P-1) (Huang et al. 2019). Megatron's rule of thumb M >= 4P keeps it under
# about a fifth; at one half every stage idles as long as it works.
BUBBLE_WARNING = 0.2
BUBBLE_PROBLEM = 0.5
# Communication: predicted collective time against the step's compute (the roofline's communication term,
# scaling book Part 1). Above the compute time no overlap can hide it; above half, only near-perfect overlap can.
COMM_BOUND_PROBLEM = 1.0
COMM_BOUND_WARNING = 0.5
# Communication volume over the data axes in model copies per step, against the ZeRO paper's accounting
# (Rajbhandari et al. 2020, Section 7: DDP, ZeRO-1 and ZeRO-2 move 2Ψ, ZeRO-3 3Ψ). Twice that means something
# repeats (gathers per micro-batch); four times is a layout paying more for communication than for anything else.
VOLUME_WARNING = 2.0
VOLUME_PROBLEM = 4.0
# Exposed communication as a fraction of the predicted step (lab.hlo.schedule): a quarter is worth overlapping better;
# half the step waiting for the network is the bottleneck.
EXPOSED_WARNING = 0.25
EXPOSED_PROBLEM = 0.5
# Numerics: a gradient norm this many times the median of the previous steps is a spike (Adam's normalised
# update hides a 2-3x wobble; PaLM, Chowdhery et al. 2022, Section 5.1, restarts around spikes of this kind).
SPIKE_FACTOR = 5.0
SPIKE_WINDOW = 5
RISE_WARNING = 1.2  # a loss 20 % above its best so far is rising, not noise, on these synthetic batches


@dataclass(frozen=True)
class Finding:
    """One check's outcome: where, how bad, what it means, the numbers, and what to try."""

    layer: str  # one of LAYERS
    check: str
    severity: str  # one of SEVERITIES
    verdict: str
    evidence: tuple[str, ...] = ()  # numbers with their units, as a person reads them
    fix: str = ""
    numbers: Mapping[str, float] = field(default_factory=dict)  # the same numbers for machines (result.json, tests)


def _severity(value: float, warning: float, problem: float) -> str:
    return "problem" if value >= problem else "warning" if value >= warning else "ok"


def _median_after_warmup(values: Sequence[float]) -> float:
    kept = list(values[WARMUP_STEPS:]) or list(values)
    return float(np.median(kept))


# --- memory ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryEvidence:
    """Bytes per device: the compiled step's peak (None when the compiler refused it) and what it holds."""

    capacity_bytes: float
    capacity_source: str
    states: Mapping[str, int]  # params, master, optimizer: per device, from the shardings
    largest: tuple[tuple[str, int], ...]  # the largest arrays of the state, per device
    peak_bytes: float | None = None
    temp_bytes: float | None = None
    compiler_refused: str = ""  # the compiler's own out-of-memory message
    shards_params: bool = False
    devices: int = 1


def check_memory(e: MemoryEvidence) -> Finding:
    """Peak per device against capacity; the fix follows from what dominates (model states or temporaries)."""
    states = sum(e.states.values())
    peak = e.peak_bytes if e.peak_bytes is not None else states + (e.temp_bytes or 0)
    temps = e.temp_bytes if e.temp_bytes is not None else max(peak - states, 0)  # a refused step: what the states leave
    fraction = peak / e.capacity_bytes
    severity = "problem" if e.compiler_refused or fraction > 1 else "warning" if fraction > MEMORY_HEADROOM else "ok"
    evidence = [
        f"peak {format_bytes(peak)} per device against {format_bytes(e.capacity_bytes)} "
        f"({e.capacity_source}): {fraction:.0%}"
    ]
    if e.compiler_refused:
        evidence.insert(0, f"the compiler refused the step: {e.compiler_refused}")
    evidence.append(
        "model states "
        + ", ".join(f"{name} {format_bytes(b)}" for name, b in e.states.items() if b)
        + f" = {format_bytes(states)}"
    )
    evidence.append(
        f"temporaries (gradients, activations, gathered weights) {format_bytes(temps)}"
        + ("" if e.temp_bytes is not None else ": peak less states")
    )
    evidence.append("largest arrays: " + ", ".join(f"{name} {format_bytes(b)}" for name, b in e.largest))
    verdict = {
        "problem": "the step does not fit in device memory",
        "warning": "the step fits with little headroom",
        "ok": "the step fits",
    }[severity]
    return Finding(
        "memory",
        "peak memory per device",
        severity,
        verdict,
        tuple(evidence),
        _memory_fix(e, states, temps, severity),
        {"peak_bytes": peak, "capacity_bytes": e.capacity_bytes, "states_bytes": states, "temp_bytes": temps},
    )


def _memory_fix(e: MemoryEvidence, states: int, temps: float, severity: str) -> str:
    """What to shrink, the larger part first: whole model states (shard them), or temporaries (split the batch)."""
    if severity == "ok":
        return ""
    shard = (
        (
            f"shard the model states with --strategy zero3 on an fsdp axis (--mesh fsdp={e.devices}: "
            f"{format_bytes(states / e.devices)} of states per device instead of {format_bytes(states)})"
        )
        if not e.shards_params
        else ""
    )
    split = f"split the batch with --micro-batches (the temporaries, {format_bytes(temps)}, scale with the micro-batch)"
    fixes = [fix for fix in ((split, shard) if temps > states else (shard, split)) if fix]
    return "; then ".join(fixes) if fixes else "more devices on the fsdp axis, or a smaller model"


# --- input ------------------------------------------------------------------------------------------


def check_input(step_s: Sequence[float], data_s: Sequence[float]) -> Finding:
    """Median time waiting for the batch against the median iteration, after warm-up."""
    if not step_s:
        return Finding("input", "time waiting for data", "not applicable", "no steps were run")
    step, wait = _median_after_warmup(step_s), _median_after_warmup(data_s)
    fraction = wait / step
    severity = _severity(fraction, INPUT_WARNING, INPUT_PROBLEM)
    verdict = {
        "problem": "input-bound: the step waits for its batch",
        "warning": "the loader costs a visible part of each step",
        "ok": "the input pipeline keeps up",
    }[severity]
    fix = (
        ""
        if severity == "ok"
        else "prefetch batches in the background (--prefetch 2) or make the loader cheaper; then re-run the doctor"
    )
    evidence = (
        f"median wait for data {wait * 1e3:.1f} ms of a {step * 1e3:.1f} ms step: {fraction:.0%}",
        f"medians over {max(len(step_s) - WARMUP_STEPS, len(step_s) and 1)} steps after {WARMUP_STEPS} warm-up steps",
    )
    return Finding(
        "input",
        "time waiting for data",
        severity,
        verdict,
        evidence,
        fix,
        {"data_s": wait, "step_s": step, "fraction": fraction},
    )


# --- layout -----------------------------------------------------------------------------------------


def check_idle_axes(sizes: Mapping[str, int], idle: Sequence[str]) -> Finding:
    """Mesh axes of size > 1 that split nothing: their devices repeat the same work."""
    total = math.prod(sizes.values())
    repeats = math.prod(sizes[a] for a in idle)
    if not idle:
        return Finding(
            "layout",
            "axes repeating work",
            "ok",
            "every mesh axis of size > 1 splits the batch or the weights",
            (f"{total} devices, {total} doing distinct work",),
            numbers={"repeats": 1},
        )
    shown = ", ".join(f"{a}={sizes[a]}" for a in idle)
    return Finding(
        "layout",
        "axes repeating work",
        "problem",
        f"{shown} splits nothing: its devices repeat the same work",
        (f"{total} devices do the work of {total // repeats}: {repeats}x repeated", f"idle axes: {shown}"),
        f"fold {shown} into the data axes (e.g. --mesh fsdp={total}) or give it a strategy that splits it",
        {"repeats": repeats},
    )


def check_pipeline_bubble(stage: int, micro_batches: int, layers: int) -> Finding:
    """The GPipe bubble of the stage axis, (P-1)/(M+P-1): the share of every stage's time spent idle."""

    if stage == 1:
        return Finding("layout", "pipeline bubble", "not applicable", "the mesh has no stage axis")
    bubble = pipeline_bubble_fraction(stage, micro_batches)
    evidence = (
        f"stage={stage}, {micro_batches} micro-batch(es): bubble (P-1)/(M+P-1) = {bubble:.0%} of each stage's time",
        f"{layers // stage} of {layers} layers per stage: equal work, no stage imbalance",
    )
    severity = _severity(bubble, BUBBLE_WARNING, BUBBLE_PROBLEM)
    verdict = {
        "ok": "the bubble is small",
        "warning": "the pipeline idles a noticeable share of the step",
        "problem": "the pipeline idles as much as it works",
    }[severity]
    fix = (
        ""
        if severity == "ok"
        else f"raise --micro-batches to {4 * stage} or more (M >= 4P: bubble "
        f"{pipeline_bubble_fraction(stage, 4 * stage):.0%})"
    )
    return Finding("layout", "pipeline bubble", severity, verdict, evidence, fix, {"bubble": bubble})


def check_expert_skew(max_over_mean: Sequence[float], dropped: Sequence[float] = ()) -> Finding:
    """The busiest expert's tokens over the mean (per step, median after warm-up)."""
    if not max_over_mean:
        return Finding("layout", "expert load skew", "not applicable", "the model has no experts")
    skew = _median_after_warmup(max_over_mean)
    severity = _severity(skew, EXPERT_SKEW_WARNING, EXPERT_SKEW_PROBLEM)
    evidence = [f"busiest expert / mean load: median {skew:.2f}, worst step {max(max_over_mean):.2f}"]
    if dropped:
        evidence.append(f"tokens dropped: median {_median_after_warmup(dropped):.1%}")
    verdict = {
        "problem": "the router sends most tokens to few experts",
        "warning": "the expert load is uneven",
        "ok": "the experts share the load",
    }[severity]
    fix = (
        ""
        if severity == "ok"
        else "balance the router: an auxiliary load-balancing loss or a bias update (see the moe_load_balance page)"
    )
    return Finding("layout", "expert load skew", severity, verdict, tuple(evidence), fix, {"skew": skew})


def check_unsharded(strategy, report, fsdp: int) -> Finding:
    """Parameter bytes left whole on every device of the fsdp axis (`lab.rules.sharding_report`)."""
    if fsdp == 1:
        return Finding("layout", "parameters left unsharded", "not applicable", "the mesh has no fsdp axis")
    fraction = report.unsharded_fraction
    evidence = (
        f"{format_bytes(report.unsharded_bytes)} of {format_bytes(report.total_bytes)} "
        f"parameter bytes whole on each of fsdp={fsdp}: {fraction:.0%}",
        "largest whole: " + (", ".join(report.largest_unsharded) or "none"),
    )
    numbers = {"unsharded_fraction": fraction}
    if not strategy.shards_params:
        return Finding(
            "layout",
            "parameters left unsharded",
            "ok",
            f"{strategy.name} keeps parameters whole by design (memory checks the cost)",
            evidence,
            numbers=numbers,
        )
    if fraction > strategy.max_unsharded_fraction:
        return Finding(
            "layout",
            "parameters left unsharded",
            "problem",
            f"{strategy.name} leaves {fraction:.0%} of the parameters whole",
            evidence,
            "map a dimension of those parameters to fsdp",
            numbers,
        )
    return Finding(
        "layout",
        "parameters left unsharded",
        "ok",
        f"{strategy.name} shards the parameters over fsdp",
        evidence,
        numbers=numbers,
    )


# --- communication ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Traffic:
    """Collectives of one kind over one set of mesh axes, per step."""

    kind: str
    axes: tuple[str, ...]
    count: int
    bytes_per_step: float  # S (nccl-tests convention) times runs
    predicted_s: float
    exact: bool = True  # False: some ran in a loop of unknown trip count and were counted once (a lower bound)


def check_comm_time(traffic: Sequence[Traffic], compute_s: float, compute_source: str) -> Finding:
    """The largest collectives per axis and their predicted time against the step's compute."""
    if not traffic:
        return Finding(
            "communication", "largest collectives per axis", "ok", "the step has no collectives", numbers={"ratio": 0.0}
        )
    comm = sum(t.predicted_s for t in traffic)
    ratio = comm / compute_s
    severity = _severity(ratio, COMM_BOUND_WARNING, COMM_BOUND_PROBLEM)
    largest = sorted(traffic, key=lambda t: -t.bytes_per_step)[:3]
    evidence = (
        f"all collectives predicted {comm * 1e3:.3g} ms against {compute_s * 1e3:.3g} "
        f"ms of compute ({compute_source}): {ratio:.2f}",
    )
    evidence += tuple(
        f"{t.kind} over {','.join(t.axes) or '-'}: {t.count}{'' if t.exact else '+'} "
        f"per step, {format_bytes(t.bytes_per_step)}, "
        f"predicted {t.predicted_s * 1e3:.3g} ms"
        for t in largest
    )
    if not all(t.exact for t in traffic):
        evidence += ("+: in loops of unknown trip count, counted once: a lower bound",)
    verdict = {
        "problem": "communication-bound: the collectives take longer than the compute",
        "warning": "communication is a large part of the step",
        "ok": "communication is small next to compute",
    }[severity]
    fix = (
        ""
        if severity == "ok"
        else "put the largest collective's axis on faster links, or give each "
        "device more work (a larger batch per device)"
    )
    return Finding(
        "communication",
        "largest collectives per axis",
        severity,
        verdict,
        evidence,
        fix,
        {"comm_s": comm, "compute_s": compute_s, "ratio": ratio},
    )


def zero_volume(shards_params: bool, reshard_after_forward: bool) -> float:
    """Model copies moved per step over the data axes, ZeRO paper Section 7: 2Ψ, or 3Ψ for ZeRO-3 (gather twice)."""
    return 3.0 if shards_params and reshard_after_forward else 2.0


def check_comm_volume(
    moved_bytes: float,
    model_bytes: float,
    expected_copies: float,
    micro_batches: int,
    strategy: str,
    exact: bool = True,
) -> Finding:
    """Bytes the data-axis collectives move per step, in model copies, against the strategy's textbook volume.

    `exact` False: some collectives sit in loops of unknown trip count (counted once), so the volume is a lower bound.
    """
    copies = moved_bytes / model_bytes
    ratio = copies / expected_copies
    severity = _severity(ratio, VOLUME_WARNING, VOLUME_PROBLEM)
    evidence = (
        f"{format_bytes(moved_bytes)} per step over the data axes = {copies:.2f} "
        f"model copies ({format_bytes(model_bytes)} each; all-reduce counted "
        "twice)",
        f"ZeRO paper for {strategy}: {expected_copies:.0f} copies per step; "
        f"observed {ratio:.2f}x that, with {micro_batches} micro-batch(es)",
    )
    if not exact:
        evidence += ("some collectives run in loops of unknown trip count and were counted once: a lower bound",)
        if severity == "ok":  # a lower bound under the thresholds proves nothing
            return Finding(
                "communication",
                "communication volume per step",
                "not applicable",
                "cannot tell: loop trip counts are unknown in this HLO, and the lower bound is under the thresholds",
                evidence,
                numbers={"copies": copies, "ratio": ratio},
            )
    verdict = {
        "problem": "the step moves the model many times over: collectives repeat",
        "warning": "the step moves more than its strategy needs",
        "ok": "the step moves what its strategy needs",
    }[severity]
    fix = ""
    if severity != "ok":
        fix = (
            (
                "each micro-batch gathers the weights and reduces its gradients "
                "again: fewer --micro-batches, or, where memory allows, "
                "a strategy that keeps weights whole and accumulates gradients "
                "unreduced (zero1, ddp: one reduction per step); "
                "zero3-keep only halves the gathers"
            )
            if micro_batches > 1
            else "look for collectives the layout repeats (lab inspect)"
        )
    return Finding(
        "communication",
        "communication volume per step",
        severity,
        verdict,
        evidence,
        fix,
        {"copies": copies, "ratio": ratio},
    )


def check_exposed(report) -> Finding:
    """Exposed communication from `lab.hlo.schedule.overlap_report` (None: the HLO has no async collectives)."""
    if report is None:
        return Finding(
            "communication",
            "exposed communication",
            "not applicable",
            "the compiled step has no async collectives (XLA:CPU schedules "
            "every one synchronously): nothing overlaps, each one waits",
        )
    fraction = report.exposed_s / report.step_s if report.step_s else 0.0
    severity = _severity(fraction, EXPOSED_WARNING, EXPOSED_PROBLEM)
    evidence = (
        f"predicted communication {report.communication_s * 1e3:.3g} ms, "
        f"hidden {report.hidden_s * 1e3:.3g} ms, exposed {report.exposed_s * 1e3:.3g} "
        "ms",
        f"exposed / predicted step ({report.step_s * 1e3:.3g} ms on {report.chip}): {fraction:.0%}",
    )
    verdict = {
        "problem": "the step waits for the network",
        "warning": "part of the communication is not hidden",
        "ok": "exposed communication is a small part of the step",
    }[severity]
    fix = (
        ""
        if severity == "ok"
        else "give the scheduler compute to overlap with (larger per-device batch), or fewer, larger collectives"
    )
    return Finding(
        "communication", "exposed communication", severity, verdict, evidence, fix, {"exposed_fraction": fraction}
    )


# --- numerics ---------------------------------------------------------------------------------------


def check_nonfinite(losses: Sequence[float], grad_norms: Sequence[float]) -> Finding:
    if not losses:
        return Finding("numerics", "NaN or Inf", "not applicable", "no steps were run")
    bad = [
        i for i, (loss, norm) in enumerate(zip(losses, grad_norms)) if not (math.isfinite(loss) and math.isfinite(norm))
    ]
    if not bad:
        return Finding(
            "numerics",
            "NaN or Inf",
            "ok",
            "loss and gradient norm stay finite",
            (f"{len(losses)} steps",),
            numbers={"first_bad_step": -1},
        )
    return Finding(
        "numerics",
        "NaN or Inf",
        "problem",
        f"non-finite loss or gradient norm from step {bad[0]}",
        (
            f"{len(bad)} of {len(losses)} steps non-finite; step {bad[0]}: "
            f"loss {losses[bad[0]]}, grad norm {grad_norms[bad[0]]}",
        ),
        "lower --learning-rate; look for bad batches and overflow in low precision",
        {"first_bad_step": bad[0]},
    )


def gradient_spikes(grad_norms: Sequence[float]) -> list[tuple[int, float]]:
    """(step, norm / running median of the previous SPIKE_WINDOW norms) where that ratio reaches SPIKE_FACTOR."""
    spikes = []
    for i in range(SPIKE_WINDOW, len(grad_norms)):
        baseline = float(np.median(grad_norms[i - SPIKE_WINDOW : i]))
        if baseline > 0 and grad_norms[i] / baseline >= SPIKE_FACTOR:
            spikes.append((i, grad_norms[i] / baseline))
    return spikes


def check_spikes(grad_norms: Sequence[float]) -> Finding:
    if len(grad_norms) <= SPIKE_WINDOW:
        return Finding(
            "numerics",
            "gradient-norm spikes",
            "not applicable",
            f"fewer than {SPIKE_WINDOW + 1} steps: no running median to compare with",
        )
    spikes = gradient_spikes(grad_norms)
    if not spikes:
        return Finding(
            "numerics",
            "gradient-norm spikes",
            "ok",
            "no spikes",
            (f"max grad norm / running median {_max_ratio(grad_norms):.2f} (spike: {SPIKE_FACTOR:g})",),
            numbers={"spikes": 0},
        )
    worst = max(spikes, key=lambda s: s[1])
    return Finding(
        "numerics",
        "gradient-norm spikes",
        "warning",
        f"{len(spikes)} gradient-norm spike(s)",
        (f"worst at step {worst[0]}: {worst[1]:.1f}x the median of the previous {SPIKE_WINDOW} steps",),
        "clip gradients or lower --learning-rate; skip the batches around a spike",
        {"spikes": len(spikes)},
    )


def _max_ratio(grad_norms: Sequence[float]) -> float:
    ratios = [grad_norms[i] / np.median(grad_norms[i - SPIKE_WINDOW : i]) for i in range(SPIKE_WINDOW, len(grad_norms))]
    return float(max(ratios))


def check_divergence(losses: Sequence[float]) -> Finding:
    """The last quarter's median loss against the first loss (diverged) and against the best so far (rising)."""
    finite = [x for x in losses if math.isfinite(x)]
    if len(finite) < 4:
        return Finding("numerics", "loss divergence", "not applicable", "fewer than 4 finite losses")
    final = float(np.median(finite[-max(1, len(finite) // 4) :]))
    first, best = finite[0], min(finite)
    evidence = (f"loss {first:.3f} at the first step, best {best:.3f}, last quarter's median {final:.3f}",)
    numbers = {"first": first, "best": best, "final": final}
    if final > first:
        return Finding(
            "numerics",
            "loss divergence",
            "problem",
            "the loss diverged: worse than the untrained model's",
            evidence,
            "lower --learning-rate (or add warm-up and clipping)",
            numbers,
        )
    if final > RISE_WARNING * best:
        return Finding(
            "numerics",
            "loss divergence",
            "warning",
            "the loss is rising again",
            evidence,
            "lower --learning-rate",
            numbers,
        )
    return Finding("numerics", "loss divergence", "ok", "the loss falls", evidence, numbers=numbers)
