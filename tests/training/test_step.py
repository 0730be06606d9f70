"""The train step: every strategy matches single-device training step by step; bad input is refused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lab.errors import LabError
from lab.mesh import MeshSpec
from lab.model import preset
from lab.training.step import TrainConfig, Trainer

STEPS, BATCH = 3, 16
# Adam divides by |g| + eps: with eps = 1e-8 a gradient near 1e-8 turns a 1e-9 difference in summation
# order into a visible difference in the update. A larger eps keeps the comparison about the sharding.
OPTIMIZER = {"learning_rate": 1e-2, "adam_eps": 1e-4}


def _trajectory(mesh, start=None, **config):
    trainer = Trainer(preset("tiny"), TrainConfig(**OPTIMIZER, **config), mesh)
    state = trainer.init(seed=0) if start is None else trainer.place(start)
    assert _types(trainer.abstract_state()) == _types(state)  # what compile-only targets see is what runs here
    batch = trainer.batch(BATCH, seed=0)
    losses, params, first = [], [], jax.tree.map(np.asarray, state)
    for _ in range(STEPS):
        state, metrics = trainer.step(state, batch)
        losses.append(float(metrics["loss"]))
        params.append([np.asarray(p) for p in jax.tree.leaves(state.params)])
    return first, losses, params


def _types(state):
    return jax.tree.map(lambda a: (a.shape, a.dtype, a.sharding.spec), state)


@pytest.fixture(scope="module")
def single_device():
    return _trajectory(MeshSpec().build(jax.devices()[:1]), strategy="ddp")


@pytest.mark.parametrize(
    "strategy, mesh, micro_batches",
    [
        ("ddp", "data=8", 2),  # partial sums accumulated over micro-batches, one all-reduce
        ("zero1", "data=2,fsdp=4", 1),
        ("zero2", "fsdp=8", 2),  # a reduce-scatter per micro-batch
        ("zero3", "data=4,fsdp=2", 2),  # HSDP: reduce-scatter over fsdp, all-reduce of the shard over data
        ("zero3-keep", "fsdp=8", 1),
    ],
)
def test_each_strategy_matches_single_device_training_step_by_step(
    single_device, devices, strategy, mesh, micro_batches
):
    start, reference_losses, reference_params = single_device
    _, losses, params = _trajectory(
        MeshSpec.parse(mesh).build(devices), start, strategy=strategy, micro_batches=micro_batches
    )
    np.testing.assert_allclose(losses, reference_losses, rtol=1e-5)
    for step, (got, want) in enumerate(zip(params, reference_params)):
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=f"step {step + 1}")


def test_mixed_precision_keeps_bf16_weights_and_sharded_fp32_master_weights(devices):
    trainer = Trainer(
        preset("tiny"),
        TrainConfig(strategy="zero1", param_dtype="bfloat16", compute_dtype="bfloat16", learning_rate=1e-2),
        MeshSpec.parse("fsdp=8").build(devices),
    )
    state, batch = trainer.init(), trainer.batch(BATCH)
    w_in, master_w_in = state.params["blocks"]["mlp"]["w_in"][...], state.master["blocks"]["mlp"]["w_in"][...]
    assert w_in.dtype == jnp.bfloat16 and w_in.sharding.spec == jax.sharding.PartitionSpec(
        None, None, None, reduced={"fsdp"}
    )
    assert master_w_in.dtype == jnp.float32 and master_w_in.sharding.spec[1] == "fsdp"
    losses = []
    for _ in range(3):
        state, metrics = trainer.step(state, batch)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0]


def test_bad_input_is_one_clear_error(devices):
    mesh = MeshSpec.parse("data=2,fsdp=4").build(devices)
    trainer = Trainer(preset("tiny"), TrainConfig(strategy="ddp", micro_batches=2), mesh)
    with pytest.raises(
        LabError,
        match=r"global batch 8 is not divisible by the data axes \(data=2,fsdp=4\) "
        r"times 2 micro-batches; use a multiple of 16",
    ):
        trainer.batch(8)
    with pytest.raises(LabError, match="unknown strategy 'zero9'"):
        Trainer(preset("tiny"), TrainConfig(strategy="zero9"), mesh)
    with pytest.raises(LabError, match="unknown dtype 'float16'"):
        Trainer(preset("tiny"), TrainConfig(param_dtype="float16"), mesh)
    with pytest.raises(LabError, match="unknown remat policy 'some'"):
        Trainer(preset("tiny"), TrainConfig(remat="some"), mesh)
    with pytest.raises(LabError, match=r"parameter .* is not divisible by mesh axis fsdp=8"):
        Trainer(
            preset("tiny").__class__(embed=60, heads=4, head_dim=16),
            TrainConfig(strategy="zero3"),
            MeshSpec.parse("fsdp=8").build(devices),
        )
    with pytest.raises(LabError, match=r"leaves .* of parameter bytes unsharded"):
        Trainer(
            preset("tiny"), TrainConfig(strategy="zero3", persist_below=10**9), MeshSpec.parse("fsdp=8").build(devices)
        )


def test_a_fresh_state_is_computed_once_and_placed_on_the_next_mesh_with_the_values_that_mesh_computes(
    devices, monkeypatch
):
    from lab.training import step as step_module

    monkeypatch.setattr(step_module, "_fresh", {})
    model = preset("tiny")
    first = Trainer(model, TrainConfig(), MeshSpec.parse("fsdp=8").build(devices)).init(seed=3)
    other = Trainer(model, TrainConfig(), MeshSpec.parse("data=2,fsdp=4").build(devices))
    compiles = []
    compile_ = jax.stages.Lowered.compile
    monkeypatch.setattr(
        jax.stages.Lowered, "compile", lambda self, *a, **k: compiles.append(1) or compile_(self, *a, **k)
    )
    placed = other.init(seed=3)
    assert not compiles and _types(placed) == _types(other.abstract_state())  # placed in its shardings, not compiled
    step_module._fresh.clear()
    computed = other.init(seed=3)  # what that mesh's own initializer gives
    assert compiles
    for a, b, c in zip(*(jax.tree.leaves(s) for s in (first, placed, computed))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        np.testing.assert_allclose(np.asarray(b), np.asarray(c), rtol=1e-6, atol=1e-7)  # random bits: mesh-free
    reseeded = jax.tree.leaves(other.init(seed=4).params)
    assert not all(
        np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(reseeded, jax.tree.leaves(placed.params))
    )
