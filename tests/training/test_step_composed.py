"""Training on meshes that compose axes: tensor parallelism, an MoE model with expert parallelism, and GPipe over stage.

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
from lab.training.step import TrainConfig, Trainer

pytestmark = pytest.mark.long  # a training step compiled per composed layout: scheduled first (tests/conftest.py)

STEPS, BATCH = 3, 16
OPTIMIZER = {
    "learning_rate": 1e-2,
    "adam_eps": 1e-4,
}  # a larger eps keeps the comparison about sharding (see test_train)
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


def _control(model: ModelConfig):
    """The same training on one device: what every split run is held to."""
    return _run(model, MeshSpec().build(jax.devices()[:1]), strategy="ddp")


@pytest.fixture(scope="module")
def dense_control():
    return _control(preset("tiny"))


@pytest.fixture(scope="module")
def moe_control():
    return _control(MOE)


@pytest.fixture(scope="module")
def tensor_run(dense_control, devices):
    return _run(
        preset("tiny"), MeshSpec.parse("data=2,fsdp=2,tensor=2").build(devices), dense_control[1], strategy="zero3"
    )


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
    forward = {
        scope
        for c in over_tensor
        if "transpose" not in c.op_name
        for scope in ("attention", "mlp")
        if f"/{scope}/" in c.op_name
    }
    assert forward == {"attention", "mlp"}  # Megatron: one all-reduce per sub-layer in the forward pass...
    assert all(c.repeats == trainer.model.layers for c in over_tensor)  # ...in every layer
    weight_gathers = {c.axes for c in program.collectives if c.kind == "all-gather"}
    assert weight_gathers == {("fsdp",)}  # ZeRO-3 gathers over fsdp alone: the tensor split stays


QK_NORM = replace(preset("tiny"), qk_norm=True)  # a q/k norm's scale meets heads split over tensor too


@pytest.fixture(scope="module")
def qk_norm_control():
    return _control(QK_NORM)


@pytest.fixture(scope="module")
def sequence_parallel_run(qk_norm_control, devices):
    return _run(
        QK_NORM,
        MeshSpec.parse("data=2,fsdp=2,tensor=2").build(devices),
        qk_norm_control[1],
        strategy="zero3",
        sequence_parallel=True,
        remat="dots",  # saves matmul outputs: the partial sums must not be among them, their reduce-scatter is
    )


def test_sequence_parallel_matches_one_device(qk_norm_control, sequence_parallel_run):
    np.testing.assert_allclose(_losses(sequence_parallel_run[2]), _losses(qk_norm_control[2]), rtol=1e-5)
    for got, want in zip(jax.tree.leaves(sequence_parallel_run[3].params), jax.tree.leaves(qk_norm_control[3].params)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-6)


def test_sequence_parallel_reduce_scatters_each_row_parallel_output_and_gathers_each_sub_layer_input(
    sequence_parallel_run,
):
    trainer = sequence_parallel_run[0]
    program = trainer.inspect_step(BATCH, to_read=True)
    forward = {
        (c.kind, scope)
        for c in program.collectives
        if c.axes == ("tensor",) and "forward_backward" in (c.op_name or "") and "transpose" not in c.op_name
        for scope in ("attention", "mlp")
        if f"/{scope}/" in c.op_name
    }
    # Korthikanti et al.: each sub-layer's input is gathered along the sequence first (the TP step has no forward
    # all-gather over tensor); XLA:CPU writes the reduce-scatter after it as all-reduce + dynamic-slice, the TPU
    # compiler as a reduce-scatter (tests/predict/test_command.py)
    assert {("all-gather", "attention"), ("all-gather", "mlp")} <= forward


def test_sequence_parallel_needs_a_tensor_axis_and_no_stage_axis(devices):
    for mesh, says in (("fsdp=8", "tensor=2 or more"), ("stage=2,tensor=2,fsdp=2", "stage axis")):
        with pytest.raises(LabError, match=says):
            Trainer(preset("tiny"), TrainConfig(sequence_parallel=True), MeshSpec.parse(mesh).build(devices))


def test_moe_with_expert_parallelism_matches_one_device(moe_control, expert_run):
    assert _losses(expert_run[2]) == pytest.approx(_losses(moe_control[2]), rel=1e-5)
    for got, want in zip(expert_run[2], moe_control[2]):
        assert (
            set(got) == {"loss", "grad_norm", *MOE_METRICS} and got["dropped_fraction"] == want["dropped_fraction"] == 0
        )
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
    _, _, history, state = _run(
        MOE, MeshSpec.parse(mesh).build(devices), moe_control[1], strategy=strategy, micro_batches=micro_batches
    )
    np.testing.assert_allclose(_losses(history), _losses(moe_control[2]), rtol=1e-5)
    np.testing.assert_allclose(
        [h["balance_loss"] for h in history], [h["balance_loss"] for h in moe_control[2]], rtol=1e-5
    )
    assert (
        state.params["blocks"]["moe"]["w_in"][...].sharding.spec.partitions[1:] == w_in_split
    )  # [experts, embed, mlp]


def test_expert_layout_dispatches_and_combines_with_all_to_alls_over_expert(expert_run):
    trainer = expert_run[0]
    program = trainer.inspect_step(BATCH, to_read=True)
    moved = [c for c in program.collectives if c.kind == "all-to-all"]
    assert {c.axes for c in moved} == {("expert",)}
    # dispatch and combine in the forward, their transposes in the backward, once per layer each
    assert sum(c.repeats for c in moved) == 4 * trainer.model.layers


def test_idle_axes_are_those_nothing_splits(devices):
    def idle(mesh):
        return Trainer(
            preset("tiny"), TrainConfig(strategy="zero3"), MeshSpec.parse(mesh).build(devices)
        ).layout.idle_axes

    assert idle("stage=2,fsdp=2,tensor=2") == ()  # stage pipelines the blocks' layers
    assert idle("data=2,fsdp=2,tensor=2") == ()
    assert idle("expert=2,fsdp=4") == ()  # a dense model: expert splits the batch like a data axis


def test_axes_that_do_not_divide_the_model_are_one_clear_error(devices):
    def trainer(model, mesh):
        return Trainer(model, TrainConfig(strategy="zero3"), MeshSpec.parse(mesh).build(devices))

    with pytest.raises(
        LabError, match=r"parameter blocks/attention/\w+ dimension 2 \(size 4\) is not divisible by mesh axis tensor=8"
    ):
        trainer(preset("tiny"), "tensor=8")
    with pytest.raises(
        LabError, match=r"parameter blocks/mlp/w_in dimension 2 \(size 250\) is not divisible by mesh axis tensor=4"
    ):
        trainer(replace(preset("tiny"), mlp=250), "fsdp=2,tensor=4")
    with pytest.raises(
        LabError, match=r"parameter blocks/moe/w_\w+ dimension 1 \(size 6\) is not divisible by mesh axis expert=4"
    ):
        trainer(replace(preset("tiny-moe"), experts=6), "expert=4,fsdp=2")
    with pytest.raises(
        LabError, match=r"^2 layers cannot be cut into stage=4 pipeline stages; use a stage axis that divides 2$"
    ):
        trainer(preset("tiny"), "stage=4,fsdp=2")
    with pytest.raises(LabError, match=r"global batch 12 is not divisible by the data axes \(fsdp=2,expert=4\)"):
        trainer(preset("tiny-moe"), "expert=4,fsdp=2").batch(12)


# --- GPipe over stage (lab.parallel.pipeline.spmd) --------------------------------------------------------------------

DEEP = replace(preset("tiny"), layers=4)  # four stages need four layers


@pytest.fixture(scope="module")
def pipeline_run(dense_control, devices):
    return _run(
        preset("tiny"),
        MeshSpec.parse("stage=2,fsdp=2,tensor=2").build(devices),
        dense_control[1],
        strategy="zero3",
        micro_batches=4,
    )


@pytest.mark.parametrize(
    "model, mesh, strategy, micro_batches",
    [
        ("tiny", "stage=2,data=2,fsdp=2", "zero3", 4),  # HSDP: block weights reduced over data
        ("tiny", "stage=2,data=4", "ddp", 2),  # every weight whole on each stage's data replicas
        ("deep", "stage=4,fsdp=2", "zero3", 1),  # one micro-batch: a pipeline that is all bubble
    ],
)
def test_pipelines_over_stage_match_one_device(dense_control, devices, model, mesh, strategy, micro_batches):
    if model == "deep":
        control = _run(DEEP, MeshSpec().build(devices[:1]), strategy="ddp")
        model_config = DEEP
    else:
        control, model_config = dense_control, preset("tiny")
    _, _, history, _ = _run(
        model_config, MeshSpec.parse(mesh).build(devices), control[1], strategy=strategy, micro_batches=micro_batches
    )
    np.testing.assert_allclose(_losses(history), _losses(control[2]), rtol=1e-5)
    np.testing.assert_allclose([h["grad_norm"] for h in history], [h["grad_norm"] for h in control[2]], rtol=1e-5)


def test_pipeline_with_tensor_parallelism_matches_one_device_and_stores_layers_split_over_stage(
    dense_control, pipeline_run
):
    np.testing.assert_allclose(_losses(pipeline_run[2]), _losses(dense_control[2]), rtol=1e-5)
    for got, want in zip(jax.tree.leaves(pipeline_run[3].params), jax.tree.leaves(dense_control[3].params)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-6)
    w_in = pipeline_run[3].params["blocks"]["mlp"]["w_in"][...]
    assert w_in.shape == (2, 64, 256) and w_in.sharding.spec.partitions == (
        "stage",
        "fsdp",
        "tensor",
    )  # [layers, embed, mlp]
    assert pipeline_run[3].params["embedding"][...].sharding.spec.partitions == (
        None,
        "fsdp",
    )  # outside the blocks: whole on each stage


def test_moe_pipelines_over_stage_with_expert_parallelism(moe_control, devices):
    _, _, history, _ = _run(
        MOE, MeshSpec.parse("stage=2,expert=2,fsdp=2").build(devices), moe_control[1], strategy="zero3", micro_batches=2
    )
    np.testing.assert_allclose(_losses(history), _losses(moe_control[2]), rtol=1e-5)
    for got, want in zip(
        history, moe_control[2]
    ):  # bubble ticks route zeros: their counts and balancing loss must not count
        assert [got[m] for m in MOE_METRICS] == pytest.approx([want[m] for m in MOE_METRICS], rel=1e-5)


def test_pipeline_shifts_one_activation_per_tick_with_collective_permutes_over_stage(pipeline_run):
    trainer = pipeline_run[0]
    program = trainer.inspect_step(BATCH, to_read=True)
    permutes = [c for c in program.collectives if c.kind == "collective-permute"]
    assert {c.axes for c in permutes} == {("stage",)}
    stages, micro_batches = 2, trainer.config.micro_batches
    ticks = micro_batches + stages - 1
    assert sorted(c.repeats for c in permutes) == [
        ticks,
        ticks,
    ]  # one in the forward loop, its transpose in the backward
    micro_batch_per_device = BATCH // micro_batches // 2  # the micro-batch is split over fsdp=2
    activation_bytes = micro_batch_per_device * trainer.model.seq * trainer.model.embed * 4
    assert all(c.operand_bytes == activation_bytes for c in permutes)
    in_the_loop = {c.kind for c in program.collectives if c.axes == ("stage",) and c.repeats == ticks}
    assert in_the_loop == {"collective-permute"}  # the stages talk to each other only by passing activations


def test_a_pipelined_checkpoint_restores_onto_a_mesh_without_stages(pipeline_run, devices, tmp_path):
    from lab.training.checkpoint import CheckpointPolicy, Checkpoints

    checkpoints = Checkpoints(CheckpointPolicy(tmp_path))
    assert checkpoints.save(3, pipeline_run[3], force=True)
    checkpoints.wait()
    flat = Trainer(preset("tiny"), TrainConfig(**OPTIMIZER, strategy="zero3"), MeshSpec.parse("fsdp=8").build(devices))
    _, restored = checkpoints.restore(flat.abstract_state())
    checkpoints.close()
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(pipeline_run[3])):
        np.testing.assert_array_equal(
            np.asarray(got), np.asarray(want)
        )  # stored [L, ...]: the same shapes on any stage count


# DeepSeek-V3's and Llama 4's blocks in one small stack: latent attention, a dense layer first, then periods of a
# dense and an MoE layer, a shared expert beside the routed ones
MIXED = replace(
    MOE,
    layers=5,
    dense_layers=1,
    moe_every=2,
    dense_mlp=128,
    shared_experts=1,
    kv_rank=32,
    q_rank=24,
    rope_dim=8,
    feed_forward="swiglu",
)


def test_a_mixed_moe_stack_matches_one_device(devices):
    control = _control(MIXED)
    _, _, history, state = _run(
        MIXED, MeshSpec.parse("expert=2,fsdp=2,tensor=2").build(devices), control[1], strategy="zero3"
    )
    np.testing.assert_allclose(_losses(history), _losses(control[2]), rtol=1e-5)
    np.testing.assert_allclose([h["balance_loss"] for h in history], [h["balance_loss"] for h in control[2]], rtol=1e-5)
    shared = state.params["blocks"]["blocks"][1]["moe"]["shared"]["w_in"][...]
    assert shared.sharding.spec.partitions[1:] == ("fsdp", "tensor")  # [embed, mlp], Megatron-split
    key_value = state.params["dense_blocks"]["attention"]["key_value"][...]  # latent attention's up-projection
    assert key_value.sharding.spec.partitions[1:3] == ("fsdp", "tensor")


GPT_OSS = replace(MOE, kv_heads=2, feed_forward="swiglu", biases=True, sinks=True, window=8, global_every=2)


def test_biases_sinks_and_windows_train_as_on_one_device_under_every_split(devices):
    """GPT-OSS's blocks with experts, fsdp, tensor and sequence parallelism: each bias and sink is a weight whose
    gradient is summed over the sequences (and, under sequence parallelism, the sequence's shards) it met."""
    control = _control(GPT_OSS)
    mesh = MeshSpec.parse("expert=2,fsdp=2,tensor=2").build(devices)
    _, _, history, state = _run(GPT_OSS, mesh, control[1], strategy="zero3", sequence_parallel=True)
    np.testing.assert_allclose(_losses(history), _losses(control[2]), rtol=1e-5)
    for got, want in zip(jax.tree.leaves(state.params), jax.tree.leaves(control[3].params), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-6)
    sinks = state.params["blocks"]["blocks"][0]["attention"]["mixing"]["sinks"][...]
    assert sinks.sharding.spec.partitions[1:] == ("tensor",)  # [layers, heads]: split as the heads
