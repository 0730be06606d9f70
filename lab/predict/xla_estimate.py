"""The compiler's own estimate of a compiled step, laid beside the lab's: a second opinion, compile-only.

**XLA:GPU.** Compiled with ``xla_gpu_collect_cost_model_stats``, XLA:GPU writes into each
fusion's backend config the times its cost models give it
(``"reification_cost": [{"exec_time_us": ..., "compute_time_us": ...,
"memory_access_time_us": ..., "name": ...}, ...]``): its indexing cost model
(``"indexing-cost-model"``), its older performance model (``""``), and its
speed-of-light estimator (``"sol"``, the only one on a collective). The option
only annotates; the program is the same instruction for instruction
(tests/predict/test_xla_estimate.py compiles it both ways). The older model
is not used where the indexing model speaks: on a fusion that broadcasts into
a large output (the attention's [.., S, S] masks) it gives hours for what the
indexing model gives a millisecond.

**libtpu.** Its latency-hiding scheduler prices every instruction it places
with libtpu's own cost model, and with ``xla_dump_latency_hiding_schedule``
(and ``xla_dump_to``, given per compile as `tpu_options`) it writes that
timeline as ``<module>.schedule.txt``: the scheduled module, then for each
computation each instruction's estimated ``start_timestamp_cycles`` and
``end_timestamp_cycles`` and the clock (``cycles_per_microsecond``). An
instruction's own time is its end less its start; an asynchronous collective
or host transfer is a start and a done of no time each, its latency only the
gap the scheduler leaves between them, which also holds whatever compute it
overlaps: so on TPU the estimate covers the ops that take time themselves
(fusions, kernels, synchronous collectives), not the asynchronous ones.
The options write files only; the program is the same. libtpu writes a schedule
only where that scheduler runs: for every v5e, v4 and TPU7x program tried
here, for some on v6e and v5p (one with host offload, not a sharded matmul, nor
Llama 3.1 405B on 2048 v5p); where it writes none there is no estimate.

`estimate` lays those numbers over the ops the lab priced (`lab.predict.ops`):
each op's runs times the compiler's time for one run, summed as compute (fusions,
library calls) and as collectives, serially (no overlap credited: XLA's
scheduler statistics are per computation and do not count loop trips).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from lab.predict.ops import StepPrediction

COMPILER_OPTIONS = {"xla_gpu_collect_cost_model_stats": True}
SCHEDULE_SUFFIX = ".schedule.txt"  # libtpu's latency-hiding schedule dump, one per module

_NAME = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=")
_COST = re.compile(r'"reification_cost":\[(.*?)\]')
_MODELS = ("indexing-cost-model", "", "sol")  # most trusted first
_ENTRY = re.compile(r'"exec_time_us":([0-9.eE+\-]+)[^{}]*?"name":"([\w\-]*)"')


def xla_times(hlo_text: str) -> dict[str, float]:
    """Seconds per run of each instruction XLA:GPU priced: its indexing cost model's time, else its older
    performance model's (the unnamed entry), else its speed-of-light estimate (``"sol"``, the collectives)."""
    times = {}
    for line in hlo_text.splitlines():
        cost = _COST.search(line)
        name = _NAME.match(line)
        if not (cost and name):
            continue
        entries = {kind: float(us) for us, kind in _ENTRY.findall(cost.group(1))}
        if entries:
            preferred = next((model for model in _MODELS if model in entries), next(iter(entries)))
            times[name.group(1)] = 1e-6 * entries[preferred]
    return times


@dataclass(frozen=True)
class XlaEstimate:
    """XLA's time for the ops the lab priced, over the whole step (loop trips as the lab counts them)."""

    compute_s: float  # fusions and library calls, one after another
    comm_s: float  # collectives, each whole (no overlap credited)
    ops: dict[str, float]  # instruction -> XLA's seconds over all its runs (the lab's ops and collectives)
    unpriced: int  # ops the lab priced that XLA gave no time (bookkeeping XLA does not model; on TPU also the
    # fusions libtpu forms after it schedules, which its schedule does not name)
    lab_compute_s: float  # the lab's own seconds for the ops in compute_s: the like-for-like base

    @property
    def serial_s(self) -> float:
        return self.compute_s + self.comm_s


def tpu_options(directory: str | Path) -> dict:
    """Compile options that have libtpu write its latency-hiding schedule into `directory`, and not the module's
    text before and after its passes (no module name matches ``^$``): with those, DeepSeek-V3's compile took 145 s
    on this lab's 2-core machine where it takes 110 s without."""
    return {"xla_dump_to": str(directory), "xla_dump_latency_hiding_schedule": True, "xla_dump_hlo_module_re": "^$"}


def schedule_times(directory: str | Path) -> dict[str, float]:
    """Seconds per run of each instruction libtpu's scheduler gave time of its own, from the schedule it dumped in
    `directory` (empty when it dumped none: a program with nothing to schedule)."""
    times: dict[str, float] = {}
    for path in sorted(Path(directory).glob(f"*{SCHEDULE_SUFFIX}")):
        times.update(_durations(path.read_text()))
    return times


_INSTRUCTION = re.compile(r'\n\s*instructions \{\n\s*name: "([^"]+)"\n.*?\n\s*id: (\d+)\n', re.S)
_PLACED = re.compile(
    r"\bid: (\d+)\n(?:\s*start_timestamp_cycles: ([0-9.eE+\-]+)\n)?\s*end_timestamp_cycles: ([0-9.eE+\-]+)"
)
_CLOCK = re.compile(r"cycles_per_microsecond: ([0-9.eE+\-]+)")


def _durations(text: str) -> dict[str, float]:
    """One schedule dump: the module's instruction names by id, then each placed instruction's end less start."""
    module, _, schedules = text.partition("\ncomputation_schedules {")
    clock = _CLOCK.search(schedules)
    if not clock:
        return {}
    per_second = float(clock.group(1)) * 1e6
    names = {iid: name for name, iid in _INSTRUCTION.findall(module)}
    times = {}
    for iid, start, end in _PLACED.findall(schedules):
        cycles = float(end) - float(start or 0)
        if cycles > 0 and iid in names:
            times[names[iid]] = cycles / per_second
    return times


def estimate(times: dict[str, float], step: StepPrediction) -> XlaEstimate:
    """The compiler's `times` (seconds per run, by instruction: `xla_times` or `schedule_times`) for `step`'s ops."""
    priced = [op for op in step.ops if op.name in times]
    ops = {op.name: op.runs * times[op.name] for op in priced}
    comms = {c.name: c.runs * times[c.name] for c in step.comms if c.name in times}
    return XlaEstimate(
        compute_s=sum(ops.values()),
        comm_s=sum(comms.values()),
        ops={**ops, **comms},
        unpriced=len(step.ops) - len(priced),
        lab_compute_s=sum(op.seconds for op in priced),
    )


def nearer_status(errors: list[tuple[float, float]]) -> str:
    """Whether the compiler's prices predict published steps better than the lab's, from each run's (error at the
    compiler's prices, error at the lab's): "confirmed" nearer on every run, "refuted" on none, "refined" between."""
    nearer = sum(abs(theirs) < abs(ours) for theirs, ours in errors)
    return "confirmed" if nearer == len(errors) else ("refuted" if nearer == 0 else "refined")
