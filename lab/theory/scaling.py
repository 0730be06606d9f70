"""When sharded training stays compute-bound: the scaling book's thresholds.

Source: "How to Scale Your Model" (the scaling book), Part 5 "How to
Parallelize a Transformer for Training" (jax-ml/scaling-book training.md).
A sharding strategy is compute-bound while each chip's matmul FLOPs take
longer than the bytes it must exchange for them. The ratio that decides it
is alpha = C / W_ici, the chip's FLOPs per byte of bidirectional ICI
bandwidth on one torus axis (2550 on TPU v5p); M_X, M_Y count the torus
axes a mesh axis spans, each adding its links. Data parallelism needs
enough tokens per chip; tensor parallelism is capped by the MLP width F;
FSDP x TP combines both, and has an optimal split.
"""

from __future__ import annotations

import math

from lab.errors import LabError
from lab.targets.hardware import ChipProfile


def ici_arithmetic_intensity(chip: ChipProfile) -> float:
    """alpha = C / W_ici, with W_ici = both directions of one axis's link (v5p: 4.59e14 / 1.8e11 = 2550)."""
    return chip.peak_bf16_flops / (2 * chip.link_bandwidth)


def data_parallel_min_batch_per_chip(chip: ChipProfile, axes_spanned: int = 1) -> float:
    """DP and FSDP are compute-bound while tokens per chip B/N > alpha / M_X (v5p, 3 axes: 850)."""
    return ici_arithmetic_intensity(chip) / axes_spanned


def tensor_parallel_max_ways(chip: ChipProfile, mlp: int, axes_spanned: int = 1) -> float:
    """Tensor parallelism over Y chips stays compute-bound while Y < M_Y * F / alpha."""
    return axes_spanned * mlp / ici_arithmetic_intensity(chip)


def fsdp_tp_min_batch_per_chip(chip: ChipProfile, mlp: int, fsdp_axes: int, tp_axes: int) -> float:
    """FSDP x TP is compute-bound while B/N > 4 alpha^2 / (M_X M_Y F) (about 400 tokens for F = 32k on v5p).

    Earlier versions of the book wrote alpha^2 / (M_X M_Y F); the current one
    carries the factor 4 from counting both the forward and backward gathers.
    """
    alpha = ici_arithmetic_intensity(chip)
    return 4 * alpha**2 / (fsdp_axes * tp_axes * mlp)


def fsdp_tp_optimal_fsdp_ways(batch_tokens: float, mlp: int, chips: int, fsdp_axes: int = 1, tp_axes: int = 1) -> float:
    """The FSDP degree that minimises communication: X_opt = sqrt((B / F) (M_X / M_Y) N)."""
    return math.sqrt(batch_tokens / mlp * fsdp_axes / tp_axes * chips)


def dcn_arithmetic_intensity(chip: ChipProfile) -> float:
    """alpha_DCN = C / W_dcn: FLOPs per byte of one chip's share of the data-centre network (v5p: 73440)."""
    if not chip.dcn_bandwidth:
        raise LabError(f"{chip.name} has no data-centre network")
    return chip.peak_bf16_flops / chip.dcn_bandwidth


def fsdp_tp_comm_to_compute(
    chip: ChipProfile,
    batch_per_chip: float,
    mlp: int,
    *,
    tensor_ways: int = 1,
    fsdp_axes: float = 1,
    tp_axes: float = 1,
    fsdp_over_dcn: bool = False,
) -> float:
    """Communication over compute of an MLP layer under FSDP (or data parallelism) x TP over Y = `tensor_ways`.

    The book's accounting (Part 5), per pass over a layer of B tokens on N = X·Y chips: the weights cost
    4DF / (Y·W·M_X), the activations 4BD / (X·W·M_Y), the matmuls 4BDF / (N·C), so

        T_comm / T_math = alpha_X / (Y · M_X · B/N) + alpha · Y / (M_Y · F)

    with alpha_X = alpha over ICI and alpha_DCN (M_X = 1) when the FSDP axis crosses slices. Y = 1 is pure FSDP:
    alpha / (M_X · B/N), compute-bound above `data_parallel_min_batch_per_chip`. Below 1: compute-bound.
    """
    alpha = ici_arithmetic_intensity(chip)
    weights = (dcn_arithmetic_intensity(chip) if fsdp_over_dcn else alpha / fsdp_axes) / (tensor_ways * batch_per_chip)
    activations = alpha * tensor_ways / (tp_axes * mlp) if tensor_ways > 1 else 0.0
    return weights + activations


def fsdp_tp_min_batch_per_chip_at(
    chip: ChipProfile, mlp: int, tensor_ways: int, fsdp_axes: float = 1, tp_axes: float = 1
) -> float:
    """Tokens per chip above which FSDP x TP over exactly Y = `tensor_ways` chips is compute-bound (ICI):
    B/N > alpha / (Y M_X (1 - alpha Y / (M_Y F))), infinite where TP alone is communication-bound (Y >= M_Y F / alpha).

    Its minimum over Y, at Y = M_Y F / (2 alpha), is `fsdp_tp_min_batch_per_chip`.
    """
    alpha = ici_arithmetic_intensity(chip)
    left = 1 - alpha * tensor_ways / (tp_axes * mlp) if tensor_ways > 1 else 1.0
    return math.inf if left <= 0 else alpha / (tensor_ways * fsdp_axes * left)
