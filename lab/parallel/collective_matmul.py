"""Collective matmul: overlapping a matmul with the collective it depends on, by decomposing both.

A step that computes for C seconds and communicates for T seconds takes C + T
when one waits for the other, and max(C, T) when they run at once: overlap
hides min(C, T) and never removes bytes.

``all_gather(X) @ W`` must wait for the whole gather before the matmul starts
(Wang et al. 2023, "Overlap Communication with Dependent Computation via
Decomposition in Large Deep Learning Models", ASPLOS; the scaling book,
Part 3, "collective matmul"). Cut it into N block products instead: each ring
step multiplies the block a device holds while the next block travels, one
``ppermute`` per step, so only the first block's product and the last
transfer stay exposed. The bidirectional variant sends blocks both ways round
the ring and needs floor(N/2) steps; ``reduce_scatter(X @ W)`` works the same
way backwards: each step adds the block product a partial sum needs while
that partial sum travels.

Each algorithm is a `MatmulVariant` next to its plain twin (gather then
multiply, multiply then reduce-scatter); `build_matmul` makes any of them a
jitted global program Y = X @ W over one mesh axis. Whether the compiler
really overlaps the steps is read from the schedule it wrote
(`lab.hlo.schedule`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from lab.collectives import ring_pairs, send
from lab.errors import LabError

# ------------------------------------------------------------------ collective matmul
# Inside shard_map, on one device. x_MK is this device's rows (all-gather) or
# columns (reduce-scatter) of X; w_KF its piece of W.


def ring_allgather_matmul(x_MK: jax.Array, w_KF: jax.Array, axis: str) -> jax.Array:
    """all_gather(x, axis) @ w as N block products on a ring: (N*M, F).

    At step s a device holds the rows of device (me - s) and multiplies them
    while sending them on to device me + 1.
    """
    n, me = lax.axis_size(axis), lax.axis_index(axis)
    out_NMF = jnp.zeros((n, x_MK.shape[0], w_KF.shape[1]), jnp.result_type(x_MK, w_KF))
    block_MK = x_MK
    for step in range(n):
        # issued before the product so that the transfer and the dot are independent
        incoming_MK = send(block_MK, axis, ring_pairs(n, 1)) if step < n - 1 else None
        out_NMF = lax.dynamic_update_index_in_dim(out_NMF, block_MK @ w_KF, (me - step) % n, axis=0)
        block_MK = incoming_MK
    return out_NMF.reshape(n * x_MK.shape[0], w_KF.shape[1])


def bidirectional_allgather_matmul(x_MK: jax.Array, w_KF: jax.Array, axis: str) -> jax.Array:
    """all_gather(x) @ w with blocks travelling both ways: floor(N/2) steps, each block the short way.

    Step s brings the rows of device me - s from the left and of me + s from
    the right; for even N the block opposite arrives once, from the left.
    """
    n, me = lax.axis_size(axis), lax.axis_index(axis)
    out_NMF = jnp.zeros((n, x_MK.shape[0], w_KF.shape[1]), jnp.result_type(x_MK, w_KF))
    from_left_MK = from_right_MK = x_MK
    out_NMF = lax.dynamic_update_index_in_dim(out_NMF, x_MK @ w_KF, me, axis=0)
    for step in range(1, n // 2 + 1):
        from_left_MK = send(from_left_MK, axis, ring_pairs(n, 1))
        out_NMF = lax.dynamic_update_index_in_dim(out_NMF, from_left_MK @ w_KF, (me - step) % n, axis=0)
        if 2 * step != n:
            from_right_MK = send(from_right_MK, axis, ring_pairs(n, -1))
            out_NMF = lax.dynamic_update_index_in_dim(out_NMF, from_right_MK @ w_KF, (me + step) % n, axis=0)
    return out_NMF.reshape(n * x_MK.shape[0], w_KF.shape[1])


def ring_matmul_reduce_scatter(x_MK: jax.Array, w_KF: jax.Array, axis: str) -> jax.Array:
    """reduce_scatter(x @ w, axis) over rows, on a ring: (M/N, F).

    A partial sum for row block b travels the ring; each device adds its own
    product for block b, computed just before it is needed, so the product of
    the next step overlaps the transfer. After N-1 steps device i holds block i.
    """
    n, me = lax.axis_size(axis), lax.axis_index(axis)
    rows = x_MK.shape[0] // n

    def product(block) -> jax.Array:
        return lax.dynamic_slice_in_dim(x_MK, (block % n) * rows, rows, axis=0) @ w_KF

    partial_sum_MF = product(me - 1)
    for step in range(n - 1):
        partial_sum_MF = send(partial_sum_MF, axis, ring_pairs(n, 1)) + product(me - step - 2)
    return partial_sum_MF


def plain_allgather_matmul(x_MK: jax.Array, w_KF: jax.Array, axis: str) -> jax.Array:
    """The reference twin: gather everything, then one matmul."""
    return lax.all_gather(x_MK, axis, axis=0, tiled=True) @ w_KF


def plain_matmul_reduce_scatter(x_MK: jax.Array, w_KF: jax.Array, axis: str) -> jax.Array:
    """The reference twin: one matmul, then one reduce-scatter."""
    return lax.psum_scatter(x_MK @ w_KF, axis, scatter_dimension=0, tiled=True)


@dataclass(frozen=True)
class MatmulVariant:
    """One way to compute a sharded matmul: its shard_map body and its global layouts."""

    name: str
    local: Callable[[jax.Array, jax.Array, str], jax.Array]
    x_spec: Callable[[str], P]  # axis -> how X [M, K] is split
    w_spec: Callable[[str], P]  # axis -> how W [K, F] is split
    out_spec: Callable[[str], P]  # axis -> how Y [M, F] is split
    plain: str  # the variant with the same result computed the plain way


def _rows(axis: str) -> P:
    return P(axis, None)


def _columns(axis: str) -> P:
    return P(None, axis)


VARIANTS: dict[str, MatmulVariant] = {
    v.name: v
    for v in (
        MatmulVariant(
            "all-gather then matmul", plain_allgather_matmul, _rows, _columns, _columns, "all-gather then matmul"
        ),
        MatmulVariant(
            "ring all-gather matmul", ring_allgather_matmul, _rows, _columns, _columns, "all-gather then matmul"
        ),
        MatmulVariant(
            "bidirectional all-gather matmul",
            bidirectional_allgather_matmul,
            _rows,
            _columns,
            _columns,
            "all-gather then matmul",
        ),
        MatmulVariant(
            "matmul then reduce-scatter",
            plain_matmul_reduce_scatter,
            _columns,
            _rows,
            _rows,
            "matmul then reduce-scatter",
        ),
        MatmulVariant(
            "ring matmul reduce-scatter",
            ring_matmul_reduce_scatter,
            _columns,
            _rows,
            _rows,
            "matmul then reduce-scatter",
        ),
    )
}


@dataclass(frozen=True)
class MatmulProgram:
    """A variant over one mesh axis as a jitted global program Y = X @ W, with its input layouts."""

    variant: MatmulVariant
    mesh: Mesh
    axis: str
    shape_MKF: tuple[int, int, int]
    dtype: np.dtype
    fn: Callable[[jax.Array, jax.Array], jax.Array]

    def abstract_inputs(self) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
        m, k, f = self.shape_MKF
        x_sharding = NamedSharding(self.mesh, self.variant.x_spec(self.axis))
        w_sharding = NamedSharding(self.mesh, self.variant.w_spec(self.axis))
        return (
            jax.ShapeDtypeStruct((m, k), self.dtype, sharding=x_sharding),
            jax.ShapeDtypeStruct((k, f), self.dtype, sharding=w_sharding),
        )

    def example_inputs(self, seed: int = 0) -> tuple[jax.Array, jax.Array]:
        """Random X and W placed as `fn` expects."""
        rng = np.random.default_rng(seed)
        return tuple(
            jax.device_put(rng.standard_normal(a.shape).astype(self.dtype), a.sharding) for a in self.abstract_inputs()
        )

    @property
    def flops(self) -> int:
        """2MKF: the matmul's FLOPs over all devices."""
        m, k, f = self.shape_MKF
        return 2 * m * k * f


def build_matmul(variant: str, mesh: Mesh, axis: str, shape_MKF: Sequence[int], dtype=np.float32) -> MatmulProgram:
    """`variant` (one of VARIANTS) of Y[M,F] = X[M,K] @ W[K,F] over mesh `axis`, jitted."""
    if variant not in VARIANTS:
        raise LabError(f"unknown matmul variant {variant!r}; choose one of: {', '.join(VARIANTS)}")
    if axis not in mesh.axis_names:
        raise LabError(f"axis {axis!r} is not a mesh axis; use one of {', '.join(mesh.axis_names)}")
    chosen, n = VARIANTS[variant], mesh.shape[axis]
    m, k, f = (int(d) for d in shape_MKF)
    _check_divides(chosen, n, axis, (m, k, f))
    program = jax.shard_map(
        partial(chosen.local, axis=axis),
        mesh=mesh,
        in_specs=(chosen.x_spec(axis), chosen.w_spec(axis)),
        out_specs=chosen.out_spec(axis),
    )
    return MatmulProgram(chosen, mesh, axis, (m, k, f), np.dtype(dtype), jax.jit(program))


def _check_divides(variant: MatmulVariant, n: int, axis: str, shape_MKF: tuple[int, int, int]) -> None:
    """Every split dimension must be a multiple of the ring's N (the reduce-scatter also cuts M)."""
    m, k, f = shape_MKF
    needs = {"M": m, "F": f} if variant.x_spec(axis) == _rows(axis) else {"M": m, "K": k}
    for name, size in needs.items():
        if size < 1 or size % n:
            raise LabError(
                f"{variant.name}: {name}={size} is not a positive multiple of "
                f"{n}, the size of the ring axis {axis!r}; choose {name} divisible "
                f"by {n}"
            )
