"""Tests for lab.hlo: replica-group notations, real CPU/TPU HLO, live compilation.

Fixtures in tests/data/hlo/ are optimized HLO written by the programs below;
regenerate them with ``JAX_PLATFORMS=cpu python tests/test_hlo.py``.
"""

from __future__ import annotations

import functools
import math
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from lab.errors import LabError
from lab.hlo import Collective, expand_replica_groups, inspect, op_names, parse_collectives, summarize
from lab.mesh import AXES, MeshSpec, device_groups

# Other processes on this machine may hold libtpu's lockfile; compile-only use is safe to share.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

DATA = Path(__file__).parent / "data" / "hlo"
MESH222 = (2, 1, 2, 1, 2)  # data=2, fsdp=2, tensor=2
MESH224 = (2, 1, 2, 1, 4)  # data=2, fsdp=2, tensor=4 (v5e:4x4)
FSDP8 = (1, 1, 8, 1, 1)

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
    sharding = lambda *spec: NamedSharding(mesh, P(*spec))
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
    sharding = lambda *spec: NamedSharding(mesh, P(*spec))

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
    sharding = lambda *spec: NamedSharding(mesh, P(*spec))

    def loss(w_LDD, x_BD):
        layer = lambda x, w: (jnp.tanh(jnp.einsum("bd,de->be", x, w, out_sharding=sharding("fsdp", None))), None)
        return jnp.mean(jax.lax.scan(layer, x_BD, w_LDD)[0] ** 2)

    fn = jax.jit(lambda w, x: w - 0.1 * jax.grad(loss)(w, x))
    w = jax.ShapeDtypeStruct((4, 128, 128), jnp.float32, sharding=sharding(None, "fsdp", None))
    x = jax.ShapeDtypeStruct((64, 128), jnp.float32, sharding=sharding("fsdp", None))
    return fn, (w, x)


def small_psum_scatter_program(mesh):
    """A 4 KiB psum_scatter: the TPU compiler writes it as an all-reduce and a dynamic-slice."""
    spec = P(("data", "fsdp"), "tensor")
    body = lambda x_local: jax.lax.psum_scatter(x_local, "fsdp", scatter_dimension=0, tiled=True)
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
    return fn, (
        jax.ShapeDtypeStruct((8 * 4, 128 * mesh.shape["tensor"]), jnp.float32, sharding=NamedSharding(mesh, spec)),
    )


def transposed_sum_program(mesh):
    """A sum over the tensor-sharded dim of P('tensor', 'data'): GSPMD prints mesh groups with device_ids."""
    x = jax.ShapeDtypeStruct((64, 64), jnp.float32, sharding=NamedSharding(mesh, P("tensor", "data")))
    return jax.jit(lambda x: jnp.sum(x, axis=0)), (x,)


def kinds_and_axes(collectives) -> set[tuple[str, tuple[str, ...] | None]]:
    return {(c.kind, c.axes) for c in collectives}


def by_kind_axes(collectives, kind: str, axes: tuple[str, ...]) -> Collective:
    (found,) = [c for c in collectives if c.kind == kind and c.axes == axes]
    return found


def module(*lines: str, devices: int = 8) -> str:
    """A minimal HLO module around instruction lines."""
    body = "\n".join(f"  {line}" for line in lines)
    return f"HloModule test, num_partitions={devices}\n\nENTRY %main (p: f32[8]) -> f32[8] {{\n{body}\n}}\n"


def all_reduce_line(replica_groups: str) -> str:
    return f"%ar = f32[8]{{0}} all-reduce(%p), channel_id=1, replica_groups={replica_groups}, use_global_device_ids=true, to_apply=%add"


def fixture(name: str, mesh_shape):
    return parse_collectives((DATA / name).read_text(), mesh_shape)


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


# --------------------------------------------------------------------------- forms (written by hand, after XLA's own tests)

ASYNC_FORMS = """HloModule async_forms, num_partitions=4

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}

%wrapped_reduce_scatter (p: f32[16]) -> f32[4] {
  %p = f32[16]{0} parameter(0)
  ROOT %rs = f32[4]{0} reduce-scatter(%p), channel_id=3, replica_groups={{0,1,2,3}}, use_global_device_ids=true, dimensions={0}, to_apply=%add
}

ENTRY %main (a: f32[16], b: bf16[8,4]) -> f32[4] {
  %a = f32[16]{0} parameter(0)
  %b = bf16[8,4]{1,0} parameter(1)
  %ag-start = (bf16[8,4]{1,0}, bf16[16,4]{1,0}) all-gather-start(%b), channel_id=1, replica_groups=[2,2]<=[4], dimensions={0}, use_global_device_ids=true
  %ars = (f32[16]{0}, bf16[8,4]{1,0}) all-reduce-start(%a, %b), channel_id=2, replica_groups={}, use_global_device_ids=true, to_apply=%add
  %rs-start = ((f32[16]{0}), f32[8]{0}) reduce-scatter-start(%a), channel_id=4, replica_groups=[2,2]<=[2,2]T(1,0), dimensions={0}, use_global_device_ids=true, to_apply=%add
  %rs-update = ((f32[16]{0}), f32[8]{0}) reduce-scatter-update(%rs-start)
  %wrapped-start = ((f32[16]{0}), f32[4]{0}, u32[]) async-start(%a), calls=%wrapped_reduce_scatter
  %wrapped-done = f32[4]{0} async-done(%wrapped-start)
  %rs-done = f32[8]{0} reduce-scatter-done(%rs-update)
  %ard = (f32[16]{0}, bf16[8,4]{1,0}) all-reduce-done(%ars)
  ROOT %ag-done = bf16[16,4]{1,0} all-gather-done(%ag-start)
}
"""


def test_async_pairs_are_counted_once_with_done_shapes():
    collectives, skipped = parse_collectives(ASYNC_FORMS, (2, 2), ("x", "y"))
    assert skipped == ()
    assert sorted(c.name for c in collectives) == ["ag-start", "ars", "rs", "rs-start"]
    assert all(c.is_async for c in collectives)
    gather = next(c for c in collectives if c.kind == "all-gather")
    assert (gather.form, gather.axes, gather.operand_shapes, gather.result_shapes) == (
        "all-gather-start/all-gather-done",
        ("y",),
        ((8, 4),),
        ((16, 4),),
    )
    assert gather.size_bytes == gather.result_bytes == 16 * 4 * 2
    scatter = next(c for c in collectives if c.name == "rs-start")
    assert (scatter.axes, scatter.operand_shapes, scatter.size_bytes) == (("x",), ((16,),), 16 * 4)


def test_combined_all_reduce_and_async_start_wrapper():
    collectives, _ = parse_collectives(ASYNC_FORMS, (2, 2), ("x", "y"))
    combined = next(c for c in collectives if c.kind == "all-reduce")
    assert combined.combined and combined.dtypes == ("f32", "bf16")
    assert (combined.group_size, combined.axes, combined.operand_bytes) == (4, ("x", "y"), 16 * 4 + 8 * 4 * 2)
    wrapped = next(c for c in collectives if c.name == "rs")
    assert wrapped.is_async and wrapped.form.startswith("async-start %wrapped-start")
    assert wrapped.computation == "wrapped_reduce_scatter"


def test_unreadable_lines_are_reported_not_raised():
    text = module(
        "%ok = f32[8]{0} all-reduce(%p), replica_groups={{0,1},{2,3}}, to_apply=%add",
        "%weird = f32[8]{0} all-reduce(%p), replica_groups=<<unknown>>, to_apply=%add",
        "%ag = f32[8]{0} all-gather(%p), replica_groups={{0,1}}",
        "%orphan = f32[8]{0} all-gather-done(%nothing)",
        "%lost = (f32[4]{0}, f32[8]{0}) all-gather-start(%p), replica_groups={{0,1}}, dimensions={0}",
        "%r = f32[8]{0} ragged-all-to-all(%p, %q, %o1, %s1, %o2, %s2), replica_groups={{0,1}}",
        "this mentions all-reduce but is no instruction",
        "%cp = f32[8]{0} collective-permute(%p), channel_id=1",
        devices=4,
    )
    collectives, skipped = parse_collectives(text, (4,), ("x",))
    assert [c.name for c in collectives] == ["ok"]
    reasons = " | ".join(s.reason for s in skipped)
    for expected in (
        "unknown replica_groups",
        "without dimensions",
        "without a matching start",
        "without a matching done",
        "ragged",
        "not an HLO instruction",
        "source_target_pairs",
    ):
        assert expected in reasons
    assert len(skipped) == 7 and all(s.line_number > 0 for s in skipped)


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_truncated_or_random_text_never_raises(data):
    real = (DATA / "tpu_v5p_2x2x2_fsdp_tp_step.hlo").read_text().splitlines()
    lines = data.draw(st.lists(st.sampled_from(real), max_size=30))
    cut = [line[: data.draw(st.integers(0, len(line)))] for line in lines]
    noise = data.draw(
        st.text(alphabet=st.sampled_from(list("%{}[]()<=,'=T: allreducegathr-0123456789\n")), max_size=300)
    )
    collectives, skipped = parse_collectives("\n".join(cut) + "\n" + noise, MESH222)
    assert all(isinstance(c, Collective) for c in collectives) and all(s.reason for s in skipped)


# --------------------------------------------------------------------------- real HLO, CPU compiler


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


def test_cpu_fixture_loops_count_trip_counts():
    collectives, _ = fixture("cpu_scan_fsdp.hlo", FSDP8)
    assert {c.repeats for c in collectives} == {4}  # known_trip_count of the scans over 4 layers
    totals = {(t.kind, t.axes): t for t in summarize(collectives)}
    gathers = [c for c in collectives if c.kind == "all-gather"]
    assert totals[("all-gather", ("fsdp",))].count == 4 * len(gathers)
    assert totals[("all-gather", ("fsdp",))].total_bytes == 4 * sum(c.size_bytes for c in gathers)
    assert all(t.exact for t in totals.values())


def test_cpu_fixture_mesh_groups_with_device_ids():
    text = (DATA / "cpu_transposed_sum.hlo").read_text()
    assert "device_ids=(" in text  # the compiler mesh is not a plain iota
    (collective,), _ = parse_collectives(text, MESH222)
    assert (collective.kind, collective.axes) == ("all-reduce", ("tensor",))


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


def test_user_mistakes_raise_lab_errors():
    with pytest.raises(LabError, match="needs a function"):
        inspect("not a function")
    with pytest.raises(LabError, match="axis_names"):
        parse_collectives(module(all_reduce_line("{}")), MESH222, ("x", "y"))


# --------------------------------------------------------------------------- real HLO, TPU compiler (compile-only)


def test_tpu_fixture_primitives_v5e():
    collectives, skipped = fixture("tpu_v5e_4x4_shard_map_primitives.hlo", MESH224)
    assert skipped == ()
    _assert_primitives(collectives, rows=TPU_ROWS)
    permute = by_kind_axes(collectives, "collective-permute", ("tensor",))
    assert permute.is_async and permute.form == "collective-permute-start/collective-permute-done"
    assert permute.result_shapes == ((TPU_ROWS, 128),)  # the -done's shape, not the -start's scratch tuple
    gather = by_kind_axes(collectives, "all-gather", ("data", "fsdp"))
    assert not gather.is_async and "was all-gather-start" in gather.form  # the scheduler made it synchronous


def test_tpu_fixture_small_psum_scatter_becomes_all_reduce():
    text = (DATA / "tpu_v5e_4x4_small_psum_scatter.hlo").read_text()
    (collective,), _ = parse_collectives(text, MESH224)
    assert (collective.kind, collective.axes, collective.result_shapes) == ("all-reduce", ("fsdp",), ((8, 128),))
    assert "dynamic-slice" in text and "reduce-scatter(" not in text


def test_tpu_fixture_fsdp_tp_step_v5p():
    collectives, skipped = fixture("tpu_v5p_2x2x2_fsdp_tp_step.hlo", MESH222)
    assert skipped == ()
    assert kinds_and_axes(collectives) >= {
        ("all-gather", ("fsdp",)),
        ("reduce-scatter", ("fsdp",)),
        ("all-reduce", ("data",)),
        ("all-reduce", ("tensor",)),
    }
    (scatter,) = [c for c in collectives if c.kind == "reduce-scatter"]
    assert scatter.fused and "all-reduce + dynamic-slice" in scatter.form  # the %all-reduce-scatter fusion
    assert scatter.combined and scatter.operand_bytes == 2 * scatter.result_bytes  # both weight gradients
    data_reduce = by_kind_axes(collectives, "all-reduce", ("data",))
    assert data_reduce.combined and len(data_reduce.operand_shapes) == 2  # both weight gradients in one all-reduce
    assert "<=" in (DATA / "tpu_v5p_2x2x2_fsdp_tp_step.hlo").read_text()  # iota-form groups were parsed


def test_tpu_fixture_async_collective_fusion_counts_once():
    text = (DATA / "tpu_v5e_4x4_async_collective_fusion.hlo").read_text()
    assert text.count(" all-gather(") == 3  # start, continuation, done fusions each hold a copy
    collectives, _ = parse_collectives(text, MESH224)
    (gather,) = [c for c in collectives if c.kind == "all-gather"]
    assert gather.is_async and gather.fused and gather.axes == ("fsdp",)
    assert "async collective fusion" in gather.form


@pytest.fixture(scope="module")
def v5e():
    from lab.devices import topology_devices

    return topology_devices("v5e:4x4")


def test_live_tpu_primitives_v5e_and_v5p(v5e):
    from lab.devices import topology_devices

    for devices in (v5e, topology_devices("v5p:2x2x2")):
        mesh = MeshSpec.parse("data=2,fsdp=2,tensor=-1").build(devices)
        fn, args = primitives_program(mesh, rows=TPU_ROWS)
        inspection = inspect(fn, *args)
        assert inspection.skipped == ()
        _assert_primitives(inspection.collectives, rows=TPU_ROWS)
        assert inspection.memory["argument_size"] == TPU_ROWS * 128 * 4 and inspection.cost["flops"] >= 0


def test_live_tpu_fsdp_tp_step_v5p():
    from lab.devices import topology_devices

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
    from lab.devices import devices_for, topology_devices

    root = str(Path(__file__).resolve().parents[1]) + "/"
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


def test_op_names_link_each_instruction_to_the_jax_code_that_made_it():
    text = (
        "ENTRY %main {\n"
        "  %p0 = f32[4]{0} parameter(0)\n"
        "  %fusion.3 = f32[4]{0} fusion(f32[4]{0} %p0), kind=kLoop, calls=%fused, "
        'metadata={op_name="jit(step)/optimizer/mul"}\n'
        "  ROOT %all-reduce.1 = f32[4]{0} all-reduce(%fusion.3), replica_groups={}, "
        'metadata={op_name="jit(step)/forward_backward/reshard"}\n'
        "}\n"
    )
    assert op_names(text) == {
        "fusion.3": ("fusion", "jit(step)/optimizer/mul"),
        "all-reduce.1": ("all-reduce", "jit(step)/forward_backward/reshard"),
    }
