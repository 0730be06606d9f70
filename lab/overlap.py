"""Overlapping communication with compute: collective matmul, and what a schedule hides.

A step that computes for C seconds and communicates for T seconds takes C + T
when one waits for the other, and max(C, T) when they run at once: overlap
hides min(C, T) and never removes bytes. Two halves:

1. **Collective matmul** (Wang et al. 2023, "Overlap Communication with
   Dependent Computation via Decomposition in Large Deep Learning Models",
   ASPLOS; the scaling book, Part 3, "collective matmul"). ``all_gather(X) @ W``
   must wait for the whole gather before the matmul starts. Cut it into N
   block products instead: each ring step multiplies the block a device holds
   while the next block travels, one ``ppermute`` per step, so only the first
   block's product and the last transfer stay exposed. The bidirectional
   variant sends blocks both ways round the ring and needs floor(N/2) steps;
   ``reduce_scatter(X @ W)`` works the same way backwards: each step adds the
   block product a partial sum needs while that partial sum travels.

2. **Overlap windows** of a compiled program. In scheduled HLO an async
   collective is a ``-start`` and a ``-done`` (on TPU also an "async collective
   fusion" chain: start, continuations that carry compute, done); whatever the
   scheduler put between them runs while the bytes travel. For each window the
   compute between is priced with a roofline, max(FLOPs / peak, bytes / HBM
   bandwidth) on a chip profile, the collective with `lab.theory`, and
   hidden = min(compute, communication). A synchronous collective hides nothing.
   Windows can nest, and each is credited with all the compute inside it: an
   upper bound when several collectives share the same compute. The order is
   the schedule only in a scheduled module (``is_scheduled=true``), which is
   what ``compiled.as_text()`` gives on CPU and TPU.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from lab.collectives import ring_pairs, send
from lab.errors import LabError
from lab.hlo import HEADER, INSTRUCTION

# ------------------------------------------------------------------ collective matmul
# Inside shard_map, on one device. x_MK is this device's rows (all-gather) or
# columns (reduce-scatter) of X; w_KF its piece of W.


def ring_allgather_matmul(x_MK: jax.Array, w_KF: jax.Array, axis: str) -> jax.Array:
    """all_gather(x, axis) @ w as N block products on a ring: (N*M, F).

    At step s a device holds the rows of device (me - s) and multiplies them
    while sending them on to device me + 1.
    """
    n, me = lax.axis_size(axis), lax.axis_index(axis)
    out_NMF = jnp.zeros((n, x_MK.shape[0], w_KF.shape[1]), jnp.result_type(x_MK, w_KF))
    block_MK = x_MK
    for step in range(n):
        # issued before the product so that the transfer and the dot are independent
        incoming_MK = send(block_MK, axis, ring_pairs(n, 1)) if step < n - 1 else None
        out_NMF = lax.dynamic_update_index_in_dim(out_NMF, block_MK @ w_KF, (me - step) % n, axis=0)
        block_MK = incoming_MK
    return out_NMF.reshape(n * x_MK.shape[0], w_KF.shape[1])


def bidirectional_allgather_matmul(x_MK: jax.Array, w_KF: jax.Array, axis: str) -> jax.Array:
    """all_gather(x) @ w with blocks travelling both ways: floor(N/2) steps, each block the short way.

    Step s brings the rows of device me - s from the left and of me + s from
    the right; for even N the block opposite arrives once, from the left.
    """
    n, me = lax.axis_size(axis), lax.axis_index(axis)
    out_NMF = jnp.zeros((n, x_MK.shape[0], w_KF.shape[1]), jnp.result_type(x_MK, w_KF))
    from_left_MK = from_right_MK = x_MK
    out_NMF = lax.dynamic_update_index_in_dim(out_NMF, x_MK @ w_KF, me, axis=0)
    for step in range(1, n // 2 + 1):
        from_left_MK = send(from_left_MK, axis, ring_pairs(n, 1))
        out_NMF = lax.dynamic_update_index_in_dim(out_NMF, from_left_MK @ w_KF, (me - step) % n, axis=0)
        if 2 * step != n:
            from_right_MK = send(from_right_MK, axis, ring_pairs(n, -1))
            out_NMF = lax.dynamic_update_index_in_dim(out_NMF, from_right_MK @ w_KF, (me + step) % n, axis=0)
    return out_NMF.reshape(n * x_MK.shape[0], w_KF.shape[1])


def ring_matmul_reduce_scatter(x_MK: jax.Array, w_KF: jax.Array, axis: str) -> jax.Array:
    """reduce_scatter(x @ w, axis) over rows, on a ring: (M/N, F).

    A partial sum for row block b travels the ring; each device adds its own
    product for block b, computed just before it is needed, so the product of
    the next step overlaps the transfer. After N-1 steps device i holds block i.
    """
    n, me = lax.axis_size(axis), lax.axis_index(axis)
    rows = x_MK.shape[0] // n

    def product(block) -> jax.Array:
        return lax.dynamic_slice_in_dim(x_MK, (block % n) * rows, rows, axis=0) @ w_KF

    partial_sum_MF = product(me - 1)
    for step in range(n - 1):
        partial_sum_MF = send(partial_sum_MF, axis, ring_pairs(n, 1)) + product(me - step - 2)
    return partial_sum_MF


def plain_allgather_matmul(x_MK: jax.Array, w_KF: jax.Array, axis: str) -> jax.Array:
    """The reference twin: gather everything, then one matmul."""
    return lax.all_gather(x_MK, axis, axis=0, tiled=True) @ w_KF


def plain_matmul_reduce_scatter(x_MK: jax.Array, w_KF: jax.Array, axis: str) -> jax.Array:
    """The reference twin: one matmul, then one reduce-scatter."""
    return lax.psum_scatter(x_MK @ w_KF, axis, scatter_dimension=0, tiled=True)


@dataclass(frozen=True)
class MatmulVariant:
    """One way to compute a sharded matmul: its shard_map body and its global layouts."""

    name: str
    local: Callable[[jax.Array, jax.Array, str], jax.Array]
    x_spec: Callable[[str], P]  # axis -> how X [M, K] is split
    w_spec: Callable[[str], P]  # axis -> how W [K, F] is split
    out_spec: Callable[[str], P]  # axis -> how Y [M, F] is split
    plain: str  # the variant with the same result computed the plain way


def _rows(axis: str) -> P:
    return P(axis, None)


def _columns(axis: str) -> P:
    return P(None, axis)


VARIANTS: dict[str, MatmulVariant] = {
    v.name: v
    for v in (
        MatmulVariant(
            "all-gather then matmul", plain_allgather_matmul, _rows, _columns, _columns, "all-gather then matmul"
        ),
        MatmulVariant(
            "ring all-gather matmul", ring_allgather_matmul, _rows, _columns, _columns, "all-gather then matmul"
        ),
        MatmulVariant(
            "bidirectional all-gather matmul",
            bidirectional_allgather_matmul,
            _rows,
            _columns,
            _columns,
            "all-gather then matmul",
        ),
        MatmulVariant(
            "matmul then reduce-scatter",
            plain_matmul_reduce_scatter,
            _columns,
            _rows,
            _rows,
            "matmul then reduce-scatter",
        ),
        MatmulVariant(
            "ring matmul reduce-scatter",
            ring_matmul_reduce_scatter,
            _columns,
            _rows,
            _rows,
            "matmul then reduce-scatter",
        ),
    )
}


@dataclass(frozen=True)
class MatmulProgram:
    """A variant over one mesh axis as a jitted global program Y = X @ W, with its input layouts."""

    variant: MatmulVariant
    mesh: Mesh
    axis: str
    shape_MKF: tuple[int, int, int]
    dtype: np.dtype
    fn: Callable[[jax.Array, jax.Array], jax.Array]

    def abstract_inputs(self) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
        m, k, f = self.shape_MKF
        x_sharding = NamedSharding(self.mesh, self.variant.x_spec(self.axis))
        w_sharding = NamedSharding(self.mesh, self.variant.w_spec(self.axis))
        return (
            jax.ShapeDtypeStruct((m, k), self.dtype, sharding=x_sharding),
            jax.ShapeDtypeStruct((k, f), self.dtype, sharding=w_sharding),
        )

    def example_inputs(self, seed: int = 0) -> tuple[jax.Array, jax.Array]:
        """Random X and W placed as `fn` expects."""
        rng = np.random.default_rng(seed)
        return tuple(
            jax.device_put(rng.standard_normal(a.shape).astype(self.dtype), a.sharding) for a in self.abstract_inputs()
        )

    @property
    def flops(self) -> int:
        """2MKF: the matmul's FLOPs over all devices."""
        m, k, f = self.shape_MKF
        return 2 * m * k * f


def build_matmul(variant: str, mesh: Mesh, axis: str, shape_MKF: Sequence[int], dtype=np.float32) -> MatmulProgram:
    """`variant` (one of VARIANTS) of Y[M,F] = X[M,K] @ W[K,F] over mesh `axis`, jitted."""
    if variant not in VARIANTS:
        raise LabError(f"unknown matmul variant {variant!r}; choose one of: {', '.join(VARIANTS)}")
    if axis not in mesh.axis_names:
        raise LabError(f"axis {axis!r} is not a mesh axis; use one of {', '.join(mesh.axis_names)}")
    chosen, n = VARIANTS[variant], mesh.shape[axis]
    m, k, f = (int(d) for d in shape_MKF)
    _check_divides(chosen, n, axis, (m, k, f))
    program = jax.shard_map(
        partial(chosen.local, axis=axis),
        mesh=mesh,
        in_specs=(chosen.x_spec(axis), chosen.w_spec(axis)),
        out_specs=chosen.out_spec(axis),
    )
    return MatmulProgram(chosen, mesh, axis, (m, k, f), np.dtype(dtype), jax.jit(program))


def _check_divides(variant: MatmulVariant, n: int, axis: str, shape_MKF: tuple[int, int, int]) -> None:
    """Every split dimension must be a multiple of the ring's N (the reduce-scatter also cuts M)."""
    m, k, f = shape_MKF
    needs = {"M": m, "F": f} if variant.x_spec(axis) == _rows(axis) else {"M": m, "K": k}
    for name, size in needs.items():
        if size < 1 or size % n:
            raise LabError(
                f"{variant.name}: {name}={size} is not a positive multiple of "
                f"{n}, the size of the ring axis {axis!r}; choose {name} divisible "
                f"by {n}"
            )


# ------------------------------------------------------------------ scheduled HLO
# A scheduled module (``is_scheduled=true``) lists each computation's
# instructions in the order they run; that order is all the analysis needs.

_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([\d,]*)\]")
_CALLEES = re.compile(r"\b(?:calls|body)=%?([\w.\-]+)")
_COLLECTIVE_OPCODES = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
    "collective-broadcast",
    "ragged-all-to-all",
)
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
    "opt-barrier",
    "custom-call",
}


@dataclass(frozen=True)
class Instruction:
    """One scheduled HLO instruction: enough to price it and follow its calls."""

    name: str
    opcode: str
    shape: str
    operands: tuple[str, ...]
    callees: tuple[str, ...]
    attrs: str

    def attr(self, pattern: str) -> str | None:
        match = re.search(pattern, self.attrs)
        return match.group(1) if match else None


@dataclass(frozen=True)
class Schedule:
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


def parse_schedule(hlo_text: str) -> Schedule:
    """The computations of an HLO module's text, instructions in the order printed (the schedule, once scheduled)."""
    computations: dict[str, list[Instruction]] = {}
    entry, current = "", None
    for line in hlo_text.splitlines():
        if not line.startswith((" ", "\t")):
            header = HEADER.match(line) if line.rstrip().endswith("{") else None
            if header:
                current = computations.setdefault(header["name"], [])
                entry = header["name"] if line.startswith("ENTRY") else entry
            continue
        match = INSTRUCTION.match(line) if current is not None else None
        if match:
            current.append(_instruction(match))
    if not entry:
        raise LabError("this HLO text has no ENTRY computation; pass the whole module, e.g. compiled.as_text()")
    return Schedule(entry, {name: tuple(body) for name, body in computations.items()})


def _instruction(match: re.Match) -> Instruction:
    rest = match["rest"]
    depth, end = 1, len(rest)
    for index, char in enumerate(rest):  # the operand list ends at the ')' that closes it
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0:
            end = index
            break
    operands = tuple(re.findall(r"%([\w.\-]+)", rest[:end]))
    attrs = rest[end + 1 :]
    return Instruction(match["name"], match["opcode"], match["shape"], operands, tuple(_CALLEES.findall(attrs)), attrs)


def _arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    return [(dtype, tuple(int(d) for d in dims.split(",") if d)) for dtype, dims in _ARRAY.findall(shape)]


def _nbytes(shape: str) -> int:
    width = {"pred": 8}
    return sum(
        math.prod(dims)
        * width.get(dtype, int(re.search(r"\d+", dtype).group()) if re.search(r"\d+", dtype) else 0)
        // 8
        for dtype, dims in _arrays(shape)
    )


# ------------------------------------------------------------------ pricing compute


def flops(schedule: Schedule, computation: str, instruction: Instruction) -> float:
    """FLOPs of the matmuls in `instruction` (dots and convolutions, through fusions; a loop body times its known trip count)."""
    if instruction.opcode == "dot":
        lhs = _arrays(schedule.shapes(computation).get(instruction.operands[0], ""))
        contracting = instruction.attr(r"lhs_contracting_dims=\{([\d,]*)\}") or ""
        inner = math.prod(lhs[0][1][int(d)] for d in contracting.split(",") if d) if lhs else 0
        return 2.0 * _elements(instruction.shape) * inner
    if instruction.opcode == "convolution":
        return 2.0 * _elements(instruction.shape) * _kernel_inputs(schedule, computation, instruction)
    inside = sum(
        flops(schedule, callee, i) for callee in instruction.callees for i in schedule.computations.get(callee, ())
    )
    return inside * _trips(instruction)


def _trips(instruction: Instruction) -> int:
    """How often a while loop runs its body (1 for anything else, and for a loop whose count XLA does not know)."""
    if instruction.opcode != "while":
        return 1
    return int(instruction.attr(r'"known_trip_count":\{"n":"(\d+)"\}') or 1)


def _elements(shape: str) -> int:
    return sum(math.prod(dims) for _, dims in _arrays(shape))


def _kernel_inputs(schedule: Schedule, computation: str, instruction: Instruction) -> int:
    """Multiply-adds per output element of a convolution: the kernel's size over its output features."""
    rhs = _arrays(schedule.shapes(computation).get(instruction.operands[1], ""))
    labels = instruction.attr(r"dim_labels=\w+_(\w+)->")
    if not rhs or not labels or "o" not in labels:
        return 0
    kernel = rhs[0][1]
    return math.prod(kernel) // kernel[labels.index("o")]


def bytes_accessed(schedule: Schedule, computation: str, instruction: Instruction) -> int:
    """Bytes read and written: operands plus result; a buffer updated in place counts as its update only."""
    shapes = schedule.shapes(computation)
    updates = _in_place_updates(schedule, instruction)
    operands = [shapes.get(name, "") for name in instruction.operands]
    if updates is None:
        return sum(map(_nbytes, operands)) + _nbytes(instruction.shape)
    result_arrays = _arrays(instruction.shape)
    read = sum(_nbytes(s) for s in operands if _arrays(s) != result_arrays)
    return read + 2 * updates


def _in_place_updates(schedule: Schedule, instruction: Instruction) -> int | None:
    """Bytes a fusion writes through dynamic-update-slice into a buffer it updates in place, or None."""
    for callee in instruction.callees:
        shapes = schedule.shapes(callee)
        written = [
            _nbytes(shapes.get(i.operands[1], ""))
            for i in schedule.computations.get(callee, ())
            if i.opcode == "dynamic-update-slice"
        ]
        if written:
            return sum(written)
    return None


def compute_seconds(schedule: Schedule, computation: str, instruction: Instruction, chip) -> float:
    """Roofline time on `chip`: max(FLOPs / peak FLOP/s, bytes / HBM bandwidth); 0 for bookkeeping and pure communication.

    A while loop is its body's instructions priced one by one, times the trip
    count. A fusion that also communicates (a TPU async collective fusion's
    continuation) is priced by its matmuls alone: the buffers it threads
    through belong to the collective, whose transfer is priced separately.
    """
    if instruction.opcode == "while":
        body = [c for c in instruction.callees if c == instruction.attr(r"\bbody=%?([\w.\-]+)")]
        return _trips(instruction) * sum(
            compute_seconds(schedule, c, i, chip) for c in body for i in schedule.computations.get(c, ())
        )
    matmul_flops = flops(schedule, computation, instruction)
    if instruction.opcode in _FREE or _communicates(schedule, instruction):
        return matmul_flops / chip.peak_bf16_flops
    return max(
        matmul_flops / chip.peak_bf16_flops, bytes_accessed(schedule, computation, instruction) / chip.hbm_bandwidth
    )


def _communicates(schedule: Schedule, instruction: Instruction) -> bool:
    """A collective, an async wrapper of one, or a fusion with a collective inside."""
    if _base(instruction.opcode) in _COLLECTIVE_OPCODES or instruction.opcode in (
        "async-start",
        "async-update",
        "async-done",
    ):
        return True
    return any(
        schedule.contains(callee, lambda i: _base(i.opcode) in _COLLECTIVE_OPCODES) for callee in instruction.callees
    )


def _base(opcode: str) -> str:
    return re.sub(r"-(start|update|done)$", "", opcode)


def _async_marker(schedule: Schedule, computation: str) -> str | None:
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

    collective: object  # lab.hlo.Collective
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
    """Windows of every collective in `hlo_text` (scheduled HLO), priced on `chip` (a lab.hardware.ChipProfile).

    `topology` is the TPU slice's torus, e.g. (4, 4); without it (or on a
    switched chip) collectives are priced on the chip's links as a switch.
    """
    from lab import hlo
    from lab.mesh import AXES

    schedule = parse_schedule(hlo_text)
    collectives, _ = hlo.parse_collectives(hlo_text, mesh_shape, tuple(axis_names or AXES))
    windows = tuple(_window(schedule, c, chip, tuple(topology)) for c in collectives)
    entry_s = sum(compute_seconds(schedule, schedule.entry, i, chip) for i in schedule.computations[schedule.entry])
    return OverlapReport(windows, entry_s, chip.name)


def _window(schedule: Schedule, collective, chip, topology: tuple[int, ...]) -> Window:
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


def _bounds(schedule: Schedule, collective) -> tuple[str, str, str]:
    """(scheduled computation, start instruction, done instruction) of a collective as lab.hlo reports it."""
    if "chain" in collective.form:  # TPU async collective fusion: lab.hlo names the start fusion's computation
        return _chain_bounds(schedule, collective.computation)
    if "async-start" in collective.form:
        caller, start = _caller(schedule, collective.computation)
        return caller, start.name, _done_of(schedule, caller, start.name)
    if collective.is_async:
        return collective.computation, collective.name, _done_of(schedule, collective.computation, collective.name)
    if collective.fused:  # a synchronous collective inside a fusion (the TPU's reduce-scatter): the fusion is the step
        caller, fusion = (
            _caller(schedule, collective.computation)
            if collective.computation in _callees(schedule)
            else (collective.computation, None)
        )
        name = fusion.name if fusion is not None else collective.name
        return caller, name, name
    return collective.computation, collective.name, collective.name


def _callees(schedule: Schedule) -> set[str]:
    return {c for body in schedule.computations.values() for i in body for c in i.callees}


def _caller(schedule: Schedule, callee: str) -> tuple[str, Instruction]:
    for computation, body in schedule.computations.items():
        for instruction in body:
            if callee in instruction.callees:
                return computation, instruction
    raise LabError(f"no instruction calls computation {callee!r}; pass the whole HLO module")


def _done_of(schedule: Schedule, computation: str, start: str) -> str:
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


def _chain_bounds(schedule: Schedule, start_callee: str) -> tuple[str, str, str]:
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


def _chain_id(schedule: Schedule, computation: str) -> str | None:
    return next(
        (
            i.attr(r'chain_id="(\d+)"')
            for i in schedule.computations.get(computation, ())
            if i.attr(r'chain_id="(\d+)"')
        ),
        None,
    )


def predict_seconds(collective, chip, topology: tuple[int, ...] = ()) -> float:
    """lab.theory's time for one run of `collective` on `chip`: over torus dims its group spans, else a switch."""
    from lab import theory

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
    import itertools

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


def _letter(schedule: Schedule, instruction: Instruction) -> str:
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


# ------------------------------------------------------------------ measuring variants side by side
