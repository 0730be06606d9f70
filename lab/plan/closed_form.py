"""The closed form of one layout: memory per chip and step time, from the model's shapes and the pod's links.

**Memory per chip** (bytes), the lab's ZeRO-3 table (`lab.rules`): working
weights and gradients in bf16 and Adam's fp32 master weights and two moments
(2 + 2 + 12 bytes a parameter, `lab.theory.zero_model_states`), each weight
split over ``fsdp`` (along ``embed``), ``tensor`` (heads, K/V heads, MLP
width), ``stage`` (layers) and ``expert`` (experts), whole over ``data``. The
embedding and unembedding are split over ``fsdp`` only. Activations saved for
the backward pass, per layer and micro-batch, per remat policy
(`lab.predict.step`: ``full`` keeps each block's input, ``minimal`` every
weight matmul's output, ``none`` everything; the tally of Korthikanti et al. 2022,
Section 4, for this block, bf16, no dropout), times the layers of a stage
and the micro-batches in flight (a GPipe pipeline holds all of them,
`lab.theory.peak_micro_batches_in_flight`). On top, the largest transient:
one layer's weights gathered over ``fsdp`` (twice: the next layer is
prefetched) with its backward working set, or the loss's logits chunk with
the gathered unembedding and its gradient.

**Step time**: every op at its own roofline, its FLOPs at the chip's peak or
its bytes at HBM's bandwidth, whichever is longer, each rate times the
chip's efficiency constant (`Problem.efficiency`, `lab predict`'s, so the
closed form and the compiled prediction price alike):

* the matmuls: per layer the attention's projections and the MLP's two or
  three (or an MoE layer's experts, router and shared experts; a model whose
  dense and MoE layers differ is priced kind by kind), forward once, backward
  twice (the input's and the weight's gradient), plus what remat recomputes
  (under ``full`` all but the out-projection and W_out, whose outputs the
  backward never reads); attention's QK^T and AV (the causal flash kernel: the
  tiles on and below the diagonal, its backward seven products against a
  dot's four, each of its kernels at its own roofline: its operands and
  results, the softmax statistics among them as fp32 rows of 128 lanes, weigh
  more than its FLOPs when heads are narrow and sequences short); the
  embedding (a one-hot matmul) and the head, run whole on every ``tensor`` and
  ``stage`` device;
* the HBM-bound ops: the norms, residual adds, rotary, the MLP's activation
  and XLA attention's fp32 softmax, each reading its inputs and writing its
  output once (twice over in the backward); what the forward saves, written
  into the scan's stack and read back; the loss's fp32 logits; and AdamW,
  which reads and writes the 16 bytes of state of every stored parameter;
* the pipeline's bubble (`lab.theory.pipeline_step_time`: the SPMD pipeline
  runs M + P - 1 ticks);
* per axis the collectives it implies, priced on its links
  (`lab.targets.topology.placement` on the compile-only chips, priced by
  `lab.targets.topology.predict`, the compiled prediction's link model):

  * ``fsdp``: per layer and tick, each weight all-gathered forward and again
    backward, its gradient reduce-scattered (ZeRO paper, Section 7.2.2), one
    collective per weight as XLA emits them (each pays its latency);
    where the compiler runs them asynchronously they overlap the layer's compute, so only what exceeds it is
    exposed (on TPU as libtpu answers `lab.plan.overlap`'s probe for the generation and flags, the gathers and the
    reduce-scatters each; on GPU within its scheduler's memory limit), else the step waits for them;
    but over every chip of a slice libtpu compiles the reduce-scatter as a
    synchronous all-reduce of the whole gradient (twice the bytes, none
    hidden), and an axis across slices waits for its reduce-scatter within
    each slice, and rewrites each gathered weight and gradient in HBM, on the
    compute stream (`_relayout_s`); the vocabulary tables gathered once and
    reduced once;
  * ``data``: one all-reduce of each chip's gradient shard per step, exposed
    (across slices XLA compiles it as a reduce-scatter within each slice, the
    shard's all-reduce on DCN by libtpu's megascale runtime, an all-gather);
  * ``tensor``: two all-reduces of the [b, S, D] activations per layer forward,
    two backward, two more when ``full`` remat recomputes the forward (Megatron,
    Section 3), on the critical path: exposed;
  * ``stage``: one collective-permute of a micro-batch's activations per tick
    and direction; after the loop the last stage's outputs all-reduced over
    ``stage`` (the others masked to zero, `lab.parallel.pipeline.spmd`), and
    the embedding's gradient, which only stage 0 has, summed the same way; exposed;
  * ``expert``: dispatch and combine all-to-alls per layer, forward and
    backward (`lab.theory.moe_traffic`), exposed.

Each collective is priced by `lab.targets.topology.predict`, as the compiled prediction prices it: an axis that
crosses TPU slices in two tiers, the ICI part within a slice and the DCN part on S / (ICI ways), one after the
other; an axis across GPU nodes as NCCL's hierarchical ring, its NVLink and InfiniBand tiers pipelined, the
slower bounding it.

It is one concept in one module, though above 500 lines: a layout's memory,
compute and communication are one model over the same per-layer shapes (the
exposed communication is what a layer's compute does not hide, the transient
memory is the layer its gathers fill), so they stay together.
"""

from __future__ import annotations

import collections
import functools
import math
from dataclasses import dataclass, replace

from lab import theory
from lab.mesh import AXES, MeshSpec
from lab.model import FLASH_BLOCK, flash_head_width
from lab.plan.overlap import Overlap
from lab.plan.space import Layout, Problem
from lab.predict.spec import model_flops
from lab.ragged import GMM_TILING, row_tile
from lab.targets.topology import Placement, placement, predict

PARAM_BYTES, GRAD_BYTES, OPTIMIZER_BYTES = 2, 2, 12  # bf16 working weights and gradients; fp32 master + Adam moments
ACTIVATION_BYTES = 2  # bf16 compute
LOSS_CHUNK = 1024  # tokens of a sequence whose logits exist at once (lab.predict.step.LOSS_CHUNK)
# the flash kernel's backward products of the scores' size: its dK/dV kernel's QK^T, dO V^T, dV and dK; its dQ
# kernel's QK^T, dO V^T and dQ; per forward product (QK^T and AV), (4 + 3) / 2 where a dot's backward runs 2
DKV_PRODUCTS, DQ_PRODUCTS = 4, 3
FLASH_BACKWARD = (DKV_PRODUCTS + DQ_PRODUCTS) / 2


@dataclass(frozen=True)
class AxisCost:
    """The collectives one mesh axis implies per step."""

    axis: str
    link: str  # where they run, as lab.targets.topology.Placement says (and "+ DCN x K" across slices)
    collectives: int  # per step
    size_bytes: float  # S per device, summed over the step's collectives
    seconds: float  # transfer time, all of them
    exposed_s: float  # what the step waits for


@dataclass(frozen=True)
class Memory:
    """Bytes per chip."""

    params: float
    grads: float
    optimizer: float
    activations: float  # saved for the backward pass
    transient: float  # the largest working set on top

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.transient


@dataclass(frozen=True)
class Estimate:
    """The closed form of one layout."""

    layout: Layout
    memory: Memory
    flops_per_chip: float  # hardware FLOPs (recompute included)
    matmul_s: float  # the matmuls and attention's kernels, each at its own roofline
    hbm_s: float  # the HBM-bound ops: norms, activations, softmax, the loss, saved stacks, the AdamW update
    bubble_s: float
    axes: tuple[AxisCost, ...]
    model_flops: float  # per step, all chips (lab predict's convention)
    hbm_bytes: float

    @property
    def compute_s(self) -> float:
        return self.matmul_s + self.hbm_s

    @property
    def exposed_s(self) -> float:
        return sum(a.exposed_s for a in self.axes)

    @property
    def step_s(self) -> float:
        return self.compute_s + self.bubble_s + self.exposed_s

    @property
    def chips(self) -> int:
        return self.layout.mesh.size

    @property
    def mfu(self) -> float:
        return self.model_flops / (self.chips * self.step_s) / self.peak

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.hbm_bytes

    peak: float = 0.0


# --------------------------------------------------------------------------- the model's shapes


@functools.cache  # every layout of a plan asks it several times (memory, compute, gradients, optimizer)
def layer_kinds(model) -> tuple[tuple[int, object], ...]:
    """The model's layers by kind, (how many, the model with every layer of that kind): one kind, or an MoE
    model's dense layers (DeepSeek-V3's first three, Llama 4's interleaved) and its MoE ones, a windowed model's
    windowed and global layers (GPT-OSS's)."""
    counts = collections.Counter(((False, 0),) * model.dense_layers + model.layer_pattern * model.scan_length)
    if len(counts) == 1:
        return ((model.layers, model),)
    return tuple((n, _every_layer(model, n, moe, window)) for (moe, window), n in sorted(counts.items()))


def _every_layer(model, layers: int, moe: bool, window: int):
    """`model` as `layers` layers all of one kind: MoE or dense (its dense width), windowed or global."""
    one_kind = replace(model, layers=layers, dense_layers=0, moe_every=1, window=window, global_every=0)
    if moe:
        return one_kind
    return replace(one_kind, experts=0, shared_experts=0, mlp=model.dense_width)


def _vocab(model) -> float:
    return (1 if model.tied else 2) * model.vocab * model.embed + model.embed


def params_per_chip(model, mesh: MeshSpec) -> float:
    """Parameters each chip stores (the ZeRO-3 table with the model-parallel splits)."""
    s = mesh.sizes
    layers = sum(n * _layer_gathered(kind, mesh) for n, kind in layer_kinds(model))
    return (layers / s["stage"] + _vocab(model)) / s["fsdp"]


def _layer_gathered(model, mesh: MeshSpec) -> float:
    """One layer's weights as the matmuls use them: whole over fsdp, still split over tensor and expert."""
    return sum(_layer_weights(model, mesh))


def _layer_weights(model, mesh: MeshSpec) -> tuple[float, ...]:
    """Each weight of one layer (elements) as the matmuls use it; XLA gathers and reduce-scatters them one by one.

    The attention's projections; the MLP's two or three matrices (an MoE layer's expert stacks, its router and its
    shared experts); the norms' scales."""
    d = model.embed
    norms = (float(d),) * (1 if model.block == "parallel" else 2)
    return _embed_major(model, mesh) + _embed_minor(model, mesh) + norms + _biases(model, mesh)


def _embed_major(model, mesh: MeshSpec) -> tuple[float, ...]:
    """The matrices that take the embedding in (its dimension their first after the experts'): the attention's
    input projections, the MLP's one or two input matrices (an MoE layer's expert stacks, router and shared
    experts')."""
    s = mesh.sizes
    d, f, t, inputs = model.embed, model.mlp, s["tensor"], 2 if model.gated else 1
    if model.experts:
        shared = (d * model.shared_width / t,) * (inputs if model.shared_experts else 0)
        mlp = (model.experts * d * f / (t * s["expert"]),) * inputs + (d * model.experts,) + shared
    else:
        mlp = (d * f / t,) * inputs
    return _attention_weights(model, t)[:-1] + mlp


def _embed_minor(model, mesh: MeshSpec) -> tuple[float, ...]:
    """The matrices that give the embedding out, its dimension their last (XLA's minor one): the attention's
    out-projection [h, k, d] and the MLP's output matrix [f, d] (an MoE layer's [E, f, d], and its shared
    experts'). Split over fsdp along that minor dimension, their gradients are not reduce-scattered on TPU: libtpu
    all-reduces each whole, synchronously, and keeps its slice (Llama 3 70B on v6e-256, data=4,fsdp=64: the
    [28672, 8192] and [64, 128, 8192] gradients of every layer, 0.35 s of its 0.60 s exposed on fsdp)."""
    s = mesh.sizes
    d, f, t = model.embed, model.mlp, s["tensor"]
    if model.experts:
        mlp = (model.experts * d * f / (t * s["expert"]),) + (
            (d * model.shared_width / t,) if model.shared_experts else ()
        )
    else:
        mlp = (d * f / t,)
    return _attention_weights(model, t)[-1:] + mlp


def _biases(model, mesh: MeshSpec) -> tuple[float, ...]:
    """A layer's biases and sinks, each split as the weight it follows: q, k, v, out, the MLP's (an MoE layer's
    experts' and router's), the heads' sinks."""
    s = mesh.sizes
    d, f, t, k, gates = model.embed, model.mlp, s["tensor"], model.head_dim, 2 if model.gated else 1
    sinks = (model.heads / t,) if model.sinks else ()
    if not model.biases:
        return sinks
    attention = (model.heads * k / t, model.groups * k / t, model.groups * k / t, float(d))
    if model.experts:
        e = model.experts / s["expert"]
        mlp = (e * f / t,) * gates + (e * d, float(model.experts))
    else:
        mlp = (f / t,) * gates + (float(d),)
    return attention + mlp + sinks


def _attention_weights(model, t: int) -> tuple[float, ...]:
    """Q, K, V and the output projection; latent attention's down-projections (whole over tensor), their norms and
    its up-projections."""
    d, k, h, g = model.embed, model.head_dim, model.heads, model.groups
    if not model.kv_rank:
        return (d * h * k / t, d * g * k / t, d * g * k / t, h * k * d / t)
    c, r, q = model.kv_rank, model.rope_dim, model.q_rank
    query = (d * q, float(q), q * h * (k + r) / t) if q else (d * h * (k + r) / t,)
    return (*query, d * (c + r), float(c), c * h * k / t, c * h * k / t, h * k * d / t)


def _attention_matmuls(model, t: int) -> tuple[tuple[float, float, float], ...]:
    """The attention's forward projections as (tokens through it per token, in, out features)."""
    d, k, h, g = model.embed, model.head_dim, model.heads, model.groups
    if not model.kv_rank:
        return ((1.0, d, (h + 2 * g) * k / t), (1.0, h * k / t, d))  # q, k, v; the out-projection
    c, r, q = model.kv_rank, model.rope_dim, model.q_rank
    query = ((1.0, d, q), (1.0, q, h * (k + r) / t)) if q else ((1.0, d, h * (k + r) / t),)
    return (*query, (1.0, d, c + r), (1.0, c, 2 * h * k / t), (1.0, h * k / t, d))


def _attention_outputs(model, t: int) -> float:
    """Elements per token the attention's projections write (what ``minimal`` remat saves of them)."""
    return sum(n for _, _, n in _attention_matmuls(model, t)[:-1])


def _qk_width(model, t: int) -> float:
    """Channels per token of the queries and keys (rotary rotates them; a latent key's rotary part is shared)."""
    if not model.kv_rank:
        return (model.heads + model.groups) * model.head_dim / t
    return 2 * model.heads * (model.head_dim + model.rope_dim) / t


# --------------------------------------------------------------------------- activations


def _mlp_width(model) -> float:
    """Rows through the MLP per token: 1; in an MoE layer top_k x the capacity factor (each expert's buffer), E
    without a factor (every expert's buffer holds its whole group), top_k dropless (the routed rows)."""
    if not model.experts:
        return 1.0
    if model.dropless:
        return float(model.top_k)
    return model.top_k * model.capacity_factor if model.capacity_factor else float(model.experts)


def _as_buffer(model, tokens: float):
    """`model` as its matmuls are priced on a chip of `tokens` tokens: a dropless MoE layer as a buffer of the rows
    its grouped matmul visits, times the columns its whole blocks multiply (`lab.ragged`, as `lab.predict.ops`
    prices the kernel): the T·k routed rows in row tiles, each tile once and once more for each expert whose rows
    start inside one, (tiles + E - 1) x the tile; and the model's and the experts' widths in tiles of up to
    1024, each multiplied whole (a width of 1536 as 2048). The gradient's matmuls reuse the forward's tiles with
    k and n swapped, which costs more only where a width is under its tile: left out, as are the sort's
    permutations (HBM-bound gathers, like a buffer's dispatch and combine, which are left out too)."""
    if not model.dropless:
        return model
    rows = tokens * model.top_k
    tile = row_tile(math.ceil(rows))
    visited = (math.ceil(rows / tile) + model.experts - 1) * tile
    _, tile_k, tile_n = GMM_TILING
    columns = _whole(model.embed, tile_k) * _whole(model.mlp, tile_n) / (model.embed * model.mlp)
    return replace(model, dropless=False, capacity_factor=visited / rows * columns)


def _whole(size: int, tile: int) -> int:
    """`size` in whole tiles of up to `tile` (a tile no larger than the size)."""
    tile = min(tile, size)
    return math.ceil(size / tile) * tile


def _hidden(model, tensor: int) -> float:
    """The MLP's hidden elements per token on a tensor shard: its width, or the experts' and the shared experts'."""
    return (model.mlp * _mlp_width(model) + (model.shared_width if model.experts else 0)) / tensor


def saved_per_layer(model, tokens: float, tensor: int, remat: str, attention: str) -> float:
    """Bytes one layer keeps for the backward pass for `tokens` tokens on a chip (see the module docstring)."""
    d, k, h = model.embed, model.head_dim, model.heads
    if remat == "full":
        return ACTIVATION_BYTES * tokens * d  # the block's input: the scan's carry
    hidden = (2 if model.gated else 1) * _hidden(model, tensor)
    saved = _attention_outputs(model, tensor) + d + hidden + d  # the projections; out-projection; MLP hidden and out
    if remat == "none":
        # everything else: two norm outputs, rotated q and k, the attention output, the activation, the residual
        saved += 2 * d + _qk_width(model, tensor) + h * k / tensor + hidden + d
        if attention == "xla":  # the scores [b, H, S, S] and their mix, then the fp32 softmax
            saved += model.seq * h / tensor + h * k / tensor + 2 * model.seq * h / tensor
        else:
            saved += 2 * h / tensor  # the kernel's fp32 logsumexp
    return ACTIVATION_BYTES * tokens * saved


def memory(problem: Problem, layout: Layout) -> Memory:
    """Bytes per chip of `layout` (see the module docstring)."""
    model, mesh = problem.model, layout.mesh
    s = mesh.sizes
    params = params_per_chip(model, mesh)
    states = theory.zero_model_states(
        3, params, 1, param_bytes=PARAM_BYTES, grad_bytes=GRAD_BYTES, optimizer_bytes=OPTIMIZER_BYTES
    )
    shard_tokens = problem.tokens / layout.batch_ways  # tokens on a chip per step
    micro_tokens = shard_tokens / layout.micro_batches
    in_flight = theory.peak_micro_batches_in_flight("gpipe", s["stage"], layout.micro_batches) if s["stage"] > 1 else 1
    kinds = layer_kinds(model)
    saved = in_flight * sum(
        saved_per_layer(kind, micro_tokens, s["tensor"], layout.remat, model.attention) * n / s["stage"]
        for n, kind in kinds
    )
    # backward of one layer: its full working set recomputed (the `none` tally) with its weights gathered twice
    backward = max(
        saved_per_layer(kind, micro_tokens, s["tensor"], "none", model.attention)
        + (PARAM_BYTES * (2 if s["fsdp"] > 1 else 0) + GRAD_BYTES) * _layer_gathered(kind, mesh)
        for _, kind in kinds
    )
    sequences = micro_tokens / model.seq
    logits = 2 * 4 * sequences * min(LOSS_CHUNK, model.seq) * model.vocab  # fp32 logits and their gradient
    # through the loss's chunks: the unembedding gathered once, and its gradient's partial sums
    unembed = (PARAM_BYTES + GRAD_BYTES) * model.vocab * model.embed if s["fsdp"] > 1 else 0.0
    transient = max(backward, logits + unembed)
    return Memory(states.params, states.grads, states.optimizer, saved, transient)


# --------------------------------------------------------------------------- compute


def _block_matmuls(model, tensor: int) -> tuple[tuple[float, float, float], ...]:
    """The forward matmuls of one layer on one tensor shard: (tokens through it per token, in, out features)."""
    d, f, gates = model.embed, model.mlp, 2 if model.gated else 1  # W_in, and W_gate beside it in a gated MLP
    attention = _attention_matmuls(model, tensor)
    if model.experts:  # each token through top_k experts (and the capacity's padding), the router, the shared ones
        width, sw = _mlp_width(model), model.shared_width / tensor
        shared = ((1.0, d, gates * sw), (1.0, sw, d)) if sw else ()
        return (*attention, (width, d, gates * f / tensor), (width, f / tensor, d), (1.0, d, model.experts), *shared)
    return (*attention, (1.0, d, gates * f / tensor), (1.0, f / tensor, d))


def _core_flops(model, tensor: int) -> float:
    """Attention's QK^T and AV per token of one layer, forward: 2 · S · H · (K + R) and 2 · S · H · K, the scores
    whole (XLA's dot product). The flash kernel computes only the tiles on and below the causal diagonal, (n + 1)/2n
    of n x n tiles of `FLASH_BLOCK`, both products at its head width (K + R, padded past 128 to a multiple of 128:
    `lab.model.flash_head_width`); with a sliding window, the splash kernel's 1 + ceil((window - 1) / block) blocks
    a row reaches."""
    s, h = model.seq, model.heads
    if model.attention != "flash":
        return 2 * s * h * (2 * model.head_dim + model.rope_dim) / tensor
    block = min(FLASH_BLOCK, s)
    tiles = s // block
    live = (tiles + 1) / (2 * tiles)
    if model.window:  # the splash kernel's grid shrinks to the blocks a row's window reaches
        live = min(live, (1 + -(-(model.window - 1) // block)) / tiles)
    return 4 * s * h * flash_head_width(model.head_dim + model.rope_dim) / tensor * live


def _flash_bytes(model, tensor: int) -> tuple[float, float, float, float]:
    """HBM bytes per token of one layer's flash kernels, each its operands and results as
    `jax.experimental.pallas.ops.tpu.flash_attention` declares them (the compiled prediction prices a kernel so):
    (the forward, which reads q, k and v, the K/V heads repeated to H, writes o, bf16, and each query row's softmax
    statistics l and m as fp32 rows of the TPU's 128 lanes; the backward's dK/dV kernel, which reads q, k, v, dO and
    the rows l, m and di = rowsum(o . dO) and writes dk and dv; its dQ kernel, which reads the same but di at the key
    block's width and writes dq; the broadcasts that make those rows, written once and shared). Its K/V blocks
    re-read per query block stay on chip at the block sizes the lab gives it (`lab.model.FLASH_BLOCK`)."""
    # local: the Pallas TPU ops load only when a flash kernel is priced; it keeps each query row's statistics l and
    # m as fp32 rows of MIN_BLOCK_SIZE (128) lanes
    from jax.experimental.pallas.ops.tpu.flash_attention import MIN_BLOCK_SIZE

    heads = model.heads / tensor
    row = ACTIVATION_BYTES * heads * flash_head_width(model.head_dim + model.rope_dim)  # q, k, v, o, dO, ...
    stats = 4 * heads * MIN_BLOCK_SIZE  # one fp32 statistic's row
    wide = 4 * heads * min(FLASH_BLOCK, model.seq)  # di at the key block's width, for the dQ kernel
    return 4 * row + 2 * stats, 6 * row + 3 * stats, 5 * row + 2 * stats + wide, 3 * stats + wide


def _block_forward_flops(model, tensor: int) -> float:
    """Forward matmul FLOPs per token of one layer on one tensor shard."""
    return sum(2 * width * k * n for width, k, n in _block_matmuls(model, tensor)) + _core_flops(model, tensor)


def _kernel_backward_flops(model, tensor: int) -> float:
    """What the flash kernel's backward runs beyond a dot's two matmuls per forward one: its dK/dV and dQ kernels
    each recompute QK^T and dO V^T, seven products of the scores' size against a dot's four."""
    return (FLASH_BACKWARD - 2) * _core_flops(model, tensor) if model.attention == "flash" else 0.0


def _unread_outputs(model, tensor: int) -> tuple[tuple[float, float, float], ...]:
    """The forward matmuls whose outputs the backward pass does not read, so that remat ``full`` does not recompute
    them: the attention's out-projection and the MLP's W_out (a shared expert's too) only add to the residual
    stream. An expert's W_out output is read: the combine's gradient to the gates weighs it."""
    d, sw = model.embed, model.shared_width / tensor
    out = (1.0, model.heads * model.head_dim / tensor, d)
    if model.experts:
        return (out, (1.0, sw, d)) if sw else (out,)
    return (out, (1.0, model.mlp / tensor, d))


def _elementwise_bytes(model, tensor: int) -> float:
    """HBM bytes per token of one layer's forward outside the matmuls, each op reading its inputs and writing its
    output once (bf16; the softmax in fp32): two norms, the two residual adds, rotary on q and k, the MLP's
    activation, and XLA attention's softmax over the [H, S, S] scores (the flash kernel keeps them on chip)."""
    d, h = model.embed, model.heads
    norms, residuals = 2 * 2 * d, 2 * 3 * d
    rotary = 2 * _qk_width(model, tensor)
    hidden = _hidden(model, tensor)
    activation = (3 if model.gated or model.experts else 2) * hidden
    values = ACTIVATION_BYTES * (norms + residuals + rotary + activation)
    softmax = 2 * 4 * model.seq * h / tensor if model.attention == "xla" else 0.0
    return values + softmax


@dataclass(frozen=True)
class _Roofline:
    """Seconds of an op on one chip: its FLOPs at the matmul units' rate or its bytes at HBM's, whichever is longer
    (the rates are the chip's peaks times `lab.predict.calibration`'s efficiencies, as `lab predict` prices)."""

    flops_per_s: float
    bytes_per_s: float

    def matmul(self, tokens: float, k: float, n: float) -> float:
        """[tokens, k] x [k, n] with bf16 operands and result."""
        moved = ACTIVATION_BYTES * (tokens * k + k * n + tokens * n)
        return max(2 * tokens * k * n / self.flops_per_s, moved / self.bytes_per_s)

    def layer_forward(self, model, tensor: int, tokens: float) -> tuple[float, float]:
        """(weight matmuls s, HBM-bound s) of one layer's forward over `tokens` (attention's core: `core`)."""
        dots = sum(self.matmul(tokens * width, k, n) for width, k, n in _block_matmuls(model, tensor))
        return dots, tokens * _elementwise_bytes(model, tensor) / self.bytes_per_s

    def core(self, model, tensor: int, tokens: float) -> tuple[float, float, float]:
        """(forward s, backward s, backward HBM-bound s) of attention's QK^T and AV over `tokens`. XLA's dots run at
        the matmul rate, twice in the backward; the flash kernels each at its own roofline, its FLOPs or its bytes
        (`_flash_bytes`) whichever is longer, the statistics' broadcasts at HBM's rate (the splash kernel of a
        sliding window by its FLOPs: its own statistics are not modelled)."""
        products = tokens * _core_flops(model, tensor) / self.flops_per_s  # seconds of QK^T and AV at the rate
        if model.attention != "flash" or model.window:
            return products, 2 * products + tokens * _kernel_backward_flops(model, tensor) / self.flops_per_s, 0.0
        forward, dkv, dq, broadcasts = (tokens * b / self.bytes_per_s for b in _flash_bytes(model, tensor))
        per_product = products / 2
        backward = max(DKV_PRODUCTS * per_product, dkv) + max(DQ_PRODUCTS * per_product, dq)
        return max(products, forward), backward, broadcasts


def _roofline(problem: Problem) -> _Roofline:
    chip, efficiency = problem.chip, problem.efficiency
    return _Roofline(chip.peak_bf16_flops * efficiency.matmul, chip.hbm_bandwidth * efficiency.hbm)


def _recompute(model, remat: str, tensor: int) -> float:
    """Forward FLOPs per token and layer that the backward pass runs again."""
    if remat == "full":
        unread = sum(2 * width * k * n for width, k, n in _unread_outputs(model, tensor))
        return _block_forward_flops(model, tensor) - unread
    if remat == "minimal":
        return _core_flops(model, tensor)  # a kernel's output is no dot, the scores' dots have a batch dimension
    return 0.0


@dataclass(frozen=True)
class _Layer:
    """One layer on one micro-batch of one chip: forward and backward seconds, split into matmuls and HBM-bound."""

    forward: tuple[float, float]
    backward: tuple[float, float]

    @property
    def forward_s(self) -> float:
        return sum(self.forward)

    @property
    def backward_s(self) -> float:
        return sum(self.backward)


def _layer(problem: Problem, layout: Layout, tokens: float, model) -> _Layer:
    """One layer of `model` (a kind of `layer_kinds`). The backward runs each forward matmul twice (the input's and
    the weight's gradient) and each HBM-bound op about twice; remat adds what it recomputes, and what the forward
    saved is written once and read back once (the scan stacks it per layer)."""
    t, roof = layout.sizes["tensor"], _roofline(problem)
    dots, moved = roof.layer_forward(model, t, tokens)
    core, core_backward, broadcasts = roof.core(model, t, tokens)
    saved_s = saved_per_layer(model, tokens, t, layout.remat, model.attention) / roof.bytes_per_s
    if layout.remat == "full":
        redo = (dots + core - sum(roof.matmul(tokens * w, k, n) for w, k, n in _unread_outputs(model, t)), moved)
    else:
        redo = (core if layout.remat == "minimal" else 0.0, 0.0)  # minimal: the core, whose output is no dot's
    return _Layer(
        (dots + core, moved + saved_s),
        (2 * dots + core_backward + redo[0], 2 * moved + broadcasts + redo[1] + saved_s),
    )


def _vocab_s(problem: Problem, layout: Layout, tokens: float) -> tuple[float, float]:
    """(matmul s, HBM-bound s) of the embedding (a one-hot matmul: forward and weight gradient), the head (forward,
    the loss's recompute, two backward) and the loss (fp32 logits written, read, their gradient written and read)."""
    model, roof = problem.model, _roofline(problem)
    dots = 2 * roof.matmul(tokens, model.vocab, model.embed) + 4 * roof.matmul(tokens, model.embed, model.vocab)
    return dots, 4 * 4 * tokens * model.vocab / roof.bytes_per_s


def _relayout_s(problem: Problem, layout: Layout, link, ticks: int, kinds) -> float:
    """HBM seconds that an fsdp axis across TPU slices adds to the compute stream. libtpu gathers a weight in two
    tiers, within each slice and across the slices, and what arrives is in the tiers' order, not the mesh's: each
    gathered weight is rewritten whole (its ``reshard`` fusions read and write it once a gather, forward and
    backward), and each gradient once before its two-tier reduction (Llama 3 8B on 4 slices of 256 v5e, read from
    the compiled steps: at fsdp=1024 across the slices 82 ms of reshard fusions and 54 ms of dynamic-update-slice
    and reduce fusions a step, at data=4, fsdp=256 6 ms and 15 ms: 76 ms and 40 ms more; this prices 76 and 38)."""
    if link.dcn == 1 or not problem.chip.torus_dims:
        return 0.0
    weights = sum(ticks * n * PARAM_BYTES * sum(_layer_weights(kind, layout.mesh)) for n, kind, _ in kinds)
    return (2 * 2 + 2) * weights / _roofline(problem).bytes_per_s  # two gathers and one gradient, each read + written


def _optimizer_s(problem: Problem, layout: Layout) -> float:
    """AdamW reads and writes every byte of each stored parameter's state (2 + 2 + 12 bytes): HBM-bound."""
    state = PARAM_BYTES + GRAD_BYTES + OPTIMIZER_BYTES
    return 2 * state * params_per_chip(problem.model, layout.mesh) / _roofline(problem).bytes_per_s


# --------------------------------------------------------------------------- the step


def estimate(problem: Problem, layout: Layout) -> Estimate:
    """Memory, compute, bubble and per-axis communication of `layout` on `problem`'s pod."""
    model, mesh, chip = problem.model, layout.mesh, problem.chip
    s = mesh.sizes
    p, m, t = s["stage"], layout.micro_batches, s["tensor"]
    shard_tokens = problem.tokens / layout.batch_ways
    micro_tokens = shard_tokens / m
    layers = model.layers / p
    priced = [(n, _as_buffer(kind, micro_tokens)) for n, kind in layer_kinds(model)]
    kinds = [(n / p, kind, _layer(problem, layout, micro_tokens, kind)) for n, kind in priced]
    forward_s = sum(n * layer.forward_s for n, _, layer in kinds)  # one stage's layers, one micro-batch
    backward_s = sum(n * layer.backward_s for n, _, layer in kinds)
    vocab_dots, vocab_moved = _vocab_s(problem, layout, shard_tokens)
    optimizer_s = _optimizer_s(problem, layout)
    matmul_s = m * sum(n * (layer.forward[0] + layer.backward[0]) for n, _, layer in kinds) + vocab_dots
    flops = shard_tokens * sum(
        n * (3 * _block_forward_flops(kind, t) + _kernel_backward_flops(kind, t) + _recompute(kind, layout.remat, t))
        for n, kind, _ in kinds
    )
    flops += shard_tokens * (4 + 8) * model.vocab * model.embed
    ticks = m + p - 1 if p > 1 else 1
    bubble_s = theory.pipeline_step_time(p, m, forward_s, backward_s) - m * (forward_s + backward_s) if p > 1 else 0.0
    costs = []
    links = _links(problem, layout)
    hbm_s = m * sum(n * (layer.forward[1] + layer.backward[1]) for n, _, layer in kinds) + vocab_moved + optimizer_s
    if s["fsdp"] > 1:
        hbm_s += _relayout_s(problem, layout, links["fsdp"], ticks, kinds)
    bytes_per_chip = memory(problem, layout)
    if s["fsdp"] > 1:
        costs.append(_fsdp(problem, layout, links["fsdp"], ticks, kinds, _overlap(problem, bytes_per_chip)))
    if s["data"] > 1:
        grads = GRAD_BYTES * params_per_chip(model, mesh)
        costs.append(_priced("data", links["data"], _gradient_all_reduce(grads, links["data"])))
    if t > 1:
        activation = ACTIVATION_BYTES * micro_tokens * model.embed
        count = ticks * layers * (6 if layout.remat == "full" else 4)
        costs.append(_priced("tensor", links["tensor"], [("all-reduce", activation, count)]))
    if p > 1:
        activation = ACTIVATION_BYTES * micro_tokens * model.embed
        outputs = ACTIVATION_BYTES * shard_tokens * model.embed  # the last stage's outputs, every micro-batch
        embedding = GRAD_BYTES * model.vocab * model.embed / s["fsdp"]  # its gradient, nonzero on stage 0 only
        pipe = [("collective-permute", activation, 2 * ticks), ("all-reduce", outputs, 1), ("all-reduce", embedding, 1)]
        costs.append(_priced("stage", links["stage"], pipe))
    if s["expert"] > 1:
        traffic = theory.moe_traffic(
            int(micro_tokens), model.embed, model.experts, model.top_k, s["expert"], model.capacity_factor
        )
        buffer = ACTIVATION_BYTES * traffic.capacity * model.experts * model.embed
        costs.append(_priced("expert", links["expert"], [("all-to-all", buffer, 4 * ticks * model.moe_layers / p)]))
    return Estimate(
        layout,
        bytes_per_chip,
        flops,
        matmul_s,
        hbm_s,
        bubble_s,
        tuple(costs),
        model_flops(model, problem.tokens),
        chip.hbm_bytes,
        peak=chip.peak_bf16_flops,
    )


def _fsdp(problem, layout, link, ticks, kinds, overlap: Overlap) -> AxisCost:
    """ZeRO-3 over fsdp: per layer and tick, gather forward, gather and reduce the gradient backward; `kinds`:
    (layers of a stage, the kind's model, its `_Layer`).

    What the scheduler `overlap`s (see `_overlap`) of the gathers and of the gradients' reduce-scatters overlaps
    that layer's compute, the rest waits. But on TPU a gradient split along its minor dimension
    (`_embed_minor`) is all-reduced whole, synchronously, and so is every gradient over all the chips of a slice:
    exposed whole; across slices the reduce-scatter within each slice waits too (the DCN tier's all-reduce of the
    shard runs asynchronously). The vocabulary tables are gathered once each (the loss's chunks share the
    unembedding) and their gradients all-reduced once, exposed: the unembedding's leaves the chunk loop as partial
    sums, and on TPU the embedding [vocab, embed] is split along its minor dimension too."""
    model, on_tpu = problem.model, bool(problem.chip.torus_dims)
    whole = _whole_slice(problem, link)
    collectives = moved = seconds = exposed = 0.0
    for n, kind, layer in kinds:
        each = [PARAM_BYTES * w for w in _layer_weights(kind, layout.mesh)]
        minor = [PARAM_BYTES * w for w in _embed_minor(kind, layout.mesh)] if on_tpu else []
        scattered = [] if whole else _without(each, minor)
        gather = sum(_seconds("all-gather", w, link) for w in each)
        scatter = sum(_seconds("reduce-scatter", w, link) for w in scattered)
        reduce = scatter + sum(_seconds("all-reduce", w, link) for w in (each if whole else minor))
        hidden = scatter if overlap.scatters and link.dcn == 1 else 0.0  # the reduce-scatters overlap the backward
        per_layer = ticks * n
        collectives += 3 * per_layer * len(each)
        moved += 3 * per_layer * sum(each)
        seconds += per_layer * (2 * gather + reduce)
        hides = (layer.forward_s, layer.backward_s) if overlap.gathers else (0.0, 0.0)
        exposed += per_layer * (max(0.0, gather - hides[0]) + max(0.0, gather + hidden - hides[1]) + reduce - hidden)
    table = PARAM_BYTES * model.vocab * model.embed
    embedding = "all-reduce" if on_tpu or whole else "reduce-scatter"
    tables = [("all-gather", table, 2), ("all-reduce", table, 1)] + ([] if model.tied else [(embedding, table, 1)])
    tables_s = sum(n * _seconds(kind, size, link) for kind, size, n in tables)
    return AxisCost(
        "fsdp",
        link.text,
        round(collectives) + sum(n for _, _, n in tables),
        moved + sum(n * size for _, size, n in tables),
        seconds + tables_s,
        exposed + tables_s,
    )


# XLA:GPU's latency-hiding scheduler works within 80% of the GPU's memory less the step's inputs and outputs, times
# the slop factor (``--xla_gpu_memory_limit_slop_factor``, 95 by default): xla/service/gpu/gpu_hlo_schedule.cc,
# GetSchedulerMemoryLimit
GPU_SCHEDULER_SHARE, GPU_SLOP = 0.8, 0.95


def _overlap(problem: Problem, bytes_per_chip: Memory) -> Overlap:
    """What the compiler's scheduler may start early of a layer's collectives, to overlap compute. On TPU, what
    libtpu makes asynchronous (`Problem.overlap`: by generation and flags, asked of libtpu by `lab.plan.overlap`).
    XLA:GPU's overlaps them all, but only within its memory limit (`GPU_SCHEDULER_SHARE`): a step whose buffers
    beyond its inputs and outputs (the parameters and optimizer state, donated) exceed it is scheduled for memory,
    and every collective waits (Llama 3 70B on 32 nodes of H100: at 70 of 75 GiB all 1.0 s of its FSDP
    collectives exposed; under remat ``full``, at 26 GiB, 0.42 s)."""
    if problem.chip.torus_dims:
        return problem.overlap
    io = bytes_per_chip.params + bytes_per_chip.optimizer
    fits = bytes_per_chip.total - io <= (GPU_SCHEDULER_SHARE * problem.chip.hbm_bytes - io) * GPU_SLOP
    return Overlap(fits, fits)


def _without(sizes: list[float], taken: list[float]) -> list[float]:
    """`sizes` less one entry equal to each of `taken` (weights of one size are priced alike: which one is moot)."""
    rest = list(sizes)
    for size in taken:
        rest.remove(size)
    return rest


def _whole_slice(problem: Problem, link: _Link) -> bool:
    """Whether the axis's ICI group is every chip of a TPU slice (libtpu then reduce-scatters by all-reduce)."""
    return link.ici is not None and link.ici.network == "ici" and link.ici.devices == math.prod(problem.torus)


def _gradient_all_reduce(grads: float, link: _Link) -> list[tuple]:
    """The data axis's gradient all-reduce as XLA compiles it: whole within one slice; across slices a reduce-scatter
    within each slice, the all-reduce of the shard by libtpu's megascale runtime on DCN, an all-gather within."""
    if link.dcn == 1 or link.ici is None or link.ici.devices == 1:
        return [("all-reduce", grads, 1, link)]
    within, across = replace(link, dcn=1), replace(link, ici=None)
    shard = grads / link.ici.devices
    return [("reduce-scatter", grads, 1, within), ("all-reduce", shard, 1, across), ("all-gather", grads, 1, within)]


def _priced(axis: str, link, collectives) -> AxisCost:
    """Collectives (kind, S, count), or (kind, S, count, the tier of `link` they run on), that the step waits for
    whole."""
    placed = [(kind, size, n, *(tier or [link])) for kind, size, n, *tier in collectives]
    seconds = sum(n * _seconds(kind, size, where) for kind, size, n, where in placed)
    return AxisCost(
        axis, link.text, sum(n for *_, n, _ in placed), sum(n * size for _, size, n, _ in placed), seconds, seconds
    )


# --------------------------------------------------------------------------- links


@dataclass(frozen=True)
class _Link:
    """An axis on the pod: its ICI placement within a slice, and the slices it crosses."""

    ici: Placement | None  # None: the axis has no ICI part (all its ways are slices)
    dcn: int  # slices crossed (1: none)
    chip: object

    @functools.cached_property
    def placement(self) -> Placement | None:
        """The link as `lab.targets.topology` places a compiled collective: a TPU axis across slices runs two tiers
        in turn (ICI, then DCN on S / k); a GPU axis across nodes a hierarchical ring whose slower tier bounds it."""
        ici = self.ici if self.ici is not None and self.ici.devices > 1 else None
        if self.dcn == 1:
            return ici
        network = "dcn" if self.chip.torus_dims else "infiniband"
        within = ici or Placement((), 1, network)
        return replace(within, devices=within.devices * self.dcn, network=network, nodes=self.dcn)

    @property
    def text(self) -> str:
        parts = [str(self.ici)] if self.ici is not None and self.ici.devices > 1 else []
        if self.dcn > 1:
            parts.append(f"{self.chip.dcn_name} x{self.dcn}")
        return " + ".join(parts) or "-"


def _seconds(kind: str, size: float, link: _Link) -> float:
    """One collective of S = `size` per device on `link`, priced as the compiled prediction prices it."""
    where = link.placement
    cost = predict(kind, size, where, link.chip) if where is not None else None
    return cost.seconds if cost is not None else 0.0


def _links(problem: Problem, layout: Layout) -> dict[str, _Link]:
    sizes = layout.sizes
    local = {a: (n // problem.slices if a == layout.slices_axis else n) for a, n in sizes.items()}
    placed = _placements(problem.topology, tuple(local[a] for a in AXES))
    return {
        a: _Link(placed[a], problem.slices if a == layout.slices_axis else 1, problem.chip)
        for a in AXES
        if sizes[a] > 1
    }


@functools.cache
def _placements(topology: str, shape: tuple[int, ...]) -> dict[str, Placement | None]:
    """Where each axis of a one-slice mesh of `shape` runs, on the compile-only chips of `topology` (a TPU slice or
    one GPU node)."""
    from lab.targets.devices import pod_devices  # local: starts libtpu or the CUDA plugin, which memory never needs

    mesh = MeshSpec(**dict(zip(AXES, shape))).build(pod_devices(topology))
    return {a: (placement(mesh, (a,)) if n > 1 else None) for a, n in zip(AXES, shape)}


def axis_seconds(estimate_: Estimate) -> dict[str, float]:
    """Exposed seconds per axis."""
    return {a.axis: a.exposed_s for a in estimate_.axes}
