"""Whether libtpu overlaps a layer's FSDP gathers with its compute: asked of libtpu, not assumed.

On TPU the compiler decides, per generation and per flags, whether a weight's all-gather becomes an asynchronous
collective that the layer's compute hides, or a synchronous one the step waits for. With libtpu 0.0.42's defaults
they are asynchronous on v5e and TPU7x, synchronous on v4, v5p and v6e; MaxText's recipes pass its
collective-fusion flags (`lab.predict.calibration.CF_FOR_ALL_GATHER`), under which every generation overlaps them,
and which single flag does it differs by generation. A rule written down would be one libtpu release's, so
`overlaps` asks libtpu instead: it compiles `lab predict`'s training step of a two-layer model (d_model 256,
sequences of 256) over a four-chip slice of the generation, split over fsdp, with the flags this process gave
libtpu (`lab.targets.libtpu.prepare`), and reads whether the schedule runs any weight's all-gather asynchronously
(`lab.hlo.schedule.overlap_report`). Three to five seconds, once per generation in a process.

The training step, the mesh and the topology are imported inside `overlaps`: the topology starts libtpu, which
must first have read the process's flags, and the step imports flax and optax, which a closed-form plan on GPU
never needs.
"""

from __future__ import annotations

import functools

from lab.hlo.schedule import overlap_report
from lab.model import ModelConfig
from lab.targets.hardware import profile

PROBE = ModelConfig(vocab=1024, embed=256, heads=8, head_dim=32, mlp=1024, layers=2, seq=256, attention="xla")


@functools.cache
def overlaps(generation: str) -> bool:
    """Whether libtpu, with this process's flags, runs an FSDP gather on `generation` asynchronously."""
    from lab.predict.command import build_mesh
    from lab.predict.step import compile_step
    from lab.targets.devices import topology_devices

    chip = profile(generation)
    devices = topology_devices(f"{generation}:" + "x".join("221"[: chip.torus_dims]))
    mesh = build_mesh(f"fsdp={len(devices)}", devices, 1, "data")
    hlo = compile_step(PROBE, mesh, 1, param_dtype="bfloat16").hlo
    return any(w.is_async for w in overlap_report(hlo, chip).windows if w.collective.kind == "all-gather")
