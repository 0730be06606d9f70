"""How many times a while loop runs, read from the module's text.

XLA:CPU and XLA:GPU write the count their loop analysis proved into the
while's backend config (``"known_trip_count":{"n":"4"}``). libtpu writes none,
so a loop as JAX writes it (``scan``, ``fori_loop``: a counter from 0 in steps
of one, run while below a constant) is read from its condition computation,
which compares the counter with that constant::

    %constant.81 = s32[] constant(4)
    ROOT %lt.13 = pred[] compare(%get-tuple-element.283, %constant.81), direction=LT

A condition of any other form (a value computed in the loop, a bound passed in)
has no count here: None, which the callers show as unknown.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from lab.hlo.text import Instruction

_KNOWN = r'"known_trip_count":\{"n":"(\d+)"\}'
_CONSTANT = re.compile(r"\bconstant\((\d+)\)")


def trip_count(loop: Instruction, condition: Iterable[Instruction]) -> int | None:
    """Runs of `loop`'s body: XLA's known trip count, else the constant its `condition` compares a counter below."""
    known = loop.attr(_KNOWN)
    if known is not None:
        return int(known)
    statements = list(condition)
    constants = {i.name: _CONSTANT.search(i.line) for i in statements if i.opcode == "constant"}
    for i in statements:
        if i.opcode == "compare" and i.attr(r"direction=(LT)"):
            bounds = [constants[o] for o in i.operands if constants.get(o)]
            if bounds:
                return int(bounds[0][1])
    return None
