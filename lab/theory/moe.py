"""Mixture of experts: expert capacity, all-to-all traffic, the balance loss, dropped tokens.

An MoE layer with E experts split over an expert-parallel (EP) group of N
devices routes each token to k experts. Each device sends every token's k
copies to the devices that hold the chosen experts (dispatch) and receives
the results back (combine): two all-to-alls per layer in the forward pass.
Static shapes give every expert a buffer of C slots, its capacity; a token
routed to a full expert is dropped and skips the layer through the residual.

Sources: Switch Transformer (Fedus et al. 2021, arXiv:2101.03961, eq. 3 for
the capacity, eq. 4-6 for the load-balancing loss, Section 2.2 for
dropping); GShard (Lepikhin et al. 2020, arXiv:2006.16668, Algorithm 1) for
top-2 routing. The routing itself is in `lab.moe`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from lab.errors import LabError
from lab.theory.collectives import _check_count_and_size


def expert_capacity(tokens: int, experts: int, top_k: int, capacity_factor: float) -> int:
    """Slots in each expert's buffer for one group of `tokens`: ceil(tokens · k / E · capacity_factor).

    Switch Transformer (Fedus et al. 2021, arXiv:2101.03961, eq. 3): expert
    capacity = (tokens per batch / number of experts) · capacity factor, for
    k = 1; GShard (Lepikhin et al. 2020, arXiv:2006.16668, Algorithm 1) uses
    2·S/E for top-2, i.e. the k·S/E generalisation. The Switch example:
    4096 tokens, 64 experts, factor 1.25 -> 80 slots. Tokens beyond an
    expert's capacity are dropped (they skip the layer through the residual).
    """
    _check_moe(tokens, experts, top_k)
    if not capacity_factor > 0:
        raise LabError(
            f"capacity factor {capacity_factor}: must be > 0 (1.0 = exactly "
            "the mean load; use None in the layer for no dropping)"
        )
    return math.ceil(tokens * top_k / experts * capacity_factor)


@dataclass(frozen=True)
class AllToAllTraffic:
    """Elements one device's dispatch + combine move, for `tokens` tokens on that device.

    The quick reference's 2·B·L·d·k is `elements` summed over the EP group
    (B·L = all the group's tokens). A fraction (N-1)/N of it crosses devices
    when experts are chosen uniformly (a token's expert is local with
    probability 1/N). Static shapes pad each expert's buffer to its capacity
    C, so what an XLA all-to-all really carries is E·C·d per device and
    direction: `padded_elements`, larger by E·C / (tokens·k), about the
    capacity factor (E/k with no dropping, when C = tokens).
    """

    tokens: int
    d_model: int
    experts: int
    top_k: int
    devices: int
    capacity: int

    @property
    def elements(self) -> int:
        """2 · tokens · k · d: every routed copy goes out (dispatch) and comes back (combine)."""
        return 2 * self.tokens * self.top_k * self.d_model

    @property
    def padded_elements(self) -> int:
        """2 · E · C · d: the two all-to-all buffers as compiled, padded to capacity."""
        return 2 * self.experts * self.capacity * self.d_model

    @property
    def cross_device_fraction(self) -> float:
        """(N-1)/N: the share of an all-to-all buffer that leaves the device (nccl-tests' all-to-all factor)."""
        return (self.devices - 1) / self.devices

    @property
    def padding_factor(self) -> float:
        return self.padded_elements / self.elements


def moe_traffic(
    tokens: int, d_model: int, experts: int, top_k: int, devices: int, capacity_factor: float | None = None
) -> AllToAllTraffic:
    """Dispatch + combine traffic per device for `tokens` tokens per device on an EP group of `devices`.

    `capacity_factor=None` means no dropping: every expert's buffer must hold
    all of a device's tokens (C = tokens), since any expert may get them all.
    """
    _check_moe(tokens, experts, top_k)
    _check_count_and_size(devices, 0)
    if experts % devices:
        raise LabError(f"{experts} experts do not split over {devices} devices; use a multiple of {devices} experts")
    capacity = (
        tokens if capacity_factor is None else min(tokens, expert_capacity(tokens, experts, top_k, capacity_factor))
    )
    return AllToAllTraffic(tokens, d_model, experts, top_k, devices, capacity)


def switch_aux_loss_range(experts: int, alpha: float = 1.0) -> tuple[float, float]:
    """The Switch load-balancing loss α·N·Σ f_i·P_i at perfect balance and at full collapse: (α, α·N).

    Fedus et al. 2021, eq. 4-6: f_i is the share of tokens sent to expert i,
    P_i the router's mean probability for it. Balanced, f_i = P_i = 1/N and
    α·N·N·(1/N)² = α; collapsed onto one expert, f = P = 1 there and the loss
    is α·N. The sum Σ f_i·P_i alone runs from 1/N to 1 (the quick
    reference's numbers); the factor N keeps the balanced loss at α whatever
    the number of experts.
    """
    _check_moe(1, experts, 1)
    return alpha, alpha * experts


def dropped_share(loads: Sequence[float], capacity: float) -> float:
    """Share of routed assignments that find their expert full: Σ_i max(0, n_i - C) / Σ_i n_i.

    `loads` are the assignments each expert (or expert replica) receives from
    one group; C is its capacity (`expert_capacity`). Dropping is per expert:
    idle slots elsewhere do not absorb an overflow (Switch Transformer §2.2).
    """
    total = sum(loads)
    if total <= 0 or capacity < 0:
        raise LabError(
            f"dropped share needs a positive load and a capacity >= 0, got {total} assignments and capacity {capacity}"
        )
    return sum(max(0.0, n - capacity) for n in loads) / total


def capacity_factor_to_drop_nothing(max_load: float, tokens: int, experts: int, top_k: int) -> float:
    """The capacity factor at which the busiest expert fits: n_max · E / (tokens · k), inverting `expert_capacity`.

    A hot expert with a share h of the tokens (top-1) needs cf = h·E: every
    other expert's buffer grows with it, since capacity is one number for all.
    """
    _check_moe(tokens, experts, top_k)
    return max_load * experts / (tokens * top_k)


def _check_moe(tokens: int, experts: int, top_k: int) -> None:
    if experts < 1 or tokens < 1:
        raise LabError(f"an MoE layer needs at least one expert and one token, got {experts} experts, {tokens} tokens")
    if not 1 <= top_k <= experts:
        raise LabError(f"top-k {top_k} with {experts} experts: k must be between 1 and the number of experts")
