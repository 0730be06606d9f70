"""Closed-form costs: what theory says a distributed program should cost.

Every formula cites its source and is tested against the source's own
numbers (tests/theory/). One module per topic; each module's docstring
teaches it:

- `collectives`: the alpha-beta model of collectives (Hockney; Thakur,
  Rabenseifner & Gropp), nccl-tests' algbw and busbw, and the size at which
  a few-step algorithm stops beating a bandwidth-optimal one.
- `network`: the same collectives on a chip's network, after the scaling
  book, Part 3 (a TPU torus axis) and Part 12 (NVLink, DCN).
- `memory`: ZeRO's model states and data-parallel traffic per stage (the ZeRO
  paper); activation memory under tensor and sequence parallelism
  (Korthikanti et al. 2022).
- `moe`: expert capacity, dispatch and combine traffic, the Switch balance
  loss, dropped tokens (Switch Transformer, GShard).
- `overlap`: communication overlapped with compute, collective matmuls, and
  gradient buckets (PyTorch DDP).
- `pipeline`: bubbles, step time and activations in flight for GPipe, 1F1B,
  interleaved and zero-bubble schedules.
- `scaling`: when data, tensor and FSDP x TP parallelism stay compute-bound
  (the scaling book, Part 5).

Every public name is re-exported here, so `from lab import theory;
theory.collective_cost(...)` and `from lab.theory import collective_cost`
work as well as the module paths.
"""

from lab.theory.collectives import ALPHA_BETA_KINDS as ALPHA_BETA_KINDS
from lab.theory.collectives import CollectiveCost as CollectiveCost
from lab.theory.collectives import algorithm_bandwidth as algorithm_bandwidth
from lab.theory.collectives import algorithms_for as algorithms_for
from lab.theory.collectives import bus_bandwidth as bus_bandwidth
from lab.theory.collectives import bus_bandwidth_factor as bus_bandwidth_factor
from lab.theory.collectives import collective_cost as collective_cost
from lab.theory.collectives import crossover_bytes as crossover_bytes
from lab.theory.memory import ZERO_STAGES as ZERO_STAGES
from lab.theory.memory import ModelStateBytes as ModelStateBytes
from lab.theory.memory import activation_bytes_per_layer as activation_bytes_per_layer
from lab.theory.memory import step_wire_bytes as step_wire_bytes
from lab.theory.memory import zero_model_states as zero_model_states
from lab.theory.memory import zero_step_collectives as zero_step_collectives
from lab.theory.moe import AllToAllTraffic as AllToAllTraffic
from lab.theory.moe import capacity_factor_to_drop_nothing as capacity_factor_to_drop_nothing
from lab.theory.moe import dropped_share as dropped_share
from lab.theory.moe import expert_capacity as expert_capacity
from lab.theory.moe import moe_traffic as moe_traffic
from lab.theory.moe import switch_aux_loss_range as switch_aux_loss_range
from lab.theory.network import predict_on_rings as predict_on_rings
from lab.theory.network import predict_on_switch as predict_on_switch
from lab.theory.network import predict_on_torus as predict_on_torus
from lab.theory.overlap import BucketedTime as BucketedTime
from lab.theory.overlap import OverlapTime as OverlapTime
from lab.theory.overlap import bucket_count as bucket_count
from lab.theory.overlap import bucketed_allreduce_time as bucketed_allreduce_time
from lab.theory.overlap import collective_matmul_time as collective_matmul_time
from lab.theory.overlap import optimal_bucket_bytes as optimal_bucket_bytes
from lab.theory.overlap import overlap_time as overlap_time
from lab.theory.pipeline import imbalanced_step_time as imbalanced_step_time
from lab.theory.pipeline import optimal_micro_batches as optimal_micro_batches
from lab.theory.pipeline import peak_micro_batches_in_flight as peak_micro_batches_in_flight
from lab.theory.pipeline import pipeline_bubble_fraction as pipeline_bubble_fraction
from lab.theory.pipeline import pipeline_bubble_ratio as pipeline_bubble_ratio
from lab.theory.pipeline import pipeline_step_time as pipeline_step_time
from lab.theory.pipeline import zero_bubble_h1_step_time as zero_bubble_h1_step_time
from lab.theory.scaling import data_parallel_min_batch_per_chip as data_parallel_min_batch_per_chip
from lab.theory.scaling import fsdp_tp_min_batch_per_chip as fsdp_tp_min_batch_per_chip
from lab.theory.scaling import fsdp_tp_optimal_fsdp_ways as fsdp_tp_optimal_fsdp_ways
from lab.theory.scaling import ici_arithmetic_intensity as ici_arithmetic_intensity
from lab.theory.scaling import tensor_parallel_max_ways as tensor_parallel_max_ways
