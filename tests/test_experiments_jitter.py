"""throughput_jitter end to end on a short run: five cases, each run as its config says (no timing asserted)."""

import pytest

from experiments import get
from experiments.q53_throughput_jitter import CASES, Config


@pytest.fixture(scope="module")
def page():
    return get("throughput_jitter").run(Config(steps=12, checkpoint_every=4, global_batch=8))


def test_every_case_is_on_the_page_with_its_shape(page):
    rows = page.tables[0].rows
    assert [row[0] for row in rows] == list(CASES)
    assert all(row[1] in ("periodic", "random", "trend", "steady") for row in rows)
    assert len(page.checks) == 10 and set(page.plots) == {"step_times"}


def test_checkpoint_cases_save_every_k_steps_and_loader_cases_wait_at_least_the_loader(page):
    data = page.data
    for case in ("sync checkpoints", "async checkpoints"):
        assert [i for i, saved in enumerate(data[case]["checkpoint"]) if saved] == [3, 7, 11]
    assert not any(data["steady"]["checkpoint"])
    latency = float(data["slow loader"]["config"]["input_ms"]) / 1e3
    assert latency > 0 and all(
        wait >= latency for wait in data["slow loader"]["data_s"]
    )  # the sleep is inside the measured wait
    assert data["slow loader + prefetch"]["config"]["prefetch"] == "8"
