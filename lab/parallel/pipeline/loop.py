"""The pipeline, executed: stages on the ``stage`` axis, activations passed by ``ppermute``.

A schedule from `lab.parallel.pipeline.schedules` becomes one SPMD program. Every
device runs the same loop over the schedule's ticks (its unit grid). At each
tick a device looks up its own action in the schedule's tables and runs it
(`lax.switch`: idle, or the forward or backward of one micro-batch on one
chunk); then the devices exchange what they produced: the forward's output
moves one device down the pipe and the backward's input gradient one device
up, each a `ppermute` (a collective-permute in HLO). What arrives is filed
into the buffer slot of the micro-batch it belongs to, as the tables say. The
tables are arguments of the step, so schedules of the same size share one
compiled program.

The backward is a hand-made vjp per micro-batch, not autodiff through the
loop: the forward calls `jax.vjp` and stores the pullback's residuals in its
micro-batch's slot; the backward rebuilds the pullback from that slot and
applies it to the gradient that arrived. So 1F1B really interleaves forwards
and backwards as its table says, and the buffers hold only as many
micro-batches as the schedule keeps alive (about P for 1F1B, m for GPipe):
what the schedule saves shows in XLA's memory analysis of the compiled step.

Because the exchange is a collective, devices advance tick by tick together:
a tick lasts as long as its slowest action (`lab.parallel.pipeline.schedules.
lockstep_makespan`), where GPUs sending point to point would let each stage
run ahead (`lab.parallel.pipeline.schedules.simulate`).
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from lab.errors import LabError
from lab.mesh import MeshSpec
from lab.parallel.pipeline.schedules import BACKWARD, FORWARD, Schedule, device_of
from lab.parallel.pipeline.stages import Workload, block_graph, stage_forward, stage_loss, stage_weights_abstract

IDLE_CODE, FORWARD_CODE, BACKWARD_CODE = 0, 1, 2


# --- the schedule as tables ----------------------------------------------------------------


@dataclass(frozen=True)
class Tables:
    """A unit grid as int32 tables the loop indexes by (tick, device)."""

    action: np.ndarray  # [T, P, 3]: kind code, micro-batch, chunk
    receive_forward: np.ndarray  # [T, P, 2]: (micro-batch, chunk) of the activation arriving before this tick; -1: none
    receive_backward: np.ndarray  # [T, P, 2]: the same for the gradient arriving from the device after
    depth: int  # the most micro-batches of one chunk a device keeps at once: the buffers' slots

    @property
    def ticks(self) -> int:
        return self.action.shape[0]


def schedule_tables(schedule: Schedule) -> Tables:
    """A schedule's unit grid as tables, with the buffer depth it needs."""
    if schedule.split_backward:
        raise LabError(
            f"schedule {schedule.name!r} splits the backward into I and W; "
            "the executed pipeline runs F and B only (use gpipe, 1f1b or "
            "interleaved)"
        )
    return lower_grid(schedule.grid(), schedule.stages, schedule.chunks)


def lower_grid(grid, stages: int, chunks: int) -> Tables:
    """Tables for any grid[device][tick] of F/B actions; receives follow the pipeline's wiring."""
    ticks, last_virtual = len(grid[0]) if grid else 0, stages * chunks - 1
    action = np.zeros((ticks, stages, 3), np.int32)
    receive_forward = np.full((ticks + 1, stages, 2), -1, np.int32)
    receive_backward = np.full((ticks + 1, stages, 2), -1, np.int32)
    arrival: dict[tuple[int, int, int], int] = {}  # (device, micro-batch, chunk) -> tick from which it is kept
    for tick in range(ticks):
        for device in range(stages):
            a = grid[device][tick]
            if a is None:
                continue
            action[tick, device] = (FORWARD_CODE if a.kind == FORWARD else BACKWARD_CODE, a.micro_batch, a.chunk)
            virtual = a.chunk * stages + device
            arrival.setdefault((device, a.micro_batch, a.chunk), tick)
            if a.kind == FORWARD and virtual < last_virtual:  # the next virtual stage receives the output
                target, chunk = device_of(virtual + 1, stages)
                receive_forward[tick + 1, target] = (a.micro_batch, chunk)
                arrival[target, a.micro_batch, chunk] = min(
                    tick + 1, arrival.get((target, a.micro_batch, chunk), ticks)
                )
            if a.kind == BACKWARD and virtual > 0:
                target, chunk = device_of(virtual - 1, stages)
                receive_backward[tick + 1, target] = (a.micro_batch, chunk)
    return Tables(action, receive_forward[:ticks], receive_backward[:ticks], _depth(grid, arrival))


def _depth(grid, arrival: dict) -> int:
    """The most micro-batches of one chunk alive on one device at once (kept from arrival to backward)."""
    done = {
        (d, a.micro_batch, a.chunk): t
        for d, row in enumerate(grid)
        for t, a in enumerate(row)
        if a is not None and a.kind == BACKWARD
    }
    alive = Counter()
    for (device, micro_batch, chunk), start in arrival.items():
        for tick in range(start, done.get((device, micro_batch, chunk), len(grid[0]) - 1) + 1):
            alive[device, chunk, tick] += 1
    return max(alive.values(), default=1)


# --- the SPMD program -------------------------------------------------------------------


@dataclass(frozen=True)
class PipelineProgram:
    """One SPMD step for a workload on a mesh, able to run any tables that fit its buffers and loop.

    `step(weights, inputs, targets, *table_arrays) -> (loss, grads)`; the
    tables are arguments, so GPipe, 1F1B and the calibration grids of the same
    P, m and v share one compiled program.
    """

    workload: Workload
    mesh: jax.sharding.Mesh
    chunks: int
    depth: int
    max_ticks: int
    step: object  # the jitted step

    @property
    def stages(self) -> int:
        return self.mesh.shape["stage"]

    @functools.cached_property
    def compiled(self):
        """The step compiled for this program's shapes (once)."""
        return self.step.lower(*self.abstract_args()).compile()

    def abstract_args(self) -> tuple:
        """ShapeDtypeStructs with shardings for every argument, for compiling without data."""
        weights = stage_weights_abstract(self.workload, self.stages, self.chunks)
        staged = jax.tree.map(
            lambda w: jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=self._sharding(P("stage"))), weights
        )
        data = jax.ShapeDtypeStruct(
            (self.workload.micro_batches, *self.workload.activation_shape), jnp.float32, sharding=self._sharding(P())
        )
        tables = [
            jax.ShapeDtypeStruct((self.max_ticks, self.stages, n), jnp.int32, sharding=self._sharding(P()))
            for n in (3, 2, 2)
        ]
        return staged, data, data, *tables, jax.ShapeDtypeStruct((), jnp.int32, sharding=self._sharding(P()))

    def place(self, staged: dict, inputs_MBSD, targets_MBSD) -> tuple:
        """Put host arrays where the step expects them: weights split over ``stage``, data on every device."""
        weights = jax.device_put(staged, self._sharding(P("stage")))
        return (
            weights,
            jax.device_put(inputs_MBSD, self._sharding(P())),
            jax.device_put(targets_MBSD, self._sharding(P())),
        )

    def table_args(self, tables: Tables) -> tuple:
        """The tables padded to the program's loop length, on every device, and the tick count."""
        if tables.depth > self.depth or tables.ticks > self.max_ticks:
            raise LabError(
                f"these tables need {tables.depth} buffer slots and {tables.ticks} "
                f"ticks; the program was built for {self.depth} and {self.max_ticks}: "
                "build it with them"
            )
        if tables.action.shape[1] != self.stages:
            raise LabError(f"tables for {tables.action.shape[1]} stages cannot run on a stage axis of {self.stages}")
        if tables.ticks and (
            tables.action[..., 1].max() >= self.workload.micro_batches or tables.action[..., 2].max() >= self.chunks
        ):
            raise LabError(
                "these tables name more micro-batches or chunks than the program "
                f"has (m={self.workload.micro_batches}, v={self.chunks}); build "
                "it for them"
            )
        padded = [
            np.pad(t, ((0, self.max_ticks - tables.ticks), (0, 0), (0, 0)), constant_values=fill)
            for t, fill in ((tables.action, 0), (tables.receive_forward, -1), (tables.receive_backward, -1))
        ]
        return (
            *jax.device_put(padded, self._sharding(P())),
            jax.device_put(np.int32(tables.ticks), self._sharding(P())),
        )

    def run(self, placed: tuple, tables: Tables):
        """(loss, grads) of one step run by `tables`."""
        return self.runner(placed, tables)()

    def runner(self, placed: tuple, tables: Tables):
        """A call with no arguments that runs one step by `tables` (everything placed beforehand, for timing)."""
        return functools.partial(self.compiled, *placed, *self.table_args(tables))

    def _sharding(self, spec: P) -> NamedSharding:
        return NamedSharding(self.mesh, spec)


def pipeline_mesh(devices, stages: int) -> jax.sharding.Mesh:
    """A mesh whose ``stage`` axis has P devices (the first P of `devices`)."""
    if stages > len(devices):
        raise LabError(
            f"a {stages}-stage pipeline needs a stage axis of {stages} devices, "
            f"but the target has {len(devices)}; use at most {len(devices)} "
            "stages (or a target with more devices)"
        )
    return MeshSpec(stage=stages).build(list(devices)[:stages])


def build(workload: Workload, mesh: jax.sharding.Mesh, tables: list[Tables], chunks: int = 1) -> PipelineProgram:
    """A program that can run each of `tables`: buffers as deep as the deepest, a loop as long as the longest."""
    stages = mesh.shape["stage"]
    if len(workload.split.layers) != stages * chunks:
        raise LabError(
            f"the split names {len(workload.split.layers)} stages but the "
            f"pipeline has {stages * chunks} (P={stages} x v={chunks}); give "
            "one layer count per virtual stage"
        )
    for t in tables:
        if t.action.shape[1] != stages:
            raise LabError(
                f"a schedule for P={t.action.shape[1]} stages cannot run on "
                f"a stage axis of {stages} devices; build the mesh with stage={t.action.shape[1]}"
            )
    return _program(workload, mesh, chunks, max(t.depth for t in tables), max(t.ticks for t in tables))


@functools.lru_cache(maxsize=16)
def _program(workload: Workload, mesh: jax.sharding.Mesh, chunks: int, depth: int, max_ticks: int) -> PipelineProgram:
    """One program per shape, so that asking again for the same one reuses its compiled step."""
    stages = mesh.shape["stage"]
    loop = functools.partial(_device_loop, stages=stages, chunks=chunks, depth=depth, workload=workload)
    weights = {"blocks": P("stage"), "active": P("stage")}
    step = jax.jit(
        jax.shard_map(loop, mesh=mesh, in_specs=(weights, P(), P(), P(), P(), P(), P()), out_specs=(P(), P("stage")))
    )
    return PipelineProgram(workload, mesh, chunks, depth, max_ticks, step)


class _Carry(NamedTuple):
    """What one device keeps from tick to tick."""

    grads: dict  # [v, widest, ...] accumulated weight gradients
    inputs: jax.Array  # [v, depth+1, b, S, D] activations received, waiting for their forward
    cotangents: jax.Array  # [v, depth+1, b, S, D] gradients received (or the loss's), waiting for their backward
    residuals: list  # each [v, depth+1, ...]: what the backward of a stored micro-batch needs
    out_forward: jax.Array  # [b, S, D] this tick's forward output, to send down
    out_backward: jax.Array  # [b, S, D] this tick's input gradient, to send up
    arrived_forward: jax.Array  # [b, S, D] what the device before sent last tick
    arrived_backward: jax.Array  # [b, S, D] what the device after sent last tick
    loss: jax.Array


class _Work(NamedTuple):
    """What one action produced (zeros where it produced nothing)."""

    out_forward: jax.Array  # [b, S, D]
    residuals: list  # one micro-batch's residuals
    dloss_dy: jax.Array  # [b, S, D] the loss's gradient (last virtual stage)
    loss: jax.Array
    dweights: dict  # [widest, ...] this micro-batch's weight gradients
    out_backward: jax.Array  # [b, S, D] the input gradient


@dataclass(frozen=True)
class _Device:
    """One device inside the shard_map: sizes, its chunks' weights, every micro-batch's data, the pullback's layout."""

    stages: int
    chunks: int
    depth: int  # buffer slots per chunk; slot `depth` is scratch, where what nobody needs is written
    workload: Workload
    index: jax.Array  # this device's position on the stage axis
    weights: dict  # [v, widest, ...]
    inputs_MBSD: jax.Array
    targets_MBSD: jax.Array
    forward: Callable  # one stage's blocks: (weights, x) -> y
    pullback: tuple  # (treedef, weight positions, residual shapes) from `pullback_structure`

    def zeros(self, shape, dtype=jnp.float32) -> jax.Array:
        return jax.lax.pcast(jnp.zeros(shape, dtype), "stage", to="varying")

    def buffer(self, shape, dtype=jnp.float32) -> jax.Array:
        return self.zeros((self.chunks, self.depth + 1, *shape), dtype)

    def chunk_weights(self, chunk) -> dict:
        return jax.tree.map(lambda w: jax.lax.dynamic_index_in_dim(w, chunk, keepdims=False), self.weights)

    def slot(self, micro_batch, wanted=True):
        """The buffer slot of a micro-batch; the scratch slot when the write is not wanted."""
        return jnp.where(wanted, micro_batch % self.depth, self.depth)

    def start(self) -> _Carry:
        activation = self.zeros(self.workload.activation_shape)
        _, _, residual_shapes = self.pullback
        return _Carry(
            grads=jax.tree.map(jnp.zeros_like, self.weights),
            inputs=self.buffer(activation.shape),
            cotangents=self.buffer(activation.shape),
            residuals=[self.buffer(r.shape, r.dtype) for r in residual_shapes],
            out_forward=activation,
            out_backward=activation,
            arrived_forward=activation,
            arrived_backward=activation,
            loss=self.zeros(()),
        )

    # The branches read the buffers but return only one micro-batch's results, which `record` writes after
    # the switch, in place. Branches that returned whole updated buffers made XLA copy every buffer on every
    # tick (idle ticks ran about 20x slower).

    def idle(self, carry: _Carry, micro_batch, chunk) -> _Work:
        _, _, residual_shapes = self.pullback
        activation = self.zeros(self.workload.activation_shape)
        return _Work(
            activation,
            [self.zeros(r.shape, r.dtype) for r in residual_shapes],
            activation,
            self.zeros(()),
            jax.tree.map(lambda w: self.zeros(w.shape[1:], w.dtype), self.weights),
            activation,
        )

    def run_forward(self, carry: _Carry, micro_batch, chunk) -> _Work:
        first = chunk * self.stages + self.index == 0
        x = jnp.where(first, self.inputs_MBSD[micro_batch], _get(carry.inputs, chunk, self.slot(micro_batch)))
        y, pullback = jax.vjp(self.forward, self.chunk_weights(chunk), x)
        _, weight_positions, _ = self.pullback
        residuals = [leaf for leaf, at in zip(jax.tree.leaves(pullback), weight_positions) if at is None]
        loss, dloss_dy = jax.value_and_grad(stage_loss)(y, self.targets_MBSD[micro_batch], self.workload.micro_batches)
        return self.idle(carry, micro_batch, chunk)._replace(
            out_forward=y, residuals=residuals, dloss_dy=dloss_dy, loss=loss
        )

    def run_backward(self, carry: _Carry, micro_batch, chunk) -> _Work:
        treedef, weight_positions, _ = self.pullback
        slot = self.slot(micro_batch)
        weights, stored = (
            jax.tree.leaves(self.chunk_weights(chunk)),
            iter([_get(r, chunk, slot) for r in carry.residuals]),
        )
        pullback = jax.tree.unflatten(treedef, [next(stored) if at is None else weights[at] for at in weight_positions])
        dweights, dx = pullback(_get(carry.cotangents, chunk, slot))
        return self.idle(carry, micro_batch, chunk)._replace(dweights=dweights, out_backward=dx)

    def record(self, carry: _Carry, work: _Work, kind, micro_batch, chunk) -> _Carry:
        """Write what the action produced into its micro-batch's slot (the scratch slot when it produced nothing)."""
        is_forward = kind == FORWARD_CODE
        is_last = is_forward & (chunk * self.stages + self.index == self.stages * self.chunks - 1)
        residuals = [
            _put(r, leaf, chunk, self.slot(micro_batch, is_forward)) for r, leaf in zip(carry.residuals, work.residuals)
        ]
        # on the last virtual stage the loss's gradient starts the backward right here
        cotangents = _put(carry.cotangents, work.dloss_dy, chunk, self.slot(micro_batch, is_last))
        grads = jax.tree.map(lambda g, d: _add_at(g, d, chunk), carry.grads, work.dweights)
        return carry._replace(
            residuals=residuals,
            cotangents=cotangents,
            grads=grads,
            loss=carry.loss + jnp.where(is_last, work.loss, 0.0),
            out_forward=work.out_forward,
            out_backward=work.out_backward,
        )

    def file(self, buffer, arrived, micro_batch, chunk):
        """Store what arrived in its micro-batch's slot (-1: nothing useful arrived, so the scratch slot)."""
        useful = micro_batch >= 0
        return _put(buffer, arrived, jnp.where(useful, chunk, 0), self.slot(micro_batch, useful))

    def tick(self, t, carry: _Carry, tables) -> _Carry:
        action, receive_forward, receive_backward = (
            jax.lax.dynamic_index_in_dim(table, t, keepdims=False)[self.index] for table in tables
        )
        carry = carry._replace(
            inputs=self.file(carry.inputs, carry.arrived_forward, *receive_forward),
            cotangents=self.file(carry.cotangents, carry.arrived_backward, *receive_backward),
        )
        work = jax.lax.switch(action[0], (self.idle, self.run_forward, self.run_backward), carry, action[1], action[2])
        carry = self.record(carry, work, *action)
        # with several chunks the pipe is a ring: the last device feeds chunk c+1 of the first
        links = range(self.stages if self.chunks > 1 else self.stages - 1)
        down, up = [(d, (d + 1) % self.stages) for d in links], [((d + 1) % self.stages, d) for d in links]
        return carry._replace(
            arrived_forward=jax.lax.ppermute(carry.out_forward, "stage", down),
            arrived_backward=jax.lax.ppermute(carry.out_backward, "stage", up),
        )


def _device_loop(
    weights,
    inputs_MBSD,
    targets_MBSD,
    action_TP3,
    receive_forward_TP2,
    receive_backward_TP2,
    ticks,
    *,
    stages,
    chunks,
    depth,
    workload,
):
    """One device's step -> (loss, grads).

    It takes its chunks' weights [1, v, widest, ...], every micro-batch's data and the tables.
    """
    weights = jax.tree.map(lambda w: w[0], weights)  # [v, widest, ...]
    assert inputs_MBSD.shape == (workload.micro_batches, *workload.activation_shape)
    # every device holds every micro-batch, but each uses them differently: type them as varying over `stage`
    inputs_MBSD, targets_MBSD = (jax.lax.pcast(a, "stage", to="varying") for a in (inputs_MBSD, targets_MBSD))
    forward = stage_forward(block_graph(workload.block), workload.split.uneven)
    one_chunk = jax.tree.map(lambda w: w[0], weights)
    device = _Device(
        stages,
        chunks,
        depth,
        workload,
        jax.lax.axis_index("stage"),
        weights,
        inputs_MBSD,
        targets_MBSD,
        forward,
        pullback_structure(forward, one_chunk, inputs_MBSD[0]),
    )
    tables = (action_TP3, receive_forward_TP2, receive_backward_TP2)
    carry = jax.lax.fori_loop(0, ticks, lambda t, c: device.tick(t, c, tables), device.start())
    return jax.lax.psum(carry.loss, "stage"), jax.tree.map(lambda g: g[None], carry.grads)


def _put(buffer, value, chunk, slot):
    return jax.lax.dynamic_update_slice(
        buffer, value[None, None].astype(buffer.dtype), (chunk, slot) + (0,) * value.ndim
    )


def _get(buffer, chunk, slot):
    return jax.lax.dynamic_index_in_dim(
        jax.lax.dynamic_index_in_dim(buffer, chunk, keepdims=False), slot, keepdims=False
    )


def _add_at(accumulated, update, chunk):
    """accumulated[chunk] += update, for a dynamic chunk index."""
    current = jax.lax.dynamic_index_in_dim(accumulated, chunk, keepdims=False)
    return jax.lax.dynamic_update_index_in_dim(accumulated, current + update, chunk, axis=0)


def pullback_structure(forward, weights, x) -> tuple:
    """The pullback's tree structure, which of its leaves are the weights, and the shapes of the rest.

    The weights are residuals of every micro-batch's vjp; storing them per
    micro-batch would copy the stage's weights once per slot, so the backward
    takes them from the stage's own weights instead.
    """
    found = {}

    def residuals(weights, x):
        _, pullback = jax.vjp(forward, weights, x)
        leaves, found["treedef"] = jax.tree.flatten(pullback)
        weight_ids = {id(w): k for k, w in enumerate(jax.tree.leaves(weights))}
        found["positions"] = tuple(weight_ids.get(id(leaf)) for leaf in leaves)
        return [leaf for leaf in leaves if id(leaf) not in weight_ids]

    shapes = jax.eval_shape(residuals, weights, x)
    return found["treedef"], found["positions"], shapes


# --- what the buffers cost -------------------------------------------------------------


def slot_bytes(workload: Workload) -> int:
    """Bytes one micro-batch occupies in a stage's buffers: its residuals, its input and its gradient."""
    forward = stage_forward(block_graph(workload.block), workload.split.uneven)
    weights = jax.tree.map(lambda w: jax.ShapeDtypeStruct(w.shape[2:], w.dtype), stage_weights_abstract(workload, 1, 1))
    x = jax.ShapeDtypeStruct(workload.activation_shape, jnp.float32)
    _, _, residuals = pullback_structure(forward, weights, x)
    return sum(math.prod(r.shape) * r.dtype.itemsize for r in residuals) + 2 * math.prod(x.shape) * x.dtype.itemsize


def activation_bytes(workload: Workload, depth: int, chunks: int = 1) -> int:
    """What the step should need for activations on one device, in slots of `slot_bytes`.

    Per chunk: `depth` slots of micro-batches kept, one scratch slot, and two
    more used within a tick: the slot the action produces before it is written
    and the slot the backward reads.
    """
    return chunks * (depth + 3) * slot_bytes(workload)
