"""lab.theory.pipeline: bubbles, step time and activations in flight, against the papers' formulas."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lab.errors import LabError
from lab.theory import pipeline as pipeline_theory


def test_gpipe_bubble_is_small_once_m_is_four_times_k():
    # GPipe (Huang et al. 2019, Sec. 2.3): bubble O((K-1)/(M+K-1)), "negligible when M >= 4 x K"
    for k in (2, 4, 8, 16):
        assert pipeline_theory.pipeline_bubble_fraction(k, 4 * k) == pytest.approx((k - 1) / (5 * k - 1))
        assert pipeline_theory.pipeline_bubble_fraction(k, 4 * k) < 0.2
    assert pipeline_theory.pipeline_bubble_fraction(4, 4) == pytest.approx(3 / 7)  # the quick-reference's example


def test_megatron_bubble_ratio_and_interleaving():
    # Narayanan et al. 2021, Sec. 2.2: t_pb / t_id = (p-1)/m, and (1/v)(p-1)/m interleaved
    assert pipeline_theory.pipeline_bubble_ratio(8, 32) == pytest.approx(7 / 32)
    assert pipeline_theory.pipeline_bubble_ratio(8, 32, chunks=2) == pytest.approx(7 / 64)
    ratio = pipeline_theory.pipeline_bubble_ratio(4, 8, 2)
    assert pipeline_theory.pipeline_bubble_fraction(4, 8, 2) == pytest.approx(
        ratio / (1 + ratio)
    )  # bubble / (ideal + bubble)
    assert pipeline_theory.pipeline_step_time(4, 8, 1.0, 2.0) == pytest.approx(11 * 3)
    assert pipeline_theory.pipeline_step_time(4, 8, 1.0, 2.0, chunks=2) == pytest.approx((8 + 1.5) * 3)


def test_zero_bubble_h1_keeps_a_third_of_the_1f1b_bubble():
    # Qi et al. 2024, Sec. 3.1: 1F1B bubble (p-1)(T_F+T_B+T_W), ZB-H1 (p-1)(T_F+T_B-T_W)
    p, m = 4, 12
    one_f_one_b = pipeline_theory.pipeline_step_time(p, m, 1.0, 2.0) - m * 3.0
    zb = pipeline_theory.zero_bubble_h1_step_time(p, m, 1.0, 1.0, 1.0) - m * 3.0
    assert zb * 3 == pytest.approx(one_f_one_b)
    with pytest.raises(LabError, match="m >= P"):
        pipeline_theory.zero_bubble_h1_step_time(8, 4, 1.0, 1.0, 1.0)


def test_imbalanced_stages_set_the_pace():
    assert pipeline_theory.imbalanced_step_time([1.0] * 4, [2.0] * 4, 8) == pytest.approx(
        pipeline_theory.pipeline_step_time(4, 8, 1.0, 2.0)
    )
    # the quick-reference's follow-up: stage 0 takes 2 s, stage 1 takes 1 s, forward and backward alike
    assert pipeline_theory.imbalanced_step_time([2.0, 1.0], [2.0, 1.0], 8) == pytest.approx(6 + 7 * 4)
    with pytest.raises(LabError, match="one backward time per stage"):
        pipeline_theory.imbalanced_step_time([1.0, 1.0], [1.0], 4)


def test_micro_batches_in_flight():
    assert pipeline_theory.peak_micro_batches_in_flight("gpipe", 4, 16) == 16
    assert [pipeline_theory.peak_micro_batches_in_flight("1f1b", 4, 16, s) for s in range(4)] == [4, 3, 2, 1]
    assert pipeline_theory.peak_micro_batches_in_flight("1f1b", 4, 2) == 2
    assert pipeline_theory.peak_micro_batches_in_flight("interleaved", 4, 16, 0, chunks=2) == pytest.approx(4 + 3 / 2)
    assert pipeline_theory.peak_micro_batches_in_flight("zb-h1", 4, 16, 3) == 4
    with pytest.raises(LabError, match="unknown pipeline schedule"):
        pipeline_theory.peak_micro_batches_in_flight("pipedream-2bw", 4, 16)
    with pytest.raises(LabError, match="not one of the 4 stages"):
        pipeline_theory.peak_micro_batches_in_flight("1f1b", 4, 16, 4)


@given(st.integers(2, 16), st.floats(1e-3, 10.0), st.floats(1e-5, 1e-1))
def test_optimal_micro_batches_minimises_the_step(stages, work, overhead):
    best = pipeline_theory.optimal_micro_batches(stages, work, overhead)

    def step(m: float) -> float:
        return (m + stages - 1) * (work / m + overhead)

    assert step(best) <= min(step(best * 0.9), step(best * 1.1)) + 1e-12


def test_rule_of_thumb_leaves_a_fifth_to_a_third_of_the_step_idle():
    for p in (2, 4, 8, 16):
        assert pipeline_theory.pipeline_bubble_fraction(p, 2 * (p - 1)) == pytest.approx(1 / 3)
        assert pipeline_theory.pipeline_bubble_fraction(p, 4 * (p - 1)) == pytest.approx(1 / 5)


def test_pipeline_theory_rejects_bad_sizes():
    with pytest.raises(LabError, match="positive whole number of micro-batches"):
        pipeline_theory.pipeline_bubble_fraction(4, 0)
    with pytest.raises(LabError, match="positive whole number of chunks"):
        pipeline_theory.pipeline_bubble_fraction(4, 8, chunks=0)
    with pytest.raises(LabError, match="positive work time"):
        pipeline_theory.optimal_micro_batches(4, 1.0, 0.0)
