"""``lab predict``'s terminal view: the prediction as a few lines, the exposed communication per link and the ten
most expensive ops (``--json`` prints the same `lab.predict.command.Prediction`, or with --fn
`lab.predict.program.ProgramPrediction`, whole)."""

from __future__ import annotations

import json
from dataclasses import asdict

from rich.console import Console
from rich.table import Table

from lab.predict.calibration import CF_FOR_ALL_GATHER
from lab.units import format_bytes, format_seconds


def emit(prediction, show_it, as_json: bool) -> int:
    """Print a prediction as one JSON object, or as `show_it` lays it out (`show`, or the user's step's view)."""
    if as_json:
        print(json.dumps(asdict(prediction)))
    else:
        show_it(prediction, Console(width=160))
    return 0


def show(p, console: Console) -> None:
    """`p` (a `lab.predict.command.Prediction`) as a few lines and two tables."""
    header = [
        f"{p.model} ({p.parameters / 1e9:.2f} B params), seq {p.seq}, batch {p.batch_per_device}/chip, "
        f"remat {p.remat}, attention {p.attention}" + (", sequence parallel" if p.sequence_parallel else "")
    ]
    utilisation = [
        f"model TFLOP/s   {p.tflops_per_chip:.1f} per chip, MFU {p.mfu:.1%}  [{p.flops_convention}]",
        f"FLOPs per step  model {p.model_flops_per_step:.3e}, hardware {p.hardware_flops_per_step:.3e} "
        f"({p.hardware_flops_per_step / p.model_flops_per_step:.2f}x: remat, one-hot embedding, chunked loss)",
    ]
    if p.layers_compiled < p.layers:
        header.append(f"compiled        {p.layers_compiled} layers, read as {p.layers} (lab.predict.depth)")
    attention = [
        f"attention       XLA's scores in HBM {format_seconds(p.attention_xla_s)}; a flash kernel's estimate "
        f"{format_seconds(p.attention_flash_s)}: step with flash {format_seconds(p.step_with_flash_s)}"
    ]
    show_priced(p, header[:1], header[1:], utilisation + (attention if p.attention == "xla" else []), console)


def show_priced(p, about: list[str], compiled: list[str], own: list[str], console: Console) -> None:
    """A priced step (`lab.predict.command.PricedStep`): the lines `about` the program, where it runs, how it was
    `compiled`, its step, its `own` lines (what its FLOPs mean), its memory, the compiler's own view, then the
    links and the ten dearest ops."""
    fit = "fits" if p.fits else f"DOES NOT FIT ({p.advice})"
    lines = [
        *about,
        (
            f"{p.target} = {p.chips} GPUs, mesh {p.mesh}"
            if p.target.startswith("gpu:")
            else f"{p.target} x {p.slices} slice(s) = {p.chips} chips, mesh {p.mesh}"
            if p.devices_per_chip == 1
            else f"{p.target} x {p.slices} slice(s) = {p.chips} devices ({p.devices_per_chip} per chip: every 'per "
            f"chip' below is per device), mesh {p.mesh}"
        ),
        *(
            [
                f"matmuls         priced at the chip's {p.matmul_precision} peak (compiled bf16: no quantize or "
                "dequantize ops; the attention kernel at bf16); MFU against the bf16 peak"
            ]
            if p.matmul_precision != "bf16"
            else []
        ),
        *compiled,
        f"step            {format_seconds(p.step_s)}  (compute {format_seconds(p.compute_s)} + exposed "
        f"communication {format_seconds(p.exposed_comm_s)} of {format_seconds(p.comm_s)})",
        *own,
        f"memory per chip {format_bytes(p.memory_bytes)} of {format_bytes(p.hbm_bytes)} HBM: {fit}"
        + (f"; {format_bytes(p.host_bytes)} offloaded to host memory" if p.host_bytes else ""),
        *([_compilers_own(p)] if p.xla_compute_s is not None else []),
        *([_synchronous(p.synchronous_s)] if p.synchronous_s and not p.target.startswith("gpu:") else []),
        *(
            [
                f"compiled without the compiler's pass {', '.join(p.disabled_passes)}: it crashed on this step (the "
                "program is the same one, its loops' all-reduces left where the step wrote them)"
            ]
            if p.disabled_passes
            else []
        ),
        f"compile {p.compile_s:.1f} s, predict {p.predict_s:.2f} s; efficiency matmul {p.efficiency['matmul']:.3f}, "
        f"HBM {p.efficiency['hbm']:.2f}"
        + ("" if p.calibrated else f" ({p.calibrated_on}'s: this chip has no calibration run)"),
    ]
    for line in lines:
        console.print(line, highlight=False)
    links = Table(title="exposed communication per axis and link")
    for column in ("axes on link", "exposed"):
        links.add_column(column)
    for name, seconds in sorted(p.exposed_by_link.items(), key=lambda kv: -kv[1]):
        links.add_row(name, format_seconds(seconds))
    console.print(links)
    ops = Table(title="ten most expensive ops")
    xla = p.xla_compute_s is not None
    for column in ("op", "runs", "time", *(["compiler's"] if xla else []), "bound", "TFLOP/run", "GB/run"):
        ops.add_column(column)
    for o in p.top_ops:
        theirs = [format_seconds(o["xla_seconds"]) if o["xla_seconds"] is not None else "-"] if xla else []
        ops.add_row(
            o["op"][-70:],
            str(o["runs"]),
            format_seconds(o["seconds"]),
            *theirs,
            o["bound"],
            f"{o['flops'] / 1e12:.2f}",
            f"{o['bytes'] / 1e9:.2f}",
        )
    console.print(ops)


def _compilers_own(p) -> str:
    """The compiler's own estimate of the same ops (`lab.predict.xla_estimate`), beside the lab's."""
    if p.target.startswith("gpu:"):
        return (
            f"XLA's own       compute {format_seconds(p.xla_compute_s)}, collectives {format_seconds(p.xla_comm_s)} "
            "(its GPU cost model per fusion, speed of light per collective, each whole), beside the lab's "
            f"{format_seconds(p.compute_s)} and {format_seconds(p.comm_s)}"
        )
    if not p.xla_base_s:
        return "libtpu's own    its schedule names none of the ops the lab priced"
    return (
        f"libtpu's own    {format_seconds(p.xla_compute_s)} for the ops the lab prices at "
        f"{format_seconds(p.xla_base_s)} ({p.xla_compute_s / p.xla_base_s:.2f}x; {p.xla_unpriced} ops it formed "
        "after scheduling unnamed), "
        f"synchronous collectives {format_seconds(p.xla_comm_s)}: its latency-hiding scheduler's cost model, op by op"
    )


def _synchronous(exposed: dict[str, float]) -> str:
    """The FSDP collectives libtpu ran synchronously every time; the flags MaxText's recipes overlap gathers with."""
    kinds = " and ".join(f"{kind} ({format_seconds(seconds)} exposed)" for kind, seconds in exposed.items())
    line = f"synchronous     every FSDP {kinds}: libtpu's schedule, with these flags, hides none of it"
    if "all-gather" in exposed:
        line += f'; MaxText\'s recipes overlap the gathers with --libtpu-flags "{CF_FOR_ALL_GATHER}"'
    return line
