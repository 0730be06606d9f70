"""Ranking layouts: prune by memory, order by the closed form, re-order the top few by the compiler.

The closed form (`lab.plan.closed_form`) is cheap, thousands of layouts a
second, and approximate; the compiled prediction (`lab.predict`: the whole
step compiled for the compile-only pod, its scheduled program priced op by
op, `lab.predict.ops.predict_step`) is what XLA would run, and costs a
compile each. So a plan is three passes:

1. **prune**: drop every layout whose closed-form memory per chip exceeds the
   chip's HBM (if none is left, the plan says which layout comes closest, and
   by how much it overflows);
2. **rank**: order the rest by closed-form step time;
3. **re-rank**: compile the first few and order those by the compiled step
   (priced with the chip's efficiency constants, as the closed form is, so the
   two orders differ only where the models do), the rest keeping their closed-form order behind them.

How far the two orders agree is Spearman's rank correlation over the compiled
layouts: the Pearson correlation of their ranks (Spearman 1904), ties given
their average rank. `frontier` is the Pareto frontier of step time against
memory: the layouts no other layout beats on both.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from lab.errors import LabError
from lab.plan.closed_form import Estimate, estimate
from lab.plan.space import Layout, Problem, check_problem, layouts


@dataclass(frozen=True)
class CompiledPrediction:
    """What the compiled step of one layout predicts (per chip; times with the chip's efficiency constants)."""

    step_s: float
    compute_s: float
    exposed_s: float
    memory_bytes: int
    axes: dict[str, dict[str, float]]  # mesh axes ("fsdp", "fsdp,tensor") -> bytes (S x runs), seconds, exposed_s
    compile_s: float


@dataclass(frozen=True)
class Candidate:
    """A layout with its closed form and, when compiled, its compiled prediction."""

    estimate: Estimate
    compiled: CompiledPrediction | None = None
    not_compiled: str = ""  # why a layout among the top few was not compiled

    @property
    def layout(self) -> Layout:
        return self.estimate.layout

    @property
    def step_s(self) -> float:
        return self.compiled.step_s if self.compiled else self.estimate.step_s


@dataclass(frozen=True)
class Ranking:
    """The ranked candidates that fit, and what it took to get them."""

    problem: Problem
    enumerated: int
    ranked_s: float  # seconds to enumerate, prune and rank by the closed form
    candidates: tuple[Candidate, ...]  # fitting, best first (compiled ones by their compiled step)
    closest: Estimate | None = None  # when nothing fits: the layout with the least memory per chip
    pure_fsdp: Estimate | None = None  # the best fsdp-only layout, fitting or not (None if no such layout exists)
    everything: tuple[Estimate, ...] = field(default=(), repr=False)  # every enumerated layout, for the plot

    @property
    def compiled(self) -> tuple[Candidate, ...]:
        return tuple(c for c in self.candidates if c.compiled is not None)

    @property
    def rank_correlation(self) -> float | None:
        """Spearman's rho of the closed-form and compiled step times over the compiled layouts (None below 3)."""
        done = self.compiled
        if len(done) < 3:
            return None
        return spearman([c.estimate.step_s for c in done], [c.compiled.step_s for c in done])


def closed_form_plan(problem: Problem) -> Ranking:
    """Enumerate, prune and rank by the closed form alone."""
    check_problem(problem)
    started = time.perf_counter()
    everything = [estimate(problem, layout) for layout in layouts(problem)]
    fitting = sorted((e for e in everything if e.fits), key=_order)
    ranked_s = time.perf_counter() - started
    closest = None if fitting else min(everything, key=lambda e: e.memory.total)
    return Ranking(
        problem,
        len(everything),
        ranked_s,
        tuple(Candidate(e) for e in fitting),
        closest,
        _pure_fsdp(problem, everything),
        tuple(everything),
    )


def _order(e: Estimate) -> tuple:
    """Faster first; among equal times, less memory, then the simpler layout (fewer axes in use)."""
    return (e.step_s, e.memory.total, sum(n > 1 for n in e.layout.sizes.values()))


def _pure_fsdp(problem: Problem, everything: Iterable[Estimate]) -> Estimate | None:
    only = [e for e in everything if e.layout.mesh.fsdp == problem.chips]
    fitting = [e for e in only if e.fits]
    return min(fitting or only, key=_order) if only else None


def rerank(plan: Ranking, top: int, compile_one: Callable[[Layout], CompiledPrediction | str]) -> Ranking:
    """Compile the first `top` candidates (or until `top` compiled) and order those by the compiled step.

    `compile_one` returns a `CompiledPrediction`, or a sentence saying why this layout cannot be compiled.
    """
    chosen = []
    for tried, candidate in enumerate(plan.candidates):
        if len([c for c in chosen if c.compiled]) >= top or tried >= 2 * top:
            break
        result = compile_one(candidate.layout)
        chosen.append(
            replace(candidate, compiled=result)
            if isinstance(result, CompiledPrediction)
            else replace(candidate, not_compiled=result)
        )
    compiled = sorted((c for c in chosen if c.compiled), key=lambda c: (c.compiled.step_s, c.compiled.memory_bytes))
    rest = [c for c in chosen if not c.compiled] + list(plan.candidates[len(chosen) :])
    return replace(plan, candidates=(*compiled, *rest))


def spread(plan: Ranking, count: int, head: int = 3) -> list[Layout]:
    """`count` fitting layouts across the closed-form ranking: the first `head`, then evenly spaced to the last.

    A correlation over the top few alone measures the models on nearly equal layouts; spreading the rest over
    the ranking tests whether the closed form orders good against bad.
    """
    ranked = [c.layout for c in plan.candidates]
    if len(ranked) <= count:
        return ranked
    picks = list(range(min(head, count)))
    rest = count - len(picks)
    if rest:
        picks += [round(float(x)) for x in np.linspace(head, len(ranked) - 1, rest)]
    return [ranked[i] for i in dict.fromkeys(picks)]


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation: Pearson's r of the average ranks."""
    if len(a) != len(b) or len(a) < 2:
        raise LabError(f"a rank correlation needs two equally long series of 2 or more, got {len(a)} and {len(b)}")
    ra, rb = _ranks(np.asarray(a, float)), _ranks(np.asarray(b, float))
    if ra.std() == 0 or rb.std() == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


def _ranks(x: np.ndarray) -> np.ndarray:
    """1-based ranks, tied values sharing their average rank."""
    _, group, count = np.unique(x, return_inverse=True, return_counts=True)
    last = np.cumsum(count)  # the rank of each group of equal values' last member
    return (last - (count - 1) / 2)[group]  # the mean of the ranks last-count+1 .. last


def frontier(estimates: Iterable[Estimate]) -> list[Estimate]:
    """The Pareto frontier of (memory per chip, step time): sorted by memory, each faster than all before it."""
    best, out = float("inf"), []
    for e in sorted(estimates, key=lambda e: (e.memory.total, e.step_s)):
        if e.step_s < best:
            out.append(e)
            best = e.step_s
    return out


def differing_terms(a: Estimate, b: Estimate) -> list[tuple[str, float, float]]:
    """(term, a's, b's) for every term of the closed form, seconds or bytes, where the two layouts differ."""
    terms = [("matmul s", a.matmul_s, b.matmul_s), ("HBM-bound s", a.hbm_s, b.hbm_s)]
    terms.append(("pipeline bubble s", a.bubble_s, b.bubble_s))
    axes = sorted({x.axis for x in (*a.axes, *b.axes)})
    exposed_a, exposed_b = ({x.axis: x.exposed_s for x in e.axes} for e in (a, b))
    terms += [(f"exposed {axis} s", exposed_a.get(axis, 0.0), exposed_b.get(axis, 0.0)) for axis in axes]
    terms += [("step s", a.step_s, b.step_s)]
    for name in ("params", "grads", "optimizer", "activations", "transient"):
        terms.append((f"memory: {name} bytes", getattr(a.memory, name), getattr(b.memory, name)))
    terms.append(("memory per chip bytes", a.memory.total, b.memory.total))
    return [(t, x, y) for t, x, y in terms if abs(x - y) > 1e-9 * max(abs(x), abs(y), 1.0)]
