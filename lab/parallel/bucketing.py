"""Gradient bucketing: the gradients of a step reduced in a few fixed-size all-reduces.

Data parallelism sums every gradient over the data axis. One all-reduce per
tensor pays the per-collective latency alpha once per tensor; one all-reduce
of everything pays it once but can start only when the last gradient exists.
PyTorch DDP packs gradients, in backward order, into buckets of
``bucket_cap_mb`` (25 MiB by default) and launches a bucket's all-reduce as
soon as it is full, so communication overlaps the rest of the backward pass
(Li et al. 2020, "PyTorch Distributed: Experiences on Accelerating Data
Parallel Training", VLDB, Section 3.2.3); DeepSpeed's ZeRO reduces in buckets
of ``reduce_bucket_size`` = 5e8 elements. In the alpha-beta model a step then
costs (Li et al., Figure 2 and Section 3.2.3)

    T(b) = backward + exposed tail,   communication = n(b) * alpha + G * factor / beta,

with n(b) = ceil(G / b) buckets for G gradient bytes; `lab.theory` prices it.

Here the gradients are flattened in reverse leaf order (the last layer's
gradients exist first in a backward pass) and cut into buckets of exactly b
bytes; a bucket larger than all gradients is a single bucket. DDP instead
keeps each parameter whole (a bucket closes once it reaches the cap); the two
differ only in where a boundary falls. Each bucket is one ``psum``.

XLA has its own bucketing: its all-reduce combiner merges independent
all-reduces into one tuple-shaped all-reduce up to a byte threshold. On CPU
the threshold is unbounded (up to 256 operands, openxla/xla
xla/service/cpu/cpu_compiler.cc), so hand-made buckets are merged straight
back; on TPU it is the compile option ``xla_jf_crs_combiner_threshold_in_bytes``.
``keep_apart=True`` chains each bucket to the previous bucket's result through
``lax.optimization_barrier``: dependent all-reduces cannot be combined, and
they run in launch order, as DDP's buckets do on one communication stream.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from lab.errors import LabError
from lab.model import abstract_model, create_params, next_token_loss

DDP_BUCKET_BYTES = 25 * 2**20  # torch.nn.parallel.DistributedDataParallel(bucket_cap_mb=25)
DEEPSPEED_BUCKET_ELEMENTS = 500_000_000  # DeepSpeed ZeRO reduce_bucket_size default (elements, not bytes)


@dataclass(frozen=True)
class Segment:
    """Elements [start, stop) of gradient leaf `leaf`, flattened."""

    leaf: int
    start: int
    stop: int


@dataclass(frozen=True)
class Bucket:
    """One all-reduce: consecutive segments of the flattened gradients."""

    segments: tuple[Segment, ...]
    elements: int
    nbytes: int


@dataclass(frozen=True)
class BucketPlan:
    """How gradients of given shapes fall into buckets of `bucket_bytes`."""

    buckets: tuple[Bucket, ...]
    bucket_bytes: int
    total_bytes: int
    shapes: tuple[tuple[int, ...], ...]
    dtype: np.dtype

    @property
    def count(self) -> int:
        return len(self.buckets)

    @property
    def holds_everything(self) -> bool:
        """The bucket is at least as large as all gradients together: one all-reduce of everything."""
        return self.bucket_bytes >= self.total_bytes


def plan_buckets(leaves: Sequence, bucket_bytes: int) -> BucketPlan:
    """Cut the gradients (arrays or ShapeDtypeStructs of one dtype), last leaf first, into buckets of `bucket_bytes`."""
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, (int, np.integer)) or bucket_bytes <= 0:
        raise LabError(
            f"bucket size {bucket_bytes!r}: a bucket must hold a positive "
            f"whole number of bytes, e.g. 25 MiB = {DDP_BUCKET_BYTES}"
        )
    if not leaves:
        raise LabError("no gradients to bucket; pass the gradient arrays (or their ShapeDtypeStructs)")
    dtypes = {np.dtype(leaf.dtype) for leaf in leaves}
    if len(dtypes) > 1:
        raise LabError(
            f"gradients of several dtypes ({', '.join(sorted(d.name for d in dtypes))}) "
            "cannot share a bucket; bucket each dtype separately, as DDP "
            "does"
        )
    dtype = dtypes.pop()
    per_bucket = bucket_bytes // dtype.itemsize
    if per_bucket < 1:
        raise LabError(
            f"bucket size {bucket_bytes} bytes is smaller than one {dtype.name} "
            f"element ({dtype.itemsize} bytes); use at least {dtype.itemsize}"
        )
    shapes = tuple(tuple(leaf.shape) for leaf in leaves)
    stream = [Segment(i, 0, math.prod(shapes[i])) for i in reversed(range(len(shapes)))]
    buckets = tuple(Bucket(segments, count, count * dtype.itemsize) for segments, count in _cut(stream, per_bucket))
    return BucketPlan(buckets, int(bucket_bytes), sum(b.nbytes for b in buckets), shapes, dtype)


def _cut(stream: list[Segment], per_bucket: int) -> list[tuple[tuple[Segment, ...], int]]:
    """Split a stream of segments into runs of `per_bucket` elements (the last run may be shorter)."""
    runs, current, filled = [], [], 0
    for segment in stream:
        start = segment.start
        while start < segment.stop:
            take = min(segment.stop - start, per_bucket - filled)
            current.append(Segment(segment.leaf, start, start + take))
            start, filled = start + take, filled + take
            if filled == per_bucket:
                runs.append((tuple(current), filled))
                current, filled = [], 0
    if current:
        runs.append((tuple(current), filled))
    return runs


def bucketed_psum(
    leaves: Sequence[jax.Array], axis: str, plan: BucketPlan | None, *, keep_apart: bool = True
) -> list[jax.Array]:
    """Inside shard_map: the sum over `axis` of every gradient leaf, one psum per bucket of `plan`.

    Without a plan, one psum per leaf: the buckets are then whatever XLA's combiner makes of them.
    """
    if plan is None:
        return [lax.psum(leaf, axis) for leaf in leaves]
    if tuple(tuple(leaf.shape) for leaf in leaves) != plan.shapes:
        raise LabError(
            f"the gradients' shapes {[tuple(x.shape) for x in leaves]} differ "
            f"from the plan's {list(plan.shapes)}; plan the buckets for these "
            "gradients"
        )
    flat = [leaf.reshape(-1) for leaf in leaves]
    pieces: dict[Segment, jax.Array] = {}
    previous = None
    for bucket in plan.buckets:
        packed = jnp.concatenate([flat[s.leaf][s.start : s.stop] for s in bucket.segments])
        if keep_apart and previous is not None:
            # the bucket waits for the previous bucket's sum: XLA cannot combine dependent all-reduces
            packed = packed + 0.0 * previous[0]
        previous = lax.psum(packed, axis)
        offsets = np.cumsum([0] + [s.stop - s.start for s in bucket.segments])
        pieces.update({s: previous[offsets[k] : offsets[k + 1]] for k, s in enumerate(bucket.segments)})
    return [_unpack(pieces, index, leaf.shape) for index, leaf in enumerate(leaves)]


def _unpack(pieces: dict[Segment, jax.Array], leaf: int, shape) -> jax.Array:
    parts = sorted((s for s in pieces if s.leaf == leaf), key=lambda s: s.start)
    return jnp.concatenate([pieces[s] for s in parts]).reshape(shape)


# ------------------------------------------------------------------ the gradients of a step
# The programs below are cached by what defines them (model config, mesh, axis,
# plan): experiments that ask for the same program share one compilation.


@dataclass(frozen=True)
class _LocalLayout:
    """lab.model's Layout inside shard_map: every weight is already whole on every device."""

    compute_dtype: jnp.dtype = jnp.float32
    remat_policy: None = None

    def use(self, param) -> jax.Array:
        return param[...]


@dataclass(frozen=True)
class GradientProblem:
    """The lab transformer under data parallelism: replicated weights, a batch split over `axis`."""

    config: object  # lab.model.ModelConfig
    mesh: object
    axis: str
    params: object  # nnx.State, replicated (ShapeDtypeStructs when not placed)
    tokens: jax.Array  # [B, S+1], split over `axis`

    @property
    def leaves(self) -> list[jax.ShapeDtypeStruct]:
        """The gradient of each weight: its shape and dtype, in pytree order."""
        return [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in jax.tree.leaves(self.params)]


def local_gradients(config, axis: str, params, tokens_BT) -> list[jax.Array]:
    """Inside shard_map: this device's gradient leaves of the transformer `config`, not yet summed over `axis`."""

    graphdef, _ = abstract_model(config)
    # varying weights: autodiff then leaves each device's gradient local instead of summing it for us
    params = jax.tree.map(lambda p: lax.pcast(p, axis, to="varying"), params)

    def loss(p):
        logits = nnx.merge(graphdef, p)(tokens_BT[:, :-1], _LocalLayout())
        return next_token_loss(logits, tokens_BT[:, 1:])

    return jax.tree.leaves(jax.grad(loss)(params))


@functools.cache
def gradient_problem(
    config, mesh, axis: str = "data", sequences_per_device: int = 1, seed: int = 0, *, placed: bool = True
) -> GradientProblem:
    """The transformer `config` (a lab.model.ModelConfig) with random tokens on `mesh`.

    ``placed=False`` gives ShapeDtypeStructs only: enough to compile for a
    TPU topology that has no devices to run on.
    """

    if axis not in mesh.axis_names:
        raise LabError(f"axis {axis!r} is not a mesh axis; use one of {', '.join(mesh.axis_names)}")
    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P(axis))
    shape = (sequences_per_device * mesh.shape[axis], config.seq + 1)
    _, abstract = abstract_model(config)
    if not placed:
        params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated), abstract)
        return GradientProblem(config, mesh, axis, params, jax.ShapeDtypeStruct(shape, np.int32, sharding=split))
    params = create_params(
        config, jax.tree.map(lambda _: replicated, abstract), seed
    )  # one jitted initialisation, already replicated
    tokens = np.random.default_rng(seed).integers(0, config.vocab, shape, dtype=np.int32)
    return GradientProblem(config, mesh, axis, params, jax.device_put(tokens, split))


def local_gradient_program(problem: GradientProblem):
    """jit(params, tokens) -> every device's unreduced gradients, stacked: leaf [N, *shape]."""
    return _local_gradient_program(problem.config, problem.mesh, problem.axis)


@functools.cache
def _local_gradient_program(config, mesh, axis: str):

    def body(params, tokens_BT):
        return [g[None] for g in local_gradients(config, axis, params, tokens_BT)]

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(axis)), out_specs=P(axis)))


@functools.cache
def reduce_program(plan: BucketPlan | None, mesh, axis: str, *, keep_apart: bool = True):
    """jit(stacked local gradients) -> their sums over `axis`, one all-reduce per bucket of `plan`."""

    def body(stacked):
        return bucketed_psum([g[0] for g in stacked], axis, plan, keep_apart=keep_apart)

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(axis), out_specs=P()))


def step_program(problem: GradientProblem, plan: BucketPlan | None, *, keep_apart: bool = True):
    """jit(params, tokens) -> summed gradients: backward and bucketed all-reduces in one program."""
    return _step_program(problem.config, problem.mesh, problem.axis, plan, keep_apart)


@functools.cache
def _step_program(config, mesh, axis: str, plan: BucketPlan | None, keep_apart: bool):

    def body(params, tokens_BT):
        return bucketed_psum(local_gradients(config, axis, params, tokens_BT), axis, plan, keep_apart=keep_apart)

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(axis)), out_specs=P()))


def launch_cost_programs(mesh, axis: str, count: int = 64) -> dict[str, tuple]:
    """`count` dependent one-element all-reduces, and a single one: (compiled, args) each.

    The difference in time over count - 1 is the fixed cost of one all-reduce
    on this target (alpha_AR), free of any bandwidth term.
    """

    element = [jax.ShapeDtypeStruct((count,), jnp.float32)]
    stacked = [jax.device_put(jnp.ones((mesh.shape[axis], count), jnp.float32), NamedSharding(mesh, P(axis)))]
    chain = reduce_program(plan_buckets(element, 4), mesh, axis).lower(stacked).compile()
    single = reduce_program(plan_buckets(element, 4 * count), mesh, axis).lower(stacked).compile()
    return {"chain": (chain, (stacked,)), "single": (single, (stacked,))}
