"""The oracle checks: the scaling book's worked answers against lab.theory (unit tests) and the TPU compiler (page)."""

import pytest

from experiments.q50_oracle_checks import EXAMPLES, Config, compile_example, large_n_limit_seconds, predict
from lab.errors import LabError
from lab.mesh import MeshSpec
from lab.registry import get
from lab.report import render
from lab.targets.devices import topology_devices
from lab.targets.topology import placement
from tests.experiments.support import pinned

EXAMPLE = {e.name: e for e in EXAMPLES}
B, D = 1024, 4096
BOOK_ROUNDING = 0.05  # the book rounds its answers to two significant figures


@pytest.fixture(scope="module")
def result():
    return get("oracle_checks").run(Config())  # through the registry, which names the page


def test_registered_under_its_question():
    assert get("oracle_checks").question == "#50"


def test_book_formulas_by_hand():
    # Question 2.1: the book's 2BD / (9e10 Y) is the lab's large-N limit; the ring's exact time is 3/4 of it.
    gather_x = predict(EXAMPLE["v4-gather-x"])
    assert large_n_limit_seconds(gather_x) == pytest.approx(2 * B * D / (9e10 * 4))
    assert gather_x.seconds == pytest.approx(3 / 4 * 2 * B * D / (9e10 * 4))
    # Question 2.3: two axes, 16 chips: 2BD / 1.8e11 in the limit.
    assert large_n_limit_seconds(predict(EXAMPLE["v4-gather-xy"])) == pytest.approx(2 * B * D / 1.8e11)
    # Pop Quiz 2: no wraparound on v5e's axis of 4: 3 hops of a quarter, one way.
    assert predict(EXAMPLE["v5e-gather-no-wrap"]).seconds == pytest.approx(3 / 4 * 2 * 2048 * 8192 / 4.5e10)


@pytest.mark.parametrize("name", [e.name for e in EXAMPLES if e.large_n_limit])
def test_where_the_book_takes_the_large_n_limit_the_lab_gives_its_number_and_the_ring_share_of_it(name):
    example, cost = EXAMPLE[name], predict(EXAMPLE[name])
    assert large_n_limit_seconds(cost) == pytest.approx(example.book_seconds, rel=BOOK_ROUNDING)
    share = (cost.devices - 1) / cost.devices  # (N-1)/N of V: 3/4 on 4 chips, 15/16 on 16
    assert cost.seconds == pytest.approx(share * example.book_seconds, rel=BOOK_ROUNDING)


@pytest.mark.parametrize("name", ["v4-tiny-gather", "v5e-gather-no-wrap", "v5e-tiny-gather", "h100-node-gather"])
def test_the_lab_gives_the_books_exact_answers(name):
    assert predict(EXAMPLE[name]).seconds == pytest.approx(EXAMPLE[name].book_seconds, rel=BOOK_ROUNDING)


def test_question_2_4_the_book_charges_one_pass_for_an_all_reduce_and_the_lab_two():
    example, cost = EXAMPLE["v4-reduce-z"], predict(EXAMPLE["v4-reduce-z"])
    # book: 2BD / (16 · 9e10) = V / W_ici; lab: a bidirectional ring all-reduce, 2 (N-1)/N · V / W_ici, N = 4
    assert example.book_seconds == pytest.approx(example.size_bytes / 9e10, rel=BOOK_ROUNDING)
    assert cost.seconds == pytest.approx(2 * 3 / 4 * example.size_bytes / 9e10)
    assert cost.seconds / example.book_seconds == pytest.approx(1.5, rel=BOOK_ROUNDING)


def test_the_compiler_writes_what_the_book_assumes_but_an_all_reduce_for_the_tiny_gather(result):
    verdicts = pinned(result)
    assert len(verdicts) == 4 * sum(e.program is not None for e in EXAMPLES)
    assert {q for q, v in verdicts.items() if v != "agrees"} == {
        "Part 3, Question 3 on tpu:v4:4x4x4: collective the compiler wrote"
    }
    assert verdicts["Part 3, Question 3 on tpu:v4:4x4x4: collective the compiler wrote"] == "differs"
    assert all(c.kind == "exact" and c.rtol == 0 for c in result.checks)
    assert result.claims == []


def test_the_tiny_gather_is_an_all_reduce_of_a_zero_padded_buffer():
    found = compile_example(EXAMPLE["v4-tiny-gather"])
    assert [(c.kind, c.size_bytes) for c in found.collectives] == [("all-reduce", 256)]
    assert found.fed_by == ("dynamic-update-slice",)


def test_page_numbers_come_from_the_run(result):
    page = render(result)
    gather_x = predict(EXAMPLE["v4-gather-x"])
    assert f"{gather_x.seconds * 1e6:.3g} us" in page
    assert result.question == "#50" and result.question in page and "differ" in page


def test_v4_gives_one_device_per_chip():
    chips = topology_devices("v4:2x2x1")
    assert len(chips) == 4
    assert len({tuple(c.coords) for c in chips}) == 4


def test_mesh_axes_map_to_torus_dimensions():
    mesh = MeshSpec(data=8, fsdp=4).build(topology_devices("v5e:8x4"))
    assert placement(mesh, ("data",)).torus_dims == (0,)
    assert placement(mesh, ("fsdp",)).torus_dims == (1,)
    assert placement(mesh, ("data", "fsdp")).torus_dims == (0, 1)


def test_two_axis_gather_is_one_collective_over_both_axes():
    found = compile_example(EXAMPLE["v4-gather-xy"]).collectives
    assert [(c.kind, c.axes, c.group_size, c.size_bytes) for c in found] == [
        ("all-gather", ("data", "fsdp"), 16, 2 * B * D)
    ]


def test_reduced_config_and_bad_names():
    experiment = get("oracle_checks")
    quick = experiment.run(Config(examples=("h100-node-gather",), compile_programs=False))
    assert quick.checks == [] and len(quick.tables) == 1
    with pytest.raises(LabError, match="unknown example"):
        experiment.run(Config(examples=("v9-nothing",)))
