"""Explain a compiled program's communication: every collective, where it came from, why, and what it costs.

One report for three ways in: a function and its arguments (`explain`, the
notebook API, and ``lab inspect --fn``), an executable already compiled, or
the optimized HLO text of a dump (``lab inspect --dump`` / ``--hlo``). For
every collective XLA wrote it gives

* what it is: kind, mesh axes (from its replica groups), dtype, bytes per
  device (S, the nccl-tests size), how many times a step runs it (loop trip
  counts), whether the schedule runs it asynchronously;
* where it is: the user's call chain and the JAX op name
  (`lab.hlo.sources`), and the link it crosses on the target's machine
  (`lab.targets.topology`: ICI or DCN on TPUs, NVLink or InfiniBand on GPUs, the host
  for emulated CPU devices) with the lab's predicted time on that link;
* why it is there: what it moves (`lab.hlo.attribution`: a parameter, a
  gradient, an input, activations) and who decided (`lab.explanation.causes`:
  an op that cannot run sharded, a while_loop under vmap, shard_map, or two
  annotations that disagree, read from Shardy's record); surprises come first.

Totals per axis and kind, memory per device and (on TPU and GPU targets) the
roofline close it. An `Explanation` renders as rich tables in a terminal, as
HTML in Jupyter, and as one JSON object (`to_json`) for scripts.

It is one concept, the report: the readings it joins live in the modules it
names, and what is here is the join and its three renderings, which must show
the same rows (a surprise counted in one is flagged in the others).
"""

from __future__ import annotations

import sys
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import jax
from jax.sharding import NamedSharding
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from lab.errors import LabError
from lab.explanation.causes import Cause, cause_before, cause_of, settled
from lab.explanation.origins import Propagation, compile_with_origins, record_line
from lab.explanation.partitioner import Remat
from lab.explanation.sub_axes import sub_axis
from lab.hlo import Collective, Inspection, Skipped, parse_collectives
from lab.hlo.attribution import Dataflow, Input, Origin, attribute, op_names
from lab.hlo.kernels import Kernel, communicating_kernels
from lab.hlo.schedule import overlap_report
from lab.hlo.sources import Frame, nearest_metadata, op_of, short_chain, stack_frames, stack_of
from lab.hlo.text import module_name
from lab.mesh import AXES, axes_of_groups
from lab.roofline import Roofline, roofline
from lab.targets.hardware import ChipProfile, profile_for_device_kind
from lab.targets.topology import predict, program_placement
from lab.units import format_bytes, format_seconds

_HINT = (
    "pin the layout you want at {where}: jax.lax.with_sharding_constraint on the value, or out_sharding= on the op "
    "that makes it"
)


_LAB = Path(__file__).resolve().parents[1]  # the lab package: its frames are no line of the program


@dataclass(frozen=True)
class Explained:
    """One collective, explained."""

    collective: Collective
    origin: Origin
    stack: tuple[Frame, ...]  # the user's call chain, innermost first (`lab.hlo.sources.stack_of`); () if unknown
    cause: Cause | None  # the op or annotation that decided it (`lab.explanation.causes`); None when none is named
    link: str | None  # "ici", "dcn", "nvlink", "infiniband", "host", ...; None when the machine is unknown
    where: str | None  # the placement in words ("ICI x:4 ring")
    predicted_s: float | None  # per run, on the target's chip profile
    overlap_s: float | None = None  # compute the schedule runs while it is in flight (async pairs), per run

    @property
    def op(self) -> str:
        """The JAX op it was inserted for (of collectives XLA combined, the first one's)."""
        return op_of(op_names(self.collective.op_name or "")[0])

    @property
    def exposed_s(self) -> float | None:
        """What the step waits for: its predicted time less the compute scheduled under it."""
        if self.predicted_s is None or self.overlap_s is None:
            return None
        return self.predicted_s - min(self.predicted_s, self.overlap_s)

    @property
    def is_surprise(self) -> bool:
        """Not asked for by the program's layouts: nothing explains it, or an op or annotation forces it on a value
        that is no parameter or gradient (those move by the layout's design). One the program asks for by name (a
        ppermute in shard_map) is never one, whatever the data it moves."""
        if self.cause is not None and self.cause.asked:
            return False
        forced = self.cause is not None
        return self.origin.kind == "surprise" or (forced and self.origin.kind not in ("parameter", "gradient"))

    @property
    def source(self) -> Frame | None:
        """The innermost line of the user's code that made it."""
        return self.stack[0] if self.stack else None

    @property
    def count(self) -> int | None:
        return self.collective.repeats

    @property
    def hint(self) -> str | None:
        if self.cause is not None:
            return self.cause.hint
        if self.origin.kind != "surprise":
            return None
        if self.collective.moves_nothing:
            return "none needed: it sends no bytes"
        return _HINT.format(where=self.source or self.collective.op_name or self.collective.name)

    def to_json(self) -> dict[str, Any]:
        c = self.collective
        return {
            "kind": c.kind,
            "name": c.name,
            "axes": list(c.axes) if c.axes is not None else None,
            "dtype": ",".join(c.dtypes),
            "size_bytes": c.size_bytes,
            "count": c.repeats,
            "groups": [list(g) for g in c.replica_groups],
            "source": str(self.source) if self.source else None,
            "stack": [{"file": f.file, "line": f.line, "function": f.function} for f in self.stack],
            "op_name": c.op_name,
            "origin": {"kind": self.origin.kind, "name": self.origin.name, "why": self.origin.why},
            "surprise": self.is_surprise,  # what the summary's count counts: the origin, or a cause that forced it
            "cause": self.cause.to_json() if self.cause is not None else None,
            "async": c.is_async,
            "link": self.link,
            "where": self.where,
            "predicted_s": self.predicted_s,
            "overlap_s": self.overlap_s,
            "exposed_s": self.exposed_s,
            "hint": self.hint,
        }


@dataclass(frozen=True)
class Explanation:
    """A compiled program's collectives, explained, with totals, memory and roofline."""

    module: str
    target: str
    mesh: dict[str, int] | None
    collectives: tuple[Explained, ...]  # surprises first, then by bytes moved per step
    skipped: tuple[Skipped, ...]
    inputs: tuple[Input, ...]
    memory: dict[str, int]  # bytes per device
    roofline: Roofline | None
    origins: str = ""  # what Shardy's record of sharding origins gave, in one line (`lab.explanation.origins`)
    remats: tuple[dict[str, Any], ...] = ()  # values the partitioner gathered whole to reshard (`.partitioner`)
    kernels: tuple[tuple[Kernel, tuple[Frame, ...]], ...] = ()  # kernels that send by themselves, at their lines

    @property
    def surprises(self) -> tuple[Explained, ...]:
        return tuple(e for e in self.collectives if e.is_surprise)

    def totals(self) -> list[dict[str, Any]]:
        """Per (axes, kind): collectives, runs per step, bytes per step (S x runs), predicted seconds per step;
        not exact (at least these) when a loop's trip count is unknown, its collectives counted once."""
        grouped: dict[tuple, list[Explained]] = defaultdict(list)
        for e in self.collectives:
            grouped[
                tuple(e.collective.axes or ()) if e.collective.axes is not None else None, e.collective.kind
            ].append(e)
        rows = []
        for (axes, kind), members in grouped.items():
            runs = [e.count or 1 for e in members]
            predicted = [e.predicted_s for e in members]
            rows.append(
                {
                    "axes": list(axes) if axes is not None else None,
                    "kind": kind,
                    "collectives": len(members),
                    "runs": sum(runs),
                    "bytes": sum(e.collective.size_bytes * r for e, r in zip(members, runs)),
                    "exact": all(e.count is not None for e in members),
                    "predicted_s": None
                    if any(p is None for p in predicted)
                    else sum(p * r for p, r in zip(predicted, runs)),
                }
            )
        return sorted(rows, key=lambda r: -r["bytes"])

    def to_json(self) -> dict[str, Any]:
        return {
            "module": self.module,
            "target": self.target,
            "mesh": self.mesh,
            "collectives": [e.to_json() for e in self.collectives],
            "surprises": len(self.surprises),
            "totals": self.totals(),
            "skipped": [{"line": s.line_number, "reason": s.reason} for s in self.skipped],
            "inputs": [
                {
                    "name": i.name,
                    "shape": list(i.global_shape),
                    "per_device": list(i.local_shape),
                    "sharding": i.sharding,
                    "spec": i.spec,
                }
                for i in self.inputs
            ],
            "memory": self.memory,
            "roofline": _roofline_json(self.roofline),
            "origins": self.origins,
            "rematerializations": list(self.remats),
            "kernels": [
                {**k.to_json(), "source": f"{stack[0].file}:{stack[0].line}" if stack else None}
                for k, stack in self.kernels
            ],
        }

    # ----------------------------------------------------------------------- views

    def __rich__(self) -> Group:
        return Group(*self._renderables())

    def _repr_html_(self) -> str:
        console = Console(record=True, width=160, file=_Discard())
        console.print(self)
        return console.export_html(inline_styles=True)

    def _renderables(self) -> list:
        mesh = ",".join(f"{a}={s}" for a, s in (self.mesh or {}).items() if s > 1) or "no mesh given: raw groups"
        parts: list = [Text(f"{self.module} on {self.target} ({mesh})", style="bold")]
        if self.surprises:
            parts.append(
                Text(f"{len(self.surprises)} surprise(s): collectives the program's layouts did not ask for", "red")
            )
        parts.append(self._collectives_table())
        parts.append(self._totals_table())
        if self.skipped:
            first = self.skipped[0]
            parts.append(Text(f"{len(self.skipped)} line(s) skipped, e.g. line {first.line_number}: {first.reason}"))
        if self.origins:
            parts.append(Text(self.origins))
        parts.extend(Text(r["why"], "red") for r in self.remats)
        parts.extend(Text(_kernel_line(k, stack), "yellow") for k, stack in self.kernels)
        parts.append(Text(_memory_line(self.memory)))
        parts.append(Text(_roofline_line(self.roofline)))
        return parts

    def _collectives_table(self) -> Table:
        table = Table(title="collectives, surprises first", show_lines=False)
        for column in (
            "kind",
            "axes",
            "dtype",
            "S/device",
            "runs",
            "async",
            "link",
            "predicted",
            "exposed",
            "source",
            "why",
        ):
            table.add_column(column, overflow="fold")
        for e in self.collectives:
            c = e.collective
            style = "red" if e.is_surprise else None
            why = f"{e.origin}: {e.origin.why}" if e.cause is None else f"{e.cause.kind}: {e.cause.why}"
            why += f" ({e.origin})" if e.cause is not None and (e.is_surprise or e.origin.kind != "surprise") else ""
            why += f". Hint: {e.hint}" if e.hint else ""
            table.add_row(
                c.kind,
                _axes_cell(c, self.mesh),
                ",".join(c.dtypes),
                format_bytes(c.size_bytes),
                "?" if c.repeats is None else str(c.repeats),
                "yes" if c.is_async else "",
                e.link or "?",
                _seconds(e.predicted_s),
                _seconds(e.exposed_s),
                short_chain(e.stack, e.op),
                why,
                style=style,
            )
        return table

    def _totals_table(self) -> Table:
        table = Table(title="per axis and kind, per step")
        for column in ("axes", "kind", "collectives", "runs", "bytes", "predicted"):
            table.add_column(column, justify="left" if column in ("axes", "kind") else "right")
        rows = self.totals()
        for row in rows:
            at_least = "" if row["exact"] else ">= "
            table.add_row(
                "?" if row["axes"] is None else ",".join(row["axes"]) or "-",
                row["kind"],
                str(row["collectives"]),
                at_least + str(row["runs"]),
                at_least + format_bytes(row["bytes"]),
                (at_least if row["predicted_s"] is not None else "") + _seconds(row["predicted_s"]),
            )
        if not all(row["exact"] for row in rows):
            table.caption = ">= : a loop's trip count is unknown (runs ?): its collectives are counted once"
        return table


# --------------------------------------------------------------------------- building


def explain(fn, *args: Any, mesh=None, target: str | None = None, **kwargs: Any) -> Explanation:
    """Compile ``fn(*args, **kwargs)`` (arrays or ``jax.ShapeDtypeStruct`` with shardings) and explain it."""
    if not callable(fn):
        raise LabError(f"explain needs a function, not {type(fn).__name__}")
    mesh = mesh if mesh is not None else _mesh_of((args, kwargs))
    found, propagation, remats, names = compile_with_origins(fn, *args, mesh=mesh, **kwargs)
    return explain_inspection(found, mesh, target=target, propagation=propagation, remats=remats, names=names)


def explain_inspection(
    found: Inspection,
    mesh=None,
    *,
    target: str | None = None,
    propagation: Propagation | str | None = None,
    remats: Sequence[Remat] = (),
    names: Mapping[str, str] | None = None,
) -> Explanation:
    """The explanation of a program already compiled and inspected (with Shardy's record, the partitioner's
    rematerializations and the program's names of its inputs, when they were asked for:
    `lab.explanation.origins.compile_with_origins`)."""
    devices = list(mesh.devices.flat) if mesh is not None else []
    chip = _chip(devices)
    shown = target or (f"{devices[0].platform}:{len(devices)}" if devices else "?")
    return explain_text(
        found.optimized_hlo,
        found.collectives,
        found.skipped,
        mesh_sizes=dict(zip(found.axis_names, found.mesh_shape)) if found.mesh_shape else None,
        mesh=mesh,
        chip=chip,
        memory=found.memory,
        rooflined=roofline(found, mesh, chip) if chip is not None else None,
        target=shown,
        propagation=propagation if isinstance(propagation, Propagation) else None,
        origins_missing=propagation
        if isinstance(propagation, str)
        else "not asked for (compile with lab.explanation.origins.compile_with_origins)",
        remats=remats,
        names=names,
    )


def explain_hlo(
    hlo_text: str,
    mesh_shape: Sequence[int] | None = None,
    *,
    target: str = "a dump",
    memory: dict[str, int] | None = None,
    mesh=None,
    device_position: dict[int, int] | None = None,
) -> Explanation:
    """The explanation of optimized HLO text (a file, a dump), its groups mapped to a mesh of `mesh_shape`.

    `mesh`: the same mesh built on a compile-only target, whose links place the groups; `device_position`: device
    id -> mesh position, when the module's ids are not in mesh order.
    """
    shape = tuple(mesh_shape) if mesh_shape else None
    collectives, skipped = parse_collectives(hlo_text, None if device_position else shape)
    if device_position and shape:
        collectives = tuple(
            replace(c, axes=axes_of_groups(shape, AXES, [[device_position[d] for d in g] for g in c.replica_groups]))
            for c in collectives
        )
    devices = list(mesh.devices.flat) if mesh is not None else []
    return explain_text(
        hlo_text,
        collectives,
        skipped,
        mesh_sizes=dict(zip(AXES, shape)) if shape else None,
        mesh=mesh,
        chip=_chip(devices),
        memory=memory or {},
        target=target,
    )


def explain_text(
    hlo_text: str,
    collectives: Sequence[Collective],
    skipped: Sequence[Skipped],
    *,
    mesh_sizes: dict[str, int] | None,
    mesh=None,
    chip: ChipProfile | None = None,
    memory: dict[str, int],
    rooflined: Roofline | None = None,
    target: str,
    propagation: Propagation | None = None,
    origins_missing: str = "a dump holds no record of them (inspect the program with --fn)",
    remats: Sequence[Remat] = (),
    names: Mapping[str, str] | None = None,
) -> Explanation:
    graph = Dataflow.of(hlo_text, mesh_sizes, names)
    placed = {(c.computation, c.name): _placed(c, mesh, chip) for c in collectives}  # on whole axes' links
    collectives = [_on_sub_axis(c, mesh_sizes) for c in collectives]
    origins = attribute(graph, collectives)
    frames = stack_frames(hlo_text)
    overlaps = _overlaps(hlo_text, chip, mesh_sizes) if chip is not None else {}
    explained = []
    for c in collectives:
        key = (c.computation, c.name)
        link, where, seconds = placed[key]
        stack = stack_of(nearest_metadata(graph.instructions, key) if key in graph.instructions else {}, frames)
        consumer = ""
        if origins[c.name].kind == "input" and not (stack and c.op_name):  # an input resharded, no op named on it
            consumer, used = _consumer(graph, key, frames)  # (libtpu's all-gather as an all-reduce): where it is used
            stack = used or stack
        named = c if c.op_name or key not in graph.instructions else replace(c, op_name=_producer_op(graph, key))
        cause = (
            cause_before(c, origins[c.name].name, consumer, stack[0])
            if consumer
            else cause_of(named, stack[0] if stack else None, propagation)
        )
        cause = settled(cause, origins[c.name], c, stack[0] if stack else None, graph.inputs.values())
        origin, cause = _with_cause(origins[c.name], c, cause) if cause is not None else (origins[c.name], None)
        explained.append(Explained(c, origin, stack, cause, link, where, seconds, overlaps.get(key)))
    explained = _summed_twice(explained)
    order = {
        kind: rank for rank, kind in enumerate(("surprise", "index", "input", "activation", "gradient", "parameter"))
    }
    explained.sort(  # surprises first, of them first those nothing in the program asks for
        key=lambda e: (
            0 if e.is_surprise else order[e.origin.kind],
            e.origin.kind != "surprise",
            -e.collective.size_bytes * (e.count or 1),
        )
    )
    return Explanation(
        module=module_name(hlo_text),
        target=target,
        mesh=mesh_sizes,
        collectives=tuple(explained),
        skipped=tuple(skipped),
        inputs=graph.entry_inputs,
        memory=dict(memory),
        roofline=rooflined,
        origins=record_line(
            propagation,
            decided=sum(e.cause is not None and e.cause.kind == "annotation" and not e.cause.asked for e in explained),
            blind=sum(not e.stack or all(f.in_library for f in e.stack) for e in explained),
            missing=origins_missing,
        ),
        remats=tuple(r.to_json(mesh_sizes, frames) for r in remats),
        kernels=tuple((k, _program_frames(k, frames)) for k in communicating_kernels(hlo_text)),
    )


def _producer_op(graph: Dataflow, key: tuple[str, str], depth: int = 4) -> str | None:
    """The JAX op name of the nearest instruction upstream of `key` that has one: a collective XLA wrote without
    one (a slice's result gathered for the output) is there for the op that made its operand."""
    frontier = [key]
    for _ in range(depth):
        frontier = [
            (k[0], o) for k in frontier for o in graph.instructions[k].operands if (k[0], o) in graph.instructions
        ]
        for k in frontier:
            if name := graph.instructions[k].metadata.get("op_name"):
                return name
    return None


def _kernel_line(kernel: Kernel, stack: tuple[Frame, ...]) -> str:
    """One kernel that communicates by itself, in words."""
    axes = ",".join(kernel.axes) or "axes it does not name"
    called = f"{kernel.function or kernel.name}, {short_chain(stack, 'pallas_call') if stack else 'pallas_call'}"
    sends = (
        f"{len(kernel.remote_copies)} remote cop{'ies' if len(kernel.remote_copies) > 1 else 'y'} in its code "
        f"({', '.join(format_bytes(b) for b in kernel.remote_copies)} each time one runs)"
        if kernel.remote_copies
        else "copies the lab cannot read from its code"
    )
    return (
        f"a kernel sends by itself (remote DMA, no XLA collective): {called}, over {axes}: {sends}; how often they "
        "run is decided when it runs, so it is not among the collectives above nor priced"
    )


def _program_frames(kernel: Kernel, frames) -> tuple[Frame, ...]:
    """The program's lines that call the kernel, innermost first: none where the program hands the kernel to
    shard_map itself (then only JAX and the lab, which runs the program, are on its call chain)."""
    chain = stack_of(kernel.instruction.metadata, frames)
    return tuple(f for f in chain if not Path(f.file).resolve().is_relative_to(_LAB) and f.file != sys.argv[0])


def _consumer(graph: Dataflow, key: tuple[str, str], frames, depth: int = 6) -> tuple[str, tuple[Frame, ...]]:
    """The first instruction downstream of `key` (through tuples, copies, fusions: at most `depth` steps) that
    carries a line of the user's code: (its JAX op name, its stack), or ("", ())."""
    seen, frontier = {key}, [key]
    for _ in range(depth):
        users = [u for k in frontier for u in graph.users.get(k, ()) if (u.computation, u.name) not in seen]
        for user in users:
            stack = stack_of(user.metadata, frames)
            if stack and not all(f.in_library for f in stack):
                return str(user.metadata.get("op_name") or ""), stack
        frontier = [(u.computation, u.name) for u in users]
        seen.update(frontier)
    return "", ()


def _overlaps(hlo_text: str, chip: ChipProfile, mesh_sizes: dict[str, int] | None) -> dict[tuple[str, str], float]:
    """(computation, collective) -> seconds of compute the schedule places between its start and done."""
    if "is_scheduled=true" not in hlo_text[:4096]:
        return {}
    shape = tuple(mesh_sizes.values()) if mesh_sizes else None
    report = overlap_report(hlo_text, chip, mesh_shape=shape, axis_names=tuple(mesh_sizes) if mesh_sizes else None)
    return {(w.collective.computation, w.collective.name): w.compute_s for w in report.windows}


def _on_sub_axis(collective: Collective, mesh_sizes: dict[str, int] | None) -> Collective:
    """The collective with its axes named where its groups are part of one mesh axis (`lab.explanation.sub_axes`)."""
    if collective.axes is not None or not mesh_sizes or not collective.replica_groups:
        return collective
    part = sub_axis(tuple(mesh_sizes.values()), tuple(mesh_sizes), collective.replica_groups)
    return replace(collective, axes=(part,)) if part else collective


def _placed(collective: Collective, mesh, chip: ChipProfile | None) -> tuple[str | None, str | None, float | None]:
    """The link a collective crosses, the placement in words, and its predicted time per run."""
    if mesh is None or not (collective.axes or collective.across_slices):
        return None, None, None
    if mesh.devices.flat[0].platform == "cpu":
        return "host", "emulated devices in this process", None
    where = program_placement(mesh, collective, chip)
    cost = predict(collective.kind, collective.size_bytes, where, chip) if chip is not None else None
    return where.network, str(where), cost.seconds if cost else (0.0 if where.network == "chip" else None)


def _chip(devices: list) -> ChipProfile | None:
    """The chip profile of TPU and GPU devices; none for emulated CPU devices (they share one host)."""
    if not devices or devices[0].platform == "cpu":
        return None
    try:
        return profile_for_device_kind(devices[0].device_kind)
    except LabError:
        return None


def _mesh_of(tree):
    """The mesh of the first argument with a NamedSharding (None: nothing to map groups to)."""
    for leaf in jax.tree.leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding):
            return sharding.mesh
    return None


def _roofline_json(r: Roofline | None) -> dict[str, Any] | None:
    if r is None:
        return None
    return {
        "chip": r.chip,
        "counted_from": r.counted_from,
        "flops": r.flops,
        "bytes_accessed": r.bytes_accessed,
        "compute_s": r.compute_s,
        "memory_s": r.memory_s,
        "communication_s": r.communication_s,
        "bound": r.bound,
        "overlapped_s": r.overlapped_s,
        "serial_s": r.serial_s,
    }


def _memory_line(memory: dict[str, int]) -> str:
    shown = [f"{k.replace('_', ' ')} {format_bytes(v)}" for k, v in memory.items() if v]
    return "memory per device: " + (", ".join(shown) if shown else "not known (no memory analysis for this input)")


def _roofline_line(r: Roofline | None) -> str:
    if r is None:
        return "roofline: only on TPU and GPU targets (emulated CPU devices share one host; a dump carries no costs)"
    return (
        f"roofline on {r.chip} (FLOPs and bytes from {r.counted_from}): compute {_seconds(r.compute_s)}, "
        f"HBM {_seconds(r.memory_s)}, communication "
        f"{_seconds(r.communication_s)} -> {r.bound}-bound; {_seconds(r.overlapped_s)} if all overlaps, "
        f"{_seconds(r.serial_s)} if nothing does"
    )


def _summed_twice(explained: list[Explained]) -> list[Explained]:
    """A psum or pmean the program asks for in shard_map of a gradient autodiff has already summed over the same
    axes gets a hint: the gradient of a value the in_specs replicate is summed by autodiff (``psum_invariant``, the
    transpose of the implicit ``pvary``), so a second reduction, a habit of pmap-era code, returns the devices' sum
    where their mean was meant (a pmean of a sum), or that sum times the devices (a psum)."""
    summed = {
        (e.origin.name, tuple(e.collective.axes or ())): e
        for e in explained
        if e.origin.kind == "gradient"
        and e.cause is not None
        and e.cause.op == "psum_invariant"
        and "transpose(" in (e.collective.op_name or "")
    }
    again = []
    for e in explained:
        axes = tuple(e.collective.axes or ())
        first = summed.get((e.origin.name, axes))
        if first is not None and e is not first and e.cause is not None and e.cause.kind == "shard_map":
            where = e.cause.line.cited if e.cause.line else "its line"
            at = first.cause.line.cited if first.cause.line else "its line"
            hint = (
                f"at {where}: the gradient of {e.origin.name} is summed over {','.join(axes)} twice: autodiff already "
                f"summed it at {at} (the in_specs replicate it there), so this gives the devices' sum where a mean "
                "was meant (a pmean of a sum), or that sum times the devices (a psum); drop it"
            )
            e = replace(e, cause=replace(e.cause, hint=hint))
        again.append(e)
    return again


def _with_cause(origin: Origin, collective: Collective, cause: Cause) -> tuple[Origin, Cause]:
    """The origin and cause read together. An input the program moves by name (a ppermute in shard_map: a ring's
    next block) is moved, not resharded: no declared layout differs from a wanted one. Partial sums of activations
    or gradients are what the layouts ask for: nothing to change, so no hint. Partial sums of anything else (also
    what only seems an input moved: a one-operand fusion that sums it) are a surprise, but not a layout the
    partitioner chose."""
    axes = ",".join(collective.axes or ()) or "its groups"
    if cause.asked and origin.kind == "input":
        return replace(origin, why=f"moves {origin.name} over {axes}, as the program asks by name"), cause
    if cause.kind != "sum":
        return origin, cause
    if origin.kind in ("activation", "gradient"):
        return origin, replace(cause, hint=None)
    shapes = ", ".join(str(list(s)) for s in collective.operand_shapes)
    why = (
        f"shape {shapes}: neither activations nor a gradient: partial sums over {axes} of a value the program's "
        "layouts split where it is summed"
    )
    return Origin("surprise", None, why), cause


def _axes_cell(collective: Collective, mesh: dict[str, int] | None) -> str:
    """The mesh axes its groups span; without a mesh, its groups as XLA gave them (the first two, and how many)."""
    if collective.axes is not None:
        return ",".join(collective.axes) or "-"
    groups = collective.replica_groups
    if mesh or not groups:
        return "?"
    shown = " ".join("{" + ",".join(map(str, g)) + "}" for g in groups[:2])
    return shown + (f" +{len(groups) - 2} more" if len(groups) > 2 else "")


def _seconds(value: float | None) -> str:
    return "-" if value is None else format_seconds(value)


class _Discard:
    """A file that drops what is written (rich records the HTML; nothing goes to the terminal)."""

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass
