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

import numpy as np
from matplotlib.figure import Figure

from experiments import kit
from lab import bench, hardware, hlo, theory
from lab.bench import measure_collective
from lab.collectives import KINDS, build_program
from lab.devices import DEFAULT_TARGET, devices_for
from lab.mesh import MeshSpec
from lab.progress import track
from lab.report import Result, Table, provenance
from lab.units import format_bytes, size_sweep
from lab.verdict import check

QUESTION = "#39"


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


def run(config: Config) -> Result:
    devices = devices_for(config.target)
    mesh = MeshSpec(fsdp=len(devices)).build(devices)
    n = len(devices)
    sweep = [
        _measure(op, mesh, size, config)
        for op, size in track(
            [(op, s) for op in config.ops for s in size_sweep(config.begin, config.end, config.factor)],
            "collectives sweep",
        )
    ]
    checks, axis_rows = _axis_checks(devices)
    checks = _hlo_checks(sweep, n) + checks
    copy_bw = hardware.profile("cpu").hbm_bandwidth if devices[0].platform == "cpu" else None
    largest_ar = max((r for r in sweep if r["op"] == "all-reduce"), key=lambda r: r["size"], default=None)
    tpu_table, tpu_checks = _on_tpu(config.tpu_topology)
    checks += tpu_checks
    summary = _summary(sweep, n, largest_ar, copy_bw)
    parse_s = bench.parse_benchmark(100_000)
    return Result(
        summary=summary,
        theory=THEORY,
        tables=[
            *_semantics_tables(mesh),
            _sweep_table(sweep),
            _hlo_table(sweep, n),
            Table(
                "Each collective on each axis of a data=2,fsdp=2,tensor=2 mesh",
                ["collective", "asked for axis", "XLA's replica groups span", "group size"],
                axis_rows,
            ),
            *([tpu_table] if tpu_table else []),
            _performance_table(sweep, largest_ar, copy_bw, parse_s),
        ],
        checks=checks,
        plots={"busbw": _busbw_plot(sweep, n, copy_bw)},
        notes=_notes(sweep, largest_ar, copy_bw),
        provenance=provenance(target=config.target, devices=devices, mesh=f"fsdp={n}"),
        data={"sweep": sweep, "memory_copy_bandwidth": copy_bw},
    )


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
and only in the limit: 2(N-1)/N · S is S at N = 2 and approaches 2S as N grows.
"""


def _measure(op: str, mesh, size: int, config: Config) -> dict:
    point = measure_collective(op, mesh, "fsdp", size, dtype=config.dtype, repeats=config.repeats)
    return {
        "op": op,
        "size": size,
        "count": point.count,
        "dtype": config.dtype,
        "time_s": point.timing.median,
        "time_min_s": point.timing.min,
        "time_max_s": point.timing.max,
        "algbw": point.algbw,
        "busbw": point.busbw,
        "wrong": point.wrong,
        "hlo": [(c.kind, c.axes, c.size_bytes, c.group_size, c.form) for c in point.collectives],
    }


def _hlo_checks(sweep: list[dict], n: int) -> list:
    """One compiled program per collective (at 1 MiB or the nearest size): kind, axis, S, N."""
    checks = []
    for op in dict.fromkeys(r["op"] for r in sweep):
        row = min((r for r in sweep if r["op"] == op), key=lambda r: abs(r["size"] - 2**20))
        kinds = [h[0] for h in row["hlo"]]
        checks.append(
            check(
                f"{op}: collectives in the HLO",
                f"1 {op}",
                ", ".join(f"{kinds.count(k)} {k}" for k in dict.fromkeys(kinds)) or "none",
            )
        )
        if kinds == [op]:
            _, axes, size, group, _ = row["hlo"][0]
            checks.append(check(f"{op}: mesh axes of its replica groups", "fsdp", ",".join(axes or ("?",))))
            checks.append(check(f"{op}: S per device at {format_bytes(row['size'])} (bytes)", row["size"], size))
            checks.append(check(f"{op}: group size N", n, group))
    checks.append(check("elements wrong across the whole sweep (#wrong)", 0, sum(r["wrong"] for r in sweep)))
    return checks


def _axis_checks(devices) -> tuple[list, list]:
    """Each primitive over each axis of a 2x2x2 mesh: the replica groups map back to that axis."""
    if len(devices) != 8:
        return [], []
    mesh = MeshSpec(data=2, fsdp=2, tensor=2).build(devices)
    checks, rows = [], []
    for op in KINDS:
        for axis in ("data", "fsdp", "tensor"):
            program = build_program(op, mesh, axis)
            found = hlo.inspect(program.fn, program.abstract_input(1024), mesh=mesh).collectives
            spans = ",".join(found[0].axes or ("?",)) if len(found) == 1 else f"{len(found)} collectives"
            rows.append([op, axis, spans, found[0].group_size if found else "-"])
            checks.append(check(f"{op} over {axis}: axes found from replica groups", axis, spans))
    return checks, rows


def _on_tpu(topology: str) -> tuple[Table | None, list]:
    """The same programs compiled by the TPU compiler (no TPU needed): what it wrote instead."""
    tpu = kit.tpu_chips(topology)
    if not isinstance(tpu, kit.TpuChips):
        return (tpu.table() if tpu else None), []
    mesh = tpu.mesh("fsdp")
    rows, checks = [], []
    for op in KINDS:
        program = build_program(op, mesh, "fsdp")
        found = hlo.inspect(program.fn, program.abstract_input(2**20), mesh=mesh).collectives
        written = "; ".join(
            f"{c.kind} as `{c.form}`{' (async)' if c.is_async else ''} over "
            f"{','.join(c.axes or ('?',))}, S {format_bytes(c.size_bytes)}"
            for c in found
        )
        rows.append([op, written or "no collective"])
        kinds = [c.kind for c in found]
        explained = None
        if kinds != [op] and op == "reduce-scatter" and kinds == ["all-reduce"]:
            sent = theory.bus_bandwidth_factor("all-reduce", len(tpu)) / theory.bus_bandwidth_factor(
                "reduce-scatter", len(tpu)
            )
            explained = (
                "the TPU compiler ran the standalone psum_scatter as a full all-reduce and kept its own slice "
                f"(dynamic-slice): {sent:.0f}x the ring bytes of a reduce-scatter (see allreduce_equivalence)"
            )
        checks.append(
            check(
                f"tpu:{topology} {op}: collectives in the HLO",
                f"1 {op}",
                ", ".join(f"{kinds.count(k)} {k}" for k in dict.fromkeys(kinds)) or "none",
                explained=explained,
            )
        )
    return Table(
        f"The same programs compiled for tpu:{topology} (compile-only, 1 MiB)",
        ["program", "what the TPU compiler wrote"],
        rows,
    ), checks


def _semantics_tables(mesh) -> list[Table]:
    """Before and after on each device, small integer arrays (N = all devices)."""
    n = mesh.devices.size
    tables = []
    for op in KINDS:
        program = build_program(op, mesh, "fsdp")
        x = program.example_input(4 * n)  # n float32 per device (gathers: n after)
        y = np.asarray(program.fn(program.place(x)))
        rows = [[f"device {i}", _vector(x[i]), _vector(y[i])] for i in range(n)]
        tables.append(Table(f"{op} on {n} devices", ["device", "before", "after"], rows))
    return tables


def _vector(v) -> str:
    return "[" + " ".join(f"{int(e)}" for e in np.ravel(v)) + "]"


def _sweep_table(sweep: list[dict]) -> Table:
    rows = [
        [
            format_bytes(r["size"]),
            r["count"],
            r["dtype"],
            r["op"],
            f"{r['time_s'] * 1e6:.1f} [{r['time_min_s'] * 1e6:.1f}, {r['time_max_s'] * 1e6:.1f}]",
            f"{r['algbw'] / 1e9:.2f}",
            f"{r['busbw'] / 1e9:.2f}",
            r["wrong"],
        ]
        for r in sweep
    ]
    return Table(
        "nccl-tests-style sweep",
        ["size S", "count", "type", "op", "time us (median [min, max])", "algbw GB/s", "busbw GB/s", "#wrong"],
        rows,
        note="Medians over timed calls after warm-up; every element of every device checked against numpy.",
    )


def _hlo_table(sweep: list[dict], n: int) -> Table:
    rows = []
    for r in sweep:
        if r["size"] != max(s["size"] for s in sweep if s["op"] == r["op"]):
            continue
        for kind, axes, size, group, form in r["hlo"]:
            sent = size * theory.bus_bandwidth_factor(kind, group or n)
            rows.append([r["op"], kind, form, ",".join(axes or ("?",)), group, format_bytes(size), format_bytes(sent)])
    return Table(
        "What XLA compiled (largest size)",
        ["program", "HLO collective", "as written", "axes", "N", "S per device", "sent per device (ring theory)"],
        rows,
    )


def _busbw_plot(sweep: list[dict], n: int, copy_bw: float | None):
    figure = Figure(figsize=(7, 4.2))
    axes = figure.subplots()
    for op in dict.fromkeys(r["op"] for r in sweep):
        rows = [r for r in sweep if r["op"] == op]
        axes.plot([r["size"] for r in rows], [r["busbw"] / 1e9 for r in rows], marker="o", label=op)
    if copy_bw:
        axes.axhline(copy_bw / 1e9, color="gray", linestyle="--", label="memory-copy bandwidth (measured)")
    axes.set_xscale("log", base=2)
    axes.set_xlabel("size S per device (bytes)")
    axes.set_ylabel("busbw (GB/s)")
    axes.set_title(f"busbw against size, {n} emulated devices" if copy_bw else f"busbw against size, {n} devices")
    axes.legend(fontsize=8)
    axes.grid(alpha=0.3)
    return figure


def _performance_table(sweep, largest_ar, copy_bw, parse_s: float) -> Table:
    rows = [["parse a 100,000-line HLO text (lab.hlo.parse_collectives)", f"{parse_s:.2f} s", "under 1 s"]]
    if largest_ar and copy_bw:
        rows.append(
            [
                f"busbw of the {format_bytes(largest_ar['size'])} all-reduce / measured memory-copy bandwidth",
                f"{largest_ar['busbw'] / copy_bw:.0%}",
                "reported",
            ]
        )
    return Table("Performance", ["what", "measured", "goal"], rows)


def _summary(sweep, n, largest_ar, copy_bw) -> str:
    text = (
        f"On {n} devices, all-reduce leaves the sum on every device, all-gather leaves every block on every device, "
        f"and reduce-scatter leaves one 1/{n} piece of the sum on each (tables below, device by device). "
        f"Each compiled to exactly the collective its name says, on the mesh axis it was asked for."
    )
    if largest_ar:
        busbw = largest_ar["busbw"] / 1e9
        text += f" The {format_bytes(largest_ar['size'])} all-reduce reached a busbw of {busbw:.2f} GB/s"
        text += (
            f", {largest_ar['busbw'] / copy_bw:.0%} of this machine's measured memory-copy bandwidth."
            if copy_bw
            else "."
        )
    return text


def _notes(sweep, largest_ar, copy_bw) -> list[str]:
    notes = []
    forms = {h[0]: h[4] for r in sweep for h in r["hlo"]}
    for kind, form in forms.items():
        if form != kind:
            notes.append(f"XLA wrote the {kind} as `{form}`.")
    small = [r for r in sweep if r["size"] == min(s["size"] for s in sweep)]
    if small:
        fastest = min(small, key=lambda r: r["time_s"])
        notes.append(
            f"At {format_bytes(fastest['size'])} every collective is latency-bound: "
            f"the fastest, {fastest['op']}, still took {fastest['time_s'] * 1e6:.0f} "
            "us, so busbw there measures per-call overhead, not bandwidth."
        )
    if largest_ar and copy_bw:
        notes.append(
            "Emulated devices share one memory bus and two cores: busbw here "
            "is bounded by memory copies, not by any network; the ratios "
            "between collectives, not the absolute numbers, carry over to "
            "real hardware."
        )
    return notes
