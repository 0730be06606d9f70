"""Theory is code, and is tested: each formula against hand-computed values and its source's numbers."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lab.errors import LabError
from lab.hardware import profile
from lab.theory import (
    KINDS,
    algorithm_bandwidth,
    algorithms_for,
    bus_bandwidth,
    bus_bandwidth_factor,
    collective_cost,
    crossover_bytes,
    predict_on_switch,
    predict_on_torus,
)

MiB = 2**20
ALPHA, BETA = 1e-6, 1e10  # 1 us per message, 10 GB/s per link


def cost(kind, size, devices, algorithm, alpha=ALPHA, beta=BETA):
    return collective_cost(kind, size, devices, algorithm=algorithm, alpha=alpha, beta=beta)


# --- 1. alpha-beta schedules, by hand for N = 8, S = 64 MiB -------------------


@pytest.mark.parametrize(
    "kind, algorithm, steps, bytes_sent, links",
    [
        ("all-reduce", "ring", 14, 2 * 7 / 8 * 64 * MiB, 1),
        ("all-reduce", "bidirectional-ring", 8, 2 * 7 / 8 * 64 * MiB, 2),
        ("all-reduce", "halving-doubling", 6, 2 * 7 / 8 * 64 * MiB, 1),
        ("all-reduce", "recursive-doubling", 3, 3 * 64 * MiB, 1),
        ("all-reduce", "binomial-tree", 6, 6 * 64 * MiB, 1),
        ("all-gather", "ring", 7, 7 / 8 * 64 * MiB, 1),
        ("all-gather", "bidirectional-ring", 4, 7 / 8 * 64 * MiB, 2),
        ("all-gather", "halving-doubling", 3, 7 / 8 * 64 * MiB, 1),
        ("reduce-scatter", "ring", 7, 7 / 8 * 64 * MiB, 1),
        ("reduce-scatter", "halving-doubling", 3, 7 / 8 * 64 * MiB, 1),
        ("all-to-all", "direct", 7, 7 / 8 * 64 * MiB, 1),
        ("all-to-all", "ring", 7, (1 + 2 + 3 + 4 + 5 + 6 + 7) / 8 * 64 * MiB, 1),
        ("all-to-all", "bidirectional-ring", 4, (1 + 2 + 3 + 4 + 3 + 2 + 1) / 8 * 64 * MiB, 2),
        ("collective-permute", "direct", 1, 64 * MiB, 1),
        ("broadcast", "binomial-tree", 3, 3 * 64 * MiB, 1),
        ("broadcast", "scatter-allgather", 3 + 7, 2 * 7 / 8 * 64 * MiB, 1),
        ("reduce", "binomial-tree", 3, 3 * 64 * MiB, 1),
        ("reduce", "halving-doubling", 6, 2 * 7 / 8 * 64 * MiB, 1),
    ],
)
def test_schedules_by_hand(kind, algorithm, steps, bytes_sent, links):
    result = cost(kind, 64 * MiB, 8, algorithm)
    assert (result.steps, result.bytes_sent, result.links) == (steps, pytest.approx(bytes_sent), links)
    assert result.seconds == pytest.approx(steps * ALPHA + bytes_sent / (links * BETA))


def test_every_kind_has_an_algorithm_and_every_algorithm_handles_one_device():
    for kind in KINDS:
        assert algorithms_for(kind)
        for algorithm in algorithms_for(kind):
            alone = cost(kind, 64 * MiB, 1, algorithm)
            assert (alone.steps, alone.bytes_sent, alone.seconds) == (0, 0, 0), (kind, algorithm)


def test_bidirectional_ring_with_odd_devices_takes_the_short_way():
    assert cost("all-gather", 3 * MiB, 3, "bidirectional-ring").steps == 1
    assert cost("all-to-all", 5 * MiB, 5, "bidirectional-ring").bytes_sent == pytest.approx(
        (1 + 2 + 2 + 1) / 5 * 5 * MiB
    )


def test_user_mistakes_raise_lab_errors():
    with pytest.raises(LabError, match="power-of-two"):
        cost("all-reduce", MiB, 6, "halving-doubling")
    with pytest.raises(LabError, match="ring"):
        cost("all-to-all", MiB, 8, "halving-doubling")
    with pytest.raises(LabError, match="all-reduce"):
        cost("allreduce", MiB, 8, "ring")
    with pytest.raises(LabError, match="positive whole number"):
        cost("all-reduce", MiB, 0, "ring")
    with pytest.raises(LabError, match="beta"):
        cost("all-reduce", MiB, 8, "ring", beta=0)


kinds_and_algorithms = st.sampled_from([(kind, algorithm) for kind in KINDS for algorithm in algorithms_for(kind)])
power_of_two_devices = st.integers(0, 10).map(lambda exponent: 2**exponent)
sizes = st.integers(0, 10**12)  # bytes


@given(kinds_and_algorithms, power_of_two_devices, sizes, sizes)
def test_cost_grows_with_size(kind_and_algorithm, devices, size_a, size_b):
    kind, algorithm = kind_and_algorithm
    small, large = sorted((size_a, size_b))
    assert cost(kind, small, devices, algorithm).seconds <= cost(kind, large, devices, algorithm).seconds


@given(st.integers(1, 4096), sizes)
def test_ring_sends_less_than_twice_the_buffer(devices, size):
    ring_bytes = cost("all-reduce", size, devices, "ring").bytes_sent
    assert ring_bytes == pytest.approx(2 * (devices - 1) / devices * size)
    assert ring_bytes < 2 * size or size == 0
    assert cost("all-gather", size, devices, "ring").bytes_sent <= size


# --- 2. nccl-tests bandwidths -------------------------------------------------


@pytest.mark.parametrize(
    "kind, factor",
    [
        ("all-reduce", 2 * 7 / 8),
        ("all-gather", 7 / 8),
        ("reduce-scatter", 7 / 8),
        ("all-to-all", 7 / 8),
        ("broadcast", 1),
        ("reduce", 1),
        ("collective-permute", 1),
    ],
)
def test_bus_bandwidth_factors_follow_nccl_tests(kind, factor):
    assert bus_bandwidth_factor(kind, 8) == pytest.approx(factor)
    assert bus_bandwidth(kind, 8e9, 2.0, 8) == pytest.approx(4e9 * factor)


def test_algorithm_bandwidth_is_size_over_time():
    assert algorithm_bandwidth(64 * MiB, 0.5) == 128 * MiB
    with pytest.raises(LabError, match="positive time"):
        algorithm_bandwidth(1, 0)


@given(st.sampled_from(["all-reduce", "all-gather", "reduce-scatter"]), st.integers(2, 1024), st.integers(1, 10**12))
def test_busbw_of_a_bandwidth_bound_ring_is_the_link_bandwidth(kind, devices, size):
    # The point of nccl-tests' factor: an ideal ring's busbw equals the link rate, whatever N.
    ring = cost(kind, size, devices, "ring", alpha=0)
    assert bus_bandwidth(kind, size, ring.seconds, devices) == pytest.approx(BETA)


# --- 3. crossover -------------------------------------------------------------


def test_all_reduce_crossover_closed_form_by_hand():
    # N = 8: recursive doubling 3 steps x S, ring 14 steps x 7/4 S; S* = alpha beta (14 - 3) / (3 - 7/4) = 8.8 alpha beta
    assert crossover_bytes("all-reduce", "recursive-doubling", "ring", 8, alpha=ALPHA, beta=BETA) == pytest.approx(
        8.8 * ALPHA * BETA
    )


@given(st.integers(2, 12).map(lambda exponent: 2**exponent), st.floats(1e-7, 1e-4), st.floats(1e8, 1e12))
def test_the_costs_are_equal_at_the_crossover(devices, alpha, beta):
    size = crossover_bytes("all-reduce", "recursive-doubling", "ring", devices, alpha=alpha, beta=beta)
    few = cost("all-reduce", size, devices, "recursive-doubling", alpha, beta)
    ring = cost("all-reduce", size, devices, "ring", alpha, beta)
    assert few.seconds == pytest.approx(ring.seconds, rel=1e-9)
    assert (
        cost("all-reduce", size / 2, devices, "recursive-doubling", alpha, beta).seconds
        < cost("all-reduce", size / 2, devices, "ring", alpha, beta).seconds
    )


def test_crossover_edge_cases():
    # Halving-doubling sends the ring's bytes in fewer steps: in the alpha-beta model it never loses.
    assert crossover_bytes("all-reduce", "halving-doubling", "ring", 8, alpha=ALPHA, beta=BETA) == math.inf
    # The ring never beats recursive doubling *below* a size; it wins above one.
    assert crossover_bytes("all-reduce", "ring", "recursive-doubling", 8, alpha=ALPHA, beta=BETA) == 0
    # With two devices recursive doubling sends the ring's bytes (S) in one step instead of two.
    assert crossover_bytes("all-reduce", "recursive-doubling", "ring", 2, alpha=ALPHA, beta=BETA) == math.inf


# --- 4. on a chip's network: the scaling book's worked answers ----------------

B, D = 1024, 4096  # Part 3, "Some Problems to Work", Question 2: bf16[B_X, D_Y] on a TPU v4p 4x4x4


def test_book_q2_all_gather_over_one_wrapped_axis():
    # AllGather_X([B_X, D_Y]) gathers 2BD/Y bytes: the book's answer 2BD / (9e10 Y) = 23 us is the large-axis
    # limit V / W_ici; the ring's exact (N-1)/N share is 3/4 of it.
    gathered = 2 * B * D / 4
    result = predict_on_torus("all-gather", gathered, profile("v4"), (4, 4, 4), (0,))
    assert (result.links, result.steps) == (2, 2)
    assert result.seconds == result.transfer_s == pytest.approx(3 / 4 * gathered / 9e10)
    assert result.transfer_s * 4 / 3 == pytest.approx(2 * B * D / (9e10 * 4))
    assert round(result.transfer_s * 4 / 3 * 1e6) == 23


def test_book_q2_all_gather_over_two_axes_doubles_the_bandwidth():
    result = predict_on_torus("all-gather", 2 * B * D, profile("v4"), (4, 4, 4), (0, 1))
    assert result.links == 4
    assert result.transfer_s * 16 / 15 == pytest.approx(2 * B * D / 1.8e11)  # book: "2BD / 1.8e11 seconds, or 46 us"


def test_book_q3_tiny_all_gather_is_latency_bound():
    # AllGather_X([B_X]) with B = 128 in bf16: "we can do the full gather in only 2 hops, so roughly 2us"
    result = predict_on_torus("all-gather", 2 * 128, profile("v4"), (4, 4, 4), (0,))
    assert result.seconds == result.latency_s == pytest.approx(2e-6)


def test_book_pop_quiz_2_v5e_without_wraparound():
    # v5e mesh {X: 8, Y: 4}: AllGather_Y of bf16[2048, 8192]; no wraparound below 16, so
    # "3 * 8.4e6 / 4.5e10 = 560us" (3 hops of a 1/4 shard, one way)
    result = predict_on_torus("all-gather", 2 * 2048 * 8192, profile("v5e"), (8, 4), (1,))
    assert (result.links, result.steps) == (1, 3)
    assert result.seconds == pytest.approx(560e-6, rel=0.01)


def test_torus_all_reduce_is_twice_and_all_to_all_a_quarter_of_an_all_gather():
    v5p, size = profile("v5p"), 64 * MiB
    gather = predict_on_torus("all-gather", size, v5p, (8, 8, 8), (2,))
    assert predict_on_torus("all-reduce", size, v5p, (8, 8, 8), (2,)).transfer_s == pytest.approx(2 * gather.transfer_s)
    # Part 3: "An AllToAll ... is thus 1/4 the cost of an AllGather" of the same global array V = N * S.
    all_to_all = predict_on_torus("all-to-all", size / 8, v5p, (8, 8, 8), (2,))
    assert all_to_all.transfer_s == pytest.approx(size / (4 * 2 * v5p.link_bandwidth))


def test_torus_rejects_a_switched_chip_and_bad_dims():
    with pytest.raises(LabError, match="predict_on_switch"):
        predict_on_torus("all-gather", MiB, profile("h100"), (8,), (0,))
    with pytest.raises(LabError, match="distinct indices"):
        predict_on_torus("all-gather", MiB, profile("v5p"), (4, 4, 4), (0, 0))
    with pytest.raises(LabError, match="collective_cost"):
        predict_on_torus("broadcast", MiB, profile("v5p"), (4, 4, 4), (0,))


def test_book_gpu_pop_quiz_1_h100_node_all_gather():
    # Part 12: AllGather(bf16[B_X, F]) on 8xH100, B = 1024, F = 16384: "more precisely 65us"
    result = predict_on_switch("all-gather", 2 * 1024 * 16384, profile("h100"), 8)
    assert result.seconds == pytest.approx(65e-6, rel=0.01)


def test_gpu_all_to_all_in_a_node_is_b_over_w_n():
    # Part 12: B (N-1) / (W N^2) for B global bytes, i.e. (N-1)/N of one device's buffer over W
    h100, per_device = profile("h100"), 8 * MiB
    result = predict_on_switch("all-to-all", per_device, h100, 8)
    assert result.transfer_s == pytest.approx(8 * per_device * 7 / (h100.link_bandwidth * 64))


def test_dcn_uses_the_per_chip_data_centre_bandwidth():
    v5p = profile("v5p")
    across_slices = predict_on_switch("all-reduce", 64 * MiB, v5p, 4, network="dcn")
    assert across_slices.seconds == pytest.approx(2 * 3 / 4 * 64 * MiB / v5p.dcn_bandwidth)
    with pytest.raises(LabError, match="no data-centre network"):
        predict_on_switch("all-reduce", MiB, profile("cpu"), 4, network="dcn")


# --- 6. compute-bound thresholds (scaling book, Part 5) ------------------------


def test_v5p_thresholds_match_the_book():
    from lab.hardware import profile
    from lab.theory import (
        data_parallel_min_batch_per_chip,
        fsdp_tp_min_batch_per_chip,
        fsdp_tp_optimal_fsdp_ways,
        ici_arithmetic_intensity,
        tensor_parallel_max_ways,
    )

    v5p = profile("v5p")
    assert ici_arithmetic_intensity(v5p) == pytest.approx(2550, rel=1e-3)
    assert data_parallel_min_batch_per_chip(v5p, axes_spanned=3) == pytest.approx(850, rel=1e-3)
    assert tensor_parallel_max_ways(v5p, mlp=32768) == pytest.approx(12.85, rel=1e-2)  # "8-16 way"
    assert fsdp_tp_min_batch_per_chip(v5p, mlp=32768, fsdp_axes=2, tp_axes=1) == pytest.approx(
        397, rel=1e-2
    )  # "roughly 400"
    assert fsdp_tp_optimal_fsdp_ways(batch_tokens=2**20, mlp=2**15, chips=64) == pytest.approx(math.sqrt(32 * 64))


# --- ZeRO: model-state memory and data-parallel traffic -----------------------

from lab.theory import ModelStateBytes, step_wire_bytes, zero_model_states, zero_step_collectives


@pytest.mark.parametrize("stage, gigabytes", [(0, 120), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_figure_1_7_5b_parameters_on_64_devices(stage, gigabytes):
    # ZeRO paper, Figure 1: Ψ = 7.5B, N_d = 64, K = 12: 120 GB, 31.4 GB, 16.6 GB, 1.9 GB
    assert zero_model_states(stage, 7.5e9, 64).total / 1e9 == pytest.approx(gigabytes, abs=0.05)


def test_zero_stages_partition_one_more_term_each():
    psi, n = 1000, 8
    assert zero_model_states(0, psi, n) == ModelStateBytes(2 * psi, 2 * psi, 12 * psi)
    assert zero_model_states(1, psi, n) == ModelStateBytes(2 * psi, 2 * psi, 12 * psi / n)
    assert zero_model_states(2, psi, n) == ModelStateBytes(2 * psi, 2 * psi / n, 12 * psi / n)
    assert zero_model_states(3, psi, n) == ModelStateBytes(2 * psi / n, 2 * psi / n, 12 * psi / n)


def test_zero3_moves_one_and_a_half_times_ddp_unless_it_keeps_the_gathered_weights():
    psi, n = 1e9, 8
    ddp = step_wire_bytes(zero_step_collectives(0, psi), n)
    assert ddp == pytest.approx(2 * 7 / 8 * psi)
    assert step_wire_bytes(zero_step_collectives(1, psi), n) == pytest.approx(ddp)  # RS + AG = AR
    assert step_wire_bytes(zero_step_collectives(3, psi), n) / ddp == pytest.approx(1.5)
    assert step_wire_bytes(zero_step_collectives(3, psi, regathered_bytes=0), n) / ddp == pytest.approx(1.0)


def test_zero_rejects_an_unknown_stage():
    with pytest.raises(LabError, match="ZeRO stage 4"):
        zero_model_states(4, 10, 2)
    with pytest.raises(LabError, match="ZeRO stage"):
        zero_step_collectives(-1, 10)


# --- Overlapping communication with compute, and gradient buckets -------------

from lab.theory import bucket_count, bucketed_allreduce_time, collective_matmul_time, optimal_bucket_bytes, overlap_time


def test_overlap_hides_the_smaller_of_compute_and_communication():
    step = overlap_time(0.100, 0.040)  # the quick-reference's example: 100 ms compute, 40 ms communication
    assert (step.serial_s, step.overlapped_s) == pytest.approx((0.140, 0.100))
    assert step.hidden_s == pytest.approx(0.040) and step.exposed_s == 0
    assert overlap_time(0.040, 0.100).exposed_s == pytest.approx(
        0.060
    )  # communication-bound: overlap cannot hide it all


def test_collective_matmul_hides_all_but_one_block_when_compute_covers_each_transfer():
    assert collective_matmul_time(8.0, 0.5, 8) == pytest.approx(8.0)  # c = 1 > t: compute-bound, every transfer hidden
    assert collective_matmul_time(8.0, 2.0, 8) == pytest.approx(1 + 7 * 2.0)  # c < t: the ring is communication-bound
    # both directions: 4 steps on 8 devices, two blocks a step except the opposite block
    assert collective_matmul_time(8.0, 0.5, 8, bidirectional=True) == pytest.approx(1 + 2 + 2 + 2 + 1)
    assert collective_matmul_time(8.0, 3.0, 8, bidirectional=True) == pytest.approx(1 + 4 * 3.0)


def test_bucket_count_rounds_up_and_a_huge_bucket_is_one():
    assert bucket_count(10, 4) == 3
    assert bucket_count(10, 10**9) == 1
    with pytest.raises(LabError, match="positive"):
        bucket_count(10, 0)


def test_bucketed_time_without_overlap_is_the_sum_of_the_bucket_all_reduces():
    g, n, alpha, beta = 100e6, 8, 1e-5, 1e10
    result = bucketed_allreduce_time(g, 25e6, n, alpha=alpha, beta=beta, backward_s=1.0, overlap=False)
    one = collective_cost("all-reduce", 25e6, n, algorithm="ring", alpha=alpha, beta=beta).seconds
    assert result.buckets == 4 and result.comm_s == pytest.approx(4 * one) and result.exposed_s == result.comm_s
    assert result.latency_s == pytest.approx(4 * 2 * (n - 1) * alpha)


def test_with_overlap_only_the_last_bucket_is_exposed_when_compute_dominates():
    g, n, alpha, beta = 100e6, 8, 1e-5, 1e10
    result = bucketed_allreduce_time(g, 25e6, n, alpha=alpha, beta=beta, backward_s=10.0)
    last = collective_cost("all-reduce", 25e6, n, algorithm="ring", alpha=alpha, beta=beta).seconds
    assert result.exposed_s == pytest.approx(last) and result.step_s == pytest.approx(10.0 + last)


def test_optimal_bucket_beats_its_neighbours_when_communication_bound():
    g, n, alpha, beta, backward = 1e9, 64, 5e-6, 1e11, 0.01
    latency = 2 * (n - 1) * alpha
    best = optimal_bucket_bytes(g, backward, latency)
    assert best == pytest.approx(g * math.sqrt(latency / backward))

    def step(b):
        return bucketed_allreduce_time(g, b, n, alpha=alpha, beta=beta, backward_s=backward).step_s

    assert step(best) < step(best / 4) and step(best) < step(best * 4)


# --- 5. Mixture of experts ------------------------------------------------------------

from lab.theory import (
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


# --- activation memory under tensor and sequence parallelism -------------------


def test_activation_memory_matches_korthikanti_formulas():
    from lab.theory import activation_bytes_per_layer

    s, b, h, a = 2048, 1, 12288, 96  # GPT-3 175B's layer (the paper's Table 3 model)
    sbh = s * b * h
    assert activation_bytes_per_layer(s, b, h, a) == pytest.approx(sbh * (34 + 5 * a * s / h))
    assert activation_bytes_per_layer(s, b, h, a, 8) == pytest.approx(sbh * (10 + 24 / 8 + 5 * a * s / (h * 8)))
    assert activation_bytes_per_layer(s, b, h, a, 8, sequence_parallel=True) == pytest.approx(
        sbh * (34 + 5 * a * s / h) / 8
    )
    assert activation_bytes_per_layer(s, b, h, a, 1, sequence_parallel=True) == activation_bytes_per_layer(s, b, h, a)


def test_activation_memory_without_dropout_drops_masks():
    from lab.theory import activation_bytes_per_layer

    assert activation_bytes_per_layer(16, 2, 64, 4, dropout=False) == pytest.approx(
        16 * 2 * 64 * (32 + 2 * 4 * 16 / 64)
    )
    assert activation_bytes_per_layer(16, 2, 64, 4, 4, dropout=False) == pytest.approx(
        16 * 2 * 64 * (8 + 6 + 2 * 4 * 16 / 256)
    )
    with pytest.raises(LabError, match="positive sizes"):
        activation_bytes_per_layer(16, 2, 64, 4, 0)


# --- Pipeline parallelism: bubbles, step time, activations in flight ---------

from lab import theory as pipeline_theory


def test_gpipe_bubble_is_small_once_m_is_four_times_k():
    # GPipe (Huang et al. 2019, Sec. 2.3): bubble O((K-1)/(M+K-1)), "negligible when M >= 4 x K"
    for k in (2, 4, 8, 16):
        assert pipeline_theory.pipeline_bubble_fraction(k, 4 * k) == pytest.approx((k - 1) / (5 * k - 1))
        assert pipeline_theory.pipeline_bubble_fraction(k, 4 * k) < 0.2
    assert pipeline_theory.pipeline_bubble_fraction(4, 4) == pytest.approx(3 / 7)  # the quick-reference's example


def test_megatron_bubble_ratio_and_interleaving():
    # Narayanan et al. 2021, Sec. 2.2: t_pb / t_id = (p-1)/m, and (1/v)(p-1)/m interleaved
    assert pipeline_theory.pipeline_bubble_ratio(8, 32) == pytest.approx(7 / 32)
    assert pipeline_theory.pipeline_bubble_ratio(8, 32, chunks=2) == pytest.approx(7 / 64)
    ratio = pipeline_theory.pipeline_bubble_ratio(4, 8, 2)
    assert pipeline_theory.pipeline_bubble_fraction(4, 8, 2) == pytest.approx(
        ratio / (1 + ratio)
    )  # bubble / (ideal + bubble)
    assert pipeline_theory.pipeline_step_time(4, 8, 1.0, 2.0) == pytest.approx(11 * 3)
    assert pipeline_theory.pipeline_step_time(4, 8, 1.0, 2.0, chunks=2) == pytest.approx((8 + 1.5) * 3)


def test_zero_bubble_h1_keeps_a_third_of_the_1f1b_bubble():
    # Qi et al. 2024, Sec. 3.1: 1F1B bubble (p-1)(T_F+T_B+T_W), ZB-H1 (p-1)(T_F+T_B-T_W)
    p, m = 4, 12
    one_f_one_b = pipeline_theory.pipeline_step_time(p, m, 1.0, 2.0) - m * 3.0
    zb = pipeline_theory.zero_bubble_h1_step_time(p, m, 1.0, 1.0, 1.0) - m * 3.0
    assert zb * 3 == pytest.approx(one_f_one_b)
    with pytest.raises(LabError, match="m >= P"):
        pipeline_theory.zero_bubble_h1_step_time(8, 4, 1.0, 1.0, 1.0)


def test_imbalanced_stages_set_the_pace():
    assert pipeline_theory.imbalanced_step_time([1.0] * 4, [2.0] * 4, 8) == pytest.approx(
        pipeline_theory.pipeline_step_time(4, 8, 1.0, 2.0)
    )
    # the quick-reference's follow-up: stage 0 takes 2 s, stage 1 takes 1 s, forward and backward alike
    assert pipeline_theory.imbalanced_step_time([2.0, 1.0], [2.0, 1.0], 8) == pytest.approx(6 + 7 * 4)
    with pytest.raises(LabError, match="one backward time per stage"):
        pipeline_theory.imbalanced_step_time([1.0, 1.0], [1.0], 4)


def test_micro_batches_in_flight():
    assert pipeline_theory.peak_micro_batches_in_flight("gpipe", 4, 16) == 16
    assert [pipeline_theory.peak_micro_batches_in_flight("1f1b", 4, 16, s) for s in range(4)] == [4, 3, 2, 1]
    assert pipeline_theory.peak_micro_batches_in_flight("1f1b", 4, 2) == 2
    assert pipeline_theory.peak_micro_batches_in_flight("interleaved", 4, 16, 0, chunks=2) == pytest.approx(4 + 3 / 2)
    assert pipeline_theory.peak_micro_batches_in_flight("zb-h1", 4, 16, 3) == 4
    with pytest.raises(LabError, match="unknown pipeline schedule"):
        pipeline_theory.peak_micro_batches_in_flight("pipedream-2bw", 4, 16)
    with pytest.raises(LabError, match="not one of the 4 stages"):
        pipeline_theory.peak_micro_batches_in_flight("1f1b", 4, 16, 4)


@given(st.integers(2, 16), st.floats(1e-3, 10.0), st.floats(1e-5, 1e-1))
def test_optimal_micro_batches_minimises_the_step(stages, work, overhead):
    best = pipeline_theory.optimal_micro_batches(stages, work, overhead)

    def step(m: float) -> float:
        return (m + stages - 1) * (work / m + overhead)

    assert step(best) <= min(step(best * 0.9), step(best * 1.1)) + 1e-12


def test_rule_of_thumb_leaves_a_fifth_to_a_third_of_the_step_idle():
    for p in (2, 4, 8, 16):
        assert pipeline_theory.pipeline_bubble_fraction(p, 2 * (p - 1)) == pytest.approx(1 / 3)
        assert pipeline_theory.pipeline_bubble_fraction(p, 4 * (p - 1)) == pytest.approx(1 / 5)


def test_pipeline_theory_rejects_bad_sizes():
    with pytest.raises(LabError, match="positive whole number of micro-batches"):
        pipeline_theory.pipeline_bubble_fraction(4, 0)
    with pytest.raises(LabError, match="positive whole number of chunks"):
        pipeline_theory.pipeline_bubble_fraction(4, 8, chunks=0)
    with pytest.raises(LabError, match="positive work time"):
        pipeline_theory.optimal_micro_batches(4, 1.0, 0.0)
