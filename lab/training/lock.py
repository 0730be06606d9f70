"""One run per folder: an advisory lock a run holds for its whole life.

`lab train` writes three things that another run must not share: its
checkpoint folder, and its page and metrics log under ``--results`` and
``--name``. Each is guarded by an exclusive ``flock`` on a small lock file
(``<checkpoints>/.lock``, ``<results>/.<name>.lock``) that records the owner's
pid. The lock is taken before anything is compiled or written and released by
closing the file, which the kernel also does when the process dies: a crash
leaves nothing to clean up. A second run asking for a held lock is refused with
one line naming the owner, instead of interleaving its files with the first's.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import TextIO

from lab.errors import LabError


def hold(path: Path, what: str, advice: str) -> TextIO:
    """Take the lock at `path` (its folder is created) or raise a `LabError`: "`what` is in use by another run
    (pid N); `advice`". Close the returned file to release it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = path.open("a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        owner = handle.read().strip() or "another process"
        handle.close()
        raise LabError(f"{what} is in use by another run ({owner}); {advice}") from None
    handle.truncate(0)
    handle.write(f"pid {os.getpid()}\n")
    handle.flush()
    return handle
