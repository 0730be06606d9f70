"""The step-time series analysis names the shape of the jumping: periodic, random, trend or steady."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lab.training.series import analyze, find_period


def _noisy(steps: int, seed: int = 0, level: float = 0.02) -> np.ndarray:
    return level * (1 + 0.02 * np.random.default_rng(seed).standard_normal(steps))


def test_a_save_every_ten_steps_is_a_period_of_ten_at_its_phase():
    t = _noisy(60)
    t[7::10] += 0.1  # a synchronous checkpoint at steps 7, 17, ...
    summary = analyze(t, first_step=1)
    assert summary.pattern == "periodic" and summary.period == 10 and summary.phase == 8
    assert summary.slow_steps == tuple(range(8, 61, 10))
    assert "a dip every 10 steps from step 8" in summary.describe()


def test_random_slow_steps_are_random_not_periodic():
    t = _noisy(80, seed=1)
    t[[3, 11, 12, 30, 47, 70]] += 0.05
    summary = analyze(t)
    assert summary.pattern == "random" and summary.period is None and len(summary.slow_steps) == 6


def test_steady_noise_has_no_slow_steps():
    summary = analyze(_noisy(100, seed=2))
    assert summary.pattern == "steady" and summary.slow_steps == () and summary.cv < 0.05


def test_steps_getting_slower_are_a_trend():
    t = np.linspace(0.02, 0.034, 80) + _noisy(80, seed=3, level=0.0002)
    summary = analyze(t)
    assert summary.pattern == "trend" and summary.trend_ratio > 1.4


def test_a_missing_dip_still_reads_as_periodic_but_two_dips_do_not():
    t = _noisy(100)
    t[5::10] += 0.1
    t[45] -= 0.1  # one save skipped: 9 of 10 lattice points are slow
    assert analyze(t).period == 10
    two = _noisy(100)
    two[[5, 15]] += 0.1
    assert analyze(two).period is None


def test_spread_numbers_are_the_usual_ones():
    t = np.array([1.0, 1.0, 1.0, 1.0, 5.0])
    summary = analyze(t)
    assert summary.median == 1.0 and summary.mean == pytest.approx(1.8)
    assert summary.cv == pytest.approx(np.std(t) / np.mean(t))
    assert summary.excess_fraction == pytest.approx(4.0 / 9.0)
    assert summary.slow_steps == (4,)


@settings(max_examples=60, deadline=None)
@given(period=st.integers(2, 15), phase=st.integers(0, 14), dips=st.integers(3, 8))
def test_any_clean_lattice_is_found(period, phase, dips):
    phase %= period
    slow = np.arange(phase, phase + period * dips, period)
    assert find_period(slow, int(slow[-1]) + 1) == (period, phase)


def test_an_empty_series_is_refused():
    with pytest.raises(ValueError, match="empty"):
        analyze([])
