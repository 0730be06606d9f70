"""lab.theory.moe: expert capacity, all-to-all traffic, the balance loss and dropped tokens."""

import pytest

from lab.errors import LabError
from lab.theory.moe import (
    capacity_factor_to_drop_nothing,
    dropped_share,
    expert_capacity,
    moe_traffic,
    switch_aux_loss_range,
)


def test_switch_capacity_example_4096_tokens_64_experts_factor_1_25_gives_80():
    assert expert_capacity(4096, 64, 1, 1.25) == 80
    assert expert_capacity(4096, 64, 2, 1.0) == 128  # GShard top-2: 2·S/E
    assert expert_capacity(10, 4, 1, 1.0) == 3  # rounded up: 2.5 -> 3


@pytest.mark.parametrize("capacity_factor", [0.0, -1.0])
def test_capacity_factor_at_or_below_zero_is_a_user_error(capacity_factor):
    with pytest.raises(LabError, match="capacity factor"):
        expert_capacity(4096, 64, 1, capacity_factor)


def test_top_k_above_the_expert_count_is_a_user_error():
    with pytest.raises(LabError, match="top-k 9 with 8 experts"):
        expert_capacity(64, 8, 9, 1.0)


def test_dispatch_plus_combine_move_2_B_L_d_k_over_the_group():
    devices, tokens_per_device, d, k = 8, 512, 64, 2
    traffic = moe_traffic(tokens_per_device, d, 16, k, devices, capacity_factor=1.25)
    assert devices * traffic.elements == 2 * (devices * tokens_per_device) * d * k
    assert traffic.cross_device_fraction == pytest.approx(7 / 8)
    assert traffic.capacity == 80 and traffic.padding_factor == pytest.approx(1.25)


def test_padding_with_no_dropping_is_experts_over_k():
    traffic = moe_traffic(256, 32, 16, 2, 4, capacity_factor=None)
    assert traffic.capacity == 256 and traffic.padding_factor == pytest.approx(16 / 2)


def test_padding_rounds_capacity_up():
    traffic = moe_traffic(100, 8, 8, 1, 8, capacity_factor=1.0)
    assert traffic.capacity == 13 and traffic.padded_elements == 2 * 8 * 13 * 8


def test_traffic_needs_experts_divisible_by_the_group():
    with pytest.raises(LabError, match="12 experts do not split over 8"):
        moe_traffic(64, 8, 12, 1, 8)


def test_switch_aux_loss_is_alpha_when_balanced_and_alpha_n_when_collapsed():
    assert switch_aux_loss_range(64, alpha=0.01) == pytest.approx((0.01, 0.64))
    balanced, collapsed = switch_aux_loss_range(8)
    assert balanced == 1.0 and collapsed == 8.0
    assert collapsed / 8 == 1.0 and balanced / 8 == pytest.approx(1 / 8)  # the bare sum Σ f·P: 1/N to 1


def test_dropped_share_counts_overflow_per_expert():
    assert dropped_share([30, 10, 0, 0], capacity=12) == pytest.approx(
        18 / 40
    )  # idle experts do not absorb the overflow
    assert dropped_share([10, 10, 10, 10], capacity=10) == 0.0
    with pytest.raises(LabError, match="positive load"):
        dropped_share([0, 0], capacity=4)


def test_a_hot_expert_with_share_h_needs_capacity_factor_h_times_e():
    tokens, experts = 4096, 64
    assert capacity_factor_to_drop_nothing(0.25 * tokens, tokens, experts, 1) == pytest.approx(0.25 * 64)
    assert (
        expert_capacity(tokens, experts, 1, capacity_factor_to_drop_nothing(0.25 * tokens, tokens, experts, 1)) == 1024
    )
