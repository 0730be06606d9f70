"""What the experiment tests share: pinning verdicts, never `passed`.

A test runs an experiment on a small config and pins the verdict of each of
its exact and model checks (and the refined value where there is one), so a
change that turns "agrees" into "refined", or a refinement into another
number, fails. Timing checks are not pinned: tests never assert timings.
"""

from __future__ import annotations

from lab.report import Result


def pinned(result: Result) -> dict[str, str | tuple[str, object]]:
    """quantity -> verdict of every exact and model check; a refined check gives (verdict, refined value)."""
    return {
        c.quantity: (c.verdict, c.refined) if c.verdict == "refined" else c.verdict
        for c in result.checks
        if c.kind != "timing"
    }
