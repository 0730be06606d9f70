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

Every check here reads a clock on this target, so each is a timing check
stating the claim it tests, with a margin chosen so that two runs on this
2-core host give the same verdict.
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from matplotlib.figure import Figure

from lab.progress import track
from lab.provenance import Setup
from lab.report import Result, Table
from lab.targets.devices import DEFAULT_TARGET, devices_for
from lab.targets.hardware import profile
from lab.training import run as training_run
from lab.training.data import Loader
from lab.training.page import plot_step_times
from lab.training.run import WARMUP_STEPS, RunConfig
from lab.training.series import ON_LATTICE, SeriesSummary, analyze, find_period
from lab.units import format_bytes
from lab.verdict import Check, Claim, check

QUESTION = "#53"
CASES = ("steady", "sync checkpoints", "async checkpoints", "slow loader", "slow loader + prefetch")
# Bounds, each with its margin on this target (two `lab report` runs give the same verdict):
SAVE_COST_RTOL = 0.5  # the mean step added by sync saves against T_save / K: two separate runs on a shared host
ASYNC_ADDED_BOUND = 0.5  # async saving removes most of the mean step a sync save adds (observed 0.1-0.3)
LOADER_RTOL = 0.5  # the wait is the loader's sleep plus placement; a busy host's wake-up adds 1-15 ms to tens
PREFETCH_BOUND = 0.2  # prefetching leaves at most a fifth of the unfed wait (observed a few percent)
NEIGHBOURS = 2  # the local baseline of a step: the median of the 2 steps on each side and itself
# A dip: a step at least this many times its local baseline. A synchronous save of orbax's (about 100 ms or more)
# against a step of tens of ms is 7x or more on this host; its other processes' hiccups reached under 3x in the
# runs measured for this page (a stretch of several slow steps moves the baseline with it).
DIP_RATIO = 4.0


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


@dataclass(frozen=True)
class Run:
    """One case's run, as its loop's clock saw each step (seconds; index = step, the first WARMUP_STEPS warm-up)."""

    case: str
    input_ms: float
    input_jitter_ms: float
    prefetch: int
    checkpoint_every: int
    async_checkpoint: bool
    state_bytes: int  # the training state a checkpoint saves, all devices together
    seconds: tuple[float, ...]  # the whole iteration: data + step + save
    data_s: tuple[float, ...]  # waiting for the batch (the loader and host-to-device placement)
    save_s: tuple[float, ...]  # the blocking part of a checkpoint save
    checkpoint: tuple[bool, ...]  # a save started in this step
    scheduled_s: tuple[float, ...] = ()  # the loader's cost of each step's batch (latency + its seeded Exp draw)

    @property
    def timed(self) -> slice:
        return slice(WARMUP_STEPS, None) if len(self.seconds) > WARMUP_STEPS else slice(None)

    def series(self) -> SeriesSummary:
        """The step-time series analysis of the steps after warm-up."""
        start = self.timed.start or 0
        return analyze(self.seconds[self.timed], first_step=start)

    def local_ratios(self) -> np.ndarray:
        """Each timed step over its local baseline: the median of it and its NEIGHBOURS on each side."""
        t = np.asarray(self.seconds[self.timed], dtype=float)
        return t / np.asarray([np.median(t[max(i - NEIGHBOURS, 0) : i + NEIGHBOURS + 1]) for i in range(t.size)])

    def dips(self) -> tuple[int, ...]:
        """The steps at least DIP_RATIO times their local baseline."""
        start = self.timed.start or 0
        return tuple(int(i) + start for i in np.flatnonzero(self.local_ratios() >= DIP_RATIO))

    @property
    def dip_period(self) -> int | None:
        """The period of the dips (`lab.training.series.find_period`: a lattice holding 80 % of them), or None."""
        start = self.timed.start or 0
        period, _ = find_period(np.asarray(self.dips(), dtype=int) - start, len(self.seconds[self.timed]))
        return period

    @property
    def shape(self) -> str:
        """periodic when the dips have a period, else the shape `lab.training.series` reads in the raw series."""
        return "periodic" if self.dip_period else self.series().pattern

    def mean(self, field: str = "seconds") -> float:
        return float(np.mean(getattr(self, field)[self.timed]))

    def median(self, field: str = "seconds") -> float:
        return float(np.median(getattr(self, field)[self.timed]))

    def saves(self) -> list[float]:
        """Blocking seconds of each save after warm-up (the first save also creates the manager's folders)."""
        start = self.timed.start or 0
        return [s for s, saved in zip(self.save_s[start:], self.checkpoint[start:]) if saved]

    def save_steps(self) -> set[int]:
        start = self.timed.start or 0
        return {i for i, saved in enumerate(self.checkpoint) if saved and i >= start}


@dataclass(frozen=True)
class Observations:
    setup: Setup
    host_copy_bandwidth: float  # bytes per second, measured on this host (lab.targets.hardware's cpu profile)
    runs: tuple[Run, ...]  # in CASES order

    def run(self, case: str) -> Run:
        return next(r for r in self.runs if r.case == case)


# --------------------------------------------------------------------------- measure


def measure(config: Config) -> Observations:
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
        runs = _run_cases(config, base, devices, Path(scratch))
    return Observations(
        setup=Setup.of(config.target, devices, config.mesh),
        host_copy_bandwidth=float(profile("cpu").hbm_bandwidth),
        runs=runs,
    )


def _run_cases(config: Config, base: RunConfig, devices, scratch: Path) -> tuple[Run, ...]:
    """The steady run first: the slow loader is sized against its median step."""
    runs: list[Run] = []
    for case in track(CASES, "throughput cases"):
        steady_ms = runs[0].series().median * 1e3 if runs else 0.0
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
        run_config = replace(base, results=scratch / "pages", **changes)
        log = training_run.run(run_config, devices)
        loader = Loader(lambda step: None, run_config.input_ms / 1e3, run_config.input_jitter_ms / 1e3, run_config.seed)
        runs.append(
            Run(
                case=case,
                input_ms=float(run_config.input_ms),
                input_jitter_ms=float(run_config.input_jitter_ms),
                prefetch=run_config.prefetch,
                checkpoint_every=run_config.checkpoint_every,
                async_checkpoint=run_config.async_checkpoint,
                state_bytes=int(log.state_bytes),
                seconds=tuple(float(s.seconds) for s in log.steps),
                data_s=tuple(float(s.data_s) for s in log.steps),
                save_s=tuple(float(s.save_s) for s in log.steps),
                checkpoint=tuple(bool(s.checkpoint) for s in log.steps),
                scheduled_s=tuple(float(loader.cost_s(s.step)) for s in log.steps) if run_config.input_ms else (),
            )
        )
    return tuple(runs)


# --------------------------------------------------------------------------- judge


def judge(obs: Observations, config: Config) -> Result:
    checks = _checks(obs, config)
    return Result(
        summary=_summary(obs, config),
        theory=THEORY,
        tables=[_table(obs)],
        checks=checks,
        claims=_claims(obs, config),
        plots={"step_times": partial(_plot, obs, config)},
        notes=_notes(obs),
    )


def _sync_added(obs: Observations) -> float:
    """Seconds a synchronous save every K steps adds to the mean step, against the steady run."""
    return obs.run("sync checkpoints").mean() - obs.run("steady").mean()


def _async_added(obs: Observations) -> float:
    return obs.run("async checkpoints").mean() - obs.run("steady").mean()


def _copy_s(obs: Observations) -> float:
    """The textbook's blocking time of an async save: the state copied to host memory at the host's bandwidth."""
    return obs.run("async checkpoints").state_bytes / obs.host_copy_bandwidth


def _loader_median(run: Run) -> float:
    """The textbook's median wait of an unfed loader: latency + ln2 x the exponential's mean (its median)."""
    return run.input_ms / 1e3 + math.log(2) * run.input_jitter_ms / 1e3


def _checks(obs: Observations, config: Config) -> list[Check]:
    k = config.checkpoint_every
    steady, sync, slow, fed = (
        obs.run(c) for c in ("steady", "sync checkpoints", "slow loader", "slow loader + prefetch")
    )
    saves, dips = sync.save_steps(), set(sync.dips())
    placing = steady.median("data_s")  # what the steady run waits too: host-to-device placement
    scheduled = float(np.median(slow.scheduled_s[slow.timed])) if slow.scheduled_s else None
    slow_wait, fed_wait = slow.median("data_s"), fed.median("data_s")
    return [
        check(
            f"steady: period of the dips (steps {DIP_RATIO:g}x their neighbours)",
            "none",
            steady.dip_period or "none",
            kind="timing",
            basis=f"on this target the steady run's noise makes no lattice of steps {DIP_RATIO:g}x their neighbours",
        ),
        check(
            "sync checkpoints: the shape found from the series alone",
            "periodic",
            sync.shape,
            kind="timing",
            basis="a blocking save of hundreds of ms stands far out of a step of tens of ms on this target",
        ),
        check(
            f"sync checkpoints: period of the dips (steps {DIP_RATIO:g}x their neighbours)",
            k,
            sync.dip_period or "none",
            kind="timing",
            basis=(
                "the dips found from the series alone sit every K steps on this target; read against a local "
                "baseline, since the shared host slows stretches of several steps and a save slows one"
            ),
        ),
        check(
            "sync checkpoints: save steps that are dips / save steps",
            1.0,
            len(saves & dips) / len(saves) if saves else 0.0,
            kind="timing",
            relation=">=",
            basis=f"every synchronous save makes its step {DIP_RATIO:g}x its neighbours or more on this target",
        ),
        check(
            "sync checkpoints: dips that are save steps / dips",
            ON_LATTICE,
            len(saves & dips) / len(dips) if dips else 0.0,
            kind="timing",
            relation=">=",
            basis=(
                f"the dips are the saves: at least {ON_LATTICE:.0%} of them (the series' own lattice rule), so one "
                "hiccup of the shared host does not change the verdict"
            ),
        ),
        check(
            "sync checkpoints: mean step time added / (mean blocking save time / K)",
            1.0,
            _sync_added(obs) / sync.mean("save_s") if sync.mean("save_s") else math.inf,
            kind="timing",
            rtol=SAVE_COST_RTOL,
            basis=(
                "on this target a synchronous save adds its blocking time to one step in K and nothing else; "
                "the added time is a difference of two separate runs on a shared host, hence within half"
            ),
        ),
        *_async_checks(obs),
        check(
            "slow loader: the shape found from the series alone",
            "random",
            slow.shape,
            kind="timing",
            basis="an exponential tail twice the step's mean makes the step times spread at random on this target",
        ),
        check(
            "slow loader: median wait for data (ms) = latency + ln2 x jitter + placement",
            (_loader_median(slow) + placing) * 1e3,
            slow_wait * 1e3,
            kind="timing",
            rtol=LOADER_RTOL,
            refined=(scheduled + placing) * 1e3 if scheduled is not None else None,
            why=(
                f"the loader's seeded costs for the {len(slow.seconds[slow.timed])} timed steps: their median is "
                f"{scheduled * 1e3:.1f} ms, against {_loader_median(slow) * 1e3:.1f} ms for an infinite sample"
                if scheduled is not None
                else ""
            ),
            basis=(
                "on this target the unfed loop waits for the loader's sleep plus host-to-device placement; on the "
                "busy 2-core host waking from the sleep and placing the batch added 1-15 ms a step (median 1-3 ms) "
                "to waits of tens: within half"
            ),
        ),
        check(
            f"slow loader + prefetch {config.prefetch}: median wait for data / the unfed loader's",
            PREFETCH_BOUND,
            fed_wait / slow_wait,
            kind="timing",
            relation="<=",
            basis=(
                f"{config.prefetch} workers supply more batches per second than the step uses on this target, so "
                "the wait falls to placement: a few percent of the unfed wait"
            ),
        ),
    ]


def _async_checks(obs: Observations) -> list[Check]:
    """The textbook: an async save blocks only for the device-to-host copy, so most of the dip goes."""
    blocking = float(np.median(obs.run("async checkpoints").saves()))
    return [
        check(
            "async checkpoints: median blocking save (ms) = the state's copy to host memory",
            _copy_s(obs) * 1e3,
            blocking * 1e3,
            kind="timing",
            relation="<=",
            rtol=1.0,
            basis=(
                "the textbook on this target: an async save blocks only while the state is copied to host memory, "
                "its bytes at this host's measured copy bandwidth (up to twice that)"
            ),
        ),
        check(
            "async checkpoints: mean step time added / sync's, over the run (first save included)",
            ASYNC_ADDED_BOUND,
            _async_added(obs) / _sync_added(obs),
            kind="timing",
            relation="<=",
            basis=(
                "over a run on this target async saving removes most of the mean step time that synchronous "
                "saving adds, above all the first save's seconds of set-up, which the writer thread takes"
            ),
        ),
    ]


def _claims(obs: Observations, config: Config) -> list[Claim]:
    k = config.checkpoint_every
    steady, sync, asyn, slow, fed = (obs.run(c) for c in CASES)
    shapes = {r.case: r.shape for r in obs.runs}
    named = (
        shapes["sync checkpoints"] == "periodic"
        and shapes["slow loader"] == "random"
        and shapes["steady"] != "periodic"
    )
    claims = [
        Claim(
            "Look at the timeline first: its shape (periodic, random, trend) names the layer that jitters",
            "confirmed" if named else "refuted",
            "shapes read from the step times alone: " + ", ".join(f"{case} {shape}" for case, shape in shapes.items()),
        ),
        Claim(
            "A drop every N steps is most likely a checkpoint save: check that the save interval is N",
            "confirmed" if sync.dip_period == k and set(sync.dips()) >= sync.save_steps() else "refuted",
            f"period of the dips {sync.dip_period or 'none'} against K = {k}; dips at {list(sync.dips())}, "
            f"saves at {sorted(sync.save_steps())}",
        ),
    ]
    sync_added, async_added = _sync_added(obs), _async_added(obs)
    blocking, copy = float(np.median(asyn.saves())), _copy_s(obs)
    sync_blocking = float(np.median(sync.saves()))
    works = async_added <= ASYNC_ADDED_BOUND * sync_added
    claims.append(
        Claim(
            "The fix for periodic drops: save asynchronously (or less often, or to faster storage)",
            "refuted" if not works else "refined" if blocking > 10 * copy else "confirmed",
            f"async saving adds {async_added * 1e3:.1f} ms to the mean step against sync's {sync_added * 1e3:.1f} ms; "
            f"but an async save still blocks for {blocking * 1e3:.0f} ms ({blocking / sync_blocking:.0%} of a sync "
            f"one) while copying its {format_bytes(asyn.state_bytes)} takes {copy * 1e3:.2f} ms: a fixed floor per "
            "save",
        )
    )
    fixed = shapes["slow loader"] == "random" and fed.median("data_s") <= PREFETCH_BOUND * slow.median("data_s")
    before, after = slow.series(), fed.series()
    claims.append(
        Claim(
            "Random jitter points at the data loader: more workers / prefetching fix it",
            "confirmed" if fixed else "refuted",
            f"slow loader {shapes['slow loader']}, median wait {slow.median('data_s') * 1e3:.1f} ms, MAD/median "
            f"{before.robust_cv:.2f} (std/mean {before.cv:.2f}); with {config.prefetch} workers median wait "
            f"{fed.median('data_s') * 1e3:.2f} ms, MAD/median {after.robust_cv:.2f} (std/mean {after.cv:.2f}); "
            f"steady MAD/median {steady.series().robust_cv:.2f} (std/mean {steady.series().cv:.2f})",
        )
    )
    return claims


def _table(obs: Observations) -> Table:
    steady_mean = obs.run("steady").mean()
    rows = []
    for run in obs.runs:
        series = run.series()
        saves = run.saves()
        rows.append(
            [
                run.case,
                run.shape,
                run.dip_period or "",
                series.median * 1e3,
                series.p90 * 1e3,
                run.mean() * 1e3,
                run.mean() / steady_mean,
                series.cv,
                run.median("data_s") * 1e3,
                float(np.median(saves)) * 1e3 if saves else "",
                len(series.slow_steps),
            ]
        )
    return Table(
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
        f"Shape and period: a period of the dips (steps at least {DIP_RATIO:g}x their local baseline, the median "
        f"of each step and its {NEIGHBOURS} neighbours on each side) wins; otherwise the shape `lab.training.series` "
        "reads in the raw step times. The other columns, slow steps included, read the raw step times.",
    )


def _log(run: Run) -> SimpleNamespace:
    """What `plot_step_times` reads of a run log: its steps."""
    return SimpleNamespace(
        steps=[
            SimpleNamespace(step=i, seconds=s, data_s=d, checkpoint=c)
            for i, (s, d, c) in enumerate(zip(run.seconds, run.data_s, run.checkpoint))
        ]
    )


def _plot(obs: Observations, config: Config) -> Figure:
    figure = Figure(figsize=(8, 2.0 * len(obs.runs)))
    panels = figure.subplots(len(obs.runs), 1, sharex=True)
    for axes, run in zip(panels, obs.runs):
        series = run.series()
        plot_step_times(axes, _log(run), run.case)
        axes.axhline(series.median * 1e3, color="grey", linewidth=0.8, linestyle="--")
        axes.set(yscale="log", xlabel="")  # a first save of seconds and steps of milliseconds on one axis
        axes.set_ylim(top=axes.get_ylim()[1] * 4)  # room for the legend above the series
        axes.set_title(f"{run.case}: {run.shape}", fontsize=9, loc="left")
        axes.legend(fontsize=7, loc="upper center", ncol=3, frameon=False)
    panels[-1].set_xlabel("step")
    figure.suptitle(
        f"step time over steps, {config.model} on {config.mesh} (log scale; dashed: median after warm-up)", fontsize=10
    )
    figure.tight_layout()
    return figure


def _summary(obs: Observations, config: Config) -> str:
    steady, sync, asyn, slow, fed = (obs.run(c) for c in CASES)
    period = sync.dip_period
    return (
        f"Read from the step times alone: synchronous checkpoints every {config.checkpoint_every} steps show as "
        f"{sync.shape}" + (f" dips every {period} steps" if period else "") + ", and raise the mean step to "
        f"{sync.mean() / steady.mean():.2f}x the steady run's; "
        f"asynchronous saving brings it to {asyn.mean() / steady.mean():.2f}x ({asyn.shape}). "
        f"A loader costing {slow.input_ms:.0f} ms + Exp({slow.input_jitter_ms:.0f} ms) per batch "
        f"makes the series {slow.shape} (MAD/median {slow.series().robust_cv:.2f} against "
        f"{steady.series().robust_cv:.2f} steady), and {config.prefetch} prefetching workers take it back to "
        f"{fed.mean() / steady.mean():.2f}x. "
        "The first thing to look at is the shape of the timeline, then the layer it names."
    )


def _notes(obs: Observations) -> list[str]:
    sync, asyn = obs.run("sync checkpoints"), obs.run("async checkpoints")
    first_save = next(s for s, saved in zip(sync.save_s, sync.checkpoint) if saved)
    blocking = float(np.median(asyn.saves()))
    return [
        (
            f"Each run's first {WARMUP_STEPS} steps are left out of every statistic (warm-up). The first save of a "
            f"checkpoint manager blocked for {first_save * 1e3:.0f} ms against a median of "
            f"{np.median(sync.saves()) * 1e3:.0f} ms for the later ones: it also creates the folder and starts "
            "orbax's machinery, so the first dip is the deepest."
        ),
        (
            f"The async save blocks for {blocking * 1e3:.0f} ms (median) while copying its "
            f"{format_bytes(asyn.state_bytes)} to host memory takes {_copy_s(obs) * 1e3:.2f} ms at this host's "
            f"{obs.host_copy_bandwidth / 1e9:.0f} GB/s: the textbook's blocking time misses by "
            f"{blocking / _copy_s(obs):.0f}x, and this page computes no corrected value, so that check differs. "
            "What is known: at this state size a save costs orbax's fixed work (a temporary folder renamed when "
            "complete, metadata, handing the arrays to the writer thread), not bandwidth; only a state large "
            "enough for the copy to dominate would hide it. That blocking time was "
            f"{blocking / float(np.median(sync.saves())):.0%} of a synchronous save's here; across runs on this "
            "host it ranged from a third to four fifths with the other processes' load, so it is shown, not "
            "judged. Over the run, async saving still removes most of the added time "
            f"({_async_added(obs) / _sync_added(obs):.2f} of sync's): the first save's "
            f"{first_save:.1f} s of set-up, {first_save / len(sync.seconds[sync.timed]) * 1e3:.0f} ms per step of "
            "the synchronous run, goes to the writer thread."
        ),
        (
            "On a 2-core machine the asynchronous writer shares cores with the step, so the steps after an async "
            "save can be a little slower: the cost moves rather than vanishes, and on a busy host it can show up "
            "as random jitter."
        ),
        (
            "The loader's cost is a sleep (an I/O-bound loader releases the GIL), drawn from the seed for each "
            "step: the same draws every run, so the sample median of the wait differs from latency + ln2 x jitter "
            "by the same amount each time. A CPU-bound loader would also take cores from the step, and "
            "prefetching would hide less of it."
        ),
        (
            f"Verdicts: every check reads this host's clock. Bounds sit where the observed values of the runs "
            "measured for this page leave a margin of about 2x (the slowest check, async against sync, read 0.1 "
            "to 0.3 against its bound of 0.5). The period is read from the dips, steps at least "
            f"{DIP_RATIO:g}x the median of their neighbours: other processes on this shared 2-core host slow "
            "stretches of several steps at a time, and single steps by up to about 3x, which on the raw series "
            "break the lattice of slow steps (a stretch of 7 slow steps before the first save turned the "
            "synchronous run 'random' in one run, three hiccups of 1.3-2x broke the period in another), while a "
            "save makes its step 7x its neighbours or more."
        ),
        (
            "The quick-reference verifies a fix by the jitter's std/mean before and after. On a shared host one "
            "hiccup of another process moves std/mean more than the fix does, so the claims above compare the "
            "robust spread MAD/median (`lab.training.series`), and std/mean is shown beside it."
        ),
        (
            "The quick-reference's remedy list for a periodic drop (async saving, saving less often, faster "
            "storage) holds; what it leaves out is that the period can be found from the series itself, before "
            "reading any configuration, and that async saving has a floor."
        ),
    ]


THEORY = (
    "A synchronous save every K steps adds its time T_save to one step in K: the mean step grows by T_save / K and "
    "the series has a period of K. An asynchronous save blocks only for the device-to-host copy (state bytes / copy "
    "bandwidth) plus fixed bookkeeping. A loader with latency L and an exponential tail of mean J makes each step "
    "wait L + Exp(J) when nothing is prefetched: a median wait of L + ln2·J (the exponential's median is ln2 times "
    "its mean), at random. With k workers loading ahead, the supply rate is k / (L + J) batches per second; when "
    "that exceeds 1 / step time the queue keeps up on average, and its depth k absorbs a run of long loads, so the "
    "wait goes to zero (with a margin: at 1.6x the demand, clusters of the exponential's tail still drain a queue "
    "of 4). Slow steps, periods and trends are found by `lab.training.series` (median, MAD, the most common gap "
    "between slow steps)."
)
