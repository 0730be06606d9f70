"""The ``lab`` command's entry point: Ctrl-C and SIGTERM are answered from the first moment.

Starting ``lab`` imports jax, flax, orbax and tyro, which takes seconds. A
Ctrl-C in that time would raise ``KeyboardInterrupt`` wherever the import
happens to be and print its traceback, and a SIGTERM would kill the process
without a word. So this module imports nothing of the lab's but `lab.interrupts` (the
standard library only) and `lab.cli`, and that only once handlers are in place that print one line (``lab:
interrupted``, ``lab: terminated``) and exit at once with the signal's code
(130, 143), as the command does later on. It relies on the package ``lab``
itself importing nothing heavy: ``lab/__init__.py`` must load its public names
on first use, or ``python -m lab`` and the console script spend those seconds
there, before this module runs.

Once `lab.cli` is imported, `lab.interrupts` takes both over: from then on they
unwind the running command (an asynchronous checkpoint save finishes) before
the same line and code, and a compile that holds the main thread is abandoned.

libtpu's driver writes a set of log files to ``/tmp/tpu_logs`` in every process that starts it (a compile-only
target too): hundreds of files over a few `lab report` runs, none of which the lab reads. So the command sets
``TPU_LOG_DIR=disabled`` (libtpu then logs to stderr only, at its usual level) unless the user's environment names a
directory of its own; the processes the command starts inherit it.
"""

from __future__ import annotations

import os
import signal
import sys

from lab.interrupts import EXIT_CODES, MESSAGES  # the standard library only: imported in no time


def main() -> int:
    """Entry point of the ``lab`` console script and of ``python -m lab``."""
    for signum in EXIT_CODES:
        signal.signal(signum, _stop_at_once)
    os.environ.setdefault("TPU_LOG_DIR", "disabled")
    from lab import cli  # imported here, once the handlers above are set: it imports jax, flax and orbax (seconds)

    return cli.main()  # which hands both signals to lab.interrupts


def _stop_at_once(signum: int, frame) -> None:
    """The signal arrived while Python was importing: nothing to unwind, nothing written yet."""
    sys.stderr.write(MESSAGES[signum] + "\n")
    sys.stderr.flush()
    os._exit(EXIT_CODES[signum])
