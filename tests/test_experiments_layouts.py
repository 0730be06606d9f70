"""train_layouts end to end on three layouts: parity with one device, and what XLA inserted per axis.

No timing is asserted.
"""

import pytest

from experiments import get
from experiments.q50_train_layouts import Config


@pytest.fixture(scope="module")
def page():
    return get("train_layouts").run(
        Config(dense_layouts=("data=2,fsdp=2,tensor=2",), moe_layouts=("fsdp=2,expert=4",), steps=4, global_batch=8)
    )


def test_every_layout_matches_its_one_device_control(page):
    parity = [c for c in page.checks if "loss difference" in c.quantity]
    assert len(parity) == 2 and all(c.verdict == "agrees" for c in parity)
    assert [row[:2] for row in page.tables[0].rows] == [
        ["tiny", "data=1"],
        ["tiny", "data=2,fsdp=2,tensor=2"],
        ["tiny-moe", "data=1"],
        ["tiny-moe", "fsdp=2,expert=4"],
    ]


def test_the_collectives_of_each_axis_are_found_and_megatron_is_counted(page):
    verdicts = {c.quantity.split(": ", 1)[1]: c for c in page.checks}
    assert verdicts["ZeRO-3 gathers weights over fsdp"].verdict == "agrees"
    assert verdicts["expert parallelism dispatches with all-to-all over expert"].verdict == "agrees"
    count = verdicts["activation all-reduces over tensor per step (4 per layer applied)"]
    assert (count.theory, count.observed) == (8, 8)
    assert verdicts["bytes they carry per step (4 activations of b·s·d per layer applied)"].verdict in (
        "agrees",
        "refined",
    )
    assert set(page.plots) == {"tokens_per_s"}
