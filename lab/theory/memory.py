"""Memory per device: ZeRO's model states and data-parallel traffic, activations under TP and SP.

ZeRO: Rajbhandari, Rasley, Ruwase & He (2020), "ZeRO: Memory Optimizations
Toward Training Trillion Parameter Models", SC20, arXiv:1910.02054 (the ZeRO
paper). Mixed-precision Adam keeps three model states per parameter:
parameters, gradients and optimizer state; each ZeRO stage partitions one
more of them over the N data-parallel devices (Section 5, Figure 1), and
pays for it in collectives per step (Section 7), counted here as nccl-tests
sizes S and turned into bytes on the wire with the busbw factors of
`lab.theory.collectives`.

Activations: Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models" (arXiv:2205.05198), Section 4, eqs. (1)-(3). Bytes
kept for the backward pass by one transformer layer, 16-bit activations: s
sequence, b micro-batch, h hidden, a heads, t tensor-parallel ways. The 34
is attention 11sbh + MLP 19sbh + two layer norms 4sbh; 5as^2b is the softmax
output (2), its dropout mask (1) and dropout output (2). Without dropout the
three sbh-sized masks-and-outputs vanish: 34 -> 32 (mask bytes sbh in
attention and in the MLP) and 5 -> 2, and TP's unsplit 10 -> 8.
"""

from __future__ import annotations

from dataclasses import dataclass

from lab.errors import LabError
from lab.theory.collectives import _check_count_and_size, bus_bandwidth_factor

ZERO_STAGES = (0, 1, 2, 3)  # 0 is plain data parallelism (DDP)


@dataclass(frozen=True)
class ModelStateBytes:
    """Bytes per device of the three model states ZeRO partitions."""

    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


def zero_model_states(
    stage: int,
    parameters: float,
    devices: int,
    *,
    param_bytes: float = 2,
    grad_bytes: float = 2,
    optimizer_bytes: float = 12,
) -> ModelStateBytes:
    """Model-state memory per device under ZeRO stage 0-3 (ZeRO paper, Section 5 and Figure 1).

    Mixed-precision Adam keeps bf16/fp16 parameters and gradients (2Ψ + 2Ψ
    bytes) and K = 12 bytes per parameter of optimizer state (fp32 master
    weights, momentum, variance). Each stage divides one more term by the
    data-parallel degree N:
        stage 0: (2 + 2 + K) Ψ          stage 1: 2Ψ + 2Ψ + KΨ/N
        stage 2: 2Ψ + (2 + K) Ψ/N       stage 3: (2 + 2 + K) Ψ/N
    """
    if stage not in ZERO_STAGES:
        raise LabError(f"ZeRO stage {stage!r}: use 0 (DDP), 1, 2 or 3")
    _check_count_and_size(devices, parameters)
    shard = 1 / devices
    return ModelStateBytes(
        params=param_bytes * parameters * (shard if stage >= 3 else 1.0),
        grads=grad_bytes * parameters * (shard if stage >= 2 else 1.0),
        optimizer=optimizer_bytes * parameters * (shard if stage >= 1 else 1.0),
    )


def zero_step_collectives(stage: int, model_bytes: float, *, regathered_bytes: float | None = None) -> dict[str, float]:
    """S (nccl-tests size) moved per step by each collective kind, for a model of `model_bytes`.

    ZeRO paper, Section 7: data parallelism all-reduces the gradients (S = Ψ);
    stages 1 and 2 reduce-scatter the gradients and all-gather the updated
    parameters (the two halves of that all-reduce: the same volume, 7.2.1);
    stage 3 all-gathers the parameters before the forward pass and again before
    the backward pass, and reduce-scatters the gradients (7.2.2). Whatever is
    kept gathered from forward to backward (`regathered_bytes` smaller than
    `model_bytes`; 0 for PyTorch FSDP's reshard_after_forward=False) is not
    gathered twice.
    """
    if stage not in ZERO_STAGES:
        raise LabError(f"ZeRO stage {stage!r}: use 0 (DDP), 1, 2 or 3")
    if stage == 0:
        return {"all-reduce": model_bytes}
    if stage in (1, 2):
        return {"reduce-scatter": model_bytes, "all-gather": model_bytes}
    regathered = model_bytes if regathered_bytes is None else regathered_bytes
    return {"all-gather": model_bytes + regathered, "reduce-scatter": model_bytes}


def step_wire_bytes(collectives: dict[str, float], devices: int) -> float:
    """Bytes each device sends per step on a ring: sum of S * busbw factor (2(N-1)/N for all-reduce, (N-1)/N else).

    With it, DDP sends 2(N-1)/N Ψ and ZeRO-3 with the backward re-gather
    3(N-1)/N Ψ: 1.5x, the ZeRO paper's "3Ψ versus 2Ψ" (7.2.2), where the
    textbook pairing all-reduce = reduce-scatter + all-gather gives "the same 2Ψ".
    """
    return sum(size * bus_bandwidth_factor(kind, devices) for kind, size in collectives.items())


def activation_bytes_per_layer(
    seq: int,
    batch: int,
    hidden: int,
    heads: int,
    tensor: int = 1,
    *,
    sequence_parallel: bool = False,
    dropout: bool = True,
) -> float:
    """Korthikanti et al. 2022: sbh(34 + 5as/h) alone, sbh(10 + 24/t + 5as/(ht)) with TP, sbh(34 + 5as/h)/t with TP+SP.

    With TP alone the 10sbh of the layer norms, the inputs of the first
    matmuls and the dropout masks stay whole on every device; SP splits them
    along the sequence too, so everything is divided by t.
    """
    if min(seq, batch, hidden, heads, tensor) < 1:
        raise LabError(
            f"activation memory needs positive sizes, got s={seq}, b={batch}, h={hidden}, a={heads}, t={tensor}"
        )
    whole, split, attention = (10, 24, 5) if dropout else (8, 24, 2)
    sbh = seq * batch * hidden
    if sequence_parallel:
        return sbh * (whole + split + attention * heads * seq / hidden) / tensor
    return sbh * (whole + split / tensor + attention * heads * seq / (hidden * tensor))
