"""What XLA's SPMD partitioner says of its own choices while it compiles: its involuntary full rematerializations.

The partitioner reshards a value between two layouts with the collectives
that move each device's part where it goes. When it knows no such way from
one layout to the other, it says so on the process's stderr (C++, not
Python) and takes the last resort:

    Involuntary full rematerialization. The compiler cannot go from sharding
    {devices=[2,1,4]<=[8] last_tile_dim_replicate} to {devices=[1,4,2]...}
    efficiently for HLO operation %dot_general.1 = ... metadata={op_name=
    "jit(f)/bd,df->bf/dot_general" stack_frame_id=9}. As the last resort, SPMD
    will replicate the tensor and then partition it ...

Every device then gathers the value whole and keeps its part: the all-gather
moves the value's every byte to every device, where a reshard between the two
layouts moves at most a share of it. The line is the compiler's own account
of why such a collective is there. `read` takes it out of the compiler's log
(the rest of the log passes on to stderr untouched); `Remat` holds one, its
layouts as PartitionSpecs where the mesh's axes tile them
(`lab.hlo.specs`) and its op at the user's line.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from lab.hlo.sources import StackFrames, op_of, source_of
from lab.hlo.specs import partition_spec

_REMAT = re.compile(
    r"Involuntary full rematerialization\. The compiler cannot go from sharding (\{.*?\}) to (\{.*?\}) "
    r"efficiently for HLO operation (.*?)\. As the last resort"
)


@dataclass(frozen=True)
class Remat:
    """One value the partitioner replicated whole to reshard it: its op, its layouts before and after."""

    op_name: str  # the JAX op that made the value (jit(f)/bd,df->bf/dot_general)
    frame_id: int | None  # its traceback in the module's stack frame table
    source: str  # XLA's sharding text of the layout it had
    target: str  # and of the one it was wanted in

    def to_json(self, mesh: dict[str, int] | None, frames: StackFrames) -> dict:
        """Its op, line and layouts (PartitionSpecs over `mesh` where they are a tiling of its axes, else XLA's
        text), and the sentence the report prints."""
        source, target = ((partition_spec(s, mesh) if mesh else None) or s for s in (self.source, self.target))
        line = source_of({"stack_frame_id": self.frame_id}, frames) if self.frame_id is not None else None
        at = f" at {line.cited}" if line else ""
        why = (
            f"XLA's partitioner knows no efficient way to reshard the result of the "
            f"{op_of(self.op_name) or 'an op'}{at} from {source} to {target}: it gathers the value whole "
            "on every device, then keeps each device's part (an involuntary full rematerialization)"
        )
        return {"op": self.op_name, "line": str(line) if line else None, "from": source, "to": target, "why": why}


def read(log: Iterable[str]) -> tuple[tuple[Remat, ...], list[str]]:
    """The compiler's stderr lines -> (the rematerializations it reported, the lines that are not one)."""
    found, rest = [], []
    for text in log:
        match = _REMAT.search(text)
        if match is None:
            rest.append(text)
            continue
        op = re.search(r'op_name="([^"]*)"', match[3])
        frame = re.search(r"stack_frame_id=(\d+)", match[3])
        found.append(Remat(op[1] if op else "", int(frame[1]) if frame else None, match[1], match[2]))
    return tuple(found), rest
