"""The doctor's cases: deliberately broken training configurations, each found and named by `lab doctor`.

Question #48 asks what to look at first when a training system misbehaves.
The page answers by running the lab's doctor (`lab.doctor.diagnosis`) on a healthy
control and on one configuration broken on purpose in each layer, in the
doctor's order: memory, input, layout, communication, numerics. For each case
it shows the ranked report and checks that the first problem the doctor names
is in the layer that was broken, and that the control has no problem at all.
The doctor's communication volume of the control (and of the case that
re-gathers every micro-batch) is checked against the ZeRO paper's 3Ψ, and the
difference accounted for from the compiled step's collectives.

The order is the quick-reference's, with one change: it starts with GPU
utilisation, the doctor starts with memory. A step that does not fit tells you
nothing else (the TPU compiler refuses it outright, before any utilisation
exists), and utilisation is an effect of the layers below, not a layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import jax

from experiments import kit
from lab.doctor.checks import COMM_BOUND_PROBLEM, INPUT_PROBLEM, Finding
from lab.doctor.diagnosis import Diagnosis, diagnose
from lab.model import preset
from lab.progress import track
from lab.provenance import Setup
from lab.report import Result, Table
from lab.targets.devices import DEFAULT_TARGET, devices_for, topology_devices
from lab.training.run import RunConfig, trainer_for
from lab.units import format_bytes
from lab.verdict import Check, Claim, check

QUESTION = "#48"
VOLUME_CASES = ("control", "regather")  # the cases whose compiled collectives the page reads
# The doctor's checks that read a clock on an executed target: the data wait, and the measured compute the
# predicted collectives are set against. Every other check reads the compiler, the shapes or the losses.
CLOCKED = ("time waiting for data", "largest collectives per axis")
_DP_KINDS = ("all-gather", "reduce-scatter", "all-reduce")  # what the doctor's volume counts (lab.doctor.diagnosis)
_ZERO_AXES = {"data", "fsdp"}
VOLUME_RTOL = 1e-3  # the step's scalar all-reduces (tens of bytes) against a volume of MiB: under 1e-4
VOLUME_BASIS = (
    "the doctor counts every collective over the data axes, the step's scalar all-reduces (the loss and the "
    "gradient norm's partial sums: tens of bytes, under 1e-4 of the volume) among them; the prediction counts "
    "the parameters only"
)


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
    clocked: bool = False  # the finding that names the broken layer reads a clock on this target


def cases(config: Config, devices: int, chips: int) -> list[Case]:
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
            f"the 1b model with ddp (everything replicated) on the {chips} chips of a {tpu} slice, compile-only",
            replace(control, target=tpu, model="1b", strategy="ddp", mesh="data=-1", global_batch=8),
        ),
        Case(
            "slow_loader",
            "input",
            f"a loader taking {config.input_ms:g} ms per batch, no prefetching",
            replace(control, input_ms=config.input_ms),
            clocked=True,
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
            f"the tiny model with zero3 over the {chips} chips of {tpu}: too little compute per collective",
            replace(control, target=tpu, mesh="fsdp=-1", global_batch=16),
        ),
        Case(
            "diverging",
            "numerics",
            f"a learning rate of {config.diverging_learning_rate:g}",
            replace(control, learning_rate=config.diverging_learning_rate),
        ),
    ]


# --------------------------------------------------------------------------- observations


@dataclass(frozen=True)
class FindingSeen:
    """One of the doctor's findings as `lab.doctor.checks.Finding` gave it: layer, check, severity, the numbers."""

    layer: str
    check: str
    severity: str
    verdict: str
    evidence: tuple[str, ...]
    fix: str
    numbers: dict[str, float]

    @classmethod
    def of(cls, f: Finding) -> FindingSeen:
        numbers = {name: float(value) for name, value in f.numbers.items()}
        return cls(f.layer, f.check, f.severity, f.verdict, tuple(f.evidence), f.fix, numbers)

    def finding(self) -> Finding:
        return Finding(self.layer, self.check, self.severity, self.verdict, self.evidence, self.fix, self.numbers)


@dataclass(frozen=True)
class Param:
    """One parameter array of the trained model, whole (one model copy counts it so)."""

    name: str  # "blocks/mlp/w_in": the layer loop's arrays sit under blocks/
    bytes: int


@dataclass(frozen=True)
class CaseSeen:
    """What the doctor found for one case, in the order it checked; for the volume cases the compiled collectives."""

    name: str
    not_run: str  # why no steps ran (compile-only, does not fit); empty when they did
    findings: tuple[FindingSeen, ...]
    collectives: tuple[kit.Seen, ...] = ()  # the compiled step's, for VOLUME_CASES
    params: tuple[Param, ...] = ()  # the model's parameter arrays, for VOLUME_CASES


@dataclass(frozen=True)
class Observations:
    setup: Setup
    devices: int
    tpu_chips: int  # chips of the compile-only topology, as libtpu built it
    cases: tuple[CaseSeen, ...]

    def case(self, name: str) -> CaseSeen | None:
        return next((c for c in self.cases if c.name == name), None)


# --------------------------------------------------------------------------- measure


def measure(config: Config) -> Observations:
    devices = devices_for(config.target)  # before any compile-only target: the emulated device count is fixed first
    chips = len(topology_devices(config.tpu_topology))
    seen = tuple(_measure_case(case, devices) for case in track(cases(config, len(devices), chips), "doctor cases"))
    return Observations(
        setup=Setup.of(config.target, devices, f"fsdp={len(devices)} (cases vary it)"),
        devices=len(devices),
        tpu_chips=chips,
        cases=seen,
    )


def _measure_case(case: Case, devices) -> CaseSeen:
    diagnosis = diagnose(case.run)
    findings = tuple(FindingSeen.of(f) for f in diagnosis.findings)
    if case.name not in VOLUME_CASES:
        return CaseSeen(case.name, diagnosis.not_run, findings)
    trainer = trainer_for(case.run, devices)  # the doctor's trainer (cached): its step is already compiled
    collectives = kit.seen(trainer.inspect_step(case.run.global_batch).collectives)
    params = tuple(
        Param(_name(path), int(a.size * a.dtype.itemsize))
        for path, a in jax.tree_util.tree_flatten_with_path(trainer.abstract_state().params)[0]
    )
    return CaseSeen(case.name, diagnosis.not_run, findings, collectives, params)


def _name(path) -> str:
    """blocks/mlp/w_in: a parameter's path, without nnx's trailing "value"."""
    keys = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
    return "/".join(keys[:-1] if keys and keys[-1] == "value" else keys)


# --------------------------------------------------------------------------- judge


def judge(obs: Observations, config: Config) -> Result:
    diagnosed = [(case, _diagnosis(obs.case(case.name), case)) for case in cases(config, obs.devices, obs.tpu_chips)]
    volumes = {
        case.name: _volume(obs.case(case.name), case)
        for case, _ in diagnosed
        if case.name in VOLUME_CASES and obs.case(case.name).collectives
    }
    checks = _checks(diagnosed, volumes)
    return Result(
        summary=_summary(diagnosed, volumes),
        theory=THEORY,
        tables=[_overview(diagnosed), *_volume_tables(obs, volumes)]
        + [_report(case, diagnosis) for case, diagnosis in diagnosed],
        checks=checks,
        claims=_claims(diagnosed),
        notes=_notes(diagnosed, volumes),
    )


def _diagnosis(seen: CaseSeen, case: Case) -> Diagnosis:
    """The doctor's diagnosis rebuilt from its stored findings: its own ranking, its own first problem."""
    return Diagnosis(tuple(f.finding() for f in seen.findings), case.run.target, seen.not_run)


def _named(diagnosis: Diagnosis) -> str:
    """The layer of the doctor's first problem, or "none"."""
    return diagnosis.start_here.layer if diagnosis.start_here else "none"


def _finding(diagnosis: Diagnosis, name: str) -> Finding | None:
    return next((f for f in diagnosis.findings if f.check == name), None)


@dataclass(frozen=True)
class Volume:
    """Model copies one ZeRO-3 step moves over the data axes: the textbook, what the compiled step moves (each
    kind apart), and the prediction corrected by what the HLO shows (None when it shows something unforeseen)."""

    micro_batches: int
    doctor: float  # the doctor's number: every data-axis collective's bytes per step / one model copy
    gathered: float  # all-gathers' bytes per step / Ψ
    reduced: float  # the reductions' (all-reduce counted twice, as the doctor does) / Ψ
    outside: float  # f: the share of Ψ in arrays outside the layer loop
    gathers_in_loop: float | None  # per micro-batch, of each array in the layer loop
    gathers_outside: float | None  # per step, of each array outside it
    reduction_kinds: tuple[str, ...]
    refined_gathered: float | None
    refined_reduced: float | None
    why: str
    groups: tuple[tuple[str, int, int, float], ...]  # (kind and where, instructions, runs per step, model copies)

    @property
    def textbook(self) -> float:
        """Rajbhandari et al. 2020, Section 7: per micro-batch, gather Ψ forward, again backward, reduce-scatter Ψ."""
        return 3.0 * self.micro_batches

    @property
    def refined(self) -> float | None:
        if self.refined_gathered is None or self.refined_reduced is None:
            return None
        return self.refined_gathered + self.refined_reduced


def _volume(seen: CaseSeen, case: Case) -> Volume:
    """Read the compiled step's collectives over the data axes, in model copies, and the HLO facts that price them:
    how often each array is gathered (counts of instructions and their runs, not bytes) and which kind reduces."""
    psi = sum(p.bytes for p in seen.params)
    block = [p for p in seen.params if p.name.startswith("blocks/")]
    rest = [p for p in seen.params if not p.name.startswith("blocks/")]
    f = sum(p.bytes for p in rest) / psi
    layers, m = preset(case.run.model).layers, case.run.micro_batches
    dp = [c for c in seen.collectives if c.kind in _DP_KINDS and c.axes and set(c.axes) <= _ZERO_AXES]
    gathers = [c for c in dp if c.kind == "all-gather"]
    reductions = [c for c in dp if c.kind != "all-gather"]

    def copies(group, twice: bool) -> float:
        return (
            sum(c.size_bytes * (c.repeats or 1) * (2 if twice and c.kind == "all-reduce" else 1) for c in group) / psi
        )

    known = all(c.repeats is not None for c in dp)
    in_loop = [c for c in gathers if (c.repeats or 0) > 1]
    once = [c for c in gathers if c.repeats == 1]
    g_in = sum(c.repeats for c in in_loop) / (len(block) * layers * m) if known and block else None
    g_out = len(once) / len(rest) if known and rest else None
    kinds = tuple(sorted({c.kind for c in reductions}))
    r = 2.0 if kinds == ("all-reduce",) else None  # an all-reduce moves 2 copies in this count; a reduce-scatter 1
    refined_gathered = m * g_in * (1 - f) + g_out * f if g_in is not None and g_out is not None else None
    refined_reduced = m * r if r is not None else None
    why = (
        f"the compiled step's {len(in_loop)} all-gathers in the layer loop run {sum(c.repeats or 0 for c in in_loop)} "
        f"times per step: each of the {len(block)} arrays of each of {layers} layers gathered {g_in or 0:g} times per "
        f"micro-batch; its {len(once)} all-gathers outside the loop run once: {g_out or 0:g} per step for each of the "
        f"{len(rest)} arrays outside it (f = {f:.4f} of Ψ, in the embedding tables and final norm); the gradients are "
        f"reduced by {', '.join(kinds) or 'nothing'} (no reduce-scatter: 2 copies per micro-batch). "
        f"So {m:g}·{g_in or 0:g}·(1 - f) + {g_out or 0:g}·f gathered + {m:g}·2 reduced"
    )
    groups = tuple(
        (label, len(group), sum(c.repeats or 1 for c in group), copies(group, True))
        for label, group in (
            ("all-gather in the layer loop", in_loop),
            ("all-gather outside the loop", once),
            *(
                (f"{kind} (counted twice)" if kind == "all-reduce" else kind, [c for c in reductions if c.kind == kind])
                for kind in kinds
            ),
        )
        if group
    )
    doctor = _finding_numbers(seen, "communication volume per step").get("copies", math.nan)
    return Volume(
        m,
        doctor,
        copies(gathers, False),
        copies(reductions, True),
        f,
        g_in,
        g_out,
        kinds,
        refined_gathered,
        refined_reduced,
        why,
        groups,
    )


def _finding_numbers(seen: CaseSeen, name: str) -> dict[str, float]:
    return next((f.numbers for f in seen.findings if f.check == name), {})


def _checks(diagnosed, volumes: dict[str, Volume]) -> list[Check]:
    """Each broken layer named first; the control clean; the volume against the ZeRO paper, refined by the HLO."""
    rows = []
    for case, diagnosis in diagnosed:
        if case.broken_layer:
            rows.append(_layer_check(case, diagnosis))
            continue
        rows += _control_checks(diagnosis)
    for name, v in volumes.items():
        rows += _volume_checks(name, v)
    return rows


def _layer_check(case: Case, diagnosis: Diagnosis) -> Check:
    quantity = f"{case.name}: layer of the first problem"
    if not case.clocked:
        return check(quantity, case.broken_layer, _named(diagnosis), kind="exact")
    return check(
        quantity,
        case.broken_layer,
        _named(diagnosis),
        kind="timing",
        basis=(
            "the loader's sleep is several times the tiny model's step on this target, so its wait passes the "
            f"doctor's {INPUT_PROBLEM:.0%} of the step by a wide margin and input is named first"
        ),
    )


def _control_checks(diagnosis: Diagnosis) -> list[Check]:
    """No problem found: by the checks that read no clock (exactly), and by the two that do (with their margins)."""
    unclocked = [f for f in diagnosis.problems if f.check not in CLOCKED]
    rows = [check("control: problems found by the checks that read no clock", 0, len(unclocked), kind="exact")]
    wait = _finding(diagnosis, "time waiting for data")
    if wait is not None and "fraction" in wait.numbers:
        rows.append(
            check(
                f"control: median wait for data / step (a problem from {INPUT_PROBLEM:g})",
                INPUT_PROBLEM,
                wait.numbers["fraction"],
                kind="timing",
                relation="<=",
                basis=(
                    "on this target a loop whose batches are ready waits only for host-to-device placement, "
                    "a few percent of the step: far under the doctor's threshold"
                ),
            )
        )
    comm = _finding(diagnosis, "largest collectives per axis")
    if comm is not None and "ratio" in comm.numbers:
        rows.append(
            check(
                f"control: predicted communication / measured compute (a problem from {COMM_BOUND_PROBLEM:g})",
                COMM_BOUND_PROBLEM,
                comm.numbers["ratio"],
                kind="timing",
                relation="<=",
                basis=(
                    "the tiny model's collectives, priced at this host's copy bandwidth, are a small fraction of "
                    "its measured compute on this target, orders of magnitude under the threshold"
                ),
            )
        )
    return rows


def _volume_checks(name: str, v: Volume) -> list[Check]:
    m = f" per micro-batch, {v.micro_batches} micro-batches" if v.micro_batches > 1 else ""
    rows = []
    if name == "control":
        rows += [
            check(
                f"{name}: model copies gathered per step over fsdp (ZeRO-3: forward and backward, 2Ψ)",
                2.0 * v.micro_batches,
                v.gathered,
                kind="exact",
                rtol=1e-9,
                refined=v.refined_gathered,
                why=v.why if v.refined_gathered is not None else "",
            ),
            check(
                f"{name}: model copies the gradient reduction moves per step (ZeRO-3: a reduce-scatter, Ψ)",
                1.0 * v.micro_batches,
                v.reduced,
                kind="model",
                rtol=VOLUME_RTOL,
                refined=v.refined_reduced,
                why=f"the compiled step reduces the gradients by {', '.join(v.reduction_kinds) or 'nothing'}"
                if v.refined_reduced is not None
                else "",
                basis=VOLUME_BASIS,
            ),
        ]
    rows.append(
        check(
            f"{name}: model copies moved per step over fsdp, as the doctor counts them (ZeRO-3: 3Ψ{m})",
            v.textbook,
            v.doctor,
            kind="model",
            rtol=VOLUME_RTOL,
            refined=v.refined,
            why=v.why if v.refined is not None else "",
            basis=VOLUME_BASIS,
        )
    )
    return rows


def _claims(diagnosed) -> list[Claim]:
    by_name = {c.name: d for c, d in diagnosed}
    broken = [(c, d) for c, d in diagnosed if c.broken_layer]
    found = [c.name for c, d in broken if _named(d) == c.broken_layer]
    missed = [f"{c.name}: {_named(d)} instead of {c.broken_layer}" for c, d in broken if _named(d) != c.broken_layer]
    claims = [
        Claim(
            "System layers before numerics (data, then parallel layout, then communication, numerics last): the "
            "first problem found in that order is the broken layer",
            "confirmed" if not missed else "refuted",
            f"{len(found)} of {len(broken)} broken cases named by their layer first"
            + (f"; missed: {'; '.join(missed)}" if missed else ""),
        )
    ]
    too_big = by_name.get("too_big")
    if too_big is not None:
        memory = _finding(too_big, "peak memory per device")
        first = _named(too_big)
        status = "refuted" if first != "memory" else "refined" if too_big.not_run else "confirmed"
        peak = memory.numbers.get("peak_bytes") if memory else None
        capacity = memory.numbers.get("capacity_bytes") if memory else None
        claims.append(
            Claim(
                "Look first at resource utilisation: GPU utilisation, memory, network bandwidth",
                status,
                f"too_big: first problem {first}; "
                + (
                    f"peak {format_bytes(peak)} against {format_bytes(capacity)} per chip; "
                    if peak and capacity
                    else ""
                )
                + (
                    "no step ran, so there was no utilisation to read: memory is the first gate"
                    if too_big.not_run
                    else "the step ran"
                ),
            )
        )
    collapsed = by_name.get("collapsed_router")
    if collapsed is not None:
        layers = [f.layer for f in collapsed.problems]
        skew = _finding(collapsed, "expert load skew")
        divergence = _finding(collapsed, "loss divergence")
        symptom_first = bool(layers) and layers[0] == "layout" and "numerics" in layers
        claims.append(
            Claim(
                "Checking system layers before numerics keeps you from starting in the wrong direction",
                "refined" if symptom_first else "confirmed",
                "collapsed_router (only the learning rate changed): problems in the order "
                + (", ".join(layers) or "none")
                + (f"; expert skew {skew.numbers['skew']:.2f}" if skew and "skew" in skew.numbers else "")
                + (
                    f"; loss {divergence.numbers['first']:.2f} -> {divergence.numbers['final']:.2f}"
                    if divergence and "final" in divergence.numbers
                    else ""
                )
                + (
                    ": the first problem is a symptom of the numerics, whose fix is the one that works"
                    if symptom_first
                    else ""
                ),
            )
        )
    return claims


def _summary(diagnosed, volumes: dict[str, Volume]) -> str:
    broken = [(c, d) for c, d in diagnosed if c.broken_layer]
    found = sum(_named(d) == c.broken_layer for c, d in broken)
    control = next(d for c, d in diagnosed if not c.broken_layer)
    firsts = "; ".join(f"{c.name}: {d.start_here.check if d.start_here else 'nothing'}" for c, d in broken)
    text = (
        f"The doctor named the broken layer first in {found} of {len(broken)} "
        f"broken configurations ({firsts}) and found "
        f"{len(control.problems)} problem(s) in the healthy control. Memory "
        "comes first because a step that does not fit "
        f"is refused before anything else can be measured; numerics last, because a diverging loss on a wrong layout "
        f"sends you in the wrong direction."
    )
    v = volumes.get("control")
    if v is not None:
        text += (
            f" The control moves {v.doctor:.2f} model copies per step, not ZeRO-3's 3: the compiled step gathers "
            f"{v.gathered:.2f} (the arrays outside the layer loop once, not twice) and reduces the gradients by "
            f"{', '.join(v.reduction_kinds)} ({v.reduced:.2f} copies, not a reduce-scatter's 1)."
        )
    return text


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


def _volume_tables(obs: Observations, volumes: dict[str, Volume]) -> list[Table]:
    rows = []
    for name, v in volumes.items():
        rows += [[name, label, count, runs, round(copies, 4)] for label, count, runs, copies in v.groups]
        against = f"ZeRO-3: {v.textbook:g}; from the HLO's counts: {v.refined:.4f}" if v.refined else "-"
        rows.append([name, "total, as the doctor counts it", "", "", round(v.doctor, 4), against])
    if not rows:
        return []
    return [
        Table(
            "The ZeRO-3 cases' collectives over fsdp, in model copies per step",
            ["case", "collectives", "instructions", "runs per step", "model copies", "against"],
            [row + [""] * (6 - len(row)) for row in rows],
            "Model copies: bytes per step (S times runs) over the bytes of all parameters, an all-reduce counted "
            "twice (a reduce-scatter plus an all-gather), as the doctor counts them.",
        )
    ]


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


def _notes(diagnosed, volumes: dict[str, Volume]) -> list[str]:
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
    control = volumes.get("control")
    if control is not None and control.reduction_kinds == ("all-reduce",):
        notes.append(
            "control: the compiled step has no reduce-scatter. XLA:CPU does write one when a program asks for it "
            "(the allreduce_equivalence page's shard_map reduce-scatter stays one); here the partitioner reduces "
            "each gradient with an all-reduce, of which each device keeps its slice, and nothing on this target "
            f"rewrites that pair into a reduce-scatter. Counted as the doctor counts (an all-reduce twice), the "
            f"reduction moves {control.reduced:.4f} copies instead of 1, while the embedding tables and the final "
            f"norm (f = {control.outside:.4f} of Ψ), outside the rematerialised layer loop, are gathered once "
            f"instead of twice: {control.gathered:.4f} copies gathered instead of 2."
        )
    regather = by_name.get("regather")
    if regather is not None:
        volume = _finding(regather, "communication volume per step")
        timing = _finding(regather, "largest collectives per axis")
        if volume is not None and timing is not None and volume.evidence and timing.evidence:
            notes.append(
                "regather: on emulated CPU devices the repeated gathers are memory "
                f"copies ({timing.evidence[0]}), so time alone would "
                f"not find them; the bytes do ({volume.evidence[0]}). On a real network the same bytes cost real "
                "time. The arrays outside the layer loop are gathered once per step, not once per micro-batch: "
                "the compiler hoisted their gathers out of the micro-batch loop."
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
        "Verdicts: the layer named first is exact where the finding that names it reads the compiler, the shapes "
        "or the losses, and a timing check where it reads a clock (the slow loader's wait); the control's two "
        "clocked checks are bounds at the doctor's own thresholds, with the margin in the observed value."
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

ZeRO-3's volume, per micro-batch: gather every parameter for the forward (Ψ), gather it again for the backward (Ψ),
reduce-scatter the gradients (Ψ): 3Ψ, so 3M copies with M micro-batches. The corrected prediction reads three facts
from the compiled step, counts rather than bytes: how many times the layer loop's all-gathers run per step (each
array gathered g_in times per micro-batch), how many all-gathers run once outside it (each of the other arrays
gathered g_out times per step; they hold a share f of Ψ), and which kind reduces the gradients (an all-reduce moves
2 copies in this count, a reduce-scatter 1): M·g_in·(1 - f) + g_out·f + M·r.
"""  # noqa: E501
