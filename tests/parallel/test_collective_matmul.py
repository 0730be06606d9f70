"""lab.parallel.collective_matmul: each collective matmul against its plain twin, and the schedule XLA gives it."""

import numpy as np
import pytest

from lab.errors import LabError
from lab.hlo.schedule import timeline
from lab.mesh import MeshSpec
from lab.parallel.collective_matmul import VARIANTS, build_matmul

SHAPE = (64, 32, 48)  # M, K, F: every split dimension a multiple of 8


@pytest.fixture(scope="module")
def ring_mesh(devices):
    return MeshSpec(tensor=8).build(devices)


@pytest.fixture(scope="module")
def compiled(ring_mesh):
    """Every variant compiled once, with its inputs and output."""
    out = {}
    for name in VARIANTS:
        program = build_matmul(name, ring_mesh, "tensor", SHAPE)
        x, w = program.example_inputs()
        executable = program.fn.lower(*program.abstract_inputs()).compile()
        out[name] = (executable, (x, w), np.asarray(executable(x, w)))
    return out


@pytest.mark.parametrize("name", list(VARIANTS))
def test_every_variant_computes_x_at_w(compiled, name):
    _, (x, w), y = compiled[name]
    np.testing.assert_allclose(y, np.asarray(x) @ np.asarray(w), rtol=1e-5, atol=1e-5)


def test_the_all_gather_rings_match_the_plain_program_exactly(compiled):
    plain = compiled["all-gather then matmul"][2]
    assert np.array_equal(compiled["ring all-gather matmul"][2], plain)
    assert np.array_equal(compiled["bidirectional all-gather matmul"][2], plain)


def test_the_ring_interleaves_n_minus_1_permutes_with_its_products(compiled):
    text = compiled["ring all-gather matmul"][0].as_text()
    line = timeline(text)
    assert line.count("C") == 7 and "CC" not in line  # XLA:CPU: synchronous permutes, a product after each
    assert timeline(compiled["all-gather then matmul"][0].as_text()) == "CM"


def test_a_matrix_the_ring_does_not_divide_is_refused(ring_mesh):
    with pytest.raises(LabError, match="M=60 is not a positive multiple of 8"):
        build_matmul("ring all-gather matmul", ring_mesh, "tensor", (60, 32, 48))
    with pytest.raises(LabError, match="K=30"):
        build_matmul("ring matmul reduce-scatter", ring_mesh, "tensor", (64, 30, 48))
    with pytest.raises(LabError, match="unknown matmul variant"):
        build_matmul("telepathy", ring_mesh, "tensor", SHAPE)
    with pytest.raises(LabError, match="not a mesh axis"):
        build_matmul("ring all-gather matmul", ring_mesh, "rows", SHAPE)
