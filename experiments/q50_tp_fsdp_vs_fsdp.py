"""FSDP x TP against a very large FSDP: equal chips, 64 to 1024 and across DCN slices.

Question #50: why put tensor parallelism inside the fast domain and FSDP
across it, rather than growing FSDP? At a fixed global batch of B tokens,
FSDP over N chips moves the whole weights through every chip each step (all-
gather forward and backward, reduce-scatter of the gradients) while each chip's
compute shrinks as B/N: past B/N ≈ α/M_X (`scaling_thresholds`) the step is
communication-bound and more chips stop paying. FSDP over X chips x TP over
Y = N/X moves weights X-ways and activations Y-ways; the communication is least
at X_opt = sqrt((B/F)·(M_X/M_Y)·N) (the scaling book, Part 5). Across slices
the FSDP axis crosses the data-centre network and pays far more per byte.

Here the MLP block of `scaling_thresholds` (same program, built on its
`_step`) is compiled by the TPU compiler (compile-only) for v5p slices from
64 to 1024 chips and for two slices over DCN, as pure FSDP and as FSDP x TP
with TP at N/X_opt; the collectives per mesh axis come from the HLO and the
step times from the roofline of the compiled program.
"""

from __future__ import annotations

from dataclasses import dataclass

from matplotlib.figure import Figure

from experiments.q50_scaling_thresholds import _step
from lab import theory
from lab.devices import parse_target, topology_devices
from lab.progress import track
from lab.report import Result, Table, provenance
from lab.topology import placement
from lab.units import format_bytes
from lab.verdict import check

QUESTION = "#50"
COMPILE_ONLY = True  # runs on TPU topologies through libtpu, whatever target `lab report` uses


@dataclass(frozen=True)
class Config:
    target: str = "tpu:v5p:4x4x4"
    """a TPU generation to compile for (compile-only); the topologies below are of this generation"""
    topologies: tuple[str, ...] = ("4x4x4", "8x8x16")
    """single-slice topologies, 64 to 1024 chips (add 8x8x4 for 256: about 15 s more)"""
    dcn_topology: str = "4x4x4"
    """a slice repeated `dcn_slices` times, FSDP across the slices ('' to skip)"""
    dcn_slices: int = 2
    """slices joined over DCN"""
    global_tokens: int = 131072
    """B, tokens per step (fixed: strong scaling)"""
    embed: int = 8192
    """D, the model width"""
    mlp: int = 32768
    """F, the MLP width"""


def run(config: Config) -> Result:
    target = parse_target(config.target)
    generation = target.generation if target.compile_only else parse_target(Config.target).generation
    machines = [(f"{generation}:{t}", topology_devices(f"{generation}:{t}")) for t in config.topologies]
    if config.dcn_topology:
        machines.append(
            (
                f"{generation}:{config.dcn_topology} x{config.dcn_slices} slices",
                topology_devices(f"{generation}:{config.dcn_topology}", config.dcn_slices),
            )
        )
    rows = [row for name, chips in track(machines, "topologies") for row in _compare(name, chips, config)]
    return Result(
        summary=_summary(rows, config),
        theory=THEORY,
        tables=[_optimum_table(rows, config), _step_table(rows), _axis_table(rows)],
        checks=_checks(rows, config),
        plots={"crossover": _plot(rows, config)},
        notes=_notes(rows, config),
        provenance=provenance(target=f"tpu:{generation}", devices=machines[-1][1], mesh="fsdp=N; fsdp=N/Y,tensor=Y"),
        data={"rows": [{k: v for k, v in r.items() if k not in ("roofline", "mesh")} for r in rows]},
    )


THEORY = r"""
Per step of an MLP block (the scaling book, Part 5, "How to Parallelize a Transformer for Training"), B tokens,
width D, MLP width F, N chips, α = C / W_ici (2550 on v5p), M_X, M_Y the torus axes the FSDP and TP mesh axes span:

* compute per chip: 12·B·D·F / N FLOPs, whatever the split;
* FSDP over X chips: all-gather the weights forward and backward and reduce-scatter their gradients, 3 collectives of
  2·D·F·bytes / Y per weight pair: **independent of X**, so at fixed B the ratio to compute grows like N;
* TP over Y chips: all-reduce (or reduce-scatter + all-gather) of the B/X·D activations per matmul;
* the total is least at **X_opt = sqrt((B/F)·(M_X/M_Y)·N)** FSDP ways (`lab.theory.fsdp_tp_optimal_fsdp_ways`),
  i.e. Y = N/X_opt tensor ways; FSDP x TP stays compute-bound down to B/N = 4α²/(M_X·M_Y·F) tokens per chip,
  pure FSDP only down to α/M_X.

Across slices the FSDP axis's collectives run on DCN, whose bandwidth per chip is a small fraction of ICI's.
"""


def _tensor_ways(chips: int, config: Config) -> int:
    """Y = N / X_opt, rounded to a power of two (at least 2)."""
    x_opt = theory.fsdp_tp_optimal_fsdp_ways(config.global_tokens, config.mlp, chips)
    y = max(2, round(chips / x_opt))
    return 1 << (y.bit_length() - 1) if y & (y - 1) else y


def _compare(name: str, chips, config: Config) -> list[dict]:
    n = len(chips)
    y = _tensor_ways(n, config)
    out = []
    for strategy, spec in (("FSDP", "fsdp=-1"), (f"FSDP x TP (Y={y})", f"fsdp=-1,tensor={y}")):
        row = _step(spec, chips, config, config.global_tokens // n)
        roof = row["roofline"]
        out.append(
            row
            | {
                "machine": name,
                "strategy": strategy,
                "tensor": y if "tensor" in spec else 1,
                "compute_s": roof.compute_s,
                "communication_s": roof.communication_s,
                "step_s": roof.overlapped_s,
                "bound": roof.bound,
                "per_axis": _per_axis(roof),
            }
        )
    return out


def _per_axis(roof) -> dict:
    """mesh axes -> (collectives, bytes per device moved as S, predicted seconds)."""
    out: dict[str, list] = {}
    for c in roof.collectives:
        axes = ",".join(c.collective.axes or ()) or "none"
        runs = c.collective.repeats or 1
        count, size, seconds = out.get(axes, (0, 0, 0.0))
        out[axes] = (count + runs, size + runs * c.collective.size_bytes, seconds + c.seconds)
    return out


def _checks(rows, config: Config) -> list:
    checks = []
    for fsdp, tp in zip(rows[::2], rows[1::2]):
        n = fsdp["chips"]
        checks.append(
            check(
                f"{fsdp['machine']}: FLOPs per chip equal under both splits (12·B·D·F/N)",
                12 * config.global_tokens * config.embed * config.mlp / n,
                tp["roofline"].flops,
                rtol=0.05,
            )
        )
        fsdp_ax = _axes_spanned(fsdp["mesh"], "fsdp")
        threshold = theory.data_parallel_min_batch_per_chip(_chip(fsdp), fsdp_ax)
        expected = "communication" if config.global_tokens / n < threshold else "compute"
        checks.append(
            check(
                f"{fsdp['machine']}: pure FSDP at B/N={config.global_tokens // n} "
                f"is bound by (threshold α/M_X = {threshold:.0f})",
                expected,
                _bound(fsdp),
                explained=_WHY_DCN if "slices" in fsdp["machine"] else None,
            )
        )
        checks.append(
            check(
                f"{fsdp['machine']}: FSDP x TP at least as fast as pure FSDP",
                "yes",
                "yes" if tp["step_s"] <= fsdp["step_s"] * 1.001 else "no",
                explained=_WHY_SMALL if n <= 64 else None,
            )
        )
    return checks


_WHY_DCN = (
    "the FSDP axis crosses DCN here: its threshold uses W_dcn, far below W_ici, so FSDP is communication-bound "
    "at any batch in the sweep"
)
_WHY_SMALL = "at 64 chips B/N is large enough that pure FSDP is already compute-bound; TP only adds activation traffic"


def _bound(row) -> str:
    return "communication" if row["communication_s"] > row["compute_s"] else "compute"


def _chip(row):
    from lab.hardware import profile_for_device_kind

    return profile_for_device_kind(row["mesh"].devices.flat[0].device_kind)


def _axes_spanned(mesh, axis: str) -> int:
    return max(1, len(placement(mesh, (axis,)).torus_dims))


def _optimum_table(rows, config: Config) -> Table:
    body = []
    for r in rows[1::2]:
        x_opt = theory.fsdp_tp_optimal_fsdp_ways(config.global_tokens, config.mlp, r["chips"])
        body.append(
            [
                r["machine"],
                r["chips"],
                f"{x_opt:.1f}",
                f"{r['chips'] / x_opt:.1f}",
                r["tensor"],
                r["chips"] // r["tensor"],
            ]
        )
    return Table(
        "How large TP should be: X_opt = sqrt((B/F)·(M_X/M_Y)·N), with M_X = M_Y",
        ["machine", "chips N", "X_opt (FSDP ways)", "N / X_opt", "TP ways Y used (power of 2)", "FSDP ways used"],
        body,
    )


def _step_table(rows) -> Table:
    return Table(
        "Predicted step of the compiled MLP block (roofline of the TPU compiler's program)",
        ["machine", "chips", "strategy", "tokens per chip", "compute", "communication", "step (overlapped)", "bound"],
        [
            [
                r["machine"],
                r["chips"],
                r["strategy"],
                r["batch_per_chip"],
                f"{r['compute_s'] * 1e3:.2f} ms",
                f"{r['communication_s'] * 1e3:.2f} ms",
                f"{r['step_s'] * 1e3:.2f} ms",
                _bound(r),
            ]
            for r in rows
        ],
    )


def _axis_table(rows) -> Table:
    body = []
    for r in rows:
        for axes, (count, size, seconds) in sorted(r["per_axis"].items()):
            body.append([r["machine"], r["strategy"], axes, count, format_bytes(size), f"{seconds * 1e3:.2f} ms"])
    return Table(
        "Collectives per mesh axis, from the compiled HLO",
        ["machine", "strategy", "mesh axes", "collectives", "bytes per device (S, summed)", "predicted time"],
        body,
        note="A multi-slice program is compiled per slice; its collectives over fsdp include the DCN hop.",
    )


def _plot(rows, config: Config):
    fig = Figure(figsize=(6.5, 4))
    ax = fig.subplots()
    for label, style in (("FSDP", "o-"), ("FSDP x TP", "s-")):
        picked = [
            r
            for r in rows
            if r["strategy"].startswith(label)
            and (label != "FSDP" or "TP" not in r["strategy"])
            and "slices" not in r["machine"]
        ]
        ax.plot(
            [r["chips"] for r in picked],
            [r["communication_s"] / r["compute_s"] for r in picked],
            style,
            label=f"{label}: communication / compute (ICI)",
        )
        dcn = [
            r
            for r in rows
            if r["strategy"].startswith(label)
            and (label != "FSDP" or "TP" not in r["strategy"])
            and "slices" in r["machine"]
        ]
        ax.plot(
            [r["chips"] for r in dcn],
            [r["communication_s"] / r["compute_s"] for r in dcn],
            style[0],
            markersize=10,
            fillstyle="none",
            label=f"{label}: {config.dcn_slices} slices over DCN",
        )
    single = sorted({r["chips"] for r in rows if "slices" not in r["machine"]})
    fsdp_threshold = theory.data_parallel_min_batch_per_chip(
        _chip(rows[0]), 3
    )  # α / M_X, FSDP over all three torus axes
    ax.plot(
        single,
        [fsdp_threshold / (config.global_tokens / n) for n in single],
        ":",
        color="tab:blue",
        label="FSDP theory: (α/M_X) / (B/N), M_X = 3",
    )
    ax.axhline(1.0, color="grey", linestyle="--", label="compute = communication")
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="chips N (fixed global batch)",
        ylabel="communication / compute",
        title=f"B = {config.global_tokens} tokens, D={config.embed}, F={config.mlp}",
    )
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def _summary(rows, config: Config) -> str:
    single = [r for r in rows if "slices" not in r["machine"]]
    fsdp = [r for r in single if "TP" not in r["strategy"]]
    tp = [r for r in single if "TP" in r["strategy"]]
    first_bad = next((r for r in fsdp if _bound(r) == "communication"), None)
    biggest = max(single, key=lambda r: r["chips"])
    big_fsdp, big_tp = [r for r in single if r["chips"] == biggest["chips"]]
    return (
        f"At a fixed {config.global_tokens} tokens per step, pure FSDP's communication / compute ratio goes from "
        f"{fsdp[0]['communication_s'] / fsdp[0]['compute_s']:.2f} on {fsdp[0]['chips']} "
        f"chips to {fsdp[-1]['communication_s'] / fsdp[-1]['compute_s']:.2f} "
        f"on {fsdp[-1]['chips']}"
        + (
            f"; it is communication-bound from {first_bad['chips']} chips"
            if first_bad
            else "; it stays compute-bound in this sweep"
        )
        + " (theory: past N = B·M_X/α = "
        f"{config.global_tokens / theory.data_parallel_min_batch_per_chip(_chip(fsdp[0]), 3):.0f} "
        "chips on a 3-axis torus)" + f". On {biggest['chips']} chips FSDP x TP with Y={big_tp['tensor']} "
        f"(N/X_opt) predicts {big_tp['step_s'] * 1e3:.2f} ms against FSDP's "
        f"{big_fsdp['step_s'] * 1e3:.2f} ms "
        f"({big_fsdp['step_s'] / big_tp['step_s']:.1f}x). TP degrees tried: {', '.join(str(r['tensor']) for r in tp)}."
    )


def _notes(rows, config: Config) -> list[str]:
    notes = []
    for r in rows:
        if "slices" in r["machine"]:
            notes.append(
                f"{r['machine']}, {r['strategy']}: predicted {r['step_s'] * 1e3:.2f} "
                f"ms, {_bound(r)}-bound; collectives by axes: "
                + "; ".join(f"{a}: {c} ({format_bytes(s)})" for a, (c, s, _) in sorted(r["per_axis"].items()))
            )
    notes.append(
        "Compared with `scaling_thresholds` (per-chip batch sweep on one "
        "64-chip slice), this page holds B fixed and grows N: "
        "the per-chip batch falls as 1/N, which is what ends FSDP's scaling."
    )
    return notes
