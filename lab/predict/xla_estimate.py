"""XLA:GPU's own estimate of a compiled step, laid beside the lab's: a second opinion, compile-only.

Compiled with ``xla_gpu_collect_cost_model_stats``, XLA:GPU writes into each
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

`estimate` lays those numbers over the ops the lab priced (`lab.predict.ops`):
each op's runs times XLA's time for one run, summed as compute (fusions,
library calls) and as collectives, serially (no overlap credited: XLA's
scheduler statistics are per computation and do not count loop trips).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from lab.predict.ops import StepPrediction

COMPILER_OPTIONS = {"xla_gpu_collect_cost_model_stats": True}

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
    unpriced: int  # ops the lab priced that XLA gave no time (bookkeeping XLA does not model)

    @property
    def serial_s(self) -> float:
        return self.compute_s + self.comm_s


def estimate(hlo_text: str, step: StepPrediction) -> XlaEstimate:
    """XLA's own times for `step`'s ops (`step` read from the same `hlo_text`, compiled with COMPILER_OPTIONS)."""
    times = xla_times(hlo_text)
    ops = {op.name: op.runs * times[op.name] for op in step.ops if op.name in times}
    comms = {c.name: c.runs * times[c.name] for c in step.comms if c.name in times}
    return XlaEstimate(
        compute_s=sum(ops.values()),
        comm_s=sum(comms.values()),
        ops={**ops, **comms},
        unpriced=sum(op.name not in times for op in step.ops),
    )
