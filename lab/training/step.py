"""The training step: one function for every data-parallel strategy.

A step is: split the global batch into micro-batches; for each, the forward
and backward pass, adding its gradients into an accumulator (`Layout.accumulate`
reduce-scatters there when the strategy shards gradients); reduce what is left
(`Layout.finish`: the all-reduce of DDP and ZeRO-1); then AdamW (optax) on the
optimizer's shard, and the new weights written back in the parameters' layout
(for ZeRO-1 and ZeRO-2 that is the all-gather of the updated weights).

On a mesh with a ``stage`` axis the blocks' layers are split over it and the
micro-batches go through one GPipe forward and backward together
(`lab.parallel.pipeline.spmd`); the embedding and the loss run replicated over
``stage``, and the gradients are reduced once the pipeline has drained.

Mixed precision follows the ZeRO paper's accounting (Rajbhandari et al. 2020,
Section 3.1): the working weights and gradients are kept in ``param_dtype``
(bf16: 2Ψ + 2Ψ bytes) while the optimizer keeps fp32 master weights and two
fp32 moments (12Ψ), each in its strategy's layout. With fp32 working weights
the master copy would duplicate them, so the optimizer reads the working
weights directly (resharding replicated weights to its shard is a local slice).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding

from lab import hlo
from lab.bench import time_fn
from lab.errors import LabError
from lab.model import ModelConfig, MoEStats, abstract_model, init_params, next_token_loss, run_blocks
from lab.moe import load_metrics
from lab.parallel.layout import Layout
from lab.parallel.pipeline.spmd import pipeline, split_stages
from lab.rules import get_strategy

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
FRESH_KEPT = 4  # fresh states a process keeps on the host for other meshes (`Trainer.init`)
FRESH_MAX_BYTES = 2**28
_fresh: dict[tuple, TrainState] = {}


@dataclass(frozen=True)
class TrainConfig:
    """How to train: strategy, micro-batching, optimizer and precision."""

    strategy: str = "zero3"
    micro_batches: int = 1  # gradient accumulation; with a stage axis, the pipeline's micro-batches
    learning_rate: float = 1e-3
    weight_decay: float = 0.01
    adam_eps: float = 1e-8
    param_dtype: str = "float32"  # working weights and gradients; "bfloat16" with fp32 master weights
    compute_dtype: str = "float32"
    remat: str = "none"  # none | dots | full | offload
    persist_below: int = 0  # ZeRO-3: parameters with fewer elements stay replicated
    sequence_parallel: bool = False  # Megatron SP on the tensor axis (`lab.parallel.layout.Layout.sequence_parallel`)

    def dtype(self, name: str) -> jnp.dtype:
        if name not in DTYPES:
            raise LabError(f"unknown dtype {name!r}; use one of {', '.join(DTYPES)}")
        return DTYPES[name]


class TrainState(NamedTuple):
    """What persists between steps: working weights, fp32 master weights (None when the same), AdamW state."""

    params: nnx.State
    master: nnx.State | None
    opt_state: optax.OptState


class Trainer:
    """A model, a strategy and a mesh: the state's shardings and the jitted step."""

    def __init__(self, model: ModelConfig, config: TrainConfig, mesh: jax.sharding.Mesh):
        if config.micro_batches < 1:
            raise LabError(f"micro_batches={config.micro_batches}: use 1 or more")
        strategy = replace(get_strategy(config.strategy), persist_below=config.persist_below)
        self.model, self.config, self.mesh = model, config, mesh
        self.layout = Layout(
            mesh,
            strategy,
            config.dtype(config.param_dtype),
            config.dtype(config.compute_dtype),
            config.remat,
            config.sequence_parallel,
        )
        stages = self.layout.stages
        if stages > 1 and model.dense_layers:
            raise LabError(
                f"stage={stages}: the pipeline cuts the layers' one scan into stages, and this model's "
                f"dense_layers={model.dense_layers} are a scan of their own; drop the stage axis"
            )
        if model.scan_length % stages:
            what = f"{model.scan_length} periods of {model.period}" if model.period > 1 else str(model.layers)
            raise LabError(
                f"{what} layers cannot be cut into stage={stages} "
                f"pipeline stages; use a stage axis that divides {model.scan_length}"
            )
        self.graphdef, self.abstract_params = abstract_model(model)
        self.param_shardings = self.layout.shardings(self.abstract_params, "params")
        self.grad_shardings = self.layout.shardings(self.abstract_params, "grads")
        self.optimizer_shardings = self.layout.shardings(self.abstract_params, "optimizer")
        self.layout.check_sufficiently_sharded(self.abstract_params)
        self._compiled: dict[tuple[str, int, bool], jax.stages.Compiled] = {}
        self.optimizer = optax.adamw(
            config.learning_rate, b1=0.9, b2=0.95, eps=config.adam_eps, weight_decay=config.weight_decay
        )

    @property
    def separate_master(self) -> bool:
        return self.layout.param_dtype != jnp.float32

    # --- state --------------------------------------------------------------------------

    def init(self, seed: int = 0) -> TrainState:
        """The state, initialized directly into its shardings (one program: no device holds more than its shard).

        The initializer runs once, so on CPU its machine code is not worth LLVM's optimizations (about half its
        compile): the same HLO, values equal to a few ulps. Its values depend on the model, the dtypes and the
        seed, not on the mesh (JAX's random bits are the same however they are sharded), so on CPU devices a
        process keeps the last few fresh states on the host and places them on the next mesh that asks: runs of
        one model on many meshes (a report's layouts, the doctor's cases) compile one initializer, not one each."""
        abstract = self.abstract_state()
        key = self._fresh_key(abstract, seed)
        if key in _fresh:
            return self.place(_fresh[key])
        shardings = jax.tree.map(lambda a: a.sharding, abstract)
        with jax.set_mesh(self.mesh):
            lowered = jax.jit(lambda: self._create(seed), out_shardings=shardings).lower()
            state = lowered.compile(self._unoptimized_on_cpu(True))()
        if key is not None:
            while len(_fresh) >= FRESH_KEPT:
                del _fresh[next(iter(_fresh))]
            _fresh[key] = jax.tree.map(np.asarray, state)
        return state

    def _fresh_key(self, abstract: TrainState, seed: int) -> tuple | None:
        """What a fresh state's values depend on; None where keeping it is not wanted: accelerators (the host copy
        would double what the devices hold), several processes, a large state, or random bits that depend on the
        sharding (``jax_threefry_partitionable`` off)."""
        leaves, tree = jax.tree.flatten(abstract)
        wanted = (
            self.mesh.devices.flat[0].platform == "cpu"
            and jax.process_count() == 1
            and jax.config.jax_threefry_partitionable
            and sum(a.size * a.dtype.itemsize for a in leaves) <= FRESH_MAX_BYTES
        )
        return (self.model, seed, tree, tuple((a.shape, a.dtype) for a in leaves)) if wanted else None

    def place(self, state: TrainState) -> TrainState:
        """Put a state (e.g. from another mesh, or numpy) into this trainer's shardings."""
        shardings = jax.tree.map(lambda a: a.sharding, self.abstract_state())
        return jax.device_put(jax.tree.map(np.asarray, state), shardings)

    def abstract_state(self) -> TrainState:
        """The state as ShapeDtypeStructs with shardings: enough to compile on a topology with no devices."""
        with jax.set_mesh(self.mesh):
            return self._on_mesh(jax.eval_shape(lambda: self._create(0)))

    def _create(self, seed: int) -> TrainState:
        master = jax.reshard(init_params(self.model, seed), self.optimizer_shardings)
        return TrainState(
            self._working_copy(master), master if self.separate_master else None, self.optimizer.init(master)
        )

    def _on_mesh(self, abstract):
        """eval_shape types carry the abstract mesh; compiling for a topology needs the concrete one."""

        def concrete(a):
            spec = a.sharding.spec if a.sharding is not None else jax.sharding.PartitionSpec()  # optax's step count
            return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(self.mesh, spec))

        return jax.tree.map(concrete, abstract)

    def _working_copy(self, master: nnx.State) -> nnx.State:
        """fp32 master weights -> working weights in the parameters' layout (ZeRO-1/2: an all-gather)."""
        return jax.reshard(jax.tree.map(lambda m: m.astype(self.layout.param_dtype), master), self.param_shardings)

    # --- data ---------------------------------------------------------------------------

    def batch_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, self.layout.batch_spec())

    def batch(self, global_batch: int, seed: int = 0) -> jax.Array:
        """Random tokens [B, S+1] (inputs and next-token targets), split over the data axes."""
        self.layout.check_batch(global_batch, self.config.micro_batches)
        tokens = np.random.default_rng(seed).integers(
            0, self.model.vocab, (global_batch, self.model.seq + 1), dtype=np.int32
        )
        return jax.device_put(tokens, self.batch_sharding())

    def abstract_batch(self, global_batch: int) -> jax.ShapeDtypeStruct:
        self.layout.check_batch(global_batch, self.config.micro_batches)
        return jax.ShapeDtypeStruct((global_batch, self.model.seq + 1), jnp.int32, sharding=self.batch_sharding())

    # --- the step -----------------------------------------------------------------------

    @functools.cached_property
    def step(self):
        """jit(state, tokens) -> (state, {"loss", "grad_norm"}), plus for an MoE model {"balance_loss",
        "expert_load_max_over_mean", "dropped_fraction"}; every entry a scalar; the state is donated.

        The gradient's global L2 norm comes with the loss: the numerics a doctor reads (a spike, an Inf)
        cost one reduction over gradients the step already holds."""
        return jax.jit(self._step, donate_argnums=0)

    @functools.cached_property
    def gradients(self):
        """jit(params, tokens) -> (reduced gradients in the strategy's layout, loss)."""
        return jax.jit(lambda params, tokens_BT: self._gradients(params, tokens_BT)[:2])

    def compiled_step(self, global_batch: int, *, to_read: bool = False) -> jax.stages.Compiled:
        """The step compiled ahead of time for abstract inputs: no device memory needed, so it works on
        compile-only topologies; on real devices the same executable is what `time_step` runs.

        ``to_read=True`` compiles it only to read its HLO and memory: on CPU the LLVM back end then runs
        unoptimized (HLO, buffers and collectives are settled before it), about twice as fast to compile.
        """
        return self._compile(
            "step",
            global_batch,
            to_read,
            lambda: self.step.lower(self.abstract_state(), self.abstract_batch(global_batch)),
        )

    def compiled_gradients(self, global_batch: int) -> jax.stages.Compiled:
        """The forward and backward alone, compiled to be read.

        Its outputs are the reduced gradients in their layout, and the loss.
        """
        return self._compile(
            "gradients",
            global_batch,
            True,
            lambda: self.gradients.lower(self.abstract_state().params, self.abstract_batch(global_batch)),
        )

    def _compile(self, program: str, global_batch: int, to_read: bool, lower) -> jax.stages.Compiled:
        key = (program, global_batch, to_read)
        if key not in self._compiled:  # jit's own cache does not hold ahead-of-time compiles
            with jax.set_mesh(self.mesh):
                self._compiled[key] = lower().compile(self._unoptimized_on_cpu(to_read))
        return self._compiled[key]

    def _unoptimized_on_cpu(self, wanted: bool) -> dict | None:
        """Compiler options for a program only read or run once: on CPU, LLVM's back end without optimizations."""
        return {"xla_backend_optimization_level": 0} if wanted and self.mesh.devices.flat[0].platform == "cpu" else None

    def inspect_step(self, global_batch: int, *, to_read: bool = False) -> hlo.Inspection:
        """The step's collectives, memory and cost (`lab.hlo.Inspection`); ``to_read``: see `compiled_step`."""
        return hlo.inspect_compiled(self.compiled_step(global_batch, to_read=to_read), self.mesh)

    def inspect_gradients(self, global_batch: int) -> hlo.Inspection:
        return hlo.inspect_compiled(self.compiled_gradients(global_batch), self.mesh)

    def time_step(self, global_batch: int, *, repeats: int = 5, warmup: int = 2, start: TrainState | None = None):
        """Median step time (`lab.bench.Timing`) of the compiled step; each call consumes the previous state.

        `start` (any mesh, or numpy) saves compiling the initializer when several trainers time the same model.
        """

        executable, batch = self.compiled_step(global_batch), self.batch(global_batch)
        state = [self.init() if start is None else self.place(start)]

        def one_step():
            state[0], metrics = executable(state[0], batch)
            return metrics["loss"]

        return time_fn(one_step, warmup=warmup, repeats=repeats)

    def _loss(self, params: nnx.State, tokens_BT: jax.Array) -> tuple[jax.Array, tuple[jax.Array, MoEStats | None]]:
        """The training loss (language model + MoE balancing) and, as aux, the language-model loss and MoE stats."""
        logits_BSV, stats = nnx.merge(self.graphdef, params).forward(tokens_BT[:, :-1], self.layout)
        language_loss = next_token_loss(logits_BSV, tokens_BT[:, 1:])
        balance = 0.0 if stats is None else stats.balance_loss.sum()  # summed over layers, each its own α·aux
        return language_loss + balance, (language_loss, stats)

    def _pipelined_loss(
        self, params: nnx.State, tokens_BT: jax.Array
    ) -> tuple[jax.Array, tuple[jax.Array, MoEStats | None]]:
        """`_loss` over all micro-batches at once, the blocks pipelined over ``stage``.

        The embedding and the head are replicated over ``stage``.
        """
        model = nnx.merge(self.graphdef, params)
        micro_MbT = _split_micro_batches(tokens_BT, self.config.micro_batches)
        x_MbSD = jax.vmap(lambda micro_bT: model.embed(micro_bT[:, :-1], self.layout))(micro_MbT)
        blocks_graphdef, blocks = nnx.split(model.blocks)

        def stage(blocks_of_stage: nnx.State, x_bSD: jax.Array) -> tuple[jax.Array, MoEStats | None]:
            return run_blocks(nnx.merge(blocks_graphdef, blocks_of_stage), x_bSD, self.layout)

        y_MbSD, stats_P = pipeline(stage, split_stages(blocks, self.layout.stages), x_MbSD)
        logits_MbSV = jax.vmap(lambda y_bSD: model.head(y_bSD, self.layout))(y_MbSD)
        language_loss = next_token_loss(logits_MbSV, micro_MbT[..., 1:])
        if stats_P is None:
            return language_loss, (language_loss, None)
        # [P, L/P] -> [L]: stage p ran layers p·L/P ...; the balancing loss averaged over micro-batches, counts summed
        stats = jax.tree.map(lambda s: s.reshape(-1, *s.shape[2:]), stats_P)
        stats = stats._replace(balance_loss=stats.balance_loss / self.config.micro_batches)
        return language_loss + stats.balance_loss.sum(), (language_loss, stats)

    def _gradients(self, params: nnx.State, tokens_BT: jax.Array) -> tuple[nnx.State, jax.Array, MoEStats | None]:
        """Reduced gradients, the language-model loss and the MoE stats.

        Over the micro-batches, the balancing loss is averaged and the counts are summed.
        """
        count = self.config.micro_batches
        self.layout.check_batch(tokens_BT.shape[0], count)
        if self.layout.stages > 1:
            (_, (loss, stats)), grads = jax.value_and_grad(self._pipelined_loss, has_aux=True)(params, tokens_BT)
            with jax.named_scope("reduce_gradients"):
                return (
                    self.layout.finish(self.layout.accumulate(None, grads, self.grad_shardings), self.grad_shardings),
                    loss,
                    stats,
                )

        def one(accumulated, micro_BT):
            # each micro-batch's mean loss is divided by the count before autodiff: partial sums support
            # addition but not division, so the gradients must arrive already scaled
            (_, (loss, stats)), grads = jax.value_and_grad(
                lambda p: _scaled(self._loss(p, micro_BT), count), has_aux=True
            )(params)
            with jax.named_scope("reduce_gradients"):
                return self.layout.accumulate(accumulated, grads, self.grad_shardings), (loss, stats)

        if count == 1:
            summed, (loss, stats) = one(None, tokens_BT)
        else:
            micro_MBT = _split_micro_batches(tokens_BT, count)
            start = self.layout.zeros(jax.eval_shape(lambda: one(None, micro_MBT[0])[0]))
            summed, (losses, stats) = jax.lax.scan(one, start, micro_MBT)
            loss, stats = losses.sum(), jax.tree.map(lambda s: s.sum(0), stats)
        with jax.named_scope("reduce_gradients"):
            return self.layout.finish(summed, self.grad_shardings), loss, stats

    def _step(self, state: TrainState, tokens_BT: jax.Array) -> tuple[TrainState, dict[str, jax.Array]]:
        # named scopes label the HLO ops (op_name metadata) and so the rows of a jax.profiler trace
        with jax.named_scope("forward_backward"):
            grads, loss, stats = self._gradients(state.params, tokens_BT)
        with jax.named_scope("optimizer"):
            master = state.master if self.separate_master else jax.reshard(state.params, self.optimizer_shardings)
            grads = jax.reshard(jax.tree.map(lambda g: g.astype(jnp.float32), grads), self.optimizer_shardings)
            grad_norm = optax.tree.norm(grads)
            updates, opt_state = self.optimizer.update(grads, state.opt_state, master)
            master = optax.apply_updates(master, updates)
        with jax.named_scope("write_back"):
            params = self._working_copy(master)
        metrics = {"loss": loss, "grad_norm": grad_norm} | ({} if stats is None else _moe_metrics(stats))
        return TrainState(params, master if self.separate_master else None, opt_state), metrics


def _scaled(loss_and_aux: tuple[jax.Array, tuple], count: int) -> tuple[jax.Array, tuple]:
    """Divide the training loss, the language-model loss and the balancing loss by the micro-batch count.

    The counts stay sums.
    """
    loss, (language_loss, stats) = loss_and_aux
    stats = None if stats is None else stats._replace(balance_loss=stats.balance_loss / count)
    return loss / count, (language_loss / count, stats)


def _moe_metrics(stats: MoEStats) -> dict[str, jax.Array]:
    """Scalars a doctor reads from an MoE step: the balancing loss, the worst layer's load skew, the dropped share."""
    per_layer = jax.vmap(load_metrics)(stats.counts)
    return {
        "balance_loss": stats.balance_loss.sum(),
        "expert_load_max_over_mean": per_layer.max_over_mean.max(),
        "dropped_fraction": stats.counts.dropped.sum() / jnp.maximum(stats.counts.chosen.sum(), 1.0),
    }


def _split_micro_batches(tokens_BT: jax.Array, count: int) -> jax.Array:
    """[B, T] -> [M, B/M, T], micro-batch m taking rows m, m+M, ...: each device keeps its own rows (no data moves)."""
    batch, length = tokens_BT.shape
    sharding = jax.typeof(tokens_BT).sharding
    rows_stay = NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(sharding.spec[0], None, None))
    interleaved = jnp.reshape(tokens_BT, (batch // count, count, length), out_sharding=rows_stay)
    return jnp.moveaxis(interleaved, 1, 0)
