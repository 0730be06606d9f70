"""A `shard_map` program: a tensor-parallel matmul written by hand, each collective asked for by name.

    lab inspect --fn examples/shard_map_collectives.py:tensor_parallel_mlp --mesh data=2,tensor=4

Inside `shard_map` every device sees its own block: `x` is split over `data`
(rows) and over `tensor` (columns), so its row is first put together with an
`all_gather` over `tensor`; the MLP is Megatron's: the first weight split by
columns, the second by rows, the partial products summed with `psum` over
`tensor` (an all-reduce of activations). A ring shift passes each `data`
shard's rows to its neighbour (`ppermute`, a collective-permute, the step of a
ring algorithm), and the loss is averaged over `data` with `pmean`.
"""

from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

D_MODEL, D_FF, BATCH = 256, 1024, 32


def tensor_parallel_mlp(mesh):
    tensor = mesh.shape["tensor"]

    @jax.jit
    @partial(
        jax.shard_map,
        mesh=mesh,
        in_specs=(P("data", "tensor"), P(None, "tensor"), P("tensor", None)),
        out_specs=(P(), P("data", None)),
    )
    def mlp(x, w_in, w_out):
        x = jax.lax.all_gather(x, "tensor", axis=1, tiled=True)  # every device needs the whole row of x
        h = jax.nn.relu(x @ w_in)  # column-parallel: this device's block of hidden units
        y = jax.lax.psum(h @ w_out, "tensor")  # row-parallel: partial sums over the hidden units, summed
        neighbours = [(i, (i + 1) % mesh.shape["data"]) for i in range(mesh.shape["data"])]
        shifted = jax.lax.ppermute(y, "data", neighbours)  # a ring step: the next data shard's rows
        loss = jax.lax.pmean(jnp.mean((y - shifted) ** 2), "data")
        return loss, shifted

    def abstract(shape, spec):
        return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, spec))

    assert D_MODEL % tensor == 0, "tensor must divide the model width"
    args = (
        abstract((BATCH, D_MODEL), P("data", "tensor")),
        abstract((D_MODEL, D_FF), P(None, "tensor")),
        abstract((D_FF, D_MODEL), P("tensor", None)),
    )
    return mlp, args
