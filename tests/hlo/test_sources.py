"""The stack-frame tables: an instruction's line in the user's code, past the libraries that called it."""

import importlib
from pathlib import Path

import pytest

from lab.hlo import parse_collectives
from lab.hlo.sources import Frame, is_library, source_of, stack_frames, stack_of

DATA = Path(__file__).parents[1] / "data" / "hlo"

TABLES = """HloModule jit_step, entry_computation_layout={()->f32[]}

FileNames
1 "/home/me/train.py"
2 "/usr/lib/python3.11/site-packages/flax/nnx/nn/linear.py"
3 "/home/me/caf\\303\\251 \\"model\\".py"

FunctionNames
1 "loss"
2 "__call__"

FileLocations
1 {file_name_id=1 function_name_id=1 line=10 end_line=10 column=4 end_column=9}
2 {file_name_id=2 function_name_id=2 line=388 end_line=388 column=8 end_column=20}
3 {file_name_id=3 function_name_id=1 line=7 end_line=7 column=1 end_column=2}

StackFrames
1 {file_location_id=1 parent_frame_id=1}
2 {file_location_id=2 parent_frame_id=1}
3 {file_location_id=3 parent_frame_id=0}

ENTRY %main () -> f32[] {
  ROOT %c = f32[] constant(0), metadata={op_name="x" stack_frame_id=2}
}
"""


def test_a_frame_inside_a_library_points_at_the_users_line_that_called_it():
    frames = stack_frames(TABLES)
    assert frames.chain(2) == (
        Frame("/usr/lib/python3.11/site-packages/flax/nnx/nn/linear.py", 388, "__call__"),
        Frame("/home/me/train.py", 10, "loss"),
    )
    assert source_of({"stack_frame_id": 2}, frames) == Frame("/home/me/train.py", 10, "loss")
    # escaped names are unescaped: octal UTF-8 and quotes
    assert str(source_of({"stack_frame_id": 3}, frames)) == '/home/me/café "model".py:7'


def test_the_older_source_file_metadata_is_read_when_there_are_no_frames():
    frames = stack_frames(TABLES)
    assert source_of({"source_file": "own.py", "source_line": 2}, frames) == Frame("own.py", 2, "?")
    assert source_of({"op_name": "x"}, frames) is None
    assert source_of({"stack_frame_id": 99}, frames) is None
    assert stack_frames("HloModule m\nENTRY %e () -> f32[] {\n}\n").chain(1) == ()


def test_the_recorded_fixture_names_its_lines():
    text = (DATA / "cpu_scan_fsdp.hlo").read_text()
    frames = stack_frames(text)
    assert frames.chain(1)[0] == Frame("tests/test_hlo.py", 482, "<module>")
    collectives, _ = parse_collectives(text, (1, 1, 8, 1, 1))
    assert collectives and all(
        c.source_file == "tests/test_hlo.py" and c.source_line in (113, 114, 116) for c in collectives
    )


def _inner(x):
    return x * 2.0


def _middle(x):
    return _inner(x) + 1.0


def _outer(x):
    return _middle(x)


def test_a_compiled_chain_reads_every_caller_up_to_the_outermost():
    import jax
    import jax.numpy as jnp

    lowered = jax.jit(_outer).lower(jnp.ones(4))
    text = lowered.compile().as_text()
    frames = stack_frames(text)
    chains = [frames.chain(key) for key in frames.parents]
    functions = {tuple(f.function for f in chain if f.file == __file__) for chain in chains}
    # the multiply sits in _inner, called by _middle, called by _outer, called by this test
    assert ("_inner", "_middle", "_outer", test_a_compiled_chain_reads_every_caller_up_to_the_outermost.__name__) in {
        chain[:4] for chain in functions
    }


@pytest.mark.parametrize(
    "file, library",
    [
        ("/home/me/venv/lib/python3.11/site-packages/flax/nnx/nn/linear.py", True),
        ("/opt/conda/envs/train/lib/python3.12/site-packages/optax/_src/transform.py", True),
        ("/home/me/.local/lib/python3.11/site-packages/jax/_src/numpy/lax_numpy.py", True),
        ("/usr/lib/python3/dist-packages/numpy/core/numeric.py", True),
        ("/usr/lib/python3.11/functools.py", True),
        ("<frozen runpy>", True),
        ("/home/me/src/jax/_src/pjit.py", True),
        ("/home/me/project/train.py", False),
        ("/home/me/python3.11/train.py", False),
        ("/home/me/site_packages_notes/model.py", False),
        ("train.py", False),
    ],
)
def test_library_frames_are_told_from_the_users_own_files(file, library):
    assert is_library(file) is library


def test_this_interpreters_own_folders_count_as_libraries():
    import sysconfig

    assert is_library(sysconfig.get_path("purelib") + "/anything.py")
    assert is_library(sysconfig.get_path("stdlib") + "/json/decoder.py")


def _venv_layout(tmp_path: Path, monkeypatch, *, library: tuple[str, str], user: tuple[str, str]) -> Path:
    """A module `library` installed in a folder laid out like a venv's site-packages, and the user's module `user`
    beside it, both importable; returns the site-packages folder."""
    packages = tmp_path / "venv" / "lib" / "python3.11" / "site-packages"
    packages.mkdir(parents=True)
    (packages / f"{library[0]}.py").write_text(library[1])
    (tmp_path / f"{user[0]}.py").write_text(user[1])
    monkeypatch.syspath_prepend(str(packages))
    monkeypatch.syspath_prepend(str(tmp_path))
    return packages


def test_an_example_whose_layers_live_in_a_venv_points_at_the_users_line(tmp_path, monkeypatch):
    import jax
    import jax.numpy as jnp

    packages = _venv_layout(
        tmp_path,
        monkeypatch,
        library=("layers", "def dense(x):\n    return x @ x.T\n"),
        user=(
            "train",
            "import layers\n\n\ndef step(x):\n    y = x + 1.0\n    return layers.dense(y)  # the user's line\n",
        ),
    )
    train = importlib.import_module("train")
    text = jax.jit(train.step).lower(jnp.ones((4, 4))).compile().as_text()
    frames = stack_frames(text)
    dot = next(line for line in text.splitlines() if " dot(" in line)
    frame_id = int(dot.split("stack_frame_id=")[1].split()[0].rstrip("}"))
    assert frames.chain(frame_id)[0].file == str(packages / "layers.py")  # JAX kept the library's frame
    assert source_of({"stack_frame_id": frame_id}, frames) == Frame(str(tmp_path / "train.py"), 6, "step")


def test_a_helper_shared_by_two_call_sites_is_told_apart_by_its_callers(tmp_path, monkeypatch):
    """A model written with one einsum helper: every matmul's innermost line is the helper's; the chain names the
    call site (attention's or the MLP's) and steps over a library layer between the user's frames; outside
    `lab inspect` the code that called jit (this test) is the chain's outermost user frame."""
    import jax
    import jax.numpy as jnp

    _venv_layout(
        tmp_path,
        monkeypatch,
        library=("wrap", "def call(f, x):\n    return f(x)\n"),
        user=(
            "model",
            "import jax.numpy as jnp\nimport wrap\n\n\n"
            "def einsum(x):\n    return jnp.einsum('ij,kj->ik', x, x)\n\n\n"
            "def attention(x):\n    return einsum(x)\n\n\n"
            "def mlp(x):\n    return wrap.call(einsum, x)\n\n\n"
            "def forward(x):\n    return attention(x) + mlp(x * 2.0)\n",
        ),
    )
    model = importlib.import_module("model")
    text = jax.jit(model.forward).lower(jnp.ones((4, 4))).compile().as_text()
    frames = stack_frames(text)
    chains = set()
    for line in text.splitlines():
        if "stack_frame_id=" in line and (" dot(" in line or "convolution(" in line):
            frame_id = int(line.split("stack_frame_id=")[1].split()[0].rstrip("},"))
            chain = [(Path(f.file).name, f.line, f.function) for f in stack_of({"stack_frame_id": frame_id}, frames)]
            assert chain[3][0] == Path(__file__).name  # the caller of jit (then the test runner's own frames)
            chains.add(tuple(chain[:3]))
    assert chains == {
        (("model.py", 6, "einsum"), ("model.py", 10, "attention"), ("model.py", 18, "forward")),
        (("model.py", 6, "einsum"), ("model.py", 14, "mlp"), ("model.py", 18, "forward")),
    }
