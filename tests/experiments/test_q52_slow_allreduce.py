"""A slow all-reduce is not always a slow network: the structure is exact; the timings are shown, never asserted."""

import math

import pytest

from experiments import q52_slow_allreduce as slow
from experiments.q52_slow_allreduce import Config
from lab.bench import Timing
from lab.provenance import Setup
from lab.registry import get
from tests.experiments.support import pinned


@pytest.fixture(scope="module")
def result(devices):
    return get("slow_allreduce").run(Config(model="tiny", small_bucket="64K", repeats=1))


def test_the_structural_checks(result):
    exact = {q: v for q, v in pinned(result).items() if q in {c.quantity for c in result.checks if c.kind == "exact"}}
    assert exact == {
        "asynchronous collectives in the CPU step": "agrees",
        # two psum groups of 11 tensors; XLA's combiner put all 22 in one tuple all-reduce
        "gradients and the other traffic on the same axis: all-reduces in HLO": ("refined", 1),
        "tpu:v5e:4x4 default compile: asynchronous gradient all-reduces in the schedule": "agrees",
    }
    kinds = {c.quantity.split(":")[0]: c.kind for c in result.checks}
    assert kinds["9 buckets of 64 KiB"] == "model" and len(result.tables[0].rows) == 4


def test_the_tpu_schedule_claim_is_read_from_the_compiled_schedule(result):
    claim = result.claims[-1]
    assert claim.claim.startswith("a collective dragged onto the critical path") and claim.status == "confirmed"


def _timing(seconds):
    return Timing(seconds, seconds, seconds, 1)


def test_the_model_prices_launches_busbw_and_copies_from_the_calibration_programs():
    times = {
        "isolation": 10e-3,
        "backward": 30e-3,
        "step": 40e-3,
        "small buckets": 20e-3,
        "same-axis traffic": 19e-3,
        "copy": 2.3e-3,
        "chain": 0.5e-3 + 63 * 0.2e-3,  # a single call, then 63 more all-reduces
        "single": 0.5e-3,
    }
    obs = slow.Observations(
        setup=Setup("cpu:8", "8 x cpu", "data=8"),
        devices=8,
        bytes=7 * 2**20,
        small_buckets=28,
        chain_length=64,
        timings={k: _timing(v) for k, v in times.items()},
        compiled={"isolation": (), "step": (), "same-axis traffic": ()},
    )
    m = slow.model(obs)
    assert m.alpha == pytest.approx(0.2e-3)
    assert m.copy == pytest.approx(2.3e-3 - (0.5e-3 - 0.2e-3))  # less one program call
    transfer = 10e-3 - 0.2e-3
    assert m.beta == pytest.approx(7 * 2**20 * 2 * 7 / 8 / transfer)
    scenarios = slow._scenarios(obs, m, Config(small_bucket="256K"))
    assert scenarios[2].model_s == pytest.approx(10e-3 + 27 * 0.2e-3 + 2 * m.copy)
    assert scenarios[3].model_s == pytest.approx(10e-3 + transfer)  # twice the bytes: the transfer once more
    assert math.isclose(scenarios[1].allreduce_s, 10e-3)
