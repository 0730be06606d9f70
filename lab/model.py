"""A small decoder-only transformer, written only against logical axes.

Every parameter is declared with the *meaning* of each dimension, e.g.
``nnx.Param(w, out_sharding=("embed", "mlp"))``; the model never names a mesh
axis. A `Layout` (see `lab.parallel.fsdp`) decides at run time where each
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
model, and per-layer collectives appear once in a while loop. Parameter count,
with V vocab, D embed, H heads of K dims, F mlp, L layers (no biases, untied
embeddings, RMSNorm scales, rotary positions):
    Ψ = 2VD + L (4DHK + 2DF + 2D) + D.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import jax
import jax.numpy as jnp
from flax import nnx

from lab.errors import LabError


@dataclass(frozen=True)
class ModelConfig:
    """Sizes of the transformer; the default is small enough for 8 emulated CPU devices."""

    vocab: int = 256
    embed: int = 64
    heads: int = 4
    head_dim: int = 16
    mlp: int = 256
    layers: int = 2
    seq: int = 32

    @property
    def parameters(self) -> int:
        """Ψ = 2VD + L(4DHK + 2DF + 2D) + D (see the module docstring)."""
        return 2 * self.vocab * self.embed + self.block_parameters + self.embed

    @property
    def block_parameters(self) -> int:
        """L(4DHK + 2DF + 2D): the weights inside the layer scan (attention, MLP, their two norms)."""
        d = self.embed
        return self.layers * (4 * d * self.heads * self.head_dim + 2 * d * self.mlp + 2 * d)


PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(),  # 0.13 M: tests and cpu:8 pages
    "small": ModelConfig(vocab=1024, embed=256, heads=8, head_dim=32, mlp=1024, layers=4, seq=128),  # 3.7 M: cpu timings
    "125m": ModelConfig(vocab=32768, embed=768, heads=12, head_dim=64, mlp=3072, layers=12, seq=1024),
    "350m": ModelConfig(vocab=32768, embed=1024, heads=16, head_dim=64, mlp=4096, layers=24, seq=1024),
    "1b": ModelConfig(vocab=32768, embed=2048, heads=16, head_dim=128, mlp=8192, layers=16, seq=2048),  # compile-only
}


def preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise LabError(f"unknown model preset {name!r}; use one of {', '.join(PRESETS)}")
    return PRESETS[name]


class Layout(Protocol):
    """What the model needs from a parallelism strategy (implemented by `lab.parallel.fsdp.Layout`)."""

    compute_dtype: jnp.dtype

    def use(self, param: nnx.Param) -> jax.Array:
        """The weight as a matmul uses it: gathered, cast to the compute dtype."""
        ...

    @property
    def remat_policy(self) -> Callable | None:
        """The checkpoint policy for one block (None: save every residual)."""
        ...


def _param(rngs: nnx.Rngs, init, shape: tuple[int, ...], axes: tuple[str, ...]) -> nnx.Param:
    return nnx.Param(init(rngs.params(), shape, jnp.float32), out_sharding=axes)


def _fan_in(in_axis, out_axis):
    return nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=in_axis, out_axis=out_axis)


class RMSNorm(nnx.Module):
    """x / rms(x) * scale, computed in fp32 (Zhang & Sennrich 2019)."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        self.scale = _param(rngs, nnx.initializers.ones, (config.embed,), ("embed",))

    def __call__(self, x_BSD: jax.Array, layout: Layout) -> jax.Array:
        x = x_BSD.astype(jnp.float32)
        normed = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)
        # an einsum, not a broadcast multiply: JAX allows a reduced (replicated, gradient-unreduced) weight in a dot only
        return jnp.einsum("bsd,d->bsd", normed, layout.use(self.scale).astype(jnp.float32)).astype(x_BSD.dtype)


def rotary(x_BSHK: jax.Array) -> jax.Array:
    """Rotary position embedding (Su et al. 2021, RoFormer, eq. 34): rotate pairs of channels by position."""
    seq, half = x_BSHK.shape[1], x_BSHK.shape[-1] // 2
    frequencies = 10_000.0 ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle_SK = jnp.arange(seq, dtype=jnp.float32)[:, None] * frequencies[None, :]
    cos, sin = jnp.cos(angle_SK)[None, :, None, :], jnp.sin(angle_SK)[None, :, None, :]
    first, second = x_BSHK[..., :half].astype(jnp.float32), x_BSHK[..., half:].astype(jnp.float32)
    return jnp.concatenate([first * cos - second * sin, first * sin + second * cos], axis=-1).astype(x_BSHK.dtype)


class Attention(nnx.Module):
    """Causal multi-head self-attention."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        d, h, k = config.embed, config.heads, config.head_dim
        self.query = _param(rngs, _fan_in(0, (1, 2)), (d, h, k), ("embed", "heads", "head_dim"))
        self.key = _param(rngs, _fan_in(0, (1, 2)), (d, h, k), ("embed", "heads", "head_dim"))
        self.value = _param(rngs, _fan_in(0, (1, 2)), (d, h, k), ("embed", "heads", "head_dim"))
        self.out = _param(rngs, _fan_in((0, 1), 2), (h, k, d), ("heads", "head_dim", "embed"))

    def __call__(self, x_BSD: jax.Array, layout: Layout) -> jax.Array:
        q_BSHK = rotary(jnp.einsum("bsd,dhk->bshk", x_BSD, layout.use(self.query)))
        k_BSHK = rotary(jnp.einsum("bsd,dhk->bshk", x_BSD, layout.use(self.key)))
        v_BSHK = jnp.einsum("bsd,dhk->bshk", x_BSD, layout.use(self.value))
        scores_BHST = jnp.einsum("bshk,bthk->bhst", q_BSHK, k_BSHK).astype(jnp.float32) / jnp.sqrt(q_BSHK.shape[-1])
        seq = x_BSD.shape[1]
        causal_ST = jnp.tril(jnp.ones((seq, seq), dtype=bool))
        weights_BHST = jax.nn.softmax(jnp.where(causal_ST, scores_BHST, -1e30), axis=-1).astype(x_BSD.dtype)
        mixed_BSHK = jnp.einsum("bhst,bthk->bshk", weights_BHST, v_BSHK)
        return jnp.einsum("bshk,hkd->bsd", mixed_BSHK, layout.use(self.out))


class MLP(nnx.Module):
    """GELU feed-forward: D -> F -> D."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        self.w_in = _param(rngs, _fan_in(0, 1), (config.embed, config.mlp), ("embed", "mlp"))
        self.w_out = _param(rngs, _fan_in(0, 1), (config.mlp, config.embed), ("mlp", "embed"))

    def __call__(self, x_BSD: jax.Array, layout: Layout) -> jax.Array:
        hidden_BSF = jax.nn.gelu(jnp.einsum("bsd,df->bsf", x_BSD, layout.use(self.w_in)))
        return jnp.einsum("bsf,fd->bsd", hidden_BSF, layout.use(self.w_out))


class Block(nnx.Module):
    """Pre-norm residual block: x + attention(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        self.attention_norm = RMSNorm(config, rngs)
        self.attention = Attention(config, rngs)
        self.mlp_norm = RMSNorm(config, rngs)
        self.mlp = MLP(config, rngs)

    def __call__(self, x_BSD: jax.Array, layout: Layout) -> jax.Array:
        with jax.named_scope("attention"):
            x_BSD = x_BSD + self.attention(self.attention_norm(x_BSD, layout), layout)
        with jax.named_scope("mlp"):
            return x_BSD + self.mlp(self.mlp_norm(x_BSD, layout), layout)


_LAYERS = {nnx.PARTITION_NAME: "layers"}  # nnx.vmap/scan add and remove this logical axis on the stacked weights


class Transformer(nnx.Module):
    """tokens [B, S] -> next-token logits [B, S, V] (fp32)."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        self.config = config
        self.embedding = _param(rngs, nnx.initializers.normal(1.0), (config.vocab, config.embed), ("vocab", "embed"))

        @nnx.split_rngs(splits=config.layers)
        @nnx.vmap(in_axes=0, out_axes=0, transform_metadata=_LAYERS)
        def stacked_blocks(rngs: nnx.Rngs) -> Block:
            return Block(config, rngs)

        self.blocks = stacked_blocks(rngs)
        self.final_norm = RMSNorm(config, rngs)
        self.unembed = _param(rngs, _fan_in(0, 1), (config.embed, config.vocab), ("embed", "vocab"))

    def __call__(self, tokens_BS: jax.Array, layout: Layout) -> jax.Array:
        # a one-hot matmul, not a gather: JAX 0.10 has no sharding rule for gathering from a reduced array,
        # and as a matmul the table's gradient comes out unreduced like every other weight's
        one_hot_BSV = jax.nn.one_hot(tokens_BS, self.config.vocab, dtype=layout.compute_dtype)
        x_BSD = jnp.einsum("bsv,vd->bsd", one_hot_BSV, layout.use(self.embedding))

        def block(x_BSD: jax.Array, one_block: Block) -> jax.Array:
            return one_block(x_BSD, layout)

        if layout.remat_policy is not None:
            block = nnx.remat(block, policy=layout.remat_policy, prevent_cse=False)  # scan already keeps XLA from CSE-ing the recompute
        x_BSD = nnx.scan(block, in_axes=(nnx.Carry, 0), out_axes=nnx.Carry, transform_metadata=_LAYERS)(x_BSD, self.blocks)
        x_BSD = self.final_norm(x_BSD, layout)
        return jnp.einsum("bsd,dv->bsv", x_BSD, layout.use(self.unembed)).astype(jnp.float32)


def abstract_model(config: ModelConfig) -> tuple[nnx.GraphDef, nnx.State]:
    """The model's structure and its parameters as ShapeDtypeStructs with logical axes; nothing is allocated."""
    with nnx.use_eager_sharding(False):  # the lab's rules, not flax's, turn logical axes into shardings
        model = nnx.eval_shape(lambda: Transformer(config, nnx.Rngs(0)))
    return nnx.split(model)


def logical_axes(variable: nnx.Variable) -> tuple[str, ...]:
    """The logical axes a parameter was declared with (``layers`` first for stacked block weights)."""
    return tuple(variable.get_metadata("out_sharding"))


def init_params(config: ModelConfig, seed: int = 0) -> nnx.State:
    """The initial parameters as a State (call it inside jit, as `create_params` does)."""
    with nnx.use_eager_sharding(False):
        return nnx.split(Transformer(config, nnx.Rngs(seed)))[1]


def create_params(config: ModelConfig, shardings: nnx.State, seed: int = 0) -> nnx.State:
    """Initialize the parameters directly into `shardings` (a State of NamedShardings): no device holds more than its shard."""
    return jax.jit(lambda: init_params(config, seed), out_shardings=shardings)()


def next_token_loss(logits_BSV: jax.Array, targets_BS: jax.Array) -> jax.Array:
    """Mean cross-entropy of predicting each next token."""
    import optax

    return optax.softmax_cross_entropy_with_integer_labels(logits_BSV, targets_BS).mean()
