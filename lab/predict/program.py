"""``lab predict --fn``: your own training step on a pod you have not rented, priced as the lab's model is.

The step is loaded and built as ``lab inspect --fn`` does it
(`lab.explanation.program`: ``NAME(mesh)`` returns ``(fn, args)``, the
arguments abstract so that nothing is allocated), over ``--mesh`` laid on the
compile-only target's devices (or the builder's own mesh over those devices),
and compiled as written, with the user's compiler flags. The compiled,
scheduled program is then priced by the code that prices the lab's model
(`lab.predict.ops`): each fusion by the roofline of its matmul FLOPs and HBM
bytes at the chip's calibrated constants, each collective on the links its
replica groups use, the schedule's async windows deciding what the compute
stream waits for. Memory per chip is the compiler's, against the chip's HBM.

What the lab cannot know of someone else's program it does not guess. Its
model FLOPs (what MFU divides by) are the user's to count, ``--model-flops``
(6 x parameters x tokens, say); without them the prediction reports the FLOPs
the compiled matmuls run (remat recompute included) and their utilisation of
the chip's peak. Nothing is read at depth (`lab.predict.depth` needs the lab's
layer scope): a step whose layers run under ``scan`` compiles as one body
anyway.

The compile and the reading are imported inside the function that needs them,
as in `lab.predict.command`: libtpu must read the user's flags before it starts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from rich.console import Console

from lab import inputs
from lab.errors import LabError
from lab.explanation import program
from lab.predict import calibration
from lab.predict.command import Predict
from lab.predict.display import emit, show_priced
from lab.predict.options import check_program_options
from lab.predict.priced import (
    PricedStep,
    Reading,
    build_mesh,
    checked_target,
    memory_bytes,
    more_chips,
    price_step,
    target_devices,
)


@dataclass(frozen=True, kw_only=True)
class ProgramPrediction(PricedStep):
    """What ``lab predict --fn`` reports (the --json object): the priced step, and the utilisation it implies."""

    program: str  # FILE.py:NAME or package.module:NAME
    hardware_tflops_per_chip: float  # the compiled matmuls' FLOPs per chip over the predicted step
    hfu: float  # ... against the chip's bf16 peak: hardware FLOPs utilisation (remat recompute counts as work)
    model_flops_per_step: float | None  # --model-flops, when given
    tflops_per_chip: float | None  # model FLOPs per chip over the predicted step, when given
    mfu: float | None  # ... against the chip's bf16 peak


def predict_program(command: Predict) -> ProgramPrediction:
    """Compile the user's step (--fn) on the command's target and mesh and price it op by op."""
    check_program_options(command, Predict)
    inputs.number("--model-flops", command.model_flops, low=0)
    inputs.number("--timeout", command.timeout, low=0)
    reading = read_program(command)
    efficiency = calibration.efficiency(reading.chip.name)
    step, priced = price_step(reading, efficiency, lambda over: _advice(over, command.target))
    chips = priced["chips"]
    peak = reading.chip.peak_bf16_flops
    hardware = priced["hardware_flops_per_step"] / chips / step.step_s
    model = command.model_flops / chips / step.step_s if command.model_flops else None
    return ProgramPrediction(
        **priced,
        program=command.fn,
        hardware_tflops_per_chip=hardware / 1e12,
        hfu=hardware / peak,
        model_flops_per_step=command.model_flops or None,
        tflops_per_chip=model / 1e12 if model else None,
        mfu=model / peak if model else None,
    )


def read_program(command: Predict) -> Reading:
    """The user's step compiled for the command's target and read, not yet priced."""
    from lab.hlo.inspection import lower
    from lab.predict.ops import read_schedule
    from lab.predict.step import DoesNotFit, compile_lowered
    from lab.targets.hardware import profile_for_device_kind

    command, target = checked_target(command)
    spec = command.fn
    devices = target_devices(command, target)  # before the user's module is imported: it may build arrays on them
    builder = program.load(spec)
    mesh = build_mesh(command.mesh, devices, command.slices, command.dcn_axis, command.axis_types == "explicit")
    chip = profile_for_device_kind(devices[0].device_kind)
    with program.bounded(command.timeout):  # the user's code, not the compiler's: bounded
        fn, args = program.build(builder, mesh, spec, compile_only=True)
        mesh = program.own_mesh(args, mesh, spec)
        started = time.perf_counter()
        with program.blamed(spec, "tracing it", compile_only=True):
            lowered = program.in_its_context(lambda: lower(fn, *args, mesh=mesh), mesh)
    with program.blamed(spec, "compiling it", compile_only=True), program.in_context(mesh):
        try:
            compiled = compile_lowered(lowered, mesh, started)
        except DoesNotFit as err:
            raise LabError(f"--fn {spec!r} does not fit a chip of {target}; the compiler stopped: {err}") from None
    began = time.perf_counter()
    read = read_schedule(compiled.hlo, mesh, chip)
    memory = memory_bytes(compiled.memory)
    return Reading(command, None, target, mesh, chip, compiled, read, memory, time.perf_counter() - began)


def _advice(over: int, target: str) -> str:
    """What may fit a step over HBM by `over` bytes: its batch and its remat are in the user's code."""
    ideas = ("less kept for the backward pass (jax.checkpoint in your step)", "a smaller batch per chip")
    return f"does not fit by {over / 2**30:.2f} GiB per chip; try " + ", or ".join(
        [*ideas, f"more chips ({more_chips(target)})"]
    )


def predict(command: Predict) -> int:
    """The ``lab predict --fn`` handler: the user's own step, priced; tables, or --json."""
    return emit(predict_program(command), show_program, command.json)


def show_program(p: ProgramPrediction, console: Console) -> None:
    """`p` as a few lines and the two tables `lab predict` shows for the lab's model."""
    utilisation = [
        f"hardware TFLOP/s {p.hardware_tflops_per_chip:.1f} per chip, {p.hfu:.1%} of the chip's bf16 peak (the "
        f"compiled matmuls' {p.hardware_flops_per_step:.3e} FLOPs a step, remat recompute included)",
        f"model TFLOP/s   {p.tflops_per_chip:.1f} per chip, MFU {p.mfu:.1%}  "
        f"[--model-flops {p.model_flops_per_step:.3e}]"
        + ("; above 100%: more FLOPs than the chips can run in this step, check the count" if p.mfu > 1 else "")
        if p.mfu is not None
        else "MFU             give --model-flops (e.g. 6 x parameters x tokens a step) to divide by the model's FLOPs",
    ]
    show_priced(
        p, [f"{p.program}: your step"], ["compiled        as written (nothing read at depth)"], utilisation, console
    )
