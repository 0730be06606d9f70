"""The layout space: every factorisation the model allows, and nothing it does not (against a brute force)."""

import itertools
import math
from dataclasses import replace

import pytest

from lab.errors import LabError
from lab.mesh import AXES
from lab.model import ModelConfig
from lab.plan.space import Problem, check_problem, layouts, meshes, micro_batch_choices
from lab.targets.hardware import profile

SMALL = ModelConfig(vocab=512, embed=128, heads=4, kv_heads=2, head_dim=32, mlp=384, layers=6, seq=64)


def problem(model=SMALL, sequences=16, torus=(2, 4), slices=1):
    return Problem(model, sequences, profile("v5e"), torus, "v5e:" + "x".join(map(str, torus)), slices)


def brute_force(p: Problem) -> set[tuple[int, ...]]:
    """Every 5-tuple of sizes 1..N with product N, filtered by the rules as the module docstring states them."""
    m, n = p.model, p.chips
    found = set()
    for sizes in itertools.product(range(1, n + 1), repeat=5):
        if math.prod(sizes) != n:
            continue
        data, stage, fsdp, expert, tensor = sizes
        if m.heads % tensor or m.groups % tensor or m.mlp % tensor:
            continue
        if m.layers % stage or m.embed % fsdp:
            continue
        if (m.experts and m.experts % expert) or (not m.experts and expert != 1):
            continue
        if p.sequences % (data * fsdp * expert):
            continue
        found.add(sizes)
    return found


@pytest.mark.parametrize(
    "p",
    [
        problem(),
        problem(sequences=4),  # the batch limits data x fsdp
        problem(replace(SMALL, layers=5), torus=(4, 4)),  # 5 layers: stage 1 only
        problem(replace(SMALL, experts=4, mlp=64), torus=(4, 4), sequences=32),  # MoE: expert ways
        problem(replace(SMALL, heads=6, kv_heads=3, mlp=96), torus=(2, 2, 3)),  # 12 chips, odd factors
    ],
)
def test_every_factorisation_and_nothing_that_violates_divisibility(p):
    enumerated = [tuple(m.sizes[a] for a in AXES) for m in meshes(p)]
    assert len(enumerated) == len(set(enumerated))
    assert set(enumerated) == brute_force(p)


def test_layouts_cross_meshes_with_remat_micro_batches_and_the_slices_axis():
    p = problem(torus=(2, 2), slices=2, sequences=8)
    found = list(layouts(p))
    assert {x.remat for x in found} == {"none", "minimal", "full"}
    assert all(x.sizes[x.slices_axis] % 2 == 0 for x in found)  # only an axis with a multiple of 2 crosses
    assert {x.slices_axis for x in found} >= {"data", "fsdp", "stage"}
    for x in found:
        assert x.micro_batches == 1 or x.sizes["stage"] > 1
        assert (p.sequences // x.batch_ways) % x.micro_batches == 0
    per_mesh = len({(str(x.mesh), x.slices_axis, x.micro_batches) for x in found})
    assert len(found) == 3 * per_mesh


def test_a_pipeline_offers_every_power_of_two_micro_batch_count_that_divides_a_shard():
    p = problem(sequences=24)
    from lab.mesh import MeshSpec

    assert micro_batch_choices(p, MeshSpec(stage=2, data=4)) == (1, 2, 6)  # a shard of 6 sequences
    assert micro_batch_choices(p, MeshSpec(fsdp=8)) == (1,)


def test_a_batch_no_layout_divides_is_one_line():
    with pytest.raises(LabError, match="no layout of 8 chips divides a batch of 3 sequences"):
        check_problem(problem(replace(SMALL, heads=1, kv_heads=1, layers=1), sequences=3))
