"""scaling_thresholds compiled for a 2x2x2 v5p slice (libtpu, no TPU): the book's thresholds against XLA's program."""

import pytest

from experiments.q50_scaling_thresholds import Config, crossing
from lab.registry import get
from tests.experiments.support import pinned

pytestmark = pytest.mark.long  # full-width MLP steps compiled by libtpu: scheduled first (tests/conftest.py)

SMALL = Config(
    target="tpu:v5p:2x2x2",
    batch_per_chip=(256, 4096),  # the ratio is a + b/(B/N): two points fix the crossing
    tensor_ways=(4,),
    pod_topologies=(),
    benchmark_preset="tiny",
    benchmark_topology="v5p:2x2x2",
)


@pytest.fixture(scope="module")
def result():
    return get("scaling_thresholds").run(SMALL)


def test_the_books_thresholds_are_refined_by_the_collectives_xla_wrote(result):
    # 2x2x2 lines: M = 0.5 per dimension. data parallel: the book's α/M_X = 2550/1.5 = 1700; XLA all-reduces the two
    # gradients over 8 chips, 2·(7/8)·2DF bf16 bytes, against 12·D·F FLOPs per token: 1700 · (7/8) · (2/3) = 992
    assert pinned(result) == {
        "data parallel: FLOPs per chip at B/N=4096 (12·B·D·F/N)": "agrees",
        "data parallel: tokens per chip where compute = communication (α/M_X)": ("refined", 991.5),
        "FSDP: FLOPs per chip at B/N=4096 (12·B·D·F/N)": "agrees",
        "FSDP: tokens per chip where compute = communication (α/M_X)": ("refined", 1487.2),
        "FSDP x TP: FLOPs per chip at B/N=4096 (12·B·D·F/N)": "agrees",
        "FSDP x TP: tokens per chip where compute = communication (Y=4: α/(Y·M_X·(1-α·Y/(M_Y·F))))": (
            "refined",
            503.7,
        ),
        # the book's α·Y/(M_Y·F) = 0.311; XLA: two all-reduces over 4 chips ((3/4) of the large-N bytes) against
        # 12·D·F FLOPs per token where the book counts 8: 0.311 · (3/4) · (2/3) = 0.156
        "tensor parallel Y=4: tensor-axis communication / compute (α·Y/(M_Y·F), compute-bound below 1)": (
            "refined",
            0.1556,
        ),
    }


def test_the_claim_is_judged_from_the_crossings(result):
    assert [(c.claim, c.status) for c in result.claims] == [
        ("TP + FSDP keeps the step compute-bound where an ever larger FSDP does not", "confirmed")
    ]


def test_the_observations_hold_the_program_and_the_benchmark(result):
    fsdp = result.observations["sweep"]["FSDP"]
    assert [s["batch_per_chip"] for s in fsdp] == [256, 4096] and all(s["chips"] == 8 for s in fsdp)
    assert result.observations["benchmark"]["chips"] == 8 and result.observations["benchmark"]["collectives"] > 0
    assert result.provenance["target"] == "tpu:v5p:2x2x2"


def test_the_crossing_is_exact_for_a_ratio_linear_in_one_over_the_batch():
    def ratio(b):
        return 0.2 + 400 / b  # crosses 1 at 500

    assert crossing([256, 4096], [ratio(256), ratio(4096)]) == pytest.approx(500)
    assert crossing([128, 256, 512, 1024], [ratio(b) for b in (128, 256, 512, 1024)]) == pytest.approx(500)
    assert crossing([1024, 2048], [ratio(1024), ratio(2048)]) is None
