"""Ring all-reduce by hand: 2(N-1) permutes, against psum and trees.

Question #39 says a ring all-reduce is a reduce-scatter followed by an
all-gather, 2(N-1) steps each moving D/N per device, 2(N-1)/N·D in all. Here
the ring is written with ``ppermute`` alone (lab.collectives) and checked:

1. numerics: the ring's sum equals psum's, exactly, for N = 2, 4, 8;
2. the compiled HLO: 2(N-1) collective-permutes, D/N bytes each, on the axis;
3. time: the hand-written ring against XLA's own all-reduce at the same size;
4. latency against bandwidth: the alpha-beta model, fitted on single permutes
   at the inner sizes of the sweep, predicts the ring, the bidirectional ring,
   recursive halving-doubling and recursive doubling at the smallest and the
   largest size (held out of every fit), and where recursive doubling's log2 N
   full-size steps stop beating the ring's 2(N-1) small ones.
   Where the textbook misses, a corrected prediction adds what this target
   does between the sends: the reduction arithmetic (TRG's gamma term) with
   gamma measured on a local add, one call's overhead and the per-step latency
   measured on a chain of permutes, and the steps and bytes XLA wrote.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import jax
import matplotlib
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from matplotlib.figure import Figure

from experiments import kit
from lab import theory
from lab.bench import Timing, crossover, time_interleaved
from lab.collectives import build_program, ring_pairs, send
from lab.errors import LabError
from lab.mesh import MeshSpec
from lab.progress import track
from lab.provenance import Setup
from lab.report import Result, Table
from lab.targets.devices import DEFAULT_TARGET, devices_for
from lab.units import format_bytes, parse_size, size_sweep
from lab.verdict import Check, Claim, check

QUESTION = "#39"

# program name -> the theory module's algorithm name for all-reduce
ALGORITHMS = {
    "ring-all-reduce": "ring",
    "bidirectional-ring-all-reduce": "bidirectional-ring",
    "halving-doubling-all-reduce": "halving-doubling",
    "recursive-doubling-all-reduce": "recursive-doubling",
}
PSUM, PERMUTE, ADD, CHAIN = "all-reduce", "collective-permute", "local add", "permute chain"
CHAIN_LENGTH = 16  # permutes in the chain that measures the latency of one step
ROUND_SECONDS = 0.5  # each size keeps going round for at least this long: microsecond programs get many rounds
RTOL = 0.2
MODEL_BASIS = (
    "fastest of at least 0.5 s of round-robin rounds (other processes only ever add time); the corrected "
    "prediction moved by under 10% between two runs on this shared, loaded 2-core machine: 20% leaves room for "
    "that and still fails a factor of 1.5 either way"
)


@dataclass(frozen=True)
class Config:
    target: str = DEFAULT_TARGET
    """where to run (cpu:N, gpu, tpu)"""
    size: str = "16M"
    """D per device for the ring-against-psum comparison"""
    group_sizes: tuple[int, ...] = (2, 4, 8)
    """ring sizes N to check (each needs N devices)"""
    begin: str = "1K"
    """smallest D of the algorithm sweep (held out of the fits: a prediction is judged here)"""
    end: str = "16M"
    """largest D of the algorithm sweep (held out of the fits: a prediction is judged here)"""
    factor: int = 4
    repeats: int = 7
    """timed rounds per point, after warm-up (the median is reported)"""


@dataclass(frozen=True)
class RingRun:
    """The hand-written ring against psum on N devices: its HLO and both times."""

    n: int
    size: int  # D per device
    identical: bool  # the ring's result against psum's, element by element on every device
    collectives: tuple[kit.Seen, ...]  # what XLA compiled the ring to
    ring: Timing
    psum: Timing


@dataclass(frozen=True)
class Program:
    """One program of the sweep at one size: what XLA compiled it to, and its time."""

    name: str
    collectives: tuple[kit.Seen, ...]
    time: Timing


@dataclass(frozen=True)
class AtSize:
    """Every algorithm, psum and the calibration programs at one D, timed round-robin."""

    size: int
    programs: tuple[Program, ...]

    def program(self, name: str) -> Program:
        return next(p for p in self.programs if p.name == name)

    def fastest(self, name: str) -> float:
        """The fastest round: on a shared machine other processes only ever add time."""
        return self.program(name).time.min


@dataclass(frozen=True)
class Observations:
    setup: Setup
    devices: int  # N of the sweep
    rings: tuple[RingRun, ...]
    sweep: tuple[AtSize, ...]
    chain_length: int


# --------------------------------------------------------------------------- measure


def measure(config: Config) -> Observations:
    devices = devices_for(config.target)
    sizes = size_sweep(config.begin, config.end, config.factor)
    if len(sizes) < 4:
        raise LabError(
            f"the sweep {config.begin}..{config.end} (factor {config.factor}) has {len(sizes)} sizes; it needs at "
            "least 4: the smallest and the largest are held out, the fits need two more"
        )
    if not config.group_sizes or min(config.group_sizes) < 2:
        raise LabError(f"--group-sizes {list(config.group_sizes)}: a ring needs 2 or more devices; give e.g. 2 4 8")
    size = parse_size(config.size)
    rings = tuple(
        _ring_against_psum(n, devices, size, config.repeats)
        for n in track(config.group_sizes, "ring vs psum")
        if n <= len(devices)
    )
    if not rings:
        raise LabError(f"no ring size in {list(config.group_sizes)} fits on {len(devices)} devices")
    n = max(r.n for r in rings)
    mesh = MeshSpec(tensor=n).build(devices[:n])
    sweep = tuple(
        _at_size(mesh, s, config.repeats, chain=s == sizes[0]) for s in track(sizes, "algorithms across sizes")
    )
    return Observations(
        setup=Setup.of(config.target, devices, f"tensor=N on the first N devices, N in {[r.n for r in rings]}"),
        devices=n,
        rings=rings,
        sweep=sweep,
        chain_length=CHAIN_LENGTH,
    )


def _ring_against_psum(n: int, devices, size: int, repeats: int) -> RingRun:
    mesh = MeshSpec(tensor=n).build(devices[:n])
    ring, psum = build_program("ring-all-reduce", mesh, "tensor"), build_program(PSUM, mesh, "tensor")
    placed = ring.place(ring.example_input(size))
    compiled_ring, inspection = kit.compile_and_inspect(ring.fn, ring.abstract_input(size), mesh=mesh)
    compiled_psum = psum.fn.lower(psum.abstract_input(size)).compile()
    same = bool(np.array_equal(np.asarray(compiled_ring(placed)), np.asarray(compiled_psum(placed))))
    timings = time_interleaved(
        {"ring": (compiled_ring, (placed,)), "psum": (compiled_psum, (placed,))}, repeats=repeats
    )
    return RingRun(n, size, same, kit.seen(inspection.collectives), timings["ring"], timings["psum"])


def _local_add(mesh):
    """a + b on every device's own block: the reduction arithmetic alone, no communication."""
    spec = P("tensor")
    return jax.jit(jax.shard_map(lambda a, b: a + b, mesh=mesh, in_specs=(spec, spec), out_specs=spec))


def _chain(mesh, length: int):
    """`length` ring shifts in a row: one call's overhead plus `length` steps."""
    n = mesh.devices.size

    @partial(jax.shard_map, mesh=mesh, in_specs=P("tensor"), out_specs=P("tensor"))
    def shifts(block):
        for _ in range(length):
            block = send(block, "tensor", ring_pairs(n))
        return block

    return jax.jit(shifts)


def _at_size(mesh, size: int, repeats: int, *, chain: bool) -> AtSize:
    """Compile every program at D = `size`, then time them all round-robin."""
    calls, found = {}, {}
    for name in (*ALGORITHMS, PSUM, PERMUTE):
        program = build_program(name, mesh, "tensor")
        compiled, inspection = kit.compile_and_inspect(program.fn, program.abstract_input(size), mesh=mesh)
        calls[name] = (compiled, (program.place(program.example_input(size)),))
        found[name] = kit.seen(inspection.collectives)
    n = mesh.devices.size
    block = jax.device_put(np.ones((n, size // 4), np.float32), NamedSharding(mesh, P("tensor")))
    calls[ADD] = (_local_add(mesh).lower(block, block).compile(), (block, block))
    found[ADD] = ()
    if chain:
        compiled, inspection = kit.compile_and_inspect(_chain(mesh, CHAIN_LENGTH), block, mesh=mesh)
        calls[CHAIN], found[CHAIN] = (compiled, (block,)), kit.seen(inspection.collectives)
    times = time_interleaved(calls, repeats=repeats, min_seconds=ROUND_SECONDS)
    return AtSize(size, tuple(Program(name, found[name], times[name]) for name in calls))


# --------------------------------------------------------------------------- judge


@dataclass(frozen=True)
class Model:
    """The textbook's alpha and beta, fitted on single permutes at the fit sizes (every size of the sweep but the
    smallest and the largest), and this target's corrections from calibration programs."""

    fit_sizes: tuple[int, ...]
    alpha: float  # s: intercept of the single permute's line (one call and one step)
    beta: float  # bytes/s: 1 / its slope
    gamma: float  # s per byte added: slope of the local add's line at the fit sizes
    overhead: float  # s: one program call, from the chain against the single permute at the smallest size
    alpha_step: float  # s: one more step in the same call, from the same chain


def _line(x: list[float], y: list[float]) -> tuple[float, float]:
    """Slope and intercept of y = a x + b by least squares on relative residuals (weights 1/y, so us and ms
    points count alike), in closed form with exactly rounded sums: the same bits on any install, so a rejudge
    reproduces the page exactly (LAPACK's least squares, behind np.polyfit, differs in the last bit by build)."""
    w = [1.0 / (v * v) for v in y]
    total = math.fsum(w)
    xm = math.fsum(wi * xi for wi, xi in zip(w, x)) / total
    ym = math.fsum(wi * yi for wi, yi in zip(w, y)) / total
    slope = math.fsum(wi * (xi - xm) * (yi - ym) for wi, xi, yi in zip(w, x, y)) / math.fsum(
        wi * (xi - xm) ** 2 for wi, xi in zip(w, x)
    )
    return slope, ym - slope * xm


def fit(obs: Observations) -> Model:
    fitted = obs.sweep[1:-1]
    sizes = [float(at.size) for at in fitted]
    slope, alpha = _line(sizes, [at.fastest(PERMUTE) for at in fitted])
    beta = 1.0 / max(slope, 1e-15)
    gamma = max(_line(sizes, [at.fastest(ADD) for at in fitted])[0], 0.0)
    # the chain runs in the same rounds as the smallest size's programs: the same load, whatever it was
    at = next(a for a in obs.sweep if any(p.name == CHAIN for p in a.programs))
    per_step = (at.fastest(CHAIN) - at.fastest(PERMUTE)) / (obs.chain_length - 1)  # one step: alpha_step + m/beta
    alpha_step = max(per_step - at.size / beta, 0.0)
    overhead = max(at.fastest(PERMUTE) - per_step, 0.0)
    return Model(tuple(int(s) for s in sizes), max(alpha, 1e-9), beta, gamma, overhead, alpha_step)


def textbook(name: str, size: int, n: int, model: Model) -> float:
    """The alpha-beta prediction (Hockney; TRG 2005) with the fitted alpha and beta."""
    if name == PERMUTE:
        return model.alpha + size / model.beta
    algorithm = ALGORITHMS[name]
    return theory.collective_cost(
        "all-reduce", size, n, algorithm=algorithm, alpha=model.alpha, beta=model.beta
    ).seconds


def corrected(program: Program, size: int, n: int, model: Model) -> float:
    """What this target pays: one call, then per collective XLA wrote one step and its bytes over one shared bus,
    plus TRG's gamma term (bytes added into partial sums) at the gamma the local add measured."""
    steps = sum(c.repeats or 1 for c in program.collectives)
    sent = sum(c.size_bytes * (c.repeats or 1) for c in program.collectives)
    reduced = 0.0
    if program.name in ALGORITHMS:
        reduced = theory.collective_cost(
            "all-reduce", size, n, algorithm=ALGORITHMS[program.name], alpha=0, beta=1
        ).bytes_reduced
    return model.overhead + steps * model.alpha_step + sent / model.beta + reduced * model.gamma


def judge(obs: Observations, config: Config) -> Result:
    model = fit(obs)
    checks = [c for r in obs.rings for c in _ring_checks(r)]
    checks += _small_checks(obs.sweep[0], obs.devices, model)
    checks += _model_checks(obs.sweep[-1], obs.devices, model)
    cross = _crossover(obs, model)
    checks.append(cross)
    return Result(
        summary=_summary(obs, model, cross),
        theory=THEORY,
        tables=[_ring_table(obs), _fit_table(obs, model), _sweep_table(obs, model), _held_out_table(obs, model)],
        checks=checks,
        claims=_claims(obs),
        plots={"algorithms": partial(_plot, obs, model, cross)},
        notes=_notes(obs, model),
    )


def _permutes(collectives) -> list[kit.Seen]:
    return [c for c in collectives if c.kind == "collective-permute"]


def _the_one(values: set):
    """The single value of a set, or all of them as text when they differ."""
    return next(iter(values)) if len(values) == 1 else ", ".join(map(str, sorted(values)))


def _sent(collectives) -> int:
    return sum(c.size_bytes * (c.repeats or 1) for c in _permutes(collectives))


def _ring_checks(r: RingRun) -> list[Check]:
    n, permutes = r.n, _permutes(r.collectives)
    expected = theory.collective_cost("all-reduce", r.size, n, algorithm="ring", alpha=0, beta=1)
    return [
        check(f"N={n}: ring result equals psum (all elements)", "True", str(r.identical), kind="exact"),
        check(
            f"N={n}: collective-permutes in the HLO",
            expected.steps,
            sum(c.repeats or 1 for c in permutes),
            kind="exact",
        ),
        check(f"N={n}: bytes per permute (D/N)", r.size // n, _the_one({c.size_bytes for c in permutes}), kind="exact"),
        check(f"N={n}: bytes sent per device, 2(N-1)/N·D", expected.bytes_sent, _sent(r.collectives), kind="exact"),
        check(
            f"N={n}: permutes run on the tensor axis",
            "tensor",
            ",".join(sorted({",".join(c.axes or ("?",)) for c in permutes})),
            kind="exact",
        ),
    ]


def _small_checks(at: AtSize, n: int, model: Model) -> list[Check]:
    """Each program at the smallest, held-out size against this target's model: at 1 KiB the textbook's alpha-beta
    lands within the clock's noise of the observation, so a check against it would agree on one run and need the
    correction on the next; the textbook's number is in the table beside it."""
    rows = []
    for name in ALGORITHMS:
        program = at.program(name)
        predicted = corrected(program, at.size, n, model)
        if predicted is None:
            continue
        steps = sum(c.repeats or 1 for c in program.collectives)
        rows.append(
            check(
                f"{name} at {format_bytes(at.size)} (held out): fastest round (ms) against this target's model: one "
                f"call, {steps} steps of the chain's latency, beta and gamma",
                predicted * 1e3,
                program.time.min * 1e3,
                kind="model",
                rtol=RTOL,
                basis=MODEL_BASIS,
            )
        )
    return rows


def _model_checks(at: AtSize, n: int, model: Model) -> list[Check]:
    """Each program at a held-out size: the textbook prediction, and this target's where it misses."""
    rows = []
    for name in ALGORITHMS:  # the single permute, what the corrections are read from, is shown in a table only
        program = at.program(name)
        refined = corrected(program, at.size, n, model)
        steps = sum(c.repeats or 1 for c in program.collectives)
        rows.append(
            check(
                f"{name} at {format_bytes(at.size)} (held out): fastest round (ms) against alpha-beta "
                "fitted on single permutes",
                textbook(name, at.size, n, model) * 1e3,
                program.time.min * 1e3,
                kind="model",
                rtol=RTOL,
                refined=refined * 1e3 if refined is not None else None,
                why=""
                if refined is None
                else (
                    f"one call {model.overhead * 1e6:.0f} us + {steps} steps of {model.alpha_step * 1e6:.0f} us "
                    f"(the permutes XLA wrote, latency from a chain of {CHAIN_LENGTH}) + their "
                    f"{format_bytes(_sent(program.collectives))} over one shared bus at beta + TRG's gamma term at "
                    f"the local add's {model.gamma * 1e9:.2f} ns/byte"
                ),
                basis=MODEL_BASIS,
            )
        )
    return rows


def _measured_crossover(obs: Observations) -> float | None:
    sizes = [at.size for at in obs.sweep]
    ratios = [at.fastest("ring-all-reduce") / at.fastest("recursive-doubling-all-reduce") for at in obs.sweep]
    return crossover(sizes, ratios)  # where the ring overtakes doubling


def _crossover(obs: Observations, model: Model) -> Check:
    """Where recursive doubling stops beating the ring: the textbook, this target's model, the measured curves."""
    n = obs.devices
    predicted = theory.crossover_bytes(
        "all-reduce", "recursive-doubling", "ring", n, alpha=model.alpha, beta=model.beta
    )
    refined = theory.crossover_bytes(
        "all-reduce", "recursive-doubling", "ring", n, alpha=model.alpha_step, beta=model.beta, gamma=model.gamma
    )
    measured = _measured_crossover(obs)
    return check(
        "size where the ring overtakes recursive doubling (bytes)",
        round(predicted) if math.isfinite(predicted) else "never",
        round(measured) if measured else "no crossing in the sweep",
        kind="model",
        rtol=0.25,
        refined=round(refined) if math.isfinite(refined) else "never",
        why=f"per-step latency {model.alpha_step * 1e6:.0f} us and TRG's gamma term at {model.gamma * 1e9:.2f} ns/byte",
        basis=(
            "the measured crossover is interpolated on a log scale between sweep sizes a factor of 4 apart and "
            "moved by about 20% between two runs here: 25%"
        ),
    )


def _claims(obs: Observations) -> list[Claim]:
    rings = obs.rings
    structure = all(
        r.identical
        and len(_permutes(r.collectives)) == 2 * (r.n - 1)
        and {c.size_bytes for c in _permutes(r.collectives)} == {r.size // r.n}
        for r in rings
    )
    per_n = ", ".join(
        f"N={r.n}: {sum(1 for _ in _permutes(r.collectives))} permutes of {format_bytes(r.size // r.n)}" for r in rings
    )
    ratios = {r.n: _sent(r.collectives) / r.size for r in rings}
    follows_n = all(math.isclose(ratios[n], 2 * (n - 1) / n) for n in ratios)
    about_2d = all(abs(x - 2) <= 0.1 * 2 for x in ratios.values())
    small, large = obs.sweep[0], obs.sweep[-1]
    few_small = small.fastest("recursive-doubling-all-reduce") / small.fastest("ring-all-reduce")
    few_large = large.fastest("recursive-doubling-all-reduce") / large.fastest("ring-all-reduce")
    return [
        Claim(
            "ring all-reduce = reduce-scatter (N-1 steps) then all-gather (N-1 steps), D/N per device per step",
            "confirmed" if structure else "refuted",
            f"{per_n}; the ring's result equals psum's on every device: "
            f"{', '.join(f'N={r.n} {r.identical}' for r in rings)}",
        ),
        Claim(
            "all-reduce sends about 2D per device, independent of N",
            "confirmed" if about_2d else "refined" if follows_n else "refuted",
            "bytes sent per device from the HLO / D: "
            + ", ".join(f"N={n}: {x:.2f}" for n, x in ratios.items())
            + " = 2(N-1)/N: it depends on N and only approaches 2",
        ),
        Claim(
            "a few-step (tree-like) algorithm wins small messages, the ring wins large ones",
            "confirmed" if few_small < 1 < few_large else "refuted",
            f"recursive doubling / ring time at {format_bytes(small.size)}: {few_small:.2f}x, "
            f"at {format_bytes(large.size)}: {few_large:.2f}x (N={obs.devices}, this target)",
        ),
    ]


# --------------------------------------------------------------------------- the page


def _ring_table(obs: Observations) -> Table:
    rows = [
        [
            r.n,
            format_bytes(r.size),
            len(_permutes(r.collectives)),
            format_bytes(_sent(r.collectives)),
            str(r.ring),
            str(r.psum),
            f"{r.ring.median / r.psum.median:.2f}",
        ]
        for r in obs.rings
    ]
    return Table(
        "Hand-written ring against XLA's all-reduce (psum)",
        [
            "N",
            "D",
            "permutes in HLO",
            "sent per device (HLO)",
            "ring (median [min, max])",
            "psum (median [min, max])",
            "ring / psum",
        ],
        rows,
        note="Both timed round-robin in one run.",
    )


def _fit_table(obs: Observations, model: Model) -> Table:
    rows = [
        [
            format_bytes(at.size),
            "fit" if at.size in model.fit_sizes else "held out",
            str(at.program(PERMUTE).time),
            f"{(model.alpha + at.size / model.beta) * 1e3:.3f}",
            str(at.program(ADD).time),
        ]
        for at in obs.sweep
    ]
    return Table(
        f"Calibration programs on N={obs.devices}: alpha = {model.alpha * 1e6:.1f} us, beta = "
        f"{model.beta / 1e9:.2f} GB/s (single permute); gamma = {model.gamma * 1e9:.2f} ns/byte (local add); one "
        f"call {model.overhead * 1e6:.0f} us, one step {model.alpha_step * 1e6:.0f} us (chain of {obs.chain_length} "
        f"at {format_bytes(obs.sweep[0].size)})",
        ["D", "", "single collective-permute", "alpha + D/beta (ms)", "local add of D"],
        rows,
        note="Fitted on the inner sizes only; the smallest and the largest are held out and judged below.",
    )


def _sweep_table(obs: Observations, model: Model) -> Table:
    names = [*ALGORITHMS, PSUM]
    rows = []
    for at in obs.sweep:
        cells = [format_bytes(at.size)]
        for name in names:
            text = f"{at.fastest(name) * 1e6:.0f}"
            if name in ALGORITHMS:
                text += (
                    f" ({textbook(name, at.size, obs.devices, model) * 1e6:.0f} / "
                    f"{corrected(at.program(name), at.size, obs.devices, model) * 1e6:.0f})"
                )
            cells.append(text)
        rows.append(cells)
    return Table(
        "All-reduce algorithms across sizes: fastest round, us (textbook alpha-beta / with this target's corrections)",
        ["D", *names],
        rows,
    )


def _held_out_table(obs: Observations, model: Model) -> Table:
    rows = []
    for at in (obs.sweep[0], obs.sweep[-1]):
        for name in (PERMUTE, *ALGORITHMS):
            program = at.program(name)
            measured = program.time.min
            rows.append(
                [
                    format_bytes(at.size),
                    name,
                    str(program.time),
                    f"{measured / textbook(name, at.size, obs.devices, model):.2f}",
                    f"{measured / corrected(program, at.size, obs.devices, model):.2f}" if name in ALGORITHMS else "-",
                ]
            )
    return Table(
        "Held-out sizes: measured against each prediction",
        ["D", "program", "measured (median [min, max])", "fastest / textbook", "fastest / corrected"],
        rows,
    )


def _plot(obs: Observations, model: Model, cross: Check):
    figure = Figure(figsize=(7.5, 4.5))
    axes = figure.subplots()
    sizes = [at.size for at in obs.sweep]
    colors = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    for color, name in zip(colors, [*ALGORITHMS, PSUM]):
        axes.plot(sizes, [at.fastest(name) for at in obs.sweep], marker="o", color=color, label=f"{name} (fastest)")
        if name in ALGORITHMS:
            axes.plot(sizes, [textbook(name, s, obs.devices, model) for s in sizes], "--", color=color, alpha=0.5)
            axes.plot(
                sizes,
                [corrected(at.program(name), at.size, obs.devices, model) for at in obs.sweep],
                ":",
                color=color,
                alpha=0.8,
            )
    for value, style, label in (
        (cross.theory, ":", "textbook crossover"),
        (cross.observed, "-.", "measured crossover"),
    ):
        if isinstance(value, int | float):
            axes.axvline(value, color="gray", linestyle=style, label=label)
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    axes.set_xlabel("D per device (bytes)")
    axes.set_ylabel("time per all-reduce (s)")
    axes.set_title(f"All-reduce algorithms on {obs.devices} devices (dashed: textbook, dotted: corrected)")
    axes.legend(fontsize=7)
    axes.grid(alpha=0.3)
    return figure


def _summary(obs: Observations, model: Model, cross: Check) -> str:
    rings, largest, top = obs.rings, obs.rings[-1], obs.sweep[-1]
    text = (
        f"For N = {', '.join(str(r.n) for r in rings)} the hand-written ring gave psum's result "
        f"{'exactly' if all(r.identical for r in rings) else 'NOT exactly'} and compiled to "
        f"{', '.join(str(len(_permutes(r.collectives))) for r in rings)} collective-permutes, sending "
        f"{', '.join(format_bytes(_sent(r.collectives)) for r in rings)} per device for D = "
        f"{format_bytes(rings[0].size)}. At N = {largest.n} the ring took "
        f"{largest.ring.median / largest.psum.median:.2f}x psum's time. "
    )
    misses = [top.fastest(name) / textbook(name, top.size, obs.devices, model) for name in ALGORITHMS]
    text += (
        f"The textbook alpha-beta model (alpha = {model.alpha * 1e6:.0f} us, beta = {model.beta / 1e9:.2f} GB/s from "
        f"single permutes) is off by {min(misses):.1f}x to {max(misses):.1f}x at the held-out "
        f"{format_bytes(top.size)}: besides sending, every step here adds or copies its piece on the same two "
        f"cores. The ring overtakes recursive doubling at {_bytes(cross.observed)} measured, "
        f"{_bytes(cross.theory)} in the textbook."
    )
    return text


def _bytes(value) -> str:
    return format_bytes(value) if isinstance(value, int | float) else str(value)


def _notes(obs: Observations, model: Model) -> list[str]:
    small = {name: obs.sweep[0].fastest(name) for name in (*ALGORITHMS, PSUM)}
    large = {name: obs.sweep[-1].fastest(name) for name in (*ALGORITHMS, PSUM)}
    fastest_small, fastest_large = min(small, key=small.get), min(large, key=large.get)
    bidirectional = obs.sweep[-1].program("bidirectional-ring-all-reduce")
    return [
        f"At {format_bytes(obs.sweep[0].size)} the fastest was {fastest_small} ({small[fastest_small] * 1e6:.0f} us); "
        f"at {format_bytes(obs.sweep[-1].size)} it was {fastest_large} ({large[fastest_large] * 1e3:.2f} ms).",
        "The CPU compiler keeps every collective-permute synchronous and in program order, and runs each step's "
        "add (reduce-scatter) or copy (all-gather) on the same cores between the sends: the textbook's "
        "alpha-beta sum of sends leaves that work out (TRG's gamma term, which accelerators overlap with the "
        "transfers). The corrected prediction adds it with gamma from a local add; it still leaves out the "
        "all-gather's copies and the selects of halving-doubling.",
        f"The textbook's bidirectional ring sends every shard the short way in 2·floor(N/2) steps over two "
        f"links; lab.collectives runs two full rings of D/2 instead, "
        f"{sum(c.repeats or 1 for c in bidirectional.collectives)} permutes, and the emulated devices' two "
        "directions share one memory bus: the corrected prediction prices the permutes XLA wrote.",
        f"alpha, beta and gamma are fitted on the inner sizes ({', '.join(format_bytes(s) for s in model.fit_sizes)}) "
        "of calibration programs timed round-robin with the algorithms; the smallest and the largest size are "
        "predictions, never fitted. The call overhead and the per-step latency come from a chain of "
        f"{obs.chain_length} permutes timed in the same rounds as the smallest size's programs, so that a load "
        "that slows one slows the other.",
    ]


# a markdown table keeps each row on one line
THEORY = r"""
Alpha-beta model (Hockney): sending m bytes costs α + m/β. For an all-reduce of D bytes per device on N devices
(Thakur, Rabenseifner & Gropp 2005; Patarasuk & Yuan 2009):

| algorithm | steps | bytes sent per device | bytes added per device (γ term) | time |
|---|---|---|---|---|
| ring = reduce-scatter + all-gather | 2(N-1) | 2(N-1)/N · D | (N-1)/N · D | 2(N-1)·α + 2(N-1)/N · D/β |
| bidirectional ring (shards the short way) | 2·⌊N/2⌋ | 2(N-1)/N · D, half each way | (N-1)/N · D | 2⌊N/2⌋·α + (N-1)/N · D/β with full-duplex links |
| recursive halving-doubling (Rabenseifner) | 2·log2 N | 2(N-1)/N · D | (N-1)/N · D | 2·log2N·α + 2(N-1)/N · D/β |
| recursive doubling | log2 N | log2 N · D | log2 N · D | log2N·(α + D/β) |

Recursive doubling wins below the crossover S* = αβ·(2(N-1) − log2N)/(log2N − 2(N-1)/N) (8.8·αβ for N = 8)
and the ring wins above it. Halving-doubling sends exactly the ring's bytes in fewer steps, so in this model it is
never slower; what makes rings win on real clusters is link contention (distant partners share links on a ring or
torus), which the model leaves out. TRG's full model also charges γ per byte added into a partial sum; accelerators
overlap that with the transfers, so the textbook drops it. Here α and β are fitted on single collective-permutes at
the inner sizes of the sweep; the corrected prediction is one call's overhead + (permutes XLA wrote) × the latency
of one step + (their bytes)/β + (bytes added) × γ, with γ fitted on a local add.
"""  # noqa: E501
