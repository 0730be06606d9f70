"""The user's own program for ``lab inspect --fn`` and ``lab predict --fn``: load ``FILE.py:NAME`` or
``package.module:NAME`` and call it.

The one convention: ``NAME(mesh)`` returns ``(fn, args)``, a function and the
arguments to call it with, where an argument may be abstract
(``jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P(...)))``)
so that a 70B-parameter step is compiled without allocating it. ``args`` is a
tuple (or list) of positional arguments; a single non-sequence value is one
argument. The lab chooses the devices (emulated CPU devices before JAX starts,
or a compile-only topology) and builds the mesh before it imports the file,
so the user's module may build arrays at import time on the right devices,
and it calls ``NAME`` and compiles ``fn`` with the mesh in context, as the
user's own script would (`in_context`): ``jax.set_mesh(mesh)``, which flax's
eager sharding and bare PartitionSpecs need, and the resource environment of
``with mesh:``, where ``pjit``-era code (t5x, early MaxText) resolves its
PartitionSpecs.

Everything that can go wrong in someone else's code is one line here: a file
or module that does not exist or raises on import, a NAME that is missing or
not callable, a builder that does not take a mesh, raises (a ``sys.exit`` or
another `BaseException` too), or returns something that is not
``(fn, args)``. What the user's code prints goes to stderr, so ``--json``
stays parseable.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import signal
import sys
import threading
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import jax

from lab.errors import LabError
from lab.interrupts import Terminated

_LAB = str(Path(__file__).resolve().parent)
_FORMS = "FILE.py:NAME or package.module:NAME, where NAME(mesh) returns (fn, args)"
T = TypeVar("T")


def load(spec: str) -> Callable:
    """The builder named by ``FILE.py:NAME`` or ``package.module:NAME``."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name.isidentifier():
        raise LabError(f"--fn {spec!r}: write {_FORMS}")
    module = _import_file(spec, Path(where)) if where.endswith(".py") else _import_module(spec, where)
    builder = getattr(module, name, None)
    if builder is None:
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))[:8]
        raise LabError(f"--fn {spec!r}: {where} has no {name!r} (it defines {', '.join(public) or 'no functions'})")
    if not callable(builder):
        raise LabError(f"--fn {spec!r}: {name} is of type {type(builder).__name__}, not a function of the mesh")
    return builder


def build(builder: Callable, mesh, spec: str, *, compile_only: bool = False) -> tuple[Callable, tuple[Any, ...]]:
    """Call ``builder(mesh)`` and check that it returned ``(fn, args)``."""
    try:
        inspect.signature(builder).bind(mesh)
    except TypeError:
        raise LabError(f"--fn {spec!r}: {builder.__name__} must take one argument, the mesh: def NAME(mesh)") from None
    except ValueError:
        pass  # a builtin or C function without a signature: just call it
    with blamed(spec, f"{builder.__name__}(mesh)", compile_only), in_context(mesh):  # as the user's script runs it
        made = builder(mesh)
    if not (isinstance(made, (tuple, list)) and len(made) == 2 and callable(made[0])):
        raise LabError(
            f"--fn {spec!r}: {builder.__name__}(mesh) returned {_kind(made)}; it must return (fn, args), "
            "a function and its arguments"
        )
    fn, args = made
    return fn, tuple(args) if isinstance(args, (tuple, list)) else (args,)


def leaf_names(fn: Callable, args: tuple[Any, ...]) -> dict[str, str]:
    """The names JAX gives the leaves of flax NNX objects that ``nnx.jit`` passes flattened, by position
    (``model.states[0][3]``) -> the names ``jax.jit`` gives the same leaves (``model.l2.kernel.value``).

    ``nnx.jit`` hands JAX each object's state as one list of leaves, in the order the object flattens as a pytree;
    other arguments are named by JAX as the user wrote them, and keep their names."""
    nnx = sys.modules.get("flax.nnx")  # only a program that imported it passes NNX objects
    try:
        arguments = inspect.signature(fn).bind(*args).arguments if nnx is not None else {}
    except (TypeError, ValueError):
        return {}
    names = {}
    for name, value in arguments.items():
        if nnx.graph.is_graph_node(value):
            leaves = jax.tree_util.tree_flatten_with_path(value)[0]
            names |= {f"{name}.states[0][{k}]": name + jax.tree_util.keystr(path) for k, (path, _) in enumerate(leaves)}
    return names


@contextlib.contextmanager
def in_context(mesh) -> Iterator[None]:
    """`mesh` in context for the user's code, as programs of each JAX era look for it: ``jax.set_mesh`` and, unless
    JAX is configured to refuse it, the deprecated ``with mesh:`` that ``jax.experimental.pjit`` still reads."""
    legacy = contextlib.nullcontext() if jax.config.jax_disallow_mesh_context_manager else mesh
    with jax.set_mesh(mesh), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "`with mesh:`", DeprecationWarning)
        with legacy:
            yield


def in_its_context(run: Callable[[], T], mesh) -> T:
    """``run()``, the tracing of the user's step, with `mesh` in context (`in_context`); a step that brings a mesh
    of its own (``jax.pmap``, which runs as a shard_map over its axis name; a shard_map over a mesh the builder
    made and does not lay its arguments on) is traced again without it, as its own script runs it."""
    try:
        with in_context(mesh):
            return run()
    except ValueError as err:
        if "should match the mesh passed to shard_map" not in str(err):
            raise
    return run()


def own_mesh(args, mesh, spec: str):
    """The mesh of the first argument laid out on a mesh of its own over the same devices (a builder that made one
    with jax.make_mesh and its own axis names: the collectives are named by those), else the lab's `mesh`.

    An argument whose sharding is a bare PartitionSpec (``ShapeDtypeStruct(..., sharding=P(...))``) is read with
    the lab's mesh in context, as its step will be compiled; one naming axes that mesh does not have was made for
    a mesh of the builder's own, which the lab cannot know: one line says what to write instead."""
    with in_context(mesh):
        for leaf in jax.tree.leaves(args):
            try:
                own = getattr(getattr(leaf, "sharding", None), "mesh", None)
            except (TypeError, ValueError) as err:
                raise LabError(
                    f"--fn {spec!r}: an argument's sharding cannot be read on the lab's mesh ({_one_line(err)}); a "
                    "bare PartitionSpec is resolved against the mesh in context: give it NamedSharding(mesh, P(...)) "
                    "with the mesh your builder lays it out on"
                ) from None
            if isinstance(own, jax.sharding.Mesh) and own != mesh and set(own.devices.flat) == set(mesh.devices.flat):
                return own
    return mesh


class OutOfTime(BaseException):
    """Raised in the main thread when the user's code runs past its bound (`bounded`)."""


@contextlib.contextmanager
def bounded(seconds: float) -> Iterator[None]:
    """Stop the user's Python code (importing, building, tracing) after `seconds` (0: no bound) with `OutOfTime`.

    A timer signal, so it reaches Python code only: a compile inside XLA runs to its end first."""
    if seconds <= 0 or threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise OutOfTime(seconds)

    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@contextlib.contextmanager
def blamed(spec: str, doing: str, compile_only: bool = False, option: str = "--fn") -> Iterator[None]:
    """The user's code fenced: any failure inside (their code, or JAX tracing it), a ``sys.exit`` or another
    `BaseException` included, becomes one line naming what raised it and where; what it prints goes to stderr, so
    ``--json`` output stays JSON. Only Ctrl-C and SIGTERM pass through, to stop the lab as they stop it anywhere.
    `option` names where the program came from (``--fn``, or ``--program`` for one of the lab's)."""
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    except (LabError, KeyboardInterrupt, Terminated):
        raise
    except OutOfTime as err:
        raise LabError(
            f"{option} {spec!r}: {doing} did not finish within {err.args[0]:g} s (--timeout); make it return, or give "
            "more time with --timeout"
        ) from None
    except SystemExit as err:
        raise LabError(
            f"{option} {spec!r}: {doing} called sys.exit({err.code!r}); the file is imported and NAME(mesh) called by "
            "the lab: return (fn, args) instead of exiting"
        ) from None
    except BaseException as err:  # the user's code: any failure is theirs to see, in one line with its place
        raise LabError(
            f"{option} {spec!r}: {doing} raised {_one_line(err)}{_hint(err, compile_only, option)}"
        ) from None


def _hint(err: BaseException, compile_only: bool, option: str) -> str:
    """What to change in the lab's command for a failure the user's code did not cause: a program written for the
    other kind of mesh axes (JAX's explicit sharding against its automatic one), an op only TPU's and GPU's
    compilers have, or arrays on a compile-only target."""
    if option != "--fn":
        return ""
    if "of type: AxisType.Auto" in str(err):  # out_sharding=, reshard: explicit sharding's annotations
        return "; the program shards explicitly (out_sharding=, reshard): give --axis-types explicit"
    if "of type `Explicit`" in str(err):  # with_sharding_constraint is an assertion on explicit axes
        return "; the program leaves layouts to the partitioner: give --axis-types auto (the default)"
    if "not supported by XLA:CPU" in str(err):  # ragged_all_to_all: TPU's and GPU's compilers have it
        return "; XLA:CPU cannot compile it: compile for a TPU or GPU target, e.g. --target tpu:v5e:2x4"
    if "Only interpret mode is supported on CPU" in str(err):  # a Pallas TPU kernel: Mosaic compiles it for TPU
        return "; a Pallas TPU kernel compiles for TPU only: give a compile-only TPU target, e.g. --target tpu:v5e:2x4"
    if compile_only and _this_machines_devices(str(err)):
        return (
            "; on a compile-only target jax.devices() lists this machine's devices, not the target's: build the "
            "mesh from mesh.devices, the target's, which NAME(mesh) is given"
        )
    if compile_only and _ran(err):
        return (
            "; on a compile-only target nothing runs: make every argument abstract (jax.ShapeDtypeStruct, "
            "jax.eval_shape) and create no arrays"
        )
    return ""


def _ran(err: BaseException) -> bool:
    """Whether the failure came from running something on the devices (JAX's dispatch or its arrays), not from
    the program's own checks (a shard_map's specs) or its compile."""
    frames = traceback.extract_tb(err.__traceback__)
    return any(Path(f.filename).name in ("dispatch.py", "array.py") and "jax" in f.filename for f in frames)


def _this_machines_devices(message: str) -> bool:
    """A mesh of ``jax.devices()`` on a compile-only target: this machine's devices, too few to reshape (one CPU)
    or of another platform than the target's mesh."""
    return "cannot reshape array of size" in message or (
        "Received incompatible devices" in message and "on platform CPU" in message
    )


def _import_file(spec: str, path: Path):
    if not path.is_file():
        raise LabError(f"--fn {spec!r}: no file {path}")
    name = f"_lab_user_{path.stem}"
    loader = importlib.util.spec_from_file_location(name, path)
    if loader is None or loader.loader is None:
        raise LabError(f"--fn {spec!r}: {path} cannot be imported as Python")
    module = importlib.util.module_from_spec(loader)
    sys.modules[name] = module  # dataclasses and pickling look modules up by name
    sys.path.insert(0, str(path.resolve().parent))  # its sibling modules import as they would from a script
    try:
        with blamed(spec, f"importing {path}"):
            loader.loader.exec_module(module)
    except LabError:
        sys.modules.pop(name, None)
        raise
    finally:
        sys.path.remove(str(path.resolve().parent))
    return module


def _import_module(spec: str, dotted: str):
    with blamed(spec, f"importing {dotted}"):
        try:
            return importlib.import_module(dotted)
        except ModuleNotFoundError as err:
            if err.name and dotted.startswith(err.name):  # the module named, not one it imports
                raise LabError(f"--fn {spec!r}: no module {dotted!r} (write {_FORMS})") from None
            raise


def _one_line(err: BaseException) -> str:
    """``ValueError: bad shape (model.py:12)``: the error and the innermost line of the user's code."""
    frames = [f for f in traceback.extract_tb(err.__traceback__) if not f.filename.startswith(_LAB)]
    at = f" ({Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
    message = " ".join(str(err).split())[:300]
    return f"{type(err).__name__}: {message}{at}" if message else f"{type(err).__name__}{at}"


def _kind(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)} items"
    return "None" if value is None else f"a value of type {type(value).__name__}"
