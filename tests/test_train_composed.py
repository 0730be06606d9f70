"""Training on meshes that compose the axes: tensor parallelism and an MoE model with expert parallelism.

One control, many layouts (torchtitan's parity test): each mesh trains from the
1-device run's initial weights on the same global batch and must follow its
losses step by step; the compiled step must hold the collectives that make it
tensor or expert parallel, and the weights must be stored split.
"""

from dataclasses import replace

import jax
import numpy as np
import pytest

from lab.errors import LabError
from lab.mesh import MeshSpec
from lab.model import ModelConfig, preset
from lab.train import TrainConfig, Trainer

STEPS, BATCH = 3, 16
OPTIMIZER = {"learning_rate": 1e-2, "adam_eps": 1e-4}  # a larger eps keeps the comparison about sharding (see test_train)
MOE = replace(preset("tiny-moe"), capacity_factor=None)  # every sequence's buffers hold it whole: nothing is dropped
MOE_METRICS = ("balance_loss", "expert_load_max_over_mean", "dropped_fraction")


def _run(model: ModelConfig, mesh, start=None, **config):
    """(trainer, initial state as numpy, metrics per step, final state)."""
    trainer = Trainer(model, TrainConfig(**OPTIMIZER, **config), mesh)
    state = trainer.init(seed=0) if start is None else trainer.place(start)
    first, batch, history = jax.tree.map(np.asarray, state), trainer.batch(BATCH, seed=0), []
    for _ in range(STEPS):
        state, metrics = trainer.step(state, batch)
        history.append({name: float(value) for name, value in metrics.items()})
    return trainer, first, history, state


@pytest.fixture(scope="module")
def dense_control():
    return _run(preset("tiny"), MeshSpec().build(jax.devices()[:1]), strategy="ddp")


@pytest.fixture(scope="module")
def moe_control():
    return _run(MOE, MeshSpec().build(jax.devices()[:1]), strategy="ddp")


@pytest.fixture(scope="module")
def tensor_run(dense_control, devices):
    return _run(preset("tiny"), MeshSpec.parse("data=2,fsdp=2,tensor=2").build(devices), dense_control[1], strategy="zero3")


@pytest.fixture(scope="module")
def expert_run(moe_control, devices):
    return _run(MOE, MeshSpec.parse("expert=2,fsdp=2,data=2").build(devices), moe_control[1], strategy="zero3")


def _losses(history) -> list[float]:
    return [metrics["loss"] for metrics in history]


def test_tensor_parallel_zero3_matches_one_device(dense_control, tensor_run):
    np.testing.assert_allclose(_losses(tensor_run[2]), _losses(dense_control[2]), rtol=1e-5)
    for got, want in zip(jax.tree.leaves(tensor_run[3].params), jax.tree.leaves(dense_control[3].params)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("mesh, strategy", [("fsdp=4,tensor=2", "zero3"), ("data=2,tensor=4", "ddp")])
def test_other_tensor_layouts_match_one_device(dense_control, devices, mesh, strategy):
    _, _, history, _ = _run(preset("tiny"), MeshSpec.parse(mesh).build(devices), dense_control[1], strategy=strategy)
    np.testing.assert_allclose(_losses(history), _losses(dense_control[2]), rtol=1e-5)


def test_tensor_split_weights_are_stored_split_and_gathered_over_fsdp_only(tensor_run):
    def stored(params, *path):  # the partitions of a working weight (reduced over data, where it is whole)
        for key in path:
            params = params[key]
        return params[...].sharding.spec.partitions[1:]  # after the stacked layers

    params = tensor_run[3].params["blocks"]
    assert stored(params, "attention", "query") == ("fsdp", "tensor", None)  # [embed, heads, head_dim]
    assert stored(params, "attention", "out") == ("tensor", None, "fsdp")
    assert stored(params, "mlp", "w_out") == ("tensor", "fsdp")
    assert stored(params, "mlp_norm", "scale") == ("fsdp",)  # no heads or mlp: not split over tensor


def test_tensor_layout_all_reduces_each_row_parallel_output_over_tensor(tensor_run):
    trainer = tensor_run[0]
    program = trainer.inspect_step(BATCH, to_read=True)
    over_tensor = [c for c in program.collectives if c.axes == ("tensor",) and "forward_backward" in (c.op_name or "")]
    assert {c.kind for c in over_tensor} == {"all-reduce"}
    forward = {scope for c in over_tensor if "transpose" not in c.op_name for scope in ("attention", "mlp") if f"/{scope}/" in c.op_name}
    assert forward == {"attention", "mlp"}  # Megatron: one all-reduce per sub-layer in the forward pass...
    assert all(c.repeats == trainer.model.layers for c in over_tensor)  # ...in every layer
    weight_gathers = {c.axes for c in program.collectives if c.kind == "all-gather"}
    assert weight_gathers == {("fsdp",)}  # ZeRO-3 gathers over fsdp alone: the tensor split stays


def test_moe_with_expert_parallelism_matches_one_device(moe_control, expert_run):
    assert _losses(expert_run[2]) == pytest.approx(_losses(moe_control[2]), rel=1e-5)
    for got, want in zip(expert_run[2], moe_control[2]):
        assert set(got) == {"loss", "grad_norm", *MOE_METRICS} and got["dropped_fraction"] == want["dropped_fraction"] == 0
        assert [got[m] for m in MOE_METRICS] == pytest.approx([want[m] for m in MOE_METRICS], rel=1e-5)
        assert got["expert_load_max_over_mean"] >= 1


@pytest.mark.parametrize(
    "mesh, strategy, micro_batches, w_in_split",
    [
        ("expert=4,fsdp=2", "zero3", 2, ("expert", "fsdp", None)),  # balancing loss and counts added over micro-batches
        ("expert=2,fsdp=2,tensor=2", "zero1", 1, ("expert", None, "tensor")),  # each expert's MLP Megatron-split too
    ],
)
def test_other_moe_layouts_match_one_device(moe_control, devices, mesh, strategy, micro_batches, w_in_split):
    _, _, history, state = _run(MOE, MeshSpec.parse(mesh).build(devices), moe_control[1], strategy=strategy, micro_batches=micro_batches)
    np.testing.assert_allclose(_losses(history), _losses(moe_control[2]), rtol=1e-5)
    np.testing.assert_allclose([h["balance_loss"] for h in history], [h["balance_loss"] for h in moe_control[2]], rtol=1e-5)
    assert state.params["blocks"]["moe"]["w_in"][...].sharding.spec.partitions[1:] == w_in_split  # [experts, embed, mlp]


def test_expert_layout_dispatches_and_combines_with_all_to_alls_over_expert(expert_run):
    trainer = expert_run[0]
    program = trainer.inspect_step(BATCH, to_read=True)
    moved = [c for c in program.collectives if c.kind == "all-to-all"]
    assert {c.axes for c in moved} == {("expert",)}
    # dispatch and combine in the forward, their transposes in the backward, once per layer each
    assert sum(c.repeats for c in moved) == 4 * trainer.model.layers


def test_idle_axes_are_those_nothing_splits(devices):
    def idle(mesh):
        return Trainer(preset("tiny"), TrainConfig(strategy="zero3"), MeshSpec.parse(mesh).build(devices)).layout.idle_axes

    assert idle("stage=2,fsdp=2,tensor=2") == ("stage",)  # pipelines live in lab.parallel.pipeline*, not in lab train
    assert idle("data=2,fsdp=2,tensor=2") == ()
    assert idle("expert=2,fsdp=4") == ()  # a dense model: expert splits the batch like a data axis


def test_axes_that_do_not_divide_the_model_are_one_clear_error(devices):
    def trainer(model, mesh):
        return Trainer(model, TrainConfig(strategy="zero3"), MeshSpec.parse(mesh).build(devices))

    with pytest.raises(LabError, match=r"parameter blocks/attention/\w+ dimension 2 \(size 4\) is not divisible by mesh axis tensor=8"):
        trainer(preset("tiny"), "tensor=8")
    with pytest.raises(LabError, match=r"parameter blocks/mlp/w_in dimension 2 \(size 250\) is not divisible by mesh axis tensor=4"):
        trainer(replace(preset("tiny"), mlp=250), "fsdp=2,tensor=4")
    with pytest.raises(LabError, match=r"parameter blocks/moe/w_\w+ dimension 1 \(size 6\) is not divisible by mesh axis expert=4"):
        trainer(replace(preset("tiny-moe"), experts=6), "expert=4,fsdp=2")
    with pytest.raises(LabError, match=r"global batch 12 is not divisible by the data axes \(fsdp=2,expert=4\)"):
        trainer(preset("tiny-moe"), "expert=4,fsdp=2").batch(12)
