"""The prediction-cost page's judge on hand-made observations, and its one measured piece: a process's own peak."""

import pytest

from experiments import q50_prediction_cost as page
from lab.errors import LabError
from lab.provenance import Setup


def _row(model: str, wall_s: float = 90.0, rss_gib: float = 5.0, closed_form_ratio: float = 1.02) -> page.Row:
    return page.Row(
        model=model,
        target="tpu:v5p:8x16x16",
        mesh="fsdp=2048",
        seq=4096,
        parameters=int(671e9),
        wall_s=wall_s,
        peak_rss_gib=rss_gib,
        compile_s=wall_s * 0.9,
        layers_compiled=61,
        layers=61,
        step_s=11.0,
        memory_bytes=15 * 2**30,
        hbm_bytes=95 * 2**30,
        hardware_flops_per_chip=1.7e15,
        closed_form_flops_per_chip=1.7e15 * closed_form_ratio,
        closed_form_step_s=4.7,
    )


def _judged(*rows):
    obs = page.Observations(Setup.of("tpu:v5p:8x16x16", [], "fsdp=2048"), rows=rows, wall_s=300.0)
    return page.judge(obs, page.Config())


def test_within_the_bar_every_check_agrees_and_the_claim_is_confirmed():
    result = _judged(_row("deepseek-v3"), _row("llama3-405b"))
    assert {c.verdict for c in result.checks} == {"agrees"}
    assert result.claims[0].status == "confirmed"


@pytest.mark.parametrize(
    ("row", "failing"),
    [
        (_row("deepseek-v3", wall_s=121.0), "wall time"),
        (_row("deepseek-v3", rss_gib=8.5), "peak resident memory"),
        (_row("deepseek-v3", closed_form_ratio=1.2), "compiled = closed form"),
    ],
)
def test_each_check_fails_past_its_bar(row, failing):
    result = _judged(row, _row("llama3-405b"))
    differ = [c.quantity for c in result.checks if c.verdict == "differs"]
    assert len(differ) == 1 and failing in differ[0] and "deepseek-v3" in differ[0]
    assert result.claims[0].status == ("confirmed" if failing == "compiled = closed form" else "refined")


def test_an_unknown_model_is_refused_before_any_compile():
    with pytest.raises(
        LabError, match="--models gpt-5: choose among llama3-405b, deepseek-v3, llama4-maverick, gpt-oss-120b"
    ):
        page.measure(page.Config(models=("gpt-5",)))


def test_a_case_is_typed_as_a_user_types_it():
    case = page.CASES[1]
    assert case.argv() == [
        *("--model", "deepseek-v3", "--target", "tpu:v5p:8x16x16", "--mesh", "fsdp=256,expert=8"),
        *("--seq", "4096", "--batch-per-device", "1", "--json"),
    ]
