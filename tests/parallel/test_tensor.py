"""Tensor and sequence parallelism: numerics against the model itself, collectives in the HLO, bad input."""

import functools
from dataclasses import replace

import jax
import numpy as np
import optax
import pytest

from lab import hlo
from lab.errors import LabError
from lab.mesh import MeshSpec
from lab.model import ModelConfig
from lab.parallel.tensor import TensorParallel, reference_loss, train_step

pytestmark = (
    pytest.mark.long
)  # a training step compiled per tensor-parallel variant: scheduled first (tests/conftest.py)

MODEL = ModelConfig(layers=2, seq=16)
BATCH, STEPS = 4, 2
OPTIMIZER = optax.adamw(1e-2)


@pytest.fixture(scope="module")
def mesh(devices):
    return MeshSpec.parse("data=2,tensor=4").build(devices)


@pytest.fixture(scope="module")
def reference_losses(mesh):
    """The model's own loss, on one device, over a few AdamW steps."""
    tp = TensorParallel(MODEL, mesh)
    params, tokens = jax.device_get(tp.init()), jax.device_get(tp.batch(BATCH))
    step = train_step(lambda p, t: reference_loss(MODEL, p, t), OPTIMIZER)
    return _run(step, params, tokens)


def _run(step, params, tokens) -> list[float]:
    state, losses = OPTIMIZER.init(params), []
    for _ in range(STEPS):
        params, state, loss = step(params, state, tokens)
        losses.append(float(loss))
    return losses


@pytest.fixture(
    scope="module",
    params=[(False, "shard_map"), (True, "shard_map"), (False, "annotations"), (True, "annotations")],
    ids=["tp-shard_map", "tp+sp-shard_map", "tp-annotations", "tp+sp-annotations"],
)
def parallel_run(request, mesh):
    return _parallel_run(mesh, *request.param)


@functools.cache
def _parallel_run(mesh, sequence_parallel: bool, style: str):
    """A few AdamW steps under one layout, and the collectives of its compiled step."""
    tp = TensorParallel(MODEL, mesh, sequence_parallel, style)
    params, tokens = tp.init(), tp.batch(BATCH)
    step = tp.step(OPTIMIZER)
    with jax.set_mesh(mesh):
        text = jax.jit(step).lower(params, OPTIMIZER.init(params), tokens).compile().as_text()
    collectives, _ = hlo.parse_collectives(text, mesh.devices.shape, mesh.axis_names)
    return tp, _run(step, params, tokens), hlo.summarize(collectives)


def test_matches_the_single_device_model_step_by_step(parallel_run, reference_losses):
    _, losses, _ = parallel_run
    np.testing.assert_allclose(losses, reference_losses, rtol=2e-5)
    assert losses[-1] < losses[0]  # the steps did train


def test_activation_collectives_run_over_tensor(parallel_run):
    tp, _, totals = parallel_run
    kinds = {t.kind for t in totals if t.axes == ("tensor",)}
    if tp.sequence_parallel:
        assert "all-gather" in kinds  # before each column-parallel matmul
    else:
        assert kinds == {"all-reduce"}  # after each row-parallel matmul, nothing else


def test_shard_map_sequence_parallel_swaps_all_reduce_for_reduce_scatter(mesh):
    _, _, totals = _parallel_run(mesh, True, "shard_map")
    by_kind = {t.kind: t for t in totals if t.axes == ("tensor",)}
    assert by_kind["reduce-scatter"].count == by_kind["all-gather"].count
    assert by_kind["reduce-scatter"].total_bytes == by_kind["all-gather"].total_bytes  # same bytes each way


@pytest.mark.parametrize(
    "model, sequence_parallel, dimension",
    [
        (replace(MODEL, heads=6), False, "heads=6"),
        (replace(MODEL, mlp=250), False, "mlp"),
        (replace(MODEL, vocab=254), False, "vocab=254"),
        (replace(MODEL, seq=18), True, "seq=18"),
    ],
)
def test_sizes_tensor_does_not_divide_name_the_dimension_and_axis(mesh, model, sequence_parallel, dimension):
    with pytest.raises(LabError, match=f"{dimension}.*mesh axis tensor=4"):
        TensorParallel(model, mesh, sequence_parallel)


def test_sequence_tensor_does_not_divide_is_fine_without_sp(mesh):
    assert TensorParallel(replace(MODEL, seq=18), mesh).ways == 4


def test_a_batch_data_does_not_divide_is_refused(mesh):
    with pytest.raises(LabError, match="global batch 3 is not divisible by mesh axis data=2"):
        TensorParallel(MODEL, mesh).batch(3)


def test_unknown_style_and_busy_axes_are_refused(devices, mesh):
    with pytest.raises(LabError, match="unknown tensor-parallel style"):
        TensorParallel(MODEL, mesh, style="gspmd")
    with pytest.raises(LabError, match="fsdp=2; set it to 1"):
        TensorParallel(MODEL, MeshSpec.parse("fsdp=2,tensor=4").build(devices))


def test_saved_activations_list_the_residuals_and_the_weights_they_include(devices):
    """The residuals of one block's backward: each array's bytes plus an 8-byte pointer each is XLA's output size,
    the block's weights among them; sequence parallelism splits what tensor parallelism alone keeps whole."""
    import math

    import jax.numpy as jnp

    kept = {}
    for sequence_parallel in (False, True):
        tp = TensorParallel(MODEL, MeshSpec.parse("tensor=4").build(devices[:4]), sequence_parallel)
        saved = tp.saved_activations(2)
        arrays = sum(math.prod(shape) * jnp.dtype(dtype).itemsize for dtype, shape in saved.residuals)
        assert saved.output_bytes == arrays + 8 * len(saved.residuals)
        assert saved.weight_bytes == sum(  # one block's weights, each split 4 ways but the two norm scales, in bf16
            2 * n
            for n in (
                4 * MODEL.embed * MODEL.heads * MODEL.head_dim // 4,
                2 * MODEL.embed * MODEL.mlp // 4,
                2 * MODEL.embed,
            )
        )
        assert tp.saved_activation_bytes(2) == saved.output_bytes - saved.weight_bytes
        kept[sequence_parallel] = saved.output_bytes - saved.weight_bytes
    assert kept[True] < kept[False]
