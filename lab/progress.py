"""Progress bars for long sweeps, shared by `lab report` and single runs.

`lab report` opens one `rich.progress.Progress` for the whole run; an
experiment's sweep adds its own bar to it with `track`. Outside a session (in
tests, in a notebook) `track` still works and shows a bar only on a terminal.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import TypeVar

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

T = TypeVar("T")
_console = Console(stderr=True)
_session: Progress | None = None


@contextlib.contextmanager
def session() -> Iterator[Progress]:
    """One live display for everything run inside it."""
    global _session
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=_console,
        transient=False,
        disable=not _console.is_terminal,
    )
    _session = progress
    try:
        with progress:
            yield progress
    finally:
        _session = None


def track(items: Iterable[T], description: str, total: int | None = None) -> Iterator[T]:
    """Iterate with a progress bar (inside the current session when there is one)."""
    items = list(items) if total is None else items
    total = len(items) if total is None else total  # type: ignore[arg-type]
    if _session is None:
        with session():
            yield from track(items, description, total)
        return
    task = _session.add_task(description, total=total)
    for item in items:
        yield item
        _session.advance(task)
    _session.remove_task(task)


def say(message: str) -> None:
    """A line above the bars (or plain on stderr when not a terminal)."""
    _console.print(message, highlight=False)
