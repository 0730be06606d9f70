"""Timing the executed pipeline: calibration grids, round-robin timing, the shared-host tick model."""

import pytest

from lab.parallel.pipeline.schedules import BACKWARD, FORWARD, Action, gpipe, lockstep_makespan
from lab.parallel.pipeline.timing import (
    RESOLUTION,
    RoundRobin,
    StageTimes,
    calibration_grid,
    calibration_tables,
    ideal_tables,
    stage_times,
    time_round_robin,
)


def test_calibration_grids_keep_chosen_stages_busy_without_waiting():
    grid = calibration_grid(3, 2, 1, (1,), "F")
    assert grid[0] == grid[2] == (None, None)
    assert grid[1] == (Action(FORWARD, 0), Action(FORWARD, 1))
    tables = calibration_tables(2, 3)
    assert set(tables) == {
        "F on stage 0",
        "B on stage 0",
        "F on stage 1",
        "B on stage 1",
        "F on every stage",
        "B on every stage",
        "idle",
        "no ticks",
    }
    assert tables["no ticks"].ticks == 0 and tables["idle"].ticks == 3
    assert all(t.depth == 1 for t in tables.values())  # their numbers are never read: they fit any program's buffers
    ideal = ideal_tables(2, 3)
    assert ideal.ticks == 6 and (ideal.action[:, :, 0] > 0).all()  # every stage busy on every tick: no bubble


def test_round_robin_times_every_call_in_each_round():
    calls = []
    timings = time_round_robin({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, repeats=3, warmup=1)
    assert calls == ["a", "b"] + ["a", "b"] * 3
    assert timings.timing("a").repeats == 3 and timings.ratio("a", "a") == 1.0


def shared_host(sharing: float) -> StageTimes:
    """Two stages: F = 2, B = 3 alone, idle tick 1; with both busy the host needs `sharing` times longer."""
    return StageTimes((2.0, 2.0), (3.0, 3.0), 1.0, 2.0 * sharing, 3.0 * sharing, call=0.0)


def test_a_tick_is_bounded_by_its_slowest_action_and_by_the_host():
    dedicated = shared_host(1.0)
    assert dedicated.sharing == 1.0
    assert dedicated.tick([]) == 1.0
    assert dedicated.tick([(0, Action(FORWARD, 0)), (1, Action(BACKWARD, 0))]) == 3.0  # the slowest action
    shared = shared_host(2.0)
    assert shared.sharing == pytest.approx(2.0)
    assert shared.tick([(0, Action(FORWARD, 0)), (1, Action(FORWARD, 0))]) == pytest.approx(
        4.0
    )  # calibrated point: all busy
    assert shared.tick([(0, Action(FORWARD, 0))]) == 2.0  # calibrated point: alone
    assert shared.tick([(0, Action(FORWARD, 0)), (1, Action(BACKWARD, 0))]) == pytest.approx(
        3.0 + 2.0
    )  # B alone + what a busy F adds
    # bubble ticks are cheaper than full ones on a shared host: the pipeline looks less idle than (P-1)/(m+P-1) = 1/5
    step, ideal = lockstep_makespan(gpipe(2, 4).grid(), shared.tick), 4 * 4.0 + 4 * 6.0
    assert 1 - ideal / step < 1 / 5
    assert 1 - 4 * (2.0 + 3.0) / lockstep_makespan(gpipe(2, 4).grid(), dedicated.tick) == pytest.approx(1 / 5)


def test_a_grid_no_slower_than_the_empty_step_is_floored_at_the_clock_resolution_not_zero():
    """On a busy host every calibration grid can time at or below the empty step: no tick time may come out 0."""
    tables = calibration_tables(2, 4)
    samples = {name: [0.010, 0.010, 0.010] for name in tables}  # every grid exactly as fast as "no ticks"
    samples["F on stage 1"] = [0.009, 0.009, 0.009]  # and one faster still
    times = stage_times(RoundRobin(samples), tables, 2)
    assert min(times.forward + times.backward) > 0 and times.idle > 0
    assert times.forward[1] == RESOLUTION / tables["F on stage 1"].ticks
    assert set(times.floored) == set(tables) - {"no ticks"}
    assert times.sharing == pytest.approx(1.0)  # finite: every tick floored alike
    # tick counts serve as well as the tables they come from (a judge re-reads them from stored observations)
    assert stage_times(RoundRobin(samples), {n: t.ticks for n, t in tables.items()}, 2) == times
    measured = dict(samples, **{"F on stage 0": [0.014, 0.014, 0.014]})
    assert "F on stage 0" not in stage_times(RoundRobin(measured), tables, 2).floored
    assert stage_times(RoundRobin(measured), tables, 2).forward[0] == pytest.approx(0.004 / 4)
