"""Chip profiles: cited figures, wraparound rules, lookups, and the CPU probe."""

import math

import pytest

from lab.errors import LabError
from lab.targets.hardware import PROFILES, measure_cpu_profile, profile, profile_for_device_kind


@pytest.mark.parametrize(
    "name, peak_bf16, hbm_bandwidth, ici_one_way",
    [  # scaling book Part 2, "TPU Specs" and interconnect tables
        ("v4", 2.75e14, 1.2e12, 4.5e10),
        ("v5p", 4.59e14, 2.8e12, 9e10),
        ("v5e", 1.97e14, 8.1e11, 4.5e10),
        ("v6e", 9.2e14, 1.6e12, 9e10),
    ],
)
def test_tpu_figures_match_the_scaling_book(name, peak_bf16, hbm_bandwidth, ici_one_way):
    chip = profile(name)
    assert (chip.peak_bf16_flops, chip.hbm_bandwidth, chip.link_bandwidth) == (peak_bf16, hbm_bandwidth, ici_one_way)
    assert any("scaling-book" in source for source in chip.sources)


def test_tpu_torus_dimensions_and_links():
    assert [profile(name).torus_dims for name in ("v4", "v5p", "v5e", "v6e")] == [3, 3, 2, 2]
    assert profile("v5p").links_per_chip == 6 and profile("v5e").links_per_chip == 4


def test_dcn_per_chip_and_per_host():
    # scaling book Part 2: 6.25e9 bytes/s per TPU, 3.125e9 on v5e (2 x 100 Gbps NICs per 8-chip host), 12.5e9 on v6e
    assert profile("v5p").dcn_bandwidth == 6.25e9
    assert profile("v5e").dcn_bandwidth_per_host == pytest.approx(2 * 100e9 / 8)
    assert profile("v6e").dcn_bandwidth == 1.25e10


def test_gpu_figures_match_nvidia_datasheets():
    h100, h200 = profile("h100"), profile("h200")
    assert h100.peak_bf16_flops == pytest.approx(1979e12 / 2, rel=1e-3)  # datasheet quotes 2:4 sparse; dense is half
    assert (h100.hbm_bytes, h100.hbm_bandwidth) == (80e9, 3.35e12)
    assert (h200.hbm_bytes, h200.hbm_bandwidth) == (141e9, 4.8e12)
    assert h100.link_bandwidth == 18 * 25e9  # NVLink 4: 18 links x 25 GB/s each way
    assert h200.dcn_bandwidth == 400e9 / 8  # one 400 Gb/s InfiniBand NIC per GPU
    assert h100.torus_dims == 0
    b200 = profile("b200")  # DGX B200: 72 PFLOPS fp8 sparse, 1,440 GB, 64 TB/s over 8 GPUs; NVLink 5 1.8 TB/s
    assert (b200.peak_bf16_flops, b200.peak_fp8_flops) == (4.5e15 / 2, 72e15 / 8 / 2)
    assert (b200.hbm_bytes, b200.hbm_bandwidth) == (1440e9 / 8, 64e12 / 8)
    assert b200.link_bandwidth == 2 * h100.link_bandwidth and b200.dcn_bandwidth == h100.dcn_bandwidth


@pytest.mark.parametrize(
    "name, topology, expected",
    [
        ("v5p", (4, 4, 4), (True, True, True)),  # a full cube: optical wraparound on every axis
        ("v5p", (4, 4, 8), (True, True, True)),
        ("v5p", (2, 2, 4), (False, False, False)),  # not whole cubes: no optical switch, no wrap at all
        ("v4", (2, 2, 1), (False, False, False)),
        ("v5e", (16, 16), (True, True)),
        ("v5e", (8, 16), (False, True)),  # book: "a TPU v5e 8x16 will have a wraparound on the longer axis"
        ("v6e", (4, 4), (False, False)),
    ],
)
def test_wraparound_rules(name, topology, expected):
    assert profile(name).wraparound(topology) == expected


def test_wraparound_rejects_a_topology_that_does_not_fit():
    with pytest.raises(LabError, match="2D torus"):
        profile("v5e").wraparound((4, 4, 4))
    with pytest.raises(LabError, match="no torus"):
        profile("h100").wraparound((8,))


@pytest.mark.parametrize(
    "device_kind, name",
    [
        ("TPU v4", "v4"),
        ("TPU v5 lite", "v5e"),
        ("TPU v5", "v5p"),
        ("TPU v5p", "v5p"),
        ("TPU v6 lite", "v6e"),
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA B200", "b200"),
        ("cpu", "cpu-local"),
    ],
)
def test_profile_for_device_kind(device_kind, name):
    assert profile_for_device_kind(device_kind).name == name


def test_compile_only_tpu_devices_map_to_their_profile():
    from lab.targets.devices import topology_devices

    (device, *_) = topology_devices("v5e:2x2")
    assert profile_for_device_kind(device.device_kind).name == "v5e"


def test_unknown_names_list_the_known_ones():
    with pytest.raises(LabError, match=r"v5e.*h100.*cpu-local"):
        profile("v7x")
    with pytest.raises(LabError, match="tpu v5 lite"):
        profile_for_device_kind("AMD MI300X")


def test_profiles_are_keyed_by_their_names():
    assert all(chip.name == name for name, chip in PROFILES.items())


def test_cpu_probe_measures_positive_finite_numbers():
    cpu = measure_cpu_profile(copy_bytes=8 * 2**20, matmul_size=128, repeats=2)
    assert cpu.name == "cpu-local" and cpu.torus_dims == 0 and cpu.dcn_bandwidth is None
    for figure in (cpu.hbm_bandwidth, cpu.link_bandwidth, cpu.peak_bf16_flops):
        assert figure > 0 and math.isfinite(figure)
    assert "share" in cpu.note


def test_cpu_probe_rejects_nonsense_arguments():
    with pytest.raises(LabError, match="positive"):
        measure_cpu_profile(copy_bytes=0)


def test_hopper_fp8_is_twice_bf16_and_the_two_networks_are_nvlink_over_infiniband():
    for name in ("h100", "h200"):
        chip = profile(name)
        assert chip.peak_fp8_flops == pytest.approx(2 * chip.peak_bf16_flops, rel=1e-3)  # datasheets: 1979 vs 989
        assert chip.link_bandwidth / chip.dcn_bandwidth == 9  # 450 GB/s NVLink against one 400 Gb/s NIC
    assert profile("v5e").peak_fp8_flops is None


def test_compile_only_gpu_kinds_map_to_their_profile():
    from lab.targets.gpu import SPECS

    for name, gpu in SPECS.items():
        assert profile_for_device_kind(gpu.device_kind).name == name


def test_each_chip_prices_matmuls_only_at_the_precisions_its_maker_publishes():
    for name, int8_over_bf16 in (("v4", 1), ("v5e", 2), ("v5p", 2), ("v6e", 2), ("h100", 2)):
        chip = profile(name)
        assert chip.matmul_peak("int8") == pytest.approx(int8_over_bf16 * chip.peak_bf16_flops, rel=0.01)
    assert profile("v6e").matmul_peak("fp8") == pytest.approx(
        profile("v6e").peak_bf16_flops, rel=0.01
    )  # as bf16 (Cloud)
    for name in ("v4", "v5e"):
        assert set(profile(name).matmul_peaks) == {"bf16", "int8"}
        with pytest.raises(LabError, match="publishes no fp8 matmul peak"):
            profile(name).matmul_peak("fp8")
