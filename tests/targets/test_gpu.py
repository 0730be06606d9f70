"""Compile-only GPU clusters: target configs from public specs, devices per node, compiled collectives per link."""

from pathlib import Path

import pytest

from lab import hlo
from lab.errors import LabError
from lab.mesh import MeshSpec
from lab.targets import gpu
from lab.targets.devices import devices_for, gpu_cluster_devices, parse_target
from lab.targets.hardware import B200, H100, H200, profile_for_device_kind
from lab.targets.topology import placement

pytestmark = pytest.mark.skipif(not gpu.cuda_plugin_installed(), reason="needs the gpu extra (CUDA plugin)")
DATA = Path(__file__).parents[1] / "data" / "hlo"


@pytest.mark.parametrize(
    "chip, profile, sms, capability",
    [
        ("h100", H100, 132, "major: 9 minor: 0"),
        ("h200", H200, 132, "major: 9 minor: 0"),
        ("b200", B200, 148, "major: 10 minor: 0"),
    ],
)
def test_the_spec_rebuilds_the_datasheet_peak_and_the_config_carries_it(chip, profile, sms, capability):
    spec = gpu.spec(chip)
    # Hopper: 132 SMs x 4096 x 1.83 GHz = 0.989 PFLOPS; Blackwell: 148 x 8192 x 1.856 GHz = 2.25 PFLOPS
    assert spec.peak_bf16_flops == pytest.approx(profile.peak_bf16_flops, rel=1e-3)
    text = gpu.target_config(spec)
    assert f"core_count: {sms}" in text and f"cuda_compute_capability {{ {capability} }}" in text
    assert f"memory_bandwidth: {int(profile.hbm_bandwidth)}" in text and f'"{spec.device_kind}"' in text


@pytest.mark.parametrize(
    "text, words",
    [
        ("gpu:a100:1x8", "unknown GPU 'a100'"),
        ("gpu:h100:8", "give gpu:<chip>:<nodes>x<gpus per node>"),
        ("gpu:h100:2x4x8", "give gpu:<chip>"),
        ("gpu:h100:0x8", "must be positive"),
        ("gpu:h100:2x16", "at most 8 GPUs"),
    ],
)
def test_bad_gpu_targets_are_one_line(text, words):
    with pytest.raises(LabError, match=words) as err:
        parse_target(text)
    assert "\n" not in str(err.value)


def test_each_node_is_one_process_and_the_kind_maps_to_the_profile(capfd):
    chips = devices_for("gpu:h100:2x4")
    assert len(chips) == 8 and {c.platform for c in chips} == {"gpu"}
    assert [c.process_index for c in chips] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert profile_for_device_kind(chips[0].device_kind) is H100
    assert capfd.readouterr().err == ""  # the plugin says nothing on a machine without a GPU


def test_placement_reads_the_node_not_the_device_order():
    chips = devices_for("gpu:h100:2x4")
    mesh = MeshSpec(fsdp=2, tensor=4).build(chips)
    assert placement(mesh, ("tensor",)).network == "nvlink"
    assert (placement(mesh, ("fsdp",)).network, placement(mesh, ("fsdp",)).nodes) == ("infiniband", 2)
    interleaved = [chips[i] for i in (0, 4, 1, 5, 2, 6, 3, 7)]  # tensor groups now pair GPUs of both nodes
    crossed = MeshSpec(fsdp=4, tensor=2).build(interleaved)
    where = placement(crossed, ("tensor",))
    assert (where.network, where.nodes, where.per_node) == ("infiniband", 2, 1)
    assert placement(crossed, ("fsdp",)).network == "nvlink"


def test_a_mesh_that_does_not_fit_the_cluster_is_a_lab_error():
    with pytest.raises(LabError):
        MeshSpec.parse("fsdp=3,tensor=8").build(devices_for("gpu:h100:2x4"))


def test_a_missing_plugin_says_what_to_install(monkeypatch):
    monkeypatch.setattr(gpu, "cuda_plugin_installed", lambda: False)
    with pytest.raises(LabError, match=r"needs JAX's CUDA plugin.*pip install -e '\.\[gpu\]'"):
        gpu_cluster_devices.__wrapped__("h100:3x8")  # past the cache: a fresh build


def test_a_plugin_that_cannot_build_the_cluster_says_so(monkeypatch):
    from jax.experimental import topologies

    def broken(*args, **kwargs):
        raise NotImplementedError("topology not implemented for cuda")

    monkeypatch.setattr(topologies, "get_topology_desc", broken)
    with pytest.raises(LabError, match=r"could not build gpu:h100:3x8 \(topology not implemented"):
        gpu_cluster_devices.__wrapped__("h100:3x8")


def test_xla_gpu_writes_async_nccl_pairs_over_the_axes_and_links():
    from lab.collectives import build_program

    mesh = MeshSpec(fsdp=2, tensor=4).build(devices_for("gpu:h100:2x4"))
    program = build_program("all-reduce", mesh, ("tensor",))
    found = hlo.inspect(program.fn, program.abstract_input(2**20), mesh=mesh)
    assert [(c.kind, c.form, c.axes, c.group_size) for c in found.collectives] == [
        # XLA:GPU keeps the NCCL start/done pair but marks it is_sync: it does not overlap this one
        ("all-reduce", "all-reduce-start/all-reduce-done (is_sync: run in place)", ("tensor",), 4)
    ]
    assert '"collective_backend_config"' in found.optimized_hlo and "is_scheduled=true" in found.optimized_hlo


def test_64_gpus_gather_over_infiniband_one_gpu_per_node():
    from lab.collectives import build_program

    mesh = MeshSpec(fsdp=8, tensor=8).build(devices_for("gpu:h100:8x8"))
    program = build_program("all-gather", mesh, ("fsdp",))
    found = hlo.inspect(program.fn, program.abstract_input(2**20), mesh=mesh).collectives
    assert [(c.kind, c.axes, c.group_size, c.is_async) for c in found] == [("all-gather", ("fsdp",), 8, False)]
    where = placement(mesh, ("fsdp",))
    assert (where.network, where.nodes, where.per_node) == ("infiniband", 8, 1)


def test_the_saved_gpu_module_parses_in_all_three_group_notations():
    text = (DATA / "gpu_h100_2x4_matmul.hlo").read_text()
    for notation in ("<=[2,4]T(1,0)", "<=[8]", "mesh['axis_0'=8"):
        assert f"replica_groups={notation}" in text or notation in text
    found, skipped = hlo.parse_collectives(text, (1, 1, 2, 1, 4))
    assert not skipped
    assert [(c.kind, c.axes, c.group_size, c.is_async) for c in found] == [
        ("all-gather", ("fsdp",), 2, False),  # "is_sync":true: the scheduler did not overlap these two
        ("all-gather", ("tensor",), 4, False),
        ("all-gather", ("fsdp", "tensor"), 8, True),
        ("all-gather", ("fsdp",), 2, True),
    ]
