"""Mixture of experts with expert parallelism: dispatch and combine as all-to-alls.

An MoE layer replaces the MLP with E expert MLPs and a router (`lab.moe`).
Expert parallelism (GShard, Lepikhin et al. 2020, arXiv:2006.16668) puts E/N
experts on each of the N devices of the ``expert`` mesh axis while the tokens
stay split over every batch axis. Each device routes its own tokens (one
*group*) and fills a buffer of C slots per expert, x_ECD; then

1. dispatch: an all-to-all over ``expert`` sends each device the slots of its
   own experts from every device: E·C·d out, (E/N)·(N·C)·d in;
2. the local experts run on what arrived;
3. combine: the inverse all-to-all sends the results home, where each token
   adds its experts' outputs, weighted by their gates.

Static shapes pad every buffer to its capacity whatever the router chose, so
an all-to-all carries E·C·d elements per device, not the tokens·k·d the
router routed (`lab.theory.moe_traffic`). Ragged all-to-all would send only
what was routed, but it does not run on the CPU backend.

Three versions of the same layer, which agree to float rounding:

* `expert_parallel`: shard_map, with the all-to-alls written by hand;
* `gshard`: the GShard paper's way, dense dispatch/combine einsums with
  sharding annotations, where XLA's partitioner inserts the collectives
  (on a mesh with Auto axes, on purpose: the partitioner must choose);
* `moe_reference`: one device, no buffers: every token through its chosen
  experts directly. With no dropping the others must match it exactly.

Expert weights may also be split over ``fsdp`` (along d_ff), gathered inside
the layer, so EP composes with data parallelism and FSDP.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from lab.errors import LabError
from lab.moe import (
    NO_BALANCING,
    Balance,
    LoadCounts,
    RouterConfig,
    Routing,
    balance_loss,
    combine,
    dispatch,
    load_counts,
    route,
)

TOKEN_AXES = ("data", "fsdp", "expert")  # tokens are split over every batch-like axis; experts only over `expert`


@dataclass(frozen=True)
class MoEConfig:
    """Sizes of the layer: model width, each expert's hidden width, and its router."""

    d_model: int = 64
    d_ff: int = 128
    router: RouterConfig = field(default_factory=RouterConfig)


@struct.dataclass
class ExpertParams:
    """The router's weights and every expert's MLP, stacked on a leading experts axis."""

    router_DE: jax.Array
    w_in_EDF: jax.Array
    w_out_EFD: jax.Array


@struct.dataclass
class MoEOutput:
    """The layer's output, its balancing loss, and the load counts for the metrics."""

    y_TD: jax.Array
    balance_loss: jax.Array  # α·aux + β·z, averaged over groups
    counts: LoadCounts  # summed over groups


def init_experts(config: MoEConfig, key: jax.Array) -> ExpertParams:
    """Fan-in scaled normal weights (the router small, so that routing starts near uniform)."""
    e, d, f = config.router.experts, config.d_model, config.d_ff
    router_key, in_key, out_key = jax.random.split(key, 3)
    return ExpertParams(
        router_DE=jax.random.normal(router_key, (d, e)) * 0.02,
        w_in_EDF=jax.random.normal(in_key, (e, d, f)) / math.sqrt(d),
        w_out_EFD=jax.random.normal(out_key, (e, f, d)) / math.sqrt(f),
    )


def expert_mlp(x_ECD: jax.Array, w_in_EDF: jax.Array, w_out_EFD: jax.Array) -> jax.Array:
    """Each expert's GELU MLP on its own buffer: D -> F -> D."""
    return jnp.einsum("ecf,efd->ecd", jax.nn.gelu(jnp.einsum("ecd,edf->ecf", x_ECD, w_in_EDF)), w_out_EFD)


def moe_local(
    params: ExpertParams,
    x_TD: jax.Array,
    config: MoEConfig,
    balance: Balance = NO_BALANCING,
    *,
    bias_E=None,
    noise_key=None,
) -> MoEOutput:
    """The layer on one device and one group: route, dispatch, experts, combine."""
    routing = route(x_TD @ params.router_DE, config.router, bias_E=bias_E, noise_key=noise_key)
    y_ECD = expert_mlp(dispatch(x_TD, routing, config.router.experts), params.w_in_EDF, params.w_out_EFD)
    return MoEOutput(combine(y_ECD, routing), balance_loss(routing, balance), load_counts(routing))


def moe_reference(params: ExpertParams, x_TD: jax.Array, config: MoEConfig, groups: int = 1) -> jax.Array:
    """The twin without buffers or collectives: every expert on every token, each token keeps its kept choices.

    `groups` splits the tokens as the sharded layers do (each group routes,
    and fills capacity, on its own); with no dropping the grouping does not
    matter for token choice.
    """
    tokens, d = x_TD.shape
    x_GSD = x_TD.reshape(groups, tokens // groups, d)
    routing = jax.vmap(lambda x_SD: route(x_SD @ params.router_DE, config.router))(x_GSD)
    all_GSED = jnp.einsum(
        "gsef,efd->gsed", jax.nn.gelu(jnp.einsum("gsd,edf->gsef", x_GSD, params.w_in_EDF)), params.w_out_EFD
    )
    chosen_GSKD = jnp.take_along_axis(all_GSED, routing.expert_TK[..., None], axis=2)
    weight_GSK = routing.gate_TK * routing.kept_TK
    return jnp.einsum("gsk,gskd->gsd", weight_GSK, chosen_GSKD).reshape(tokens, d)


# --- the sharded layers --------------------------------------------------------------


@dataclass(frozen=True)
class ShardedMoE:
    """A jitted sharded MoE layer and where its inputs must live.

    ``fn(params, x_TD, balance, bias_E) -> MoEOutput``; x_TD is all tokens,
    split over `TOKEN_AXES`; each shard is one routing group.
    """

    fn: Callable
    mesh: Mesh
    config: MoEConfig
    param_specs: ExpertParams  # of PartitionSpecs

    @property
    def groups(self) -> int:
        return math.prod(self.mesh.shape[a] for a in TOKEN_AXES)

    def check_tokens(self, tokens: int) -> None:
        if tokens % self.groups:
            raise LabError(
                f"{tokens} tokens do not split into {self.groups} groups (data "
                f"x fsdp x expert); use a multiple of {self.groups}"
            )

    def shardings(self) -> tuple[ExpertParams, NamedSharding]:
        params = jax.tree.map(
            lambda spec: NamedSharding(self.mesh, spec), self.param_specs, is_leaf=lambda s: isinstance(s, P)
        )
        return params, NamedSharding(self.mesh, P(TOKEN_AXES))

    def place(self, params: ExpertParams, x_TD: jax.Array) -> tuple[ExpertParams, jax.Array]:
        self.check_tokens(x_TD.shape[0])
        param_shardings, token_sharding = self.shardings()
        return jax.device_put(params, param_shardings), jax.device_put(x_TD, token_sharding)

    def abstract(self, tokens: int, dtype=jnp.float32) -> tuple:
        """All of `fn`'s arguments as ShapeDtypeStructs, for compiling without data.

        For example `lab.hlo.inspect(layer.fn, *abstract)`.
        """
        self.check_tokens(tokens)
        c, (param_shardings, token_sharding) = self.config, self.shardings()
        replicated = NamedSharding(self.mesh, P())
        shapes = ExpertParams(
            (c.d_model, c.router.experts), (c.router.experts, c.d_model, c.d_ff), (c.router.experts, c.d_ff, c.d_model)
        )
        params = jax.tree.map(
            lambda shape, s: jax.ShapeDtypeStruct(shape, dtype, sharding=s),
            shapes,
            param_shardings,
            is_leaf=lambda s: isinstance(s, tuple),
        )
        balance = jax.tree.map(lambda _: jax.ShapeDtypeStruct((), jnp.float32, sharding=replicated), Balance())
        bias = jax.ShapeDtypeStruct((c.router.experts,), jnp.float32, sharding=replicated)
        return params, jax.ShapeDtypeStruct((tokens, c.d_model), dtype, sharding=token_sharding), balance, bias

    def __call__(
        self, params: ExpertParams, x_TD: jax.Array, balance: Balance = NO_BALANCING, bias_E: jax.Array | None = None
    ) -> MoEOutput:
        # strongly typed f32 scalars, as in `abstract`: one compiled program serves both
        # (and every value of the coefficients)
        replicated = NamedSharding(self.mesh, P())
        balance = jax.device_put(jax.tree.map(lambda v: jnp.asarray(v, jnp.float32), balance), replicated)
        bias_E = jax.device_put(
            jnp.zeros(self.config.router.experts, jnp.float32) if bias_E is None else bias_E, replicated
        )
        return self.fn(params, x_TD, balance, bias_E)


def expert_parallel(mesh: Mesh, config: MoEConfig) -> ShardedMoE:
    """EP with hand-written all-to-alls over ``expert``, inside shard_map; expert weights also split over ``fsdp``."""
    sizes = _check_mesh(mesh, config)
    experts, ep, fsdp = config.router.experts, sizes["expert"], sizes["fsdp"]
    if config.d_ff % fsdp:
        raise LabError(f"d_ff={config.d_ff} does not split over fsdp={fsdp}; choose d_ff divisible by {fsdp}")
    specs = ExpertParams(P(), P("expert", None, "fsdp"), P("expert", "fsdp", None))

    def layer(params: ExpertParams, x_TD, balance: Balance, bias_E) -> MoEOutput:
        routing = route(x_TD @ params.router_DE, config.router, bias_E=bias_E)
        x_ECD = dispatch(x_TD, routing, experts)
        # dispatch: my experts' slots from every device, source-major: (E/N, N·C, D)
        x_LMD = jax.lax.all_to_all(x_ECD, "expert", split_axis=0, concat_axis=1, tiled=True)
        assert x_LMD.shape == (experts // ep, ep * routing.capacity, config.d_model), x_LMD.shape
        y_LMD = expert_mlp(x_LMD, *_whole_experts(params, fsdp))
        y_ECD = jax.lax.all_to_all(y_LMD, "expert", split_axis=1, concat_axis=0, tiled=True)  # combine: results go home
        loss = jax.lax.pmean(balance_loss(routing, balance), TOKEN_AXES)
        counts = jax.tree.map(lambda c: jax.lax.psum(c, TOKEN_AXES), load_counts(routing))
        return MoEOutput(combine(y_ECD, routing), loss, counts)

    sharded = jax.shard_map(
        layer, mesh=mesh, in_specs=(specs, P(TOKEN_AXES), P(), P()), out_specs=MoEOutput(P(TOKEN_AXES), P(), P())
    )
    return ShardedMoE(jax.jit(sharded), mesh, config, specs)


def _whole_experts(params: ExpertParams, fsdp: int) -> tuple[jax.Array, jax.Array]:
    """FSDP: gather this device's experts whole just before use.

    Skipped on a size-1 axis, which XLA would keep as a no-op all-gather.
    """
    if fsdp == 1:
        return params.w_in_EDF, params.w_out_EFD
    return jax.lax.all_gather(params.w_in_EDF, "fsdp", axis=2, tiled=True), jax.lax.all_gather(
        params.w_out_EFD, "fsdp", axis=1, tiled=True
    )


def gshard(mesh: Mesh, config: MoEConfig, *, annotate_masks: bool = True) -> ShardedMoE:
    """GShard-style: dense dispatch/combine einsums and sharding annotations; XLA inserts the collectives.

    The mesh's axes are made Auto: with_sharding_constraint only annotates,
    and the SPMD partitioner decides how to move from tokens-split to
    experts-split (GShard §3.2 expects an all-to-all). `annotate_masks=False`
    leaves the dispatch and combine masks unannotated, to show what the
    partitioner does when the routing's sharding is left to propagation.
    """
    sizes = _check_mesh(mesh, config)
    auto = Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))
    groups = math.prod(sizes[a] for a in TOKEN_AXES)
    replica_axes = tuple(a for a in TOKEN_AXES if a != "expert")
    by_group, by_expert = NamedSharding(auto, P(TOKEN_AXES)), NamedSharding(auto, P("expert", replica_axes))
    annotate_mask = (
        (lambda mask: jax.lax.with_sharding_constraint(mask, by_group)) if annotate_masks else (lambda mask: mask)
    )
    specs = ExpertParams(P(), P("expert"), P("expert"))

    def layer(params: ExpertParams, x_TD, balance: Balance, bias_E) -> MoEOutput:
        x_GSD = jax.lax.with_sharding_constraint(x_TD.reshape(groups, -1, config.d_model), by_group)
        routing = jax.vmap(lambda x_SD: route(x_SD @ params.router_DE, config.router, bias_E=bias_E))(x_GSD)
        dispatch_GSEC = annotate_mask(_dense_dispatch(routing, config.router.experts))
        combine_GSEC = annotate_mask(dispatch_GSEC * _dense_gates(routing, config.router.experts))
        x_EGCD = jax.lax.with_sharding_constraint(jnp.einsum("gsec,gsd->egcd", dispatch_GSEC, x_GSD), by_expert)
        y_EGCD = jnp.einsum(
            "egcf,efd->egcd", jax.nn.gelu(jnp.einsum("egcd,edf->egcf", x_EGCD, params.w_in_EDF)), params.w_out_EFD
        )
        y_EGCD = jax.lax.with_sharding_constraint(y_EGCD, by_expert)
        y_GSD = jax.lax.with_sharding_constraint(jnp.einsum("gsec,egcd->gsd", combine_GSEC, y_EGCD), by_group)
        per_group = jax.vmap(balance_loss, in_axes=(0, None))(routing, balance)
        counts = jax.tree.map(lambda c: c.sum(0), jax.vmap(load_counts)(routing))
        return MoEOutput(y_GSD.reshape(x_TD.shape), per_group.mean(), counts)

    shardings = jax.tree.map(lambda s: NamedSharding(auto, s), specs, is_leaf=lambda s: isinstance(s, P))
    replicated = NamedSharding(auto, P())
    fn = jax.jit(layer, in_shardings=(shardings, NamedSharding(auto, P(TOKEN_AXES)), replicated, replicated))
    return ShardedMoE(fn, auto, config, specs)


def _dense_dispatch(routing: Routing, experts: int) -> jax.Array:
    """GShard's dispatch mask: 1 where token s of group g sits in slot c of expert e.

    A dropped slot one-hots to zeros.
    """
    slots_GSKC = jax.nn.one_hot(routing.slot_TK, routing.capacity)
    return jnp.einsum("gske,gskc->gsec", jax.nn.one_hot(routing.expert_TK, experts), slots_GSKC)


def _dense_gates(routing: Routing, experts: int) -> jax.Array:
    """Each (token, expert) gate as a (G, S, E, 1) array; zero where the expert was not chosen."""
    return jnp.einsum("gske,gsk->gse", jax.nn.one_hot(routing.expert_TK, experts), routing.gate_TK)[..., None]


def _check_mesh(mesh: Mesh, config: MoEConfig) -> dict[str, int]:
    sizes = dict(mesh.shape)
    missing = [a for a in TOKEN_AXES if a not in sizes]
    if missing:
        raise LabError(
            f"the mesh has no {missing[0]!r} axis; build it with lab.mesh.MeshSpec, which carries all five axes"
        )
    if config.router.noise_std > 0:
        raise LabError(
            "noisy top-k needs a random key per group: use it with moe_local "
            "(training), and noise_std=0 in the sharded layers"
        )
    if config.router.experts % sizes["expert"]:
        raise LabError(
            f"{config.router.experts} experts are not divisible by the expert "
            f"axis (size {sizes['expert']}); use a multiple of {sizes['expert']} "
            "experts or a smaller expert axis"
        )
    return sizes
