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
and `pick` chooses one. By default it takes the module that spans the most
partitions (``num_partitions=`` in its header; XLA omits it when it is 1),
then the one with the most collectives, then the longest: a helper compiled
for one device can be the longest file of a dump (a multi-slice program's
``jit__multi_slice``), but a training step is the program that runs on every
device and communicates. `DumpedModule.why` says which rule decided.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from lab.collectives import KINDS
from lab.errors import LabError

_OPTIMIZED = re.compile(
    r"^module_(?P<id>\d+)\.(?P<name>.+?)(?:\.cl_\d+)?\.(?:(?P<backend>[\w.]+?)_)?after_optimizations\.txt$"
)
_TOTAL_BYTES = re.compile(r"^Total bytes:\s*(\d+)", re.MULTILINE)
_DEVICE_IDS = re.compile(r"replica_device_ids:\s*(\d+)")
_PARTITIONS = re.compile(rb"\bnum_partitions=(\d+)")
_COLLECTIVE = re.compile(  # an instruction of one of the kinds; an async pair is counted at its -start
    rb"\s(?:" + b"|".join(kind.encode() for kind in (*KINDS, "ragged-all-to-all")) + rb")(?:-start)?\("
)
# what only a module before SPMD partitioning holds: GSPMD's sharding custom calls and shard_map's boundaries, or
# Shardy's mesh and shardings (XLA writes them into the module's frontend attributes until the partitioner runs)
_UNPARTITIONED = re.compile(
    r'custom_call_target="(?:Sharding|SPMDFullToShardShape|SPMDShardToFullShape)"|\bxla\.sdy\.(?:meshes|sharding)\b'
)
MAX_MODULES = 10_000  # a folder with more optimized modules than this is not one program's dump


@dataclass(frozen=True)
class DumpedModule:
    """One optimized module of a dump folder."""

    id: str  # XLA's module number, as written ("0003")
    name: str  # the module's name (jit_train_step)
    backend: str  # "cpu", "sm_9.0_gpu", "" (TPU writes none)
    path: Path
    lines: int  # lines of optimized HLO
    partitions: int  # num_partitions of its header (1 when XLA wrote none)
    collectives: int  # collective instructions (an async pair counted once)

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
            (DumpedModule(m["id"], m["name"], m["backend"] or "", p, *_scan(p)) for m, p in found),
            key=lambda module: module.id,
        )
    )


def _rank(module: DumpedModule) -> tuple:
    return (module.partitions, module.collectives, module.lines, module.id)


def pick(modules: tuple[DumpedModule, ...], wanted: str | None = None) -> DumpedModule:
    """The module named `wanted` (its name, id or file name), or when None the one that spans the most partitions,
    then has the most collectives, then the most lines."""
    if wanted is None:
        return max(modules, key=_rank)
    matches = [m for m in modules if wanted in (m.name, m.id, m.id.lstrip("0") or "0", m.path.name)]
    if not matches:
        names = ", ".join(f"{m.id}:{m.name}" for m in modules[:12]) + (" ..." if len(modules) > 12 else "")
        raise LabError(f"--module {wanted!r} is not in the dump; its modules are {names}")
    if len(matches) > 1:
        ids = ", ".join(m.id for m in matches)
        raise LabError(f"--module {wanted!r} matches {len(matches)} modules (ids {ids}); give the id instead")
    return matches[0]


def why(chosen: DumpedModule, modules: tuple[DumpedModule, ...]) -> str:
    """Which rule of `pick` set `chosen` apart from the runner-up, in words."""
    others = [m for m in modules if m is not chosen]
    if not others:
        return "the only optimized module"
    second = max(others, key=_rank)
    for field, words in (("partitions", "partitions"), ("collectives", "collectives"), ("lines", "HLO lines")):
        if getattr(chosen, field) != getattr(second, field):
            mine, theirs = getattr(chosen, field), getattr(second, field)
            return f"the most {words} ({mine:,}; next {second.id}:{second.name} with {theirs:,})"
    return f"ties {second.id}:{second.name} on partitions, collectives and lines; the later id"


def _scan(path: Path) -> tuple[int, int, int]:
    """(lines, partitions, collectives) of one module's text, read once line by line."""
    lines, partitions, collectives = 0, 1, 0
    with path.open("rb") as handle:
        for lines, line in enumerate(handle, 1):
            header = _PARTITIONS.search(line) if lines == 1 else None  # the HloModule line
            partitions = int(header[1]) if header else partitions
            collectives += bool(_COLLECTIVE.search(line))
    return lines, partitions, collectives


def refuse_unpartitioned(path: Path, text: str) -> None:
    """Refuse a module from before XLA's optimizations: its shardings are still annotations, not collectives."""
    marker = _UNPARTITIONED.search(text)
    if marker:
        optimized = path.name.replace("before_optimizations", "after_optimizations")
        beside = f" ({optimized} beside it)" if optimized != path.name else ""
        raise LabError(
            f"{path} is a module before XLA's optimizations ({marker[0]!r}: its shardings are annotations, no "
            f"collective is placed yet); give the *after_optimizations.txt file of the same dump{beside}"
        )
