"""Pictures of pipeline schedules: the textbook grid, a timeline plot, a Perfetto trace.

Three views of the same `lab.parallel.pipeline.schedules` data:

* `ascii_grid`: one row per stage, one column per tick, one tick per action:
  the figure pipeline papers and textbooks draw (``.`` marks an idle tick);
* `timeline_figure`: simulated start and end times drawn to scale with
  matplotlib, so unequal forward and backward costs show;
* `chrome_trace`: the Chrome trace-event JSON ("X" complete events per
  action, one thread per stage, and flow arrows for every send) that
  https://ui.perfetto.dev and chrome://tracing open (Trace Event Format,
  Google, "Trace Event Format" document, 2016).
"""

from __future__ import annotations

import json
from pathlib import Path

from lab.parallel.pipeline.schedules import BACKWARD, FORWARD, INPUT_GRAD, WEIGHT_GRAD, Schedule, Timeline, transfers

COLORS = {FORWARD: "#4C78A8", BACKWARD: "#F58518", INPUT_GRAD: "#F58518", WEIGHT_GRAD: "#54A24B"}


def ascii_grid(schedule: Schedule, *, idle: str = ".") -> str:
    """The unit-tick table of a schedule as text, one line per stage."""
    grid = schedule.grid()
    labels = [[a.label(schedule.chunks) if a else idle for a in row] for row in grid]
    width = max(len(cell) for row in labels for cell in row) + 1
    ticks = len(grid[0])
    header = "tick    " + "".join(str(t).ljust(width) for t in range(ticks))
    rows = [f"stage {s:<2}" + "".join(cell.ljust(width) for cell in row) for s, row in enumerate(labels)]
    return "\n".join([header.rstrip(), *(r.rstrip() for r in rows)])


def timeline_figure(timelines: list[Timeline], *, titles: list[str] | None = None, unit: str = "ticks"):
    """One panel per timeline: a bar per action, stages top to bottom, time to scale."""
    # not pyplot: no display, no global figure to close; imported on use, it is slow
    from matplotlib.figure import Figure

    height = sum(t.schedule.stages for t in timelines) * 0.32 + 0.9 * len(timelines)
    figure = Figure(figsize=(11, max(height, 2.5)))
    axes = figure.subplots(len(timelines), 1, squeeze=False)
    end = max(t.makespan for t in timelines)
    for index, (axis, timeline) in enumerate(zip(axes[:, 0], timelines)):
        _draw(axis, timeline, end)
        title = titles[index] if titles else timeline.schedule.name
        axis.set_title(
            f"{title}: makespan {timeline.makespan:.4g} {unit}, bubble {timeline.bubble_fraction:.1%}",
            fontsize=9,
            loc="left",
        )
    axes[-1, 0].set_xlabel(unit)
    figure.tight_layout()
    return figure


def _draw(axis, timeline: Timeline, end: float) -> None:
    chunks = timeline.schedule.chunks
    for span in timeline.spans:
        width = span.end - span.start
        shade = 1.0 - 0.45 * span.action.chunk / max(chunks - 1, 1) if chunks > 1 else 1.0
        axis.barh(
            span.stage,
            width,
            left=span.start,
            height=0.8,
            color=COLORS[span.action.kind],
            alpha=shade,
            edgecolor="white",
            linewidth=0.5,
        )
        if width >= end / 60:
            axis.text(
                span.start + width / 2,
                span.stage,
                span.action.label(chunks),
                ha="center",
                va="center",
                fontsize=6,
                color="white",
            )
    axis.set_yticks(
        range(timeline.schedule.stages), [f"stage {s}" for s in range(timeline.schedule.stages)], fontsize=7
    )
    axis.set_ylim(timeline.schedule.stages - 0.5, -0.5)
    axis.set_xlim(0, end)
    axis.tick_params(axis="x", labelsize=7)


def chrome_trace(timeline: Timeline, *, microseconds_per_unit: float = 1000.0) -> dict:
    """Trace-event JSON: one thread per stage, an "X" event per action, flow arrows for sends."""
    schedule, scale = timeline.schedule, microseconds_per_unit
    events: list[dict] = [
        {
            "ph": "M",
            "name": "process_name",
            "pid": 0,
            "args": {"name": f"{schedule.name} P={schedule.stages} m={schedule.micro_batches} v={schedule.chunks}"},
        }
    ]
    events += [
        {"ph": "M", "name": "thread_name", "pid": 0, "tid": s, "args": {"name": f"stage {s}"}}
        for s in range(schedule.stages)
    ]
    for span in timeline.spans:
        events.append(
            {
                "ph": "X",
                "pid": 0,
                "tid": span.stage,
                "name": span.action.label(schedule.chunks),
                "cat": span.action.kind,
                "ts": span.start * scale,
                "dur": (span.end - span.start) * scale,
                "args": {"micro_batch": span.action.micro_batch, "chunk": span.action.chunk},
            }
        )
    for flow_id, send in enumerate(transfers(schedule)):
        produced, consumed = timeline.span_of(send.source, send.action), timeline.span_of(send.target, send.consumer)
        kind = "activation" if send.action.kind == FORWARD else "gradient"
        events.append(
            {
                "ph": "s",
                "id": flow_id,
                "pid": 0,
                "tid": send.source,
                "ts": produced.end * scale,
                "name": kind,
                "cat": "send",
            }
        )
        events.append(
            {
                "ph": "f",
                "bp": "e",
                "id": flow_id,
                "pid": 0,
                "tid": send.target,
                "ts": consumed.start * scale,
                "name": kind,
                "cat": "send",
            }
        )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(timeline: Timeline, path: str | Path, **kwargs) -> Path:
    """Write `chrome_trace(timeline)` to `path`; open it in https://ui.perfetto.dev."""
    path = Path(path)
    path.write_text(json.dumps(chrome_trace(timeline, **kwargs)))
    return path
