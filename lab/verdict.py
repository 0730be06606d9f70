"""Theory against observation: checks, their verdicts, and the quick-reference's claims.

A `Check` puts one quantity's prediction next to what this run observed. Its
`kind` says what sort of evidence it is, and so how strict it must be:

* ``exact``: counts, kinds, axes, bytes, FLOPs and memory that a compiler
  reports. Nothing about them is approximate: rtol 0, or at most 1e-6.
* ``model``: a closed-form or simulated prediction of a quantity measured
  independently (a simulator against an executed program, a cost model against
  a clock). Its `basis` says why the tolerance is as wide as it is.
* ``timing``: a clock on this target. Its `basis` states the claim it tests
  *here* (emulated devices share the host's cores: a claim about real hardware
  is not evidence from them).

The verdict follows from the numbers alone:

* ``agrees``: observed within rtol of the theory;
* ``refined``: the textbook value differs, and a corrected prediction
  (`refined`, computed in this run from evidence read in this run: the element
  type XLA gathered in, the tuple members it combined) agrees within the same
  rtol; `why` names that evidence;
* ``differs``: anything else. A sentence without a number changes nothing.

A bound ("at most half the dip is left") is a check whose `relation` is
``<=`` or ``>=``. `Claim` is the separate ledger of what the quick-reference
says: confirmed, refined or refuted, with the numbers that decide it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

Kind = Literal["exact", "model", "timing"]
Verdict = Literal["agrees", "refined", "differs"]
Relation = Literal["==", "<=", ">="]
Status = Literal["confirmed", "refined", "refuted"]

KINDS: tuple[Kind, ...] = ("exact", "model", "timing")
VERDICTS: tuple[Verdict, ...] = ("agrees", "refined", "differs")
STATUSES: tuple[Status, ...] = ("confirmed", "refined", "refuted")
EXACT_RTOL = 1e-6  # float formatting of a compiler's integer report; anything wider is a model, not exact
_ABS_TOL = 1e-12  # zero against zero agrees

Value = float | int | str


@dataclass(frozen=True)
class Check:
    """One quantity: what theory predicts, what this run observed, and the verdict the two give."""

    quantity: str
    kind: Kind
    theory: Value
    observed: Value
    rtol: float
    verdict: Verdict
    relation: Relation = "=="
    refined: Value | None = None  # a corrected prediction computed from this run's evidence
    why: str = ""  # the evidence behind `refined`
    basis: str = ""  # model: why the tolerance is what it is; timing: the claim tested on this target

    @property
    def passed(self) -> bool:
        return self.verdict != "differs"


def check(
    quantity: str,
    theory: Value,
    observed: Value,
    *,
    kind: Kind,
    rtol: float = 0.0,
    relation: Relation = "==",
    refined: Value | None = None,
    why: str = "",
    basis: str = "",
) -> Check:
    """Judge one quantity (see the module docstring); numbers compare within `rtol`, strings must match."""
    if kind not in KINDS:
        raise ValueError(f"check {quantity!r}: kind {kind!r} is none of {KINDS}")
    if kind == "exact" and rtol > EXACT_RTOL:
        raise ValueError(f"check {quantity!r}: an exact check takes rtol <= {EXACT_RTOL:g}, not {rtol:g}")
    if kind != "exact" and not basis:
        raise ValueError(f"check {quantity!r}: a {kind} check says why its tolerance is what it is (basis=...)")
    if refined is not None and not why:
        raise ValueError(f"check {quantity!r}: a refined prediction names the evidence it was computed from (why=)")
    if holds(theory, observed, rtol, relation):
        verdict: Verdict = "agrees"
    elif refined is not None and holds(refined, observed, rtol, relation):
        verdict = "refined"
    else:
        verdict = "differs"
    return Check(quantity, kind, theory, observed, rtol, verdict, relation, refined, why, basis)


def holds(theory: Value, observed: Value, rtol: float, relation: Relation = "==") -> bool:
    """Whether `observed` satisfies `relation` against `theory` within `rtol`."""
    if not (_is_number(theory) and _is_number(observed)):
        return relation == "==" and str(theory) == str(observed)
    if relation == "<=":
        return observed <= theory * (1 + rtol) + _ABS_TOL
    if relation == ">=":
        return observed >= theory * (1 - rtol) - _ABS_TOL
    return abs(observed - theory) <= rtol * abs(theory) + _ABS_TOL  # relative to the theory, not to the larger


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass(frozen=True)
class Claim:
    """One sentence of the quick-reference, and what this run's numbers make of it."""

    claim: str
    status: Status
    numbers: str  # the numbers from this run that decide it

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"claim {self.claim!r}: status {self.status!r} is none of {STATUSES}")
        if not self.numbers:
            raise ValueError(f"claim {self.claim!r}: a status without numbers is an opinion")


def counts(checks: Iterable[Check]) -> dict[Verdict, int]:
    """How many checks gave each verdict."""
    checks = list(checks)
    return {v: sum(c.verdict == v for c in checks) for v in VERDICTS}


def tally(checks: Iterable[Check]) -> str:
    """``"5 agree, 1 refined, 0 differ"``."""
    n = counts(checks)
    return f"{n['agrees']} agree, {n['refined']} refined, {n['differs']} differ"
