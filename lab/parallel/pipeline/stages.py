"""The transformer cut into pipeline stages: blocks, weights and the model to check against.

A pipeline stage is a stack of the transformer's blocks (`lab.model.Block`).
`StageSplit` says how many blocks each virtual stage runs (virtual stage
c·P + d is chunk c of device d), `Workload` adds the block sizes and the
micro-batches. The weights of all L blocks are stacked [L, ...];
`stage_weights` lays them out [P, v, widest, ...] so that the ``stage`` mesh
axis splits them by device, padding short stages with layers that
`stage_forward` skips. The loss is the mean squared error of the last block's
output against a target, averaged over micro-batches (the pipeline is about
the blocks; an embedding and a vocabulary head would only add work to the
first and last stage). `reference_loss_and_grads` is the same model without a
pipeline, on one device.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lab.errors import LabError
from lab.model import Block, ModelConfig
from lab.parallel.pipeline.schedules import device_of


@dataclass(frozen=True)
class _LocalLayout:
    """The model's `Layout` for one device: weights used as they are, no remat."""

    compute_dtype: jnp.dtype = jnp.float32
    remat_policy: None = None

    def use(self, param: nnx.Param) -> jax.Array:
        return param[...]


@dataclass(frozen=True)
class StageSplit:
    """How many of the model's blocks each virtual stage runs (virtual stage c·P + d is chunk c of device d)."""

    layers: tuple[int, ...]

    @classmethod
    def parse(cls, text: str) -> StageSplit:
        """``"3,3,2,2"``: the blocks of each (virtual) stage, in order."""
        try:
            counts = tuple(int(part) for part in text.split(","))
        except ValueError:
            raise LabError(
                f"split {text!r}: write the blocks per stage as integers separated by commas, e.g. 3,3,2,2"
            ) from None
        if min(counts) < 1:
            raise LabError(f"split {text!r}: every stage needs at least one block")
        return cls(counts)

    @classmethod
    def even(cls, layers: int, virtual_stages: int) -> StageSplit:
        if layers % virtual_stages:
            raise LabError(
                f"{layers} layers do not split evenly into {virtual_stages} "
                f"(virtual) stages; use a multiple of {virtual_stages} layers, "
                "or name the split, e.g. --split 3,3,2,2"
            )
        return cls((layers // virtual_stages,) * virtual_stages)

    @property
    def total(self) -> int:
        return sum(self.layers)

    @property
    def widest(self) -> int:
        return max(self.layers)

    @property
    def uneven(self) -> bool:
        return len(set(self.layers)) > 1

    def first_layer(self, virtual_stage: int) -> int:
        return sum(self.layers[:virtual_stage])


def balanced_split(layers: int, virtual_stages: int) -> StageSplit:
    """The most even split of `layers`: the first stages take one more layer when it does not divide."""
    if layers < virtual_stages:
        raise LabError(f"{layers} layers cannot fill {virtual_stages} stages; use at least one layer per stage")
    base, extra = divmod(layers, virtual_stages)
    return StageSplit(tuple(base + (s < extra) for s in range(virtual_stages)))


@dataclass(frozen=True)
class Workload:
    """The blocks' sizes, how they split into stages, and the micro-batches."""

    block: ModelConfig  # embed, heads, head_dim, mlp, seq of one block
    split: StageSplit
    batch: int  # sequences in the whole step
    micro_batches: int

    def __post_init__(self) -> None:
        if self.micro_batches < 1 or self.batch % self.micro_batches:
            raise LabError(
                f"a batch of {self.batch} sequences does not split into {self.micro_batches} "
                f"equal micro-batches; use a batch that is a multiple of {self.micro_batches}"
            )

    @property
    def micro_batch_size(self) -> int:
        return self.batch // self.micro_batches

    @property
    def activation_shape(self) -> tuple[int, int, int]:
        """One micro-batch's activation between stages: [b, S, D]."""
        return (self.micro_batch_size, self.block.seq, self.block.embed)


# --- parameters -----------------------------------------------------------------------


def _blocks(config: ModelConfig, layers: int, seed: int) -> tuple[nnx.GraphDef, dict]:
    """`layers` blocks stacked on a leading axis: the graph of one block and the pure weights."""

    @nnx.split_rngs(splits=layers)
    @nnx.vmap(in_axes=0, out_axes=0)
    def stacked(rngs: nnx.Rngs) -> Block:
        return Block(config, rngs)

    with nnx.use_eager_sharding(False):  # plain arrays: this module places them itself
        graphdef, state = nnx.split(stacked(nnx.Rngs(seed)))
    return graphdef, nnx.to_pure_dict(state)


@functools.cache
def block_graph(config: ModelConfig) -> nnx.GraphDef:
    """The structure of one block (no weights are created)."""
    return jax.eval_shape(lambda: _blocks(config, 1, 0))[0]


def block_shapes(config: ModelConfig) -> dict:
    """One block's weights as ShapeDtypeStructs with a leading layer axis of 1."""
    return jax.eval_shape(lambda: _blocks(config, 1, 0)[1])


def example_batch(workload: Workload, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Inputs and regression targets [m, b, S, D], standard normal."""
    rng = np.random.default_rng(seed)
    shape = (workload.micro_batches, *workload.activation_shape)
    return rng.standard_normal(shape, np.float32), rng.standard_normal(shape, np.float32)


def init_weights(workload: Workload, seed: int = 0) -> dict:
    """The model's weights, stacked by layer: every leaf is [L, ...].

    Drawn with numpy, normal with std 1/sqrt(D) (norm scales: 1): running
    lab.model's initialisers costs a compilation of their own, longer than
    the step's, and any weights serve to compare a pipeline with its model.
    """
    rng = np.random.default_rng(seed)
    layers, scale = workload.split.total, workload.block.embed**-0.5

    def draw(path, shape) -> np.ndarray:
        full = (layers, *shape.shape[1:])
        if "norm" in jax.tree_util.keystr(path):
            return np.ones(full, np.float32)
        return (scale * rng.standard_normal(full)).astype(np.float32)

    return jax.tree_util.tree_map_with_path(draw, block_shapes(workload.block))


def stage_weights(weights_L: dict, split: StageSplit, stages: int) -> dict:
    """[L, ...] -> [P, v, widest, ...]: device d, chunk c holds virtual stage c·P + d's layers (zero-padded)."""
    chunks = len(split.layers) // stages

    def place(w_L: np.ndarray) -> np.ndarray:
        w_L = np.asarray(w_L)
        out = np.zeros((stages, chunks, split.widest, *w_L.shape[1:]), w_L.dtype)
        for virtual, count in enumerate(split.layers):
            device, chunk = device_of(virtual, stages)
            first = split.first_layer(virtual)
            out[device, chunk, :count] = w_L[first : first + count]
        return out

    return jax.tree.map(place, weights_L)


def unstage_weights(staged: dict, split: StageSplit, stages: int) -> dict:
    """The inverse of `stage_weights`: [P, v, widest, ...] -> [L, ...]."""

    def gather(w: np.ndarray) -> np.ndarray:
        w = np.asarray(w)
        pieces = [w[device_of(v, stages)][:count] for v, count in enumerate(split.layers)]
        return np.concatenate(pieces)

    return jax.tree.map(gather, staged)


def stage_weights_abstract(workload: Workload, stages: int, chunks: int) -> dict:
    """The staged weights' shapes, [P, v, widest, ...], and the active-layer mask."""
    one_block = block_shapes(workload.block)
    blocks = jax.tree.map(
        lambda w: jax.ShapeDtypeStruct((stages, chunks, workload.split.widest, *w.shape[1:]), w.dtype), one_block
    )
    return {"blocks": blocks, "active": jax.ShapeDtypeStruct((stages, chunks, workload.split.widest), jnp.float32)}


def staged_weights(workload: Workload, weights_L: dict, stages: int) -> dict:
    """The weights as the pipelined step takes them: blocks [P, v, widest, ...] and the active-layer mask."""
    blocks = stage_weights(weights_L, workload.split, stages)
    active = stage_weights({"one": np.ones((workload.split.total,), np.float32)}, workload.split, stages)["one"]
    return {"blocks": blocks, "active": active}


# --- one stage's forward, and the reference model ----------------------------------------


def stage_forward(graphdef: nnx.GraphDef, skip_padding: bool):
    """weights, x [b,S,D] -> the stage's blocks applied in order.

    ``weights["blocks"]`` holds the stage's layers stacked [widest, ...];
    with an uneven split, ``weights["active"]`` [widest] is 0 on the padding
    layers, which are skipped (a `lax.cond`, so they cost nothing).
    """
    layout = _LocalLayout()

    def forward(weights: dict, x_BSD: jax.Array) -> jax.Array:
        def one_block(x_BSD, layer):
            weights_l, active = layer

            def apply(x):
                return nnx.merge(graphdef, nnx.State(weights_l))(x, layout)

            return (jax.lax.cond(active > 0, apply, lambda x: x, x_BSD) if skip_padding else apply(x_BSD)), None

        blocks = weights["blocks"]
        active = weights["active"] if skip_padding else jnp.ones(jax.tree.leaves(blocks)[0].shape[0])
        return jax.lax.scan(one_block, x_BSD, (blocks, active))[0]

    return forward


def stage_loss(y_BSD: jax.Array, target_BSD: jax.Array, micro_batches: int) -> jax.Array:
    """This micro-batch's share of the step's loss: mean squared error / m."""
    return jnp.mean((y_BSD - target_BSD) ** 2) / micro_batches


def reference_loss_and_grads(workload: Workload, weights_L: dict, inputs_MBSD, targets_MBSD) -> tuple[jax.Array, dict]:
    """The same model without a pipeline: every block in order, on each micro-batch, on one device."""
    return _reference_step(workload.block, workload.micro_batches)(weights_L, inputs_MBSD, targets_MBSD)


@functools.lru_cache(maxsize=8)
def _reference_step(block: ModelConfig, micro_batches: int):
    """The jitted reference for one block size and m (jit caches the shapes; the split does not matter)."""
    forward = stage_forward(block_graph(block), skip_padding=False)

    def loss(weights, inputs_MBSD, targets_MBSD):
        per_micro_batch = jax.vmap(lambda x, t: stage_loss(forward({"blocks": weights}, x), t, micro_batches))
        return jnp.sum(per_micro_batch(inputs_MBSD, targets_MBSD))

    return jax.jit(jax.value_and_grad(loss))
