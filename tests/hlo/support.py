"""What the HLO tests share: a module around instruction lines, the recorded fixtures, and lookups by kind and axes."""

from __future__ import annotations

from pathlib import Path

from lab.hlo import Collective, parse_collectives

DATA = Path(__file__).parents[1] / "data" / "hlo"
MESH222 = (2, 1, 2, 1, 2)  # data=2, fsdp=2, tensor=2
MESH224 = (2, 1, 2, 1, 4)  # data=2, fsdp=2, tensor=4 (v5e:4x4)
FSDP8 = (1, 1, 8, 1, 1)


def kinds_and_axes(collectives) -> set[tuple[str, tuple[str, ...] | None]]:
    return {(c.kind, c.axes) for c in collectives}


def by_kind_axes(collectives, kind: str, axes: tuple[str, ...]) -> Collective:
    (found,) = [c for c in collectives if c.kind == kind and c.axes == axes]
    return found


def module(*lines: str, devices: int = 8) -> str:
    """A minimal HLO module around instruction lines."""
    body = "\n".join(f"  {line}" for line in lines)
    return f"HloModule test, num_partitions={devices}\n\nENTRY %main (p: f32[8]) -> f32[8] {{\n{body}\n}}\n"


def fixture(name: str, mesh_shape):
    """The collectives of a recorded module in tests/data/hlo."""
    return parse_collectives((DATA / name).read_text(), mesh_shape)
