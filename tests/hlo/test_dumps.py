"""A dump folder's modules: which one `lab inspect --dump` explains by default, and why it says so."""

from pathlib import Path

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from lab.cli import main
from lab.hlo.dumps import find_modules, pick, why

STEP = """HloModule jit_train_step, num_partitions=8
ENTRY %main (p: f32[8]) -> f32[8] {
  %p = f32[8] parameter(0)
  %ar = f32[8] all-reduce-start(%p), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  %d = f32[8] all-reduce-done(%ar)
  ROOT %g = f32[8] all-gather(%d), replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
}
"""


def _helper(lines: int) -> str:
    """A one-device helper longer than the step (XLA writes no num_partitions when it is 1)."""
    body = "".join(f"  %c{i} = f32[] constant({i})\n" for i in range(lines))
    return f"HloModule jit__multi_slice\nENTRY %main () -> f32[] {{\n{body}  ROOT %r = f32[] constant(0)\n}}\n"


def _dump(folder: Path, **modules: str) -> Path:
    folder.mkdir()
    for number, (name, text) in enumerate(modules.items(), 1):
        (folder / f"module_{number:04d}.{name}.cpu_after_optimizations.txt").write_text(text)
    return folder


def test_the_step_spanning_every_partition_is_chosen_over_a_longer_one_device_helper(tmp_path):
    folder = _dump(tmp_path / "dump", jit__multi_slice=_helper(200), jit_train_step=STEP)
    modules = find_modules(folder)
    helper, step = modules
    assert (helper.lines, helper.partitions, helper.collectives) == (204, 1, 0)
    assert (step.partitions, step.collectives) == (8, 2)  # an async pair counts once
    assert pick(modules) is step and helper.lines > step.lines
    assert why(step, modules) == "the most partitions (8; next 0001:jit__multi_slice with 1)"


def test_among_modules_of_one_size_the_one_that_communicates_is_chosen(tmp_path):
    quiet = STEP.replace("all-reduce-start", "negate").replace("all-reduce-done", "copy").replace("all-gather", "abs")
    folder = _dump(tmp_path / "dump", jit_init=quiet + "\n" * 50, jit_train_step=STEP)
    modules = find_modules(folder)
    assert pick(modules).name == "jit_train_step"
    assert why(pick(modules), modules).startswith("the most collectives (2; next 0001:jit_init with 0)")


def test_the_listing_says_which_module_it_explains_and_why(tmp_path, capsys):
    folder = _dump(tmp_path / "dump", jit__multi_slice=_helper(200), jit_train_step=STEP)
    assert main(["inspect", "--dump", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "explained: 0002:jit_train_step, the most partitions (8; next 0001:jit__multi_slice with 1)" in out
    assert "jit_train_step on a dump (no mesh given: raw groups)" in out  # said once
    assert out.count("{0,1,2,3,4,5,6,7}") == 2  # without a mesh, each collective's groups stand for its axes


def test_a_module_before_optimizations_is_refused_with_the_file_to_give(tmp_path, capsys, devices):
    """A dump's before_optimizations file holds the program's shardings as annotations and no collective: read as
    the program it would list nothing, so it is refused, naming the optimized file beside it."""
    mesh = jax.make_mesh((8,), ("fsdp",))
    x = jax.ShapeDtypeStruct((64, 64), jnp.float32, sharding=NamedSharding(mesh, P("fsdp")))
    unoptimized = tmp_path / "module_0001.jit_step.before_optimizations.txt"
    unoptimized.write_text(jax.jit(lambda a: a.sum(0)).lower(x).as_text(dialect="hlo"))
    assert main(["inspect", "--hlo", str(unoptimized), "--mesh", "fsdp=8"]) == 2
    err = capsys.readouterr().err
    assert "a module before XLA's optimizations" in err
    assert "module_0001.jit_step.after_optimizations.txt beside it" in " ".join(err.split())
