"""The experiments' shared kit: the compile-only TPU companion, one compile read by lab.hlo, typed sub-results."""

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from experiments import kit
from lab.mesh import MeshSpec


def test_no_topology_asked_for_is_none():
    assert kit.tpu_chips("") is None


def test_a_topology_libtpu_cannot_build_is_skipped_with_one_row():
    skipped = kit.tpu_chips("v5e:3x3x3x3")
    assert isinstance(skipped, kit.Unavailable) and skipped.what.startswith("tpu:v5e:3x3x3x3")
    table = skipped.table()
    assert table.columns == ["skipped"] and table.rows == [[skipped.reason]] and skipped.reason


def test_tpu_chips_carry_their_chip_torus_and_a_one_axis_mesh():
    tpu = kit.tpu_chips("v5e:2x2")
    assert isinstance(tpu, kit.TpuChips)
    assert (len(tpu), tpu.target, tpu.dims, tpu.chip.name) == (4, "tpu:v5e:2x2", (2, 2), "v5e")
    mesh = tpu.mesh("fsdp")
    assert mesh.shape["fsdp"] == 4 and mesh.devices.size == 4


def test_compile_and_inspect_runs_the_executable_it_read(devices):
    mesh = MeshSpec(fsdp=len(devices)).build(devices)
    sharding = NamedSharding(mesh, P("fsdp"))
    x = jax.device_put(np.arange(8 * 4, dtype=np.float32).reshape(8, 4), sharding)
    compiled, inspection = kit.compile_and_inspect(jax.jit(lambda a: a.sum(0)), x, mesh=mesh)
    assert np.allclose(np.asarray(compiled(x)), np.arange(32).reshape(8, 4).sum(0))
    assert [(c.kind, c.axes) for c in inspection.collectives] == [("all-reduce", ("fsdp",))]


def test_seen_keeps_what_a_judge_reads_of_a_collective(devices):
    mesh = MeshSpec(fsdp=len(devices)).build(devices)
    x = jax.device_put(np.ones((8, 4), np.float32), NamedSharding(mesh, P("fsdp")))
    _, inspection = kit.compile_and_inspect(jax.jit(lambda a: a.sum(0)), x, mesh=mesh)
    (seen,) = kit.seen(inspection.collectives)
    assert (seen.kind, seen.axes, seen.dtypes, seen.size_bytes, seen.group_size) == (
        "all-reduce",
        ("fsdp",),
        ("f32",),
        16,
        8,
    )
