"""Layout plans: every way to lay a model on a pod, ranked, and why the winner beats plain FSDP.

Question #50 (TP + FSDP against a very large FSDP) is answered again for each
model and pod; `lab plan` answers it by search. For each case it enumerates
every factorisation of the chips over ``data, stage, fsdp, expert, tensor``
that the model allows, with the axis that crosses slices, micro-batches for a
pipeline and three remat policies (`lab.plan.space`); prunes what does not fit
by the closed-form memory model and ranks the rest by the closed-form step
time (`lab.plan.closed_form`); and compares the closed form with the compiled
prediction of `lab predict` (`lab.plan.compiled`: the whole step compiled by
the TPU compiler for the compile-only pod, priced op by op at the chip's peak).

Each case's best layouts by the closed form are compiled at full size (20 to
45 s each on a two-core machine) and held to the compiled prediction: the
level within 10%, and the order wherever two compiled steps differ by more
than 2% (what `lab plan` needs of a closed form that prunes before it
compiles). Every compile passes MaxText's collective-overlap flags (its
recipes' ``DATA_PARALLEL_OVERLAP`` and ``CF_FOR_ALL_GATHER``): under
libtpu's defaults v6e runs the FSDP gathers synchronously, a schedule no
recipe asks for. The gradients' reduce-scatters stay synchronous with them,
except on TPU7x; the closed form hides what libtpu's probe compile
(`lab.plan.overlap`) says it runs asynchronously, and nothing else. A wider spread of layouts, pipelines among them, is
compiled on a *proxy*: the same chip generation and slice count, an 8-chip
pod, and the model shrunk (its width, depth and vocabulary, keeping its GQA
ratio and gated MLP) until one compile takes seconds; the closed form is
evaluated for exactly that proxy, so the two sides describe the same
program, and at that size fixed costs the closed form leaves out weigh more.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass, replace
from functools import partial

from matplotlib.figure import Figure

from lab.plan.closed_form import Estimate
from lab.plan.overlap import overlaps
from lab.plan.rank import closed_form_plan, differing_terms, frontier, spearman, spread
from lab.plan.space import Problem
from lab.predict import calibration
from lab.predict.spec import parse_model
from lab.progress import track
from lab.provenance import Setup
from lab.report import Result, Table
from lab.targets.devices import parse_target, topology_shape
from lab.targets.hardware import profile
from lab.units import format_bytes
from lab.verdict import Check, Claim, check

QUESTION = "#50"
COMPILE_ONLY = True  # compiles for TPU topologies through libtpu, whatever target `lab report` uses
HEAVY = "about 12 minutes here: twelve full-size TPU compiles (Llama 3 8B and 70B) and thirty proxy compiles"

STEP_RTOL = 0.5
STEP_BASIS = (
    "both sides price each op at its roofline with the chip's constants; the closed form prices the op classes the "
    "model's shapes imply (matmuls, norms, activations, softmax, the loss, the saved stacks, AdamW), the compiled "
    "prediction the fusions XLA emitted, with the copies, casts and layout changes the closed form does not know: "
    "within 50% says the closed form has the step's main terms, not its last ones"
)
MEMORY_RTOL = 0.35
MEMORY_BASIS = (
    "the closed form counts model states, saved activations and the largest transient; XLA's buffer assignment "
    "adds fusion temporaries, layout copies and the loss chunk's buffers and reuses others, none of which it "
    "models; 35% is the share such buffers reach at these sizes, where the states are small"
)
BYTES_RTOL = 0.25
BYTES_BASIS = (
    "the closed form counts the weights, gradients and activations the lab's rules move on each axis; XLA also "
    "moves small arrays (the loss, the gradient norm, norm scales), may combine gathers of a layer's weights or "
    "keep the unembedding gathered between the forward and the recomputed loss: a quarter either way"
)
FULL_STEP_RTOL = 0.10
FULL_STEP_BASIS = (
    "at full size both sides price the same program at the same constants: the closed form from the model's shapes "
    "and the pod's links, the compiled prediction from the fusions and the schedule libtpu emitted; issue #26's bar "
    "for a closed form that ranks before compiling is 10%"
)
ORDER_GAP = 0.02
ORDER_BASIS = (
    "every pair of full-size layouts whose compiled steps differ by more than 2% must be ordered alike by the "
    "closed form (issue #26: nearer pairs are ties the planner may order either way)"
)
RHO_MIN = 0.8
RHO_BASIS = (
    "Spearman's rho over the compiled layouts of a case; the closed form is for ordering layouts, so it passes when "
    "it orders them as the compiler does but for near ties (0.8, the bar issue #17 set: a planner whose closed form "
    "orders layouts less well than that cannot be trusted to prune before compiling)"
)


@dataclass(frozen=True)
class Case:
    """One planning problem at full size, and the proxy whose compiles fit the page's budget."""

    name: str
    model: str
    target: str  # one slice, tpu:<gen>:<topology>
    slices: int
    sequences: int
    seq: int
    proxy_model: str
    proxy_target: str
    proxy_slices: int
    proxy_sequences: int
    proxy_seq: int


PROXY = "layers=4,d_model=128,heads=8,kv_heads=2,head_dim=16,d_ff=448,vocab=1024,mlp=swiglu"


@dataclass(frozen=True)
class Config:
    cases: tuple[Case, ...] = (
        Case("llama3-8b on 256 v5e", "llama3-8b", "tpu:v5e:16x16", 1, 256, 4096, PROXY, "tpu:v5e:2x4", 1, 8, 256),
        Case("llama3-70b on 256 v6e", "llama3-70b", "tpu:v6e:16x16", 1, 256, 4096, PROXY, "tpu:v6e:2x4", 1, 8, 256),
        Case(
            "llama3-8b on 4 slices of 256 v5e (DCN)",
            "llama3-8b",
            "tpu:v5e:16x16",
            4,
            1024,
            4096,
            PROXY,
            "tpu:v5e:2x2",
            2,
            8,
            256,
        ),
    )
    """the full-size problems and their compiled proxies"""
    compiled_per_case: int = 10
    """proxy layouts compiled per case, spread over the proxy's closed-form ranking"""
    full_size: int = 4
    """the closed form's best compilable layouts of each case compiled at full size (0: none)"""
    libtpu_flags: str = f"{calibration.DATA_PARALLEL_OVERLAP} {calibration.CF_FOR_ALL_GATHER}"
    """the compiles' libtpu flags: MaxText's collective-overlap groups"""


@dataclass(frozen=True)
class Row:
    """One layout's closed form."""

    layout: str
    slices_axis: str
    remat: str
    micro_batches: int
    step_s: float
    compute_s: float
    bubble_s: float
    mfu: float
    memory_bytes: float
    exposed: dict[str, float]
    bytes: dict[str, float]

    @classmethod
    def of(cls, e: Estimate) -> Row:
        lay = e.layout
        return cls(
            str(lay.mesh),
            lay.slices_axis or "",
            lay.remat,
            lay.micro_batches,
            e.step_s,
            e.compute_s,
            e.bubble_s,
            e.mfu,
            e.memory.total,
            {a.axis: a.exposed_s for a in e.axes},
            {a.axis: a.size_bytes for a in e.axes},
        )


@dataclass(frozen=True)
class Compiled:
    """One layout's closed form next to its compiled prediction."""

    closed: Row
    step_s: float
    compute_s: float  # every op's time, the pipeline's ticks included
    memory_bytes: float
    exposed_s: float
    bytes: dict[str, float]  # mesh axes -> S x runs
    compile_s: float


@dataclass(frozen=True)
class Term:
    against: str
    term: str
    winner: float
    other: float


@dataclass(frozen=True)
class Planned:
    case: str
    enumerated: int
    fitting: int
    ranked_s: float
    hbm_bytes: float
    top: tuple[Row, ...]
    pure_fsdp: Row | None
    closest: Row | None
    terms: tuple[Term, ...]
    points: tuple[tuple[float, float, str], ...]  # every layout: memory, step, remat
    frontier: tuple[tuple[float, float], ...]
    full_size: tuple[Compiled, ...]
    proxy: tuple[Compiled, ...]
    proxy_not_compiled: tuple[str, ...]


@dataclass(frozen=True)
class Observations:
    setup: Setup
    cases: tuple[Planned, ...]
    overlapped: tuple[tuple[str, bool, bool], ...] = ()  # per generation: libtpu runs the gathers, the scatters async


# --------------------------------------------------------------------------- measure


def _problem(model: str, target: str, slices: int, sequences: int, seq: int) -> Problem:
    """The case as `lab plan` poses it, FSDP's collectives overlapping where libtpu, with the page's flags, says."""
    pod = parse_target(target)
    spec = replace(parse_model(model), seq=seq, attention="flash")
    chip, shape = profile(pod.generation), topology_shape(pod.topology)
    return Problem(spec, sequences, chip, shape, pod.topology, slices, overlaps(pod.generation))


def _compiled(problem: Problem, layouts, plan) -> tuple[list[Compiled], list[str]]:
    # local: compiling imports lab predict's training step and starts libtpu
    from lab.plan.compiled import compilable, compile_layout

    rows = {(c.layout.mesh, c.layout.slices_axis, c.layout.remat, c.layout.micro_batches): c for c in plan.candidates}
    done, skipped = [], []
    for layout in layouts:
        result = compilable(problem, layout) or compile_layout(problem, layout)
        if isinstance(result, str):
            skipped.append(f"{layout} {layout.remat}: {result}")
            continue
        e = rows[(layout.mesh, layout.slices_axis, layout.remat, layout.micro_batches)].estimate
        done.append(
            Compiled(
                Row.of(e),
                result.step_s,
                result.compute_s,
                result.memory_bytes,
                result.exposed_s,
                {k: v["bytes"] for k, v in result.axes.items()},
                result.compile_s,
            )
        )
    return done, skipped


def measure(config: Config) -> Observations:
    # local: libtpu must see lab predict's flags before the first topology starts it
    from lab.plan.compiled import compilable
    from lab.targets import libtpu

    libtpu.prepare(config.libtpu_flags)
    planned = []
    for case in track(config.cases, "cases"):
        problem = _problem(case.model, case.target, case.slices, case.sequences, case.seq)
        plan = closed_form_plan(problem)
        top = [c.estimate for c in plan.candidates[:10]]
        terms = []
        if plan.candidates:
            winner = plan.candidates[0].estimate
            others = [("runner-up", c.estimate) for c in plan.candidates[1:2]]
            if plan.pure_fsdp is not None and plan.pure_fsdp.layout != winner.layout:
                others.append(("pure FSDP", plan.pure_fsdp))
            for name, other in others:
                label = f"{name}: {other.layout} {other.layout.remat}"
                terms += [Term(label, t, a, b) for t, a, b in differing_terms(winner, other)]
        full_layouts = [c.layout for c in plan.candidates if not compilable(problem, c.layout)]
        full, _ = _compiled(problem, full_layouts[: config.full_size], plan)
        proxy_problem = _problem(
            case.proxy_model, case.proxy_target, case.proxy_slices, case.proxy_sequences, case.proxy_seq
        )
        proxy_plan = closed_form_plan(proxy_problem)
        compilable_plan = replace(
            proxy_plan, candidates=tuple(c for c in proxy_plan.candidates if not compilable(proxy_problem, c.layout))
        )
        proxy, skipped = _compiled(proxy_problem, spread(compilable_plan, config.compiled_per_case), proxy_plan)
        planned.append(
            Planned(
                case.name,
                plan.enumerated,
                len(plan.candidates),
                plan.ranked_s,
                problem.chip.hbm_bytes,
                tuple(Row.of(e) for e in top),
                Row.of(plan.pure_fsdp) if plan.pure_fsdp else None,
                Row.of(plan.closest) if plan.closest else None,
                tuple(terms),
                tuple((e.memory.total, e.step_s, e.layout.remat) for e in plan.everything),
                tuple((e.memory.total, e.step_s) for e in frontier(plan.everything)),
                tuple(full),
                tuple(proxy),
                tuple(skipped),
            )
        )
    generations = dict.fromkeys(parse_target(c.target).generation for c in config.cases)
    overlapped = tuple((g, *astuple(overlaps(g))) for g in generations)
    return Observations(Setup("compile-only TPU pods", "", "enumerated"), tuple(planned), overlapped)


# --------------------------------------------------------------------------- judge


def judge(obs: Observations, config: Config) -> Result:
    checks = [c for p in obs.cases for c in _checks(p)]
    return Result(
        summary=_summary(obs),
        theory=THEORY,
        tables=[t for p in obs.cases for t in _tables(p)],
        checks=checks,
        claims=_claims(obs),
        plots={
            **{f"plan_{i}": partial(_plot, p) for i, p in enumerate(obs.cases)},
            "closed_vs_compiled": partial(_agreement_plot, obs),
        },
        notes=_notes(obs, config),
    )


THEORY = r"""
A layout is mesh sizes for `data, stage, fsdp, expert, tensor` (product = chips), the axis across slices, the
pipeline's micro-batches M and a remat policy. Per chip (`lab.plan.closed_form`):

* **memory** = 16 bytes x parameters / (fsdp · tensor · stage [· expert]) (bf16 weights and gradients, fp32 master
  and Adam moments: the ZeRO paper's 2 + 2 + 12) + saved activations (per layer: the block input for `full`, every
  matmul output for `minimal`, everything for `none`; x L / stage x the micro-batches a GPipe pipeline holds) + the
  largest transient (one layer's gathered weights twice and its backward working set, or the loss's logits chunk
  with the gathered unembedding and its gradient);
* **step** = compute + the bubble (P - 1)/M of the pipelined part + exposed communication. Compute is every op at
  its roofline, max(FLOPs / (peak x e_matmul), bytes / (HBM bandwidth x e_hbm)) with the chip's constants (lab
  predict's): the matmuls (forward once, backward twice, plus what remat recomputes, which under `full` is all but
  the out-projection and W_out; the flash kernel's tiles on and below the causal diagonal, its backward seven
  products of the scores' size against a dot's four, each of its three kernels against the bytes of its operands
  and results, the softmax statistics among them as fp32 rows of 128 lanes, whichever is longer: on the proxies'
  16-wide heads the bytes; the one-hot embedding and the head run whole on every tensor and stage device) and the
  HBM-bound ops (norms, residual adds, rotary, the activation, XLA attention's softmax, the flash backward's
  broadcasts of its statistics, the saved activations written and read back, the loss's fp32 logits, and AdamW
  reading and writing 16 bytes of state per stored parameter). Exposed communication: fsdp's per-layer gathers and
  reduce-scatters beyond the layer's compute where libtpu runs them asynchronously, else whole (and over every
  chip of a slice libtpu compiles a reduce-scatter as a synchronous all-reduce of the whole gradient, and across
  slices the reduce-scatter within a slice waits: exposed whole), the vocabulary tables' gathers and reductions,
  data's gradient all-reduce, tensor's four (six with
  `full`) activation all-reduces per layer, stage's permutes, expert's all-to-alls, each priced on its torus links
  (`lab.targets.topology`) and, across slices, on DCN.

Where the two orders disagree, the page swaps one term of the closed form for the compiler's (compute with the
bubble, or the exposed communication) and ranks again: the swap that restores the compiler's order names the term
that lowers the correlation.

MFU = 6·N'·tokens + 12·L·H·K·S·tokens over chips x peak x step (lab predict's convention: the chip's peak, not
the calibrated rate).
"""


def _checks(p: Planned) -> list[Check]:
    checks = []
    for c in p.full_size:
        checks += _level(f"{p.case}: {_layout(c.closed)} {c.closed.remat}", c, 4, FULL_STEP_RTOL, FULL_STEP_BASIS)
    pairs = _apart(p.full_size)
    if pairs:
        checks.append(
            check(
                f"{p.case}: pairs of full-size layouts more than 2% apart compiled, ordered alike by the closed form",
                len(pairs),
                sum(_alike(a, b) for a, b in pairs),
                kind="model",
                basis=ORDER_BASIS,
            )
        )
    for c in p.proxy:
        label = f"{p.case} (proxy): {c.closed.layout} {c.closed.remat}"
        checks += _level(label, c, 7, STEP_RTOL, STEP_BASIS)
        for axis, size in sorted(c.closed.bytes.items()):
            checks.append(
                check(
                    f"{label}: bytes over {axis}",
                    round(size),
                    round(c.bytes.get(axis, 0.0)),
                    kind="model",
                    rtol=BYTES_RTOL,
                    basis=BYTES_BASIS,
                )
            )
    rho = _rho(p.proxy)
    if rho is not None:
        checks.append(
            check(
                f"{p.case} (proxy): Spearman rho, closed form against compiled, {len(p.proxy)} layouts",
                RHO_MIN,
                round(rho, 3),
                kind="model",
                relation=">=",
                rtol=0.0,
                basis=RHO_BASIS,
            )
        )
    return checks


def _level(label: str, c: Compiled, digits: int, step_rtol: float, step_basis: str) -> list[Check]:
    """The closed form's step (to `digits` decimals) and memory per chip against the compiled prediction's."""
    return [
        check(
            f"{label}: step s",
            round(c.closed.step_s, digits),
            round(c.step_s, digits),
            kind="model",
            rtol=step_rtol,
            basis=step_basis,
        ),
        check(
            f"{label}: memory per chip bytes",
            round(c.closed.memory_bytes),
            round(c.memory_bytes),
            kind="model",
            rtol=MEMORY_RTOL,
            basis=MEMORY_BASIS,
        ),
    ]


def _apart(compiled) -> list[tuple[Compiled, Compiled]]:
    """The pairs whose compiled steps differ by more than ORDER_GAP of the shorter."""
    return [(a, b) for i, a in enumerate(compiled) for b in compiled[i + 1 :] if _gap(a.step_s, b.step_s) > ORDER_GAP]


def _gap(a: float, b: float) -> float:
    return abs(a - b) / min(a, b)


def _alike(a: Compiled, b: Compiled) -> bool:
    return (a.closed.step_s < b.closed.step_s) == (a.step_s < b.step_s)


def _layout(r: Row) -> str:
    return r.layout + (f" (DCN: {r.slices_axis})" if r.slices_axis else "")


def _rho(compiled) -> float | None:
    if len(compiled) < 3:
        return None
    return spearman([c.closed.step_s for c in compiled], [c.step_s for c in compiled])


# the closed form's step with one term taken from the compiled prediction instead
SWAPS = {
    "compute (with the bubble)": lambda c: c.compute_s + sum(c.closed.exposed.values()),
    "exposed communication": lambda c: c.closed.compute_s + c.closed.bubble_s + c.exposed_s,
}


def _swapped(compiled) -> dict[str, float]:
    """Spearman's rho against the compiled order when one term of the closed form is the compiler's."""
    if len(compiled) < 3:
        return {}
    order = [c.step_s for c in compiled]
    return {term: spearman([swap(c) for c in compiled], order) for term, swap in SWAPS.items()}


def _culprit(compiled) -> tuple[str, float] | None:
    """The term whose swap restores the compiler's order best, and the rho it reaches; None when none helps."""
    rho, swapped = _rho(compiled), _swapped(compiled)
    if rho is None or not swapped:
        return None
    term, best = max(swapped.items(), key=lambda kv: kv[1])
    return (term, best) if best > rho else None


def _ms(s: float) -> str:
    return f"{s * 1e3:.2f} ms" if s < 1 else f"{s:.3f} s"


def _row(r: Row) -> list:
    exposed = ", ".join(f"{a} {_ms(s)}" for a, s in r.exposed.items() if s > 0) or "-"
    return [
        _layout(r),
        r.remat,
        r.micro_batches,
        _ms(r.step_s),
        f"{r.mfu:.1%}",
        format_bytes(r.memory_bytes),
        exposed,
    ]


def _tables(p: Planned) -> list[Table]:
    head = ["layout", "remat", "M", "step (closed form)", "MFU", "memory per chip", "exposed per axis"]
    tables = [
        Table(
            f"{p.case}: the ten best of {p.fitting} fitting layouts ({p.enumerated} enumerated, ranked in "
            f"{p.ranked_s:.2f} s)",
            ["#", *head],
            [[i, *_row(r)] for i, r in enumerate(p.top, 1)]
            + ([["pure FSDP", *_row(p.pure_fsdp)]] if p.pure_fsdp else []),
        )
    ]
    if p.terms:
        tables.append(
            Table(
                f"{p.case}: where the winner differs from the runner-up and from pure FSDP",
                ["against", "term", "winner", "other"],
                [
                    [
                        t.against,
                        t.term,
                        format_bytes(t.winner) if "bytes" in t.term else _ms(t.winner),
                        format_bytes(t.other) if "bytes" in t.term else _ms(t.other),
                    ]
                    for t in p.terms
                ],
            )
        )
    compared = [*(("full size", c) for c in p.full_size), *(("proxy", c) for c in p.proxy)]
    if compared:
        tables.append(
            Table(
                f"{p.case}: closed form against compiled (lab predict's step, priced at peak)",
                [
                    "size",
                    "layout",
                    "remat",
                    "step closed",
                    "step compiled",
                    "memory closed",
                    "memory compiled",
                    "bytes per axis closed",
                    "bytes per axis compiled",
                    "compile",
                ],
                [
                    [
                        size,
                        _layout(c.closed),
                        c.closed.remat,
                        _ms(c.closed.step_s),
                        _ms(c.step_s),
                        format_bytes(c.closed.memory_bytes),
                        format_bytes(c.memory_bytes),
                        ", ".join(f"{a} {format_bytes(b)}" for a, b in sorted(c.closed.bytes.items())) or "-",
                        ", ".join(f"{a} {format_bytes(b)}" for a, b in sorted(c.bytes.items())) or "-",
                        f"{c.compile_s:.1f} s",
                    ]
                    for size, c in compared
                ],
                note="proxy: " + PROXY + "; its closed form is computed for the proxy itself",
            )
        )
    if _swapped(p.proxy):
        tables.append(
            Table(
                f"{p.case} (proxy): which term orders the layouts differently (Spearman rho against the compiled "
                "order)",
                ["closed form", "rho"],
                [["as it is", f"{_rho(p.proxy):.2f}"]]
                + [[f"with the compiler's {term}", f"{rho:.2f}"] for term, rho in _swapped(p.proxy).items()],
            )
        )
    return tables


def _agreement_plot(obs: Observations) -> Figure:
    fig = Figure(figsize=(6, 5))
    ax = fig.subplots()
    steps = []
    for p, marker in zip(obs.cases, "os^"):
        for size, compiled, fill in (("proxy", p.proxy, "none"), ("full size", p.full_size, None)):
            closed, steps_ = [c.closed.step_s * 1e3 for c in compiled], [c.step_s * 1e3 for c in compiled]
            steps += closed + steps_
            rho = _rho(compiled) if size == "proxy" else None
            label = f"{p.case}, {size}" + (f" (rho {rho:.2f})" if rho is not None else "")
            if compiled:
                ax.scatter(
                    closed, steps_, marker=marker, facecolors=fill, edgecolors=f"C{obs.cases.index(p)}", label=label
                )
    if steps:
        ax.plot([min(steps), max(steps)], [min(steps), max(steps)], "k--", lw=1, label="closed form = compiled")
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="closed-form step (ms)",
        ylabel="compiled step (ms)",
        title="The closed form against the compiler, layout by layout",
    )
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def _plot(p: Planned) -> Figure:
    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
    for remat, marker in zip(("none", "minimal", "full"), "o^s"):
        pts = [(m, s) for m, s, r in p.points if r == remat]
        ax.scatter(
            [m / 2**30 for m, _ in pts], [s for _, s in pts], s=8, alpha=0.4, marker=marker, label=f"remat {remat}"
        )
    ax.plot([m / 2**30 for m, _ in p.frontier], [s for _, s in p.frontier], "k-", lw=1, label="frontier")
    ax.axvline(p.hbm_bytes / 2**30, color="red", ls="--", lw=1, label="HBM per chip")
    if p.top:
        ax.scatter(
            [p.top[0].memory_bytes / 2**30],
            [p.top[0].step_s],
            s=90,
            facecolors="none",
            edgecolors="k",
            label=f"chosen: {p.top[0].layout} ({p.top[0].remat})",
        )
    if p.pure_fsdp:
        ax.scatter(
            [p.pure_fsdp.memory_bytes / 2**30],
            [p.pure_fsdp.step_s],
            s=90,
            marker="x",
            color="k",
            label=f"pure FSDP ({p.pure_fsdp.remat})",
        )
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="memory per chip (GiB, closed form)",
        ylabel="step time (s, closed form)",
        title=p.case,
    )
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def _claims(obs: Observations) -> list[Claim]:
    claims = []
    for p in obs.cases:
        if not p.top or not p.pure_fsdp:
            continue
        best, fsdp = p.top[0], p.pure_fsdp
        fits = fsdp.memory_bytes <= p.hbm_bytes
        mixed = any(v > 1 for v in _sizes(best.layout, ("tensor", "stage")))
        status = "confirmed" if mixed and best.step_s < fsdp.step_s else "refuted"
        claims.append(
            Claim(
                f"{p.case}: TP (or a pipeline) with a smaller FSDP beats a very large FSDP",
                status,
                f"chosen {best.layout} ({best.remat}) {_ms(best.step_s)}, MFU {best.mfu:.1%}; pure FSDP {fsdp.layout} "
                f"({fsdp.remat}) {_ms(fsdp.step_s)}, MFU {fsdp.mfu:.1%}, {format_bytes(fsdp.memory_bytes)} per chip"
                + ("" if fits else " (does not fit)"),
            )
        )
    return claims


def _sizes(layout: str, axes) -> list[int]:
    pairs = dict(part.split("=") for part in layout.split(",") if "=" in part)
    return [int(pairs.get(a, 1)) for a in axes]


def _summary(obs: Observations) -> str:
    parts = []
    for p in obs.cases:
        if not p.top:
            parts.append(f"{p.case}: nothing fits ({p.closest.layout} needs {format_bytes(p.closest.memory_bytes)}).")
            continue
        best = p.top[0]
        against = ""
        if p.pure_fsdp and (p.pure_fsdp.layout, p.pure_fsdp.remat) != (best.layout, best.remat):
            against = (
                f" against pure FSDP's {_ms(p.pure_fsdp.step_s)} ({p.pure_fsdp.remat}, "
                f"{format_bytes(p.pure_fsdp.memory_bytes)})"
            )
        rho = _rho(p.proxy)
        parts.append(
            f"{p.case}: of {p.enumerated} layouts ({p.fitting} fit), the closed form chooses {best.layout} with remat "
            f"{best.remat}: {_ms(best.step_s)} a step, MFU {best.mfu:.1%}, {format_bytes(best.memory_bytes)} per chip"
            + against
            + "."
            + _full_size(p)
            + (
                f" On its proxy the closed form and the compiler order {len(p.proxy)} layouts with Spearman "
                f"rho {rho:.2f}{_lowered_by(p.proxy)}."
                if rho is not None
                else ""
            )
        )
    return " ".join(parts) + " Every time is a prediction (compile-only; no TPU ran)."


def _full_size(p: Planned) -> str:
    if not p.full_size:
        return ""
    worst = max(p.full_size, key=lambda c: abs(c.closed.step_s / c.step_s - 1))
    pairs = _apart(p.full_size)
    order = (
        f"; of the {len(pairs)} pairs whose compiled steps differ by more than 2%, it orders "
        f"{sum(_alike(a, b) for a, b in pairs)} alike"
        if pairs
        else "; no two compiled steps differ by more than 2%"
    )
    return (
        f" Compiled at full size, its best {len(p.full_size)} are within "
        f"{abs(worst.closed.step_s / worst.step_s - 1):.1%} of the compiled step (worst: {_layout(worst.closed)} "
        f"{worst.closed.remat}, {_ms(worst.closed.step_s)} against {_ms(worst.step_s)}){order}."
    )


def _lowered_by(compiled) -> str:
    rho, culprit = _rho(compiled), _culprit(compiled)
    if rho is None or rho >= RHO_MIN:
        return ""
    if culprit is None:
        return "; swapping in neither of the compiler's terms raises it, so no one term explains it"
    term, better = culprit
    return f"; the term that lowers it is {term}: with the compiler's, the closed form's order reaches rho {better:.2f}"


def _notes(obs: Observations, config: Config) -> list[str]:
    notes = []
    for p in obs.cases:
        if len(p.proxy) < 10:
            notes.append(
                f"{p.case}: {len(p.proxy)} proxy layouts compiled (Config.compiled_per_case = "
                f"{config.compiled_per_case}), fewer than 10: the page's budget (~150 s) pays for about "
                "that many compiles on this machine."
            )
        for line in p.proxy_not_compiled:
            notes.append(f"{p.case}, not compiled: {line}")
    notes.append(
        "Full-size compiles: "
        + (", ".join(f"{p.case} {len(p.full_size)}" for p in obs.cases) if config.full_size else "none")
        + f"; every compile with libtpu flags {config.libtpu_flags} (MaxText's DATA_PARALLEL_OVERLAP and "
        "CF_FOR_ALL_GATHER; `lab plan --libtpu-flags` passes a recipe's own). With them libtpu runs "
        + "; ".join(f"on {g} {_asynchronous(gathers, scatters)}" for g, gathers, scatters in obs.overlapped)
        + " (`lab.plan.overlap`'s probe compile), and the closed form hides those under compute, nothing else."
    )
    return notes


def _asynchronous(gathers: bool, scatters: bool) -> str:
    return ", ".join(
        f"the {name} {'asynchronously' if on else 'synchronously'}"
        for name, on in (("gathers", gathers), ("reduce-scatters", scatters))
    )
