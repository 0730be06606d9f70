"""Dropless experts: what a capacity buffer costs against MaxText's sorted, ragged path.

Question #42 gives each expert a capacity, (tokens / E) x capacity factor slots,
and drops what overflows. The compute follows the buffer, not the tokens: every
slot is multiplied whether a token filled it or not. MaxText's MoE recipes drop
nothing instead (``sparse_matmul``): each device sorts its tokens by expert and
multiplies each expert's rows by its weights in one grouped matmul (megablox's
``gmm`` on TPU), which pays the routed rows plus a row tile for each expert whose
rows start inside one. This page compiles the lab's MoE (`lab.model`) both ways:

1. on this target, the dropless layer against a buffer of the whole sequence per
   expert (which drops nothing either): the same loss and the same gradients, on
   a mesh that splits the batch over ``fsdp`` and the experts' width over ``tensor``;
2. compile-only for a TPU, one training step per capacity (1.25, MaxText's
   default; 1, a perfectly balanced buffer; none; dropless): the experts' matmul
   FLOPs read from the compiled step by `lab.predict.ops` against the count from
   the sizes alone, and the step `lab predict` prices from each;
3. ``lab plan``'s closed form (`lab.plan.closed_form`, from the shapes alone) against
   each compiled step's matmul FLOPs;
4. the grouped matmul's row-tile overhead at the sizes of published dropless runs.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from functools import partial

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from experiments import kit
from lab.mesh import MeshSpec
from lab.model import ModelConfig, abstract_model, create_params
from lab.parallel import Layout
from lab.plan import closed_form
from lab.plan import space as plan
from lab.predict import calibration
from lab.predict.command import Predict, price, read_step
from lab.predict.spec import parse_model
from lab.provenance import Setup
from lab.ragged import GMM_TILING
from lab.report import Result, Table
from lab.rules import get_strategy
from lab.targets.devices import DEFAULT_TARGET, devices_for, topology_shape
from lab.targets.hardware import profile
from lab.units import format_bytes
from lab.verdict import Check, Claim, check

QUESTION = "#42"
UNTIMED = True  # reads what XLA compiled and computes, no clock: lab report may run it beside another page
CAPACITIES = ("1.25", "1", "none", "dropless")
_EXPERT_EINSUMS = re.compile(r"becd,edf->becf|becf,efd->becd")  # the buffered path's expert matmuls (`lab.model`)


@dataclass(frozen=True)
class Config:
    target: str = DEFAULT_TARGET
    """where to compare the two paths' numerics (cpu:N)"""
    mesh: str = "fsdp=4,tensor=2"
    """their mesh: the batch over fsdp, the experts' width over tensor"""
    model: str = (
        "layers=2,d_model=1024,heads=8,kv_heads=4,head_dim=128,d_ff=1536,vocab=1024,mlp=swiglu,experts=8,top_k=2"
    )
    """the MoE compiled for the TPU (its capacity is set per step): d_ff 1536, Qwen3-235B's, is 1.5 tiles of 1024"""
    tpu_topology: str = "v5e:2x2"
    """compile one step per capacity for this TPU topology (compile-only); empty to skip"""
    seq: int = 512
    """tokens per sequence of the TPU steps"""
    batch_per_device: int = 2
    """sequences per chip of the TPU steps"""
    capacities: tuple[str, ...] = CAPACITIES
    """the TPU steps' capacities: factors, none, dropless"""


@dataclass(frozen=True)
class Numerics:
    mesh: str
    loss_buffered: float
    loss_dropless: float
    worst_gradient: float  # max over parameters of max |dropless - buffered| / max |buffered|
    norm_buffered: float  # the gradients' global norm, each path
    norm_dropless: float


@dataclass(frozen=True)
class Step:
    """One TPU step, compiled for one capacity and read by `lab.predict`."""

    capacity: str
    expert_flops: float  # the experts' matmuls, all runs, per chip, as `lab.predict.ops` prices them
    expert_ops: int
    hardware_flops: float  # the whole step's matmuls, per chip
    step_s: float
    memory_bytes: int


@dataclass(frozen=True)
class Observations:
    setup: Setup
    numerics: Numerics
    steps: tuple[Step, ...] = ()
    tpu_unavailable: kit.Unavailable | None = None


# --------------------------------------------------------------------------- measure


def measure(config: Config) -> Observations:
    devices = devices_for(config.target)
    tpu = kit.tpu_chips(config.tpu_topology)
    steps = tuple(_step(config, c) for c in config.capacities) if isinstance(tpu, kit.TpuChips) else ()
    return Observations(
        setup=Setup.of(config.target, devices, config.mesh),
        numerics=_numerics(config, devices),
        steps=steps,
        tpu_unavailable=tpu if isinstance(tpu, kit.Unavailable) else None,
    )


def _numerics(config: Config, devices) -> Numerics:
    """The loss and gradients of a small MoE, dropless against a whole-sequence buffer, on `config.mesh`."""
    base = ModelConfig(mlp=32, experts=4, top_k=2, capacity_factor=None, feed_forward="swiglu", biases=True)
    mesh = MeshSpec.parse(config.mesh).build(devices)
    layout = Layout(mesh, get_strategy("zero3"))
    params = create_params(base, layout.shardings(abstract_model(base)[1], "params"))
    tokens = np.random.default_rng(0).integers(0, base.vocab, (2 * mesh.devices.size, base.seq), dtype=np.int32)
    tokens = jax.device_put(tokens, NamedSharding(mesh, layout.batch_spec()))

    def loss_and_grads(model: ModelConfig):
        graphdef = abstract_model(model)[0]

        def step(params, tokens):
            value, grads = jax.value_and_grad(lambda p: nnx.merge(graphdef, p).forward(tokens, layout)[0].mean())(
                params
            )
            # the reshard of an unreduced gradient is its sum over the batch axes
            whole = partial(_summed, mesh)
            return value, jax.tree.map(whole, grads)

        return jax.jit(step)(params, tokens)

    (loss_b, grads_b), (loss_d, grads_d) = loss_and_grads(base), loss_and_grads(replace(base, dropless=True))
    gaps = jax.tree.map(lambda d, b: float(np.abs(d - b).max() / max(np.abs(b).max(), 1e-30)), grads_d, grads_b)
    norm_b, norm_d = (_norm(g) for g in (grads_b, grads_d))
    return Numerics(config.mesh, float(loss_b), float(loss_d), max(jax.tree.leaves(gaps)), norm_b, norm_d)


def _norm(grads) -> float:
    """The gradients' global norm, in float64."""
    return float(np.sqrt(sum(np.sum(np.square(np.asarray(g, np.float64))) for g in jax.tree.leaves(grads))))


def _summed(mesh, grad: jax.Array) -> jax.Array:
    return jax.reshard(grad, NamedSharding(mesh, P(*jax.typeof(grad).sharding.spec.partitions)))


def _step(config: Config, capacity: str) -> Step:
    command = Predict(
        model=f"{config.model},capacity={capacity}",
        target=f"tpu:{config.tpu_topology}",
        mesh="fsdp=-1",
        seq=config.seq,
        batch_per_device=config.batch_per_device,
    )
    reading = read_step(command)
    ops = reading.read.predict(calibration.efficiency(reading.chip.name)).ops
    experts = [o for o in ops if "gmm" in o.name or _EXPERT_EINSUMS.search(o.op_name)]
    prediction = price(reading)
    return Step(
        capacity,
        sum(o.flops * o.runs for o in experts),
        len(experts),
        prediction.hardware_flops_per_step / prediction.chips,
        prediction.step_s,
        prediction.memory_bytes,
    )


# --------------------------------------------------------------------------- judge


def expert_flops(model: ModelConfig, capacity: str, sequences: int) -> float:
    """The experts' matmul FLOPs per chip and step from the sizes alone: each matmul [rows, k] x [k, n] (SwiGLU:
    [D, F] twice, then [F, D]) runs four times under remat full (forward, its recompute, the two halves of its
    gradient), in every layer. A buffer: E · C rows per sequence, C = ceil(S·k/E · cf) or S with none, each product
    exact (XLA's dots). Dropless: megablox's row-tile visits (`visited_rows`), each multiplying whole blocks
    (`_block_columns`), the forward's tiles reused by the rows' gradient on [n, k]."""
    s, k, e = model.seq, model.top_k, model.experts
    shapes = [(model.embed, model.mlp)] * (3 if model.gated else 2)
    shapes[-1] = shapes[-1][::-1]  # W_out: [F, D]
    if capacity == "dropless":
        per_row = sum(3 * _block_columns(a, b, a, b) + _block_columns(b, a, a, b) for a, b in shapes)
        return model.layers * 2 * visited_rows(sequences * s * k, e) * per_row
    slots = s if capacity == "none" else math.ceil(s * k / e * float(capacity))
    return model.layers * 2 * sequences * e * min(slots, s) * sum(4 * a * b for a, b in shapes)


def visited_rows(routed: int, experts: int) -> int:
    """The rows megablox's gmm multiplies for `routed` rows: t = ceil(rows / tm) tiles, visited t + E - 1 times
    (once more for each expert whose rows start inside a tile), tm = 512 or the rows rounded up to 128."""
    tile = min(GMM_TILING[0], -(-routed // 128) * 128)
    return (-(-routed // tile) + experts - 1) * tile


def _block_columns(k: int, n: int, k_forward: int, n_forward: int) -> int:
    """k x n as megablox multiplies it: each in whole tiles, the tiles (min(1024, k), min(1024, n)) of the forward's
    [k_forward, n_forward]; the last tile computed whole where it is only partly filled."""
    tk, tn = min(GMM_TILING[1], k_forward), min(GMM_TILING[2], n_forward)
    return -(-k // tk) * tk * (-(-n // tn) * tn)


def planned_flops(config: Config, capacity: str) -> float:
    """`lab plan`'s closed form for the TPU step of `capacity`: its matmul FLOPs per chip (remat full, fsdp over
    every chip, as `lab predict` compiles it)."""
    model = replace(parse_model(f"{config.model},capacity={capacity}"), seq=config.seq)
    shape = topology_shape(config.tpu_topology)
    chips = math.prod(shape)
    generation = config.tpu_topology.split(":")[0]
    problem = plan.Problem(model, config.batch_per_device * chips, profile(generation), shape, config.tpu_topology)
    return closed_form.estimate(problem, plan.Layout(MeshSpec.parse(f"fsdp={chips}"), None, "full")).flops_per_chip


def tile_visits(routed: int, experts: int) -> float:
    """Megablox's row-tile visits over the routed rows (1 with no straddled boundary and whole tiles)."""
    return visited_rows(routed, experts) / routed


def column_tiles(d_model: int, d_ff: int) -> float:
    """A forward expert matmul's whole-tile work over its exact [D, F] (or [F, D]): the widths in tiles of 1024."""
    return _block_columns(d_model, d_ff, d_model, d_ff) / (d_model * d_ff)


# published MoE runs that drop nothing: the rows one device routes per layer (sequences x tokens x k), the
# experts, and the widths the expert matmuls multiply (d_model, the expert's d_ff)
PUBLISHED_SIZES = (
    ("Qwen3-235B-A22B, TPU7x-256 (tpu-recipes@c8cfe2f)", 16 * 4096 * 8, 128, 4096, 1536),
    ("GPT-OSS 120B, TPU7x-64 (tpu-recipes@c8cfe2f)", 10 * 8192 * 4, 128, 2880, 2880),
    ("DeepSeek-V3, TPU7x-256 (tpu-recipes@c8cfe2f)", 8 * 4096 * 8, 256, 7168, 2048),
)


def judge(obs: Observations, config: Config) -> Result:
    checks = _numerics_checks(obs.numerics)
    model = replace(parse_model(config.model), seq=config.seq)
    planned = {s.capacity: planned_flops(config, s.capacity) for s in obs.steps}  # lab plan's, for checks and table
    checks += [
        check(
            f"tpu:{config.tpu_topology} capacity={s.capacity}: the experts' matmul FLOPs per chip, read from the "
            "compiled step, against the count from the sizes",
            expert_flops(model, s.capacity, config.batch_per_device),
            s.expert_flops,
            kind="exact",
            rtol=1e-9,
        )
        for s in obs.steps
    ]
    checks += [
        check(
            f"tpu:{config.tpu_topology} capacity={s.capacity}: lab plan's closed form, the step's matmul FLOPs per "
            "chip against the compiled step's",
            planned[s.capacity],
            s.hardware_flops,
            kind="model",
            rtol=0.05,
            basis="the closed form counts the model's matmuls from its shapes (each expert's rows as the capacity "
            "or the grouped matmul's tiles make them); the compiled step adds the buffer's one-hot dispatch and "
            "combine and the loss's chunks, and the closed form's one-hot embedding runs whole: a few per cent",
        )
        for s in obs.steps
    ]
    return Result(
        summary=_summary(obs, config, model),
        theory=THEORY,
        tables=[_numerics_table(obs.numerics), *_step_tables(obs, config, model, planned), _published_table()],
        checks=checks,
        claims=_claims(obs, config, model),
        notes=NOTES,
    )


def _numerics_checks(n: Numerics) -> list[Check]:
    basis = "float32: the sorted rows and the buffers add the same products in other orders (~1e-7 each)"
    pairs = (("loss", n.loss_buffered, n.loss_dropless), ("gradients' global norm", n.norm_buffered, n.norm_dropless))
    return [
        check(
            f"{n.mesh}: the {what}, dropless against a whole-sequence buffer's",
            buffered,
            dropless,
            kind="model",
            rtol=1e-5,
            basis=basis,
        )
        for what, buffered, dropless in pairs
    ]


def _numerics_table(n: Numerics) -> Table:
    return Table(
        "Dropless against a whole-sequence buffer, on this target",
        ["mesh", "loss, buffered", "loss, dropless", "worst gradient difference (relative)"],
        [[n.mesh, f"{n.loss_buffered:.7g}", f"{n.loss_dropless:.7g}", f"{n.worst_gradient:.2e}"]],
    )


def _published_table() -> Table:
    return Table(
        "The grouped matmul's tiles at published sizes, at MaxText's default tiling (from the sizes alone)",
        [
            "run",
            "rows per device and layer",
            "experts",
            f"row tiles of {GMM_TILING[0]}",
            "row-tile visits over the routed rows",
            "d_model x d_ff",
            f"columns in tiles of {GMM_TILING[1]}",
            "work over the routed rows",
        ],
        [
            [
                run,
                str(rows),
                str(e),
                str(-(-rows // GMM_TILING[0])),
                f"{tile_visits(rows, e):.3f}x",
                f"{d} x {f}",
                f"{column_tiles(d, f):.3f}x",
                f"{tile_visits(rows, e) * column_tiles(d, f):.3f}x",
            ]
            for run, rows, e, d, f in PUBLISHED_SIZES
        ],
    )


def _step_tables(obs: Observations, config: Config, model: ModelConfig, planned: dict[str, float]) -> list[Table]:
    if obs.tpu_unavailable:
        return [obs.tpu_unavailable.table()]
    routed = expert_flops(model, "1", config.batch_per_device)  # a balanced buffer: exactly the routed rows
    rows = [
        [
            s.capacity,
            f"{s.expert_flops:.4g}",
            f"{s.expert_flops / routed:.3f}x",
            str(s.expert_ops),
            f"{s.hardware_flops:.4g}",
            f"{planned[s.capacity]:.4g}",
            f"{s.step_s * 1e3:.2f}",
            format_bytes(s.memory_bytes),
        ]
        for s in obs.steps
    ]
    return [
        Table(
            f"One training step per capacity, tpu:{config.tpu_topology} (compile-only, priced by lab predict)",
            [
                "capacity",
                "expert matmul FLOPs per chip",
                "of the routed work",
                "expert ops",
                "step FLOPs per chip",
                "lab plan's closed form",
                "predicted step ms",
                "memory per chip",
            ],
            rows,
        ),
    ]


def _claims(obs: Observations, config: Config, model: ModelConfig) -> list[Claim]:
    by = {s.capacity: s for s in obs.steps}
    if not {"1.25", "none", "dropless"} <= by.keys():
        return []
    routed = expert_flops(model, "1", config.batch_per_device)
    padded = by["1.25"].expert_flops / routed
    whole = by["none"].expert_flops / routed
    dropless = by["dropless"].expert_flops / routed
    status = "refined" if dropless > 1 else "confirmed"
    return [
        Claim(
            "capacity = tokens / E x capacity factor; what overflows is dropped",
            status,
            f"a buffer's compute is its slots, filled or not: {padded:.2f}x the routed work at capacity 1.25, "
            f"{whole:.2f}x (E/k) with none; dropless drops nothing for {dropless:.2f}x (the row tiles that straddle "
            f"two of the {model.experts} experts, and the widths in whole tiles: "
            f"{column_tiles(model.embed, model.mlp):.2f}x at d_model {model.embed}, d_ff {model.mlp}), predicted step "
            f"{by['dropless'].step_s * 1e3:.2f} ms against "
            f"{by['1.25'].step_s * 1e3:.2f} ms at 1.25 on tpu:{config.tpu_topology}",
        )
    ]


def _summary(obs: Observations, config: Config, model: ModelConfig) -> str:
    n = obs.numerics
    text = (
        f"On {obs.setup.target} ({n.mesh}) the dropless MoE layer gives the loss of a buffer that drops nothing "
        f"({n.loss_dropless:.7g} against {n.loss_buffered:.7g}) and its gradients within {n.worst_gradient:.1e}."
    )
    if obs.steps:
        routed = expert_flops(model, "1", config.batch_per_device)
        ratios = ", ".join(f"{s.capacity}: {s.expert_flops / routed:.2f}x" for s in obs.steps)
        text += (
            f" Compiled for tpu:{config.tpu_topology}, the experts' matmuls cost, against the routed rows' work: "
            f"{ratios}; each as counted from the sizes."
        )
    return text


THEORY = r"""
A group of T tokens routed to k of E experts makes T·k (token, expert) rows, T·k/E per expert on average.

- **Capacity** (GShard, Switch: `lab.moe`): each expert gets C = ceil(T·k/E · cf) slots per group, and each expert
  matmul multiplies all E·C of them, filled or not: cf times the routed rows; with no dropping, C = T and E/k times.
- **Dropless** (MegaBlocks, Gale et al. 2022; MaxText's `sparse_matmul`: `lab.ragged`): sort the T·k rows by expert
  and multiply each expert's contiguous rows in one grouped matmul. Megablox's `gmm` walks row tiles of tm rows
  (512 in MaxText): every tile once, and once more for each expert whose rows start inside a tile, so
  t + E - 1 tile visits for t = ceil(T·k/tm) tiles when no boundary falls on a tile edge. Each visit multiplies
  whole (tm, tk) x (tk, tn) blocks, tk and tn up to 1024 (MaxText's defaults): a width that is no multiple of its
  tile is computed to the next whole tile (Qwen3-235B's expert d_ff 1536 as 2048: 1.33x). Its gradient is `gmm`
  again (the rows', the forward's tiles on [n, k]) and `tgmm` (the weights'), each over the same row tiles.

Per chip and step, with remat full: every expert matmul runs four times (forward, its recompute, and the two halves
of its gradient), 2·rows·D·F FLOPs each, in every layer.
"""

NOTES = [
    "The TPU steps are compiled, not run: the FLOPs are what `lab.predict.ops` reads from each compiled step (the "
    "buffered path's expert einsums inside their fusions; megablox's kernels from the grid and blocks of their Mosaic "
    "modules, `lab.hlo.mosaic`, and their row-tile tables), and the step times are its prices at the chip's "
    "calibrated constants.",
    "The dropless layer runs under shard_map on each device's own sequences with every expert's whole weights: "
    "MaxText's sparse_matmul without expert parallelism, as its TPU7x recipes run it. With an expert axis it is "
    "refused (its tokens would have to move by a ragged all-to-all, which the lab does not compile).",
    "Dropless has no overflow, so no token is dropped whatever the router does, and its matmul work does not grow "
    "with the imbalance either: at most E - 1 extra row tiles, fewer when experts get no rows. What it adds to a "
    "buffer of the balanced load is those tiles, its sort and its two row permutations (gathers, HBM-bound). "
    "`lab plan`'s closed form prices the tiles (a buffer of the rows the grouped matmul visits on a chip's tokens) "
    "but not the sort and the permutations, as it leaves out a buffer's dispatch and combine.",
]
