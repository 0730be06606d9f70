"""What ``lab predict`` (and ``lab plan``) may be asked for: each option checked before anything compiles.

A compile of a full-size step takes minutes; a value that cannot work is refused before libtpu or the CUDA
plugin starts, in one line that says what to give instead (`lab.errors.LabError`: exit 2, no traceback).
"""

from __future__ import annotations

from lab.errors import LabError
from lab.ragged import NO_EXPERT_AXIS
from lab.targets.gpu import GPU_TARGET_FORM


def resolve_attention(choice: str, on_gpu: bool) -> str:
    """The attention to compile: auto is the Pallas flash kernel on TPU, XLA's dot product on GPU."""
    if choice == "auto":
        return "xla" if on_gpu else "flash"
    if on_gpu and choice == "flash":
        raise LabError(
            "--attention flash is the Pallas TPU kernel, which XLA:GPU does not compile; use --attention xla "
            "(or auto) on a GPU target"
        )
    return choice


def check_experts(model, ways: int) -> None:
    """The expert axis splits an MoE model's experts: it must divide their count, and a dense model has none."""
    if ways > 1 and not model.experts:
        raise LabError(
            f"--mesh expert={ways}: a dense model has no experts to split; give an MoE model (experts=E, or a preset "
            "such as mixtral-8x7b) or leave the expert axis out"
        )
    if model.dropless and ways > 1:
        raise LabError(f"--mesh expert={ways}: {NO_EXPERT_AXIS}")
    if model.experts % ways:
        fits = [w for w in range(2, ways + 1) if model.experts % w == 0]
        raise LabError(
            f"--mesh expert={ways} does not divide the model's {model.experts} experts; use an expert axis of "
            + (f"{', '.join(map(str, fits))} or 1" if fits else "1")
        )


def check_dropless(model, on_gpu: bool) -> None:
    """A dropless MoE compiles megablox's grouped matmul (`lab.ragged`), a Pallas TPU kernel: TPU targets only."""
    if on_gpu and model.dropless:
        raise LabError(
            "capacity=dropless compiles megablox's grouped matmul, a Pallas TPU kernel; on a GPU target give a "
            "capacity (1 does a dropless run's work, a perfectly balanced buffer)"
        )


def check_precision(precision: str, chip) -> None:
    """A matmul precision the chip (a `lab.targets.hardware.ChipProfile`) publishes no peak for is refused."""
    if precision not in chip.matmul_peaks:
        runs = " or ".join(chip.matmul_peaks)
        raise LabError(
            f"--matmul-precision {precision}: {chip.name} publishes no {precision} matmul peak (its matrix units run "
            f"{runs}); use --matmul-precision {runs}"
        )


def check_gpu_slices(slices: int) -> None:
    """A GPU cluster's nodes are in its target; ``--slices`` joins TPU slices only."""
    if slices != 1:
        raise LabError(
            f"--slices {slices}: a GPU cluster's nodes are in its target ({GPU_TARGET_FORM}); --slices joins TPU slices"
        )


def check_gpu_flags(libtpu_flags: str) -> None:
    """libtpu's flags mean nothing to XLA:GPU."""
    if libtpu_flags:
        raise LabError("--libtpu-flags: libtpu compiles for TPU targets only; a GPU target takes --xla-flags")


def check_tpu_flags(xla_flags: str) -> None:
    """libtpu takes its compiler's flags from LIBTPU_INIT_ARGS, not XLA_FLAGS."""
    if xla_flags:
        raise LabError("--xla-flags: XLA_FLAGS go to XLA:GPU; a TPU target takes its flags as --libtpu-flags")


def compiled_layers_for(layers_compiled: int, layers: int) -> int:
    """The layers to compile: all of them (0, or at least the model's depth), or K >= 2 read at depth."""
    if layers_compiled < 0:
        raise LabError(f"--layers-compiled {layers_compiled}: use 0 (all layers) or a count of 2 or more")
    if layers_compiled == 1:  # XLA removes a loop of one trip: that program has no layer loop to read deeper
        raise LabError(
            "--layers-compiled 1: XLA compiles a scan over one layer without its loop, so that program is not one "
            "layer of the deep model's; use 2 or more"
        )
    if layers_compiled == 0 or layers_compiled >= layers:
        return layers
    return layers_compiled


def pipelined_layers(stages: int) -> int:
    """The fewest layers a pipeline of `stages` compiles to be read at depth (see `check_pipelined_layers`)."""
    return stages * (2 if stages != 2 else 3)


def check_pipelined_layers(compiled: int, stages: int) -> None:
    """K layers of a pipeline read at depth: each stage runs K/P of them, its layers' loop inside the loop over the
    pipeline's M + P - 1 ticks (one micro-batch: P). Depth reading tells a buffer stacked over layers by its
    leading dimension, so K/P must be 2 or more (XLA drops a loop of one trip) and differ from the ticks."""
    if compiled % stages or compiled // stages < 2 or compiled // stages == stages:
        raise LabError(
            f"--layers-compiled {compiled} with stage={stages}: each stage must run the same 2 or more layers, and "
            f"not {stages} (the pipeline's ticks, whose buffers would read as the layers'); give "
            f"{pipelined_layers(stages)}"
        )


# the options that describe the lab's model, and those that describe the user's program (--fn)
_MODEL_OPTIONS = (
    "model",
    "seq",
    "batch_per_device",
    "remat",
    "attention",
    "param_dtype",
    "compute_dtype",
    "sequence_parallel",
    "layers_compiled",
)
_PROGRAM_OPTIONS = ("model_flops", "axis_types", "timeout")


def check_program_options(command, defaults) -> None:
    """--fn prices the user's step as written: the lab's model options cannot change it, and --fn's own options
    mean nothing without it (`defaults`: the options class, whose attributes are the defaults)."""
    options = _MODEL_OPTIONS if command.fn is not None else _PROGRAM_OPTIONS
    given = [name for name in options if getattr(command, name) != getattr(defaults, name)]
    if not given:
        return
    flags = ", ".join("--" + name.replace("_", "-") for name in given)
    verb = "goes" if len(given) == 1 else "go"
    if command.fn is not None:
        raise LabError(
            f"{flags} {verb} with the lab's model, not with --fn: your step is compiled as it is written; drop it"
        )
    raise LabError(f"{flags} {verb} with --fn (your own step): the lab's model counts its own; drop it")
