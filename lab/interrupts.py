"""How the ``lab`` command stops on Ctrl-C and SIGTERM: one line, the signal's exit code, within a second or two.

Python runs a signal handler in the main thread, between two bytecodes. Once
`install` has run, Ctrl-C raises ``KeyboardInterrupt`` and SIGTERM `Terminated`
there, so the running command unwinds (an asynchronous checkpoint save
finishes) and `lab.cli` prints ``lab: interrupted`` or ``lab: terminated``
and leaves with 130 or 143 (`exit_now`).

A compile is the exception. libtpu and XLA compile in C++ for seconds to
minutes without returning to the interpreter, and look at no signal, so the
handler would run only when the compile returns (83 s late, measured on a
libtpu compile). `install` therefore also has the C-level handler write each
signal's number to a pipe (`signal.set_wakeup_fd`, done at once, whatever the
main thread is doing) and a watcher thread read it: when the main thread's
handler has not run `GRACE_S` seconds after the signal, the main thread is held
by native code, and the watcher prints the line and ends the process itself.
The compiler releases Python's lock while it works, so the watcher runs. A
TPU or GPU compile runs with descriptor 2 pointed at a sink (its C++ log is not
the user's), so the line goes to where stderr was when `install` ran.

A handler that runs inside a finalizer or a garbage-collector callback (jax
registers one) raises where Python cannot propagate: the exception is printed
as "Exception ignored in ..." and the command would go on. `install` therefore
also hooks `sys.unraisablehook`: a swallowed ``KeyboardInterrupt`` or
`Terminated` ends the process there, with its line.
Nothing half-written is left by ending there: pages and checkpoints are
written whole and renamed into place. Ending there skips ``finally`` blocks
and ``atexit``, so what must go however the process ends (the command's
scratch folder, `lab.cli`) is registered with `on_leave` and removed first.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import NoReturn

EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 128 + signal.SIGTERM}  # the shell's 128 + signal number
MESSAGES = {signal.SIGINT: "lab: interrupted", signal.SIGTERM: "lab: terminated"}
GRACE_S = 1.0  # how long the main thread's handler may take to run before the watcher stops the process


class Terminated(BaseException):
    """SIGTERM, raised in the main thread like Ctrl-C's KeyboardInterrupt."""


_on_leave: list[Callable[[], object]] = []  # run by `_leave`, last registered first
_terminal = [2]  # the descriptor the user's stderr was at `install` (a compile may point 2 at a sink meanwhile)
_answered = [0]  # signals the main thread's handlers have run for (the watcher compares with those it read)
_installed = False


def install() -> None:
    """Ctrl-C and SIGTERM raise in the main thread, and stop the process from a watcher when it cannot run.

    Outside the main thread (a notebook's worker calling the lab) signals are left as they are.
    """
    global _installed
    if threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _terminate)
    if _installed:
        return
    _installed = True
    _terminal[0] = os.dup(2)
    sys.unraisablehook = _unraisable(sys.unraisablehook)
    read, write = os.pipe()
    os.set_blocking(write, False)
    with contextlib.suppress(ValueError):  # a wakeup fd somebody else set (an event loop): leave theirs
        theirs = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        if theirs != -1:
            signal.set_wakeup_fd(theirs)
            return
        threading.Thread(target=_watch, args=(read,), name="lab-signal-watcher", daemon=True).start()


@contextlib.contextmanager
def on_leave(cleanup: Callable[[], object]) -> Iterator[None]:
    """While inside, have `cleanup` run if a signal ends the process here, where ``finally`` blocks and ``atexit``
    do not (the block's own ``finally`` does it when the block ends otherwise)."""
    _on_leave.append(cleanup)
    try:
        yield
    finally:
        _on_leave.remove(cleanup)


def exit_now(stop: BaseException) -> NoReturn:
    """One line, then exit at once with the signal's code (130, 143).

    Not a normal return: XLA's compiler and orbax's writer threads may still be running, and tearing the
    interpreter down under them crashes (a segfault seconds later).
    """
    signum = signal.SIGINT if isinstance(stop, KeyboardInterrupt) else signal.SIGTERM
    sys.stdout.flush()
    _leave(signum)


def _interrupt(signum, frame) -> None:
    _answered[0] += 1
    raise KeyboardInterrupt


def _terminate(signum, frame) -> None:
    _answered[0] += 1
    raise Terminated


def _unraisable(previous):
    """`sys.unraisablehook` that ends the process on a stop Python could not raise (in a gc callback, a finalizer)."""

    def hook(unraisable) -> None:
        if isinstance(unraisable.exc_value, KeyboardInterrupt | Terminated):
            _leave(signal.SIGINT if isinstance(unraisable.exc_value, KeyboardInterrupt) else signal.SIGTERM)
        previous(unraisable)

    return hook


def _watch(read: int) -> None:
    """Each signal's number as the C handler wrote it; the process ended when the main thread does not answer."""
    seen = 0
    while True:
        stops = [signal.Signals(n) for n in os.read(read, 64) if n in MESSAGES]
        seen += len(stops)
        deadline = time.monotonic() + GRACE_S
        while stops and _answered[0] < seen and time.monotonic() < deadline:
            time.sleep(0.05)
        if stops and _answered[0] < seen:
            _leave(stops[0])


_leaving = threading.Lock()  # the watcher and the main thread may both decide to leave: one line, once


def _leave(signum: int) -> NoReturn:
    _leaving.acquire()  # the second caller waits here for the first one's os._exit
    sys.stderr.flush()
    os.write(_terminal[0], (MESSAGES[signum] + "\n").encode())
    for cleanup in reversed(_on_leave):
        with contextlib.suppress(Exception):
            cleanup()
    os._exit(EXIT_CODES[signum])
