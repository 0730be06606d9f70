"""Stage imbalance: the quick-reference's case simulated against the flow shop, the executed splits against the
unpipelined model and XLA's argument bytes; the claims judged from this run. Timings are never asserted."""

import pytest

from experiments.q43_stage_imbalance import Config
from lab.errors import LabError
from lab.registry import get
from tests.experiments.support import pinned


@pytest.fixture(scope="module")
def result(devices):
    return get("stage_imbalance").run(Config(split="1,3", micro_batches=2, micro_batch_size=4, repeats=1))


def test_the_flow_shop_the_padding_and_the_numerics_agree(result):
    split = {
        f"split {label}: {what}": "agrees"
        for label in ("1,3", "2,2")
        for what in (
            "XLA's argument bytes per device = widest stage x (a block's weights + its mask) + data + tables",
            *(
                f"executed {name} {quantity}"
                for name in ("gpipe", "1f1b")
                for quantity in (
                    "loss against the same model without a pipeline",
                    "gradient elements off the unpipelined model's by more than 1e-05 of the largest",
                )
            ),
        )
    }
    assert pinned(result) == {
        "2 stages of 2 s and 1 s, m=2: GPipe step, flow-shop formula against the simulator (s)": "agrees",
        "2 stages of 2 s and 1 s, m=2: the fast stage's idle time, T - m(F_1+B_1), against the simulator (s)": "agrees",
        "2 stages of 2 s and 1 s, m=2: GPipe bubble, 1 - sum_s m(F_s+B_s) / (P·T), against the simulator": "agrees",
        "2 stages of 2 s and 1 s, m=2: 1F1B step at most GPipe's flow-shop step (s)": "agrees",
        **split,
    }
    # the padding is real: each device of the 1,3 split holds three blocks' weights, of the 2,2 split two
    by_name = {c.quantity: c for c in result.checks}
    uneven = by_name[
        "split 1,3: XLA's argument bytes per device = widest stage x (a block's weights + its mask) + data + tables"
    ]
    even = by_name[
        "split 2,2: XLA's argument bytes per device = widest stage x (a block's weights + its mask) + data + tables"
    ]
    assert uneven.observed - even.observed == 197120 + 4  # one more tiny block (49280 float32 weights) and its mask


def test_the_claims_are_judged_from_this_run(result):
    statuses = [(c.claim, c.status) for c in result.claims]
    assert statuses[:3] == [
        ("the pipeline's time is set by its slowest stage", "confirmed"),
        ("the fast stage waits 1 s per step", "refined"),  # 1 s per micro-batch and phase, plus the fill and drain
        ("with unequal stages the bubble is no longer (P-1)/(m+P-1)", "confirmed"),
    ]
    assert statuses[3][0] == "moving layers from the slow stage to the fast one fixes it"  # from the clock: unpinned
    assert result.observations["textbook"][0]["makespan"] == pytest.approx(6 + 1 * 4)


def test_bad_input_is_a_lab_error(devices):
    with pytest.raises(LabError, match="integers separated by commas"):
        get("stage_imbalance").run(Config(split="4,four"))
    with pytest.raises(LabError, match="needs a stage axis of 9"):
        get("stage_imbalance").run(Config(split="1,1,1,1,1,1,1,1,1"))
