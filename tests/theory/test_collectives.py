"""lab.theory.collectives: the alpha-beta schedules by hand, nccl-tests' bandwidths, the crossover.

Theory is code, and is tested: each formula against hand-computed values and its source's numbers.
"""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lab.errors import LabError
from lab.theory.collectives import (
    ALPHA_BETA_KINDS,
    algorithm_bandwidth,
    algorithms_for,
    bus_bandwidth,
    bus_bandwidth_factor,
    collective_cost,
    crossover_bytes,
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
    for kind in ALPHA_BETA_KINDS:
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


kinds_and_algorithms = st.sampled_from(
    [(kind, algorithm) for kind in ALPHA_BETA_KINDS for algorithm in algorithms_for(kind)]
)
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
    # N = 8: recursive doubling 3 steps x S, ring 14 steps x 7/4 S;
    # S* = alpha beta (14 - 3) / (3 - 7/4) = 8.8 alpha beta
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


# --- 4. the reduction arithmetic (TRG's gamma term) ---------------------------


@pytest.mark.parametrize(
    "kind, algorithm, reduced",
    [
        ("all-reduce", "ring", 7 / 8),  # the reduce-scatter pass adds what it receives; the all-gather only copies
        ("all-reduce", "bidirectional-ring", 7 / 8),
        ("all-reduce", "halving-doubling", 7 / 8),  # Rabenseifner: (p-1)/p n gamma
        ("all-reduce", "recursive-doubling", 3),  # lg p (a + n b + n g)
        ("all-reduce", "binomial-tree", 3),  # the binomial reduce adds, the broadcast does not
        ("reduce-scatter", "ring", 7 / 8),
        ("reduce-scatter", "halving-doubling", 7 / 8),
        ("reduce", "binomial-tree", 3),
        ("reduce", "halving-doubling", 7 / 8),
        ("all-gather", "ring", 0),
        ("all-to-all", "direct", 0),
        ("collective-permute", "direct", 0),
        ("broadcast", "binomial-tree", 0),
    ],
)
def test_bytes_reduced_by_hand(kind, algorithm, reduced):
    gamma = 2e-10
    result = collective_cost(kind, 64 * MiB, 8, algorithm=algorithm, alpha=ALPHA, beta=BETA, gamma=gamma)
    assert result.bytes_reduced == pytest.approx(reduced * 64 * MiB)
    assert result.reduction_s == pytest.approx(reduced * 64 * MiB * gamma)
    assert result.seconds == pytest.approx(result.latency_s + result.transfer_s + result.reduction_s)
    # without gamma the reduction is hidden behind the transfers, as before
    assert cost(kind, 64 * MiB, 8, algorithm).seconds == pytest.approx(result.latency_s + result.transfer_s)


def test_gamma_moves_the_crossover_down():
    # recursive doubling adds 3 S, the ring 7/8 S: a reduction cost per byte makes doubling lose sooner
    gamma = 1 / BETA
    with_gamma = crossover_bytes("all-reduce", "recursive-doubling", "ring", 8, alpha=ALPHA, beta=BETA, gamma=gamma)
    # S* = alpha (14 - 3) / ((3 - 7/4)/beta + (3 - 7/8) gamma)
    assert with_gamma == pytest.approx(ALPHA * 11 / ((3 - 7 / 4) / BETA + (3 - 7 / 8) * gamma))
    assert with_gamma < crossover_bytes("all-reduce", "recursive-doubling", "ring", 8, alpha=ALPHA, beta=BETA)


def test_a_negative_gamma_is_refused():
    with pytest.raises(LabError, match="gamma"):
        collective_cost("all-reduce", MiB, 8, algorithm="ring", alpha=ALPHA, beta=BETA, gamma=-1)
