"""What a schedule hides: the overlap windows of a compiled program's collectives, priced.

A step that computes for C seconds and communicates for T seconds takes C + T
when one waits for the other, and max(C, T) when they run at once: overlap
hides min(C, T) and never removes bytes. Which of the two a compiled program
does is written in its scheduled HLO.

In scheduled HLO an async collective is a ``-start`` and a ``-done`` (on TPU
also an "async collective fusion" chain: start, continuations that carry
compute, done); whatever the scheduler put between them runs while the bytes
travel. For each such *window* the compute between is priced with a
roofline, max(FLOPs / peak, bytes / HBM bandwidth) on a chip profile
(`compute_seconds`), the collective with `lab.theory` (`predict_seconds`),
and hidden = min(compute, communication). A synchronous collective hides
nothing. Windows can nest, and each is credited with all the compute inside
it: an upper bound when several collectives share the same compute.

The order is the schedule only in a scheduled module (``is_scheduled=true``),
which is what ``compiled.as_text()`` gives on CPU and TPU. `parse_schedule`
reads it into a `ScheduledModule` (every computation, its instructions in
order, read by `lab.hlo.text`); the collectives come from
`lab.hlo.collectives`; `overlap_report` pairs each with its window and totals
the step, and `timeline` draws the entry computation as letters.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

from lab import theory
from lab.collectives import KINDS
from lab.errors import LabError
from lab.hlo import loops
from lab.hlo.collectives import Collective, parse_collectives
from lab.hlo.text import Computation, Instruction, arrays, base_opcode, computations, nbytes, parse_instruction
from lab.mesh import AXES

# ------------------------------------------------------------------ scheduled HLO
# A scheduled module (``is_scheduled=true``) lists each computation's
# instructions in the order they run; that order is all the analysis needs.

# every opcode that moves data between devices: the modelled kinds, and two that lab.hlo.collectives skips
_COLLECTIVE_OPCODES = (*KINDS, "collective-broadcast", "ragged-all-to-all")
# No compute time: bookkeeping and addressing; asynchronous copies (DMA engines, not the compute units);
# custom calls, which are opaque to this analysis (on TPU here: buffer concatenations and collective markers).
_FREE = {
    "parameter",
    "constant",
    "get-tuple-element",
    "tuple",
    "bitcast",
    "partition-id",
    "replica-id",
    "after-all",
    "copy-start",
    "copy-done",
    "slice-start",
    "slice-done",
    "dynamic-slice-start",  # the async DMAs of an offloading remat policy: to host memory and back
    "dynamic-slice-done",
    "dynamic-update-slice-start",
    "dynamic-update-slice-done",
    "opt-barrier",
    "custom-call",
}


@dataclass(frozen=True)
class ScheduledModule:
    """Every computation of a module, its instructions in scheduled order."""

    entry: str
    computations: dict[str, tuple[Instruction, ...]]

    def shapes(self, computation: str) -> dict[str, str]:
        return {i.name: i.shape for i in self.computations.get(computation, ())}

    def contains(self, computation: str, predicate: Callable[[Instruction], bool]) -> bool:
        """Whether `computation`, or anything it calls, has an instruction matching `predicate`."""
        return any(
            predicate(i) or any(self.contains(c, predicate) for c in i.callees)
            for i in self.computations.get(computation, ())
        )


def parse_schedule(hlo_text: str) -> ScheduledModule:
    """The computations of an HLO module's text, instructions in the order printed (the schedule, once scheduled)."""
    found = computations(hlo_text)
    entry = next((c.name for c in reversed(found) if c.is_entry), "")
    if not entry:
        raise LabError("this HLO text has no ENTRY computation; pass the whole module, e.g. compiled.as_text()")
    return ScheduledModule(entry, {c.name: _instructions(c) for c in found if c.name})


def _instructions(computation: Computation) -> tuple[Instruction, ...]:
    parsed = (parse_instruction(line, computation.name, number) for number, line in computation.instruction_lines())
    return tuple(i for i in parsed if i is not None)


def _shape_bytes(shape: str) -> int:
    return nbytes(arrays(shape))


# ------------------------------------------------------------------ pricing compute


def flops(schedule: ScheduledModule, computation: str, instruction: Instruction) -> float:
    """FLOPs of the matmuls in `instruction`: dots and convolutions, through fusions; a loop body times its known
    trip count."""
    if instruction.opcode == "dot":
        lhs = arrays(schedule.shapes(computation).get(instruction.operands[0], ""))
        contracting = instruction.attr(r"lhs_contracting_dims=\{([\d,]*)\}") or ""
        inner = math.prod(lhs[0][1][int(d)] for d in contracting.split(",") if d) if lhs else 0
        return 2.0 * _elements(instruction.shape) * inner
    if instruction.opcode == "convolution":
        return 2.0 * _elements(instruction.shape) * _kernel_inputs(schedule, computation, instruction)
    inside = sum(
        flops(schedule, callee, i) for callee in instruction.callees for i in schedule.computations.get(callee, ())
    )
    return inside * _trips(schedule, instruction)


def _trips(schedule: ScheduledModule, instruction: Instruction) -> int:
    """How often a while loop runs its body (`lab.hlo.loops`; 1 for anything else, and for a loop of unknown
    count)."""
    if instruction.opcode != "while":
        return 1
    condition = instruction.attr(r"\bcondition=%?([\w.\-]+)") or ""
    return loops.trip_count(instruction, schedule.computations.get(condition, ())) or 1


def _elements(shape: str) -> int:
    return sum(math.prod(dims) for _, dims in arrays(shape))


def _kernel_inputs(schedule: ScheduledModule, computation: str, instruction: Instruction) -> int:
    """Multiply-adds per output element of a convolution: the kernel's size over its output features."""
    rhs = arrays(schedule.shapes(computation).get(instruction.operands[1], ""))
    labels = instruction.attr(r"dim_labels=\w+_(\w+)->")
    if not rhs or not labels or "o" not in labels:
        return 0
    kernel = rhs[0][1]
    return math.prod(kernel) // kernel[labels.index("o")]


def bytes_accessed(schedule: ScheduledModule, computation: str, instruction: Instruction) -> int:
    """Bytes read and written: operands plus result; a buffer updated in place counts as its update only."""
    shapes = schedule.shapes(computation)
    updates = _in_place_updates(schedule, instruction)
    operands = [shapes.get(name, "") for name in instruction.operands]
    if updates is None:
        return sum(map(_shape_bytes, operands)) + _shape_bytes(instruction.shape)
    result_arrays = arrays(instruction.shape)
    read = sum(_shape_bytes(s) for s in operands if arrays(s) != result_arrays)
    return read + 2 * updates


def _in_place_updates(schedule: ScheduledModule, instruction: Instruction) -> int | None:
    """Bytes a fusion writes through dynamic-update-slice into a buffer it updates in place, or None."""
    for callee in instruction.callees:
        shapes = schedule.shapes(callee)
        written = [
            _shape_bytes(shapes.get(i.operands[1], ""))
            for i in schedule.computations.get(callee, ())
            if i.opcode == "dynamic-update-slice"
        ]
        if written:
            return sum(written)
    return None


def compute_seconds(schedule: ScheduledModule, computation: str, instruction: Instruction, chip) -> float:
    """Roofline time on `chip`: max(FLOPs / peak FLOP/s, bytes / HBM bandwidth); 0 for bookkeeping and pure
    communication.

    A while loop is its body's instructions priced one by one, times the trip
    count. A fusion that also communicates (a TPU async collective fusion's
    continuation) is priced by its matmuls alone: the buffers it threads
    through belong to the collective, whose transfer is priced separately.
    """
    if instruction.opcode == "while":
        body = [c for c in instruction.callees if c == instruction.attr(r"\bbody=%?([\w.\-]+)")]
        return _trips(schedule, instruction) * sum(
            compute_seconds(schedule, c, i, chip) for c in body for i in schedule.computations.get(c, ())
        )
    matmul_flops = flops(schedule, computation, instruction)
    if instruction.opcode in _FREE or _communicates(schedule, instruction):
        return matmul_flops / chip.peak_bf16_flops
    return max(
        matmul_flops / chip.peak_bf16_flops, bytes_accessed(schedule, computation, instruction) / chip.hbm_bandwidth
    )


def _communicates(schedule: ScheduledModule, instruction: Instruction) -> bool:
    """A collective, an async wrapper of one, or a fusion with a collective inside."""
    if base_opcode(instruction.opcode) in _COLLECTIVE_OPCODES or instruction.opcode in (
        "async-start",
        "async-update",
        "async-done",
    ):
        return True
    return any(
        schedule.contains(callee, lambda i: base_opcode(i.opcode) in _COLLECTIVE_OPCODES)
        for callee in instruction.callees
    )


def _async_marker(schedule: ScheduledModule, computation: str) -> str | None:
    """ "start"/"done" for the computation of a TPU async collective fusion's first/last fusion."""
    for i in schedule.computations.get(computation, ()):
        target = i.attr(r'custom_call_target="(AsyncCollective(?:Start|Done))"')
        if target:
            return "start" if target.endswith("Start") else "done"
    return None


# ------------------------------------------------------------------ overlap windows


@dataclass(frozen=True)
class Window:
    """One collective and what the schedule runs while its bytes travel."""

    collective: Collective
    computation: str
    start: str  # the instruction that starts it (the collective itself when synchronous)
    done: str
    between: tuple[str, ...]  # instructions with compute time scheduled between start and done
    compute_s: float
    comm_s: float  # predicted by lab.theory on the chip's network

    @property
    def is_async(self) -> bool:
        return self.start != self.done

    @property
    def hidden_s(self) -> float:
        return min(self.compute_s, self.comm_s)

    @property
    def exposed_s(self) -> float:
        return self.comm_s - self.hidden_s

    @property
    def hidden_fraction(self) -> float:
        return self.hidden_s / self.comm_s if self.comm_s else 1.0

    @property
    def runs(self) -> int:
        """Runs per program call (loop trip counts; 1 when unknown)."""
        return self.collective.repeats or 1


@dataclass(frozen=True)
class OverlapReport:
    """Every collective of a compiled program with its window, and the step's totals."""

    windows: tuple[Window, ...]
    compute_s: float  # roofline time of everything the entry computation runs
    chip: str

    @property
    def communication_s(self) -> float:
        return sum(w.comm_s * w.runs for w in self.windows)

    @property
    def hidden_s(self) -> float:
        return sum(w.hidden_s * w.runs for w in self.windows)

    @property
    def exposed_s(self) -> float:
        """Communication the step waits for: every synchronous collective, and what async windows leave uncovered."""
        return sum(w.exposed_s * w.runs for w in self.windows)

    @property
    def step_s(self) -> float:
        """Predicted step time: compute plus exposed communication."""
        return self.compute_s + self.exposed_s


def overlap_report(
    hlo_text: str,
    chip,
    topology: Sequence[int] = (),
    mesh_shape: Sequence[int] | None = None,
    axis_names: Sequence[str] | None = None,
) -> OverlapReport:
    """Windows of every collective in `hlo_text` (scheduled HLO), priced on `chip` (a lab.targets.hardware.ChipProfile).

    `topology` is the TPU slice's torus, e.g. (4, 4); without it (or on a
    switched chip) collectives are priced on the chip's links as a switch.
    """
    schedule = parse_schedule(hlo_text)
    collectives, _ = parse_collectives(hlo_text, mesh_shape, tuple(axis_names or AXES))
    windows = tuple(_window(schedule, c, chip, tuple(topology)) for c in collectives)
    entry_s = sum(compute_seconds(schedule, schedule.entry, i, chip) for i in schedule.computations[schedule.entry])
    return OverlapReport(windows, entry_s, chip.name)


def _window(schedule: ScheduledModule, collective: Collective, chip, topology: tuple[int, ...]) -> Window:
    computation, start, done = _bounds(schedule, collective)
    order = [i.name for i in schedule.computations[computation]]
    inside = schedule.computations[computation][order.index(start) + 1 : order.index(done)]
    priced = [(i.name, compute_seconds(schedule, computation, i, chip)) for i in inside]
    busy = tuple(name for name, seconds in priced if seconds > 0)
    return Window(
        collective,
        computation,
        start,
        done,
        busy,
        sum(s for _, s in priced),
        predict_seconds(collective, chip, topology),
    )


def _bounds(schedule: ScheduledModule, collective: Collective) -> tuple[str, str, str]:
    """(scheduled computation, start instruction, done instruction) of a collective as lab.hlo reports it."""
    if "chain" in collective.form:  # TPU async collective fusion: lab.hlo names the start fusion's computation
        return _chain_bounds(schedule, collective.computation)
    if "async-start" in collective.form:
        caller, start = _caller(schedule, collective.computation)
        return caller, start.name, _done_of(schedule, caller, start.name)
    if collective.done:  # a megascale transfer: its result arrives at the recv-done
        return collective.computation, collective.name, collective.done
    if collective.is_async:
        return collective.computation, collective.name, _done_of(schedule, collective.computation, collective.name)
    if collective.fused:  # a synchronous collective inside a fusion: the fusion is the step
        computation, name = _fusion_of(schedule, collective)
        return computation, name, name
    return collective.computation, collective.name, collective.name


def _fusion_of(schedule: ScheduledModule, collective: Collective) -> tuple[str, str]:
    """(computation, instruction) that runs a fused synchronous collective: the fusion around it.

    lab.hlo names the TPU's reduce-scatter by its fusion already, in the entry or in a loop body (which runs it once
    a trip, not once a step); any other fused collective by the instruction inside the fusion's computation.
    """
    for computation, body in schedule.computations.items():
        for instruction in body:
            if instruction.opcode == "fusion" and collective.computation in instruction.callees:
                return computation, instruction.name
    return collective.computation, collective.name


def _caller(schedule: ScheduledModule, callee: str) -> tuple[str, Instruction]:
    for computation, body in schedule.computations.items():
        for instruction in body:
            if callee in instruction.callees:
                return computation, instruction
    raise LabError(f"no instruction calls computation {callee!r}; pass the whole HLO module")


def _done_of(schedule: ScheduledModule, computation: str, start: str) -> str:
    """The -done that completes `start` (through any -update in between)."""
    names = {start}
    for instruction in schedule.computations[computation]:
        if instruction.operands and instruction.operands[0] in names:
            if instruction.opcode.endswith("-done"):
                return instruction.name
            if instruction.opcode.endswith("-update"):
                names.add(instruction.name)
    raise LabError(
        f"async collective {start!r} has no matching -done in {computation!r}; pass the whole scheduled module"
    )


def _chain_bounds(schedule: ScheduledModule, start_callee: str) -> tuple[str, str, str]:
    """A TPU async collective fusion chain: the fusion calling `start_callee`, and the done fusion of the same chain."""
    computation, start = _caller(schedule, start_callee)
    chain = _chain_id(schedule, start_callee)
    for instruction in schedule.computations[computation]:
        for callee in instruction.callees:
            if _async_marker(schedule, callee) == "done" and _chain_id(schedule, callee) == chain:
                return computation, start.name, instruction.name
    raise LabError(
        f"async collective fusion {start.name!r} has no done fusion with chain {chain}; pass the whole scheduled module"
    )


def _chain_id(schedule: ScheduledModule, computation: str) -> str | None:
    return next(
        (
            i.attr(r'chain_id="(\d+)"')
            for i in schedule.computations.get(computation, ())
            if i.attr(r'chain_id="(\d+)"')
        ),
        None,
    )


def window_flops(schedule: ScheduledModule, window: Window) -> float:
    """Matmul FLOPs of the instructions the schedule runs between `window`'s start and done."""
    found = {i.name: i for i in schedule.computations.get(window.computation, ())}
    return sum(flops(schedule, window.computation, found[name]) for name in window.between)


def flops_in_flight(schedule: ScheduledModule, windows: Sequence[Window]) -> float:
    """Matmul FLOPs run while at least one collective of `windows` is in flight, each instruction counted once.

    Windows can nest or overlap (two transfers in flight at once); an instruction inside several counts once.
    """
    inside = {(w.computation, name) for w in windows for name in w.between}
    found = {(c, i.name): i for c, body in schedule.computations.items() for i in body}
    return sum(flops(schedule, c, found[(c, name)]) for c, name in inside)


def predict_seconds(collective: Collective, chip, topology: tuple[int, ...] = ()) -> float:
    """lab.theory's time for one run of `collective` on `chip`: over torus dims its group spans, else a switch."""
    kind, size, group = collective.kind, collective.size_bytes, collective.group_size or 1
    if group < 2:
        return 0.0
    if not (chip.torus_dims and topology):
        return theory.predict_on_switch(kind, size, chip, group).seconds
    dims = _spanned_dims(topology, group)
    if dims is None:  # a group that is not whole torus dimensions: a line (or ring) of its own length
        return theory.predict_on_torus(kind, size, chip, (group,), (0,)).seconds
    return theory.predict_on_torus(kind, size, chip, topology, dims).seconds


def _spanned_dims(topology: tuple[int, ...], group: int) -> tuple[int, ...] | None:
    """The fewest torus dimensions whose chips multiply to `group` (innermost first), or None."""
    for count in range(1, len(topology) + 1):
        for dims in itertools.combinations(reversed(range(len(topology))), count):
            if math.prod(topology[d] for d in dims) == group:
                return tuple(sorted(dims))
    return None


def timeline(hlo_text: str) -> str:
    """The entry computation as letters: ``[`` a collective starts, ``]`` it is done, ``C`` a synchronous
    collective, ``M`` an instruction with a matmul; everything else left out. ``[M]`` is an overlapped step."""
    schedule = parse_schedule(hlo_text)
    return "".join(_letter(schedule, instruction) for instruction in schedule.computations[schedule.entry])


def _letter(schedule: ScheduledModule, instruction: Instruction) -> str:
    has_matmul = flops(schedule, schedule.entry, instruction) > 0
    if not _communicates(schedule, instruction):
        return "M" if has_matmul else ""
    phase = next((m for m in map(partial(_async_marker, schedule), instruction.callees) if m), None)
    if phase is None:
        match = re.search(r"-(start|done)$", instruction.opcode)
        phase = match.group(1) if match else None
    if phase is not None:
        return "[" if phase == "start" else "]"
    return "M" if has_matmul else "C"  # an async collective fusion's continuation carries compute
