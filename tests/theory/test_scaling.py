"""lab.theory.scaling: the compute-bound thresholds of the scaling book, Part 5."""

import math

import pytest

from lab.targets.hardware import profile
from lab.theory.scaling import (
    data_parallel_min_batch_per_chip,
    dcn_arithmetic_intensity,
    fsdp_tp_comm_to_compute,
    fsdp_tp_min_batch_per_chip,
    fsdp_tp_min_batch_per_chip_at,
    fsdp_tp_optimal_fsdp_ways,
    ici_arithmetic_intensity,
    tensor_parallel_max_ways,
)


def test_v5p_thresholds_match_the_book():
    v5p = profile("v5p")
    assert ici_arithmetic_intensity(v5p) == pytest.approx(2550, rel=1e-3)
    assert data_parallel_min_batch_per_chip(v5p, axes_spanned=3) == pytest.approx(850, rel=1e-3)
    assert tensor_parallel_max_ways(v5p, mlp=32768) == pytest.approx(12.85, rel=1e-2)  # "8-16 way"
    assert fsdp_tp_min_batch_per_chip(v5p, mlp=32768, fsdp_axes=2, tp_axes=1) == pytest.approx(
        397, rel=1e-2
    )  # "roughly 400"
    assert fsdp_tp_optimal_fsdp_ways(batch_tokens=2**20, mlp=2**15, chips=64) == pytest.approx(math.sqrt(32 * 64))


def test_the_comm_to_compute_ratio_crosses_one_at_the_thresholds():
    v5p = profile("v5p")
    # pure FSDP: 1 exactly at alpha / M_X
    assert fsdp_tp_comm_to_compute(v5p, 850, 32768, fsdp_axes=3) == pytest.approx(1, rel=1e-3)
    # FSDP x TP at a given Y: 1 exactly at the threshold for that Y
    at_y4 = fsdp_tp_min_batch_per_chip_at(v5p, 32768, tensor_ways=4, fsdp_axes=2)
    assert fsdp_tp_comm_to_compute(v5p, at_y4, 32768, tensor_ways=4, fsdp_axes=2) == pytest.approx(1)
    # alpha / (Y M_X (1 - alpha Y / F)) = 2550 / (8 (1 - 10200 / 32768)) for the 64-chip page's FSDP x TP
    assert at_y4 == pytest.approx(2550 / (8 * (1 - 4 * 2550 / 32768)), rel=1e-3)
    # TP alone past M_Y F / alpha: no batch is enough
    assert fsdp_tp_min_batch_per_chip_at(v5p, 32768, tensor_ways=16) == math.inf
    # across slices the weights' term uses the data-centre network: alpha_DCN = C / W_dcn
    assert dcn_arithmetic_intensity(v5p) == pytest.approx(4.59e14 / 6.25e9)
    assert fsdp_tp_comm_to_compute(v5p, 1024, 32768, fsdp_over_dcn=True) == pytest.approx(4.59e14 / 6.25e9 / 1024)


def test_the_best_tensor_degree_gives_the_books_fsdp_tp_threshold():
    v5p = profile("v5p")
    alpha, mlp = ici_arithmetic_intensity(v5p), 32768
    best = mlp / (2 * alpha)  # Y = M_Y F / (2 alpha)
    book = fsdp_tp_min_batch_per_chip(v5p, mlp=mlp, fsdp_axes=2, tp_axes=1)
    assert fsdp_tp_min_batch_per_chip_at(v5p, mlp, best, fsdp_axes=2) == pytest.approx(book)
    assert all(fsdp_tp_min_batch_per_chip_at(v5p, mlp, y, fsdp_axes=2) > book for y in (2, 4, 8, 12))
