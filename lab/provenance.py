"""Where a page's numbers come from: versions, machine, commit, the command as typed, and the code that made them.

Every page carries its provenance. Two of its fields make a page checkable:

* ``command`` is the command as the user typed it (``lab report``,
  ``lab run ring_allreduce --size 4M``), never a path on the machine that ran;
* ``code_hash`` is a hash of the source that produced the page: the
  experiment's module and every module of the lab and of the experiments
  package it imports, transitively (read with `ast`, not by importing). A
  page whose hash differs from the code's hash is stale; `stale` says so and
  ``lab report --stale`` regenerates exactly those pages.
"""

from __future__ import annotations

import ast
import datetime as _dt
import functools
import hashlib
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]  # the folder holding lab/ and experiments/
PACKAGES = ("lab", "experiments")


@dataclass(frozen=True)
class Setup:
    """Where a measurement ran: the target as typed, its devices (``"8 x cpu"``) and the mesh (``"fsdp=8"``)."""

    target: str
    devices: str = ""
    mesh: str = ""

    @classmethod
    def of(cls, target: str, devices: Sequence = (), mesh: str = "") -> Setup:
        return cls(target, describe_devices(devices), mesh)


def provenance(*, target: str, devices: str = "", mesh: str = "", module: str | None = None) -> dict[str, Any]:
    """The provenance block of a page produced by `module` (a dotted name) on `target`."""
    return {
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "command": command(),
        "git_commit": _git_commit(),
        "code_hash": code_hash(module) if module else "",
        "target": target,
        "devices": devices,
        "mesh": mesh,
        "python": platform.python_version(),
        "machine": f"{platform.machine()}, {_cpu_count()} cores",
        **{package: _version(package) for package in ("jax", "jaxlib", "libtpu", "flax", "optax")},
    }


def describe_devices(devices) -> str:
    """``"8 x cpu"``: how many devices of which kinds."""
    kinds = sorted({getattr(d, "device_kind", "?") for d in devices})
    return f"{len(devices)} x {', '.join(kinds)}" if devices else ""


def command(argv: list[str] | None = None) -> str:
    """The command as the user typed it: ``lab report``, whether through the script or ``python -m lab``.

    Never a path on this machine: a program other than the lab is named by its file name alone.
    """
    program, *args = argv if argv is not None else sys.argv
    path = Path(program)
    if path.name == "lab" or (path.name == "__main__.py" and path.parent.name == "lab"):
        return shlex.join(["lab", *args])
    if path.name == "__main__.py":  # python -m package
        return shlex.join(["python", "-m", path.parent.name, *args])
    return shlex.join([path.name, *args])


def code_hash(module: str) -> str:
    """A short hash of `module`'s source and of every lab/experiments module it imports, transitively."""
    digest = hashlib.sha256()
    for name in sorted(sources(module)):
        digest.update(name.encode() + b"\0" + _path(name).read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def sources(module: str) -> set[str]:
    """`module` and the lab and experiments modules it imports, transitively (function-local imports included)."""
    seen, todo = set(), [module]
    while todo:
        name = todo.pop()
        if name in seen or not _path(name).exists():
            continue
        seen.add(name)
        todo.extend(_imports(name))
    return seen


@functools.cache
def _imports(module: str) -> tuple[str, ...]:
    """The lab/experiments modules `module` imports (a package's re-exporting __init__ only when imported by name)."""
    path = _path(module)
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(node.module)
            found += [f"{node.module}.{alias.name}" for alias in node.names]
    return tuple(
        name for name in found if name.split(".")[0] in PACKAGES and name not in PACKAGES and _path(name).exists()
    )


def _path(module: str) -> Path:
    base = ROOT.joinpath(*module.split("."))
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


def _git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5, cwd=ROOT, check=False
        )
        # the pages a running report has already rewritten do not make the code dirty
        code_only = ["--", ":/", ":(top,exclude)results"]
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", *code_only],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=ROOT,
            check=False,
        )
        return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "") if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def _cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
