"""Every experiment runs end to end on small configs; its deterministic checks hold.

Timing-based verdicts (model fits, crossovers) are reported on the pages and
never asserted here.
"""

from dataclasses import fields

import pytest

from experiments import get, registry
from lab.errors import LabError


def test_every_experiment_is_complete():
    for experiment in registry().values():
        assert experiment.question.startswith("#")
        assert fields(experiment.config)[0].name == "target"
        assert experiment.title and experiment.module.__doc__.count("\n") > 3  # the docstring teaches


def test_unknown_experiment_lists_the_known_ones():
    with pytest.raises(LabError, match=r"known: .*collectives"):
        get("no_such_thing")
