"""The pod-predictions page's judge on hand-made observations: every exact and model check can fail."""

from dataclasses import replace

import pytest

from experiments import q50_pod_predictions as page
from lab.predict import calibration
from lab.provenance import Setup


def _point(model="llama3.1-8b", step=4.5, layers=0, slices=1, mesh="fsdp=256", dcn=0.0) -> page.Point:
    links = {"fsdp on ICI": 0.1} | ({"data on DCN": dcn} if dcn else {})
    return page.Point(
        model, "tpu:v6e:16x16", slices, 256 * slices, mesh, 8192, 4, layers, step, step * 0.9, sum(links.values()),
        1.0, links, 0.4, 370.0, 20 * 2**30, 32 * 2**30, 0, 10.0, 2.3e15,
    )  # fmt: skip


def _observations() -> page.Observations:
    solved = calibration.MATMUL_EFFICIENCY["v6e"] + 1e-5  # the fit, to more decimals than the constant keeps
    return page.Observations(
        Setup("tpu:v6e:16x16", "256 x TPU v6 lite", "fsdp=256"),
        solved_matmul=solved,
        stored_matmul=round(solved, calibration.MATMUL_DIGITS),
        hbm=0.9,
        whole_8b=_point(step=4.52),
        full_8b=_point(step=4.54),
        read_8b=_point(step=4.55, layers=2),
        held_out_70b=_point("llama3.1-70b", step=41.9),
        held_out_moe=_point("mixtral-8x7b", step=13.9),
        grid=(_point(mesh="fsdp=256"), _point(mesh="fsdp=64,tensor=4", step=4.2)),
        dcn=(_point(), _point(slices=4, dcn=0.05, step=4.6)),
        dcn_read=_point(slices=4, dcn=0.05, step=4.61, layers=2),
        wall_s=200.0,
        compiles=25,
    )


def _verdicts(obs) -> list[str]:
    result = page.judge(obs, page.Config())
    assert result.tables and result.summary and result.claims
    return [c.verdict for c in result.checks]


def test_the_page_agrees_on_consistent_observations():
    assert _verdicts(_observations()) == ["agrees"] * 8


@pytest.mark.parametrize(
    ("index", "perturb"),
    [
        (0, lambda o: replace(o, solved_matmul=o.solved_matmul + 0.001)),  # the code moved the fit
        (1, lambda o: replace(o, whole_8b=replace(o.whole_8b, step_s=6.0))),
        (2, lambda o: replace(o, held_out_70b=replace(o.held_out_70b, step_s=50.0))),
        (3, lambda o: replace(o, held_out_moe=replace(o.held_out_moe, step_s=15.39))),  # +14%
        (4, lambda o: replace(o, read_8b=replace(o.read_8b, step_s=4.8))),
        (5, lambda o: replace(o, read_8b=replace(o.read_8b, memory_bytes=16 * 2**30))),  # 20% under the whole
        (5, lambda o: replace(o, full_8b=replace(o.full_8b, memory_bytes=16 * 2**30))),  # the control moved
        (6, lambda o: replace(o, dcn_read=replace(o.dcn_read, step_s=4.8))),
        (7, lambda o: replace(o, dcn_read=replace(o.dcn_read, memory_bytes=25 * 2**30))),
    ],
)
def test_each_check_can_fail(index, perturb):
    assert _verdicts(perturb(_observations()))[index] == "differs"


def test_the_plot_draws():
    figure = page.judge(_observations(), page.Config()).plots["dcn_slices"]()
    assert figure.axes


def test_libtpus_own_prices_are_held_against_the_held_out_steps():
    obs = _observations()  # the 70B at 41.9 s and Mixtral at 13.9 s, against 42.656 s and 13.484 s published
    nearer = replace(obs.held_out_70b, libtpu_base_s=10.0, libtpu_s=10.5)  # 41.9 -> 42.4 s: nearer 42.656
    further = replace(obs.held_out_moe, libtpu_base_s=5.0, libtpu_s=6.0)  # 13.9 -> 14.9 s: further from 13.484
    claim = page.judge(replace(obs, held_out_70b=nearer, held_out_moe=further), page.Config()).claims[0]
    assert claim.status == "refined" and "10.500 s where the lab says 10.000 s" in claim.numbers
    both = replace(obs, held_out_70b=nearer, held_out_moe=replace(further, libtpu_s=4.8))  # 13.7 s: nearer too
    assert page.judge(both, page.Config()).claims[0].status == "confirmed"
    unpriced = page.judge(obs, page.Config()).claims  # no schedule dumped for either: no claim about libtpu
    assert not any("libtpu" in c.claim for c in unpriced)
