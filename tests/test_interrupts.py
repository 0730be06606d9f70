"""Ctrl-C and SIGTERM stop the lab with one line and the signal's exit code, however early they come.

The first seconds of every command are spent importing jax, flax and orbax; a
signal then used to print a ``KeyboardInterrupt`` traceback (Ctrl-C) or kill
the process without a word (SIGTERM). `lab.entry` answers both from the first
moment. The delays below land inside that import on any machine this suite
runs on (it takes seconds); what is asserted is the outcome, not the timing.
"""

import os
import pty
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIST = [sys.executable, "-m", "lab", "list"]
BENCH = [sys.executable, "-m", "lab", "bench", "collectives", "-b", "1M", "-e", "64M", "-n", "50"]


def _signalled(argv, signum, after_s: float) -> tuple[int, str]:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=ROOT, text=True)
    time.sleep(after_s)
    process.send_signal(signum)
    _, err = process.communicate(timeout=60)  # a generous bound: only a hang fails it
    return process.returncode, err


@pytest.mark.parametrize("after_s", [0.2, 1.0])
def test_ctrl_c_while_starting_is_one_line_and_130(after_s):
    code, err = _signalled(LIST, signal.SIGINT, after_s)
    assert code == 130, err[-2000:]
    assert err.strip() == "lab: interrupted", err[-2000:]  # one line, no traceback


@pytest.mark.parametrize("argv", [LIST, BENCH], ids=["list", "bench"])
def test_sigterm_while_starting_is_one_line_and_143(argv):
    code, err = _signalled(argv, signal.SIGTERM, 1.0)
    assert code == 143, err[-2000:]
    assert err.strip() == "lab: terminated", err[-2000:]


def test_sigterm_mid_sweep_stops_within_seconds_with_one_line_and_143():
    """On a terminal, once the sweep's bar shows (imports done, measuring), SIGTERM stops it."""
    controller, terminal = pty.openpty()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "TERM": "xterm", "COLUMNS": "120"}
    process = subprocess.Popen(BENCH, stdin=terminal, stdout=terminal, stderr=terminal, env=env, cwd=ROOT)
    os.close(terminal)
    out, sent = b"", None
    while True:
        try:
            chunk = os.read(controller, 4096)  # read all along: a full terminal would block the process
        except OSError:  # the terminal closed: the process is done
            break
        if not chunk:
            break
        out += chunk
        if sent is None and _mid_sweep(out):
            process.send_signal(signal.SIGTERM)
            sent = time.monotonic()
    os.close(controller)
    assert sent is not None, "the bar never showed a sweep under way:\n" + out.decode(errors="replace")[-2000:]
    assert process.wait(timeout=60) == 143, out.decode(errors="replace")[-2000:]
    assert time.monotonic() - sent < 30  # a generous bound: only an ignored signal fails it
    after = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.decode(errors="replace")).splitlines()[-1]
    assert after.strip() == "lab: terminated"


def _mid_sweep(out: bytes) -> bool:
    """The bar shows done < total: measuring, not finished (a bar drawn once at the end shows total/total)."""
    return any(int(done) < int(total) for done, total in re.findall(rb"bench .*?(\d+)/(\d+)", out))


LONG_COMPILE = '''
import sys
import textwrap

import jax
import jax.numpy as jnp


def chain(mesh):
    """1500 matmuls, each its own fusion: XLA:CPU compiles them for half a minute, tracing takes one second."""

    def f(x):
        for i in range(1500):
            x = jnp.sin(x @ x.T + i) * jnp.cos(x[::-1])
        return x

    print("built", file=sys.stderr, flush=True)
    return f, (jax.ShapeDtypeStruct((64, 64), jnp.float32),)
'''


@pytest.mark.parametrize(
    "signum, code, line, target",
    [
        (signal.SIGINT, 130, "lab: interrupted", "cpu:8"),
        (signal.SIGTERM, 143, "lab: terminated", "cpu:8"),
        (signal.SIGTERM, 143, "lab: terminated", "tpu:v5e:2x4"),  # libtpu compiles with descriptor 2 in a sink
    ],
)
def test_a_signal_during_a_compile_ends_the_process_within_seconds(tmp_path, signum, code, line, target):
    """XLA compiles in C++ and looks at no signal: the handler would run only when the compile returns, half a
    minute later. `lab.interrupts`' watcher ends the process when the main thread does not answer, says so on the
    user's stderr, and removes the command's temporary folder."""
    (tmp_path / "chain.py").write_text(LONG_COMPILE)
    argv = [sys.executable, "-m", "lab", "inspect", "--fn", f"{tmp_path / 'chain.py'}:chain", "--mesh", "data=8"]
    argv += ["--target", target]
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "TMPDIR": str(scratch)}
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=ROOT, text=True)
    assert process.stderr.readline().strip() == "built"
    time.sleep(3)  # tracing takes about one second of it: the rest is XLA's compile
    process.send_signal(signum)
    sent = time.monotonic()
    _, err = process.communicate(timeout=120)
    assert process.returncode == code, err[-2000:]
    assert err.strip().splitlines()[-1] == line and "Traceback" not in err, err[-2000:]  # XLA may log before it
    assert time.monotonic() - sent < 10  # the compile alone takes 30 s or more; only a waited-for compile fails it
    assert not list(scratch.iterdir())  # the compile's temporary folder (Shardy's record) went with the process


@pytest.mark.parametrize(
    ("signum", "code", "line"), [(signal.SIGINT, 130, "lab: interrupted"), (signal.SIGTERM, 143, "lab: terminated")]
)
def test_a_signal_handled_inside_a_gc_callback_still_stops_the_process(signum, code, line):
    """jax registers a garbage-collector callback; a handler that runs inside it raises where Python can only print
    "Exception ignored" and go on (seen: Ctrl-C lost mid-report). The stop must still end the process."""
    program = f"""
        import gc, os, signal, time
        from lab import interrupts
        interrupts.install()
        def callback(phase, info):
            if phase == "start":
                gc.callbacks.remove(callback)
                os.kill(os.getpid(), {int(signum)})
                for _ in range(1000):  # bytecodes for the handler to run on, inside the callback
                    pass
        gc.callbacks.append(callback)
        gc.collect()
        time.sleep(30)
        print("went on")
    """
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(program)], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert (result.returncode, result.stderr.strip(), result.stdout) == (code, line, "")
    assert time.monotonic() - started < 20


def _children(pid: int) -> set[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return {int(c) for c in path.read_text().split()} if path.exists() else set()


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads a process's children from /proc")
def test_sigterm_while_pages_run_two_at_a_time_ends_the_workers_too(tmp_path):
    argv = [sys.executable, "-m", "lab", "report", "--only", "oracle_checks", "reduce_scatter_pairing"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    argv += ["--results", str(tmp_path)]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=ROOT, text=True)
    deadline, workers = time.monotonic() + 60, set()
    while len(workers) < 2 and time.monotonic() < deadline:  # the pool's two workers (and its resource tracker)
        time.sleep(0.2)
        workers = _children(process.pid)
    time.sleep(2)  # the workers start JAX and begin measuring
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 143 and err.strip().splitlines()[-1] == "lab: terminated", err[-2000:]
    assert len(workers) >= 2
    time.sleep(2)
    assert not [pid for pid in workers if Path(f"/proc/{pid}").exists()], "a worker outlived the report"
    left = [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # pages.write's staging folders
    assert not left and all((page / "README.md").exists() for page in tmp_path.iterdir() if page.is_dir())
