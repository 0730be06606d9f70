"""Micro-batches: the compiled schedules' bubble, the buffers' depth and XLA's temp memory against the model; the
claims judged from this run. Timings are never asserted."""

import pytest

from experiments.q44_microbatches import Config
from lab.errors import LabError
from lab.registry import get
from tests.experiments.support import pinned


@pytest.fixture(scope="module")
def result(devices):
    return get("microbatches").run(Config(stages=2, batch=8, micro_batches=(2, 4), gpipe_micro_batches=(4,), repeats=1))


def test_schedules_buffers_and_memory_agree(result):
    model = "XLA temp memory against (depth + 3) micro-batch slots + the weight gradients"
    assert pinned(result) == {
        "1F1B m=2: ticks the step loop runs = 2(m+P-1)": "agrees",
        "1F1B m=2: idle share of the step's (tick, stage) slots = (P-1)/(m+P-1)": "agrees",
        "1F1B m=4: ticks the step loop runs = 2(m+P-1)": "agrees",
        "1F1B m=4: idle share of the step's (tick, stage) slots = (P-1)/(m+P-1)": "agrees",
        "1F1B m=2: buffer depth (micro-batches kept) against min(P, m)": "agrees",
        f"1F1B m=2: {model}": "agrees",
        "1F1B m=4: buffer depth (micro-batches kept) against min(P, m)": "agrees",
        f"1F1B m=4: {model}": "agrees",
        "GPipe m=4: buffer depth (micro-batches kept) against m": "agrees",
        f"GPipe m=4: {model}": "agrees",
    }
    found = {(c["schedule"], c["m"]): c for c in [*result.observations["one_f_one_b"], *result.observations["gpipe"]]}
    assert found["1f1b", 4]["depth"] == 2 and found["gpipe", 4]["depth"] == 4  # P against m micro-batches kept
    assert found["1f1b", 4]["temp"] < found["gpipe", 4]["temp"]


def test_the_claims_are_judged_from_this_run(result):
    statuses = {c.claim: c.status for c in result.claims}
    assert statuses["more micro-batches shrink the bubble, (P-1)/(m+P-1), toward zero"] == "confirmed"
    assert statuses["more micro-batches usually mean more activation memory"] == "refuted"
    assert statuses["at m = 10 the bubble may already be below 10%"] == "confirmed"  # P = 2: 1/11
    assert "the best m lies between 2(P-1) and 4(P-1) = 2..4" in statuses  # from the clock: unpinned


def test_bad_input_is_a_lab_error(devices):
    with pytest.raises(LabError, match="does not split into m=3"):
        get("microbatches").run(Config(batch=8, micro_batches=(1, 3)))
    with pytest.raises(LabError, match="at least two micro-batch counts"):
        get("microbatches").run(Config(batch=8, micro_batches=(4,), gpipe_micro_batches=(4,)))
