"""The closed form of one layout: memory per chip and step time, from the model's shapes and the pod's links.

**Memory per chip** (bytes), the lab's ZeRO-3 table (`lab.rules`): working
weights and gradients in bf16 and Adam's fp32 master weights and two moments
(2 + 2 + 12 bytes a parameter, `lab.theory.zero_model_states`), each weight
split over ``fsdp`` (along ``embed``), ``tensor`` (heads, K/V heads, MLP
width), ``stage`` (layers) and ``expert`` (experts), whole over ``data``. The
embedding and unembedding are split over ``fsdp`` only. Activations saved for
the backward pass, per layer and micro-batch, per remat policy
(`lab.predict.step`: ``full`` keeps each block's input, ``minimal`` every
matmul output, ``none`` everything; the tally of Korthikanti et al. 2022,
Section 4, for this block, bf16, no dropout), times the layers of a stage
and the micro-batches in flight (a GPipe pipeline holds all of them,
`lab.theory.peak_micro_batches_in_flight`). On top, the largest transient:
one layer's weights gathered over ``fsdp`` (twice: the next layer is
prefetched) with its backward working set, or the loss's logits chunk.

**Step time**: the hardware FLOPs each chip runs at the chip's peak (what
remat recomputes included; the embedding, a one-hot matmul, and the head run
whole on every ``tensor`` and ``stage`` device), the pipeline's bubble
(`lab.theory.pipeline_step_time`: the SPMD pipeline runs M + P - 1 ticks),
and per axis the collectives it implies, priced on its links
(`lab.topology.placement` on the compile-only chips, `lab.theory.predict_on_rings`,
DCN by `lab.theory.predict_on_switch`):

* ``fsdp``: per layer and tick, the weights all-gathered forward and again
  backward, their gradients reduce-scattered (ZeRO paper, Section 7.2.2);
  XLA overlaps them with the layer's compute, so only what exceeds it is exposed;
* ``data``: one all-reduce of each chip's gradient shard per step, exposed;
* ``tensor``: two all-reduces of the [b, S, D] activations per layer forward,
  two backward, two more when ``full`` remat recomputes the forward (Megatron,
  Section 3), on the critical path: exposed;
* ``stage``: one collective-permute of a micro-batch's activations per tick
  and direction, exposed;
* ``expert``: dispatch and combine all-to-alls per layer, forward and
  backward (`lab.theory.moe_traffic`), exposed.

An axis that crosses slices runs each collective in two tiers, the ICI part
within a slice and the DCN part across slices on S / (ICI ways), one after the other.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from lab import theory
from lab.mesh import AXES, MeshSpec
from lab.plan.space import Layout, Problem
from lab.topology import Placement, placement

PARAM_BYTES, GRAD_BYTES, OPTIMIZER_BYTES = 2, 2, 12  # bf16 working weights and gradients; fp32 master + Adam moments
ACTIVATION_BYTES = 2  # bf16 compute
LOSS_CHUNK = 1024  # tokens of a sequence whose logits exist at once (lab.predict.step.LOSS_CHUNK)


@dataclass(frozen=True)
class AxisCost:
    """The collectives one mesh axis implies per step."""

    axis: str
    link: str  # where they run, as lab.topology.Placement says (and "+ DCN x K" across slices)
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
    compute_s: float  # at the chip's peak
    bubble_s: float
    axes: tuple[AxisCost, ...]
    model_flops: float  # per step, all chips (lab predict's convention)
    hbm_bytes: float

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


@dataclass(frozen=True)
class _Shapes:
    """Per-layer weights, split by which axes divide them."""

    tensor_split: float  # attention and (dense) MLP weights: split over tensor
    expert_split: float  # expert weights: split over expert and tensor
    whole: float  # norms and router: split over fsdp only (and stage)
    vocab: float  # embedding (+ unembedding) parameters


@functools.cache
def _shapes(model) -> _Shapes:
    d, k = model.embed, model.head_dim
    attention = 2 * d * k * (model.heads + model.groups)
    norms = (1 if model.block == "parallel" else 2) * d
    if model.experts:
        return _Shapes(attention, model.experts * 2 * d * model.mlp, norms + d * model.experts, _vocab(model))
    return _Shapes(attention + (3 if model.gated else 2) * d * model.mlp, 0.0, norms, _vocab(model))


def _vocab(model) -> float:
    return (1 if model.tied else 2) * model.vocab * model.embed + model.embed


def params_per_chip(model, mesh: MeshSpec) -> float:
    """Parameters each chip stores (the ZeRO-3 table with the model-parallel splits)."""
    s, shapes = mesh.sizes, _shapes(model)
    per_layer = shapes.tensor_split / s["tensor"] + shapes.expert_split / (s["tensor"] * s["expert"]) + shapes.whole
    return (model.layers / s["stage"] * per_layer + shapes.vocab) / s["fsdp"]


def _layer_gathered(model, mesh: MeshSpec) -> float:
    """One layer's weights as the matmuls use them: whole over fsdp, still split over tensor and expert."""
    s, shapes = mesh.sizes, _shapes(model)
    return shapes.tensor_split / s["tensor"] + shapes.expert_split / (s["tensor"] * s["expert"]) + shapes.whole


# --------------------------------------------------------------------------- activations


def saved_per_layer(model, tokens: float, tensor: int, remat: str, attention: str) -> float:
    """Bytes one layer keeps for the backward pass for `tokens` tokens on a chip (see the module docstring)."""
    d, f, k, h, g = model.embed, model.mlp, model.head_dim, model.heads, model.groups
    experts = model.experts
    if remat == "full":
        return ACTIVATION_BYTES * tokens * d  # the block's input: the scan's carry
    width = model.top_k * (model.capacity_factor or 1.0) if experts else 1.0  # tokens through the MLP, per token
    hidden = (2 if model.gated or experts else 1) * f / tensor * width
    dots = k * (h + 2 * g) / tensor + d + hidden + d  # q, k, v; attention out-projection; MLP hidden; MLP out
    scores = model.seq * h / tensor if attention == "xla" else 0.0  # [b, H, S, S]: a dot only without flash
    mixed = h * k / tensor if attention == "xla" else 0.0  # scores @ V is a dot too
    saved = dots + scores + mixed
    if remat == "none":
        # everything else: two norm outputs, rotated q and k, the attention output, the activation, the residual
        saved += 2 * d + k * (h + g) / tensor + h * k / tensor + hidden + d
        saved += 2 * model.seq * h / tensor if attention == "xla" else 2 * h / tensor  # fp32 softmax (or logsumexp)
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
    layers = model.layers / s["stage"]
    saved = saved_per_layer(model, micro_tokens, s["tensor"], layout.remat, model.attention) * layers * in_flight
    # backward of one layer: its full working set recomputed (the `none` tally) with its weights gathered twice
    working = saved_per_layer(model, micro_tokens, s["tensor"], "none", model.attention)
    gathered = PARAM_BYTES * _layer_gathered(model, mesh) * (2 if s["fsdp"] > 1 else 0)
    layer_grads = GRAD_BYTES * _layer_gathered(model, mesh)
    sequences = micro_tokens / model.seq
    logits = 2 * 4 * sequences * min(LOSS_CHUNK, model.seq) * model.vocab  # fp32 logits and their gradient
    unembed = PARAM_BYTES * model.vocab * model.embed if s["fsdp"] > 1 else 0.0
    transient = max(working + gathered + layer_grads, logits + unembed)
    return Memory(states.params, states.grads, states.optimizer, saved, transient)


# --------------------------------------------------------------------------- FLOPs


def model_flops(model, tokens: float) -> float:
    """6 · N' · tokens + 12 · L · H · K · S · tokens: `lab predict`'s convention (MaxText's)."""
    dense = model.active_parameters - (0 if model.tied else model.vocab * model.embed)
    return 6 * dense * tokens + 12 * model.layers * model.heads * model.head_dim * model.seq * tokens


def _block_forward_flops(model, tensor: int) -> float:
    """Forward matmul FLOPs per token of one layer on one tensor shard."""
    shapes = _shapes(model)
    mlp = 2 * model.top_k * 2 * model.embed * model.mlp * (model.capacity_factor or 1.0) if model.experts else 0.0
    core = 4 * model.seq * model.heads * model.head_dim  # QK^T and AV over the whole S x S
    if model.attention == "flash":
        core /= 2  # the causal kernels skip the blocks above the diagonal
    return 2 * shapes.tensor_split / tensor + mlp / tensor + core / tensor + 2 * model.embed * model.experts


def _recompute(model, remat: str, tensor: int) -> float:
    """Forward FLOPs per token and layer that the backward pass runs again."""
    if remat == "full":
        return _block_forward_flops(model, tensor)
    if remat == "minimal" and model.attention == "flash":
        return 2 * model.seq * model.heads * model.head_dim / tensor  # a kernel's output is no dot: recomputed
    return 0.0


# --------------------------------------------------------------------------- the step


def estimate(problem: Problem, layout: Layout) -> Estimate:
    """Memory, compute, bubble and per-axis communication of `layout` on `problem`'s pod."""
    model, mesh, chip = problem.model, layout.mesh, problem.chip
    s = mesh.sizes
    p, m, t = s["stage"], layout.micro_batches, s["tensor"]
    shard_tokens = problem.tokens / layout.batch_ways
    micro_tokens = shard_tokens / m
    layers = model.layers / p
    block_fwd = _block_forward_flops(model, t)
    block_per_token = layers * (3 * block_fwd + _recompute(model, layout.remat, t))
    # the embedding (one-hot matmul: forward, weight gradient) and the head (forward, recompute, two backward)
    vocab_per_token = (4 + 8) * model.vocab * model.embed
    flops = shard_tokens * (block_per_token + vocab_per_token)
    block_s = shard_tokens * block_per_token / chip.peak_bf16_flops
    vocab_s = shard_tokens * vocab_per_token / chip.peak_bf16_flops
    ticks = m + p - 1 if p > 1 else 1
    bubble_s = theory.pipeline_step_time(p, m, block_s / m / 3, 2 * block_s / m / 3) - block_s if p > 1 else 0.0
    # one layer's forward and backward time on one tick: what the fsdp gathers can hide behind
    layer_fwd_s = micro_tokens * block_fwd / chip.peak_bf16_flops
    layer_bwd_s = micro_tokens * (2 * block_fwd + _recompute(model, layout.remat, t)) / chip.peak_bf16_flops
    costs = []
    links = _links(problem, layout)
    if s["fsdp"] > 1:
        costs.append(_fsdp(problem, layout, links["fsdp"], ticks, layers, layer_fwd_s, layer_bwd_s))
    if s["data"] > 1:
        grads = GRAD_BYTES * params_per_chip(model, mesh)
        costs.append(_priced("data", links["data"], [("all-reduce", grads, 1)]))
    if t > 1:
        activation = ACTIVATION_BYTES * micro_tokens * model.embed
        count = ticks * layers * (6 if layout.remat == "full" else 4)
        costs.append(_priced("tensor", links["tensor"], [("all-reduce", activation, count)]))
    if p > 1:
        activation = ACTIVATION_BYTES * micro_tokens * model.embed
        costs.append(_priced("stage", links["stage"], [("collective-permute", activation, 2 * ticks)]))
    if s["expert"] > 1:
        traffic = theory.moe_traffic(
            int(micro_tokens), model.embed, model.experts, model.top_k, s["expert"], model.capacity_factor
        )
        buffer = ACTIVATION_BYTES * traffic.capacity * model.experts * model.embed
        costs.append(_priced("expert", links["expert"], [("all-to-all", buffer, 4 * ticks * layers)]))
    return Estimate(
        layout,
        memory(problem, layout),
        flops,
        block_s + vocab_s,
        bubble_s,
        tuple(costs),
        model_flops(model, problem.tokens),
        chip.hbm_bytes,
        peak=chip.peak_bf16_flops,
    )


def _fsdp(problem, layout, link, ticks, layers, layer_fwd_s, layer_bwd_s) -> AxisCost:
    """ZeRO-3 over fsdp: per layer and tick, gather forward, gather and reduce-scatter backward, overlapped."""
    model, mesh = problem.model, layout.mesh
    weights = PARAM_BYTES * _layer_gathered(model, mesh)
    gather = _seconds("all-gather", weights, link)
    scatter = _seconds("reduce-scatter", weights, link)
    per_layer = ticks * layers
    exposed = per_layer * (max(0.0, gather - layer_fwd_s) + max(0.0, gather + scatter - layer_bwd_s))
    # the vocabulary tables: gathered before use (the unembedding again for the loss's recompute), reduce-scattered
    tables = PARAM_BYTES * model.vocab * model.embed
    table_kinds = [("all-gather", tables, 1 if model.tied else 3), ("reduce-scatter", tables, 1 if model.tied else 2)]
    tables_s = sum(n * _seconds(kind, size, link) for kind, size, n in table_kinds)
    return AxisCost(
        "fsdp",
        link.text,
        3 * per_layer + sum(n for _, _, n in table_kinds),
        3 * per_layer * weights + sum(n * size for _, size, n in table_kinds),
        per_layer * (2 * gather + scatter) + tables_s,
        exposed + tables_s,
    )


def _priced(axis: str, link, collectives) -> AxisCost:
    """Collectives (kind, S, count) that the step waits for whole."""
    seconds = sum(n * _seconds(kind, size, link) for kind, size, n in collectives)
    return AxisCost(
        axis, link.text, sum(n for *_, n in collectives), sum(n * size for _, size, n in collectives), seconds, seconds
    )


# --------------------------------------------------------------------------- links


@dataclass(frozen=True)
class _Link:
    """An axis on the pod: its ICI placement within a slice, and the slices it crosses."""

    ici: Placement | None  # None: the axis has no ICI part (all its ways are slices)
    dcn: int  # slices crossed (1: none)
    chip: object

    @property
    def text(self) -> str:
        parts = [str(self.ici)] if self.ici is not None and self.ici.devices > 1 else []
        if self.dcn > 1:
            parts.append(f"DCN x{self.dcn}")
        return " + ".join(parts) or "-"


def _seconds(kind: str, size: float, link: _Link) -> float:
    """One collective of S = `size` per device: ICI tier, then the DCN tier on the ICI shard."""
    total, ici_ways = 0.0, 1
    if link.ici is not None and link.ici.devices > 1:
        ici_ways = link.ici.devices
        where = link.ici
        if where.network == "ici":
            total += theory.predict_on_rings(kind, size, link.chip, where.extents, where.wraps).seconds
        elif where.network not in ("chip", "host"):
            total += theory.predict_on_switch(kind, size, link.chip, where.devices).seconds
    if link.dcn > 1:
        share = size if kind == "collective-permute" else size / ici_ways
        total += theory.predict_on_switch(kind, share, link.chip, link.dcn, network="dcn").seconds
    return total


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
    """Where each axis of a one-slice mesh of `shape` runs, on libtpu's compile-only chips of `topology`."""
    from lab.devices import topology_devices  # local: starts libtpu's topology client, which memory never needs

    mesh = MeshSpec(**dict(zip(AXES, shape))).build(topology_devices(topology))
    return {a: (placement(mesh, (a,)) if n > 1 else None) for a, n in zip(AXES, shape)}


def axis_seconds(estimate_: Estimate) -> dict[str, float]:
    """Exposed seconds per axis."""
    return {a.axis: a.exposed_s for a in estimate_.axes}
