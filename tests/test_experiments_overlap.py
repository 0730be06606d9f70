"""The overlap and bucketing experiments end to end on small configs: their deterministic checks hold.

Timing-based rows (ratios, fitted models) are reported on the pages and never asserted here.
"""

import pytest

from experiments import get
from experiments.q45_overlap import Config as OverlapConfig
from experiments.q46_overlap_backfires import Config as BackfiresConfig
from experiments.q47_bucket_size import Config as BucketConfig
from lab.cli import main
from lab.report import render

TIMED = ("time", "(ms)", "(s)", "faster", "penalty")


def structural(result):
    """The checks that do not depend on a clock."""
    return [c for c in result.checks if not any(word in c.quantity for word in TIMED)]


def test_overlap_page_numerics_hlo_and_the_tpu_schedule(devices):
    result = get("overlap").run(OverlapConfig(shape=(64, 64, 64), repeats=1, tpu_shape=(1024, 512, 65536)))
    rows = structural(result)
    assert all(c.verdict == "agrees" for c in rows), [c for c in rows if c.verdict != "agrees"]
    quantities = {c.quantity for c in rows}
    assert "ring all-gather matmul: collective-permutes in HLO" in quantities
    assert "tpu:v5e:2x4 ring all-gather matmul: permutes with a matmul between start and done" in quantities
    assert "overlap" in result.plots and "Question #45" in render(result)


def test_bucket_size_page_counts_one_all_reduce_per_bucket(devices):
    result = get("bucket_size").run(
        BucketConfig(model="tiny", bucket_sizes=("64K", "256K"), repeats=1, tpu_topology="")
    )
    rows = structural(result)
    assert all(c.passed for c in rows), [c for c in rows if not c.passed]
    counts = [c for c in rows if "all-reduces in HLO = ceil(G/b)" in c.quantity]
    assert len(counts) == 4 and all(
        c.verdict == "agrees" for c in counts
    )  # 64K, 256K, DDP's 25 MiB, DeepSpeed's 5e8 elements
    assert any(c.verdict == "refined" and "combiner" in c.note for c in rows)
    assert "one bucket" in render(result)


def test_backfires_page_runs_its_structural_checks(devices):
    result = get("overlap_backfires").run(
        BackfiresConfig(model="tiny", tiny_bucket="64K", narrow_shape=(64, 64, 64), repeats=1, tpu_topology="")
    )
    rows = structural(result)
    assert all(c.passed for c in rows), [c for c in rows if not c.passed]
    assert {"tiny buckets: all-reduces in HLO", "per-tensor psums: all-reduces in HLO"} <= {c.quantity for c in rows}


@pytest.mark.parametrize(
    "argv, words",
    [
        (["run", "bucket_size", "--bucket-sizes", "0"], "sizes must be positive"),
        (["run", "overlap", "--shape", "100", "64", "64", "--tpu-topology", ""], "is not a positive multiple of 8"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, devices, argv, words):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert words in err and len(err.strip().splitlines()) == 1
