"""A hot expert: dropped tokens exactly as theory says, the same all-to-all bytes whatever the routing."""

import pytest

from experiments.q42_hot_expert import Config
from lab.errors import LabError
from lab.registry import get
from tests.experiments.support import pinned

SMALL = Config(
    slots=8,
    tokens_per_device=32,
    d_model=16,
    d_ff=32,
    hot_shares=(0.125, 0.5),
    capacity_factors=("1.0", "none"),
    replicas=(1, 2),
    replicated_at=1.0,
    repeats=1,
)


@pytest.fixture(scope="module")
def result(devices):
    return get("hot_expert").run(SMALL)


def test_dropped_shares_and_bytes_agree_with_theory(result):
    assert pinned(result) == {
        # h = 0.5: 16 tokens want a 4-slot expert, 12 of 32 dropped
        "cf=1: dropped share at h = 0.125, 0.5": "agrees",
        "cf=none: dropped share at h = 0.125, 0.5": "agrees",
        "2 replicas at cf=1: dropped share at the same h": "agrees",
        "cf=1: all-to-all bytes per device, 2·S·C·d·4 with C = 4, whatever the routing": "agrees",
        "cf=none: all-to-all bytes per device, 2·S·C·d·4 with C = 32, whatever the routing": "agrees",
    }
    dropped = next(c for c in result.checks if c.quantity == "cf=1: dropped share at h = 0.125, 0.5")
    assert dropped.observed == "0.00%, 37.50%"


def test_the_claims_are_judged_from_this_run(result):
    statuses = {c.claim: c.status for c in result.claims}
    assert statuses["capacity = tokens/E × capacity factor caps each expert; what overflows is dropped"] == "confirmed"
    assert statuses["more replicas of the hot expert relieve it"] == "confirmed"
    assert statuses["a capacity factor keeps a hot expert in check"] == "refined"
    # "a hot expert lowers throughput" is decided by a clock: reported, not asserted
    assert "a hot expert lowers throughput" in statuses


def test_the_page_draws_its_plot(result):
    result.plots["dropped"]()


def test_hot_expert_needs_the_replicated_capacity_among_the_factors(devices):
    with pytest.raises(LabError, match=r"replicated_at=3\.0"):
        get("hot_expert").run(Config(replicated_at=3.0))
