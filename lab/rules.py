"""Logical axes to mesh axes: a parallelism strategy is a rules table, not a fork of the model.

The model names each array dimension by what it means (``batch``, ``embed``,
``mlp``, ...). A `Rules` table says which mesh axes each logical axis is split
over; `Rules.spec` turns a parameter's logical axes into a `PartitionSpec`.
A `Strategy` is a few such tables, one per moment of a training step:

* ``params``: where the working copy of the weights lives between steps;
* ``grads``: where gradients end up once reduced (replicated: an all-reduce;
  sharded over ``fsdp``: a reduce-scatter);
* ``optimizer``: where the fp32 master weights and Adam's moments live;
* ``compute``: the weights as a matmul uses them (whole over the data axes);
* ``activations``: the batch is split over every batch axis (``data``,
  ``fsdp``, and ``expert``, which splits tokens like data outside the experts).

The data-parallel family (Rajbhandari et al. 2020, ZeRO, arXiv:1910.02054) is
then four tables: DDP replicates everything; ZeRO-1 shards the optimizer state;
ZeRO-2 also the gradients; ZeRO-3 / FSDP also the parameters, gathering each
layer's weights just before use. ZeRO-3 comes twice: resharding after the
forward pass (gather again in the backward: ZeRO-3 memory) or keeping the
gathered weights until the backward (PyTorch FSDP's
``reshard_after_forward=False``: ZeRO-2 memory in the backward pass).

Model parallelism is one more table, `MODEL_PARALLEL`, that every strategy
adds to each of its tables: attention heads and the MLP's hidden dimension
over ``tensor`` (Megatron, Shoeybi et al. 2019, arXiv:1909.08053, Section 3:
column-parallel Q/K/V and W_in, row-parallel output projections), experts over
``expert`` (GShard, Lepikhin et al. 2020, arXiv:2006.16668), and the stacked
blocks' ``layers`` over ``stage`` in contiguous runs, one per pipeline stage
(GPipe, `lab.parallel.pipeline.spmd`). Parameters, their
gradients, optimizer state and the matmuls all keep that split; the data
tables only add ``fsdp`` on ``embed``. A ZeRO-3 weight is thus stored split
over ``fsdp`` and ``tensor`` and gathered over ``fsdp`` alone.

Two mistakes are caught here rather than deep inside XLA: a table that maps
two dimensions of one array onto the same mesh axis (a collision), and a
"sharded" strategy that leaves too much of the model unsharded (the
sufficiently-sharded guard, after the check MaxText runs before training).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from jax.sharding import PartitionSpec as P

from lab.errors import LabError
from lab.mesh import AXES

LOGICAL_AXES = (
    "batch",
    "sequence",
    "embed",
    "latent",
    "heads",
    "head_dim",
    "mlp",
    "vocab",
    "layers",
    "experts",
    "routing",
    "capacity",
)
# the mesh axes the batch is split over: the data-parallel ones, and `expert`, which splits tokens like a data
# axis everywhere but inside the experts (lab.parallel.expert.TOKEN_AXES)
DATA_AXES = ("data", "fsdp", "expert")


@dataclass(frozen=True)
class Rules:
    """logical axis -> mesh axes; a logical axis not listed is replicated."""

    table: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def __post_init__(self) -> None:
        for logical, mesh_axes in self.table:
            if logical not in LOGICAL_AXES:
                raise LabError(
                    f"rules map unknown logical axis {logical!r}; the logical axes are {', '.join(LOGICAL_AXES)}"
                )
            unknown = [a for a in mesh_axes if a not in AXES]
            if unknown:
                raise LabError(
                    f"rules map {logical!r} to unknown mesh axis {unknown[0]!r}; the mesh axes are {', '.join(AXES)}"
                )

    @classmethod
    def of(cls, mapping: Mapping[str, str | Sequence[str]]) -> Rules:
        """``Rules.of({"embed": "fsdp", "batch": ("data", "fsdp")})``."""
        return cls(tuple((k, (v,) if isinstance(v, str) else tuple(v)) for k, v in mapping.items()))

    def __or__(self, other: Rules) -> Rules:
        """Both tables; a logical axis listed in both takes `other`'s mesh axes."""
        return Rules(tuple((dict(self.table) | dict(other.table)).items()))

    def mesh_axes(self, logical: str | None) -> tuple[str, ...]:
        return dict(self.table).get(logical, ()) if logical is not None else ()

    def spec(self, logical_axes: Sequence[str | None], name: str = "array") -> P:
        """The PartitionSpec of an array whose dimensions have these logical axes.

        A mesh axis may split only one dimension of an array: mapping two
        dimensions of `name` onto one mesh axis raises a LabError naming both.
        """
        entries, owner = [], {}
        for dim, logical in enumerate(logical_axes):
            axes = self.mesh_axes(logical)
            for axis in axes:
                if axis in owner:
                    raise LabError(
                        f"rules collide on {name}: dimensions {owner[axis][0]} "
                        f"({owner[axis][1]}) and {dim} ({logical}) "
                        f"both map to mesh axis {axis!r}; map one of {owner[axis][1]!r}, {logical!r} elsewhere"
                    )
                owner[axis] = (dim, logical)
            entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
        return P(*entries)


def logical_axes(variable) -> tuple[str, ...]:
    """The logical axes an ``nnx.Variable`` was declared with (``layers`` first for stacked block weights)."""
    return tuple(variable.get_metadata("out_sharding"))


def check_divisible(name: str, shape: Sequence[int], spec: P, mesh_sizes: Mapping[str, int]) -> None:
    """Every split dimension must divide evenly over its mesh axes (XLA would pad silently)."""
    for dim, (size, entry) in enumerate(zip(shape, spec.partitions)):
        axes = (entry,) if isinstance(entry, str) else tuple(entry or ())
        ways = math.prod(mesh_sizes[a] for a in axes)
        if size % ways:
            shown = ",".join(f"{a}={mesh_sizes[a]}" for a in axes)
            raise LabError(
                f"parameter {name} dimension {dim} (size {size}) is not divisible "
                f"by mesh axis {shown}; choose a model size divisible by {ways} "
                f"or a smaller {'/'.join(axes)} axis"
            )


BATCH_OVER_DATA_AXES = Rules.of({"batch": DATA_AXES})  # activations of every data-parallel strategy
# Megatron's split over `tensor`, GShard's over `expert` and GPipe's over `stage`. An expert index as the router sees
# it (logical axis `routing`: every token is scored against every expert) stays whole on every device.
MEGATRON = Rules.of({"heads": "tensor", "mlp": "tensor"})
VOCAB_PARALLEL = Rules.of({"vocab": "tensor"})  # the embedding and the logits split over vocab (Megatron Section 3)
# Megatron's sequence parallelism (Korthikanti et al. 2022, arXiv:2205.05198, Section 4.2): the residual stream
# between sub-layers split along the sequence over `tensor` (`lab.parallel.layout.Layout.sequence_parallel`)
SEQUENCE_PARALLEL = Rules.of({"sequence": "tensor"})
MODEL_PARALLEL = MEGATRON | Rules.of({"experts": "expert", "layers": "stage"})
TABLES = ("params", "grads", "optimizer", "compute")


@dataclass(frozen=True)
class Strategy:
    """A data-parallel strategy: where params, grads and optimizer state live, as rules tables.

    The tables hold the data-parallel splits only; `rules` adds the model-parallel table shared by every strategy.
    """

    name: str
    description: str
    params: Rules
    grads: Rules
    optimizer: Rules
    compute: Rules = Rules()
    activations: Rules = BATCH_OVER_DATA_AXES
    model_parallel: Rules = MODEL_PARALLEL
    reshard_after_forward: bool = True  # ZeRO-3: drop gathered weights after the forward, gather again in the backward
    persist_below: int = (
        0  # parameters with fewer elements stay replicated (DeepSpeed's stage3_param_persistence_threshold)
    )
    max_unsharded_fraction: float = 0.05  # the sufficiently-sharded guard, for strategies that shard parameters

    @property
    def shards_params(self) -> bool:
        return bool(self.params.table)

    @property
    def shards_grads(self) -> bool:
        return bool(self.grads.table)

    def param_rules(self, size: int) -> Rules:
        """The storage table for a `size`-element parameter (small ones may persist replicated over the data axes)."""
        return (Rules() if size < self.persist_below else self.params) | self.model_parallel

    def grad_rules(self, size: int) -> Rules:
        return (Rules() if size < self.persist_below and self.shards_params else self.grads) | self.model_parallel

    def rules(self, table: str, size: int) -> Rules:
        """One of `TABLES` for a `size`-element parameter.

        The strategy's data-parallel table and the model-parallel one.
        """
        if table not in TABLES:
            raise LabError(f"unknown rules table {table!r}; use one of {', '.join(TABLES)}")
        if table == "params":
            return self.param_rules(size)
        if table == "grads":
            return self.grad_rules(size)
        return getattr(self, table) | self.model_parallel

    @property
    def used_axes(self) -> frozenset[str]:
        """Every mesh axis some table of the strategy splits an array over."""
        tables = (self.params, self.grads, self.optimizer, self.compute, self.activations, self.model_parallel)
        return frozenset(axis for rules in tables for _, axes in rules.table for axis in axes)


# ZeRO shards every weight along its model dimension, like MaxText's fsdp rule, or along a latent attention's compressed
# width where the weight has no model dimension (its up-projections; MaxText's q_lora and kv_lora)
_SHARDED = Rules.of({"embed": "fsdp", "latent": "fsdp"})
_REPLICATED = Rules()

STRATEGIES: dict[str, Strategy] = {
    s.name: s
    for s in (
        Strategy(
            "ddp",
            "DDP: replicated params, grads and Adam state; gradients all-reduced",
            _REPLICATED,
            _REPLICATED,
            _REPLICATED,
        ),
        Strategy("zero1", "ZeRO-1: Adam state (and fp32 master weights) sharded", _REPLICATED, _REPLICATED, _SHARDED),
        Strategy("zero2", "ZeRO-2: + gradients sharded (reduce-scatter)", _REPLICATED, _SHARDED, _SHARDED),
        Strategy(
            "zero3",
            "ZeRO-3 / FSDP: + params sharded, gathered before use, resharded after the forward",
            _SHARDED,
            _SHARDED,
            _SHARDED,
        ),
        Strategy(
            "zero3-keep",
            "ZeRO-3 keeping gathered weights from forward to backward (FSDP reshard_after_forward=False)",
            _SHARDED,
            _SHARDED,
            _SHARDED,
            reshard_after_forward=False,
        ),
    )
}


def get_strategy(name: str) -> Strategy:
    """A strategy by name; an unknown name lists the known ones."""
    if name not in STRATEGIES:
        raise LabError(f"unknown strategy {name!r}; use one of {', '.join(STRATEGIES)}")
    return STRATEGIES[name]


def spec_axes(spec: P) -> set[str]:
    """The mesh axes a PartitionSpec splits some dimension over (its reduced/unreduced sets are not splits)."""
    return {a for entry in spec.partitions for a in ((entry,) if isinstance(entry, str) else (entry or ()))}


@dataclass(frozen=True)
class ShardingReport:
    """How much of the model a strategy leaves whole on every device of the fsdp axis."""

    total_bytes: int
    unsharded_bytes: int
    largest_unsharded: tuple[str, ...]

    @property
    def unsharded_fraction(self) -> float:
        return self.unsharded_bytes / self.total_bytes if self.total_bytes else 0.0


def sharding_report(params: Iterable[tuple[str, int, P]], axis: str = "fsdp") -> ShardingReport:
    """(name, bytes, storage spec) per parameter -> bytes not split over `axis`."""
    total, unsharded = 0, []
    for name, nbytes, spec in params:
        total += nbytes
        if axis not in spec_axes(spec):
            unsharded.append((nbytes, name))
    unsharded.sort(reverse=True)
    return ShardingReport(total, sum(b for b, _ in unsharded), tuple(n for _, n in unsharded[:3]))


def check_sufficiently_sharded(strategy: Strategy, report: ShardingReport, axis_size: int) -> None:
    """Fail loudly when a parameter-sharding strategy leaves more than its limit of bytes whole."""
    if not strategy.shards_params or axis_size == 1:
        return
    if report.unsharded_fraction > strategy.max_unsharded_fraction:
        raise LabError(
            f"strategy {strategy.name} leaves {report.unsharded_fraction:.0%} of parameter bytes unsharded over fsdp "
            f"(limit {strategy.max_unsharded_fraction:.0%}; largest: {', '.join(report.largest_unsharded)}); "
            f"map a dimension of those parameters to 'fsdp' or lower the persistence threshold"
        )
