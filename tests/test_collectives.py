"""Every collective against its numpy twin, every algorithm against its lax
primitive, and the compiled CPU HLO against the step counts of the algorithms.

Inputs are small integers in float32, so every sum is exact whatever order a
ring adds in, and comparisons are exact. Each (collective, mesh, axes) case is
compiled once and the executable is reused by every test that needs it.
"""

import functools
import re
from collections import Counter

import jax
import numpy as np
import pytest

from lab.collectives import NAMES, RECIPES, build_program, require_power_of_two
from lab.errors import LabError
from lab.mesh import MeshSpec
from tests.conftest import run_python

BYTES = 32 * 4  # D = 32 float32 per device: splits into 2N pieces for every N up to 16

PRIMITIVES = [name for name in NAMES if RECIPES[name].same_as == name]
ALGORITHMS = [name for name in NAMES if RECIPES[name].same_as != name]

# (mesh spec, axes): every axis of 2x2x2, a tuple out of mesh order, and N = 4, 8.
CASES = [
    ("data=2,fsdp=2,tensor=2", "data"),
    ("data=2,fsdp=2,tensor=2", "fsdp"),
    ("data=2,fsdp=2,tensor=2", "tensor"),
    ("data=2,fsdp=2,tensor=2", ("tensor", "data")),
    ("fsdp=4,tensor=2", "fsdp"),
    ("fsdp=4,tensor=2", ("fsdp", "tensor")),
    ("fsdp=8", "fsdp"),
]
CASE_IDS = [f"{spec}-{'+'.join(axes) if isinstance(axes, tuple) else axes}" for spec, axes in CASES]

# An HLO instruction whose opcode is a collective (sync, or the start of an async pair).
COLLECTIVE_OP = re.compile(
    r"(?<![%\w.-])(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?:-start)?\("
)
SOURCE_TARGET_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)+)\}")
PERMUTE_SIZE = re.compile(r"= f32\[(\d+)\]\{0\} collective-permute(?:-start)?\(")


@pytest.fixture(scope="module")
def meshes(devices, mesh222):
    return {"data=2,fsdp=2,tensor=2": mesh222} | {
        spec: MeshSpec.parse(spec).build(devices) for spec in ("fsdp=4,tensor=2", "fsdp=8")
    }


@functools.cache
def compiled_run(name: str, mesh, axes, root: int = 0):
    """(program, input, output, optimized HLO text), compiling the program once."""
    program = build_program(name, mesh, axes, root=root)
    x = program.example_input(BYTES)
    compiled = program.fn.lower(program.abstract_input(BYTES)).compile()
    return program, x, np.asarray(compiled(program.place(x))), compiled.as_text()


@pytest.mark.parametrize("spec,axes", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("name", NAMES)
def test_matches_numpy_reference(meshes, name, spec, axes):
    program, x, y, _ = compiled_run(name, meshes[spec], axes)
    np.testing.assert_array_equal(y, program.reference(x))


@pytest.mark.parametrize("spec,axes", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("name", ALGORITHMS)
def test_algorithm_matches_lax_primitive(meshes, name, spec, axes):
    _, x, y, _ = compiled_run(name, meshes[spec], axes)
    _, x_builtin, y_builtin, _ = compiled_run(RECIPES[name].same_as, meshes[spec], axes)
    np.testing.assert_array_equal(x, x_builtin)
    np.testing.assert_array_equal(y, y_builtin)


@pytest.mark.parametrize("spec,axes", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("name", NAMES)
def test_compiled_collectives(meshes, name, spec, axes):
    """Primitives compile to their one HLO collective; algorithms to one collective-permute per step."""
    program, _, _, hlo = compiled_run(name, meshes[spec], axes)
    recipe = program.recipe
    assert Counter(COLLECTIVE_OP.findall(hlo)) == {recipe.hlo_op: recipe.hlo_op_count(program.group_size)}


@pytest.mark.parametrize("spec,n", [("data=2,fsdp=2,tensor=2", 2), ("fsdp=4,tensor=2", 4), ("fsdp=8", 8)])
def test_ring_all_reduce_has_2_n_minus_1_permutes_of_d_over_n(meshes, spec, n):
    _, _, _, hlo = compiled_run("ring-all-reduce", meshes[spec], "fsdp")
    assert [int(size) for size in PERMUTE_SIZE.findall(hlo)] == [32 // n] * (2 * (n - 1))


def test_halving_doubling_halves_then_doubles_the_message(meshes):
    _, _, _, hlo = compiled_run("halving-doubling-all-reduce", meshes["fsdp=8"], "fsdp")
    assert [int(size) for size in PERMUTE_SIZE.findall(hlo)] == [16, 8, 4, 4, 8, 16]


def test_bidirectional_ring_sends_both_ways_round(meshes):
    """On fsdp=8 mesh positions are ring indices: half the permutes go i -> i+1, half i -> i-1."""
    _, _, _, hlo = compiled_run("bidirectional-ring-all-reduce", meshes["fsdp=8"], "fsdp")
    pair_lists = [re.findall(r"\{(\d+),(\d+)\}", pairs) for pairs in SOURCE_TARGET_PAIRS.findall(hlo)]
    shifts = Counter(frozenset((int(t) - int(s)) % 8 for s, t in pairs) for pairs in pair_lists)
    assert shifts == {frozenset({1}): 14, frozenset({7}): 14}


@pytest.mark.parametrize("name", ["broadcast", "reduce"])
def test_root_other_than_zero(meshes, name):
    program, x, y, _ = compiled_run(name, meshes["data=2,fsdp=2,tensor=2"], ("tensor", "data"), root=3)
    np.testing.assert_array_equal(y, program.reference(x))
    assert not np.array_equal(y, build_program(name, program.mesh, program.axes).reference(x))


@pytest.mark.parametrize("name", ["all-to-all", "ring-all-reduce", "halving-doubling-all-reduce"])
def test_blocks_with_trailing_dimensions(meshes, name):
    program = build_program(name, meshes["fsdp=4,tensor=2"], "fsdp")
    x_NDK = np.arange(4 * 8 * 3, dtype=np.float32).reshape(4, 8, 3)
    np.testing.assert_array_equal(program.fn(program.place(x_NDK)), program.reference(x_NDK))


def test_example_input_has_the_requested_data_size(mesh222):
    for name in NAMES:
        program = build_program(name, mesh222, ("data", "tensor"))
        assert program.data_bytes(program.example_input(BYTES)) == BYTES
        assert program.data_bytes(program.abstract_input(BYTES)) == BYTES


def test_example_input_sums_stay_exact_in_bfloat16(meshes):
    program = build_program("all-reduce", meshes["fsdp=8"], "fsdp")
    x = program.example_input(2 * 512, jax.numpy.bfloat16)
    assert len(np.unique(x[0])) > 1
    assert float(np.asarray(x, np.float32).sum(0).max()) <= 256  # bfloat16 holds integers exactly up to 256


def test_halving_doubling_needs_a_power_of_two():
    require_power_of_two(8, "fsdp")
    with pytest.raises(LabError, match=r"power-of-two.*'fsdp'.*6"):
        require_power_of_two(6, "fsdp")


def test_six_devices_ring_works_and_halving_doubling_refuses():
    result = run_python(
        """
        import jax
        jax.config.update("jax_num_cpu_devices", 6)
        import numpy as np
        from lab.collectives import build_program
        from lab.errors import LabError
        from lab.mesh import MeshSpec

        mesh = MeshSpec.parse("fsdp=6").build()
        ring = build_program("bidirectional-ring-all-reduce", mesh, "fsdp")
        x = ring.example_input(12 * 4)
        np.testing.assert_array_equal(ring.fn(ring.place(x)), ring.reference(x))
        try:
            build_program("halving-doubling-all-reduce", mesh, "fsdp")
        except LabError as err:
            print("refused:", err)
        """
    )
    assert result.returncode == 0, result.stderr
    assert (
        "refused: halving-doubling all-reduce needs a power-of-two number of devices, but axis 'fsdp' spans 6"
        in result.stdout
    )


def test_undivided_block_names_dimension_size_and_axis(meshes):
    program = build_program("reduce-scatter", meshes["fsdp=4,tensor=2"], "fsdp")
    with pytest.raises(LabError, match=r"over axis 'fsdp': dimension 1 of the input \(size 6\) is not divisible by 4"):
        program.place(np.zeros((4, 6), np.float32))


def test_undivided_block_is_caught_in_the_local_view_too(meshes):
    """Placed by hand, past `place`: the shard_map body still rejects it when it traces."""
    program = build_program("ring-all-reduce", meshes["fsdp=4,tensor=2"], "fsdp")
    placed = jax.device_put(np.zeros((4, 6), np.float32), program.sharding)
    with pytest.raises(LabError, match=r"dimension 0 of the per-device block \(size 6\) is not divisible by 4.*'fsdp'"):
        program.fn(placed)


@pytest.mark.parametrize(
    "name,axes,root,message",
    [
        ("ring-all-sum", "fsdp", 0, "unknown collective 'ring-all-sum'"),
        ("all-reduce", "model", 0, "unknown axis 'model'"),
        ("all-reduce", ("fsdp", "fsdp"), 0, "named twice"),
        ("broadcast", "fsdp", 4, "root 4 is not a device index"),
    ],
)
def test_bad_requests_raise_lab_errors(meshes, name, axes, root, message):
    with pytest.raises(LabError, match=message):
        build_program(name, meshes["fsdp=4,tensor=2"], axes, root=root)


def test_wrong_stack_height_and_size_raise_lab_errors(meshes):
    program = build_program("all-gather", meshes["fsdp=4,tensor=2"], "fsdp")
    with pytest.raises(LabError, match="N=4 per-device blocks, got shape"):
        program.place(np.zeros((8, 4), np.float32))
    with pytest.raises(LabError, match="D=24 bytes per device is not a positive multiple of 16 bytes"):
        program.example_input(24)
