"""lab.hlo.collectives: every form a collective takes in HLO, as one Collective; odd text is skipped, never raised.

The forms are written by hand after XLA's own tests, and read from the CPU and
TPU compilers' HLO in tests/data/hlo (written by tests/hlo/test_inspection.py).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lab.errors import LabError
from lab.hlo import Collective, parse_collectives, summarize
from tests.hlo.support import DATA, FSDP8, MESH222, MESH224, by_kind_axes, fixture, kinds_and_axes, module

# --------------------------------------------------------------------------- forms, after XLA's own tests


ASYNC_FORMS = """HloModule async_forms, num_partitions=4

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}

%wrapped_reduce_scatter (p: f32[16]) -> f32[4] {
  %p = f32[16]{0} parameter(0)
  ROOT %rs = f32[4]{0} reduce-scatter(%p), channel_id=3, replica_groups={{0,1,2,3}}, use_global_device_ids=true, \
dimensions={0}, to_apply=%add
}

ENTRY %main (a: f32[16], b: bf16[8,4]) -> f32[4] {
  %a = f32[16]{0} parameter(0)
  %b = bf16[8,4]{1,0} parameter(1)
  %ag-start = (bf16[8,4]{1,0}, bf16[16,4]{1,0}) all-gather-start(%b), channel_id=1, replica_groups=[2,2]<=[4], \
dimensions={0}, use_global_device_ids=true
  %ars = (f32[16]{0}, bf16[8,4]{1,0}) all-reduce-start(%a, %b), channel_id=2, replica_groups={}, \
use_global_device_ids=true, to_apply=%add
  %rs-start = ((f32[16]{0}), f32[8]{0}) reduce-scatter-start(%a), channel_id=4, replica_groups=[2,2]<=[2,2]T(1,0), \
dimensions={0}, use_global_device_ids=true, to_apply=%add
  %rs-update = ((f32[16]{0}), f32[8]{0}) reduce-scatter-update(%rs-start)
  %wrapped-start = ((f32[16]{0}), f32[4]{0}, u32[]) async-start(%a), calls=%wrapped_reduce_scatter
  %wrapped-done = f32[4]{0} async-done(%wrapped-start)
  %rs-done = f32[8]{0} reduce-scatter-done(%rs-update)
  %ard = (f32[16]{0}, bf16[8,4]{1,0}) all-reduce-done(%ars)
  ROOT %ag-done = bf16[16,4]{1,0} all-gather-done(%ag-start)
}
"""


def test_async_pairs_are_counted_once_with_done_shapes():
    collectives, skipped = parse_collectives(ASYNC_FORMS, (2, 2), ("x", "y"))
    assert skipped == ()
    assert sorted(c.name for c in collectives) == ["ag-start", "ars", "rs", "rs-start"]
    assert all(c.is_async for c in collectives)
    gather = next(c for c in collectives if c.kind == "all-gather")
    assert (gather.form, gather.axes, gather.operand_shapes, gather.result_shapes) == (
        "all-gather-start/all-gather-done",
        ("y",),
        ((8, 4),),
        ((16, 4),),
    )
    assert gather.size_bytes == gather.result_bytes == 16 * 4 * 2
    scatter = next(c for c in collectives if c.name == "rs-start")
    assert (scatter.axes, scatter.operand_shapes, scatter.size_bytes) == (("x",), ((16,),), 16 * 4)


def test_combined_all_reduce_and_async_start_wrapper():
    collectives, _ = parse_collectives(ASYNC_FORMS, (2, 2), ("x", "y"))
    combined = next(c for c in collectives if c.kind == "all-reduce")
    assert combined.combined and combined.dtypes == ("f32", "bf16")
    assert (combined.group_size, combined.axes, combined.operand_bytes) == (4, ("x", "y"), 16 * 4 + 8 * 4 * 2)
    wrapped = next(c for c in collectives if c.name == "rs")
    assert wrapped.is_async and wrapped.form.startswith("async-start %wrapped-start")
    assert wrapped.computation == "wrapped_reduce_scatter"


def test_unreadable_lines_are_reported_not_raised():
    text = module(
        "%ok = f32[8]{0} all-reduce(%p), replica_groups={{0,1},{2,3}}, to_apply=%add",
        "%weird = f32[8]{0} all-reduce(%p), replica_groups=<<unknown>>, to_apply=%add",
        "%ag = f32[8]{0} all-gather(%p), replica_groups={{0,1}}",
        "%orphan = f32[8]{0} all-gather-done(%nothing)",
        "%lost = (f32[4]{0}, f32[8]{0}) all-gather-start(%p), replica_groups={{0,1}}, dimensions={0}",
        "%b = f32[8]{0} collective-broadcast(%p), replica_groups={{0,1}}",
        "this mentions all-reduce but is no instruction",
        "%cp = f32[8]{0} collective-permute(%p), channel_id=1",
        devices=4,
    )
    collectives, skipped = parse_collectives(text, (4,), ("x",))
    assert [c.name for c in collectives] == ["ok"]
    reasons = " | ".join(s.reason for s in skipped)
    for expected in (
        "unknown replica_groups",
        "without dimensions",
        "without a matching start",
        "without a matching done",
        "collective-broadcast",
        "not an HLO instruction",
        "source_target_pairs",
    ):
        assert expected in reasons
    assert len(skipped) == 7 and all(s.line_number > 0 for s in skipped)


def test_a_ragged_all_to_all_is_an_all_to_all_of_its_whole_input_buffer():
    """jax.lax.ragged_all_to_all (a dropless MoE's dispatch): its sizes are operands read at run time, so S is the
    input buffer it sends from, the most it can send; the four offset and size arrays are not data."""
    text = module(
        "%r = bf16[1024,256]{1,0} ragged-all-to-all(%x, %out, %o1, %s1, %o2, %s2), "
        "replica_groups={{0,1,2,3},{4,5,6,7}}",
        devices=8,
    )
    (collective,), skipped = parse_collectives(text, (2, 4), ("expert", "tensor"))
    assert not skipped
    assert (collective.kind, collective.axes, collective.size_bytes) == ("all-to-all", ("tensor",), 1024 * 256 * 2)
    assert collective.form.startswith("ragged-all-to-all (its sizes known at run time")


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_truncated_or_random_text_never_raises(data):
    real = (DATA / "tpu_v5p_2x2x2_fsdp_tp_step.hlo").read_text().splitlines()
    lines = data.draw(st.lists(st.sampled_from(real), max_size=30))
    cut = [line[: data.draw(st.integers(0, len(line)))] for line in lines]
    noise = data.draw(
        st.text(alphabet=st.sampled_from(list("%{}[]()<=,'=T: allreducegathr-0123456789\n")), max_size=300)
    )
    collectives, skipped = parse_collectives("\n".join(cut) + "\n" + noise, MESH222)
    assert all(isinstance(c, Collective) for c in collectives) and all(s.reason for s in skipped)


def test_mesh_shape_and_axis_names_of_different_lengths_are_refused():
    with pytest.raises(LabError, match="axis_names"):
        parse_collectives(
            module("%ar = f32[8]{0} all-reduce(%p), replica_groups={}, to_apply=%add"), MESH222, ("x", "y")
        )


# --------------------------------------------------------------------------- real HLO, CPU compiler


def test_cpu_fixture_loops_count_trip_counts():
    collectives, _ = fixture("cpu_scan_fsdp.hlo", FSDP8)
    assert {c.repeats for c in collectives} == {4}  # known_trip_count of the scans over 4 layers
    totals = {(t.kind, t.axes): t for t in summarize(collectives)}
    gathers = [c for c in collectives if c.kind == "all-gather"]
    assert totals[("all-gather", ("fsdp",))].count == 4 * len(gathers)
    assert totals[("all-gather", ("fsdp",))].total_bytes == 4 * sum(c.size_bytes for c in gathers)
    assert all(t.exact for t in totals.values())


# --------------------------------------------------------------------------- real HLO, TPU compiler (compile-only)


def test_tpu_fixture_small_psum_scatter_becomes_all_reduce():
    text = (DATA / "tpu_v5e_4x4_small_psum_scatter.hlo").read_text()
    (collective,), _ = parse_collectives(text, MESH224)
    assert (collective.kind, collective.axes, collective.result_shapes) == ("all-reduce", ("fsdp",), ((8, 128),))
    assert "dynamic-slice" in text and "reduce-scatter(" not in text


def test_tpu_fixture_fsdp_tp_step_v5p():
    collectives, skipped = fixture("tpu_v5p_2x2x2_fsdp_tp_step.hlo", MESH222)
    assert skipped == ()
    assert kinds_and_axes(collectives) >= {
        ("all-gather", ("fsdp",)),
        ("reduce-scatter", ("fsdp",)),
        ("all-reduce", ("data",)),
        ("all-reduce", ("tensor",)),
    }
    (scatter,) = [c for c in collectives if c.kind == "reduce-scatter"]
    assert scatter.fused and "all-reduce + dynamic-slice" in scatter.form  # the %all-reduce-scatter fusion
    assert scatter.combined and scatter.operand_bytes == 2 * scatter.result_bytes  # both weight gradients
    data_reduce = by_kind_axes(collectives, "all-reduce", ("data",))
    assert data_reduce.combined and len(data_reduce.operand_shapes) == 2  # both weight gradients in one all-reduce
    assert "<=" in (DATA / "tpu_v5p_2x2x2_fsdp_tp_step.hlo").read_text()  # iota-form groups were parsed


def test_tpu_fixture_async_collective_fusion_counts_once():
    text = (DATA / "tpu_v5e_4x4_async_collective_fusion.hlo").read_text()
    assert text.count(" all-gather(") == 3  # start, continuation, done fusions each hold a copy
    collectives, _ = parse_collectives(text, MESH224)
    (gather,) = [c for c in collectives if c.kind == "all-gather"]
    assert gather.is_async and gather.fused and gather.axes == ("fsdp",)
    assert "async collective fusion" in gather.form


SPARSECORE = """HloModule sparsecore, num_partitions=4, is_scheduled=true

%sc_gather (p: bf16[2,4]) -> bf16[8,4] {
  %p = bf16[2,4]{1,0} parameter(0)
  ROOT %ag = bf16[8,4]{1,0} all-gather(%p), channel_id=5, replica_groups={{0,1,2,3}}, dimensions={0}, \
use_global_device_ids=true
}

ENTRY %main (b: bf16[2,4]) -> bf16[8,4] {
  %b = bf16[2,4]{1,0} parameter(0)
  %ag-start = ((bf16[2,4]{1,0}), bf16[8,4]{1,0}) call-start(%b), async_execution_thread="sparsecore", \
to_apply=%sc_gather
  %n = bf16[2,4]{1,0} negate(%b)
  ROOT %ag-done = bf16[8,4]{1,0} call-done(%ag-start)
}
"""


def test_a_collective_on_the_sparsecores_is_an_async_call_around_it():
    # TPU7x with the SparseCore offload flags: the all-gather runs in a computation called on another thread
    from lab.hlo.schedule import overlap_report
    from lab.targets.hardware import profile

    (gather,) = parse_collectives(SPARSECORE, (4,), ("x",))[0]
    assert gather.kind == "all-gather" and gather.axes == ("x",) and gather.form.startswith("async-start %ag-start")
    (window,) = overlap_report(SPARSECORE, profile("tpu7x")).windows
    assert (window.start, window.done, window.between) == ("ag-start", "ag-done", ("n",)) and window.is_async
