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

libtpu's driver writes log files in every process that starts it (a compile-only target too): to
``/tmp/tpu_logs``, or, with ``TPU_LOG_DIR=disabled``, to glog's fallback, ``$TMPDIR`` (``/tmp``) itself: two to four
``tpu_driver.*`` files a process, hundreds over a few `lab report` runs, none of which the lab reads, and nothing in
them a user sees otherwise (libtpu prints only fatal lines to stderr). So `libtpu_logs_off_disk` sets
``TPU_LOG_DIR=disabled`` and ``TPU_MIN_LOG_LEVEL=3`` (glog then opens no file: it opens one on its first line below
fatal) unless the user's environment names a directory of its own; the processes the command starts inherit both.
libtpu's ``ERROR: ...`` lines for a flag it rejects are printed, not logged, and still reach `lab.targets.libtpu`.
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
    libtpu_logs_off_disk(os.environ)
    from lab import cli  # imported here, once the handlers above are set: it imports jax, flax and orbax (seconds)

    return cli.main()  # which hands both signals to lab.interrupts


def libtpu_logs_off_disk(environ) -> None:
    """No libtpu log file in `environ`'s processes, unless it names a ``TPU_LOG_DIR`` of its own (see above)."""
    if "TPU_LOG_DIR" not in environ:
        environ["TPU_LOG_DIR"] = "disabled"
        environ.setdefault("TPU_MIN_LOG_LEVEL", "3")


def _stop_at_once(signum: int, frame) -> None:
    """The signal arrived while Python was importing: nothing to unwind, nothing written yet."""
    sys.stderr.write(MESSAGES[signum] + "\n")
    sys.stderr.flush()
    os._exit(EXIT_CODES[signum])
