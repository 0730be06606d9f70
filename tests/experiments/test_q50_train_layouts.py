"""train_layouts on two layouts: parity with one device, what XLA inserted per axis, and the tuple it combined.

No timing is asserted.
"""

import pytest

from experiments.q50_train_layouts import Config
from lab.registry import get
from tests.experiments.support import pinned


@pytest.fixture(scope="module")
def result(devices):
    return get("train_layouts").run(
        Config(dense_layouts=("data=2,fsdp=2,tensor=2",), moe_layouts=("fsdp=2,expert=4",), steps=4, global_batch=8)
    )


def test_parity_structure_and_the_megatron_bytes_refined_by_the_arrays_xla_combined(result):
    # one [b, s, d] fp32 activation: b = 8 / (data 2 x fsdp 2) = 2, s = 32, d = 64: 16 KiB; 2 layers -> 8 textbook,
    # 12 arrays as written (the q, k and v input gradients as one 3-array tuple per layer)
    assert pinned(result) == {
        "tiny on data=2,fsdp=2,tensor=2: largest relative loss difference from the 1-device run": "agrees",
        "tiny on data=2,fsdp=2,tensor=2: ZeRO-3 gathers weights over fsdp": "agrees",
        "tiny on data=2,fsdp=2,tensor=2: activation all-reduces over tensor per step (4 per layer applied)": "agrees",
        "tiny on data=2,fsdp=2,tensor=2: bytes they carry per step (4 activations of b·s·d per layer applied)": (
            "refined",
            12 * 16384,
        ),
        "tiny-moe on fsdp=2,expert=4: largest relative loss difference from the 1-device run": "agrees",
        "tiny-moe on fsdp=2,expert=4: ZeRO-3 gathers weights over fsdp": "agrees",
        "tiny-moe on fsdp=2,expert=4: expert parallelism dispatches with all-to-all over expert": "agrees",
    }


def test_the_frequency_claim_is_judged_from_the_counts(result):
    # ZeRO-3 gathers every weight of every layer: more collectives over fsdp than TP's 4 per layer, and smaller
    assert [(c.claim.split(";")[0], c.status) for c in result.claims] == [
        ("TP all-reduces every layer (high frequency)", "refuted")
    ]


def test_the_table_lists_every_run_with_its_control_first(result):
    assert [row[:2] for row in result.tables[0].rows] == [
        ["tiny", "data=1"],
        ["tiny", "data=2,fsdp=2,tensor=2"],
        ["tiny-moe", "data=1"],
        ["tiny-moe", "fsdp=2,expert=4"],
    ]
    assert set(result.plots) == {"tokens_per_s"}
