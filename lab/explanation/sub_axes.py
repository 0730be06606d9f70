"""A collective over part of a mesh axis, named as Shardy names it: ``tensor:(1)2``.

XLA's partitioner may split a dimension over part of an axis: 2 key/value heads over tensor=4 (grouped-query
attention) go to halves of it, and the collectives of those values run within groups that no set of whole mesh
axes forms (`lab.mesh.axes_of_groups` finds none). Shardy writes such a sub-axis ``"tensor":(m)k``: the axis's
devices numbered row-major as (m, k, n/(m·k)), the middle factor, of size k. So on tensor=4, ``tensor:(1)2``
pairs devices 2 apart ({0, 2}, {1, 3}: the major half) and ``tensor:(2)2`` neighbours ({0, 1}, {2, 3}: the minor
half). The same name in a collective's axes and in Shardy's record (`lab.explanation.origins`) lets the causes
match one to the other.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def sub_axis(shape: Sequence[int], names: Sequence[str], groups: Sequence[Sequence[int]]) -> str | None:
    """The sub-axis of one mesh axis whose devices form `groups` (mesh positions), as Shardy names it; None when no
    single sub-axis does."""
    shape = tuple(shape)
    target = {frozenset(int(p) for p in group) for group in groups}
    positions = np.arange(math.prod(shape)).reshape(shape)
    for index, (name, size) in enumerate(zip(names, shape)):
        for part in range(2, size):
            if size % part:
                continue
            for before in (m for m in range(1, size // part + 1) if (size // part) % m == 0):
                after = size // (before * part)
                split = positions.reshape((*shape[:index], before, part, after, *shape[index + 1 :]))
                found = np.moveaxis(split, index + 1, -1).reshape(-1, part)
                if {frozenset(int(p) for p in group) for group in found} == target:
                    return f"{name}:({before}){part}"
    return None
