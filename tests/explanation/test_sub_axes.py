"""A collective's groups named as part of one mesh axis, as Shardy names a sub-axis."""

import itertools

import numpy as np
import pytest

from lab.explanation.sub_axes import sub_axis
from lab.mesh import AXES, device_groups

SHAPE = (2, 1, 1, 1, 4)  # data=2, tensor=4: device = 4 * data + tensor


@pytest.mark.parametrize(
    ("groups", "named"),
    [
        ([[0, 2], [1, 3], [4, 6], [5, 7]], "tensor:(1)2"),  # tensor's major half: devices 2 apart
        ([[0, 1], [2, 3], [4, 5], [6, 7]], "tensor:(2)2"),  # its minor half: neighbours
        ([[0, 4], [1, 5], [2, 6], [3, 7]], None),  # the whole of data: no part of an axis
        ([[0, 1, 2, 3], [4, 5, 6, 7]], None),  # the whole of tensor
        ([[0, 5], [1, 4], [2, 7], [3, 6]], None),  # no sub-axis pairs these
    ],
)
def test_groups_within_one_axis_are_named_by_their_stride(groups, named):
    assert sub_axis(SHAPE, AXES, groups) == named


@pytest.mark.parametrize(
    ("size", "before", "part"), [(8, 1, 2), (8, 2, 2), (8, 4, 2), (8, 1, 4), (8, 2, 4), (16, 2, 4)]
)
def test_every_sub_axis_is_found_from_the_groups_it_makes(size, before, part):
    """Numbered row-major as (before, part, after), the sub-axis is the middle factor: its groups vary only it."""
    shape = (2, 1, size, 1, 1)  # data=2, fsdp=size
    after = size // (before * part)
    positions = np.arange(2 * size).reshape(2, before, part, after)
    groups = [list(map(int, g)) for g in np.moveaxis(positions, 2, -1).reshape(-1, part)]
    found = sub_axis(shape, AXES, groups)
    # the name is one of those that make these groups (a sub-axis of size `part` spans the same devices whichever
    # equal name it has; e.g. (1)2 of 4 and (1)2 of 8 with after 1 are the same when before x part = size)
    assert found is not None and found.startswith("fsdp:(")
    named_before, named_part = map(int, found[len("fsdp:(") :].split(")"))
    assert named_part == part
    again = np.moveaxis(np.arange(2 * size).reshape(2, named_before, part, -1), 2, -1).reshape(-1, part)
    assert {frozenset(map(int, g)) for g in again} == {frozenset(g) for g in groups}


def test_whole_axes_are_never_named_as_parts():
    shape = (2, 1, 4, 1, 2)
    live = [0, 2, 4]
    for r in range(1, len(live) + 1):
        for axes in itertools.combinations(live, r):
            assert sub_axis(shape, AXES, device_groups(shape, axes)) is None
