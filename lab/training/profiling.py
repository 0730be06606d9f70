"""Profiles: a jax.profiler trace of a run, and where the step's time went by named scope.

`trace(folder)` records what JAX's profiler records (host threads, the
runtime, every executed HLO op on every device) and writes it twice: as
``*.xplane.pb`` for XProf/TensorBoard and as ``perfetto_trace.json.gz``,
which https://ui.perfetto.dev opens directly. The host side carries the
loop's annotations (``train`` per step with its number, and ``input``,
``step``, ``checkpoint`` inside it).

The device side names ops by their HLO instruction (``fusion.12``), not by
the Python that made them. The link is the ``op_name`` metadata XLA keeps on
every instruction: ``jit(_step)/forward_backward/.../transpose(jvp())/.../attention/...``
carries the ``jax.named_scope`` the code opened and, through the autodiff
transforms, whether it is the forward (``jvp``) or the backward (``transpose``)
pass. `scope_times` joins the two: the trace's time per op, summed by the part
of the step that op belongs to (forward/backward × attention/mlp/moe, the
gradient reduction, the optimizer, writing the weights back), with the
collectives in rows of their own, by kind. Control-flow
ops (a ``while`` over layers, a ``call``) contain other ops and are skipped,
so each microsecond is counted once.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import jax

from lab.errors import LabError
from lab.hlo import op_names

LAYER_SCOPES = ("attention", "mlp", "moe")
STEP_SCOPES = (
    "reduce_gradients",
    "optimizer",
    "write_back",
)  # checked before forward/backward: they nest inside forward_backward
CONTAINERS = ("while", "call", "conditional")  # their time is their children's
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


@contextlib.contextmanager
def trace(folder: Path | None) -> Iterator[Path | None]:
    """Profile the body into `folder` (nothing when None); yields the folder this trace's files went to."""
    if folder is None:
        yield None
        return

    folder = Path(folder)
    before = set(folder.glob("plugins/profile/*"))
    with jax.profiler.trace(folder, create_perfetto_trace=True):
        yield folder
    # the profiler names each session's folder by its start time; report the one this trace added
    added = sorted(set(folder.glob("plugins/profile/*")) - before)
    if not added:
        raise LabError(f"the profiler wrote no trace under {str(folder)!r}; check that the folder is writable")


def latest_session(folder: Path) -> Path:
    """The newest ``plugins/profile/<time>/`` folder under a trace folder."""
    sessions = sorted(Path(folder).glob("plugins/profile/*"))
    if not sessions:
        raise LabError(f"no jax.profiler trace under {str(folder)!r}; run with --profile {folder} first")
    return sessions[-1]


def scope_of(op_name: str) -> str:
    """The part of a training step an HLO op belongs to, from its op_name metadata."""
    parts = op_name.split("/")
    for scope in STEP_SCOPES:
        if scope in parts:
            return scope
    if "forward_backward" not in parts:
        return "other"
    direction = "backward" if any(p.startswith("transpose(") for p in parts) else "forward"
    layer = next((p for p in parts if p in LAYER_SCOPES), "embed/loss")
    return f"{direction} {layer}"


def op_scopes(hlo_text: str) -> dict[str, str]:
    """HLO instruction name -> step part, for every instruction that is not control flow.

    Collectives get their own rows (``communication: all-gather``): XLA moves and combines them, so the
    scope in their metadata (often the backward matmul a gradient reduce-scatter was split off) says less
    than their kind does."""

    return {
        name: _part(opcode, op_name)
        for name, (opcode, op_name) in op_names(hlo_text).items()
        if opcode not in CONTAINERS
    }


def _part(opcode: str, op_name: str) -> str:
    kind = opcode.removesuffix("-start").removesuffix("-done")
    return f"communication: {kind}" if kind in COLLECTIVES else scope_of(op_name)


def scope_times(session: Path, hlo_text: str, module: str | None = None) -> dict[str, float]:
    """Device seconds per step part in a trace session (summed over devices and steps).

    `module` keeps only ops of that HLO module (e.g. ``jit__step``); None keeps every module's ops
    whose names the HLO knows.
    """

    scopes, seconds = op_scopes(hlo_text), defaultdict(float)
    for path in Path(session).glob("*.xplane.pb"):
        for plane in jax.profiler.ProfileData.from_file(str(path)).planes:
            for line in plane.lines:
                for event in line.events:
                    stats = dict(event.stats)
                    op, owner = stats.get("hlo_op"), stats.get("hlo_module")
                    if op in scopes and (module is None or owner == module) and op == event.name:
                        seconds[scopes[op]] += event.duration_ns / 1e9
    return dict(sorted(seconds.items(), key=lambda item: -item[1]))
