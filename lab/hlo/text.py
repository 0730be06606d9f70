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

XLA's parser reads more than its printer writes, and dumps from other tools
(torch_xla, hand-edited text) use that freedom. This reader accepts it too:

* an instruction may run over several lines: a line whose parentheses,
  brackets, braces or quotes are still open (or that ends in ``,`` or ``=``)
  continues on the next, and is read as one *statement*;
* the module may be indented as a whole, and blanks may stand around ``=`` and
  inside shapes and lists (``replica_groups = { {0,2}, {1,3} }``);
* names and operands may lack the ``%`` and operands may carry their shapes
  (``all-reduce(f32[8]{0} p)``);
* attributes are read outside quoted strings, so ``metadata={op_name="a, b=c"}``
  holds no attribute, and strings are C-escaped (``op_name="jit(f)/\\"x\\""``).

*Metadata* names the code that made an instruction: ``metadata={op_type=".."
op_name="jit(f)/psum" source_file="f.py" source_line=3 stack_frame_id=2}``.
Current JAX prints no ``source_file`` there but a ``stack_frame_id`` into the
module's stack-frame tables, printed after the ``HloModule`` line
(`lab.hlo.sources` reads them). The header says how many devices run the module
(``num_partitions``, ``replica_count``; `module_devices`) but not which: the
device assignment lives outside the text (a dump directory's
``compile_options.textproto``).

`computations` splits a module's text into computations of statements;
`parse_instruction` reads one statement. The module is long but one concept:
the one place that knows HLO's lexical syntax (statements, instructions,
attributes, metadata, shapes, the stack-frame tables), one grammar, which
split in two would let two readers disagree about the same line. `lab.hlo.collectives` and
`lab.hlo.schedule` are built on these two; `op_names` and
`lab.training.profiling` read the same instructions.
"""

from __future__ import annotations

import codecs
import functools
import math
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

Shape = tuple[int, ...]

# one HLO instruction (``%name = shape opcode(operands), attributes``) and a computation's header line
INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>.*?[\]})])\s*(?P<opcode>[a-z][a-z0-9\-]*)\s*\((?P<rest>.*)$"
)
HEADER = re.compile(r"^\s*(?P<entry>ENTRY\s+)?%?(?P<name>[^\s(){]+)")
OP_NAME = r'op_name="((?:[^"\\]|\\.)*)"'  # the raw (still escaped) op_name; `Instruction.metadata` unescapes it
CALLEE = re.compile(r"\b(?:calls|body|to_apply)=%?([\w.\-]+)")  # fusion/async/while/call -> the computation it runs
ASYNC_SUFFIX = re.compile(r"-(start|update|done)$")
STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')  # a C-escaped string literal
_SIMPLE_OPERANDS = re.compile(r"^([^()]*)\)")
_LITERAL_OPCODES = ("parameter", "constant")  # parameter(0), constant(0.1): a literal in the parens, no operands
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")
_ASSIGN = re.compile(r"\s*(?:ROOT\s+)?%?[\w.\-]+\s*=")  # how an instruction starts: its name and "="
_CLOSE = re.compile(r"[ \t]*\}")  # the line closing a computation's body
# a line that cannot continue the statement before it: a new instruction (name = shape), header or module line
_STATEMENT = re.compile(
    r"\s*(?:(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?:\(|[a-z][a-z0-9]*\[)|ENTRY\b|HloModule\b|%?[\w.\-]+\s*(?:\(.*->.*)?\{\s*$)"
)
_BLANKS = re.compile(r"\s+")
# what splitting at top-level commas must see: strings and small balanced groups (``{{0,1},{2,3}}``, ``[2,4]``)
# whole, else single brackets and commas
_STRUCTURE = re.compile(
    r'"[^"\\]*(?:\\.[^"\\]*)*"|\{(?:[^{}"]|\{[^{}"]*\})*\}|\[[^\[\]"]*\]|\((?:[^()"]|\([^()"]*\))*\)|[(){}\[\],]'
)
_OPENING, _CLOSING = frozenset("({["), frozenset(")}]")
_METADATA_ITEM = re.compile(r'([\w.\-]+)\s*=\s*("[^"\\]*(?:\\.[^"\\]*)*"|\{[^{}]*\}|[^\s{}"]+)')
_INTEGER = re.compile(r"-?\d+")


# --------------------------------------------------------------------------- statements: lines joined, balanced


def _open(text: str) -> tuple[bool, int]:
    """(whether `text` leaves a string, parenthesis or bracket open, how many braces it leaves open)."""
    if '"' in text:
        text = STRING.sub("", text)
        if '"' in text:  # a string still open
            return True, 0
    return (
        text.count("(") > text.count(")") or text.count("[") > text.count("]"),
        text.count("{") - text.count("}"),
    )


def statement_is_open(text: str) -> bool:
    """Whether a statement leaves a quote, parenthesis, bracket or brace open (text cut short)."""
    unclosed, braces = _open(text)
    return unclosed or braces > 0


def _continues(text: str) -> bool:
    """Whether the statement in `text` goes on to the next line."""
    unclosed, braces = _open(text)
    if unclosed:
        return True
    if braces > 0:  # a computation's header opens its body with "{"; an instruction closes what it opens
        return braces > 1 or _ASSIGN.match(text) is not None or not text.rstrip().endswith("{")
    if braces == 0 and _ASSIGN.match(text):  # an instruction cut after "=" or "," or before its opcode
        return text.rstrip()[-1:] in (",", "=") or "(" not in STRING.sub("", text)
    return False


def statements(lines: Sequence[str], first_line: int = 1) -> Iterator[tuple[int, str]]:
    """(line number, text) of each statement: a line, or an instruction continued over several lines joined by blanks.

    A statement continues while it leaves a quote, parenthesis, bracket or
    brace open, ends in ``,`` or ``=``, or is an instruction whose line holds
    no parenthesis yet (a break between an array shape and its opcode); a line
    that starts a new instruction, computation or module ends it even so, so
    one broken line cannot swallow the rest of the module.
    """
    index, count = 0, len(lines)
    for flagged in (*_lines_to_check(lines), count):
        if flagged < index:  # consumed as a continuation already
            continue
        yield from zip(range(index + first_line, flagged + first_line), lines[index:flagged])
        if flagged == count:
            return
        index = flagged + 1
        text = lines[flagged]
        if not _continues(text):
            yield flagged + first_line, text
            continue
        parts = [text]
        while index < count:
            following = lines[index].strip()
            if following and (
                _STATEMENT.match(following) or (following.startswith("}") and _open(" ".join(parts))[1] <= 0)
            ):
                break
            index += 1
            if following:
                parts.append(following)
                if not _continues(" ".join(parts)):
                    break
        yield flagged + first_line, " ".join(parts)


# what `_lines_to_check` runs over the module's bytes
_LINE_STRING = re.compile(rb'"[^"\\\n]*(?:\\.[^"\\\n]*)*"')  # a string closed on its line
_PLAIN_LINE_STRING = re.compile(rb'"[^"\n]*"')  # the same where the text holds no backslash
_NOT_STRUCTURE = bytes(byte for byte in range(256) if byte not in b'()[]{}"\n')
_CUT = re.compile(rb"[,=][ \t]*(?=\n|\Z)")
_SHAPE_WITHOUT_PARENS = re.compile(rb"^[^(\n\[]*\[[^(\n]*$", re.MULTILINE)
_LEFT_OPEN = re.compile(rb"[^\n]+")


def _lines_to_check(lines: Sequence[str]) -> list[int]:
    """Indices of the lines that may not be whole statements: those leaving something open or closing more than
    they open (headers, "}"), ending in "," or "=", or holding a shape but no parenthesis.

    Found over the whole text at once (strings removed, then everything but
    brackets, then empty pairs until none is left), so a module of 100k
    ordinary lines costs a few passes of C code, not a Python loop per line.
    """
    data = "\n".join(lines).encode("utf-8", "surrogatepass") + b"\n"
    bare = (_LINE_STRING if b"\\" in data else _PLAIN_LINE_STRING).sub(b"", data)
    structure = bare.translate(None, _NOT_STRUCTURE)
    found = set(_line_indices(structure, (m.start() for m in _SHAPE_WITHOUT_PARENS.finditer(structure))))
    shorter = len(structure) + 1
    while len(structure) < shorter:
        shorter = len(structure)
        structure = structure.replace(b"()", b"").replace(b"[]", b"").replace(b"{}", b"")
    found.update(_line_indices(structure, (m.start() for m in _LEFT_OPEN.finditer(structure))))
    if b" \n" in bare or b"\t\n" in bare:
        cuts = [m.start() for m in _CUT.finditer(bare)]
    else:  # the usual text: no blanks at line ends, so a cut line ends in ",\n" or "=\n"
        cuts = sorted(_positions(bare, b",\n") + _positions(bare, b"=\n"))
    found.update(_line_indices(bare, cuts))
    return sorted(found)


def _positions(data: bytes, needle: bytes) -> list[int]:
    found, start = [], data.find(needle)
    while start >= 0:
        found.append(start)
        start = data.find(needle, start + 1)
    return found


def _line_indices(text: bytes, positions: Iterable[int]) -> Iterator[int]:
    """The line index of each of increasing `positions` in `text`."""
    line, last = 0, 0
    for position in positions:
        line += text.count(b"\n", last, position)
        last = position
        yield line


# --------------------------------------------------------------------------- one instruction


@dataclass(frozen=True)
class Instruction:
    """One HLO instruction, split into its parts."""

    name: str
    shape: str
    opcode: str
    operands: tuple[str, ...]
    attrs: str  # everything after the operand list, as written
    computation: str  # the computation it lives in
    line_number: int
    line: str  # the statement: its lines joined when it was continued

    @functools.cached_property
    def attributes(self) -> dict[str, str]:
        """Attribute name -> value as written (blanks trimmed), split at commas outside strings and brackets."""
        return split_attributes(self.attrs)

    def attribute(self, name: str) -> str | None:
        """The value of attribute `name` with blanks outside strings removed, or None."""
        value = self.attributes.get(name)
        return None if value is None else compact(value)

    @functools.cached_property
    def _searchable(self) -> str:
        """The attributes as ``name=value, ...``, blanks outside strings removed, metadata left out."""
        return ", ".join(f"{name}={compact(value)}" for name, value in self.attributes.items() if name != "metadata")

    @functools.cached_property
    def callees(self) -> tuple[str, ...]:
        """The computations it runs: calls= (fusions, async wrappers), body= (loops), to_apply= (reductions, calls)."""
        if "calls" not in self.attrs and "body" not in self.attrs and "to_apply" not in self.attrs:
            return ()
        return tuple(CALLEE.findall(self._searchable))

    def attr(self, pattern: str) -> str | None:
        """The first group of `pattern` in the attributes (``name=value, ...``: blanks outside strings removed,
        metadata left out, so text quoted in metadata is never taken for an attribute), or None."""
        match = re.search(pattern, self._searchable)
        return match.group(1) if match else None

    @functools.cached_property
    def metadata(self) -> dict[str, str | int | None]:
        """Its ``metadata={...}``: op_name, source_file, source_line (None when not printed) and whatever else XLA
        printed there (op_type, source_end_line, source_column, stack_frame_id, ...); strings unescaped, numbers int."""
        return parse_metadata(self.attributes.get("metadata", ""))

    @functools.cached_property
    def frontend_attributes(self) -> dict[str, str]:
        """Its ``frontend_attributes={key="value",...}``, string values unescaped."""
        value = self.attributes.get("frontend_attributes", "").strip()
        if not value.startswith("{"):
            return {}
        return {name: _unquote(item) for name, item in split_attributes(value[1:-1]).items()}


def parse_instruction(line: str, computation: str = "", line_number: int = 0) -> Instruction | None:
    """The instruction in statement `line` (lines already joined; a text with line breaks is joined here), or None."""
    if "\n" in line:
        line = " ".join(part.strip() for part in line.splitlines())
    match = INSTRUCTION.match(line)
    if not match:
        return None
    rest = match["rest"]
    simple = _SIMPLE_OPERANDS.match(rest)
    end = simple.end() if simple else _closing_paren(rest)
    listed = rest[: end - 1]
    if "/*" in listed:  # /*index=5*/ comments in long operand lists
        listed = re.sub(r"/\*.*?\*/", "", listed)
    if match["opcode"] in _LITERAL_OPCODES:
        operands = ()
    else:  # operands are printed as %name; older text and hand-written text put a shape before it, or drop the %
        operands = tuple(
            operand.rsplit(None, 1)[-1].lstrip("%") for operand in _split_top_level(listed) if operand.strip()
        )
    return Instruction(
        match["name"],
        match["shape"].strip(),
        match["opcode"],
        operands,
        rest[end:],
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


def _split_top_level(text: str) -> list[str]:
    """`text` split at commas outside strings, parentheses, brackets and braces."""
    if "(" not in text and "[" not in text and "{" not in text and '"' not in text:
        return text.split(",")
    parts, depth, start = [], 0, 0
    for token in _STRUCTURE.finditer(text):
        char = token.group()
        if len(char) > 1:  # a string or a balanced group: no top-level comma inside
            continue
        if char in _OPENING:
            depth += 1
        elif char in _CLOSING:
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(text[start : token.start()])
            start = token.end()
    parts.append(text[start:])
    return parts


def split_attributes(attrs: str) -> dict[str, str]:
    """``, a=1, b={x, y}, c="p, q"`` -> {a: 1, b: {x, y}, c: "p, q"}: values as written, blanks trimmed.

    A mesh replica-group list's ``, device_ids=(...)`` belongs to the value
    before it (``replica_groups=mesh[a=2], device_ids=([2]T(0)) {a}``).
    """
    found: dict[str, str] = {}
    previous = None
    for part in _split_top_level(attrs):
        name, equals, value = part.partition("=")
        name = name.strip()
        if not equals or not name:
            continue
        if name == "device_ids" and previous is not None and found[previous].startswith(("mesh", "@mesh")):
            found[previous] = f"{found[previous]}, {part.strip()}"
            continue
        found.setdefault(name, value.strip())
        previous = name
    return found


def compact(value: str) -> str:
    """`value` with blanks outside strings removed (``{ {0, 1} }`` -> ``{{0,1}}``)."""
    if " " not in value and "\t" not in value:
        return value
    if '"' not in value:
        return _BLANKS.sub("", value)
    pieces, last = [], 0
    for string in STRING.finditer(value):
        pieces.extend((_BLANKS.sub("", value[last : string.start()]), string.group()))
        last = string.end()
    pieces.append(_BLANKS.sub("", value[last:]))
    return "".join(pieces)


def unescape(text: str) -> str:
    """A C-escaped string's text (absl::CEscape: ``\\"``, ``\\\\``, ``\\n``, octal bytes of UTF-8)."""
    if "\\" not in text:
        return text
    return codecs.escape_decode(text.encode("utf-8"))[0].decode("utf-8", "replace")


def _unquote(value: str) -> str:
    value = value.strip()
    return unescape(value[1:-1]) if len(value) >= 2 and value[0] == value[-1] == '"' else value


def parse_metadata(value: str) -> dict[str, str | int | None]:
    """``{op_name="a" source_line=3 ...}`` -> {op_name: "a", source_file: None, source_line: 3, ...}."""
    found: dict[str, str | int | None] = {"op_name": None, "source_file": None, "source_line": None}
    value = value.strip()
    if value.startswith("{") and value.endswith("}"):
        value = value[1:-1]
    for name, item in _METADATA_ITEM.findall(value):
        if item.startswith('"'):
            found[name] = unescape(item[1:-1])
        else:
            found[name] = int(item) if _INTEGER.fullmatch(item) else item
    return found


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
    """One computation of a module: its name, its lines up to the next computation's header, its statements."""

    name: str  # "" for lines before any header (a snippet of instructions)
    is_entry: bool
    first_line: int  # the line number of lines[0]
    lines: tuple[str, ...]
    body: tuple[tuple[int, str], ...] = ()  # (line number, statement) between the header's "{" and its "}"

    def instruction_lines(self) -> Iterator[tuple[int, str]]:
        """(line number, statement) of each instruction, in printed order; a continued instruction is one."""
        return iter(self.body)


def computations(hlo_text: str) -> list[Computation]:
    """The computations of an HLO module's text, in printed order (each one's statements: the schedule, once
    scheduled). Indentation does not matter: a header is a statement ending in ``{`` that is no instruction."""
    lines = hlo_text.splitlines()
    headers: list[tuple[int, str, bool]] = []  # (index of the header line, name, is entry)
    bodies: list[list[tuple[int, str]]] = [[]]  # bodies[0]: instructions before any header
    inside, body, closes = False, bodies[0], _CLOSE.match
    for number, text in statements(lines):
        if inside:
            if closes(text):
                inside = False
            elif text and not text.isspace():
                body.append((number, text))
            continue
        stripped = text.strip()
        if not stripped:
            continue
        if _is_header(stripped):
            header = HEADER.match(stripped)
            headers.append((number - 1, header["name"], bool(header["entry"])))
            body = []
            bodies.append(body)
            inside = True
        elif (
            not headers
            and (text.startswith((" ", "\t")) or INSTRUCTION.match(text))
            and not stripped.startswith("HloModule")
        ):
            bodies[0].append((number, text))
    starts = [index for index, _, _ in headers]
    found = [Computation("", False, 1, tuple(lines[: starts[0] if starts else len(lines)]), tuple(bodies[0]))]
    for (start, name, is_entry), end, body in zip(headers, [*starts[1:], len(lines)], bodies[1:]):
        found.append(Computation(name, is_entry, start + 2, tuple(lines[start + 1 : end]), tuple(body)))
    return found if found[0].body else found[1:]


def _is_header(stripped: str) -> bool:
    return (
        stripped.endswith("{")
        and not stripped.startswith("HloModule")
        and _ASSIGN.match(stripped) is None
        and HEADER.match(stripped) is not None
    )


def _module_header(hlo_text: str) -> str:
    header = re.search(r"^\s*HloModule\b.*$", hlo_text, re.MULTILINE)
    return header.group() if header else ""


def module_devices(hlo_text: str) -> int | None:
    """Devices the module runs on, from its header: num_partitions x replica_count (None if it says neither).

    That is all the text says about devices: which devices run it (the device
    assignment) is not printed in the HLO text.
    """
    header = _module_header(hlo_text)
    partitions = re.search(r"\bnum_partitions\s*=\s*(\d+)", header)
    replicas = re.search(r"\breplica_count\s*=\s*(\d+)", header)
    if not partitions and not replicas:
        return None
    return int(partitions.group(1) if partitions else 1) * int(replicas.group(1) if replicas else 1)


def damage(hlo_text: str) -> str | None:
    """Why a module's text cannot be whole, in words, or None: a header counting zero devices, no entry
    computation, or text that stops inside a computation (a file cut short while it was written or copied).

    XLA prints the entry computation last and closes every computation with a
    line ``}``, so a whole module's last non-blank line is that ``}``.
    """
    header = _module_header(hlo_text)
    for field in ("num_partitions", "replica_count"):
        count = re.search(rf"\b{field}\s*=\s*(\d+)", header)
        if count and int(count.group(1)) == 0:
            return f"its header says {field}=0, and XLA runs a module on at least one device"
    if not re.search(r"^\s*ENTRY\b", hlo_text, re.MULTILINE):
        return "it has no ENTRY computation (the text stops before it, or is not a whole module)"
    lines = hlo_text.rstrip().splitlines()
    if lines[-1].strip() != "}":
        return f"it stops inside a computation, at line {len(lines)} ({lines[-1].strip()[:60]!r}...)"
    return None


def module_name(hlo_text: str) -> str:
    match = re.match(r"\s*HloModule\s+([\w.\-]+)", hlo_text)
    return match.group(1) if match else "module"


def op_names(hlo_text: str) -> dict[str, tuple[str, str]]:
    """Instruction name -> (opcode, op_name metadata) for every instruction that carries an op_name: the link from
    an op in a profile back to the JAX code (its named scopes, its autodiff transforms) that made it."""
    found = {}
    for _, line in statements(hlo_text.splitlines()):
        if "op_name" not in line:
            continue
        instruction = parse_instruction(line)
        op_name = instruction.metadata["op_name"] if instruction is not None else None
        if op_name is not None:
            found[instruction.name] = (instruction.opcode, op_name)
    return found
