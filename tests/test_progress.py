"""Progress bars show on a terminal and stay out of pipes and logs (run under a pseudo-terminal)."""

import os
import pty
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = [sys.executable, "-m", "lab", "bench", "-b", "1K", "-e", "4K", "--ops", "all-reduce", "-n", "2"]
BAR = re.compile(r"bench .*\d+/\d+ \d:\d\d:\d\d")  # the sweep's bar: its name, done/total, time elapsed


def _on_a_terminal(argv) -> str:
    controller, terminal = pty.openpty()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "TERM": "xterm", "COLUMNS": "120"}
    process = subprocess.Popen(argv, stdin=terminal, stdout=terminal, stderr=terminal, env=env, cwd=ROOT)
    os.close(terminal)
    out = b""
    while True:
        try:
            chunk = os.read(controller, 4096)
        except OSError:  # the terminal closed: the process is done
            break
        if not chunk:
            break
        out += chunk
    os.close(controller)
    assert process.wait(timeout=120) == 0, out.decode(errors="replace")[-2000:]
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.decode(errors="replace"))  # without the colours


def test_a_sweep_shows_its_bar_on_a_terminal():
    assert BAR.search(_on_a_terminal(BENCH))


def test_a_pipe_gets_the_table_without_a_bar():
    piped = subprocess.run(BENCH, capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"}, cwd=ROOT)
    assert piped.returncode == 0 and "all-reduce" in piped.stdout
    assert not BAR.search(piped.stdout + piped.stderr)


def test_ctrl_c_mid_run_stops_at_once_with_one_line_and_leaves_the_pages(tmp_path):
    import signal
    import time

    # a page that measures for tens of seconds, so the signal lands mid-run however fast this machine is
    argv = [sys.executable, "-m", "lab", "report", "--only", "collectives", "--results", str(tmp_path)]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=ROOT, text=True)
    first = process.stderr.readline()  # "collectives (#39) ...": imports done, measuring
    assert "collectives" in first
    time.sleep(0.5)
    process.send_signal(signal.SIGINT)
    stopped = time.monotonic()
    _, err = process.communicate(timeout=30)
    assert process.returncode == 130 and time.monotonic() - stopped < 10
    assert err.strip() == "lab: interrupted" and not list(tmp_path.iterdir())  # no page, no staging folder
