"""The executed pipeline (lab.parallel.pipeline.loop): the same loss and gradients as the model, in XLA's terms.

Compiling is what costs here. Programs are cached by shape within the test
session, and the shapes below are the ones tests/test_experiments_pipeline.py
runs, so the two files share their compilations.
"""

import numpy as np
import pytest

from lab import hlo
from lab.errors import LabError
from lab.model import preset
from lab.parallel.pipeline import loop
from lab.parallel.pipeline.schedules import gpipe, make_schedule, zb_h1
from lab.parallel.pipeline.stages import (
    StageSplit,
    Workload,
    balanced_split,
    example_batch,
    init_weights,
    reference_loss_and_grads,
    staged_weights,
    unstage_weights,
)

TINY = preset("tiny")


def assert_matches_reference(program, workload, weights, inputs, targets, tables):
    placed = program.place(staged_weights(workload, weights, program.stages), inputs, targets)
    loss, grads = program.run(placed, tables)
    reference_loss, reference_grads = reference_loss_and_grads(workload, weights, inputs, targets)
    assert float(loss) == pytest.approx(float(reference_loss), rel=1e-5)
    ours = unstage_weights(_host(grads)["blocks"], workload.split, program.stages)
    for path, expected in _flat(reference_grads):
        np.testing.assert_allclose(_flat_dict(ours)[path], expected, rtol=2e-4, atol=1e-6, err_msg=path)


def _host(tree):
    import jax

    return jax.device_get(tree)


def _flat(tree):
    import jax

    return [(jax.tree_util.keystr(path), np.asarray(leaf)) for path, leaf in jax.tree_util.tree_leaves_with_path(tree)]


def _flat_dict(tree):
    return dict(_flat(tree))


@pytest.fixture(scope="module")
def two_stages(devices):
    workload = Workload(TINY, StageSplit.even(4, 2), batch=8, micro_batches=4)
    tables = {name: loop.schedule_tables(make_schedule(name, 2, 4)) for name in ("gpipe", "1f1b")}
    program = loop.build(workload, loop.pipeline_mesh(devices, 2), list(tables.values()))
    inputs, targets = example_batch(workload)
    return workload, tables, program, init_weights(workload), inputs, targets


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_loss_and_gradients_match_the_model_without_a_pipeline(two_stages, schedule):
    workload, tables, program, weights, inputs, targets = two_stages
    assert_matches_reference(program, workload, weights, inputs, targets, tables[schedule])


def test_1f1b_tables_interleave_forwards_and_backwards(two_stages):
    _, tables, _, _, _, _ = two_stages
    kinds = "".join(".FB"[k] for k in tables["1f1b"].action[:, 0, 0])  # stage 0, tick by tick
    assert kinds.index("B") < kinds.rindex("F")  # a backward runs before the last forward
    assert (tables["gpipe"].depth, tables["1f1b"].depth) == (4, 2)  # micro-batches kept: m against P


def test_each_tick_exchanges_over_the_stage_axis_with_two_permutes(two_stages):
    _, _, program, _, _, _ = two_stages
    found, _ = hlo.parse_collectives(program.compiled.as_text(), program.mesh.devices.shape, program.mesh.axis_names)
    permutes = [c for c in found if c.kind == "collective-permute"]
    assert len(permutes) == 2 and all(c.axes == ("stage",) for c in permutes)
    assert {c.operand_bytes for c in permutes} == {2 * 32 * 64 * 4}  # one micro-batch's activation [b, S, D] in f32
    assert [c.kind for c in found if c.kind != "collective-permute"] == [
        "all-reduce"
    ]  # the loss, summed over stages once


def test_xla_memory_follows_the_micro_batches_kept(two_stages, devices):
    workload, tables, gpipe_sized, _, _, _ = two_stages
    one_f_one_b_sized = loop.build(workload, loop.pipeline_mesh(devices, 2), [tables["1f1b"]])
    temp = {p.depth: p.compiled.memory_analysis().temp_size_in_bytes for p in (gpipe_sized, one_f_one_b_sized)}
    assert temp[2] < temp[4]
    for depth, used in temp.items():
        assert used == pytest.approx(loop.activation_bytes(workload, depth), rel=0.15)


def test_interleaved_chunks_match_too(devices):
    workload = Workload(TINY, StageSplit.even(4, 4), batch=8, micro_batches=4)
    tables = loop.schedule_tables(make_schedule("interleaved", 2, 4, 2))
    program = loop.build(workload, loop.pipeline_mesh(devices, 2), [tables], chunks=2)
    inputs, targets = example_batch(workload)
    assert_matches_reference(program, workload, init_weights(workload), inputs, targets, tables)


def test_an_uneven_split_skips_its_padding_and_matches_too(devices):
    workload = Workload(TINY, StageSplit((1, 3)), batch=8, micro_batches=2)
    tables = {name: loop.schedule_tables(make_schedule(name, 2, 2)) for name in ("gpipe", "1f1b")}
    program = loop.build(workload, loop.pipeline_mesh(devices, 2), list(tables.values()))
    inputs, targets = example_batch(workload, seed=1)
    assert_matches_reference(program, workload, init_weights(workload, seed=1), inputs, targets, tables["1f1b"])


def test_staging_weights_round_trips_and_pads_uneven_stages():
    workload = Workload(TINY, StageSplit((1, 3)), batch=2, micro_batches=1)
    weights = init_weights(workload)
    staged = staged_weights(workload, weights, 2)
    assert staged["active"].tolist() == [[[1.0, 0.0, 0.0]], [[1.0, 1.0, 1.0]]]
    back = unstage_weights(staged["blocks"], workload.split, 2)
    for (path, a), (_, b) in zip(_flat(back), _flat(weights)):
        np.testing.assert_array_equal(a, b, err_msg=path)


def test_receives_are_filed_under_their_micro_batch():
    tables = loop.schedule_tables(gpipe(2, 2))
    assert tables.receive_forward[1, 1].tolist() == [0, 0]  # F0 on stage 0 at tick 0 arrives at stage 1 before tick 1
    assert tables.receive_backward[4, 0].tolist() == [0, 0]  # B0 on stage 1 at tick 3 arrives at stage 0 before tick 4
    assert balanced_split(10, 4).layers == (3, 3, 2, 2)


def test_bad_input_is_a_lab_error(devices, two_stages):
    workload, _, program, _, _, _ = two_stages
    with pytest.raises(LabError, match="do not split evenly into 3"):
        StageSplit.even(4, 3)
    with pytest.raises(LabError, match="does not split into 3 equal micro-batches"):
        Workload(TINY, StageSplit.even(4, 2), batch=8, micro_batches=3)
    with pytest.raises(LabError, match="needs a stage axis of 16 devices"):
        loop.pipeline_mesh(devices, 16)
    with pytest.raises(LabError, match="P=4 stages cannot run on a stage axis of 2"):
        loop.build(workload, loop.pipeline_mesh(devices, 2), [loop.schedule_tables(make_schedule("gpipe", 4, 4))])
    with pytest.raises(LabError, match="splits the backward into I and W"):
        loop.schedule_tables(zb_h1(2, 4))
    with pytest.raises(LabError, match="one layer count per virtual stage"):
        loop.build(
            workload,
            loop.pipeline_mesh(devices, 2),
            [loop.schedule_tables(make_schedule("interleaved", 2, 4, 2))],
            chunks=2,
        )
    with pytest.raises(LabError, match="build it with them"):
        program.table_args(loop.schedule_tables(gpipe(2, 8)))
    with pytest.raises(LabError, match="integers separated by commas"):
        StageSplit.parse("3,x")
