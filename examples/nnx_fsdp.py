"""A flax nnx MLP whose weights are sharded over `fsdp`, its batch over `data`: one forward and backward pass.

Inspect it without allocating a single weight:

    lab inspect --fn examples/nnx_fsdp.py:train_step --mesh data=2,fsdp=4

and price its step on eight v5e chips, compile-only:

    lab predict --fn examples/nnx_fsdp.py:train_step --target tpu:v5e:2x4 --mesh data=2,fsdp=4

`train_step(mesh)` is the one thing the lab asks of a program: a function of
the mesh that returns the step and its arguments. The arguments here are
abstract (`jax.ShapeDtypeStruct` with a `NamedSharding`), made by
`nnx.eval_shape` from the model's own partitioning annotations.
"""

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

D_MODEL, D_FF, BATCH = 512, 2048, 64


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.w_up = nnx.Linear(
            D_MODEL, D_FF, use_bias=False, kernel_init=nnx.with_partitioning(init, ("fsdp", None)), rngs=rngs
        )
        self.w_down = nnx.Linear(
            D_FF, D_MODEL, use_bias=False, kernel_init=nnx.with_partitioning(init, ("fsdp", None)), rngs=rngs
        )

    def __call__(self, x):
        return self.w_down(jax.nn.gelu(self.w_up(x)))


def loss_fn(model: MLP, x, y):
    return jnp.mean((model(x) - y) ** 2)


def train_step(mesh):
    abstract = nnx.eval_shape(lambda: MLP(nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    specs = nnx.get_partition_spec(state)
    params = jax.tree.map(
        lambda leaf, spec: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=NamedSharding(mesh, spec)),
        state,
        specs,
    )
    batch = jax.ShapeDtypeStruct((BATCH, D_MODEL), jnp.float32, sharding=NamedSharding(mesh, P("data", None)))

    @jax.jit
    def step(params, x, y):
        model = nnx.merge(graphdef, params)
        loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
        return loss, nnx.state(grads)

    return step, (params, batch, batch)
