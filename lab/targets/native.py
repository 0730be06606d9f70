"""JAX's native side in one process of a distributed run: its C++ log, and the aborts that end the process.

The distributed runtime (the coordination service and its agent in every
process, gRPC underneath, gloo for CPU collectives) logs through absl straight
to file descriptor 2, so Python's ``sys.stderr`` cannot catch it: connection
chatter, ``E...`` lines, and when something goes wrong for good a ``F...``
line from ``client.h`` followed by a C++ stack dump and ``abort()``. That
fatal path is how every process learns that a peer stopped sending heartbeats,
that the others never joined within the initialization timeout, or that a
process id joined twice. jaxlib lets a caller replace it with a Python
callback (``missed_heartbeat_callback``), but the binding cannot pass the
status to Python (``std::bad_cast``), so the abort itself is what we handle.

`divert` moves descriptors 2 and 1 (gloo prints its connection chatter on
stdout) into a log file for the rest of the process (the native text is kept,
not thrown away) and points ``sys.stderr`` and ``sys.stdout`` back at the
terminal, so the lab's own lines, progress bars and Python tracebacks
still show. It installs a C-level SIGABRT handler that reads the fatal message
back from that file, prints one line saying what happened (and where the full
log is), and exits with code 1 at once: no stack dump, no ``Aborted (core
dumped)`` from the shell. A Python ``signal.signal`` handler could not do it,
as it would only run after the aborting thread had already killed the process.

When a peer dies, the survivors' gloo collectives may fail first ("connection
reset by peer") in the main thread; `await_verdict` then waits for the
coordinator's verdict, which names the process that stopped.
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import NoReturn

from lab.errors import LabError

EXIT_CODE = 1  # the run failed (not a user's typo, which is LabError's 2)

_handler = None  # the ctypes callback must outlive this call: libc keeps only its address


def divert(label: str, timeout_s: float) -> Path:
    """Send this process's native stderr to a log file and turn a native abort into one line; return the file.

    `label` names the file (``process0``); `timeout_s` is the initialization timeout the one line quotes."""
    fd, name = tempfile.mkstemp(prefix=f"lab-jax-{label}-", suffix=".log")
    log = Path(name)
    sys.stdout.flush()
    sys.stderr.flush()
    terminal, screen = os.dup(2), os.dup(1)
    os.dup2(fd, 2)
    os.dup2(fd, 1)  # gloo prints its connection chatter on stdout
    os.close(fd)
    sys.stderr = os.fdopen(terminal, "w", buffering=1, errors="backslashreplace")
    sys.stdout = os.fdopen(screen, "w", buffering=1, errors="backslashreplace")
    _on_abort(log, terminal, timeout_s)
    return log


def _on_abort(log: Path, terminal: int, timeout_s: float) -> None:
    global _handler

    first = threading.Lock()

    def stop(signum: int) -> None:
        # two of the runtime's threads may abort at once (the error poller, a failed RPC): the first one says its
        # line and exits; a second waits here, without the GIL, never to return
        first.acquire()
        try:
            line = f"lab: error: {explain(log.read_text(errors='replace'), timeout_s)} (JAX's log: {log})\n"
        except BaseException:  # nothing may escape a signal handler: say at least where the log is
            line = f"lab: error: JAX's distributed runtime stopped this process; see {log}\n"
        clear = "\r\x1b[2K" if os.isatty(terminal) else ""  # over a progress bar's half-drawn line
        os.write(terminal, (clear + line).encode())
        os._exit(EXIT_CODE)

    _handler = ctypes.CFUNCTYPE(None, ctypes.c_int)(stop)
    libc = ctypes.CDLL(None)
    libc.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
    libc.signal.restype = ctypes.c_void_p
    libc.signal(signal.SIGABRT, ctypes.cast(_handler, ctypes.c_void_p))


_STATUS = re.compile(r"Terminating process because.*?absl::Status: (?P<status>.*?)(?:\nRPC:|\[type\.|\Z)", re.S)


def explain(native_log: str, timeout_s: float) -> str:
    """One sentence for the fatal message in a native log: what happened, and what to do."""
    found = list(_STATUS.finditer(native_log))
    if not found:
        tail = [line for line in native_log.splitlines() if line.startswith(("F", "E"))]
        return "JAX's distributed runtime stopped this process" + (f": {tail[-1][:200]}" if tail else "")
    status = found[-1]["status"]
    # the service names the silent task in one of two forms; a later fatal status (a failed shutdown) may quote it
    silent = re.findall(r"Task (\d+) heartbeat timeout", native_log) + re.findall(
        r"stopped sending heartbeats\):\s*\n((?:\s*\d+\s*\n)+)", native_log
    )
    if silent or "stopped sending heartbeats" in status:
        ids = sorted({int(i) for found_ids in silent for i in found_ids.split()})
        who = f"process {', '.join(map(str, ids))}" if ids else "another process"
        return (
            f"{who} of this run stopped sending heartbeats (it died, was killed, or lost the network); "
            "this process stops too"
        )
    if "incarnation" in status or "already in error" in status:
        task = re.search(r"(\d+) unexpectedly tried to connect", status)
        which = f"--process-id {task[1]}" if task else "one --process-id"
        return f"two processes joined with {which} (or that process restarted); give each process its own --process-id"
    if "DEADLINE_EXCEEDED" in status and "RegisterTask" in native_log:
        return (
            f"the processes of this run did not all join within {timeout_s:g} s; start all --num-processes of them "
            "with the same --coordinator, each with its own --process-id"
        )
    if "UNAVAILABLE" in status:
        return (
            "this process lost the coordinator (process 0 died, was killed, or the network failed); this process "
            "stops too"
        )
    return f"JAX's distributed runtime stopped this process: {' '.join(status.split())[:200]}"


def await_verdict(err: Exception, heartbeat_s: float) -> NoReturn:
    """A collective across the processes failed (gloo: "connection reset by peer"): a peer has almost surely
    stopped. The coordination service names it within the heartbeat timeout, and the abort handler above turns
    that into the one line and the exit; wait for it rather than guess, then say what is known."""
    time.sleep(heartbeat_s + 10)
    detail = str(err).splitlines()[0][:200] if str(err) else type(err).__name__
    raise LabError(
        f"a collective across the processes failed ({detail}) and the coordinator named no stopped process within "
        f"{heartbeat_s + 10:g} s; look at every process's output"
    )
