"""Op by op: the predicted time of a compiled, scheduled step, and what of its communication is exposed.

One concept, one module: pricing each op and walking the schedule that decides what hides are one model (the walk
needs each op's price, the prices mean nothing without the walk), so they stay together.

XLA's cost analysis is one number for the whole program; the scheduled HLO
(``compiled.as_text()``, ``is_scheduled=true``) has every instruction in the
order it runs, so each can be priced on its own:

* a fusion (or any compute instruction): its matmul FLOPs (dots and
  convolutions inside it, `lab.hlo.schedule.flops`) over the chip's peak times
  the matmul efficiency, or its HBM bytes over the bandwidth times the HBM
  efficiency, whichever is longer (a roofline per op; the constants are
  `lab.predict.calibration`'s). The peak is bf16's, or the chip's int8 or fp8
  peak for a quantized step (`lab predict --matmul-precision`: priced, not
  compiled; the attention kernel stays bf16). Bytes are the fusion's operands and result,
  except that an operand the fusion only slices (a layer's weights or saved
  activation taken out of the scanned stack, also through the bitcasts, copies
  and copy fusions that change its tiling first: inside a fusion nothing is
  materialized) counts the slice it reads, and a
  buffer updated in place counts its update;
* a Pallas kernel (``tpu_custom_call``; the flash attention's forward, dq and
  dkv kernels) is opaque to XLA: its FLOPs are counted from its operand shapes
  (forward 4·b·h·S·T·K, dq 6·, dkv 8·, the causal kernels skipping the blocks
  above the diagonal: a fraction (n + 1) / 2n of n x n blocks; the splash
  kernel of a sliding window, the blocks its mask's table lists; a dropless
  MoE's grouped matmuls, megablox's ``gmm`` and ``tgmm``, their grid of whole
  blocks as the kernel's Mosaic module gives it (`lab.hlo.mosaic`), with the row
  tiles that straddle two experts, `_grouped_flops`);
* a loop: its body, priced twice in a row and the second pass taken as the
  steady state (a collective the scheduler starts in one iteration and
  finishes in the next then waits as it would), times its trip count (the
  condition's bound);
* a collective: the lab's link model (`lab.targets.topology.placement` and
  `lab.targets.topology.predict`) on the ICI or DCN links of its mesh axes;
* a DMA between HBM and host memory (memory space S(5): an offloading remat
  policy's ``dynamic-update-slice-start`` of a layer's activation to host, its
  ``dynamic-slice-start`` back): the bytes over the chip's PCIe bandwidth,
  each direction its own link (`lab.targets.hardware.ChipProfile.host_bandwidth`).

The schedule decides overlap. The compute stream runs the instructions in
order; an async collective starts when its start instruction is reached (after
the previous transfer on the same network: one transfer at a time per link)
and the stream waits at its done instruction until the bytes have arrived.
What the stream waits is the *exposed* communication; a synchronous
collective is exposed whole. This is the schedule's async windows priced,
with two windows sharing compute only once (unlike `lab.hlo.schedule`'s upper
bound, which credits each window with all the compute inside it).
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass, field, replace

import numpy as np

from lab.hlo import loops, mosaic
from lab.hlo.schedule import ScheduledModule, Window, _communicates, flops, overlap_report, parse_schedule
from lab.hlo.text import Instruction, arrays, nbytes
from lab.targets.hardware import ChipProfile
from lab.targets.topology import predict, program_placement

# bookkeeping, addressing and DMA: no compute-unit time
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
    "dynamic-slice-start",  # the async DMAs of an offloading remat policy, on the PCIe links (`_host_transfer`)
    "dynamic-slice-done",
    "dynamic-update-slice-start",
    "dynamic-update-slice-done",
    "call-start",  # an async call on another execution thread (TPU7x's SparseCores: a collective, or a relayout)
    "call-done",
    "opt-barrier",
    "add-dependency",
}
_SLICING = {"dynamic-slice", "slice", "gather"}
HOST_SPACE = "S(5)"  # TPU memory space 5: pinned host memory (an offloading checkpoint policy's destination)
_TRANSFERS = {"dynamic-update-slice-start": "to host", "dynamic-slice-start": "from host"}
_TRANSFER_DONES = {"dynamic-update-slice-done", "dynamic-slice-done"}


def _host_transfer(instruction: Instruction) -> tuple[str, int] | None:
    """An async DMA between HBM and host memory: (direction, bytes moved), or None for any other instruction.

    A ``dynamic-update-slice-start`` writes its update (one layer's activation) into the host buffer, a
    ``dynamic-slice-start`` reads a slice of it back; in both shapes the slice is the second array that is not a
    scalar: ((buffer, update, indices), buffer, u32) and ((buffer, indices), slice, u32)."""
    direction = _TRANSFERS.get(instruction.opcode)
    if direction is None or HOST_SPACE not in instruction.shape:
        return None
    moved = [a for a in arrays(instruction.shape) if a[1]][1:2]
    return direction, nbytes(moved)


_FLASH_UNITS = (("bwd_dkv", 8), ("bwd_dq", 6), ("flash", 4))  # matmul FLOPs per b·h·S·T·K of each kernel
_SPLASH_UNITS = (("dkv", 8), ("dq", 6), ("fwd", 4))  # the splash kernel's, named its way


@dataclass(frozen=True)
class Efficiency:
    """Fractions of the chip's peaks a well-shaped op reaches (see `lab.predict.calibration`)."""

    matmul: float = 1.0
    hbm: float = 1.0


@dataclass(frozen=True)
class OpCost:
    """One instruction's predicted time in the whole step (its loops' trip counts included)."""

    name: str
    computation: str
    op_name: str
    runs: int
    flops: float  # per run
    bytes: float  # per run
    seconds: float  # all runs

    @property
    def bound(self) -> str:
        return "compute" if self.flops and self.seconds_compute >= self.seconds_memory else "memory"

    seconds_compute: float = 0.0
    seconds_memory: float = 0.0


@dataclass(frozen=True)
class CommCost:
    """One collective's predicted transfer time and what the compute stream waited for it, over the step."""

    kind: str
    axes: tuple[str, ...]
    network: str  # where its devices meet: "ici", "dcn", "chip"
    link: str  # the placement, as text
    bytes: int  # S per device, one run
    runs: int
    seconds: float  # transfer time, all runs
    exposed_s: float  # waited for, all runs
    is_async: bool
    name: str = ""  # the instruction that starts it


@dataclass
class StepPrediction:
    """The step, op by op: total time, compute, exposed communication, and each op's share."""

    step_s: float
    compute_s: float
    matmul_flops: float  # hardware FLOPs the program runs (remat recompute included)
    ops: list[OpCost] = field(default_factory=list)
    comms: list[CommCost] = field(default_factory=list)

    @property
    def exposed_comm_s(self) -> float:
        return sum(c.exposed_s for c in self.comms)

    @property
    def comm_s(self) -> float:
        return sum(c.seconds for c in self.comms)

    def exposed_by_link(self) -> dict[str, float]:
        """Exposed seconds per (axes, link)."""
        out: dict[str, float] = defaultdict(float)
        for c in self.comms:
            out[f"{','.join(c.axes) or '-'} on {c.link}"] += c.exposed_s
        return dict(out)

    def top_ops(self, n: int = 10) -> list[OpCost]:
        return sorted(self.ops, key=lambda o: o.seconds, reverse=True)[:n]


def predict_step(hlo_text: str, mesh, chip: ChipProfile, efficiency: Efficiency) -> StepPrediction:
    """Price every instruction of scheduled `hlo_text` compiled over `mesh` and simulate the schedule."""
    return read_schedule(hlo_text, mesh, chip).predict(efficiency)


@dataclass
class ReadSchedule:
    """A compiled step read once (instructions, async windows, each op's FLOPs and bytes), to price many times.

    Solving an efficiency constant walks the same schedule under many candidate values; what does not depend
    on the constants (parsing, the FLOPs and bytes of every op, each collective's link time) is kept here.
    """

    schedule: ScheduledModule
    windows: list
    mesh: object
    chip: ChipProfile
    work: dict = field(default_factory=dict)  # (computation, name) -> (matmul FLOPs, HBM bytes)
    links: dict = field(default_factory=dict)  # id(window) -> (seconds, network, placement, mesh axes, bytes)
    # read deeper than compiled (`lab.predict.depth`): loops run more often, ops and transfers grow
    trips: dict = field(default_factory=dict)  # (computation, while) -> trips run instead of its own
    scale: dict = field(default_factory=dict)  # (computation, instruction) -> factor on its FLOPs and bytes

    def read_as(self, trips: dict, scale: dict) -> ReadSchedule:
        """The same program with loops run `trips` times and ops scaled by `scale` (`lab.predict.depth`)."""
        return replace(self, trips=dict(trips), scale=dict(scale), work={}, links={})

    def predict(self, efficiency: Efficiency, precision: str = "bf16") -> StepPrediction:
        """The step priced at `efficiency`, its matmuls at the chip's `precision` peak (see `_Simulator`)."""
        simulator = _Simulator(self, efficiency, precision)
        total = simulator.run(self.schedule.entry, 1)
        prediction = StepPrediction(total, simulator.compute_s, simulator.matmul_flops, simulator.op_list(), [])
        prediction.comms = simulator.comm_list()
        return prediction


def read_schedule(hlo_text: str, mesh, chip: ChipProfile) -> ReadSchedule:
    """Parse scheduled `hlo_text` compiled over `mesh` and find its async windows (see `ReadSchedule`)."""
    # local: lab.mesh.slice_local_shape names the one slice's program libtpu compiles
    from lab.mesh import slice_local_shape

    schedule = parse_schedule(hlo_text)
    report = overlap_report(hlo_text, chip, mesh_shape=slice_local_shape(mesh), axis_names=mesh.axis_names)
    return ReadSchedule(schedule, list(report.windows), mesh, chip)


class _Simulator:
    """The compute stream and the links, walked through the schedule (see the module docstring)."""

    def __init__(self, read: ReadSchedule, efficiency: Efficiency, precision: str = "bf16"):
        self.schedule, self.mesh, self.chip, self.efficiency = read.schedule, read.mesh, read.chip, efficiency
        self.matmul_peak = read.chip.matmul_peak(precision)
        self._work, self._comm_seconds = read.work, read.links
        self._trips, self._scale = read.trips, read.scale
        self.starts: dict[tuple[str, str], Window] = {}
        self.dones: dict[tuple[str, str], Window] = {}
        for w in read.windows:
            self.starts[(w.computation, w.start)] = w
            self.dones[(w.computation, w.done)] = w
        self.compute_s = 0.0
        self.matmul_flops = 0.0
        self._ops: dict[tuple[str, str], list] = {}
        self._comms: dict[int, list] = {}
        self._host: dict[tuple[str, str], list] = {}  # DMA start -> [link, bytes, seconds, runs, exposed]
        self._counting = True

    # --- the walk ----------------------------------------------------------------------

    def run(self, computation: str, runs: int) -> float:
        """Seconds one run of `computation` takes; its ops and collectives are recorded `runs` times."""
        clock = _Clock()
        self._walk(computation, clock, runs)
        clock.drain()
        return clock.t

    def _walk(self, computation: str, clock: _Clock, runs: int) -> None:
        for instruction in self.schedule.computations.get(computation, ()):
            key = (computation, instruction.name)
            if key in self.starts:
                self._start(self.starts[key], clock, runs)
            if instruction.opcode in _TRANSFERS:
                self._transfer_start(key, instruction, clock)
            elif instruction.opcode in _TRANSFER_DONES and instruction.operands:
                self._transfer_done((computation, instruction.operands[0]), clock, runs)
            elif instruction.opcode == "while":
                self._loop(computation, instruction, clock, runs)
            elif instruction.opcode in ("call", "conditional"):
                for callee in instruction.callees:
                    self._walk(callee, clock, runs)
            else:
                clock.t += self._price(computation, instruction, runs)
            if key in self.dones:
                self._done(self.dones[key], clock, runs)

    def _loop(self, computation: str, instruction: Instruction, clock: _Clock, runs: int) -> None:
        body = instruction.attr(r"\bbody=%?([\w.\-]+)")
        trips = self._trips.get((computation, instruction.name)) or trip_count(self.schedule, instruction)
        if not body or trips < 1:
            return
        inner = _Clock()
        counting, self._counting = self._counting, False
        self._walk(body, inner, 0)  # a first pass: fills the links as the previous iteration would
        self._counting = counting
        before = inner.t
        self._walk(body, inner, runs * trips)
        clock.t += trips * (inner.t - before)

    # --- compute -----------------------------------------------------------------------

    def _price(self, computation: str, instruction: Instruction, runs: int) -> float:
        if instruction.opcode in _FREE:
            return 0.0
        key = (computation, instruction.name)
        if key not in self._work:
            moved = 0.0
            if not _communicates(self.schedule, instruction):
                moved = op_bytes(self.schedule, computation, instruction)
            factor = self._scale.get(key, 1.0)
            self._work[key] = (factor * op_flops(self.schedule, computation, instruction), factor * moved)
        matmul, moved = self._work[key]
        # a quantized step (AQT int8, fp8) runs its dots and convolutions at the precision's peak; an attention
        # kernel (a custom call) stays bf16, as MaxText quantizes the projections and MLPs, not the attention
        peak = self.chip.peak_bf16_flops if instruction.opcode == "custom-call" else self.matmul_peak
        compute = matmul / (peak * self.efficiency.matmul)
        memory = moved / (self.chip.hbm_bandwidth * self.efficiency.hbm)
        seconds = max(compute, memory)
        if self._counting and runs:
            self.compute_s += seconds * runs
            self.matmul_flops += matmul * runs
            entry = self._ops.setdefault(key, [instruction, 0, matmul, moved, 0.0, 0, 0])
            entry[1] += runs
            entry[4] += seconds * runs
            entry[5] += compute * runs
            entry[6] += memory * runs
        return seconds

    # --- communication -----------------------------------------------------------------

    def _seconds(self, window: Window) -> tuple[float, str, str]:
        key = id(window)
        if key not in self._comm_seconds:
            c = window.collective
            size = int(c.size_bytes * self._scale.get((window.computation, window.start), 1.0))
            if not c.axes and not c.across_slices:
                self._comm_seconds[key] = (0.0, "chip", "no mesh axes", (), size)
            else:
                where = program_placement(self.mesh, c, self.chip)
                cost = predict(c.kind, size, where, self.chip)
                self._comm_seconds[key] = (cost.seconds if cost else 0.0, where.network, str(where), where.axes, size)
        return self._comm_seconds[key]

    def _start(self, window: Window, clock: _Clock, runs: int) -> None:
        seconds, network, *_ = self._seconds(window)
        if not window.is_async:
            clock.t += seconds
            self._record(window, runs, seconds)
            return
        begin = max(clock.t, clock.links.get(network, 0.0))
        clock.links[network] = begin + seconds
        clock.inflight[id(window)] = begin + seconds

    def _done(self, window: Window, clock: _Clock, runs: int) -> None:
        if not window.is_async:
            return
        end = clock.inflight.pop(id(window), None)
        wait = 0.0 if end is None else max(0.0, end - clock.t)  # None: started before this pass began
        clock.t += wait
        self._record(window, runs, wait)

    def _transfer_start(self, key: tuple[str, str], instruction: Instruction, clock: _Clock) -> None:
        transfer = _host_transfer(instruction)
        if transfer is None:
            return
        direction, size = transfer
        size = int(size * self._scale.get(key, 1.0))
        bandwidth = self.chip.host_bandwidth
        seconds = size / bandwidth if bandwidth else 0.0  # a chip without a PCIe figure: transfers taken as free
        link = f"PCIe {direction}"
        begin = max(clock.t, clock.links.get(link, 0.0))
        clock.links[link] = begin + seconds
        clock.transfers[key] = begin + seconds
        self._host.setdefault(key, [link, size, seconds, 0, 0.0])

    def _transfer_done(self, key: tuple[str, str], clock: _Clock, runs: int) -> None:
        end = clock.transfers.pop(key, None)
        if end is None:
            return
        wait = max(0.0, end - clock.t)
        clock.t += wait
        if self._counting and runs:
            entry = self._host[key]
            entry[3] += runs
            entry[4] += wait * runs

    def _record(self, window: Window, runs: int, exposed: float) -> None:
        if not (self._counting and runs):
            return
        entry = self._comms.setdefault(id(window), [window, 0, 0.0])
        entry[1] += runs
        entry[2] += exposed * runs

    # --- results -----------------------------------------------------------------------

    def op_list(self) -> list[OpCost]:
        out = []
        for (computation, name), (instruction, runs, matmul, moved, seconds, compute, memory) in self._ops.items():
            op_name = instruction.metadata.get("op_name") or instruction.opcode  # attr() leaves metadata out
            out.append(OpCost(name, computation, op_name, runs, matmul, moved, seconds, compute, memory))
        return out

    def comm_list(self) -> list[CommCost]:
        out = []
        for window, runs, exposed in self._comms.values():
            seconds, network, link, axes, size = self._seconds(window)
            c = window.collective
            out.append(
                CommCost(
                    c.kind,
                    tuple(axes),
                    network,
                    link,
                    size,
                    runs,
                    seconds * runs,
                    exposed,
                    window.is_async,
                    window.start,
                )
            )
        for (_, name), (link, size, seconds, runs, exposed) in self._host.items():
            out.append(CommCost("host transfer", (), "pcie", link, size, runs, seconds * runs, exposed, True, name))
        return out


@dataclass
class _Clock:
    t: float = 0.0
    links: dict[str, float] = field(default_factory=dict)  # when each network is free again
    inflight: dict[int, float] = field(default_factory=dict)  # window -> when its bytes arrive
    transfers: dict[tuple[str, str], float] = field(default_factory=dict)  # host DMA start -> when it is done

    def drain(self) -> None:
        """The step ends when its last transfer has arrived."""
        pending = [*self.inflight.values(), *self.transfers.values()]
        if pending:
            self.t = max(self.t, *pending)


def score_ops(read: ReadSchedule, step: StepPrediction, seq: int, heads: int) -> list[OpCost]:
    """The priced ops on XLA attention's scores: the scores, their mask and softmax, their gradients and the dots that
    make or read them, which a flash kernel computes block by block on chip without an S x S array in HBM.

    XLA lays the scores out as it fuses them: [b, h, S, T]; a grouped query's [b, g, r, S, T] or [b, g, S, r, T]; a
    dot's [g, S, r·T]. An op is on them when one of its arrays has two dimensions of the sequence and at least the
    elements of one sequence's scores over the chip's `heads` (an activation [b, S, D] whose width D is the sequence
    length has b·S², not heads·S²); or when it hands such an op, or takes from one, a value of as many elements as
    those scores (the dot whose [g, S, r·T] output the softmax's reductions read)."""
    instructions = {(i.computation, i.name): i for c in read.schedule.computations.values() for i in c}
    priced = {(op.computation, op.name): op for op in step.ops if (op.computation, op.name) in instructions}

    def on_scores(dims: tuple[int, ...]) -> bool:
        return dims.count(seq) >= 2 and math.prod(dims) >= heads * seq * seq

    found, sizes, edges = set(), set(), []  # edges: (reader, the op whose value it reads, that value's elements)
    for key in priced:
        instruction, shapes = instructions[key], read.schedule.shapes(key[0])
        for text in (instruction.shape, *(shapes.get(o, "") for o in instruction.operands)):
            for _, dims in arrays(text):
                if on_scores(dims):
                    found.add(key)
                    sizes.add(math.prod(dims))
        for operand in instruction.operands:
            elements = {math.prod(dims) for _, dims in arrays(shapes.get(operand, ""))}
            edges += [(key, source, elements) for source in _sources(instructions, key[0], operand)]
    on = frozenset(found)
    for reader, source, elements in edges:
        if elements & sizes and (reader in on) != (source in on):
            found |= {reader, source} & priced.keys()
    return [op for op in step.ops if (op.computation, op.name) in found]


_PASS_THROUGH = {"get-tuple-element", "bitcast", "copy", "reshape", "transpose"}


def _sources(instructions: dict, computation: str, name: str) -> set[tuple[str, str]]:
    """The instructions whose values `name` is, followed back through tuple elements and relayouts."""
    found, todo = set(), [name]
    while todo:
        operand = instructions.get((computation, todo.pop()))
        if operand is None:
            continue
        if operand.opcode in _PASS_THROUGH:
            todo.extend(operand.operands)
        else:
            found.add((computation, operand.name))
    return found


def trip_count(schedule: ScheduledModule, instruction: Instruction) -> int:
    """How often a while loop runs (`lab.hlo.loops`); once when its count is unknown."""
    condition = instruction.attr(r"\bcondition=%?([\w.\-]+)")
    return loops.trip_count(instruction, schedule.computations.get(condition or "", ())) or 1


def op_flops(schedule: ScheduledModule, computation: str, instruction: Instruction) -> float:
    """Matmul FLOPs of one instruction: dots and convolutions through fusions; a Pallas kernel from its shapes."""
    if instruction.opcode == "custom-call":
        return _kernel_flops(schedule, computation, instruction)
    if instruction.opcode == "dot":
        return flops(schedule, computation, instruction)
    if instruction.opcode == "convolution":
        return convolution_flops(schedule, computation, instruction)
    if instruction.opcode in ("while", "call", "conditional"):
        return 0.0  # the simulator walks these itself
    return sum(
        op_flops(schedule, callee, i) for callee in instruction.callees for i in schedule.computations.get(callee, ())
    )


def convolution_flops(schedule: ScheduledModule, computation: str, instruction: Instruction) -> float:
    """2 · output batch · output features · kernel input features · the real (unpadded) taps of every window.

    The TPU compiler writes many dots as convolutions whose windows run mostly over padding (a [.., 1] input,
    a window of 64 padded 63 on each side: each output reads one real element), or over the holes of a dilated
    input (a batched matmul's batch of 8 as a spatial dimension dilated 8 times, window 8, stride 7: each output
    reads one of the 8 taps), so the taps are counted per spatial dimension as the (output, tap) pairs that land
    on a real input element, not as the window's size.
    """
    shapes = schedule.shapes(computation)
    lhs = arrays(shapes.get(instruction.operands[0], ""))
    rhs = arrays(shapes.get(instruction.operands[1], ""))
    out = arrays(instruction.shape)
    labels = instruction.attr(r"dim_labels=(\w+_\w+->\w+)")
    if not (lhs and rhs and out and labels):
        return 0.0
    lhs_labels, rest = labels.split("_")
    rhs_labels, out_labels = rest.split("->")
    lhs_dims, rhs_dims, out_dims = lhs[0][1], rhs[0][1], out[0][1]
    window = _window(instruction.attributes.get("window", "").strip("{} "))  # as written: its blanks separate
    macs = out_dims[out_labels.index("b")] * out_dims[out_labels.index("f")] * rhs_dims[rhs_labels.index("i")]
    for d in range(len(lhs_labels) - 2):
        n = lhs_dims[lhs_labels.index(str(d))]
        w = rhs_dims[rhs_labels.index(str(d))]
        n_out = out_dims[out_labels.index(str(d))]
        lo = window["pad"][d][0] if d < len(window["pad"]) else 0
        stride, dilation, holes = (
            window[k][d] if d < len(window[k]) else 1 for k in ("stride", "rhs_dilate", "lhs_dilate")
        )
        macs *= _taps(n, w, n_out, lo, stride, dilation, holes)
    return 2.0 * macs


def _window(text: str) -> dict[str, list]:
    found: dict[str, list] = {"pad": [], "stride": [], "rhs_dilate": [], "lhs_dilate": []}
    for part in text.split():
        key, _, value = part.partition("=")
        if key == "pad":
            found["pad"] = [tuple(int(x) for x in p.split("_")) for p in value.split("x")]
        elif key in ("stride", "rhs_dilate", "lhs_dilate"):
            found[key] = [int(x) for x in value.split("x")]
    return found


def _taps(n: int, w: int, n_out: int, lo: int, stride: int, dilation: int, holes: int = 1) -> int:
    """(output, tap) pairs of one spatial dimension whose position o·stride + k·dilation - lo in the input, dilated
    `holes` times ((n - 1)·holes + 1 positions, a real element at every multiple of `holes`), is a real element.

    Counted for all w taps at once (a window may span a whole sequence of rows: hundreds of thousands of taps).
    """
    offset = np.arange(w, dtype=np.int64) * dilation - lo  # tap k reads input position o·stride + offset
    extent = (n - 1) * holes + 1
    first = np.maximum(0, -(offset // stride))  # the first output whose position is >= 0: ceil(-offset / stride)
    last = np.minimum(n_out, -((offset - extent) // stride))  # one past the last below extent
    if holes == 1:
        return int(np.maximum(0, last - first).sum())
    # outputs o with o·stride + offset a multiple of `holes`: none unless gcd(stride, holes) divides the offset,
    # else one residue class o0 modulo holes / gcd, o0 = (-offset / gcd) · (stride / gcd)^-1
    g = math.gcd(stride, holes)
    period = holes // g
    inverse = pow(stride // g, -1, period) if period > 1 else 0
    o0 = ((-offset // g) % period) * inverse % period
    hits = (last - 1 - o0) // period - (first - 1 - o0) // period  # o = o0 (mod period) in [first, last)
    return int(np.where((offset % g == 0) & (last > first), hits, 0).sum())


def _kernel_flops(schedule: ScheduledModule, computation: str, instruction: Instruction) -> float:
    target = instruction.attr(r'custom_call_target="([^"]+)"') or ""
    if target.startswith("__cublas"):
        return _gemm_flops(schedule.shapes(computation), instruction)
    if "tpu_custom_call" not in target:
        return 0.0
    if instruction.name.startswith("splash"):
        return _splash_flops(schedule.shapes(computation), instruction)
    if "gmm" in instruction.name:
        return _grouped_flops(schedule.shapes(computation), instruction)
    units = next((u for key, u in _FLASH_UNITS if key in instruction.name), 0)
    q = arrays(schedule.shapes(computation).get(instruction.operands[0], "")) if instruction.operands else []
    if not units or not q or len(q[0][1]) != 4:
        return 0.0
    b, h, s, k = q[0][1]
    block = int(instruction.attr(r"block_q(?:_major)?_(\d+)") or 128)
    blocks = max(1, math.ceil(s / block))
    causal = (blocks + 1) / (2 * blocks) if "causal" in instruction.name or units else 1.0
    return units * b * h * s * s * k * causal


def _gemm_flops(shapes: dict[str, str], instruction: Instruction) -> float:
    """A cuBLAS GEMM's matmul FLOPs (XLA:GPU's ``__cublas$gemm`` / ``__cublas$lt$matmul`` custom calls, where
    ``--xla_gpu_enable_triton_gemm=false`` puts its dots): 2 · its result's elements (the first array of its
    output; the second is cuBLAS's workspace) · the lhs's contracted dimensions, as its backend config names them."""
    out = arrays(instruction.shape)
    lhs = arrays(shapes.get(instruction.operands[0], "")) if instruction.operands else []
    contracting = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', instruction.attrs)
    if not out or not lhs or contracting is None:
        return 0.0
    dims = [int(d) for d in re.findall(r"\d+", contracting.group(1))]
    return 2.0 * math.prod(out[0][1]) * math.prod(lhs[0][1][d] for d in dims)


def _grouped_flops(shapes: dict[str, str], instruction: Instruction) -> float:
    """A megablox grouped matmul's FLOPs (``gmm``: rows [m, k] by their experts' [k, n]; ``tgmm``, the weights'
    gradient: rows [m, k] and [m, n] into [E, k, n]): its grid steps times one step's blocks, read from the
    kernel's Mosaic module (`lab.hlo.mosaic`). A step multiplies a (tm, tk) block by a (tk, tn) one whole, so
    2·tm·tk·tn = 2·sqrt(the three blocks' sizes multiplied): where k or n is no multiple of its tile the last
    tile is computed whole (masked, not skipped). The grid's row-tile dimension is set when it runs; its
    operands bound it: after the tile count, the group offsets [E + 1] and the tiles' group ids [V],
    V = m/tm + E - 1, a visit more for each expert whose rows start inside a tile (with the tokens' choices unknown
    when compiling, every one of them: a tile-aligned boundary is a 1-in-tm chance). Without a readable module:
    2·m·k·n x V / (m/tm), the operands' sizes."""
    operands = [arrays(shapes.get(o, "")) for o in instruction.operands]
    out = arrays(instruction.shape)
    if len(operands) < 6 or not out or not all(operands[i] for i in (1, 2, 5)) or len(operands[5][0][1]) != 2:
        return 0.0
    groups, visits = operands[1][0][1][0] - 1, operands[2][0][1][0]
    kernel = mosaic.kernel(instruction.attrs)
    if kernel is not None and len(kernel.blocks) >= 3:
        steps = math.prod(visits if bound is None else bound for bound in kernel.grid)
        lhs, rhs, result = (math.prod(b) for b in (kernel.blocks[0], kernel.blocks[1], kernel.blocks[-1]))
        return 2.0 * steps * math.sqrt(lhs * rhs * result)
    (m, k), n = operands[5][0][1], out[0][1][-1]
    return 2.0 * m * k * n * visits / max(1, visits - groups + 1)


def _splash_flops(shapes: dict[str, str], instruction: Instruction) -> float:
    """A splash kernel's matmul FLOPs: its units (as the flash kernel's) times b·h·S·T·K of its queries (the first
    floating [b, h, S, K] operand, after the mask's integer tables: bf16, or f32 at --compute-dtype float32) times
    the blocks it computes. Its first operand, the mask's block table [1, n, m], says how many: a causal mask keeps
    the n x n grid and skips the (n - 1)/2n above the diagonal; a sliding window shrinks the grid to the m blocks a
    row reaches."""
    units = next((u for key, u in _SPLASH_UNITS if key in instruction.name), 0)
    operands = [arrays(shapes.get(o, "")) for o in instruction.operands]
    queries = [a[0][1] for a in operands if a and len(a[0][1]) in (3, 4) and a[0][0].startswith(("bf", "f"))]
    grid = operands[0][0][1][-2:] if operands and operands[0] and len(operands[0][0][1]) == 3 else ()
    if not units or not queries or len(grid) != 2:
        return 0.0
    *batch, h, s, k = queries[0]
    n = max(grid)
    live = min((n + 1) / (2 * n), grid[0] * grid[1] / n**2)
    return units * math.prod(batch) * h * s * s * k * live


def op_bytes(schedule: ScheduledModule, computation: str, instruction: Instruction) -> float:
    """HBM bytes an instruction reads and writes (see the module docstring for sliced and in-place operands)."""
    shapes = schedule.shapes(computation)
    callee = instruction.callees[0] if instruction.opcode == "fusion" and instruction.callees else None
    body = schedule.computations.get(callee or "", ())
    read = 0.0
    sliced = _sliced_parameters(body, schedule) if body else {}
    for index, operand in enumerate(instruction.operands):
        read += sliced.get(index, _nbytes(shapes.get(operand, "")))
    written = _nbytes(instruction.shape)
    updates = [i for i in body if i.opcode == "dynamic-update-slice"]
    if updates:
        inner = schedule.shapes(callee)
        update_bytes = sum(_nbytes(inner.get(u.operands[1], "")) for u in updates)
        buffers = sum(_nbytes(inner.get(u.operands[0], "")) for u in updates)
        read -= buffers  # the buffer updated in place is neither read nor written whole
        written = max(0.0, written - buffers) + update_bytes
    return max(0.0, read) + written


def _sliced_parameters(body, schedule: ScheduledModule | None = None) -> dict[int, float]:
    """Fusion parameters read only through slices (here or in a fusion nested inside): index -> bytes read."""
    users: dict[str, list[tuple[Instruction, int]]] = defaultdict(list)
    for i in body:
        for position, operand in enumerate(i.operands):
            users[operand].append((i, position))
    out = {}
    for i in body:
        if i.opcode != "parameter":
            continue
        found = re.search(r"\bparameter\((\d+)\)", i.line)
        number = int(found.group(1)) if found else -1
        total, sliced = 0.0, True
        for reader, position in _through_relayouts(i.name, users, schedule):
            if reader.opcode in _SLICING and position == 0:  # the array sliced (not an index into it)
                total += _nbytes(reader.shape)
                continue
            inner = _nested(reader, schedule)
            if inner is not None and position in inner:
                total += inner[position]
                continue
            sliced = False
            break
        if sliced and total:
            out[number] = total
    return out


def _nested(reader: Instruction, schedule: ScheduledModule | None) -> dict[int, float] | None:
    if schedule is None or reader.opcode != "fusion" or not reader.callees:
        return None
    return _sliced_parameters(schedule.computations.get(reader.callees[0], ()), schedule)


def _through_relayouts(name: str, users, schedule: ScheduledModule | None) -> list[tuple[Instruction, int]]:
    """The readers of `name`, looking through bitcasts, copies and fusions that only copy (a change of tiling):
    the TPU compiler writes a saved stack's relayout before the slice it takes, and reads only that slice."""
    found = []
    for user, position in users.get(name, ()):
        passes = user.opcode in ("bitcast", "copy") or _relayout(user, schedule)
        found += _through_relayouts(user.name, users, schedule) if passes else [(user, position)]
    return found


def _relayout(instruction: Instruction, schedule: ScheduledModule | None) -> bool:
    """A fusion of one operand whose body only copies or bitcasts it (XLA's ``copy_fusion``)."""
    if schedule is None or instruction.opcode != "fusion" or len(instruction.operands) != 1:
        return False
    body = schedule.computations.get(instruction.callees[0] if instruction.callees else "", ())
    return bool(body) and all(i.opcode in ("parameter", "copy", "bitcast") for i in body)


def _nbytes(shape: str) -> float:
    return float(nbytes(arrays(shape))) if shape else 0.0
