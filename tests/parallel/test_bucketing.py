"""lab.parallel.bucketing: bucket plans, bucketed all-reduces against per-tensor psums, the transformer's gradients."""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from lab import hlo
from lab.errors import LabError
from lab.mesh import MeshSpec
from lab.model import preset
from lab.parallel import bucketing

SHAPES = [(6, 5), (7,), (3, 4, 2)]  # 30 + 7 + 24 = 61 float32 elements


def leaves(shapes=SHAPES, dtype=jnp.float32):
    return [jax.ShapeDtypeStruct(s, dtype) for s in shapes]


@given(
    shapes=st.lists(st.lists(st.integers(1, 6), min_size=1, max_size=3), min_size=1, max_size=5),
    elements=st.integers(1, 200),
)
@settings(max_examples=60, deadline=None)
def test_a_plan_cuts_every_gradient_once_into_full_buckets(shapes, elements):
    plan = bucketing.plan_buckets(leaves([tuple(s) for s in shapes]), 4 * elements)
    total = sum(math.prod(s) for s in shapes)
    assert plan.count == math.ceil(total / elements) and plan.total_bytes == 4 * total
    assert all(b.elements == elements for b in plan.buckets[:-1]) and 0 < plan.buckets[-1].elements <= elements
    covered = {}
    for bucket in plan.buckets:
        assert sum(s.stop - s.start for s in bucket.segments) == bucket.elements
        for s in bucket.segments:
            covered.setdefault(s.leaf, []).append((s.start, s.stop))
    for leaf, spans in covered.items():  # each leaf's spans tile it exactly
        spans.sort()
        assert spans[0][0] == 0 and spans[-1][1] == math.prod(shapes[leaf])
        assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))


def test_the_last_gradient_goes_first_and_a_huge_bucket_is_one():
    plan = bucketing.plan_buckets(leaves(), 4 * 10)
    assert (
        plan.buckets[0].segments[0].leaf == len(SHAPES) - 1
    )  # backward order: the last layer's gradient is ready first
    everything = bucketing.plan_buckets(leaves(), bucketing.DDP_BUCKET_BYTES)
    assert everything.count == 1 and everything.holds_everything


@pytest.mark.parametrize(
    "size, words",
    [
        (0, "positive whole number"),
        (-4, "positive whole number"),
        (True, "positive whole number"),
        (2.5, "positive whole number"),
        (2, "smaller than one float32"),
    ],
)
def test_bad_bucket_sizes_are_refused(size, words):
    with pytest.raises(LabError, match=words):
        bucketing.plan_buckets(leaves(), size)


def test_mixed_dtypes_and_wrong_shapes_are_refused(mesh222):
    with pytest.raises(LabError, match="several dtypes"):
        bucketing.plan_buckets([jax.ShapeDtypeStruct((4,), jnp.float32), jax.ShapeDtypeStruct((4,), jnp.bfloat16)], 64)
    plan = bucketing.plan_buckets(leaves(), 64)
    with pytest.raises(LabError, match="differ from the plan"):
        bucketing.bucketed_psum([jnp.ones((2,))], "data", plan)


@pytest.fixture(scope="module")
def data_mesh(devices):
    return MeshSpec(data=8).build(devices)


@pytest.fixture(scope="module")
def stacked(data_mesh):
    rng = np.random.default_rng(0)
    return [
        jax.device_put(rng.standard_normal((8, *s)).astype(np.float32), NamedSharding(data_mesh, P("data")))
        for s in SHAPES
    ]


def _all_reduces(compiled, mesh) -> int:
    found, _ = hlo.parse_collectives(compiled.as_text(), mesh.devices.shape, mesh.axis_names)
    return sum(c.kind == "all-reduce" for c in found)


def test_buckets_sum_exactly_like_per_tensor_psums_one_all_reduce_each(data_mesh, stacked):
    plan = bucketing.plan_buckets(leaves(), 4 * 16)  # 4 buckets
    bucketed = bucketing.reduce_program(plan, data_mesh, "data").lower(stacked).compile()
    assert _all_reduces(bucketed, data_mesh) == plan.count == 4
    sums = [np.asarray(x) for x in bucketed(stacked)]
    for got, leaf in zip(sums, stacked):
        np.testing.assert_allclose(got, np.asarray(leaf).sum(0), rtol=1e-6, atol=1e-6)
    per_tensor = bucketing.reduce_program(None, data_mesh, "data")(stacked)
    assert all(np.array_equal(a, np.asarray(b)) for a, b in zip(sums, per_tensor))


def test_xla_cpu_combines_independent_bucket_all_reduces_back_into_one(data_mesh, stacked):
    plan = bucketing.plan_buckets(leaves(), 4 * 16)
    loose = bucketing.reduce_program(plan, data_mesh, "data", keep_apart=False).lower(stacked).compile()
    assert _all_reduces(loose, data_mesh) == 1


def test_launch_cost_programs_chain_count_all_reduces(data_mesh):
    programs = bucketing.launch_cost_programs(data_mesh, "data", count=5)
    assert _all_reduces(programs["chain"][0], data_mesh) == 5 and _all_reduces(programs["single"][0], data_mesh) == 1


def test_summed_local_gradients_are_n_times_the_global_batch_gradient(data_mesh):
    """The reference twin: psum of the per-device gradients = N * the gradient of the mean loss over the whole batch."""
    from flax import nnx

    from lab.model import abstract_model, next_token_loss

    config = preset("tiny")
    problem = bucketing.gradient_problem(config, data_mesh)
    reduced = bucketing.step_program(problem, bucketing.plan_buckets(problem.leaves, 64 * 1024))(
        problem.params, problem.tokens
    )
    graphdef, _ = abstract_model(config)

    class Whole:
        compute_dtype, remat_policy = jnp.float32, None

        def use(self, param):
            return param[...]

    tokens = np.asarray(problem.tokens)
    params = jax.tree.map(np.asarray, problem.params)
    expected = jax.jit(
        jax.grad(lambda p: next_token_loss(nnx.merge(graphdef, p)(tokens[:, :-1], Whole()), tokens[:, 1:]))
    )(params)
    for got, want in zip(reduced, jax.tree.leaves(expected)):
        np.testing.assert_allclose(np.asarray(got), 8 * np.asarray(want), rtol=2e-4, atol=2e-6)
    assert len(problem.leaves) == 11


def test_gradient_problem_needs_a_mesh_axis(data_mesh):
    with pytest.raises(LabError, match="not a mesh axis"):
        bucketing.gradient_problem(preset("tiny"), data_mesh, axis="batch")
