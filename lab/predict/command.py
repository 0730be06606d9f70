"""``lab predict``: this model, this batch, this layout, this many chips: how long is a step, and why.

The handler compiles the whole training step for a compile-only TPU topology
(one slice, or ``--slices K`` joined by DCN) or a compile-only NVIDIA cluster
(``gpu:h100:32x8``: XLA:GPU through the CUDA plugin, no GPU needed; NVLink
inside a node, InfiniBand across) and reads the prediction off the compiled,
scheduled program (`lab.predict.ops`); nothing runs and nothing is allocated.
It prints the step time, the model TFLOP/s per chip and MFU, the hardware
FLOPs (remat included), memory per chip against HBM, the exposed communication
per mesh axis and link, the ten most expensive ops and the compile time;
``--json`` prints the same as one object. What any prediction shares (the
target, the mesh, the pricing of a compiled step) is `lab.predict.priced`;
``--fn``, the user's own step in place of the lab's model, is
`lab.predict.program`.

On GPU the lab's attention is XLA's dot product (the flash kernel it compiles
is Pallas's TPU kernel), where published GPU runs use cuDNN's flash attention.
That difference is priced, not hidden: the seconds of the ops on an
[.., S, S] array (`lab.predict.ops.score_ops`) beside a flash kernel's
estimate at the same matmul efficiency (`lab.predict.attention`), and the step with
the one replaced by the other.

FLOPs convention (MaxText's, so MFU compares with published runs): model FLOPs
per step = 6 · N' · tokens + 12 · L · H · K · S · tokens, where N' is the
parameter count a token uses (an MoE's router and its k experts, not all E),
without the input embedding table (a lookup, no matmul; a tied table counts
once, as the unembedding) and the attention term counts the full S x S score
matrix, not the causal half.

JAX, libtpu and the compile are imported inside the functions that need them:
libtpu must read ``LIBTPU_INIT_ARGS`` (the user's ``--libtpu-flags``) before it
starts, and the CLI imports this module before any target is chosen.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

from lab.errors import LabError
from lab.model import check_flash_tiling
from lab.predict import calibration
from lab.predict.display import emit, show
from lab.predict.options import (
    check_dropless,
    check_experts,
    check_pipelined_layers,
    check_precision,
    check_program_options,
    compiled_layers_for,
    pipelined_layers,
    resolve_attention,
)
from lab.predict.priced import (
    PricedStep,
    Reading,
    build_mesh,
    checked_target,
    memory_bytes,
    more_chips,
    price_step,
    target_devices,
)
from lab.predict.spec import check_step_tokens, model_flops, parse_model

GiB = 2**30


@dataclass(frozen=True)
class Predict:
    """Predict one training step on a TPU pod or a GPU cluster, compile-only: step time, MFU, memory, exposed
    communication."""

    model: str = "llama3-8b"
    """a preset (llama3-8b, llama3-70b, mistral-7b, gemma-7b, mixtral-8x7b, qwen3-30b-a3b, ...), key=value pairs
    (layers, d_model, heads, kv_heads, head_dim, d_ff, vocab, mlp (swiglu|geglu|gelu|relu|silu), block
    (sequential|parallel), tied, qk_norm (true|false); an MoE: experts, top_k, capacity (a factor, default 1.25;
    none: a buffer of the whole sequence per expert; dropless: MaxText's sparse_matmul, tokens sorted by
    expert, megablox's grouped matmul, TPU only, no expert axis)), or a preset then pairs that change it
    (mixtral-8x7b,capacity=2)"""
    seq: int = 8192
    """tokens per sequence"""
    batch_per_device: int = 1
    """sequences per chip per step"""
    remat: str = "full"
    """what the backward pass keeps: full (each block's input only), minimal (every weight matmul's output, as
    MaxText's), minimal_flash (those and the attention's output), none, or MaxText's custom policy,
    custom:<name>=<device|offload|remat>,... (each named activation kept in HBM, sent to host memory or
    recomputed; the rest recomputed) or offload:<names> (these to host memory); names from
    decoder_layer_input, context, query_proj, key_proj, value_proj, qkv_proj, out_proj, mlpwi, mlpwi_0, mlpwi_1,
    mlpwo"""
    mesh: str = "fsdp=-1"
    """one slice's (or the whole GPU cluster's) mesh over data,stage,fsdp,expert,tensor (one axis may be -1)"""
    target: str = "tpu:v6e:16x16"
    """one slice's topology, tpu:<gen>:<topology>, or a GPU cluster, gpu:<chip>:<nodes>x<gpus per node>"""
    slices: int = 1
    """TPU slices joined by DCN (a GPU cluster's nodes are in its target)"""
    dcn_axis: str = "data"
    """the mesh axis that spans the slices"""
    libtpu_flags: str = ""
    """TPU compiler flags as in LIBTPU_INIT_ARGS, e.g. "--xla_tpu_enable_async_collective_fusion=true" """
    xla_flags: str = ""
    """GPU compiler flags as in XLA_FLAGS, e.g. "--xla_gpu_enable_latency_hiding_scheduler=true" (a recipe's)"""
    attention: Literal["auto", "flash", "xla"] = "auto"
    """flash (the Pallas TPU kernel, TPU only) or xla (dot product, scores materialized); auto: flash on TPU, xla
    on GPU"""
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    compute_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    matmul_precision: Literal["bf16", "int8", "fp8"] = "bf16"
    """the precision the step's matmuls run at: bf16 as compiled, or int8 / fp8 (a quantized run, AQT-style),
    priced at the chip's int8 / fp8 peak; the program compiled stays bf16 (its quantize and dequantize ops
    and its narrower weights are not in it) and the flash attention kernel stays at bf16"""
    sequence_parallel: bool = False
    """split the residual stream between sub-layers along the sequence over the tensor axis (Megatron SP: an
    all-gather before and a reduce-scatter after each sub-layer in place of its all-reduce)"""
    layers_compiled: int = 0
    """0: compile every layer (or 2, read at the model's depth, when the layers' saved inputs alone exceed HBM or
    libtpu refuses the whole step); K (2 or more): compile K layers under scan and read that program at the
    model's depth, its layer loops run L/K times as often and its stacked buffers L/K times as large (K periods
    of an interleaved MoE's layers; a dense prefix compiled whole; with a stage axis of P, a multiple of P, K/P
    neither 1 nor P) (lab.predict.depth; barely faster than the whole: the layers are one scanned body, which is
    what the compile spends its time on)"""
    fn: str | None = None
    """your own step in place of the lab's model: FILE.py:NAME or package.module:NAME, where NAME(mesh) returns
    (fn, args) as for lab inspect --fn (args abstract, so nothing is allocated); compiled as written over --mesh on
    --target and priced op by op as the lab's model is (lab.predict.program)"""
    model_flops: float = 0.0
    """with --fn: the model FLOPs of one whole step as you count them (e.g. 6 x parameters x tokens), for the MFU;
    0: the compiled matmuls' FLOPs and their utilisation only"""
    axis_types: Literal["auto", "explicit"] = "auto"
    """with --fn: the mesh's axis types (auto, as jax.sharding.Mesh makes by default; explicit for sharding in types)"""
    timeout: float = 600.0
    """with --fn: seconds your program may take to import, build and trace (one line past it; 0: no bound)"""
    json: bool = False
    """print one JSON object instead of tables"""


@dataclass(frozen=True, kw_only=True)
class Prediction(PricedStep):
    """What `lab predict` reports of the lab's model (the --json object)."""

    model: str
    parameters: int
    layers: int
    sequence_parallel: bool
    seq: int
    batch_per_device: int
    remat: str
    attention: str
    tflops_per_chip: float
    mfu: float
    model_flops_per_step: float
    flops_convention: str
    layers_compiled: int  # the model's layers when compiled whole; else fewer, read as its depth
    attention_xla_s: float  # with --attention xla: the step's seconds in ops on an [.., S, S] array (else 0)
    attention_flash_s: float  # ... and a flash kernel's estimate for the same attention (`lab.predict.attention`)

    @property
    def step_with_flash_s(self) -> float:
        """The step with XLA's attention priced as a flash kernel instead (the same step when flash was compiled)."""
        return self.step_s - self.attention_xla_s + self.attention_flash_s


def run_prediction(command: Predict, efficiency=None):
    """Compile and predict; returns the `Prediction` (`efficiency`: the chip's calibrated constants unless given)."""
    return price(read_step(command), efficiency)


def read_step(command: Predict) -> Reading:
    """Check the command, compile its step (or fewer layers, see `Predict.layers_compiled`) and read it at depth."""
    # local: libtpu must see the flags before it starts, so nothing here imports JAX's TPU side at module level
    from lab.predict.step import DoesNotFit, layout_remat, offloads

    check_program_options(command, Predict)
    command, target = checked_target(command)
    on_gpu = target.platform == "gpu"
    attention = resolve_attention(command.attention, on_gpu)
    if command.seq < 1:
        raise LabError(f"--seq {command.seq}: use 1 or more")
    if attention == "flash":
        check_flash_tiling(command.seq)
    check_step_tokens(command.batch_per_device, _chips(target, command.slices), command.seq)
    layout_remat(command.remat)  # a policy name it does not know stops here, before libtpu starts
    check_precision(command.matmul_precision, _profile(target))  # as is a precision
    model = replace(parse_model(command.model), seq=command.seq, attention=attention)
    check_dropless(model, on_gpu)
    scan = model.scan_length  # what depth reading counts: the layers' scan, not a dense prefix before it
    compiled_layers = compiled_layers_for(command.layers_compiled, scan)
    devices = target_devices(command, target)
    mesh = build_mesh(command.mesh, devices, command.slices, command.dcn_axis)
    check_experts(model, mesh.shape["expert"])
    chip = _chip(devices)
    stages = dict(mesh.shape).get("stage", 1)
    fallback = FALLBACK_LAYERS if stages == 1 else pipelined_layers(stages)
    if compiled_layers < scan and stages > 1:
        check_pipelined_layers(compiled_layers, stages)
    offloaded = offloads(command.remat)
    if compiled_layers < scan and offloaded:
        raise LabError(_OFFLOADED)
    whole = compiled_layers == scan > fallback and not offloaded
    if whole and _saved_inputs_bytes(model, command) > chip.hbm_bytes:  # libtpu would refuse the whole program
        compiled_layers = fallback
    try:
        compiled, read, memory, read_s = _compile(model, compiled_layers, mesh, chip, command)
    except DoesNotFit as err:
        if compiled_layers < scan or scan <= fallback or offloaded:
            raise LabError(f"even {compiled_layers} layer(s) of this step do not fit one chip: {err}") from None
        # the whole depth does not compile: read a shallower program as the model's depth (lab.predict.depth)
        compiled, read, memory, read_s = _compile(model, fallback, mesh, chip, command)
    return Reading(command, model, target, mesh, chip, compiled, read, memory, read_s)


def price(reading: Reading, efficiency=None) -> Prediction:
    """The step of `reading` priced op by op at `efficiency` (the chip's calibrated constants unless given)."""
    # local: see read_step
    from lab.predict.attention import attention_terms

    command, model, chip = reading.command, reading.model, reading.chip
    efficiency = efficiency or calibration.efficiency(chip.name)
    step, priced = price_step(reading, efficiency, lambda over: _advice(over, command, reading.mesh))
    attention_s = attention_terms(reading.read, step, model, command.batch_per_device, command.remat, chip, efficiency)
    tokens = command.batch_per_device * priced["chips"] * command.seq
    flops = model_flops(model, tokens)
    per_chip = flops / priced["chips"] / step.step_s
    return Prediction(
        **priced,
        model=command.model,
        parameters=model.parameters,
        layers=model.layers,
        sequence_parallel=command.sequence_parallel,
        seq=command.seq,
        batch_per_device=command.batch_per_device,
        remat=command.remat,
        attention=model.attention,
        tflops_per_chip=per_chip / 1e12,
        mfu=per_chip / chip.peak_bf16_flops,
        model_flops_per_step=flops,
        flops_convention=(
            "6*N'*tokens + 12*L*H*K*S*tokens (N': active, without input embedding; attention not causal-halved)"
        ),
        layers_compiled=reading.compiled.layers,
        attention_xla_s=attention_s[0],
        attention_flash_s=attention_s[1],
    )


def _chips(target, slices: int) -> int:
    """The devices of `target` (times `slices` for a TPU slice), counted without starting a backend."""
    # local: see run_prediction
    from lab.targets.devices import topology_shape
    from lab.targets.gpu import parse_cluster

    if target.platform == "gpu":
        _, nodes, per_node = parse_cluster(str(target))
        return nodes * per_node
    return math.prod(topology_shape(target.topology)) * slices * _profile(target).devices_per_chip


def _profile(target):
    """The chip profile a compile-only target names (tpu:<gen>:..., gpu:<chip>:...), without starting a backend."""
    from lab.targets.hardware import profile

    return profile(target.topology.partition(":")[0])


def _compile(model, scan: int, mesh, chip, command: Predict):
    """Compile the step with its layers' scan `scan` long and read it at the model's depth: (Compiled,
    ReadSchedule, memory bytes per chip, seconds the reading took)."""
    # local: see read_step
    import time

    from lab.predict.depth import deeper
    from lab.predict.ops import read_schedule
    from lab.predict.step import compile_step

    compiled = compile_step(
        model.with_scan_length(scan),
        mesh,
        command.batch_per_device,
        remat=command.remat,
        param_dtype=command.param_dtype,
        compute_dtype=command.compute_dtype,
        sequence_parallel=command.sequence_parallel,
    )
    started = time.perf_counter()
    read = read_schedule(compiled.hlo, mesh, chip)
    memory = memory_bytes(compiled.memory)
    if scan < model.scan_length:
        depth = deeper(read.schedule, scan, model.scan_length)
        read, memory = read.read_as(depth.trips, depth.scale), depth.memory(memory)
    return compiled, read, memory, time.perf_counter() - started


_OFFLOADED = (
    "--layers-compiled with an offloading remat: XLA unrolls or peels the layer loops that move activations to "
    "host memory, so fewer layers cannot be read as the model's depth; compile every layer (--layers-compiled 0)"
)
FALLBACK_LAYERS = 2  # the fewest layers whose scan XLA keeps as a loop (see `compiled_layers_for`)


def _saved_inputs_bytes(model, command: Predict) -> int:
    """At least the bytes per chip of the one buffer in which the layers' scan saves each layer's input.

    Every remat policy saves a layer's input [b, S, D] for the backward pass, stacked over the L layers; a chip
    holds b = batch per device x tensor sequences, split at most tensor ways: L x batch per device x S x D at least.
    libtpu refuses a program one of whose buffers exceeds HBM, after most of a compile (two minutes for a 70B).
    """
    itemsize = {"bfloat16": 2, "float32": 4}[command.compute_dtype]
    return model.layers * command.batch_per_device * command.seq * model.embed * itemsize


def _chip(devices):
    # local: lab.targets.hardware is light, but keeps this module's import list to what the handler needs first
    from lab.targets.hardware import profile_for_device_kind

    return profile_for_device_kind(devices[0].device_kind)


def _advice(over: int, command: Predict, mesh) -> str:
    ideas = []
    if command.remat != "full":
        ideas.append("--remat full")
    if command.batch_per_device > 1:
        ideas.append(f"--batch-per-device {max(1, command.batch_per_device // 2)}")
    if mesh.shape["tensor"] == 1:
        ideas.append("a tensor axis (e.g. tensor=4) to split activations and weights")
    ideas.append(f"more chips on fsdp ({more_chips(command.target)})")
    return f"does not fit by {over / GiB:.2f} GiB per chip; try " + ", or ".join(ideas)


def predict(command: Predict) -> int:
    """The ``lab predict`` handler for the lab's model (the user's own step, --fn: `lab.predict.program.predict`)."""
    return emit(run_prediction(command), show, command.json)
