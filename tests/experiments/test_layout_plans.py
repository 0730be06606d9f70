"""layout_plans on one small case: the closed form ranked, three proxy layouts compiled (libtpu, no TPU)."""

from dataclasses import replace

import pytest

from experiments import q50_layout_plans as page
from experiments.q50_layout_plans import Case, Config

TINY = "layers=2,d_model=128,heads=4,d_ff=256,vocab=512"
SMALL = Config(
    cases=(Case("tiny on 8 v5e", TINY, "tpu:v5e:2x4", 1, 16, 128, TINY, "tpu:v5e:2x4", 1, 8, 128),),
    compiled_per_case=3,
)


@pytest.fixture(scope="module")
def observations():
    return page.measure(SMALL)


def test_the_case_is_ranked_and_its_proxy_compiled(observations):
    (case,) = observations.cases
    assert case.enumerated == len(case.points) >= case.fitting > 0
    assert len(case.proxy) == 3
    result = page.judge(observations, SMALL)
    names = [c.quantity for c in result.checks]
    assert any("Spearman rho" in n for n in names)
    assert sum(": step s" in n for n in names) == 3 and sum("memory per chip" in n for n in names) == 3
    assert result.tables[0].rows[0][1] == case.top[0].layout


def test_every_model_check_can_fail(observations):
    (case,) = observations.cases
    moved = tuple(replace(c, step_s=c.step_s * 10, memory_bytes=c.memory_bytes * 10) for c in case.proxy)
    perturbed = replace(observations, cases=(replace(case, proxy=moved),))
    checks = page.judge(perturbed, SMALL).checks
    assert all(c.verdict == "differs" for c in checks if ": step s" in c.quantity or "memory per chip" in c.quantity)
