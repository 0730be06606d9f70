"""lab.theory.overlap: overlapped communication, collective matmuls and gradient buckets."""

import math

import pytest

from lab.errors import LabError
from lab.theory.collectives import collective_cost
from lab.theory.overlap import (
    bucket_count,
    bucketed_allreduce_time,
    collective_matmul_time,
    optimal_bucket_bytes,
    overlap_time,
)


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
