"""all-reduce = all-gather(reduce-scatter(x)): in numerics, in HLO, in bytes.

Question #40 asks why reduce-scatter and all-gather so often come as a pair.
Because together they *are* an all-reduce: reduce-scatter leaves each device
one 1/N piece of the sum, all-gather hands every piece to everyone. The
experiment writes both programs with ``shard_map`` and checks:

1. numerics: the two results are identical on every device;
2. HLO: one all-reduce against one reduce-scatter plus one all-gather, on the
   same axis; and what the TPU compiler (compile-only) makes of each;
3. bytes: (N-1)/N·D + (N-1)/N·D = 2(N-1)/N·D, the ring all-reduce's traffic;
4. time on this target, both ways.

The split is what sharded training wants: between the two halves each device
holds only its piece of the gradient sum, exactly what it needs to update its
shard of the parameters (ZeRO-2/3, FSDP).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from experiments import kit
from lab import hlo, theory
from lab.bench import Timing, time_interleaved
from lab.collectives import all_gather, all_reduce, reduce_scatter
from lab.devices import DEFAULT_TARGET, devices_for
from lab.errors import LabError
from lab.mesh import MeshSpec
from lab.progress import track
from lab.report import Result, Table, provenance
from lab.units import format_bytes, parse_size
from lab.verdict import Check, check

QUESTION = "#40"


@dataclass(frozen=True)
class Config:
    target: str = DEFAULT_TARGET
    """where to run (cpu:N, gpu, tpu)"""
    sizes: tuple[str, ...] = ("64K", "4M")
    """D per device"""
    repeats: int = 7
    tpu_topology: str = "v5e:2x4"
    """also compile both programs for this TPU topology (compile-only); empty to skip"""


@dataclass(frozen=True)
class Comparison:
    """The fused and the split all-reduce at one size D: results, HLO, ring bytes and times."""

    size: int  # D per device
    n: int
    same: bool  # identical results on every device
    kinds: dict[str, str]  # program -> the collectives it compiled to
    sent: dict[str, float]  # program -> ring bytes sent per device, from the HLO
    time: dict[str, Timing]
    checks: tuple[Check, ...]


def run(config: Config) -> Result:
    devices = devices_for(config.target)
    n = len(devices)
    mesh = MeshSpec(fsdp=n).build(devices)
    rows = [
        _compare(mesh, parse_size(s), config.repeats)
        for s in track(config.sizes, "all-reduce vs reduce-scatter + all-gather")
    ]
    tpu_tables, tpu_checks, tpu_notes = _on_tpu(config.tpu_topology, parse_size(config.sizes[-1]))
    return Result(
        summary=_summary(rows, n),
        theory=THEORY,
        tables=[_table(rows), *tpu_tables],
        checks=[c for r in rows for c in r.checks] + tpu_checks,
        notes=[CPU_NOTE, *tpu_notes],
        provenance=provenance(target=config.target, devices=devices, mesh=f"fsdp={n}"),
        data={"rows": [kit.numbers(r) for r in rows]},
    )


THEORY = r"""
With N devices each holding D bytes (Thakur, Rabenseifner & Gropp 2005; nccl-tests conventions):

- reduce-scatter: each device ends with its 1/N piece of the sum, sending (N-1)/N · D;
- all-gather of those pieces: every device ends with all N pieces, sending (N-1)/N · D;
- together: the sum on every device, 2(N-1)/N · D — exactly what a ring all-reduce sends, because a ring
  all-reduce *is* a reduce-scatter pass followed by an all-gather pass.

So all-reduce(x) = all-gather(reduce-scatter(x)) holds in values and in bytes. What the split buys is the state in
between: each device holds only the piece of the sum that it owns.
"""


def _programs(mesh):
    """The fused and the split all-reduce, as jitted shard_map programs over `fsdp` (stack layout)."""
    spec = P("fsdp")

    @partial(jax.shard_map, mesh=mesh, in_specs=spec, out_specs=spec)
    def fused(block_1D):
        return all_reduce(block_1D[0], "fsdp")[None]

    @partial(jax.shard_map, mesh=mesh, in_specs=spec, out_specs=spec)
    def split(block_1D):
        piece = reduce_scatter(block_1D[0], "fsdp")  # (D/N,): this device's piece of the sum
        return all_gather(piece, "fsdp")[None]

    return jax.jit(fused), jax.jit(split)


def _compare(mesh, size: int, repeats: int) -> Comparison:
    n = mesh.devices.size
    if size % (4 * n):
        raise LabError(f"size {size} bytes: D must be a multiple of {4 * n} bytes (float32, split into {n} pieces)")
    fused, split = _programs(mesh)
    abstract = jax.ShapeDtypeStruct((n, size // 4), np.float32, sharding=NamedSharding(mesh, P("fsdp")))
    x = (np.arange(n * size // 4) % 1024).reshape(n, -1).astype(np.float32)
    placed = jax.device_put(x, abstract.sharding)
    seen, compiled = {}, {}
    for name, program in (("all-reduce", fused), ("reduce-scatter + all-gather", split)):
        compiled[name], inspection = kit.compile_and_inspect(program, abstract, mesh=mesh)
        seen[name] = inspection.collectives
    same = bool(
        np.array_equal(
            np.asarray(compiled["all-reduce"](placed)), np.asarray(compiled["reduce-scatter + all-gather"](placed))
        )
    )
    sent = {
        name: sum(c.size_bytes * theory.bus_bandwidth_factor(c.kind, c.group_size) for c in found)
        for name, found in seen.items()
    }
    timing = time_interleaved({name: (c, (placed,)) for name, c in compiled.items()}, repeats=repeats)
    ring = theory.collective_cost("all-reduce", size, n, algorithm="ring", alpha=0, beta=1).bytes_sent
    label = f"D={format_bytes(size)}"
    checks = (
        check(f"{label}: results identical on every device", True, same),
        check(f"{label}: all-reduce program compiles to", "all-reduce", _kinds(seen["all-reduce"])),
        check(
            f"{label}: split program compiles to",
            "reduce-scatter, all-gather",
            _kinds(seen["reduce-scatter + all-gather"]),
        ),
        check(
            f"{label}: both run on the fsdp axis",
            "fsdp",
            ",".join(sorted({",".join(c.axes or ("?",)) for f in seen.values() for c in f})),
        ),
        check(f"{label}: ring bytes per device, all-reduce = 2(N-1)/N·D", ring, sent["all-reduce"], rtol=1e-9),
        check(
            f"{label}: ring bytes per device, reduce-scatter + all-gather",
            ring,
            sent["reduce-scatter + all-gather"],
            rtol=1e-9,
        ),
    )
    return Comparison(size, n, same, {k: _kinds(v) for k, v in seen.items()}, sent, timing, checks)


def _kinds(found) -> str:
    return ", ".join(c.kind for c in found) or "none"


def _on_tpu(topology: str, size: int) -> tuple[list[Table], list, list[str]]:
    """What the TPU compiler writes for the two programs (no TPU needed): its table, checks and notes."""
    tpu = kit.tpu_chips(topology)
    if not isinstance(tpu, kit.TpuChips):
        return [tpu.table()] if tpu else [], [], []
    mesh, n = tpu.mesh("fsdp"), len(tpu)
    abstract = jax.ShapeDtypeStruct((n, size // 4), np.float32, sharding=NamedSharding(mesh, P("fsdp")))
    rows, checks = [], []
    ring = theory.collective_cost("all-reduce", size, n, algorithm="ring", alpha=0, beta=1).bytes_sent
    for name, program in zip(("all-reduce", "reduce-scatter + all-gather"), _programs(mesh)):
        found = hlo.inspect(program, abstract, mesh=mesh).collectives
        sent = sum(c.size_bytes * theory.bus_bandwidth_factor(c.kind, c.group_size) for c in found)
        rows.append([name, "; ".join(f"{c.kind} (`{c.form}`)" for c in found), format_bytes(sent)])
        explained = None
        if name != "all-reduce" and [c.kind for c in found] == ["all-reduce", "all-gather"]:
            explained = (
                "the TPU compiler turned the standalone reduce-scatter into "
                "an all-reduce whose result each chip slices (dynamic-slice), "
                "then all-gathers: "
                f"{format_bytes(sent)} instead of {format_bytes(ring)} in ring terms"
            )
        checks.append(
            check(f"tpu:{topology} {name}: ring bytes per device", ring, sent, rtol=1e-9, explained=explained)
        )
    table = Table(
        f"Compiled for tpu:{topology} (compile-only)",
        ["program", "collectives the TPU compiler wrote", "ring bytes sent per device"],
        rows,
    )
    notes = []
    if "all-reduce" in rows[-1][1]:
        notes.append(
            "On TPU the reduce-scatter of a program that does nothing with "
            "its piece became an all-reduce plus a slice, so the split costs "
            "more bytes than the fused all-reduce there: the compiler's choice, "
            "visible only in the HLO."
        )
    return [table], checks, notes


def _table(rows) -> Table:
    body = []
    for r in rows:
        for name in ("all-reduce", "reduce-scatter + all-gather"):
            body.append([format_bytes(r.size), name, r.kinds[name], format_bytes(r.sent[name]), str(r.time[name])])
        body.append(
            [
                format_bytes(r.size),
                "split / fused time",
                "",
                "",
                f"{r.time['reduce-scatter + all-gather'].median / r.time['all-reduce'].median:.2f}x",
            ]
        )
    return Table(
        "Fused against split, on this target",
        ["D", "program", "collectives in HLO", "ring bytes sent per device", "time (median [min, max])"],
        body,
    )


def _summary(rows, n) -> str:
    last = rows[-1]
    ratio = last.time["reduce-scatter + all-gather"].median / last.time["all-reduce"].median
    return (
        f"On {n} devices the two programs gave identical results on every "
        "device, compiled to one all-reduce against one reduce-scatter "
        f"and one all-gather on the same axis, and send the same {format_bytes(last.sent['all-reduce'])} "
        f"per device for D = {format_bytes(last.size)} "
        "(2(N-1)/N·D). They pair up because the state between them, one "
        "piece of the sum per device, is what a sharded optimizer needs. "
        f"On this target the split took {ratio:.2f}x the fused all-reduce's time."
    )


CPU_NOTE = (
    "The CPU compiler keeps reduce-scatter and all-gather as two collectives: "
    "it does not fuse them back into an all-reduce, nor split the all-reduce."
)
