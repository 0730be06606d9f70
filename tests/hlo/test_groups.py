"""lab.hlo.groups: replica groups in XLA's three notations, read back to device groups and mesh axes."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lab.hlo import expand_replica_groups, parse_collectives
from lab.mesh import device_groups
from tests.hlo.support import DATA, MESH222, module


def all_reduce_line(replica_groups: str) -> str:
    return (
        f"%ar = f32[8]{{0}} all-reduce(%p), channel_id=1, replica_groups={replica_groups}, "
        "use_global_device_ids=true, to_apply=%add"
    )


# --------------------------------------------------------------------------- notations


def test_iota_groups_match_xla_reference():
    # xla/hlo/ir/replica_group_test.cc, IotaListToString2
    assert expand_replica_groups("[2,10]<=[4,5]T(1,0)") == (
        (0, 5, 10, 15, 1, 6, 11, 16, 2, 7),
        (12, 17, 3, 8, 13, 18, 4, 9, 14, 19),
    )
    assert expand_replica_groups("[2,4]<=[8]") == ((0, 1, 2, 3), (4, 5, 6, 7))


def test_explicit_and_empty_groups():
    assert expand_replica_groups("{{0,2},{1,3}}") == ((0, 2), (1, 3))
    assert expand_replica_groups("{}", num_devices=4) == ((0, 1, 2, 3),)
    with pytest.raises(ValueError, match="device count"):
        expand_replica_groups("{}")


def test_mesh_groups_with_sub_axes():
    # A sub-axis (pre)size is the piece of `size` after `pre` major elements of its axis.
    assert expand_replica_groups("mesh['x'=8] {'x':(1)2}") == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert expand_replica_groups("mesh['x'=8] {'x':(2)4}") == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert expand_replica_groups("mesh['x'=8] {'x':(2)2}") == ((0, 2), (1, 3), (4, 6), (5, 7))
    # two pieces of one axis: x = 4*b0 + 2*b1 + b2; groups vary b0 and b2, in the order the refs name them
    assert expand_replica_groups("mesh['x'=8] {'x':(1)2,'x':(4)2}") == ((0, 1, 4, 5), (2, 3, 6, 7))
    assert expand_replica_groups("mesh['x'=8] {'x':(4)2,'x':(1)2}") == ((0, 4, 1, 5), (2, 6, 3, 7))
    assert expand_replica_groups("mesh[u=2,v=3] {}") == tuple((i,) for i in range(6))


def test_mesh_groups_with_explicit_device_ids_old_notation():
    # xla/hlo/ir/replica_group_test.cc, MeshAxesToString: devices 8,3,7,... grouped over ooo:(5)2
    groups = expand_replica_groups("@mesh<ooo=10>(devices=[10]8,3,7,5,4,2,6,0,1,9) {ooo:(5)2}")
    assert groups == ((8, 3), (7, 5), (4, 2), (6, 0), (1, 9))


def test_mesh_groups_with_iota_device_ids_vary_exactly_the_named_pieces():
    # xla/hlo/ir/mesh_and_axis_test.cc: mesh[a=2,b=4,c=4,d=2], device_ids=([4,16]T(1,0))
    groups = expand_replica_groups("mesh[a=2,b=4,c=4,d=2], device_ids=([4,16]T(1,0)) {a,b:(1)2,d}")
    devices = np.arange(64).reshape(4, 16).T.reshape(2, 4, 4, 2)
    assert sorted(i for g in groups for i in g) == list(range(64)) and {len(g) for g in groups} == {8}
    for group in groups:
        coords = np.array([np.argwhere(devices == i)[0] for i in group])  # (a, b, c, d) of each member
        b_major, b_minor = coords[:, 1] // 2, coords[:, 1] % 2
        assert len(set(coords[:, 2])) == 1 and len(set(b_minor)) == 1  # c and the minor half of b fixed
        assert len(set(zip(coords[:, 0], b_major, coords[:, 3]))) == 8  # a, major half of b, d all vary


# --------------------------------------------------------------------------- notations -> mesh axes


@st.composite
def meshes_and_axes(draw):
    rank = draw(st.integers(1, 5))
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=rank, max_size=rank)))
    axes = draw(st.lists(st.integers(0, rank - 1), min_size=1, max_size=rank, unique=True))
    return shape, axes


def _iota_notation(shape, axes) -> str:
    perm = [i for i in range(len(shape)) if i not in axes] + list(axes)
    size = math.prod(shape[i] for i in axes)
    return f"[{math.prod(shape) // size},{size}]<=[{','.join(map(str, shape))}]T({','.join(map(str, perm))})"


def _mesh_notation(shape, names, axes) -> str:
    sizes = ",".join(f"'{n}'={s}" for n, s in zip(names, shape))
    return f"mesh[{sizes}] {{{','.join(repr(names[i]) for i in axes)}}}"


@settings(max_examples=60, deadline=None)
@given(meshes_and_axes(), st.sampled_from(["explicit", "iota", "mesh"]))
def test_every_notation_parses_back_to_the_same_groups_and_axes(mesh_and_axes, notation):
    shape, axes = mesh_and_axes
    names = tuple(f"ax{i}" for i in range(len(shape)))
    groups = tuple(device_groups(shape, axes))
    text = {
        "explicit": "{" + ",".join("{" + ",".join(map(str, g)) + "}" for g in groups) + "}",
        "iota": _iota_notation(shape, axes),
        "mesh": _mesh_notation(shape, names, axes),
    }[notation]
    (collective,), skipped = parse_collectives(module(all_reduce_line(text), devices=math.prod(shape)), shape, names)
    assert skipped == ()
    assert collective.replica_groups == groups
    assert collective.axes == tuple(names[i] for i in sorted(axes) if shape[i] > 1)


def test_cpu_fixture_mesh_groups_with_device_ids():
    text = (DATA / "cpu_transposed_sum.hlo").read_text()
    assert "device_ids=(" in text  # the compiler mesh is not a plain iota
    (collective,), _ = parse_collectives(text, MESH222)
    assert (collective.kind, collective.axes) == ("all-reduce", ("tensor",))
