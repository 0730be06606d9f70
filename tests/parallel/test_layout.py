"""The strategies' collectives in compiled HLO: what DDP, ZeRO-2 and ZeRO-3 move, and where."""

import math

import jax
import pytest
from flax import nnx

from lab.mesh import MeshSpec
from lab.model import preset
from lab.training.step import TrainConfig, Trainer

BATCH = 16
SCALAR = 16  # the loss all-reduce may ride along in a combined tuple: a few bytes
GRAD_NORM = "optimizer/reduce_sum"  # the gradient norm's per-parameter partial sums, combined into one all-reduce


def _compiled(devices, mesh, **config):
    trainer = Trainer(preset("tiny"), TrainConfig(**config), MeshSpec.parse(mesh).build(devices))
    return trainer, trainer.inspect_step(BATCH, to_read=True)


def _bytes(state) -> int:
    return sum(math.prod(v.shape) * 4 for v in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable)))


def _moved(program, kinds, axes, *, inside_loop=None) -> int:
    """Total S of the collectives of `kinds` over `axes` (loops counted by trip count), larger than the loss scalar,
    leaving out the gradient norm's."""
    return sum(
        c.size_bytes * c.repeats
        for c in program.collectives
        if c.kind in kinds
        and c.axes == axes
        and c.size_bytes > SCALAR
        and GRAD_NORM not in (c.op_name or "")
        and (inside_loop is None or (c.repeats > 1) == inside_loop)
    )


def test_ddp_all_reduces_the_gradients_once_per_step_after_all_micro_batches(devices):
    trainer, program = _compiled(devices, "data=8", strategy="ddp", micro_batches=2)
    model_bytes = _bytes(trainer.abstract_params)
    assert _moved(program, {"all-reduce"}, ("data",), inside_loop=False) == pytest.approx(model_bytes, abs=SCALAR)
    assert (
        _moved(program, {"all-reduce"}, ("data",), inside_loop=True) == 0
    )  # partial sums wait for the last micro-batch
    assert _moved(program, {"all-gather", "reduce-scatter"}, ("data",)) == 0


def test_zero2_reduces_every_micro_batch_and_gathers_the_updated_weights(devices):
    trainer, program = _compiled(devices, "fsdp=8", strategy="zero2", micro_batches=2)
    model_bytes = _bytes(trainer.abstract_params)
    assert _moved(program, {"all-reduce", "reduce-scatter"}, ("fsdp",), inside_loop=True) == pytest.approx(
        2 * model_bytes, abs=2 * SCALAR
    )
    assert _moved(program, {"all-gather"}, ("fsdp",)) == model_bytes


@pytest.mark.parametrize("strategy, regathered", [("zero3", "blocks"), ("zero3-keep", None)])
def test_zero3_gathers_before_use_again_in_the_backward_and_syncs_shards_over_data(devices, strategy, regathered):
    trainer, program = _compiled(devices, "data=2,fsdp=4", strategy=strategy)
    model_bytes = _bytes(trainer.abstract_params)
    again = (
        _bytes(trainer.abstract_params[regathered]) if regathered else 0
    )  # the blocks are rematerialized, the root is not
    assert _moved(program, {"all-gather"}, ("fsdp",)) == model_bytes + again
    assert _moved(program, {"all-reduce", "reduce-scatter"}, ("fsdp",)) == pytest.approx(model_bytes, abs=SCALAR)
    assert _moved(program, {"all-reduce"}, ("data",)) == pytest.approx(
        model_bytes / 4, abs=SCALAR
    )  # HSDP: only the shard
