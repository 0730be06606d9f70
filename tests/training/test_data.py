"""The input pipeline: batches depend on the step only, loading costs what it says, prefetch hides it."""

import time

import numpy as np
import pytest

from lab.errors import LabError
from lab.training.data import Loader, batches


def _make(step: int) -> np.ndarray:
    return np.full((2, 3), step, dtype=np.int32)


@pytest.mark.parametrize("prefetch", [0, 1, 3])
def test_batches_come_in_step_order_whatever_the_prefetch(prefetch):
    loader = Loader(_make, jitter_s=0.002, seed=1)  # jitter makes workers finish out of order
    got = [int(b[0, 0]) for b in batches(loader, 5, 12, prefetch)]
    assert got == list(range(5, 12))


def test_cost_is_latency_plus_a_deterministic_exponential_jitter():
    loader = Loader(_make, latency_s=0.01, jitter_s=0.005, seed=3)
    costs = [loader.cost_s(step) for step in range(2000)]
    assert costs == [Loader(_make, 0.01, 0.005, seed=3).cost_s(step) for step in range(2000)]
    assert min(costs) >= 0.01
    assert np.mean(costs) - 0.01 == pytest.approx(0.005, rel=0.1)  # the exponential's mean
    assert Loader(_make, latency_s=0.01).cost_s(7) == 0.01


def test_prefetch_overlaps_loading_with_the_consumer():
    """With the consumer busy as long as a load, a 2-deep prefetch hides all but the first load."""
    loader = Loader(_make, latency_s=0.02)
    waits = []
    stream = batches(loader, 0, 6, prefetch=2)
    for _ in range(6):
        tick = time.perf_counter()
        next(stream)
        waits.append(time.perf_counter() - tick)
        time.sleep(0.03)  # the "step"
    assert waits[0] >= 0.015  # nothing was ready yet
    assert sum(waits[2:]) < sum(waits[:1])  # later batches were already loaded


def test_bad_settings_are_one_clear_error():
    with pytest.raises(LabError, match="must not be negative"):
        Loader(_make, latency_s=-0.001)
    with pytest.raises(LabError, match="--prefetch -1"):
        next(batches(Loader(_make), 0, 3, prefetch=-1))
