"""DDP, ZeRO-1/2/3 and FSDP as one `Layout`: where each array lives, and which collective moves it.

The model reads every weight through `Layout.use`, and the training step
reduces gradients through `Layout.accumulate` and `Layout.finish`. Those
places are the whole difference between the strategies; the rules tables of
`lab.rules.STRATEGIES` say which branch each array takes.

JAX's sharding-in-types autodiff puts the collectives in the types (JAX docs,
"Autodiff and sharding", docs/301/sharding-ad). An array that is whole on every
device of a data axis is stored as *reduced* over it (physically replicated);
the cotangent of a reduced array is *unreduced*: per-device partial sums, no
collective yet. A `jax.reshard` of an unreduced array is the reduction: to a
whole spec an all-reduce, to a spec split over ``fsdp`` a reduce-scatter. So:

* DDP, ZeRO-1, ZeRO-2 store the working weights whole (reduced over the data
  axes); `use` has nothing to do and gradients come out as partial sums. A
  whole gradient buffer can hold partial sums, so DDP and ZeRO-1 accumulate
  micro-batches unreduced and all-reduce once per step (PyTorch's
  ``no_sync``); a sharded buffer cannot, so ZeRO-2 reduce-scatters each
  micro-batch's gradient into its shard.
* ZeRO-3 stores each weight split over ``fsdp`` (and reduced over ``data``,
  for HSDP meshes); `use` reshards it whole: the all-gather. Autodiff
  transposes that all-gather into the reduce-scatter of the gradient inside
  the backward pass of each layer; the ``data`` replicas' partial sums wait
  for one all-reduce of the shard per step.
* Reshard after forward: the block's remat policy refuses to save the output
  of a ``reshard`` (the gathered weight), so the backward pass gathers it
  again (ZeRO-3 memory). Keeping it (``zero3-keep``, FSDP's
  ``reshard_after_forward=False``) saves one all-gather per weight and holds
  every layer's whole weights from forward to backward.

Tensor and expert parallelism ride along (`lab.rules.MODEL_PARALLEL`): a
weight's ``heads``/``mlp`` dimension stays split over ``tensor`` in every
table, so `use` gathers over ``fsdp`` only and a matmul sees its 1/t slice.
A contraction over a ``tensor``-split dimension (Megatron's row-parallel
matmuls) cannot guess where its result goes on an Explicit mesh: the model
asks `activation_sharding` for its logical axes and passes it as the
einsum's ``out_sharding``, which is the all-reduce over ``tensor``. Expert
weights are split over ``expert`` and reduced over the other batch axes only.
The stacked blocks' ``layers`` dimension is split over ``stage`` in every
table too (pipeline stages, `lab.parallel.pipeline.spmd`); a block uses one
layer's weights, so `use` never gathers over ``stage``.

With ``sequence_parallel`` the residual stream between sub-layers (the block's
input, the norms, the residual adds) is split along the sequence over
``tensor`` too (Megatron SP, `lab.rules.SEQUENCE_PARALLEL`): a sub-layer's
input is gathered whole before its column-parallel matmuls and the row-parallel
matmul's ``out_sharding`` becomes a reduce-scatter; the bytes moved are those
of the all-reduce they replace, the activations saved for the backward are 1/t.

Meshes use Explicit axis types, so every collective here is a `jax.reshard`
or an ``out_sharding`` someone wrote; nothing is left to sharding propagation.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from lab.errors import LabError
from lab.rules import (
    DATA_AXES,
    SEQUENCE_PARALLEL,
    Strategy,
    check_divisible,
    check_sufficiently_sharded,
    logical_axes,
    sharding_report,
    spec_axes,
)

_REMAT: dict[str, Callable | None] = {
    "none": None,
    # save the weight matmuls' outputs (dots without batch dimensions: MaxText's `minimal`); recompute the rest, the
    # attention's batched dots (scores, their mix) and the norms' scale (an einsum with a batch dimension) among it
    "dots": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
    # MaxText's `minimal_flash`: those, and the attention's output (its kernel's forward is not run again)
    "dots_flash": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
        jax.checkpoint_policies.save_only_these_names("context"),
    ),
    "full": jax.checkpoint_policies.nothing_saveable,  # save only each block's input
    "offload": jax.checkpoint_policies.offload_dot_with_no_batch_dims(
        "device", "pinned_host"
    ),  # weight-matmul outputs to host memory
}
REMAT_POLICIES = tuple(_REMAT)
# MaxText's names for the activations its custom remat policy places (`lab.model` names them alike): the block's
# input, the attention's projections and its output, the MLP's (an MoE's experts' too): ``mlpwi`` un-gated, else
# ``mlpwi_0`` the gate's and ``mlpwi_1`` the other; ``mlpwo`` its output. ``qkv_proj`` is MaxText's fused projection,
# which neither its Llama, Mixtral or DeepSeek configurations nor the lab's models have: it names nothing, there
# as here, and recipes that set it are taken as written.
NAMED_ACTIVATIONS = (
    "decoder_layer_input",
    "context",
    "query_proj",
    "key_proj",
    "value_proj",
    "qkv_proj",
    "out_proj",
    "mlpwi",
    "mlpwi_0",
    "mlpwi_1",
    "mlpwo",
)
OFFLOAD_PREFIX = "offload:"  # offload:<names>: these to host memory, the rest recomputed
CUSTOM_PREFIX = "custom:"  # custom:<name>=<device|offload|remat>,...: MaxText's custom policy as a recipe writes it
_PLACES = ("device", "offload", "remat")


def remat_policy(name: str) -> Callable | None:
    """The checkpoint policy a remat name means: one of `REMAT_POLICIES`, or MaxText's custom policy, as
    ``custom:<name>=<device|offload|remat>,...`` (each named activation of `NAMED_ACTIVATIONS` kept in HBM, sent to
    host memory in the forward pass and back for the backward, or recomputed) or ``offload:<names>`` (these
    offloaded); everything unnamed in the block is recomputed."""
    if name in _REMAT:
        return _REMAT[name]
    saved, offloaded = custom_places(name)
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=saved,
        names_which_can_be_offloaded=offloaded,
        offload_src="device",
        offload_dst="pinned_host",
    )


def custom_places(name: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The activations a custom remat saves in HBM and those it offloads to host memory; a LabError says what is
    wrong with `name`."""
    example = f"{CUSTOM_PREFIX}decoder_layer_input=offload,query_proj=device"
    if name.startswith(OFFLOAD_PREFIX):
        places = {n.strip(): "offload" for n in name.removeprefix(OFFLOAD_PREFIX).split(",")}
    elif name.startswith(CUSTOM_PREFIX):
        pairs = [pair.partition("=") for pair in name.removeprefix(CUSTOM_PREFIX).split(",")]
        if any(not sep for _, sep, _ in pairs):
            raise LabError(f"{name!r}: write name=place pairs, e.g. {example}")
        places = {n.strip(): place.strip() for n, _, place in pairs}
    else:
        raise LabError(
            f"unknown remat policy {name!r}; use one of {', '.join(_REMAT)}, {OFFLOAD_PREFIX}<names> or "
            f"{CUSTOM_PREFIX}<name>=<{'|'.join(_PLACES)}>,... with names from {', '.join(NAMED_ACTIVATIONS)}"
        )
    unknown = [n for n in places if n not in NAMED_ACTIVATIONS]
    if unknown:
        raise LabError(
            f"{name!r}: {', '.join(map(repr, unknown))} is not a named activation; name some of "
            f"{', '.join(NAMED_ACTIVATIONS)}, comma-separated"
        )
    wrong = [f"{n}={place}" for n, place in places.items() if place not in _PLACES]
    if wrong:
        raise LabError(f"{name!r}: {', '.join(wrong)}: a place is one of {', '.join(_PLACES)}")
    return tuple(n for n, p in places.items() if p == "device"), tuple(n for n, p in places.items() if p == "offload")


def _gathered(prim, params) -> bool:
    """Whether a primitive's output may be a gathered weight: a ``reshard`` to a spec reduced over batch axes (what
    `Layout.use` writes; activations, e.g. tokens dispatched to experts, are never reduced) or the cast after it."""
    if prim.name == "reshard":
        return bool(getattr(getattr(params["dst_sharding"], "spec", None), "reduced", None))
    return prim.name == "convert_element_type"


def _partial_sum(prim, params) -> bool:
    """A matmul whose output is unreduced: partial sums (`lab.model.row_parallel` under sequence parallelism)."""
    return prim.name == "dot_general" and bool(
        getattr(getattr(params.get("out_sharding"), "spec", None), "unreduced", None)
    )


def _reduces_partial(prim, args) -> bool:
    """A ``reshard`` of partial sums: their reduction (all-reduce, or reduce-scatter)."""
    return prim.name == "reshard" and bool(args and getattr(args[0].sharding.spec, "unreduced", None))


@dataclass(frozen=True)
class Layout:
    """A strategy on a mesh, with the dtypes of the working weights and of the matmuls."""

    mesh: jax.sharding.Mesh
    strategy: Strategy
    param_dtype: jnp.dtype = (
        jnp.float32
    )  # the working copy the forward gathers (FSDP2's MixedPrecisionPolicy.param_dtype)
    compute_dtype: jnp.dtype = jnp.float32
    remat: str = "none"
    sequence_parallel: bool = False  # the residual stream split along the sequence over `tensor` (module docstring)
    sizes: dict[str, int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        remat_policy(self.remat)  # refuses a name it does not know
        object.__setattr__(self, "sizes", dict(self.mesh.shape))
        if self.sequence_parallel and self.sizes.get("tensor", 1) == 1:
            raise LabError(
                "sequence parallelism splits the sequence over the tensor axis; give the mesh tensor=2 or more"
            )
        if self.sequence_parallel and self.stages > 1:
            raise LabError("sequence parallelism with a stage axis is not built; drop one of them")

    # --- where arrays live -------------------------------------------------------------

    @property
    def data_axes(self) -> frozenset[str]:
        """The batch axes with more than one device (data, fsdp, expert): the batch is split over them."""
        return frozenset(a for a in DATA_AXES if self.sizes.get(a, 1) > 1)

    @property
    def stages(self) -> int:
        """Pipeline stages: axis ``stage`` splits the stacked blocks' layers (GPipe, `lab.parallel.pipeline.spmd`)."""
        return self.sizes.get("stage", 1)

    @property
    def idle_axes(self) -> tuple[str, ...]:
        """Mesh axes of size > 1 that split neither the batch nor a weight: their devices repeat the same work."""
        return tuple(a for a, n in self.sizes.items() if n > 1 and a not in self.strategy.used_axes)

    def activation_sharding(self, axes: tuple[str, ...]) -> NamedSharding:
        """Where an activation with these logical axes lives; the model passes it as a matmul's ``out_sharding``.

        The batch dimension takes the batch axes no other dimension of the array splits: tokens dispatched to
        their experts (``experts`` over ``expert``) stay split over data and fsdp only.
        """
        rules = self.strategy.activations | self.strategy.model_parallel
        if self.sequence_parallel:
            rules = rules | SEQUENCE_PARALLEL
        others = self._live(rules.spec([None if a == "batch" else a for a in axes], "an activation"))
        batch = _entry([a for a in rules.mesh_axes("batch") if a in self.data_axes and a not in spec_axes(others)])
        return NamedSharding(
            self.mesh, P(*(batch if logical == "batch" else entry for logical, entry in zip(axes, others)))
        )

    def batch_spec(self) -> P:
        """The tokens' spec: the batch split over the live batch axes (a size-1 axis in a contracting
        dimension would have to appear in every unreduced set, so it is left out)."""
        return self.activation_sharding(("batch", None)).spec  # [B, S + 1]: the sequence stays whole

    def check_batch(self, global_batch: int, micro_batches: int = 1) -> None:
        ways = micro_batches * math.prod(self.sizes[a] for a in self.data_axes)
        if global_batch % ways:
            shown = ",".join(f"{a}={self.sizes[a]}" for a in DATA_AXES if a in self.data_axes) or "one device"
            raise LabError(
                f"global batch {global_batch} is not divisible by the data axes "
                f"({shown}) times {micro_batches} micro-batches; use a multiple "
                f"of {ways}"
            )

    def shardings(self, params: nnx.State, table: str) -> nnx.State:
        """NamedShardings of `params` under the strategy's ``params``, ``grads`` or ``optimizer`` table."""
        return _map_variables(
            lambda path, v: v.replace(NamedSharding(self.mesh, self.spec(_name(path), v, table))), params
        )

    def spec(self, name: str, variable: nnx.Variable, table: str) -> P:
        """One parameter's spec under a table; working weights are reduced over the data axes they are whole on."""
        spec = self.strategy.rules(table, math.prod(variable.shape)).spec(logical_axes(variable), name)
        check_divisible(name, variable.shape, spec, self.sizes)
        spec = self._live(spec)
        whole_on = self.data_axes - spec_axes(spec)
        return P(*spec, reduced=whole_on) if table == "params" and whole_on else spec

    def _live(self, spec: P) -> P:
        """The spec without size-1 axes: they split nothing, and would only make types differ."""
        return P(*(_entry([a for a in _axes(entry) if self.sizes[a] > 1]) for entry in spec))

    def check_sufficiently_sharded(self, params: nnx.State) -> None:
        rows = []
        itemsize = jnp.dtype(self.param_dtype).itemsize
        _map_variables(
            lambda path, v: rows.append((_name(path), v.size * itemsize, self.spec(_name(path), v, "params"))), params
        )
        check_sufficiently_sharded(self.strategy, sharding_report(rows), self.sizes.get("fsdp", 1))

    # --- the forward pass: a weight as a matmul uses it --------------------------------

    def use(self, param: nnx.Param, beside: jax.Array | None = None) -> jax.Array:
        """The weight whole over every data axis it is split on (ZeRO-3: the all-gather over fsdp), still split
        over the model-parallel axes, reduced over the batch axes it is whole on, in the compute dtype.

        An elementwise weight (a norm's scale) may meet an activation split over a model axis too: ``tensor`` splits
        the heads a q/k norm scales, and the sequence under sequence parallelism. Each such device then holds a
        partial sum of the weight's gradient, so the weight is reduced over those axes as well (`beside`)."""
        w = param[...].astype(self.compute_dtype)  # the shard first (MaxText's order): the gather moves bf16 bytes
        model_axes = spec_axes(jax.typeof(beside).sharding.spec) - self.data_axes if beside is not None else set()
        if self.data_axes or model_axes:  # a no-op unless the weight is split over a data axis or meets a split
            spec = self._live(self.strategy.rules("compute", w.size).spec(logical_axes(param)))
            reduced = (self.data_axes | model_axes) - spec_axes(spec)
            w = jax.reshard(w, NamedSharding(self.mesh, P(*spec, reduced=reduced)))
        return w

    @property
    def remat_policy(self) -> Callable | None:
        """The block's checkpoint policy: the chosen remat, without (or with) the gathered weights.

        The test is on primitives, not on a `checkpoint_name`: a policy that refuses a named value still saves
        the unnamed value the name was applied to. A gathered weight is the output of a ``reshard`` to a reduced
        spec, the shard cast to the compute dtype before it; refusing both makes the backward pass gather again (casts
        of activations are recomputed too, which costs one elementwise pass).
        """
        policy = self._weights_policy(remat_policy(self.remat))
        if not self.sequence_parallel:
            return policy
        # a row-parallel matmul's partial sums are never saved (JAX cannot slice an unreduced residual out of the
        # layers' stack); their reduce-scatter, the sub-layer's output, is saved where the policy saves matmuls
        inner = policy or (lambda *args, **params: True)
        keeps_matmuls = self.remat in ("dots", "dots_flash", "none")
        return lambda prim, *args, **params: (
            False
            if _partial_sum(prim, params)
            else keeps_matmuls
            if _reduces_partial(prim, args)
            else inner(prim, *args, **params)
        )

    def _weights_policy(self, base: Callable | None) -> Callable | None:
        """`base` without (or, keeping them, with) the gathered weights."""
        if not self.strategy.shards_params:
            return base
        if self.strategy.reshard_after_forward:
            return lambda prim, *args, **params: (
                not _gathered(prim, params) and (base is None or base(prim, *args, **params))
            )
        if base is None:
            return None
        return lambda prim, *args, **params: prim.name == "reshard" or base(prim, *args, **params)

    # --- the backward pass: where gradients are reduced --------------------------------

    def accumulate(self, accumulated: nnx.State | None, grads: nnx.State, targets: nnx.State) -> nnx.State:
        """Add one micro-batch's gradients, reduce-scattering now over the axes the target is split on."""

        def scatter(grad: jax.Array, target: NamedSharding) -> jax.Array:
            unreduced = jax.typeof(grad).sharding.spec.unreduced
            scatter_over = unreduced & spec_axes(target.spec)
            if not scatter_over:  # nothing to split: keep partial sums (DDP, ZeRO-1, HSDP's data axis)
                return grad
            return jax.reshard(
                grad, NamedSharding(self.mesh, P(*target.spec.partitions, unreduced=unreduced - scatter_over))
            )

        grads = jax.tree.map(scatter, grads, targets)
        return grads if accumulated is None else jax.tree.map(jnp.add, accumulated, grads)

    def finish(self, accumulated: nnx.State, targets: nnx.State) -> nnx.State:
        """Reduce what is still partial sums: the once-per-step all-reduce (of the shard, for ZeRO-3 on HSDP)."""
        return jax.reshard(accumulated, targets)

    def zeros(self, accumulator: nnx.State) -> nnx.State:
        """Zeros typed like `accumulator` (ShapeDtypeStructs), unreduced ones included."""
        return jax.tree.map(lambda a: jax.reshard(jnp.zeros(a.shape, a.dtype), a.sharding), accumulator)


def _axes(entry) -> tuple[str, ...]:
    return (entry,) if isinstance(entry, str) else tuple(entry or ())


def _entry(axes: list[str]):
    return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)


def _name(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)


def _map_variables(fn, state: nnx.State) -> nnx.State:
    """Apply fn(path, variable) to every Variable of a State."""
    return jax.tree_util.tree_map_with_path(fn, state, is_leaf=lambda x: isinstance(x, nnx.Variable))
