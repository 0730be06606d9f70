"""The five collectives: kinds, axes, S and N in the HLO, every element against numpy; the TPU compiler's rewrite."""

import pytest

from experiments.q39_collectives import Config
from lab.collectives import KINDS
from lab.registry import get
from lab.report import render
from tests.experiments.support import pinned


@pytest.fixture(scope="module")
def result(devices):
    return get("collectives").run(Config(begin="1K", end="4K", factor=4, repeats=1))


def test_every_check_on_this_target_agrees_and_the_tpu_reduce_scatter_differs(result):
    expected = {}
    for op in KINDS:
        expected |= {
            f"{op}: collectives in the HLO": "agrees",
            f"{op}: mesh axes of its replica groups": "agrees",
            f"{op}: S per device at 4 KiB (bytes)": "agrees",
            f"{op}: group size N": "agrees",
        }
    expected["elements wrong across the whole sweep (#wrong)"] = "agrees"
    for op in KINDS:
        for axis in ("data", "fsdp", "tensor"):
            expected[f"{op} over {axis}: axes found from replica groups"] = "agrees"
    for op in KINDS:
        # the TPU compiler writes the standalone psum_scatter as an all-reduce (then a slice): nothing predicts it
        expected[f"tpu:v5e:2x4 {op}: collectives in the HLO"] = "differs" if op == "reduce-scatter" else "agrees"
    assert pinned(result) == expected


def test_the_claims_are_judged_from_this_run(result):
    assert [c.status for c in result.claims] == ["confirmed"] * 3
    assert [c.claim.split(":")[0] for c in result.claims] == ["all-reduce", "all-gather", "reduce-scatter"]


def test_the_registry_names_the_page(result):
    experiment = get("collectives")
    assert (result.name, result.question) == ("collectives", "#39")
    assert result.title == experiment.title == experiment.module.__doc__.splitlines()[0].rstrip(".")
    assert render(result).startswith(f"# {experiment.title}\n")
    assert "busbw" in result.plots and "Question #39" in render(result)
