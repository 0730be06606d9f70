"""The decision behind a collective, in the user's terms: which operation or annotation made XLA communicate.

`lab.hlo.attribution` says *what* a collective moves (a parameter, a gradient,
an input, activations). A systems engineer asks next *who decided*. XLA writes
on every collective the metadata of the operation it partitioned when it
inserted it, so the JAX primitive at the end of the collective's op name
(``jit(f)/jit(argsort)/sort``), at the user's line (`lab.hlo.sources`), is the
operation that needed the data laid out otherwise. Some operations cannot run
on a dimension a mesh axis splits, and the partitioner makes that dimension
whole first:

* **op**: a sort (``argsort``, ``sort``), ``top_k``, an ``fft``, a cumulative
  op (``cumsum`` is a ``reduce_window``), a convolution (windowed or grouped
  along the split dimension), a ``gather`` or ``scatter`` that indexes the
  split dimension (or a lookup whose table, indices and result cannot keep
  their splits together: ``jnp.take`` of a table split by columns with ids
  split by rows gathers the ids, and its own bounds mask with them), a
  ``reshape`` that merges or splits it, a ``flip``, a slice of it
  (``x[1:]``, ``jnp.diff``, a last stage's output), an ``argmax`` over it
  (a reduction of a value and its index together): the data is
  gathered or transposed (all-gather, all-to-all) or the partial lookups are
  summed (all-reduce); a ``jnp.roll`` along a split dimension is a shift
  between neighbours that the program asks for (a circular pipeline's step);
* **op**, too, where the operands' layouts are what it cannot keep together
  (`_clash`): one axis on two dimensions of its result (``a @ a.T`` of rows
  split), two axes on one (a batched matmul whose batches two axes split),
  one axis on a dimension one operand sums over and on one the other keeps
  (attention's values against probabilities whose queries it splits); or a
  weight split along what a matmul sums over while propagation put its axis
  on the result, so the partitioner moves the weight's split there (an
  all-to-all: FSDP's weight turned tensor-parallel);
* **loop predicate**: a ``while_loop`` under ``vmap`` runs until every batch
  element is done, so each iteration all-reduces whether any still runs;
* **loop motion**: a sum XLA moved out of a loop (a ``scan``, a
  ``fori_loop``): the op name is the loop's own, ``jit(f)/while``, because
  the compiler's while-loop all-reduce code motion found the iterations
  adding their partial sums to a value the loop carries, and reduces the
  carried total once, after the loop, in place of one reduction an
  iteration (gradient accumulation over micro-batches is the common case);
* **shard_map**: a collective asked for by name inside ``shard_map`` (``psum``,
  ``all_gather``, ``ppermute``, ``all_to_all``, ``psum_scatter``), or its
  transpose in the backward pass; there autodiff also sums the gradient of a
  value the in_specs replicate over an axis (``psum_invariant``, the transpose
  of the implicit ``pvary``);
* **annotation**: a ``with_sharding_constraint`` / ``out_sharding`` that asks
  for a layout the computation does not have there, or a ``reshard``, which
  asks for the move itself (nothing to change);
* **sum**: a reduction or a matmul (``reduce_sum``, ``dot_general``) summing
  over a dimension the layouts split (Shardy's sharding rule lists the
  dimensions an op sums over): each device sums its own part and an
  all-reduce or reduce-scatter adds the parts; the annotation or declaration
  that split the dimension is named. Of activations or gradients (tensor
  parallelism's all-reduce, data parallelism's gradient sum, a loss over a
  split batch) the layouts ask for it, and the explanation drops its hint
  (`lab.explanation.explain`); of anything else (a norm over a weight's split
  dimension) it stays a surprise, with the change that avoids it;
* **from what it moves**, where the op's name and the record say nothing
  (inside a scanned micro-batch, whose ops Shardy's record does not join to
  lines) or name an op beside the point (a scatter's, on a gradient summed
  over the batch; a matmul's clash, on a weight gathered whole): a gradient
  summed over the axes that split what it is computed from, a weight stored
  split and gathered whole for its use, a weight declared whole whose value
  is computed split and gathered (ZeRO-1's update);
* **partitioner**: a collective over a mesh axis that no layout of the
  program names, declared or propagated (Shardy's record names it nowhere):
  the devices along it hold the same data, and XLA's partitioner chose on its
  own to split an op's work among them and put the pieces back together; or
  numbers made of no input (an arange: attribution's **index**) that it made
  split for one use and moves for another, which each device could make
  itself (``jax.lax.broadcasted_iota`` at the shape of the use).

Anything else is the partitioner's own choice between the layouts the program
declared (`attribution` names what it moves); no cause is guessed for it.

It is one concept, the decision behind a collective: the op's name and
Shardy's record are two readings of the same question, each the other's
fallback, and the tables of what each op does to a split dimension are the
words both use.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable
from dataclasses import dataclass, replace

from lab.explanation.origins import Decision, Propagation, Value, resharding
from lab.hlo.attribution import Input, Origin, op_names
from lab.hlo.collectives import Collective
from lab.hlo.sources import Frame, op_of

CAUSES = ("op", "loop predicate", "loop motion", "shard_map", "annotation", "sum", "partitioner")


@dataclass(frozen=True)
class Cause:
    """The operation or annotation that decided one collective, where it is, and what to change there."""

    kind: str  # one of CAUSES
    op: str  # the JAX primitive or annotation, as JAX names it (sort, fft, psum, sharding_constraint, ...)
    line: Frame | None  # the user's line that holds it
    why: str
    hint: str | None  # the change at that line; None when the collective was asked for

    @property
    def asked(self) -> bool:
        """The program asked for this collective, by name (in shard_map) or by summing activations or gradients
        that its layouts split: nothing to change, so no hint."""
        return self.hint is None

    def to_json(self) -> dict:
        where = f"{self.line.file}:{self.line.line}" if self.line else None
        return {"kind": self.kind, "op": self.op, "line": where, "why": self.why, "hint": self.hint}


# primitive -> (what it does to the split dimension, the change that avoids it)
_OPS = {
    "sort": ("sorts along one dimension, which must be whole on one device", "sort along a dimension no axis splits"),
    "top_k": ("selects along its last dimension, which must be whole on one device", "shard another dimension"),
    "fft": ("transforms along its last dimensions, which must be whole on one device", "shard a batch dimension"),
    "reduce_window_sum": (
        "accumulates along one dimension (cumsum), each element needing every one before it",
        "accumulate along a dimension no axis splits, or scan the shards with shard_map and add the carried totals",
    ),
    "conv_general_dilated": (
        "slides a window (or splits feature groups) along a dimension that is split",
        "shard the batch or the output features, not a spatial or grouped feature dimension",
    ),
    "gather": (
        "looks up rows by index in a dimension that is split: each device holds some of the rows, so the partial "
        "lookups are combined",
        "replicate the table, or look up inside shard_map on each device's rows",
    ),
    "scatter": ("writes rows by index into a dimension that is split", "replicate the target, or write per shard"),
    "pad": (
        "pads a dimension that is split: each device takes its neighbour's edge elements (a halo) to shift its own",
        "pad a dimension no axis splits, or pad the input before it is split",
    ),
    "dynamic_slice": (
        "slices a dimension that is split, at an offset known only when it runs: each device takes the dimension "
        "whole to slice it",
        "slice a dimension no axis splits",
    ),
    "rev": (
        "reverses a dimension that is split: each device's piece goes to the device at the mirrored place",
        "reverse a dimension no axis splits, or reverse each shard in place and read the devices in reverse order",
    ),
    "slice": (
        "slices a dimension that is split: the slice lies on some devices and its result is laid out on others, so "
        "they send it (a halo off a shard's edge, a pipeline's last stage's output) or the dimension is gathered "
        "whole",
        "slice a dimension no axis splits, or lay the result out where the slice lies",
    ),
    "reduce": (
        "reduces along a dimension that is split with a reduction of several values at once (argmax and argmin "
        "carry a value and its index), which the partitioner does not combine from each device's result",
        "reduce along a dimension no axis splits, or reduce each shard inside shard_map and combine the pairs",
    ),
    "reshape": (
        "merges or splits a dimension that an axis splits, into one the axis cannot split the same way",
        "reshape so the split dimension stays a whole dimension, or reshard before it",
    ),
}
_LOOKUPS = ("take", "take_along_axis")  # jnp functions that are a gather (a nested jit of their own)
_LOOKUP_MOVED = (  # a gather's collective that sums nothing (`_MOVING`): not partial lookups, a layout brought whole
    "looks up rows by index where the table, the indices and the result are not laid out alike (the table's rows "
    "split, or the indices split where the result keeps another split of the table's): one of them is brought whole"
)
# the ops an input is resharded for when it comes right before them (`cause_before`): the _OPS, and a concatenate,
# which is not in _OPS because XLA also names the gather a constraint after it asks for by the concatenate
_BEFORE = {
    **_OPS,
    "concatenate": (
        "joins its operands along a dimension that is split",
        "concatenate along a dimension no axis splits",
    ),
}
_BY_NAME = (
    "psum",
    "pmax",
    "pmin",
    "pmean",
    "all_gather",
    "all_to_all",
    "ragged_all_to_all",
    "ppermute",
    "pshuffle",
    "reduce_scatter",
)
_ROLL = re.compile(r"\bjit\(_roll_(static|dynamic)\)")  # jnp.roll's nested jit, forward or transposed
_MOVING = ("all-gather", "all-to-all", "collective-permute")  # the collectives that move data, summing nothing
_SPELLED = {"psum_invariant": "psum", "reduce_scatter": "psum_scatter"}  # JAX's primitive -> the function called
_ANNOTATIONS = ("sharding_constraint", "reshard", "out_sharding")
_REDUCING = {  # a reduction other than a sum, in words: the op over a dimension, a device of its part, the collective
    # of the parts, and the change ("... along a dimension no mesh axis splits")
    "reduce_max": ("takes the max", "takes the max of", "takes the max of", "take the max"),
    "reduce_min": ("takes the min", "takes the min of", "takes the min of", "take the min"),
    "reduce_prod": ("multiplies", "multiplies", "multiplies", "multiply"),
}


def cause_of(collective: Collective, line: Frame | None, propagation: Propagation | None = None) -> Cause | None:
    """The op or annotation that decided `collective` (at the user's `line`), or None when nothing names one: its op
    name, or Shardy's record of where the layouts at that op came from (`propagation`)."""
    collective = replace(collective, op_name=op_names(collective.op_name or "")[0])  # of combined ones, the first
    path = tuple(collective.op_name.split("/"))
    if not path[-1]:
        return None
    where = line.cited if line else "its line"
    said = _said(collective, path, line, where)
    if said is None and propagation is not None:
        said = _recorded(collective, line, where, propagation) or _idle_axes(collective, line, where, propagation)
    return said or _within_lookup(collective, path, line, where)


def cause_before(collective: Collective, moved: str, consumer: str, line: Frame) -> Cause | None:
    """The op the reshard of input `moved` comes right before (`consumer`, its JAX op name, at the user's `line`),
    when it is one that needs the dimension the input is split on: the reshard moves the split off it."""
    op = op_of(consumer).split("-")[0]
    if op not in _BEFORE:
        return None
    does, change = _BEFORE[op]
    where = line.cited
    why = f"{op} at {where} {does}: the {collective.kind} over {_axes(collective)} reshards {moved} before it"
    return Cause("op", op, line, why, f"at {where}: {change}, or declare the input split along another dimension")


def settled(
    cause: Cause | None, origin: Origin, collective: Collective, line: Frame | None, inputs: Iterable[Input]
) -> Cause | None:
    """The cause once what the collective moves is known (`lab.hlo.attribution`): where the op's name and Shardy's
    record gave none, or named an op beside the point, what it moves decides (`_by_origin`)."""
    inputs = tuple(inputs)
    if cause is None or _beside_the_point(cause, origin, collective, inputs):
        return _by_origin(origin, collective, line, inputs) or cause
    return cause


def _beside_the_point(cause: Cause, origin: Origin, collective: Collective, inputs: Iterable[Input]) -> bool:
    """A gather's or scatter's op named on a gradient's sum over axes that split none of the weights it is the
    gradient of (an embedding's gradient, a scatter-add, summed over data where fsdp splits the table): the op's
    rows are not what the axes split, the batch is, so the sum is autodiff's over the batch. Or a clash of layouts
    at an op with no rule of its own for a split dimension (a matmul, `_clash`) on a weight gathered whole: that is
    FSDP's gather, which what it moves says."""
    if cause.kind != "op":
        return False
    op = cause.op.rsplit("(", 1)[-1].rstrip(")")
    if origin.kind == "parameter" and collective.kind in ("all-gather", "all-reduce"):
        return op not in _BEFORE
    if origin.kind != "gradient" or not origin.name:
        return False
    if op not in ("gather", "scatter"):
        return False
    return not any(f"'{axis}'" in _declared(origin, inputs) for axis in collective.axes or ())


def _declared(origin: Origin, inputs: Iterable[Input]) -> str:
    """The shardings declared for the inputs `origin` names, one string (``P('fsdp', None) P()``)."""
    names = set((origin.name or "").split(", "))
    return " ".join(i.declared for i in inputs if i.name in names)


def _by_origin(origin: Origin, collective: Collective, line: Frame | None, inputs: Iterable[Input]) -> Cause | None:
    """Where no op name or record of Shardy's says who decided (inside a scanned layer's backward pass, which
    Shardy's record does not join to lines), what it moves says it for the two collectives the layouts always ask
    for: a gradient summed over the axes that split what it is computed from, and a weight stored split and used
    whole (FSDP's gather before its use)."""
    axes, where = ",".join(collective.axes or ()) or "its groups", line.cited if line else "its line"
    if origin.kind == "index":
        return _made_split(collective, line, where, axes)
    if origin.kind == "gradient" and collective.kind in ("all-reduce", "reduce-scatter"):
        why = (
            f"autodiff sums the gradient of {origin.name} over {axes}, which split the values it is computed from "
            f"at {where}: each device's part gives a partial gradient, and the {collective.kind} adds them"
        )
        return Cause("sum", "gradient", line, why, None)
    if origin.kind != "parameter" or collective.kind not in ("all-gather", "all-reduce") or not collective.axes:
        return None
    written = ", written as an all-reduce of each device's part among zeros" * (collective.kind == "all-reduce")
    declared = _declared(origin, inputs)
    if declared and not all(f"'{axis}'" in declared for axis in collective.axes):
        layout = declared if "'" in declared else "whole"  # a PartitionSpec that names axes, or replicated
        why = (
            f"{origin.name} is declared {layout}, not split over {axes}, but a value of its shape is computed split "
            f"over {axes} at {where} (its update or its gradient, from values split so: ZeRO-1's update of a "
            f"sharded optimizer state, a gradient the layouts split): the {collective.kind} brings the parts "
            f"together where it is returned or used whole{written}"
        )
        return Cause("annotation", "out_shardings", line, why, None)
    why = (
        f"{origin.name} is stored split over {axes}, as declared, and used whole at {where}: the "
        f"{collective.kind} brings the other devices' parts before the use (FSDP's gather of a weight{written})"
    )
    return Cause("annotation", "in_shardings", line, why, None)


def _made_split(collective: Collective, line: Frame | None, where: str, axes: str) -> Cause:
    """Numbers computed from no input (an arange, positions) that XLA's partitioner made split, as one use of them
    wanted, and moves for another that wants them otherwise: each device could make its own."""
    op = op_of(op_names(collective.op_name or "")[0]) or "its use"  # of combined collectives, the first's
    why = (
        f"{op} at {where} uses numbers computed from no input (an iota: a jnp.arange, positions) in two layouts: "
        f"XLA's partitioner made them split over {axes}, as one use wants, and the {collective.kind} moves them "
        "for the other (a mask comparing i[:, None] with i[None, :] over rows split)"
    )
    hint = (
        f"at {where}: make the numbers at the shape of their use (jax.lax.broadcasted_iota over the whole array, "
        "jnp.tri), which each device computes for its own part"
    )
    return Cause("partitioner", op, line, why, hint)


def _by_name(op: str, path: tuple[str, ...], where: str, axes: str) -> str:
    """Why a collective inside shard_map is there: the program asks for it by name, or, in the backward pass
    (``transpose(...)`` in its op name), autodiff writes the transpose of what it asks for; JAX's ``psum_invariant``
    there is the transpose of the implicit ``pvary`` of a value the in_specs replicate over the axis."""
    if not any(part.startswith("transpose(") for part in path):
        return f"asked for by name: {_SPELLED.get(op, op)} inside shard_map at {where}, over {axes}"
    if op == "psum_invariant":
        return (
            f"autodiff sums a gradient over {axes}: a value the in_specs replicate over {axes} meets values that "
            f"vary over it at {where} (psum_invariant, the transpose of shard_map's implicit pvary)"
        )
    return f"the backward pass of the collective at {where}: {op} over {axes}, the transpose of what is asked there"


def _said(collective: Collective, path: tuple[str, ...], line: Frame | None, where: str) -> Cause | None:
    """The cause its op name says: a shard_map, an annotation, a while_loop under vmap, an op that needs a dimension
    whole."""
    op, axes, kind = path[-1], _axes(collective), collective.kind
    if op == "shard_map":  # inserted at the boundary: the inputs do not have the in_specs' layout
        return Cause(
            "shard_map",
            "shard_map in_specs/out_specs",
            line,
            f"the shard_map at {where} takes (or returns) a layout its arguments (or users) do not have: the {kind} "
            f"over {axes} reshards at its boundary",
            f"at {where}: give in_specs/out_specs the layout the values already have",
        )
    if "shard_map" in path[:-1] and op.startswith(_BY_NAME):
        return Cause("shard_map", op, line, _by_name(op, path, where, axes), None)
    if any(_ROLL.search(part) for part in path):  # jnp.roll over a split dimension: the shift is the permute
        return Cause(
            "op",
            "roll",
            line,
            f"asked for: jnp.roll at {where} shifts a dimension split over {axes}, so each device's edge moves to its "
            f"neighbour: the {kind} is that shift (a circular pipeline's step to the next stage, a stencil's halo)",
            None,
        )
    if op == "reshard":  # jax.sharding.reshard: the move itself is what the program asks for
        return Cause(
            "annotation",
            op,
            line,
            f"asked for: reshard at {where} moves the value to another layout, and the {kind} over {axes} is that move",
            None,
        )
    if op in _ANNOTATIONS or any(part.startswith(_ANNOTATIONS) for part in path[1:]):
        return Cause(
            "annotation",
            op,
            line,
            f"{op} at {where} asks for a layout the computation does not have there: the {kind} over {axes} makes it",
            f"at {where}: drop the annotation, or ask for the layout the computation has there",
        )
    if op == "while" and "vmap" in " ".join(path) and kind == "all-reduce":
        return Cause(
            "loop predicate",
            "while_loop under vmap",
            line,
            f"a while_loop under vmap at {where} runs until every batch element is done: each iteration all-reduces "
            f"whether any still runs, over {axes}",
            f"at {where}: give the loop a fixed trip count (fori_loop or scan), or run it per shard inside shard_map",
        )
    if op == "while" and kind in ("all-reduce", "reduce-scatter"):  # outside the loop, on what it carried out
        return Cause(
            "loop motion",
            "while",
            line,
            f"XLA moved this {kind} out of the loop at {where} (its pass while-loop-all-reduce-code-motion): each "
            f"iteration adds its part to a sum the loop carries, and the {kind} over {axes} reduces the carried total "
            "once, after the loop, where the program reduces every iteration's",
            None,
        )
    base = op.split("-")[0]
    return _op_cause(collective, base, path, line, where) if base in _OPS else None


def _op_cause(collective: Collective, base: str, path: tuple[str, ...], line: Frame | None, where: str) -> Cause:
    """What op `base` (one of `_OPS`) does to a split dimension, named as the user wrote it: a jnp function is a
    nested jit (jnp.cumsum -> jit(f)/jit(cumsum)/reduce_window_sum; path[0] is the user's own)."""
    does, change = _OPS[base]
    if base == "gather" and collective.kind in _MOVING:  # nothing summed: one of the lookup's three is brought whole
        does = _LOOKUP_MOVED
    function = _jnp_function(path) or base
    name = f"{function} ({base})" if function != base else base
    why = f"{name} at {where} {does}: the {collective.kind} over {_axes(collective)} makes it so"
    return Cause("op", name, line, why, f"at {where}: {change}")


def _within_lookup(collective: Collective, path: tuple[str, ...], line: Frame | None, where: str) -> Cause | None:
    """An op of jnp.take's own (its bounds mask, its index arithmetic: a nested jit) that nothing else explains: the
    lookup's."""
    return _op_cause(collective, "gather", path, line, where) if _jnp_function(path) in _LOOKUPS else None


def _jnp_function(path: tuple[str, ...]) -> str | None:
    """The jnp function whose nested jit holds the op (``jit(f)/jit(_take)/gather`` -> ``take``: JAX's ``_take``
    is the user's jnp.take), or None for an op the user's function holds itself."""
    wrapper = re.fullmatch(r"jit\((\w+)\)", path[-2]) if len(path) > 2 else None
    return wrapper[1].lstrip("_") if wrapper else None


def _recorded(collective: Collective, line: Frame | None, where: str, propagation: Propagation) -> Cause | None:
    """The cause Shardy's record shows at the collective's op: a sum over what the layouts split, its own
    out_sharding=, two annotations that disagree, or a with_sharding_constraint that set the layout of the op it
    constrains (one no location joins)."""
    at_line = line.line if line else None
    decisions = propagation.decisions(collective.op_name, at_line)
    summed = _sum_of(collective, decisions, line, where, propagation)
    if summed is not None:  # partial sums: no out_sharding= or constraint would spare their reduction
        return summed
    asked = propagation.out_sharding(collective.op_name, at_line)
    if asked is not None:
        op = op_of(collective.op_name)
        return Cause(
            "annotation",
            "out_sharding",
            line,
            f"{op} at {where} asks for the layout {asked} (its out_sharding=), not the one its operands give it: "
            f"the {collective.kind} over {_axes(collective)} makes the result so",
            f"at {where}: give out_sharding= the layout the operands lead to, or drop it",
        )
    found = next((c for d in decisions if (c := _layouts_clash(collective, d, line, where, propagation))), None)
    decision = resharding(decisions)
    if found is None and decision is not None:
        found = _conflict(collective, decision, line, propagation, _axes(collective))
    # a concatenate, a pad, ... whose result a constraint laid out; or a matmul's, moved by a gather, a permute or an
    # all-to-all (its own rule sums, and a sum is tried above: what moves its result is the constraint's)
    if found is None and decision is not None and (not _lays_out_itself(decision.op) or collective.kind in _MOVING):
        constraint = next((o for o in decision.result.origins.values() if o.startswith("constraint_")), None)
        found = _constrained(collective, decision, constraint, line, where, propagation) if constraint else None
    if found is not None or not collective.result_shapes:
        return found
    constrained = propagation.constrained(op_of(collective.op_name), tuple(collective.result_shapes[0]))
    return _constrained(collective, *constrained, line, where, propagation) if constrained else None


def _idle_axes(collective: Collective, line: Frame | None, where: str, propagation: Propagation) -> Cause | None:
    """A collective over mesh axes no layout of the program names: the partitioner's own use of idle devices."""
    idle = [axis for axis in collective.axes or () if axis not in propagation.named_axes]
    if not idle or not propagation.named_axes:
        return None
    axes, op = ",".join(idle), op_of(collective.op_name)
    why = (
        f"no layout of the program names {axes} (Shardy's record splits nothing over it): the devices along it hold "
        f"the same data, and XLA's partitioner chose to share {op}'s work at {where} among them; the "
        f"{collective.kind} over {_axes(collective)} puts the pieces together"
    )
    hint = (
        f"at {where}: lay {op}'s operands out over {axes} if those devices should share the work, or leave {axes} "
        "out of the mesh"
    )
    return Cause("partitioner", op, line, why, hint)


def _lays_out_itself(op: str) -> bool:
    """A matmul, a convolution or a reduction: its operands are laid out otherwise than its result by its own rule
    (a contracted dimension's split becomes a partial sum), not only by the annotations that reach it."""
    return op_of(op).startswith(("dot_general", "conv", "reduce"))


def _axes(collective: Collective) -> str:
    return ",".join(collective.axes or ()) or "its groups"


def _conflict(
    collective: Collective, decision: Decision, line: Frame | None, propagation: Propagation, axes: str
) -> Cause | None:
    """Two annotations that disagree at one op: the one its result's layout came from, and an operand's (each
    operand read in the result's dimensions, `Decision.aligned`)."""
    result = decision.result
    differing = [v for v in decision.aligned if v.sharding and v.sharding != result.sharding]
    if not differing or not result.origins:
        return None
    op = op_of(decision.op)
    where = line.cited if line else "its line"
    operand = next((v for v in differing if set(v.origins.values()) != set(result.origins.values())), None)
    if operand is None or (not decision.elementwise and op != "transpose"):  # a matmul's: `_constrained`
        return None
    deciding = _annotation(result, propagation) or line
    why = (
        f"{op} at {where} takes the layout {result.sharding} from {_described(result, propagation)}, but its operand "
        f"{operand.name} comes as {operand.sharding} from {_described(operand, propagation)}: the {collective.kind} "
        f"over {axes} reshards between the two"
    )
    at = deciding.cited if deciding else where
    hint = (
        f"at {at}: ask for {operand.sharding} (the layout {operand.name} has), or give {operand.name} "
        f"{result.sharding} where it is made or declared"
    )
    return Cause("annotation", _annotation_name(next(iter(result.origins.values()))), deciding, why, hint)


def _layouts_clash(
    collective: Collective, decision: Decision, line: Frame | None, where: str, propagation: Propagation
) -> Cause | None:
    """Operands whose layouts the op cannot keep together over the collective's axes (`_clash`: ``a @ a.T`` of rows
    split, a batched matmul whose batches two axes split), or a weight moved off the dimension it sums over
    (`_off_the_sum`); not where a constraint laid out the op's result (then `_constrained`'s)."""
    if any(o.startswith("constraint_") for o in decision.result.origins.values()):
        return None
    clash = _clash(decision, set(collective.axes or ()))
    if clash is not None:
        return _clashing(collective, op_of(decision.op), clash, line, where, propagation)
    return _off_the_sum(collective, decision, line, where, propagation)


def _off_the_sum(
    collective: Collective, decision: Decision, line: Frame | None, where: str, propagation: Propagation
) -> Cause | None:
    """An operand split over an axis along a dimension the op sums over, where propagation laid the op's result
    out with that axis on a dimension of its own (an FSDP weight split along its input features, the matmul's
    result along its output features): the partitioner moves the operand's split onto that dimension (an
    all-to-all), so each device multiplies whole columns and adds no partial sums."""
    if collective.kind not in ("all-to-all", "all-gather"):
        return None
    result, axes = decision.result, set(collective.axes or ())
    for operand, axis in decision.summed_over():
        kept = next((v for v in decision.aligned if v.name == operand.name), None)
        if kept is None or axis not in axes or not any(axis in d for d in result.dims):
            continue
        if any(axis in d for d in kept.dims):
            continue
        op = op_of(decision.op)
        why = (
            f"{op} at {where} sums over the dimension {operand.name} splits over {axis} ({operand.sharding}, from "
            f"{_described(operand, propagation)}), while propagation laid its result out as {result.sharding}, "
            f"{axis} on a dimension of its own (from {_described(result, propagation)}): the {collective.kind} over "
            f"{_axes(collective)} moves {operand.name}'s split onto that dimension, so each device sums over the whole "
            "dimension for its part of the result and no partial sums are added"
        )
        hint = (
            f"at {where}: split {operand.name} over {axis} along the dimension the result keeps, or constrain the "
            f"result to the layout {operand.name}'s split gives (partial sums, then a reduce-scatter)"
        )
        return Cause("op", op, line, why, hint)
    return None


@dataclass(frozen=True)
class _Clash:
    """Two operands of one op laid out in ways the op cannot keep together, in the result's dimensions
    (`Decision.aligned`): one mesh axis on two of the result's dimensions ("twice"); two axes on the same one
    ("disagree"); one axis on a dimension the op sums over in `first` (then as it comes: the summed dimension is
    not the result's) and on one the result keeps in `second` ("contracted")."""

    form: str
    first: Value
    second: Value
    first_axes: str
    second_axes: str


def _clash(decision: Decision, axes: set[str]) -> _Clash | None:
    """The first way `decision`'s operands clash (`_Clash`) over one of `axes` (any, where empty: a collective
    whose groups no axis names), or None."""

    def ours(*found: Iterable[str]) -> bool:
        return not axes or any(axis in axes for names in found for axis in names)

    aligned = decision.aligned
    for first, second in itertools.combinations(aligned, 2):
        for i, here in enumerate(first.dims):
            for j, there in enumerate(second.dims):
                if i != j and (shared := [a for a in here if a in there and ours([a])]):
                    return _Clash("twice", first, second, shared[0], shared[0])
                if i == j and here and there and not set(here) & set(there) and ours(here, there):
                    return _Clash("disagree", first, second, ",".join(here), ",".join(there))
    for operand, axis in decision.summed_over():
        kept = next((v for v in aligned if v.name != operand.name and any(axis in dims for dims in v.dims)), None)
        if kept is not None and ours([axis]):
            return _Clash("contracted", operand, kept, axis, axis)
    return None


def _clashing(
    collective: Collective, op: str, clash: _Clash, line: Frame | None, where: str, propagation: Propagation
) -> Cause:
    """Why the partitioner makes one of two clashing operands whole (or moves its split), and what to change."""
    first, second = clash.first, clash.second
    origins = [_described(v, propagation) for v in (first, second)]
    said = f"both from {origins[0]}" if origins[0] == origins[1] else f"from {origins[0]} and {origins[1]}"
    moved = f"the {collective.kind} over {_axes(collective)} moves"
    if clash.form == "twice":
        why = (
            f"{op} at {where} would split two of its result's dimensions over {clash.first_axes}: {first.name} "
            f"splits one ({first.sharding} in the result's dimensions), {second.name} another ({second.sharding}), "
            f"{said}; an axis splits one dimension, so {moved} one of them"
        )
    elif clash.form == "contracted":  # the summed dimension is not the result's: `first` as it comes
        why = (
            f"{op} at {where} sums over a dimension {first.name} splits over {clash.first_axes}, while {second.name} "
            f"keeps {clash.first_axes} on a dimension of the result ({first.name} comes as {first.sharding}, "
            f"{second.name} as {second.sharding} in the result's; {said}); one axis cannot split both, so {moved} "
            "one of them"
        )
    else:
        why = (
            f"{op} at {where} lines up {first.name}, split over {clash.first_axes}, and {second.name}, split over "
            f"{clash.second_axes}, along one dimension of its result ({first.name} {first.sharding}, {second.name} "
            f"{second.sharding} in the result's dimensions; {said}); a dimension is split one way, so {moved} them "
            "to one layout"
        )
    change = {
        "twice": f"split one of {first.name} and {second.name} over another axis",
        "contracted": f"split {second.name} over another axis than {first.name}",
        "disagree": f"split {first.name} and {second.name} over the same axis",
    }[clash.form]
    hint = f"at {where}: {change}, or reshard one before {op}"
    return Cause("op", op, line, why, hint)


def _constrained(
    collective: Collective,
    decision: Decision,
    constraint: str,
    line: Frame | None,
    where: str,
    propagation: Propagation,
) -> Cause | None:
    """A with_sharding_constraint that set the layout of an op (the one it constrains, or one it reached), whose
    operands (over the collective's axes) come otherwise: the partitioner reshards between the two."""
    axes, result = set(collective.axes or ()), decision.result
    operands = [v for v in decision.operands if v.sharding and v.sharding != result.sharding]
    if not axes or not operands or not all(axes <= set(re.findall(r"'(\w+)'", v.sharding)) for v in operands):
        return None
    deciding = _constraint_frame(constraint, propagation) or line
    at = deciding.cited if deciding else where
    layouts = " and ".join(dict.fromkeys(v.sharding for v in operands))
    names = ", ".join(dict.fromkeys(v.name for v in operands))
    why = (
        f"the with_sharding_constraint at {at} gives the {op_of(decision.op)} at {where} the layout "
        f"{result.sharding}, but its operands ({names}) come as {layouts} from "
        f"{' and '.join(dict.fromkeys(_described(v, propagation) for v in operands))}: the {collective.kind} over "
        f"{_axes(collective)} reshards between the two"
    )
    hint = f"at {at}: ask for {layouts} (the layout the operands have), or give them {result.sharding} earlier"
    return Cause("annotation", "with_sharding_constraint", deciding, why, hint)


def _sum_of(
    collective: Collective, decisions: list[Decision], line: Frame | None, where: str, propagation: Propagation
) -> Cause | None:
    """The sum the collective adds up: an op at its line (`decisions`) that sums what the layouts split, or, where
    no op of that name is joined to a line (inside a nested jit), the ones of its kind in Shardy's module that do
    so to a result of the collective's shape."""
    sums = (_summed(collective, d, line, where, propagation) for d in decisions)
    found = next((cause for cause in sums if cause is not None), None)
    if found is not None or decisions or not collective.result_shapes:
        return found
    axes, shape = set(collective.axes or ()), tuple(collective.result_shapes[0])
    summing = propagation.summing(op_of(collective.op_name), axes, shape)
    return _summed(collective, summing[0], line, where, propagation, len(summing)) if summing else None


def _summed(
    collective: Collective,
    decision: Decision,
    line: Frame | None,
    where: str,
    propagation: Propagation,
    alike: int = 1,
) -> Cause | None:
    """An op that sums over a dimension its operands have split over every axis of the collective (an all-reduce or
    a reduce-scatter): the collective adds the devices' partial sums, as the layouts ask. `alike`: how many such
    ops the collective may come from (a norm over a tree's leaves, one per leaf), of which `decision` is one."""
    axes = set(collective.axes or ())
    if collective.kind not in ("all-reduce", "reduce-scatter") or not axes:
        return None
    summed = [(value, axis) for value, axis in decision.summed_over() if axis in axes]
    split = {
        (value.name, axis): _origin_words(value.origins.get(axis, ""), value, propagation) for value, axis in summed
    }
    if {axis for _, axis in split} != axes:
        return None
    op = op_of(decision.op)
    how = "; ".join(f"{name} split over {axis} by {words}" for (name, axis), words in split.items())
    one = f"; one of {alike} alike" if alike > 1 else ""
    over, of, combines, along = _REDUCING.get(op, ("sums", "sums", "adds", "sum"))
    why = (
        f"{op} at {where} {over} over a dimension split over {_axes(collective)} ({how}{one}): each device {of} "
        f"its own part, and the {collective.kind} {combines} the parts"
    )
    hint = f"at {where}: {along} along a dimension no mesh axis splits, or split one {op} keeps, in " + " and ".join(
        dict.fromkeys(split.values())
    )
    return Cause("sum", op, line, why, hint)


def _annotation_name(origin: str) -> str:
    """The JAX spelling of the annotation Shardy calls `origin`."""
    if origin.startswith("constraint_"):
        return "with_sharding_constraint"
    if origin.startswith("output: "):
        return "out_shardings"
    if origin.startswith("input: ") or origin == "self":
        return "in_shardings"
    return origin


def _annotation(value: Value, propagation: Propagation) -> Frame | None:
    """The line of the with_sharding_constraint a value's layout came from, if it came from one."""
    found = (_constraint_frame(o, propagation) for o in dict.fromkeys(value.origins.values()))
    return next((frame for frame in found if frame is not None), None)


def _constraint_frame(origin: str, propagation: Propagation) -> Frame | None:
    """The line of the with_sharding_constraint Shardy calls `origin` (``constraint_0``), when it is one."""
    found = propagation.constraint_line(origin) if origin.startswith("constraint_") else None
    return Frame(found[0], found[1], "with_sharding_constraint") if found else None


def _described(value: Value, propagation: Propagation) -> str:
    """Where each axis of a value's layout came from, in words."""
    return " and ".join(_origin_words(name, value, propagation) for name in dict.fromkeys(value.origins.values()))


def _origin_words(name: str, value: Value, propagation: Propagation) -> str:
    if not name:
        return "Shardy's propagation"
    if name == "self":
        return f"the sharding declared for {value.name}"
    if match := re.fullmatch(r"input: (\d+)", name):
        return f"the sharding declared for {propagation.input_name(int(match[1]))}"
    if match := re.fullmatch(r"output: (\d+)", name):
        return f"the sharding declared for output {match[1]} (out_shardings)"
    if name.startswith("constraint_"):
        frame = _constraint_frame(name, propagation)
        return f"with_sharding_constraint at {frame.cited}" if frame else "a constraint"
    return f"Shardy's origin {name!r}"
