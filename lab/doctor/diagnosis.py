"""`lab doctor`: a training configuration diagnosed in the order a careful engineer would, as a ranked report.

The order is the point (quick-reference #48, refined). A run that does not
fit in memory tells you nothing else, so **memory** comes first: the compiled
step's peak per device against the device's capacity. Then the **input**
pipeline (does the step wait for its batch?), the parallel **layout** (mesh
axes that repeat work, parameters left whole, skewed experts, pipeline
bubble), **communication** (the largest collectives per axis against the
compute, the bytes moved against the strategy's textbook volume, what the
schedule leaves exposed), and only then **numerics** (NaN/Inf, gradient-norm
spikes, divergence): a loss that misbehaves on a layout that is already
wrong sends you in the wrong direction.

The evidence comes from two places: the step compiled for the target (memory
analysis, collectives in the optimized HLO, cost analysis; this works on
compile-only TPU topologies) and a short run of `lab train`'s loop on real or
emulated devices (wait for data, step time, loss, gradient norm, MoE load).
Each check (`lab.doctor.checks`) turns its numbers into a `Finding`;
`Diagnosis.ranked` puts problems first in layer order, and the first problem
is where to start.
"""

from __future__ import annotations

import math
import re
import shutil
import tempfile
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path

import jax
import numpy as np

from lab import hlo
from lab.doctor import checks
from lab.doctor.checks import LAYERS, SEVERITIES, Finding
from lab.hlo import Inspection, schedule
from lab.roofline import roofline
from lab.rules import sharding_report, spec_axes
from lab.targets.devices import devices_for, parse_target
from lab.targets.hardware import profile, profile_for_device_kind
from lab.targets.topology import slice_shape
from lab.training import run as training_run
from lab.training.run import RunConfig, RunLog, trainer_for
from lab.training.step import Trainer, TrainState

_DP_KINDS = ("all-gather", "reduce-scatter", "all-reduce")  # the collectives the ZeRO accounting counts
_ZERO_AXES = ("data", "fsdp")  # the axes ZeRO shards model states over


@dataclass(frozen=True)
class Diagnosis:
    """The findings in the order they were checked (layer order), and why steps were not run, if they were not."""

    findings: tuple[Finding, ...]
    target: str
    not_run: str = ""  # why no steps ran (compile-only target, the step does not fit); empty when they did

    @property
    def ranked(self) -> tuple[Finding, ...]:
        """Problems first, then warnings, ok, not applicable; within each, the layer order."""
        return tuple(sorted(self.findings, key=lambda f: (SEVERITIES.index(f.severity), LAYERS.index(f.layer))))

    @property
    def start_here(self) -> Finding | None:
        """The first problem in the careful engineer's order, or None when nothing is a problem."""
        first = self.ranked[0] if self.findings else None
        return first if first is not None and first.severity == "problem" else None

    @property
    def problems(self) -> tuple[Finding, ...]:
        return tuple(f for f in self.ranked if f.severity == "problem")


@dataclass(frozen=True)
class _Compiled:
    """The trainer, its state as shapes and shardings, and what compiling its step gave: the inspection, or the
    compiler's out-of-memory message."""

    trainer: Trainer
    state: TrainState  # ShapeDtypeStructs with shardings
    inspection: Inspection | None
    refused: str


def diagnose(config: RunConfig, *, capacity_bytes: float | None = None, devices=None) -> Diagnosis:
    """Check `config` (a `lab.training.run.RunConfig`): compile its step, run it when it fits and can execute.

    `capacity_bytes` overrides the memory per device to check against; `devices` defaults to the target's.
    """

    training_run.check(config)
    devices = devices_for(config.target) if devices is None else devices
    compiled = _compile(config, devices)
    memory = checks.check_memory(_memory_evidence(compiled, devices, capacity_bytes))
    not_run = _why_not_run(config, memory)
    log = None if not_run else _run(config, devices)
    findings = (
        memory,
        *_observed(
            "input",
            ("time waiting for data",),
            not_run,
            lambda: (checks.check_input([s.seconds for s in log.steps], [s.data_s for s in log.steps]),),
        ),
        *_layout(compiled, log),
        *_communication(compiled, log, devices),
        *_observed("numerics", NUMERICS_CHECKS, not_run, lambda: _numerics(log)),
    )
    return Diagnosis(findings, config.target, not_run)


def _observed(layer: str, names: tuple[str, ...], not_run: str, observe) -> tuple[Finding, ...]:
    """The checks that need steps to have run, or each one not applicable with the reason."""
    return tuple(Finding(layer, name, "not applicable", not_run) for name in names) if not_run else observe()


def _compile(config: RunConfig, devices) -> _Compiled:
    """The trainer `lab train` uses (the same cached one) and its step compiled.

    A compiler out of memory is evidence, not an error.
    """

    trainer = trainer_for(config, devices)
    trainer.layout.check_batch(config.global_batch, config.micro_batches)
    state = trainer.abstract_state()
    try:
        # the executable the run will execute (the trainer caches it): reading it costs no second compile
        return _Compiled(trainer, state, trainer.inspect_step(config.global_batch), "")
    except jax.errors.JaxRuntimeError as err:  # the TPU compiler refuses a program that cannot fit in HBM
        # "Invalid TPU program" is the same refusal once lab predict has started libtpu in this process with
        # --xla_tpu_no_crash_on_oom=true (`lab.targets.libtpu.prepare`)
        if "RESOURCE_EXHAUSTED" not in str(err) and "Invalid TPU program" not in str(err):
            raise
        return _Compiled(trainer, state, None, str(err).splitlines()[0])


def _why_not_run(config: RunConfig, memory: Finding) -> str:

    if parse_target(config.target).compile_only:
        return f"{config.target} is compile-only: nothing executes, so input and numerics cannot be observed"
    if memory.severity == "problem":
        return "the step does not fit in device memory: running it would only fail"
    return ""


def _run(config: RunConfig, devices) -> RunLog:
    """A short `lab train` run in a scratch folder that is then removed: its log and its checkpoints go there, so
    the doctor never writes into the run it diagnoses (given --resume, it resumes from a copy of the checkpoints)."""

    with tempfile.TemporaryDirectory(prefix="lab-doctor-") as folder:
        scratch = Path(folder)
        checkpoints = None if config.checkpoint_dir is None else scratch / "checkpoints"
        if config.resume and config.checkpoint_dir.is_dir():
            shutil.copytree(config.checkpoint_dir, checkpoints, ignore=shutil.ignore_patterns(".lock"))
        return training_run.run(
            replace(
                config,
                page=False,
                results=scratch,
                log=None,
                name="doctor",
                halt_on_nan=False,
                checkpoint_dir=checkpoints,
            ),
            devices,
        )


# --- memory -------------------------------------------------------------------------------------


def _memory_evidence(compiled: _Compiled, devices, capacity_bytes: float | None) -> checks.MemoryEvidence:
    trainer, state = compiled.trainer, compiled.state
    per_array = [
        (_name(path), _bytes_per_device(leaf)) for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]
    ]
    groups = {"params": state.params, "master weights": state.master, "optimizer": state.opt_state}
    capacity, source = _capacity(devices, capacity_bytes)
    memory = compiled.inspection.memory if compiled.inspection is not None else {}
    return checks.MemoryEvidence(
        capacity_bytes=capacity,
        capacity_source=source,
        states={name: sum(_bytes_per_device(a) for a in jax.tree.leaves(tree)) for name, tree in groups.items()},
        largest=tuple(sorted(per_array, key=lambda item: -item[1])[:3]),
        peak_bytes=_peak(memory) if memory else _refused_bytes(compiled.refused),
        temp_bytes=memory.get("temp_size"),
        compiler_refused=compiled.refused,
        shards_params=trainer.layout.strategy.shards_params,
        devices=len(devices),
    )


def _name(path) -> str:
    """params/blocks/mlp/w_in: a state leaf's path, without nnx's trailing "value"."""
    keys = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
    return "/".join(keys[:-1] if keys and keys[-1] == "value" else keys)


def _bytes_per_device(array) -> int:
    return math.prod(array.sharding.shard_shape(array.shape)) * array.dtype.itemsize


def _peak(memory: dict[str, int]) -> int:
    """Arguments + temporaries + outputs not aliased to arguments, or the compiler's own peak when larger."""
    return max(
        memory["argument_size"] + memory["temp_size"] + memory["output_size"] - memory["alias_size"],
        memory.get("peak_memory", 0),
    )


def _refused_bytes(message: str) -> float | None:
    """The bytes the TPU compiler said the program needs: "... temporaries (42.28G) exceeds available HBM (15.75G)"."""
    found = re.search(r"\(([\d.]+)([KMGT])\) exceeds", message)
    return float(found[1]) * 1024 ** ("KMGT".index(found[2]) + 1) if found else None


def _capacity(devices, override: float | None) -> tuple[float, str]:
    """Bytes one device may use: the override, the runtime's limit, the chip profile, or host memory shared out."""

    device = devices[0]
    if override is not None:
        return override, "--capacity"
    if device.platform == "cpu":
        return profile("cpu").hbm_bytes / len(devices), f"host memory shared by {len(devices)} emulated devices"
    try:
        stats = device.memory_stats() or {}
    except jax.errors.JaxRuntimeError:  # a compile-only device has no runtime to ask
        stats = {}
    if "bytes_limit" in stats:
        return float(stats["bytes_limit"]), "the runtime's bytes_limit"
    chip = profile_for_device_kind(device.device_kind)
    return chip.hbm_bytes, f"{chip.name} HBM (lab.targets.hardware)"


# --- layout -------------------------------------------------------------------------------------


def _layout(compiled: _Compiled, log: RunLog | None) -> tuple[Finding, ...]:

    layout = compiled.trainer.layout
    params = compiled.state.params
    rows = [
        (_name(path), a.size * a.dtype.itemsize, a.sharding.spec)
        for path, a in jax.tree_util.tree_flatten_with_path(params)[0]
    ]
    extra = [s.extra for s in log.steps] if log else []
    return (
        checks.check_idle_axes(layout.sizes, layout.idle_axes),
        checks.check_pipeline_bubble(
            layout.sizes.get("stage", 1), compiled.trainer.config.micro_batches, compiled.trainer.model.layers
        ),
        checks.check_expert_skew(
            [e["expert_load_max_over_mean"] for e in extra if "expert_load_max_over_mean" in e],
            [e["dropped_fraction"] for e in extra if "dropped_fraction" in e],
        ),
        checks.check_unsharded(layout.strategy, sharding_report(rows), layout.sizes.get("fsdp", 1)),
    )


# --- communication ------------------------------------------------------------------------------


def _communication(compiled: _Compiled, log: RunLog | None, devices) -> tuple[Finding, ...]:
    if compiled.inspection is None:
        reason = "the step did not compile (see memory), so there is no HLO to read"
        return tuple(
            Finding("communication", name, "not applicable", reason)
            for name in ("largest collectives per axis", "communication volume per step", "exposed communication")
        )
    chip = _chip(devices)
    compute_s, source = _compute_time(compiled, log, chip)
    layout = compiled.trainer.layout
    return (
        checks.check_comm_time(_traffic(compiled, chip), compute_s, source),
        _volume(compiled)
        if layout.data_axes
        else Finding("communication", "communication volume per step", "not applicable", "the mesh has no data axis"),
        checks.check_exposed(_overlap(compiled, chip, devices)),
    )


def _chip(devices):

    return profile("cpu") if devices[0].platform == "cpu" else profile_for_device_kind(devices[0].device_kind)


def _on_torus(devices) -> bool:
    return devices[0].platform == "tpu" and hasattr(devices[0], "coords")


def _traffic(compiled: _Compiled, chip) -> list[checks.Traffic]:
    """Bytes per step and predicted seconds per (kind, axes): on TPU over the links each axis uses, else a switch."""

    inspection, mesh = compiled.inspection, compiled.trainer.mesh
    if _on_torus(mesh.devices.flat):
        seconds = [p.seconds for p in roofline(inspection, mesh, chip).collectives]
    else:
        seconds = [schedule.predict_seconds(c, chip) * (c.repeats or 1) for c in inspection.collectives]
    predicted: dict[tuple, float] = defaultdict(float)
    for c, s in zip(inspection.collectives, seconds):
        predicted[c.kind, c.axes] += s
    return [
        checks.Traffic(t.kind, t.axes or (), t.count, t.total_bytes, predicted[t.kind, t.axes], t.exact)
        for t in hlo.summarize(inspection.collectives)
    ]


def _compute_time(compiled: _Compiled, log: RunLog | None, chip) -> tuple[float, str]:
    """The step's compute: measured on a run (its median less the data wait), else the roofline on the chip."""

    if log is not None:
        return float(
            np.median([s.seconds - s.data_s - s.save_s for s in log.timed_steps])
        ), "the measured step, less its data wait"
    cost = compiled.inspection.cost
    seconds = max(cost.get("flops", 0.0) / chip.peak_bf16_flops, cost.get("bytes accessed", 0.0) / chip.hbm_bandwidth)
    return seconds, f"roofline compute and HBM time on {chip.name}"


def _volume(compiled: _Compiled) -> Finding:
    """Data-axis collectives' bytes per step against the ZeRO paper's volume for the strategy."""
    trainer = compiled.trainer
    layout = trainer.layout
    counted = [
        c for c in compiled.inspection.collectives if c.kind in _DP_KINDS and c.axes and set(c.axes) <= layout.data_axes
    ]
    moved = sum(c.size_bytes * (c.repeats or 1) * (2 if c.kind == "all-reduce" else 1) for c in counted)
    # one model copy as the data axes see it: each parameter whole over the axes ZeRO shards it on (an expert or
    # tensor split is model parallelism: no data-axis collective ever gathers it)
    model = sum(
        _bytes_per_device(a)
        * math.prod(layout.sizes[axis] for axis in spec_axes(a.sharding.spec) if axis in _ZERO_AXES)
        for a in jax.tree.leaves(compiled.state.params)
    )
    strategy = layout.strategy
    expected = checks.zero_volume(
        strategy.shards_params and layout.sizes.get("fsdp", 1) > 1, strategy.reshard_after_forward
    )  # fsdp=1: nothing to gather
    exact = all(c.repeats is not None for c in counted)
    return checks.check_comm_volume(moved, model, expected, trainer.config.micro_batches, strategy.name, exact)


def _overlap(compiled: _Compiled, chip, devices):
    """lab.hlo.schedule's overlap report where the HLO has async collectives (TPU torus or switch); else None."""

    inspection = compiled.inspection
    if not any(c.is_async for c in inspection.collectives):
        return None
    torus = (
        slice_shape(devices)[: chip.torus_dims] if _on_torus(devices) else ()
    )  # coords have three entries; a v5e torus two
    return schedule.overlap_report(inspection.optimized_hlo, chip, torus, inspection.mesh_shape, inspection.axis_names)


# --- numerics -----------------------------------------------------------------------------------


NUMERICS_CHECKS = ("NaN or Inf", "gradient-norm spikes", "loss divergence")


def _numerics(log: RunLog) -> tuple[Finding, ...]:
    losses, norms = log.losses, [s.grad_norm for s in log.steps]
    return checks.check_nonfinite(losses, norms), checks.check_spikes(norms), checks.check_divergence(losses)
