"""Every experiment is complete: a question, a teaching docstring, a Config, and measure/judge with Observations."""

import dataclasses
import inspect

import pytest

from experiments import get, registry
from lab.errors import LabError
from lab.provenance import Setup


@pytest.mark.parametrize("name", sorted(registry()))
def test_every_experiment_measures_then_judges(name):
    experiment = registry()[name]
    module = experiment.module
    assert experiment.question.startswith("#")
    names = [f.name for f in dataclasses.fields(experiment.config)]
    # `lab report --target` reaches every experiment through its first field; a compile-only page whose cases each
    # name their own topology has no target to take, and says so by having no `target` field at all
    assert names[0] == "target" or (experiment.compile_only and "target" not in names), names
    assert experiment.title == module.__doc__.splitlines()[0].rstrip(".") and module.__doc__.count("\n") > 3
    assert dataclasses.is_dataclass(module.Observations) and module.Observations.__dataclass_params__.frozen
    setup = {f.name: f.type for f in dataclasses.fields(module.Observations)}.get("setup")
    assert setup in (Setup, "Setup"), f"{name}: Observations has no setup: Setup field"
    assert list(inspect.signature(module.judge).parameters)[:2] and not hasattr(module, "run")


def test_unknown_experiment_lists_the_known_ones():
    with pytest.raises(LabError, match=r"known: .*collectives"):
        get("no_such_thing")


def test_a_page_that_reads_a_clock_runs_alone_even_when_it_only_compiles():
    # lab report runs untimed pages two at a time (lab.side_by_side): on two cores a neighbour decides a timing
    assert registry()["layout_plans"].untimed  # compile-only, no clock
    assert not registry()["prediction_cost"].untimed  # compile-only, but it times `lab predict` itself
    assert not registry()["collectives"].untimed
