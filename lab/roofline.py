"""Roofline of a compiled program: compute-, memory- or communication-bound?

For one step of an SPMD program on one chip (the scaling book, Part 1
"Rooflines", and Part 5 "Training"), three lower bounds on its time:

* compute:       T_math = FLOPs per chip / peak FLOP/s
* memory:        T_hbm  = bytes accessed per chip / HBM bandwidth
* communication: T_comm = the sum of each collective's predicted time on the
  links its mesh axes use (lab.targets.topology), counted without overlap.

XLA's cost analysis of the partitioned module gives FLOPs and bytes per chip;
the collectives come from its optimized HLO. With perfect overlap the step
takes max(T_math, T_hbm, T_comm); with none, about the sum. A program is
"bound" by its largest term: compute-bound is the goal, communication-bound
means more chips no longer help.
"""

from __future__ import annotations

from dataclasses import dataclass

from lab.hlo import Collective, Inspection
from lab.hlo.schedule import bytes_accessed, parse_schedule
from lab.hlo.schedule import flops as schedule_flops
from lab.targets.hardware import ChipProfile, profile_for_device_kind
from lab.targets.topology import Placement, predict, program_placement


@dataclass(frozen=True)
class PredictedCollective:
    collective: Collective
    where: Placement | None  # None: no mesh axes known for it
    seconds: float


@dataclass(frozen=True)
class Roofline:
    """Predicted times of one compiled step on one chip profile."""

    chip: str
    counted_from: str  # "cost analysis" (XLA's), or "the HLO" (dots and bytes counted where XLA reports none)
    flops: float
    bytes_accessed: float
    compute_s: float
    memory_s: float
    collectives: tuple[PredictedCollective, ...]

    @property
    def communication_s(self) -> float:
        return sum(c.seconds for c in self.collectives)

    @property
    def bound(self) -> str:
        """Which term is largest: "compute", "memory" or "communication"."""
        terms = {"compute": self.compute_s, "memory": self.memory_s, "communication": self.communication_s}
        return max(terms, key=terms.get)

    @property
    def overlapped_s(self) -> float:
        """Step time if everything overlapped perfectly: the largest term."""
        return max(self.compute_s, self.memory_s, self.communication_s)

    @property
    def serial_s(self) -> float:
        """Step time if nothing overlapped: the sum."""
        return self.compute_s + self.memory_s + self.communication_s


def roofline(inspection: Inspection, mesh, chip: ChipProfile | None = None) -> Roofline:
    """Predict compute, HBM and communication time for a program compiled over `mesh`."""
    chip = chip or profile_for_device_kind(mesh.devices.flat[0].device_kind)
    flops, accessed, counted = inspection.cost.get("flops"), inspection.cost.get("bytes accessed"), "cost analysis"
    if flops is None:  # XLA:GPU reports no cost analysis: count the matmuls and the bytes in the HLO itself
        flops, accessed, counted = _counted(inspection.optimized_hlo)
    return Roofline(
        counted_from=counted,
        chip=chip.name,
        flops=flops,
        bytes_accessed=accessed,
        compute_s=flops / chip.peak_bf16_flops,
        memory_s=accessed / chip.hbm_bandwidth,
        collectives=tuple(_predicted(c, mesh, chip) for c in inspection.collectives),
    )


def _counted(hlo_text: str) -> tuple[float, float, str]:
    """FLOPs of the entry computation's matmuls (loops times their trip counts) and the bytes its kernels touch."""
    schedule = parse_schedule(hlo_text)
    entry = schedule.entry
    body = schedule.computations.get(entry, ())
    flops = sum(schedule_flops(schedule, entry, i) for i in body)
    accessed = sum(bytes_accessed(schedule, entry, i) for i in body)
    return float(flops), float(accessed), "the HLO"


def _predicted(collective: Collective, mesh, chip: ChipProfile) -> PredictedCollective:
    if not (collective.axes or collective.across_slices):
        return PredictedCollective(collective, None, 0.0)
    where = program_placement(mesh, collective, chip)
    cost = predict(collective.kind, collective.size_bytes, where, chip)
    runs = collective.repeats if collective.repeats is not None else 1
    return PredictedCollective(collective, where, runs * (cost.seconds if cost else 0.0))
