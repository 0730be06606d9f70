"""Compile-only NVIDIA GPU clusters: what XLA:GPU needs to know about a GPU it will never see.

XLA compiles for a GPU from a *target config* (``stream_executor.GpuTargetConfigProto``,
openxla/xla ``xla/stream_executor/device_description.proto``): the numbers a real
GPU reports to the CUDA driver at start-up (compute capability, SM count, clock,
shared memory and registers per SM, L2, memory size and bandwidth) plus the
cuDNN and CUDA runtime versions the compiler may use. Given one, the CUDA PJRT
plugin builds compile-only devices without a GPU or a driver
(``jax.experimental.topologies.get_topology_desc(platform="cuda",
target_config=..., topology=...)``), and ``jit(...).lower(...).compile()`` runs
the whole GPU pipeline: SPMD partitioning, NCCL collectives as async start/done
pairs, the latency-hiding scheduler, Triton/cuBLAS fusions.

``topology`` is ``"<partitions>x<hosts per partition>x<devices per host>"``
(openxla/xla ``xla/service/gpu_topology.cc``, ``TryParseInlineGpuTopology``;
the two-number form is refused by the plugin in jaxlib 0.10.2). A *partition*
("slice" in older XLA) is one NVLink domain: "devices on the same slice are
connected by the fast network via NVLinks, which could be within a host or span
across multiple hosts" (``gpu_topology.proto``). An HGX/DGX H100 node is one host
whose 8 GPUs share NVSwitches, and nodes meet over InfiniBand, so the lab's
``gpu:h100:4x8`` is topology ``4x1x8``: 4 partitions of one host of 8 GPUs.
Each compile-only device then reports ``process_index`` = its host (node) and
``coords`` = (partition, host in partition, GPU in host); `lab.targets.topology` reads
the node from ``process_index``.

The target configs here are written from NVIDIA's public specifications, each
number with its source (`GpuSpec`), not copied from a dump of a real GPU; memory
size and bandwidth come from the chip profile (`lab.targets.hardware`), so one number
has one source.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
from dataclasses import dataclass

from lab.errors import LabError
from lab.targets.hardware import B200, H100, H200, ChipProfile

HOPPER_WHITEPAPER = (
    "https://resources.nvidia.com/en-us-tensor-core (NVIDIA H100 Tensor Core GPU Architecture, Table 2-3)"
)
CUDA_GUIDE = (
    "https://docs.nvidia.com/cuda/cuda-c-programming-guide/#features-and-technical-specifications "
    "(Table 'Technical Specifications per Compute Capability', 9.0)"
)
HOPPER_TUNING = "https://docs.nvidia.com/cuda/hopper-tuning-guide/ (Unified Shared Memory/L1/Texture Cache)"


@dataclass(frozen=True)
class GpuSpec:
    """One GPU model as XLA's target config describes it, from public specifications."""

    name: str  # the lab's chip name, as in the target "gpu:h100:4x8"
    device_kind: str  # what jax's device.device_kind says on the real GPU (and on these compile-only ones)
    profile: ChipProfile  # peak FLOP/s, memory, NVLink and InfiniBand (lab.targets.hardware)
    compute_capability: tuple[int, int]
    sm_count: int
    clock_ghz: float
    fp32_cores_per_sm: int
    l2_cache_bytes: int
    shared_memory_per_sm: int
    shared_memory_per_block: int  # without opting in
    shared_memory_per_block_optin: int
    registers_per_sm: int  # 32-bit registers
    registers_per_block: int
    threads_per_sm: int
    threads_per_block: int
    tensor_flops_per_clock_per_sm: int  # dense bf16
    gpus_per_node: int  # GPUs one node's NVSwitches join (HGX/DGX: 8)
    sources: tuple[str, ...] = ()

    @property
    def peak_bf16_flops(self) -> float:
        """SMs x dense bf16 FLOPs per clock x clock: the datasheet's peak, rebuilt from the architecture."""
        return self.sm_count * self.tensor_flops_per_clock_per_sm * self.clock_ghz * 1e9


_HOPPER = {
    "compute_capability": (9, 0),  # CUDA guide: Hopper is compute capability 9.0
    "fp32_cores_per_sm": 128,  # whitepaper Table 2: 128 FP32 cores per SM
    "l2_cache_bytes": 50 * 2**20,  # whitepaper Table 2: 50 MB L2 (GH100 die, H100 SXM5 and H200 alike)
    "shared_memory_per_sm": 228 * 1024,  # tuning guide: "up to 228 KB" shared memory per SM
    "shared_memory_per_block": 48 * 1024,  # CUDA guide: 48 KB per block without opt-in
    "shared_memory_per_block_optin": 227 * 1024,  # tuning guide / CUDA guide: 227 KB per block with opt-in
    "registers_per_sm": 65536,  # CUDA guide: 64K 32-bit registers per SM
    "registers_per_block": 65536,  # CUDA guide: 64K per block
    "threads_per_sm": 2048,  # CUDA guide: 2048 resident threads per SM
    "threads_per_block": 1024,  # CUDA guide: 1024 threads per block
    # whitepaper: A100's SM does 1024 dense FP16/BF16 FMA per clock (4 Tensor Cores x 256), H100's twice that:
    # 2048 FMA = 4096 FLOPs (check: A100 108 SMs x 2048 x 1.41 GHz = 312 TFLOPS, its datasheet's figure)
    "tensor_flops_per_clock_per_sm": 4096,
    "gpus_per_node": 8,  # HGX H100 / H200 8-GPU baseboard: 8 GPUs on 4 NVSwitches (datasheets' "HGX" form)
}

# Blackwell (B200): two dies of 74 enabled SMs each, which CUDA sees as one GPU
BLACKWELL_MICROBENCHMARKS = (
    "https://chipsandcheese.com/p/nvidias-b200-keeping-the-cuda-juggernaut (148 SMs, 74 per die; 126 MB of L2 "
    "measured; L1/shared memory 256 KB per SM as H100)"
)
_BLACKWELL = {
    **_HOPPER,  # the CUDA guide's per-SM and per-block limits for 10.0 are Hopper's (228 KB shared, 64K registers)
    "compute_capability": (10, 0),  # CUDA guide: B200 (sm_100) is compute capability 10.0
    "l2_cache_bytes": 126 * 2**20,  # BLACKWELL_MICROBENCHMARKS
    # HGX B200's 2.25 PFLOPS dense bf16 from 148 SMs at its 1.856 GHz tensor clock: 8192 FLOPs per clock per SM,
    # twice Hopper's (fifth-generation Tensor Cores)
    "tensor_flops_per_clock_per_sm": 8192,
}

SPECS: dict[str, GpuSpec] = {
    "h100": GpuSpec(
        name="h100",
        device_kind="NVIDIA H100 80GB HBM3",  # the H100 SXM5's CUDA device name
        profile=H100,
        sm_count=132,  # whitepaper Table 2: H100 SXM5, 132 SMs
        # the clock at which NVIDIA quotes H100 SXM5's peaks: 989.4 TFLOPS dense bf16 = 132 SMs x 4096 x 1.83 GHz
        clock_ghz=1.83,
        sources=(HOPPER_WHITEPAPER, CUDA_GUIDE, HOPPER_TUNING, "https://www.nvidia.com/en-us/data-center/h100/"),
        **_HOPPER,
    ),
    "h200": GpuSpec(
        name="h200",
        device_kind="NVIDIA H200",  # the H200 SXM's CUDA device name
        profile=H200,
        sm_count=132,  # H200 datasheet: the same GH100 compute as H100 SXM (989 TFLOPS bf16 dense)
        clock_ghz=1.83,  # as H100 SXM5: the same peak from the same SMs
        sources=(HOPPER_WHITEPAPER, CUDA_GUIDE, HOPPER_TUNING, "https://www.nvidia.com/en-us/data-center/h200/"),
        **_HOPPER,
    ),
    "b200": GpuSpec(
        name="b200",
        device_kind="NVIDIA B200",  # the B200 SXM's CUDA device name
        profile=B200,
        sm_count=148,  # BLACKWELL_MICROBENCHMARKS
        clock_ghz=1.856,  # the tensor clock at which 148 SMs x 8192 give the datasheet's 2.25 PFLOPS
        sources=(BLACKWELL_MICROBENCHMARKS, CUDA_GUIDE, "https://www.nvidia.com/en-us/data-center/hgx/"),
        **_BLACKWELL,
    ),
}

_GPU_TARGET = re.compile(r"^gpu:(?P<chip>[a-z0-9]+):(?P<nodes>\d+)x(?P<gpus>\d+)$", re.ASCII)
GPU_TARGET_FORM = "gpu:<chip>:<nodes>x<gpus per node> (e.g. gpu:h100:4x8)"


def spec(chip: str) -> GpuSpec:
    """The GPU called `chip` ("h100", "h200", "b200")."""
    key = chip.strip().lower()
    if key not in SPECS:
        raise LabError(f"unknown GPU {chip!r}; compile-only GPU targets exist for {', '.join(SPECS)}")
    return SPECS[key]


def parse_cluster(text: str) -> tuple[str, int, int]:
    """``"gpu:h100:4x8"`` -> ("h100", 4 nodes, 8 GPUs per node), checked against the chip's node."""
    match = _GPU_TARGET.match(text.strip().lower())
    if not match:
        raise LabError(f"target {text!r}: give {GPU_TARGET_FORM}")
    gpu = spec(match["chip"])
    nodes, per_node = int(match["nodes"]), int(match["gpus"])
    if nodes < 1 or per_node < 1:
        raise LabError(f"target {text!r}: nodes and GPUs per node must be positive, as in gpu:{gpu.name}:4x8")
    if per_node > gpu.gpus_per_node:
        raise LabError(
            f"target {text!r}: each {gpu.name} node holds at most {gpu.gpus_per_node} GPUs on its NVLink switches; "
            f"use gpu:{gpu.name}:<nodes>x{gpu.gpus_per_node} or fewer GPUs per node"
        )
    return gpu.name, nodes, per_node


def xla_topology(nodes: int, gpus_per_node: int) -> str:
    """The plugin's topology string: one NVLink partition of one host per node."""
    return f"{nodes}x1x{gpus_per_node}"


def _version(package: str, fallback: tuple[int, ...]) -> tuple[int, ...]:
    """The version the CUDA plugin installed (cuDNN, the CUDA runtime), else `fallback`."""
    try:
        parts = importlib.metadata.version(package).split(".")
    except importlib.metadata.PackageNotFoundError:
        return fallback
    return tuple(int(p) for p in parts[: len(fallback)] if p.isdigit())


def target_config(gpu: GpuSpec) -> str:
    """The ``GpuTargetConfigProto`` text for `gpu` (memory from its chip profile; cuDNN and CUDA as installed)."""
    cudnn = _version("nvidia-cudnn-cu12", (9, 8, 0))
    cuda = _version("nvidia-cuda-runtime-cu12", (12, 8, 0))
    major, minor = gpu.compute_capability
    info = {
        "threads_per_block_limit": gpu.threads_per_block,
        "threads_per_warp": 32,  # CUDA guide: every compute capability
        "shared_memory_per_block": gpu.shared_memory_per_block,
        "shared_memory_per_block_optin": gpu.shared_memory_per_block_optin,
        "shared_memory_per_core": gpu.shared_memory_per_sm,
        "threads_per_core_limit": gpu.threads_per_sm,
        "core_count": gpu.sm_count,
        "fpus_per_core": gpu.fp32_cores_per_sm,
        "block_dim_limit_x": 2**31 - 1,  # CUDA guide: grid x up to 2^31-1, y and z up to 65535
        "block_dim_limit_y": 65535,
        "block_dim_limit_z": 65535,
        "memory_bandwidth": int(gpu.profile.hbm_bandwidth),
        "l2_cache_size": gpu.l2_cache_bytes,
        "clock_rate_ghz": gpu.clock_ghz,
        "device_memory_size": int(gpu.profile.hbm_bytes),
        "registers_per_core_limit": gpu.registers_per_sm,
        "registers_per_block_limit": gpu.registers_per_block,
    }
    fields = "\n".join(f"  {key}: {value}" for key, value in info.items())
    return (
        "gpu_device_info {\n"
        f"  cuda_compute_capability {{ major: {major} minor: {minor} }}\n"
        f"{fields}\n"
        "}\n"
        'platform_name: "CUDA"\n'
        f"dnn_version_info {{ major: {cudnn[0]} minor: {cudnn[1]} patch: {cudnn[2] if len(cudnn) > 2 else 0} }}\n"
        f"runtime_version {{ major: {cuda[0]} minor: {cuda[1]} }}\n"
        f'device_description_str: "{gpu.device_kind}"\n'  # becomes device.device_kind
    )


def cuda_plugin_installed() -> bool:
    """Whether the CUDA PJRT plugin (``pip install 'jax[cuda12]'``) is importable."""
    try:
        return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
    except ModuleNotFoundError:  # no jax_plugins namespace at all
        return False
