"""An HLO sharding read back as the PartitionSpec that JAX lowered it from, on the lab's five-axis meshes."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from lab.hlo.specs import partition_spec
from lab.mesh import MeshSpec

CASES = [
    ("data=2,fsdp=4", P("data", "fsdp", None)),
    ("data=2,fsdp=4", P("fsdp", None, "data")),
    ("data=2,tensor=4", P("tensor", None, None)),  # data replicates: the grid's last dimension
    ("data=2,tensor=4", P(None, ("data", "tensor"), None)),
    ("data=2,tensor=4", P(None, ("tensor", "data"), None)),  # minor axis first: a transposed iota
    ("data=2,fsdp=2,tensor=2", P("tensor", "data", "fsdp")),
    ("data=2,fsdp=2,tensor=2", P(None, "fsdp", None)),
    ("fsdp=8", P(None, None, "fsdp")),
]


@pytest.mark.parametrize(("mesh_spec", "spec"), CASES, ids=[f"{m}:{s}" for m, s in CASES])
def test_a_lowered_sharding_reads_back_as_its_partition_spec(devices, mesh_spec, spec):
    mesh = MeshSpec.parse(mesh_spec).build(devices, explicit=False)
    x = jax.ShapeDtypeStruct((8, 16, 32), jnp.float32, sharding=NamedSharding(mesh, spec))
    text = jax.jit(lambda a: a * 2).lower(x).compile().as_text()
    sharding = next(line for line in text.splitlines() if " parameter(0)" in line and "sharding=" in line)
    sizes = dict(zip(mesh.axis_names, mesh.devices.shape))
    written = sharding.split("sharding=", 1)[1]
    assert partition_spec(written, sizes) == str(P(*spec, *[None] * (3 - len(spec)))).replace("PartitionSpec", "P")


def test_what_is_no_tiling_of_the_mesh_has_no_spec():
    mesh = {"data": 2, "tensor": 4}
    assert partition_spec("{replicated}", mesh) is None
    assert partition_spec("{maximal device=0}", mesh) is None
    # tensor cut in two halves of two: a device order the mesh's axes do not have
    assert partition_spec("{devices=[2,1,4]<=[4,2]T(1,0) last_tile_dim_replicate}", mesh) is None
    assert partition_spec("{devices=[2,4]0,2,1,3,4,6,5,7}", mesh) is None
    # devices the mesh does not have: a module of 16 devices, or one that runs on some of them
    assert partition_spec("{devices=[4,4]<=[16]}", mesh) is None
    assert partition_spec("{devices=[2,4]8,9,10,11,12,13,14,15}", mesh) is None
    assert partition_spec("{devices=[2,4]0,1,2,3,4,5,6,7}", mesh) == "P('data', 'tensor')"
