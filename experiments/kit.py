"""The plumbing every experiment shares, written once.

An experiment is a module with ``QUESTION``, a frozen ``Config`` and
``run(config) -> Result``; its registry entry (`lab.registry`) fills the
page's name, title (the module docstring's first line) and question. What the
experiments would otherwise each repeat lives here.

**The compile-only TPU companion.** Many pages also show what the TPU compiler
makes of the same program, for a topology such as ``v5e:2x4``
(``Config.tpu_topology``, empty to skip), compiled through libtpu on this
machine without a TPU. `tpu_chips` gives its chips as `TpuChips` (with the
chip profile, torus shape and a one-axis mesh at hand), ``None`` when no
topology was asked for, or `Unavailable` when libtpu cannot build it here; a page
shows a `Unavailable` as one row and goes on, rather than failing::

    tpu = kit.tpu_chips(config.tpu_topology)
    if not isinstance(tpu, kit.TpuChips):
        return tpu  # not asked for, or not possible here
    mesh = tpu.mesh("fsdp")

**Compile once, read through `lab.hlo`.** Every collective a page reports is
read by `lab.hlo.inspect` (compile and read) or `lab.hlo.inspect_compiled`
(read an executable already compiled): the one reader that maps replica groups
to mesh axes, multi-slice meshes included. `compile_and_inspect` is the
second for programs a page also runs or times: one compile serves both.

**Measure, then judge.** ``measure(config)`` returns the module's frozen
``Observations``: facts only (what the compiler wrote, what a clock read),
JSON-serialisable, with ``setup = Setup.of(target, devices, mesh)``. A
collective the compiler wrote is stored as a `Seen`, the part of a
`lab.hlo.Collective` a judge reads. ``judge(observations, config)`` computes
every prediction, check and claim from them and nothing else, so a page can be
re-judged from its result.json (`lab.registry.Experiment.rejudge`).

**Figures without pyplot.** Plots are built as ``matplotlib.figure.Figure``
and ``figure.subplots(...)``: nothing is registered in pyplot's global list,
so nothing has to be closed and a long ``lab report`` keeps no figures alive.
"""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

from lab import hlo
from lab.errors import LabError
from lab.hlo import Collective
from lab.mesh import MeshSpec
from lab.report import Table
from lab.targets.devices import topology_devices, topology_shape
from lab.targets.hardware import ChipProfile, profile_for_device_kind


@dataclass(frozen=True)
class Unavailable:
    """A part of an experiment that could not run here, and why."""

    what: str  # "tpu:v5e:2x4 (compile-only)"
    reason: str  # one line, e.g. the LabError saying that libtpu is not installed

    def table(self) -> Table:
        """The page's one row in place of the part's tables."""
        return Table(self.what, ["skipped"], [[self.reason]])


@dataclass(frozen=True)
class TpuChips:
    """The compile-only chips of one TPU topology, as libtpu builds them."""

    topology: str  # "v5e:2x4": generation and torus, without the "tpu:" of a target
    devices: tuple

    def __len__(self) -> int:
        return len(self.devices)

    @property
    def target(self) -> str:
        return f"tpu:{self.topology}"

    @property
    def chip(self) -> ChipProfile:
        return profile_for_device_kind(self.devices[0].device_kind)

    @property
    def dims(self) -> tuple[int, ...]:
        """Chips along each torus dimension, (2, 4) for v5e:2x4."""
        return topology_shape(self.topology)

    def mesh(self, axis: str):
        """Every chip on one mesh axis (the other four of size 1)."""
        return MeshSpec(**{axis: len(self.devices)}).build(self.devices)


def tpu_chips(topology: str) -> TpuChips | Unavailable | None:
    """The chips of `topology` ("v5e:2x4"); None when it is empty, Unavailable when libtpu cannot build it here."""
    if not topology:
        return None
    try:
        return TpuChips(topology, topology_devices(topology))
    except LabError as err:
        return Unavailable(f"tpu:{topology} (compile-only)", str(err))


def in_fresh_process(function, *args: Any) -> Any:
    """`function(*args)` in a spawned child process. A compiler reads its flags once, when it starts (libtpu its
    LIBTPU_INIT_ARGS, XLA:GPU its XLA_FLAGS): a published run compiled with its recipe's flags needs a process of
    its own. `function` is a module's top-level function, its arguments and result picklable."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as child:
        return child.submit(function, *args).result()


def compile_and_inspect(fn, *args: Any, mesh) -> tuple[Any, hlo.Inspection]:
    """Compile the jitted `fn` for `args` once: the executable (to run or time) and what XLA put in it."""
    compiled = fn.lower(*args).compile()
    return compiled, hlo.inspect_compiled(compiled, mesh)


@dataclass(frozen=True)
class Seen:
    """One collective as the compiler wrote it: the part of a `lab.hlo.Collective` a judge reads."""

    kind: str
    axes: tuple[str, ...] | None  # mesh axes its groups span; None when no set of axes matches
    dtypes: tuple[str, ...]
    size_bytes: int  # S per device, the nccl-tests convention
    group_size: int | None
    form: str  # how XLA wrote it (opcode, fusion, async pair)
    combined: bool  # several arrays in one tuple-shaped instruction
    is_async: bool
    repeats: int | None  # runs per program call (loop trip counts); None when unknown

    @classmethod
    def of(cls, c: Collective) -> Seen:
        return cls(c.kind, c.axes, c.dtypes, c.size_bytes, c.group_size, c.form, c.combined, c.is_async, c.repeats)


def seen(collectives) -> tuple[Seen, ...]:
    """The `Seen` record of each collective, in program order."""
    return tuple(Seen.of(c) for c in collectives)
