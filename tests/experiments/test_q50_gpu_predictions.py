"""The GPU-predictions page's judge on hand-made observations, and the committed page's own numbers."""

import json
from dataclasses import replace
from pathlib import Path

import pytest

from experiments import q50_gpu_predictions as page
from lab.predict import calibration
from lab.provenance import Setup

PAGE = Path(__file__).resolve().parents[2] / "results" / "gpu_predictions" / "result.json"


GEMM = ("mlp/bsd,df->bsf/dot_general", "compute", 0.07, 2.0, 32 * 3.7e13)  # XLA's own price 29x the lab's


def _point(name="one node", step=1.4, xla=0.7, flash=0.02, chips=8, xla_compute=30.0) -> page.Point:
    return page.Point(
        name, f"gpu:h100:{chips // 8}x8", "fsdp=8", 2, 32, step, xla, flash, step - xla + flash, step * 0.9,
        {"fsdp on NVLink within one node (8 GPUs)": 0.1}, 3.5e15, 3.0e15, 0.25, chips, 100 * 2**30, 80e9, 7.0,
        0.12, xla_compute, 0.1, (GEMM, ("norm/add", "memory", 0.02, 0.021, 0.0)),
    )  # fmt: skip


def _observations() -> page.Observations:
    solved = calibration.MATMUL_EFFICIENCY["h100"] + 1e-5
    return page.Observations(
        Setup("gpu:h100:1x8", "8 x NVIDIA H100 80GB HBM3", "fsdp=8"),
        solved_matmul=solved,
        stored_matmul=round(solved, calibration.MATMUL_DIGITS),
        hbm=0.9,
        calibration_run=_point(step=1.401, flash=0.02),  # with flash: 0.721
        held_out=_point("32 nodes", step=2.7, xla=1.4, flash=0.1, chips=256),  # with flash: 1.4
        wall_s=20.0,
    )


def _verdicts(obs) -> list[str]:
    result = page.judge(obs, page.Config())
    assert result.tables and result.summary
    return [c.verdict for c in result.checks]


def test_the_page_agrees_on_consistent_observations():
    assert _verdicts(_observations()) == ["agrees"] * 3


@pytest.mark.parametrize(
    ("index", "perturb"),
    [
        (0, lambda o: replace(o, solved_matmul=o.solved_matmul + 0.001)),  # the code moved the fit
        (1, lambda o: replace(o, calibration_run=replace(o.calibration_run, step_with_flash_s=0.9))),
        (2, lambda o: replace(o, held_out=replace(o.held_out, step_with_flash_s=1.8))),  # +20%
    ],
)
def test_each_check_can_fail(index, perturb):
    assert _verdicts(perturb(_observations()))[index] == "differs"


def test_the_ops_table_lists_only_what_differs_by_more_than_2x_and_says_which_is_closer():
    table = next(t for t in page.judge(_observations(), page.Config()).tables if "differs by more than 2x" in t.title)
    assert [row[0] for row in table.rows] == [GEMM[0]] and table.rows[0][-1] == "592"  # 32 x 37 TFLOP in 2 s
    assert "exceeds the whole published step" in table.note
    beside = next(t for t in page.judge(_observations(), page.Config()).tables if "own estimate beside" in t.title)
    assert "the lab's is the nearer" in beside.note
    closer = replace(_observations().held_out, xla_compute_s=1.4)  # XLA's serial 1.5 s: the published step
    beside = next(
        t
        for t in page.judge(replace(_observations(), held_out=closer), page.Config()).tables
        if "own estimate beside" in t.title
    )
    assert "XLA's is the nearer" in beside.note


def test_the_committed_page_replaces_exactly_the_attention_and_solved_the_stored_constant():
    observed = json.loads(PAGE.read_text())["observations"]
    assert round(observed["solved_matmul"], calibration.MATMUL_DIGITS) == calibration.MATMUL_EFFICIENCY["h100"]
    for point, chips in ((observed["calibration_run"], 8), (observed["held_out"], 256)):
        assert point["chips"] == chips
        assert 0 < point["attention_flash_s"] < point["attention_xla_s"] < point["step_s"]
        assert point["step_with_flash_s"] == pytest.approx(
            point["step_s"] - point["attention_xla_s"] + point["attention_flash_s"]
        )
    across = observed["held_out"]["exposed_by_link"]
    assert any("InfiniBand across 32 nodes" in link for link in across)  # data over the 32 nodes' NICs
