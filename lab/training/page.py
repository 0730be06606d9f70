"""The page of a training run: loss and step time over steps, the series analysis, the metrics, the profile.

`result(log)` turns a `lab.training.run.RunLog` into a `lab.report.Result`
(``results/train/<name>/``); `plot_step_times` draws a step-time series with
its checkpoint saves marked, for this page and for pages that compare runs.
"""

from __future__ import annotations

from dataclasses import asdict

import numpy as np

from lab.mesh import MeshSpec
from lab.provenance import provenance
from lab.report import Result, Table
from lab.training.run import RunLog


def _notes(log: RunLog) -> list[str]:
    """What a reader of the page should not miss: a resumed start, axes that only repeat work."""

    sizes = MeshSpec.parse(log.config.mesh).sizes
    notes = []
    if log.start_step:
        notes.append(
            f"started at step {log.start_step} (resumed from a checkpoint); the loss plot also shows the "
            f"{len(log.earlier)} earlier steps the metrics log kept, the step times only this run's"
        )
    if log.idle_axes:
        idle = ", ".join(f"{axis}={sizes[axis]}" for axis in log.idle_axes)
        notes.append(
            f"{idle}: neither the batch nor any weight of {log.config.model} with {log.config.strategy} is split over "
            "these axes, so their devices hold the same shards and repeat the same work"
        )
    if any(s.mfu > 1 for s in log.steps):
        notes.append(
            "MFU above 1: on cpu the peak is lab.targets.hardware's measured numpy matmul rate, which undershoots what "
            "XLA's multi-threaded kernels reach on a shared machine; read MFU there "
            "as a ratio between layouts, not as utilisation"
        )
    return notes


def plot_step_times(axes, log: RunLog, label: str | None = None) -> None:
    """Step time over steps: the whole iteration, the saves marked, and the wait for data where it matters
    (a median share of the step above 10 %)."""
    steps = [s.step for s in log.steps]
    (line,) = axes.plot(
        steps, [s.seconds * 1e3 for s in log.steps], marker=".", markersize=3, linewidth=1, label=label or "step"
    )
    if np.median([s.data_s / s.seconds for s in log.steps]) > 0.1:
        axes.plot(
            steps,
            [s.data_s * 1e3 for s in log.steps],
            linestyle=":",
            color=line.get_color(),
            linewidth=1,
            label=f"{label + ': ' if label else ''}waiting for data",
        )
    saves = [s for s in log.steps if s.checkpoint]
    if saves:
        axes.scatter(
            [s.step for s in saves],
            [s.seconds * 1e3 for s in saves],
            marker="v",
            color=line.get_color(),
            zorder=3,
            label=f"{label + ': ' if label else ''}checkpoint saved",
        )
    axes.set(xlabel="step", ylabel="step time (ms)")


def result(log: RunLog):
    """The run's page: loss and step time over steps, the series analysis, the metrics, the profile."""
    # not pyplot: no display, no global figure to close; imported here because it is slow and only pages need it
    from matplotlib.figure import Figure

    loss_figure = Figure(figsize=(6, 3))
    axes = loss_figure.subplots()
    axes.plot([s.step for s in log.history], [s.loss for s in log.history], marker=".")
    axes.set(xlabel="step", ylabel="loss", title=f"loss, mesh {log.config.mesh}")
    time_figure = Figure(figsize=(6, 3))
    axes = time_figure.subplots()
    plot_step_times(axes, log)
    axes.set(title=f"step time, mesh {log.config.mesh}")
    axes.legend(fontsize=7)
    series = log.series()
    summary = (
        f"{len(log.steps)} steps of the {log.config.model} model with {log.config.strategy} "
        f"on the mesh {log.config.mesh} "
        f"({log.devices}, {log.processes} process(es)): loss {log.losses[0]:.3f} -> {log.losses[-1]:.3f}; median step "
        f"{log.median_step_s * 1e3:.1f} ms, {log.tokens_per_s:,.0f} tokens/s; "
        f"compiling the step took {log.compile_s:.1f} s. "
        f"Step times: {series.describe()}."
    )
    return Result(
        name=log.config.name,
        title=f"Training run: {log.config.model} on {log.config.mesh}",
        summary=summary,
        theory="MFU = (6Ψ + 12·L·H·K·S) × tokens/s ÷ peak FLOP/s (Chowdhery "
        "et al. 2022, PaLM, Appendix B); on emulated CPU devices the "
        "peak is the one measured machine's. "
        "Step times are read with `lab.training.series`: median and spread, "
        "slow steps, and a period found from the series itself.",
        tables=_tables(log),
        plots={"loss": loss_figure, "step_time": time_figure},
        notes=_notes(log),
        provenance=provenance(target=log.config.target, devices=log.devices, mesh=log.config.mesh),
        observations={
            "steps": [asdict(s) for s in log.steps],
            "earlier_steps": [asdict(s) for s in log.earlier],  # a resumed run: what its log kept from before
            "compile_s": log.compile_s,
            "profile_device_s": log.profile,
        },
        config={k: str(v) for k, v in asdict(log.config).items()},
    )


MAX_STEP_ROWS = 40  # beyond this the per-step table is unreadable: the plot and metrics.jsonl hold every step


def _tables(log: RunLog) -> list:

    tables = []
    extra = sorted({name for s in log.steps for name in s.extra})  # what the model adds (MoE: load skew, drops)
    if len(log.steps) <= MAX_STEP_ROWS:
        rows = [
            [
                s.step,
                s.loss,
                s.grad_norm,
                s.seconds * 1e3,
                s.data_s * 1e3,
                s.save_s * 1e3,
                s.tokens_per_s,
                s.mfu,
                "yes" if s.checkpoint else "",
                *(s.extra.get(name, "") for name in extra),
            ]
            for s in log.steps
        ]
        tables.append(
            Table(
                "per step",
                [
                    "step",
                    "loss",
                    "grad norm",
                    "step (ms)",
                    "data (ms)",
                    "save (ms)",
                    "tokens/s",
                    "MFU",
                    "checkpoint",
                    *extra,
                ],
                rows,
            )
        )
    else:
        timed = log.timed_steps
        seconds = np.array([[s.seconds, s.data_s, s.save_s] for s in timed]) * 1e3
        rows = [
            [name, *np.percentile(seconds[:, i], [50, 10, 90]).tolist(), seconds[:, i].max()]
            for i, name in enumerate(("step", "waiting for data", "blocking save"))
        ]
        tables.append(
            Table(
                f"step time over steps {timed[0].step}-{timed[-1].step} (ms)",
                ["part", "median", "p10", "p90", "max"],
                rows,
            )
        )
        if extra:
            values = np.array([[s.extra.get(name, np.nan) for name in extra] for s in timed])
            rows = [
                [name, *np.nanpercentile(values[:, i], [50, 10, 90]).tolist(), np.nanmax(values[:, i])]
                for i, name in enumerate(extra)
            ]
            tables.append(
                Table(
                    f"what the model reports, over steps {timed[0].step}-{timed[-1].step}",
                    ["metric", "median", "p10", "p90", "max"],
                    rows,
                )
            )
    if log.profile:
        total = sum(log.profile.values())
        rows = [[part, seconds * 1e3, seconds / total] for part, seconds in log.profile.items()]
        tables.append(
            Table(
                f"device time by part of the step (from the trace in {log.config.profile}; "
                "summed over devices and steps)",
                ["part", "device ms", "share"],
                rows,
            )
        )
    return tables
