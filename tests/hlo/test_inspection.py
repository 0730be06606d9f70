"""lab.hlo.inspection: programs compiled live (CPU, and the TPU compiler compile-only) and read back.

The programs below also wrote the fixtures in tests/data/hlo; regenerate them
with ``JAX_PLATFORMS=cpu python tests/hlo/test_inspection.py``. The recorded
primitives are checked here against the same expectations as the live ones.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from lab.errors import LabError
from lab.hlo import format_cost, format_memory, inspect, summary_table
from lab.mesh import AXES, MeshSpec
from tests.hlo.support import DATA, MESH222, MESH224, by_kind_axes, fixture, kinds_and_axes

# Other processes on this machine may hold libtpu's lockfile; compile-only use is safe to share.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


# What each primitive in `primitives_program` must compile to: (kind, axes).
PRIMITIVES = {
    ("all-reduce", ("tensor",)),
    ("all-gather", ("data", "fsdp")),
    ("reduce-scatter", ("fsdp",)),
    ("all-to-all", ("data",)),
    ("collective-permute", ("tensor",)),
    ("all-reduce", ("data", "tensor")),
}

TPU_ROWS = 64  # below ~16 KiB per device the TPU compiler writes psum_scatter as all-reduce + dynamic-slice


# --------------------------------------------------------------------------- programs


def primitives_program(mesh, rows: int = 8):
    """psum, all_gather, psum_scatter, all_to_all, ppermute and a psum over two axes, in one shard_map.

    Each device holds an f32[rows, 128] block.
    """
    spec = P(("data", "fsdp"), "tensor")
    tensor = mesh.shape["tensor"]
    ring = [(i, (i + 1) % tensor) for i in range(tensor)]

    def body(x_local):
        assert x_local.shape == (rows, 128)
        return (
            jax.lax.psum(x_local, "tensor"),
            jax.lax.all_gather(x_local, ("data", "fsdp"), tiled=True),
            jax.lax.psum_scatter(x_local, "fsdp", scatter_dimension=0, tiled=True),
            jax.lax.all_to_all(x_local, "data", 0, 0, tiled=True),
            jax.lax.ppermute(x_local, "tensor", ring),
            jax.lax.psum(x_local, ("data", "tensor")),
        )

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=(spec,) * 6))
    x = jax.ShapeDtypeStruct((rows * 4, 128 * tensor), jnp.float32, sharding=NamedSharding(mesh, spec))
    return fn, (x,)


def fsdp_tp_step(mesh):
    """One SGD step of a two-layer MLP, weights sharded over fsdp x tensor, batch over data x fsdp (GSPMD)."""

    def sharding(*spec):
        return NamedSharding(mesh, P(*spec))

    batch, d_model, d_ff = 256, 1024, 2048  # large enough that the TPU compiler keeps reduce-scatters

    def loss(params, x_BD):
        w_DF, w_FD = params
        h_BF = jnp.tanh(jnp.einsum("bd,df->bf", x_BD, w_DF, out_sharding=sharding(("data", "fsdp"), "tensor")))
        y_BD = jnp.einsum("bf,fd->bd", h_BF, w_FD, out_sharding=sharding(("data", "fsdp"), None))
        return jnp.mean(y_BD.astype(jnp.float32) ** 2)

    def step(params, x_BD):
        grads = jax.grad(loss)(params, x_BD)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    params = (
        jax.ShapeDtypeStruct((d_model, d_ff), jnp.bfloat16, sharding=sharding("fsdp", "tensor")),
        jax.ShapeDtypeStruct((d_ff, d_model), jnp.bfloat16, sharding=sharding("tensor", "fsdp")),
    )
    x = jax.ShapeDtypeStruct((batch, d_model), jnp.bfloat16, sharding=sharding(("data", "fsdp"), None))
    return jax.jit(step), (params, x)


def overlap_program(mesh):
    """An all-gather the TPU compiler can overlap with an independent matmul (async collective fusion)."""

    def sharding(*spec):
        return NamedSharding(mesh, P(*spec))

    def body(w_local, x_local):
        w_full = jax.lax.all_gather(w_local, "fsdp", tiled=True, axis=0)
        independent = jnp.tanh(x_local @ x_local.T) @ x_local
        return jax.lax.psum(x_local @ w_full, ("data", "tensor")), independent

    fn = jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(P("fsdp", None), P(("data", "fsdp"), "tensor")),
            out_specs=(P(("data", "fsdp")), P(("data", "fsdp"), "tensor")),
        )
    )
    w = jax.ShapeDtypeStruct((128, 1024), jnp.bfloat16, sharding=sharding("fsdp", None))
    x = jax.ShapeDtypeStruct((1024, 512), jnp.bfloat16, sharding=sharding(("data", "fsdp"), "tensor"))
    return fn, (w, x)


def scan_fsdp_program(mesh):
    """FSDP over a scanned stack of layers: collectives inside while loops."""

    def sharding(*spec):
        return NamedSharding(mesh, P(*spec))

    def loss(w_LDD, x_BD):
        def layer(x, w):
            return jnp.tanh(jnp.einsum("bd,de->be", x, w, out_sharding=sharding("fsdp", None))), None

        return jnp.mean(jax.lax.scan(layer, x_BD, w_LDD)[0] ** 2)

    fn = jax.jit(lambda w, x: w - 0.1 * jax.grad(loss)(w, x))
    w = jax.ShapeDtypeStruct((4, 128, 128), jnp.float32, sharding=sharding(None, "fsdp", None))
    x = jax.ShapeDtypeStruct((64, 128), jnp.float32, sharding=sharding("fsdp", None))
    return fn, (w, x)


def small_psum_scatter_program(mesh):
    """A 4 KiB psum_scatter: the TPU compiler writes it as an all-reduce and a dynamic-slice."""
    spec = P(("data", "fsdp"), "tensor")

    def body(x_local):
        return jax.lax.psum_scatter(x_local, "fsdp", scatter_dimension=0, tiled=True)

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
    return fn, (
        jax.ShapeDtypeStruct((8 * 4, 128 * mesh.shape["tensor"]), jnp.float32, sharding=NamedSharding(mesh, spec)),
    )


def transposed_sum_program(mesh):
    """A sum over the tensor-sharded dim of P('tensor', 'data'): GSPMD prints mesh groups with device_ids."""
    x = jax.ShapeDtypeStruct((64, 64), jnp.float32, sharding=NamedSharding(mesh, P("tensor", "data")))
    return jax.jit(lambda x: jnp.sum(x, axis=0)), (x,)


# --------------------------------------------------------------------------- CPU compiler: recorded and live


def _assert_primitives(collectives, rows: int = 8):
    local_bytes = rows * 128 * 4
    assert kinds_and_axes(collectives) == PRIMITIVES and len(collectives) == len(PRIMITIVES)
    gather = by_kind_axes(collectives, "all-gather", ("data", "fsdp"))
    assert (gather.group_size, gather.operand_bytes, gather.size_bytes) == (4, local_bytes, 4 * local_bytes)
    scatter = by_kind_axes(collectives, "reduce-scatter", ("fsdp",))
    assert (scatter.size_bytes, scatter.result_bytes) == (local_bytes, local_bytes // 2)
    assert by_kind_axes(collectives, "all-reduce", ("data", "tensor")).size_bytes == local_bytes
    assert by_kind_axes(collectives, "all-to-all", ("data",)).size_bytes == local_bytes
    assert {c.op_name.rsplit("/", 1)[-1] for c in collectives} >= {
        "all_gather",
        "reduce_scatter",
        "all_to_all",
        "ppermute",
    }


def test_cpu_fixture_primitives():
    collectives, skipped = fixture("cpu_shard_map_primitives.hlo", MESH222)
    assert skipped == ()
    _assert_primitives(collectives)
    # The CPU compiler writes all_to_all as a tuple of per-peer chunks: one array, not a combined collective.
    all_to_all = by_kind_axes(collectives, "all-to-all", ("data",))
    assert len(all_to_all.result_shapes) == 2 and not all_to_all.combined


def test_live_cpu_inspection(mesh222, tmp_path):
    fn, args = primitives_program(mesh222)
    inspection = inspect(fn, *args)
    _assert_primitives(inspection.collectives)
    assert inspection.skipped == ()
    assert inspection.memory["argument_size"] == 8 * 128 * 4  # per device
    assert inspection.memory["output_size"] > 0 and "flops" in inspection.cost
    before, after = inspection.dump(tmp_path)
    assert (before.name, after.name) == ("jit_body.before_optimizations.hlo", "jit_body.after_optimizations.hlo")
    assert "all-gather" in before.read_text() and "is_scheduled=true" in after.read_text()
    assert {t.kind for t in inspection.summary()} == {k for k, _ in PRIMITIVES}


def test_live_cpu_plain_function_on_concrete_arrays(mesh222):
    x = jax.device_put(np.ones((16, 16), np.float32), NamedSharding(mesh222, P("data", "tensor")))
    inspection = inspect(lambda x: jnp.sum(x), x)  # jitted for us; the mesh comes from x's sharding
    # GSPMD reduces one sharded dimension at a time: two all-reduces, not one over (data, tensor)
    assert sorted(kinds_and_axes(inspection.collectives)) == [("all-reduce", ("data",)), ("all-reduce", ("tensor",))]
    assert inspection.mesh_shape == MESH222


def test_inspect_refuses_what_is_not_a_function():
    with pytest.raises(LabError, match="needs a function"):
        inspect("not a function")


# --------------------------------------------------------------------------- TPU compiler (compile-only)


def test_tpu_fixture_primitives_v5e():
    collectives, skipped = fixture("tpu_v5e_4x4_shard_map_primitives.hlo", MESH224)
    assert skipped == ()
    _assert_primitives(collectives, rows=TPU_ROWS)
    permute = by_kind_axes(collectives, "collective-permute", ("tensor",))
    assert permute.is_async and permute.form == "collective-permute-start/collective-permute-done"
    assert permute.result_shapes == ((TPU_ROWS, 128),)  # the -done's shape, not the -start's scratch tuple
    gather = by_kind_axes(collectives, "all-gather", ("data", "fsdp"))
    assert not gather.is_async and "was all-gather-start" in gather.form  # the scheduler made it synchronous


@pytest.fixture(scope="module")
def v5e():
    from lab.targets.devices import topology_devices

    return topology_devices("v5e:4x4")


def test_live_tpu_primitives_v5e_and_v5p(v5e):
    from lab.targets.devices import topology_devices

    for devices in (v5e, topology_devices("v5p:2x2x2")):
        mesh = MeshSpec.parse("data=2,fsdp=2,tensor=-1").build(devices)
        fn, args = primitives_program(mesh, rows=TPU_ROWS)
        inspection = inspect(fn, *args)
        assert inspection.skipped == ()
        _assert_primitives(inspection.collectives, rows=TPU_ROWS)
        assert inspection.memory["argument_size"] == TPU_ROWS * 128 * 4 and inspection.cost["flops"] >= 0


def test_live_tpu_fsdp_tp_step_v5p():
    from lab.targets.devices import topology_devices

    mesh = MeshSpec.parse("data=2,fsdp=2,tensor=2").build(topology_devices("v5p:2x2x2"))
    fn, args = fsdp_tp_step(mesh)
    found = kinds_and_axes(inspect(fn, *args).collectives)
    assert found >= {("all-gather", ("fsdp",)), ("reduce-scatter", ("fsdp",)), ("all-reduce", ("data",))}


def test_replica_group_ids_are_mesh_positions_not_device_ids(v5e):
    order = np.random.default_rng(0).permutation(len(v5e))
    mesh = Mesh(
        np.asarray(v5e, dtype=object)[order].reshape(MESH224), AXES, axis_types=(AxisType.Explicit,) * len(AXES)
    )
    assert [d.id for d in mesh.devices.flat] != list(range(len(v5e)))
    spec = P(("data", "fsdp"), "tensor")
    fn = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "tensor"), mesh=mesh, in_specs=spec, out_specs=spec))
    (collective,) = inspect(
        fn, jax.ShapeDtypeStruct((32, 512), jnp.float32, sharding=NamedSharding(mesh, spec))
    ).collectives
    assert collective.replica_groups == ((0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11), (12, 13, 14, 15))
    assert collective.axes == ("tensor",)


# --------------------------------------------------------------------------- fixture writer


def write_fixtures() -> None:
    from lab.targets.devices import devices_for, topology_devices

    root = str(Path(__file__).resolve().parents[2]) + "/"
    cases = {
        "cpu_shard_map_primitives.hlo": (primitives_program, devices_for("cpu:8"), "data=2,fsdp=2,tensor=2"),
        "cpu_scan_fsdp.hlo": (scan_fsdp_program, devices_for("cpu:8"), "fsdp=8"),
        "cpu_transposed_sum.hlo": (transposed_sum_program, devices_for("cpu:8"), "data=2,fsdp=2,tensor=2"),
        "tpu_v5e_4x4_shard_map_primitives.hlo": (
            functools.partial(primitives_program, rows=TPU_ROWS),
            topology_devices("v5e:4x4"),
            "data=2,fsdp=2,tensor=4",
        ),
        "tpu_v5e_4x4_small_psum_scatter.hlo": (
            small_psum_scatter_program,
            topology_devices("v5e:4x4"),
            "data=2,fsdp=2,tensor=4",
        ),
        "tpu_v5e_4x4_async_collective_fusion.hlo": (
            overlap_program,
            topology_devices("v5e:4x4"),
            "data=2,fsdp=2,tensor=4",
        ),
        "tpu_v5p_2x2x2_fsdp_tp_step.hlo": (fsdp_tp_step, topology_devices("v5p:2x2x2"), "data=2,fsdp=2,tensor=2"),
    }
    DATA.mkdir(parents=True, exist_ok=True)
    for name, (program, devices, spec) in cases.items():
        fn, args = program(MeshSpec.parse(spec).build(devices))
        (DATA / name).write_text(inspect(fn, *args).optimized_hlo.replace(root, ""))
        print("wrote", DATA / name)


if __name__ == "__main__":
    write_fixtures()


def test_console_views_of_an_inspection(mesh222):
    fn, args = primitives_program(mesh222)
    inspection = inspect(fn, *args)
    assert "argument size 4 KiB" in format_memory(inspection.memory) and "FLOP" in format_cost(inspection.cost)
    assert format_memory({}) == "no memory figures" and format_cost({}) == "no cost figures"
    assert format_cost({"optimal_seconds": 0.002}) == "optimal 2.00 ms"
    assert format_cost({"optimal_seconds": -2.99}) == "optimal unknown (the compiler gave -2.99 s)"
    table = summary_table(inspection.summary())
    assert table.row_count == len(inspection.summary()) and table.columns[0].header == "kind"
