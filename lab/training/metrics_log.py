"""The metrics log of a training run: one JSON line per step, beside the run's page.

`lab train` appends a `StepMetrics` line after every step (process 0 only), so
the log holds every step even when the run is killed. It lives at ``--log`` or
at ``<results>/<name>.metrics.jsonl``: beside the page's folder, never inside
it, because writing a page replaces its folder whole.

A resumed run reads the log before it restores or compiles anything: a line
cut off by the kill is dropped, any other damaged line (another tool's output,
a byte that is not UTF-8, an object that is not a step's metrics) is refused
with one line. The steps the checkpoint holds are kept, the later ones (which
the run is about to redo) dropped, so no step is logged twice and none lost;
the page shows the kept steps beside the new ones.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import jax

from lab.errors import LabError


@dataclass(frozen=True)
class StepMetrics:
    """One line of the JSONL log."""

    step: int
    loss: float
    grad_norm: float
    seconds: float  # the whole iteration: data + compute + save
    data_s: float  # waiting for the batch (input pipeline and host-to-device)
    save_s: float  # the blocking part of a checkpoint save
    tokens_per_s: float
    mfu: float
    checkpoint: bool = False  # a save started in this step
    extra: dict[str, float] = field(default_factory=dict)  # further scalars the step returns (MoE load, ...)


def path_of(config) -> Path:
    """Where the run's JSONL log goes: --log, or beside the page's folder (never inside it: a page is replaced
    whole when it is written)."""
    return config.log or config.results / f"{config.name}.metrics.jsonl"


def logged(config) -> list[StepMetrics]:
    """The steps a resumed run's log holds (process 0 reads it; a fresh run starts a fresh log)."""
    if not config.resume or jax.process_index() != 0:
        return []
    return [_metrics(line) for line in _lines(path_of(config))]


def writer(config, kept: list[StepMetrics]):
    """A function appending one JSON line per step, after the `kept` lines (process 0 only; the others write
    nothing).

    A resumed run keeps the lines of the steps its checkpoint holds (0 to start_step - 1) and drops the later
    ones, which the interrupted run logged after its last checkpoint and this run is about to redo: no step is
    logged twice, none is lost.
    """
    if jax.process_index() != 0:
        return lambda metrics: None
    path = path_of(config)
    path.parent.mkdir(parents=True, exist_ok=True)
    staged = path.with_name(f".{path.name}.tmp")
    staged.write_text("".join(json.dumps(asdict(metrics)) + "\n" for metrics in kept))
    staged.replace(path)  # the log is replaced whole (a regular file: lab.inputs refuses links and devices)

    def write(metrics: StepMetrics) -> None:
        with path.open("a") as out:
            out.write(json.dumps(asdict(metrics)) + "\n")

    return write


def _metrics(line: dict) -> StepMetrics:
    """A log line back as the step's metrics; a line lab train did not write is refused, not guessed at."""
    try:
        return StepMetrics(**line)
    except TypeError:
        raise LabError(
            f"{line!r:.80} in the metrics log is not a line lab train wrote; resume with another --log, or move "
            "the old log aside"
        ) from None


def _lines(path: Path) -> list:
    """The lines of a log, parsed. The last may be cut off by a kill and is then dropped; a damaged line before it
    (another tool's output, a byte that is not UTF-8) is refused: resuming past it would lose steps silently."""
    if not path.is_file():
        return []
    texts = path.read_bytes().decode("utf-8", errors="replace").splitlines()
    lines = []
    for number, text in enumerate(texts, 1):
        try:
            lines.append(json.loads(text))
        except ValueError:
            if number < len(texts):
                raise LabError(
                    f"line {number} of the metrics log {str(path)!r} is damaged ({text!r:.60}); resume with another "
                    "--log, or move the old log aside"
                ) from None
    return lines
