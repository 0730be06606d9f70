"""Pipeline parallelism: bubbles, step time, activations in flight.

P stages, m micro-batches, v chunks (virtual stages) per device, F and B the
forward and backward time of one micro-batch on one whole stage. A stage
idles while the pipeline fills and drains: the bubble, (P-1)(F+B)/v of the
step. More micro-batches shrink its share; the schedule decides the memory:
at its peak GPipe holds the activations of all m micro-batches, 1F1B of at
most P. Splitting the backward into its input- and weight-gradient halves
fills two thirds of the bubble when the three costs are equal (ZB-H1).

Sources: GPipe (Huang et al. 2019, Sec. 2.3); Megatron-LM (Narayanan et al.
2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", Sec. 2.2); PipeDream-Flush / 1F1B (Narayanan et al. 2021,
"Memory-Efficient Pipeline-Parallel DNN Training", Sec. 3.2); Zero Bubble
(Qi et al. 2024, Sec. 3.1); flow shops (Johnson 1954; Pinedo, "Scheduling",
2016, Sec. 6.1). The schedules themselves, and a simulator that checks every
formula here, are in `lab.parallel.pipeline.schedules`.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

from lab.errors import LabError


def _check_pipeline(stages: int, micro_batches: int, chunks: int = 1) -> None:
    for name, value in (("stages", stages), ("micro_batches", micro_batches), ("chunks", chunks)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise LabError(f"{name}={value!r}: a pipeline needs a positive whole number of {name.replace('_', '-')}")


def pipeline_bubble_fraction(stages: int, micro_batches: int, chunks: int = 1) -> float:
    """Idle share of the step, equal stages and costs: (P-1) / (v·m + P-1).

    v = 1 is GPipe (Huang et al. 2019, Sec. 2.3: bubble O((K-1)/(M+K-1)))
    and equally 1F1B: with F and B the same on every stage both take
    (m + P - 1)(F + B), since 1F1B only reorders each stage's work
    (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on
    GPU Clusters Using Megatron-LM", Sec. 2.2.1: "the bubble time is the same").
    Interleaving v chunks cuts the bubble *time* to (P-1)(F+B)/v (ibid.,
    Sec. 2.2.2), so of the whole step it is (P-1)/(v·m + P-1).
    """
    _check_pipeline(stages, micro_batches, chunks)
    return (stages - 1) / (chunks * micro_batches + stages - 1)


def pipeline_bubble_ratio(stages: int, micro_batches: int, chunks: int = 1) -> float:
    """Megatron-LM's bubble time over ideal time: (P-1) / (v·m) (Narayanan et al. 2021, Sec. 2.2)."""
    _check_pipeline(stages, micro_batches, chunks)
    return (stages - 1) / (chunks * micro_batches)


def pipeline_step_time(stages: int, micro_batches: int, forward: float, backward: float, chunks: int = 1) -> float:
    """m(F+B) + (P-1)(F+B)/v: the ideal work plus the bubble (equal stages; Narayanan et al. 2021, Sec. 2.2)."""
    _check_pipeline(stages, micro_batches, chunks)
    return (micro_batches + (stages - 1) / chunks) * (forward + backward)


def imbalanced_step_time(forward: Sequence[float], backward: Sequence[float], micro_batches: int) -> float:
    """GPipe with a time per stage: sum_s (F_s + B_s) + (m-1)(max_s F_s + max_s B_s).

    Each phase is a flow shop of m identical jobs through the stages in order,
    whose makespan is the sum of the stage times plus m-1 times the slowest
    one (Johnson 1954; Pinedo, "Scheduling", 2016, Sec. 6.1): the slowest
    stage sets the pace, the others wait for it.
    """
    _check_pipeline(len(forward), micro_batches)
    if len(forward) != len(backward):
        raise LabError(f"give one backward time per stage: {len(forward)} forward, {len(backward)} backward")
    return sum(forward) + sum(backward) + (micro_batches - 1) * (max(forward) + max(backward))


def zero_bubble_h1_step_time(
    stages: int, micro_batches: int, forward: float, input_grad: float, weight_grad: float
) -> float:
    """ZB-H1: m(F+I+W) + (P-1)(F+I-W), for m >= P (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", Sec. 3.1).

    I is the input-gradient half of the backward and W the weight-gradient
    half; 1F1B's bubble is (P-1)(F+I+W), so with F = I = W ZB-H1 keeps a third of it.
    """
    _check_pipeline(stages, micro_batches)
    if micro_batches < stages:
        raise LabError(
            f"the ZB-H1 formula assumes m >= P; got m={micro_batches}, P={stages} (simulate the schedule instead)"
        )
    return micro_batches * (forward + input_grad + weight_grad) + (stages - 1) * (forward + input_grad - weight_grad)


def peak_micro_batches_in_flight(
    schedule: str, stages: int, micro_batches: int, stage: int = 0, chunks: int = 1
) -> float:
    """Micro-batches whose activations stage `stage` holds at once, in units of one whole stage's activations.

    * gpipe: all m (every forward runs before the first backward);
    * 1f1b: min(P - s, m): P - 1 - s warm-up forwards plus the one in steady
      state (Narayanan et al. 2021, "Memory-Efficient Pipeline-Parallel DNN
      Training", Sec. 3.2): bounded by P, not m;
    * interleaved: device d warms up with 2(P-1-d) + (v-1)P chunk forwards
      (Megatron-LM's schedule), one more in steady state, each 1/v of a stage:
      min(m, P + (P-1-2d)/v): a little more than 1F1B;
    * zb-h1: P on every stage for m >= P (1F1B's P - s plus the s weight
      gradients held back).
    """
    _check_pipeline(stages, micro_batches, chunks)
    if not 0 <= stage < stages:
        raise LabError(f"stage {stage} is not one of the {stages} stages (0 to {stages - 1})")
    peaks = {
        "gpipe": lambda: float(micro_batches),
        "1f1b": lambda: float(min(stages - stage, micro_batches)),
        "interleaved": lambda: min(float(micro_batches), stages + (stages - 1 - 2 * stage) / chunks),
        "zb-h1": lambda: float(min(stages, micro_batches)),
    }
    if schedule not in peaks:
        raise LabError(f"unknown pipeline schedule {schedule!r}; use one of {', '.join(peaks)}")
    return peaks[schedule]()


def optimal_micro_batches(stages: int, work_s: float, overhead_s: float) -> float:
    """The m that minimises (m + P - 1)(W/m + c): m* = sqrt((P-1) W / c).

    Splitting a fixed batch whose forward and backward take W per stage into m
    micro-batches makes each tick W/m of work plus a fixed cost c (launch,
    send, bookkeeping), over m + P - 1 ticks per direction. More micro-batches
    shrink the bubble (the (P-1) W/m term) but pay c once more each (the m·c
    term); the two balance at m*. The same square root as the gradient-bucket
    optimum (`lab.theory.overlap.optimal_bucket_bytes`), from the same trade.
    """
    _check_pipeline(stages, 1)
    if work_s <= 0 or overhead_s <= 0:
        raise LabError("optimal_micro_batches needs a positive work time and a positive per-micro-batch overhead")
    return math.sqrt((stages - 1) * work_s / overhead_s)
