"""Reading HLO text: the one instruction reader every part of the lab uses.

``compiled.as_text()`` prints an HLO module: a header line, then computations,
each a header and its instructions, one per (indented) line::

    HloModule jit_step, is_scheduled=true, num_partitions=8

    %add (x: f32[], y: f32[]) -> f32[] {
      ...
    }

    ENTRY %main (p: f32[8,128]) -> f32[8,128] {
      %p = f32[8,128]{1,0} parameter(0)
      ROOT %ar = f32[8,128]{1,0} all-reduce(%p), replica_groups={{0,1}}, to_apply=%add, metadata={op_name="jit(f)/psum"}

An instruction is ``[ROOT] %name = shape opcode(operands), attributes``:

* the *shape* is an array ``dtype[dims]{layout}`` or a tuple of them
  ``(f32[8]{0}, bf16[4,2]{1,0})``; a dim may be bounded dynamic (``<=8``);
* *operands* are printed by name (``%p``); older text put a shape before each
  name, and long operand lists carry ``/*index=5*/`` comments;
* *attributes* hold everything else: ``replica_groups=``, ``dimensions=``,
  the computations it calls (``calls=`` for fusions and async wrappers,
  ``body=`` for while loops, ``to_apply=`` for reductions and calls), a
  ``backend_config`` and the ``metadata`` naming the JAX op that made it.

An asynchronous operation is split into ``<op>-start``, optional
``<op>-update`` and ``<op>-done`` instructions. In a scheduled module
(``is_scheduled=true``) each computation lists its instructions in the order
they run.

Sizes: an XLA primitive type's width is the number in its name (``bf16``,
``f8e4m3fn``, ``s4``, ``c64``), ``pred`` is stored as a byte, and ``token`` holds
no data; an array's bytes round sub-byte types up.

`computations` splits a module's text into computations; `parse_instruction`
reads one line. `lab.hlo.collectives` and `lab.hlo.schedule` are built on these
two; `op_names` and `lab.training.profiling` read the same instructions.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

Shape = tuple[int, ...]

# one HLO instruction line (``%name = shape opcode(operands), attributes``) and a computation's header line
INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>.*?)\s+(?P<opcode>[a-z][a-z0-9\-]*)\((?P<rest>.*)$"
)
HEADER = re.compile(r"^(?P<entry>ENTRY\s+)?%?(?P<name>[^\s(){]+)")
OP_NAME = r'op_name="([^"]*)"'
CALLEE = re.compile(r"\b(?:calls|body|to_apply)=%?([\w.\-]+)")  # fusion/async/while/call -> the computation it runs
ASYNC_SUFFIX = re.compile(r"-(start|update|done)$")
_SIMPLE_OPERANDS = re.compile(r"^([^()]*)\)")
_LITERAL_OPCODES = ("parameter", "constant")  # parameter(0), constant(0.1): a literal in the parens, no operands
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")


# --------------------------------------------------------------------------- one instruction


@dataclass(frozen=True)
class Instruction:
    """One HLO instruction line, split into its parts."""

    name: str
    shape: str
    opcode: str
    operands: tuple[str, ...]
    attrs: str  # everything after the operand list
    computation: str  # the computation it lives in
    line_number: int
    line: str

    @functools.cached_property
    def callees(self) -> tuple[str, ...]:
        """The computations it runs: calls= (fusions, async wrappers), body= (loops), to_apply= (reductions, calls)."""
        return tuple(CALLEE.findall(self.attrs))

    def attr(self, pattern: str) -> str | None:
        """The first group of `pattern` in the attributes, or None."""
        match = re.search(pattern, self.attrs)
        return match.group(1) if match else None


def parse_instruction(line: str, computation: str = "", line_number: int = 0) -> Instruction | None:
    """The instruction on `line`, or None when it is not one."""
    match = INSTRUCTION.match(line)
    if not match:
        return None
    rest = match["rest"]
    simple = _SIMPLE_OPERANDS.match(rest)
    end = simple.end() if simple else _closing_paren(rest)
    listed = re.sub(r"/\*.*?\*/", "", rest[: end - 1])
    if match["opcode"] in _LITERAL_OPCODES:
        operands = ()
    else:  # current XLA prints operands as %name; older text put a shape before each name
        operands = tuple(
            re.findall(r"%([\w.\-]+)", listed)
            if "%" in listed
            else (op.strip() for op in listed.split(",") if op.strip())
        )
    attrs = rest[end:]
    return Instruction(
        match["name"],
        match["shape"],
        match["opcode"],
        operands,
        attrs,
        computation,
        line_number,
        line,
    )


def _closing_paren(text: str) -> int:
    """Index just past the ')' closing an operand list (operands printed with layouts hold parens)."""
    depth = 1
    for index, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0:
            return index + 1
    return len(text)


def base_opcode(opcode: str) -> str:
    """The operation an async piece belongs to: ``all-gather-start`` -> ``all-gather``."""
    return ASYNC_SUFFIX.sub("", opcode)


# --------------------------------------------------------------------------- shapes


def arrays(shape_text: str) -> list[tuple[str, Shape]]:
    """(dtype, dims) of every array in a shape, tuples flattened; layouts ignored."""
    return [
        (dtype, tuple(int(d.strip().lstrip("<=")) for d in dims.split(",") if d.strip()))
        for dtype, dims in _ARRAY.findall(shape_text)
    ]


def bits(dtype: str) -> int:
    """Width of an XLA primitive type: the first number in its name (bf16, f8e4m3fn, c64, s4); pred is a byte."""
    if dtype == "pred":
        return 8
    width = re.search(r"\d+", dtype)
    return int(width.group()) if width else 0  # token, opaque: no data


def nbytes(shape_arrays: Iterable[tuple[str, Shape]]) -> int:
    """Bytes of (dtype, dims) arrays, as `arrays` returns them."""
    return sum(math.ceil(math.prod(dims) * bits(dtype) / 8) for dtype, dims in shape_arrays)


# --------------------------------------------------------------------------- a module


@dataclass(frozen=True)
class Computation:
    """One computation of a module: its name and the lines up to the next computation's header."""

    name: str  # "" for lines before any header (a snippet of instructions)
    is_entry: bool
    first_line: int  # the line number of lines[0]
    lines: tuple[str, ...]

    def instruction_lines(self) -> Iterator[tuple[int, str]]:
        """(line number, text) of each indented line: its instructions, in printed order."""
        for number, line in enumerate(self.lines, self.first_line):
            if line.startswith((" ", "\t")):
                yield number, line


def computations(hlo_text: str) -> list[Computation]:
    """The computations of an HLO module's text, in printed order (each one's lines: the schedule, once scheduled)."""
    lines = tuple(hlo_text.splitlines())
    starts = [i for i, line in enumerate(lines) if line.rstrip().endswith("{") and _is_header(line)]
    found = [Computation("", False, 1, lines[: starts[0] if starts else len(lines)])]
    for start, end in zip(starts, [*starts[1:], len(lines)]):
        header = HEADER.match(lines[start])
        found.append(Computation(header["name"], bool(header["entry"]), start + 2, lines[start + 1 : end]))
    return found if any(found[0].instruction_lines()) else found[1:]


def _is_header(line: str) -> bool:
    return not line.startswith((" ", "\t", "HloModule")) and HEADER.match(line) is not None


def module_devices(hlo_text: str) -> int | None:
    """Devices the module runs on, from its header: num_partitions x replica_count (None if it says neither)."""
    header = re.search(r"^HloModule\b.*$", hlo_text, re.MULTILINE)
    partitions = re.search(r"num_partitions=(\d+)", header.group()) if header else None
    replicas = re.search(r"replica_count=(\d+)", header.group()) if header else None
    if not partitions and not replicas:
        return None
    return int(partitions.group(1) if partitions else 1) * int(replicas.group(1) if replicas else 1)


def module_name(hlo_text: str) -> str:
    match = re.match(r"\s*HloModule\s+([\w.\-]+)", hlo_text)
    return match.group(1) if match else "module"


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
