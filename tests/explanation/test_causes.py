"""Why each collective is there, in the user's terms: the op or annotation that decided it, at its line.

The corpus (`tests/data/programs/public_issues.py`) holds programs from public JAX and XLA issues where a user
asked why a collective was there and a maintainer named the cause; each marks that line ``# decides``. The lab
must name the same cause there, from the compiled program and Shardy's record alone.
"""

import importlib.util
import json
from pathlib import Path

import pytest

from lab.cli import main
from lab.explanation.explain import explain_hlo

PROGRAMS = Path(__file__).parents[1] / "data" / "programs" / "public_issues.py"
_spec = importlib.util.spec_from_file_location("public_issues", PROGRAMS)
corpus = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(corpus)


def _inspect(capsys, name: str, mesh: str, *options: str) -> dict:
    assert main(["inspect", "--fn", f"{PROGRAMS}:{name}", "--mesh", mesh, "--json", *options]) == 0
    return json.loads(capsys.readouterr().out)


def _deciding_line(name: str) -> int:
    """The line of `name`'s builder marked ``# decides``."""
    lines = PROGRAMS.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"def {name}("))
    return next(i for i, line in enumerate(lines[start:], start + 1) if line.rstrip().endswith("# decides"))


@pytest.mark.parametrize("name", list(corpus.CASES))
def test_the_cause_a_maintainer_named_is_named_at_its_line(capsys, devices, name):
    source, mesh, kind, op = corpus.CASES[name]
    found = _inspect(capsys, name, mesh)
    assert found["collectives"], f"{name} ({source}): no collective found"
    for c in found["collectives"]:  # every collective: a user line and a call chain in the program's file
        assert c["stack"] and all(f["file"] == str(PROGRAMS) for f in c["stack"]), c
    causes = [c["cause"] for c in found["collectives"] if c["cause"] is not None]
    named = [c for c in causes if c["kind"] == kind and op in c["op"]]
    assert named, f"{name} ({source}): expected {kind} {op}, found {causes}"
    assert all(c["line"] == f"{PROGRAMS}:{_deciding_line(name)}" for c in named), named
    assert all(c["hint"] for c in named)  # each names the change at that line


def test_a_conflicting_constraint_names_both_sides_and_the_sharding_to_write(capsys, devices):
    found = _inspect(capsys, "involuntary_full_remat", "fsdp=4,tensor=2")
    cause = next(c["cause"] for c in found["collectives"] if c["cause"])
    assert "P(None, ('fsdp', 'tensor'), None) from with_sharding_constraint" in cause["why"]
    assert "comes as P('tensor', None, 'fsdp') from the sharding declared for a" in cause["why"]
    assert cause["hint"].startswith(f"at public_issues.py:{_deciding_line('involuntary_full_remat')}: ask for P(")
    assert found["origins"].startswith("sharding origins: Shardy's record read; 2 collective(s)")
    # and XLA's own account, from its stderr: the add's result replicated whole on the way between the two
    (remat,) = found["rematerializations"]
    assert remat["op"] == "jit(f)/add" and remat["line"] == f"{PROGRAMS}:{_deciding_line('involuntary_full_remat') - 1}"
    assert (remat["from"], remat["to"]) == ("P('tensor', None, 'fsdp')", "P(None, ('fsdp', 'tensor'), None)")


def test_a_collective_asked_for_in_shard_map_is_no_surprise(capsys, devices):
    found = _inspect(capsys, "psum_in_shard_map", "fsdp=8")
    (collective,) = found["collectives"]
    assert collective["cause"]["kind"] == "shard_map" and collective["cause"]["op"].startswith("psum")
    assert collective["hint"] is None and found["surprises"] == 0


def test_an_out_sharding_that_replicates_a_split_value_is_named_at_its_line(capsys, devices):
    found = _inspect(capsys, "einsum_out_sharding_replicates", "data=8", "--axis-types", "explicit")
    (collective,) = found["collectives"]
    cause = collective["cause"]
    assert (cause["kind"], cause["op"]) == ("annotation", "out_sharding")
    assert cause["line"] == f"{PROGRAMS}:{_deciding_line('einsum_out_sharding_replicates')}"
    assert "P(None, None, None)" in cause["why"] and found["surprises"] == 1


def test_a_transposes_operand_is_compared_in_the_results_order_of_dimensions(capsys, devices):
    """P('fsdp', None) on both sides of a transpose are not the same layout: the operand's rows become the result's
    columns, so the constraint asking for rows is what moves the data."""
    found = _inspect(capsys, "transpose_of_split_rows", "fsdp=8")
    (collective,) = found["collectives"]
    assert collective["kind"] == "all-to-all"
    assert "its operand a (transposed) comes as P(None, 'fsdp')" in collective["cause"]["why"]


def test_a_sum_xla_moved_out_of_a_scan_is_told_at_the_loops_line(capsys):
    """On TPU the micro-batches' gradient all-reduce leaves the loop (openxla/xla#49143's pass): its op name is the
    loop's, and the lab says so at the scan's line; the ids' gather, which libtpu writes as an all-reduce with no op
    name, is told at the lookup that needs it."""
    found = _inspect(capsys, "scanned_embedding_gradients", "fsdp=4", "--target", "tpu:v5e:2x2")
    causes = {c["name"]: (c["kind"], c["size_bytes"], c["cause"]) for c in found["collectives"]}
    assert all(cause is not None for _, _, cause in causes.values()), causes
    moved = [(size, cause) for kind, size, cause in causes.values() if cause["kind"] == "loop motion"]
    (size, cause), line = moved[0], _deciding_line("scanned_embedding_gradients")
    assert len(moved) == 1 and size == 96 * 35 * 256 * 4  # the whole table's gradient, once a step
    assert cause["line"] == f"{PROGRAMS}:{line}" and "while-loop-all-reduce-code-motion" in cause["why"]
    assert cause["hint"] is None
    gathered = [cause for kind, size, cause in causes.values() if size == 8 * 4]  # the ids: 8 int32 of 16
    assert gathered and gathered[0]["op"] == "gather" and "reshards ids before it" in gathered[0]["why"]


def test_a_dump_says_it_holds_no_record_of_sharding_origins():
    text = (Path(__file__).parents[1] / "data" / "hlo" / "cpu_scan_fsdp.hlo").read_text()
    assert explain_hlo(text).origins.startswith("sharding origins: none read; a dump holds no record")


def test_a_program_whose_frames_are_all_in_libraries_says_so(capsys, devices, tmp_path):
    packages = tmp_path / "venv" / "lib" / "python3.11" / "site-packages"
    packages.mkdir(parents=True)
    (packages / "library_step.py").write_text(
        "import jax\nimport jax.numpy as jnp\nfrom jax.sharding import NamedSharding, PartitionSpec as P\n\n\n"
        "def step(mesh):\n    x = jax.ShapeDtypeStruct((64,), jnp.float32, sharding=NamedSharding(mesh, P('data')))\n"
        "    return (lambda v: jnp.sort(v)), (x,)\n"
    )
    assert main(["inspect", "--fn", f"{packages / 'library_step.py'}:step", "--mesh", "data=8", "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    blind = len(found["collectives"])
    assert blind and f"{blind} collective(s) with no frame of your code" in found["origins"]


OPS = """
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P


def _split(mesh, shape, spec, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


def lookup(mesh):
    return (lambda table, idx: table[idx]), (_split(mesh, (1024, 64), P("fsdp")), _split(mesh, (32,), P(), jnp.int32))


def running_total(mesh):
    return (lambda x: jnp.cumsum(x, axis=1)), (_split(mesh, (8, 1024), P(None, "fsdp")),)


def take_columns(mesh):  # a table split by columns, the ids by rows: the result cannot keep both splits
    ids = _split(mesh, (64, 128), P("fsdp"), jnp.int32)
    return (lambda table, ids: jnp.take(table, ids, axis=0)), (_split(mesh, (4096, 256), P(None, "fsdp")), ids)
"""


@pytest.mark.parametrize("name, op", [("lookup", "gather"), ("running_total", "cumsum (reduce_window_sum)")])
def test_an_op_is_named_as_the_user_wrote_it(capsys, devices, tmp_path, name, op):
    """A jnp function is a nested jit (jit(f)/jit(cumsum)/reduce_window_sum): named by it; an op written directly in
    the user's function (jit(f)/gather) by its own name, not the user's function's."""
    (tmp_path / "ops.py").write_text(OPS)
    assert main(["inspect", "--fn", f"{tmp_path / 'ops.py'}:{name}", "--mesh", "data=2,fsdp=4", "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert {c["cause"]["op"] for c in found["collectives"] if c["cause"]} == {op}


MASKS = """
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P


def _scores(mesh):
    return jax.ShapeDtypeStruct((256, 256), jnp.float32, sharding=NamedSharding(mesh, P("fsdp")))


def from_arange(mesh):
    def f(s):
        i = jnp.arange(s.shape[0])
        return jnp.where(i[:, None] >= i[None, :], s, -1e9)

    return f, (_scores(mesh),)


def from_broadcasted_iota(mesh):
    def f(s):
        rows, cols = (jax.lax.broadcasted_iota(jnp.int32, s.shape, d) for d in (0, 1))
        return jnp.where(rows >= cols, s, -1e9)

    return f, (_scores(mesh),)
"""


def test_an_arange_made_split_and_gathered_is_the_partitioners_and_the_hint_removes_it(capsys, devices, tmp_path):
    """A causal mask from one arange on both dimensions of row-split scores: XLA makes the arange split, as the rows
    want, and gathers it whole for the columns. Nothing moved is an input's: the numbers are made of an iota."""
    (tmp_path / "masks.py").write_text(MASKS)
    assert main(["inspect", "--fn", f"{tmp_path / 'masks.py'}:from_arange", "--mesh", "fsdp=8", "--json"]) == 0
    (gathered,) = json.loads(capsys.readouterr().out)["collectives"]
    assert (gathered["kind"], gathered["axes"], gathered["origin"]["kind"]) == ("all-gather", ["fsdp"], "index")
    assert gathered["size_bytes"] == 256 * 4  # the arange, int32, whole
    assert (gathered["cause"]["kind"], gathered["cause"]["op"]) == ("partitioner", "ge")
    assert gathered["cause"]["line"].endswith("masks.py:14") and gathered["surprise"]
    assert "broadcasted_iota" in gathered["hint"]
    # the hint's change: each device makes its own rows' and columns' numbers, nothing moves
    assert (
        main(["inspect", "--fn", f"{tmp_path / 'masks.py'}:from_broadcasted_iota", "--mesh", "fsdp=8", "--json"]) == 0
    )
    assert json.loads(capsys.readouterr().out)["collectives"] == []


def test_a_lookup_that_gathers_its_indices_says_so_not_that_rows_are_split(capsys, devices, tmp_path):
    """jnp.take of a table split by columns with ids split by rows: XLA gathers the ids whole (and the lookup's own
    bounds mask, an op of jnp.take's nested jit), the table's rows never split. Each is the lookup's, named as the
    user wrote it, and says one of the three is brought whole, not that partial lookups are combined."""
    (tmp_path / "ops.py").write_text(OPS)
    assert main(["inspect", "--fn", f"{tmp_path / 'ops.py'}:take_columns", "--mesh", "fsdp=8", "--json"]) == 0
    found = json.loads(capsys.readouterr().out)["collectives"]
    assert found and all(c["kind"] == "all-gather" and c["origin"]["name"] == "ids" for c in found)
    assert {c["cause"]["op"] for c in found} == {"take (gather)"}
    assert all("not laid out alike" in c["cause"]["why"] and "partial" not in c["cause"]["why"] for c in found)


def _marked_line(name: str, mark: str) -> int:
    """The line of `name`'s builder marked ``# <mark>``."""
    lines = PROGRAMS.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"def {name}("))
    return next(i for i, line in enumerate(lines[start:], start + 1) if line.rstrip().endswith(f"# {mark}"))


@pytest.mark.parametrize(
    ("name", "mesh", "op", "axis"),
    [
        ("sum_over_split_rows", "data=8", "reduce_sum", "data"),
        ("row_parallel_matmul", "fsdp=2,tensor=4", "dot_general", "tensor"),
        # flax's nn.with_logical_constraint and nn.Dense: named at the lines that call them, not at flax's own
        ("flax_logical_constraint", "data=2,fsdp=2,tensor=2", "dot_general", "tensor"),
    ],
)
def test_a_sum_over_a_split_dimension_names_the_sum_and_what_split_it(capsys, devices, name, mesh, op, axis):
    found = _inspect(capsys, name, mesh)
    (summed,) = [c for c in found["collectives"] if c["cause"] and c["cause"]["kind"] == "sum" and c["axes"] == [axis]]
    assert summed["kind"] == "all-reduce"
    cause = summed["cause"]
    assert cause["op"] == op and cause["line"] == f"{PROGRAMS}:{_deciding_line(name)}"
    assert f"with_sharding_constraint at public_issues.py:{_marked_line(name, 'splits')}" in cause["why"]
    if name == "sum_over_split_rows":  # partial sums of neither activations nor gradients: a surprise, with a change
        assert summed["surprise"] and summed["origin"]["kind"] == "surprise"
        assert summed["hint"] == cause["hint"] and cause["hint"].startswith(
            f"at public_issues.py:{_deciding_line(name)}: "
        )
    else:  # activations' partial sums: the layouts ask for them, nothing to change
        assert cause["hint"] is None and summed["hint"] is None and not summed["surprise"]
        assert summed["origin"]["kind"] == "activation"


def test_a_matmul_names_each_operand_the_layouts_split(capsys, devices):
    found = _inspect(capsys, "row_parallel_matmul", "fsdp=2,tensor=4")
    (summed,) = [c for c in found["collectives"] if c["cause"]]
    assert "w_out split over tensor by the sharding declared for w_out" in summed["cause"]["why"]


def test_a_gradient_the_step_returns_whole_is_a_gradient_of_the_split_weight(capsys, devices):
    found = _inspect(capsys, "gradient_returned_whole", "data=8")
    reduced = next(c for c in found["collectives"] if c["kind"] == "all-reduce")
    assert (reduced["origin"]["kind"], reduced["origin"]["name"]) == ("gradient", "m")
    assert "10,240 elements, the whole parameter (each device holds 1,280)" in reduced["origin"]["why"]
    gathered = next(c for c in found["collectives"] if c["kind"] == "all-gather")
    assert (gathered["origin"]["kind"], gathered["origin"]["name"]) == ("parameter", "m")
    assert found["surprises"] == 0


@pytest.mark.filterwarnings("ignore:jax.experimental.pjit.pjit has been deprecated")
def test_pjit_era_code_finds_its_mesh_and_a_lone_returned_gradient_is_one(capsys, devices):
    found = _inspect(capsys, "pjit_era_gradient", "data=2,fsdp=4")
    (reduced,) = found["collectives"]
    assert (reduced["kind"], reduced["axes"]) == ("all-reduce", ["data"])
    assert (reduced["origin"]["kind"], reduced["origin"]["name"]) == ("gradient", "w")
    assert (
        reduced["cause"]["kind"] == "sum"
        and reduced["cause"]["line"] == f"{PROGRAMS}:{_deciding_line('pjit_era_gradient')}"
    )


def test_a_norm_over_a_weights_split_dimension_is_a_surprise_named_inside_its_jnp_function(capsys, devices):
    found = _inspect(capsys, "norm_over_a_split_weight", "data=2,fsdp=4")
    (norm,) = [c for c in found["collectives"] if c["surprise"]]
    assert norm["cause"]["kind"] == "sum" and norm["cause"]["op"] == "reduce_sum" and "jit(norm)" in norm["op_name"]
    assert norm["cause"]["line"] == f"{PROGRAMS}:{_deciding_line('norm_over_a_split_weight')}"
    assert norm["hint"].endswith("in the sharding declared for w") and found["surprises"] == 1


def test_collectives_over_an_axis_no_layout_names_are_the_partitioners_own(capsys, devices):
    found = _inspect(capsys, "an_axis_no_layout_names", "data=2,fsdp=2,tensor=2")
    over_tensor = [c for c in found["collectives"] if "tensor" in c["axes"]]
    assert over_tensor and all(c["cause"]["kind"] == "partitioner" for c in over_tensor)
    line = f"public_issues.py:{_deciding_line('an_axis_no_layout_names')}"
    assert all(
        c["hint"].startswith(f"at {line}: ") and c["hint"].endswith("leave tensor out of the mesh") for c in over_tensor
    )
    # the axes the program names are never the partitioner's
    assert not any(
        c["cause"] and c["cause"]["kind"] == "partitioner" for c in found["collectives"] if "tensor" not in c["axes"]
    )


def test_partial_sums_are_a_sum_whatever_out_sharding_asks(capsys, devices):
    """Explicit sharding: each op's result layout is written (an out_sharding=, or the type's), but no layout spares
    the reduction of partial sums: the contraction, and the sum over the dimension a reshard split, are named."""
    found = _inspect(capsys, "explicit_matmul_then_sum", "fsdp=2,tensor=4", "--axis-types", "explicit")
    reductions = {tuple(c["axes"]): c["cause"] for c in found["collectives"] if c["kind"] == "all-reduce"}
    assert (reductions[("tensor",)]["kind"], reductions[("tensor",)]["op"]) == ("sum", "dot_general")
    assert reductions[("tensor",)]["line"] == f"{PROGRAMS}:{_deciding_line('explicit_matmul_then_sum')}"
    assert (reductions[("fsdp",)]["kind"], reductions[("fsdp",)]["op"]) == ("sum", "reduce_sum")


def test_a_pmap_step_is_traced_on_its_own_mesh(capsys, devices):
    found = _inspect(capsys, "pmap_data_parallel", "data=8")
    (mean,) = found["collectives"]
    assert (mean["kind"], mean["axes"], mean["origin"]["kind"]) == ("all-reduce", ["data"], "gradient")
    assert mean["cause"]["kind"] == "shard_map" and mean["cause"]["op"].startswith("psum")
    assert mean["cause"]["line"] == f"{PROGRAMS}:{_deciding_line('pmap_data_parallel')}"
