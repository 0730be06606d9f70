"""GPipe over the ``stage`` mesh axis, written as one SPMD program (the way MaxText pipelines with GSPMD).

The stacked block weights [L, ...] are stored split over ``stage`` in
contiguous runs, so reshaping them to [P, L/P, ...] moves no data: stage p
holds layers p·L/P ... (p+1)·L/P - 1. The global batch is cut into M
micro-batches and a `lax.scan` runs M + P - 1 ticks over a state [P, b, S, D]
split over ``stage``. Each tick:

1. the state shifts one stage down the pipe (``ppermute`` over ``stage``: one
   collective-permute of a [b, S, D] activation per device), and stage 0
   takes the next micro-batch instead (zeros once they run out);
2. every stage applies its L/P blocks at once: ``jax.vmap`` over the stage
   dimension, which the Explicit mesh splits over ``stage``, so each device
   runs its own stage's blocks (an inner scan over its layers);
3. the outputs are kept: at tick t the last stage holds micro-batch t - P + 1.

Stage p works on micro-batch t - p, so ticks t < p and t ≥ M + p are its
bubble: (P-1)/(M+P-1) of each stage's time (Huang et al. 2019, "GPipe",
arXiv:1811.06965, Sec. 2.3; `lab.theory.pipeline_bubble_fraction`).
Autodiff through the scan is GPipe's backward: the ticks in reverse, each
transposed ppermute sending one activation gradient back up the pipe, so a
step holds 2(M + P - 1) collective-permutes of [b, S, D]. What a bubble tick
computes (on zeros) is never read, so it gets no gradient.

After the loop the last stage's outputs are summed over ``stage`` with the
others masked to zero (one all-reduce of [M, b, S, D]), so the final norm,
unembedding and loss run replicated over ``stage``, as the embedding did
before the loop. MaxText's ``layers/pipeline.py`` builds the same loop with a
circular shift of a stage-sharded state under ``nn.vmap``; on an Explicit mesh
``jnp.roll`` of a split dimension does not lower (slicing a sharded dimension
is refused), hence the ``shard_map`` around ``ppermute``.

``jax.vmap`` reads the mesh axis a mapped dimension is split over from the
arguments' types. Data-parallel weights are *reduced* over the data axes (see
`lab.parallel.layout`), and jax 0.10.2 reads their spec in a way that raises
for reduced specs; `_vmap_accepts_reduced_weights` works around that while
tracing (remove it once jax reads ``spec.partitions``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

STAGE = "stage"


def split_stages(stacked: Any, stages: int) -> Any:
    """Leaves [L, ...] split over ``stage`` -> [P, L/P, ...] with ``stage`` on the new leading dimension.

    No data moves.
    """

    def split(w_L: jax.Array) -> jax.Array:
        sharding = jax.typeof(w_L).sharding
        spec = sharding.spec
        layers, *rest = spec.partitions
        staged = P(layers, None, *rest, reduced=spec.reduced, unreduced=spec.unreduced)
        return jnp.reshape(
            w_L, (stages, w_L.shape[0] // stages, *w_L.shape[1:]), out_sharding=NamedSharding(sharding.mesh, staged)
        )

    return jax.tree.map(split, stacked)


def shift(state_P: jax.Array, stages: int) -> jax.Array:
    """Stage p's slice moves to stage p + 1: a collective-permute.

    The last stage's wraps to stage 0, which overwrites it.
    """
    down_the_pipe = [(p, (p + 1) % stages) for p in range(stages)]

    def send(local_1bSD: jax.Array) -> jax.Array:
        assert local_1bSD.shape[0] == 1, local_1bSD.shape  # one stage per device
        return jax.lax.ppermute(local_1bSD, STAGE, down_the_pipe)

    # every mesh axis manual, the batch axes kept as the state has them: with only `stage` manual
    # (axis_names={"stage"}), XLA gathered the micro-batch over fsdp before each permute and sent it whole
    sharding = jax.typeof(state_P).sharding
    return jax.shard_map(send, mesh=sharding.mesh, in_specs=sharding.spec, out_specs=sharding.spec)(state_P)


def _stage_index(mesh, stages: int, trailing: int) -> jax.Array:
    """0 .. P-1 along a leading dimension split over ``stage``, with `trailing` size-1 dimensions to broadcast."""
    index = jax.reshard(jnp.arange(stages), NamedSharding(mesh, P(STAGE)))
    return index.reshape(stages, *(1,) * trailing)


def pipeline(stage_fn: Callable, weights_P: Any, x_MbSD: jax.Array) -> tuple[jax.Array, Any]:
    """GPipe forward of `stage_fn` over M micro-batches.

    `stage_fn(weights of one stage [L/P, ...], x [b, S, D]) -> (y [b, S, D], aux)`; `weights_P`: leaves [P, L/P, ...]
    split over ``stage`` (`split_stages`); `x_MbSD`: the embedded micro-batches, replicated over ``stage``. Returns
    the last stage's outputs [M, b, S, D], replicated over ``stage``, and `aux` (e.g. MoE stats, leaves [L/P, ...]
    per stage) summed over the micro-batches each stage really ran, [P, L/P, ...].
    """
    stages, micro_batches = jax.tree.leaves(weights_P)[0].shape[0], x_MbSD.shape[0]
    x_sharding = jax.typeof(x_MbSD).sharding
    mesh, micro_spec = x_sharding.mesh, x_sharding.spec.partitions[1:]
    bubble_inputs = jnp.zeros((stages - 1, *x_MbSD.shape[1:]), x_MbSD.dtype, out_sharding=x_sharding)
    inputs_TbSD = jnp.concatenate([x_MbSD, bubble_inputs])
    is_first_P = _stage_index(mesh, stages, x_MbSD.ndim - 1) == 0
    # each tick's input already placed at stage 0 (zeros elsewhere), before the loop: the backward pass then sums the
    # embeddings' gradient over `stage` once, not once per tick
    inputs_TPbSD = jnp.where(is_first_P[None], inputs_TbSD[:, None], 0)
    # on an Explicit mesh vmap finds from the arguments that the stage dimension is split over `stage`
    run_stages = jax.vmap(stage_fn)

    def tick(state_PbSD: jax.Array, x_PbSD: jax.Array):
        state_PbSD = jnp.where(is_first_P, x_PbSD, shift(state_PbSD, stages))
        state_PbSD, aux = run_stages(weights_P, state_PbSD)
        return state_PbSD, (state_PbSD, aux)

    start = jnp.zeros(
        (stages, *x_MbSD.shape[1:]), x_MbSD.dtype, out_sharding=NamedSharding(mesh, P(STAGE, *micro_spec))
    )
    with _vmap_accepts_reduced_weights():
        _, (outputs_TPbSD, aux_TP) = jax.lax.scan(tick, start, inputs_TPbSD)
    return _last_stage(outputs_TPbSD[stages - 1 :], stages), _sum_real_ticks(aux_TP, mesh, stages, micro_batches)


def _last_stage(outputs_MPbSD: jax.Array, stages: int) -> jax.Array:
    """The last stage's slice, replicated over ``stage``: the others masked to zero and summed (an all-reduce)."""

    def keep_last(local_M1bSD):
        assert local_M1bSD.shape[1] == 1, local_M1bSD.shape  # one stage per device
        is_last = jax.lax.axis_index(STAGE) == stages - 1
        return jax.lax.psum(jnp.where(is_last, local_M1bSD, 0), STAGE)[:, 0]

    sharding = jax.typeof(outputs_MPbSD).sharding
    micro, _, *rest = sharding.spec.partitions  # every axis manual, as in `shift`
    return jax.shard_map(keep_last, mesh=sharding.mesh, in_specs=sharding.spec, out_specs=P(micro, *rest))(
        outputs_MPbSD
    )


def _sum_real_ticks(aux_TP: Any, mesh, stages: int, micro_batches: int) -> Any:
    """Sum each stage's `aux` over the ticks where it ran a micro-batch (t - p in [0, M)); the bubble's is dropped."""
    if aux_TP is None:
        return None
    stage_1P = _stage_index(mesh, stages, 0)[None]
    tick_T1 = jnp.arange(micro_batches + stages - 1)[:, None]
    real_TP = (tick_T1 >= stage_1P) & (tick_T1 - stage_1P < micro_batches)

    def masked_sum(a_TP):
        mask = real_TP.reshape(*real_TP.shape, *(1,) * (a_TP.ndim - 2))
        return jnp.where(mask, a_TP, 0).sum(0)

    return jax.tree.map(masked_sum, aux_TP)


@contextlib.contextmanager
def _vmap_accepts_reduced_weights() -> Iterator[None]:
    """Let `jax.vmap` map arguments whose spec is reduced over some axes (data-parallel weights), while tracing.

    jax 0.10.2's vmap finds the mesh axis of the mapped dimension with ``spec[i]`` (``jax._src.api._mapped_axis_spec``),
    and ``PartitionSpec.__getitem__`` raises a ValueError for a spec with reduced axes, which it does not catch. The
    mapped dimension's entry does not depend on what the array is reduced over, so it is read from ``spec.partitions``.
    """
    from jax._src import api  # private, and only while the workaround is live: not at module level

    reads_spec = getattr(api, "_mapped_axis_spec", None)
    if reads_spec is None:  # a jax that reads the mapped dimension some other way: nothing to work around
        yield
        return

    def partitions_only(x):
        sharding = getattr(jax.typeof(x), "sharding", None) if isinstance(x, jax.Array) else None
        if sharding is None or not (sharding.spec.reduced or sharding.spec.unreduced):
            return x
        return jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=NamedSharding(sharding.mesh, P(*sharding.spec.partitions))
        )

    api._mapped_axis_spec = lambda args, in_axes: reads_spec([partitions_only(x) for x in args], in_axes)
    try:
        yield
    finally:
        api._mapped_axis_spec = reads_spec
