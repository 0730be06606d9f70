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
from lab.errors import LabError
from lab.mesh import MeshSpec
from lab.progress import track
from lab.provenance import Setup
from lab.report import Result, Table
from lab.targets.devices import DEFAULT_TARGET, devices_for
from lab.units import format_bytes, parse_size
from lab.verdict import Check, Claim, check

QUESTION = "#40"
FUSED, SPLIT = "all-reduce", "reduce-scatter + all-gather"


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
class Program:
    """One of the two programs as compiled (and, on this target, run)."""

    name: str  # FUSED or SPLIT
    collectives: tuple[kit.Seen, ...]
    time: Timing | None = None  # None when only compiled


@dataclass(frozen=True)
class AtSize:
    """Both programs at one D per device."""

    size: int
    identical: bool  # the two programs' results, compared element by element on every device
    programs: tuple[Program, ...]

    def program(self, name: str) -> Program:
        return next(p for p in self.programs if p.name == name)


@dataclass(frozen=True)
class Observations:
    setup: Setup
    devices: int
    sizes: tuple[AtSize, ...]
    tpu: tuple[Program, ...] = ()  # compiled for the TPU topology at the largest D
    tpu_chips: int = 0
    tpu_unavailable: kit.Unavailable | None = None


# --------------------------------------------------------------------------- measure


def measure(config: Config) -> Observations:
    devices = devices_for(config.target)
    mesh = MeshSpec(fsdp=len(devices)).build(devices)
    sizes = tuple(
        _measure_size(mesh, parse_size(s), config.repeats) for s in track(config.sizes, f"{FUSED} vs {SPLIT}")
    )
    tpu = kit.tpu_chips(config.tpu_topology)
    programs = _compile_on_tpu(tpu, parse_size(config.sizes[-1])) if isinstance(tpu, kit.TpuChips) else ()
    return Observations(
        setup=Setup.of(config.target, devices, f"fsdp={len(devices)}"),
        devices=len(devices),
        sizes=sizes,
        tpu=programs,
        tpu_chips=len(tpu) if isinstance(tpu, kit.TpuChips) else 0,
        tpu_unavailable=tpu if isinstance(tpu, kit.Unavailable) else None,
    )


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


def _measure_size(mesh, size: int, repeats: int) -> AtSize:
    n = mesh.devices.size
    if size % (4 * n):
        raise LabError(f"size {size} bytes: D must be a multiple of {4 * n} bytes (float32, split into {n} pieces)")
    abstract = jax.ShapeDtypeStruct((n, size // 4), np.float32, sharding=NamedSharding(mesh, P("fsdp")))
    placed = jax.device_put((np.arange(n * size // 4) % 1024).reshape(n, -1).astype(np.float32), abstract.sharding)
    compiled, found = {}, {}
    for name, program in zip((FUSED, SPLIT), _programs(mesh)):
        compiled[name], inspection = kit.compile_and_inspect(program, abstract, mesh=mesh)
        found[name] = kit.seen(inspection.collectives)
    identical = bool(np.array_equal(np.asarray(compiled[FUSED](placed)), np.asarray(compiled[SPLIT](placed))))
    timing = time_interleaved({name: (c, (placed,)) for name, c in compiled.items()}, repeats=repeats)
    return AtSize(size, identical, tuple(Program(name, found[name], timing[name]) for name in (FUSED, SPLIT)))


def _compile_on_tpu(tpu: kit.TpuChips, size: int) -> tuple[Program, ...]:
    """What the TPU compiler writes for the two programs (compile-only, no TPU needed)."""
    mesh, n = tpu.mesh("fsdp"), len(tpu)
    abstract = jax.ShapeDtypeStruct((n, size // 4), np.float32, sharding=NamedSharding(mesh, P("fsdp")))
    return tuple(
        Program(name, kit.seen(hlo.inspect(program, abstract, mesh=mesh).collectives))
        for name, program in zip((FUSED, SPLIT), _programs(mesh))
    )


# --------------------------------------------------------------------------- judge


def judge(obs: Observations, config: Config) -> Result:
    checks = [c for at in obs.sizes for c in _size_checks(at, obs.devices)]
    if obs.tpu:
        checks += _tpu_checks(obs, config.tpu_topology, config.sizes[-1])
    return Result(
        summary=_summary(obs),
        theory=THEORY,
        tables=[_table(obs), *_tpu_tables(obs, config.tpu_topology)],
        checks=checks,
        claims=_claims(obs, checks),
        notes=[CPU_NOTE, *_tpu_notes(obs)],
    )


def _ring_bytes(size: int, n: int) -> float:
    """The textbook: a ring all-reduce of D sends 2(N-1)/N·D per device (Thakur et al. 2005)."""
    return theory.collective_cost("all-reduce", size, n, algorithm="ring", alpha=0, beta=1).bytes_sent


def _sent(program: Program) -> float:
    """Bytes each device sends, read from the compiled collectives: S times its bus factor ((N-1)/N, 2(N-1)/N)."""
    return sum(c.size_bytes * theory.bus_bandwidth_factor(c.kind, c.group_size) for c in program.collectives)


def _kinds(program: Program) -> str:
    return ", ".join(c.kind for c in program.collectives) or "none"


def _size_checks(at: AtSize, n: int) -> list[Check]:
    label, fused, split = f"D={format_bytes(at.size)}", at.program(FUSED), at.program(SPLIT)
    axes = ",".join(sorted({",".join(c.axes or ("?",)) for p in at.programs for c in p.collectives}))
    ring = _ring_bytes(at.size, n)
    return [
        check(f"{label}: results identical on every device", "True", str(at.identical), kind="exact"),
        check(f"{label}: the all-reduce program compiles to", "all-reduce", _kinds(fused), kind="exact"),
        check(f"{label}: the split program compiles to", "reduce-scatter, all-gather", _kinds(split), kind="exact"),
        check(f"{label}: both run on the fsdp axis", "fsdp", axes, kind="exact"),
        check(f"{label}: bytes sent per device, all-reduce = 2(N-1)/N·D", ring, _sent(fused), kind="exact", rtol=1e-9),
        check(
            f"{label}: bytes sent per device, reduce-scatter + all-gather", ring, _sent(split), kind="exact", rtol=1e-9
        ),
    ]


def _tpu_checks(obs: Observations, topology: str, size_text: str) -> list[Check]:
    """Bytes per chip on the TPU topology; where the compiler changed the split program's kinds, the corrected
    prediction prices the kinds it wrote with the textbook's sizes (an all-reduce of D, an all-gather of D)."""
    n, size = obs.tpu_chips, parse_size(size_text)
    checks = []
    for program in obs.tpu:
        kinds = [c.kind for c in program.collectives]
        textbook = {FUSED: ["all-reduce"], SPLIT: ["reduce-scatter", "all-gather"]}[program.name]
        refined = why = None
        if kinds != textbook:
            refined = sum(theory.bus_bandwidth_factor(kind, n) * size for kind in kinds)
            why = f"the TPU compiler wrote {', '.join(kinds)} instead of {', '.join(textbook)}"
        checks.append(
            check(
                f"tpu:{topology} {program.name}: bytes sent per chip",
                _ring_bytes(size, n),
                _sent(program),
                kind="exact",
                rtol=1e-9,
                refined=refined,
                why=why or "",
            )
        )
    return checks


def _claims(obs: Observations, checks: list[Check]) -> list[Claim]:
    last = obs.sizes[-1]
    fused, split = _sent(last.program(FUSED)), _sent(last.program(SPLIT))
    identical = all(at.identical for at in obs.sizes)
    claims = [
        Claim(
            "all-reduce(x) = all-gather(reduce-scatter(x))",
            "confirmed" if identical else "refuted",
            f"results {'identical' if identical else 'different'} on all {obs.devices} devices at "
            + ", ".join(format_bytes(at.size) for at in obs.sizes),
        )
    ]
    on_tpu = {p.name: _sent(p) for p in obs.tpu}
    same_here = fused == split
    same_on_tpu = not on_tpu or on_tpu[FUSED] == on_tpu[SPLIT]
    status = "confirmed" if same_here and same_on_tpu else "refined" if same_here else "refuted"
    numbers = (
        f"this target: {format_bytes(fused)} against {format_bytes(split)} per device at D = {format_bytes(last.size)}"
    )
    if on_tpu:
        numbers += f"; TPU compiler: {format_bytes(on_tpu[FUSED])} against {format_bytes(on_tpu[SPLIT])} per chip"
    claims.append(Claim("all-reduce and reduce-scatter + all-gather move the same ~2D", status, numbers))
    return claims


def _table(obs: Observations) -> Table:
    body = []
    for at in obs.sizes:
        for program in at.programs:
            body.append(
                [format_bytes(at.size), program.name, _kinds(program), format_bytes(_sent(program)), str(program.time)]
            )
        ratio = at.program(SPLIT).time.median / at.program(FUSED).time.median
        body.append([format_bytes(at.size), "split / fused time", "", "", f"{ratio:.2f}x"])
    return Table(
        "Fused against split, on this target",
        ["D", "program", "collectives in HLO", "bytes sent per device", "time (median [min, max])"],
        body,
    )


def _tpu_tables(obs: Observations, topology: str) -> list[Table]:
    if obs.tpu_unavailable:
        return [obs.tpu_unavailable.table()]
    if not obs.tpu:
        return []
    rows = [
        [p.name, "; ".join(f"{c.kind} (`{c.form}`)" for c in p.collectives), format_bytes(_sent(p))] for p in obs.tpu
    ]
    return [
        Table(
            f"Compiled for tpu:{topology} (compile-only)",
            ["program", "collectives the TPU compiler wrote", "bytes sent per chip"],
            rows,
        )
    ]


def _tpu_notes(obs: Observations) -> list[str]:
    split = next((p for p in obs.tpu if p.name == SPLIT), None)
    if split is None or "all-reduce" not in _kinds(split):
        return []
    return [
        "On TPU the reduce-scatter of a program that does nothing with its piece became an all-reduce plus a slice, "
        f"so the split sends {format_bytes(_sent(split))} per chip, more than the fused all-reduce: the compiler's "
        "choice, visible only in the HLO."
    ]


def _summary(obs: Observations) -> str:
    last = obs.sizes[-1]
    ratio = last.program(SPLIT).time.median / last.program(FUSED).time.median
    return (
        f"On {obs.devices} devices the two programs gave identical results on every device, compiled to one "
        "all-reduce against one reduce-scatter and one all-gather on the same axis, and send the same "
        f"{format_bytes(_sent(last.program(FUSED)))} per device for D = {format_bytes(last.size)} (2(N-1)/N·D). "
        "They pair up because the state between them, one piece of the sum per device, is what a sharded "
        f"optimizer needs. On this target the split took {ratio:.2f}x the fused all-reduce's time."
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


CPU_NOTE = (
    "The CPU compiler keeps reduce-scatter and all-gather as two collectives: "
    "it does not fuse them back into an all-reduce, nor split the all-reduce."
)
