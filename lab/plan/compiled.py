"""A layout compiled: `lab predict`'s step for the compile-only pod, priced op by op.

The same machinery as ``lab predict``: the mesh across slices by
`lab.predict.priced.build_mesh` (one slice's sizes, the DCN axis multiplied
by the slices), the whole training step by `lab.predict.step.compile_step`
(the lab's Trainer at full size, chunked loss, bf16 working weights with fp32
master weights here, as the closed form assumes) and the scheduled program
priced by `lab.predict.ops.predict_step`. The prices use the chip's
efficiency constants (`Problem.efficiency`, `lab predict`'s), as the closed
form does, so that closed form against compiled compares the two models of
the same program and not two calibrations; memory is the compiler's peak per
chip.

Two layouts `compile_step` cannot express are reported, not approximated: a
pipeline with more than one micro-batch (it compiles one), and a global
batch that is not a whole number of sequences per chip.
"""

from __future__ import annotations

import time
from collections import defaultdict

from lab.errors import LabError
from lab.mesh import AXES
from lab.plan.rank import CompiledPrediction
from lab.plan.space import Layout, Problem
from lab.predict.ops import predict_step
from lab.predict.priced import build_mesh, memory_bytes  # one reading of the compiler's peak, shared
from lab.predict.step import compile_step
from lab.targets import libtpu


def compilable(problem: Problem, layout: Layout) -> str:
    """Why `compile_step` cannot compile this layout, or ''."""
    if layout.micro_batches > 1:
        return f"{layout.micro_batches} micro-batches: lab predict's step compiles a pipeline of one micro-batch"
    if problem.sequences % problem.chips:
        return f"{problem.sequences} sequences on {problem.chips} chips: lab predict compiles whole sequences per chip"
    return ""


def compile_layout(problem: Problem, layout: Layout) -> CompiledPrediction | str:
    """Compile `layout` and read its prediction; a sentence instead when it cannot be compiled."""
    reason = compilable(problem, layout)
    if reason:
        return reason
    # local: the topology's devices start libtpu, which must first see lab predict's flags
    from lab.targets.devices import pod_devices

    libtpu.prepare()
    devices = pod_devices(problem.topology, problem.slices)
    local = {a: (n // problem.slices if a == layout.slices_axis else n) for a, n in layout.sizes.items()}
    spec = ",".join(f"{a}={local[a]}" for a in AXES)
    mesh = build_mesh(spec, devices, problem.slices, layout.slices_axis or "data")
    started = time.perf_counter()
    try:
        compiled = compile_step(
            problem.model, mesh, problem.sequences // problem.chips, remat=layout.remat, param_dtype="bfloat16"
        )
    except LabError as err:
        return str(err)
    step = predict_step(compiled.hlo, mesh, problem.chip, problem.efficiency)
    axes: dict[str, dict[str, float]] = defaultdict(lambda: {"bytes": 0.0, "seconds": 0.0, "exposed_s": 0.0})
    for c in step.comms:
        row = axes[",".join(c.axes) or "-"]
        row["bytes"] += c.bytes * c.runs
        row["seconds"] += c.seconds
        row["exposed_s"] += c.exposed_s
    return CompiledPrediction(
        step_s=step.step_s,
        compute_s=step.compute_s,
        exposed_s=step.exposed_comm_s,
        memory_bytes=memory_bytes(compiled.memory),
        axes=dict(axes),
        compile_s=time.perf_counter() - started,
    )
