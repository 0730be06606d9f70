"""Bucket size: one all-reduce per bucket in the HLO, exact sums, XLA's combiners on the CPU and the TPU."""

import pytest

from experiments.q47_bucket_size import Config
from lab.cli import main
from lab.registry import get
from tests.experiments.support import pinned


@pytest.fixture(scope="module")
def result(devices):
    return get("bucket_size").run(Config(model="tiny", bucket_sizes=("64K", "256K"), repeats=1))


def test_one_all_reduce_per_bucket_exact_sums_and_the_combiners(result):
    assert pinned(result) == {
        "b=64 KiB: all-reduces in HLO = ceil(G/b)": "agrees",
        "b=64 KiB: every gradient sum bit-identical to per-tensor psums": "agrees",
        "b=256 KiB: all-reduces in HLO = ceil(G/b)": "agrees",
        "b=256 KiB: every gradient sum bit-identical to per-tensor psums": "agrees",
        "b=25 MiB: all-reduces in HLO = ceil(G/b)": "agrees",  # DDP's default: one bucket for these gradients
        "b=25 MiB: every gradient sum bit-identical to per-tensor psums": "agrees",
        "b=1.86 GiB: all-reduces in HLO = ceil(G/b)": "agrees",  # DeepSpeed's 5e8 elements
        "b=1.86 GiB: every gradient sum bit-identical to per-tensor psums": "agrees",
        # XLA:CPU's combiner (no byte threshold, up to 256 operands) merges the 3 independent buckets into one
        "b=256 KiB written as independent psums: all-reduces in HLO (one per bucket)": ("refined", 1),
        "asynchronous collectives in the CPU step": "agrees",
        "tpu:v5e:4x4: all-reduces with combiner threshold 0 = gradient tensors": "agrees",
        "tpu:v5e:4x4: all-reduces with the compiler's default threshold (all in one)": "agrees",
        "tpu:v5e:4x4: asynchronous all-reduces, at every combiner threshold": "agrees",
    }


def test_the_claims_are_judged_from_this_run(result):
    assert [(c.claim, c.status) for c in result.claims] == [
        ("Too-small buckets fragment communication: the launch overhead grows with the bucket count", "confirmed"),
    ]


def test_the_launch_model_is_fitted_at_the_ends_and_not_judged_on_its_own_points(result):
    assert not any(c.kind == "timing" for c in result.checks)
    rows = {row[0]: row[4] for row in result.tables[0].rows}
    assert "fitted" in rows["64 KiB"] and "fitted" in rows["256 KiB"] and "held out" in rows["25 MiB"]


def test_a_bucket_size_of_zero_is_one_line_and_exit_2(capsys, devices):
    assert main(["run", "bucket_size", "--bucket-sizes", "0"]) == 2
    err = capsys.readouterr().err
    assert "sizes must be positive" in err and len(err.strip().splitlines()) == 1
