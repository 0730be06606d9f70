"""The timing harness and nccl-tests-style sizes (timings are never asserted)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lab.bench import Timing, time_fn, time_interleaved
from lab.errors import LabError
from lab.units import format_bytes, parse_size, size_sweep


def test_sizes_use_binary_units():
    assert parse_size("1K") == 1024 and parse_size("64M") == 64 * 2**20 and parse_size("2GiB") == 2 * 2**30
    assert parse_size(17) == 17


@pytest.mark.parametrize("bad", ["", "1T", "-4K", "K", "0"])
def test_bad_sizes_are_lab_errors(bad):
    with pytest.raises(LabError):
        parse_size(bad)


def test_sweep_like_nccl_tests():
    assert size_sweep("1K", "8K", 2) == [1024, 2048, 4096, 8192]
    assert size_sweep("1K", "10K", 4) == [1024, 4096]
    with pytest.raises(LabError, match="factor"):
        size_sweep("1K", "8K", 1)
    with pytest.raises(LabError, match="must not exceed"):
        size_sweep("8K", "1K")


def test_time_fn_counts_repeats_and_orders_its_statistics():
    timing = time_fn(lambda x: x + 1, jnp.ones(4), warmup=1, repeats=5)
    assert timing.repeats == 5 and timing.min <= timing.median <= timing.max


def test_format_bytes():
    assert format_bytes(512) == "512 Bytes" and format_bytes(1536) == "1.5 KiB" and format_bytes(64 * 2**20) == "64 MiB"


def test_crossover_interpolates_where_a_ratio_falls_through_one():
    from lab.bench import crossover

    assert crossover([1, 4], [2.0, 0.5]) == pytest.approx(2.0)  # log-midpoint
    assert crossover([1, 2, 4], [0.5, 0.4, 0.3]) is None
    assert crossover([1, 2, 4], [3.0, 1.0, 0.5]) == pytest.approx(2.0)


def test_interleaved_timing_gives_every_program_its_rounds():
    square = jax.jit(lambda x: x * x)
    timings = time_interleaved({"a": (square, (np.ones(4),)), "b": (square, (np.ones(8),))}, repeats=3)
    assert set(timings) == {"a", "b"} and all(
        isinstance(t, Timing) and t.repeats == 3 and t.min <= t.median <= t.max for t in timings.values()
    )
