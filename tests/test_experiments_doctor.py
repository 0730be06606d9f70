"""The doctor_cases experiment end to end on cpu:8 (and compile-only v5e).

Each broken layer is named first, and the control is clean.
"""

import pytest

from experiments import get


@pytest.fixture(scope="module")
def result(devices):
    experiment = get("doctor_cases")
    return experiment.run(experiment.config(steps=6, input_ms=100.0))  # a loader far slower than any step here


def test_every_broken_case_is_named_by_its_layer_and_the_control_is_clean(result):
    assert result.passed, [c for c in result.checks if not c.passed]
    firsts = {c.quantity.split(":")[0]: c.observed for c in result.checks if "layer of the first problem" in c.quantity}
    assert firsts == {
        "too_big": "memory",
        "slow_loader": "input",
        "bubble": "layout",
        "collapsed_router": "layout",
        "regather": "communication",
        "tiny_on_tpu": "communication",
        "diverging": "numerics",
    }
    control = next(c for c in result.checks if c.quantity == "control: problems found")
    assert control.observed == 0


def test_the_page_shows_each_ranked_report_with_its_evidence(result):
    titles = [t.title for t in result.tables]
    assert len(titles) == 1 + 8 and all(
        f"{name}: the ranked report" in titles for name in ("control", "too_big", "diverging")
    )
    regather = result.data["regather"]["findings"][0]
    assert regather["check"] == "communication volume per step" and regather["numbers"]["ratio"] >= 4
    assert "#48" in result.notes[0] and "GPU utilisation" in result.notes[0]
