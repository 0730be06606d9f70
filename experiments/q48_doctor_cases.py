"""The doctor's cases: deliberately broken training configurations, each found and named by `lab doctor`.

Question #48 asks what to look at first when a training system misbehaves.
The page answers by running the lab's doctor (`lab.doctor.diagnosis`) on a healthy
control and on one configuration broken on purpose in each layer, in the
doctor's order: memory, input, layout, communication, numerics. For each case
it shows the ranked report and checks that the first problem the doctor names
is in the layer that was broken, and that the control has no problem at all.

The order is the quick-reference's, with one change: it starts with GPU
utilisation, the doctor starts with memory. A step that does not fit tells you
nothing else (the TPU compiler refuses it outright, before any utilisation
exists), and utilisation is an effect of the layers below, not a layer.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from lab.devices import DEFAULT_TARGET, devices_for
from lab.doctor.diagnosis import Diagnosis, diagnose
from lab.model import preset
from lab.progress import track
from lab.report import Result, Table, provenance
from lab.training.run import RunConfig
from lab.verdict import check

QUESTION = "#48"


@dataclass(frozen=True)
class Config:
    target: str = DEFAULT_TARGET
    """where the executed cases run (cpu:N, gpu, tpu); the compile-only cases use tpu_topology"""
    steps: int = 12
    """steps each executed case runs (the doctor's medians skip the first 2)"""
    global_batch: int = 64
    """sequences per step: divisible by the devices times the micro-batches"""
    tpu_topology: str = "v5e:2x2"
    """compile-only TPU topology of the memory case (the 1b model with ddp) and the small-model communication case"""
    input_ms: float = 60.0
    """the slow loader's milliseconds per batch (the tiny model's step: tens of ms on cpu:8, a few on an accelerator)"""
    micro_batches: int = 8
    """ZeRO-3 micro-batches of the communication case: each gathers the weights again"""
    diverging_learning_rate: float = 1.0
    """AdamW's learning rate in the numerics case and the collapsed-router case (the control uses 3e-3)"""


@dataclass(frozen=True)
class Case:
    """One configuration: what was broken (and in which layer; none for the control) and the run's options."""

    name: str
    broken_layer: str  # "" for the healthy control
    what: str
    run: RunConfig


def cases(config: Config, devices: int) -> list[Case]:
    """The control and one broken configuration per layer (two for layout and for communication)."""
    tpu = f"tpu:{config.tpu_topology}"
    control = RunConfig(
        target=config.target,
        mesh=f"fsdp={devices}",
        model="tiny",
        strategy="zero3",
        steps=config.steps,
        global_batch=config.global_batch,
        page=False,
    )
    return [
        Case(
            "control",
            "",
            f"nothing: the tiny model, zero3 over fsdp={devices}, a learning rate of {control.learning_rate:g}",
            control,
        ),
        Case(
            "too_big",
            "memory",
            f"the 1b model with ddp (everything replicated) on a {tpu} slice, compile-only",
            replace(control, target=tpu, model="1b", strategy="ddp", mesh="data=-1", global_batch=8),
        ),
        Case(
            "slow_loader",
            "input",
            f"a loader taking {config.input_ms:g} ms per batch, no prefetching",
            replace(control, input_ms=config.input_ms),
        ),
        Case(
            "bubble",
            "layout",
            f"a 2-stage pipeline (stage=2,fsdp={devices // 2}) fed one micro-batch "
            "per step: GPipe's bubble is half the step",
            replace(control, mesh=f"stage=2,fsdp={devices // 2}", micro_batches=1),
        ),
        Case(
            "collapsed_router",
            "layout",
            f"the tiny-moe model on expert={devices} at a learning rate of {config.diverging_learning_rate:g}: "
            "the router collapses onto a few experts (and the loss diverges)",
            replace(control, model="tiny-moe", mesh=f"expert={devices}", learning_rate=config.diverging_learning_rate),
        ),
        Case(
            "regather",
            "communication",
            f"zero3 with {config.micro_batches} micro-batches: every micro-batch gathers the weights again",
            replace(control, micro_batches=config.micro_batches),
        ),
        Case(
            "tiny_on_tpu",
            "communication",
            f"the tiny model with zero3 over the 4 chips of {tpu}: too little compute per collective",
            replace(control, target=tpu, mesh="fsdp=-1", global_batch=16),
        ),
        Case(
            "diverging",
            "numerics",
            f"a learning rate of {config.diverging_learning_rate:g}",
            replace(control, learning_rate=config.diverging_learning_rate),
        ),
    ]


def run(config: Config) -> Result:
    devices = devices_for(config.target)  # before any compile-only target: the emulated device count is fixed first
    diagnosed = [(case, diagnose(case.run)) for case in track(cases(config, len(devices)), "doctor cases")]
    return Result(
        summary=_summary(diagnosed),
        theory=THEORY,
        tables=[_overview(diagnosed)] + [_report(case, diagnosis) for case, diagnosis in diagnosed],
        checks=_checks(diagnosed),
        notes=_notes(diagnosed),
        provenance=provenance(target=config.target, devices=devices, mesh=f"fsdp={len(devices)} (cases vary it)"),
        data={
            case.name: {
                "broken_layer": case.broken_layer,
                "what": case.what,
                "not_run": d.not_run,
                "findings": [
                    {
                        "layer": f.layer,
                        "check": f.check,
                        "severity": f.severity,
                        "verdict": f.verdict,
                        "evidence": list(f.evidence),
                        "fix": f.fix,
                        "numbers": dict(f.numbers),
                    }
                    for f in d.ranked
                ],
            }
            for case, d in diagnosed
        },
    )


def _named(diagnosis: Diagnosis) -> str:
    """The layer of the doctor's first problem, or "none"."""
    return diagnosis.start_here.layer if diagnosis.start_here else "none"


def _checks(diagnosed) -> list:
    """Each broken layer named first, nothing in the control; and the control's volume against the ZeRO paper."""
    rows = []
    for case, diagnosis in diagnosed:
        if case.broken_layer:
            rows.append(check(f"{case.name}: layer of the first problem", case.broken_layer, _named(diagnosis)))
            continue
        rows.append(check("control: problems found", 0, len(diagnosis.problems)))
        volume = next(f for f in diagnosis.findings if f.check == "communication volume per step")
        if "copies" in volume.numbers and case.run.strategy == "zero3":
            rows.append(
                _volume_check(volume.numbers["copies"], preset(case.run.model), case.run.target.startswith("cpu"))
            )
    return rows


def _volume_check(copies: float, model, on_cpu: bool):
    """ZeRO-3's 3Ψ per step against the control's copies; on XLA:CPU refined by the accounting below."""
    embeddings = 2 * model.vocab * model.embed / model.parameters  # f: the share of Ψ in the two embedding tables
    on_cpu_copies = 2 * (1 - embeddings) + embeddings + 2
    explained = None
    if on_cpu and abs(copies - on_cpu_copies) <= 0.02 * on_cpu_copies:
        explained = (
            "XLA:CPU has no reduce-scatter: the gradient's reduce-scatter "
            "runs as an all-reduce and a slice (2Ψ, not Ψ); and "
            f"the embedding tables (f = 2VD/Ψ = {embeddings:.3f} of the model), "
            "outside the rematerialised blocks, are gathered "
            f"once, not twice (the backward keeps the forward's copy): 2(1 - f) + f + 2 = {on_cpu_copies:.3f} copies"
        )
    return check(
        "control: model copies moved per step over fsdp (ZeRO-3)", 3.0, round(copies, 3), rtol=0.05, explained=explained
    )


def _summary(diagnosed) -> str:
    broken = [(c, d) for c, d in diagnosed if c.broken_layer]
    found = sum(_named(d) == c.broken_layer for c, d in broken)
    control = next(d for c, d in diagnosed if not c.broken_layer)
    firsts = "; ".join(f"{c.name}: {d.start_here.check if d.start_here else 'nothing'}" for c, d in broken)
    return (
        f"The doctor named the broken layer first in {found} of {len(broken)} "
        f"broken configurations ({firsts}) and found "
        f"{len(control.problems)} problem(s) in the healthy control. Memory "
        "comes first because a step that does not fit "
        f"is refused before anything else can be measured; numerics last, because a diverging loss on a wrong layout "
        f"sends you in the wrong direction."
    )


def _overview(diagnosed) -> Table:
    rows = []
    for case, d in diagnosed:
        start = d.start_here
        rows.append(
            [
                case.name,
                case.broken_layer or "-",
                case.what,
                f"{start.layer}: {start.check}" if start else "no problem",
                start.evidence[0] if start and start.evidence else "-",
                start.fix if start else "-",
            ]
        )
    return Table(
        "Each case: what was broken, and what the doctor named first",
        ["case", "broken layer", "what was broken", "start here", "evidence", "fix"],
        rows,
    )


def _report(case: Case, diagnosis: Diagnosis) -> Table:
    rows = [
        [rank, f.severity, f.layer, f.check, f.verdict, "; ".join(f.evidence) or "-", f.fix or "-"]
        for rank, f in enumerate(diagnosis.ranked, 1)
        if f.severity != "not applicable"
    ]
    skipped = [f"{f.layer}/{f.check}" for f in diagnosis.ranked if f.severity == "not applicable"]
    note = ("Not applicable: " + ", ".join(skipped) + "." if skipped else "") + (
        f" No steps ran: {diagnosis.not_run}." if diagnosis.not_run else ""
    )
    return Table(
        f"{case.name}: the ranked report",
        ["#", "severity", "layer", "check", "verdict", "evidence", "fix"],
        rows,
        note.strip(),
    )


QUICK_REFERENCE = (
    "What the quick-reference #48 gets right: system before numerics, "
    "and data before parallelism before communication; "
    "a loss curve read on a broken layout misleads. What it leaves out: "
    "memory is the first gate (its order starts with "
    "GPU utilisation, which is an effect of every layer below, not a layer); the evidence for each layer exists before "
    "any profiler runs (the compiled step's memory analysis and collectives, "
    "on a laptop, even for a TPU pod); and each "
    "finding needs a threshold with a reason, or the checklist only moves the guessing."
)


def _notes(diagnosed) -> list[str]:
    by_name = {c.name: d for c, d in diagnosed}
    notes = [QUICK_REFERENCE]
    too_big = by_name.get("too_big")
    if too_big is not None and too_big.start_here is not None:
        notes.append(
            f"too_big: {too_big.start_here.evidence[0]} The TPU compiler knows "
            "the chip's HBM and refuses the program, so no "
            "TPU is needed to learn that it does not fit; on CPU targets "
            "the doctor compares XLA's memory analysis with the host's "
            "memory shared out among the emulated devices instead."
        )
    regather = by_name.get("regather")
    if regather is not None:
        volume = next(f for f in regather.findings if f.check == "communication volume per step")
        timing = next(f for f in regather.findings if f.check == "largest collectives per axis")
        notes.append(
            "regather: on emulated CPU devices the repeated gathers are memory "
            f"copies ({timing.evidence[0]}), so time alone would "
            f"not find them; the bytes do ({volume.evidence[0]}). On a real network the same bytes cost real time."
        )
    collapsed = by_name.get("collapsed_router")
    if collapsed is not None and collapsed.start_here is not None:
        diverged = [f for f in collapsed.problems if f.layer == "numerics"]
        notes.append(
            f"collapsed_router: the doctor names the skew first ({collapsed.start_here.evidence[0]})"
            + (f" and the divergence later ({diverged[0].evidence[0]})" if diverged else "")
            + ". The layers order where to look, not what caused what: here "
            "the cause is the learning rate, the skew its "
            "first symptom. Rebalancing the router would not help; the fix of the numerics finding would."
        )
    notes.append(
        "XLA:CPU schedules no collective asynchronously, so the overlap analysis (lab.hlo.schedule) applies only "
        "to the compile-only TPU cases; loop trip counts are missing from the TPU "
        "HLO's collectives, so counts there are lower bounds."
    )
    return notes


# a markdown table keeps each row on one line
THEORY = r"""
The doctor checks five layers in a fixed order and ranks what it finds: problems first, in layer order; the first
problem is where to start.

| layer | check | evidence | problem when |
|---|---|---|---|
| memory | peak per device | XLA's memory analysis of the compiled step (or the TPU compiler's refusal) against the device's capacity | peak > capacity (warning above 90 %) |
| input | time waiting for data | median wait for the batch / median step, after 2 warm-up steps | ≥ 20 % (warning ≥ 5 %) |
| layout | axes repeating work | mesh axes of size > 1 that split neither the batch nor a weight (`Layout.idle_axes`) | any |
| layout | parameters left unsharded, expert load skew, pipeline bubble | `lab.rules.sharding_report`; the busiest expert / mean; (P-1)/(M+P-1) | over the strategy's limit; skew ≥ 2 (warning ≥ 1.25, Switch's capacity factor); bubble ≥ 50 % (warning ≥ 20 %: Megatron's M ≥ 4P) |
| communication | largest collectives per axis | bytes per step from the optimized HLO, time predicted by `lab.theory` on the links each axis uses, against the compute | predicted communication ≥ compute (warning ≥ half) |
| communication | volume per step | bytes over the data axes in model copies (all-reduce counted twice) against the ZeRO paper: 2Ψ for DDP, ZeRO-1, ZeRO-2; 3Ψ for ZeRO-3 (Rajbhandari et al. 2020, Section 7) | ≥ 4x (warning ≥ 2x) |
| communication | exposed communication | `lab.hlo.schedule`: communication not covered by compute in the schedule (TPU HLO only) | ≥ 50 % of the step (warning ≥ 25 %) |
| numerics | NaN/Inf, gradient-norm spikes, divergence | per-step loss and global gradient norm | non-finite; final loss above the first (a spike ≥ 5x the running median is a warning) |

A step compiled for a TPU topology needs no TPU: memory, layout and communication are read from what the compiler
produced; input and numerics need steps to run, so they are not applicable there.
"""  # noqa: E501
