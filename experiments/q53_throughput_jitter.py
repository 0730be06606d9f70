"""Throughput that jumps: a periodic checkpoint, an asynchronous one, and a loader that cannot keep up.

Question #53 asks what goes wrong first when throughput jumps: staring at one
kernel or one log line instead of the timeline. The timeline's *shape* names
the layer (`lab.training.series`): dips every K steps are something scheduled;
random slow steps are a supply problem (data, stragglers, routing); a trend
is something accumulating. This page trains the same model five times with
`lab train`'s loop, each run breaking or fixing one thing, and reads each
step-time series without being told what was done:

1. **steady**: nothing saved, batches ready at once: the noise floor;
2. **synchronous checkpoints** every K steps: the loop stops while orbax
   writes, so the series dips every K steps, and the mean step grows by
   about save time / K;
3. **asynchronous checkpoints** every K steps: the state is copied to host
   memory and written by a background thread; what is left in the loop is
   the copy and orbax's bookkeeping;
4. **a slow loader**: each batch costs a fixed latency plus an exponential
   tail; without prefetching, the step waits for every batch, at random;
5. **the same loader with prefetching**: workers load the next batches while
   the step runs; once k workers outpace the step the waits vanish.
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from lab.devices import DEFAULT_TARGET, devices_for
from lab.hardware import profile
from lab.progress import track
from lab.report import Result, Table, provenance
from lab.training import run as training_run
from lab.training.page import plot_step_times
from lab.training.run import WARMUP_STEPS, RunConfig, RunLog
from lab.units import format_bytes
from lab.verdict import at_most, check

QUESTION = "#53"
CASES = ("steady", "sync checkpoints", "async checkpoints", "slow loader", "slow loader + prefetch")


@dataclass(frozen=True)
class Config:
    target: str = DEFAULT_TARGET
    """where to train (cpu:N, gpu, tpu)"""
    mesh: str = "data=2,fsdp=4"
    """the mesh every case trains on"""
    model: str = "tiny"
    """lab.model preset"""
    steps: int = 60
    """steps per case"""
    global_batch: int = 16
    """sequences per step"""
    checkpoint_every: int = 10
    """K: the period of the checkpoint cases"""
    loader_latency: float = 0.5
    """the slow loader's fixed cost per batch, as a fraction of the steady median step"""
    loader_jitter: float = 2.0
    """the mean of its exponential tail, as a fraction of the steady median step"""
    prefetch: int = 8
    """workers loading ahead in the fixed case (k / (L + J) batches per step time: 3.2x the demand at the defaults)"""


def run(config: Config = Config()) -> Result:
    devices = devices_for(config.target)
    base = RunConfig(
        target=config.target,
        mesh=config.mesh,
        model=config.model,
        steps=config.steps,
        global_batch=config.global_batch,
        page=False,
        name="throughput_jitter",
    )
    with tempfile.TemporaryDirectory() as scratch:
        logs = _run_cases(config, base, devices, Path(scratch))
    return _result(config, logs, base)


def _run_cases(config: Config, base: RunConfig, devices, scratch: Path) -> dict[str, RunLog]:
    """The steady run first: the slow loader is sized against its median step."""
    logs = {}
    for case in track(CASES, "throughput cases"):
        steady_ms = logs["steady"].series().median * 1e3 if logs else 0.0
        changes = {
            "steady": {},
            "sync checkpoints": {"checkpoint_dir": scratch / "sync", "checkpoint_every": config.checkpoint_every},
            "async checkpoints": {
                "checkpoint_dir": scratch / "async",
                "checkpoint_every": config.checkpoint_every,
                "async_checkpoint": True,
            },
            "slow loader": {
                "input_ms": config.loader_latency * steady_ms,
                "input_jitter_ms": config.loader_jitter * steady_ms,
            },
            "slow loader + prefetch": {
                "input_ms": config.loader_latency * steady_ms,
                "input_jitter_ms": config.loader_jitter * steady_ms,
                "prefetch": config.prefetch,
            },
        }[case]
        logs[case] = training_run.run(replace(base, results=scratch / "pages", **changes), devices)
    return logs


def _median(log: RunLog, field: str) -> float:
    return float(np.median([getattr(s, field) for s in log.timed_steps]))


def _mean(log: RunLog, field: str = "seconds") -> float:
    return float(np.mean([getattr(s, field) for s in log.timed_steps]))


def _saves(log: RunLog) -> list[float]:
    """Blocking seconds of each save after warm-up (the first save also creates the manager's folders)."""
    return [s.save_s for s in log.timed_steps if s.checkpoint]


def _checks(config: Config, logs: dict[str, RunLog]) -> list:
    k = config.checkpoint_every
    steady, sync, asyn, slow, fed = (logs[c] for c in CASES)
    sync_series, slow_series = sync.series(), slow.series()
    saves = {s.step for s in sync.steps if s.checkpoint}
    loader = (
        slow.config.input_ms / 1e3 + math.log(2) * slow.config.input_jitter_ms / 1e3
    )  # median of latency + Exp(jitter)
    placing = _median(steady, "data_s")  # what the steady run waits too: host-to-device placement
    fed_wait, slow_wait = _median(fed, "data_s"), _median(slow, "data_s")
    return [
        check("steady: no period found in the noise", "none", steady.series().period or "none"),
        check("sync checkpoints: the shape found from the series alone", "periodic", sync_series.pattern),
        check("sync checkpoints: the period found (steps)", k, sync_series.period or "none"),
        check(
            "sync checkpoints: every slow step is a save step",
            "yes",
            "yes" if set(sync_series.slow_steps) <= saves else f"no: {sorted(set(sync_series.slow_steps) - saves)}",
        ),
        check(
            "sync checkpoints: mean step time added (ms) = mean blocking save time / K",
            _mean(sync, "save_s") * 1e3,
            (_mean(sync) - _mean(steady)) * 1e3,
            rtol=0.5,
        ),
        *_async_checks(config, steady, sync, asyn),
        check("slow loader: the shape found from the series alone", "random", slow_series.pattern),
        check(
            "slow loader: median wait for data (ms) = latency + ln2 x jitter + placement",
            (loader + placing) * 1e3,
            slow_wait * 1e3,
            rtol=0.25,
        ),
        at_most(
            f"slow loader + prefetch {config.prefetch}: median wait for data / the unfed loader's",
            fed_wait / slow_wait,
            0.2,
        ),
    ]


def _async_checks(config: Config, steady: RunLog, sync: RunLog, asyn: RunLog) -> list:
    """The textbook: an async save blocks only for the device-to-host copy, so most of the dip goes. Where it does not,
    the numbers say why: a blocking time far above the copy is a fixed cost per save; steps between saves slower than
    the steady run's are the background writer taking cores."""
    state, bandwidth = asyn.state_bytes, profile("cpu").hbm_bandwidth
    copy_s, blocking = state / bandwidth, float(np.median(_saves(asyn)))
    fixed = None
    if blocking > 10 * copy_s:
        fixed = (
            f"the async save blocks for {blocking * 1e3:.0f} ms while copying "
            f"its {format_bytes(state)} to host memory takes "
            f"{copy_s * 1e3:.2f} ms at {bandwidth / 1e9:.0f} GB/s: the rest "
            "is orbax's fixed work per save (a temporary folder, "
            "metadata, handing the arrays to the writer thread), which only "
            "a state large enough for the write to dominate hides"
        )
    between = [s.seconds for s in asyn.timed_steps if not s.checkpoint]
    spill = float(np.mean(between)) - _mean(steady)
    sync_added = _mean(sync) - _mean(steady)
    moved = None
    if _mean(asyn, "save_s") <= 0.5 * sync_added < _mean(asyn) - _mean(steady) and spill > 0:
        moved = (
            f"the blocking part alone adds {_mean(asyn, 'save_s') * 1e3:.1f} "
            "ms per step (within the bound), but the steps between "
            f"saves are {spill * 1e3:.1f} ms slower than the steady run's: "
            "the background writer shares the host's cores with the step, "
            "so part of the cost moves instead of vanishing"
        )
    return [
        at_most(
            "async checkpoints: median blocking save / a sync one's",
            blocking / float(np.median(_saves(sync))),
            0.5,
            explained=fixed,
        ),
        at_most(
            "async checkpoints: mean step time added / sync's",
            (_mean(asyn) - _mean(steady)) / sync_added,
            0.5,
            explained=moved,
        ),
    ]


def _plot(logs: dict[str, RunLog], config: Config):
    figure = Figure(figsize=(8, 2.0 * len(CASES)))
    panels = figure.subplots(len(CASES), 1, sharex=True)
    for axes, (case, log) in zip(panels, logs.items()):
        plot_step_times(axes, log, case)
        axes.axhline(log.series().median * 1e3, color="grey", linewidth=0.8, linestyle="--")
        axes.set(yscale="log", xlabel="")  # a first save of seconds and steps of milliseconds on one axis
        axes.set_ylim(top=axes.get_ylim()[1] * 4)  # room for the legend above the series
        axes.set_title(f"{case}: {log.series().pattern}", fontsize=9, loc="left")
        axes.legend(fontsize=7, loc="upper center", ncol=3, frameon=False)
    panels[-1].set_xlabel("step")
    figure.suptitle(
        f"step time over steps, {config.model} on {config.mesh} (log scale; dashed: median after warm-up)", fontsize=10
    )
    figure.tight_layout()
    return figure


def _result(config: Config, logs: dict[str, RunLog], base: RunConfig) -> Result:
    steady_mean = _mean(logs["steady"])
    rows = []
    for case, log in logs.items():
        series = log.series()
        saves = _saves(log)
        rows.append(
            [
                case,
                series.pattern,
                series.period or "",
                series.median * 1e3,
                series.p90 * 1e3,
                _mean(log) * 1e3,
                _mean(log) / steady_mean,
                series.cv,
                _median(log, "data_s") * 1e3,
                float(np.median(saves)) * 1e3 if saves else "",
                len(series.slow_steps),
            ]
        )
    checks = _checks(config, logs)
    sync, asyn, slow = (
        logs["sync checkpoints"].series(),
        logs["async checkpoints"].series(),
        logs["slow loader"].series(),
    )
    summary = (
        f"Read from the step times alone: synchronous checkpoints every {config.checkpoint_every} steps show as "
        f"{sync.describe().split(';')[0]}, and raise the mean step to "
        f"{_mean(logs['sync checkpoints']) / steady_mean:.2f}x the steady "
        "run's; "
        f"asynchronous saving brings it to {_mean(logs['async checkpoints']) / steady_mean:.2f}x ({asyn.pattern}). "
        f"A loader costing {logs['slow loader'].config.input_ms:.0f} ms + "
        f"Exp({logs['slow loader'].config.input_jitter_ms:.0f} ms) per batch "
        f"makes the series {slow.pattern} (std/mean {slow.cv:.2f} against {logs['steady'].series().cv:.2f} steady), "
        f"and {config.prefetch} prefetching workers take it back to "
        f"{_mean(logs['slow loader + prefetch']) / steady_mean:.2f}x. "
        "The first thing to look at is the shape of the timeline, then the layer it names."
    )
    first_save = next(s.save_s for s in logs["sync checkpoints"].steps if s.checkpoint)
    notes = [
        (
            f"Each run's first {WARMUP_STEPS} steps are left out of every "
            "statistic (warm-up). The first save of a checkpoint manager "
            "blocked for "
            f"{first_save * 1e3:.0f} ms against a median of "
            f"{np.median(_saves(logs['sync checkpoints'])) * 1e3:.0f} ms for "
            "the later ones: it also "
            "creates the folder and starts orbax's machinery, so the first dip is the deepest."
        ),
        (
            f"The state saved is {format_bytes(logs['sync checkpoints'].state_bytes)} "
            "per checkpoint; at this size a save costs orbax's fixed work "
            "(metadata, a temporary folder renamed when complete), not bandwidth, "
            "which is why the asynchronous save still blocks for "
            f"{np.median(_saves(logs['async checkpoints'])) * 1e3:.0f} ms "
            "(median): the device-to-host copy plus that bookkeeping."
        ),
        (
            "On a 2-core machine the asynchronous writer shares cores with "
            "the step, so the steps after an async save can be a little slower: "
            "the cost moves rather than vanishes, and on a busy host it can show up as random jitter."
        ),
        (
            "The loader's cost is a sleep (an I/O-bound loader releases the "
            "GIL). A CPU-bound loader would also take cores from the step, "
            "and prefetching would hide less of it."
        ),
        (
            "The quick-reference's remedy list for a periodic drop (async "
            "saving, saving less often, faster storage) holds; what it leaves "
            "out "
            "is that the period can be found from the series itself, before "
            "reading any configuration, and that async saving has a floor."
        ),
    ]
    return Result(
        summary=summary,
        theory=(
            "A synchronous save every K steps adds its time T_save to one "
            "step in K: the mean step grows by T_save / K and the series "
            "has a "
            "period of K. An asynchronous save blocks only for the device-to-host "
            "copy (state bytes / copy bandwidth) plus fixed bookkeeping. "
            "A loader with latency L and an exponential tail of mean J makes "
            "each step wait L + Exp(J) when nothing is prefetched: a median "
            "wait "
            "of L + ln2·J (the exponential's median is ln2 times its mean), "
            "at random. With k workers loading ahead, the supply rate is "
            "k / (L + J) batches per second; when that exceeds 1 / step time "
            "the queue keeps up on average, and its depth k absorbs a run "
            "of long loads, so the wait goes to zero (with a margin: at 1.6x "
            "the demand, clusters of the exponential's tail still drain a "
            "queue of 4). "
            "Slow steps, periods and trends are found by `lab.training.series` "
            "(median, MAD, the most common gap between slow steps)."
        ),
        tables=[
            Table(
                "each case, read from its step times (ms; warm-up steps left out)",
                [
                    "case",
                    "shape",
                    "period",
                    "median",
                    "p90",
                    "mean",
                    "mean / steady",
                    "std/mean",
                    "data wait",
                    "save blocks",
                    "slow steps",
                ],
                rows,
            )
        ],
        checks=checks,
        plots={"step_times": _plot(logs, config)},
        notes=notes,
        provenance=provenance(target=config.target, devices=(), mesh=config.mesh),
        data={
            case: {
                "steps": [s.seconds for s in log.steps],
                "data_s": [s.data_s for s in log.steps],
                "save_s": [s.save_s for s in log.steps],
                "checkpoint": [s.checkpoint for s in log.steps],
                "config": {k: str(v) for k, v in vars(log.config).items()},
            }
            for case, log in logs.items()
        },
    )
