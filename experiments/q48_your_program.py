"""Your own program: every collective of a user's training step, where it comes from and why it is there.

Question #48 asks what to look at first when a training system misbehaves;
for a sharded step the first look is *what the compiler made it
communicate*. This page points `lab inspect --fn` at a program the lab did
not write, `examples/optax_train_step.py`, written the way users write it:
an embedding, a weight-normalized MLP and a tied output layer, AdamW from
optax, the weights and both moments sharded over ``fsdp``, the batch over
``data``, nothing else said, the rest left to XLA's partitioner (Auto axes).

`lab.explanation.explain` compiles it on this target and, compile-only, for a TPU
topology, and for every collective says which line of the example made it,
the JAX op, and why it is there, by following its data in the optimized HLO
(`lab.hlo.attribution`): a parameter moved, a gradient reduced, an input
resharded, activations moved; whatever nothing explains, or a sum the layouts
force on anything else, is a *surprise*. The example plants one: the column
norm of ``w_up`` sums over the rows its declared sharding splits over ``fsdp``.

#49 is in the same table: "ZeRO-3 / FSDP all-gather each weight before its
matmul". With the shardings on the arguments only, the partitioner is free to
move activations instead, and the page counts which it chose.

On the TPU topology the same step is then priced as `lab predict --fn` prices
it (`lab.predict.program`): step, exposed communication per link, memory per
chip; the FLOPs its compiled matmuls run are checked against the example's
own sizes, 6 x tokens x (2 x d_model x d_ff + d_model x vocab).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import jax

from experiments import kit
from lab.explanation import program
from lab.explanation.explain import Explanation, explain_inspection
from lab.explanation.origins import compile_with_origins
from lab.hlo.attribution import ORIGINS
from lab.mesh import MeshSpec
from lab.predict.command import Predict
from lab.predict.program import predict_program
from lab.provenance import Setup
from lab.report import Result, Table
from lab.targets.devices import DEFAULT_TARGET, devices_for
from lab.units import format_bytes, format_seconds
from lab.verdict import Check, Claim, check

QUESTION = "#48"
UNTIMED = True  # reads what XLA compiled, no clock: lab report may measure it beside another page
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
MARKER = "the surprise"  # the comment on the example's line that plants it


@dataclass(frozen=True)
class Config:
    target: str = DEFAULT_TARGET
    """where to compile (cpu:N, gpu, tpu)"""
    program: str = "optax_train_step.py:train_step"
    """the example to explain, FILE:NAME inside examples/"""
    mesh: str = "data=2,fsdp=4"
    tpu_topology: str = "v5e:2x4"
    """also compile it for this TPU topology (compile-only); empty to skip"""


@dataclass(frozen=True)
class Row:
    """One collective as the explanation gave it."""

    kind: str
    axes: tuple[str, ...] | None
    dtype: str
    size_bytes: int
    count: int | None
    line: int | None  # the line of the example it came from (None: from elsewhere)
    op_name: str
    origin: str
    name: str | None
    why: str
    link: str | None
    predicted_s: float | None
    chain: str = ""  # the call chain in the example, innermost first: "optax_train_step.py:37 loss_fn <- ..."
    cause: str = ""  # the op or annotation that decided it (lab.explanation.causes), "" when none is named


@dataclass(frozen=True)
class Declared:
    """One argument of the step: JAX's name for it and its declared (global) shape."""

    name: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Compiled:
    """The example compiled on one target, explained."""

    target: str
    rows: tuple[Row, ...]
    inputs: tuple[Declared, ...]  # what the lab read from the module
    memory_bytes: int


@dataclass(frozen=True)
class Priced:
    """The example's step priced compile-only, as `lab predict --fn` prices it."""

    target: str
    step_s: float
    compute_s: float
    exposed_comm_s: float
    exposed_by_link: dict[str, float]
    hardware_flops_per_step: float  # what the compiled matmuls run, all chips
    memory_bytes: int
    hbm_bytes: int


@dataclass(frozen=True)
class Observations:
    setup: Setup
    declared: tuple[Declared, ...]  # the step's arguments, read from the example's own pytrees
    parameters: tuple[str, ...]  # the example's parameter names, from its params tree
    planted_line: int  # the line of the example that carries MARKER
    here: Compiled
    sizes: dict[str, int]  # the example's own D_MODEL, D_FF, VOCAB, BATCH, SEQ
    tpu: Compiled | None = None
    priced: Priced | None = None
    tpu_unavailable: kit.Unavailable | None = None


# --------------------------------------------------------------------------- measure


def measure(config: Config) -> Observations:
    file = EXAMPLES / config.program.split(":")[0]
    spec = f"{EXAMPLES / config.program}"
    builder = program.load(spec)
    devices = devices_for(config.target)
    mesh = MeshSpec.parse(config.mesh).build(devices, explicit=False)
    fn, args = program.build(builder, mesh, spec)
    here = _compiled(fn, args, mesh, config.target, file)
    tpu = kit.tpu_chips(config.tpu_topology)
    compiled_tpu = priced = None
    if isinstance(tpu, kit.TpuChips):
        tpu_mesh = MeshSpec.parse(config.mesh).build(tpu.devices, explicit=False)
        tpu_fn, tpu_args = program.build(builder, tpu_mesh, spec, compile_only=True)
        compiled_tpu = _compiled(tpu_fn, tpu_args, tpu_mesh, tpu.target, file)
        priced = _priced(predict_program(Predict(fn=spec, target=tpu.target, mesh=config.mesh)))
    return Observations(
        setup=Setup.of(config.target, devices, config.mesh),
        declared=_declared(args),
        parameters=tuple(jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(args[0])[0]),
        planted_line=next(n for n, line in enumerate(file.read_text().splitlines(), 1) if MARKER in line),
        here=here,
        sizes={name: builder.__globals__[name] for name in ("D_MODEL", "D_FF", "VOCAB", "BATCH", "SEQ")},
        tpu=compiled_tpu,
        priced=priced,
        tpu_unavailable=tpu if isinstance(tpu, kit.Unavailable) else None,
    )


def _compiled(fn, args, mesh, target: str, file: Path) -> Compiled:
    with jax.set_mesh(mesh):
        found, propagation, _, names = compile_with_origins(fn, *args, mesh=mesh)
    explained = explain_inspection(found, mesh, target=target, propagation=propagation, names=names)
    return Compiled(
        target,
        _rows(explained, file),
        tuple(Declared(i.name, i.global_shape) for i in explained.inputs),
        explained.memory.get("peak_memory", 0) or sum(explained.memory.values()),
    )


def _priced(p) -> Priced:
    return Priced(
        p.target,
        p.step_s,
        p.compute_s,
        p.exposed_comm_s,
        p.exposed_by_link,
        p.hardware_flops_per_step,
        p.memory_bytes,
        p.hbm_bytes,
    )


def _rows(explained: Explanation, file: Path) -> tuple[Row, ...]:
    rows = []
    for e in explained.collectives:
        c = e.collective
        line = e.source.line if e.source is not None and Path(e.source.file) == file else None
        rows.append(
            Row(
                c.kind,
                c.axes,
                ",".join(c.dtypes),
                c.size_bytes,
                c.repeats,
                line,
                e.op,
                e.origin.kind,
                e.origin.name,
                e.origin.why,
                e.link,
                e.predicted_s,
                " <- ".join(f"{Path(f.file).name}:{f.line} {f.function}" for f in e.stack),
                f"{e.cause.kind} ({e.cause.op}): {e.cause.why}" if e.cause else "",
            )
        )
    return tuple(rows)


def _declared(args) -> tuple[Declared, ...]:
    """The step's arguments as JAX names them in the module: params['w_up'], opt_state[0].mu['embed'], tokens."""
    names = ("params", "opt_state", "tokens", "targets")
    found = []
    for name, arg in zip(names, args):
        for path, leaf in jax.tree_util.tree_flatten_with_path(arg)[0]:
            found.append(Declared(f"{name}{jax.tree_util.keystr(path)}", tuple(leaf.shape)))
    return tuple(found)


# --------------------------------------------------------------------------- judge


def judge(obs: Observations, config: Config) -> Result:
    checks = _checks(obs.here, obs) + (_checks(obs.tpu, obs) if obs.tpu else []) + _lines_check(obs)
    tables = [_table(obs.here), _origins_table(obs)]
    if obs.tpu:
        tables.append(_table(obs.tpu))
    if obs.priced:
        checks.append(_flops_check(obs.priced, obs.sizes))
        tables.append(_priced_table(obs.priced))
    if obs.tpu_unavailable:
        tables.append(obs.tpu_unavailable.table())
    return Result(
        summary=_summary(obs),
        theory=THEORY,
        tables=tables,
        checks=checks,
        claims=_claims(obs),
        notes=[NOTE],
    )


def _checks(compiled: Compiled, obs: Observations) -> list[Check]:
    at = compiled.target
    rows = compiled.rows
    surprises = [r for r in rows if r.origin == "surprise"]
    gradients = {n for r in rows if r.origin == "gradient" for n in (r.name or "").split(", ")}
    checks = [
        check(f"{at}: surprises (the one planted)", 1, len(surprises), kind="exact"),
        check(
            f"{at}: the surprise's line is the planted norm's",
            obs.planted_line,
            surprises[0].line if surprises else "none",
            kind="exact",
        ),
        check(
            f"{at}: weights whose gradient is reduced",
            ", ".join(f"params{p}" for p in sorted(obs.parameters)),
            ", ".join(sorted(gradients)),
            kind="exact",
        ),
        check(
            f"{at}: inputs read from the module (names, declared shapes)",
            _inputs_text(obs.declared),
            _inputs_text(compiled.inputs),
            kind="exact",
        ),
    ]
    if compiled.target.startswith("tpu:"):
        links = sorted({r.link or "?" for r in rows})
        checks.append(check(f"{at}: links the collectives cross", "ici", ",".join(links), kind="exact"))
    return checks


def _flops_check(priced: Priced, sizes: dict[str, int]) -> Check:
    """Every matmul of the step three times (forward, the input's gradient, the weight's): 2·tokens·m·n each."""
    tokens = sizes["BATCH"] * sizes["SEQ"]
    d, f, v = sizes["D_MODEL"], sizes["D_FF"], sizes["VOCAB"]
    return check(
        f"{priced.target}: matmul FLOPs a step, priced by lab predict --fn = 6·tokens·(2·d_model·d_ff + d_model·vocab)",
        6 * tokens * (2 * d * f + d * v),
        priced.hardware_flops_per_step,
        kind="exact",
    )


def _priced_table(priced: Priced) -> Table:
    links = "; ".join(f"{link} {format_seconds(s)}" for link, s in sorted(priced.exposed_by_link.items()))
    return Table(
        f"the step priced on {priced.target} (lab predict --fn, compile-only)",
        ["step", "compute", "exposed communication", "exposed, per axis and link", "matmul FLOPs", "memory per chip"],
        [
            [
                format_seconds(priced.step_s),
                format_seconds(priced.compute_s),
                format_seconds(priced.exposed_comm_s),
                links or "-",
                f"{priced.hardware_flops_per_step:.4g}",
                f"{format_bytes(priced.memory_bytes)} of {format_bytes(priced.hbm_bytes)}",
            ]
        ],
    )


def _lines_check(obs: Observations) -> list[Check]:
    """Both compilers trace their collectives to the same lines of the example (different partitioners, one source)."""
    if obs.tpu is None:
        return []
    return [
        check(
            f"lines of the example that made collectives: {obs.here.target} and {obs.tpu.target}",
            _lines(obs.here),
            _lines(obs.tpu),
            kind="exact",
        )
    ]


def _lines(compiled: Compiled) -> str:
    return ", ".join(
        str(line) if line is not None else "outside" for line in sorted({r.line or 0 for r in compiled.rows})
    )


def _inputs_text(inputs: tuple[Declared, ...]) -> str:
    return "; ".join(f"{i.name} {list(i.shape)}" for i in sorted(inputs, key=lambda i: i.name))


def _moved_bytes(compiled: Compiled, origin: str) -> int:
    return sum(r.size_bytes * (r.count or 1) for r in compiled.rows if r.origin == origin)


def _claims(obs: Observations) -> list[Claim]:
    claims = []
    for compiled in (obs.here, obs.tpu):
        if compiled is None:
            continue
        weights, activations = _moved_bytes(compiled, "parameter"), _moved_bytes(compiled, "activation")
        claims.append(
            Claim(
                f"#49 on {compiled.target}: FSDP all-gathers each weight before its matmul (weights, not activations, "
                "are what moves over fsdp)",
                "confirmed" if weights > activations else "refuted",
                f"with only the arguments' shardings given, XLA moved {format_bytes(weights)} of weights and "
                f"{format_bytes(activations)} of activations per step over its axes",
            )
        )
    return claims


def _table(compiled: Compiled) -> Table:
    return Table(
        f"every collective of the step on {compiled.target}, surprises first",
        ["kind", "axes", "dtype", "S/device", "runs", "call chain", "op", "origin", "link", "predicted", "why"],
        [
            [
                r.kind,
                ",".join(r.axes) if r.axes is not None else "?",
                r.dtype,
                format_bytes(r.size_bytes),
                r.count if r.count is not None else "?",
                r.chain or (r.line if r.line is not None else "-"),
                r.op_name,
                f"{r.origin} {r.name}" if r.name else r.origin,
                r.link or "?",
                f"{r.predicted_s * 1e6:.1f} us" if r.predicted_s else "-",
                f"{r.why}; decided by {r.cause}" if r.cause else r.why,
            ]
            for r in compiled.rows
        ],
        note=f"memory per device: {format_bytes(compiled.memory_bytes)} at its peak",
    )


def _origins_table(obs: Observations) -> Table:
    compiled = [c for c in (obs.here, obs.tpu) if c is not None]
    return Table(
        "bytes moved per step, by why they move",
        ["origin", *(c.target for c in compiled)],
        [[o, *(format_bytes(_moved_bytes(c, o)) for c in compiled)] for o in ORIGINS],
    )


def _summary(obs: Observations) -> str:
    here = obs.here
    surprise = next((r for r in here.rows if r.origin == "surprise"), None)
    where = f"line {surprise.line} ({surprise.kind} over {','.join(surprise.axes or ())})" if surprise else "none"
    return (
        f"The example's step compiles to {len(here.rows)} collectives on {here.target}"
        + (f" and {len(obs.tpu.rows)} for {obs.tpu.target}" if obs.tpu else "")
        + f"; each is traced to a line of the example and a reason. The one surprise is at {where}, the "
        f"planted norm. Weights moved {format_bytes(_moved_bytes(here, 'parameter'))} and activations "
        f"{format_bytes(_moved_bytes(here, 'activation'))} per step on {here.target}: with only the arguments' "
        "shardings, the partitioner chose what to move."
        + (
            f" Priced on {obs.priced.target} as lab predict --fn prices it: a step of "
            f"{format_seconds(obs.priced.step_s)}, {format_seconds(obs.priced.exposed_comm_s)} of it waiting on "
            "communication."
            if obs.priced
            else ""
        )
    )


THEORY = """\
`lab inspect --fn FILE.py:NAME` calls `NAME(mesh)` for `(fn, args)`, compiles `fn(*args)` for the target (arguments
may be `jax.ShapeDtypeStruct`, so nothing is allocated) and explains every collective in the optimized HLO:

- *where*: the stack frame XLA recorded for the instruction (`stack_frame_id` and the module's frame tables), the
  innermost frame outside installed libraries, and the JAX op name;
- *why* (`lab.hlo.attribution`), by following its operand back through data movement (copies, converts, slices,
  loop carries, other collectives) to the entry computation's parameters, and its result forward through
  elementwise work to the update of a weight of the same size:
  **parameter** (a weight moved), **gradient** (the reduction of a weight's gradient), **input** (an input whose
  declared sharding is not the one the computation wants), **activation** (a value whose shape carries the batch,
  or a scalar: the loss), and **surprise** for the rest;
- *cost*: the link its mesh axes use on the target (ICI/DCN on TPUs, NVLink/InfiniBand on GPUs) and the lab's
  closed form for that link (`lab.targets.topology`, `lab.theory`).

The checks compare what the explanation read from the compiled module with what the example declares, read from
its own Python objects: the argument names and shapes from its pytrees, the weights from its params tree, the
planted line from its source text.
"""

NOTE = (
    "The example is `examples/optax_train_step.py`; `lab inspect --fn examples/optax_train_step.py:train_step "
    "--mesh data=2,fsdp=4` prints the same table in a terminal, `--json` as one object, and `lab inspect --dump DIR` "
    "the same from a folder XLA_FLAGS=--xla_dump_to=DIR wrote. On emulated CPU devices no time is predicted (they "
    "share this host); on the TPU topology each collective is priced on the ICI links its axes use."
)
