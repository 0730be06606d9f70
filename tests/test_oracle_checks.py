"""The oracle checks: the scaling book's worked answers against lab.theory and the TPU compiler (compile-only)."""

from dataclasses import fields

import pytest

from experiments import get
from experiments.q50_oracle_checks import (
    EXAMPLES,
    Config,
    compile_example,
    large_n_limit_seconds,
    predict,
    run,
)
from lab.devices import topology_devices
from lab.errors import LabError
from lab.mesh import MeshSpec
from lab.report import render
from lab.topology import placement

EXAMPLE = {e.name: e for e in EXAMPLES}
B, D = 1024, 4096


@pytest.fixture(scope="module")
def result():
    return get("oracle_checks").run(Config())  # through the registry, which names the page


def test_registered_under_its_question():
    experiment = get("oracle_checks")
    assert experiment.question == "#50"
    assert fields(experiment.config)[0].name == "target"


def test_book_formulas_by_hand():
    # Question 2.1: the book's 2BD / (9e10 Y) is the lab's large-N limit; the ring's exact time is 3/4 of it.
    gather_x = predict(EXAMPLE["v4-gather-x"])
    assert large_n_limit_seconds(gather_x) == pytest.approx(2 * B * D / (9e10 * 4))
    assert gather_x.seconds == pytest.approx(3 / 4 * 2 * B * D / (9e10 * 4))
    # Question 2.3: two axes, 16 chips: 2BD / 1.8e11 in the limit.
    assert large_n_limit_seconds(predict(EXAMPLE["v4-gather-xy"])) == pytest.approx(2 * B * D / 1.8e11)
    # Pop Quiz 2: no wraparound on v5e's axis of 4: 3 hops of a quarter, one way.
    assert predict(EXAMPLE["v5e-gather-no-wrap"]).seconds == pytest.approx(3 / 4 * 2 * 2048 * 8192 / 4.5e10)


def test_verdicts_are_honest_about_the_book(result):
    verdicts = {c.quantity: c.verdict for c in result.checks}
    assert verdicts["Part 3, Question 2.1: all-gather time (us)"] == "refined"  # 17.5 us exact against the book's 23
    assert verdicts["Part 3, Question 2.1: lab's large-N limit (us)"] == "agrees"
    assert verdicts["Part 3, Question 3: all-gather time (us)"] == "agrees"  # latency-bound: 2 hops
    assert verdicts["Part 12, GPU Pop Quiz 1: all-gather time (us)"] == "agrees"
    # The book charges one pass for an all-reduce in Question 2.4; the lab does not pretend to agree.
    assert [c.quantity for c in result.checks if c.verdict == "differs"] == [
        "Part 3, Question 2.4: all-reduce time (us)"
    ]
    assert all(c.note for c in result.checks if c.verdict == "refined")


def test_compiled_programs_match_what_the_book_assumes(result):
    program_checks = [c for c in result.checks if " on tpu:" in c.quantity]
    assert len(program_checks) == 4 * sum(e.program is not None for e in EXAMPLES)
    assert all(c.passed for c in program_checks)
    # The one refinement: the TPU compiler all-reduces a zero-padded buffer for the tiny gather.
    assert [(c.quantity, c.observed) for c in program_checks if c.verdict == "refined"] == [
        ("Part 3, Question 3 on tpu:v4:4x4x4: collective the compiler wrote", "all-reduce")
    ]


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
    quick = run(Config(examples=("h100-node-gather",), compile_programs=False))
    assert [c.verdict for c in quick.checks] == ["agrees"]
    assert len(quick.tables) == 1
    with pytest.raises(LabError, match="unknown example"):
        run(Config(examples=("v9-nothing",)))
