"""The folder ``XLA_FLAGS=--xla_dump_to=DIR`` writes: which files are the optimized modules, and what else it says.

XLA names every file of a dump ``module_<id>.<module name>.<what>``; the
optimized HLO of one compiled module is the text file whose ``<what>`` ends in
``after_optimizations.txt``, with the backend before it on CPU and GPU::

    module_0003.jit_train_step.cpu_after_optimizations.txt
    module_0007.jit_train_step.sm_9.0_gpu_after_optimizations.txt
    module_0002.jit_step.cl_933746096.after_optimizations.txt     (TPU: the compiler's build)

Beside it the same prefix may carry ``-buffer-assignment.txt`` and
``-memory-usage-report.txt`` (whose ``Total bytes:`` line is the device memory
the module's buffers take) and a ``module_<id>.<name>/compile_options.textproto``
holding the module's device assignment (the physical device id of each
partition, in partition order). A dump of a whole program holds many modules:
the step, its initializer, small jitted helpers; `find_modules` lists them
and `pick` chooses one, by default the largest (most instruction lines),
which in a training program is the step.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from lab.errors import LabError

_OPTIMIZED = re.compile(
    r"^module_(?P<id>\d+)\.(?P<name>.+?)(?:\.cl_\d+)?\.(?:(?P<backend>[\w.]+?)_)?after_optimizations\.txt$"
)
_TOTAL_BYTES = re.compile(r"^Total bytes:\s*(\d+)", re.MULTILINE)
_DEVICE_IDS = re.compile(r"replica_device_ids:\s*(\d+)")
MAX_MODULES = 10_000  # a folder with more optimized modules than this is not one program's dump


@dataclass(frozen=True)
class DumpedModule:
    """One optimized module of a dump folder."""

    id: str  # XLA's module number, as written ("0003")
    name: str  # the module's name (jit_train_step)
    backend: str  # "cpu", "sm_9.0_gpu", "" (TPU writes none)
    path: Path
    lines: int  # lines of optimized HLO: the size `pick` compares

    @property
    def prefix(self) -> Path:
        """``module_<id>.<name>``: what every file of this module starts with."""
        return self.path.with_name(f"module_{self.id}.{self.name}")

    def memory_bytes(self) -> int | None:
        """Device memory of its buffers, from the memory-usage report XLA wrote beside it (None if absent)."""
        for report in self.path.parent.glob(f"{self.prefix.name}.*memory-usage-report.txt"):
            total = _TOTAL_BYTES.search(report.read_text(errors="replace"))
            if total:
                return int(total[1])
        return None

    def device_assignment(self) -> tuple[int, ...] | None:
        """The physical device id of each partition, from ``compile_options.textproto`` (None if absent)."""
        options = self.prefix / "compile_options.textproto"
        if not options.is_file():
            return None
        text = options.read_text(errors="replace")
        block = text[text.find("device_assignment") :] if "device_assignment" in text else ""
        ids = tuple(int(i) for i in _DEVICE_IDS.findall(block))
        return ids or None


def find_modules(folder: Path) -> tuple[DumpedModule, ...]:
    """Every optimized module in a dump folder, by module id."""
    if not folder.exists():
        raise LabError(f"--dump {folder}: no such folder; give the folder XLA_FLAGS=--xla_dump_to=DIR wrote")
    if not folder.is_dir():
        raise LabError(f"--dump {folder} is a file; give the folder (use --hlo FILE to read one HLO file)")
    found = []
    for path in folder.iterdir():
        match = _OPTIMIZED.match(path.name)
        if match and path.is_file():
            found.append((match, path))
            if len(found) > MAX_MODULES:
                raise LabError(
                    f"--dump {folder} holds over {MAX_MODULES} optimized modules; dump one program at a time"
                )
    if not found:
        hint = (
            " (it holds only binary protos: add --xla_dump_hlo_as_text to XLA_FLAGS)"
            if any(folder.glob("*.pb"))
            else " (XLA writes module_<id>.<name>.*after_optimizations.txt there when XLA_FLAGS has --xla_dump_to)"
        )
        raise LabError(f"--dump {folder} holds no optimized HLO module{hint}")
    return tuple(
        sorted(
            (DumpedModule(m["id"], m["name"], m["backend"] or "", p, _count_lines(p)) for m, p in found),
            key=lambda module: module.id,
        )
    )


def pick(modules: tuple[DumpedModule, ...], wanted: str | None = None) -> DumpedModule:
    """The module named `wanted` (its name, id or file name), or the largest when None."""
    if wanted is None:
        return max(modules, key=lambda m: (m.lines, m.id))
    matches = [m for m in modules if wanted in (m.name, m.id, m.id.lstrip("0") or "0", m.path.name)]
    if not matches:
        names = ", ".join(f"{m.id}:{m.name}" for m in modules[:12]) + (" ..." if len(modules) > 12 else "")
        raise LabError(f"--module {wanted!r} is not in the dump; its modules are {names}")
    if len(matches) > 1:
        ids = ", ".join(m.id for m in matches)
        raise LabError(f"--module {wanted!r} matches {len(matches)} modules (ids {ids}); give the id instead")
    return matches[0]


def _count_lines(path: Path) -> int:
    with path.open("rb") as handle:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: handle.read(1 << 20), b""))
