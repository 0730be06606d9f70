"""When overlap backfires: launches counted in the HLO, the combiner refined by its rule, buffers exact, the TPU
schedule at a narrow and a wide width."""

import pytest

from experiments.q46_overlap_backfires import Config
from lab.registry import get
from tests.experiments.support import pinned


@pytest.fixture(scope="module")
def result(devices):
    return get("overlap_backfires").run(Config(model="tiny", tiny_bucket="64K", repeats=1))


def test_launches_buffers_and_what_the_tpu_schedule_overlaps(result):
    narrow, wide = "tpu:v5e:2x4 F=4096", "tpu:v5e:2x4 F=65536"
    assert pinned(result) == {
        "tiny buckets (64 KiB): all-reduces in HLO = ceil(G/b)": "agrees",
        "baseline buckets (4 MiB): all-reduces in HLO = ceil(G/b)": "agrees",
        # XLA:CPU's combiner (no byte threshold, up to 256 operands) makes the 11 psums one tuple all-reduce
        "per-tensor psums: all-reduces in HLO (one per tensor)": ("refined", 1),
        "one bucket: temp memory = packed copy + its sum = 2G (bytes)": "agrees",
        f"{narrow} all-gather then matmul: matmul FLOPs per chip = 2MKF/N": "agrees",
        f"{narrow} all-gather then matmul: matmul FLOPs run while a transfer is in flight (the matmul waits for it)": (
            "agrees"
        ),
        f"{narrow} ring all-gather matmul: matmul FLOPs per chip = 2MKF/N": "agrees",
        f"{narrow} ring all-gather matmul: matmul FLOPs run while a transfer is in flight = (N-1) block products": (
            "agrees"
        ),
        # too narrow to hide anything, the scheduler runs the transfers back to back: products in 2 windows of 7
        f"{narrow} ring all-gather matmul: transfers with a block product in their window": "differs",
        f"{narrow} ring all-gather matmul: bytes sent per chip = the all-gather's (N-1)/N·D": "agrees",
        f"{wide} all-gather then matmul: matmul FLOPs per chip = 2MKF/N": "agrees",
        f"{wide} all-gather then matmul: matmul FLOPs run while a transfer is in flight (the matmul waits for it)": (
            "agrees"
        ),
        f"{wide} ring all-gather matmul: matmul FLOPs per chip = 2MKF/N": "agrees",
        f"{wide} ring all-gather matmul: matmul FLOPs run while a transfer is in flight = (N-1) block products": (
            "agrees"
        ),
        f"{wide} ring all-gather matmul: transfers with a block product in their window": "agrees",
        f"{wide} ring all-gather matmul: bytes sent per chip = the all-gather's (N-1)/N·D": "agrees",
    }


def test_the_claims_are_judged_from_this_run(result):
    assert [(c.claim, c.status) for c in result.claims] == [
        ("Finer buckets mean more launches, each paying a fixed scheduling cost", "confirmed"),
        ("Bucketing for overlap costs extra buffer memory", "confirmed"),
        ("When compute is too short there is little to hide, and overlap can make the step slower", "confirmed"),
    ]


def test_the_tiny_bucket_penalty_is_shown_not_judged(result):
    assert not any("penalty" in c.quantity for c in result.checks)
    assert "Tiny-bucket penalty: measured" in result.tables[0].note
