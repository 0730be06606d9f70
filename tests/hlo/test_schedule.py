"""lab.hlo.schedule: scheduled HLO, the roofline price of its compute, and the overlap window of each collective."""

from pathlib import Path

import pytest

from lab.errors import LabError
from lab.hlo.schedule import flops, flops_in_flight, overlap_report, parse_schedule, timeline, window_flops
from lab.mesh import MeshSpec
from lab.parallel.collective_matmul import build_matmul
from lab.targets.hardware import profile

DATA = Path(__file__).parents[1] / "data" / "hlo"
SHAPE = (64, 32, 48)  # M, K, F: every split dimension a multiple of 8


@pytest.fixture(scope="module")
def compiled(devices):
    """The plain all-gather matmul over 8 devices, compiled once."""
    program = build_matmul("all-gather then matmul", MeshSpec(tensor=8).build(devices), "tensor", SHAPE)
    return {"all-gather then matmul": (program.fn.lower(*program.abstract_inputs()).compile(),)}


def test_matmul_flops_from_the_schedule_equal_xla_cost_analysis(compiled):
    executable = compiled["all-gather then matmul"][0]
    schedule = parse_schedule(executable.as_text())
    total = sum(flops(schedule, schedule.entry, i) for i in schedule.computations[schedule.entry])
    m, k, f = SHAPE
    assert total == 2 * m * k * (f // 8) == executable.cost_analysis()["flops"]


SYNTHETIC = """HloModule m, is_scheduled=true, num_partitions=4

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main (p: f32[256,512], w: f32[512,1024]) -> (f32[1024,512], f32[256,1024]) {
  %p = f32[256,512]{1,0} parameter(0)
  %w = f32[512,1024]{1,0} parameter(1)
  %ags = (f32[256,512]{1,0}, f32[1024,512]{1,0}) all-gather-start(%p), replica_groups={{0,1,2,3}}, dimensions={0}
  %dot = f32[256,1024]{1,0} dot(%p, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %agd = f32[1024,512]{1,0} all-gather-done(%ags)
  %ar = f32[256,1024]{1,0} all-reduce(%dot), replica_groups={{0,1,2,3}}, to_apply=%add
  ROOT %t = (f32[1024,512]{1,0}, f32[256,1024]{1,0}) tuple(%agd, %ar)
}
"""


def test_windows_credit_the_compute_between_start_and_done():
    chip = profile("v5e")
    report = overlap_report(SYNTHETIC, chip, (4,), (4,), ("data",))
    gather, reduce = report.windows
    assert gather.is_async and gather.between == ("dot",)
    dot_s = max(
        2 * 256 * 512 * 1024 / chip.peak_bf16_flops, 4 * (256 * 512 + 512 * 1024 + 256 * 1024) / chip.hbm_bandwidth
    )
    assert gather.compute_s == pytest.approx(dot_s)
    assert gather.hidden_s == pytest.approx(min(dot_s, gather.comm_s)) and gather.exposed_s == pytest.approx(
        gather.comm_s - gather.hidden_s
    )
    assert not reduce.is_async and reduce.hidden_s == 0 and reduce.exposed_s == reduce.comm_s
    assert report.exposed_s == pytest.approx(gather.exposed_s + reduce.comm_s)
    assert report.step_s == pytest.approx(dot_s + report.exposed_s)
    assert timeline(SYNTHETIC) == "[M]C"


def test_window_flops_and_flops_in_flight_count_the_matmuls_under_a_transfer_once():
    chip = profile("v5e")
    report = overlap_report(SYNTHETIC, chip, (4,), (4,), ("data",))
    schedule = parse_schedule(SYNTHETIC)
    gather, reduce = report.windows
    assert window_flops(schedule, gather) == 2 * 256 * 512 * 1024 and window_flops(schedule, reduce) == 0
    # the same dot inside two windows counts once
    assert flops_in_flight(schedule, [gather, gather, reduce]) == 2 * 256 * 512 * 1024


LOOPED_SCATTER = """HloModule m, is_scheduled=true, num_partitions=4

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%all-reduce-scatter.1 (input: f32[1024,512]) -> f32[256,512] {
  %input = f32[1024,512]{1,0} parameter(0)
  %ar = f32[1024,512]{1,0} all-reduce(%input), channel_id=1, replica_groups={{0,1,2,3}}, to_apply=%add
  %pid = u32[] partition-id()
  %rows = u32[] constant(256)
  %offset = u32[] multiply(%pid, %rows)
  %zero = u32[] constant(0)
  ROOT %ds = f32[256,512]{1,0} dynamic-slice(%ar, %offset, %zero), dynamic_slice_sizes={256,512}
}

%body (state: (s32[], f32[1024,512])) -> (s32[], f32[1024,512]) {
  %state = (s32[], f32[1024,512]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%state), index=0
  %x = f32[1024,512]{1,0} get-tuple-element(%state), index=1
  %scatter = f32[256,512]{1,0} fusion(%x), kind=kCustom, calls=%all-reduce-scatter.1
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %out = (s32[], f32[1024,512]{1,0}) tuple(%next, %x)
}

%cond (state: (s32[], f32[1024,512])) -> pred[] {
  %state = (s32[], f32[1024,512]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%state), index=0
  %n = s32[] constant(6)
  ROOT %less = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (p: f32[1024,512]) -> (s32[], f32[1024,512]) {
  %p = f32[1024,512]{1,0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[1024,512]{1,0}) tuple(%zero, %p)
  ROOT %loop = (s32[], f32[1024,512]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"6"}}
}
"""  # noqa: E501


def test_a_reduce_scatter_fusion_in_a_loop_body_is_a_step_of_the_body_run_every_trip(devices):
    """libtpu's in-loop %all-reduce-scatter fusion: priced per layer, not once at the while (as it once was)."""
    from lab.predict.ops import Efficiency, predict_step

    chip = profile("v5p")
    (window,) = overlap_report(LOOPED_SCATTER, chip, (4,), (1, 4, 1, 1, 1)).windows
    assert (window.computation, window.start, window.done) == ("body", "scatter", "scatter")
    assert window.collective.kind == "reduce-scatter" and window.runs == 6

    mesh = MeshSpec(fsdp=4).build(devices[:4])
    (priced,) = predict_step(LOOPED_SCATTER, mesh, chip, Efficiency()).comms
    assert (priced.name, priced.runs) == ("scatter", 6)  # once a trip, not once a step


TPU_SHAPE = (8192, 4096, 65536)  # the overlap page's TPU shape: each block product longer than its transfer


@pytest.fixture(scope="module")
def tpu_reports():
    """The plain and the ring all-gather matmul compiled for v5e:2x4 (compile-only), with their overlap reports."""
    import jax.numpy as jnp

    from lab.hlo import inspect
    from lab.targets.devices import topology_devices, topology_shape

    try:
        chips = topology_devices("v5e:2x4")
    except LabError as err:
        pytest.skip(str(err))
    mesh, chip = MeshSpec(tensor=len(chips)).build(chips), profile("v5e")
    reports = {}
    for name in ("all-gather then matmul", "ring all-gather matmul"):
        program = build_matmul(name, mesh, "tensor", TPU_SHAPE, jnp.bfloat16)
        inspection = inspect(program.fn, *program.abstract_inputs(), mesh=mesh)
        reports[name] = overlap_report(
            inspection.optimized_hlo, chip, topology_shape("v5e:2x4"), inspection.mesh_shape, inspection.axis_names
        )
    return chip, reports


def test_a_synchronous_all_gather_hides_nothing_so_the_priced_step_is_matmul_plus_transfer(tpu_reports):
    """The identity the overlap page used to show as a check: one pricing on both sides."""
    chip, reports = tpu_reports
    plain = reports["all-gather then matmul"]
    m, k, f = TPU_SHAPE
    assert plain.hidden_s == 0
    assert plain.compute_s == pytest.approx(2 * m * k * f / 8 / chip.peak_bf16_flops)
    assert plain.step_s == pytest.approx(plain.compute_s + plain.communication_s, rel=1e-12)


def test_the_ring_priced_from_its_schedule_is_the_closed_form_plus_its_output_buffer(tpu_reports):
    from lab.theory import collective_matmul_time

    chip, reports = tpu_reports
    ring = reports["ring all-gather matmul"]
    m, k, f = TPU_SHAPE
    closed = collective_matmul_time(2 * m * k * f / 8 / chip.peak_bf16_flops, ring.windows[0].comm_s, 8)
    assert ring.hidden_s == pytest.approx(ring.communication_s)  # every transfer under a block product
    assert closed <= ring.step_s <= 1.1 * closed  # the zero-filled output buffer and its updates: a few %


def test_a_tpu_async_collective_fusion_chain_is_one_window_holding_its_continuation():
    text = (DATA / "tpu_v5e_4x4_async_collective_fusion.hlo").read_text()
    report = overlap_report(text, profile("v5e"), (4, 4), (2, 1, 2, 1, 4))
    gather = next(w for w in report.windows if w.collective.kind == "all-gather")
    assert gather.is_async and gather.start == "async-collective-start" and gather.done == "async-collective-done"
    assert "fusion.8" in gather.between and gather.compute_s > 0  # the continuation carries a matmul
    assert all(0 <= w.hidden_fraction <= 1 for w in report.windows)
    assert timeline(text).startswith("[M]")


def test_scheduled_text_without_an_entry_is_refused():
    with pytest.raises(LabError, match="no ENTRY computation"):
        parse_schedule("HloModule m\n")
