"""Dropless experts: every (token, choice) multiplied by its own expert, nothing dropped, no buffer padded.

The capacity path (`lab.moe.dispatch`) gives each expert a fixed buffer of
slots and drops what overflows. MaxText's ``sparse_matmul`` path, which its
MoE recipes run, drops nothing: each device sorts its own T·k assignments by
expert, gathers the tokens into that order (each expert's rows now
contiguous), multiplies every expert's rows by its weights in one *grouped*
matmul, and puts the results back in token order, weighted by the gates.

The grouped matmul is megablox's Pallas kernel ``gmm`` on TPU (its gradient
``gmm`` again for the rows and ``tgmm`` for the weights), what MaxText runs
with ``megablox=True``; elsewhere `jax.lax.ragged_dot`. The kernel walks row
tiles of ``tm`` rows: every tile once, and once more for each expert whose
rows start inside a tile, so its work is the T·k rows plus up to E - 1 tiles
(`lab.predict.ops` prices it so). The sort is a permutation, so its gradient
is the inverse permutation, a gather like the forward (`permute`), not the
scatter-add XLA would derive for an indexed read.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

GMM_TILING = (512, 1024, 1024)  # rows, contraction, output columns: MaxText's default megablox tiles
NO_EXPERT_AXIS = (  # why a dropless layer refuses experts split over devices, and what to do instead
    "capacity=dropless multiplies each device's own tokens by every expert's whole weights (MaxText's sparse_matmul "
    "without expert parallelism); leave the expert axis out, or give a capacity such as 1.25"
)


@jax.custom_vjp
def permute(x_AD: jax.Array, order_A: jax.Array) -> jax.Array:
    """Rows of `x_AD` in the order `order_A` (a permutation): row i of the result is row order_A[i]."""
    return x_AD[order_A]


def _permute_forward(x_AD: jax.Array, order_A: jax.Array) -> tuple[jax.Array, jax.Array]:
    return x_AD[order_A], order_A


def _permute_backward(order_A: jax.Array, grad_AD: jax.Array) -> tuple[jax.Array, None]:
    return grad_AD[inverse(order_A)], None  # the row that went to i comes back from i


permute.defvjp(_permute_forward, _permute_backward)


def inverse(order_A: jax.Array) -> jax.Array:
    """The permutation that undoes `order_A`: inverse[order_A[i]] = i."""
    return jnp.zeros_like(order_A).at[order_A].set(jnp.arange(order_A.shape[0], dtype=order_A.dtype))


def ragged_matmul(lhs_AD: jax.Array, rhs_EDF: jax.Array, sizes_E: jax.Array, tpu: bool) -> jax.Array:
    """Rows [a, a + sizes_E[e]) of `lhs_AD` times `rhs_EDF[e]`, expert by expert, the rows sorted by expert.

    On TPU megablox's ``gmm``, its row count padded to a whole number of row tiles (rows past the last group
    belong to no expert and are cut off again); elsewhere `jax.lax.ragged_dot`.
    """
    if not tpu:
        return jax.lax.ragged_dot(lhs_AD, rhs_EDF, sizes_E)
    # local: the Pallas kernel is imported only by programs compiled for a TPU, as the flash kernel is
    from jax.experimental.pallas.ops.tpu.megablox import ops as megablox

    rows, (width, out) = lhs_AD.shape[0], rhs_EDF.shape[1:]
    tile_rows = row_tile(rows)
    padded = -(-rows // tile_rows) * tile_rows
    tiling = (tile_rows, min(GMM_TILING[1], width), min(GMM_TILING[2], out))
    lhs_AD = jnp.pad(lhs_AD, ((0, padded - rows), (0, 0)))
    return megablox.gmm(lhs_AD, rhs_EDF, sizes_E.astype(jnp.int32), lhs_AD.dtype, tiling)[:rows]


def row_tile(rows: int) -> int:
    """The grouped matmul's row tile for `rows` rows: MaxText's 512, or the rows rounded up to 128 when fewer."""
    return min(GMM_TILING[0], -(-rows // 128) * 128)


def dropless(x_TD: jax.Array, expert_TK: jax.Array, gate_TK: jax.Array, experts: int, mlp, tpu: bool) -> jax.Array:
    """Each token's gate-weighted sum of its k experts' outputs, every assignment computed.

    `mlp(x_AD, matmul, expert_A)` runs the experts on the sorted rows: `matmul(rows, weights_EDF)` is the grouped
    matmul over them, `expert_A` each row's expert (for per-expert biases).
    """
    tokens, k = expert_TK.shape
    expert_A = expert_TK.reshape(-1)
    order_A = jnp.argsort(expert_A, stable=True)  # assignments sorted by expert; row a is token a // k's
    sizes_E = jnp.bincount(expert_A, length=experts)
    matmul = functools.partial(ragged_matmul, sizes_E=sizes_E, tpu=tpu)
    x_AD = permute(jnp.repeat(x_TD, k, axis=0), order_A)
    y_AD = permute(mlp(x_AD, matmul, expert_A[order_A]), inverse(order_A))
    return jnp.einsum("tk,tkd->td", gate_TK.astype(y_AD.dtype), y_AD.reshape(tokens, k, -1))
