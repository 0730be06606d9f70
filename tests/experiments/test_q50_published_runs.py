"""The published-runs scoreboard's judge on hand-made observations: every check can fail, the claim follows them."""

from dataclasses import replace

import pytest

from experiments import q50_published_runs as page
from lab.predict import calibration
from lab.provenance import Setup


def _row(run, borrowed_step: float, solved: float | None = 0.9) -> page.Row:
    tflop = run.tflops_per_device * run.step_s * 1e12
    return page.Row(
        name=run.name,
        chip=run.topology.split(":")[0],
        target=f"tpu:{run.topology}",
        mesh=run.mesh,
        seq=run.seq,
        batch_per_device=run.batch_per_device,
        remat=run.compiled_remat,
        attention=run.compiled_attention,
        published_step_s=run.step_s,
        published_tflops=run.tflops_per_device,
        borrowed_matmul=0.6538,
        borrowed_step_s=borrowed_step,
        solved_matmul=solved,
        peak_step_s=run.step_s * 0.8 if solved else run.step_s * 1.05,
        stored_matmul=None if solved is None else round(solved, calibration.MATMUL_DIGITS),
        compute_s=run.step_s * 0.9,
        matmul_bound_s=run.step_s * 0.8,
        memory_bound_s=run.step_s * 0.1,
        exposed_comm_s=run.step_s * 0.1,
        model_flops_per_chip=tflop * 1.01,
        attention_flops_per_chip=tflop * 0.1,
        causal_flops=False,
        hardware_flops_per_chip=tflop * 1.2,
        memory_bytes=10 * 2**30,
        hbm_bytes=16 * 2**30,
        compile_s=40.0,
        differs="",
    )


def _observations(*rows) -> page.Observations:
    runs = page.RUNS
    rows = rows or (_row(runs[0], runs[0].step_s * 1.05), _row(runs[1], runs[1].step_s * 1.4, solved=None))
    return page.Observations(Setup("tpu:v5e:16x16", "compile-only", "fsdp=256"), rows=rows, wall_s=100.0)


def _verdicts(obs) -> list[str]:
    result = page.judge(obs, page.Config())
    assert result.tables and result.summary and result.notes
    return [c.verdict for c in result.checks]


def test_a_run_within_the_bar_agrees_and_one_past_it_differs():
    # per run: the prediction with v6e's constant, the FLOP parity, then the stored constant (or, where none can
    # be solved, the step at the peak against the published one)
    assert _verdicts(_observations()) == ["agrees", "agrees", "agrees", "differs", "agrees", "differs"]
    claims = page.judge(_observations(), page.Config()).claims
    assert len(claims) == 1  # libtpu dumped no schedule in these rows: no claim about its cost model
    assert claims[0].status == "refined" and "+40.0%" in claims[0].numbers and "none: at the peak" in claims[0].numbers


@pytest.mark.parametrize(
    ("index", "perturb"),
    [
        (0, lambda r: replace(r, borrowed_step_s=r.published_step_s * 0.85)),
        (1, lambda r: replace(r, model_flops_per_chip=r.model_flops_per_chip * 1.1)),  # 10% more than MaxText's
        (2, lambda r: replace(r, solved_matmul=r.solved_matmul + 0.001)),  # the code moved the fit
    ],
)
def test_each_check_can_fail(index, perturb):
    run = page.RUNS[0]
    assert _verdicts(_observations(perturb(_row(run, run.step_s))))[index] == "differs"


def test_the_claim_is_refuted_when_no_run_is_within_the_bar():
    runs = page.RUNS
    obs = _observations(*(_row(run, run.step_s * 1.3) for run in runs))
    assert page.judge(obs, page.Config()).claims[0].status == "refuted"


def test_a_run_whose_formula_halved_the_attention_is_counted_so():
    run = page.RUNS[0]
    whole = _row(run, run.step_s)
    halved = replace(whole, model_flops_per_chip=whole.model_flops_per_chip + whole.attention_flops_per_chip / 2)
    assert _verdicts(_observations(halved))[1] == "differs"  # 6% more than MaxText's, counted in full
    assert _verdicts(_observations(replace(halved, causal_flops=True)))[1] == "agrees"


def test_libtpus_second_opinion_is_held_against_the_published_step_like_the_lab():
    run = page.RUNS[0]
    lab_miss = _row(run, run.step_s * 1.2)  # the lab +20% with v6e's constant
    # on ops the lab prices at 5 s, libtpu says 3 s: the held-out step 2 s shorter
    closer = replace(lab_miss, libtpu_base_s=5.0, libtpu_s=3.0)
    claim = page.judge(_observations(closer), page.Config()).claims[1]
    assert page._libtpu_step(closer) == pytest.approx(run.step_s * 1.2 - 2.0)
    assert claim.status == "confirmed" and "0.60x" in claim.numbers
    further = replace(lab_miss, libtpu_base_s=5.0, libtpu_s=15.0)
    assert page.judge(_observations(further), page.Config()).claims[1].status == "refuted"
    unpriced = page.judge(_observations(closer, lab_miss), page.Config()).claims[1]  # one run without a schedule
    assert unpriced.status == "confirmed" and "libtpu dumped no schedule" in unpriced.numbers
