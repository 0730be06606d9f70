"""Sizes in bytes, written and read the way nccl-tests and XLA do.

``-b 1K -e 64M -f 2`` means from 1 KiB to 64 MiB, each size twice the
previous: K, M and G are powers of 1024, and sizes print in binary units
(1.5 MiB), as XLA's memory reports do.
"""

from __future__ import annotations

import re

import humanize

from lab.errors import LabError

_UNITS = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30}


def parse_size(text: str | int) -> int:
    """``"64M"`` -> 67108864 bytes (K, M, G are powers of 1024, as in nccl-tests)."""
    if isinstance(text, int):
        value = text
    else:
        match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(?:i?B)?\s*", str(text), flags=re.IGNORECASE)
        if not match:
            raise LabError(f"size {text!r}: write bytes as a number with an optional K, M or G suffix, e.g. 1K or 64M")
        value = int(match[1]) * _UNITS[match[2].upper()]
    if value <= 0:
        raise LabError(f"size {text!r}: sizes must be positive")
    return value


def size_sweep(begin: str | int, end: str | int, factor: int = 2) -> list[int]:
    """Sizes from `begin` to `end` (inclusive), each `factor` times the previous."""
    low, high = parse_size(begin), parse_size(end)
    if factor < 2:
        raise LabError(f"sweep factor {factor}: must be an integer >= 2 (as in nccl-tests -f 2)")
    if low > high:
        raise LabError(f"sweep from {begin} to {end}: the first size must not exceed the last")
    sizes = [low]
    while sizes[-1] * factor <= high:
        sizes.append(sizes[-1] * factor)
    return sizes


def format_bytes(n: float) -> str:
    """Binary units, the way nccl-tests and XLA print sizes: 1.5 MiB."""
    return humanize.naturalsize(n, binary=True, format="%.3g")


def format_seconds(seconds: float) -> str:
    """A duration at the scale that keeps its digits: 6.729 s, 41.20 ms, 22.6 us (and 0)."""
    if seconds == 0:
        return "0"
    if abs(seconds) >= 1:
        return f"{seconds:.3f} s"
    return f"{seconds * 1e3:.2f} ms" if abs(seconds) >= 1e-3 else f"{seconds * 1e6:.1f} us"
