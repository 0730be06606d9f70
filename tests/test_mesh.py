"""MeshSpec parsing, resolution and building; replica groups back to axes."""

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lab.errors import LabError
from lab.mesh import AXES, MeshSpec, axes_of_groups, describe, device_groups

sizes = st.sampled_from([1, 2, 3, 4])
specs = st.builds(MeshSpec, data=sizes, stage=sizes, fsdp=sizes, expert=sizes, tensor=sizes)


@given(specs)
def test_spec_round_trips_through_its_text(spec):
    assert MeshSpec.parse(str(spec)) == spec


@given(specs)
def test_minus_one_takes_the_devices_the_others_leave(spec):
    for axis in AXES:
        partial = MeshSpec(**{**spec.sizes, axis: -1})
        assert partial.resolve(spec.size) == spec


def test_parse_text_and_mapping():
    assert MeshSpec.parse("data=2, fsdp=2,tensor=2") == MeshSpec(data=2, fsdp=2, tensor=2)
    assert MeshSpec.parse({"expert": 4}) == MeshSpec(expert=4)
    assert MeshSpec.parse("") == MeshSpec()


@pytest.mark.parametrize(
    "text, words",
    [
        ("dta=2", "unknown axis 'dta'"),
        ("data=2,data=4", "given twice"),
        ("data=two", "must be an integer"),
        ("data=0", "must be positive"),
        ("data=-1,fsdp=-1", "at most one axis"),
        ("data", "axis=size pairs"),
        ("data=-3", "must be positive"),
    ],
)
def test_bad_specs_say_what_is_wrong(text, words):
    with pytest.raises(LabError, match=words):
        MeshSpec.parse(text)


def test_sizes_must_use_every_device():
    with pytest.raises(LabError, match="uses 4 devices but the target has 8"):
        MeshSpec.parse("data=2,tensor=2").resolve(8)
    with pytest.raises(LabError, match="does not divide"):
        MeshSpec.parse("data=3,tensor=-1").resolve(8)


def test_build_carries_all_five_axes_tensor_innermost(devices):
    mesh = MeshSpec.parse("data=2,tensor=4").build(devices)
    assert mesh.axis_names == AXES
    assert mesh.devices.shape == (2, 1, 1, 1, 4)
    # neighbours in device order differ only in their tensor index
    assert [d.id for d in mesh.devices[0, 0, 0, 0, :]] == [0, 1, 2, 3]
    from jax.sharding import AxisType

    assert set(mesh.axis_types) == {AxisType.Explicit}


def test_build_on_a_subset_of_devices(devices):
    mesh = MeshSpec(tensor=4).build(devices[:4])
    assert mesh.devices.size == 4


@given(st.lists(st.sampled_from([1, 2, 3]), min_size=1, max_size=5), st.data())
def test_groups_map_back_to_their_axes(shape, data):
    names = [f"a{i}" for i in range(len(shape))]
    live = [i for i, s in enumerate(shape) if s > 1]
    chosen = sorted(data.draw(st.sets(st.sampled_from(live), min_size=1)) if live else [])
    groups = device_groups(shape, chosen)
    assert len(groups) == math.prod(shape) // math.prod(shape[i] for i in chosen)
    assert sorted(p for g in groups for p in g) == list(range(math.prod(shape)))
    found = axes_of_groups(shape, names, groups)
    assert found == tuple(names[i] for i in chosen)


def test_groups_of_a_sub_group_match_no_axes():
    # halves of a size-4 axis: no set of mesh axes forms them
    assert axes_of_groups((4,), ["x"], [[0, 1], [2, 3]]) is None


def test_groups_follow_shard_map_order(mesh222):
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    def body(x):
        return jax.lax.psum(x, ("data", "tensor"))

    x = jax.device_put(jnp.zeros(8), NamedSharding(mesh222, P(("data", "fsdp", "tensor"))))
    text = (
        jax.jit(
            jax.shard_map(
                body, mesh=mesh222, in_specs=P(("data", "fsdp", "tensor")), out_specs=P(("data", "fsdp", "tensor"))
            )
        )
        .lower(x)
        .compile()
        .as_text()
    )
    expected = device_groups(mesh222.devices.shape, [0, 4])
    rendered = "{" + ",".join("{" + ",".join(map(str, g)) + "}" for g in expected) + "}"
    assert rendered in text.replace(" ", "")


def test_describe_names_axes_and_groups(mesh222):
    text = describe(mesh222)
    assert "data=2" in text and "tensor size 2: groups {0,1} {2,3} {4,5} {6,7}" in text
    assert np.asarray(mesh222.devices).size == 8
