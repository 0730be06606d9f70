"""A training step with an optax optimizer, weights over `fsdp`, batch over `data`, and one surprise on purpose.

    lab inspect --fn examples/optax_train_step.py:train_step --mesh data=2,fsdp=4

Parameters and AdamW's two moments are sharded over `fsdp` (ZeRO-3 as
written by most JAX users: the shardings on the arguments, the rest left to
XLA). Each weight is gathered where a matmul needs it, each gradient reduced
over `data` and `fsdp`; those are explained by the weights and the batch.

The surprise: the model normalizes the columns of `w_up` (weight
normalization, Salimans & Kingma 2016). The norm sums over the rows, which
are split over `fsdp`, so XLA inserts an all-reduce of per-column partial
sums that neither a weight, a gradient nor the batch explains. `lab inspect`
lists it first, at the line below that computes the norm.

It finds a second one, not planted: the embedding lookup. The table's rows
(the vocabulary) are split over `fsdp`, so each device looks up the rows it
holds and an all-reduce adds the partial lookups, activations of the batch's
size, where a ZeRO-3 reader expects the table gathered.
"""

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

D_MODEL, D_FF, VOCAB, BATCH, SEQ = 256, 1024, 512, 16, 64


def init_params(key):
    k1, k2, k3 = jax.random.split(key, 3)
    return {
        "embed": jax.random.normal(k1, (VOCAB, D_MODEL)) * 0.02,
        "w_up": jax.random.normal(k2, (D_MODEL, D_FF)) * D_MODEL**-0.5,
        "w_down": jax.random.normal(k3, (D_FF, D_MODEL)) * D_FF**-0.5,
    }


def loss_fn(params, tokens, targets):
    x = params["embed"][tokens]
    w_up = params["w_up"] / jnp.linalg.norm(params["w_up"], axis=0, keepdims=True)  # the surprise: a norm over fsdp
    h = jax.nn.gelu(x @ w_up)
    logits = (h @ params["w_down"]) @ params["embed"].T
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


optimizer = optax.adamw(3e-4)


def train_step(mesh):
    def abstract(tree, spec):
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, spec)), tree)

    params = abstract(jax.eval_shape(lambda: init_params(jax.random.key(0))), P("fsdp", None))
    opt_state = jax.eval_shape(optimizer.init, params)
    opt_state = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(
            a.shape, a.dtype, sharding=NamedSharding(mesh, P("fsdp", None) if a.ndim == 2 else P())
        ),
        opt_state,
    )
    tokens = jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32, sharding=NamedSharding(mesh, P("data", None)))

    @jax.jit
    def step(params, opt_state, tokens, targets):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, targets)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step, (params, opt_state, tokens, tokens)
