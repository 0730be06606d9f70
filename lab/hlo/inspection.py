"""Compile a program and read what XLA made of it: HLO before and after optimization, collectives, memory, cost.

`inspect` lowers and compiles a function (jitting it if needed) on whatever
the arguments' mesh lives on: real devices, or a compile-only TPU or GPU
topology where nothing runs and the arguments are ``jax.ShapeDtypeStruct``.
`inspect_compiled` reads an executable already compiled, so one compile can
serve HLO, memory and timing. Either gives an `Inspection`:

* the optimized HLO text, parsed into collectives (`lab.hlo.collectives`)
  whose replica groups are mapped to the mesh's axes (the slice-local shape on
  a multi-slice TPU mesh: libtpu compiles one slice's program);
* XLA's memory analysis (argument, output, temp, alias, ... bytes per device)
  and cost analysis (flops, bytes accessed, and on TPU the optimal seconds).

`summary_table`, `format_memory` and `format_cost` are its console views.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import humanize
import jax
from jax.sharding import NamedSharding
from rich.table import Table

from lab.errors import LabError
from lab.hlo.collectives import Collective, CollectiveTotal, Skipped, parse_collectives, summarize
from lab.hlo.text import Shape, module_name
from lab.mesh import AXES, slice_local_shape
from lab.targets.devices import quiet_native_stderr
from lab.units import format_bytes


@dataclass(frozen=True)
class Inspection:
    """A compiled program: its HLO before and after optimization, collectives, memory, cost."""

    optimized_hlo: str
    unoptimized_hlo: str
    collectives: tuple[Collective, ...]
    skipped: tuple[Skipped, ...]
    memory: dict[str, int]  # bytes per device: argument, output, temp, alias, generated_code, peak_memory, ...
    cost: dict[str, float]  # XLA's cost analysis: flops, bytes accessed, (TPU) optimal_seconds, ...
    mesh_shape: Shape | None = None
    axis_names: tuple[str, ...] = AXES

    def summary(self) -> tuple[CollectiveTotal, ...]:
        return summarize(self.collectives)

    def dump(self, directory: str | Path) -> tuple[Path, Path]:
        """Write ``<module>.before_optimizations.hlo`` and ``.after_optimizations.hlo``."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        module = module_name(self.optimized_hlo)
        before = directory / f"{module}.before_optimizations.hlo"
        after = directory / f"{module}.after_optimizations.hlo"
        before.write_text(self.unoptimized_hlo)
        after.write_text(self.optimized_hlo)
        return before, after


# --------------------------------------------------------------------------- compiling


def inspect(fn, *args: Any, mesh=None, **kwargs: Any) -> Inspection:
    """Lower and compile ``fn(*args, **kwargs)`` (jitting it if needed) and read what XLA produced.

    `args` may be arrays or ``jax.ShapeDtypeStruct`` with shardings; on a
    compile-only TPU topology they must be ShapeDtypeStructs, and nothing runs.
    `mesh` (default: the mesh of the first NamedSharding among the args) maps
    replica groups to axes.
    """
    mesh = mesh if mesh is not None else _mesh_of((args, kwargs))
    return inspect_lowered(lower(fn, *args, mesh=mesh, **kwargs), mesh)


def lower(fn, *args: Any, mesh=None, **kwargs: Any):
    """``jax.jit(fn).lower(*args, **kwargs)`` (`fn` jitted if it is not yet), quiet on accelerators."""
    if not callable(fn):
        raise LabError(f"inspect needs a function (or a jax.jit-ed one), not {type(fn).__name__}")
    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    mesh = mesh if mesh is not None else _mesh_of((args, kwargs))
    with _quiet_on_accelerators(mesh):
        return jitted.lower(*args, **kwargs)


def inspect_lowered(lowered, mesh=None, *, compiler_options: dict | None = None) -> Inspection:
    """Compile a lowered program (with XLA `compiler_options`, debug options included) and read what XLA produced."""
    with _quiet_on_accelerators(mesh):
        compiled = lowered.compile(compiler_options) if compiler_options else lowered.compile()
    return inspect_compiled(compiled, mesh, unoptimized_hlo=lowered.as_text(dialect="hlo"))


def inspect_compiled(compiled, mesh=None, *, unoptimized_hlo: str = "") -> Inspection:
    """The same reading from an executable already compiled (one compile then serves HLO, memory and timing)."""
    optimized = compiled.as_text()
    shape = slice_local_shape(mesh) if mesh is not None else None
    names = tuple(mesh.axis_names) if mesh is not None else AXES
    collectives, skipped = parse_collectives(optimized, shape, names)
    return Inspection(
        optimized_hlo=optimized,
        unoptimized_hlo=unoptimized_hlo,
        collectives=collectives,
        skipped=skipped,
        memory=_memory(compiled),
        cost=_cost(compiled),
        mesh_shape=shape,
        axis_names=names,
    )


def _mesh_of(tree):
    for leaf in jax.tree.leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding):
            return sharding.mesh
    return None


def _quiet_on_accelerators(mesh):
    """libtpu and XLA:GPU write start-up noise and C++ warnings to fd 2 when they compile; hide it for their meshes
    (the CPU compiler writes nothing there)."""
    platform = getattr(mesh.devices.flat[0], "platform", "") if mesh is not None else ""
    return quiet_native_stderr() if platform in ("tpu", "gpu", "cuda") else contextlib.nullcontext()


def _memory(compiled) -> dict[str, int]:
    stats = compiled.memory_analysis()
    if stats is None:
        return {}
    suffix = "_in_bytes"
    return {name[: -len(suffix)]: int(getattr(stats, name)) for name in dir(stats) if name.endswith(suffix)}


def _cost(compiled) -> dict[str, float]:
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):  # older jax returned one dict per program
        cost = cost[0] if cost else {}
    # keys like "bytes accessed0{}" are per operand; keep the totals
    return {key: float(value) for key, value in (cost or {}).items() if "{" not in key}


# --------------------------------------------------------------------------- console views


def summary_table(totals: Iterable[CollectiveTotal], title: str = "collectives in the compiled program"):
    """A rich Table of `summarize` rows."""
    table = Table(title=title)
    for column, justify in (("kind", "left"), ("axes", "left"), ("count", "right"), ("bytes (S)", "right")):
        table.add_column(column, justify=justify)
    for t in totals:
        axes = "?" if t.axes is None else ",".join(t.axes) or "-"
        table.add_row(t.kind, axes, f"{t.count}{'' if t.exact else '+'}", format_bytes(t.total_bytes))
    return table


def format_memory(memory: dict[str, int]) -> str:
    """One line: the non-zero memory figures per device, in KiB/MiB/GiB."""
    return (
        ", ".join(f"{name.replace('_', ' ')} {format_bytes(value)}" for name, value in memory.items() if value)
        or "no memory figures"
    )


def format_cost(cost: dict[str, float]) -> str:
    """One line: flops, bytes accessed, and (TPU) the compiler's optimal time."""
    shown = []
    if "flops" in cost:
        shown.append(f"{humanize.metric(cost['flops'], 'FLOP')}")
    if "bytes accessed" in cost:
        shown.append(f"{format_bytes(cost['bytes accessed'])} accessed")
    if "optimal_seconds" in cost:  # libtpu's figure is negative when it could not price the program
        optimal = cost["optimal_seconds"]
        given = humanize.metric(optimal, "s")
        shown.append(f"optimal {given}" if optimal >= 0 else f"optimal unknown (the compiler gave {given})")
    return ", ".join(shown) or "no cost figures"
