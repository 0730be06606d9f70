"""A small decoder-only transformer, written only against logical axes.

Every parameter is declared with the *meaning* of each dimension, e.g.
``nnx.Param(w, out_sharding=("embed", "mlp"))``; the model never names a mesh
axis. A `Layout` (see `lab.parallel.layout`) decides at run time where each
weight lives and how it reaches a matmul: `layout.use(param)` is the single
point where a sharded weight is gathered (ZeRO-3's all-gather) and cast to the
compute dtype, and `layout.remat_policy` decides what the backward pass keeps.

Declare abstractly, create sharded (the jax-llm-examples / nanodo pattern):
`abstract_model(config)` gives shapes, dtypes and logical axes without
allocating; `create_params(config, shardings)` runs the initializers under
``jit(out_shardings=...)``, so each device only ever materializes its shard
of a 1B-parameter model.

The blocks are stacked on a leading ``layers`` axis (``nnx.vmap`` at creation,
``nnx.scan`` in the forward pass): XLA compiles one block however deep the
model, and per-layer collectives appear once in a while loop. `run_blocks`
runs any such stack, so a pipeline stage runs its L/P layers with the same code
(`lab.parallel.pipeline.spmd`). Parameter count,
with V vocab, D embed, H heads of K dims, F mlp, L layers (no biases, untied
embeddings, RMSNorm scales, rotary positions):
    Ψ = 2VD + L (4DHK + 2DF + 2D) + D.

Tensor parallelism needs one thing from the model: a matmul that contracts a
dimension the layout may split (``heads`` in the attention's output
projection, ``mlp`` in W_out: Megatron's row-parallel matmuls) says where its
result goes, ``out_sharding=layout.activation_sharding(logical axes)``; on an
Explicit mesh that is the all-reduce over ``tensor``.

The family covers today's open decoders, declared by `ModelConfig` fields
whose defaults give the original model above: grouped-query attention
(``kv_heads`` G < H shared K/V heads; Ainslie et al. 2023, GQA), a gated MLP
(``feed_forward="swiglu"``: silu(x W_gate) * (x W_in) W_out, Shazeer 2020; or
``"geglu"``) or a plain one with its activation named (``"gelu"``, ``"relu"``,
``"silu"``), a parallel block (``block="parallel"``: attention and MLP read
one norm and add to the residual together, GPT-J / PaLM), tied embeddings
(``tied=True``: the unembedding is the embedding table transposed), and the
attention as XLA's dot product (``attention="xla"``) or the Pallas TPU flash
kernel (``attention="flash"``, `jax.experimental.pallas.ops.tpu.flash_attention`,
per device under ``shard_map``; TPU targets only). In general
    Ψ = (2 - tied) VD + L (2DK(H + G) + (2 + gated) DF + n_norms D) + D.

An MoE model (``experts > 0``) replaces every MLP by E expert MLPs of width F
(plain or gated, as ``feed_forward`` says: Mixtral's and Qwen3's are SwiGLU)
and a top-k router (GShard, Lepikhin et al. 2020; the routing, balancing loss
and load counts of `lab.moe`, the buffers of
`lab.parallel.expert`): Ψ = 2VD + L (4DHK + DE + (2 + gated) EDF + 2D) + D, of
which a token uses the k experts it is routed to; ``dropless`` replaces the
buffers by MaxText's sorted rows and grouped matmuls (`lab.ragged`), the same
numbers as a buffer that drops nothing. ``qk_norm`` adds an RMSNorm
of each query and key head (Qwen3): 2K more per layer.

The MoE stacks of DeepSeek-V3 and Llama 4 add four fields: ``shared_experts``
(S experts every token goes through, one MLP S x F wide beside the routed
ones: + (2 + gated) DSF per MoE layer), ``dense_layers`` (the first layers
dense, a scan of their own before the others), ``moe_every`` (an MoE layer
every n, the n - 1 before it dense: the scan then runs over periods of n
layers, `Period`) and ``dense_mlp`` (the dense layers' width). ``kv_rank``
makes the attention DeepSeek's multi-head latent attention (`LatentAttention`:
K and V from a C-wide latent, the queries from a ``q_rank``-wide one, R =
``rope_dim`` rotary channels apart): D·Q + Q + Q·H(K + R) + D(C + R) + C +
2CHK + HKD in place of 2DK(H + G).

GPT-OSS adds three: ``biases`` (each projection adds one: + (H + 2G)K + D per
attention, + (1 + gated)F + D per MLP or expert, + E per router), ``sinks`` (a
learned logit per head that joins each softmax's denominator, a key with no
value: + H per layer; `Mixing`) and ``window`` (a query sees itself and the
window - 1 tokens before it), with ``global_every`` (every n-th layer attends
to all earlier tokens: the scan's `Period` then holds a windowed and a global
layer). The TPU kernel of such a layer is Pallas's splash attention, whose
mask skips the tiles outside the window; XLA's dot product masks the scores.

Over 500 lines, and one concept: the decoder family, each variant a few lines of
the same blocks (attention, MLP, MoE, norm) that share one parameter formula.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from lab.errors import LabError
from lab.moe import Balance, LoadCounts, RouterConfig, Routing, balance_loss, combine, dispatch, load_counts, route
from lab.ragged import NO_EXPERT_AXIS, dropless
from lab.rules import (
    logical_axes,  # noqa: F401 - declared here, read by the Layout there; lab.model.logical_axes stays importable
    spec_axes,
)


@dataclass(frozen=True)
class ModelConfig:
    """Sizes of the transformer; the default is small enough for 8 emulated CPU devices.

    ``experts > 0`` makes every block's MLP a mixture of that many experts, each ``mlp`` wide.
    """

    vocab: int = 256
    embed: int = 64
    heads: int = 4
    head_dim: int = 16
    mlp: int = 256
    layers: int = 2
    seq: int = 32
    experts: int = 0  # 0: dense MLP blocks
    top_k: int = 2
    capacity_factor: float | None = 1.25  # slots per expert per sequence: ceil(S·k/E · factor); None drops nothing
    dropless: bool = False  # no slots: assignments sorted by expert, ragged matmuls (MaxText's sparse_matmul)
    aux_loss: float = 0.01  # α of the Switch load-balancing loss added to the training loss
    kv_heads: int | None = None  # G key/value heads shared by H/G query heads each (GQA); None: G = H (multi-head)
    feed_forward: str = "gelu"  # plain MLP with this activation (gelu, relu, silu) or a gated one (swiglu, geglu)
    block: str = "sequential"  # sequential (Llama: attention, then MLP) or parallel (GPT-J/PaLM: both from one norm)
    tied: bool = False  # the unembedding is the embedding table, transposed
    attention: str = "xla"  # xla (dot product, scores materialized) or flash (the Pallas TPU kernel; TPU only)
    qk_norm: bool = False  # RMSNorm of each query and key head before the rotation (Qwen3, OLMo 2, Gemma 3)
    shared_experts: int = 0  # experts every token goes through besides its top k, each `mlp` wide (DeepSeek, Llama 4)
    dense_layers: int = 0  # an MoE model's first layers, with a dense MLP instead (DeepSeek-V3: 3)
    moe_every: int = 1  # an MoE layer every n layers, the n - 1 before it dense (Llama 4 Maverick: 2)
    dense_mlp: int = 0  # the width of an MoE model's dense layers (0: `mlp`)
    kv_rank: int = 0  # multi-head latent attention: K and V from one compressed width (DeepSeek-V2/V3); 0: off
    q_rank: int = 0  # MLA's compressed query width (0: the queries from the full width)
    rope_dim: int = 0  # MLA's rotary channels of each query and key head, beside head_dim (the key's shared by heads)
    biases: bool = False  # each projection adds a bias: the attention's q, k, v and out, the MLPs', the router's
    sinks: bool = False  # a learned logit per attention head in each softmax's denominator (GPT-OSS's sinks)
    window: int = 0  # sliding-window attention: a query sees itself and the window - 1 tokens before it; 0: off
    global_every: int = 0  # with a window: every n-th layer attends to every earlier token (GPT-OSS: 2); 0: none

    def __post_init__(self) -> None:
        if self.experts < 0:
            raise LabError(f"experts={self.experts}: use 0 for a dense model or a positive number of experts")
        if self.experts:
            self.router  # noqa: B018 - RouterConfig refuses a bad top-k or capacity factor
        if self.feed_forward not in FEED_FORWARDS:
            raise LabError(f"feed_forward={self.feed_forward!r}: use one of {', '.join(FEED_FORWARDS)}")
        if self.block not in BLOCKS:
            raise LabError(f"block={self.block!r}: use one of {', '.join(BLOCKS)}")
        if self.attention not in ATTENTIONS:
            raise LabError(f"attention={self.attention!r}: use one of {', '.join(ATTENTIONS)}")
        if self.kv_heads is not None and (self.kv_heads < 1 or self.heads % self.kv_heads):
            raise LabError(
                f"kv_heads={self.kv_heads} must divide heads={self.heads} (each K/V head serves heads/kv_heads queries)"
            )
        self._check_moe_layers()
        self._check_latent_attention()
        self._check_window()

    def _check_moe_layers(self) -> None:
        mixed = {
            "shared_experts": self.shared_experts,
            "dense_layers": self.dense_layers,
            "moe_every": self.moe_every - 1,
        }
        if any(v < 0 for v in mixed.values()) or self.moe_every < 1:
            raise LabError("shared_experts and dense_layers must be 0 or more, moe_every 1 or more")
        given = [name for name, value in mixed.items() if value]
        if given and not self.experts:
            raise LabError(f"{', '.join(given)}: a dense model has no MoE layers to shape; give experts=E too")
        moe_part = self.layers - self.dense_layers
        if self.experts and (moe_part < self.moe_every or moe_part % self.moe_every):
            raise LabError(
                f"layers={self.layers} after dense_layers={self.dense_layers} must be a positive multiple of "
                f"moe_every={self.moe_every} (each period: moe_every - 1 dense layers, then an MoE one)"
            )

    def _check_window(self) -> None:
        if self.window < 0 or self.global_every < 0:
            raise LabError(
                f"window={self.window}, global_every={self.global_every}: give a window of 0 or more tokens and "
                "global_every of 0 or more layers"
            )
        if self.global_every and not self.window:
            raise LabError(f"global_every={self.global_every} alternates windowed and global layers: give window too")
        if self.window and self.dense_layers:
            raise LabError("window with dense_layers: a windowed stack after a dense prefix is not modelled")
        if (self.layers - self.dense_layers) % self.period:
            raise LabError(
                f"layers={self.layers} must be a multiple of global_every={self.global_every} "
                f"(and of moe_every={self.moe_every}): the scan runs over periods of {self.period} layers"
            )

    def _check_latent_attention(self) -> None:
        if not self.kv_rank:
            if self.q_rank or self.rope_dim:
                raise LabError("q_rank and rope_dim shape latent attention: give kv_rank too (DeepSeek-V3: 512)")
            return
        if self.kv_heads not in (None, self.heads) or self.biases:
            raise LabError(
                f"kv_rank={self.kv_rank}: latent attention has a key and value per head and no biases; drop kv_heads "
                "and biases"
            )
        if self.rope_dim < 2 or self.rope_dim % 2 or self.head_dim % 2:
            raise LabError(f"kv_rank={self.kv_rank}: give an even rope_dim of 2 or more (DeepSeek-V3: 64)")

    @property
    def groups(self) -> int:
        """G: the key/value heads (H for multi-head attention)."""
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def gated(self) -> bool:
        return self.feed_forward in _GATED

    @property
    def router(self) -> RouterConfig:
        """How tokens choose experts (MoE models only); over capacity, the latest tokens drop, as MaxText drops."""
        return RouterConfig(self.experts, self.top_k, self.capacity_factor, dropless=self.dropless, drop_policy="token")

    @property
    def dense_width(self) -> int:
        """The MLP width of a dense layer (an MoE model's dense layers may differ from its experts)."""
        return self.dense_mlp or self.mlp

    @property
    def moe_layers(self) -> int:
        """The layers whose MLP is a mixture of experts."""
        return (self.layers - self.dense_layers) // self.moe_every if self.experts else 0

    @property
    def period(self) -> int:
        """The layers the scan's body runs: 1, or a `Period` as long as the least common multiple of `moe_every`
        (an MoE layer every n) and `global_every` (a global-attention layer every n)."""
        return math.lcm(self.moe_every, self.global_every or 1)

    @property
    def layer_pattern(self) -> tuple[tuple[bool, int], ...]:
        """Each layer of a period as (MoE, window): layer i (from 1) is an MoE one when `moe_every` divides i, and
        attends globally (window 0) when `global_every` divides i (GPT-OSS: windowed, global, windowed, ...)."""
        return tuple(
            (
                bool(self.experts) and i % self.moe_every == 0,
                0 if self.global_every and i % self.global_every == 0 else self.window,
            )
            for i in range(1, self.period + 1)
        )

    @property
    def scan_length(self) -> int:
        """How many times the layers' scan runs its body: once per layer, or per `period` of layers, after the
        `dense_layers` (their own scan)."""
        return (self.layers - self.dense_layers) // self.period

    def with_scan_length(self, n: int) -> ModelConfig:
        """This model with its scan `n` long (its dense prefix as it is): the shallower program depth reading
        compiles."""
        return replace(self, layers=self.dense_layers + n * self.period)

    @property
    def parameters(self) -> int:
        """Ψ: the embeddings, the blocks, the final norm (see the module docstring)."""
        return (1 if self.tied else 2) * self.vocab * self.embed + self.block_parameters + self.embed

    @property
    def block_parameters(self) -> int:
        """The weights inside the layers' scans (attention, MLP or experts and router, the norms)."""
        norms = (1 if self.block == "parallel" else 2) * self.embed + (2 * self.head_dim if self.qk_norm else 0)
        dense = (self.layers - self.moe_layers) * self._mlp_parameters(self.dense_width)
        return self.layers * (self._attention_parameters + norms) + dense + self.moe_layers * self._moe_parameters

    @property
    def active_parameters(self) -> int:
        """The parameters one token goes through: Ψ with k experts in place of E (Ψ itself for a dense model)."""
        return self.parameters - self.moe_layers * (self.experts - self.top_k) * self._mlp_parameters(self.mlp)

    @property
    def _attention_parameters(self) -> int:
        """Q, K, V and the output projection: 2DK(H + G); latent attention's down- and up-projections instead."""
        d, h, k = self.embed, self.heads, self.head_dim
        sinks = h if self.sinks else 0
        if not self.kv_rank:
            biases = (h + 2 * self.groups) * k + d if self.biases else 0
            return 2 * d * k * (h + self.groups) + biases + sinks
        r, c = self.rope_dim, self.kv_rank
        query = self.q_rank * (d + 1 + h * (k + r)) if self.q_rank else d * h * (k + r)
        return query + d * (c + r) + c + c * h * 2 * k + h * k * d + sinks

    def _mlp_parameters(self, width: int) -> int:
        """2DF for a plain MLP or expert of width F, 3DF for a gated one; with biases, each matrix's output's."""
        matrices = 3 if self.gated else 2
        biases = (matrices - 1) * width + self.embed if self.biases else 0
        return matrices * self.embed * width + biases

    @property
    def _moe_parameters(self) -> int:
        """One MoE layer: the router DE (+ E biases), E experts and the shared ones."""
        router = self.embed + (1 if self.biases else 0)
        return self.experts * (router + self._mlp_parameters(self.mlp)) + (
            self._mlp_parameters(self.shared_width) if self.shared_experts else 0
        )

    @property
    def shared_width(self) -> int:
        """The shared experts as one MLP (DeepSeek-V2's): `shared_experts` x `mlp` wide."""
        return self.shared_experts * self.mlp


FEED_FORWARDS = ("gelu", "relu", "silu", "swiglu", "geglu")
_GATED = {"swiglu": "silu", "geglu": "gelu"}  # gated MLPs and the activation of their gate
_ACTIVATIONS = {"gelu": jax.nn.gelu, "relu": jax.nn.relu, "silu": jax.nn.silu}
BLOCKS = ("sequential", "parallel")


def _activation(config: ModelConfig) -> Callable[[jax.Array], jax.Array]:
    """The MLP's activation: the named one, or the gate's of a gated MLP."""
    return _ACTIVATIONS[_GATED.get(config.feed_forward, config.feed_forward)]


ATTENTIONS = ("xla", "flash")


PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(),  # 0.13 M: tests and cpu:8 pages
    "tiny-moe": ModelConfig(mlp=64, experts=8, top_k=2),  # 0.20 M, 8 experts of width 64, top-2: tests and cpu:8 pages
    "small": ModelConfig(
        vocab=1024, embed=256, heads=8, head_dim=32, mlp=1024, layers=4, seq=128
    ),  # 3.7 M: cpu timings
    "125m": ModelConfig(vocab=32768, embed=768, heads=12, head_dim=64, mlp=3072, layers=12, seq=1024),
    "350m": ModelConfig(vocab=32768, embed=1024, heads=16, head_dim=64, mlp=4096, layers=24, seq=1024),
    "1b": ModelConfig(vocab=32768, embed=2048, heads=16, head_dim=128, mlp=8192, layers=16, seq=2048),  # compile-only
}


def preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise LabError(f"unknown model preset {name!r}; use one of {', '.join(PRESETS)}")
    return PRESETS[name]


class Parallelism(Protocol):
    """What the model needs from a parallelism strategy: the interface `lab.parallel.layout.Layout` implements.

    A layout may also have ``activation_sharding(axes) -> NamedSharding``, where activations with these logical axes go
    (see `activation_sharding`); one without it (one device, a shard_map body) leaves them where the matmuls put them.
    One that places activations takes ``use(param, beside=x)`` too: `x` is the activation an elementwise weight (a
    norm's scale) meets, whose split decides over which axes the weight's gradient is summed.
    """

    compute_dtype: jnp.dtype

    def use(self, param: nnx.Param) -> jax.Array:
        """The weight as a matmul uses it: gathered, cast to the compute dtype."""
        ...

    @property
    def remat_policy(self) -> Callable | None:
        """The checkpoint policy for one block (None: save every residual)."""
        ...


@dataclass(frozen=True)
class WholeWeights:
    """The simplest `Parallelism`: every weight used as stored (one device, or replicated)."""

    compute_dtype: jnp.dtype = jnp.float32
    remat_policy: Callable | None = None

    def use(self, param: nnx.Param) -> jax.Array:
        return param[...].astype(self.compute_dtype)


def activation_sharding(layout: Parallelism, axes: tuple[str, ...]) -> jax.sharding.NamedSharding | None:
    """Where `layout` puts an activation with these logical axes; None for a layout that does not say."""
    where = getattr(layout, "activation_sharding", None)
    return None if where is None else where(axes)


def _move(x: jax.Array, layout: Parallelism, axes: tuple[str, ...]) -> jax.Array:
    """`x` resharded to where `layout` puts an activation with logical `axes` (by whatever collective that takes)."""
    sharding = activation_sharding(layout, axes)
    return x if sharding is None else jax.reshard(x, sharding)


def sequence_whole(x_BSD: jax.Array, layout: Parallelism) -> jax.Array:
    """The residual stream whole along the sequence: with sequence parallelism (a layout's ``sequence_parallel``),
    the all-gather before a sub-layer's column-parallel matmuls (and before the head); otherwise `x_BSD` itself."""
    return _move(x_BSD, layout, _BSD_WHOLE) if getattr(layout, "sequence_parallel", False) else x_BSD


def sequence_split(x_BSD: jax.Array, layout: Parallelism) -> jax.Array:
    """The residual stream where the blocks carry it: with sequence parallelism split along the sequence over
    ``tensor`` (a local slice of an array that is whole there); otherwise `x_BSD` itself."""
    return _move(x_BSD, layout, _BSD) if getattr(layout, "sequence_parallel", False) else x_BSD


def row_parallel(equation: str, lhs: jax.Array, weight: jax.Array, layout: Parallelism) -> jax.Array:
    """A matmul back into the residual stream contracting a dimension ``tensor`` may split (Megatron's row-parallel
    attention output and W_out): each device holds a partial sum, completed by an all-reduce (the out_sharding),
    or with sequence parallelism by a reduce-scatter along the sequence. The latter is written as the partial sums
    (unreduced over ``tensor``) resharded, so that autodiff transposes it into the all-gather of the cotangent."""
    out = activation_sharding(layout, _BSD)
    if not getattr(layout, "sequence_parallel", False):
        return jnp.einsum(equation, lhs, weight, out_sharding=out)
    whole = activation_sharding(layout, _BSD_WHOLE)
    partial = jnp.einsum(equation, lhs, weight, out_sharding=whole.update(spec=P(*whole.spec, unreduced={"tensor"})))
    return jax.reshard(partial, out)


def _mesh_axes(x: jax.Array, dim: int) -> set[str]:
    """The mesh axes dimension `dim` of `x` is split over (none without a mesh)."""
    partitions = jax.typeof(x).sharding.spec.partitions
    return spec_axes(P(partitions[dim])) if dim < len(partitions) else set()


def _platform(layout: Parallelism) -> str:
    """The platform the program is compiled for: the layout's mesh's devices' (this process's without one)."""
    mesh = getattr(layout, "mesh", None)
    return mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()


def _param(rngs: nnx.Rngs, init, shape: tuple[int, ...], axes: tuple[str, ...]) -> nnx.Param:
    return nnx.Param(init(rngs.params(), shape, jnp.float32), out_sharding=axes)


def _fan_in(in_axis, out_axis):
    return nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=in_axis, out_axis=out_axis)


class RMSNorm(nnx.Module):
    """x / rms(x) * scale over the last axis, computed in fp32 (Zhang & Sennrich 2019): the model width, each
    attention head's (``axis="head_dim"``, the query and key norms), or a latent attention's compressed width
    (``axis="latent"``, ``width=`` it)."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs, axis: str = "embed", width: int = 0):
        width = width or (config.embed if axis == "embed" else config.head_dim)
        self.scale = _param(rngs, nnx.initializers.ones, (width,), (axis,))

    def __call__(self, x: jax.Array, layout: Parallelism) -> jax.Array:
        wide = x.astype(jnp.float32)
        normed = wide * jax.lax.rsqrt(jnp.mean(wide * wide, axis=-1, keepdims=True) + 1e-6)
        return _elementwise(normed, self.scale, layout, x).astype(x.dtype)


def _elementwise(
    x: jax.Array, weight: nnx.Param, layout: Parallelism, beside: jax.Array, equation: str = ""
) -> jax.Array:
    """x * weight over x's trailing axes (or as `equation` says), in x's dtype. An einsum, not a broadcast multiply:
    JAX lets only a dot consume a reduced (replicated, gradient-unreduced) weight, which is what `use` gives."""
    places = getattr(layout, "activation_sharding", None) is not None  # then `use` takes `beside` (Parallelism)
    w = (layout.use(weight, beside=beside) if places else layout.use(weight)).astype(x.dtype)
    trailing = "wxyz"[-w.ndim :]
    return jnp.einsum(equation or f"...{trailing},{trailing}->...{trailing}", x, w)


def _plus_bias(y: jax.Array, module: nnx.Module, name: str, layout: Parallelism, equation: str = "") -> jax.Array:
    """y + the module's bias `name` (over y's trailing axes, or as the einsum `equation` of y's ones and the bias
    places it), or y itself when the model has no biases."""
    bias = getattr(module, name, None)
    return y if bias is None else y + _elementwise(jnp.ones_like(y), bias, layout, y, equation)


def _bias(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str, ...]) -> nnx.Param:
    return _param(rngs, nnx.initializers.zeros, shape, axes)


def rotary(x_BSHK: jax.Array) -> jax.Array:
    """Rotary position embedding (Su et al. 2021, RoFormer, eq. 34): rotate pairs of channels by position."""
    seq, half = x_BSHK.shape[1], x_BSHK.shape[-1] // 2
    frequencies = 10_000.0 ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle_SK = jnp.arange(seq, dtype=jnp.float32)[:, None] * frequencies[None, :]
    cos, sin = jnp.cos(angle_SK)[None, :, None, :], jnp.sin(angle_SK)[None, :, None, :]
    first, second = x_BSHK[..., :half].astype(jnp.float32), x_BSHK[..., half:].astype(jnp.float32)
    return jnp.concatenate([first * cos - second * sin, first * sin + second * cos], axis=-1).astype(x_BSHK.dtype)


class Attention(nnx.Module):
    """Causal self-attention: H query heads, G key/value heads (G = H: multi-head; G < H: grouped-query)."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs, window: int = 0):
        d, h, g, k = config.embed, config.heads, config.groups, config.head_dim
        self.query = _param(rngs, _fan_in(0, (1, 2)), (d, h, k), ("embed", "heads", "head_dim"))
        # G heads carry the logical axis `heads` too: a tensor axis splits the K/V heads as it splits the queries
        self.key = _param(rngs, _fan_in(0, (1, 2)), (d, g, k), ("embed", "heads", "head_dim"))
        self.value = _param(rngs, _fan_in(0, (1, 2)), (d, g, k), ("embed", "heads", "head_dim"))
        self.out = _param(rngs, _fan_in((0, 1), 2), (h, k, d), ("heads", "head_dim", "embed"))
        if config.biases:
            self.query_bias = _bias(rngs, (h, k), ("heads", "head_dim"))
            self.key_bias = _bias(rngs, (g, k), ("heads", "head_dim"))
            self.value_bias = _bias(rngs, (g, k), ("heads", "head_dim"))
            self.out_bias = _bias(rngs, (d,), ("embed",))
        if config.qk_norm:
            self.query_norm = RMSNorm(config, rngs, "head_dim")
            self.key_norm = RMSNorm(config, rngs, "head_dim")
        self.mixing = Mixing(config, rngs, window)
        self.qk_norm = config.qk_norm

    def __call__(self, x_BSD: jax.Array, layout: Parallelism) -> jax.Array:
        # the projections' outputs carry MaxText's names, for a remat policy that offloads them (lab.parallel.layout)
        q_BSHK = jnp.einsum("bsd,dhk->bshk", x_BSD, layout.use(self.query))
        q_BSHK = checkpoint_name(_plus_bias(q_BSHK, self, "query_bias", layout), "query_proj")
        k_BSGK = jnp.einsum("bsd,dgk->bsgk", x_BSD, layout.use(self.key))
        k_BSGK = checkpoint_name(_plus_bias(k_BSGK, self, "key_bias", layout), "key_proj")
        if self.qk_norm:
            q_BSHK, k_BSGK = self.query_norm(q_BSHK, layout), self.key_norm(k_BSGK, layout)
        q_BSHK, k_BSGK = rotary(q_BSHK), rotary(k_BSGK)
        v_BSGK = jnp.einsum("bsd,dgk->bsgk", x_BSD, layout.use(self.value))
        v_BSGK = checkpoint_name(_plus_bias(v_BSGK, self, "value_bias", layout), "value_proj")
        mixed_BSD = self.mixing.project(q_BSHK, k_BSGK, v_BSGK, self.out, layout)
        return _plus_bias(mixed_BSD, self, "out_bias", layout)


class Mixing(nnx.Module):
    """What the scores of a layer's attention see and how its kernel computes them: causal, or within a sliding
    `window` (Longformer's local attention, Beltagy et al. 2020; GPT-OSS's every other layer), and with a learned
    sink logit per head in each softmax's denominator (GPT-OSS; Xiao et al. 2023, attention sinks), by the kernel
    the config names."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs, window: int = 0):
        if config.sinks:
            self.sinks = _bias(rngs, (config.heads,), ("heads",))
        self.window, self.kernel = window, config.attention

    def project(self, q_BSHK, k_BSGK, v_BSGK, out: nnx.Param, layout: Parallelism) -> jax.Array:
        """The attention of q over k and v, then the row-parallel output projection."""
        sinks_BH = None
        if hasattr(self, "sinks"):  # [B, H]: each sequence's copy, split as the queries' heads are
            sinks_BH = _plus_bias(jnp.zeros_like(q_BSHK[:, 0, :, 0], dtype=jnp.float32), self, "sinks", layout)
        if self.kernel == "flash":
            mixed_BSHK = flash_attention(q_BSHK, k_BSGK, v_BSGK, self.window, sinks_BH)
        elif k_BSGK.shape[2] == q_BSHK.shape[2]:
            mixed_BSHK = _dot_attention(q_BSHK, k_BSGK, v_BSGK, self.window, sinks_BH)
        else:
            mixed_BSHK = _grouped_dot_attention(q_BSHK, k_BSGK, v_BSGK, layout, self.window, sinks_BH)
        mixed_BSHK = checkpoint_name(mixed_BSHK, "context")  # the attention's output, before its projection
        return checkpoint_name(row_parallel("bshk,hkd->bsd", mixed_BSHK, layout.use(out), layout), "out_proj")


class LatentAttention(nnx.Module):
    """Multi-head latent attention (DeepSeek-V2, arXiv:2405.04434, Section 2.1), as trained (not absorbed).

    Keys and values come from one compressed width C (`kv_rank`) per token, normed, then expanded per head; the
    queries likewise from `q_rank` (or from the model width). Rotary positions live in R (`rope_dim`) channels
    apart: each query head has its own, the key one set shared by every head, taken from the model width beside
    the latent. Each head then attends with K + R channels and reads K-wide values.
    """

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs, window: int = 0):
        d, h, k, r, c = config.embed, config.heads, config.head_dim, config.rope_dim, config.kv_rank
        if config.q_rank:
            self.query_down = _param(rngs, _fan_in(0, 1), (d, config.q_rank), ("embed", None))
            self.query_norm = RMSNorm(config, rngs, "latent", config.q_rank)
        widths = config.q_rank or d
        self.query = _param(
            rngs, _fan_in(0, (1, 2)), (widths, h, k + r), ("latent" if config.q_rank else "embed", "heads", "head_dim")
        )
        self.kv_down = _param(rngs, _fan_in(0, 1), (d, c + r), ("embed", None))
        self.kv_norm = RMSNorm(config, rngs, "latent", c)
        # each head's key (its rotary channels apart) and value from one up-projection, as MaxText's ``wkv_b``; as two,
        # the latent's gradient sums two matmuls in one fusion that libtpu takes ~13 s longer to lower (2 cores)
        self.key_value = _param(rngs, _fan_in(0, (1, 2)), (c, h, 2 * k), ("latent", "heads", "head_dim"))
        self.out = _param(rngs, _fan_in((0, 1), 2), (h, k, d), ("heads", "head_dim", "embed"))
        self.mixing = Mixing(config, rngs, window)
        self.compressed_queries, self.rank = bool(config.q_rank), c

    def __call__(self, x_BSD: jax.Array, layout: Parallelism) -> jax.Array:
        if self.compressed_queries:
            x_BSQ = self.query_norm(jnp.einsum("bsd,dq->bsq", x_BSD, layout.use(self.query_down)), layout)
            q_BSHJ = jnp.einsum("bsq,qhj->bshj", x_BSQ, layout.use(self.query))
        else:
            q_BSHJ = jnp.einsum("bsd,dhj->bshj", x_BSD, layout.use(self.query))
        q_BSHJ = checkpoint_name(q_BSHJ, "query_proj")
        latent_BSC = jnp.einsum("bsd,dc->bsc", x_BSD, layout.use(self.kv_down))
        c_BSC = self.kv_norm(latent_BSC[..., : self.rank], layout)
        kv_BSHK = jnp.einsum("bsc,chk->bshk", c_BSC, layout.use(self.key_value))
        k = kv_BSHK.shape[-1] // 2
        k_BSHK = checkpoint_name(kv_BSHK[..., :k], "key_proj")
        v_BSHK = checkpoint_name(kv_BSHK[..., k:], "value_proj")
        q_BSHJ = jnp.concatenate([q_BSHJ[..., :k], rotary(q_BSHJ[..., k:])], axis=-1)
        rope_BSHR = jnp.broadcast_to(
            rotary(latent_BSC[:, :, None, self.rank :]), (*k_BSHK.shape[:3], q_BSHJ.shape[-1] - k)
        )
        k_BSHJ = jnp.concatenate([k_BSHK, _move(rope_BSHR, layout, _BSHK)], axis=-1)
        return self.mixing.project(q_BSHJ, k_BSHJ, v_BSHK, self.out, layout)


def _causal_softmax(scores: jax.Array, dtype, window: int = 0, sinks: jax.Array | None = None) -> jax.Array:
    """Softmax over the last axis (keys) of scores [..., S, T] with future keys masked (and those `window` or more
    tokens back), in fp32; a sink [...] adds exp(sink) to each row's denominator, a key no value stands behind."""
    seq = scores.shape[-1]
    query_S1, key_1T = jnp.arange(seq)[:, None], jnp.arange(seq)[None, :]
    seen_ST = (key_1T <= query_S1) & ((query_S1 - key_1T < window) if window else True)
    logits = jnp.where(seen_ST, scores, -1e30)
    if sinks is None:
        return jax.nn.softmax(logits, axis=-1).astype(dtype)
    sinks = sinks[..., None, None]
    top = jax.lax.stop_gradient(jnp.maximum(logits.max(axis=-1, keepdims=True), sinks))
    exp = jnp.exp(logits - top)
    return (exp / (exp.sum(axis=-1, keepdims=True) + jnp.exp(sinks - top))).astype(dtype)


def _dot_attention(q_BSHK, k_BSHK, v_BSHK, window: int = 0, sinks_BH: jax.Array | None = None) -> jax.Array:
    """XLA's dot-product attention: the [B, H, S, S] scores are materialized."""
    scores_BHST = jnp.einsum("bshk,bthk->bhst", q_BSHK, k_BSHK).astype(jnp.float32) / jnp.sqrt(q_BSHK.shape[-1])
    weights_BHST = _causal_softmax(scores_BHST, q_BSHK.dtype, window, sinks_BH)
    return jnp.einsum("bhst,bthk->bshk", weights_BHST, v_BSHK)


def _grouped_dot_attention(
    q_BSHK, k_BSGK, v_BSGK, layout: Parallelism, window: int = 0, sinks_BH: jax.Array | None = None
) -> jax.Array:
    """Grouped-query attention: query head g·R + r reads key/value head g (R = H/G queries per K/V head)."""
    b, s, h, k = q_BSHK.shape
    g = k_BSGK.shape[2]
    grouped = activation_sharding(layout, ("batch", None, "heads", None, "head_dim"))
    q_BSGRK = jnp.reshape(q_BSHK, (b, s, g, h // g, k), out_sharding=grouped)  # a split over tensor stays on G
    scores_BGRST = jnp.einsum("bsgrk,btgk->bgrst", q_BSGRK, k_BSGK).astype(jnp.float32) / jnp.sqrt(k)
    if sinks_BH is not None:
        sinks_BH = jnp.reshape(sinks_BH, (b, g, h // g), out_sharding=activation_sharding(layout, _BH_GROUPED))
    weights_BGRST = _causal_softmax(scores_BGRST, q_BSHK.dtype, window, sinks_BH)
    mixed_BSGRK = jnp.einsum("bgrst,btgk->bsgrk", weights_BGRST, v_BSGK)
    return jnp.reshape(mixed_BSGRK, (b, s, h, k), out_sharding=activation_sharding(layout, _BSHK))


FLASH_BLOCK = 512  # query and key block of the flash kernel (its default 128 makes a long sequence slow to compile)
_FLASH_BLOCK_NAMES = (
    "block_q",
    "block_k_major",
    "block_k",
    "block_q_major_dkv",
    "block_k_major_dkv",
    "block_k_dkv",
    "block_q_dkv",
    "block_k_major_dq",
    "block_k_dq",
    "block_q_dq",
)


_SPLASH_BLOCK_NAMES = ("block_q", "block_kv", "block_q_dkv", "block_kv_dkv", "block_q_dq", "block_kv_dq")


def check_flash_tiling(seq: int) -> int:
    """A sequence length the flash kernel tiles: blocks of min(FLASH_BLOCK, seq) tokens, each a multiple of the
    TPU's 128 lanes, dividing the sequence; refused before a compile that libtpu would fail midway."""
    block = min(FLASH_BLOCK, seq)
    if seq < 1 or block % 128 or seq % block:
        raise LabError(
            f"--seq {seq}: the flash attention kernel tiles the sequence in blocks of min({FLASH_BLOCK}, seq) tokens, "
            f"a multiple of 128; give a multiple of 128 up to {FLASH_BLOCK} and of {FLASH_BLOCK} beyond, "
            "or --attention xla"
        )
    return seq


def flash_head_width(width: int) -> int:
    """The head width the flash kernel takes for `width` channels: itself up to 128, else the next multiple of 128."""
    return width if width <= 128 else -(-width // 128) * 128


def flash_attention(
    q_BSHK: jax.Array, k_BSGK: jax.Array, v_BSGK: jax.Array, window: int = 0, sinks_BH: jax.Array | None = None
) -> jax.Array:
    """Causal attention by a Pallas TPU flash kernel (Dao et al. 2022), one device's heads at a time: the flash
    kernel, or, for a sliding `window` or sinks, which it does not take, the splash kernel (the block-sparse one
    MaxText runs), whose mask skips the tiles outside the window. Both in blocks of `FLASH_BLOCK` tokens.

    The kernel sees local arrays, so it runs under ``shard_map`` over whatever the inputs are split on (batch
    over the data axes, heads over ``tensor``); G < H K/V heads are repeated to H on each device first (the
    kernel wants equal head counts; the repeat is local because a split over ``tensor`` keeps whole groups).
    """
    scale = 1.0 / math.sqrt(q_BSHK.shape[-1])

    def local(q_bshk, k_bsgk, v_bsgk, *sinks_bh):
        repeats = q_bshk.shape[2] // k_bsgk.shape[2]
        q, k, v = (jnp.swapaxes(a, 1, 2) for a in (q_bshk, k_bsgk, v_bsgk))  # the kernels' [b, h, s, k]
        if repeats > 1:
            k, v = jnp.repeat(k, repeats, axis=1), jnp.repeat(v, repeats, axis=1)
        # the kernels want one head width for q, k and v, a multiple of 128 beyond 128: latent attention's (192 for
        # q and k, 128 for v) is zero-padded to it, which changes no score and no output (the scale is the unpadded)
        width, padded = v.shape[-1], flash_head_width(q.shape[-1])
        q, k, v = (jnp.pad(a, ((0, 0),) * 3 + ((0, padded - a.shape[-1]),)) for a in (q, k, v))
        if window or sinks_bh:
            mixed = _splash(q * jnp.asarray(scale, q.dtype), k, v, window, *sinks_bh)
        else:
            mixed = _flash(q, k, v, scale)
        return jnp.swapaxes(mixed[..., :width], 1, 2)

    operands = (q_BSHK, k_BSGK, v_BSGK) + (() if sinks_BH is None else (sinks_BH,))
    if jax.typeof(q_BSHK).sharding.mesh.empty:  # one device, no mesh: the kernel sees the whole arrays
        return local(*operands)
    specs = tuple(jax.typeof(a).sharding.spec for a in operands)
    # check_vma off: pallas_call does not track which mesh axes its outputs vary over
    return jax.shard_map(local, in_specs=specs, out_specs=specs[0], check_vma=False)(*operands)


def _flash(q_bhsk: jax.Array, k_bhsk: jax.Array, v_bhsk: jax.Array, scale: float) -> jax.Array:
    """The Pallas flash kernel, causal, on one device's [b, h, s, k] arrays."""
    # local: Pallas kernels are imported only by models that use them (TPU targets); CPU-only runs never load them
    from jax.experimental.pallas.ops.tpu import flash_attention as pallas_flash

    block = min(FLASH_BLOCK, q_bhsk.shape[2])
    blocks = pallas_flash.BlockSizes(block_b=1, **dict.fromkeys(_FLASH_BLOCK_NAMES, block))
    return pallas_flash.flash_attention(q_bhsk, k_bhsk, v_bhsk, causal=True, sm_scale=scale, block_sizes=blocks)


def _splash(q_bhsk, k_bhsk, v_bhsk, window: int, sinks_bh: jax.Array | None = None) -> jax.Array:
    """The Pallas splash kernel on one device's [b, h, s, k] arrays (queries already scaled): causal, or within
    `window` tokens back, with a sink logit per head; one sequence at a time (the kernel takes [h, s, k])."""
    # local, as the flash kernel's: Pallas kernels are imported only by models that use them (TPU targets)
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    heads, seq = q_bhsk.shape[1], q_bhsk.shape[2]
    mask = splash.LocalMask((seq, seq), (window - 1, 0), offset=0) if window else splash.CausalMask((seq, seq))
    block = min(FLASH_BLOCK, seq)
    sizes = splash.BlockSizes(**dict.fromkeys(_SPLASH_BLOCK_NAMES, block))
    kernel = splash.make_splash_mha(
        splash.MultiHeadMask([mask] * heads), block_sizes=sizes, head_shards=1, q_seq_shards=1
    )
    if sinks_bh is None:
        return jax.vmap(kernel)(q_bhsk, k_bhsk, v_bhsk)
    return jax.vmap(lambda q, k, v, sinks: kernel(q, k, v, sinks=sinks))(q_bhsk, k_bhsk, v_bhsk, sinks_bh)


class MLP(nnx.Module):
    """Feed-forward D -> F -> D: act(x W_in) W_out, or gated, (act(x W_gate) * x W_in) W_out (SwiGLU, GeGLU)."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs, width: int = 0):
        d, f = config.embed, width or config.mlp
        self.w_in = _param(rngs, _fan_in(0, 1), (d, f), ("embed", "mlp"))
        if config.gated:
            self.w_gate = _param(rngs, _fan_in(0, 1), (d, f), ("embed", "mlp"))
        self.w_out = _param(rngs, _fan_in(0, 1), (f, d), ("mlp", "embed"))
        if config.biases:
            self.in_bias, self.out_bias = _bias(rngs, (f,), ("mlp",)), _bias(rngs, (d,), ("embed",))
            if config.gated:
                self.gate_bias = _bias(rngs, (f,), ("mlp",))
        self.gated = config.gated
        self.activation = _activation(config)

    def __call__(self, x_BSD: jax.Array, layout: Parallelism) -> jax.Array:
        hidden_BSF = jnp.einsum("bsd,df->bsf", x_BSD, layout.use(self.w_in))  # column-parallel
        hidden_BSF = _plus_bias(hidden_BSF, self, "in_bias", layout)
        if self.gated:
            gate_BSF = _plus_bias(jnp.einsum("bsd,df->bsf", x_BSD, layout.use(self.w_gate)), self, "gate_bias", layout)
            hidden_BSF = _gated(self.activation, gate_BSF, hidden_BSF)
        else:
            hidden_BSF = self.activation(checkpoint_name(hidden_BSF, "mlpwi"))
        y_BSD = row_parallel("bsf,fd->bsd", hidden_BSF, layout.use(self.w_out), layout)
        return checkpoint_name(_plus_bias(y_BSD, self, "out_bias", layout), "mlpwo")


def _gated(activation: Callable, gate: jax.Array, hidden: jax.Array) -> jax.Array:
    """act(gate) * hidden, both inputs under MaxText's names (the gate its ``wi_0``, the other its ``wi_1``), as
    are the non-gated ``mlpwi`` and the output ``mlpwo``: a custom remat policy places them (lab.parallel.layout)."""
    return activation(checkpoint_name(gate, "mlpwi_0")) * checkpoint_name(hidden, "mlpwi_1")


_EXPERT_HIDDEN = "becf,ef->becf"  # an expert's bias, each slot of the buffer taking its expert's


class MoEStats(NamedTuple):
    """One MoE layer's balancing loss (mean over sequences) and load counts (summed over sequences)."""

    balance_loss: jax.Array
    counts: LoadCounts


class MoE(nnx.Module):
    """A mixture of E expert MLPs in place of the MLP; each token goes to its router's top k.

    Routing groups are sequences: each sequence fills its own C slots per expert (`RouterConfig.capacity`),
    token after token as MaxText's dropping path does (``drop_policy="token"``, no sort), so what is dropped
    does not depend on the mesh, nor on the sequence's later tokens (a policy that ranks by probability lets a
    later token take an earlier one's slot: the decoder is then not strictly causal).

    Expert parallelism is two moves of the token buffers [B, E, C, D]: from split by sequence (``routing``:
    every device holds its sequences' slots for every expert) to split by expert (``experts``), the dispatch
    all-to-all, and back, the combine all-to-all.
    """

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        e, d, f = config.experts, config.embed, config.mlp
        self.router = _param(
            rngs, nnx.initializers.normal(0.02), (d, e), ("embed", "routing")
        )  # small: routing starts near uniform
        self.w_in = _param(rngs, _fan_in(1, 2), (e, d, f), ("experts", "embed", "mlp"))
        if config.gated:
            self.w_gate = _param(rngs, _fan_in(1, 2), (e, d, f), ("experts", "embed", "mlp"))
        self.w_out = _param(rngs, _fan_in(1, 2), (e, f, d), ("experts", "mlp", "embed"))
        if config.biases:  # the router's, and each expert's
            self.router_bias = _bias(rngs, (e,), ("routing",))
            self.in_bias, self.out_bias = (
                _bias(rngs, (e, f), ("experts", "mlp")),
                _bias(rngs, (e, d), ("experts", "embed")),
            )
            if config.gated:
                self.gate_bias = _bias(rngs, (e, f), ("experts", "mlp"))
        if config.shared_experts:  # one dense MLP as wide as the shared experts together
            self.shared = MLP(config, rngs, config.shared_width)
        self.activation = _activation(config)
        self.config = config

    def __call__(self, x_BSD: jax.Array, layout: Parallelism) -> tuple[jax.Array, MoEStats]:
        router = self.config.router
        logits_BSE = _plus_bias(jnp.einsum("bsd,de->bse", x_BSD, layout.use(self.router)), self, "router_bias", layout)
        # (XLA's CPU partitioner gathers the logits over the batch axes for top_k; the TPU compiler keeps them split)
        routing = jax.vmap(lambda logits_SE: route(logits_SE, router))(logits_BSE)
        y_BSD = (
            self._dropless(x_BSD, routing, layout) if self.config.dropless else self._buffered(x_BSD, routing, layout)
        )
        if self.config.shared_experts:
            y_BSD = sequence_split(y_BSD, layout) + self.shared(x_BSD, layout)
        balance = jax.vmap(balance_loss, in_axes=(0, None))(routing, Balance(aux_loss=self.config.aux_loss))
        return y_BSD, MoEStats(balance.mean(), jax.tree.map(lambda c: c.sum(0), jax.vmap(load_counts)(routing)))

    def _buffered(self, x_BSD: jax.Array, routing: Routing, layout: Parallelism) -> jax.Array:
        """The experts on their buffers [B, E, C, D]: dispatch, the expert MLP, combine."""
        experts = self.config.experts
        home_BECD = jax.vmap(lambda x_SD, one: dispatch(x_SD, one, experts))(x_BSD, routing)
        x_BECD = _move(home_BECD, layout, _BECD_AT_EXPERTS)  # dispatch: the all-to-all over expert
        hidden_BECF = _plus_bias(
            jnp.einsum("becd,edf->becf", x_BECD, layout.use(self.w_in)), self, "in_bias", layout, _EXPERT_HIDDEN
        )
        if self.config.gated:
            gate_BECF = jnp.einsum("becd,edf->becf", x_BECD, layout.use(self.w_gate))
            gate_BECF = _plus_bias(gate_BECF, self, "gate_bias", layout, _EXPERT_HIDDEN)
            hidden_BECF = _gated(self.activation, gate_BECF, hidden_BECF)
        else:
            hidden_BECF = self.activation(checkpoint_name(hidden_BECF, "mlpwi"))
        y_BECD = jnp.einsum(
            "becf,efd->becd",
            hidden_BECF,
            layout.use(self.w_out),
            out_sharding=activation_sharding(layout, _BECD_AT_EXPERTS),
        )
        y_BECD = checkpoint_name(_plus_bias(y_BECD, self, "out_bias", layout, "becd,ed->becd"), "mlpwo")
        y_BECD = _move(y_BECD, layout, _BECD_AT_HOME)  # combine: the all-to-all back
        y_BSD = jax.vmap(combine)(y_BECD, routing)
        return y_BSD

    def _dropless(self, x_BSD: jax.Array, routing: Routing, layout: Parallelism) -> jax.Array:
        """The experts on every assignment (`lab.ragged.dropless`): each device sorts its own sequences' tokens
        and multiplies them by every expert's weights, under ``shard_map``; the experts' width split over
        ``tensor`` ends in a sum over it, after the combine (k times fewer rows than before it)."""
        names = [n for n in ("w_in", "w_gate", "w_out", "in_bias", "gate_bias", "out_bias") if hasattr(self, n)]
        weights = {n: layout.use(getattr(self, n)) for n in names}
        expert_BSK, gate_BSK = (_move(a, layout, ("batch", None, None)) for a in (routing.expert_TK, routing.gate_TK))
        split = _mesh_axes(weights["w_out"], 1)  # the mesh axes the experts' width is split over
        experts_split = _mesh_axes(weights["w_in"], 0) | _mesh_axes(weights["w_in"], 1)
        if experts_split:
            raise LabError(f"the experts' weights are split over {', '.join(sorted(experts_split))}: {NO_EXPERT_AXIS}")
        tpu = _platform(layout) == "tpu"

        def local(x_bsd, expert_bsk, gate_bsk, weights):
            def mlp(x_AD, matmul, expert_A):
                def bias(name):
                    return weights[name][expert_A] if name in weights else 0

                hidden_AF = matmul(x_AD, weights["w_in"]) + bias("in_bias")
                if self.config.gated:
                    hidden_AF = _gated(self.activation, matmul(x_AD, weights["w_gate"]) + bias("gate_bias"), hidden_AF)
                else:
                    hidden_AF = self.activation(checkpoint_name(hidden_AF, "mlpwi"))
                return checkpoint_name(matmul(hidden_AF, weights["w_out"]), "mlpwo")

            b, s, d = x_bsd.shape
            k = expert_bsk.shape[-1]
            expert_TK, gate_TK = expert_bsk.reshape(b * s, k), gate_bsk.reshape(b * s, k)
            y_TD = dropless(x_bsd.reshape(b * s, d), expert_TK, gate_TK, self.config.experts, mlp, tpu)
            y_TD = jax.lax.psum(y_TD, tuple(sorted(split))) if split else y_TD
            if "out_bias" in weights:  # once, after the sum: each choice's bias, gate-weighted
                y_TD = y_TD + jnp.einsum("tk,tkd->td", gate_TK.astype(y_TD.dtype), weights["out_bias"][expert_TK])
            return y_TD.reshape(b, s, d)

        operands = (x_BSD, expert_BSK, gate_BSK, weights)
        if jax.typeof(x_BSD).sharding.mesh.empty:  # one device, no mesh
            return local(*operands)
        specs = jax.tree.map(lambda a: jax.typeof(a).sharding.spec, operands)
        # check_vma off: the Pallas kernel does not track which mesh axes its output varies over
        mesh = jax.typeof(x_BSD).sharding.mesh
        return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=specs[0], check_vma=False)(*operands)


class Block(nnx.Module):
    """Pre-norm residual block: x + attention(norm(x)), then x + mlp(norm(x)) (or x + moe(norm(x)));
    parallel: x + attention(norm(x)) + mlp(norm(x)) with one norm."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs, moe: bool | None = None, window: int = 0):
        self.attention_norm = RMSNorm(config, rngs)
        self.attention = (LatentAttention if config.kv_rank else Attention)(config, rngs, window)
        self.parallel = config.block == "parallel"
        if not self.parallel:
            self.mlp_norm = RMSNorm(config, rngs)
        self.experts = config.experts if moe is None or moe else 0
        if self.experts:
            self.moe = MoE(config, rngs)
        else:
            self.mlp = MLP(config, rngs, config.dense_width)

    def __call__(self, x_BSD: jax.Array, layout: Parallelism) -> jax.Array:
        return self.forward(x_BSD, layout)[0]

    def forward(self, x_BSD: jax.Array, layout: Parallelism) -> tuple[jax.Array, MoEStats | None]:
        """The block's output and, for an MoE block, its `MoEStats`."""
        x_BSD = checkpoint_name(x_BSD, "decoder_layer_input")  # every use of the input goes through the name
        if self.parallel:
            return self._parallel(x_BSD, layout)
        with jax.named_scope("attention"):
            x_BSD = x_BSD + self.attention(sequence_whole(self.attention_norm(x_BSD, layout), layout), layout)
        if self.experts:
            with jax.named_scope("moe"):
                y_BSD, stats = self.moe(sequence_whole(self.mlp_norm(x_BSD, layout), layout), layout)
                return x_BSD + sequence_split(y_BSD, layout), stats
        with jax.named_scope("mlp"):
            return x_BSD + self.mlp(sequence_whole(self.mlp_norm(x_BSD, layout), layout), layout), None

    def _parallel(self, x_BSD: jax.Array, layout: Parallelism) -> tuple[jax.Array, MoEStats | None]:
        normed_BSD = sequence_whole(self.attention_norm(x_BSD, layout), layout)
        with jax.named_scope("attention"):
            mixed_BSD = self.attention(normed_BSD, layout)
        if self.experts:
            with jax.named_scope("moe"):
                y_BSD, stats = self.moe(normed_BSD, layout)
                return x_BSD + mixed_BSD + sequence_split(y_BSD, layout), stats
        with jax.named_scope("mlp"):
            return x_BSD + mixed_BSD + self.mlp(normed_BSD, layout), None


_LAYERS = {nnx.PARTITION_NAME: "layers"}  # nnx.vmap/scan add and remove this logical axis on the stacked weights
_BSD = ("batch", "sequence", "embed")  # the residual stream (`sequence`: split over tensor by sequence parallelism)
_BSD_WHOLE = ("batch", None, "embed")  # a sub-layer's input: attention and the MLP see the whole sequence
_BSHK = ("batch", None, "heads", "head_dim")
_BH_GROUPED = ("batch", "heads", None)  # a sequence's per-head values, the heads as [G, H/G]
_BECD_AT_HOME = ("batch", "routing", "capacity", "embed")  # each device: its sequences' slots for every expert
_BECD_AT_EXPERTS = (
    "batch",
    "experts",
    "capacity",
    "embed",
)  # each device: its experts' slots from a share of the sequences


class Period(nnx.Module):
    """`ModelConfig.period` consecutive layers of a stack whose layers differ: an interleaved MoE model's dense
    ones, then an MoE one (Llama 4 Maverick: dense, MoE, dense, MoE, ...), or windowed attention, then global
    (GPT-OSS); the layers' scan runs over periods."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        self.blocks = nnx.List([Block(config, rngs, moe, window) for moe, window in config.layer_pattern])

    def forward(self, x_BSD: jax.Array, layout: Parallelism) -> tuple[jax.Array, MoEStats | None]:
        """The period's output and its MoE layers' `MoEStats` stacked in order (None without MoE layers)."""
        stats = []
        for block in self.blocks:
            x_BSD, one = block.forward(x_BSD, layout)
            stats += [] if one is None else [one]
        return x_BSD, jax.tree.map(lambda *layers: jnp.stack(layers), *stats) if stats else None


def _stacked(n: int, make: Callable[[nnx.Rngs], nnx.Module], rngs: nnx.Rngs) -> nnx.Module:
    """`n` modules made by `make`, their weights stacked on a leading ``layers`` axis."""

    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=0, out_axes=0, transform_metadata=_LAYERS)
    def stacked(rngs: nnx.Rngs) -> nnx.Module:
        return make(rngs)

    return stacked(rngs)


class Transformer(nnx.Module):
    """tokens [B, S] -> next-token logits [B, S, V] (fp32).

    The layers are one scan over `blocks` (a `Block` per layer, or a `Period` of layers), after a scan over
    `dense_blocks` where an MoE model begins with dense layers (DeepSeek-V3's first three).
    """

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        self.config = config
        self.embedding = _param(rngs, nnx.initializers.normal(1.0), (config.vocab, config.embed), ("vocab", "embed"))
        if config.dense_layers:
            self.dense_blocks = _stacked(config.dense_layers, lambda r: Block(config, r, moe=False), rngs)
        if config.period > 1:
            self.blocks = _stacked(config.scan_length, lambda r: Period(config, r), rngs)
        else:
            self.blocks = _stacked(config.scan_length, lambda r: Block(config, r, *config.layer_pattern[0]), rngs)
        self.final_norm = RMSNorm(config, rngs)
        if not config.tied:
            self.unembed = _param(rngs, _fan_in(0, 1), (config.embed, config.vocab), ("embed", "vocab"))

    def __call__(self, tokens_BS: jax.Array, layout: Parallelism) -> jax.Array:
        return self.forward(tokens_BS, layout)[0]

    def forward(self, tokens_BS: jax.Array, layout: Parallelism) -> tuple[jax.Array, MoEStats | None]:
        """Logits and, for an MoE model, each MoE layer's `MoEStats` stacked on a leading layers axis."""
        x_BSD, stats = run_blocks(self.blocks, self.dense_prefix(self.embed(tokens_BS, layout), layout), layout)
        return self.head(x_BSD, layout), stats

    def dense_prefix(self, x_BSD: jax.Array, layout: Parallelism) -> jax.Array:
        """The first `dense_layers` layers (x itself when there are none), under the named scope ``dense_layers``."""
        if not self.config.dense_layers:
            return x_BSD
        return run_blocks(self.dense_blocks, x_BSD, layout, scope="dense_layers")[0]

    def embed(self, tokens_BS: jax.Array, layout: Parallelism) -> jax.Array:
        """tokens [B, S] -> embeddings [B, S, D]."""
        # a one-hot matmul, not a gather: JAX 0.10 has no sharding rule for gathering from a reduced array,
        # and as a matmul the table's gradient comes out unreduced like every other weight's
        one_hot_BSV = jax.nn.one_hot(tokens_BS, self.config.vocab, dtype=layout.compute_dtype)
        return sequence_split(jnp.einsum("bsv,vd->bsd", one_hot_BSV, layout.use(self.embedding)), layout)

    def unembedding(self, layout: Parallelism) -> jax.Array:
        """The head's table as its matmul uses it (`Parallelism.use`: gathered): [D, V], or the tied [V, D]."""
        return layout.use(self.embedding if self.config.tied else self.unembed)

    def head(self, x_BSD: jax.Array, layout: Parallelism, unembedding: jax.Array | None = None) -> jax.Array:
        """The last block's output -> logits [B, S, V] (fp32): final norm and unembedding (`unembedding`, if the
        caller gathered it already: a loss over chunks gathers it once for all of them)."""
        x_BSD = sequence_whole(self.final_norm(x_BSD, layout), layout)
        table = self.unembedding(layout) if unembedding is None else unembedding
        pattern = "bsd,vd->bsv" if self.config.tied else "bsd,dv->bsv"
        return jnp.einsum(pattern, x_BSD, table).astype(jnp.float32)


LAYERS_SCOPE = "layers"  # the named scope of the layers' scan: `lab.predict.depth` reads its loops deeper


def run_blocks(
    blocks: Block | Period, x_BSD: jax.Array, layout: Parallelism, scope: str = LAYERS_SCOPE
) -> tuple[jax.Array, MoEStats | None]:
    """Apply stacked blocks or periods (weights [n, ...]: all of them, or one pipeline stage's share) in order, as
    one scan under the named `scope` (its loops' names in the compiled program, wherever the scan runs: a
    pipeline stage's inside the loop over micro-batches too)."""

    def block(x_BSD: jax.Array, one_block: Block | Period) -> tuple[jax.Array, MoEStats | None]:
        return one_block.forward(x_BSD, layout)

    if layout.remat_policy is not None:
        block = nnx.remat(
            block, policy=layout.remat_policy, prevent_cse=False
        )  # scan already keeps XLA from CSE-ing the recompute
    scan = nnx.scan(block, in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0), transform_metadata=_LAYERS)
    with jax.named_scope(scope):
        x_BSD, stats = scan(x_BSD, blocks)
    if isinstance(blocks, Period):  # [periods, MoE layers of one, ...] -> [MoE layers, ...], in order
        stats = jax.tree.map(lambda s: s.reshape(-1, *s.shape[2:]), stats)
    return x_BSD, stats


def abstract_model(config: ModelConfig) -> tuple[nnx.GraphDef, nnx.State]:
    """The model's structure and its parameters as ShapeDtypeStructs with logical axes; nothing is allocated."""
    with nnx.use_eager_sharding(False):  # the lab's rules, not flax's, turn logical axes into shardings
        model = nnx.eval_shape(lambda: Transformer(config, nnx.Rngs(0)))
    return nnx.split(model)


def init_params(config: ModelConfig, seed: int = 0) -> nnx.State:
    """The initial parameters as a State (call it inside jit, as `create_params` does)."""
    with nnx.use_eager_sharding(False):
        return nnx.split(Transformer(config, nnx.Rngs(seed)))[1]


def create_params(config: ModelConfig, shardings: nnx.State, seed: int = 0) -> nnx.State:
    """Initialize the parameters directly into `shardings` (a State of NamedShardings).

    No device holds more than its shard.
    """
    return jax.jit(lambda: init_params(config, seed), out_shardings=shardings)()


def next_token_loss(logits_BSV: jax.Array, targets_BS: jax.Array) -> jax.Array:
    """Mean cross-entropy of predicting each next token."""

    return optax.softmax_cross_entropy_with_integer_labels(logits_BSV, targets_BS).mean()
