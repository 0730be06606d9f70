"""`lab train`: a training run on any mesh of the five axes, with metrics, a log, checkpoints and a page.

The run is the loop users write around a train step: build the mesh, create
(or restore) the sharded state, feed batches, measure each step, save now and
then. Four things make it a lab rather than a demo:

* **Deterministic data.** Batch ``k`` depends only on the seed and ``k``, so a
  resumed run sees the batches the uninterrupted one saw, and any mesh sees
  the same global batch as the 1-device control (torchtitan's parity test:
  one control, many layouts). The synthetic language is arithmetic sequences
  ``t_{i+1} = t_i + stride (mod V)``: learnable, so the loss visibly falls.
* **Per-step metrics.** Step time is one iteration of the loop on the wall
  clock, split into its parts: waiting for the batch (`lab.training.data`,
  which can be made slow and can prefetch), the step until its loss is ready,
  the blocking part of a checkpoint save; tokens/s = B·S / step time; model
  FLOPs utilisation (Chowdhery et al. 2022, PaLM, Appendix B) = (6Ψ_active +
  12·L·H·K·S) FLOPs per token × tokens/s ÷ peak FLOP/s of the chips
  (`lab.targets.hardware`); the gradient norm and what the model reports (MoE load).
* **A readable timeline.** The page reads the step-time series with
  `lab.training.series` (periodic, random, trend or steady), and ``--profile``
  records a `jax.profiler` trace whose device time `lab.training.profiling` splits by
  the step's named scopes.
* **Several processes.** With ``jax.distributed`` the same loop runs once per
  host; every process builds the same global batch (each device loads only
  its slice) and only process 0 writes the log and the page. The processes
  first agree on their options; when one stops, the others stop too within
  the heartbeat timeout, each saying why in one line (`lab.targets.native`).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.profiler import StepTraceAnnotation, TraceAnnotation

from lab import inputs, progress
from lab.errors import LabError
from lab.mesh import MeshSpec, describe
from lab.model import preset
from lab.targets import native
from lab.targets.devices import DEFAULT_TARGET, describe_devices, devices_for, distributed_devices
from lab.targets.hardware import profile, profile_for_device_kind
from lab.training import data as input_pipeline
from lab.training import lock, metrics_log, profiling
from lab.training.checkpoint import CheckpointPolicy, Checkpoints
from lab.training.metrics_log import StepMetrics
from lab.training.series import analyze
from lab.training.step import TrainConfig, Trainer


@dataclass(frozen=True)
class RunConfig:
    """Train the lab's transformer on synthetic data on any mesh; write a JSONL log and a results page."""

    target: str = DEFAULT_TARGET
    """cpu:N, gpu or tpu (with several processes: the devices of this process, e.g. cpu:4)"""
    mesh: str = "data=2,fsdp=2,tensor=2"
    """axis sizes over data, stage, fsdp, expert, tensor: data/fsdp/expert split the batch, fsdp the weights
    (ZeRO), tensor the heads and MLP (Megatron), expert the experts of an MoE model, stage the layers (GPipe)"""
    model: str = "tiny"
    """model preset from lab.model.PRESETS (tiny, tiny-moe, small, 125m, ...)"""
    strategy: str = "zero3"
    """data-parallel strategy from lab.rules.STRATEGIES (ddp, zero1, zero2, zero3, zero3-keep); the tensor and
    expert splits come with every one"""
    steps: int = 20
    """train until this step (a resumed run continues from its checkpoint's step)"""
    global_batch: int = 16
    """sequences per step, split over the data axes"""
    micro_batches: int = 1
    """micro-batches per step: gradient accumulation, or with stage > 1 the pipeline's micro-batches
    (bubble (P-1)/(M+P-1))"""
    learning_rate: float = 3e-3
    """AdamW's learning rate"""
    seed: int = 0
    """seeds the initial weights and the data"""
    results: Path = Path("results")
    """the page goes to <results>/<name>/"""
    name: str = "train"
    """the run's name: its page folder"""
    log: Path | None = None
    """JSONL metrics, one line per step (default <results>/<name>.metrics.jsonl, beside the page's folder, which a
    page write replaces whole)"""
    checkpoint_dir: Path | None = None
    """save the state here (orbax); none: no checkpoints"""
    checkpoint_every: int = 0
    """save every this many steps (0: only at the end)"""
    async_checkpoint: bool = False
    """write checkpoints in the background while training continues"""
    input_ms: float = 0.0
    """milliseconds the input pipeline takes to make each batch (simulates a slow loader; 0: instant)"""
    input_jitter_ms: float = 0.0
    """random extra milliseconds per batch, exponential with this mean (a loader's long tail)"""
    prefetch: int = 0
    """batches loaded ahead by background workers (0: the loop waits for each batch)"""
    profile: Path | None = None
    """write a jax.profiler trace of the run here (opens in XProf/TensorBoard, or Perfetto: perfetto_trace.json.gz)"""
    resume: bool = False
    """continue from the latest checkpoint in --checkpoint-dir (onto this mesh, whatever mesh saved it)"""
    coordinator: str | None = None
    """jax.distributed coordinator host:port; with --num-processes and --process-id, or from TPU/SLURM"""
    num_processes: int | None = None
    """how many processes the run has (with --coordinator)"""
    process_id: int | None = None
    """this process's index, 0 to num-processes - 1 (0 runs the coordinator)"""
    distributed: bool = False
    """initialise jax.distributed from the environment (TPU VM, SLURM) without the three flags"""
    page: bool = True
    """write the results page (process 0)"""
    halt_on_nan: bool = True
    """stop at the first NaN or Inf loss with an error (lab doctor keeps going, to study the divergence)"""


WARMUP_STEPS = 2  # left out of step-time statistics


@dataclass(frozen=True)
class RunLog:
    """What a run did: its metrics per step, compile time and where it started."""

    config: RunConfig
    mesh: str
    devices: str
    processes: int
    start_step: int
    compile_s: float
    peak_flops: float
    idle_axes: tuple[str, ...] = ()  # mesh axes > 1 that nothing splits: their devices repeat the same work
    state_bytes: int = (
        0  # the training state (weights, master weights, optimizer), all devices together: what a checkpoint saves
    )
    steps: list[StepMetrics] = field(default_factory=list)
    earlier: list[StepMetrics] = field(default_factory=list)  # a resumed run: the steps its log kept, 0..start_step-1
    profile: dict[str, float] = field(
        default_factory=dict
    )  # device seconds per part of the step, from --profile's trace

    @property
    def losses(self) -> list[float]:
        return [s.loss for s in self.steps]

    @property
    def history(self) -> list[StepMetrics]:
        """Every step the run's log holds: the earlier run's up to the checkpoint, then this run's."""
        return self.earlier + self.steps

    @property
    def timed_steps(self) -> list[StepMetrics]:
        """The steps after warm-up (the first iterations run freshly loaded code and caches)."""
        return self.steps[WARMUP_STEPS:] if len(self.steps) > WARMUP_STEPS else self.steps

    def series(self):
        """The step-time series analysis (`lab.training.series`) of the steps after warm-up."""

        timed = self.timed_steps
        return analyze([s.seconds for s in timed], first_step=timed[0].step)

    @property
    def median_step_s(self) -> float:
        return float(np.median([s.seconds for s in self.steps])) if self.steps else float("nan")

    @property
    def tokens_per_s(self) -> float:
        return self.config.global_batch * _model(self.config).seq / self.median_step_s


def synthetic_batch(vocab: int, global_batch: int, length: int, seed: int, step: int) -> np.ndarray:
    """Batch `step` of the arithmetic-sequence language: [B, length] int32, a function of (seed, step) only."""
    rng = np.random.default_rng([seed, step])
    start_B1 = rng.integers(0, vocab, (global_batch, 1))
    stride_B1 = rng.integers(1, 4, (global_batch, 1))
    return ((start_B1 + stride_B1 * np.arange(length)[None, :]) % vocab).astype(np.int32)


def flops_per_token(model) -> float:
    """6Ψ + 12·L·H·K·S: training FLOPs per token, weights and attention (PaLM, Appendix B); for MoE, Ψ counts
    the parameters a token goes through (k experts of E), not all of them."""
    return 6 * model.active_parameters + 12 * model.layers * model.heads * model.head_dim * model.seq


def run(config: RunConfig, devices=None) -> RunLog:
    """Train as `config` says on `devices` (default: the target's, after jax.distributed when asked)."""

    check(config)
    devices = _devices(config) if devices is None else devices
    # a batch the mesh cannot split fails at once, before any compile or any file is written
    trainer_for(config, devices).layout.check_batch(config.global_batch, config.micro_batches)
    try:
        with _results_lock(config):
            return _train(config, devices)
    except jax.errors.JaxRuntimeError as err:
        if jax.process_count() == 1:
            raise  # one process: a runtime failure is a bug to see whole
        native.await_verdict(err, HEARTBEAT_S)


def _results_lock(config: RunConfig):
    """Process 0 holds ``<results>/.<name>.lock`` for the run: its page and log are no other run's."""
    if jax.process_index() != 0:
        return contextlib.nullcontext()
    return lock.hold(
        config.results / f".{config.name}.lock",
        f"--results {str(config.results)!r} --name {config.name!r}",
        "wait for it, or give this run another --name",
    )


def _train(config: RunConfig, devices) -> RunLog:
    model, trainer = _model(config), trainer_for(config, devices)
    mesh = trainer.mesh
    logged = metrics_log.logged(config)  # before the restore and the compile: a damaged log is refused first
    checkpoints = _checkpoints(config)
    start_step, state = _initial_state(config, trainer, checkpoints)
    started = time.perf_counter()
    step_fn = trainer.compiled_step(config.global_batch)
    log = RunLog(
        config,
        describe(mesh),
        _describe(devices),
        jax.process_count(),
        start_step,
        time.perf_counter() - started,
        _peak_flops(devices),
        trainer.layout.idle_axes,
        sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(trainer.abstract_state())),
    )
    log.earlier.extend(s for s in logged if s.step < start_step)
    writer = metrics_log.writer(config, log.earlier)
    loader = input_pipeline.Loader(
        lambda step: synthetic_batch(model.vocab, config.global_batch, model.seq + 1, config.seed, step),
        config.input_ms / 1e3,
        config.input_jitter_ms / 1e3,
        config.seed,
    )
    data = input_pipeline.batches(loader, start_step, config.steps, config.prefetch)
    loop = _Loop(config, model, step_fn, trainer.batch_sharding(), checkpoints, log.peak_flops)
    try:
        with profiling.trace(config.profile):
            for step in progress.track(range(start_step, config.steps), f"train {config.mesh}"):
                state, metrics = loop.iterate(step, state, data)
                log.steps.append(metrics)
                writer(metrics)
                if config.halt_on_nan and not math.isfinite(metrics.loss):
                    raise LabError(
                        f"step {metrics.step}: the loss is {metrics.loss}: training diverged (the log has every step "
                        "so far); run `lab doctor` with the same options to see why"
                    )
    finally:
        data.close()
        if checkpoints is not None:
            checkpoints.close()
    if config.profile is not None:
        log.profile.update(profiling.scope_times(profiling.latest_session(config.profile), step_fn.as_text()))
    return log


def trainer_for(config: RunConfig, devices):
    """The Trainer a run of `config` on `devices` uses (cached: a second call or run reuses its compiled step)."""

    mesh = MeshSpec.parse(config.mesh).build(devices)
    return _trainer(
        _model(config),
        TrainConfig(strategy=config.strategy, micro_batches=config.micro_batches, learning_rate=config.learning_rate),
        mesh,
    )


@functools.lru_cache(maxsize=4)
def _trainer(model, train_config, mesh):
    """One Trainer per (model, training config, mesh): repeated runs in one process reuse its compiled step."""

    return Trainer(model, train_config, mesh)


def check(config: RunConfig) -> None:
    """Refuse what cannot run before anything is compiled or written (`lab.inputs`)."""
    inputs.number("--steps", config.steps, low=1, high=MAX_STEPS)
    inputs.number("--global-batch", config.global_batch, low=1)
    inputs.number("--micro-batches", config.micro_batches, low=1, high=config.global_batch)
    inputs.positive("--learning-rate", config.learning_rate, high=1.0)
    inputs.number("--seed", config.seed, low=0, high=2**32 - 1)
    inputs.number("--checkpoint-every", config.checkpoint_every, low=0)
    inputs.number("--input-ms", config.input_ms, low=0, high=MAX_INPUT_MS)
    inputs.number("--input-jitter-ms", config.input_jitter_ms, low=0, high=MAX_INPUT_MS)
    inputs.number("--prefetch", config.prefetch, low=0, high=64)
    tokens_bytes = config.global_batch * (preset(config.model).seq + 1) * 4
    if tokens_bytes > _host_memory() / 4:
        raise LabError(
            f"--global-batch {config.global_batch}: one step's tokens alone take {tokens_bytes / 2**30:.1f} GiB, "
            f"more than a quarter of this host's {_host_memory() / 2**30:.0f} GiB; use a smaller batch"
        )
    if config.resume and config.checkpoint_dir is None:
        raise LabError("--resume needs --checkpoint-dir: the folder an earlier lab train saved to")
    inputs.page_name("--name", config.name)
    if config.coordinator is not None:
        inputs.address("--coordinator", config.coordinator)
    if config.num_processes is not None:
        inputs.number("--num-processes", config.num_processes, low=1)
    if config.process_id is not None:
        most = config.num_processes - 1 if config.num_processes is not None else None
        inputs.number("--process-id", config.process_id, low=0, high=most)
    if config.page:
        inputs.output_folder("--results", config.results)
    inputs.output_file(
        "--log", metrics_log.path_of(config)
    )  # the default one too: beside the page, never through a link
    for option, folder in (("--checkpoint-dir", config.checkpoint_dir), ("--profile", config.profile)):
        if folder is not None:
            inputs.output_folder(option, folder)


MAX_STEPS = 10**8  # a run of more steps than this is a typo (1e20), not a plan
MAX_INPUT_MS = 60_000.0  # a simulated loader slower than a minute per batch is a typo


def _host_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _model(config: RunConfig):

    return preset(config.model)


JOIN_TIMEOUT_S = 60  # how long the processes of a run wait for each other to join
HEARTBEAT_S = 10  # a process silent this long is declared dead by the coordinator, and every other one stops


def _devices(config: RunConfig) -> tuple:
    if config.distributed or config.coordinator is not None or config.num_processes is not None:
        devices = distributed_devices(
            config.target,
            config.coordinator,
            config.num_processes,
            config.process_id,
            timeout_s=JOIN_TIMEOUT_S,
            heartbeat_s=HEARTBEAT_S,
        )
        try:
            _agree(config)
        except jax.errors.JaxRuntimeError as err:
            native.await_verdict(err, HEARTBEAT_S)
        return devices
    return devices_for(config.target)


# what every process of a run must agree on before the first step (the rest, such as --process-id, may differ)
AGREED = ("mesh", "model", "strategy", "steps", "global_batch", "micro_batches", "learning_rate", "seed", "resume")


def _agree(config: RunConfig) -> None:
    """Every process publishes a hash of each field of `AGREED`; a mismatch stops all of them, naming the field.

    Processes started with different meshes or step counts would otherwise compile different programs and wait on
    each other's collectives forever.
    """
    mine = np.array([zlib.crc32(repr(getattr(config, name)).encode()) for name in AGREED], np.uint32)
    everyone = np.asarray(multihost_utils.process_allgather(mine))  # [processes, fields]
    for index, name in enumerate(AGREED):
        if len(set(everyone[:, index].tolist())) > 1:
            raise LabError(
                f"the processes of this run disagree on --{name.replace('_', '-')} (this is process "
                f"{jax.process_index()}, with {getattr(config, name)!r}); start every process with the same options"
            )


def _checkpoints(config: RunConfig):

    if config.checkpoint_dir is None:
        return None
    return Checkpoints(CheckpointPolicy(config.checkpoint_dir, config.checkpoint_every, config.async_checkpoint))


def _initial_state(config: RunConfig, trainer, checkpoints) -> tuple[int, object]:
    """Step 0 and fresh weights, or the latest checkpoint placed onto this run's mesh."""
    if not config.resume:
        return 0, trainer.init(config.seed)
    step, state = checkpoints.restore(trainer.abstract_state())
    for skipped in checkpoints.skipped:
        progress.say(f"checkpoint {skipped}; moved aside, resuming from step {step}")
    if step >= config.steps:
        raise LabError(
            f"the checkpoint in {str(config.checkpoint_dir)!r} is already "
            f"at step {step}; ask for more --steps than {step}"
        )
    return step, state


def _place(tokens: np.ndarray, sharding) -> jax.Array:
    """Each device takes its slice of the global batch; works across processes as every one builds the same batch."""
    return jax.make_array_from_callback(tokens.shape, sharding, lambda index: tokens[index])


@dataclass(frozen=True)
class _Loop:
    """What every iteration needs: the compiled step, where batches go, the checkpoints, the FLOP yardstick."""

    config: RunConfig
    model: object
    step_fn: object
    batch_sharding: object
    checkpoints: object
    peak_flops: float

    def iterate(self, step: int, state, data: Iterator[np.ndarray]):
        """One iteration as the wall clock sees it: wait for the batch, run the step, maybe save. The trace
        annotations name the same three parts in a profile (StepTraceAnnotation marks the step for XProf)."""

        tick = time.perf_counter()
        with StepTraceAnnotation("train", step_num=step):
            with TraceAnnotation("input"):
                batch = _place(next(data), self.batch_sharding)
            data_s = time.perf_counter() - tick
            with TraceAnnotation("step"):
                state, outputs = self.step_fn(state, batch)
                # one transfer of every scalar, which waits for the step to finish (a float() each would sync each one)
                outputs = {name: float(value) for name, value in jax.device_get(outputs).items()}
            save_tick = time.perf_counter()
            with TraceAnnotation("checkpoint"):
                saved = self.checkpoints is not None and self.checkpoints.save(
                    step + 1, state, force=step + 1 == self.config.steps
                )
            save_s = time.perf_counter() - save_tick
        seconds = time.perf_counter() - tick
        tokens_per_s = self.config.global_batch * self.model.seq / seconds
        loss, grad_norm = outputs.pop("loss"), outputs.pop("grad_norm")
        mfu = flops_per_token(self.model) * tokens_per_s / self.peak_flops
        return state, StepMetrics(
            step, loss, grad_norm, seconds, data_s, save_s, tokens_per_s, mfu, bool(saved), outputs
        )


def _peak_flops(devices) -> float:
    """Peak FLOP/s of the chips: one profile per accelerator; emulated CPU devices share the one measured machine."""

    if devices[0].platform == "cpu":
        return profile("cpu").peak_bf16_flops
    return profile_for_device_kind(devices[0].device_kind).peak_bf16_flops * len(devices)


def _describe(devices) -> str:

    return describe_devices(devices)
