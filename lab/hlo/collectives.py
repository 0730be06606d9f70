"""The collectives in a compiled program, read from its optimized HLO and mapped to mesh axes.

``jax.jit(f).lower(*args).compile().as_text()`` is the optimized HLO the
compiler will run. Every collective the SPMD partitioner inserted (or that a
``shard_map`` asked for) is an instruction there, e.g.::

    %ar = f32[64,128] all-reduce(%x), replica_groups={{0,1},{2,3}}, to_apply=%add

Its replica groups (`lab.hlo.groups`) name the devices that talk, and so the
mesh axes it runs over.

The same collective takes several forms: synchronous; an async ``-start`` /
``-done`` pair (counted once); ``async-start`` wrapping it (or ``call-start``,
TPU7x's SparseCores running it on their own thread); inside a fusion
(the TPU compiler writes a reduce-scatter as an ``all-reduce-scatter`` fusion
of all-reduce + dynamic-slice, and an overlapped collective as an "async
collective fusion" chain: start, continuations, done); or *combined*: one
tuple-shaped instruction carrying several arrays. XLA:GPU also writes a
pipelined permute as ``send`` / ``recv`` instructions on one channel, their
pairs in ``frontend_attributes={_xla_send_recv_source_target_pairs=...}``; a
send/recv pair is one collective-permute here. A host transfer
(``is_host_transfer=true``) is no collective, but for one: over an axis that
crosses slices, libtpu compiles the collective's DCN part as a send of the
data to its megascale runtime and a recv of the result
(``_xla_megascale_transfer_type="ALL_REDUCE"``, one rendezvous for both);
that pair is one collective ``across_slices``, with no replica groups (the
slice's program numbers only its own devices), done at the recv-done.
`parse_collectives` makes
each of them one `Collective`, and lists the lines it could not read
(`Skipped`) instead of raising; `summarize` totals them per kind and axes,
counting loop bodies by their trip counts.

Sizes follow the nccl-tests convention for S, the size one quotes for a
collective (https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md):
all-gather: the gathered result; reduce-scatter: the full input; all-reduce,
all-to-all, collective-permute: the operand; an in-place permute
(``collective-permute(in, out, in_offsets, out_offsets), slice_sizes={{..}}``)
sends only its slices, so its S is theirs. Bytes are per device.

Each collective carries the JAX op name and source line of the instruction
that holds it (the -start of an async pair, the collective inside a fusion,
else the fusion), read from its metadata or the module's stack frames.

It is one concept in one module, though above 500 lines: every form above must
become the same `Collective` through one path (groups, sizes, loop counts,
source): forms built apart would drift apart.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

from lab.collectives import KINDS
from lab.errors import LabError
from lab.hlo import loops
from lab.hlo.groups import Groups, collective_axes, expand_replica_groups, groups_of_pairs, replica_groups_text
from lab.hlo.sources import StackFrames, source_of, stack_frames
from lab.hlo.text import (
    ASYNC_SUFFIX,
    STRING,
    Instruction,
    Shape,
    arrays,
    base_opcode,
    compact,
    computations,
    module_devices,
    nbytes,
    parse_instruction,
    statement_is_open,
)
from lab.mesh import AXES

# --------------------------------------------------------------------------- types


@dataclass(frozen=True)
class Collective:
    """One collective found in optimized HLO (a start/done pair is one)."""

    kind: str  # one of KINDS
    name: str  # HLO instruction name (the -start for async pairs, the fusion for all-reduce-scatter)
    computation: str  # the HLO computation it lives in
    form: str  # how XLA wrote it: opcode(s), fusion, async wrapper, as text
    is_async: bool
    fused: bool
    combined: bool  # several arrays in one tuple-shaped instruction (e.g. XLA's combiner)
    dtypes: tuple[str, ...]
    operand_shapes: tuple[Shape, ...]
    result_shapes: tuple[Shape, ...]
    operand_bytes: int  # per device
    result_bytes: int  # per device
    group_size: int | None  # N; None when the device count is unknown
    replica_groups: Groups
    source_target_pairs: tuple[tuple[int, int], ...] = ()
    axes: tuple[str, ...] | None = None  # mesh axes the groups span; None: unknown or no set of axes
    op_name: str | None = None  # JAX op name from metadata
    repeats: int | None = 1  # runs per program call: product of loop trip counts; None if unknown
    source_file: str | None = None  # the Python file that made it (metadata, or the module's stack frames)
    source_line: int | None = None
    across_slices: bool = False  # run by libtpu's megascale runtime on DCN, over the slices (no replica groups)
    done: str = ""  # where it completes when that is not its -done: a megascale transfer's recv-done

    @property
    def moves_nothing(self) -> bool:
        """Every group is one device (an axis of size 1): each device keeps its own data. XLA's simplifiers remove
        most such collectives, not all (XLA:CPU keeps some in optimized HLO); unoptimized or edited text may hold
        any."""
        return self.group_size == 1

    @property
    def size_bytes(self) -> int:
        """S in the nccl-tests convention: gathered result, full reduce-scatter input, else the operand; 0 when the
        collective moves nothing."""
        if self.moves_nothing:
            return 0
        return self.result_bytes if self.kind == "all-gather" else self.operand_bytes


@dataclass(frozen=True)
class Skipped:
    """A line the parser did not understand, and why."""

    line_number: int
    line: str
    reason: str


@dataclass(frozen=True)
class CollectiveTotal:
    """Collectives of one kind over one set of axes: how many, how many bytes (S, summed)."""

    kind: str
    axes: tuple[str, ...] | None
    count: int
    total_bytes: int
    exact: bool  # False when a loop trip count was unknown (such collectives counted once)


# --------------------------------------------------------------------------- scanning

_KEYWORDS = re.compile(  # a cheap test before a line is parsed: does it mention a collective at all?
    r"all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute|collective-broadcast|AsyncCollective"
)
_POINT_TO_POINT_OPCODE = re.compile(r"\b(?:send|recv)(?:-done)?\s*\(")  # tried only on lines saying send or recv
# a computation a fusion, async wrapper, loop or call runs: read on the line with its strings removed
_CALLEE_ON_LINE = re.compile(r",\s*(?:calls|body|to_apply)\s*=\s*%?([\w.\-]+)")
_POINT_TO_POINT = ("send", "recv", "send-done", "recv-done")
_PAIRS_ATTRIBUTE = "_xla_send_recv_source_target_pairs"
# libtpu hands a collective over slices to its megascale runtime as a host send (the data) and recv (the result)
_MEGASCALE = "_xla_megascale_transfer_type"
_RENDEZVOUS = "_xla_host_transfer_rendezvous"
_MEGASCALE_KINDS = {
    "ALL_REDUCE": "all-reduce",
    "ALL_GATHER": "all-gather",
    "REDUCE_SCATTER": "reduce-scatter",
    "ALL_TO_ALL": "all-to-all",
}
_UNMODELLED = {"collective-broadcast": "collective-broadcast is not one of the modelled kinds"}
# an all-to-all whose sizes are operands known only at run time (jax.lax.ragged_all_to_all: a dropless MoE's
# dispatch): listed as an all-to-all of its whole input buffer, the most it can send
_RAGGED = "ragged-all-to-all"
_SMALL = 16  # statements a loop's condition has at most (a counter, a bound, a compare; a fusion or two on TPU)


@dataclass
class _Scan:
    """One pass over the text: computations, callers, collective-ish instructions."""

    entry: str | None = None
    num_devices: int | None = None
    instructions: list[Instruction] = field(default_factory=list)
    callers: dict[str, tuple[str, int, str]] = field(default_factory=dict)  # callee -> (computation, line number, line)
    markers: dict[str, str] = field(default_factory=dict)  # computation -> "start"/"done" of an async collective fusion
    small: dict[str, tuple] = field(default_factory=dict)  # computation -> its statements, for the few-line ones
    skipped: list[Skipped] = field(default_factory=list)
    point_to_point: list[Instruction] = field(default_factory=list)  # send, recv (their -done: bookkeeping)
    recv_pairs: dict[tuple[str, str], str] = field(default_factory=dict)  # (computation, send) -> its recv's pairs
    recv_dones: dict[tuple[str, str], str] = field(default_factory=dict)  # (computation, recv) -> its recv-done
    megascale_done: dict[tuple[str, str], str] = field(default_factory=dict)  # (computation, send) -> recv-done
    frames: StackFrames = field(default_factory=lambda: stack_frames(""))


def _scan(hlo_text: str) -> _Scan:
    scan = _Scan(num_devices=module_devices(hlo_text), frames=stack_frames(hlo_text))
    for computation in computations(hlo_text):
        scan.entry = computation.name if computation.is_entry else scan.entry
        if len(computation.body) <= _SMALL:  # a loop's condition, read for its trip count (`lab.hlo.loops`)
            scan.small[computation.name] = computation.body
        for number, line in computation.instruction_lines():
            _scan_line(scan, computation.name, number, line)
    return scan


def _scan_line(scan: _Scan, computation: str, number: int, line: str) -> None:
    """Note who calls whom, and keep `line` if it is a collective."""
    if "calls" in line or "body" in line or "to_apply" in line:
        for callee in _callees_on_line(line):
            scan.callers.setdefault(callee, (computation, number, line))
    if not _KEYWORDS.search(line) and not (("send" in line or "recv" in line) and _POINT_TO_POINT_OPCODE.search(line)):
        return
    if "AsyncCollectiveStart" in line or "AsyncCollectiveDone" in line:
        scan.markers[computation] = "start" if "AsyncCollectiveStart" in line else "done"
    instruction = parse_instruction(line, computation, number)
    if instruction is None:
        scan.skipped.append(
            Skipped(
                number,
                line.strip()[:240],
                "mentions a collective but is not an HLO instruction this parser can read",
            )
        )
    elif statement_is_open(line):
        scan.skipped.append(
            Skipped(number, line.strip()[:240], "a quote, bracket or brace is never closed: the instruction is cut")
        )
    elif base_opcode(instruction.opcode) in (*KINDS, _RAGGED) or instruction.opcode in _UNMODELLED:
        scan.instructions.append(instruction)
    elif instruction.opcode in ("send", "recv"):
        scan.point_to_point.append(instruction)
    elif instruction.opcode == "recv-done" and instruction.operands:
        scan.recv_dones[(computation, instruction.operands[0])] = instruction.name


def _callees_on_line(line: str) -> list[str]:
    """The computations an instruction line names in calls=, body= or to_apply=, never text quoted in it."""
    found = _CALLEE_ON_LINE.findall(line)
    if not found or '"' not in line:
        return found
    # XLA prints these attributes before any quoted one: the line up to its first quote is usually the answer
    head = _CALLEE_ON_LINE.findall(line[: line.index('"')])
    return head if head == found else _CALLEE_ON_LINE.findall(STRING.sub("", line))


# --------------------------------------------------------------------------- building collectives


class _Unreadable(ValueError):
    """A collective instruction this parser cannot interpret; becomes a Skipped entry."""


@dataclass(frozen=True)
class _Context:
    """Where a computation is called from: the innermost fusion, an async wrapper, loop trip counts."""

    fusion: Instruction | None = None
    fusion_callee: str = ""
    async_wrapper: Instruction | None = None
    repeats: int | None = 1


def parse_collectives(
    hlo_text: str, mesh_shape: Sequence[int] | None = None, axis_names: Sequence[str] = AXES
) -> tuple[tuple[Collective, ...], tuple[Skipped, ...]]:
    """The collectives in an HLO module's text, and the lines it skipped (never raises on odd text).

    With `mesh_shape` (and the mesh's `axis_names`), each collective's groups
    are mapped to the mesh axes they span.
    """
    if mesh_shape is not None and len(mesh_shape) != len(axis_names):
        raise LabError(
            f"mesh_shape {tuple(mesh_shape)} has {len(mesh_shape)} axes but "
            f"axis_names has {len(axis_names)}; pass axis_names=mesh.axis_names"
        )
    scan = _scan(hlo_text)
    mesh = (tuple(mesh_shape), tuple(axis_names)) if mesh_shape is not None else None
    num_devices = scan.num_devices or (math.prod(mesh_shape) if mesh_shape is not None else None)
    contexts: dict[str, _Context] = {}
    skipped = list(scan.skipped)
    found: list[tuple[Collective, str | None]] = []
    for instruction, result, form, is_async in (*_logical_collectives(scan, skipped), *_send_recv(scan, skipped)):
        try:
            if instruction.opcode in _UNMODELLED:
                raise _Unreadable(_UNMODELLED[instruction.opcode])
            if instruction.computation not in contexts:
                contexts[instruction.computation] = _context(instruction.computation, scan)
            context = contexts[instruction.computation]
            collective = _build(instruction, result, form, is_async, context, num_devices, mesh, scan)
            found.append((collective, instruction.attr(r'chain_id="(\d+)"') if context.fusion else None))
        except (
            ValueError,
            TypeError,
            IndexError,
            KeyError,
            ZeroDivisionError,
        ) as err:  # text we misread must not crash the caller
            skipped.append(
                Skipped(instruction.line_number, instruction.line.strip()[:240], str(err) or type(err).__name__)
            )
    return _merge_async_fusion_chains(found, scan.markers), tuple(skipped)


def _logical_collectives(scan: _Scan, skipped: list[Skipped]) -> Iterable[tuple[Instruction, str, str, bool]]:
    """(instruction holding the attributes, result shape, form, is_async) per collective; a -start/-done pair is one."""
    starts: dict[str, Instruction] = {}
    updates: dict[str, str] = {}  # -update name -> its -start's name
    for instruction in scan.instructions:
        phase = ASYNC_SUFFIX.search(instruction.opcode)
        first = instruction.operands[0] if instruction.operands else ""
        if not phase:
            was_async = instruction.attr(r'async_collective_name="([^"]+)"')
            form = (
                f"{instruction.opcode} (was {was_async}, scheduled synchronously)" if was_async else instruction.opcode
            )
            yield instruction, instruction.shape, form, False
        elif phase.group(1) == "start":
            starts[instruction.name] = instruction
        elif phase.group(1) == "update":
            updates[instruction.name] = updates.get(first, first)
        else:
            start = starts.pop(updates.get(first, first), None)
            if start is None:
                skipped.append(
                    Skipped(
                        instruction.line_number,
                        instruction.line.strip()[:240],
                        f"{instruction.opcode} without a matching start",
                    )
                )
                continue
            if _runs_synchronously(start):
                yield start, instruction.shape, f"{start.opcode}/{instruction.opcode} (is_sync: run in place)", False
            else:
                yield start, instruction.shape, f"{start.opcode}/{instruction.opcode}", True
    for start in starts.values():
        skipped.append(Skipped(start.line_number, start.line.strip()[:240], f"{start.opcode} without a matching done"))


def _runs_synchronously(start: Instruction) -> bool:
    """XLA:GPU keeps the start/done pair of a collective it decided not to overlap, and marks it
    ``backend_config={"collective_backend_config":{"is_sync":true,...}}``: NCCL runs it on the compute stream."""
    return '"is_sync":true' in start.attrs.replace(" ", "")


def _send_recv(scan: _Scan, skipped: list[Skipped]) -> Iterable[tuple[Instruction, str, str, bool]]:
    """(send, its shape, form, True) per send/recv pair on one channel: XLA:GPU's pipelined permute.

    A send's shape is ``(data, u32[] context, token[])``; its pairs are the
    ``_xla_send_recv_source_target_pairs`` frontend attribute of the send (or
    of its recv). A megascale send (a collective's DCN part, see the module docstring) is one collective whose
    result arrives at the recv-done of its rendezvous; other host transfers and unpaired halves are skipped.
    """
    channels: dict[str, dict[str, list[Instruction]]] = defaultdict(lambda: {"send": [], "recv": []})
    results = {  # a megascale transfer's result arrives through the recv of the same rendezvous
        (i.computation, i.frontend_attributes.get(_RENDEZVOUS)): i.name
        for i in scan.point_to_point
        if i.opcode == "recv" and _MEGASCALE in i.frontend_attributes
    }
    for instruction in scan.point_to_point:
        if _MEGASCALE in instruction.frontend_attributes:
            if instruction.opcode == "send":
                recv = results.get((instruction.computation, instruction.frontend_attributes.get(_RENDEZVOUS)))
                done = scan.recv_dones.get((instruction.computation, recv), "")
                scan.megascale_done[(instruction.computation, instruction.name)] = done
                yield instruction, instruction.shape, "send/recv to libtpu's megascale runtime (DCN)", True
            continue  # the recv: the same transfer's result
        if instruction.attribute("is_host_transfer") == "true":
            skipped.append(_skip(instruction, f"{instruction.opcode} is a host transfer, not a collective"))
            continue
        channel = instruction.attribute("channel_id")
        if channel is None:
            skipped.append(_skip(instruction, f"{instruction.opcode} without channel_id: its other half is unknown"))
            continue
        channels[channel][instruction.opcode].append(instruction)
    for channel, halves in channels.items():
        for send, recv in zip(halves["send"], halves["recv"]):
            if _PAIRS_ATTRIBUTE in recv.frontend_attributes:
                scan.recv_pairs[(send.computation, send.name)] = recv.frontend_attributes[_PAIRS_ATTRIBUTE]
            yield send, send.shape, "send/recv", True
        count = min(len(halves["send"]), len(halves["recv"]))
        for unpaired in (*halves["send"][count:], *halves["recv"][count:]):
            other = "recv" if unpaired.opcode == "send" else "send"
            skipped.append(_skip(unpaired, f"{unpaired.opcode} without a matching {other} on channel_id={channel}"))


def _skip(instruction: Instruction, reason: str) -> Skipped:
    return Skipped(instruction.line_number, instruction.line.strip()[:240], reason)


def _context(computation: str, scan: _Scan) -> _Context:
    """Walk the callers of `computation` up to ENTRY: innermost fusion, async wrapper, loop trip counts."""
    context, seen = _Context(), set()
    while computation != scan.entry and computation in scan.callers and computation not in seen:
        seen.add(computation)
        caller_computation, number, line = scan.callers[computation]
        caller = parse_instruction(line, caller_computation, number)
        if caller is None:
            break
        if caller.opcode == "fusion" and context.fusion is None:
            context = replace(context, fusion=caller, fusion_callee=computation)
        elif caller.opcode in ("async-start", "call-start") and context.async_wrapper is None:
            context = replace(context, async_wrapper=caller)
        elif caller.opcode == "while" and caller.attr(r"\bbody=%?([\w.\-]+)") == computation:
            condition = caller.attr(r"\bcondition=%?([\w.\-]+)") or ""
            statements = [parse_instruction(text, condition, n) for n, text in scan.small.get(condition, ())]
            trips = loops.trip_count(caller, [i for i in statements if i is not None])
            context = replace(
                context, repeats=None if trips is None or context.repeats is None else context.repeats * trips
            )
        computation = caller_computation
    return context


def _build(
    instruction: Instruction,
    result_shape: str,
    form: str,
    is_async: bool,
    context: _Context,
    num_devices: int | None,
    mesh,
    scan: _Scan,
) -> Collective:
    markers = scan.markers
    megascale = instruction.frontend_attributes.get(_MEGASCALE) if instruction.opcode == "send" else None
    kind = "collective-permute" if instruction.opcode == "send" else base_opcode(instruction.opcode)
    if kind == _RAGGED:
        kind = "all-to-all"
        form = f"{form} (its sizes known at run time: S is its input buffer, the most it sends)"
    if megascale is not None:
        if megascale not in _MEGASCALE_KINDS:
            raise _Unreadable(f"a megascale {megascale} transfer is not one of the modelled kinds")
        kind = _MEGASCALE_KINDS[megascale]
    results = arrays(result_shape)
    if instruction.opcode == "send":
        results = _sent_arrays(results, result_shape)
    if not results:
        raise _Unreadable(f"no array shape in {result_shape[:80]!r}")
    groups, pairs = ((), ()) if megascale else _groups_and_pairs(kind, instruction, num_devices, scan)
    group_size = max(map(len, groups), default=None)
    operands = results if megascale else _operand_arrays(kind, results, instruction, group_size)
    name, computation, fused = instruction.name, instruction.computation, context.fusion is not None
    split_all_to_all = kind == "all-to-all" and instruction.attr(r"dimensions=\{([\d,]*)\}") is None
    if context.fusion is not None:
        form = _fused_form(kind, context, markers.get(instruction.computation))
        if kind == "all-reduce" and _is_reduce_scatter_fusion(context):
            kind, operands, results = "reduce-scatter", results, arrays(context.fusion.shape)
            name, computation = context.fusion.name, context.fusion.computation
    elif context.async_wrapper is not None:
        form = f"async-start %{context.async_wrapper.name} wrapping {form}"
    metadata = instruction.metadata
    if metadata["op_name"] is None and context.fusion is not None:
        metadata = context.fusion.metadata
    source = source_of(metadata, scan.frames)
    source_file, source_line = (source.file, source.line) if source is not None else (None, None)
    return Collective(
        kind=kind,
        name=name,
        computation=computation,
        form=form,
        is_async=is_async or context.async_wrapper is not None,
        fused=fused,
        combined=len(results) > 1 and not split_all_to_all,
        dtypes=tuple(dict.fromkeys(dtype for dtype, _ in results)),
        operand_shapes=tuple(dims for _, dims in operands),
        result_shapes=tuple(dims for _, dims in results),
        operand_bytes=nbytes(operands),
        result_bytes=nbytes(results),
        group_size=group_size,
        replica_groups=groups,
        source_target_pairs=pairs,
        axes=None if megascale else collective_axes(kind, groups, pairs, mesh),
        op_name=instruction.metadata["op_name"] or (context.fusion.metadata["op_name"] if context.fusion else None),
        repeats=context.repeats,
        source_file=source_file,
        source_line=source_line,
        across_slices=megascale is not None,
        done=scan.megascale_done.get((instruction.computation, instruction.name), ""),
    )


def _sent_arrays(arrays_: list[tuple[str, Shape]], shape: str) -> list[tuple[str, Shape]]:
    """The data a send carries: its shape is (data..., u32[] context, token[])."""
    if len(arrays_) < 3 or arrays_[-1] != ("token", ()) or arrays_[-2] != ("u32", ()):
        raise _Unreadable(f"send shape {shape[:80]!r} is not (data, u32[], token[])")
    return arrays_[:-2]


def _groups_and_pairs(
    kind: str, instruction: Instruction, num_devices: int | None, scan: _Scan
) -> tuple[Groups, tuple[tuple[int, int], ...]]:
    """Replica groups (for a permute: the devices its pairs link) and a permute's source-target pairs."""
    if kind == "collective-permute":
        pairs = _source_target_pairs(instruction, scan)
        return groups_of_pairs(pairs), pairs
    return expand_replica_groups(replica_groups_text(instruction.attributes) or "{}", num_devices), ()


_PAIRS = re.compile(r"\{(?:\{\d+,\d+\},?)*\}")


def _source_target_pairs(instruction: Instruction, scan: _Scan) -> tuple[tuple[int, int], ...]:
    if instruction.opcode == "send":
        text = instruction.frontend_attributes.get(_PAIRS_ATTRIBUTE) or scan.recv_pairs.get(
            (instruction.computation, instruction.name)
        )
        missing = f"send/recv without {_PAIRS_ATTRIBUTE} in frontend_attributes"
    else:
        text, missing = instruction.attribute("source_target_pairs"), "collective-permute without source_target_pairs"
    if text is None:
        raise _Unreadable(missing)
    text = compact(text)
    if not _PAIRS.fullmatch(text):
        raise _Unreadable(f"unreadable source-target pairs {text[:80]!r}")
    return tuple((int(a), int(b)) for a, b in re.findall(r"\{(\d+),(\d+)\}", text))


def _operand_arrays(
    kind: str, results: list[tuple[str, Shape]], instruction: Instruction, group_size: int | None
) -> list[tuple[str, Shape]]:
    """Operand shapes from result shapes (operands are printed by name only in current HLO text); an in-place
    permute's operands are the slices it sends."""
    if kind == "collective-permute" and instruction.attribute("slice_sizes") is not None:
        return _permute_slices(results, instruction.attribute("slice_sizes"))
    if kind not in ("all-gather", "reduce-scatter"):
        return results
    dimension = instruction.attr(r"\bdimensions=\{(\d+)\}")
    if dimension is None or not group_size:
        raise _Unreadable(f"{kind} without dimensions={{..}} or without a known group size")
    d = int(dimension)
    scale = (lambda n: n // group_size) if kind == "all-gather" else (lambda n: n * group_size)
    # a rank-0 member of a combined tuple (a scalar) has no dimension d: it is moved whole, as printed
    return [(dtype, (*dims[:d], scale(dims[d]), *dims[d + 1 :]) if d < len(dims) else dims) for dtype, dims in results]


def _permute_slices(results: list[tuple[str, Shape]], text: str) -> list[tuple[str, Shape]]:
    """The slices an in-place permute sends (``slice_sizes={{128,32},...}``), each of its buffer's dtype.

    The slices are listed buffer by buffer, so with a tuple of k buffers and
    m slices, slice i belongs to buffer i * k // m.
    """
    if not re.fullmatch(r"\{(?:\{[\d,]*\},?)+\}", text):
        raise _Unreadable(f"unreadable slice_sizes {text[:80]!r}")
    slices = [tuple(int(d) for d in dims.split(",") if d) for dims in re.findall(r"\{([\d,]*)\}", text[1:-1])]
    return [(results[i * len(results) // len(slices)][0], dims) for i, dims in enumerate(slices)]


def _is_reduce_scatter_fusion(context: _Context) -> bool:
    """The TPU compiler's reduce-scatter: a kCustom fusion calling %all-reduce-scatter (all-reduce + dynamic-slice)."""
    return "reduce-scatter" in context.fusion_callee or "ReduceScatterFusion" in context.fusion.attrs


def _fused_form(kind: str, context: _Context, marker: str | None) -> str:
    fusion, callee = context.fusion, context.fusion_callee
    fusion_kind = fusion.attr(r"kind=(k\w+)") or "?"
    if kind == "all-reduce" and _is_reduce_scatter_fusion(context):
        return f"fusion %{fusion.name} (kind={fusion_kind}, calls=%{callee}): all-reduce + dynamic-slice"
    if marker is not None or callee.startswith("async_collective_fusion"):
        return f"{kind} in async collective fusion %{fusion.name} (calls=%{callee})"
    return f"{kind} inside fusion %{fusion.name} (kind={fusion_kind}, calls=%{callee})"


def _merge_async_fusion_chains(
    found: list[tuple[Collective, str | None]], markers: dict[str, str]
) -> tuple[Collective, ...]:
    """One collective per TPU async collective fusion chain (start, continuations, done share a chain_id)."""
    chains: dict[str, list[Collective]] = defaultdict(list)
    for collective, chain in found:
        if chain is not None:
            chains[chain].append(collective)
    result = []
    for collective, chain in found:
        members = chains.get(chain, [])
        if chain is None or (len(members) == 1 and markers.get(collective.computation) is None):
            result.append(collective)
        elif collective is _chain_head(members, markers):
            parts = len(members)
            result.append(
                replace(
                    collective,
                    is_async=True,
                    form=f"{collective.form}; chain {chain}: {parts} fusions (start, continuations, done)",
                )
            )
    return tuple(result)


def _chain_head(members: list[Collective], markers: dict[str, str]) -> Collective:
    return next((c for c in members if markers.get(c.computation) == "start"), members[0])


# --------------------------------------------------------------------------- summaries


def summarize(collectives: Iterable[Collective]) -> tuple[CollectiveTotal, ...]:
    """Count and total S per (kind, axes), counting loop bodies by their trip counts where known."""
    totals: dict[tuple, list] = {}
    for c in collectives:
        row = totals.setdefault((c.kind, c.axes), [0, 0, True])
        runs = c.repeats if c.repeats is not None else 1
        row[0] += runs
        row[1] += runs * c.size_bytes
        row[2] &= c.repeats is not None
    order = sorted(
        totals, key=lambda key: (KINDS.index(key[0]) if key[0] in KINDS else len(KINDS), key[1] is None, key[1] or ())
    )
    return tuple(CollectiveTotal(kind, axes, *totals[(kind, axes)]) for kind, axes in order)
