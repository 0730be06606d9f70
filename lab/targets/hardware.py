"""Chip profiles: the few numbers that bound a distributed program.

A step cannot run faster than its FLOPs over the chip's peak FLOP/s, its memory
traffic over the HBM bandwidth, or its communication over the network that
carries it: the chip-to-chip links (a TPU's ICI torus, a GPU's NVLink), or the
data-centre network between slices and nodes (DCN, InfiniBand). `lab.theory`
turns these numbers into predicted times.

Every figure names its source. TPU figures are the tables of "How to Scale Your
Model" (the scaling book), Part 2 "TPU Specs", the numbers its worked examples
use, cross-checked against Google Cloud's system-architecture pages; GPU
figures are NVIDIA's datasheets and the book's GPU chapter (Part 12). The local
CPU is measured, not looked up.

On a GPU the two networks are NVLink and InfiniBand: `link_bandwidth` is one
GPU's NVLink egress to the other GPUs of its node (through the NVSwitches, any
GPU one hop away), `dcn_bandwidth` its share of the network between nodes (one
400 Gb/s NDR InfiniBand NIC per GPU on DGX/HGX H100, H200 and B200).

Wraparound decides whether a torus axis is a ring or a line, which halves or
doubles collective time (scaling book, Part 2, "TPU Networking"): v4 and v5p
wrap every axis when the slice is made of whole 4x4x4 cubes (the optical
switches that close the rings exist only per cube); v5e and v6e wrap an axis
only when it spans the full pod edge of 16 chips.
"""

from __future__ import annotations

import functools
import math
import os
import statistics
import timeit
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from lab.errors import LabError

SCALING_BOOK_TPUS = (
    "https://jax-ml.github.io/scaling-book/tpus/ (TPU Specs tables; source jax-ml/scaling-book tpus.md @54e2c43)"
)
SCALING_BOOK_SHARDING = "https://jax-ml.github.io/scaling-book/sharding/ (A note on ICI latency)"
CLOUD_TPU7X = "https://cloud.google.com/tpu/docs/tpu7x (specification table: v5p, v6e, TPU7x)"
SCALING_BOOK_GPUS = "https://jax-ml.github.io/scaling-book/gpus/ (Summary of GPU specs; Networking)"


@dataclass(frozen=True)
class ChipProfile:
    """One accelerator's peak compute, memory and network, with where each figure comes from."""

    name: str
    peak_bf16_flops: float  # dense bf16 FLOP/s per chip
    hbm_bytes: float  # memory capacity per chip
    hbm_bandwidth: float  # bytes/s between memory and compute
    link_bandwidth: float  # bytes/s per link per direction: one ICI link; a GPU's whole NVLink egress (to its node)
    torus_dims: int  # 3 (v4, v5p), 2 (v5e, v6e), 0 for a switched network (GPU node, this CPU)
    dcn_bandwidth: float | None  # bytes/s per chip to other slices or nodes (DCN, InfiniBand); None: no such network
    hop_latency_s: float  # latency of one hop on the chip-to-chip network
    chips_per_host: int
    wrap_cube: int = 0  # a slice made of whole cubes of this edge wraps every axis (v4, v5p)
    wrap_axis: int = 0  # an axis of exactly this length wraps (v5e, v6e)
    sources: tuple[str, ...] = ()
    note: str = ""
    peak_fp8_flops: float | None = None  # dense fp8 FLOP/s per chip where its maker publishes one
    peak_int8_ops: float | None = None  # dense int8 OP/s per chip where its maker publishes one
    host_bandwidth: float | None = None  # bytes/s per chip each way between HBM and host memory (PCIe)
    devices_per_chip: int = 1  # JAX devices per chip: 2 on TPU7x (two chiplets); compute and HBM figures are
    # then per device, network figures per chip (see TPU_7X)

    @property
    def matmul_peaks(self) -> dict[str, float]:
        """Dense matmul operations per second at each precision its maker publishes a peak for (bf16, int8, fp8)."""
        peaks = {"bf16": self.peak_bf16_flops, "int8": self.peak_int8_ops, "fp8": self.peak_fp8_flops}
        return {precision: peak for precision, peak in peaks.items() if peak}

    def matmul_peak(self, precision: str) -> float:
        """The peak at `precision`; a LabError where the chip has none published (no such matrix units)."""
        if precision not in self.matmul_peaks:
            runs = " or ".join(self.matmul_peaks)
            raise LabError(f"{self.name} publishes no {precision} matmul peak: its matrix units run {runs}")
        return self.matmul_peaks[precision]

    @property
    def links_per_chip(self) -> int:
        """ICI links per chip: one to each neighbour, two per torus dimension."""
        return 2 * self.torus_dims

    @property
    def dcn_name(self) -> str:
        """What the network between slices is called: InfiniBand between GPU nodes, DCN between TPU slices."""
        return "DCN" if self.torus_dims else "InfiniBand"

    @property
    def dcn_bandwidth_per_host(self) -> float | None:
        return None if self.dcn_bandwidth is None else self.dcn_bandwidth * self.chips_per_host

    def wraparound(self, topology: Sequence[int]) -> tuple[bool, ...]:
        """For each axis of a slice `topology` (e.g. (4, 4, 8)), whether it wraps into a ring."""
        if not self.torus_dims:
            raise LabError(
                f"{self.name} has no torus (its chips meet through a switch); wraparound applies to TPU slices only"
            )
        if len(topology) > self.torus_dims or any(size < 1 for size in topology):
            shape = "x".join(map(str, topology))
            raise LabError(
                f"topology {shape} does not fit {self.name}'s {self.torus_dims}D "
                f"torus; give {self.torus_dims} positive sizes"
            )
        if self.wrap_cube:
            whole_cubes = all(size % self.wrap_cube == 0 for size in topology)
            return tuple(whole_cubes for _ in topology)
        return tuple(size == self.wrap_axis for size in topology)


TPU_V4 = ChipProfile(
    name="v4",
    peak_bf16_flops=2.75e14,  # book TPU Specs; Cloud: 275 TFLOPs
    hbm_bytes=32 * 2**30,  # Cloud: 32 GiB (book: 32GB)
    hbm_bandwidth=1.2e12,  # book TPU Specs; Cloud: 1200 GBps
    link_bandwidth=4.5e10,  # book interconnect table: ICI BW/link one-way
    torus_dims=3,  # book TPU Networking: 6 nearest neighbours, 3D torus
    dcn_bandwidth=6.25e9,  # book: "typically 6.25e9 bytes/s per TPU" (v4 not listed apart)
    hop_latency_s=1e-6,  # book Part 3, A note on ICI latency: "typically around 1us"
    chips_per_host=4,  # book TPU Specs: host 2x2x1
    wrap_cube=4,  # book: 4x4x4 and 4x4x8 wrap, 2x2x4 does not; Cloud: torus when every dimension is a multiple of 4
    host_bandwidth=1.6e10,  # book TPU Specs: "PCIe bandwidth for TPU v4 is 16GB / second each way"
    peak_int8_ops=2.75e14,  # Cloud v4: 275 peak TFLOPs bf16 or int8 (no fp8 published)
    sources=(SCALING_BOOK_TPUS, SCALING_BOOK_SHARDING, "https://cloud.google.com/tpu/docs/v4"),
)

TPU_V5P = ChipProfile(
    name="v5p",
    peak_bf16_flops=4.59e14,  # book TPU Specs; Cloud: 459 TFLOPs
    hbm_bytes=95 * 2**30,  # Cloud: 95 GiB (book: 96GB)
    hbm_bandwidth=2.8e12,  # book TPU Specs; Cloud: 2765 GBps
    link_bandwidth=9e10,  # book interconnect table (Cloud's 1200 GBps bidirectional over 6 ports is 1e11 one-way)
    torus_dims=3,
    dcn_bandwidth=6.25e9,  # book TPU Networking: 6.25e9 bytes/s egress per TPU; Cloud: 50 Gbps per chip
    hop_latency_s=1e-6,  # book Part 3, A note on ICI latency
    chips_per_host=4,  # book TPU Specs: host 2x2x1
    wrap_cube=4,  # book TPU Networking: wraparound from the optical switches of whole 4x4x4 cubes
    host_bandwidth=1.5e10,  # book TPU Specs: PCIe "typically around 1.5e10 bytes / second per chip"
    peak_int8_ops=9.18e14,  # book TPU Specs: 9.18e14 int8 OP/s; Cloud v5p: 918 TOPs
    peak_fp8_flops=4.59e14,  # Cloud TPU7x comparison table: v5p fp8 459 TFLOPs, its bf16 rate
    sources=(SCALING_BOOK_TPUS, SCALING_BOOK_SHARDING, "https://cloud.google.com/tpu/docs/v5p", CLOUD_TPU7X),
)

TPU_V5E = ChipProfile(
    name="v5e",
    peak_bf16_flops=1.97e14,  # book TPU Specs; Cloud: 197 TFLOPs
    hbm_bytes=16 * 2**30,  # book: "TPU v5e has 16GiB of HBM"; Cloud: 16 GB
    hbm_bandwidth=8.1e11,  # book TPU Specs; Cloud: 819 GBps
    link_bandwidth=4.5e10,  # book interconnect table (Cloud's 400 GBps bidirectional over 4 ports is 5e10 one-way)
    torus_dims=2,  # book: 4 nearest neighbours, 2D torus; Cloud: 4 ICI ports
    dcn_bandwidth=3.125e9,  # book: 3.125e9 bytes/s per TPU; Cloud: 2 x 100 Gbps NICs per 8-chip host
    hop_latency_s=1e-6,  # book Part 3, A note on ICI latency
    chips_per_host=8,  # book TPU Specs: host 4x2
    wrap_axis=16,  # book: "smaller topologies can be requested without wraps on dims < 16"
    host_bandwidth=1.5e10,  # book TPU Specs: PCIe "typically around 1.5e10 bytes / second per chip"
    peak_int8_ops=3.94e14,  # book TPU Specs: 3.94e14 int8 OP/s; Cloud v5e: 393 TOPs (no fp8 published)
    sources=(SCALING_BOOK_TPUS, SCALING_BOOK_SHARDING, "https://cloud.google.com/tpu/docs/v5e"),
)

TPU_V6E = ChipProfile(
    name="v6e",
    peak_bf16_flops=9.2e14,  # book TPU Specs; Cloud: 918 TFLOPs
    hbm_bytes=32 * 2**30,  # book and Cloud: 32 GB
    hbm_bandwidth=1.6e12,  # book TPU Specs; Cloud: 1638 GBps
    link_bandwidth=9e10,  # book interconnect table (Cloud: 800 GBps bidirectional over 4 ports)
    torus_dims=2,
    dcn_bandwidth=1.25e10,  # book: 12.5e9 bytes/s per TPU
    hop_latency_s=1e-6,  # book Part 3, A note on ICI latency
    chips_per_host=8,  # book TPU Specs: host 4x2
    wrap_axis=16,  # book: as v5e, wraps only along a full 16-chip axis
    host_bandwidth=3.2e10,  # book TPU Specs: "Trillium (TPU v6e) has 32GB/s, about 2x higher than v5"
    peak_int8_ops=1.84e15,  # book TPU Specs: 1.84e15 int8 OP/s; Cloud v6e: 1836 TOPs
    peak_fp8_flops=9.18e14,  # Cloud TPU7x comparison table: v6e fp8 918 TFLOPs, its bf16 rate
    sources=(SCALING_BOOK_TPUS, SCALING_BOOK_SHARDING, "https://cloud.google.com/tpu/docs/v6e", CLOUD_TPU7X),
)

TPU_7X = ChipProfile(
    # Ironwood: JAX sees each chip's two TensorCore chiplets as two devices (Cloud: "access two TPU devices
    # instead of the single logical core"), each with half the chip's compute and HBM: those figures are per
    # device. The ICI links are the chip's, shared by its two devices (a collective over both is priced on the
    # chips it spans); two devices of one chip meet die to die, priced as no link.
    name="tpu7x",
    peak_bf16_flops=2.307e15 / 2,  # Cloud TPU7x: 2307 TFLOPs bf16 per chip
    hbm_bytes=192 * 2**30 / 2,  # Cloud TPU7x: 192 GiB per chip
    hbm_bandwidth=7.38e12 / 2,  # Cloud TPU7x: 7380 GBps per chip
    link_bandwidth=1e11,  # Cloud TPU7x: 1200 GBps bidirectional per chip over a 3D torus's 6 ports: 1e11 one-way
    torus_dims=3,
    dcn_bandwidth=1.25e10,  # Cloud TPU7x: 100 Gbps per chip
    hop_latency_s=1e-6,  # as v5p (book Part 3, A note on ICI latency); no Ironwood figure published
    chips_per_host=4,  # Cloud TPU7x: 4-chip VMs
    wrap_cube=4,  # Cloud: "shares many similarities with TPU v5p": 4x4x4 cubes joined by optical switches
    sources=(CLOUD_TPU7X,),
    note="no PCIe figure published: host transfers are not priced",
    peak_fp8_flops=4.614e15 / 2,  # Cloud TPU7x: 4614 TFLOPs fp8 per chip (no int8 figure)
    devices_per_chip=2,
)

_NCCL_LATENCY = "NVIDIA/nccl src/graph/tuning.cc hwLat, NVLink ring LL (2020-era table: 0.47 us)"
_DGX_H100 = (
    "https://docs.nvidia.com/dgx/dgxh100-user-guide/introduction-to-dgxh100.html "
    "(8 single-port ConnectX-7 NICs, 400 Gb/s InfiniBand each, one per GPU; NVLink 4 through 4 NVSwitches)"
)

H100 = ChipProfile(
    name="h100",
    peak_bf16_flops=9.89e14,  # H100 SXM datasheet: 1,979 TFLOPS bf16 with 2:4 sparsity, dense is half; book: 9.9e14
    hbm_bytes=80e9,  # datasheet: 80 GB
    hbm_bandwidth=3.35e12,  # datasheet: 3.35 TB/s
    link_bandwidth=4.5e11,  # NVLink 4: 18 links x 25 GB/s each way (datasheet: 900 GB/s both ways); book Networking
    torus_dims=0,  # NVSwitch: all GPUs of a node one hop apart
    dcn_bandwidth=5e10,  # one 400 Gb/s ConnectX-7 InfiniBand NIC per GPU (book: DGX H100 SuperPod)
    hop_latency_s=0.47e-6,  # _NCCL_LATENCY
    chips_per_host=8,  # DGX/HGX H100 node
    sources=("https://www.nvidia.com/en-us/data-center/h100/", SCALING_BOOK_GPUS, _NCCL_LATENCY, _DGX_H100),
    peak_fp8_flops=1.979e15,  # H100 SXM datasheet: 3,958 TFLOPS fp8 with 2:4 sparsity, dense is half
    peak_int8_ops=1.979e15,  # H100 SXM datasheet: 3,958 TOPS int8 with 2:4 sparsity, dense is half
)

H200 = ChipProfile(
    name="h200",
    peak_bf16_flops=9.89e14,  # NVIDIA H200 datasheet: same Hopper compute as H100 SXM; book: 9.9e14
    hbm_bytes=141e9,  # datasheet: 141 GB HBM3e
    hbm_bandwidth=4.8e12,  # datasheet: 4.8 TB/s
    link_bandwidth=4.5e11,  # NVLink 4 as H100 (datasheet: 900 GB/s both ways)
    torus_dims=0,
    dcn_bandwidth=5e10,  # one 400 Gb/s InfiniBand NIC per GPU, as the H100 reference architecture
    hop_latency_s=0.47e-6,  # _NCCL_LATENCY
    chips_per_host=8,  # HGX H200 8-GPU board
    sources=("https://www.nvidia.com/en-us/data-center/h200/", SCALING_BOOK_GPUS, _NCCL_LATENCY, _DGX_H100),
    peak_fp8_flops=1.979e15,  # H200 datasheet: 3,958 TFLOPS fp8 with sparsity, dense is half (as H100 SXM)
    peak_int8_ops=1.979e15,  # H200 datasheet: 3,958 TOPS int8 with sparsity, dense is half
)

_DGX_B200 = (
    "https://www.nvidia.com/en-us/data-center/dgx-b200/ (DGX B200 datasheet: 8 GPUs, 1,440 GB GPU memory, 64 TB/s "
    "HBM3e bandwidth, 72 PFLOPS fp8 training, 8 single-port ConnectX-7 NICs at 400 Gb/s, NVLink 5 through 2 "
    "NVSwitch chips)"
)

B200 = ChipProfile(
    name="b200",
    peak_bf16_flops=2.25e15,  # HGX B200 (1,000 W): 4.5 PFLOPS bf16 with 2:4 sparsity per GPU, dense is half
    hbm_bytes=180e9,  # DGX B200: 1,440 GB over 8 GPUs (192 GB of HBM3e stacks, 180 GB usable)
    hbm_bandwidth=8e12,  # DGX B200: 64 TB/s over 8 GPUs
    link_bandwidth=9e11,  # NVLink 5: 18 links x 50 GB/s each way (datasheet: 1.8 TB/s both ways per GPU)
    torus_dims=0,  # NVSwitch: all GPUs of a node one hop apart
    dcn_bandwidth=5e10,  # one 400 Gb/s ConnectX-7 InfiniBand NIC per GPU (_DGX_B200)
    hop_latency_s=0.47e-6,  # _NCCL_LATENCY, as Hopper's NVLink (no newer published figure)
    chips_per_host=8,  # DGX/HGX B200 node
    sources=("https://www.nvidia.com/en-us/data-center/hgx/", _DGX_B200, _NCCL_LATENCY),
    peak_fp8_flops=4.5e15,  # DGX B200: 72 PFLOPS fp8 (sparse) over 8 GPUs, dense is half
    peak_int8_ops=4.5e15,  # HGX B200: 72 POPS int8 (sparse) over 8 GPUs, dense is half
)

PROFILES: dict[str, ChipProfile] = {
    chip.name: chip for chip in (TPU_V4, TPU_V5E, TPU_V5P, TPU_V6E, TPU_7X, H100, H200, B200)
}
CPU_PROFILE_NAME = "cpu-local"

# jax's device.device_kind -> profile name. Compile-only libtpu reports these too.
_DEVICE_KINDS = {
    "tpu v4": "v4",
    "tpu v5 lite": "v5e",
    "tpu v5e": "v5e",
    "tpu v5": "v5p",
    "tpu v5p": "v5p",
    "tpu v6 lite": "v6e",
    "tpu v6e": "v6e",
    "tpu7x": "tpu7x",
    "cpu": CPU_PROFILE_NAME,
}
# GPU kinds carry the memory variant ("NVIDIA H100 80GB HBM3"), so they match by prefix.
_GPU_KIND_PREFIXES = {"nvidia h100": "h100", "nvidia h200": "h200", "nvidia b200": "b200"}


def profile(name: str) -> ChipProfile:
    """The profile called `name` ("v5e", "h100", "cpu-local" or "cpu" for the measured CPU)."""
    key = name.strip().lower()
    if key in ("cpu", CPU_PROFILE_NAME):
        return _measured_cpu_profile()
    if key not in PROFILES:
        raise LabError(f"unknown chip profile {name!r}; use one of {', '.join([*PROFILES, CPU_PROFILE_NAME])}")
    return PROFILES[key]


def profile_for_device_kind(device_kind: str) -> ChipProfile:
    """The profile of a jax device's `device_kind` ("TPU v5 lite" -> v5e, "NVIDIA H200" -> h200)."""
    key = device_kind.strip().lower()
    if key in _DEVICE_KINDS:
        return profile(_DEVICE_KINDS[key])
    for prefix, name in _GPU_KIND_PREFIXES.items():
        if key.startswith(prefix):
            return profile(name)
    known = [*_DEVICE_KINDS, *(f"{prefix}*" for prefix in _GPU_KIND_PREFIXES)]
    raise LabError(
        f"no chip profile for device kind {device_kind!r}; known kinds: {', '.join(known)}; "
        "or pick one with profile(name)"
    )


# --- The local CPU, measured ------------------------------------------------


def measure_cpu_profile(copy_bytes: int = 256 * 2**20, matmul_size: int = 1024, repeats: int = 5) -> ChipProfile:
    """Measure this machine: memory-copy bandwidth (bytes copied per second) and a rough matmul FLOP/s.

    Each figure is the median of `repeats` timings after one warm-up run. The
    copy should be well above the last-level cache so that it measures DRAM.
    """
    if copy_bytes < 1 or matmul_size < 1 or repeats < 1:
        raise LabError("measure_cpu_profile needs positive copy_bytes, matmul_size and repeats")
    copy_bandwidth = copy_bytes / _median_seconds(_copy_job(copy_bytes), repeats)
    matmul_flops = 2 * matmul_size**3 / _median_seconds(_matmul_job(matmul_size), repeats)
    return ChipProfile(
        name=CPU_PROFILE_NAME,
        peak_bf16_flops=matmul_flops,  # measured: float32 numpy matmul, a rough stand-in (numpy has no bf16 matmul)
        hbm_bytes=_physical_memory_bytes(),
        hbm_bandwidth=copy_bandwidth,  # measured: bytes copied/s (STREAM's "Copy" counts read + write, twice this)
        link_bandwidth=copy_bandwidth,  # emulated devices exchange data by copying through this same memory bus
        torus_dims=0,
        dcn_bandwidth=None,
        hop_latency_s=0.0,  # not measured here: the emulated devices' synchronisation cost is what bench.py times
        chips_per_host=1,
        sources=("measured by lab.targets.hardware.measure_cpu_profile",),
        note="emulated cpu:N devices share this one memory bus and these cores: "
        "N devices do not add bandwidth or FLOP/s",
    )


@functools.cache
def _measured_cpu_profile() -> ChipProfile:
    return measure_cpu_profile()  # measured once per process: it takes about a second


def _median_seconds(job, repeats: int) -> float:
    timings = timeit.repeat(job, number=1, repeat=repeats + 1)  # the first run warms caches and pages
    return statistics.median(timings[1:])


def _copy_job(copy_bytes: int):
    source = np.ones(
        copy_bytes, dtype=np.uint8
    )  # ones, not empty: untouched pages would be mapped lazily inside the timing
    target = np.zeros_like(source)
    return lambda: np.copyto(target, source)


def _matmul_job(size: int):
    rng = np.random.default_rng(0)
    a_NN, b_NN = (rng.standard_normal((size, size), dtype=np.float32) for _ in range(2))
    return lambda: a_NN @ b_NN


def _physical_memory_bytes() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # platforms without these sysconf names
        return math.nan
