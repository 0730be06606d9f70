"""The attention's price when XLA's dot-product attention stands for a flash kernel.

On GPU the lab compiles XLA's attention, whose [.., S, S] scores go through
HBM, where published runs use cuDNN's flash attention (and on TPU a user may
ask for ``--attention xla``). The difference is priced, not fitted: the
seconds of the step's ops on an S x S array (`lab.predict.ops.score_ops`)
beside a FlashAttention-2 kernel's matmul FLOPs at the same matmul
efficiency, and the step with the one replaced by the other.
"""

from __future__ import annotations

import math

from lab.predict.ops import score_ops

FLASH_UNITS = 14  # matmul FLOPs per b·h·S·S·K of FlashAttention-2: forward 4 (QK^T, PV), backward 10 (QK^T again,
# dV, dP, dQ, dK) (Dao 2023, FlashAttention-2, section 3.1); a remat that does not save the kernel's output
# (all but minimal_flash and none) runs its forward once more
FLASH_BLOCK_Q = 128  # the query block whose causal tiles above the diagonal a flash kernel skips


def flash_seconds(config, batch_per_device: int, remat: str, peak_flops: float, matmul_efficiency: float) -> float:
    """A flash kernel's time per step on one device: its matmul FLOPs at the matmul efficiency, masked tiles skipped.

    A device holds batch per device x heads (b, h) pairs whatever the layout (tensor splits heads, the batch axes
    split sequences); each costs FLASH_UNITS · S² · K times the share of the n x n tiles the mask leaves live:
    (n + 1) / 2n under a causal diagonal, fewer under a sliding window (`_live_tiles`).
    """
    s, blocks = config.seq, max(1, math.ceil(config.seq / FLASH_BLOCK_Q))
    units = FLASH_UNITS + (0 if remat in ("minimal_flash", "none") else 4)  # the others do not save its output
    tile = units * batch_per_device * config.heads * s * s * config.head_dim / blocks**2
    return tile * _layer_tiles(config, blocks) / (peak_flops * matmul_efficiency)


def _layer_tiles(config, blocks: int) -> int:
    """Live tiles summed over the layers: a windowed layer's query block reaches its own key block and the
    ceil((window - 1) / block) before it; a global (or unwindowed) layer's every block up to the diagonal."""
    if not config.window:
        return config.layers * _live_tiles(blocks, blocks)
    reach = 1 + math.ceil((config.window - 1) / FLASH_BLOCK_Q)
    periods = config.layers // config.period  # a windowed model has no dense prefix (lab.model refuses one)
    return periods * sum(_live_tiles(blocks, reach if window else blocks) for _, window in config.layer_pattern)


def _live_tiles(blocks: int, reach: int) -> int:
    """Tiles of a blocks x blocks causal grid computed when query block i reaches back `reach` key blocks."""
    return sum(min(i + 1, reach) for i in range(blocks))


def attention_terms(read, step, config, batch_per_device: int, remat: str, chip, efficiency) -> tuple[float, float]:
    """XLA attention's seconds in `step` (its ops on an [.., S, S] array, `lab.predict.ops.score_ops`) and a flash
    kernel's estimate of the same attention at the same matmul efficiency; (0, 0) when flash was compiled.
    `step.step_s` - the first + the second is the step with a flash kernel (`Prediction.step_with_flash_s`)."""
    if config.attention != "xla":
        return 0.0, 0.0
    heads = config.heads // dict(read.mesh.shape).get("tensor", 1)  # the tensor axis splits them
    xla_s = sum(op.seconds for op in score_ops(read, step, config.seq, heads))
    return xla_s, flash_seconds(config, batch_per_device, remat, chip.peak_bf16_flops, efficiency.matmul)
