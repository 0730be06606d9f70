"""Untimed pages two at a time: how `lab report` keeps a 2-core machine busy without touching a clock.

A page that times something (a collective's bandwidth, a training step) must
run alone: a second job on the machine would be in its numbers. A page that
only compiles and reads what XLA wrote (every compile-only TPU or GPU page,
and the CPU pages marked ``UNTIMED``) reads no clock, and XLA's compiler keeps
about 1.5 of 2 cores busy. So `lab report` measures the timed pages one after
another in its own process, then the untimed ones two at a time, each in a
child process (``python -m lab.side_by_side TARGET RESULTS NAME COMMAND``: JAX's
backends start there as in the parent, on the same target), and reads each
page back as it is written.

A child writes its page itself and says in its provenance that it ran beside
another page: the compile seconds such a page shows are a shared machine's.
Its output goes nowhere but its errors to the parent's stderr; it leaves
Ctrl-C to the parent, which stops the children on any stop of its own
(SIGTERM, which unwinds the child so that no half-written page stays behind,
then SIGKILL for one still inside a compile).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path

from lab import report as pages
from lab.errors import LabError
from lab.provenance import command
from lab.registry import get
from lab.report import Result

WORKERS = 2
BESIDE = "another page (lab report measures untimed pages two at a time): clocks on this page ran on a shared machine"
POLL_S = 0.2
STOP_S = 5.0  # how long a stopped child may take to leave cleanly before it is killed


def run(names: Sequence[str], target: str, results: Path) -> Iterator[tuple[Result, float]]:
    """Measure, judge and write each named experiment, two at a time; yields (result, seconds) as each ends."""
    waiting, running = list(names), {}
    try:
        while waiting or running:
            while waiting and len(running) < WORKERS:
                name = waiting.pop(0)
                argv = [sys.executable, "-m", "lab.side_by_side", target, str(results), name, command()]
                running[name] = (
                    subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL),
                    time.perf_counter(),
                )
            time.sleep(POLL_S)
            for name, (child, started) in list(running.items()):
                if child.poll() is None:
                    continue
                del running[name]
                if child.returncode:
                    raise LabError(
                        f"{name} stopped with exit code {child.returncode} while measured beside another page (its "
                        f"lines above); `lab report --only {name}` measures it alone"
                    )
                yield pages.read(results / name), time.perf_counter() - started
    finally:  # a stop here stops the children: asked first (a page being written finishes or is removed), then made
        for child, _ in running.values():
            child.terminate()
        for child, _ in running.values():
            try:
                child.wait(timeout=STOP_S)
            except subprocess.TimeoutExpired:  # inside a compile, where Python's handler cannot run yet
                child.kill()
                child.wait()


def main(argv: Sequence[str]) -> None:
    """A child: measure, judge and write one page on the parent's target."""
    from lab.targets.devices import devices_for  # local: starts JAX's backends, in the child only

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C reaches the parent too, which stops us
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds: a page half written is removed
    target, results, name, typed = argv
    devices_for(target)
    experiment = get(name)
    result = experiment.run(experiment.report_config(target))
    pages.write(replace(result, provenance={**result.provenance, "command": typed, "beside": BESIDE}), Path(results))


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except LabError as err:
        print(f"lab report: {sys.argv[3]}: {err}", file=sys.stderr, flush=True)
        os._exit(2)  # not a normal return: XLA's threads may still run (see lab.interrupts.exit_now)
