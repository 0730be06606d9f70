"""Theory against observation: expectations, checks and verdicts.

An `Expectation` is what theory predicts for a program: named quantities
(collectives per axis, bytes per device, memory, time on a chip profile).
`compare(expected, observed)` turns each quantity into a `Check` row with one
of three verdicts:

* ``agrees``: observed within the tolerance of the prediction;
* ``refined``: it differs, and the difference is a known, explained effect
  (XLA gathered in bf16, combined two all-reduces into one tuple, fused the
  reduce-scatter into a fusion): the textbook was too simple, not wrong;
* ``differs``: it differs and nothing explains it. This is a finding.

A check never hides a difference: the explanation of a ``refined`` verdict is
printed next to it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

Verdict = Literal["agrees", "refined", "differs"]


@dataclass(frozen=True)
class Check:
    """One quantity: theory, observation, tolerance, verdict and why."""

    quantity: str
    theory: float | int | str
    observed: float | int | str
    verdict: Verdict
    rtol: float = 0.0
    note: str = ""

    @property
    def passed(self) -> bool:
        return self.verdict != "differs"


def check(quantity: str, theory, observed, *, rtol: float = 0.0, explained: str | None = None) -> Check:
    """Compare one quantity; numbers within `rtol` agree, strings must match.

    `explained` is the known reason a difference is expected (XLA refined the
    textbook); without it a difference is reported as ``differs``.
    """
    if isinstance(theory, (int, float)) and isinstance(observed, (int, float)):
        same = math.isclose(observed, theory, rel_tol=rtol, abs_tol=1e-12)
    else:
        same = str(theory) == str(observed)
    if same:
        return Check(quantity, theory, observed, "agrees", rtol)
    if explained:
        return Check(quantity, theory, observed, "refined", rtol, explained)
    return Check(quantity, theory, observed, "differs", rtol)


def at_most(quantity: str, observed: float, limit: float, *, explained: str | None = None) -> Check:
    """Theory as an upper bound ("most of the dip is gone": a ratio at most 0.5): agrees when observed <= limit."""
    if observed <= limit:
        return Check(quantity, f"<= {limit:g}", observed, "agrees")
    return Check(quantity, f"<= {limit:g}", observed, "refined" if explained else "differs", note=explained or "")


@dataclass(frozen=True)
class Expectation:
    """What theory predicts for one program: quantity name -> value."""

    program: str
    quantities: Mapping[str, float | int | str]
    rtol: float = 0.0
    explanations: Mapping[str, str] = field(default_factory=dict)


def compare(expected: Expectation, observed: Mapping[str, float | int | str]) -> list[Check]:
    """One `Check` per expected quantity; a quantity never observed ``differs``."""
    rows = []
    for name, value in expected.quantities.items():
        label = f"{expected.program}: {name}"
        if name not in observed:
            rows.append(Check(label, value, "not found", "differs", expected.rtol))
            continue
        rows.append(check(label, value, observed[name], rtol=expected.rtol, explained=expected.explanations.get(name)))
    return rows


def tally(checks: list[Check]) -> str:
    """``"5 agree, 1 refined, 0 differ"``."""
    counts = {v: sum(c.verdict == v for c in checks) for v in ("agrees", "refined", "differs")}
    return f"{counts['agrees']} agree, {counts['refined']} refined, {counts['differs']} differ"
