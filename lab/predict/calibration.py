"""The efficiency constants of a prediction, and the published runs that set them.

The op-by-op model (`lab.predict.ops`) needs two numbers the chip profiles
(`lab.targets.hardware`) do not have: what fraction of the peak bf16 FLOP/s a large
matmul fusion reaches, and what fraction of the HBM bandwidth a memory-bound
fusion reaches. They are the chip's, not a run's: one value per TPU
generation, used for every model, batch and layout.

They may be calibrated on at most two published measurements; these are
MaxText's Trillium (v6e-256) recipes, whose logs print measured step times:

* Llama 3.1 8B, per-device batch 4, sequence 8192, ``ici_fsdp_parallelism=-1``
  (FSDP over all 256 chips), flash attention, remat ``custom`` (layer input
  and Q/K/V/out projections offloaded to host): ``completed step: 14,
  seconds: 4.546, TFLOP/s/device: 417.397``;
* Llama 3.1 70B, per-device batch 5, the same layout and attention, remat
  ``custom`` (layer input and Q/K/V offloaded): ``seconds: 42.656,
  TFLOP/s/device: 462.297``;
* Mixtral 8x7B (MoE, 8 experts, top-2, capacity factor 1.25), per-device batch 12,
  sequence 4096, the same layout: ``seconds: 13.484, TFLOP/s/device: 302.311``.

Each compiled with the libtpu flags its recipe names (`PublishedRun.flags`): MaxText's
groups DENSE_VMEM_LIMIT, LAYOUT_FOR_ALL_REDUCE_SCATTER, DATA_PARALLEL_OVERLAP,
CF_FOR_ALL_GATHER and HOST_OFFLOAD_FLAGS (the 8B also SparseCore all-reduce
offload; Mixtral MOE_VMEM_LIMIT, CF_FOR_ALL_GATHER, DATA_PARALLEL_OVERLAP) from
``benchmarks/xla_flags_library.py``. They change the schedule, not the FLOPs:
HOST_OFFLOAD_FLAGS lets 24 host transfers overlap and reruns the latency-hiding
scheduler. Compiled without them (XLA's defaults), the 8B's transfers and
gathers wait longer, that wait was absorbed into a v6e efficiency of 0.8861,
and the held-out 70B came out 15.6% fast; with them the 8B solves 0.7170 (and
TPU7x's recipe, compiled with its flags, 0.6872).

The recipes' host offload is compiled as they name it (``--remat offload:<names>``)
and its DMAs priced on the chip's PCIe links (`lab.predict.ops`): the 8B moves
about 30 GB per chip each way a step, which at v6e's 32 GB/s does not all hide
behind compute. What still differs from those runs is shown on the page rather
than fitted away: the embedding is a one-hot matmul (MaxText gathers), and the
loss runs in chunks.

The rule used here: the matmul efficiency is set from the 8B run alone (the
smaller compile of the two dense runs); the HBM efficiency is not fitted at all
but assumed; the 70B and Mixtral runs are then predictions, held
against their published times.

v5e, v5p, v4 and TPU7x (Ironwood) have their own constants, each solved from
the one published run of its generation in the development set
(`GENERATION_RUNS`: MaxText's 2023 tables, and the Ironwood table's Llama 3.1
70B compiled with its recipe's remat and flags; results/published_runs), after
that run was first predicted with v6e's constant (held out: how far a constant
carries across chips). v5p's run (remat ``minimal``) could set none while the
lab's ``minimal`` saved every dot's output, its norms' scale einsums among them:
the program then needed 114 GiB of the chip's 95, XLA's rematerialization pass
recomputed the MLP's matmuls to fit, and the step with every matmul at the peak
(10.07 s) was longer than the published 10.03 s. Compiled as MaxText's ``minimal``
(the dots without batch dimensions) it fits in 89 GiB; it solved 0.8311 with
libtpu's synchronous in-loop ``%all-reduce-scatter`` fusions priced once a step,
0.8892 priced once a layer (`lab.hlo.schedule`).

NVIDIA H100 has its own, from MaxText's Llama 2 7B on one node of 8 H100s
(NVIDIA's JAX-Toolbox table: 0.721 s), solved the same way with XLA's
attention priced as the cuDNN flash kernel the run used
(`lab.predict.attention.flash_seconds`); the same model on 32 nodes (Google
Cloud's gpu-recipes log: 1.500 s) is held out. Both are compiled with their
sources' XLA_FLAGS: among them the rematerialization pass off (without it,
XLA recomputed 16% more FLOPs to fit the lab's program, over HBM with XLA's
attention, and that work was absorbed into a constant of 0.6551, the held-out
run then 12.6% fast) and Triton GEMMs off (cuBLAS custom calls, read by
`lab.predict.ops`). And with their recipes' remat, ``minimal_flash`` (the
weight matmuls' outputs and the attention's output saved): the one-node
program fits in 50 GiB, its FSDP gathers hidden (0.006 s exposed). Saving
every dot's output, XLA's scores among them, it needed 117 GiB, its schedule
left 0.104 s of gathers exposed, and that wait was absorbed into a constant of
0.5255; then 0.4145, while the ops priced away for the flash kernel
(`lab.predict.ops.score_ops`) included the projections' matmuls (the width,
4096, equals the sequence): 0.26 s, which the constant made up for. Now
0.5934, the 32-node run +8.5%. Other GPUs borrow H100's.

Every one of these programs casts each weight's shard to bf16 before its FSDP
gather (`lab.parallel.layout.Layout.use`), as MaxText's layers do, and its chunked
loss gathers the unembedding once for all chunks and reduces its gradient once.
Until then its programs moved fp32, twice the bytes, mostly exposed, and the
constants absorbed that wait: v6e 0.7406, v5e 0.9639, v5p 0.8250, v4 0.8538, TPU7x
0.7335, H100 0.4292.
"""

from __future__ import annotations

from dataclasses import dataclass

from lab.errors import LabError
from lab.predict.ops import Efficiency, ReadSchedule
from lab.targets.gpu import SPECS

TPU_RECIPES = "AI-Hypercomputer/tpu-recipes"
MAXTEXT = "AI-Hypercomputer/maxtext"


@dataclass(frozen=True)
class PublishedRun:
    """A measured step, where it was published, and the configuration the recipe gives."""

    name: str
    preset: str
    topology: str  # one slice, tpu:<gen>:<topology>
    slices: int
    batch_per_device: int
    seq: int
    mesh: str
    remat: str  # the recipe's policy, as published
    attention: str
    libtpu_flags: str  # the names of MaxText's flag groups
    step_s: float
    tflops_per_device: float
    source: str  # repository, file and commit
    compiled_remat: str = "full"  # the recipe's policy as the lab writes it (lab.predict.step.layout_remat)
    compiled_attention: str = "flash"
    sequence_parallel: bool = False  # the residual stream split over tensor between sub-layers (see MAXTEXT_64B_V5P)
    flags: str = ""  # the run's compiler flags (LIBTPU_INIT_ARGS on TPU, XLA_FLAGS on GPU), passed as it got them
    differs: str = ""  # what the lab's program does not do the run's way, beside the remat and attention
    causal_flops: bool = False  # MaxText's formula of the day halved the attention for causality (from 2023-11-29)


# MaxText's libtpu flag groups (benchmarks/xla_flags_library.py, `XLA_FLAGS_SOURCE`), as the Trillium recipes name them
DENSE_VMEM_LIMIT = "--xla_tpu_scoped_vmem_limit_kib=98304"
MOE_VMEM_LIMIT = "--xla_tpu_scoped_vmem_limit_kib=81920"
LAYOUT_FOR_ALL_REDUCE_SCATTER = (
    "--xla_tpu_use_minor_sharding_for_major_trivial_input=true "
    "--xla_tpu_relayout_group_size_threshold_for_reduce_scatter=1 --xla_tpu_assign_all_reduce_scatter_layout=true"
)
DATA_PARALLEL_OVERLAP = (
    "--xla_tpu_enable_data_parallel_all_reduce_opt=true --xla_tpu_data_parallel_opt_different_sized_ops=true"
)
CF_FOR_ALL_GATHER = (
    "--xla_tpu_enable_async_collective_fusion=true --xla_tpu_enable_async_collective_fusion_fuse_all_gather=true "
    "--xla_tpu_enable_async_collective_fusion_multiple_steps=true --xla_tpu_overlap_compute_collective_tc=true "
    "--xla_enable_async_all_gather=true"
)
# ENABLE_SPARSECORE_OFFLOADING_FOR_ALL_REDUCE, less its build-specific --2a886c8_chip_config_name=megachip_tccontrol,
# which today's libtpu does not know (lab.targets.libtpu refuses it)
SPARSECORE_ALL_REDUCE = (
    "--xla_tpu_enable_async_collective_fusion_fuse_all_reduce=false "
    "--xla_tpu_enable_sparse_core_collective_offload_all_reduce=true --xla_tpu_enable_all_reduce_offload_tracing=true "
    "--xla_tpu_use_tc_device_shape_on_sc=true --xla_sc_enable_instruction_fusion=false --xla_sc_disjoint_spmem=false "
    "--xla_sc_disable_megacore_partitioning=true"
)
HOST_OFFLOAD_FLAGS = (
    "--xla_tpu_enable_all_experimental_scheduler_features=true "
    "--xla_tpu_enable_scheduler_memory_pressure_tracking=true --xla_tpu_host_transfer_overlap_limit=24 "
    "--xla_tpu_aggressive_opt_barrier_removal=ENABLED --xla_lhs_prioritize_async_depth_over_stall=ENABLED "
    "--xla_tpu_enable_ag_backward_pipelining=true --xla_should_allow_loop_variant_parameter_in_chain=ENABLED "
    "--xla_should_add_loop_invariant_op_in_chain=ENABLED --xla_max_concurrent_host_send_recv=100 "
    "--xla_tpu_scheduler_percent_shared_memory_limit=100 --xla_latency_hiding_scheduler_rerun=2"
)
# the groups both dense Trillium recipes name first
TRILLIUM_DENSE = (DENSE_VMEM_LIMIT, LAYOUT_FOR_ALL_REDUCE_SCATTER, DATA_PARALLEL_OVERLAP, CF_FOR_ALL_GATHER)

# the Trillium recipes' custom policies, by MaxText's names: these activations go to host memory, the rest is recomputed
OFFLOAD_QKVO = "offload:decoder_layer_input,query_proj,key_proj,value_proj,out_proj"
OFFLOAD_QKV = "offload:decoder_layer_input,query_proj,key_proj,value_proj"

LLAMA31_8B = PublishedRun(
    name="Llama 3.1 8B on v6e-256",
    preset="llama3.1-8b",
    topology="v6e:16x16",
    slices=1,
    batch_per_device=4,
    seq=8192,
    mesh="fsdp=256",
    remat="custom: decoder_layer_input, query/key/value/out_proj offloaded to host",
    attention="flash (splash, blocks 2048)",
    libtpu_flags="DENSE_VMEM_LIMIT + LAYOUT_FOR_ALL_REDUCE_SCATTER + DATA_PARALLEL_OVERLAP + CF_FOR_ALL_GATHER "
    "+ ENABLE_SPARSECORE_OFFLOADING_FOR_ALL_REDUCE + HOST_OFFLOAD_FLAGS",
    step_s=4.546,
    tflops_per_device=417.397,
    source=f"{TPU_RECIPES} training/trillium/Llama3.1-8B-MaxText/v6e-256/README.md "
    "@a9e09290174425595a0ef6ec5f765d5f04360423 (config: MaxText@tpu-recipes-v0.1.4, "
    "benchmarks/maxtext_trillium_model_configs.py @9f1820b472ef362e7b5c782fe1d6fda8a0943eff)",
    compiled_remat=OFFLOAD_QKVO,
    flags=" ".join((*TRILLIUM_DENSE, SPARSECORE_ALL_REDUCE, HOST_OFFLOAD_FLAGS)),
    differs="the recipe's SparseCore all-reduce flags less one build-specific flag today's libtpu does not know "
    "(--2a886c8_chip_config_name=megachip_tccontrol)",
)

LLAMA31_70B = PublishedRun(
    name="Llama 3.1 70B on v6e-256",
    preset="llama3.1-70b",
    topology="v6e:16x16",
    slices=1,
    batch_per_device=5,
    seq=8192,
    mesh="fsdp=256",
    remat="custom: decoder_layer_input, query/key/value_proj offloaded to host",
    attention="flash (splash, blocks 2048)",
    libtpu_flags="DENSE_VMEM_LIMIT + LAYOUT_FOR_ALL_REDUCE_SCATTER + DATA_PARALLEL_OVERLAP + CF_FOR_ALL_GATHER "
    "+ HOST_OFFLOAD_FLAGS",
    step_s=42.656,
    tflops_per_device=462.297,
    source=f"{TPU_RECIPES} training/trillium/Llama3.1-70B-MaxText/v6e-256/README.md "
    "@3596002ad03c04ae20d5f04c711e8a1d2557b7f8 (config: MaxText@tpu-recipes-v0.1.4, "
    "benchmarks/maxtext_trillium_model_configs.py @9f1820b472ef362e7b5c782fe1d6fda8a0943eff)",
    compiled_remat=OFFLOAD_QKV,
    flags=" ".join((*TRILLIUM_DENSE, HOST_OFFLOAD_FLAGS)),
)
MIXTRAL_8X7B = PublishedRun(
    name="Mixtral 8x7B on v6e-256",
    preset="mixtral-8x7b",
    topology="v6e:16x16",
    slices=1,
    batch_per_device=12,
    seq=4096,
    mesh="fsdp=256",
    remat="custom: decoder_layer_input, query/key/value/out_proj offloaded to host",
    attention="flash (splash, query blocks 2048); experts dropped at capacity factor 1.25, no megablox, "
    "no sparse matmul (MaxText's dense one-hot dispatch)",
    libtpu_flags="MOE_VMEM_LIMIT + CF_FOR_ALL_GATHER + DATA_PARALLEL_OVERLAP",
    step_s=13.484,
    tflops_per_device=302.311,
    source=f"{TPU_RECIPES} training/trillium/Mixtral-8x7B-MaxText/README.md "
    "@c8cfe2f689081d36701a101cd73a70965d80926b (log: completed step: 11, seconds: 13.484, TFLOP/s/device: 302.311; "
    f"config: {MAXTEXT} benchmarks/maxtext_trillium_model_configs.py mixtral_8x7b_dropped "
    "@14b5876ea857c09cc3d8645385f984689376a331)",
    compiled_remat=OFFLOAD_QKVO,
    flags=" ".join((MOE_VMEM_LIMIT, CF_FOR_ALL_GATHER, DATA_PARALLEL_OVERLAP)),
)
PUBLISHED = (LLAMA31_8B, LLAMA31_70B, MIXTRAL_8X7B)

# One run per other TPU generation, MaxText's 2023 tables (the model family of then: ReLU MLP, tied embeddings,
# head_dim 256). Each sets its generation's matmul efficiency, and is first predicted with v6e's (held out: how far
# a constant carries across chips).
MT2023 = "vocab=32768,heads=32,head_dim=256,mlp=relu,tied=true"
_V5E_FLAGS = f"{DATA_PARALLEL_OVERLAP} {CF_FOR_ALL_GATHER}"  # the 32b.sh script's seven
MAXTEXT_32B_V5E = PublishedRun(
    name="MaxText 32B on v5e-256",
    preset=f"layers=32,d_model=10240,d_ff=32768,{MT2023},block=parallel,qk_norm=true",
    topology="v5e:16x16",
    slices=1,
    batch_per_device=4,
    seq=2048,
    mesh="fsdp=256",
    remat="full",
    attention="flash",
    libtpu_flags="the 32b.sh script's seven (async collective fusion, data-parallel all-reduce opt)",
    step_s=12.5467,  # published 132 TFLOP/s per chip; 1652.585 TFLOP per chip a step by MaxText's formula then
    tflops_per_device=132.0,
    source=f"{MAXTEXT} MaxText/configs/v5e/README.md @76bd53b0f44caf989c88189afadeb1062f9254f0 (32B row: "
    "132 TFLOP/s/chip, MFU 66.86%; config MaxText/configs/largest_job/32b.sh "
    "@5ebcd67fe65334234b116b1453c23920480e4d78)",
    flags=_V5E_FLAGS,
    differs="T5 relative-position bias on the attention logits (the lab: rotary); q/k LayerNorm (the lab: RMSNorm)",
)
MAXTEXT_64B_V5P = PublishedRun(
    name="MaxText 64B on v5p-128",
    preset=f"layers=64,d_model=10240,d_ff=32768,{MT2023},block=parallel,qk_norm=true",
    topology="v5p:4x4x4",
    slices=1,
    batch_per_device=4,
    seq=2048,
    mesh="fsdp=16,tensor=4",
    remat="minimal",
    attention="flash",
    libtpu_flags="the 64b.sh script's nine (async collective fusion and permute, all-gather backward pipelining)",
    step_s=10.0269,  # published 323 TFLOP/s per chip; 3235.898 TFLOP per chip a step (causal attention halved)
    tflops_per_device=323.0,
    source=f"{MAXTEXT} MaxText/configs/v5p/README.md @76bd53b0f44caf989c88189afadeb1062f9254f0 (64B row: "
    "323 TFLOP/s/chip, MFU 70.31%; config MaxText/configs/v5p/64b.sh, same commit)",
    compiled_remat="minimal",
    sequence_parallel=True,
    flags="--xla_tpu_megacore_fusion_allow_ags=false --xla_enable_async_collective_permute=true "
    "--xla_tpu_enable_ag_backward_pipelining=true --xla_tpu_enable_data_parallel_all_reduce_opt=true "
    "--xla_tpu_data_parallel_opt_different_sized_ops=true --xla_tpu_enable_async_collective_fusion=true "
    "--xla_tpu_enable_async_collective_fusion_multiple_steps=true --xla_tpu_overlap_compute_collective_tc=true "
    "--xla_enable_async_all_gather=true",
    differs="MaxText then split the residual stream's embedding dimension over tensor (activation_embed), the lab "
    "splits its sequence (sequence parallelism): the same all-gather and reduce-scatter bytes, but not the norms' "
    "small all-reduce of sums; a value RMSNorm beside the q/k norms; the embedding and the head whole over tensor "
    "(MaxText split them by vocabulary: the lab runs their matmuls tensor=4 times)",
    causal_flops=True,
)
MAXTEXT_52B_V4 = PublishedRun(
    name="MaxText 52B on v4-384",
    preset=f"layers=32,d_model=12288,d_ff=49152,{MT2023},block=parallel",
    topology="v4:4x4x12",
    slices=1,
    batch_per_device=10,
    seq=1024,
    mesh="fsdp=192",
    remat="full",
    attention="dot product (before flash attention)",
    libtpu_flags="--xla_enable_async_all_gather=true, TPU_MEGACORE=MEGACORE_DENSE",
    step_s=20.7231,  # published 154 TFLOP/s per chip; 3191.360 TFLOP per chip a step (6 N tokens: no attention term)
    tflops_per_device=154.0,
    source=f"{MAXTEXT} README.md @e286533d8cb48d2e07426d73b7bdf79d7f3bc0cf (Runtime Performance Results, v4: 52B "
    "on v4-384, 154 TFLOP/s/chip, MFU 56%; config MaxText/configs/1xv4-384.sh, same commit)",
    compiled_attention="xla",
    flags="--xla_enable_async_all_gather=true",
    differs="T5 relative-position bias on the attention logits (the lab: rotary); LayerNorm (the lab: RMSNorm)",
)
# TPU7x (Ironwood): the tpu-recipes table's Llama 3.1 70B row, configured by its recipe folder
IRONWOOD_RECIPE = "training/ironwood/llama3.1-70b/8k-bf16-tpu7x-4x4x4/run_recipe.sh"
LLAMA31_70B_TPU7X = PublishedRun(
    name="Llama 3.1 70B on TPU7x-64",
    preset="llama3.1-70b",
    topology="tpu7x:4x4x4",
    slices=1,
    batch_per_device=2,  # per JAX device, two to a chip: 256 sequences a step on 64 chips
    seq=8192,
    mesh="fsdp=128",
    remat="custom: decoder_layer_input, context, query/key/value_proj saved in HBM, the rest recomputed",
    attention="flash (tokamax splash)",
    libtpu_flags="the recipe's fifteen (SparseCore offload of all-gather, reduce-scatter and all-reduce)",
    flags=" ".join(
        (
            "--xla_tpu_scoped_vmem_limit_kib=65536 --xla_tpu_bf16_emission_mode=NATIVE_EMISSION",
            "--xla_tpu_enable_sparse_core_reduce_scatter_v2=true",
            "--xla_tpu_enable_sparse_core_collective_offload_all_gather=true",
            "--xla_tpu_enable_sparse_core_collective_offload_2d_all_gather=true",
            "--xla_tpu_enable_all_gather_offload_tracing=true --xla_tpu_use_tc_device_shape_on_sc=True",
            "--xla_sc_disable_megacore_partitioning=True",
            "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=false",
            "--xla_enable_async_all_gather=true --xla_tpu_prefer_async_allgather_to_allreduce=true",
            "--xla_tpu_enable_sparse_core_collective_offload_all_reduce=true",
            "--xla_tpu_enable_sparse_core_collective_offload_reduce_scatter=true",
            "--xla_tpu_enable_sparse_core_collective_offload_3d_all_gather=true",
            "--xla_tpu_use_single_sparse_core_for_all_gather_offload=true",
        )
    ),
    step_s=12.2,
    tflops_per_device=1207.05 / 2,  # published per chip, 1207.05 TFLOP/s; a chip is two of JAX's devices
    source=f"{TPU_RECIPES} training/ironwood/README.md @c8cfe2f689081d36701a101cd73a70965d80926b (llama3.1-70b, "
    f"8192, bf16, 64 chips: 12.2 s, 1207.05 TFLOP/s/chip; config {IRONWOOD_RECIPE} "
    "@bc90a99229efb4d63bf0e04a45bcb5955f68bc76)",
    compiled_remat="custom:decoder_layer_input=device,context=device,query_proj=device,key_proj=device,"
    "value_proj=device",
    differs="the recipe's flags move the all-gathers, reduce-scatters and all-reduces to the SparseCores (async "
    "calls, priced as the same collectives on ICI: what the SparseCores reach of the links is not published); "
    "Adam's first moment in bf16 (the lab keeps fp32); tokamax's splash kernel with the recipe's block sizes (the "
    "lab: Pallas flash, blocks of 512)",
    causal_flops=True,
)
GENERATION_RUNS = (MAXTEXT_32B_V5E, MAXTEXT_64B_V5P, MAXTEXT_52B_V4, LLAMA31_70B_TPU7X)

# NVIDIA H100: MaxText's Llama 2 7B, remat minimal_flash, cuDNN flash attention (attention=cudnn_flash_te), bf16
JAX_TOOLBOX = "NVIDIA/JAX-Toolbox"
GPU_RECIPES = "AI-Hypercomputer/gpu-recipes"
# MaxText's XLA:GPU flags as each run's source gives them, less those today's XLA no longer has (lab.targets.xla_flags
# refuses them; their work is now XLA's default or gone: async collectives, fp-conversion simplification, CUDA graph
# levels, Triton softmax fusion); both turn XLA's rematerialization pass off, which the lab's program, over HBM with
# XLA's attention, would otherwise run
_GPU_SCHEDULE = (
    "--xla_gpu_enable_latency_hiding_scheduler=true --xla_gpu_enable_triton_gemm=false "
    "--xla_gpu_enable_highest_priority_async_stream=true"
)
_GPU_PIPELINED = (
    "--xla_gpu_enable_pipelined_all_gather=true --xla_gpu_enable_pipelined_reduce_scatter=true "
    "--xla_gpu_enable_pipelined_all_reduce=true --xla_gpu_enable_while_loop_double_buffering=true "
    "--xla_gpu_enable_all_gather_combine_by_dim=false --xla_gpu_enable_reduce_scatter_combine_by_dim=false "
    "--xla_disable_hlo_passes=rematerialization"
)
GPU_DROPPED = (
    "--xla_gpu_enable_async_all_gather, --xla_gpu_enable_async_reduce_scatter, --xla_gpu_enable_async_all_reduce, "
    "--xla_gpu_simplify_all_fp_conversions, --xla_gpu_graph_level=0, --xla_gpu_enable_triton_softmax_fusion=false"
)
LLAMA2_7B_8XH100 = PublishedRun(
    name="Llama 2 7B on 8 H100 (one node)",
    preset="llama2-7b",
    topology="h100:1x8",
    slices=1,
    batch_per_device=2,
    seq=4096,
    mesh="fsdp=8",
    remat="minimal_flash (the matmul outputs without batch dimensions, and the attention's output)",
    compiled_remat="minimal_flash",
    attention="cuDNN flash (Transformer Engine)",
    libtpu_flags="the README's recommended XLA_FLAGS as first published with this row (rosetta/rosetta/projects/"
    "maxtext/README.md @5fb41195efe1a35c70a52a57dfd384d3d16d8107)",
    step_s=0.721,
    tflops_per_device=0.0,  # not published: the table gives the step and 22.19 sequences/s
    source=f"{JAX_TOOLBOX} docs/frameworks/maxtext/README.md @bcbbfa578be90bf5c1dfef2c67cf074589391eee (table row "
    "7B, H100 80G SXM, BF16, 4096, 8 GPUs, micro-batch 2, fsdp 8, Flash, minimal_flash: 0.721 s)",
    flags=" ".join(
        (
            _GPU_SCHEDULE,
            "--xla_gpu_all_reduce_combine_threshold_bytes=1073741824",
            "--xla_gpu_all_gather_combine_threshold_bytes=1073741824",
            "--xla_gpu_reduce_scatter_combine_threshold_bytes=134217728",
            _GPU_PIPELINED,
        )
    ),
    differs=f"the README's flags today's XLA does not know, dropped: {GPU_DROPPED}",
)
LLAMA2_7B_256XH100 = PublishedRun(
    name="Llama 2 7B on 256 H100 (32 nodes)",
    preset="llama2-7b",
    topology="h100:32x8",
    slices=1,
    batch_per_device=4,
    seq=4096,
    mesh="data=32,fsdp=8",
    remat="minimal_flash",
    compiled_remat="minimal_flash",
    attention="cuDNN flash (Transformer Engine)",
    libtpu_flags="the recipe's Helm chart's XLA_FLAGS (src/helm-charts/a3mega/maxtext-training/templates/"
    "maxtext-configmap.yaml, same commit)",
    step_s=1.5,
    tflops_per_device=503.384,
    source=f"{GPU_RECIPES} training/a3mega/llama-2-7b/maxtext-pretraining-gke/README.md "
    "@eeadb349781fe9b6460c7da121fa49c3648529eb (log: completed step: 12, seconds: 1.500, TFLOP/s/device: 503.384; "
    "config src/frameworks/a3mega/maxtext-configs/llama-2-7b-256gpus-a3mega-bf16.yaml: dcn_data_parallelism 32, "
    "ici_fsdp_parallelism 8, per_device_batch_size 4)",
    flags=" ".join(
        (
            _GPU_SCHEDULE,
            "--xla_gpu_all_reduce_combine_threshold_bytes=536870912",
            "--xla_gpu_all_gather_combine_threshold_bytes=134217728",
            "--xla_gpu_reduce_scatter_combine_threshold_bytes=67108864",
            _GPU_PIPELINED,
        )
    ),
    differs="the chart's flags today's XLA does not know, dropped: --xla_gpu_graph_level=0, "
    "--xla_gpu_enable_triton_softmax_fusion=false; its last flag ends in a stray quote "
    '(rematerialization"), read here as the rematerialization pass the README names',
)
XLA_FLAGS_SOURCE = f"{MAXTEXT} benchmarks/xla_flags_library.py @05d3525e834959775d417fd65c3d7aadd213a3f7"

# Matmul efficiency: solved from LLAMA31_8B alone (`solve_matmul_efficiency`, run by results/pod_predictions/,
# whose page says "differs" when the code moves the fit away from the value stored here, to MATMUL_DIGITS decimals).
# HBM efficiency: not fitted; STREAM-like copies reach ~90% of HBM peak on accelerators (scaling book, Part 2
# "TPU Specs": the bandwidth figures are peaks; Part 1 uses the peak itself), so 0.9 is taken, for every chip.
HBM_EFFICIENCY = 0.9
HBM_SOURCE = "assumed 0.9 of the HBM peak (not fitted; https://jax-ml.github.io/scaling-book/tpus/ gives peaks)"
MATMUL_EFFICIENCY = {"v6e": 0.7170, "h100": 0.5934, "v5e": 0.8895, "v5p": 0.8892, "v4": 0.7967, "tpu7x": 0.6872}
MATMUL_SOURCE = {
    "v6e": "solved so that the lab's compiled Llama 3.1 8B step (the recipe's host offload and libtpu flags, "
    "fsdp=256, flash with lab.model's FLASH_BLOCK of 512) predicts LLAMA31_8B's 4.546 s "
    "(`solve_matmul_efficiency`, HBM efficiency 0.9); LLAMA31_70B is then held out (results/pod_predictions)",
    "v5e": "solved so that the lab's compiled MaxText 32B step (MAXTEXT_32B_V5E as typed in, remat full) predicts "
    "its published 12.547 s (results/published_runs; no v5e run is held out in the development set)",
    "v5p": "solved so that the lab's compiled MaxText 64B step (MAXTEXT_64B_V5P as typed in: remat minimal, "
    "sequence parallelism over tensor=4, the 64b.sh script's flags) predicts its published 10.027 s "
    "(results/published_runs; no v5p run is held out in the development set)",
    "v4": "solved so that the lab's compiled MaxText 52B step (MAXTEXT_52B_V4, XLA's attention) predicts its "
    "published 20.723 s (results/published_runs; no v4 run is held out in the development set)",
    "tpu7x": "solved so that the lab's compiled Llama 3.1 70B step (LLAMA31_70B_TPU7X: its recipe's custom remat "
    "and flags, the collectives on the SparseCores) predicts its published 12.2 s (results/published_runs; no TPU7x "
    "run is held out in the development set)",
    "h100": "solved so that the lab's compiled Llama 2 7B step on gpu:h100:1x8 (remat minimal_flash, fsdp=8, the "
    "README's XLA_FLAGS, XLA's attention priced as a flash kernel) predicts LLAMA2_7B_8XH100's 0.721 s; "
    "LLAMA2_7B_256XH100 is then held out (results/gpu_predictions)",
}


def source_chip(chip: str) -> str:
    """The chip whose calibration run `chip` uses: its own, else a calibrated chip of its kind (GPU or TPU)."""
    if chip in MATMUL_EFFICIENCY:
        return chip
    kind = [c for c in MATMUL_EFFICIENCY if (c in SPECS) == (chip in SPECS)]
    return kind[0] if kind else "v6e"


def efficiency(chip: str) -> Efficiency:
    """The constants of one chip; chips without a calibration run use another's (`source_chip`, and say so)."""
    return Efficiency(matmul=MATMUL_EFFICIENCY[source_chip(chip)], hbm=HBM_EFFICIENCY)


def calibrated(chip: str) -> bool:
    return chip in MATMUL_SOURCE


MATMUL_DIGITS = 4  # decimals the solved constant is stored to (a relative resolution of about 2e-4)


def solve_matmul_efficiency(
    read: ReadSchedule, measured_s: float, hbm: float = HBM_EFFICIENCY, step_s=lambda prediction, efficiency: None
) -> float:
    """The matmul efficiency at which the op-by-op step of `read` takes `measured_s`, by bisection.

    `step_s(prediction, efficiency)`, when it returns a number, is the step to match instead of the prediction's
    own (the GPU runs' step with XLA's attention priced as the flash kernel they ran). The predicted step never
    grows as the efficiency rises (every compute op gets faster or stays memory-bound, and a transfer waited for
    can only shrink), so the root is bracketed by a tiny efficiency and 1.
    """

    def step_at(matmul: float) -> float:
        efficiency = Efficiency(matmul=matmul, hbm=hbm)
        prediction = read.predict(efficiency)
        adjusted = step_s(prediction, efficiency)
        return prediction.step_s if adjusted is None else adjusted

    low, high = 1e-3, 1.0
    if step_at(high) > measured_s:
        raise LabError(f"even at the chip's peak the step takes longer than the measured {measured_s} s")
    while high - low > 1e-7:
        middle = (low + high) / 2
        if step_at(middle) > measured_s:
            low = middle
        else:
            high = middle
    return (low + high) / 2
