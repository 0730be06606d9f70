"""What XLA actually did: the collectives in a compiled program, mapped to mesh axes.

``jax.jit(f).lower(*args).compile().as_text()`` is the optimized HLO the
compiler will run. Every collective the SPMD partitioner inserted (or that a
``shard_map`` asked for) is an instruction there, e.g.::

    %ar = f32[64,128] all-reduce(%x), replica_groups={{0,1},{2,3}}, to_apply=%add

Its *replica groups* name the devices that talk to each other. The ids are
positions in the program's device assignment, which for a jitted program over a
mesh is the mesh's flat device order (``mesh.devices.flat``), not
``device.id``: on a TPU topology mesh whose device ids are permuted, a psum
over ``tensor`` still prints ``{{0,1,2,3},...}``. So groups map back to mesh
axes with `lab.mesh.axes_of_groups`. XLA prints groups in three notations:

* explicit ``{{0,2},{1,3}}`` (``{}`` means every device in one group);
* iota ``[2,4]<=[4,2]T(1,0)``: ``arange(8).reshape(4,2).transpose(1,0)``
  read as 2 groups of 4 (``IotaReplicaGroupList``);
* mesh ``mesh['axis_0'=4,'axis_1'=2] {'axis_0'}``: a compiler-side mesh (its
  own axis names, optionally ``, device_ids=(...)``) and the axes a group
  spans, sub-axes written ``'x':(pre)size`` (``MeshAxesReplicaGroupList``).

The same collective takes several forms: synchronous; an async ``-start`` /
``-done`` pair (counted once); ``async-start`` wrapping it; inside a fusion
(the TPU compiler writes a reduce-scatter as an ``all-reduce-scatter`` fusion
of all-reduce + dynamic-slice, and an overlapped collective as an "async
collective fusion" chain: start, continuations, done); or *combined*: one
tuple-shaped instruction carrying several arrays.

Sizes follow the nccl-tests convention for S, the size one quotes for a
collective (https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md):
all-gather: the gathered result; reduce-scatter: the full input; all-reduce,
all-to-all, collective-permute: the operand. Bytes are per device.
"""

from __future__ import annotations

import contextlib
import functools
import math
import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from lab.errors import LabError
from lab.mesh import AXES, axes_of_groups, slice_local_shape
from lab.units import format_bytes

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

Groups = tuple[tuple[int, ...], ...]
Shape = tuple[int, ...]


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

    @property
    def size_bytes(self) -> int:
        """S in the nccl-tests convention: gathered result, full reduce-scatter input, else the operand."""
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
        module = _module_name(self.optimized_hlo)
        before = directory / f"{module}.before_optimizations.hlo"
        after = directory / f"{module}.after_optimizations.hlo"
        before.write_text(self.unoptimized_hlo)
        after.write_text(self.optimized_hlo)
        return before, after


# --------------------------------------------------------------------------- replica groups

_IOTA = re.compile(r"^\[(?P<dims>[\d,]+)\]<=\[(?P<reshape>[\d,]+)\](?:T\((?P<perm>[\d,]+)\))?$")
_NESTED_PARENS = r"(?:[^()]|\([^()]*\))*"
# The mesh notation, as printed by MeshAxesReplicaGroupList::ToString and Mesh::ToString in
# openxla/xla xla/hlo/ir/replica_group.cc and mesh_and_axis.cc: "mesh[a=2,b=4]" plus
# ", device_ids=(<ids>)" when the compiler mesh is not a plain iota, then " {a,b:(1)2}".
# Current XLA/libtpu quote the names (mesh['axis_0'=4] {'axis_0'}); older XLA printed
# "@mesh<a=2,b=4>(devices=[2,4]<=[8]) {a}". All three spellings are read.
_MESH = re.compile(
    rf"^(?:mesh\[(?P<axes>[^\]]*)\](?:,\s*device_ids=\((?P<ids>{_NESTED_PARENS})\))?"
    rf"|@mesh<(?P<old_axes>[^>]*)>(?:\(devices=(?P<old_ids>{_NESTED_PARENS})\))?)"
    r"\s*\{(?P<refs>[^}]*)\}$"
)
_GROUPS_VALUE = re.compile(  # an iota or mesh replica_groups value at the start of the attributes that follow it
    rf"\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?"
    rf"|(?:mesh\[[^\]]*\](?:,\s*device_ids=\({_NESTED_PARENS}\))?|@mesh<[^>]*>(?:\({_NESTED_PARENS}\))?)\s*\{{[^}}]*\}}"
)
_AXIS_REF = re.compile(r"^(?P<name>[^:]+?)(?::\((?P<pre>\d+)\)(?P<size>\d+))?$")


@functools.lru_cache(maxsize=4096)  # a program repeats the same few groups many times
def expand_replica_groups(text: str, num_devices: int | None = None) -> Groups:
    """Expand any of XLA's replica-group notations into explicit groups of device positions.

    `num_devices` is needed only for ``{}`` (all devices in one group).
    Raises ValueError on a notation it does not know.
    """
    text = text.strip()
    if text == "{}":
        if num_devices is None:
            raise ValueError("replica_groups={} means all devices, but the device count is unknown")
        return (tuple(range(num_devices)),)
    if text.startswith("{"):
        return tuple(tuple(int(i) for i in g.split(",") if i.strip()) for g in re.findall(r"\{([^{}]*)\}", text[1:-1]))
    if text.startswith("["):
        return _iota_groups(text)
    if text.startswith(("mesh[", "@mesh<")):
        return _mesh_groups(text)
    raise ValueError(f"unknown replica_groups notation {text[:80]!r}")


def _ints(text: str) -> list[int]:
    return [int(i) for i in text.split(",") if i.strip()]


def _iota_groups(text: str) -> Groups:
    """``[G,S]<=[d0,d1,..]T(p..)``: iota reshaped to d, transposed by p, read as G groups of S."""
    match = _IOTA.match(text)
    if not match:
        raise ValueError(f"bad iota replica groups {text!r}")
    dims, reshape = _ints(match["dims"]), _ints(match["reshape"])
    perm = _ints(match["perm"]) if match["perm"] else list(range(len(reshape)))
    array = np.arange(math.prod(reshape)).reshape(reshape).transpose(perm).reshape(dims[0], -1)
    return tuple(tuple(row) for row in array.tolist())


def _mesh_groups(text: str) -> Groups:
    """Groups of a mesh-form list, computed as MeshAxesReplicaGroupList::flattened_replica_groups does."""
    match = _MESH.match(text)
    if not match:
        raise ValueError(f"bad mesh replica groups {text[:80]!r}")
    names, sizes = [], []
    for part in (match["axes"] if match["axes"] is not None else match["old_axes"]).split(","):
        name, _, size = part.rpartition("=")
        names.append(name.strip().strip("'\""))
        sizes.append(int(size))
    devices = _mesh_device_ids(match["ids"], match["old_ids"], math.prod(sizes)).reshape(sizes)
    refs = []
    for part in filter(None, (p.strip() for p in match["refs"].split(","))):
        ref = _AXIS_REF.match(part)
        name = ref["name"].strip().strip("'\"") if ref else None
        if name not in names:
            raise ValueError(f"mesh replica groups name axis {part!r}, not one of {names}")
        refs.append(
            (names.index(name), int(ref["pre"]) if ref["pre"] else None, int(ref["size"]) if ref["size"] else None)
        )
    return _groups_over_axis_refs(devices, refs)


def _mesh_device_ids(ids: str | None, old_ids: str | None, count: int) -> np.ndarray:
    """The compiler mesh's device list: iota unless printed as "[4,2]T(1,0)", "8,3,7,.." or (old) "[..]<=[..]T(..)"."""
    if ids is None and old_ids is None:
        return np.arange(count)
    text = (ids if ids is not None else old_ids).strip()
    if old_ids is not None and "<=" in text:
        rest = text.partition("<=")[2]
        return np.asarray(_iota_groups(f"[1,{count}]<={rest}")).reshape(-1)
    if old_ids is not None:
        text = text.split("]", 1)[1]  # "[10]8,3,7,..": the dims, then the ids
    iota = re.match(r"^\[(?P<reshape>[\d,]+)\](?:T\((?P<perm>[\d,]+)\))?$", text)
    if iota:
        perm = f"T({iota['perm']})" if iota["perm"] else ""
        return np.asarray(_iota_groups(f"[1,{count}]<=[{iota['reshape']}]{perm}")).reshape(-1)
    return np.asarray(_ints(text))


def _groups_over_axis_refs(devices: np.ndarray, refs: list[tuple[int, int | None, int | None]]) -> Groups:
    """Split each referenced mesh dim into (pre, size, rest) pieces, move the grouped pieces last, read groups.

    Mirrors GetDimToReshapeAndAggregateAxes / ComputeReindexedAxes in openxla/xla
    xla/hlo/ir/replica_group.cc: a sub-axis ``(pre)size`` is the piece of size
    `size` after the `pre` major elements of its axis.
    """
    by_dim: dict[int, list[tuple[int | None, int | None]]] = defaultdict(list)
    for dim, pre, size in refs:
        by_dim[dim].append((pre, size))
    pieces: dict[int, tuple[list[int], list[int]]] = {
        d: _split_dim(devices.shape[d], parts) for d, parts in by_dim.items()
    }
    reindexed, offsets = [], []
    for dim, size in enumerate(devices.shape):
        offsets.append(len(reindexed))
        reindexed.extend(pieces[dim][0] if dim in pieces else [size])
    consumed: Counter[int] = Counter()
    grouped = []
    for dim, _, _ in refs:
        grouped.append(offsets[dim] + pieces[dim][1][consumed[dim]])
        consumed[dim] += 1
    perm = [i for i in range(len(reindexed)) if i not in grouped] + grouped
    group_size = math.prod(reindexed[g] for g in grouped)
    rows = devices.reshape(reindexed).transpose(perm).reshape(-1, group_size)
    return tuple(tuple(int(i) for i in row) for row in rows)


def _split_dim(full: int, parts: list[tuple[int | None, int | None]]) -> tuple[list[int], list[int]]:
    """Reshape dims of one mesh dim and which of them are grouped, in the refs' order."""
    if len(parts) == 1:
        pre, size = parts[0]
        return ([full], [0]) if pre is None else ([pre, size, full // (pre * size)], [1])
    order = sorted(range(len(parts)), key=lambda i: parts[i][0])
    reshape, grouped_sorted, prefix = [], [], 1
    for i in order:
        pre, size = parts[i]
        if pre != prefix:  # the piece between the previous sub-axis and this one
            reshape.append(pre // prefix)
            prefix = pre
        grouped_sorted.append(len(reshape))
        reshape.append(size)
        prefix *= size
    if prefix != full:
        reshape.append(full // prefix)
    grouped = [0] * len(parts)
    for k, i in enumerate(order):
        grouped[i] = grouped_sorted[k]
    return reshape, grouped


# --------------------------------------------------------------------------- shapes

_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")


def _arrays(shape_text: str) -> list[tuple[str, Shape]]:
    """(dtype, dims) of every array in a shape, tuples flattened; layouts ignored."""
    return [
        (dtype, tuple(int(d.strip().lstrip("<=")) for d in dims.split(",") if d.strip()))
        for dtype, dims in _ARRAY.findall(shape_text)
    ]


def _bits(dtype: str) -> int:
    """Width of an XLA primitive type: the first number in its name (bf16, f8e4m3fn, c64, s4); pred is a byte."""
    if dtype == "pred":
        return 8
    width = re.search(r"\d+", dtype)
    return int(width.group()) if width else 0  # token, opaque: no data


def _nbytes(arrays: Iterable[tuple[str, Shape]]) -> int:
    return sum(math.ceil(math.prod(dims) * _bits(dtype) / 8) for dtype, dims in arrays)


# --------------------------------------------------------------------------- scanning

_KEYWORDS = re.compile(
    r"all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute|collective-broadcast|AsyncCollective"
)
# one HLO instruction line (``%name = shape opcode(operands), attributes``) and a computation's header line:
# shared by every reader of HLO text in the lab (collectives here, the schedule in lab.overlap, lab.training.profiling)
INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>.*?)\s+(?P<opcode>[a-z][a-z0-9\-]*)\((?P<rest>.*)$"
)
_SIMPLE_OPERANDS = re.compile(r"^([^()]*)\)")
HEADER = re.compile(r"^(?P<entry>ENTRY\s+)?%?(?P<name>[^\s(){]+)")
_CALLEE = re.compile(r"\b(?:calls|body|to_apply)=%?([\w.\-]+)")  # fusion/async/while/call -> callee
_ASYNC_SUFFIX = re.compile(r"-(start|update|done)$")
OP_NAME = r'op_name="([^"]*)"'
_UNMODELLED = {
    "ragged-all-to-all": "ragged-all-to-all: its sizes depend on offsets known only at run time",
    "collective-broadcast": "collective-broadcast is not one of the modelled kinds",
}


@dataclass(frozen=True)
class _Instruction:
    name: str
    shape: str
    opcode: str
    operands: tuple[str, ...]
    attrs: str
    computation: str
    line_number: int
    line: str

    def attr(self, pattern: str) -> str | None:
        match = re.search(pattern, self.attrs)
        return match.group(1) if match else None


def _instruction(line: str, computation: str, line_number: int) -> _Instruction | None:
    match = INSTRUCTION.match(line)
    if not match:
        return None
    rest = match["rest"]
    simple = _SIMPLE_OPERANDS.match(rest)
    end = simple.end() if simple else _closing_paren(rest)
    listed = re.sub(r"/\*.*?\*/", "", rest[: end - 1])
    # current XLA prints operands as %name; older text put a shape before each name
    operands = tuple(
        re.findall(r"%([\w.\-]+)", listed) if "%" in listed else (op.strip() for op in listed.split(",") if op.strip())
    )
    return _Instruction(
        match["name"], match["shape"], match["opcode"], operands, rest[end:], computation, line_number, line
    )


def _closing_paren(text: str) -> int:
    """Index just past the ')' closing an operand list (operands printed with layouts hold parens)."""
    depth = 1
    for index, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0:
            return index + 1
    return len(text)


@dataclass
class _Scan:
    """One pass over the text: computations, callers, collective-ish instructions."""

    entry: str | None = None
    num_devices: int | None = None
    instructions: list[_Instruction] = field(default_factory=list)
    callers: dict[str, tuple[str, int, str]] = field(default_factory=dict)  # callee -> (computation, line number, line)
    markers: dict[str, str] = field(
        default_factory=dict
    )  # computation -> "start"/"done" of a TPU async collective fusion
    skipped: list[Skipped] = field(default_factory=list)


def _scan(hlo_text: str) -> _Scan:
    scan = _Scan()
    computation = ""
    for number, line in enumerate(hlo_text.splitlines(), 1):
        if not line.startswith((" ", "\t")):
            if line.startswith("HloModule"):
                scan.num_devices = _module_devices(line)
            elif line.rstrip().endswith("{"):
                header = HEADER.match(line)
                computation = header["name"] if header else computation
                scan.entry = computation if header and header["entry"] else scan.entry
            continue
        if "calls=" in line or "body=" in line or "to_apply=" in line:
            for callee in _CALLEE.findall(line):
                scan.callers.setdefault(callee, (computation, number, line))
        if not _KEYWORDS.search(line):
            continue
        if "AsyncCollectiveStart" in line or "AsyncCollectiveDone" in line:
            scan.markers[computation] = "start" if "AsyncCollectiveStart" in line else "done"
        instruction = _instruction(line, computation, number)
        if instruction is None:
            scan.skipped.append(
                Skipped(
                    number,
                    line.strip()[:240],
                    "mentions a collective but is not an HLO instruction this parser can read",
                )
            )
        elif _base_opcode(instruction.opcode) in KINDS or instruction.opcode in _UNMODELLED:
            scan.instructions.append(instruction)
    return scan


def _module_devices(header: str) -> int | None:
    partitions = re.search(r"num_partitions=(\d+)", header)
    replicas = re.search(r"replica_count=(\d+)", header)
    if not partitions and not replicas:
        return None
    return int(partitions.group(1) if partitions else 1) * int(replicas.group(1) if replicas else 1)


def _base_opcode(opcode: str) -> str:
    return _ASYNC_SUFFIX.sub("", opcode)


def _module_name(hlo_text: str) -> str:
    match = re.match(r"\s*HloModule\s+([\w.\-]+)", hlo_text)
    return match.group(1) if match else "module"


# --------------------------------------------------------------------------- building collectives


class _Unreadable(ValueError):
    """A collective instruction this parser cannot interpret; becomes a Skipped entry."""


@dataclass(frozen=True)
class _Context:
    """Where a computation is called from: the innermost fusion, an async wrapper, loop trip counts."""

    fusion: _Instruction | None = None
    fusion_callee: str = ""
    async_wrapper: _Instruction | None = None
    repeats: int | None = 1


def op_names(hlo_text: str) -> dict[str, tuple[str, str]]:
    """Instruction name -> (opcode, op_name metadata) for every instruction that carries an op_name: the link from
    an op in a profile back to the JAX code (its named scopes, its autodiff transforms) that made it."""
    found = {}
    for line in hlo_text.splitlines():
        match = INSTRUCTION.match(line)
        op_name = re.search(OP_NAME, line) if match else None
        if op_name:
            found[match["name"]] = (match["opcode"], op_name[1])
    return found


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
    for instruction, result, form, is_async in _logical_collectives(scan, skipped):
        try:
            if instruction.opcode in _UNMODELLED:
                raise _Unreadable(_UNMODELLED[instruction.opcode])
            if instruction.computation not in contexts:
                contexts[instruction.computation] = _context(instruction.computation, scan)
            context = contexts[instruction.computation]
            collective = _build(instruction, result, form, is_async, context, num_devices, mesh, scan.markers)
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


def _logical_collectives(scan: _Scan, skipped: list[Skipped]) -> Iterable[tuple[_Instruction, str, str, bool]]:
    """(instruction holding the attributes, result shape, form, is_async) per collective; a -start/-done pair is one."""
    starts: dict[str, _Instruction] = {}
    updates: dict[str, str] = {}  # -update name -> its -start's name
    for instruction in scan.instructions:
        phase = _ASYNC_SUFFIX.search(instruction.opcode)
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
            yield start, instruction.shape, f"{start.opcode}/{instruction.opcode}", True
    for start in starts.values():
        skipped.append(Skipped(start.line_number, start.line.strip()[:240], f"{start.opcode} without a matching done"))


def _context(computation: str, scan: _Scan) -> _Context:
    """Walk the callers of `computation` up to ENTRY: innermost fusion, async wrapper, loop trip counts."""
    context, seen = _Context(), set()
    while computation != scan.entry and computation in scan.callers and computation not in seen:
        seen.add(computation)
        caller_computation, number, line = scan.callers[computation]
        caller = _instruction(line, caller_computation, number)
        if caller is None:
            break
        if caller.opcode == "fusion" and context.fusion is None:
            context = replace(context, fusion=caller, fusion_callee=computation)
        elif caller.opcode == "async-start" and context.async_wrapper is None:
            context = replace(context, async_wrapper=caller)
        elif caller.opcode == "while" and caller.attr(r"\bbody=%?([\w.\-]+)") == computation:
            trips = caller.attr(r'"known_trip_count":\{"n":"(\d+)"\}')
            context = replace(
                context, repeats=None if trips is None or context.repeats is None else context.repeats * int(trips)
            )
        computation = caller_computation
    return context


def _build(
    instruction: _Instruction,
    result_shape: str,
    form: str,
    is_async: bool,
    context: _Context,
    num_devices: int | None,
    mesh,
    markers: dict[str, str],
) -> Collective:
    kind = _base_opcode(instruction.opcode)
    results = _arrays(result_shape)
    if not results:
        raise _Unreadable(f"no array shape in {result_shape[:80]!r}")
    groups, pairs = _groups_and_pairs(kind, instruction, num_devices)
    group_size = max(map(len, groups), default=None)
    operands = _operand_arrays(kind, results, instruction, group_size)
    name, computation, fused = instruction.name, instruction.computation, context.fusion is not None
    split_all_to_all = kind == "all-to-all" and instruction.attr(r"dimensions=\{([\d,]*)\}") is None
    if context.fusion is not None:
        form = _fused_form(kind, context, markers.get(instruction.computation))
        if kind == "all-reduce" and _is_reduce_scatter_fusion(context):
            kind, operands, results = "reduce-scatter", results, _arrays(context.fusion.shape)
            name, computation = context.fusion.name, context.fusion.computation
    elif context.async_wrapper is not None:
        form = f"async-start %{context.async_wrapper.name} wrapping {form}"
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
        operand_bytes=_nbytes(operands),
        result_bytes=_nbytes(results),
        group_size=group_size,
        replica_groups=groups,
        source_target_pairs=pairs,
        axes=_axes(kind, groups, pairs, mesh),
        op_name=instruction.attr(OP_NAME) or (context.fusion.attr(OP_NAME) if context.fusion else None),
        repeats=context.repeats,
    )


def _groups_and_pairs(
    kind: str, instruction: _Instruction, num_devices: int | None
) -> tuple[Groups, tuple[tuple[int, int], ...]]:
    """Replica groups (for a permute: the devices its pairs link) and a permute's source-target pairs."""
    if kind == "collective-permute":
        pairs = _source_target_pairs(instruction)
        return _connected_components(pairs), pairs
    return expand_replica_groups(_replica_groups_text(instruction) or "{}", num_devices), ()


def _replica_groups_text(instruction: _Instruction) -> str | None:
    """The replica_groups value in any notation (a mesh value holds commas, spaces and braces)."""
    attrs = instruction.attrs
    start = attrs.find("replica_groups=")
    if start < 0:
        return None
    value = attrs[start + len("replica_groups=") :]
    if value.startswith("{"):
        return value[: _closing_brace(value)]
    match = _GROUPS_VALUE.match(value)
    if not match:
        raise _Unreadable(f"unknown replica_groups notation {value[:80]!r}")
    return match.group()


def _closing_brace(text: str) -> int:
    depth = 0
    for index, char in enumerate(text):
        depth += {"{": 1, "}": -1}.get(char, 0)
        if depth == 0:
            return index + 1
    raise _Unreadable(f"unbalanced braces in {text[:80]!r}")


def _source_target_pairs(instruction: _Instruction) -> tuple[tuple[int, int], ...]:
    text = instruction.attr(r"source_target_pairs=(\{(?:\{\d+,\d+\},?)*\})")
    if text is None:
        raise _Unreadable("collective-permute without source_target_pairs")
    return tuple((int(a), int(b)) for a, b in re.findall(r"\{(\d+),(\d+)\}", text))


def _connected_components(pairs: Sequence[tuple[int, int]]) -> Groups:
    """Devices linked by a permute's pairs, as groups (a ring over an axis gives that axis's groups)."""
    parent: dict[int, int] = {}

    def root(i: int) -> int:
        while parent.setdefault(i, i) != i:
            i = parent[i]
        return i

    for source, target in pairs:
        parent[root(source)] = root(target)
    members: dict[int, list[int]] = defaultdict(list)
    for device in sorted(parent):
        members[root(device)].append(device)
    return tuple(sorted(tuple(m) for m in members.values()))


def _operand_arrays(
    kind: str, results: list[tuple[str, Shape]], instruction: _Instruction, group_size: int | None
) -> list[tuple[str, Shape]]:
    """Operand shapes from result shapes (operands are printed by name only in current HLO text)."""
    if kind not in ("all-gather", "reduce-scatter"):
        return results
    dimension = instruction.attr(r"dimensions=\{(\d+)\}")
    if dimension is None or not group_size:
        raise _Unreadable(f"{kind} without dimensions={{..}} or without a known group size")
    d = int(dimension)
    scale = (lambda n: n // group_size) if kind == "all-gather" else (lambda n: n * group_size)
    return [(dtype, dims[:d] + (scale(dims[d]),) + dims[d + 1 :]) for dtype, dims in results]


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


def _axes(kind: str, groups: Groups, pairs, mesh) -> tuple[str, ...] | None:
    if mesh is None:
        return None
    shape, names = mesh
    if kind == "collective-permute":
        return _permute_axes(pairs, shape, names)
    return _cached_axes_of_groups(shape, names, groups)


@functools.lru_cache(maxsize=4096)
def _cached_axes_of_groups(shape: Shape, names: tuple[str, ...], groups: Groups) -> tuple[str, ...] | None:
    if any(i >= math.prod(shape) for g in groups for i in g):
        return None
    return axes_of_groups(shape, names, groups)


def _permute_axes(pairs, shape: Shape, names: tuple[str, ...]) -> tuple[str, ...] | None:
    """The mesh axes along which some pair moves data (coordinates of source and target differ)."""
    if not pairs or any(i >= math.prod(shape) for pair in pairs for i in pair):
        return None
    sources, targets = (np.stack(np.unravel_index([p[k] for p in pairs], shape)) for k in (0, 1))
    moved = np.any(sources != targets, axis=1)
    return tuple(name for name, used in zip(names, moved) if used)


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


def summary_table(totals: Iterable[CollectiveTotal], title: str = "collectives in the compiled program"):
    """A rich Table of `summarize` rows."""
    from rich.table import Table

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
    import humanize

    shown = []
    if "flops" in cost:
        shown.append(f"{humanize.metric(cost['flops'], 'FLOP')}")
    if "bytes accessed" in cost:
        shown.append(f"{format_bytes(cost['bytes accessed'])} accessed")
    if "optimal_seconds" in cost:
        shown.append(f"optimal {humanize.metric(cost['optimal_seconds'], 's')}")
    return ", ".join(shown) or "no cost figures"


# --------------------------------------------------------------------------- compiling


def inspect(fn, *args: Any, mesh=None, **kwargs: Any) -> Inspection:
    """Lower and compile ``fn(*args, **kwargs)`` (jitting it if needed) and read what XLA produced.

    `args` may be arrays or ``jax.ShapeDtypeStruct`` with shardings; on a
    compile-only TPU topology they must be ShapeDtypeStructs, and nothing runs.
    `mesh` (default: the mesh of the first NamedSharding among the args) maps
    replica groups to axes.
    """
    import jax

    if not callable(fn):
        raise LabError(f"inspect needs a function (or a jax.jit-ed one), not {type(fn).__name__}")
    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    mesh = mesh if mesh is not None else _mesh_of((args, kwargs))
    with _quiet_on_tpu(mesh):
        lowered = jitted.lower(*args, **kwargs)
        compiled = lowered.compile()
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
    import jax
    from jax.sharding import NamedSharding

    for leaf in jax.tree.leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding):
            return sharding.mesh
    return None


def _quiet_on_tpu(mesh):
    """libtpu writes start-up noise to fd 2 when it compiles; hide it for TPU meshes only."""
    from lab.devices import quiet_native_stderr

    on_tpu = mesh is not None and getattr(mesh.devices.flat[0], "platform", "") == "tpu"
    return quiet_native_stderr() if on_tpu else contextlib.nullcontext()


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
