"""Pipeline schedules as data and their simulator (lab.parallel.pipeline.schedules).

Pure Python: no JAX program is compiled here.
"""

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lab import theory
from lab.errors import LabError
from lab.parallel.pipeline.schedules import (
    BACKWARD,
    FORWARD,
    INPUT_GRAD,
    WEIGHT_GRAD,
    Action,
    Costs,
    Schedule,
    dependencies,
    dependency_violations,
    gpipe,
    interleaved,
    lockstep_makespan,
    make_schedule,
    one_f_one_b,
    simulate,
    slowest_action,
    transfers,
    zb_h1,
)

stages = st.integers(1, 8)
micro_batches = st.integers(1, 24)


def kinds(order) -> str:
    return "".join(a.kind for a in order)


def test_gpipe_runs_every_forward_then_every_backward():
    schedule = gpipe(3, 4)
    assert all(kinds(order) == "FFFFBBBB" for order in schedule.orders)


def test_1f1b_warms_up_p_minus_1_minus_s_forwards_then_alternates():
    schedule = one_f_one_b(4, 6)
    assert kinds(schedule.orders[0]) == "FFF" + "FB" * 3 + "BBB"
    assert kinds(schedule.orders[3]) == "FB" * 6
    assert [a.micro_batch for a in schedule.orders[1] if a.kind == BACKWARD] == list(range(6))


def test_interleaved_follows_megatron_chunk_groups():
    schedule = interleaved(2, 4, 2)
    forwards = [(a.micro_batch, a.chunk) for a in schedule.orders[0] if a.kind == FORWARD]
    assert forwards == [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0), (2, 1), (3, 1)]
    backwards = [(a.micro_batch, a.chunk) for a in schedule.orders[0] if a.kind == BACKWARD]
    assert backwards[:2] == [(0, 1), (1, 1)]  # the last chunk's backward comes first


def test_zb_h1_splits_the_backward_and_holds_back_s_weight_gradients():
    schedule = zb_h1(4, 8)
    assert schedule.split_backward
    first, last = schedule.orders[0], schedule.orders[3]
    assert kinds(first).startswith("FFFFIWFIW")  # stage 0: 1F1B's warm-up, then each W right after its I
    assert kinds(last).startswith("FIFIFIFIW")  # stage 3 holds 3 W back ...
    assert kinds(last).endswith("IWWWW")  # ... and runs them at the end


@given(stages, micro_batches)
@settings(max_examples=60, deadline=None)
def test_gpipe_and_1f1b_have_the_same_bubble_the_formula(p, m):
    for name in ("gpipe", "1f1b"):
        timeline = simulate(make_schedule(name, p, m), Costs.uniform(p))
        assert timeline.bubble_fraction == pytest.approx(theory.pipeline_bubble_fraction(p, m), abs=1e-12)
        assert timeline.makespan == pytest.approx(2 * (m + p - 1))


@given(stages, micro_batches)
@settings(max_examples=60, deadline=None)
def test_1f1b_bounds_micro_batches_in_flight_by_p_minus_s_gpipe_by_m(p, m):
    one = simulate(one_f_one_b(p, m), Costs.uniform(p, 1.0, 2.0)).peak_in_flight
    assert one == tuple(float(min(p - s, m)) for s in range(p))
    assert simulate(gpipe(p, m), Costs.uniform(p)).peak_in_flight == (float(m),) * p


@given(st.integers(2, 6), st.integers(1, 4), st.integers(2, 4))
@settings(max_examples=40, deadline=None)
def test_interleaved_bubble_shrinks_by_v(p, groups, v):
    m = p * groups
    timeline = simulate(interleaved(p, m, v), Costs.uniform(p, 1.0, 2.0))
    assert timeline.makespan == pytest.approx(theory.pipeline_step_time(p, m, 1.0, 2.0, v))
    assert timeline.bubble_fraction == pytest.approx(theory.pipeline_bubble_fraction(p, m, v))
    for s in range(p):
        assert timeline.peak_in_flight[s] == pytest.approx(
            theory.peak_micro_batches_in_flight("interleaved", p, m, s, v)
        )


@given(st.integers(1, 8), st.integers(0, 16))
@settings(max_examples=40, deadline=None)
def test_zb_h1_keeps_a_third_of_1f1b_bubble_at_1f1b_memory(p, extra):
    m = p + extra
    timeline = simulate(zb_h1(p, m), Costs.uniform(p, 1.0, 2.0))  # F = I = W = 1
    assert timeline.makespan == theory.zero_bubble_h1_step_time(p, m, 1, 1, 1)
    assert max(timeline.peak_in_flight) == p
    one_f_one_b_idle = simulate(one_f_one_b(p, m), Costs.uniform(p, 1.0, 2.0)).idle[0]
    assert timeline.idle[0] * 3 == pytest.approx(one_f_one_b_idle)


@given(st.lists(st.integers(1, 4), min_size=2, max_size=6), micro_batches)
@settings(max_examples=60, deadline=None)
def test_gpipe_with_unequal_stages_is_a_flow_shop(forward, m):
    backward = [2 * f for f in forward]
    costs = Costs(tuple(map(float, forward)), tuple(map(float, backward)))
    assert simulate(gpipe(len(forward), m), costs).makespan == pytest.approx(
        theory.imbalanced_step_time(forward, backward, m)
    )
    # 1F1B is never slower than GPipe
    assert (
        simulate(one_f_one_b(len(forward), m), costs).makespan
        <= theory.imbalanced_step_time(forward, backward, m) + 1e-9
    )


def test_simulation_respects_every_dependency_and_stage_order():
    schedule, costs = interleaved(3, 6, 2), Costs((1.0, 2.0, 1.5), (2.0, 1.0, 3.0), send=0.25)
    timeline = simulate(schedule, costs)
    starts = {(s.stage, s.action): s.start for s in timeline.spans}
    assert dependency_violations(schedule, starts, costs) == []
    for span in timeline.spans:
        for needed in dependencies(schedule, span.stage, span.action):
            hop = costs.send if needed[0] != span.stage else 0.0
            assert span.start >= timeline.span_of(*needed).end + hop - 1e-12
    for stage in range(3):
        mine = [s for s in timeline.spans if s.stage == stage]
        assert [s.action for s in sorted(mine, key=lambda s: s.start)] == list(schedule.orders[stage])


def test_idle_plus_busy_is_the_makespan_and_chunks_cost_a_fraction():
    timeline = simulate(interleaved(2, 2, 2), Costs.uniform(2, 2.0, 4.0))
    assert all(b + i == pytest.approx(timeline.makespan) for b, i in zip(timeline.busy, timeline.idle))
    assert timeline.busy[0] == pytest.approx(2 * (2.0 + 4.0))  # m(F+B), split over two chunks of half the layers


def test_grid_is_one_tick_per_action():
    grid = gpipe(4, 4).grid()
    assert len(grid[0]) == 14
    assert [a.label() if a else "." for a in grid[3]] == [
        ".",
        ".",
        ".",
        "F0",
        "F1",
        "F2",
        "F3",
        "B0",
        "B1",
        "B2",
        "B3",
        ".",
        ".",
        ".",
    ]
    assert Counter(a.kind for row in zb_h1(2, 3).grid() for a in row if a) == {
        FORWARD: 6,
        INPUT_GRAD: 6,
        WEIGHT_GRAD: 6,
    }


def test_transfers_are_the_cross_device_dependencies():
    sends = transfers(gpipe(3, 2))
    assert len(sends) == 2 * 2 * 2  # 2 links, 2 micro-batches, forward and backward
    assert {(t.source, t.target) for t in sends} == {(0, 1), (1, 2), (2, 1), (1, 0)}
    ring = transfers(interleaved(2, 2, 2))
    assert any(
        t.source == 1 and t.target == 0 and t.action.kind == FORWARD for t in ring
    )  # chunk 0 of the last feeds chunk 1 of the first


def test_dependency_violations_find_a_backward_run_the_wrong_way():
    schedule, unit = gpipe(2, 1), Costs.uniform(2)
    drawn = {
        (0, Action(FORWARD, 0)): 0,
        (1, Action(FORWARD, 0)): 1,
        (0, Action(BACKWARD, 0)): 2,
        (1, Action(BACKWARD, 0)): 3,
    }
    problems = dependency_violations(schedule, drawn, unit)
    assert len(problems) == 1 and "B0 on stage 0 starts at 2" in problems[0]


def test_lockstep_ticks_last_as_long_as_their_slowest_action():
    schedule = one_f_one_b(2, 2)
    costs = Costs.uniform(2, 1.0, 3.0)
    assert lockstep_makespan(schedule.grid(), slowest_action(costs)) >= simulate(schedule, costs).makespan
    assert lockstep_makespan(gpipe(2, 2).grid(), slowest_action(costs)) == pytest.approx(
        simulate(gpipe(2, 2), costs).makespan
    )


def test_bad_schedules_and_costs_are_lab_errors():
    with pytest.raises(LabError, match="multiple of P"):
        interleaved(4, 6, 2)
    with pytest.raises(LabError, match="2 or more chunks"):
        interleaved(4, 8, 1)
    with pytest.raises(LabError, match="interleaved schedule for chunks"):
        make_schedule("1f1b", 4, 8, 2)
    with pytest.raises(LabError, match="unknown pipeline schedule"):
        make_schedule("pipedream", 4, 8)
    with pytest.raises(LabError, match="positive whole number of stages"):
        gpipe(0, 4)
    with pytest.raises(LabError, match="exactly once"):
        Schedule("broken", 1, 2, 1, ((Action(FORWARD, 0), Action(BACKWARD, 0)),))
    with pytest.raises(LabError, match="deadlocks"):
        simulate(
            Schedule("backwards first", 2, 1, 1, ((Action(BACKWARD, 0), Action(FORWARD, 0)),) * 2), Costs.uniform(2)
        )
    with pytest.raises(LabError, match="costs are given for 3 stages"):
        simulate(gpipe(2, 2), Costs.uniform(3))
    with pytest.raises(LabError, match="one of each per stage"):
        Costs((1.0,), (1.0, 2.0))
