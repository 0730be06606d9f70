"""Routing: capacity, who gets dropped, gates, balancing losses and load metrics, against hand-made cases."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lab import moe as routing_module
from lab.errors import LabError
from lab.moe import (
    Balance,
    RouterConfig,
    balance_loss,
    load_counts,
    load_metrics,
    parse_capacity_factor,
    router_z_loss,
    switch_aux_loss,
    update_bias,
)
from lab.theory import switch_aux_loss_range

route = jax.jit(routing_module.route, static_argnames="config")  # one compile per case instead of one per eager op


def test_capacity_follows_the_switch_example_and_is_capped_by_the_group():
    assert RouterConfig(experts=64, capacity_factor=1.25).capacity(4096) == 80
    assert RouterConfig(experts=2, capacity_factor=4.0).capacity(10) == 10  # 20 slots would exceed the group
    assert RouterConfig(experts=8, top_k=2, capacity_factor=None).capacity(96) == 96


def test_a_capacity_factor_is_read_as_a_number_or_none_and_anything_else_is_a_user_error():
    assert parse_capacity_factor("1.25") == 1.25
    assert parse_capacity_factor(" None ") is None
    with pytest.raises(LabError, match="capacity factor 'lots'"):
        parse_capacity_factor("lots")


@pytest.mark.parametrize(
    "options, message",
    [
        ({"experts": 4, "top_k": 5}, "top-k 5 is larger than the 4 experts"),
        ({"capacity_factor": 0.0}, "capacity factor 0.0"),
        ({"capacity_factor": -1.0}, "capacity factor -1.0"),
        ({"score": "relu"}, "score='relu'"),
        ({"choice": "experts", "capacity_factor": None}, "expert-choice routing needs a capacity factor"),
        ({"noise_std": -0.1}, "noise_std"),
    ],
)
def test_bad_router_settings_are_user_errors(options, message):
    with pytest.raises(LabError, match=message):
        RouterConfig(**options)


def _logits(rows):
    return jnp.log(jnp.asarray(rows, jnp.float32))


def test_position_policy_keeps_the_earliest_tokens_probability_policy_the_most_confident():
    # four tokens all want expert 0; capacity ceil(4·1/4·1.0) = 1
    logits_TE = _logits([[0.4, 0.2, 0.2, 0.2], [0.7, 0.1, 0.1, 0.1], [0.5, 0.2, 0.2, 0.1], [0.9, 0.05, 0.03, 0.02]])
    by_position = route(logits_TE, RouterConfig(experts=4, capacity_factor=1.0, drop_policy="position"))
    by_probability = route(logits_TE, RouterConfig(experts=4, capacity_factor=1.0, drop_policy="probability"))
    assert by_position.capacity == 1
    np.testing.assert_array_equal(by_position.kept_TK[:, 0], [True, False, False, False])
    np.testing.assert_array_equal(by_probability.kept_TK[:, 0], [False, False, False, True])


def test_position_policy_serves_every_first_choice_before_any_second_choice():
    # top-2 over 2 experts, capacity ceil(3·2/2·0.67) = 3 slots each:
    # token 2's first choice (expert 1) beats token 0's second
    logits_TE = _logits([[0.9, 0.1], [0.8, 0.2], [0.3, 0.7]])
    routing = route(logits_TE, RouterConfig(experts=2, top_k=2, capacity_factor=0.67, drop_policy="position"))
    assert routing.capacity == 3
    np.testing.assert_array_equal(routing.expert_TK, [[0, 1], [0, 1], [1, 0]])
    np.testing.assert_array_equal(routing.slot_TK, [[0, 1], [1, 2], [0, 2]])


def test_token_policy_serves_each_token_whole_before_the_next():
    # MaxText's generate_masks example: 4 experts, top-2, tokens routed to [0, 1] and [1, 3], capacity 1:
    # token 1's choice of expert 1 finds the slot taken by token 0's second choice, and is dropped
    logits_TE = _logits([[0.5, 0.4, 0.05, 0.05], [0.05, 0.5, 0.05, 0.4]])
    routing = route(logits_TE, RouterConfig(experts=4, top_k=2, capacity_factor=1.0, drop_policy="token"))
    assert routing.capacity == 1
    np.testing.assert_array_equal(routing.expert_TK, [[0, 1], [1, 3]])
    np.testing.assert_array_equal(routing.kept_TK, [[True, True], [False, True]])
    # the GShard order serves token 1's first choice (expert 1) before token 0's second
    gshard = route(logits_TE, RouterConfig(experts=4, top_k=2, capacity_factor=1.0, drop_policy="position"))
    np.testing.assert_array_equal(gshard.kept_TK, [[True, False], [True, True]])


def test_sigmoid_gates_are_renormalized_over_the_top_k():
    routing = route(jnp.array([[2.0, 1.0, -1.0, 0.0]]), RouterConfig(experts=4, top_k=2, score="sigmoid"))
    s = jax.nn.sigmoid(jnp.array([2.0, 1.0]))
    np.testing.assert_allclose(routing.gate_TK[0], s / s.sum(), rtol=1e-6)
    np.testing.assert_array_equal(routing.expert_TK[0], [0, 1])


def test_bias_steers_the_choice_but_not_the_gate():
    logits_TE = _logits([[0.6, 0.4]])
    routing = route(logits_TE, RouterConfig(experts=2, capacity_factor=None), bias_E=jnp.array([0.0, 0.5]))
    assert int(routing.expert_TK[0, 0]) == 1
    assert float(routing.gate_TK[0, 0]) == pytest.approx(0.4)


def test_expert_choice_gives_every_expert_exactly_its_capacity():
    logits_TE = jax.random.normal(jax.random.key(0), (16, 4))
    routing = route(logits_TE, RouterConfig(experts=4, top_k=1, capacity_factor=1.0, choice="experts"))
    metrics = load_metrics(load_counts(routing))
    np.testing.assert_array_equal(metrics.tokens_per_expert, [4, 4, 4, 4])
    assert float(metrics.max_over_mean) == 1.0 and float(metrics.dropped_share) == 0.0
    assert float(metrics.unserved_share) > 0  # some tokens are picked by no expert


def test_noise_changes_choices_only_when_a_key_is_given():
    logits_TE = jax.random.normal(jax.random.key(1), (64, 8)) * 0.1
    config = RouterConfig(experts=8, capacity_factor=None, noise_std=1.0)
    quiet = route(logits_TE, config)
    np.testing.assert_array_equal(quiet.expert_TK[:, 0], jnp.argmax(logits_TE, -1))
    noisy = route(logits_TE, config, noise_key=jax.random.key(2))
    assert np.any(np.asarray(noisy.expert_TK) != np.asarray(quiet.expert_TK))


def test_switch_loss_matches_theory_at_balance_and_at_collapse():
    experts = 8
    uniform = route(jnp.zeros((32, experts)), RouterConfig(experts=experts, capacity_factor=None))
    collapsed = route(
        jnp.tile(jnp.array([40.0] + [0.0] * (experts - 1)), (32, 1)),
        RouterConfig(experts=experts, capacity_factor=None),
    )
    balanced_theory, collapsed_theory = switch_aux_loss_range(experts)
    assert float(switch_aux_loss(uniform)) == pytest.approx(balanced_theory)
    assert float(switch_aux_loss(collapsed)) == pytest.approx(collapsed_theory, rel=1e-6)


def test_balance_loss_weights_the_switch_and_z_losses():
    routing = route(jnp.zeros((8, 4)), RouterConfig(experts=4, capacity_factor=None))
    assert float(router_z_loss(routing)) == pytest.approx(np.log(4) ** 2)
    total = balance_loss(routing, Balance(aux_loss=0.1, z_loss=0.01))
    assert float(total) == pytest.approx(0.1 * 1.0 + 0.01 * np.log(4) ** 2)


def test_bias_update_pushes_load_toward_the_mean():
    bias = update_bias(jnp.zeros(4), jnp.array([7.0, 1.0, 4.0, 4.0]), 0.01)
    np.testing.assert_allclose(bias, [-0.01, 0.01, -0.0, -0.0])


def test_load_metrics_of_a_skewed_top_1_routing():
    # 6 tokens: 4 want expert 0, 2 want expert 1, none want 2 or 3; capacity ceil(6/4·1) = 2
    choice = jnp.array([0, 0, 0, 0, 1, 1])
    routing = route(jax.nn.one_hot(choice, 4) * 10.0, RouterConfig(experts=4, capacity_factor=1.0))
    metrics = load_metrics(load_counts(routing))
    np.testing.assert_array_equal(metrics.tokens_per_expert, [4, 2, 0, 0])
    assert float(metrics.max_over_mean) == pytest.approx(4 / 1.5)
    assert float(metrics.coefficient_of_variation) == pytest.approx(np.std([4, 2, 0, 0]) / 1.5)
    assert float(metrics.dropped_share) == pytest.approx(2 / 6)
    assert float(metrics.router_entropy) < 0.01  # confident router


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), policy=st.sampled_from(["probability", "position", "token"]))
def test_slots_are_unique_within_capacity_and_fill_each_expert_up_to_it(seed, policy):
    config = RouterConfig(experts=4, top_k=2, capacity_factor=0.75, drop_policy=policy)
    routing = route(jax.random.normal(jax.random.key(seed), (12, 4)) * 2, config)
    expert, slot, kept = (np.asarray(a).ravel() for a in (routing.expert_TK, routing.slot_TK, routing.kept_TK))
    for e in range(4):
        wanted = int(np.sum(expert == e))
        slots = np.sort(slot[(expert == e) & kept])
        np.testing.assert_array_equal(slots, np.arange(min(wanted, routing.capacity)))
