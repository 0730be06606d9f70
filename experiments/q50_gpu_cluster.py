"""TP inside 8-GPU nodes, FSDP across them, against FSDP over every GPU: an H100 cluster, compiled.

Question #50's answer on GPUs: put tensor parallelism where the bandwidth is,
inside a node (8 GPUs on NVSwitches, 450 GB/s per GPU each way), and FSDP
across nodes (InfiniBand, one 400 Gb/s NIC per GPU: 50 GB/s), rather than one
FSDP over every GPU. Here one decoder layer of a Llama-class model (grouped-
query attention with fused QKV, a SwiGLU MLP with fused gate/up, bf16; the
layer sizes of Llama 3 8B and 70B) is compiled by XLA:GPU for clusters of
H100 SXM nodes (`gpu:h100:<nodes>x8`, compile-only, no GPU) under both
layouts at one fixed global batch. What is observed is the program XLA wrote:
its matmul FLOPs (counted in the optimized HLO), its collectives, and for
each collective the nodes its replica groups span (the HLO's device ids mapped
to the devices' ``process_index``: the node), so which link each one crosses
is read from the compiled program, not assumed from the mesh. Every time on
this page is a prediction from the compiled program on the lab's link model
(`lab.targets.topology`), not a measurement: no GPU ran. The answer is then
judged again on the whole training step of each model, as `lab predict`
prices it (`whole_step`), so it does not rest on one layer.

One module, one question: the layer program, the closed forms it is judged
against and the page's tables are kept together (about 600 lines) so that the
two sides of every check can be read side by side.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from matplotlib.figure import Figure

from experiments import kit
from lab import hlo, theory
from lab.errors import LabError
from lab.hlo.schedule import flops, parse_schedule
from lab.mesh import MeshSpec
from lab.progress import track
from lab.provenance import Setup
from lab.report import Result, Table
from lab.targets.devices import devices_for, parse_target
from lab.targets.hardware import ChipProfile, profile_for_device_kind
from lab.targets.topology import Placement, placement, predict
from lab.units import format_bytes
from lab.verdict import Check, Claim, check

QUESTION = "#50"
COMPILE_ONLY = True  # compiles for a GPU cluster through the CUDA plugin, whatever target `lab report` uses

# name -> (D model width, F MLP width, H query heads, KV heads, head dim): Llama 3 8B and 70B (Meta's model cards)
MODELS = {
    "8b": (4096, 14336, 32, 8, 128),
    "70b": (8192, 28672, 64, 8, 128),
}
COMM_RTOL = 0.02
COMM_BASIS = (
    "the link model adds NVLink hop latency (0.47 us per ring step) to bytes over bandwidth and prices XLA's "
    "collectives one by one (a weight gather split into several); the closed form is bytes over bandwidth of one "
    "gather and one reduce-scatter of all the weights: the latency is under 2% of the communication at these sizes"
)


@dataclass(frozen=True)
class Config:
    target: str = "gpu:h100:4x8"
    """the GPU whose clusters are compiled (compile-only); its chip, with `nodes` nodes of 8 GPUs each"""
    nodes: tuple[int, ...] = (4, 32)
    """cluster sizes in 8-GPU nodes (4: 32 GPUs, 32: 256 GPUs; add 8 for 64 GPUs: about 10 s more)"""
    models: tuple[str, ...] = ("8b", "70b")
    """layer sizes: 8b (Llama 3 8B) and 70b (Llama 3 70B)"""
    sequences: int = 256
    """global batch in sequences (fixed across cluster sizes: strong scaling)"""
    sequence_length: int = 2048
    """tokens per sequence"""
    whole_steps: bool = True
    """also predict each model's whole training step under both layouts with lab predict (two layers compiled, read
    at the model's depth: lab.predict.depth), so the answer does not rest on one layer"""


@dataclass(frozen=True)
class Crossing:
    """One collective as compiled, and the nodes its replica groups span (read from the HLO's groups)."""

    seen: kit.Seen
    nodes: int  # the most nodes one of its groups spans
    per_node: int  # the most GPUs of one group inside one node


@dataclass(frozen=True)
class LayerStep:
    """One layer's training step as XLA:GPU compiled it, for one layout on one cluster."""

    model: str
    strategy: str  # "FSDP" or "FSDP x TP"
    mesh: str  # as built, "fsdp=4,tensor=8"
    gpus: int
    nodes: int
    sequences_per_gpu: float
    device_kind: str
    flops: float  # per GPU: the dots of the optimized HLO (XLA:GPU's compile-only executables give no cost analysis)
    peak_memory: int  # per GPU, XLA's memory analysis
    crossings: tuple[Crossing, ...]
    placements: tuple[Placement, ...]  # each mesh axis of size > 1, and each set of axes a collective spans
    sync_collectives: int  # collectives whose backend_config says "is_sync":true (nothing overlaps them)

    @property
    def sizes(self) -> dict[str, int]:
        return MeshSpec.parse(self.mesh).sizes

    def where(self, axes) -> Placement | None:
        axes = tuple(axes or ())
        return next((p for p in self.placements if p.axes == axes), None)


@dataclass(frozen=True)
class WholeStep:
    """A whole training step of the model the layer comes from, as `lab predict` predicts it (compile-only)."""

    model: str
    strategy: str
    gpus: int
    step_s: float  # as compiled: XLA's attention
    step_with_flash_s: float  # XLA's attention priced as a flash kernel (lab.predict.attention)
    compute_s: float
    exposed_by_link: dict[str, float]


@dataclass(frozen=True)
class Observations:
    setup: Setup
    chip: str
    steps: tuple[LayerStep, ...]
    whole: tuple[WholeStep, ...] = ()


# --------------------------------------------------------------------------- measure


def _chip(config: Config) -> str:
    target = parse_target(config.target)
    if target.platform != "gpu" or not target.compile_only:
        target = parse_target(Config.target)  # a CPU or TPU target: this page compiles for its default GPU
    return target.topology.split(":")[0]


def measure(config: Config) -> Observations:
    unknown = [m for m in config.models if m not in MODELS]
    if unknown:
        raise LabError(f"unknown model {unknown[0]!r}; use {', '.join(MODELS)}")
    chip = _chip(config)
    steps, whole, devices = [], [], ()
    for nodes, model in track([(n, m) for n in config.nodes for m in config.models], "clusters"):
        devices = devices_for(f"gpu:{chip}:{nodes}x8")
        for strategy, spec in LAYOUTS:
            steps.append(compile_layer_step(model, strategy, spec, devices, config))
            if config.whole_steps:
                whole.append(whole_step(model, strategy, spec, f"gpu:{chip}:{nodes}x8", len(devices), config))
    setup = Setup.of(f"gpu:{chip}", devices, "fsdp=N; fsdp=N/8,tensor=8")
    return Observations(setup, chip, tuple(steps), tuple(whole))


LAYOUTS = (("FSDP", "fsdp=-1"), ("FSDP x TP", "fsdp=-1,tensor=8"))


def whole_step(model: str, strategy: str, spec: str, target: str, gpus: int, config: Config) -> WholeStep:
    """`lab predict` for the model's whole step (Llama 3 at the page's batch and sequence), two layers compiled."""
    from lab.predict.command import Predict, run_prediction  # local: lab predict's compile imports its step

    if config.sequences % gpus:
        raise LabError(f"--sequences {config.sequences} does not split over {gpus} GPUs; give a multiple of {gpus}")
    command = Predict(
        model=f"llama3-{model}",
        seq=config.sequence_length,
        batch_per_device=config.sequences // gpus,
        mesh=spec,
        target=target,
        remat="full",
        layers_compiled=2,
    )
    p = run_prediction(command)
    return WholeStep(model, strategy, gpus, p.step_s, p.step_with_flash_s, p.compute_s, dict(p.exposed_by_link))


def compile_layer_step(model: str, strategy: str, spec: str, devices, config: Config) -> LayerStep:
    """Compile one layer's value_and_grad over `spec` on `devices` (compile-only) and read what XLA wrote."""
    mesh = MeshSpec.parse(spec).build(devices, explicit=False)
    sizes = dict(zip(mesh.axis_names, mesh.devices.shape))
    if config.sequences % sizes["fsdp"]:
        raise LabError(f"--sequences {config.sequences} must divide over fsdp={sizes['fsdp']} ({spec})")
    step, weights, batch = _layer_step(mesh, *MODELS[model])
    x = jax.ShapeDtypeStruct((config.sequences, config.sequence_length, MODELS[model][0]), jnp.bfloat16, sharding=batch)
    found = hlo.inspect(step, weights, x, mesh=mesh)
    schedule = parse_schedule(found.optimized_hlo)
    node_of = [d.process_index for d in mesh.devices.flat]  # HLO device ids are positions in the mesh's device list
    crossings = tuple(_crossing(c, node_of) for c in found.collectives)
    wanted = [(a,) for a, size in sizes.items() if size > 1] + [c.axes for c in found.collectives if c.axes]
    return LayerStep(
        model=model,
        strategy=strategy,
        mesh=",".join(f"{a}={s}" for a, s in sizes.items() if s > 1),
        gpus=mesh.devices.size,
        nodes=len(set(node_of)),
        sequences_per_gpu=config.sequences / sizes["fsdp"] / sizes["tensor"],
        device_kind=mesh.devices.flat[0].device_kind,
        flops=sum(flops(schedule, schedule.entry, i) for i in schedule.computations[schedule.entry]),
        peak_memory=int(found.memory.get("peak_memory", 0)),
        crossings=crossings,
        placements=tuple(placement(mesh, axes) for axes in dict.fromkeys(wanted)),
        sync_collectives=found.optimized_hlo.count('"is_sync":true'),
    )


def _crossing(c: hlo.Collective, node_of: list[int]) -> Crossing:
    groups = c.replica_groups or ()
    nodes = max((len({node_of[d] for d in g}) for g in groups), default=0)
    per_node = max((max(sum(node_of[d] == n for d in g) for n in {node_of[d] for d in g}) for g in groups), default=0)
    return Crossing(kit.Seen.of(c), nodes, per_node)


def _layer_step(mesh, d: int, f: int, heads: int, kv_heads: int, head_dim: int):
    """jit(value_and_grad) of one decoder layer with sharding annotations only: XLA inserts the collectives.

    Megatron's layout over `tensor`: QKV (fused, grouped by KV head) and gate/up (fused) split by columns,
    the output projections by rows; FSDP shards every weight's other dimension over `fsdp` and the batch. The
    mesh uses Auto axis types on purpose, as `scaling_thresholds` does: GSPMD partitions.
    """
    sizes = dict(zip(mesh.axis_names, mesh.devices.shape))
    fs = "fsdp" if sizes["fsdp"] > 1 else None
    tp = "tensor" if sizes["tensor"] > 1 else None
    group = heads // kv_heads

    def at(spec):
        return NamedSharding(mesh, spec)

    stored = {  # weight -> (shape, stored sharding, sharding where used: gathered over fsdp)
        "w_qkv_DKGH": ((d, kv_heads, group + 2, head_dim), P(fs, tp, None, None), P(None, tp, None, None)),
        "w_o_NHD": ((heads, head_dim, d), P(tp, None, fs), P(tp, None, None)),
        "w_gate_up_D2F": ((d, 2, f), P(fs, None, tp), P(None, None, tp)),
        "w_down_FD": ((f, d), P(tp, fs), P(tp, None)),
    }
    batch, hidden = P(fs, None, None), P(fs, None, tp)

    def loss(weights, x_BSD):
        w_qkv, w_o, w_gate_up, w_down = (
            jax.lax.with_sharding_constraint(w, at(stored[name][2])) for name, w in zip(stored, weights)
        )
        b, s, _ = x_BSD.shape
        qkv_BSKGH = jnp.einsum("bsd,dkgh->bskgh", x_BSD, w_qkv)
        q_BSKGH, k_BSKH, v_BSKH = qkv_BSKGH[..., :group, :], qkv_BSKGH[..., group, :], qkv_BSKGH[..., group + 1, :]
        scores_BKGST = jnp.einsum("bskgh,btkh->bkgst", q_BSKGH, k_BSKH).astype(jnp.float32) / math.sqrt(head_dim)
        causal = jnp.tril(jnp.ones((s, s), bool))
        probs = jax.nn.softmax(jnp.where(causal, scores_BKGST, -1e30), axis=-1).astype(x_BSD.dtype)
        out_BSNH = jnp.einsum("bkgst,btkh->bskgh", probs, v_BSKH).reshape(b, s, heads, head_dim)
        y_BSD = jax.lax.with_sharding_constraint(x_BSD + jnp.einsum("bsnh,nhd->bsd", out_BSNH, w_o), at(batch))
        gate_up_BS2F = jnp.einsum("bsd,dtf->bstf", y_BSD, w_gate_up)
        h_BSF = jax.lax.with_sharding_constraint(jax.nn.silu(gate_up_BS2F[:, :, 0]) * gate_up_BS2F[:, :, 1], at(hidden))
        z_BSD = jax.lax.with_sharding_constraint(y_BSD + h_BSF @ w_down, at(batch))
        return jnp.sum((z_BSD * x_BSD).astype(jnp.float32))  # every backward matmul is needed, the input's too

    shardings = tuple(at(spec) for _, spec, _ in stored.values())
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), out_shardings=(at(P()), (shardings, at(batch))))
    weights = tuple(
        jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=sharding)
        for (shape, _, _), sharding in zip(stored.values(), shardings)
    )
    return step, weights, at(batch)


# --------------------------------------------------------------------------- closed forms (theory side)


def weight_bytes(model: str) -> int:
    """W: one layer's weights in bf16, 2·(D·(H+2·KV)·h + H·h·D + 3·D·F) bytes."""
    d, f, heads, kv, head_dim = MODELS[model]
    return 2 * (d * (heads + 2 * kv) * head_dim + heads * head_dim * d + 3 * d * f)


def layer_flops(model: str, tokens: float, sequence_length: int) -> float:
    """Training FLOPs of one layer for `tokens`: 6 per weight per token, and dense attention 3 x 4·s·H·h a token."""
    _d, _, heads, _, head_dim = MODELS[model]
    return 6 * tokens * weight_bytes(model) / 2 + 3 * 4 * tokens * sequence_length * heads * head_dim


def activation_bytes(model: str, tokens: float) -> float:
    """A: one activation of the layer, tokens x D in bf16 (what Megatron's all-reduces carry)."""
    return 2 * tokens * MODELS[model][0]


def closed_form_bytes(step: LayerStep, config: Config) -> dict[str, float]:
    """Bytes one GPU sends per layer step on each network, from the model's sizes alone.

    FSDP over N = M·8 GPUs: one all-gather of the weights W (kept for the backward: no rematerialisation here) and
    one reduce-scatter of their gradients, each hierarchical: (k-1)/k·W on NVLink among the node's k = 8, and on
    the GPU's own NIC (M-1)/M of its W/k share. FSDP x TP: the same two passes of W/8 over M nodes, one GPU each
    (IB only), and Megatron's 4 all-reduces of the activations A (2 forward, 2 backward) on NVLink, 2·(8-1)/8·A.
    """
    w, m = weight_bytes(step.model), step.nodes
    if step.strategy == "FSDP":
        k = step.gpus // m
        return {"nvlink": 2 * (k - 1) / k * w, "infiniband": 2 * (m - 1) / m * w / k}
    tokens_per_group = config.sequences * config.sequence_length / step.sizes["fsdp"]
    tp = step.sizes["tensor"]
    return {
        "nvlink": 4 * 2 * (tp - 1) / tp * activation_bytes(step.model, tokens_per_group),
        "infiniband": 2 * (m - 1) / m * w / tp,
    }


def closed_form_seconds(step: LayerStep, config: Config, chip: ChipProfile) -> float:
    """The same traffic over bandwidth, each FSDP pass bounded by its slower tier (no latency)."""
    sent = closed_form_bytes(step, config)
    if step.strategy == "FSDP":
        per_pass = max(sent["nvlink"] / 2 / chip.link_bandwidth, sent["infiniband"] / 2 / chip.dcn_bandwidth)
        return 2 * per_pass
    return sent["nvlink"] / chip.link_bandwidth + sent["infiniband"] / chip.dcn_bandwidth


# --------------------------------------------------------------------------- what XLA wrote, on the link model


def tier_bytes(step: LayerStep) -> dict[str, float]:
    """Bytes one GPU sends on each network for the collectives XLA wrote, from their groups' nodes.

    A group inside one node is an NVLink ring; a group of k GPUs in each of M nodes sends (M-1)/M of S/k on its
    own NIC and (k-1)/k·S among the node's k on NVLink (the hierarchical ring). All-to-all and permutes across
    nodes count whole on IB.
    """
    out = {"nvlink": 0.0, "infiniband": 0.0}
    for c in step.crossings:
        s, n, runs = c.seen.size_bytes, c.seen.group_size or 1, c.seen.repeats or 1
        if n < 2:
            continue
        if c.nodes <= 1:
            out["nvlink"] += runs * theory.bus_bandwidth_factor(c.seen.kind, n) * s
        elif c.seen.kind in ("all-reduce", "all-gather", "reduce-scatter"):
            k, m = c.per_node, c.nodes
            out["infiniband"] += runs * theory.bus_bandwidth_factor(c.seen.kind, m) * s / k
            out["nvlink"] += runs * (theory.bus_bandwidth_factor(c.seen.kind, k) * s if k > 1 else 0.0)
        else:
            out["infiniband"] += runs * theory.bus_bandwidth_factor(c.seen.kind, n) * s
    return out


def chip_of(step: LayerStep) -> ChipProfile:
    return profile_for_device_kind(step.device_kind)


def compute_s(step: LayerStep) -> float:
    return step.flops / chip_of(step).peak_bf16_flops


def communication_s(step: LayerStep, network: str | None = None) -> float:
    """The collectives' predicted seconds on their placements (`lab.targets.topology.predict`), one network or all."""
    chip, total = chip_of(step), 0.0
    for c in step.crossings:
        where = step.where(c.seen.axes) if c.seen.axes else None
        cost = predict(c.seen.kind, c.seen.size_bytes, where, chip) if where else None
        if cost and (network is None or where.network == network):
            total += (c.seen.repeats or 1) * cost.seconds
    return total


def overlapped_s(step: LayerStep) -> float:
    return max(compute_s(step), communication_s(step))


def serial_s(step: LayerStep) -> float:
    return compute_s(step) + communication_s(step)


def tensor_nodes(step: LayerStep) -> int:
    """The most nodes a group of a collective over `tensor` spans in the HLO (0: no such collective)."""
    return max((c.nodes for c in step.crossings if c.seen.axes and "tensor" in c.seen.axes), default=0)


# --------------------------------------------------------------------------- judge


def judge(obs: Observations, config: Config) -> Result:
    return Result(
        summary=_summary(obs, config),
        theory=THEORY,
        tables=[
            _step_table(obs),
            *([_whole_table(obs)] if obs.whole else []),
            _link_table(obs, config),
            _collective_table(obs),
        ],
        checks=[c for s in obs.steps for c in _checks(s, config)],
        claims=_claims(obs),
        plots={"step": partial(_plot, obs)},
        notes=_notes(obs),
    )


THEORY = r"""
One decoder layer's training step at a fixed global batch of B tokens, on N = M·8 GPUs (M nodes), weights W bytes
(bf16), activations A = tokens·D·2 bytes (`closed_form_bytes`):

* **FSDP over all N**: all-gather W and reduce-scatter its gradient. NCCL runs them hierarchically: inside a node
  over NVLink, (k-1)/k·W per GPU per pass (k = 8), and across nodes each GPU's own NIC carries (M-1)/M of its
  W/8 share (rail-optimised: one 400 Gb/s NIC per GPU). The two tiers are pipelined, so the slower bounds a pass.
* **FSDP x TP (TP = 8 inside a node, FSDP = M across)**: the FSDP passes move W/8 over M nodes, one GPU of each
  (IB only); Megatron's TP all-reduces 4 activations per layer (2 forward, 2 backward) of A_group = B/M·D·2 bytes,
  2·(8-1)/8·A_group per GPU each, all on NVLink.
* NCCL's ring all-reduce moves 2(N-1)/N·S per GPU, all-gather and reduce-scatter (N-1)/N·S (nccl-tests'
  PERFORMANCE.md; `lab.theory.bus_bandwidth_factor`); times are bytes over the tier's bandwidth (H100 SXM:
  NVLink 450 GB/s per GPU each way, IB 50 GB/s per GPU), NVLink rings adding 0.47 us a step (`lab.targets.topology`).

Both layouts send the same IB bytes per GPU for the weights, 2·(M-1)/M·W/8: TP does not shrink what crosses
InfiniBand on a rail-optimised cluster, it moves FSDP's node-internal share and adds activations on NVLink. What
it changes is where the time goes, which the checks and the step table read from the compiled programs.
"""


def _label(step: LayerStep) -> str:
    return f"{step.model} on {step.gpus} GPUs ({step.nodes} nodes): {step.strategy} ({step.mesh})"


def _checks(step: LayerStep, config: Config) -> list[Check]:
    label, chip = _label(step), chip_of(step)
    tokens = config.sequences * config.sequence_length / (step.gpus / step.sizes.get("tensor", 1))
    flops_theory = layer_flops(step.model, tokens, config.sequence_length) / step.sizes.get("tensor", 1)
    expected, observed = closed_form_bytes(step, config), tier_bytes(step)
    checks = [
        check(
            f"{label}: matmul FLOPs per GPU (6·tokens·weights + 12·tokens·s·H·h, / TP)",
            flops_theory,
            step.flops,
            kind="exact",
            rtol=1e-6,
        ),
        check(
            f"{label}: bytes per GPU on InfiniBand (closed form)",
            round(expected["infiniband"]),
            round(observed["infiniband"]),
            kind="exact",
            rtol=1e-6,
        ),
        check(
            f"{label}: bytes per GPU on NVLink (closed form)",
            round(expected["nvlink"]),
            round(observed["nvlink"]),
            kind="exact",
            rtol=1e-6,
        ),
        check(
            f"{label}: predicted communication, ms (closed form, bytes over each tier's bandwidth)",
            round(closed_form_seconds(step, config, chip) * 1e3, 4),
            round(communication_s(step) * 1e3, 4),
            kind="model",
            rtol=COMM_RTOL,
            basis=COMM_BASIS,
        ),
    ]
    if step.strategy == "FSDP x TP":
        checks.append(
            check(
                f"{label}: nodes a TP group spans in the HLO's replica groups (TP inside a node: NVLink)",
                1,
                tensor_nodes(step),
                kind="exact",
            )
        )
    return checks


def _pairs(obs: Observations):
    by = {(s.model, s.gpus, s.strategy): s for s in obs.steps}
    for s in obs.steps:
        if s.strategy == "FSDP" and (s.model, s.gpus, "FSDP x TP") in by:
            yield s, by[s.model, s.gpus, "FSDP x TP"]


def _whole_pairs(obs: Observations):
    by = {(w.model, w.gpus, w.strategy): w for w in obs.whole}
    return [
        (w, by[w.model, w.gpus, "FSDP x TP"])
        for w in obs.whole
        if w.strategy == "FSDP" and (w.model, w.gpus, "FSDP x TP") in by
    ]


def _whole_claim(obs: Observations) -> list[Claim]:
    pairs = _whole_pairs(obs)
    if not pairs:
        return []
    wins = [(f, m) for f, m in pairs if m.step_with_flash_s < f.step_with_flash_s]
    return [
        Claim(
            "Past a few nodes, TP inside the node with a smaller FSDP beats one FSDP over every GPU (the whole step)",
            "confirmed" if len(wins) == len(pairs) else ("refined" if wins else "refuted"),
            "; ".join(
                f"{f.model} on {f.gpus} GPUs: lab predict's step with flash attention, FSDP "
                f"{f.step_with_flash_s:.3f} s, FSDP x TP {m.step_with_flash_s:.3f} s"
                for f, m in pairs
            ),
        )
    ]


def _whole_table(obs: Observations) -> Table:
    rows = [
        [
            w.model,
            str(w.gpus),
            w.strategy,
            f"{w.step_s:.3f} s",
            f"{w.step_with_flash_s:.3f} s",
            f"{w.compute_s:.3f} s",
            "; ".join(f"{k}: {v * 1e3:.1f} ms" for k, v in sorted(w.exposed_by_link.items()) if v > 5e-4) or "none",
        ]
        for w in obs.whole
    ]
    return Table(
        "The whole step (lab predict: Llama 3, remat full, two layers compiled and read at the model's depth)",
        ["model", "GPUs", "layout", "step as compiled", "step with flash", "compute", "exposed per link"],
        rows,
        note="The step with flash replaces XLA's attention by a flash kernel's estimate (lab.predict.attention), as "
        "a GPU run would use; H100's matmul efficiency is the one calibrated on results/gpu_predictions.",
    )


def _claims(obs: Observations) -> list[Claim]:
    pairs = list(_pairs(obs))
    if not pairs:
        return []
    wins = [(f, m) for f, m in pairs if overlapped_s(m) < overlapped_s(f)]
    on_nvlink = all(tensor_nodes(m) == 1 for _, m in pairs)
    same_ib = all(
        math.isclose(tier_bytes(f)["infiniband"], tier_bytes(m)["infiniband"], rel_tol=0.01) for f, m in pairs
    )
    return [
        Claim(
            "TP belongs inside the node (NVLink) and FSDP across nodes (InfiniBand)",
            "confirmed" if on_nvlink else "refuted",
            "; ".join(
                f"{m.model} on {m.gpus} GPUs: TP groups span {tensor_nodes(m)} node, "
                f"{format_bytes(tier_bytes(m)['nvlink'])} per GPU on NVLink, "
                f"{format_bytes(tier_bytes(m)['infiniband'])} on IB"
                for _, m in pairs
            ),
        ),
        Claim(
            "Past a few nodes, TP inside the node with a smaller FSDP beats one FSDP over every GPU",
            "confirmed" if len(wins) == len(pairs) else ("refined" if wins else "refuted"),
            "; ".join(
                f"{f.model} on {f.gpus} GPUs: predicted step FSDP {overlapped_s(f) * 1e3:.2f} ms, FSDP x TP "
                f"{overlapped_s(m) * 1e3:.2f} ms (overlapped), IB bytes per GPU "
                f"{format_bytes(tier_bytes(f)['infiniband'])} and {format_bytes(tier_bytes(m)['infiniband'])}"
                for f, m in pairs
            )
            + ("; the IB bytes per GPU are equal in every pair (rail-optimised NICs)" if same_ib else ""),
        ),
        *_whole_claim(obs),
    ]


def _step_table(obs: Observations) -> Table:
    return Table(
        "Predicted step of one layer (compiled by XLA:GPU, priced on the link model: predictions, not measurements)",
        [
            "model",
            "GPUs",
            "strategy",
            "mesh",
            "seq per GPU",
            "compute",
            "NVLink",
            "InfiniBand",
            "step (overlapped)",
            "step (serial)",
            "peak memory per GPU",
        ],
        [
            [
                s.model,
                s.gpus,
                s.strategy,
                s.mesh,
                f"{s.sequences_per_gpu:g}",
                f"{compute_s(s) * 1e3:.2f} ms",
                f"{communication_s(s, 'nvlink') * 1e3:.2f} ms",
                f"{communication_s(s, 'infiniband') * 1e3:.2f} ms",
                f"{overlapped_s(s) * 1e3:.2f} ms",
                f"{serial_s(s) * 1e3:.2f} ms",
                format_bytes(s.peak_memory),
            ]
            for s in obs.steps
        ],
        note="compute: the HLO's matmul FLOPs at 989 TFLOP/s bf16 dense; a sequence split by TP counts 1/8 per GPU.",
    )


def _link_table(obs: Observations, config: Config) -> Table:
    body = []
    for s in obs.steps:
        seen, expected = tier_bytes(s), closed_form_bytes(s, config)
        for network in ("nvlink", "infiniband"):
            body.append(
                [s.model, s.gpus, s.strategy, network, format_bytes(seen[network]), format_bytes(expected[network])]
            )
    return Table(
        "Bytes each GPU sends per layer step, per link: the compiled collectives against the closed form",
        ["model", "GPUs", "strategy", "link", "from the HLO's groups", "closed form"],
        body,
    )


def _collective_table(obs: Observations) -> Table:
    body = []
    for s in obs.steps:
        rows: dict[tuple, list] = {}
        for c in s.crossings:
            axes = ",".join(c.seen.axes or ("?",))
            key = (c.seen.kind, axes, c.nodes, c.per_node)
            row = rows.setdefault(key, [0, 0, 0])
            row[0] += c.seen.repeats or 1
            row[1] += (c.seen.repeats or 1) * c.seen.size_bytes
            row[2] += int(c.seen.is_async)
        for (kind, axes, nodes, per_node), (count, size, asynchronous) in rows.items():
            where = s.where(tuple(axes.split(","))) if axes != "?" else None
            body.append(
                [
                    s.model,
                    s.gpus,
                    s.strategy,
                    kind,
                    axes,
                    count,
                    asynchronous,
                    format_bytes(size),
                    f"{nodes} x {per_node}",
                    str(where) if where else "-",
                ]
            )
    return Table(
        "Collectives XLA:GPU wrote, and the link each crosses (groups: nodes spanned x GPUs per node)",
        ["model", "GPUs", "strategy", "kind", "mesh axes", "count", "async pairs", "S summed", "groups", "placement"],
        body,
    )


def _plot(obs: Observations) -> Figure:
    fig = Figure(figsize=(6.5, 4))
    ax = fig.subplots()
    for model in dict.fromkeys(s.model for s in obs.steps):
        for strategy, style in (("FSDP", "o-"), ("FSDP x TP", "s--")):
            steps = [s for s in obs.steps if s.model == model and s.strategy == strategy]
            ax.plot(
                [s.gpus for s in steps], [overlapped_s(s) * 1e3 for s in steps], style, label=f"{model}: {strategy}"
            )
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="H100 GPUs (8 per node, fixed global batch)",
        ylabel="predicted layer step, ms (overlapped)",
        title="Predicted from the compiled program: no GPU ran",
    )
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def _summary(obs: Observations, config: Config) -> str:
    pairs = list(_pairs(obs))
    if not pairs:
        return "No cluster was compiled under both layouts."
    f, m = max(pairs, key=lambda p: (p[0].gpus, weight_bytes(p[0].model)))
    return (
        f"XLA:GPU compiled one {f.model} layer at {config.sequences} x {config.sequence_length} tokens per step for "
        f"{', '.join(str(n * 8) for n in config.nodes)} H100s (compile-only, no GPU). With TP inside the node, every "
        f"TP collective's groups stay in one node (NVLink) and only FSDP's weight traffic crosses InfiniBand; on "
        f"{f.gpus} GPUs the {f.model} layer is predicted at {overlapped_s(m) * 1e3:.2f} ms with FSDP x TP against "
        f"{overlapped_s(f) * 1e3:.2f} ms with FSDP over all GPUs (compute {compute_s(f) * 1e3:.2f} ms, IB "
        f"{communication_s(f, 'infiniband') * 1e3:.2f} and {communication_s(m, 'infiniband') * 1e3:.2f} ms)."
        + "".join(
            f" The whole {w.model} step on {w.gpus} GPUs (lab predict, attention as flash): FSDP "
            f"{w.step_with_flash_s:.3f} s, FSDP x TP {t.step_with_flash_s:.3f} s."
            for w, t in _whole_pairs(obs)
            if w.gpus == f.gpus and w.model == f.model
        )
        + " These times are predictions from the compiled programs on the lab's link model, not measurements."
    )


def _notes(obs: Observations) -> list[str]:
    sync = sorted({s.sync_collectives for s in obs.steps})
    whole = [
        "The whole steps differ from the layer mostly in compute, where one layer shows none: FSDP x TP's compute is "
        + ", ".join(f"{m.compute_s / f.compute_s:.2f}x FSDP's ({f.model}, {f.gpus} GPUs)" for f, m in _whole_pairs(obs))
        + ". The whole step adds what the page's layer leaves out (lab.model's own layer and attention, the one-hot "
        "embedding, the chunked loss, the optimizer); which of them costs the difference is not isolated here."
    ]
    return [
        *(whole if obs.whole else []),
        "Every collective in these programs is an async start/done pair; the backend_config of "
        f'{"/".join(map(str, sync))} per program says "is_sync":true (XLA:GPU found nothing to overlap them with '
        "and runs them synchronously): the overlapped step is a bound the schedule does not reach for those.",
        "The node of each GPU is its device's process_index (compile-only devices: one host per node, see "
        "lab.targets.gpu); a collective's groups are the HLO's device ids mapped to them, not the mesh's axes.",
        "The link model: NVLink 450 GB/s per GPU each way, InfiniBand 50 GB/s per GPU (one 400 Gb/s NIC per GPU), "
        "no IB latency term (the scaling book gives none); hierarchical collectives are bounded by their slower tier. "
        "The NVLink and InfiniBand columns of the step table are the collectives placed on each: a hierarchical "
        "FSDP collective across nodes counts whole under InfiniBand.",
        "What this model leaves out, and what favours TP at scale in practice: IB and NCCL ring latency over "
        "hundreds of ranks, and the global batch: pure FSDP cannot spread 256 sequences over more than 256 GPUs, "
        "FSDP x TP can (each TP group shares its sequences).",
    ]
