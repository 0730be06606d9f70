"""Steps for `lab predict --fn`, ``NAME(mesh) -> (fn, args)`` with abstract arguments: the lab's own model step (the
same program `lab predict --model` compiles), a matmul whose FLOPs are counted by hand, and one too big for a chip."""

from dataclasses import replace

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from lab.predict.spec import parse_model
from lab.predict.step import step_program

SMALL = "layers=2,d_model=256,heads=4,kv_heads=2,head_dim=64,d_ff=512,vocab=1024,mlp=swiglu"
SEQ, BATCH_PER_DEVICE = 128, 2
ROWS, WIDTH = 4096, 8192  # the matmul's x [ROWS, WIDTH] (rows over fsdp) and w [WIDTH, WIDTH] (columns over fsdp)


def lab_model(mesh):
    """`lab predict --model SMALL --seq 128 --batch-per-device 2`'s step, as a user would hand it over."""
    model = replace(parse_model(SMALL), seq=SEQ, attention="flash")
    return step_program(model, mesh, BATCH_PER_DEVICE)


def matmul_gradient(mesh):
    """The gradient of sum(tanh(x @ w)) in w: two matmuls of 2 x ROWS x WIDTH x WIDTH FLOPs, all chips together."""
    x = jax.ShapeDtypeStruct((ROWS, WIDTH), jnp.bfloat16, sharding=NamedSharding(mesh, P("fsdp", None)))
    w = jax.ShapeDtypeStruct((WIDTH, WIDTH), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "fsdp")))
    return jax.grad(lambda x, w: jnp.tanh(x @ w).sum(), argnums=1), (x, w)


def too_big(mesh):
    """Three 6 GiB weights replicated on every chip, which no 16 GiB v5e holds (none alone exceeds its HBM)."""
    w = jax.ShapeDtypeStruct((3 * 2**14, 2**15), jnp.float32, sharding=NamedSharding(mesh, P()))
    return (lambda a, b, c: a + b * c), (w, w, w)
