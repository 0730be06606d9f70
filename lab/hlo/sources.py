"""Where in the user's Python an HLO instruction came from: the stack-frame tables of a module.

JAX records the Python traceback of every operation it stages out. Older XLA
printed the innermost frame on each instruction
(``metadata={op_name="..." source_file="train.py" source_line=42}``); current
XLA prints each instruction's frame by id (``stack_frame_id=9``) and the
frames once, as four tables between the module header and its first
computation::

    FileNames
    1 "/home/me/train.py"

    FunctionNames
    1 "loss"

    FileLocations
    1 {file_name_id=1 function_name_id=1 line=10 end_line=10 column=21 end_column=21}

    StackFrames
    1 {file_location_id=1 parent_frame_id=1}

A frame names a location and its caller. XLA prints the caller one-based
(``parent_frame_id`` is the caller's id plus one, and a frame without a caller
prints 1); tables whose roots print 0 name the caller by its own id. Either
way a chain is read innermost first up to the frame without a caller.

The line a user wants is the innermost frame in *their* code, and its callers
there (`stack_of`: ``model.py:263 einsum <- model.py:915 attention``), up to
the lab's code that compiled the program. JAX keeps whole
tracebacks in the locations but drops the frames of its own tree and of the
Python installation it runs from, so which library frames survive depends on
how the user installed: in a virtual environment flax and optax frames are
kept, in the machine's Python they are dropped. The lab walks past library
frames by its own rule (anything under ``site-packages``, ``dist-packages``, a
``lib/pythonX.Y`` folder, or this interpreter's install and user-site
folders), so a matmul inside ``nnx.Linear`` points at the line of the model
that called the layer, whatever the layout.
"""

from __future__ import annotations

import re
import site
import sysconfig
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from lab.hlo.text import parse_metadata, unescape

_TABLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")
_ROW = re.compile(r"^(\d+)\s+(.*)$")
_LAB = Path(__file__).resolve().parents[1]  # the lab package
_LAB_DRIVERS = tuple(
    str(_LAB / name) for name in ("hlo/", "explanation/", "cli.py", "entry.py", "__main__.py", "interrupts.py")
)
_LIBRARY = re.compile(r"(site-packages|dist-packages)/|/lib/python\d+(\.\d+)?/|^<frozen |/jax/_src/")


@cache
def _install_folders() -> tuple[str, ...]:
    """This interpreter's standard-library, site-packages and user-site folders."""
    paths = {sysconfig.get_path(name) for name in ("stdlib", "platstdlib", "purelib", "platlib")}
    paths.update(site.getsitepackages() if hasattr(site, "getsitepackages") else ())
    paths.add(site.getusersitepackages())
    return tuple(sorted(path.rstrip("/") + "/" for path in paths if path))


def is_library(file: str) -> bool:
    """Whether `file` belongs to an installed library or Python itself rather than the user's project."""
    return bool(_LIBRARY.search(file)) or file.startswith(_install_folders())


def op_of(op_name: str) -> str:
    """The op a JAX op name ends in: ``jit(f)/jit(_pad)/pad`` -> ``pad``."""
    return op_name.rsplit("/", 1)[-1]


@dataclass(frozen=True)
class Frame:
    """One Python frame: file, line, function."""

    file: str
    line: int
    function: str

    @property
    def in_library(self) -> bool:
        return is_library(self.file)

    @property
    def in_lab_driver(self) -> bool:
        """A frame of the lab's code that compiles a program (`lab inspect`, the explanation): the caller of the
        user's step, never part of it."""
        return self.file.startswith(_LAB_DRIVERS)

    def __str__(self) -> str:
        return f"{self.file}:{self.line}"

    @property
    def cited(self) -> str:
        """``file.py:12``: the frame as a report's sentence cites it, without the folders."""
        return f"{self.file.rsplit('/', 1)[-1]}:{self.line}"


@dataclass(frozen=True)
class StackFrames:
    """A module's frame tables: stack-frame id -> the chain of frames, innermost first."""

    files: Mapping[int, str]
    functions: Mapping[int, str]
    locations: Mapping[int, tuple[int, int, int]]  # id -> (file id, function id, line)
    parents: Mapping[int, tuple[int, int]]  # frame id -> (location id, parent frame id)

    def chain(self, frame_id: int) -> tuple[Frame, ...]:
        """The frames of `frame_id` and its callers, innermost first."""
        found, seen = [], set()
        while frame_id in self.parents and frame_id not in seen:
            seen.add(frame_id)
            location, parent = self.parents[frame_id]
            if location in self.locations:
                file_id, function_id, line = self.locations[location]
                found.append(Frame(self.files.get(file_id, "?"), line, self.functions.get(function_id, "?")))
            frame_id = parent
        return tuple(found)

    def user_frame(self, frame_id: int) -> Frame | None:
        """The innermost frame outside installed libraries (else the innermost one)."""
        frames = self.chain(frame_id)
        return next((f for f in frames if not f.in_library), frames[0] if frames else None)

    def user_chain(self, frame_id: int) -> tuple[Frame, ...]:
        """The call chain in the user's code, innermost first: the frames outside installed libraries (a layer of
        flax between two of the user's frames is stepped over) up to the lab's own code that compiled it; the
        innermost frame alone when every frame is a library's, and none when only the lab's own are left."""
        frames = self.chain(frame_id)
        mine = []
        for frame in frames:
            if frame.in_lab_driver:
                break
            if not frame.in_library:
                mine.append(frame)
        return tuple(mine) or tuple(f for f in frames if not f.in_lab_driver)[:1]


def stack_frames(hlo_text: str) -> StackFrames:
    """The frame tables of a module's text (empty when it prints none)."""
    rows: dict[str, dict[int, str]] = {name: {} for name in _TABLES}
    table = None
    for line in _table_lines(hlo_text) if "StackFrames" in hlo_text else ():
        stripped = line.strip()
        if stripped in _TABLES:
            table = stripped
            continue
        row = _ROW.match(stripped)
        if table and row:
            rows[table][int(row[1])] = row[2]
    locations = {key: parse_metadata(value) for key, value in rows["FileLocations"].items()}
    frames = {key: parse_metadata(value) for key, value in rows["StackFrames"].items()}
    return StackFrames(
        files={key: _unquote(value) for key, value in rows["FileNames"].items()},
        functions={key: _unquote(value) for key, value in rows["FunctionNames"].items()},
        locations={
            key: (int(f.get("file_name_id") or 0), int(f.get("function_name_id") or 0), int(f.get("line") or 0))
            for key, f in locations.items()
        },
        parents=_callers(frames),
    )


def _callers(frames: Mapping[int, Mapping[str, str]]) -> dict[int, tuple[int, int]]:
    """Frame id -> (location id, caller id), the caller read one-based unless the table's roots print 0."""
    printed = {key: int(f.get("parent_frame_id") or 0) for key, f in frames.items()}
    shift = 0 if 0 in printed.values() else 1
    return {key: (int(f.get("file_location_id") or 0), printed[key] - shift) for key, f in frames.items()}


def source_of(metadata: Mapping[str, str], frames: StackFrames) -> Frame | None:
    """The user's line an instruction came from: its stack frame, or the older source_file/source_line."""
    frame_id = str(metadata.get("stack_frame_id") or "")
    if frame_id.isdigit():
        frame = frames.user_frame(int(frame_id))
        if frame is not None:
            return frame
    file, line = metadata.get("source_file"), str(metadata.get("source_line") or "")
    if file and line.isdigit():
        return Frame(str(file), int(line), "?")
    return None


def stack_of(metadata: Mapping[str, str], frames: StackFrames) -> tuple[Frame, ...]:
    """The user's call chain an instruction came from, innermost first (`StackFrames.user_chain`); the older
    source_file/source_line as a chain of one; empty when the instruction names no source."""
    frame_id = str(metadata.get("stack_frame_id") or "")
    if frame_id.isdigit():
        chain = frames.user_chain(int(frame_id))
        if chain:
            return chain
    source = source_of(metadata, frames)
    return (source,) if source is not None else ()


def nearest_metadata(every: Mapping, key: tuple[str, str], depth: int = 0) -> dict[str, str]:
    """The metadata of instruction `key` ((computation, name) in `every`); where it carries no source (XLA:GPU's
    combiner writes its concatenated buffer without one), its nearest producer's."""
    instruction = every[key]
    metadata = dict(instruction.metadata)
    if metadata.get("stack_frame_id") is not None or metadata.get("source_file") or depth >= 4:
        return metadata
    for operand in instruction.operands:
        found = nearest_metadata(every, (key[0], operand), depth + 1) if (key[0], operand) in every else {}
        if found.get("stack_frame_id") is not None or found.get("source_file"):
            return {**found, **{k: v for k, v in metadata.items() if v is not None}}
    return metadata


def short_chain(stack: tuple[Frame, ...], op: str = "", shown: int = 3) -> str:
    """``model.py:263 einsum <- model.py:915 attention <- ...: dot_general``: a chain in one table cell."""
    if not stack:
        return op or "?"
    calls = " <- ".join(f"{f.cited} {f.function}" for f in stack[:shown])
    return f"{calls}{' <- ...' if len(stack) > shown else ''}: {op}" if op else calls


def _table_lines(hlo_text: str):
    """The lines before the first computation (where the tables are printed)."""
    for line in hlo_text.splitlines():
        stripped = line.strip()
        if stripped.endswith("{") and not stripped[:1].isdigit() and not stripped.startswith("HloModule"):
            return
        yield line


def _unquote(text: str) -> str:
    text = text.strip()
    return unescape(text[1:-1]) if len(text) >= 2 and text[0] == text[-1] == '"' else text
