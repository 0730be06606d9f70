"""Why each collective is there: follow its data back to the program's inputs, or forward to their update.

The SPMD partitioner inserts a collective where the sharding a value has is
not the sharding an operation needs. In the optimized HLO the value's history
is still there, as the instructions that made it. Walking it explains most
collectives of a training step:

* **parameter**: the operand is an input of the entry computation reached
  through data movement only (copies, converts, bitcasts, slices, the loop
  carry of a ``while``, another collective): the gather of a weight sharded
  over ``fsdp`` (ZeRO-3's all-gather) reads the weight itself. On TPU the
  walk also crosses the fusion that holds the collective (libtpu's async
  collective fusions), asynchronous slices of a weight put back together, a
  forward loop that passes the weights on to the backward one, and the zeros
  an all-gather written as an all-reduce adds each piece into;
* **gradient**: a reduction (all-reduce, reduce-scatter) whose result flows,
  through elementwise work only, into the update of an input with the same
  number of elements, or out of the step in its place: the reduction of that
  weight's gradient over ``data``; followed through slices (ZeRO-1 updates its
  rows of it, libtpu's optimizer fusion slices this device's rows out of a
  whole reduced gradient), into the buffer a scanned backward stacks it in and
  out of the loop's carry. A permute, gather
  or all-to-all carries one only in the backward pass (``transpose(jvp(...))``)
  and at the weight's size; after the backward, a weight-sized one moving a
  value into its weight's update is that updated weight: a **parameter**;
* **input**: data movement of an input that is not a parameter: its declared
  sharding differs from the one the computation wants (a reshard);
* **activation**: a value computed in the step whose shape carries the tokens
  (a dimension equal to the batch, or the sequence, of an input that is neither
  a parameter nor optimizer state; S of S + 1 token ids only after a
  gradient's flow is ruled out), a scalar reduced across the batch (the
  loss), or a reduce's statistics of the batch (a router's load per expert)
  summed over the axes the batch is split over: tensor parallelism's
  all-reduce, MoE's all-to-all, sequence parallelism's gathers;
* **index**: a value computed from no input at all (an ``iota``, the
  device's id, constants: a ``jnp.arange``, positions, a mask's row
  numbers), which the partitioner computed split, as one of its uses wanted,
  and gathers whole for another (a causal mask comparing ``i[:, None]`` with
  ``i[None, :]``): numbers every device could make itself;
* **surprise**: nothing above. These are listed first: a sharding the user did
  not ask for, a reduction over a sharded dimension of a weight, a layout the
  partitioner chose; pin the layout at that line with
  ``jax.lax.with_sharding_constraint`` or an ``out_sharding``.

An input is a *parameter* when a gradient is attributed to it, or when its
name says so (``params``, ``weight``, ``kernel``, ...); the names are the ones
JAX writes on the entry computation's parameters (``params['w_up']``).
Shardy's own record of why a value got its sharding (its
``debug-sharding-origins`` propagation option) is compiled into jaxlib 0.10
but reachable neither from JAX's configuration nor from XLA's debug options,
so this dataflow reading is what the lab uses.

It is one concept, the dataflow reading: the graph read once, the walk back
to an input and forward to an update, and the classification that weighs the
two; each rule above is a few lines of the walk, and they only make sense
together (a gradient is decided before the batch, a move before both).
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from lab.collectives import KINDS
from lab.hlo.collectives import Collective
from lab.hlo.specs import partition_spec
from lab.hlo.text import Instruction, arrays, base_opcode, computations, parse_instruction

ORIGINS = ("surprise", "parameter", "gradient", "input", "activation", "index")

# data movement: the value is the same numbers, moved, cast or cut
_MOVES = frozenset(
    (
        "bitcast",
        "bitcast-convert",
        "broadcast",
        "collective-permute",
        "collective-permute-done",
        "collective-permute-start",
        "all-gather",
        "all-gather-done",
        "all-gather-start",
        "all-to-all",
        "convert",
        "copy",
        "copy-done",
        "copy-start",
        "dynamic-slice",
        "get-tuple-element",
        "optimization-barrier",
        "pad",
        "reshape",
        "slice",
        "transpose",
        "async-start",
        "async-done",
        "slice-start",  # libtpu's asynchronous slices of a weight (put back together by a ConcatBitcast custom-call)
        "slice-done",
    )
)
_NOT_DATA = frozenset(("constant", "iota", "partition-id", "replica-id", "after-all"))
_PARAMETER_NAME = re.compile(
    r"param|weight|kernel|bias|scale|embed|^w$|\bw_|\bw\d+\b|\['w|lm_head|wq|wk|wv|wo\b", re.IGNORECASE
)
_OPTIMIZER_NAME = re.compile(r"opt|\bmu\b|\bnu\b|mu'|nu'|\.mu|\.nu|moment|count", re.IGNORECASE)
_REDUCTIONS = ("all-reduce", "reduce-scatter")


@dataclass(frozen=True)
class Input:
    """A parameter of the entry computation: one input of the user's function."""

    index: int
    name: str  # JAX's name for it (params['w_up']), or the HLO name when none was written
    local_shape: tuple[int, ...]
    global_shape: tuple[int, ...]
    sharding: str  # as XLA wrote it ("" when replicated or unknown)
    dtype: str = ""  # XLA's element type (s32, bf16, ...)
    spec: str | None = None  # the sharding as a PartitionSpec of the mesh, when the mesh is known and it is one

    @property
    def declared(self) -> str:
        """Its sharding as the user wrote it where that can be read (`lab.hlo.specs`), else as XLA wrote it."""
        return self.spec or self.sharding or "replicated"

    @property
    def elements(self) -> int:
        return math.prod(self.local_shape)


@dataclass(frozen=True)
class Origin:
    """Why one collective is there."""

    kind: str  # one of ORIGINS
    name: str | None  # the input it moves or whose gradient it reduces
    why: str  # the evidence, in words and numbers

    def __str__(self) -> str:
        return f"{self.kind} {self.name}" if self.name else self.kind


@dataclass(frozen=True)
class Dataflow:
    """A module's instructions, who uses each, and its entry computation's inputs and outputs: read once."""

    instructions: dict[tuple[str, str], Instruction]  # (computation, name) -> instruction
    users: dict[tuple[str, str], list[Instruction]]
    while_callers: dict[str, tuple[str, Instruction]]  # body computation -> (computation, while instruction)
    entry: str
    inputs: dict[int, Input]
    outputs: tuple[str, ...]  # the entry computation's values the step returns, in order (its ROOT's operands
    # when that is a tuple or a combined all-reduce of them, else the ROOT itself)
    opcodes: dict[str, frozenset[str]] = field(default_factory=dict)  # computation -> the opcodes it holds
    callers: dict[str, tuple[str, Instruction]] = field(default_factory=dict)  # computation a fusion or call runs
    # (libtpu's async collective fusions hold the collective itself) -> (computation, the one instruction calling it)
    roots: dict[str, Instruction] = field(default_factory=dict)  # computation -> its ROOT instruction

    @classmethod
    def of(cls, hlo_text: str, mesh: dict[str, int] | None = None, names: Mapping[str, str] | None = None) -> Dataflow:
        """Read once; with the `mesh` (axis -> size, in order) the inputs' shardings read as PartitionSpecs too, and
        with `names` (JAX's name of an input -> the program's) the inputs named as the program names them."""
        return _dataflow(hlo_text, mesh or {}, names or {})

    @property
    def entry_inputs(self) -> tuple[Input, ...]:
        """The entry computation's parameters, with JAX's names and their global shapes."""
        return tuple(sorted(self.inputs.values(), key=lambda i: i.index))


def attribute(graph: Dataflow, collectives: Sequence[Collective]) -> dict[str, Origin]:
    """Collective (by HLO instruction name) -> its `Origin`."""
    named = {i.index for i in graph.inputs.values() if _PARAMETER_NAME.search(i.name)}
    weights = named or set(graph.inputs)  # without names to go by, any input may be a weight
    if not _differentiates(graph):  # no autodiff, no gradient: a result of a weight's size is only a result
        weights = set()
    members = {c.name: _members(graph, c, weights) for c in collectives}
    receives_gradient = {i for ms in members.values() for m in ms for i in m.gradient}
    parameters = named | receives_gradient
    batches, shifted = _batch_sizes(graph.inputs.values(), parameters), _shifted_sequences(graph.inputs.values())
    split = _batch_axes(graph.inputs.values(), parameters)
    return {c.name: _origin(c, members[c.name], parameters, batches, shifted, graph, split) for c in collectives}


def _differentiates(graph: Dataflow) -> bool:
    """Whether the program runs a backward pass: JAX names the ops autodiff transposes ``transpose(jvp(...))``."""
    return any("transpose(" in (i.metadata.get("op_name") or "") for i in graph.instructions.values())


@dataclass(frozen=True)
class _Member:
    """One array a collective carries (a combined collective carries several)."""

    shape: tuple[int, ...]
    moved: int | None  # the entry input it is a moved copy of
    gradient: tuple[int, ...]  # the inputs whose update (or returned gradient) it flows into
    weight_sized: bool = False  # as many elements as those inputs, shard or whole (one, or all in one buffer)
    indices: bool = False  # computed from no input: iotas, device ids and constants only


# --------------------------------------------------------------------------- classifying


def _origin(
    collective: Collective,
    members: list[_Member],
    parameters: set[int],
    batches: dict[int, str],
    shifted: dict[int, str],
    graph: Dataflow,
    batch_axes: dict[str, str],
) -> Origin:
    axes = ",".join(collective.axes or ()) or "its groups"
    if collective.moves_nothing:
        return Origin(
            "surprise",
            None,
            "moves nothing: every replica group is one device (an axis of size 1), so each keeps its own data; "
            "XLA's simplifiers usually remove such a collective, and where one stays it sends no bytes",
        )
    kinds = [_member_kind(m, parameters, batches, shifted) for m in members]
    named = [(kind, m) for kind, m in zip(kinds, members) if kind != "scalar"]
    if not named:
        if collective.kind in _REDUCTIONS:
            return Origin("activation", None, f"a scalar reduced over {axes}: the loss or a statistic of the batch")
        return Origin("activation", None, f"a scalar moved over {axes}: a counter, a random key or a statistic")
    scalars = len(members) - len(named)
    also = f" (and {scalars} scalar{'s' * (scalars > 1)}: the loss or its statistics)" if scalars else ""
    weight = {kind: sum(math.prod(m.shape) for k, m in named if k == kind) for kind in ORIGINS}
    kind = max(ORIGINS, key=lambda k: weight[k])  # what most of its elements are
    chosen = [m for k, m in named if k == kind]
    if kind in ("parameter", "input"):
        moved = [graph.inputs[i] for i in dict.fromkeys(m.moved for m in chosen)]
        names = ", ".join(i.name for i in moved)
        share = _share(collective, moved)
        if kind == "parameter":
            return Origin(kind, names, f"moves {names} over {axes}: {share}{also}")
        declared = moved[0].declared
        return Origin(
            kind,
            names,
            f"reshards {names} over {axes} (declared {declared}; the computation wants another layout): {share}{also}",
        )
    if kind == "index":
        return Origin(
            kind,
            None,
            f"shape {list(chosen[0].shape)}, computed from no input (iota, the device's id, constants: an arange, "
            f"positions): numbers each device can make itself, made split and moved over {axes}{also}",
        )
    if kind == "gradient":
        targets = [graph.inputs[i] for i in dict.fromkeys(i for m in chosen for i in m.gradient)]
        names = ", ".join(i.name for i in targets)
        local, whole = sum(i.elements for i in targets), sum(math.prod(i.global_shape) for i in targets)
        plural = "s" * (len(targets) > 1)
        carried = sum(math.prod(m.shape) for m in chosen)
        size = (
            f"{whole:,} elements, the whole parameter{plural} (each device holds {local:,})"
            if local != whole and carried == whole
            else f"{carried:,} elements per device, {carried // local} shards of the parameter{plural} (returned "
            "split over fewer axes than the parameters are)"
            if local < carried < whole
            else f"{local:,} elements per device, the size of the parameter{plural}"
        )
        return Origin(
            kind,
            names,
            f"{'reduces' if collective.kind in _REDUCTIONS else 'moves'} the gradient of {names} over {axes}: the "
            f"result goes to its update or out of the step, {size}{also}",
        )
    if kind == "activation":
        tokens = {**shifted, **batches}
        size = next(size for size in tokens if size > 1 and size in chosen[0].shape)
        return Origin(
            kind,
            None,
            f"shape {list(chosen[0].shape)} carries the tokens ({size} = {tokens[size]}): moves activations{also}",
        )
    shapes = [list(m.shape) for m in chosen]
    listed = f"{'shapes' if len(shapes) > 1 else 'shape'} {', '.join(map(str, shapes))}"
    over = set(collective.axes or ())
    if collective.kind in _REDUCTIONS and over and over <= set(batch_axes) and _reduces(collective):
        batch = batch_axes[next(iter(over))]
        return Origin(
            "activation",
            None,
            f"{listed}: statistics of the batch (a reduce over it, which leaves no batch dimension) summed over "
            f"{axes}, the axes {batch} is split over{also}",
        )
    return Origin(
        kind,
        None,
        f"{listed}: neither an input moved, a gradient, nor batch-shaped; the partitioner chose a layout here that "
        "the program does not declare",
    )


def op_names(op_name: str) -> list[str]:
    """The JAX op names a collective's holds: its own, or of collectives XLA combined into one,
    ``jit(f)/(transpose(jvp())/reduce_sum:jvp()/reduce_sum)``, each member's (``jit(f)/transpose(jvp())/reduce_sum``,
    ``jit(f)/jvp()/reduce_sum``)."""
    combined = re.fullmatch(r"(.*?)/\((.*)\)", op_name)
    return [f"{combined[1]}/{member}" for member in combined[2].split(":")] if combined else [op_name]


def _reduces(collective: Collective) -> bool:
    """Whether JAX's op at the collective is a reduction (reduce_sum, reduce_max, ...; of combined ones, each)."""
    return all(op.rsplit("/", 1)[-1].startswith("reduce_") for op in op_names(collective.op_name or ""))


def _member_kind(member: _Member, parameters: set[int], batches: dict[int, str], shifted: dict[int, str]) -> str:
    if member.moved is not None:
        return "parameter" if member.moved in parameters else "input"
    if math.prod(member.shape) == 1:
        return "scalar"
    if member.indices:
        return "index"
    if member.weight_sized:  # before the batch: a weight's dimension may equal it (8192 wide, 8192 sequences)
        return "gradient"
    if any(size > 1 and size in member.shape for size in batches):
        return "activation"
    if member.gradient:
        return "gradient"
    return "activation" if any(size > 1 and size in member.shape for size in shifted) else "surprise"


def _share(collective: Collective, moved: list[Input]) -> str:
    """How the collective's elements compare with the inputs it moves."""
    local = sum(i.elements for i in moved)
    whole = sum(math.prod(i.global_shape) for i in moved)
    result = sum(math.prod(s) for s in collective.result_shapes)
    if whole and result == whole:
        return f"its result is the whole of it ({whole:,} elements)"
    if local and result == local:
        return f"as many elements as each device holds ({local:,} of {whole:,})"
    if result > whole:  # made from it (a broadcast, a comparison), or carried with others in one collective
        return f"{result:,} elements, more than its {whole:,}: made from it, or carried with other arrays"
    return f"{result:,} of its {whole:,} elements"


def _batch_axes(inputs: Iterable[Input], parameters: set[int]) -> dict[str, str]:
    """The mesh axes the batch (dimension 0) of an input that is no parameter or optimizer state is split over
    (read from its PartitionSpec), each -> the words that name it (``the batch of tokens``)."""
    found: dict[str, str] = {}
    for i in inputs:
        if i.index in parameters or not i.local_shape or not i.spec or _OPTIMIZER_NAME.search(i.name):
            continue
        first = re.match(r"P\((\([^)]*\)|'[^']*'|None)", i.spec)
        for axis in re.findall(r"'(\w+)'", first[1]) if first else ():
            found.setdefault(axis, f"the batch of {i.name}")
    return found


def _shifted_sequences(inputs: Iterable[Input]) -> dict[int, str]:
    """The sequence of S + 1 token ids [B, S + 1] read as inputs and targets shifted by one: S, weaker evidence than
    a dimension an input has (a weight's width may be S too), so read after a gradient's flow."""
    return {
        i.global_shape[1] - 1: f"the sequence of {i.name}, less the token only a target reads"
        for i in inputs
        if len(i.local_shape) == 2 and i.dtype[:1] in ("s", "u")
    }


def _batch_sizes(inputs: Iterable[Input], parameters: set[int]) -> dict[int, str]:
    """The token dimensions of the inputs that are not parameters, global and per device: the batch (dimension 0),
    and the sequence (dimension 1) of token ids [B, S] or of embeddings [B, S, D] (not the features of [B, D])."""
    found: dict[int, str] = {}
    for i in inputs:
        if i.index in parameters or not i.local_shape or _OPTIMIZER_NAME.search(i.name):  # Adam's moments: weights'
            continue
        found.setdefault(i.global_shape[0], f"the batch of {i.name}")
        found.setdefault(i.local_shape[0], f"the batch of {i.name} per device")
        if len(i.local_shape) >= 3 or (len(i.local_shape) == 2 and i.dtype[:1] in ("s", "u")):
            found.setdefault(i.global_shape[1], f"the sequence of {i.name}")
            found.setdefault(i.local_shape[1], f"the sequence of {i.name} per device")
    return found


# --------------------------------------------------------------------------- walking the graph


def _dataflow(hlo_text: str, mesh: dict[str, int], names: Mapping[str, str]) -> Dataflow:
    instructions, users, whiles, entry, root = {}, defaultdict(list), {}, "", None
    called: dict[str, list[tuple[str, Instruction]]] = defaultdict(list)
    roots: dict[str, Instruction] = {}
    opcodes: dict[str, set[str]] = defaultdict(set)
    for computation in computations(hlo_text):
        entry = computation.name if computation.is_entry else entry
        for number, line in computation.instruction_lines():
            instruction = parse_instruction(line, computation.name, number)
            if instruction is None:
                continue
            instructions[computation.name, instruction.name] = instruction
            opcodes[computation.name].add(instruction.opcode)
            if instruction.line.lstrip().startswith("ROOT"):
                roots[computation.name] = instruction
                root = instruction if computation.is_entry else root
            for operand in instruction.operands:
                users[computation.name, operand].append(instruction)
            if instruction.opcode == "while":
                body = instruction.attr(r"\bbody=%?([\w.\-]+)")
                if body:
                    whiles[body] = (computation.name, instruction)
            elif callee := instruction.attr(r"\bcalls=%?([\w.\-]+)"):
                called[callee].append((computation.name, instruction))
    inputs = {}
    for (computation, _), instruction in instructions.items():
        if computation == entry and instruction.opcode == "parameter":
            index = _parameter_number(instruction, 0)
            inputs[index] = _input(instruction, index, mesh, names)
    outputs = () if root is None else tuple(root.operands) if _returns_each_operand(root) else (root.name,)
    callers = {callee: sites[0] for callee, sites in called.items() if len(sites) == 1}
    return Dataflow(
        instructions,
        users,
        whiles,
        entry,
        inputs,
        outputs,
        {c: frozenset(o) for c, o in opcodes.items()},
        callers,
        roots,
    )


def _returns_each_operand(root: Instruction) -> bool:
    """The step's outputs are its ROOT's operands, one each: a tuple, or a combined all-reduce of them (a psum of
    the returned gradients as the last op)."""
    combined = root.opcode == "all-reduce" and len(arrays(root.shape)) == len(root.operands) > 1
    return root.opcode == "tuple" or combined


def _parameter_number(instruction: Instruction, default: int) -> int:
    match = re.search(r"parameter\((\d+)\)", instruction.line)
    return int(match[1]) if match else default


def _input(instruction: Instruction, index: int, mesh: dict[str, int], names: Mapping[str, str]) -> Input:
    shapes = arrays(instruction.shape)
    dtype, local = shapes[0] if len(shapes) == 1 else ("", ())
    sharding = instruction.attr(r"sharding=(\{[^}]*\})") or ""
    name = instruction.metadata.get("op_name") or instruction.name
    name = names.get(name, name)
    spec = partition_spec(sharding, mesh) if mesh else None
    return Input(index, name, local, _global_shape(local, sharding), sharding, dtype, spec)


def _global_shape(local: tuple[int, ...], sharding: str) -> tuple[int, ...]:
    """The declared (global) shape: the local one times the tiles of ``sharding={devices=[a,b,...]...}``."""
    tiles = re.search(r"devices=\[([\d,]+)\]", sharding)
    if not tiles:
        return local
    counts = [int(t) for t in tiles[1].split(",")]
    return tuple(d * t for d, t in zip(local, counts))


def _members(graph: Dataflow, collective: Collective, weights: set[int]) -> list[_Member]:
    """The arrays the collective carries: each one's shape, the input it moves, the input its result updates."""
    instruction = graph.instructions.get((collective.computation, collective.name))
    shapes = list(collective.operand_shapes) or [()]
    if instruction is None:
        return [_Member(tuple(s), None, ()) for s in shapes]
    data = list(instruction.operands)  # all of them: member k of a combined collective is element k of its result
    if base_opcode(instruction.opcode) == "collective-permute" and len(data) == 4:
        data = data[:1]  # the in-place form: (input, output buffer, input offsets, output offsets)
    if base_opcode(instruction.opcode) == "ragged-all-to-all":
        data = data[:1]  # (input, output buffer, and four arrays of offsets and sizes)
    results = _results(graph, instruction, len(data))
    total = sum(math.prod(s) for s in collective.result_shapes)
    # the step's last op, a combined all-reduce of what it returns: member k is its output k
    returned = len(data) > 1 and graph.outputs == tuple(data) and graph.roots.get(graph.entry) is instruction
    members = []
    for k, operand in enumerate(data):
        if returned:
            gradient = tuple(i for i in [_returned_gradient(graph, k, weights)] if i is not None)
        else:
            gradient = _gradient_of(graph, results[k], weights, total) if k < len(results) else ()
        result = collective.result_shapes
        carried = {total, math.prod(result[k])} if k < len(result) else {total}
        sized = _weight_sized(graph, gradient, carried)
        moved = _trace_back(graph, instruction.computation, operand, None, 0)
        if collective.kind not in _REDUCTIONS:
            moved, gradient, sized = _moved_into_update(collective, moved, gradient, sized)
        elif moved is not None and graph.inputs[moved].elements > math.prod(shapes[k] if k < len(shapes) else ()):
            moved = None  # a sum of the input over a dimension (a row's max, a column's total), not the input moved
        indices = moved is None and _from_no_input(graph, instruction.computation, operand)
        members.append(_Member(tuple(shapes[k]) if k < len(shapes) else (), moved, gradient, sized, indices))
    return members


def _moved_into_update(
    collective: Collective, moved: int | None, gradient: tuple[int, ...], sized: bool
) -> tuple[int | None, tuple[int, ...], bool]:
    """A permute, gather or all-to-all flowing into a weight's update: (moved, gradient, weight-sized) as read.

    Only a reduction sums a gradient; the others move one only in the backward pass (JAX names its ops
    ``transpose(jvp(...))``) and at the weight's size. In the forward pass (``jvp(...)``) the same sizes are an
    activation's coincidence (a pipeline's stage-to-stage sends); after it (the optimizer), a weight-sized gather
    into the update is the updated weight itself, moved to the layout the step returns it in (ZeRO-1)."""
    op = collective.op_name or ""
    if not sized:
        return moved, (), False
    if "transpose(" in op:
        return moved, gradient, True
    if "jvp(" in op or moved is not None:
        return moved, (), False
    return gradient[0], (), False


def _weight_sized(graph: Dataflow, gradient: tuple[int, ...], carried: set[int]) -> bool:
    """Its result as many elements as the weight it updates (shard or whole), or as all of them together (one
    buffer of several gradients); the reduced operand, before, may be any multiple of that. One size among
    several weights' is no evidence: an activation may be as large as one of them."""
    shards = [graph.inputs[i].elements for i in gradient]
    wholes = [math.prod(graph.inputs[i].global_shape) for i in gradient]
    return bool(gradient) and bool(carried & {sum(shards), sum(wholes)})


def _results(graph: Dataflow, instruction: Instruction, members: int) -> list[list[Instruction]]:
    """For each member, the instructions that hold its result: the collective (its -done), or its tuple elements."""
    holders = [instruction]
    for user in graph.users.get((instruction.computation, instruction.name), ()):
        if user.opcode.endswith("-done") or user.opcode == "async-done":
            holders = [user]
    if members <= 1:
        return [holders]
    per: list[list[Instruction]] = [[] for _ in range(members)]
    for holder in holders:
        for user in graph.users.get((holder.computation, holder.name), ()):
            index = user.attr(r"\bindex=(\d+)") if user.opcode == "get-tuple-element" else None
            if index is not None and int(index) < members:
                per[int(index)].append(user)
    return per


def _trace_back(graph: Dataflow, computation: str, name: str, index: int | None, depth: int) -> int | None:
    """The entry input `name` is a moved copy of (element `index` of it when it is a tuple), else None."""
    instruction = graph.instructions.get((computation, name))
    if instruction is None or depth > 64:
        return None
    opcode = instruction.opcode
    if opcode == "parameter":
        if computation == graph.entry:
            return _parameter_number(instruction, 0)
        caller = graph.while_callers.get(computation)
        if caller is not None:
            outer, loop = caller
            return (
                _trace_back(graph, outer, loop.operands[0], index, depth + 1)
                if loop.operands and index is not None
                else None
            )
        if computation not in graph.callers:  # a fusion's or a call's parameter k is its caller's operand k
            return None
        outer, call = graph.callers[computation]
        k = _parameter_number(instruction, -1)
        return _trace_back(graph, outer, call.operands[k], index, depth + 1) if 0 <= k < len(call.operands) else None
    if opcode == "tuple":
        if index is None or index >= len(instruction.operands):
            return None
        return _trace_back(graph, computation, instruction.operands[index], None, depth + 1)
    if opcode == "get-tuple-element":
        element = instruction.attr(r"\bindex=(\d+)")
        if element is None or not instruction.operands:
            return None
        return _trace_back(graph, computation, instruction.operands[0], int(element), depth + 1)
    if opcode == "while":  # element k of a loop's result: its initial element k, where the body passes it on as is
        body = instruction.attr(r"\bbody=%?([\w.\-]+)")
        if index is None or not body or not instruction.operands or not _passed_on(graph, body, index):
            return None
        return _trace_back(graph, computation, instruction.operands[0], index, depth + 1)
    data = [o for o in instruction.operands if not _is_constant(graph, computation, o)]
    if opcode in _MOVES or (opcode in ("fusion", "dynamic-update-slice") and len(data) == 1):
        return _trace_back(graph, computation, data[0], index, depth + 1) if data else None
    if opcode in ("concatenate", "custom-call") and len(data) > 1:  # pieces of one input put back together
        sources = {_trace_back(graph, computation, operand, None, depth + 1) for operand in data}
        return sources.pop() if len(sources) == 1 and None not in sources else None
    return None


def _passed_on(graph: Dataflow, body: str, k: int) -> bool:
    """Whether a loop body returns element k of its carry as it received it (the weights a scanned forward pass
    carries through every layer, for the backward loop after it)."""
    root = graph.roots.get(body)
    if root is None or root.opcode != "tuple" or k >= len(root.operands):
        return False
    value = graph.instructions.get((body, root.operands[k]))
    while value is not None and value.opcode in ("copy", "bitcast") and len(value.operands) == 1:
        value = graph.instructions.get((body, value.operands[0]))
    if value is None or value.opcode != "get-tuple-element" or value.attr(r"\bindex=(\d+)") != str(k):
        return False
    carry = graph.instructions.get((body, value.operands[0]))
    return carry is not None and carry.opcode == "parameter"


def _is_constant(graph: Dataflow, computation: str, name: str) -> bool:
    """Operands that carry no data of the program: constants, ids, scalars (offsets, counters), and a constant
    broadcast (the zeros an all-gather written as an all-reduce adds each device's piece into)."""
    instruction = graph.instructions.get((computation, name))
    if instruction is None:
        return False
    shapes = arrays(instruction.shape)
    if instruction.opcode == "broadcast":
        return all(_is_constant(graph, computation, o) for o in instruction.operands)
    return instruction.opcode in _NOT_DATA or (len(shapes) == 1 and not shapes[0][1])


def _from_no_input(graph: Dataflow, computation: str, name: str) -> bool:
    """Whether a value is computed from iotas, device ids and constants alone: every instruction it is made from,
    each visited once, is one of those or an op of them (a fusion sees only its operands; a fusion of none holds
    iotas and constants), none a parameter, a loop, a call or a custom call."""
    seen, todo = set(), [name]
    while todo:
        instruction = graph.instructions.get((computation, todo.pop()))
        if instruction is None or instruction.opcode in ("parameter", "while", "call", "custom-call"):
            return False
        if instruction.name in seen or instruction.opcode in _NOT_DATA:
            continue
        if not instruction.operands and instruction.opcode != "fusion":  # made of nothing else: a random draw
            return False
        seen.add(instruction.name)
        todo += instruction.operands
    return True


def _gradient_of(graph: Dataflow, start: list[Instruction], weights: set[int], total: int) -> tuple[int, ...]:
    """The weight whose update a reduced value flows into (elementwise, or resharded by further collectives), or
    whose place it takes among the step's outputs."""
    if not start:
        return ()
    # a member, or all the collective's members put back together (a concatenate of a combined all-to-all)
    elements = {*(math.prod(d) for node in start for _, d in arrays(node.shape)), total} - {1}
    frontier, seen, found = list(start), set(), []
    while frontier and len(seen) < 512:
        node = frontier.pop(0)
        if (node.computation, node.name) in seen:
            continue
        seen.add((node.computation, node.name))
        if node.computation == graph.entry and node.name in graph.outputs:
            found.append(_returned_gradient(graph, graph.outputs.index(node.name), weights))
        for user in graph.users.get((node.computation, node.name), ()):
            for operand in user.operands if user.opcode != "tuple" else ():  # a tuple combines nothing
                if operand != node.name:
                    source = _trace_back(graph, user.computation, operand, None, 0)
                    if source in weights and (
                        graph.inputs[source].elements in elements or _updates_a_slice(graph, user, source, elements)
                    ):
                        found.append(source)
            if user.line.lstrip().startswith("ROOT") and user.computation in graph.while_callers:
                frontier += _carried_out(graph, user, node.name)  # a loop's carry: on past the loop
                continue
            sizes = _sizes_of(user.shape)
            only_this = [o for o in user.operands if not _is_constant(graph, user.computation, o)] == [node.name]
            if base_opcode(user.opcode) in KINDS or only_this or _resized(graph, node, user):
                # resharded, cut into pieces (a combiner's concatenated buffer sliced back, a ZeRO-1 shard), or
                # written into a larger buffer (a scan's stacked gradient): follow every piece
                elements |= {*sizes, sum(sizes)} - {1}
            if set(sizes) & elements:  # elementwise: the same elements go on
                frontier.append(user)
    found = list(dict.fromkeys(i for i in found if i is not None))
    # the weights, not their optimizer state (AdamW's moments are updated from the same gradient, first); several
    # when the collective carries several gradients in one buffer (XLA:GPU's combiner concatenates them)
    weights_found = tuple(i for i in found if not _OPTIMIZER_NAME.search(graph.inputs[i].name))
    return weights_found or tuple(found[:1])


def _updates_a_slice(graph: Dataflow, user: Instruction, source: int, elements: set[int]) -> bool:
    """`user` combines the value with this device's slice of input `source` (a dynamic-slice inside it, its result
    the value's size and a fraction of the input's): the update of the rows of a weight the value is the gradient of
    (a replicated bias whose gradient the layouts split)."""
    held = graph.opcodes.get(user.attr(r"\bcalls=%?([\w.\-]+)") or "", frozenset()) | {user.opcode}
    results, whole = _sizes_of(user.shape), graph.inputs[source].elements
    return (
        "dynamic-slice" in held
        and len(results) == 1
        and results[0] in elements
        and whole > results[0] > 1
        and whole % results[0] == 0
    )


def _resized(graph: Dataflow, node: Instruction, user: Instruction) -> bool:
    """`user` slices `node` (a dynamic-slice, or a fusion holding one: its result a fraction of it) or writes it
    into a buffer of its result's size (a dynamic-update-slice, or a fusion holding one)."""
    held = {user.opcode}
    if user.opcode == "fusion":
        held = graph.opcodes.get(user.attr(r"\bcalls=%?([\w.\-]+)") or "", frozenset())
    sizes, results = _sizes(graph, node.computation, node.name), _sizes_of(user.shape)
    if len(sizes) == 1 and len(results) > 1 and 0 not in sizes + results:  # a multi-output fusion (an optimizer
        # update) that slices this device's rows out of a whole reduced gradient: libtpu's reduce-scatter form
        return "dynamic-slice" in held and any(r < sizes[0] and sizes[0] % r == 0 for r in results)
    if len(sizes) != 1 or len(results) != 1 or sizes == results or 0 in sizes + results:
        return False  # tuples are followed element by element (get-tuple-element), not here
    size, result = sizes[0], results[0]
    if result < size:
        return "dynamic-slice" in held and size % result == 0
    buffers = [o for o in user.operands if o != node.name and _sizes(graph, user.computation, o) == [result]]
    return "dynamic-update-slice" in held and result % size == 0 and bool(buffers)


def _sizes(graph: Dataflow, computation: str, name: str) -> list[int]:
    instruction = graph.instructions.get((computation, name))
    return _sizes_of(instruction.shape) if instruction is not None else []


def _sizes_of(shape: str) -> list[int]:
    """The elements of each array of an HLO shape (one, or a tuple's)."""
    return [math.prod(d) for _, d in arrays(shape)]


def _carried_out(graph: Dataflow, root: Instruction, name: str) -> list[Instruction]:
    """Where a value a loop body returns (element k of its ROOT tuple) goes after the loop: the loop's element k."""
    outer, loop = graph.while_callers[root.computation]
    positions = {k for k, operand in enumerate(root.operands) if operand == name}
    return [
        user
        for user in graph.users.get((outer, loop.name), ())
        if user.opcode == "get-tuple-element" and int(user.attr(r"\bindex=(\d+)") or -1) in positions
    ]


def _between(size: int, weight: Input) -> bool:
    """`size` elements are a whole number of `weight`'s shards and a whole fraction of it, neither one nor all."""
    whole = math.prod(weight.global_shape)
    return weight.elements < size < whole and size % weight.elements == 0 and whole % size == 0


def _returned_gradient(graph: Dataflow, position: int, weights: set[int]) -> int | None:
    """A gradient returned by the step: the k-th output of a weight's size is the k-th weight of that size
    (gradients are returned as the same tree as the weights, so their order is the weights' order)."""
    sizes = _sizes(graph, graph.entry, graph.outputs[position])
    if len(sizes) != 1:
        return None
    # each device's shard of it, else the whole of it (a gradient the step returns unsplit), else a part between
    # (returned split over some of the axes that split the weight: over tensor, not fsdp)
    same = (
        [i for i in sorted(weights) if graph.inputs[i].elements == sizes[0]]
        or [i for i in sorted(weights) if math.prod(graph.inputs[i].global_shape) == sizes[0]]
        or [i for i in sorted(weights) if _between(sizes[0], graph.inputs[i])]
    )
    outputs = [p for p, name in enumerate(graph.outputs) if _sizes(graph, graph.entry, name) == sizes]
    rank = outputs.index(position)
    return same[rank] if rank < len(same) else None
