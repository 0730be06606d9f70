"""lab.overlap: collective matmul against its plain twin; schedules, roofline and overlap windows."""

from pathlib import Path

import jax
import numpy as np
import pytest

from lab import overlap
from lab.bench import Timing, time_interleaved
from lab.errors import LabError
from lab.hardware import profile
from lab.mesh import MeshSpec

DATA = Path(__file__).parent / "data" / "hlo"
SHAPE = (64, 32, 48)  # M, K, F: every split dimension a multiple of 8


@pytest.fixture(scope="module")
def ring_mesh(devices):
    return MeshSpec(tensor=8).build(devices)


@pytest.fixture(scope="module")
def compiled(ring_mesh):
    """Every variant compiled once, with its inputs and output."""
    out = {}
    for name in overlap.VARIANTS:
        program = overlap.build_matmul(name, ring_mesh, "tensor", SHAPE)
        x, w = program.example_inputs()
        executable = program.fn.lower(*program.abstract_inputs()).compile()
        out[name] = (executable, (x, w), np.asarray(executable(x, w)))
    return out


@pytest.mark.parametrize("name", list(overlap.VARIANTS))
def test_every_variant_computes_x_at_w(compiled, name):
    _, (x, w), y = compiled[name]
    np.testing.assert_allclose(y, np.asarray(x) @ np.asarray(w), rtol=1e-5, atol=1e-5)


def test_the_all_gather_rings_match_the_plain_program_exactly(compiled):
    plain = compiled["all-gather then matmul"][2]
    assert np.array_equal(compiled["ring all-gather matmul"][2], plain)
    assert np.array_equal(compiled["bidirectional all-gather matmul"][2], plain)


def test_the_ring_interleaves_n_minus_1_permutes_with_its_products(compiled):
    text = compiled["ring all-gather matmul"][0].as_text()
    line = overlap.timeline(text)
    assert line.count("C") == 7 and "CC" not in line  # XLA:CPU: synchronous permutes, a product after each
    assert overlap.timeline(compiled["all-gather then matmul"][0].as_text()) == "CM"


def test_a_matrix_the_ring_does_not_divide_is_refused(ring_mesh):
    with pytest.raises(LabError, match="M=60 is not a positive multiple of 8"):
        overlap.build_matmul("ring all-gather matmul", ring_mesh, "tensor", (60, 32, 48))
    with pytest.raises(LabError, match="K=30"):
        overlap.build_matmul("ring matmul reduce-scatter", ring_mesh, "tensor", (64, 30, 48))
    with pytest.raises(LabError, match="unknown matmul variant"):
        overlap.build_matmul("telepathy", ring_mesh, "tensor", SHAPE)
    with pytest.raises(LabError, match="not a mesh axis"):
        overlap.build_matmul("ring all-gather matmul", ring_mesh, "rows", SHAPE)


def test_matmul_flops_from_the_schedule_equal_xla_cost_analysis(compiled):
    executable = compiled["all-gather then matmul"][0]
    schedule = overlap.parse_schedule(executable.as_text())
    total = sum(overlap.flops(schedule, schedule.entry, i) for i in schedule.computations[schedule.entry])
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
    report = overlap.overlap_report(SYNTHETIC, chip, (4,), (4,), ("data",))
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
    assert overlap.timeline(SYNTHETIC) == "[M]C"


def test_a_tpu_async_collective_fusion_chain_is_one_window_holding_its_continuation():
    text = (DATA / "tpu_v5e_4x4_async_collective_fusion.hlo").read_text()
    report = overlap.overlap_report(text, profile("v5e"), (4, 4), (2, 1, 2, 1, 4))
    gather = next(w for w in report.windows if w.collective.kind == "all-gather")
    assert gather.is_async and gather.start == "async-collective-start" and gather.done == "async-collective-done"
    assert "fusion.8" in gather.between and gather.compute_s > 0  # the continuation carries a matmul
    assert all(0 <= w.hidden_fraction <= 1 for w in report.windows)
    assert overlap.timeline(text).startswith("[M]")


def test_scheduled_text_without_an_entry_is_refused():
    with pytest.raises(LabError, match="no ENTRY computation"):
        overlap.parse_schedule("HloModule m\n")


def test_interleaved_timing_gives_every_program_its_rounds():
    square = jax.jit(lambda x: x * x)
    timings = time_interleaved({"a": (square, (np.ones(4),)), "b": (square, (np.ones(8),))}, repeats=3)
    assert set(timings) == {"a", "b"} and all(
        isinstance(t, Timing) and t.repeats == 3 and t.min <= t.median <= t.max for t in timings.values()
    )
