"""Refusing bad input before any work starts.

Every option a user types is checked here for the class of mistake it can
hold, and refused with one line that names the option, what was wrong and
what to give instead (a `LabError`: exit code 2, nothing written):

* numbers that must be finite, positive or bounded (a learning rate of nan or
  1e30, a seed of -1, 1e20 steps, a batch no host memory holds);
* element types JAX can run as named: float64 without ``jax_enable_x64``
  runs as float32, so it is refused rather than relabelled;
* files that must be HLO text: a regular file, of a sane size, UTF-8, with an
  ``HloModule`` header (``/dev/zero`` or a binary file is refused up front);
* paths the run will write: a folder that is not a file, a file that is a
  regular file (not a folder, a device or a link), somewhere this user may
  write, and page names that stay inside the results folder.
"""

from __future__ import annotations

import dataclasses
import math
import os
import stat
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np

from lab.errors import LabError

MAX_COUNT = 2**31 - 1  # the most of anything an option counts (steps, layers, bytes, ids): JAX's int32
MAX_HLO_BYTES = 512 * 2**20  # a 1024-chip LLM step's optimized module is tens of MiB; beyond this it is no HLO dump
_HLO_HEADER = "HloModule"
_DTYPES = ("float32", "bfloat16", "float16", "int32", "int16", "int8", "uint32", "uint16", "uint8")
_WIDE = ("float64", "int64", "uint64", "complex128")


def number(option: str, value: float, *, low: float | None = None, high: float | None = None) -> float:
    """`value` must be finite and within [low, high] (either bound may be open by being None)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise LabError(f"{option} {value}: must be a finite number")
    if low is not None and value < low:
        raise LabError(f"{option} {value:g}: must be at least {low:g}")
    if high is not None and value > high:
        raise LabError(f"{option} {value:g}: must be at most {high:g}")
    return value


def options(config, least: Callable[[str, float], float] | None = None) -> None:
    """Every number among an options dataclass's fields (a tuple's, a nested dataclass's too) finite, every count
    (an int) at most `MAX_COUNT`, and with `least` each at least ``least(field name, value)``. The floor every
    command shares, checked before any work; each command adds its own bounds."""
    for field in dataclasses.fields(config):
        values = getattr(config, field.name)
        option = f"--{field.name.replace('_', '-')}"
        for value in values if isinstance(values, tuple) else (values,):
            if dataclasses.is_dataclass(value):
                options(value, least)
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                low = least(field.name, value) if least is not None else None
                number(option, value, low=low, high=MAX_COUNT if isinstance(value, int) else None)


def positive(option: str, value: float, *, high: float | None = None) -> float:
    """`value` must be finite, above zero, and at most `high`."""
    number(option, value, high=high)
    if value <= 0:
        raise LabError(f"{option} {value:g}: must be positive")
    return value


def dtype(option: str, name: str) -> np.dtype:
    """An element type JAX runs as named."""
    if name in _WIDE and not jax.config.jax_enable_x64:
        raise LabError(
            f"{option} {name}: JAX runs 64-bit types as 32-bit unless JAX_ENABLE_X64=1 is set, so the result would "
            f"be mislabelled; use one of {', '.join(_DTYPES)}"
        )
    if name not in (*_DTYPES, *_WIDE):
        raise LabError(f"{option} {name!r}: not an element type the lab runs; use one of {', '.join(_DTYPES)}")
    return np.dtype(jax.numpy.dtype(name))


def hlo_text(path: Path) -> str:
    """The text of an HLO dump, refused up front when it cannot be one."""
    try:
        info = path.stat()
    except OSError as err:
        raise LabError(
            f"cannot read HLO file {str(path)!r}: {err.strerror}; give the path of an HLO text dump"
        ) from None
    if not stat.S_ISREG(info.st_mode):
        raise LabError(f"{str(path)!r} is not a regular file; give the path of an HLO text dump")
    if info.st_size > MAX_HLO_BYTES:
        raise LabError(
            f"{str(path)!r} holds {info.st_size / 2**20:.0f} MiB, more than any HLO module "
            f"({MAX_HLO_BYTES // 2**20} MiB at most); give one module's .txt dump"
        )
    try:
        text = path.read_text(encoding="utf-8-sig")  # a byte-order mark (some editors write one) is no text
    except UnicodeDecodeError:
        raise LabError(f"{str(path)!r} is not text (not UTF-8): give an HLO text dump, not a binary proto") from None
    except OSError as err:
        raise LabError(f"cannot read HLO file {str(path)!r}: {err.strerror}") from None
    if _HLO_HEADER not in text[:100_000]:
        raise LabError(
            f"{str(path)!r} holds no HLO module (no {_HLO_HEADER!r} header); give a file written by "
            "XLA_FLAGS=--xla_dump_to (e.g. *.after_optimizations.txt)"
        )
    return text


def output_folder(option: str, path: Path) -> Path:
    """A folder the run will write into: not a file, and writable (or creatable) by this user."""
    if path.exists() and not path.is_dir():
        raise LabError(f"{option} {str(path)!r} is a file; give a folder")
    _writable(option, path)
    return path


def output_file(option: str, path: Path) -> Path:
    """A file the run will write: a new name or a regular file (not a folder, a device or a link, which writing
    through a temporary file and a rename would replace), in a folder this user may write."""
    if path.is_dir():
        raise LabError(f"{option} {str(path)!r} is a folder; give a file name")
    if path.is_symlink() or (path.exists() and not path.is_file()):
        kind = "a link" if path.is_symlink() else "a device or pipe, not a regular file"
        raise LabError(f"{option} {str(path)!r} is {kind}; give the name of a regular file the lab may replace")
    _writable(option, path.parent)
    return path


MAX_NAME_BYTES = 255 - len(".metrics.jsonl")  # a file name's limit, less what the lab adds to a page's name


def page_name(option: str, name: str) -> str:
    """A page's folder name: one path component, so the page stays inside the results folder, short enough that
    the files named after it (``<name>.metrics.jsonl``) are names the filesystem accepts."""
    if not name or name in (".", "..") or "/" in name or "\\" in name or name.startswith(".") or "\0" in name:
        raise LabError(f"{option} {name!r}: give a plain folder name (letters, digits, - and _), e.g. {option} my-run")
    if len(name.encode("utf-8", errors="surrogateescape")) > MAX_NAME_BYTES:
        raise LabError(f"{option} {name[:20]!r}...: {len(name.encode())} bytes; give at most {MAX_NAME_BYTES}")
    return name


def address(option: str, value: str) -> str:
    """``host:port`` with a port a socket can use (1..65535)."""
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 2**16:
        raise LabError(f"{option} {value!r}: give host:port with a port 1..65535, e.g. 10.0.0.1:1234")
    return value


def _writable(option: str, path: Path) -> None:
    existing = next((p for p in (path, *path.parents) if p.exists()), Path("."))
    if not os.access(existing, os.W_OK | os.X_OK):
        raise LabError(f"{option} {str(path)!r}: {str(existing)!r} is not writable; choose a folder you can write")
