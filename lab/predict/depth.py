"""Depth: a decoder whose layers are one scan, compiled with K layers and read as its L.

Under `scan` the layers are one loop body (forward, and with remat the backward
that recomputes it) that runs once per layer: the L-layer program is the K-layer
program with its layer loops running L/K times as often and its stacked buffers
(each holding one slice per layer) L/K times as large. A 70B step that would not
fit HBM, or would take minutes to compile, is read from a program of K layers:

* **time**: the K-layer program priced by `lab.predict.ops` with each layer
  loop's trip count t (K) read as t·L/K. A loop is a layer
  loop when JAX named it under `LAYERS_SCOPE` (``jvp(layers)/while`` forward,
  ``transpose(jvp(layers))/while`` backward). Outside the loops, an op that
  touches stacked arrays (the optimizer's update, a gradient's all-reduce
  across slices) has its FLOPs, bytes and transfer scaled by the stacked share
  of its arrays; the rest (embedding, loss) is priced as compiled.
* **memory**: the K-layer program's compiled peak plus (L/K - 1) times its
  stacked bytes: the state stacked over layers (the parameters and their
  optimizer moments, entry parameters of leading dimension t under the model's
  ``blocks``) and, inside the layer loop that carries the most, the buffers of
  leading dimension t that are not those parameters (the saved activations,
  the compute-dtype weights, the gradients). This assumes the peak lies where
  the stacked buffers all live (the backward loop), true once they dominate; at
  small depth the peak can lie elsewhere (the loss), and the allocator's
  fragmentation is not modelled.

A pipeline (a ``stage`` axis of P) runs each stage's K/P layers as a loop
inside its loop over ticks, under the same scope: those inner loops are the
layer loops, read the same way. Its buffers stacked over ticks are not grown,
nor the time of the tick loop's ops on them (2-5% of the step and of the peak
low on the tests' small pipelines), and K/P must differ from the tick count, or a
buffer stacked over ticks would read as one stacked over layers
(`lab.predict.options.check_pipelined_layers`).

K >= 2: XLA removes a loop of one trip, so a one-layer scan compiles without the
loop this module reads (and its program is not one layer of the deep model's).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from lab.errors import LabError
from lab.hlo.schedule import ScheduledModule
from lab.hlo.text import Instruction, arrays, nbytes
from lab.model import LAYERS_SCOPE
from lab.predict.ops import trip_count

STACKED_STATE = "['blocks']"  # lab.model.Transformer.blocks: the scanned layers' parameters, in the state's paths
_IN_SCOPE = re.compile(rf"(^|[/(]){LAYERS_SCOPE}([)/]|$)")


@dataclass(frozen=True)
class Deeper:
    """How to read a program compiled with `compiled` layers as one of `layers`."""

    compiled: int
    layers: int
    trips: dict[tuple[str, str], int]  # (computation, while) -> its trip count at `layers`
    scale: dict[tuple[str, str], float]  # (computation, instruction) outside the layer loops -> factor on its work
    stacked_bytes: int  # per chip, in the compiled program

    @property
    def growth(self) -> float:
        """How many times as large each stacked buffer is at `layers`."""
        return self.layers / self.compiled

    def memory(self, compiled_peak: int) -> int:
        """The peak per chip at `layers`: the compiled peak plus the stacked buffers of the layers added."""
        return int(compiled_peak + (self.growth - 1) * self.stacked_bytes)


def layer_loops(schedule: ScheduledModule) -> list[Instruction]:
    """The while loops JAX made of the layers' scan, wherever they are (a pipeline nests them)."""
    return [
        i
        for body in schedule.computations.values()
        for i in body
        if i.opcode == "while" and _IN_SCOPE.search(str(i.metadata.get("op_name") or ""))
    ]


def deeper(schedule: ScheduledModule, compiled: int, layers: int) -> Deeper:
    """Read `schedule` (compiled with `compiled` layers) as `layers` deep."""
    loops = layer_loops(schedule)
    if not loops:
        raise LabError(
            f"no layer loop (named {LAYERS_SCOPE!r}) in the compiled step: it cannot be read as {layers} layers; "
            "compile every layer (--layers-compiled 0)"
        )
    trips = {}
    for loop in loops:
        t = trip_count(schedule, loop)
        if (t * layers) % compiled:
            raise LabError(f"{compiled} layers compiled cannot be read as {layers}: {layers} / {compiled} x {t} trips")
        trips[(loop.computation, loop.name)] = t * layers // compiled
    t = trip_count(schedule, loops[0])
    state = _stacked_state(schedule, t)
    carried = {loop.name: _carried(schedule, loop, t, state) for loop in loops}
    dims = {d for i in state.values() for _, d in i} | {d for c in carried.values() for _, d in c}
    return Deeper(
        compiled,
        layers,
        trips,
        _scale(schedule, dims, layers / compiled),
        sum(nbytes(a) for a in state.values()) + max((nbytes(c) for c in carried.values()), default=0),
    )


def _stacked_state(schedule: ScheduledModule, t: int) -> dict[str, list]:
    """The entry parameters stacked over layers (the model's ``blocks`` and their optimizer moments): name -> arrays."""
    return {
        i.name: _leading(i.shape, t)
        for i in schedule.computations[schedule.entry]
        if i.opcode == "parameter" and STACKED_STATE in str(i.metadata.get("op_name") or "")
    }


def _carried(schedule: ScheduledModule, loop: Instruction, t: int, state: dict) -> list:
    """The arrays `loop` carries one slice per layer of (its body slices or updates them at the layer's index),
    except the stacked state passed in as it is."""
    by_name = {i.name: i for i in schedule.computations.get(loop.computation, ())}
    init = by_name.get(loop.operands[0]) if loop.operands else None
    elements = init.operands if init is not None and init.opcode == "tuple" else ()
    sliced = _sliced_elements(schedule, loop.attr(r"\bbody=%?([\w.\-]+)") or "")
    return [
        a
        for index, name in enumerate(elements)
        if index in sliced and name not in state and name in by_name
        for a in _leading(by_name[name].shape, t)
    ]


def _sliced_elements(schedule: ScheduledModule, body: str) -> set[int]:
    """Indices of the loop state that `body` dynamic-slices or dynamic-update-slices (directly or in a fusion)."""
    instructions = schedule.computations.get(body, ())
    state = next((i.name for i in instructions if i.opcode == "parameter"), None)
    return {
        int(i.attr(r"\bindex=(\d+)") or -1)
        for i in instructions
        if i.opcode == "get-tuple-element" and i.operands[:1] == (state,) and _sliced(schedule, body, i.name)
    }


def _sliced(schedule: ScheduledModule, computation: str, value: str) -> bool:
    """Whether `value` is the buffer a dynamic-(update-)slice reads or writes, here or in a fusion it feeds."""
    for user in schedule.computations.get(computation, ()):
        if value not in user.operands:
            continue
        if user.opcode == "bitcast" and _sliced(schedule, computation, user.name):
            return True
        if user.opcode in ("dynamic-slice", "dynamic-update-slice") and user.operands[0] == value:
            return True
        if user.opcode == "fusion" and user.callees:
            inner = _parameter(schedule, user.callees[0], user.operands.index(value))
            if inner and _sliced(schedule, user.callees[0], inner):
                return True
    return False


# ops whose result is their operand's data moved, viewed or reduced: stacked when their operand is
_CARRIES = {
    "bitcast",
    "copy",
    "copy-start",
    "copy-done",
    "reshape",
    "transpose",
    "convert",
    "send",
    "all-reduce",
    "all-reduce-start",
    "all-reduce-done",
    "reduce-scatter",
    "all-gather",
    "all-gather-start",
    "all-gather-done",
    "async-start",
    "async-done",
}


def _scale(schedule: ScheduledModule, dims: set, growth: float) -> dict[tuple[str, str], float]:
    """Each entry instruction that touches stacked arrays (the optimizer's update, a gradient's all-reduce across
    slices): 1 + (growth - 1) x the stacked share of its operands' and result's bytes.

    An array is stacked when its dimensions are those of a stacked buffer, or when it is one moved, viewed or
    reduced (`_CARRIES`) or mostly computed (a fusion, by bytes) from stacked arrays: XLA flattens the gradients it
    sends across slices (f32[2, 256, 14336] goes as f32[7168, 8, 128]).
    """
    entry = schedule.entry
    shapes = schedule.shapes(entry)
    stacked_values: set[str] = set()
    out = {}
    for i in schedule.computations[entry]:
        if i.opcode in ("while", "parameter", "tuple"):
            continue
        operands = [(name, arrays(shapes.get(name, ""))) for name in i.operands]
        read = nbytes(a for _, group in operands for a in group)
        from_stacked = nbytes(a for name, group in operands if name in stacked_values for a in group)
        from_stacked += nbytes(
            a for name, group in operands if name not in stacked_values for a in group if a[1] in dims
        )
        result = arrays(i.shape)
        if any(a[1] in dims for a in result) or (
            from_stacked and (i.opcode in _CARRIES or (i.opcode == "fusion" and from_stacked > read / 2))
        ):
            stacked_values.add(i.name)
        if i.opcode in ("get-tuple-element", "bitcast"):
            continue  # no work of their own
        written = nbytes(result) if i.name in stacked_values else 0
        touched = nbytes(result) + read
        if touched and (written or from_stacked):
            out[(entry, i.name)] = 1 + (growth - 1) * (written + from_stacked) / touched
    return out


def _parameter(schedule: ScheduledModule, computation: str, number: int) -> str | None:
    return next(
        (
            i.name
            for i in schedule.computations.get(computation, ())
            if i.opcode == "parameter" and re.search(rf"\bparameter\({number}\)", i.line)
        ),
        None,
    )


def _leading(shape: str, t: int) -> list:
    return [a for a in arrays(shape) if a[1] and a[1][0] == t]
