"""Mesh axes on TPU tori: placement from device coords, and predicted collective times."""

import pytest

from lab import theory
from lab.mesh import MeshSpec
from lab.targets.devices import topology_devices
from lab.targets.hardware import profile
from lab.targets.topology import placement, predict, slice_shape


@pytest.fixture(scope="module")
def v5e_4x4():
    return topology_devices("v5e:4x4")


def test_slice_shape_from_coords(v5e_4x4):
    assert slice_shape(v5e_4x4) == (4, 4, 1)


def test_each_axis_lands_on_one_torus_dimension(v5e_4x4):
    mesh = MeshSpec(fsdp=4, tensor=4).build(v5e_4x4)
    tensor, fsdp = placement(mesh, ("tensor",)), placement(mesh, ("fsdp",))
    assert tensor.network == fsdp.network == "ici"
    assert {tensor.torus_dims, fsdp.torus_dims} == {(0,), (1,)}
    assert placement(mesh, ("fsdp", "tensor")).torus_dims == (0, 1)
    # v5e wraps an axis only at 16 chips: a 4x4 slice is lines, not rings
    assert tensor.wraps == (False,) and str(tensor).endswith("line")


def test_a_full_v4_cube_dimension_is_a_ring_and_a_part_of_one_is_a_line():
    mesh = MeshSpec(data=2, fsdp=2, tensor=16).build(topology_devices("v4:4x4x4"))
    assert placement(mesh, ("tensor",)).wraps == (True, True)
    data = placement(mesh, ("data",))
    assert data.extents == (2,) and data.wraps == (False,)


def test_slices_are_joined_by_dcn():
    mesh = MeshSpec(data=2, tensor=4).build(topology_devices("v5e:2x2", 2))
    assert placement(mesh, ("data",)).network == "dcn"
    assert placement(mesh, ("tensor",)).network == "ici"


def test_an_axis_over_slices_and_chips_runs_in_two_tiers():
    from lab.predict.priced import build_mesh

    chip = profile("v5e")
    mesh = build_mesh("data=2,tensor=2", topology_devices("v5e:2x2", 2), 2, "data")  # data: 2 chips x 2 slices
    data = placement(mesh, ("data",))
    assert (data.network, data.devices, data.nodes, data.per_node) == ("dcn", 4, 2, 2)
    assert str(data).startswith("DCN across 2 slices, ICI ") and str(data).endswith(" within each")
    size = 64 * 2**20
    cost = predict("all-reduce", size, data, chip)
    ici = theory.predict_on_rings("all-reduce", size, chip, data.extents, data.wraps)
    dcn = theory.predict_on_switch("all-reduce", size / 2, chip, 2, network="dcn")
    assert cost.seconds == pytest.approx(ici.seconds + dcn.seconds) and cost.devices == 4
    # a permute is priced flat on DCN over the group
    flat = theory.predict_on_switch("collective-permute", size, chip, 4, network="dcn")
    assert predict("collective-permute", size, data, chip).seconds == pytest.approx(flat.seconds)


def test_an_axis_over_slices_and_one_chips_two_devices_pays_dcn_alone():
    """TPU7x: an axis over the two chiplets of one chip in each of 2 slices meets die to die, then on DCN (S / 2)."""
    from lab.predict.priced import build_mesh

    chip = profile("tpu7x")
    mesh = build_mesh("fsdp=4,tensor=2", topology_devices("tpu7x:2x2x1", 2), 2, "tensor")  # 2 devices x 2 slices
    tensor = placement(mesh, ("tensor",))
    assert (tensor.network, tensor.devices, tensor.nodes, tensor.torus_dims) == ("dcn", 4, 2, ())
    size = 64 * 2**20
    dcn = theory.predict_on_switch("all-reduce", size / 2, chip, 2, network="dcn")
    assert predict("all-reduce", size, tensor, chip).seconds == pytest.approx(dcn.seconds)


def test_predicted_times_follow_the_placement():
    chip = profile("v5e")
    mesh = MeshSpec(data=2, tensor=4).build(topology_devices("v5e:2x2", 2))
    size = 64 * 2**20
    ici = predict("all-gather", size, placement(mesh, ("tensor",)), chip)
    dcn = predict("all-gather", size, placement(mesh, ("data",)), chip)
    assert dcn.seconds > 10 * ici.seconds  # DCN per chip is an order of magnitude below ICI
    # by hand: two lines of 2 chips (no wraparound), (N-1)/N of S over one link per dimension
    expected = theory.predict_on_rings("all-gather", size, chip, (2, 2), (False, False))
    assert ici == expected and ici.bytes_sent == pytest.approx(size * 3 / 4)


def test_multislice_hlo_numbers_devices_within_one_slice():
    from lab.collectives import build_program
    from lab.hlo import inspect
    from lab.mesh import slice_local_shape

    mesh = MeshSpec(data=2, fsdp=2, tensor=2).build(topology_devices("v5e:2x2", 2))
    assert slice_local_shape(mesh) == (1, 1, 2, 1, 2)
    program = build_program("all-reduce", mesh, ("fsdp",))
    found = inspect(program.fn, program.abstract_input(1024), mesh=mesh).collectives
    assert [(c.kind, c.axes, c.group_size) for c in found] == [("all-reduce", ("fsdp",), 2)]


def test_a_256_chip_slice_compiles_and_maps_its_axes():
    from lab.collectives import build_program
    from lab.hlo import inspect

    mesh = MeshSpec(fsdp=16, tensor=16).build(topology_devices("v6e:16x16"))
    assert {placement(mesh, (a,)).torus_dims for a in ("fsdp", "tensor")} == {(0,), (1,)}
    assert placement(mesh, ("tensor",)).wraps == (True,)  # v6e wraps an axis of 16 chips
    program = build_program("all-gather", mesh, ("tensor",))
    found = inspect(program.fn, program.abstract_input(2**20), mesh=mesh).collectives
    assert [(c.axes, c.group_size) for c in found] == [(("tensor",), 16)]


def test_cpu_devices_get_a_host_placement_and_no_prediction(mesh222):
    where = placement(mesh222, ("fsdp",))
    assert (where.network, where.devices) == ("host", 2)
    assert predict("all-reduce", 2**20, where, profile("h100")) is None


def test_a_collective_across_nodes_is_bounded_by_its_slower_tier():
    from lab.targets.topology import Placement

    chip, size = profile("h100"), 64 * 2**20
    one_per_node = Placement(("fsdp",), 4, "infiniband", nodes=4)
    assert predict("all-gather", size, one_per_node, chip) == theory.predict_on_switch(
        "all-gather", size, chip, 4, network="dcn"
    )
    # 8 GPUs in each of 32 nodes: IB carries (M-1)/M of S/8 per NIC, NVLink (8-1)/8 of S; IB is slower here
    full = predict("all-reduce", size, Placement(("fsdp",), 256, "infiniband", nodes=32), chip)
    ib = theory.predict_on_switch("all-reduce", size / 8, chip, 32, network="dcn")
    assert full.seconds == ib.seconds and full.devices == 256 and "IB tier" in full.algorithm
    within = predict("all-reduce", size, Placement(("tensor",), 8, "nvlink"), chip)
    assert within == theory.predict_on_switch("all-reduce", size, chip, 8, network="link")
    assert within.bytes_sent == pytest.approx(2 * 7 / 8 * size)  # NCCL's ring: 2(N-1)/N·S per GPU


def test_sibling_groups_on_one_chip_share_its_links():
    """TPU7x: fsdp across chips with tensor inside each chip runs two fsdp groups at once over every chip's ports,
    each at half the chip's bandwidth; fsdp over both chiplets of every chip has the ports to itself."""
    from dataclasses import replace

    from lab.predict.priced import build_mesh

    chip = profile("tpu7x")
    devices = topology_devices("tpu7x:2x2x2")
    shared = placement(build_mesh("fsdp=8,tensor=2", devices, 1, "data"), ("fsdp",))
    whole = placement(build_mesh("fsdp=16", devices, 1, "data"), ("fsdp",))
    assert (shared.sharers, whole.sharers) == (2, 1)
    assert (shared.extents, shared.wraps) == (whole.extents, whole.wraps) and "shared by 2 groups" in str(shared)
    size = 64 * 2**20
    half = replace(chip, link_bandwidth=chip.link_bandwidth / 2)
    expected = theory.predict_on_rings("all-gather", size, half, shared.extents, shared.wraps)
    assert predict("all-gather", size, shared, chip).seconds == pytest.approx(expected.seconds)
    alone = theory.predict_on_rings("all-gather", size, chip, whole.extents, whole.wraps)
    assert predict("all-gather", size, whole, chip) == alone
    assert predict("all-gather", size, shared, chip).seconds > 1.5 * alone.seconds
