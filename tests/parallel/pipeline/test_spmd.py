"""GPipe as one SPMD program: a toy stack of blocks pipelined over stage against the same blocks run in order."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from lab.mesh import MeshSpec
from lab.parallel.pipeline.spmd import pipeline, split_stages

LAYERS, MICRO_BATCHES, BATCH, SEQ, DIM = 4, 3, 4, 2, 8


def _blocks(x_bSD, w_LDD):
    """x + tanh(x W) per layer, in order; aux: one count per layer, to see which ticks are counted."""

    def block(x, w_DD):
        return x + jnp.tanh(jnp.einsum("bsd,de->bse", x, w_DD)), jnp.ones(())

    return jax.lax.scan(block, x_bSD, w_LDD)


@pytest.fixture(scope="module")
def mesh(devices):
    return MeshSpec.parse("stage=2,data=2,fsdp=2").build(devices)


@pytest.fixture(scope="module")
def inputs():
    rng = np.random.default_rng(0)
    return rng.normal(size=(LAYERS, DIM, DIM)).astype(np.float32) * 0.5, rng.normal(
        size=(MICRO_BATCHES, BATCH, SEQ, DIM)
    ).astype(np.float32)


def _pipelined(mesh):
    def run(w_LDD, x_MbSD):
        # reduced over the batch axes, as a data-parallel weight is: the gradient comes out as partial sums
        w_LDD = jax.reshard(w_LDD, NamedSharding(mesh, P("stage", reduced={"data", "fsdp"})))
        y_MbSD, counts_P = pipeline(lambda w, x: _blocks(x, w), split_stages(w_LDD, 2), x_MbSD)
        return jnp.sum(y_MbSD**2), (y_MbSD, counts_P)

    return jax.jit(jax.value_and_grad(run, has_aux=True))


def test_pipelined_blocks_match_the_blocks_in_order_forward_and_backward(mesh, inputs):
    w, x = inputs
    w_placed = jax.device_put(w, NamedSharding(mesh, P("stage")))
    x_placed = jax.device_put(x, NamedSharding(mesh, P(None, ("data", "fsdp"))))
    (loss, (y, counts)), grad = _pipelined(mesh)(w_placed, x_placed)

    def reference(w):
        y = jax.vmap(lambda x_bSD: _blocks(x_bSD, w)[0])(x)
        return jnp.sum(y**2), y

    (want_loss, want_y), want_grad = jax.value_and_grad(reference, has_aux=True)(w)
    np.testing.assert_allclose(np.asarray(y), want_y, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
    np.testing.assert_allclose(
        np.asarray(jax.reshard(grad, NamedSharding(mesh, P("stage")))), want_grad, rtol=1e-4, atol=1e-4
    )
    # every layer ran each micro-batch once: the M + P - 1 ticks' bubble is not counted
    np.testing.assert_array_equal(np.asarray(counts), np.full((2, LAYERS // 2), MICRO_BATCHES))


def test_jax_still_needs_the_vmap_workaround_for_reduced_weights(devices):
    """A canary: when this fails, jax's vmap reads reduced specs itself and `_vmap_accepts_reduced_weights` can go."""
    from lab.parallel.pipeline.spmd import _vmap_accepts_reduced_weights

    mesh = MeshSpec.parse("data=2,stage=2").build(devices[:4])
    reduced = NamedSharding(mesh, P("stage", None, reduced={"data"}))

    def doubled(w):
        return jax.vmap(lambda row: row * 2)(jax.reshard(w, reduced))

    weights = jax.device_put(np.ones((2, 3), np.float32), NamedSharding(mesh, P("stage", None)))
    with jax.set_mesh(mesh):
        with pytest.raises(ValueError, match="dangerous"):
            jax.jit(doubled)(weights)
        with _vmap_accepts_reduced_weights():
            np.testing.assert_array_equal(np.asarray(jax.jit(doubled)(weights)), 2 * np.ones((2, 3)))
