"""Megatron tensor parallelism (TP) and sequence parallelism (SP) on the ``tensor`` axis.

Tensor parallelism (Shoeybi et al. 2019, Megatron-LM, Section 3) splits each
block's matmuls so that a block costs one collective per sub-layer: the first
matmul is *column*-parallel (Q/K/V split by heads, W_in by MLP columns), the
second *row*-parallel (W_out by rows, the attention output projection by heads),
so each device holds a partial sum of the block's output and one all-reduce over
``tensor`` completes it. The embedding and the LM head are split by vocabulary;
the loss then needs only per-token max and sum-of-exp all-reduces, never the
full [B, S, V] logits on one device.

Sequence parallelism (Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", Section 4.2) keeps the activations
*between* sub-layers (norms, residuals, dropout) split along the sequence over
``tensor``: the all-reduce becomes a reduce-scatter along the sequence after the
row-parallel matmul plus an all-gather before the next column-parallel one. An
all-reduce *is* reduce-scatter + all-gather (same bytes), so SP moves no more
data, and the activations kept for the backward shrink by t.

Each is written twice, on the same parameters as `lab.model.Transformer`:

* ``style="shard_map"``: the local view with the collectives spelled out
  (``psum`` / ``psum_scatter`` / ``all_gather``);
* ``style="annotations"``: global arrays on an Explicit mesh; only shardings
  are written (``jax.reshard`` to a whole layout, ``out_sharding`` on the
  row-parallel einsums) and XLA's partitioner inserts the collectives.

Where weights live is a rules table over the model's own logical axes
(`TP_RULES`: heads, mlp and vocab over ``tensor``). The lab's transformer
takes the same split from the rules tables when it trains (`lab.rules.MODEL_PARALLEL`,
its row-parallel einsums given an ``out_sharding``); this module keeps the two
hand-built versions to compare them, sequence parallelism included.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from lab.errors import LabError
from lab.model import ModelConfig, WholeWeights, abstract_model, init_params, logical_axes, next_token_loss, rotary
from lab.rules import MEGATRON, VOCAB_PARALLEL

AXIS = "tensor"
STYLES = ("shard_map", "annotations")
TP_RULES = MEGATRON | VOCAB_PARALLEL  # the Megatron split with a vocab-parallel embedding, from lab.rules


def check_tensor_split(config: ModelConfig, tensor: int, sequence_parallel: bool) -> None:
    """Heads, MLP width and vocabulary (and the sequence, with SP) must split evenly over ``tensor``."""
    dims = {"heads": config.heads, "mlp (hidden)": config.mlp, "vocab": config.vocab}
    if sequence_parallel:
        dims["seq"] = config.seq
    for name, size in dims.items():
        if size % tensor:
            raise LabError(
                f"{name}={size} is not divisible by mesh axis tensor={tensor}; "
                f"choose a {name.split()[0]} size divisible by {tensor} or a "
                "smaller tensor axis"
            )


@dataclass(frozen=True)
class TensorParallel:
    """A model split Megatron-style over the mesh's ``tensor`` axis (batch over ``data``)."""

    model: ModelConfig
    mesh: jax.sharding.Mesh
    sequence_parallel: bool = False
    style: str = "shard_map"

    def __post_init__(self) -> None:
        if self.style not in STYLES:
            raise LabError(f"unknown tensor-parallel style {self.style!r}; use one of {', '.join(STYLES)}")
        sizes = dict(self.mesh.shape)
        busy = [a for a, n in sizes.items() if n > 1 and a not in ("data", AXIS)]
        if busy:
            raise LabError(
                "tensor parallelism here uses only the data and tensor mesh "
                f"axes, but {busy[0]}={sizes[busy[0]]}; set it to 1"
            )
        check_tensor_split(self.model, sizes[AXIS], self.sequence_parallel)

    @property
    def ways(self) -> int:
        return self.mesh.shape[AXIS]

    # --- where arrays live ------------------------------------------------------------

    def param_specs(self) -> dict:
        """PartitionSpecs of the parameters (a pure dict shaped like the model's State), from `TP_RULES`."""
        _, abstract = abstract_model(self.model)
        specs = jax.tree.map(
            lambda v: v.replace(TP_RULES.spec(logical_axes(v))), abstract, is_leaf=lambda x: isinstance(x, nnx.Variable)
        )
        return nnx.to_pure_dict(specs)

    def param_shardings(self) -> dict:
        return jax.tree.map(
            lambda s: NamedSharding(self.mesh, s), self.param_specs(), is_leaf=lambda x: isinstance(x, P)
        )

    def batch_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, P("data", None))

    def init(self, seed: int = 0) -> dict:
        """The model's initial parameters (same values as `lab.model.init_params`), created in the TP layout."""
        return jax.jit(lambda: nnx.to_pure_dict(init_params(self.model, seed)), out_shardings=self.param_shardings())()

    def abstract_params(self, dtype=jnp.float32) -> dict:
        """The parameters as ShapeDtypeStructs in the TP layout (to compile without allocating)."""
        shapes = jax.eval_shape(lambda: nnx.to_pure_dict(init_params(self.model)))
        return jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, dtype, sharding=s), shapes, self.param_shardings()
        )

    def check_batch(self, global_batch: int) -> None:
        data = self.mesh.shape["data"]
        if global_batch % data:
            raise LabError(
                f"global batch {global_batch} is not divisible by mesh axis data={data}; use a multiple of {data}"
            )

    def abstract_batch(self, global_batch: int) -> jax.ShapeDtypeStruct:
        self.check_batch(global_batch)
        return jax.ShapeDtypeStruct((global_batch, self.model.seq + 1), jnp.int32, sharding=self.batch_sharding())

    def batch(self, global_batch: int, seed: int = 0) -> jax.Array:
        """Random tokens [B, S+1] (inputs and next-token targets), the batch split over ``data``."""
        self.check_batch(global_batch)
        tokens = np.random.default_rng(seed).integers(
            0, self.model.vocab, (global_batch, self.model.seq + 1), dtype=np.int32
        )
        return jax.device_put(tokens, self.batch_sharding())

    # --- the loss ---------------------------------------------------------------------

    def loss(self, params: dict, tokens_BT: jax.Array) -> jax.Array:
        """Mean next-token cross-entropy, tokens [B, S+1]."""
        inputs_BS, targets_BS = tokens_BT[:, :-1], tokens_BT[:, 1:]
        if self.style == "annotations":
            return _Annotated(self.mesh, self.sequence_parallel).loss(params, inputs_BS, targets_BS)
        local = _Local(self.model, self.ways, self.sequence_parallel)
        batch = P("data", None)
        mapped = jax.shard_map(local.loss, mesh=self.mesh, in_specs=(self.param_specs(), batch, batch), out_specs=P())
        return mapped(params, inputs_BS, targets_BS)

    def block_function(self) -> Callable:
        """(one block's params, x [B, S, D]) -> block output.

        The unit whose backward residuals the memory theory counts.
        """
        x_spec = self.x_sharding().spec
        specs = jax.tree.map(lambda s: P(*s[1:]), self.param_specs()["blocks"], is_leaf=lambda x: isinstance(x, P))
        if self.style == "annotations":
            return lambda block, x_BSD: _Annotated(self.mesh, self.sequence_parallel).block(block, x_BSD)
        local = _Local(self.model, self.ways, self.sequence_parallel)
        return jax.shard_map(local.block, mesh=self.mesh, in_specs=(specs, x_spec), out_specs=x_spec)

    def x_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, P("data", AXIS if self.sequence_parallel else None, None))

    def step(self, optimizer: optax.GradientTransformation) -> Callable:
        """(params, opt_state, tokens) -> (params, opt_state, loss): one jitted training step under this layout."""
        return train_step(self.loss, optimizer)

    def saved_activation_bytes(self, batch: int, dtype=jnp.bfloat16) -> int:
        """Bytes per device one block keeps for its backward pass, for `batch` sequences, as XLA compiled them.

        The residuals are the outputs of ``jit(vjp(block))``; the block's weights
        are among them (the backward's matmuls need them), so their bytes per
        device are taken off.
        """
        saved = self.saved_activations(batch, dtype)
        return saved.output_bytes - saved.weight_bytes

    def saved_activations(self, batch: int, dtype=jnp.bfloat16) -> SavedActivations:
        """What one block keeps for its backward pass, for `batch` sequences: XLA's output bytes of
        ``jit(vjp(block))`` per device, the block's weights among them, and each residual's type and shape."""
        one_block = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(
                a.shape[1:], dtype, sharding=NamedSharding(self.mesh, P(*a.sharding.spec[1:]))
            ),
            self.abstract_params()["blocks"],
        )
        x_BSD = jax.ShapeDtypeStruct((batch, self.model.seq, self.model.embed), dtype, sharding=self.x_sharding())
        block = self.block_function()
        compiled = jax.jit(lambda w, x: jax.vjp(block, w, x)[1]).lower(one_block, x_BSD).compile()
        weights = sum(math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(one_block))
        residuals = tuple(
            (str(a.dtype), tuple(a.sharding.shard_shape(a.shape))) for a in jax.tree.leaves(compiled.out_info)
        )
        return SavedActivations(int(compiled.memory_analysis().output_size_in_bytes), int(weights), residuals)


@dataclass(frozen=True)
class SavedActivations:
    """The residuals of one block's backward pass, per device, as XLA compiled them."""

    output_bytes: int  # XLA's output size of jit(vjp(block)): the residuals, the weights among them
    weight_bytes: int  # the block's weights per device
    residuals: tuple[tuple[str, tuple[int, ...]], ...]  # (element type, shape per device) of each output array


# --- the math shared by both styles ---------------------------------------------------


def _norm(x_BSD: jax.Array, scale_D: jax.Array) -> jax.Array:
    """RMSNorm exactly as `lab.model.RMSNorm` computes it."""
    x = x_BSD.astype(jnp.float32)
    normed = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)
    return jnp.einsum("bsd,d->bsd", normed, scale_D.astype(jnp.float32)).astype(x_BSD.dtype)


def _heads(h_BSD: jax.Array, attention: dict) -> jax.Array:
    """Column-parallel Q/K/V and causal attention on whatever heads this view holds -> mixed [B, S, H, K]."""
    q_BSHK = rotary(jnp.einsum("bsd,dhk->bshk", h_BSD, attention["query"]))
    k_BSHK = rotary(jnp.einsum("bsd,dhk->bshk", h_BSD, attention["key"]))
    v_BSHK = jnp.einsum("bsd,dhk->bshk", h_BSD, attention["value"])
    scores_BHST = jnp.einsum("bshk,bthk->bhst", q_BSHK, k_BSHK).astype(jnp.float32) / jnp.sqrt(q_BSHK.shape[-1])
    seq = h_BSD.shape[1]
    causal_ST = jnp.tril(jnp.ones((seq, seq), dtype=bool))
    weights_BHST = jax.nn.softmax(jnp.where(causal_ST, scores_BHST, -1e30), axis=-1).astype(h_BSD.dtype)
    return jnp.einsum("bhst,bthk->bshk", weights_BHST, v_BSHK)


def _gelu_hidden(h_BSD: jax.Array, w_in_DF: jax.Array) -> jax.Array:
    """Column-parallel first MLP matmul and GELU."""
    return jax.nn.gelu(jnp.einsum("bsd,df->bsf", h_BSD, w_in_DF))


# --- style 1: shard_map, the collectives written out -----------------------------------


@dataclass(frozen=True)
class _Local:
    """One device's view: heads, MLP columns and vocabulary are its 1/t slice; with SP also the sequence."""

    model: ModelConfig
    ways: int
    sequence_parallel: bool

    def gather(self, x_BsD: jax.Array) -> jax.Array:
        """The input of a column-parallel matmul, whole and typed as varying over ``tensor``.

        SP: the all-gather [B, S/t, D] -> [B, S, D]. TP: Megatron's ``f``, identity
        forward and all-reduce backward, is a cast to varying; done once here so
        the backward sums the Q, K and V gradients locally and all-reduces one
        [B, S, D] (left implicit, each einsum's cast would all-reduce its own).
        """
        if self.sequence_parallel:
            return jax.lax.all_gather(x_BsD, AXIS, axis=1, tiled=True)
        return jax.lax.pcast(x_BsD, AXIS, to="varying")

    def reduce(self, partial_BSD: jax.Array) -> jax.Array:
        """Complete a row-parallel matmul's partial sums: TP all-reduce, SP reduce-scatter along the sequence."""
        if self.sequence_parallel:
            return jax.lax.psum_scatter(partial_BSD, AXIS, scatter_dimension=1, tiled=True)
        return jax.lax.psum(partial_BSD, AXIS)

    def block(self, block: dict, x_BSD: jax.Array) -> jax.Array:
        heads, mlp = self.model.heads // self.ways, self.model.mlp // self.ways
        assert block["attention"]["query"].shape[1] == heads and block["mlp"]["w_in"].shape[1] == mlp, (
            "local weights are not 1/t slices"
        )
        h_BSD = self.gather(_norm(x_BSD, block["attention_norm"]["scale"]))
        x_BSD = x_BSD + self.reduce(
            jnp.einsum("bshk,hkd->bsd", _heads(h_BSD, block["attention"]), block["attention"]["out"])
        )
        h_BSD = self.gather(_norm(x_BSD, block["mlp_norm"]["scale"]))
        return x_BSD + self.reduce(
            jnp.einsum("bsf,fd->bsd", _gelu_hidden(h_BSD, block["mlp"]["w_in"]), block["mlp"]["w_out"])
        )

    def loss(self, params: dict, inputs_BS: jax.Array, targets_BS: jax.Array) -> jax.Array:
        vocab = self.model.vocab // self.ways
        first = jax.lax.axis_index(AXIS) * vocab  # this device's slice of the vocabulary: [first, first + V/t)
        assert params["embedding"].shape == (vocab, self.model.embed), "embedding is not split by vocabulary"
        # vocabulary-parallel embedding: a token outside the slice one-hots to zeros, so each device holds a partial sum
        x_BSD = self.reduce(jnp.einsum("bsv,vd->bsd", jax.nn.one_hot(inputs_BS - first, vocab), params["embedding"]))
        x_BSD, _ = jax.lax.scan(lambda x, block: (self.block(block, x), None), x_BSD, params["blocks"])
        h_BSD = self.gather(_norm(x_BSD, params["final_norm"]["scale"]))
        logits_BSv = jnp.einsum("bsd,dv->bsv", h_BSD, params["unembed"]).astype(jnp.float32)
        # vocabulary-parallel cross-entropy: only per-token max, sum of exp and target logit cross devices
        top_BS = jax.lax.pmax(jax.lax.stop_gradient(logits_BSv.max(axis=-1)), AXIS)
        log_sum_BS = jnp.log(jax.lax.psum(jnp.exp(logits_BSv - top_BS[..., None]).sum(axis=-1), AXIS)) + top_BS
        target_BS = jax.lax.psum(jnp.sum(logits_BSv * jax.nn.one_hot(targets_BS - first, vocab), axis=-1), AXIS)
        return jax.lax.pmean((log_sum_BS - target_BS).mean(), "data")


# --- style 2: sharding annotations, XLA inserts the collectives -------------------------


@dataclass(frozen=True)
class _Annotated:
    """Global arrays on an Explicit mesh; each collective is implied by a target sharding."""

    mesh: jax.sharding.Mesh
    sequence_parallel: bool

    def _spec(self, sequence_split: bool) -> NamedSharding:
        return NamedSharding(self.mesh, P("data", AXIS if sequence_split else None, None))

    def gather(self, x_BSD: jax.Array) -> jax.Array:
        return jax.reshard(x_BSD, self._spec(False))  # SP: the all-gather; TP: already whole, a no-op

    def row_parallel(self, equation: str, lhs: jax.Array, rhs: jax.Array) -> jax.Array:
        """A matmul contracting a ``tensor``-split dimension.

        The out_sharding says all-reduce (TP) or reduce-scatter (SP).
        """
        return jnp.einsum(equation, lhs, rhs, out_sharding=self._spec(self.sequence_parallel))

    def block(self, block: dict, x_BSD: jax.Array) -> jax.Array:
        h_BSD = self.gather(_norm(x_BSD, block["attention_norm"]["scale"]))
        x_BSD = x_BSD + self.row_parallel("bshk,hkd->bsd", _heads(h_BSD, block["attention"]), block["attention"]["out"])
        h_BSD = self.gather(_norm(x_BSD, block["mlp_norm"]["scale"]))
        return x_BSD + self.row_parallel(
            "bsf,fd->bsd", _gelu_hidden(h_BSD, block["mlp"]["w_in"]), block["mlp"]["w_out"]
        )

    def loss(self, params: dict, inputs_BS: jax.Array, targets_BS: jax.Array) -> jax.Array:
        vocab = params["embedding"].shape[0]
        split_vocab = NamedSharding(self.mesh, P("data", None, AXIS))
        x_BSD = self.row_parallel(
            "bsv,vd->bsd", jax.reshard(jax.nn.one_hot(inputs_BS, vocab), split_vocab), params["embedding"]
        )
        x_BSD, _ = jax.lax.scan(lambda x, block: (self.block(block, x), None), x_BSD, params["blocks"])
        h_BSD = self.gather(_norm(x_BSD, params["final_norm"]["scale"]))
        logits_BSV = jnp.einsum("bsd,dv->bsv", h_BSD, params["unembed"]).astype(jnp.float32)
        target_BS = jnp.sum(logits_BSV * jax.reshard(jax.nn.one_hot(targets_BS, vocab), split_vocab), axis=-1)
        return (jax.nn.logsumexp(logits_BSV, axis=-1) - target_BS).mean()


def train_step(loss: Callable, optimizer: optax.GradientTransformation) -> Callable:
    """jit((params, opt_state, tokens) -> (params, opt_state, loss)) for any loss(params, tokens)."""

    def step(params, opt_state, tokens_BT):
        value, grads = jax.value_and_grad(loss)(params, tokens_BT)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return jax.jit(step)


# --- the reference twin: the model itself on whole weights -------------------------------


def reference_loss(model: ModelConfig, params: dict, tokens_BT: jax.Array) -> jax.Array:
    """`lab.model.Transformer`'s own loss on the same parameters (a pure dict), for numerics checks."""
    graphdef, abstract = abstract_model(model)
    state = nnx.State(abstract)
    nnx.replace_by_pure_dict(state, params)
    logits_BSV = nnx.merge(graphdef, state)(tokens_BT[:, :-1], WholeWeights())
    return next_token_loss(logits_BSV, tokens_BT[:, 1:])
