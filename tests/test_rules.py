"""Rules tables: logical axes to PartitionSpecs, collisions, divisibility, strategies, the sharded-enough guard."""

import pytest
from jax.sharding import PartitionSpec as P

from lab.errors import LabError
from lab.parallel.expert import TOKEN_AXES
from lab.rules import (
    DATA_AXES,
    MODEL_PARALLEL,
    STRATEGIES,
    TABLES,
    Rules,
    check_divisible,
    check_sufficiently_sharded,
    get_strategy,
    sharding_report,
)

FSDP = Rules.of({"embed": "fsdp", "batch": ("data", "fsdp")})


def test_logical_axes_map_to_mesh_axes_and_unlisted_ones_replicate():
    assert FSDP.spec(("layers", "embed", "mlp")) == P(None, "fsdp", None)
    assert FSDP.spec(("batch", "sequence")) == P(("data", "fsdp"), None)
    assert FSDP.spec((None, "vocab")) == P(None, None)


def test_two_dimensions_on_one_mesh_axis_is_a_collision_naming_both():
    rules = Rules.of({"embed": "fsdp", "mlp": "fsdp"})
    with pytest.raises(LabError, match=r"collide on blocks/mlp/w_in: dimensions 0 \(embed\) and 1 \(mlp\).*'fsdp'"):
        rules.spec(("embed", "mlp"), "blocks/mlp/w_in")


def test_unknown_logical_or_mesh_axes_are_refused():
    with pytest.raises(LabError, match="unknown logical axis 'hidden'"):
        Rules.of({"hidden": "fsdp"})
    with pytest.raises(LabError, match="unknown mesh axis 'model'"):
        Rules.of({"embed": "model"})


def test_a_dimension_the_axis_does_not_divide_names_parameter_dimension_and_axis():
    with pytest.raises(
        LabError, match=r"parameter blocks/attention/query dimension 1 \(size 60\) is not divisible by mesh axis fsdp=8"
    ):
        check_divisible("blocks/attention/query", (2, 60, 4), P(None, "fsdp", None), {"fsdp": 8, "data": 1})
    check_divisible("ok", (2, 64, 4), P(None, "fsdp", None), {"fsdp": 8})


def test_each_zero_stage_shards_one_more_table():
    sharded = {name: (s.shards_params, s.shards_grads, bool(s.optimizer.table)) for name, s in STRATEGIES.items()}
    assert sharded == {
        "ddp": (False, False, False),
        "zero1": (False, False, True),
        "zero2": (False, True, True),
        "zero3": (True, True, True),
        "zero3-keep": (True, True, True),
    }
    assert STRATEGIES["zero3"].reshard_after_forward and not STRATEGIES["zero3-keep"].reshard_after_forward


def test_an_unknown_strategy_lists_the_known_ones():
    with pytest.raises(LabError, match="unknown strategy 'zero4'; use one of ddp, zero1, zero2, zero3, zero3-keep"):
        get_strategy("zero4")


def test_small_parameters_persist_replicated_below_the_threshold():
    from dataclasses import replace

    strategy = replace(get_strategy("zero3"), persist_below=100)
    assert strategy.param_rules(64).spec(("embed",)) == P(None)
    assert strategy.param_rules(64).spec(("mlp",)) == P("tensor")  # replicated over the data axes only
    assert strategy.param_rules(4096).spec(("embed", "mlp")) == P("fsdp", "tensor")


@pytest.mark.parametrize("name", STRATEGIES)
def test_every_table_of_every_strategy_keeps_the_tensor_expert_and_stage_splits(name):
    strategy = STRATEGIES[name]
    for table in TABLES:
        rules = strategy.rules(table, size=10**6)
        assert rules.spec(("layers", "experts", "embed", "mlp"))[:2] == ("stage", "expert")
        assert rules.spec(("layers", "experts", "embed", "mlp"))[3] == "tensor"
        assert rules.spec(("embed", "heads", "head_dim"))[1:] == ("tensor", None)
        assert rules.spec(("embed", "routing"))[1] is None  # every device scores every expert
    assert strategy.used_axes == {
        "data",
        "fsdp",
        "expert",
        "tensor",
        "stage",
    }  # stage: the blocks' layers, one run per pipeline stage
    with pytest.raises(LabError, match="unknown rules table 'weights'"):
        strategy.rules("weights", 1)


def test_merging_tables_lets_the_right_one_win_and_the_batch_axes_are_the_token_axes_of_expert_parallelism():
    assert (Rules.of({"embed": "fsdp", "mlp": "fsdp"}) | MODEL_PARALLEL).spec(("embed", "mlp")) == P("fsdp", "tensor")
    assert DATA_AXES == TOKEN_AXES


def test_the_guard_fails_loudly_when_too_much_stays_whole():
    params = [("embedding", 900, P(None, "fsdp")), ("norm", 100, P(None))]
    report = sharding_report(params)
    assert report.unsharded_fraction == pytest.approx(0.1) and report.largest_unsharded == ("norm",)
    with pytest.raises(LabError, match="zero3 leaves 10% of parameter bytes unsharded over fsdp"):
        check_sufficiently_sharded(get_strategy("zero3"), report, axis_size=8)
    check_sufficiently_sharded(get_strategy("zero3"), report, axis_size=1)  # nothing to shard over
    check_sufficiently_sharded(get_strategy("ddp"), report, axis_size=8)  # DDP never claims to shard
