"""Every experiment runs end to end on small configs; its deterministic checks hold.

Timing-based verdicts (model fits, crossovers) are reported on the pages and
never asserted here.
"""

from dataclasses import fields

import pytest

from experiments import get, registry
from experiments.q39_collectives import Config as CollectivesConfig
from experiments.q39_ring_allreduce import Config as RingConfig
from lab.errors import LabError
from lab.report import render


def test_every_experiment_is_complete():
    for experiment in registry().values():
        assert experiment.question.startswith("#")
        assert fields(experiment.config)[0].name == "target"
        assert experiment.title and experiment.module.__doc__.count("\n") > 3  # the docstring teaches


def test_unknown_experiment_lists_the_known_ones():
    with pytest.raises(LabError, match=r"known: .*collectives"):
        get("no_such_thing")


def test_collectives_checks_kind_axis_bytes_and_every_element(devices):
    result = get("collectives").run(CollectivesConfig(begin="1K", end="4K", factor=4, repeats=1))
    assert result.passed, [c for c in result.checks if not c.passed]
    quantities = {c.quantity for c in result.checks}
    assert "elements wrong across the whole sweep (#wrong)" in quantities
    assert any("over tensor: axes found" in q for q in quantities)
    assert "busbw" in result.plots and "Question #39" in render(result)
    # the registry names the page: one title on the page, in `lab list` and in the module docstring
    experiment = get("collectives")
    assert (result.name, result.question) == ("collectives", "#39")
    assert result.title == experiment.title == experiment.module.__doc__.splitlines()[0].rstrip(".")
    assert render(result).startswith(f"# {experiment.title}\n")


def test_ring_allreduce_structure_matches_theory(devices):
    result = get("ring_allreduce").run(RingConfig(size="64K", begin="1K", end="16K", factor=4, repeats=1))
    structural = [c for c in result.checks if c.quantity.startswith("N=")]
    assert len(structural) == 15 and all(c.verdict == "agrees" for c in structural), structural
    assert result.data["alpha_s"] > 0 and result.data["beta_Bps"] > 0
