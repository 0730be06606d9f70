"""The five collectives: semantics, compiled HLO, bandwidth.

Question #39 asks how all-reduce, all-gather and reduce-scatter differ. The
answer here is shown rather than told, on N devices of one mesh axis:

1. what each collective does to small arrays, device by device, before and after;
2. an nccl-tests-style sweep (size, count, dtype, op, time, algbw, busbw, #wrong)
   where #wrong compares every element of every device with a numpy reference;
3. the compiled HLO of each program: one collective of the expected kind, on the
   expected mesh axis, with the nccl-tests size S per device that theory uses;
4. busbw against size, one curve per collective.

busbw is algbw times the factor that makes it comparable to a link's bandwidth
(nccl-tests PERFORMANCE.md): 2(N-1)/N for all-reduce, (N-1)/N for all-gather,
reduce-scatter and all-to-all, 1 for a permute. On emulated CPU devices the
"link" is this machine's memory bus, so busbw is read against the measured
memory-copy bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np
from matplotlib.figure import Figure

from experiments import kit
from lab import bench, hlo, theory
from lab.bench import Timing, measure_collective
from lab.collectives import KINDS, build_program
from lab.mesh import MeshSpec
from lab.progress import track
from lab.provenance import Setup
from lab.report import Result, Table
from lab.targets import hardware
from lab.targets.devices import DEFAULT_TARGET, devices_for
from lab.units import format_bytes, size_sweep
from lab.verdict import Check, Claim, check

QUESTION = "#39"
AXES_MESH = "data=2,fsdp=2,tensor=2"


@dataclass(frozen=True)
class Config:
    target: str = DEFAULT_TARGET
    """where to run (cpu:N, gpu, tpu)"""
    begin: str = "1K"
    """smallest size S per device (nccl-tests -b)"""
    end: str = "64M"
    """largest size S per device (nccl-tests -e)"""
    factor: int = 4
    """each size is this times the previous (nccl-tests -f)"""
    ops: tuple[str, ...] = KINDS
    """which collectives to sweep"""
    dtype: str = "float32"
    repeats: int = 5
    """timed calls per size, after warm-up (the median is reported)"""
    tpu_topology: str = "v5e:2x4"
    """also compile each collective for this TPU topology (compile-only, needs libtpu); empty to skip"""


@dataclass(frozen=True)
class Semantics:
    """One collective on small integer arrays: each device's block before and after."""

    op: str
    before: tuple[tuple[float, ...], ...]
    after: tuple[tuple[float, ...], ...]


@dataclass(frozen=True)
class Point:
    """One row of the nccl-tests-style sweep."""

    size: int  # S per device
    count: int  # elements in S
    time: Timing
    wrong: int  # elements that differ from the numpy reference, over all devices


@dataclass(frozen=True)
class Swept:
    """One collective across the sweep, and what XLA compiled at the size nearest 1 MiB and at the largest."""

    op: str
    dtype: str
    group_size: int
    points: tuple[Point, ...]
    checked_size: int  # the size whose compiled program the checks read
    checked: tuple[kit.Seen, ...]
    largest: tuple[kit.Seen, ...]


@dataclass(frozen=True)
class OnAxis:
    """One collective asked for over one axis of the 2x2x2 mesh, as compiled."""

    axis: str
    collectives: tuple[kit.Seen, ...]


@dataclass(frozen=True)
class OnAxes:
    op: str
    axes: tuple[OnAxis, ...]


@dataclass(frozen=True)
class OnTpu:
    op: str
    collectives: tuple[kit.Seen, ...]


@dataclass(frozen=True)
class Observations:
    setup: Setup
    devices: int
    semantics: tuple[Semantics, ...]
    sweep: tuple[Swept, ...]
    on_axes: tuple[OnAxes, ...]  # empty unless there are 8 devices
    tpu: tuple[OnTpu, ...]
    tpu_chips: int
    tpu_unavailable: kit.Unavailable | None
    parse_seconds: float  # lab.hlo.parse_collectives on a 100,000-line module
    copy_bandwidth: float | None  # bytes/s of one memory copy on this host (CPU targets only)


# --------------------------------------------------------------------------- measure


def measure(config: Config) -> Observations:
    devices = devices_for(config.target)
    mesh = MeshSpec(fsdp=len(devices)).build(devices)
    n = len(devices)
    sizes = size_sweep(config.begin, config.end, config.factor)
    measured = {
        point: measure_collective(point[0], mesh, "fsdp", point[1], dtype=config.dtype, repeats=config.repeats)
        for point in track([(op, s) for op in config.ops for s in sizes], "collectives sweep")
    }
    sweep = tuple(_swept(op, [measured[op, s] for s in sizes], config.dtype) for op in config.ops)
    tpu = kit.tpu_chips(config.tpu_topology)
    return Observations(
        setup=Setup.of(config.target, devices, f"fsdp={n}"),
        devices=n,
        semantics=_semantics(mesh),
        sweep=sweep,
        on_axes=_on_axes(devices),
        tpu=_on_tpu(tpu) if isinstance(tpu, kit.TpuChips) else (),
        tpu_chips=len(tpu) if isinstance(tpu, kit.TpuChips) else 0,
        tpu_unavailable=tpu if isinstance(tpu, kit.Unavailable) else None,
        parse_seconds=bench.parse_benchmark(100_000),
        copy_bandwidth=hardware.profile("cpu").hbm_bandwidth if devices[0].platform == "cpu" else None,
    )


def _swept(op: str, points, dtype: str) -> Swept:
    checked = min(points, key=lambda p: abs(p.size - 2**20))
    return Swept(
        op,
        dtype,
        points[0].group_size,
        tuple(Point(p.size, p.count, p.timing, p.wrong) for p in points),
        checked.size,
        kit.seen(checked.collectives),
        kit.seen(points[-1].collectives),
    )


def _semantics(mesh) -> tuple[Semantics, ...]:
    """Before and after on each device, small integer arrays (N = all devices)."""
    n, found = mesh.devices.size, []
    for op in KINDS:
        program = build_program(op, mesh, "fsdp")
        x = program.example_input(4 * n)  # n float32 per device (gathers: n after)
        y = np.asarray(program.fn(program.place(x)))
        rows = lambda a: tuple(tuple(float(e) for e in np.ravel(a[i])) for i in range(n))  # noqa: E731
        found.append(Semantics(op, rows(x), rows(y)))
    return tuple(found)


def _on_axes(devices) -> tuple[OnAxes, ...]:
    """Each primitive over each axis of a 2x2x2 mesh, as XLA compiled it."""
    if len(devices) != 8:
        return ()
    mesh = MeshSpec.parse(AXES_MESH).build(devices)
    found = []
    for op in KINDS:
        axes = []
        for axis in ("data", "fsdp", "tensor"):
            program = build_program(op, mesh, axis)
            inspection = hlo.inspect(program.fn, program.abstract_input(1024), mesh=mesh)
            axes.append(OnAxis(axis, kit.seen(inspection.collectives)))
        found.append(OnAxes(op, tuple(axes)))
    return tuple(found)


def _on_tpu(tpu: kit.TpuChips) -> tuple[OnTpu, ...]:
    """The same programs compiled by the TPU compiler at 1 MiB (no TPU needed)."""
    mesh = tpu.mesh("fsdp")
    found = []
    for op in KINDS:
        program = build_program(op, mesh, "fsdp")
        found.append(OnTpu(op, kit.seen(hlo.inspect(program.fn, program.abstract_input(2**20), mesh=mesh).collectives)))
    return tuple(found)


# --------------------------------------------------------------------------- judge


def judge(obs: Observations, config: Config) -> Result:
    checks = _hlo_checks(obs) + _axis_checks(obs) + _tpu_checks(obs, config.tpu_topology)
    all_reduce = next((w for w in obs.sweep if w.op == "all-reduce"), None)
    largest_ar = (all_reduce, all_reduce.points[-1]) if all_reduce else None
    return Result(
        summary=_summary(obs, checks, largest_ar),
        theory=THEORY,
        tables=[
            *_semantics_tables(obs),
            _sweep_table(obs),
            _hlo_table(obs),
            *_axis_tables(obs),
            *_tpu_tables(obs, config.tpu_topology),
            _performance_table(obs, largest_ar),
        ],
        checks=checks,
        claims=_claims(obs),
        plots={"busbw": partial(_busbw_plot, obs)},
        notes=_notes(obs, largest_ar),
    )


def _kinds(collectives) -> str:
    kinds = [c.kind for c in collectives]
    return ", ".join(f"{kinds.count(k)} {k}" for k in dict.fromkeys(kinds)) or "none"


def _axes(c: kit.Seen) -> str:
    return ",".join(c.axes or ("?",))


def _algbw(p: Point) -> float:
    return theory.algorithm_bandwidth(p.size, p.time.median)


def _busbw(w: Swept, p: Point) -> float:
    return theory.bus_bandwidth(w.op, p.size, p.time.median, w.group_size)


def _hlo_checks(obs: Observations) -> list[Check]:
    """One compiled program per collective (at 1 MiB or the nearest size): kind, axis, S, N; and #wrong."""
    checks = []
    for w in obs.sweep:
        op, label = w.op, format_bytes(w.checked_size)
        checks.append(check(f"{op}: collectives in the HLO", f"1 {op}", _kinds(w.checked), kind="exact"))
        found = w.checked[0] if w.checked else None  # the same checks whatever XLA wrote
        checks += [
            check(f"{op}: mesh axes of its replica groups", "fsdp", _axes(found) if found else "none", kind="exact"),
            check(
                f"{op}: S per device at {label} (bytes)",
                w.checked_size,
                found.size_bytes if found else "none",
                kind="exact",
            ),
            check(f"{op}: group size N", obs.devices, found.group_size if found else "none", kind="exact"),
        ]
    checks.append(
        check(
            "elements wrong across the whole sweep (#wrong)",
            0,
            sum(p.wrong for w in obs.sweep for p in w.points),
            kind="exact",
        )
    )
    return checks


def _spans(found: OnAxis) -> str:
    return _axes(found.collectives[0]) if len(found.collectives) == 1 else f"{len(found.collectives)} collectives"


def _axis_checks(obs: Observations) -> list[Check]:
    """Each primitive over each axis of a 2x2x2 mesh: the replica groups map back to that axis."""
    return [
        check(f"{o.op} over {a.axis}: axes found from replica groups", a.axis, _spans(a), kind="exact")
        for o in obs.on_axes
        for a in o.axes
    ]


def _tpu_checks(obs: Observations, topology: str) -> list[Check]:
    return [
        check(f"tpu:{topology} {t.op}: collectives in the HLO", f"1 {t.op}", _kinds(t.collectives), kind="exact")
        for t in obs.tpu
    ]


def _claims(obs: Observations) -> list[Claim]:
    said = {
        "all-reduce": "all-reduce: every device ends with the full reduction (the sum) of every device's tensor",
        "all-gather": "all-gather: every device ends with every device's shard, concatenated",
        "reduce-scatter": "reduce-scatter: each device ends with one 1/N slice of the reduction",
    }
    claims = []
    for op, claim in said.items():
        swept = next((w for w in obs.sweep if w.op == op), None)
        if swept is None:
            continue
        points = swept.points
        wrong = sum(p.wrong for p in points)
        example = next(s for s in obs.semantics if s.op == op)
        claims.append(
            Claim(
                claim,
                "confirmed" if wrong == 0 else "refuted",
                f"{wrong} elements wrong against numpy over {len(points)} sizes "
                f"({format_bytes(points[0].size)}..{format_bytes(points[-1].size)}) on {obs.devices} devices; "
                f"device 0 before {_vector(example.before[0])}, after {_vector(example.after[0])}",
            )
        )
    return claims


# --------------------------------------------------------------------------- the page


def _semantics_tables(obs: Observations) -> list[Table]:
    return [
        Table(
            f"{s.op} on {obs.devices} devices",
            ["device", "before", "after"],
            [[f"device {i}", _vector(b), _vector(a)] for i, (b, a) in enumerate(zip(s.before, s.after))],
        )
        for s in obs.semantics
    ]


def _vector(v) -> str:
    return "[" + " ".join(f"{int(e)}" for e in v) + "]"


def _sweep_table(obs: Observations) -> Table:
    rows = [
        [
            format_bytes(p.size),
            p.count,
            w.dtype,
            w.op,
            f"{p.time.median * 1e6:.1f} [{p.time.min * 1e6:.1f}, {p.time.max * 1e6:.1f}]",
            f"{_algbw(p) / 1e9:.2f}",
            f"{_busbw(w, p) / 1e9:.2f}",
            p.wrong,
        ]
        for w in obs.sweep
        for p in w.points
    ]
    return Table(
        "nccl-tests-style sweep",
        ["size S", "count", "type", "op", "time us (median [min, max])", "algbw GB/s", "busbw GB/s", "#wrong"],
        rows,
        note="Medians over timed calls after warm-up; every element of every device checked against numpy.",
    )


def _hlo_table(obs: Observations) -> Table:
    rows = [
        [w.op, c.kind, c.form, _axes(c), c.group_size, format_bytes(c.size_bytes), format_bytes(_sent(c, obs.devices))]
        for w in obs.sweep
        for c in w.largest
    ]
    return Table(
        "What XLA compiled (largest size)",
        ["program", "HLO collective", "as written", "axes", "N", "S per device", "sent per device (ring theory)"],
        rows,
    )


def _sent(c: kit.Seen, n: int) -> float:
    return c.size_bytes * theory.bus_bandwidth_factor(c.kind, c.group_size or n)


def _axis_tables(obs: Observations) -> list[Table]:
    if not obs.on_axes:
        return []
    rows = [
        [o.op, a.axis, _spans(a), a.collectives[0].group_size if a.collectives else "-"]
        for o in obs.on_axes
        for a in o.axes
    ]
    return [
        Table(
            f"Each collective on each axis of a {AXES_MESH} mesh",
            ["collective", "asked for axis", "XLA's replica groups span", "group size"],
            rows,
        )
    ]


def _tpu_tables(obs: Observations, topology: str) -> list[Table]:
    if obs.tpu_unavailable:
        return [obs.tpu_unavailable.table()]
    if not obs.tpu:
        return []
    rows = [
        [
            t.op,
            "; ".join(
                f"{c.kind} as `{c.form}`{' (async)' if c.is_async else ''} over {_axes(c)}, "
                f"S {format_bytes(c.size_bytes)}"
                for c in t.collectives
            )
            or "no collective",
        ]
        for t in obs.tpu
    ]
    return [
        Table(
            f"The same programs compiled for tpu:{topology} (compile-only, 1 MiB)",
            ["program", "what the TPU compiler wrote"],
            rows,
        )
    ]


def _busbw_plot(obs: Observations):
    figure = Figure(figsize=(7, 4.2))
    axes = figure.subplots()
    for w in obs.sweep:
        axes.plot([p.size for p in w.points], [_busbw(w, p) / 1e9 for p in w.points], marker="o", label=w.op)
    if obs.copy_bandwidth:
        axes.axhline(obs.copy_bandwidth / 1e9, color="gray", linestyle="--", label="memory-copy bandwidth (measured)")
    axes.set_xscale("log", base=2)
    axes.set_xlabel("size S per device (bytes)")
    axes.set_ylabel("busbw (GB/s)")
    emulated = " emulated" if obs.copy_bandwidth else ""
    axes.set_title(f"busbw against size, {obs.devices}{emulated} devices")
    axes.legend(fontsize=8)
    axes.grid(alpha=0.3)
    return figure


def _performance_table(obs: Observations, largest_ar: tuple[Swept, Point] | None) -> Table:
    rows = [["parse a 100,000-line HLO text (lab.hlo.parse_collectives)", f"{obs.parse_seconds:.2f} s", "under 1 s"]]
    if largest_ar and obs.copy_bandwidth:
        rows.append(
            [
                f"busbw of the {format_bytes(largest_ar[1].size)} all-reduce / measured memory-copy bandwidth",
                f"{_busbw(*largest_ar) / obs.copy_bandwidth:.0%}",
                "reported",
            ]
        )
    return Table("Performance", ["what", "measured", "goal"], rows)


def _summary(obs: Observations, checks: list[Check], largest_ar: tuple[Swept, Point] | None) -> str:
    n = obs.devices
    here = [c for c in checks if not c.quantity.startswith("tpu:")]
    text = (
        f"On {n} devices, all-reduce leaves the sum on every device, all-gather leaves every block on every device, "
        f"and reduce-scatter leaves one 1/{n} piece of the sum on each (tables below, device by device). "
    )
    text += (
        "Each compiled to exactly the collective its name says, on the mesh axis it was asked for."
        if all(c.verdict == "agrees" for c in here)
        else f"{sum(c.verdict != 'agrees' for c in here)} of the {len(here)} HLO and numerics checks on this target "
        "do not agree (see Checks)."
    )
    if largest_ar:
        text += (
            f" The {format_bytes(largest_ar[1].size)} all-reduce reached a busbw of "
            f"{_busbw(*largest_ar) / 1e9:.2f} GB/s"
        )
        text += (
            f", {_busbw(*largest_ar) / obs.copy_bandwidth:.0%} of this machine's measured memory-copy bandwidth."
            if obs.copy_bandwidth
            else "."
        )
    rewritten = [t.op for t in obs.tpu if [c.kind for c in t.collectives] != [t.op]]
    if rewritten:
        text += f" The TPU compiler wrote something else for: {', '.join(rewritten)} (see the TPU table)."
    return text


def _notes(obs: Observations, largest_ar: tuple[Swept, Point] | None) -> list[str]:
    notes = []
    forms = {c.kind: c.form for w in obs.sweep for c in w.largest}
    for kind, form in forms.items():
        if form != kind:
            notes.append(f"XLA wrote the {kind} as `{form}`.")
    for t in obs.tpu:
        kinds = [c.kind for c in t.collectives]
        if kinds != [t.op]:
            notes.append(
                f"The TPU compiler compiled the standalone {t.op} to {_kinds(t.collectives)} "
                f"({'; '.join(f'`{c.form}`, S {format_bytes(c.size_bytes)}' for c in t.collectives)}): "
                "no formula here predicts that rewrite, so the check says differs"
                + (
                    "; the allreduce_equivalence page prices what it costs (an all-reduce, then a slice)."
                    if t.op == "reduce-scatter" and kinds == ["all-reduce"]
                    else "."
                )
            )
    if obs.sweep:
        op, fastest = min(((w.op, w.points[0]) for w in obs.sweep), key=lambda pair: pair[1].time.median)
        notes.append(
            f"At {format_bytes(fastest.size)} every collective is latency-bound: the fastest, {op}, still took "
            f"{fastest.time.median * 1e6:.0f} us, so busbw there measures per-call overhead, not bandwidth."
        )
    if largest_ar and obs.copy_bandwidth:
        notes.append(
            "Emulated devices share one memory bus and two cores: busbw here is bounded by memory copies, not by any "
            "network; the ratios between collectives, not the absolute numbers, carry over to real hardware."
        )
    return notes


THEORY = r"""
For N devices and a per-device size S (nccl-tests conventions: all-reduce the buffer, all-gather the
gathered output, reduce-scatter the full input), a bandwidth-optimal ring sends per device

| collective | result on each device | bytes sent per device | busbw factor |
|---|---|---|---|
| all-reduce | the sum of all N buffers | 2(N-1)/N · S | 2(N-1)/N |
| all-gather | the N blocks concatenated | (N-1)/N · S | (N-1)/N |
| reduce-scatter | its 1/N piece of the sum | (N-1)/N · S | (N-1)/N |
| all-to-all | piece i of every device | (N-1)/N · S | (N-1)/N |
| collective-permute | its neighbour's buffer | S | 1 |

algbw = S / t and busbw = algbw · factor (NVIDIA nccl-tests, `doc/PERFORMANCE.md`): busbw is what a
ring algorithm asks of each link, so it can be compared across N and with the hardware's link bandwidth.
Note the quick-reference's claim that all-reduce traffic "does not depend on N" holds only per device
and only in the limit: 2(N-1)/N · S is S at N = 2 and approaches 2S as N grows (the ring_allreduce page
counts it in the HLO for N = 2, 4, 8).
"""
