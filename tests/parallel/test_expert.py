"""The MoE layer: hand-written EP, GShard-style and single-device versions agree.

The HLO has the all-to-alls that theory says.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lab import hlo
from lab.errors import LabError
from lab.mesh import MeshSpec
from lab.moe import Balance, RouterConfig, load_metrics
from lab.parallel import expert
from lab.parallel.expert import MoEConfig, expert_parallel, gshard, init_experts, moe_local
from lab.theory import moe_traffic

TOKENS, D, F = 256, 16, 32  # 8 groups of 32 tokens
moe_reference = jax.jit(expert.moe_reference, static_argnames=("config", "groups"))  # one compile, not one per eager op


def _config(**router) -> MoEConfig:
    return MoEConfig(d_model=D, d_ff=F, router=RouterConfig(**{"experts": 8, "top_k": 2, **router}))


def _inputs(config: MoEConfig):
    params = init_experts(config, jax.random.key(0))
    params = params.replace(router_DE=params.router_DE * 50)  # a decisive router, so that capacity really drops tokens
    return params, jax.random.normal(jax.random.key(1), (TOKENS, D))


@functools.cache
def _layer(build, mesh, config: MoEConfig):
    """One sharded layer per (version, mesh, config): numerics and HLO tests share its compiled program."""
    return build(mesh, config)


@pytest.fixture(scope="module")
def ep_mesh(devices):
    return MeshSpec(data=2, expert=4).build(devices)


def test_with_no_dropping_expert_parallel_matches_the_single_device_moe(ep_mesh):
    config = _config(capacity_factor=None)
    params, x = _inputs(config)
    layer = _layer(expert_parallel, ep_mesh, config)
    out = layer(*layer.place(params, x))
    np.testing.assert_allclose(out.y_TD, moe_reference(params, x, config, groups=1), atol=1e-5)
    assert float(load_metrics(out.counts).dropped_share) == 0.0
    assert float(out.counts.tokens_per_expert.sum()) == TOKENS * 2


@pytest.mark.parametrize(
    "router, builds",
    [
        ({"capacity_factor": 1.0}, (expert_parallel, gshard)),
        ({"capacity_factor": 1.0, "drop_policy": "position", "score": "sigmoid"}, (expert_parallel,)),
    ],
)
def test_with_dropping_hand_written_and_gshard_match_the_grouped_reference(ep_mesh, router, builds):
    config = _config(**router)
    params, x = _inputs(config)
    reference = moe_reference(params, x, config, groups=8)
    for build in builds:
        layer = _layer(build, ep_mesh, config)
        out = layer(*layer.place(params, x))
        np.testing.assert_allclose(out.y_TD, reference, atol=1e-5, err_msg=build.__name__)
        assert float(load_metrics(out.counts).dropped_share) > 0.05, build.__name__


def test_expert_choice_runs_expert_parallel(ep_mesh):
    config = _config(top_k=1, capacity_factor=1.0, choice="experts")
    params, x = _inputs(config)
    layer = _layer(expert_parallel, ep_mesh, config)
    out = layer(*layer.place(params, x))
    np.testing.assert_allclose(out.y_TD, moe_reference(params, x, config, groups=8), atol=1e-5)
    np.testing.assert_array_equal(out.counts.tokens_per_expert, np.full(8, TOKENS / 8))


def test_the_single_device_layer_matches_the_reference_and_reports_its_loss():
    config = _config(capacity_factor=1.0)
    params, x = _inputs(config)
    out = jax.jit(moe_local, static_argnums=2)(params, x, config, Balance(aux_loss=0.01))
    np.testing.assert_allclose(out.y_TD, moe_reference(params, x, config, groups=1), atol=1e-5)
    assert 0.01 <= float(out.balance_loss) <= 0.01 * 8


def test_expert_parallel_gradients_match_the_reference(ep_mesh):
    config = _config(capacity_factor=None)
    params, x = _inputs(config)
    layer = _layer(expert_parallel, ep_mesh, config)
    placed_params, placed_x = layer.place(params, x)
    grads = jax.jit(jax.grad(lambda p, x: jnp.sum(layer(p, x).y_TD ** 2)))(placed_params, placed_x)
    expected = jax.jit(jax.grad(lambda p: jnp.sum(expert.moe_reference(p, x, config) ** 2)))(params)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(expected)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_hand_written_and_gshard_hlo_carry_two_padded_all_to_alls_over_expert(ep_mesh):
    config = _config(capacity_factor=1.0)  # compiled already by the numerics test
    traffic = moe_traffic(TOKENS // 8, D, 8, 2, 4, capacity_factor=1.0)
    for build in (expert_parallel, gshard):
        layer = _layer(build, ep_mesh, config)
        found = hlo.inspect(layer.fn, *layer.abstract(TOKENS), mesh=ep_mesh).collectives
        all_to_alls = [c for c in found if c.kind == "all-to-all"]
        assert [c.axes for c in all_to_alls] == [("expert",)] * 2, build.__name__
        assert [c.operand_bytes for c in all_to_alls] == [traffic.padded_elements // 2 * 4] * 2, build.__name__


def test_fsdp_splits_the_experts_and_gathers_them_inside_the_layer(devices):
    mesh = MeshSpec(fsdp=2, expert=4).build(devices)
    config = _config(capacity_factor=None)
    params, x = _inputs(config)
    layer = _layer(expert_parallel, mesh, config)
    placed = layer.place(params, x)
    assert placed[0].w_in_EDF.sharding.shard_shape((8, D, F)) == (2, D, F // 2)
    np.testing.assert_allclose(layer(*placed).y_TD, moe_reference(params, x, config), atol=1e-5)
    found = hlo.inspect(layer.fn, *layer.abstract(TOKENS), mesh=mesh).collectives
    assert {(c.kind, c.axes) for c in found} >= {("all-gather", ("fsdp",)), ("all-to-all", ("expert",))}


def test_experts_not_divisible_by_the_expert_axis_is_a_user_error(devices):
    mesh = MeshSpec(data=2, expert=4).build(devices)
    with pytest.raises(LabError, match="6 experts are not divisible by the expert axis"):
        expert_parallel(mesh, MoEConfig(router=RouterConfig(experts=6)))


def test_tokens_must_split_into_the_groups(ep_mesh):
    layer = expert_parallel(ep_mesh, _config())
    with pytest.raises(LabError, match="100 tokens do not split into 8 groups"):
        layer.abstract(100)


def test_noisy_routing_is_refused_by_the_sharded_layers(ep_mesh):
    with pytest.raises(LabError, match="noisy top-k"):
        gshard(ep_mesh, _config(noise_std=1.0))
