"""The training step a prediction compiles: the lab's `Trainer`, at full size, declared abstractly.

`lab.training.step.Trainer` already compiles a whole step (forward, backward,
gradient reduction by the strategy's `Layout`, AdamW with fp32 master weights)
for ShapeDtypeStruct inputs, which is all a compile-only topology allows. Two
things change at full size:

* the loss: a Llama-3-sized vocabulary makes the logits [B, S, V] in fp32 the
  largest array of the step (5 x 8192 x 128256 x 4 B = 21 GB per chip), so the
  head and the cross-entropy run over chunks of the sequence, each chunk
  rematerialized in the backward pass (the usual production remedy: MaxText's
  vocabulary tiling, Liger's fused linear cross-entropy). Same loss, same
  FLOPs (plus one recompute of the head matmul), a bounded buffer.
* the remat names: ``full`` saves only each block's input (`nothing_saveable`),
  ``minimal`` saves every weight matmul's output (MaxText's: the dots
  without batch dimensions; the attention's scores and the norms' scale are
  recomputed), ``minimal_flash`` those and the attention's output (MaxText's
  GPU recipes), ``none`` saves all;
  ``offload:<names>`` is MaxText's custom policy, the named activations (the
  block's input, the attention's projections) sent to host memory and brought
  back for the backward pass, the rest recomputed.

A program that does not fit the chip's HBM is still a prediction, not an
error. libtpu refuses to compile it; ``--xla_tpu_no_crash_on_oom=true`` (set
before libtpu starts by `lab.targets.libtpu.prepare`) lets some such compiles
finish with a memory analysis, but a single buffer larger than HBM, or a program far
over, still fails (`DoesNotFit`). `lab.predict.command` then compiles two
layers under scan and reads that program at the full depth (`lab.predict.depth`).
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from lab.errors import LabError
from lab.model import ModelConfig, run_blocks, sequence_whole
from lab.parallel.layout import CUSTOM_PREFIX, NAMED_ACTIVATIONS, OFFLOAD_PREFIX, custom_places, remat_policy
from lab.predict import xla_estimate
from lab.targets.devices import quiet_native_stderr
from lab.training.step import TrainConfig, Trainer

REMATS = {
    "full": "full",
    "minimal": "dots",
    "minimal_flash": "dots_flash",
    "none": "none",
}  # the predictor's names -> lab.parallel.layout's
LOSS_CHUNK = 1024  # tokens of each sequence whose logits exist at once


class _ChunkedLossTrainer(Trainer):
    """`Trainer` whose loss runs the head over sequence chunks (see the module docstring)."""

    def _loss(self, params, tokens_BT):
        model = nnx.merge(self.graphdef, params)
        x_BSD = model.dense_prefix(model.embed(tokens_BT[:, :-1], self.layout), self.layout)
        x_BSD, stats = run_blocks(model.blocks, x_BSD, self.layout)  # under LAYERS_SCOPE (lab.predict.depth)
        loss = chunked_next_token_loss(model, x_BSD, tokens_BT[:, 1:], self.layout)
        balance = 0.0 if stats is None else stats.balance_loss.sum()
        return loss + balance, (loss, stats)


def chunked_next_token_loss(model, x_BSD: jax.Array, targets_BS: jax.Array, layout, chunk: int = LOSS_CHUNK):
    """Mean next-token cross-entropy, the head applied to `chunk` positions at a time, each recomputed backward."""
    x_BSD = sequence_whole(x_BSD, layout)  # sequence parallelism: the chunks are cut from the whole sequence
    b, s, d = x_BSD.shape
    chunk = min(chunk, s)
    if s % chunk:
        chunk = s  # an odd length: one chunk (the whole logits), as the unchunked loss
    n = s // chunk
    x_NBCD = jnp.moveaxis(x_BSD.reshape(b, n, chunk, d), 1, 0)
    t_NBC = jnp.moveaxis(targets_BS.reshape(b, n, chunk), 1, 0)
    # gathered once for every chunk (as MaxText's unchunked head does), its gradient reduced once after them
    table = model.unembedding(layout)

    @jax.checkpoint  # save nothing of a chunk: its logits are rebuilt in the backward pass
    def one(x_BCD, t_BC):
        logits_BCV = model.head(x_BCD, layout, table)
        return optax.softmax_cross_entropy_with_integer_labels(logits_BCV, t_BC).sum()

    def body(total, xs):
        return total + one(*xs), None

    total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), (x_NBCD, t_NBC))
    return total / (b * s)


class DoesNotFit(LabError):
    """libtpu refused the step: some buffer, or all of them, exceed the chip's HBM."""


@dataclass(frozen=True)
class Compiled:
    """One compiled step: the executable's text and memory, and how long the compile took."""

    hlo: str
    memory: dict[str, int]
    cost: dict[str, float]
    compile_s: float
    layers: int  # the model's layers compiled (0: a program of the user's, `lab.predict.program`)
    disabled_passes: tuple[str, ...] = ()  # compiler passes this step compiled without (see `_compile`)
    xla_times: dict[str, float] = field(default_factory=dict)  # the compiler's own seconds per run (`xla_estimate`)


def layout_remat(remat: str) -> str:
    """The predictor's remat name as `lab.parallel.layout` writes it: full, minimal and none mapped (`REMATS`),
    MaxText's custom policy (``custom:<name>=<device|offload|remat>,...`` or ``offload:<names>``) checked and
    passed on."""
    if remat in REMATS:
        return REMATS[remat]
    if not remat.startswith((OFFLOAD_PREFIX, CUSTOM_PREFIX)):
        raise LabError(
            f"--remat {remat!r}: use one of {', '.join(REMATS)}, {OFFLOAD_PREFIX}<names> or "
            f"{CUSTOM_PREFIX}<name>=<device|offload|remat>,... (names: {', '.join(NAMED_ACTIVATIONS)})"
        )
    try:
        remat_policy(remat)
    except LabError as err:
        raise LabError(f"--remat {err}") from None
    return remat


def offloads(remat: str) -> bool:
    """Whether a remat sends activations to host memory (XLA then unrolls or peels the layer loops)."""
    return remat.startswith((OFFLOAD_PREFIX, CUSTOM_PREFIX)) and bool(custom_places(remat)[1])


def compile_step(model: ModelConfig, mesh, batch_per_device: int, **options) -> Compiled:
    """Lower and compile one training step of `model` over `mesh`, `batch_per_device` sequences per chip (`options`:
    `step_program`'s remat, dtypes, strategy and sequence parallelism)."""
    started = time.perf_counter()
    with jax.set_mesh(mesh):
        step, args = step_program(model, mesh, batch_per_device, **options)
        lowered = step.lower(*args)
        return compile_lowered(lowered, mesh, started, model.layers)


def step_program(
    model: ModelConfig,
    mesh,
    batch_per_device: int,
    *,
    remat: str = "full",
    param_dtype: str = "float32",
    compute_dtype: str = "bfloat16",
    strategy: str = "zero3",
    sequence_parallel: bool = False,
) -> tuple:
    """(the jitted step, its abstract arguments): the program `compile_step` compiles, in the form
    ``lab predict --fn`` and ``lab inspect --fn`` take a user's (`lab.explanation.program`)."""
    policy = layout_remat(remat)
    if batch_per_device < 1:
        raise LabError(f"--batch-per-device {batch_per_device}: use 1 or more")
    config = TrainConfig(
        strategy=strategy,
        param_dtype=param_dtype,
        compute_dtype=compute_dtype,
        remat=policy,
        sequence_parallel=sequence_parallel,
    )
    trainer = _ChunkedLossTrainer(model, config, mesh)
    return trainer.step, (trainer.abstract_state(), trainer.abstract_batch(batch_per_device * mesh.devices.size))


def compile_lowered(lowered, mesh, started: float, layers: int = 0) -> Compiled:
    """Compile a lowered step for `mesh`'s devices and read back what a prediction prices (any program: the lab's
    step, or the user's, `lab.predict.program`); `started` is when its lowering began, which the compile time
    counts from."""
    try:
        # the compiler's C++ log (libtpu's rematerialization warnings on a step over HBM) is not the user's:
        # the prediction says what does not fit, and by how much
        with quiet_native_stderr(), tempfile.TemporaryDirectory(prefix="lab-schedule-") as dumped:
            platform = mesh.devices.flat[0].platform
            compiled, disabled = _compile(lowered, _estimate_options(platform, dumped))
            elapsed = time.perf_counter() - started
            hlo = compiled.as_text()
            times = _estimate_times(platform, hlo, dumped)
    except jax.errors.JaxRuntimeError as err:
        if "RESOURCE_EXHAUSTED" not in str(err) and "Invalid TPU program" not in str(err):
            raise
        raise DoesNotFit(str(err).splitlines()[0][:200]) from None
    stats = compiled.memory_analysis()
    memory = {name[: -len("_in_bytes")]: int(getattr(stats, name)) for name in dir(stats) if name.endswith("_in_bytes")}
    cost = compiled.cost_analysis()
    cost = {k: float(v) for k, v in (cost or {}).items() if "{" not in k}
    return Compiled(hlo, memory, cost, elapsed, layers, disabled, times)


# libtpu 0.0.42's pass that hoists a loop's all-reduces out of it fails a RET_CHECK on some steps whose weights are
# cast before their gather (TPU7x's Llama 3.1 70B recipe): such a step compiles again without that pass
_CRASHING_PASS = "while-loop-all-reduce-code-motion"


def _compile(lowered, options: dict) -> tuple[object, tuple[str, ...]]:
    """The executable, and the compiler passes it was compiled without (none, or `_CRASHING_PASS` after it crashed)."""
    try:
        return lowered.compile(options or None), ()
    except jax.errors.JaxRuntimeError as err:
        if _CRASHING_PASS.replace("-", "_") not in str(err):
            raise
        return lowered.compile({**options, "xla_disable_hlo_passes": _CRASHING_PASS}), (_CRASHING_PASS,)


def _estimate_options(platform: str, dumped: str) -> dict:
    """The compiler's own estimate, asked for (`lab.predict.xla_estimate`): XLA:GPU writes it into the program,
    libtpu its schedule into `dumped`; XLA:CPU has none."""
    return {"gpu": xla_estimate.COMPILER_OPTIONS, "tpu": xla_estimate.tpu_options(dumped)}.get(platform, {})


def _estimate_times(platform: str, hlo: str, dumped: str) -> dict[str, float]:
    """The compiler's seconds per run of each instruction it priced (empty on CPU)."""
    if platform == "gpu":
        return xla_estimate.xla_times(hlo)
    return xla_estimate.schedule_times(dumped) if platform == "tpu" else {}
