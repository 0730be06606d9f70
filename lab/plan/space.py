"""The layout space: every way to lay one model's training step on one pod.

A layout is a size for each of the five mesh axes (`lab.mesh.AXES`), their
product the pod's chips, plus three choices that the mesh alone does not fix:
which axis crosses the slices over DCN (multi-slice pods only), how many
micro-batches a pipeline (``stage``) runs, and the remat policy (``none``,
``minimal``, ``full``: what the backward pass keeps, `lab.predict.step.REMATS`).

The model's dimensions decide which sizes are possible, as the lab's rules
tables (`lab.rules.MODEL_PARALLEL`, the ZeRO-3 table) split them:

* ``tensor`` splits the attention heads, the K/V heads and the MLP width
  (Megatron): it must divide ``heads``, ``kv_heads`` and ``d_ff``;
* ``stage`` splits the stacked layers into contiguous runs: it divides ``layers``;
* ``fsdp`` splits every weight along ``embed``: it divides ``d_model``;
* ``expert`` splits the experts of an MoE model (it divides their count); a
  dense model keeps ``expert=1``;
* the batch is split over ``data x fsdp x expert`` (`lab.rules.DATA_AXES`):
  their product divides the global batch of sequences, and a pipeline's
  micro-batch count divides each shard's sequences.

`layouts` walks the factorisations of the chip count recursively, axis by
axis, cutting a branch as soon as an axis cannot divide its dimension; the
tests check it against a brute force over all 5-tuples.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

from lab.errors import LabError
from lab.mesh import AXES, MeshSpec
from lab.model import ModelConfig
from lab.plan.overlap import Overlap
from lab.predict import calibration
from lab.predict.ops import Efficiency
from lab.targets.hardware import ChipProfile

REMATS = ("none", "minimal", "full")  # lab.predict.step.REMATS' names, least recompute first
ATTENTIONS = ("flash", "xla")


@dataclass(frozen=True)
class Problem:
    """What is planned: a model at a sequence length, a global batch, and a pod (one slice's torus, x slices)."""

    model: ModelConfig  # seq and attention already set
    sequences: int  # global batch, in sequences
    chip: ChipProfile
    torus: tuple[int, ...]  # one slice's chips along each torus dimension
    topology: str  # "v5e:16x16", one slice
    slices: int = 1
    overlap: Overlap = field(
        default_factory=Overlap
    )  # on TPU, which FSDP collectives libtpu runs asynchronously (`lab.plan.overlap`)

    @property
    def chips(self) -> int:
        """The devices laid out: the torus's chips x slices x the chip's devices (TPU7x: two chiplets a chip, each
        its own device with half the chip's compute and HBM, as `lab predict` counts them)."""
        return math.prod(self.torus) * self.slices * self.chip.devices_per_chip

    @property
    def tokens(self) -> int:
        return self.sequences * self.model.seq

    @property
    def generation(self) -> str:
        """The TPU generation ("v5e"), the calibration's and libtpu's name for the chip."""
        return self.topology.split(":")[0]

    @property
    def efficiency(self) -> Efficiency:
        """The fractions of the chip's peaks that its matmuls and HBM reach: `lab predict`'s constants, the chip's
        own (`lab.predict.calibration`), which both the closed form and the compiled prediction price with."""
        return calibration.efficiency(self.generation)


@dataclass(frozen=True)
class Layout:
    """One candidate: the mesh, the axis across slices, micro-batches (stage > 1 only) and the remat policy."""

    mesh: MeshSpec
    slices_axis: str | None  # None on one slice
    remat: str
    micro_batches: int = 1

    @property
    def sizes(self) -> dict[str, int]:
        return self.mesh.sizes

    @property
    def batch_ways(self) -> int:
        """How many shards the batch is split into: data x fsdp x expert."""
        s = self.sizes
        return s["data"] * s["fsdp"] * s["expert"]

    def __str__(self) -> str:
        text = str(self.mesh)
        if self.slices_axis:
            text += f" (DCN: {self.slices_axis})"
        return text


def axis_limits(model: ModelConfig) -> dict[str, tuple[int, ...]]:
    """For each axis, the model dimensions its size must divide (`expert` of a dense or dropless model: only 1)."""
    return {
        "data": (),
        "stage": (1,) if model.dense_layers else (model.scan_length,),  # a dense prefix is not pipelined
        "fsdp": (model.embed,),
        "expert": (model.experts,) if model.experts and not model.dropless else (1,),  # dropless: no expert axis
        "tensor": (model.heads, model.groups, model.mlp, model.dense_width, model.shared_width or model.mlp),
    }


def divides_model(axis: str, size: int, model: ModelConfig) -> bool:
    return all(dim % size == 0 for dim in axis_limits(model)[axis])


def meshes(problem: Problem) -> Iterator[MeshSpec]:
    """Every factorisation of the chips over the five axes that the model's dimensions and the batch allow."""
    model, chips = problem.model, problem.chips

    def walk(index: int, left: int, chosen: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
        if index == len(AXES) - 1:
            if divides_model(AXES[index], left, model):
                yield (*chosen, left)
            return
        for size in _divisors(left):
            if divides_model(AXES[index], size, model):
                yield from walk(index + 1, left // size, (*chosen, size))

    for sizes in walk(0, chips, ()):
        spec = MeshSpec(**dict(zip(AXES, sizes)))
        if problem.sequences % (spec.data * spec.fsdp * spec.expert) == 0:
            yield spec


def micro_batch_choices(problem: Problem, mesh: MeshSpec) -> tuple[int, ...]:
    """1 without a pipeline; with one, the powers of two (and the whole shard) that divide a shard's sequences."""
    if mesh.stage == 1:
        return (1,)
    shard = problem.sequences // (mesh.data * mesh.fsdp * mesh.expert)
    powers = [m for m in (2**k for k in range(shard.bit_length())) if shard % m == 0]
    return tuple(sorted({*powers, shard}))


def slices_axes(problem: Problem, mesh: MeshSpec) -> tuple[str | None, ...]:
    """The axes that can cross the slices: those whose size is a multiple of the slice count."""
    if problem.slices == 1:
        return (None,)
    return tuple(a for a in AXES if mesh.sizes[a] % problem.slices == 0)


def layouts(problem: Problem) -> Iterator[Layout]:
    """Every candidate layout of `problem` (meshes x slices axis x micro-batches x remat)."""
    for mesh in meshes(problem):
        for axis in slices_axes(problem, mesh):
            for micro in micro_batch_choices(problem, mesh):
                for remat in REMATS:
                    yield Layout(mesh, axis, remat, micro)


def check_problem(problem: Problem) -> None:
    """A LabError for a problem with no layout at all: what blocks it, in one line."""
    if problem.sequences < 1:
        raise LabError(f"the global batch is {problem.sequences} sequences; give at least one sequence")
    if next(meshes(problem), None) is None:
        batch_ways = sorted({m for m in _divisors(problem.chips) if problem.sequences % m == 0})
        raise LabError(
            f"no layout of {problem.chips} chips divides a batch of {problem.sequences} sequences with this model "
            f"(the batch splits over data x fsdp x expert into at most {max(batch_ways)} shards, and the other "
            f"{problem.chips // max(batch_ways)} chips would need tensor or stage ways the model's heads "
            f"({problem.model.heads}, kv {problem.model.groups}) or layers ({problem.model.layers}) do not divide); "
            "use a global batch that is a multiple of the chip count"
        )


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})
