"""``lab plan``: every way to lay this model on this pod, ranked, and why the winner wins.

The handler reads the model as ``lab predict`` does (`lab.predict.spec.parse_model`),
builds the `Problem`, enumerates and ranks every layout by the closed form
(`lab.plan.rank.closed_form_plan`), compiles the first ``--compile-top`` with
``lab predict``'s machinery (`lab.plan.compiled`) and re-ranks those. It prints
the ranked table, the terms in which the winner differs from the runner-up
and from pure FSDP, and the rank correlation of the two models; ``--json``
prints one object; ``--plot FILE.png`` saves step time against memory per
chip for every candidate, the frontier marked.

libtpu is imported inside the functions that need it (its flags must be set
before it starts), as `lab.predict.command` does.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from rich.console import Console
from rich.table import Table

from lab import inputs
from lab.errors import LabError
from lab.model import check_flash_tiling
from lab.plan import overlap
from lab.plan.closed_form import Estimate
from lab.plan.rank import Candidate, Ranking, closed_form_plan, differing_terms, frontier, rerank
from lab.plan.space import Problem
from lab.predict import calibration
from lab.predict.options import check_dropless, check_gpu_flags, check_gpu_slices, check_tpu_flags, resolve_attention
from lab.predict.spec import MAX_STEP_TOKENS, check_step_tokens, parse_model
from lab.units import format_bytes


@dataclass(frozen=True)
class Plan:
    """Rank every layout of a model on a TPU pod or a GPU cluster (closed form), compile the best few, and say why
    the winner wins."""

    model: str = "llama3-8b"
    """a preset (llama3-8b, llama3-70b, ...) or key=value pairs, exactly as lab predict's --model"""
    seq: int = 4096
    """tokens per sequence"""
    global_batch: int | None = None
    """tokens per step, all chips (a multiple of --seq); default: --batch-per-device sequences on every chip"""
    batch_per_device: int = 1
    """sequences per device per step, when --global-batch is not given (one device a chip; two on TPU7x)"""
    target: str = "tpu:v5e:16x16"
    """one slice's topology, tpu:<gen>:<topology>, or a GPU cluster, gpu:<chip>:<nodes>x<gpus per node>"""
    slices: int = 1
    """TPU slices joined by DCN (a GPU cluster's nodes are in its target)"""
    chips: int | None = None
    """the pod's chips, if you want it checked against the topology x slices"""
    attention: Literal["auto", "flash", "xla"] = "auto"
    """flash (the Pallas TPU kernel), xla (dot product, scores materialized) or auto: flash on TPU, xla on GPU, as
    lab predict"""
    libtpu_flags: str = ""
    """TPU compiler flags for the compiled layouts, as in LIBTPU_INIT_ARGS (a recipe's), as lab predict's"""
    xla_flags: str = ""
    """GPU compiler flags for the compiled layouts, as in XLA_FLAGS (a recipe's), as lab predict's"""
    compile_top: int = 3
    """compile this many of the best layouts and re-rank them by the compiled prediction (0: closed form only)"""
    top: int = 10
    """rows of the ranked table"""
    plot: Path | None = None
    """save step time against memory per chip (every candidate, the frontier marked) to this PNG"""
    json: bool = False
    """print one JSON object instead of tables"""


def problem_of(command: Plan) -> Problem:
    """The command's model, batch and pod; a LabError names what is wrong."""
    # local: lab.targets.devices and lab.targets.hardware pull in JAX; the CLI imports this module before it chooses
    # a target
    from lab.targets.devices import check_slices, one_slice, parse_target, topology_shape
    from lab.targets.gpu import GPU_TARGET_FORM, parse_cluster
    from lab.targets.hardware import profile

    target = parse_target(command.target)
    if target.platform not in ("tpu", "gpu") or not target.compile_only:
        raise LabError(
            f"--target {command.target!r}: lab plan lays a model on tpu:<gen>:<topology> (e.g. tpu:v5e:16x16) "
            f"or {GPU_TARGET_FORM}"
        )
    target, slices = one_slice(target, command.slices)  # "tpu:v5e:4x4 slices=2", as lab inspect takes it
    command = replace(command, slices=slices)
    if command.seq < 1 or command.top < 1 or command.compile_top < 0:
        raise LabError("--seq and --top take 1 or more, --compile-top 0 or more")
    on_gpu = target.platform == "gpu"
    if on_gpu:
        check_gpu_flags(command.libtpu_flags)
    else:
        check_tpu_flags(command.xla_flags)
    attention = resolve_attention(command.attention, on_gpu)
    if attention == "flash":
        check_flash_tiling(command.seq)
    check_slices("--slices", command.slices)
    if on_gpu:
        check_gpu_slices(command.slices)
        chip, nodes, per_node = parse_cluster(str(target))
        topology, slices = f"{chip}:1x{per_node}", nodes  # one node is the slice, InfiniBand joins the nodes
    else:
        chip, topology, slices = target.generation, target.topology, command.slices
    chip_profile = profile(chip)
    torus = topology_shape(topology)
    chips = math.prod(torus) * slices
    devices = chips * chip_profile.devices_per_chip  # TPU7x: two a chip, each laid out and priced on its own
    check_step_tokens(command.batch_per_device, devices, command.seq)
    if command.chips is not None and command.chips != chips:
        raise LabError(
            f"--chips {command.chips}: {command.target} has {math.prod(torus)} chips a slice (node), x {slices} "
            f"slice(s) = {chips}; give that, or a target with {command.chips} chips"
        )
    if command.global_batch is not None:
        if command.global_batch < 1 or command.global_batch % command.seq:
            raise LabError(f"--global-batch {command.global_batch} tokens is not a whole number of --seq {command.seq}")
        if command.global_batch > MAX_STEP_TOKENS:
            raise LabError(f"--global-batch {command.global_batch:,} tokens: a step counts {MAX_STEP_TOKENS:,} at most")
        sequences = command.global_batch // command.seq
    else:
        sequences = command.batch_per_device * devices
    model = replace(parse_model(command.model), seq=command.seq, attention=attention)
    check_dropless(model, on_gpu)
    return Problem(model, sequences, chip_profile, torus, topology, slices)


def make_plan(command: Plan) -> Ranking:
    """Closed form over every layout, then the compiled re-ranking of the best `compile_top`."""
    # local: the closed form's placements start libtpu or the CUDA plugin, which must first see the compiler's flags
    from lab.targets import libtpu, xla_flags

    problem = problem_of(command)
    if command.xla_flags:
        xla_flags.prepare(command.xla_flags)
    elif problem.chip.torus_dims:
        libtpu.prepare(command.libtpu_flags)
        problem = replace(problem, overlap=overlap.overlaps(problem.generation))
    plan = closed_form_plan(problem)
    if command.compile_top and plan.candidates:
        # local: compiling imports the training step (flax, optax); a closed-form plan never needs it
        from lab.plan.compiled import compile_layout

        plan = rerank(plan, command.compile_top, lambda layout: compile_layout(problem, layout))
    return plan


def plan(command: Plan) -> int:
    """The ``lab plan`` handler: tables (or --json) and the plot; nothing fitting is a result, not an error."""
    if command.plot is not None:
        _plot_file(command.plot)  # before the compiles: a bad name costs nothing
    result = make_plan(command)
    if command.plot is not None:
        command.plot.parent.mkdir(parents=True, exist_ok=True)
        plot(result).savefig(command.plot, dpi=120)
    if command.json:
        print(json.dumps(to_json(result)))
        return 0
    show(result, Console(width=160), command.top)
    return 0


def _plot_file(path: Path) -> None:
    """A file matplotlib can write by its name: a format it knows, not a folder, in a folder this user may write."""
    inputs.output_file("--plot", path)
    from matplotlib.figure import Figure  # local: matplotlib takes 0.4 s to import, every `lab` command would pay

    formats = Figure().canvas.get_supported_filetypes()
    if path.suffix.lstrip(".").lower() not in formats:
        raise LabError(
            f"--plot {str(path)!r}: give a file name ending in an image format matplotlib writes "
            f"({', '.join('.' + f for f in sorted(formats))}), e.g. --plot plan.png"
        )


# --------------------------------------------------------------------------- views


def mesh_text(e: Estimate) -> str:
    return str(e.layout.mesh)


def candidate_json(c: Candidate) -> dict:
    e = c.estimate
    compiled = None
    if c.compiled is not None:
        compiled = {
            "step_s": c.compiled.step_s,
            "compute_s": c.compiled.compute_s,
            "exposed_s": c.compiled.exposed_s,
            "memory_bytes": c.compiled.memory_bytes,
            "axes": c.compiled.axes,
            "compile_s": c.compiled.compile_s,
        }
    return {
        "mesh": mesh_text(e),
        "slices_axis": e.layout.slices_axis,
        "remat": e.layout.remat,
        "micro_batches": e.layout.micro_batches,
        "step_s": e.step_s,
        "mfu": e.mfu,
        "memory_bytes": e.memory.total,
        "exposed_s": {a.axis: a.exposed_s for a in e.axes},
        "compiled": compiled,
        "not_compiled": c.not_compiled or None,
    }


def to_json(result: Ranking) -> dict:
    out = {
        "enumerated": result.enumerated,
        "ranked_s": result.ranked_s,
        "rank_correlation": result.rank_correlation,
        "fits": bool(result.candidates),
        "gathers_overlap": result.problem.overlap.gathers if result.problem.chip.torus_dims else None,
        "scatters_overlap": result.problem.overlap.scatters if result.problem.chip.torus_dims else None,
        "candidates": [candidate_json(c) for c in result.candidates],
    }
    if result.closest is not None:
        out["nothing_fits"] = nothing_fits(result)
    return out


def nothing_fits(result: Ranking) -> str:
    """The layout that comes closest, and what would make it fit: more chips to spread its states over, or (when
    what each chip holds for its own tokens is already too much) fewer tokens per chip."""
    e, chips = result.closest, result.problem.chips
    m = e.memory
    states, own = m.params + m.grads + m.optimizer, m.activations + m.transient
    closest = (
        f"nothing fits: the least memory per chip, {format_bytes(m.total)}, is {mesh_text(e)} with remat "
        f"{e.layout.remat}, against {format_bytes(e.hbm_bytes)} of HBM"
    )
    if own >= e.hbm_bytes:
        return (
            f"{closest}; its activations alone take {format_bytes(own)} a chip: give a shorter --seq, or fewer "
            "sequences a chip (--batch-per-device, --global-batch)"
        )
    needed = math.ceil(chips * states / (e.hbm_bytes - own))
    return (
        f"{closest}; its weights, gradients and optimizer state ({format_bytes(states * chips)} in all) fit spread "
        f"over about {needed:,} such chips at this batch a chip: give a larger --target, or more --slices"
    )


def ranked_table(result: Ranking, rows: int) -> tuple[list[str], list[list]]:
    """The ranked candidates: closed form and, where compiled, the compiled prediction."""
    head = [
        "#",
        "layout",
        "remat",
        "M",
        "step (closed)",
        "step (compiled)",
        "MFU",
        "memory/chip (closed)",
        "memory/chip (compiled)",
        "exposed per axis (closed)",
    ]
    body = []
    for i, c in enumerate(result.candidates[:rows], 1):
        e = c.estimate
        exposed = ", ".join(f"{a.axis} {a.exposed_s * 1e3:.1f} ms" for a in e.axes if a.exposed_s > 0) or "-"
        body.append(
            [
                i,
                str(e.layout),
                e.layout.remat,
                e.layout.micro_batches,
                f"{e.step_s:.3f} s",
                f"{c.compiled.step_s:.3f} s" if c.compiled else (c.not_compiled[:40] or "-"),
                f"{e.mfu:.1%}",
                format_bytes(e.memory.total),
                format_bytes(c.compiled.memory_bytes) if c.compiled else "-",
                exposed,
            ]
        )
    return head, body


def why_table(result: Ranking) -> tuple[list[str], list[list]]:
    """Terms where the winner differs from the runner-up and from pure FSDP."""
    winner = result.candidates[0].estimate
    others = [("runner-up", c.estimate) for c in result.candidates[1:2]]
    if result.pure_fsdp is not None and result.pure_fsdp.layout != winner.layout:
        others.append(("pure FSDP", result.pure_fsdp))
    body = []
    for name, other in others:
        for term, a, b in differing_terms(winner, other):
            shown = format_bytes if term.endswith("bytes") else (lambda v: f"{v * 1e3:.2f} ms")
            body.append(
                [
                    f"{name}: {other.layout} {other.layout.remat}",
                    term.removesuffix(" bytes").removesuffix(" s"),
                    shown(a),
                    shown(b),
                ]
            )
    return ["against", "term", f"winner ({winner.layout}, {winner.layout.remat})", "other"], body


def synchronous_note(generation: str, runs_async: overlap.Overlap) -> str:
    """What the plan prices exposed on this target because libtpu runs it synchronously, and the flags that would
    overlap the gathers."""
    waits = [
        name
        for name, hidden in (("gathers", runs_async.gathers), ("reduce-scatters", runs_async.scatters))
        if not hidden
    ]
    note = (
        f"libtpu, with these flags, runs the FSDP {' and '.join(waits)} on {generation} synchronously (asked of it by "
        "a probe compile, lab.plan.overlap): none hides behind compute, and the plan prices them so"
    )
    if not runs_async.gathers:
        note += f'; MaxText\'s recipes overlap the gathers with --libtpu-flags "{calibration.CF_FOR_ALL_GATHER}"'
    return note


def show(result: Ranking, console: Console, rows: int = 10) -> None:
    p = result.problem
    per_chip = p.chip.devices_per_chip
    laid = f"{p.chips} devices ({per_chip} a chip: 'chip' below means device)" if per_chip > 1 else f"{p.chips} chips"
    console.print(
        f"{p.model.parameters / 1e9:.2f} B parameters, {p.sequences} x {p.model.seq} tokens, {p.topology} x "
        f"{p.slices} {'slice(s)' if p.chip.torus_dims else 'node(s) on InfiniBand'} = {laid}; "
        f"{result.enumerated} layouts enumerated, {len(result.candidates)} "
        f"fit, ranked in {result.ranked_s:.2f} s",
        highlight=False,
    )
    if p.chip.torus_dims and not (p.overlap.gathers and p.overlap.scatters):
        console.print(synchronous_note(p.generation, p.overlap), highlight=False)
    if not result.candidates:
        console.print(nothing_fits(result), highlight=False)
        return
    for title, (head, body) in (
        ("ranked layouts", ranked_table(result, rows)),
        ("why the winner wins", why_table(result)),
    ):
        table = Table(title=title)
        for column in head:
            table.add_column(column)
        for row in body:
            table.add_row(*map(str, row))
        console.print(table)
    rho = result.rank_correlation
    console.print(
        f"rank correlation (Spearman, closed form against compiled, {len(result.compiled)} compiled): "
        + ("-" if rho is None else f"{rho:.2f}"),
        highlight=False,
    )


def plot(result: Ranking, title: str = ""):
    """Predicted step time against memory per chip for every enumerated layout; the frontier and the winner marked."""
    from matplotlib.figure import Figure  # local: see `_plot_file`

    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
    everything = result.everything
    remats = sorted({e.layout.remat for e in everything})
    for remat, marker in zip(remats, "o^s"):
        chosen = [e for e in everything if e.layout.remat == remat]
        ax.scatter(
            [e.memory.total / 2**30 for e in chosen],
            [e.step_s for e in chosen],
            s=8,
            alpha=0.4,
            marker=marker,
            label=f"remat {remat}",
        )
    edge = frontier(everything)
    ax.plot([e.memory.total / 2**30 for e in edge], [e.step_s for e in edge], "k-", lw=1, label="frontier")
    if everything:
        ax.axvline(everything[0].hbm_bytes / 2**30, color="red", ls="--", lw=1, label="HBM per chip")
    if result.candidates:
        best = result.candidates[0].estimate
        ax.scatter(
            [best.memory.total / 2**30],
            [best.step_s],
            s=80,
            facecolors="none",
            edgecolors="k",
            label=f"chosen: {best.layout} ({best.layout.remat})",
        )
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="memory per chip (GiB, closed form)",
        ylabel="step time (s, closed form)",
        title=title,
    )
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig
