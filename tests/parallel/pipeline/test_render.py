"""Pictures of pipeline schedules: the textbook grid, the timeline plot, the Perfetto trace."""

import json

from lab.parallel.pipeline.render import ascii_grid, chrome_trace, timeline_figure, write_chrome_trace
from lab.parallel.pipeline.schedules import Costs, gpipe, interleaved, simulate, transfers, zb_h1


def test_ascii_grid_is_the_textbook_table_done_right():
    assert ascii_grid(gpipe(2, 2)).splitlines() == [
        "tick    0  1  2  3  4  5",
        "stage 0 F0 F1 .  .  B0 B1",
        "stage 1 .  F0 F1 B0 B1 .",
    ]


def test_ascii_grid_names_chunks_when_there_are_several():
    first_row = ascii_grid(interleaved(2, 2, 2)).splitlines()[1]
    assert first_row.split()[2:6] == ["F0.0", "F1.0", "F0.1", "F1.1"]


def test_chrome_trace_has_an_event_per_action_and_a_flow_per_send(tmp_path):
    schedule = zb_h1(3, 4)
    timeline = simulate(schedule, Costs.uniform(3, 1.0, 2.0))
    trace = json.loads(write_chrome_trace(timeline, tmp_path / "trace.json").read_text())
    events = trace["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == 3 * 4 * 3  # F, I, W of every micro-batch on every stage
    assert {e["tid"] for e in complete} == {0, 1, 2}
    starts, finishes = [e for e in events if e["ph"] == "s"], [e for e in events if e["ph"] == "f"]
    assert len(starts) == len(finishes) == len(transfers(schedule))
    assert all(f["ts"] >= s["ts"] for s, f in zip(starts, finishes))  # a send arrives after it leaves
    assert chrome_trace(timeline, microseconds_per_unit=2.0)["traceEvents"][-1]["ts"] == 2 * events[-1]["ts"] / 1000


def test_timeline_figure_draws_a_panel_per_timeline():
    figure = timeline_figure(
        [simulate(gpipe(2, 3), Costs.uniform(2)), simulate(interleaved(2, 2, 2), Costs.uniform(2))]
    )
    assert len(figure.axes) == 2
    assert "bubble 25.0%" in figure.axes[0].get_title(loc="left")
