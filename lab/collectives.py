"""Collectives by hand: every primitive through ``shard_map``, and ring / tree
algorithms built from ``ppermute`` alone.

A collective is a communication pattern among the N devices that differ only
along some mesh axes: one axis, or a tuple of axes that JAX numbers row-major
(first axis major), like ``P(axes)`` lays out an array. Each device holds a
block of D elements (a vector; trailing dimensions ride along):

* all-reduce       every device ends with the sum of all N blocks
* all-gather       every device ends with the N blocks concatenated (N*D)
* reduce-scatter   device i ends with piece i (D/N) of the sum
* all-to-all       device i sends its piece j to device j (a transpose)
* collective-permute  device i sends its block to device i+1 (mod N)
* broadcast        every device ends with the root's block
* reduce           the root ends with the sum, every other device with zeros

The primitives are thin wrappers of ``jax.lax`` (psum, all_gather,
psum_scatter, all_to_all, ppermute). The algorithms rebuild the big three
from point-to-point sends, one ``ppermute`` per step, with the steps unrolled
in Python (N is static) so the compiled HLO shows one collective-permute each.
Time in the alpha-beta model, a per step plus bytes over link bandwidth b,
with D the bytes of the full vector a device holds (for all-gather: the
gathered output) (Thakur, Rabenseifner & Gropp, "Optimization of Collective
Communication Operations in MPICH", IJHPCA 2005; Patarasuk & Yuan,
"Bandwidth optimal all-reduce algorithms", JPDC 2009):

* ring reduce-scatter, ring all-gather: N-1 steps of D/N: (N-1)(a + D/(N b))
* ring all-reduce: both, 2(N-1) steps: 2(N-1)a + 2(N-1)/N D/b, bandwidth-optimal
* bidirectional ring: two rings of D/2 in opposite directions, each step
  sends D/(2N) each way, so a full-duplex link carries both at once
* recursive halving-doubling (power-of-two N): 2 log2 N steps moving
  D/2, D/4, ... then back: 2 log2(N) a + 2(N-1)/N D/b
* recursive doubling (power-of-two N): log2 N steps of the whole D:
  log2(N) a + log2(N) D/b, latency-optimal, bandwidth-poor

`build_program` wraps any of them, by name, into a jitted global program with
one data layout: the global input is the *stack* of the per-device blocks,
shape ``(N, D, ...)``, dim 0 sharded over the axes and replicated over the
other mesh axes; the output is the stack of the per-device results. Every
device's result is therefore visible, and a numpy twin of the same global
semantics (`CollectiveProgram.reference`) checks all of them.

One concept, one module: the primitives, the algorithms rebuilt from sends,
their numpy twins and the recipes that pair them are one table that
`build_program` reads by name; split apart, each part would import the others.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from lab.errors import LabError

# The collective kinds XLA emits, by their HLO opcodes: the one vocabulary of lab.hlo, lab.theory and the reports.
KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

Axes = tuple[str, ...]


# ------------------------------------------------------------ point to point
# Everything below runs inside shard_map, on the device's own block x (D, ...),
# over `axes`: a mesh axis name or a tuple of them.


def ring_pairs(n: int, shift: int = 1) -> list[tuple[int, int]]:
    """(source, target) pairs of a ring shift by `shift` among n devices."""
    return [(i, (i + shift) % n) for i in range(n)]


def butterfly_pairs(n: int, distance: int) -> list[tuple[int, int]]:
    """(source, target) pairs that swap device i with device i XOR distance."""
    return [(i, i ^ distance) for i in range(n)]


def send(x: jax.Array, axes, pairs: Sequence[tuple[int, int]]) -> jax.Array:
    """``lax.ppermute`` with devices numbered as ``lax.axis_index(axes)`` numbers them.

    Why not ppermute itself: for a tuple of axes named out of mesh order, such
    as ("tensor", "data"), jax 0.10 numbers ppermute's devices in mesh order
    (its lowering sorts each replica group), while axis_index, all_gather and
    ``P(axes)`` follow the order given. Renumbering the pairs into mesh order
    makes every collective here agree with the stack layout.
    """
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    mesh_axes = jax.sharding.get_abstract_mesh().axis_names
    in_mesh_order = tuple(sorted(axes, key=mesh_axes.index))
    given_sizes = [lax.axis_size(a) for a in axes]
    mesh_sizes = [lax.axis_size(a) for a in in_mesh_order]

    def renumber(index: int) -> int:
        coords = dict(zip(axes, np.unravel_index(index, given_sizes)))
        return int(np.ravel_multi_index([coords[a] for a in in_mesh_order], mesh_sizes))

    return lax.ppermute(x, in_mesh_order, [(renumber(s), renumber(t)) for s, t in pairs])


# ---------------------------------------------------------------- primitives


def all_reduce(x: jax.Array, axes) -> jax.Array:
    """Sum of the blocks of all devices along `axes`, on every device (psum)."""
    return lax.psum(x, axes)


def all_gather(x: jax.Array, axes) -> jax.Array:
    """The blocks of all devices along `axes`, concatenated in device order: (N*D, ...)."""
    return lax.all_gather(x, axes, axis=0, tiled=True)


def reduce_scatter(x: jax.Array, axes) -> jax.Array:
    """Piece i (of N, along dim 0) of the sum, on device i: (D/N, ...) (psum_scatter)."""
    _require_divisible(x, lax.axis_size(axes), axes)
    return lax.psum_scatter(x, axes, scatter_dimension=0, tiled=True)


def all_to_all(x: jax.Array, axes) -> jax.Array:
    """Device i sends its piece j (of N) to device j, and keeps the N pieces it receives in source order."""
    _require_divisible(x, lax.axis_size(axes), axes)
    return lax.all_to_all(x, axes, split_axis=0, concat_axis=0, tiled=True)


def collective_permute(x: jax.Array, axes, shift: int = 1) -> jax.Array:
    """Ring shift: device i sends its block to device i+shift (mod N)."""
    return send(x, axes, ring_pairs(lax.axis_size(axes), shift))


def broadcast(x: jax.Array, axes, root: int = 0) -> jax.Array:
    """The root's block on every device.

    XLA has no broadcast collective: the root contributes its block and the
    others zeros to an all-reduce, so the HLO shows an all-reduce.
    """
    return lax.psum(jnp.where(lax.axis_index(axes) == root, x, jnp.zeros_like(x)), axes)


def reduce(x: jax.Array, axes, root: int = 0) -> jax.Array:
    """The sum on the root; zeros elsewhere.

    Zeros, not the untouched input, so that the result is the same array as
    an MPI_Reduce receive buffer and a wrong root cannot pass unnoticed. XLA
    has no reduce-to-one collective either: this is an all-reduce, masked.
    """
    total = lax.psum(x, axes)
    return jnp.where(lax.axis_index(axes) == root, total, jnp.zeros_like(total))


# ---------------------------------------------------------------- algorithms


def ring_reduce_scatter(x: jax.Array, axes, direction: int = 1) -> jax.Array:
    """Reduce-scatter on a ring: N-1 steps, each passing one partial sum of D/N on.

    At step s device i sends the partial sum of piece i - direction*(s+1) and
    adds its own copy of the piece it receives; after N-1 steps the partial
    sum it holds is complete, and it is piece i, as `reduce_scatter` gives.
    """
    n = lax.axis_size(axes)
    pieces_ND = _split(x, n, axes)
    me = lax.axis_index(axes)
    partial = _piece(pieces_ND, me - direction)
    for step in range(n - 1):
        partial = send(partial, axes, ring_pairs(n, direction)) + _piece(pieces_ND, me - direction * (step + 2))
    return partial


def ring_all_gather(x: jax.Array, axes, direction: int = 1) -> jax.Array:
    """All-gather on a ring: N-1 steps, each passing the last block received on.

    At step s device i receives the block of device i - direction*(s+1) and
    writes it into its place in the output.
    """
    n = lax.axis_size(axes)
    me = lax.axis_index(axes)
    gathered_ND = lax.dynamic_update_index_in_dim(jnp.zeros((n, *x.shape), x.dtype), x, me, axis=0)
    block = x
    for step in range(n - 1):
        block = send(block, axes, ring_pairs(n, direction))
        gathered_ND = lax.dynamic_update_index_in_dim(gathered_ND, block, (me - direction * (step + 1)) % n, axis=0)
    return gathered_ND.reshape(n * x.shape[0], *x.shape[1:])


def ring_all_reduce(x: jax.Array, axes, direction: int = 1) -> jax.Array:
    """Ring reduce-scatter then ring all-gather: 2(N-1) steps of D/N each."""
    return ring_all_gather(ring_reduce_scatter(x, axes, direction), axes, direction)


def bidirectional_ring_all_reduce(x: jax.Array, axes) -> jax.Array:
    """Two ring all-reduces of D/2, one each way round, so both link directions carry data."""
    clockwise, counter = _split(x, 2, axes, why="2 (one half per ring direction)")
    return jnp.concatenate([ring_all_reduce(clockwise, axes, +1), ring_all_reduce(counter, axes, -1)])


def halving_doubling_all_reduce(x: jax.Array, axes) -> jax.Array:
    """Recursive halving reduce-scatter, then recursive doubling all-gather (power-of-two N).

    Halving: partners at distance N/2, N/4, ..., 1 swap halves of what they
    hold, each keeping the half its bit at that distance selects, and add;
    device i ends with piece i of the sum. Doubling retraces the distances
    backwards, concatenating, until everyone holds the whole sum.
    """
    n = lax.axis_size(axes)
    require_power_of_two(n, axes)
    _require_divisible(x, n, axes)  # every halving must split evenly
    me = lax.axis_index(axes)
    distances = [n >> (k + 1) for k in range(n.bit_length() - 1)]  # N/2, ..., 1
    segment = x
    for distance in distances:
        upper = (me // distance) % 2 == 1
        low, high = jnp.split(segment, 2)
        keep, give = jnp.where(upper, high, low), jnp.where(upper, low, high)
        segment = keep + send(give, axes, butterfly_pairs(n, distance))
    for distance in reversed(distances):
        upper = (me // distance) % 2 == 1
        other = send(segment, axes, butterfly_pairs(n, distance))
        segment = jnp.concatenate([jnp.where(upper, other, segment), jnp.where(upper, segment, other)])
    return segment


def recursive_doubling_all_reduce(x: jax.Array, axes) -> jax.Array:
    """Partners at distance 1, 2, ..., N/2 swap their whole vector and add (power-of-two N).

    log2 N steps of D each: the fewest steps, but log2(N)/2 times the ring's
    bytes per step in total, so it wins only for small messages (MPICH uses it
    below a crossover size; Thakur, Rabenseifner & Gropp 2005).
    """
    n = lax.axis_size(axes)
    require_power_of_two(n, axes)
    for distance in [1 << k for k in range(n.bit_length() - 1)]:
        x = x + send(x, axes, butterfly_pairs(n, distance))
    return x


def require_power_of_two(n: int, axes) -> None:
    """Recursive halving-doubling pairs devices by bits: N must be a power of two."""
    if n < 1 or n & (n - 1):
        raise LabError(
            "halving-doubling all-reduce needs a power-of-two number of devices, "
            f"but {_named(axes)} spans {n}; use ring-all-reduce, or a mesh "
            "whose axes multiply to 2, 4, 8, ..."
        )


def _require_divisible(x: jax.Array, parts: int, axes, why: str | None = None) -> None:
    """A per-device block whose dim 0 `parts` does not divide is a user error."""
    if x.ndim == 0 or x.shape[0] % parts:
        size = x.shape[0] if x.ndim else "a scalar"
        reason = why or f"{parts}, the number of devices along {_named(axes)}"
        raise LabError(
            f"dimension 0 of the per-device block (size {size}) is not divisible "
            f"by {reason}; make it a multiple of {parts}"
        )


def _split(x: jax.Array, parts: int, axes, why: str | None = None) -> jax.Array:
    """x (D, ...) as (parts, D/parts, ...)."""
    _require_divisible(x, parts, axes, why)
    return x.reshape(parts, x.shape[0] // parts, *x.shape[1:])


def _piece(pieces_ND: jax.Array, index) -> jax.Array:
    """Piece `index` (mod N, may be traced) of pieces (N, D/N, ...)."""
    return lax.dynamic_index_in_dim(pieces_ND, index % pieces_ND.shape[0], axis=0, keepdims=False)


def _named(axes) -> str:
    """ "axis 'fsdp'" or "axes ('data', 'tensor')", for messages."""
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    return f"axis {axes[0]!r}" if len(axes) == 1 else "axes (" + ", ".join(map(repr, axes)) + ")"


# ------------------------------------------------------ numpy reference twins
# Global view: `stack` is (N, D, ...), row i the block of device i; each
# returns the stack of what every device should end with.


def _sum_everywhere(stack: np.ndarray, root: int) -> np.ndarray:
    return np.broadcast_to(stack.sum(0, dtype=stack.dtype), stack.shape)


def _gather_everywhere(stack: np.ndarray, root: int) -> np.ndarray:
    n = stack.shape[0]
    return np.broadcast_to(stack.reshape(1, -1, *stack.shape[2:]), (n, n * stack.shape[1], *stack.shape[2:]))


def _sum_scattered(stack: np.ndarray, root: int) -> np.ndarray:
    n = stack.shape[0]
    return stack.sum(0, dtype=stack.dtype).reshape(n, -1, *stack.shape[2:])


def _transposed(stack: np.ndarray, root: int) -> np.ndarray:
    n = stack.shape[0]
    return stack.reshape(n, n, -1, *stack.shape[2:]).swapaxes(0, 1).reshape(stack.shape)


def _shifted(stack: np.ndarray, root: int) -> np.ndarray:
    return np.roll(stack, 1, axis=0)


def _root_everywhere(stack: np.ndarray, root: int) -> np.ndarray:
    return np.broadcast_to(stack[root], stack.shape)


def _sum_on_root(stack: np.ndarray, root: int) -> np.ndarray:
    out = np.zeros_like(stack)
    out[root] = stack.sum(0, dtype=stack.dtype)
    return out


# ------------------------------------------------------------------ registry


def _any_group(n: int, axes: Axes) -> None:
    """Most collectives run on any number of devices."""


@dataclass(frozen=True)
class Recipe:
    """One named collective: what each device runs, and what the stack must become.

    `local(x, axes, **options)` runs inside shard_map on one device's block;
    `reference(stack, root)` is the numpy twin on the global stack;
    `same_as` names the primitive with the same semantics (itself for a
    primitive), which an algorithm must match exactly; `hlo_op` is the HLO
    collective the program compiles to, `hlo_op_count(n)` how many of them it
    issues for N >= 2 devices; dim 0 of the block must split into
    `parts(n)` pieces; `gathers` means the output is N blocks, so theory's D
    (the full vector a device holds) is the output; `rooted` collectives take
    a root; `check_group(n, axes)` rejects group sizes the algorithm cannot use.
    """

    name: str
    local: Callable[..., jax.Array]
    reference: Callable[[np.ndarray, int], np.ndarray]
    same_as: str
    hlo_op: str
    hlo_op_count: Callable[[int], int]
    parts: Callable[[int], int] = lambda n: n
    gathers: bool = False
    rooted: bool = False
    check_group: Callable[[int, Axes], None] = _any_group


def _one(n: int) -> int:
    return 1


RECIPES: dict[str, Recipe] = {
    recipe.name: recipe
    for recipe in [
        Recipe("all-reduce", all_reduce, _sum_everywhere, "all-reduce", "all-reduce", _one, parts=_one),
        Recipe(
            "all-gather", all_gather, _gather_everywhere, "all-gather", "all-gather", _one, parts=_one, gathers=True
        ),
        Recipe("reduce-scatter", reduce_scatter, _sum_scattered, "reduce-scatter", "reduce-scatter", _one),
        Recipe("all-to-all", all_to_all, _transposed, "all-to-all", "all-to-all", _one),
        Recipe(
            "collective-permute",
            collective_permute,
            _shifted,
            "collective-permute",
            "collective-permute",
            _one,
            parts=_one,
        ),
        Recipe("broadcast", broadcast, _root_everywhere, "broadcast", "all-reduce", _one, parts=_one, rooted=True),
        Recipe("reduce", reduce, _sum_on_root, "reduce", "all-reduce", _one, parts=_one, rooted=True),
        Recipe(
            "ring-reduce-scatter",
            ring_reduce_scatter,
            _sum_scattered,
            "reduce-scatter",
            "collective-permute",
            lambda n: n - 1,
        ),
        Recipe(
            "ring-all-gather",
            ring_all_gather,
            _gather_everywhere,
            "all-gather",
            "collective-permute",
            lambda n: n - 1,
            parts=_one,
            gathers=True,
        ),
        Recipe(
            "ring-all-reduce",
            ring_all_reduce,
            _sum_everywhere,
            "all-reduce",
            "collective-permute",
            lambda n: 2 * (n - 1),
        ),
        # Two rings, each 2(N-1) steps; XLA keeps the two directions as separate permutes.
        Recipe(
            "bidirectional-ring-all-reduce",
            bidirectional_ring_all_reduce,
            _sum_everywhere,
            "all-reduce",
            "collective-permute",
            lambda n: 4 * (n - 1),
            parts=lambda n: 2 * n,
        ),
        Recipe(
            "halving-doubling-all-reduce",
            halving_doubling_all_reduce,
            _sum_everywhere,
            "all-reduce",
            "collective-permute",
            lambda n: 2 * (n.bit_length() - 1),
            check_group=require_power_of_two,
        ),
        Recipe(
            "recursive-doubling-all-reduce",
            recursive_doubling_all_reduce,
            _sum_everywhere,
            "all-reduce",
            "collective-permute",
            lambda n: n.bit_length() - 1,
            parts=_one,
            check_group=require_power_of_two,
        ),
    ]
}
NAMES: tuple[str, ...] = tuple(RECIPES)


@dataclass(frozen=True)
class CollectiveProgram:
    """A collective over `axes` of `mesh` as a jitted global program: stack in, stack out.

    ``fn(place(x))`` runs it on a stack x of shape (N, block...) whose row i is
    the block of the i-th device along the axes; ``reference(x)`` is its numpy
    twin. ``fn`` is a plain ``jax.jit`` function, so ``fn.lower(...)`` works,
    also on `abstract_input` for compile-only targets.
    """

    recipe: Recipe
    mesh: Mesh
    axes: Axes
    root: int
    fn: Callable[[jax.Array], jax.Array]

    @property
    def name(self) -> str:
        return self.recipe.name

    @property
    def group_size(self) -> int:
        """N: the devices that take part in each instance of the collective."""
        return _group_size(self.mesh, self.axes)

    @property
    def spec(self) -> P:
        return P(self.axes)

    @property
    def sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec)

    def check_input(self, shape: Sequence[int]) -> None:
        """Raise LabError unless `shape` is a stack of N blocks whose dim 0 splits as this collective needs."""
        n, parts = self.group_size, self.recipe.parts(self.group_size)
        if len(shape) < 2 or shape[0] != n:
            raise LabError(
                f"{self.name} over {_named(self.axes)}: the input must be a "
                f"stack (N, D, ...) with N={n} per-device blocks, got shape "
                f"{tuple(shape)}; stack one block per device along dimension "
                "0"
            )
        if shape[1] % parts:
            raise LabError(
                f"{self.name} over {_named(self.axes)}: dimension 1 of the input "
                f"(size {shape[1]}) is not divisible by {parts} (it cuts each "
                f"block into {parts} pieces for {n} devices); make it a multiple "
                f"of {parts}"
            )

    def place(self, x) -> jax.Array:
        """Put the stack on the mesh as ``fn`` expects: row i on the i-th device along the axes."""
        self.check_input(np.shape(x))
        return jax.device_put(x, self.sharding)

    def reference(self, x) -> np.ndarray:
        """What ``fn`` must return for the stack x, computed with numpy."""
        self.check_input(np.shape(x))
        return self.recipe.reference(np.asarray(x), self.root)

    def data_bytes(self, x) -> int:
        """Theory's D for the stack x (an array or ShapeDtypeStruct): bytes of the full vector a device holds
        (gathers: after)."""
        block = int(np.prod(x.shape[1:])) * np.dtype(x.dtype).itemsize
        return block * self.group_size if self.recipe.gathers else block

    def input_shape(self, bytes_per_device: int, dtype) -> tuple[int, int]:
        """The stack shape (N, D/itemsize, or D/(N itemsize) for gathers) whose D is `bytes_per_device`."""
        n, dtype = self.group_size, np.dtype(dtype)
        unit = dtype.itemsize * (n if self.recipe.gathers else 1)  # a gathered D is N blocks
        if bytes_per_device % unit or bytes_per_device < unit:
            raise LabError(
                f"{self.name} over {_named(self.axes)}: D={bytes_per_device} "
                f"bytes per device is not a positive multiple of {unit} bytes "
                f"({dtype.name}{f' x {n} blocks' if self.recipe.gathers else ''}); "
                f"choose a multiple of {unit}"
            )
        shape = (n, bytes_per_device // unit)
        self.check_input(shape)
        return shape

    def example_input(self, bytes_per_device: int, dtype=np.float32) -> np.ndarray:
        """A stack with D = `bytes_per_device`, of distinct small integers so that every sum is exact."""
        shape = self.input_shape(bytes_per_device, dtype)
        # Sums of N values below limit/N stay below the dtype's exact-integer limit.
        limit = np.iinfo(dtype).max if jnp.issubdtype(dtype, jnp.integer) else 2 ** (jnp.finfo(dtype).nmant + 1)
        period = np.arange(min(max(1, limit // self.group_size), math.prod(shape))).astype(dtype)
        return np.resize(period, shape)  # 0, 1, ..., period - 1, 0, 1, ...: one period built, then repeated

    def abstract_input(self, bytes_per_device: int, dtype=np.float32) -> jax.ShapeDtypeStruct:
        """The input as shape, dtype and sharding only: enough to lower and compile ``fn``."""
        return jax.ShapeDtypeStruct(self.input_shape(bytes_per_device, dtype), dtype, sharding=self.sharding)


def build_program(name: str, mesh: Mesh, axes: str | Sequence[str], *, root: int = 0) -> CollectiveProgram:
    """The collective `name` (one of NAMES) over `axes` of `mesh`, as a jitted global program."""
    if name not in RECIPES:
        raise LabError(f"unknown collective {name!r}; choose one of: {', '.join(NAMES)}")
    recipe, axes = RECIPES[name], _mesh_axes(mesh, axes)
    n = _group_size(mesh, axes)
    recipe.check_group(n, axes)
    if recipe.rooted and not 0 <= root < n:
        raise LabError(
            f"{name} over {_named(axes)}: root {root} is not a device index along those axes; choose 0..{n - 1}"
        )
    options = {"root": root} if recipe.rooted else {}

    def per_device(row_1D: jax.Array) -> jax.Array:
        # Local view: exactly one row of the stack, this device's block.
        if row_1D.shape[0] != 1:
            raise LabError(
                f"{name} over {_named(axes)}: each device must hold one row "
                f"of the stack, got {row_1D.shape[0]}; give the input N={n} "
                "rows"
            )
        return recipe.local(row_1D[0], axes, **options)[None]

    program = jax.shard_map(per_device, mesh=mesh, in_specs=P(axes), out_specs=P(axes))
    return CollectiveProgram(recipe, mesh, axes, root, jax.jit(program))


def _mesh_axes(mesh: Mesh, axes: str | Sequence[str]) -> Axes:
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    unknown = [a for a in axes if a not in mesh.axis_names]
    if unknown or not axes:
        problem = f"unknown axis {unknown[0]!r}" if unknown else "no axis given"
        raise LabError(
            f"collective over {axes!r}: {problem}; name one or more of the mesh axes {', '.join(mesh.axis_names)}"
        )
    if len(set(axes)) != len(axes):
        raise LabError(f"collective over {_named(axes)}: an axis is named twice; name each mesh axis once")
    return axes


def _group_size(mesh: Mesh, axes: Axes) -> int:
    return int(np.prod([mesh.shape[a] for a in axes]))
