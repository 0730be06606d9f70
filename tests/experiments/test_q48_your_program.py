"""The your_program page: a user's step explained on the CPU and compile-only for a TPU topology."""

import pytest

from experiments.q48_your_program import Config
from lab.registry import get
from tests.experiments.support import pinned


@pytest.fixture(scope="module")
def result(devices):
    return get("your_program").run(Config())


def test_every_collective_is_placed_and_the_planted_surprise_is_found_on_both_compilers(result):
    checks = pinned(result)
    assert len(checks) == 11 and set(checks.values()) == {"agrees"}
    assert "tpu:v5e:2x4: links the collectives cross" in checks


def test_the_fsdp_claim_is_judged_from_the_bytes_that_moved(result):
    assert [c.status for c in result.claims] == ["refuted", "refuted"]
    assert all("of weights and" in c.numbers for c in result.claims)


def test_a_wrong_line_or_a_missing_surprise_differs(result):
    from dataclasses import replace

    from experiments.q48_your_program import judge

    obs = get("your_program").observations_of(result) if hasattr(get("your_program"), "observations_of") else None
    if obs is None:
        import dacite

        from experiments.q48_your_program import Observations

        obs = dacite.from_dict(Observations, result.observations, config=dacite.Config(cast=[tuple]))
    moved = replace(obs, planted_line=obs.planted_line + 1)
    verdicts = {c.quantity: c.verdict for c in judge(moved, Config()).checks}
    assert verdicts["cpu:8: the surprise's line is the planted norm's"] == "differs"


def test_the_priced_steps_flops_differ_when_the_example_is_another_size(result):
    """The FLOPs check reads the example's sizes: a wider model the compiled step never ran differs."""
    from dataclasses import replace

    import dacite

    from experiments.q48_your_program import Observations, judge

    obs = dacite.from_dict(Observations, result.observations, config=dacite.Config(cast=[tuple]))
    wider = replace(obs, sizes={**obs.sizes, "D_FF": 2 * obs.sizes["D_FF"]})
    flops = [c.verdict for c in judge(wider, Config()).checks if "matmul FLOPs a step" in c.quantity]
    assert flops == ["differs"]
