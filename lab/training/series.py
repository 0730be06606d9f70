"""Reading a step-time series: its level, its spread, and the shape of its jumps.

When throughput jumps, the first question is not "which kernel" but "what
shape is the jumping" (quick-reference #53): the shape names the layer.

* **periodic** dips, one every P steps at a fixed phase: something scheduled,
  a synchronous checkpoint every P steps, an evaluation, an epoch boundary;
* **random** jitter: a loader that cannot keep up, a straggler, routing
  that is skewed on some batches: slow steps off any lattice, or a series
  whose typical step is far from its median;
* a **trend**: steps getting slower over time (memory fragmentation, a growing
  cache, numerics changing the work);
* **steady**: nothing to explain beyond noise.

Statistics are robust, because the slow steps are what we are looking for
and must not inflate the yardstick: the level is the median, the noise is the
median absolute deviation (MAD, scaled by 1.4826 to estimate σ for normal
noise). A step is *slow* when it is both statistically and practically far
from the median: above median + 6 σ_MAD and above 1.25 × median. The period
comes from the series itself, not from a configuration: the most common gap
between consecutive slow steps is the candidate P, and it is accepted when
the slow steps sit on one lattice phase + kP (at least 80 % of them) and that
lattice is mostly slow (at least 80 % of its points after the first dip).
Random jitter is either more than 5 % of the steps slow, off any lattice, or
a robust spread σ_MAD / median above 0.2: a wide distribution (a loader's
exponential tail) widens the MAD with it, so it has few "outliers" but a
large spread, while one hiccup in a quiet series is neither. Spread is
reported as the coefficient of variation std/mean (the number to compare
before and after a fix) next to its robust twin MAD/median.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

MAD_TO_SIGMA = 1.4826  # σ = 1.4826 · MAD for normally distributed noise
SLOW_SIGMAS = 6.0  # far outside the noise ...
SLOW_RATIO = 1.25  # ... and large enough to matter
ON_LATTICE = 0.8  # fraction of slow steps that must sit at phase + kP, and of lattice points that must be slow
MIN_DIPS = 3  # fewer than three dips cannot show a period
TREND_RATIO = 1.2  # the last quarter's median over the first quarter's
RANDOM_SLOW_FRACTION = 0.05  # more than this share of steps slow, with no period: random jitter
RANDOM_SPREAD = 0.2  # σ_MAD / median above this: steps typically 20 % off the median (quiet CPU runs: about 0.1)


@dataclass(frozen=True)
class SeriesSummary:
    """What one step-time series says (times in seconds, steps as indices into the series)."""

    steps: int
    median: float
    mean: float
    p10: float
    p90: float
    cv: float  # std / mean
    robust_cv: float  # σ_MAD / median
    slow_steps: tuple[int, ...]
    period: int | None  # P when the slow steps are periodic
    phase: int | None  # the first slow step on the lattice
    trend_ratio: float  # median of the last quarter / median of the first quarter
    excess_fraction: float  # share of the total time spent above the median

    @property
    def pattern(self) -> str:
        """periodic | random | trend | steady (a period wins: it is the most specific finding)."""
        if self.period is not None:
            return "periodic"
        if len(self.slow_steps) > RANDOM_SLOW_FRACTION * self.steps or self.robust_cv > RANDOM_SPREAD:
            return "random"
        if self.trend_ratio > TREND_RATIO:
            return "trend"
        return "steady"

    def describe(self) -> str:
        spread = (
            f"median {self.median * 1e3:.1f} ms (p10 {self.p10 * 1e3:.1f}, p90 {self.p90 * 1e3:.1f}), "
            f"std/mean {self.cv:.2f}"
        )
        slow = f"{len(self.slow_steps)} slow step(s), {self.excess_fraction:.0%} of the time above the median"
        if self.pattern == "periodic":
            return f"periodic: a dip every {self.period} steps from step {self.phase}; {slow}; {spread}"
        if self.pattern == "trend":
            return f"trend: the last quarter is {self.trend_ratio:.2f}x the first; {spread}"
        return f"{self.pattern}: {slow}; {spread}"


def analyze(seconds: Sequence[float], first_step: int = 0) -> SeriesSummary:
    """Summarize a series of step times; `first_step` numbers its first entry (for the phase and slow steps)."""
    t = np.asarray(seconds, dtype=float)
    if t.size == 0:
        raise ValueError("an empty step-time series has nothing to analyze")
    median = float(np.median(t))
    sigma = MAD_TO_SIGMA * float(np.median(np.abs(t - median)))
    slow = np.flatnonzero((t > median + SLOW_SIGMAS * sigma) & (t > SLOW_RATIO * median))
    period, phase = find_period(slow, t.size)
    quarter = max(t.size // 4, 1)
    return SeriesSummary(
        steps=int(t.size),
        median=median,
        mean=float(t.mean()),
        p10=float(np.percentile(t, 10)),
        p90=float(np.percentile(t, 90)),
        cv=float(t.std() / t.mean()) if t.mean() else 0.0,
        robust_cv=sigma / median if median else 0.0,
        slow_steps=tuple(int(i) + first_step for i in slow),
        period=period,
        phase=None if phase is None else phase + first_step,
        trend_ratio=float(np.median(t[-quarter:]) / np.median(t[:quarter])) if median else 1.0,
        excess_fraction=float(np.clip(t - median, 0, None).sum() / t.sum()) if t.sum() else 0.0,
    )


def find_period(slow: np.ndarray, length: int) -> tuple[int | None, int | None]:
    """(P, phase) when the slow indices sit on a lattice phase + kP, else (None, None)."""
    if slow.size < MIN_DIPS:
        return None, None
    gaps = Counter(np.diff(slow).tolist())
    period = gaps.most_common(1)[0][0]
    if period < 2:  # consecutive slow steps are a slow stretch, not a period
        return None, None
    phase = Counter((slow % period).tolist()).most_common(1)[0][0]
    on_lattice = slow[slow % period == phase]
    lattice = np.arange(on_lattice[0], length, period)
    if (
        on_lattice.size >= ON_LATTICE * slow.size
        and on_lattice.size >= ON_LATTICE * lattice.size
        and on_lattice.size >= MIN_DIPS
    ):
        return int(period), int(on_lattice[0])
    return None, None
