"""Shardy's record of which annotation each value's sharding came from, joined to the user's lines.

JAX's partitioner, Shardy, propagates the shardings a program declares (its
inputs' and outputs', each ``with_sharding_constraint``) to every value. Asked
to (XLA's debug option ``xla_dump_hlo_pass_re=shardy-verbose``, passed per
compile as a compiler option, so no dump folder of the user's is needed), it
records for every value and mesh axis where that axis came from
(``sdy.sharding_origins``: ``"self"`` on a declared value, ``"input: 0"``,
``"output: 0"``, ``"constraint_0"`` for the first constraint, ...) and writes
the module after propagation::

    %0 = stablehlo.add %arg0, %arg1 {sdy.sharding = #sdy.sharding_per_value<[<@mesh, [{}, {"x", "y"}, {}]>]>,
                                      sdy.sharding_origins = [{x = "constraint_0", y = "constraint_0"}]}
    %1 = sdy.reshard %0 <@mesh, [{}, {"x", "y"}, {}]> {sdy.sharding_origin_name = "constraint_0", ...}

That text has no source locations; the module JAX lowered
(``lowered.as_text(debug_info=True)``) has them but no origins. The two list
the same operations in the same order (XLA writes a ``sharding_constraint`` as
a ``reshard``, a plain ``dot_general`` as a ``dot``, and renames constants), so
the k-th operation of a kind in one is the k-th of that kind in the other:
`Propagation` joins them, and `decision` answers, for the operation at a
user's line, which annotation gave its result its layout and which gave its
operands theirs. Where they differ, the partitioner reshards between the two:
that is a collective an annotation decided.

Only the entry function is joined (operations of nested ``jit`` functions are
not), and a kind whose counts differ between the two texts is left unjoined;
both then say nothing rather than guess.
"""

from __future__ import annotations

import math
import os
import re
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from lab.explanation import partitioner
from lab.explanation.partitioner import Remat
from lab.explanation.program import leaf_names
from lab.hlo import Inspection, inspect_lowered, lower
from lab.hlo.sources import is_library
from lab.targets.devices import quiet_native_stderr

OPTIONS = {  # XLA debug options, given to one compile: Shardy's verbose dump, and nothing else of a dump folder
    "xla_dump_hlo_pass_re": "shardy-verbose",
    "xla_dump_hlo_as_text": False,
    "xla_dump_hlo_module_re": "^$",
}
PROPAGATED = "02.after_propagation.mlir"

_OP = re.compile(r"^\s*(?:(?P<results>%[\w#:]+(?:, %[\w#:]+)*) = )?\"?(?P<kind>[a-z_]+\.[a-z_]+)\"?(?P<rest>.*)$")
_SAME = {"sdy.sharding_constraint": "sdy.reshard", "stablehlo.dot": "stablehlo.dot_general"}
_STABLEHLO = {"select_n": "select", "mul": "multiply", "sub": "subtract", "div": "divide", "max": "maximum"}
_MESH = re.compile(r"sdy\.mesh @\w+ = <\[[^\]]*\]")
_SKIPPED = ("stablehlo.constant", "sdy.constant", "func.return", "stablehlo.return", "sdy.return")
_VALUE = re.compile(r"%[\w]+(?:#\d+)?")
_FACTOR = re.compile(r"[a-z](?:_\d+)?")  # one factor of a sharding rule: i, j, ..., z_1
_LOC_REF = re.compile(r"loc\((#loc\d*)\)\s*$")
_LOC_DEF = re.compile(r"^(#loc\d*) = loc\((.*)\)\s*$")
_SHARDINGS = re.compile(r"<@\w+, \[(.*?)\]>")
_ORIGIN = re.compile(r'"?(\w+(?::\(\d+\)\d+)?)"? = "([^"]*)"')  # data = "self", "tensor:(1)2" = "input: 2"
_AXIS = re.compile(r'"(\w+)"(?::(\(\d+\)\d+))?')  # "tensor", or Shardy's sub-axis "tensor":(1)2
_ARG = re.compile(r"(%arg\d+): tensor<[^>]*>\s*(\{[^{}]*(?:\{[^{}]*\}[^{}]*)*\})?(?:\s*loc\(\"((?:[^\"\\]|\\.)*)\"\))?")


@dataclass(frozen=True)
class Value:
    """One value at an operation: its name in the program, its layout, and where each axis of it came from."""

    name: str  # an input's name (params['w']), or the operation that makes it
    sharding: str  # as a PartitionSpec: P('y', None, 'x'); "" when unknown
    origins: dict[str, str]  # mesh axis -> origin name ("self", "input: 0", "constraint_0", ...)
    dims: tuple[tuple[str, ...], ...] = ()  # the mesh axes that split each dimension (the sharding, unspelled)


@dataclass(frozen=True)
class Decision:
    """An operation at a user's line: its result's layout and origins, its operands'."""

    op: str  # the JAX op name (jit(f)/add)
    result: Value
    operands: tuple[Value, ...]
    elementwise: bool  # every operand indexed as the result: a layout differing between them is only a reshard
    summed: tuple[tuple[int, ...], ...] = ()  # per operand, the dimensions the op sums over (reduces, contracts)
    aligned: tuple[Value, ...] = ()  # the operands in the result's dimensions (`_aligned`); () where unreadable

    def summed_over(self) -> tuple[tuple[Value, str], ...]:
        """(operand, mesh axis) for each axis that splits a dimension the op sums over."""
        return tuple(
            (value, axis)
            for value, dims in zip(self.operands, self.summed)
            for d in dims
            if d < len(value.dims)
            for axis in value.dims[d]
        )


@dataclass(frozen=True)
class _Op:
    kind: str
    results: tuple[str, ...]
    operands: tuple[str, ...]
    text: str


class Propagation:
    """The module after Shardy's propagation, joined to the lowered module's locations."""

    def __init__(self, propagated: str, lowered: str, names: Mapping[str, str] | None = None):
        mesh = _MESH.search(propagated)
        self._mesh = {axis: int(size) for axis, size in re.findall(r'"(\w+)"=(\d+)', mesh[0])} if mesh else {}
        # the mesh axes any layout in the module names (declared, constrained or propagated): an axis outside them
        # splits nothing Shardy decided, so a collective over it is the partitioner's own choice
        layouts = _SHARDINGS.findall(propagated.replace(mesh[0], "") if mesh else propagated)
        self.named_axes = frozenset(axis for layout in layouts for dims in _dims(layout) for axis in dims)
        self._propagated = _entry_ops(propagated)
        self._lowered = _entry_ops(lowered)
        self._locations = _locations(lowered)
        self._args = _arguments(propagated)
        names = names or {}  # JAX's argument names -> the program's (`lab.explanation.program.leaf_names`)
        self._arg_names = {arg: names.get(name, name) for arg, (_, name) in _arguments(lowered).items() if name}
        self._made = {r.split("#")[0]: op for op in self._propagated for r in op.results}
        self._users: dict[str, list[_Op]] = {}  # a value -> the operations that take it
        for op in self._propagated:
            for operand in op.operands:
                self._users.setdefault(operand.split("#")[0], []).append(op)
        self._pairs = _join(self._lowered, self._propagated)
        self._named: dict[str, list[tuple[_Op, _Op, int | None]]] = {}  # JAX op name -> (lowered, propagated, line)
        for lowered, propagated in self._pairs:
            name, where = self._locations.get(_loc_ref(lowered.text), ("", None))
            self._named.setdefault(name, []).append((lowered, propagated, where[1] if where else None))
        self._asked: dict[tuple[str, int | None], str] = {}  # (op name, line) -> the layout its out_sharding= asks
        self._constraints: dict[str, tuple[str, int] | None] = {}  # Shardy's constraint name -> (file, line)
        for lowered in self._lowered:
            name, where = self._locations.get(_loc_ref(lowered.text), ("", None))
            asked = re.search(r"sdy\.sharding_constraint %[\w#]+ <@\w+, \[(.*?)\]>", lowered.text)
            if asked and name and not name.endswith("sharding_constraint"):
                self._asked.setdefault((name, where[1] if where else None), _spec(_dims(asked[1])))
        for lowered, propagated in self._pairs:
            origin = re.search(r'sdy\.sharding_origin_name = "([^"]*)"', propagated.text)
            if propagated.kind == "sdy.reshard" and origin:
                self._constraints.setdefault(origin[1], self._locations.get(_loc_ref(lowered.text), ("", None))[1])
        self.joined = bool(self._pairs)

    @classmethod
    def read(cls, folder: Path, lowered: str, names: Mapping[str, str] | None = None) -> Propagation | None:
        """From the dump folder of one compile with `OPTIONS` (None when Shardy wrote nothing: not its partitioner)."""
        found = sorted(folder.glob(f"shardy/*/{PROPAGATED}"))
        return cls(found[-1].read_text(), lowered, names) if found else None

    def decisions(self, op_name: str, line: int | None) -> list[Decision]:
        """Every operation named `op_name` at `line` (a tree_map's line makes one per leaf)."""
        found = []
        for _, propagated, at in self._named.get(op_name, ()):
            if line is not None and at is not None and at != line:
                continue
            decision = self._decision(op_name, propagated)
            found += [decision] if decision is not None else []
        return found

    def out_sharding(self, op_name: str, line: int | None) -> str | None:
        """The layout an op's own ``out_sharding=`` asks for (JAX lowers it as a sharding constraint carrying the
        op's name and line), as a PartitionSpec; None when the op has none."""
        if line is None:  # no line to tell two such ops apart: the first
            return next((spec for (name, _), spec in self._asked.items() if name == op_name), None)
        return self._asked.get((op_name, line)) or self._asked.get((op_name, None))

    def constraint_line(self, origin: str) -> tuple[str, int] | None:
        """(file, line) of the with_sharding_constraint Shardy calls `origin` (``constraint_0``)."""
        return self._constraints.get(origin)

    def constrained(self, primitive: str, shape: tuple[int, ...]) -> tuple[Decision, str] | None:
        """The one operation of JAX primitive `primitive` whose layout a with_sharding_constraint set: the constraint
        its only user, its result given the constraint's layout with no origin of its own (Shardy's import does
        that), of `shape` on each device in that layout, its operands laid out otherwise. (That decision, the
        constraint's Shardy name), or None.

        This reaches an operation inside a nested jit (a ``jnp`` function): Shardy's module has it inlined, where
        the lowered one has a call, so no location joins it to a line; the constraint's own line is known."""
        kind = "stablehlo." + _STABLEHLO.get(primitive, primitive)
        found = []
        for op in self._propagated:
            after = self._users.get(op.results[0], []) if len(op.results) == 1 else []
            name = re.search(r'sdy\.sharding_origin_name = "(constraint_\d+)"', after[0].text) if after else None
            if op.kind != kind or len(after) != 1 or name is None or _origins(op.text) or self._local(op) != shape:
                continue
            decision = self._decision(primitive, op)
            if (
                decision
                and decision.result.sharding in _shardings(after[0].text)
                and any(v.sharding and v.sharding != decision.result.sharding for v in decision.operands)
            ):
                found.append((decision, name[1]))
        return found[0] if len(found) == 1 else None

    def summing(self, primitive: str, axes: set[str], shape: tuple[int, ...]) -> list[Decision]:
        """The operations of JAX primitive `primitive` (``reduce_sum``, ``dot_general``, ...) that sum over
        dimensions their operands have split over exactly `axes`, their result `shape` on each device.

        This reaches an operation inside a nested jit (a ``jnp`` function: ``jnp.linalg.norm``; a library's, as
        ``optax.tree.norm``, one per leaf of a tree), which Shardy's module has inlined where the lowered one has a
        call, so that no location joins it to a line."""
        kind = "stablehlo.reduce" if primitive.startswith("reduce_") else "stablehlo." + primitive
        found = []
        for op in self._propagated:
            decision = self._decision(primitive, op) if op.kind == kind else None
            if decision is None or {axis for _, axis in decision.summed_over()} != axes:
                continue
            if self._local(op) == shape:
                found.append(decision)
        return found

    def _local(self, op: _Op) -> tuple[int, ...] | None:
        """An operation's result shape on one device, in the layout Shardy gave it (whole where it gave none)."""
        shape, layouts = _result_shape(op), _layouts(op.text)
        if shape is None or not layouts:
            return shape
        split = [math.prod(self._mesh.get(a, 0) for a in axes) for axes in layouts[0]]
        if len(split) != len(shape) or 0 in split:
            return None
        return tuple(n // k for n, k in zip(shape, split))

    def input_name(self, index: int) -> str:
        return self._arg_names.get(f"%arg{index}", f"input {index}")

    def _decision(self, op_name: str, op: _Op) -> Decision | None:
        layouts, origins, rule = _layouts(op.text), _origins(op.text), _Rule.of(op.text)
        summed = rule.summed() if rule else ()
        if not layouts and not summed:  # a sum's result may have no layout of its own: it is whole on each device
            return None
        operands = tuple(self._value(operand) for operand in op.operands)
        result = _laid_out(op_name, layouts, origins, 0)
        aligned = rule.aligned(operands, op.kind == "stablehlo.transpose") if rule else ()
        return Decision(op_name, result, operands, bool(rule and rule.elementwise), summed, aligned)

    def _value(self, name: str) -> Value:
        if name in self._args:
            text, _ = self._args[name]
            return _laid_out(self._arg_names.get(name, name), _layouts(text), _origins(text), 0)
        base, _, index = name.partition("#")
        made = self._made.get(base)
        if made is None:
            return Value(name, "", {})
        origins = _origins(made.text)
        constraint = re.search(r'sdy\.sharding_origin_name = "(constraint_\d+)"', made.text)
        if made.kind == "sdy.reshard" and constraint:  # its own layout ("self") is the constraint's
            origins = [{axis: constraint[1] if o == "self" else o for axis, o in each.items()} for each in origins]
            return _laid_out("a constrained value", _layouts(made.text), origins, 0)
        return _laid_out(made.kind.split(".")[-1], _layouts(made.text), origins, int(index or 0))


class Compiled(NamedTuple):
    """What one compile of a user's program gives the explanation."""

    inspection: Inspection
    propagation: Propagation | str  # Shardy's record, or why there is none
    remats: tuple[Remat, ...]  # the values XLA's partitioner said it replicated whole to reshard them
    names: Mapping[str, str]  # JAX's names of its inputs -> the program's (`lab.explanation.program.leaf_names`)


def compile_with_origins(fn, *args: Any, mesh=None, **kwargs: Any) -> Compiled:
    """Compile ``fn(*args, **kwargs)`` once, with Shardy's record on, and read what it left: the `Inspection` of the
    compiled program; the `Propagation`, or in its place why there is none (the partitioner wrote none: not
    Shardy; the user's XLA_FLAGS dump, which the lab leaves where they asked for it); the partitioner's
    rematerializations, from its log (`lab.explanation.partitioner`; the rest of the log goes on to stderr)."""
    lowered = lower(fn, *args, mesh=mesh, **kwargs)
    names = leaf_names(fn, args)
    dumped = "--xla_dump_to" in os.environ.get("XLA_FLAGS", "")
    with quiet_native_stderr() as log, tempfile.TemporaryDirectory(prefix="lab-shardy-") as folder:
        found = inspect_lowered(lowered, mesh, compiler_options=None if dumped else {"xla_dump_to": folder, **OPTIONS})
        propagation = None if dumped else Propagation.read(Path(folder), lowered.as_text(debug_info=True), names)
    remats, rest = partitioner.read(log)
    if rest:
        print("\n".join(rest), file=sys.stderr)
    if dumped:
        return Compiled(found, "not read: XLA_FLAGS dumps this compile, to the folder asked for", remats, names)
    return Compiled(
        found, propagation or "none recorded: the partitioner is not Shardy, or wrote nothing", remats, names
    )


def record_line(propagation: Propagation | None, *, decided: int, blind: int, missing: str) -> str:
    """The report's line on Shardy's record: how many collectives an annotation decided (`decided`), or why there is
    no record (`missing`); and how many collectives have no frame of the user's code (`blind`)."""
    if propagation is None:
        line = f"sharding origins: none read; {missing}"
    elif not propagation.joined:
        line = (
            "sharding origins: Shardy's record read but joined to no line (the entry function's work is in nested "
            "jit functions, which are not joined); no annotation is named"
        )
    else:
        line = f"sharding origins: Shardy's record read; {decided} collective(s) decided by a conflicting annotation"
    if blind:
        line += (
            f"; {blind} collective(s) with no frame of your code (a traceback all in libraries, or none): their line "
            "is the innermost library one"
        )
    return line


@dataclass(frozen=True)
class _Rule:
    """Shardy's sharding rule for an op (``#sdy.op_sharding_rule<([i, k], [k, j])->([i, j]) {...} reduction={k}>``):
    each operand's and result's dimensions as the factors they hold (a reshape's merged dimension holds several),
    the factors it sums over, and whether it needs an operand replicated."""

    operands: tuple[tuple[tuple[str, ...], ...], ...]
    results: tuple[tuple[tuple[str, ...], ...], ...]
    reduced: frozenset[str]
    replicates: bool

    @classmethod
    def of(cls, text: str) -> _Rule | None:
        rule = re.search(r"op_sharding_rule<\((.*?)\)->\((.*?)\)(.*?)>", text)
        if rule is None:
            return None
        reduced = re.search(r"reduction=\{([^}]*)\}", rule[3])

        def side(group: str) -> tuple[tuple[tuple[str, ...], ...], ...]:
            return tuple(
                tuple(tuple(_FACTOR.findall(dim)) for dim in dims.split(",") if dim.strip())
                for dims in re.findall(r"\[([^\]]*)\]", group)
            )

        return cls(
            side(rule[1]),
            side(rule[2]),
            frozenset(re.findall(r"\w+", reduced[1])) if reduced else frozenset(),
            "need_replication" in rule[3],
        )

    @property
    def elementwise(self) -> bool:
        """Every operand's dimensions map to the result's one to one (``([i, j], [i, j])->([i, j])``): no
        contraction, reduction or reshaping of its own."""
        return not self.reduced and not self.replicates and len(set(self.operands + self.results)) == 1

    def summed(self) -> tuple[tuple[int, ...], ...]:
        """Per operand, the dimensions holding a factor the op sums over (a matmul's contracted one, a reduce's)."""
        if not self.reduced:
            return ()
        return tuple(tuple(d for d, dim in enumerate(dims) if self.reduced & set(dim)) for dims in self.operands)

    def aligned(self, operands: tuple[Value, ...], transpose: bool) -> tuple[Value, ...]:
        """The operands as the result's dimensions see them: for each result dimension the axes that split the
        operand's dimension of the same factor, none where the operand has no such dimension (it is broadcast
        there); summed factors drop out (a split one is a partial sum, not a layout). So ``P('x', None)`` transposed
        reads ``P(None, 'x')``, and each operand compares with the result as an elementwise op's does; () where a
        dimension holds several factors (a reshape's)."""
        result = self.results[0] if self.results else ()
        if len(self.operands) != len(operands) or any(len(f) > 1 for dims in (*self.operands, result) for f in dims):
            return ()
        aligned = []
        for value, factors in zip(operands, self.operands):
            if len(factors) != len(value.dims):
                return ()
            dims = tuple(value.dims[factors.index(f)] if f in factors else () for f in result)
            name = f"{value.name} (transposed)" if transpose else value.name
            aligned.append(Value(name, _spec(dims), value.origins, dims))
        return tuple(aligned)


def resharding(decisions: list[Decision]) -> Decision | None:
    """Of the operations at one line, the first that reshards (an operand laid out otherwise than its result),
    else the first."""
    return next(
        (d for d in decisions if any(v.sharding != d.result.sharding for v in d.aligned or d.operands)), None
    ) or next(iter(decisions), None)


def _result_shape(op: _Op) -> tuple[int, ...] | None:
    """An operation's (last) result type's shape, as its text writes it."""
    types = re.findall(r"tensor<((?:\d+x)*)\w+>", op.text)
    return tuple(int(n) for n in types[-1].split("x") if n) if types else None


def _laid_out(name: str, layouts: list[tuple[tuple[str, ...], ...]], origins: list[dict[str, str]], k: int) -> Value:
    """Result `k` of an operation (or an argument) as a `Value`: "" and no axes where Shardy gave it no layout."""
    dims = layouts[k] if k < len(layouts) else ()
    return Value(name, _spec(dims) if k < len(layouts) else "", origins[k] if k < len(origins) else {}, dims)


def _entry_ops(text: str) -> list[_Op]:
    """The operations of the entry function (``@main``), in order, constants and returns left out."""
    ops, inside, depth = [], False, 0
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("func.func"):
            inside = " @main(" in stripped
            depth = 0
            continue
        if not inside:
            continue
        match = _OP.match(line)
        if match and match["kind"] not in _SKIPPED:
            rest = match["rest"]
            head = re.split(r" \{| : |\) \{", rest, maxsplit=1)[0]
            results = tuple(match["results"].split(", ")) if match["results"] else ()
            ops.append(_Op(_SAME.get(match["kind"], match["kind"]), results, tuple(_VALUE.findall(head)), line))
        depth += stripped.count("{") - stripped.count("}")
        if stripped == "}" and depth < 0:
            inside = False
    return ops


def _join(lowered: list[_Op], propagated: list[_Op]) -> list[tuple[_Op, _Op]]:
    """Pairs of the k-th operation of each kind in both; a kind whose counts differ is left out."""
    pairs = []
    for kind in dict.fromkeys(op.kind for op in lowered):
        mine = [op for op in lowered if op.kind == kind]
        theirs = [op for op in propagated if op.kind == kind]
        if len(mine) == len(theirs):
            pairs += zip(mine, theirs)
    return pairs


def _arguments(text: str) -> dict[str, tuple[str, str | None]]:
    """%argN of the entry function -> (its attribute text, its name from the lowered module's location)."""
    header = next((line for line in text.splitlines() if line.strip().startswith("func.func") and "@main(" in line), "")
    return {m[1]: (m[2] or "", m[3]) for m in _ARG.finditer(header)}


def _shardings(text: str) -> list[str]:
    """The layouts an operation's attributes give its results (sdy.sharding), as PartitionSpecs."""
    return [_spec(dims) for dims in _layouts(text)]


def _layouts(text: str) -> list[tuple[tuple[str, ...], ...]]:
    """The layouts an operation's attributes give its results (sdy.sharding): each dimension's mesh axes."""
    attribute = re.search(r"sdy\.sharding = #sdy\.sharding(?:_per_value)?<(.*?)>(?:,|\}\s*:|\})", text)
    if attribute is None and "sdy.reshard" in text:
        attribute = re.search(r"sdy\.reshard %[\w#]+ (<@\w+, \[.*?\]>)", text)
    if attribute is None:
        return []
    return [_dims(dims) for dims in _SHARDINGS.findall(attribute.group(0))]


def _dims(text: str) -> tuple[tuple[str, ...], ...]:
    """Shardy's ``{"y"}, {}, {"x", "z"}`` -> ``(("y",), (), ("x", "z"))``; a sub-axis ``{"y":(1)2}`` -> ``("y:(1)2",)``
    (`lab.explanation.sub_axes`)."""
    dims = re.findall(r"\{([^}]*)\}", text)
    return tuple(tuple(f"{name}:{part}" if part else name for name, part in _AXIS.findall(dim)) for dim in dims)


def _origins(text: str) -> list[dict[str, str]]:
    """Each result's origins, axis -> origin name."""
    attribute = re.search(r"sdy\.sharding_origins = (\[.*?\}\]|\{[^}]*\})", text)
    if attribute is None:
        return []
    return [dict(_ORIGIN.findall(group)) for group in re.findall(r"\{[^}]*\}", attribute.group(1))]


def _spec(dims: tuple[tuple[str, ...], ...]) -> str:
    """``(("y",), (), ("x", "z"))`` (Shardy's ``[{"y"}, {}, {"x", "z"}]``) -> ``P('y', None, ('x', 'z'))``."""
    parts = [
        "None" if not axes else repr(axes[0]) if len(axes) == 1 else f"({', '.join(map(repr, axes))})" for axes in dims
    ]
    return f"P({', '.join(parts)})"


def _loc_ref(line: str) -> str:
    match = _LOC_REF.search(line)
    return match.group(1) if match else ""


def _locations(text: str) -> dict[str, tuple[str, tuple[str, int] | None]]:
    """#locN -> (the JAX op name it names, the innermost (file, line) it reaches outside a library, else the
    innermost: a flax module's matmul, or nn.with_logical_constraint, is at the user's line that calls it)."""
    raw = {m[1]: m[2] for m in map(_LOC_DEF.match, text.splitlines()) if m}
    resolved: dict[str, tuple[str, tuple[str, int] | None]] = {}

    def resolve(ref: str, depth: int = 0) -> tuple[str, tuple[str, int] | None]:
        if ref in resolved or depth > 50:
            return resolved.get(ref, ("", None))
        body = raw.get(ref, "")
        if file := re.match(r'"((?:[^"\\]|\\.)*)":(\d+):', body):
            found = ("", (file[1], int(file[2])))
        elif call := re.match(r"callsite\((#loc\d*) at (#loc\d*)\)", body):
            found = resolve(call[1], depth + 1)  # the callee: innermost, unless a library's and the caller is yours
            if found[1] is None or is_library(found[1][0]):
                caller = resolve(call[2], depth + 1)[1]
                found = (found[0], caller if caller is not None and not is_library(caller[0]) else found[1])
        elif named := re.match(r'"((?:[^"\\]|\\.)*)"\((#loc\d*)\)', body):
            name, where = resolve(named[2], depth + 1)
            found = (named[1] if "/" in named[1] or named[1].startswith("jit(") else name, where)
        else:
            found = ("", None)
        resolved[ref] = found
        return found

    for ref in raw:
        resolve(ref)
    return resolved
