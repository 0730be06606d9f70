"""lab.hlo.schedule: scheduled HLO, the roofline price of its compute, and the overlap window of each collective."""

from pathlib import Path

import pytest

from lab.errors import LabError
from lab.hardware import profile
from lab.hlo.schedule import flops, overlap_report, parse_schedule, timeline
from lab.mesh import MeshSpec
from lab.parallel.collective_matmul import build_matmul

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
