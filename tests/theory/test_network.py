"""lab.theory.network: collectives on a TPU torus and a switched network, against the scaling book's worked answers."""

import pytest

from lab.errors import LabError
from lab.targets.hardware import profile
from lab.theory.network import predict_on_switch, predict_on_torus

MiB = 2**20


B, D = 1024, 4096  # Part 3, "Some Problems to Work", Question 2: bf16[B_X, D_Y] on a TPU v4p 4x4x4


def test_book_q2_all_gather_over_one_wrapped_axis():
    # AllGather_X([B_X, D_Y]) gathers 2BD/Y bytes: the book's answer 2BD / (9e10 Y) = 23 us is the large-axis
    # limit V / W_ici; the ring's exact (N-1)/N share is 3/4 of it.
    gathered = 2 * B * D / 4
    result = predict_on_torus("all-gather", gathered, profile("v4"), (4, 4, 4), (0,))
    assert (result.links, result.steps) == (2, 2)
    assert result.seconds == result.transfer_s == pytest.approx(3 / 4 * gathered / 9e10)
    assert result.transfer_s * 4 / 3 == pytest.approx(2 * B * D / (9e10 * 4))
    assert round(result.transfer_s * 4 / 3 * 1e6) == 23


def test_book_q2_all_gather_over_two_axes_doubles_the_bandwidth():
    result = predict_on_torus("all-gather", 2 * B * D, profile("v4"), (4, 4, 4), (0, 1))
    assert result.links == 4
    assert result.transfer_s * 16 / 15 == pytest.approx(2 * B * D / 1.8e11)  # book: "2BD / 1.8e11 seconds, or 46 us"


def test_book_q3_tiny_all_gather_is_latency_bound():
    # AllGather_X([B_X]) with B = 128 in bf16: "we can do the full gather in only 2 hops, so roughly 2us"
    result = predict_on_torus("all-gather", 2 * 128, profile("v4"), (4, 4, 4), (0,))
    assert result.seconds == result.latency_s == pytest.approx(2e-6)


def test_book_pop_quiz_2_v5e_without_wraparound():
    # v5e mesh {X: 8, Y: 4}: AllGather_Y of bf16[2048, 8192]; no wraparound below 16, so
    # "3 * 8.4e6 / 4.5e10 = 560us" (3 hops of a 1/4 shard, one way)
    result = predict_on_torus("all-gather", 2 * 2048 * 8192, profile("v5e"), (8, 4), (1,))
    assert (result.links, result.steps) == (1, 3)
    assert result.seconds == pytest.approx(560e-6, rel=0.01)


def test_torus_all_reduce_is_twice_and_all_to_all_a_quarter_of_an_all_gather():
    v5p, size = profile("v5p"), 64 * MiB
    gather = predict_on_torus("all-gather", size, v5p, (8, 8, 8), (2,))
    assert predict_on_torus("all-reduce", size, v5p, (8, 8, 8), (2,)).transfer_s == pytest.approx(2 * gather.transfer_s)
    # Part 3: "An AllToAll ... is thus 1/4 the cost of an AllGather" of the same global array V = N * S.
    all_to_all = predict_on_torus("all-to-all", size / 8, v5p, (8, 8, 8), (2,))
    assert all_to_all.transfer_s == pytest.approx(size / (4 * 2 * v5p.link_bandwidth))


def test_torus_rejects_a_switched_chip_and_bad_dims():
    with pytest.raises(LabError, match="predict_on_switch"):
        predict_on_torus("all-gather", MiB, profile("h100"), (8,), (0,))
    with pytest.raises(LabError, match="distinct indices"):
        predict_on_torus("all-gather", MiB, profile("v5p"), (4, 4, 4), (0, 0))
    with pytest.raises(LabError, match="collective_cost"):
        predict_on_torus("broadcast", MiB, profile("v5p"), (4, 4, 4), (0,))


def test_book_gpu_pop_quiz_1_h100_node_all_gather():
    # Part 12: AllGather(bf16[B_X, F]) on 8xH100, B = 1024, F = 16384: "more precisely 65us"
    result = predict_on_switch("all-gather", 2 * 1024 * 16384, profile("h100"), 8)
    assert result.seconds == pytest.approx(65e-6, rel=0.01)


def test_gpu_all_to_all_in_a_node_is_b_over_w_n():
    # Part 12: B (N-1) / (W N^2) for B global bytes, i.e. (N-1)/N of one device's buffer over W
    h100, per_device = profile("h100"), 8 * MiB
    result = predict_on_switch("all-to-all", per_device, h100, 8)
    assert result.transfer_s == pytest.approx(8 * per_device * 7 / (h100.link_bandwidth * 64))


def test_dcn_uses_the_per_chip_data_centre_bandwidth():
    v5p = profile("v5p")
    across_slices = predict_on_switch("all-reduce", 64 * MiB, v5p, 4, network="dcn")
    assert across_slices.seconds == pytest.approx(2 * 3 / 4 * 64 * MiB / v5p.dcn_bandwidth)
    with pytest.raises(LabError, match="no data-centre network"):
        predict_on_switch("all-reduce", MiB, profile("cpu"), 4, network="dcn")
