"""lab.theory.scaling: the compute-bound thresholds of the scaling book, Part 5."""

import math

import pytest

from lab.hardware import profile
from lab.theory.scaling import (
    data_parallel_min_batch_per_chip,
    fsdp_tp_min_batch_per_chip,
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
