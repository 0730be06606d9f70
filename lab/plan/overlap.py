"""Whether libtpu overlaps a layer's FSDP collectives with its compute: asked of libtpu, not assumed.

On TPU the compiler decides, per generation and per flags, whether a weight's all-gather, and its gradient's
reduce-scatter, becomes an asynchronous collective that the layer's compute hides, or a synchronous one the step
waits for. With libtpu 0.0.42's defaults the gathers are asynchronous on v5e and TPU7x, synchronous on v4, v5p and
v6e; MaxText's recipes pass its collective-fusion flags (`lab.predict.calibration.CF_FOR_ALL_GATHER`), under which
every generation overlaps them, and which single flag does it differs by generation. The reduce-scatters are
another matter: on TPU7x asynchronous, elsewhere libtpu's synchronous ``%all-reduce-scatter`` fusions, with or
without those flags (a 70B on v6e-256 at data=2, fsdp=128 waits 0.5 s a step for them). A rule written down would
be one libtpu release's, so `overlaps` asks libtpu instead: it compiles `lab predict`'s training step of a
two-layer model (d_model 256, sequences of 256) over an eight-device slice of the generation at data=2 and fsdp
over the rest (over a whole slice libtpu all-reduces every gradient instead), with the flags this process gave
libtpu (`lab.targets.libtpu.prepare`), and reads from the schedule (`lab.hlo.schedule.overlap_report`) whether any
weight's all-gather, and any gradient's reduce-scatter, runs asynchronously. Five seconds or so, once per
generation in a process.

The training step, the mesh and the topology are imported inside `overlaps`: the topology starts libtpu, which
must first have read the process's flags, and the step imports flax and optax, which a closed-form plan on GPU
never needs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from lab.hlo.schedule import overlap_report
from lab.model import ModelConfig
from lab.targets.hardware import profile

KINDS = ("all-gather", "reduce-scatter")
PROBE = ModelConfig(vocab=1024, embed=256, heads=8, head_dim=32, mlp=1024, layers=2, seq=256, attention="xla")


@dataclass(frozen=True)
class Overlap:
    """Which of a layer's FSDP collectives the compiler runs asynchronously, behind the layer's compute."""

    gathers: bool = True  # the weights' all-gathers
    scatters: bool = True  # the gradients' reduce-scatters


@functools.cache
def overlaps(generation: str) -> Overlap:
    """What libtpu, with this process's flags, runs asynchronously of FSDP's collectives on `generation`."""
    from lab.predict.priced import build_mesh
    from lab.predict.step import compile_step
    from lab.targets.devices import topology_devices

    chip = profile(generation)
    torus = "2x4" if chip.torus_dims == 2 else "2x2x2" if chip.devices_per_chip == 1 else "2x2x1"
    devices = topology_devices(f"{generation}:{torus}")
    mesh = build_mesh(f"data=2,fsdp={len(devices) // 2}", devices, 1, "data")
    hlo = compile_step(PROBE, mesh, 1, param_dtype="bfloat16").hlo
    windows = overlap_report(hlo, chip).windows
    gathers, scatters = (any(w.is_async for w in windows if w.collective.kind == k) for k in KINDS)
    return Overlap(gathers, scatters)
