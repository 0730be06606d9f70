"""``lab predict``: this model, this batch, this layout, this many chips: how long is a step, and why.

The handler compiles the whole training step for a compile-only TPU topology
(one slice, or ``--slices K`` joined by DCN) and reads the prediction off the
compiled, scheduled program (`lab.predict.ops`); nothing runs and nothing is
allocated. It prints the step time, the model TFLOP/s per chip and MFU, the
hardware FLOPs (remat included), memory per chip against HBM, the exposed
communication per mesh axis and link, the ten most expensive ops and the
compile time; ``--json`` prints the same as one object.

FLOPs convention (MaxText's, so MFU compares with published runs): model FLOPs
per step = 6 · N' · tokens + 12 · L · H · K · S · tokens, where N' is the
parameter count without the input embedding table (a lookup, no matmul; a tied
table counts once, as the unembedding) and the attention term counts the full
S x S score matrix, not the causal half.

JAX, libtpu and the compile are imported inside the functions that need them:
libtpu must read ``LIBTPU_INIT_ARGS`` (the user's ``--libtpu-flags``) before it
starts, and the CLI imports this module before any target is chosen.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from typing import Literal

from rich.console import Console
from rich.table import Table

from lab.errors import LabError
from lab.model import check_flash_tiling
from lab.predict import calibration
from lab.predict.spec import check_step_tokens, parse_model
from lab.units import format_bytes

GiB = 2**30


@dataclass(frozen=True)
class Predict:
    """Predict one training step on a TPU pod, compile-only: step time, MFU, memory, exposed communication."""

    model: str = "llama3-8b"
    """a preset (llama2-7b, llama3-8b, llama3-70b, mistral-7b, gemma-7b, ...) or key=value pairs: layers, d_model,
    heads, kv_heads, head_dim, d_ff, vocab, mlp (swiglu|geglu|gelu|relu|silu), block (sequential|parallel),
    tied (true|false)"""
    seq: int = 8192
    """tokens per sequence"""
    batch_per_device: int = 1
    """sequences per chip per step"""
    remat: Literal["full", "minimal", "none"] = "full"
    """what the backward pass keeps: full (each block's input only), minimal (every matmul output), none"""
    mesh: str = "fsdp=-1"
    """one slice's mesh over data,stage,fsdp,expert,tensor (one axis may be -1)"""
    target: str = "tpu:v6e:16x16"
    """one slice's topology, tpu:<gen>:<topology>"""
    slices: int = 1
    """slices joined by DCN"""
    dcn_axis: str = "data"
    """the mesh axis that spans the slices"""
    libtpu_flags: str = ""
    """compiler flags as in LIBTPU_INIT_ARGS, e.g. "--xla_tpu_enable_async_collective_fusion=true" """
    attention: Literal["flash", "xla"] = "flash"
    """flash (the Pallas TPU kernel) or xla (dot product, scores materialized)"""
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    compute_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    layers_compiled: int = 0
    """0: compile every layer (or 2, read at the model's depth, when the layers' saved inputs alone exceed HBM or
    libtpu refuses the whole step); K (2 or more): compile K layers under scan and read that program at the
    model's depth, its layer loops run L/K times as often and its stacked buffers L/K times as large
    (lab.predict.depth; barely faster than the whole: the layers are one scanned body, which is what the compile
    spends its time on)"""
    json: bool = False
    """print one JSON object instead of tables"""


@dataclass(frozen=True)
class Prediction:
    """What `lab predict` reports (the --json object)."""

    model: str
    parameters: int
    layers: int
    target: str
    slices: int
    chips: int
    mesh: str
    seq: int
    batch_per_device: int
    remat: str
    attention: str
    step_s: float
    compute_s: float
    exposed_comm_s: float
    comm_s: float
    tflops_per_chip: float
    mfu: float
    model_flops_per_step: float
    hardware_flops_per_step: float
    flops_convention: str
    memory_bytes: int
    layers_compiled: int  # the model's layers when compiled whole; else fewer, read as its depth
    hbm_bytes: int
    fits: bool
    over_by_bytes: int
    advice: str
    exposed_by_link: dict[str, float]
    top_ops: list[dict]
    compile_s: float
    predict_s: float
    efficiency: dict[str, float]
    calibrated: bool


def model_flops(config, tokens: int) -> float:
    """6 · N' · tokens + 12 · L · H · K · S · tokens (see the module docstring)."""
    dense = config.parameters - (0 if config.tied else config.vocab * config.embed)
    attention = 12 * config.layers * config.heads * config.head_dim * config.seq
    return float(6 * dense * tokens + attention * tokens)


def run_prediction(command: Predict, efficiency=None):
    """Compile and predict; returns the `Prediction` (`efficiency`: the chip's calibrated constants unless given)."""
    # local: libtpu must see the flags before it starts, so nothing here imports JAX's TPU side at module level
    from lab.predict.step import DoesNotFit
    from lab.targets import libtpu
    from lab.targets.devices import check_slices, parse_target, topology_devices, topology_shape

    target = parse_target(command.target)
    if target.platform != "tpu" or not target.compile_only:
        raise LabError(
            f"--target {command.target!r}: lab predict compiles for tpu:<gen>:<topology> (e.g. tpu:v6e:16x16)"
        )
    if target.slices > 1:
        raise LabError(f"--target {command.target!r}: give one slice's topology and the count as --slices")
    check_slices("--slices", command.slices)
    if command.seq < 1:
        raise LabError(f"--seq {command.seq}: use 1 or more")
    if command.attention == "flash":
        check_flash_tiling(command.seq)
    check_step_tokens(
        command.batch_per_device, math.prod(topology_shape(target.topology)) * command.slices, command.seq
    )
    model = replace(parse_model(command.model), seq=command.seq, attention=command.attention)
    compiled_layers = _compiled_layers(command.layers_compiled, model.layers)
    libtpu.prepare(command.libtpu_flags)
    devices = topology_devices(target.topology, command.slices)
    mesh = build_mesh(command.mesh, devices, command.slices, command.dcn_axis)
    chip = _chip(devices)
    efficiency = efficiency or calibration.efficiency(chip.name)
    pipelined = dict(mesh.shape).get("stage", 1) > 1
    if compiled_layers < model.layers and pipelined:
        raise LabError(_PIPELINED)
    whole = compiled_layers == model.layers > FALLBACK_LAYERS and not pipelined
    if whole and _saved_inputs_bytes(model, command) > chip.hbm_bytes:  # libtpu would refuse the whole program
        compiled_layers = FALLBACK_LAYERS
    try:
        compiled, step, memory, predict_s = _compile(model, compiled_layers, mesh, chip, efficiency, command)
    except DoesNotFit as err:
        if compiled_layers < model.layers or model.layers <= FALLBACK_LAYERS or pipelined:
            raise LabError(f"even {compiled_layers} layer(s) of this step do not fit one chip: {err}") from None
        # the whole depth does not compile: read a shallower program as the model's depth (lab.predict.depth)
        compiled, step, memory, predict_s = _compile(model, FALLBACK_LAYERS, mesh, chip, efficiency, command)
    chips = len(devices)
    tokens = command.batch_per_device * chips * command.seq
    flops = model_flops(model, tokens)
    per_chip = flops / chips / step.step_s
    over = max(0, memory - int(chip.hbm_bytes))
    return Prediction(
        model=command.model,
        parameters=model.parameters,
        layers=model.layers,
        target=str(target),
        slices=command.slices,
        chips=chips,
        mesh=_mesh_text(mesh),
        seq=command.seq,
        batch_per_device=command.batch_per_device,
        remat=command.remat,
        attention=command.attention,
        step_s=step.step_s,
        compute_s=step.compute_s,
        exposed_comm_s=step.exposed_comm_s,
        comm_s=step.comm_s,
        tflops_per_chip=per_chip / 1e12,
        mfu=per_chip / chip.peak_bf16_flops,
        model_flops_per_step=flops,
        hardware_flops_per_step=step.matmul_flops * chips,
        flops_convention="6*N'*tokens + 12*L*H*K*S*tokens (N' without input embedding; attention not causal-halved)",
        memory_bytes=memory,
        layers_compiled=compiled.layers,
        hbm_bytes=int(chip.hbm_bytes),
        fits=over == 0,
        over_by_bytes=over,
        advice=_advice(over, command, mesh),
        exposed_by_link=step.exposed_by_link(),
        top_ops=[
            {
                "name": o.name,
                "op": o.op_name,
                "runs": o.runs,
                "seconds": o.seconds,
                "bound": o.bound,
                "flops": o.flops,
                "bytes": o.bytes,
            }
            for o in step.top_ops(10)
        ],
        compile_s=compiled.compile_s,
        predict_s=predict_s,
        efficiency=asdict(efficiency),
        calibrated=calibration.calibrated(chip.name),
    )


def _compile(model, layers: int, mesh, chip, efficiency, command: Predict):
    """Compile the step with `layers` layers and predict it at the model's depth: (Compiled, StepPrediction,
    memory bytes per chip, seconds the prediction took)."""
    # local: see run_prediction
    import time

    from lab.predict.depth import deeper
    from lab.predict.ops import read_schedule
    from lab.predict.step import compile_step

    compiled = compile_step(
        replace(model, layers=layers),
        mesh,
        command.batch_per_device,
        remat=command.remat,
        param_dtype=command.param_dtype,
        compute_dtype=command.compute_dtype,
    )
    started = time.perf_counter()
    read = read_schedule(compiled.hlo, mesh, chip)
    memory = _memory_bytes(compiled.memory)
    if layers < model.layers:
        depth = deeper(read.schedule, layers, model.layers)
        read, memory = read.read_as(depth.trips, depth.scale), depth.memory(memory)
    step = read.predict(efficiency)
    return compiled, step, memory, time.perf_counter() - started


_PIPELINED = (
    "--layers-compiled with a stage axis: the pipeline runs each stage's layers inside its loop over micro-batches, "
    "which lab.predict.depth does not read deeper; compile every layer (--layers-compiled 0)"
)
FALLBACK_LAYERS = 2  # the fewest layers whose scan XLA keeps as a loop (see `_compiled_layers`)


def _saved_inputs_bytes(model, command: Predict) -> int:
    """At least the bytes per chip of the one buffer in which the layers' scan saves each layer's input.

    Every remat policy saves a layer's input [b, S, D] for the backward pass, stacked over the L layers; a chip
    holds b = batch per device x tensor sequences, split at most tensor ways: L x batch per device x S x D at least.
    libtpu refuses a program one of whose buffers exceeds HBM, after most of a compile (two minutes for a 70B).
    """
    itemsize = {"bfloat16": 2, "float32": 4}[command.compute_dtype]
    return model.layers * command.batch_per_device * command.seq * model.embed * itemsize


def _compiled_layers(layers_compiled: int, layers: int) -> int:
    if layers_compiled < 0:
        raise LabError(f"--layers-compiled {layers_compiled}: use 0 (all layers) or a count of 2 or more")
    if layers_compiled == 1:  # XLA removes a loop of one trip: that program has no layer loop to read deeper
        raise LabError(
            "--layers-compiled 1: XLA compiles a scan over one layer without its loop, so that program is not one "
            "layer of the deep model's; use 2 or more"
        )
    if layers_compiled == 0 or layers_compiled >= layers:
        return layers
    return layers_compiled


def build_mesh(spec: str, devices, slices: int, dcn_axis: str):
    """One slice's mesh spec, `dcn_axis` multiplied by the slices (and laid across them)."""
    # local: jax's mesh utilities start no backend but pull in JAX, which the CLI imports only when needed
    import numpy as np
    from jax.experimental import mesh_utils
    from jax.sharding import AxisType, Mesh

    from lab.mesh import AXES, MeshSpec

    if dcn_axis not in AXES:
        raise LabError(f"--dcn-axis {dcn_axis!r}: use one of {', '.join(AXES)}")
    per_slice = len(devices) // slices
    one = MeshSpec.parse(spec).resolve(per_slice)
    if slices == 1:
        return one.build(devices)
    dcn = tuple(slices if a == dcn_axis else 1 for a in AXES)
    grid = mesh_utils.create_hybrid_device_mesh(one.shape, dcn, list(devices), allow_split_physical_axes=True)
    return Mesh(np.asarray(grid), AXES, axis_types=(AxisType.Explicit,) * len(AXES))


def _chip(devices):
    # local: lab.targets.hardware is light, but keeps this module's import list to what the handler needs first
    from lab.targets.hardware import profile_for_device_kind

    return profile_for_device_kind(devices[0].device_kind)


def _memory_bytes(memory: dict[str, int]) -> int:
    if memory.get("peak_memory"):
        return int(memory["peak_memory"])
    return int(
        memory.get("argument_size", 0)
        + memory.get("output_size", 0)
        + memory.get("temp_size", 0)
        - memory.get("alias_size", 0)
    )


def _mesh_text(mesh) -> str:
    used = [f"{a}={s}" for a, s in mesh.shape.items() if s > 1]
    return ",".join(used) or "single device"


def _advice(over: int, command: Predict, mesh) -> str:
    if not over:
        return ""
    ideas = []
    if command.remat != "full":
        ideas.append("--remat full")
    if command.batch_per_device > 1:
        ideas.append(f"--batch-per-device {max(1, command.batch_per_device // 2)}")
    if mesh.shape["tensor"] == 1:
        ideas.append("a tensor axis (e.g. tensor=4) to split activations and weights")
    ideas.append("more chips on fsdp (a larger topology or more slices)")
    return f"does not fit by {over / GiB:.2f} GiB per chip; try " + ", or ".join(ideas)


def predict(command: Predict) -> int:
    """The ``lab predict`` handler."""
    result = run_prediction(command)
    console = Console(width=160)
    if command.json:
        print(json.dumps(asdict(result)))
        return 0
    show(result, console)
    return 0


def show(p: Prediction, console: Console) -> None:
    """The prediction as a few lines and two tables."""
    fit = "fits" if p.fits else f"DOES NOT FIT ({p.advice})"
    lines = [
        f"{p.model} ({p.parameters / 1e9:.2f} B params), seq {p.seq}, batch {p.batch_per_device}/chip, "
        f"remat {p.remat}, attention {p.attention}",
        f"{p.target} x {p.slices} slice(s) = {p.chips} chips, mesh {p.mesh}",
        *(
            [f"compiled        {p.layers_compiled} layers, read as {p.layers} (lab.predict.depth)"]
            if p.layers_compiled < p.layers
            else []
        ),
        f"step            {p.step_s:.3f} s  (compute {p.compute_s:.3f} s + exposed communication "
        f"{p.exposed_comm_s:.3f} s of {p.comm_s:.3f} s)",
        f"model TFLOP/s   {p.tflops_per_chip:.1f} per chip, MFU {p.mfu:.1%}  [{p.flops_convention}]",
        f"FLOPs per step  model {p.model_flops_per_step:.3e}, hardware {p.hardware_flops_per_step:.3e} "
        f"({p.hardware_flops_per_step / p.model_flops_per_step:.2f}x: remat, one-hot embedding, chunked loss)",
        f"memory per chip {format_bytes(p.memory_bytes)} of {format_bytes(p.hbm_bytes)} HBM: {fit}",
        f"compile {p.compile_s:.1f} s, predict {p.predict_s:.2f} s; efficiency matmul {p.efficiency['matmul']:.3f}, "
        f"HBM {p.efficiency['hbm']:.2f}" + ("" if p.calibrated else " (v6e's: this chip has no calibration run)"),
    ]
    for line in lines:
        console.print(line, highlight=False)
    links = Table(title="exposed communication per axis and link")
    for column in ("axes on link", "exposed s"):
        links.add_column(column)
    for name, seconds in sorted(p.exposed_by_link.items(), key=lambda kv: -kv[1]):
        links.add_row(name, f"{seconds:.4f}")
    console.print(links)
    ops = Table(title="ten most expensive ops")
    for column in ("op", "runs", "seconds", "bound", "TFLOP/run", "GB/run"):
        ops.add_column(column)
    for o in p.top_ops:
        ops.add_row(
            o["op"][-70:],
            str(o["runs"]),
            f"{o['seconds']:.4f}",
            o["bound"],
            f"{o['flops'] / 1e12:.2f}",
            f"{o['bytes'] / 1e9:.2f}",
        )
    console.print(ops)
