"""layout_plans on one small case: the closed form ranked, its best three and three proxy layouts compiled (libtpu,
no TPU)."""

from dataclasses import replace

import pytest

from experiments import q50_layout_plans as page
from experiments.q50_layout_plans import Case, Config

TINY = "layers=2,d_model=128,heads=4,d_ff=256,vocab=512"
SMALL = Config(
    cases=(Case("tiny on 8 v5e", TINY, "tpu:v5e:2x4", 1, 16, 128, TINY, "tpu:v5e:2x4", 1, 8, 128),),
    compiled_per_case=3,
    full_size=3,
    libtpu_flags="",  # another test of this process may have started libtpu already, without the page's flags
)


@pytest.fixture(scope="module")
def observations():
    return page.measure(SMALL)


def test_the_case_is_ranked_and_its_proxy_compiled(observations):
    (case,) = observations.cases
    assert case.enumerated == len(case.points) >= case.fitting > 0
    assert len(case.proxy) == 3 and len(case.full_size) == 3
    assert [c.closed.layout for c in case.full_size] == [r.layout for r in case.top[:3]]
    result = page.judge(observations, SMALL)
    names = [c.quantity for c in result.checks]
    assert any("Spearman rho" in n for n in names)
    assert sum(": step s" in n for n in names) == 6 and sum("memory per chip" in n for n in names) == 6
    assert result.tables[0].rows[0][1] == case.top[0].layout


def test_every_model_check_can_fail(observations):
    (case,) = observations.cases

    def moved(compiled):
        return tuple(replace(c, step_s=c.step_s * 10, memory_bytes=c.memory_bytes * 10) for c in compiled)

    perturbed = replace(observations, cases=(replace(case, proxy=moved(case.proxy), full_size=moved(case.full_size)),))
    checks = page.judge(perturbed, SMALL).checks
    assert all(c.verdict == "differs" for c in checks if ": step s" in c.quantity or "memory per chip" in c.quantity)


def test_the_full_size_order_check_fails_when_the_compiled_order_turns(observations):
    (case,) = observations.cases
    steps = [1.0, 2.0, 3.0]
    ordered = tuple(replace(c, closed=replace(c.closed, step_s=s), step_s=s) for c, s in zip(case.full_size, steps))
    turned = tuple(replace(c, step_s=s) for c, s in zip(ordered, reversed(steps)))
    for full, verdict in ((ordered, "agrees"), (turned, "differs")):
        checks = page.judge(replace(observations, cases=(replace(case, full_size=full),)), SMALL).checks
        (order,) = [c for c in checks if "ordered alike" in c.quantity]
        assert (order.theory, order.verdict) == (3, verdict)
