"""Test set-up: 8 emulated CPU devices, fixed before JAX starts its backends.

A test that needs another device count, or several processes, runs in a
subprocess (see `run_python`).
"""

import json
import os
import subprocess
import sys
import textwrap

from lab.entry import libtpu_logs_off_disk

os.environ["JAX_PLATFORMS"] = "cpu"
# The tests check what XLA's passes decide (collectives, shardings, buffers, schedules) and the numbers programs
# compute, never how fast the machine code runs. JAX's switch for LLVM's optimizations of that code leaves the
# optimized HLO and the memory analysis the same text and bytes (CPU, the CUDA plugin and libtpu alike: the
# examples, a GPU and a TPU compile, checked) and takes about 40% off every CPU compile. An environment variable,
# so the `lab` subprocesses the tests start inherit it. `lab report`, whose pages time programs, leaves it off.
os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"
libtpu_logs_off_disk(os.environ)  # as the `lab` command does: no libtpu log files in /tmp

import jax  # noqa: E402 (after the environment above, which JAX reads when it starts)

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)

# rich reads these to override what a terminal is: a CI that exports TTY_INTERACTIVE=0 has it draw a bar only when the
# sweep is over, and the tests that drive `lab` on a pseudo-terminal would never see one mid-sweep
for name in ("TTY_COMPATIBLE", "TTY_INTERACTIVE", "FORCE_COLOR"):
    os.environ.pop(name, None)

# imported only after the environment and JAX's config above are set, on purpose: they must come before anything else
import pytest  # noqa: E402


@pytest.fixture(scope="session")
def devices():
    from lab.targets.devices import devices_for

    return devices_for("cpu:8")


@pytest.fixture(scope="session")
def mesh222(devices):
    """data=2, fsdp=2, tensor=2 on the 8 CPU devices."""
    from lab.mesh import MeshSpec

    return MeshSpec.parse("data=2,fsdp=2,tensor=2").build(devices)


def run_python(code: str, *, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter (its own JAX, its own device count)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


def run_lab_json(argv: list[str], *, timeout: int = 600) -> dict:
    """`python -m lab ARGV --json` in a fresh process, as a user runs it (a compiler reads its flags once, when it
    starts); the JSON it prints."""
    done = subprocess.run(
        [sys.executable, "-m", "lab", *argv, "--json"], capture_output=True, text=True, timeout=timeout, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def pytest_collection_modifyitems(items):
    """Modules marked ``long`` (each compiles programs for a minute or more) go first: the two xdist workers take
    whole files in collection order, so a long file collected last would run alone on one core at the end."""
    items.sort(key=lambda item: item.get_closest_marker("long") is None)  # stable: the order is otherwise kept
