"""A compiled step priced op by op: what every ``lab predict`` says, of the lab's model or of the user's step.

Both kinds of prediction start the same way: a compile-only target checked
and its compiler started with the user's flags (`checked_target`,
`target_devices`), a mesh over its devices (`build_mesh`), one compiled
program read (`Reading`: its schedule, its memory per chip). Both end the same
way: `price_step` walks the schedule at the chip's constants and fills the
fields of `PricedStep` (step, compute, exposed communication per axis and
link, memory against HBM, the ten most expensive ops, the compiler's own
estimate beside the lab's). What differs is between: the lab's model is
compiled, read at depth and counted in model FLOPs by `lab.predict.command`;
the user's step is compiled as written by `lab.predict.program`.

JAX, libtpu and the compile are imported inside the functions that need them:
libtpu must read ``LIBTPU_INIT_ARGS`` (the user's ``--libtpu-flags``) before it
starts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

from lab.errors import LabError
from lab.predict import calibration
from lab.predict.options import check_gpu_flags, check_gpu_slices, check_tpu_flags
from lab.targets.gpu import GPU_TARGET_FORM


@dataclass(frozen=True, kw_only=True)
class PricedStep:
    """A compiled step priced op by op: what `lab predict` says of any program (the lab's model, `Prediction`; the
    user's own, `lab.predict.program.ProgramPrediction`)."""

    target: str
    slices: int
    chips: int
    mesh: str
    matmul_precision: str
    step_s: float
    compute_s: float
    exposed_comm_s: float
    comm_s: float
    hardware_flops_per_step: float  # the compiled program's matmul FLOPs, remat included, all chips
    memory_bytes: int
    hbm_bytes: int
    fits: bool
    over_by_bytes: int
    advice: str
    exposed_by_link: dict[str, float]
    top_ops: list[dict]
    compile_s: float
    predict_s: float
    efficiency: dict[str, float]
    calibrated: bool
    calibrated_on: str  # the chip whose published run set the constants (another one's when not `calibrated`)
    xla_compute_s: float | None = None  # the compiler's own estimate of the same compute (`lab.predict.xla_estimate`)
    xla_comm_s: float | None = None  # ... and of the same collectives, each whole
    xla_base_s: float | None = None  # the lab's own compute over the ops the compiler priced (like for like)
    xla_unpriced: int = 0  # the lab's ops the compiler gave no time
    host_bytes: int = 0  # per chip, in host memory: what an offloading remat sends there (its transfers: hidden)
    devices_per_chip: int = 1  # 2 on TPU7x: `chips` then counts devices, and every per-chip figure is per device
    disabled_passes: tuple[str, ...] = ()  # compiler passes the step compiled without, after one crashed on it
    synchronous_s: dict[str, float] = field(default_factory=dict)  # FSDP collectives of a kind never run async: exposed


@dataclass(frozen=True)
class Reading:
    """One compiled step read at the model's depth, not yet priced: what a prediction, or a calibration, starts from."""

    command: object  # lab.predict.command.Predict
    model: object  # lab.model.ModelConfig at full size, with the command's sequence and attention; None: --fn's
    target: object  # lab.targets.devices.Target
    mesh: object
    chip: object  # lab.targets.hardware.ChipProfile
    compiled: object  # lab.predict.step.Compiled
    read: object  # lab.predict.ops.ReadSchedule, at the model's depth
    memory: int  # bytes per chip, at the model's depth
    read_s: float  # seconds reading the schedule took

    @property
    def on_gpu(self) -> bool:
        return self.target.platform == "gpu"


def checked_target(command):
    """(the command with its target as one slice, that target): a compile-only TPU slice or GPU cluster, its slices
    and compiler flags checked, before any compiler starts."""
    # local: see the module docstring
    from lab.targets.devices import check_slices, one_slice, parse_target

    target = parse_target(command.target)
    if not target.compile_only or target.platform not in ("tpu", "gpu"):
        raise LabError(
            f"--target {command.target!r}: lab predict compiles for tpu:<gen>:<topology> (e.g. tpu:v6e:16x16) "
            f"or {GPU_TARGET_FORM}"
        )
    target, slices = one_slice(target, command.slices)  # "tpu:v5e:4x4 slices=2", as lab inspect takes it
    command = replace(command, target=str(target), slices=slices)
    check_slices("--slices", command.slices)
    if target.platform == "gpu":
        check_gpu_slices(command.slices)
        check_gpu_flags(command.libtpu_flags)
    else:
        check_tpu_flags(command.xla_flags)
    return command, target


def target_devices(command, target) -> list:
    """The compile-only devices of `target` (all its slices), its compiler started with the command's flags."""
    # local: see the module docstring
    from lab.targets import libtpu, xla_flags
    from lab.targets.devices import gpu_cluster_devices, topology_devices

    if target.platform == "gpu":
        xla_flags.prepare(command.xla_flags)
        return gpu_cluster_devices(target.topology)
    libtpu.prepare(command.libtpu_flags)
    return topology_devices(target.topology, command.slices)


def price_step(reading: Reading, efficiency, advise: Callable[[int], str]) -> tuple:
    """(the `lab.predict.ops.StepPrediction` of `reading` at `efficiency`, the `PricedStep` fields it fills): what
    a prediction says of any compiled step, the lab's model or the user's program; `advise` says what to try when
    the step is over HBM by the bytes it is given."""
    # local: see the module docstring
    import time

    from lab.predict import xla_estimate

    command, mesh, chip = reading.command, reading.mesh, reading.chip
    started = time.perf_counter()
    step = reading.read.predict(efficiency, command.matmul_precision)
    xla = xla_estimate.estimate(reading.compiled.xla_times, step) if reading.compiled.xla_times else None
    chips = mesh.devices.size
    over = max(0, reading.memory - int(chip.hbm_bytes))
    fields = {
        "target": str(reading.target),
        "slices": command.slices,
        "chips": chips,
        "mesh": _mesh_text(mesh),
        "matmul_precision": command.matmul_precision,
        "step_s": step.step_s,
        "compute_s": step.compute_s,
        "exposed_comm_s": step.exposed_comm_s,
        "comm_s": step.comm_s,
        "hardware_flops_per_step": step.matmul_flops * chips,
        "memory_bytes": reading.memory,
        "hbm_bytes": int(chip.hbm_bytes),
        "fits": over == 0,
        "over_by_bytes": over,
        "advice": advise(over) if over else "",
        "exposed_by_link": step.exposed_by_link(),
        "top_ops": [
            {
                "name": o.name,
                "op": o.op_name,
                "runs": o.runs,
                "seconds": o.seconds,
                "bound": o.bound,
                "flops": o.flops,
                "bytes": o.bytes,
                "xla_seconds": xla.ops.get(o.name) if xla else None,
            }
            for o in step.top_ops(10)
        ],
        "compile_s": reading.compiled.compile_s,
        "predict_s": reading.read_s + time.perf_counter() - started,
        "efficiency": asdict(efficiency),
        "calibrated": calibration.calibrated(chip.name),
        "calibrated_on": calibration.source_chip(chip.name),
        "xla_compute_s": xla.compute_s if xla else None,
        "xla_comm_s": xla.comm_s if xla else None,
        "xla_base_s": xla.lab_compute_s if xla else None,
        "xla_unpriced": xla.unpriced if xla else 0,
        "host_bytes": int(reading.compiled.memory.get("host_temp_size", 0)),
        "devices_per_chip": chip.devices_per_chip,
        "disabled_passes": reading.compiled.disabled_passes,
        "synchronous_s": _synchronous(step.comms),
    }
    return step, fields


def _synchronous(comms) -> dict[str, float]:
    """Exposed seconds of each kind of FSDP collective that the compiler ran synchronously every time (libtpu's
    defaults on v4, v5p and v6e for the gathers; its ``%all-reduce-scatter`` fusions): none of it hides."""
    fsdp = [c for c in comms if "fsdp" in c.axes and c.kind in ("all-gather", "reduce-scatter")]
    kinds = {c.kind for c in fsdp} - {c.kind for c in fsdp if c.is_async}
    return {kind: sum(c.exposed_s for c in fsdp if c.kind == kind) for kind in sorted(kinds)}


def build_mesh(spec: str, devices, slices: int, dcn_axis: str, explicit: bool = True):
    """One slice's mesh spec, `dcn_axis` multiplied by the slices (TPU slices, or GPU nodes) and laid across them;
    its axes `explicit` (the lab's model shards in types) or automatic (a user's program may leave it to XLA)."""
    # local: jax's mesh utilities start no backend but pull in JAX, which the CLI imports only when needed
    import numpy as np
    from jax.experimental import mesh_utils
    from jax.sharding import AxisType, Mesh

    from lab.mesh import AXES, MeshSpec

    if dcn_axis not in AXES:
        raise LabError(f"--dcn-axis {dcn_axis!r}: use one of {', '.join(AXES)}")
    per_slice = len(devices) // slices
    one = MeshSpec.parse(spec).resolve(per_slice)
    if slices == 1:
        return one.build(devices, explicit=explicit)
    dcn = tuple(slices if a == dcn_axis else 1 for a in AXES)
    nodes = devices[0].platform == "gpu"  # a GPU cluster's slices are its nodes, one process each
    grid = mesh_utils.create_hybrid_device_mesh(
        one.shape, dcn, list(devices), process_is_granule=nodes, allow_split_physical_axes=True
    )
    kind = AxisType.Explicit if explicit else AxisType.Auto
    return Mesh(np.asarray(grid), AXES, axis_types=(kind,) * len(AXES))


def memory_bytes(memory: dict[str, int]) -> int:
    """HBM per chip: XLA's peak, or (with buffers in host memory, which that peak counts too) the device's buffers."""
    if memory.get("peak_memory") and not memory.get("host_temp_size"):
        return int(memory["peak_memory"])
    return int(
        memory.get("argument_size", 0)
        + memory.get("output_size", 0)
        + memory.get("temp_size", 0)
        - memory.get("alias_size", 0)
    )


def _mesh_text(mesh) -> str:
    used = [f"{a}={s}" for a, s in mesh.shape.items() if s > 1]
    return ",".join(used) or "single device"


def more_chips(target: str) -> str:
    """How a target grows, for the advice to a step over HBM: more nodes of a GPU cluster, more TPU chips."""
    return "more nodes: gpu:<chip>:<nodes>x<gpus>" if target.startswith("gpu") else "a larger topology or more slices"
