"""Results with provenance, written as pages under results/.

An experiment returns a `Result`: the question it answers, the theory with its
formula, tables, plots, verdict rows (`lab.verdict.Check`) and notes. `write`
turns it into ``results/<name>/README.md`` (the page people read),
``result.json`` (the same numbers for machines) and one PNG per plot. Every
number on a page comes from the run that wrote it; the provenance block says
which run: versions, target, devices, mesh, git commit, command and date.

`write_index` writes ``results/README.md``: one line per experiment with its
verdict counts, linking to its page.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import shlex
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from lab.verdict import Check, tally


@dataclass
class Table:
    """A titled table; cells are numbers or short strings."""

    title: str
    columns: list[str]
    rows: list[list[Any]]
    note: str = ""

    def markdown(self) -> str:
        head = "| " + " | ".join(self.columns) + " |\n|" + "---|" * len(self.columns) + "\n"
        body = "".join("| " + " | ".join(_cell(c) for c in row) + " |\n" for row in self.rows)
        note = f"\n{self.note}\n" if self.note else ""
        return f"### {self.title}\n\n{head}{body}{note}"


@dataclass(kw_only=True)
class Result:
    """Everything an experiment found, ready to be written as a page.

    An experiment leaves `name`, `title` and `question` empty: its registry
    entry (`lab.registry.Experiment.run`) fills them, so they are said once.
    """

    summary: str  # the answer, in a few sentences, from this run's numbers
    name: str = ""
    title: str = ""
    question: str = ""  # which quick-reference question(s) it answers, e.g. "#39"
    theory: str = ""  # markdown, with the formulas and their sources
    tables: list[Table] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    plots: dict[str, Any] = field(default_factory=dict)  # file stem -> matplotlib Figure
    notes: list[str] = field(default_factory=list)
    provenance: dict[str, Any] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)  # raw numbers for result.json
    files: dict[str, Any] = field(
        default_factory=dict
    )  # extra files beside the page: name -> text, or an object written as JSON

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)


def provenance(*, target: str, devices=(), mesh: str = "") -> dict[str, Any]:
    """Where the numbers come from: versions, hardware, commit, command, date."""
    kinds = sorted({getattr(d, "device_kind", "?") for d in devices})
    return {
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "command": command(),
        "git_commit": _git_commit(),
        "target": target,
        "devices": f"{len(devices)} x {', '.join(kinds)}" if devices else "",
        "mesh": mesh,
        "python": platform.python_version(),
        "machine": f"{platform.machine()}, {_cpu_count()} cores",
        **{package: _version(package) for package in ("jax", "jaxlib", "libtpu", "flax", "optax")},
    }


def command(argv: list[str] | None = None) -> str:
    """The command as the user typed it: ``lab report``, whether through the script or ``python -m lab``.

    Never a path on this machine: a program other than the lab is named by its file name alone.
    """
    program, *args = argv if argv is not None else sys.argv
    path = Path(program)
    lab = path.name == "lab" or (path.name == "__main__.py" and path.parent.name == "lab")
    return shlex.join(["lab" if lab else path.name, *args])


def write(result: Result, results_dir: Path | str = "results") -> Path:
    """Write the page, result.json and plots; returns the page's path."""
    folder = Path(results_dir) / result.name
    folder.mkdir(parents=True, exist_ok=True)
    for stem, figure in result.plots.items():
        figure.savefig(folder / f"{stem}.png", dpi=110, bbox_inches="tight")
    for name, content in result.files.items():
        (folder / name).write_text(content if isinstance(content, str) else json.dumps(content))
    (folder / "result.json").write_text(json.dumps(_as_json(result), indent=1, default=str) + "\n")
    page = folder / "README.md"
    page.write_text(render(result))
    return page


def render(result: Result) -> str:
    """The markdown page."""
    answer = f"**Question {result.question}.** {result.summary}" if result.question else result.summary
    parts = [f"# {result.title}\n", answer + "\n"]
    if result.checks:
        parts.append(f"**Verdict: {tally(result.checks)}.**\n")
    if result.theory:
        parts.append("## Theory\n\n" + result.theory.strip() + "\n")
    if result.checks:
        parts.append("## Theory against XLA\n\n" + _checks_table(result.checks))
    if result.tables:
        parts.append("## Measured\n\n" + "\n".join(t.markdown() for t in result.tables))
    parts.extend(f"![{stem}]({stem}.png)\n" for stem in result.plots)
    if result.files:
        parts.append("Files: " + ", ".join(f"[{name}]({name})" for name in result.files) + "\n")
    if result.notes:
        parts.append("## What we saw\n\n" + "".join(f"- {n}\n" for n in result.notes))
    parts.append("## Provenance\n\n" + "".join(f"- {k}: `{v}`\n" for k, v in result.provenance.items() if v))
    return "\n".join(parts)


def write_index(
    results: list[Result],
    results_dir: Path | str = "results",
    *,
    elapsed_s: float | None = None,
    only: tuple[str, ...] = (),
) -> Path:
    """results/README.md: one line per experiment with its verdicts; with `only`, the pages that run regenerated."""
    lines = [
        "# Results\n",
        (
            "Written by `lab report`; every number comes from that run. Verdicts: *agrees* = theory within tolerance, "
            "*refined* = XLA differs from the textbook for a reason the page explains, *differs* = unexplained.\n"
        ),
        "| experiment | question | verdicts |",
        "|---|---|---|",
    ]
    for r in sorted(results, key=_question_order):
        verdict = tally(r.checks) if r.checks else "no checks"
        lines.append(f"| [{r.title}]({r.name}/README.md) | {r.question} | {verdict} |")
    if results:
        prov = results[0].provenance  # the run that wrote this index (with --only, its first fresh page)
        devices = next(
            (r.provenance["devices"] for r in results if r.provenance.get("devices")), "devices on each page"
        )
        lines.append(
            f"\nTarget `{prov.get('target')}`, {devices}, jax {prov.get('jax')}, "
            f"commit `{prov.get('git_commit')}`, {prov.get('date')}."
        )
    if elapsed_s is not None and only:
        lines.append(
            f"`lab report --only {' '.join(only)}` took {elapsed_s:.0f} s; "
            "the other pages are from earlier runs (each page's provenance "
            "says which)."
        )
    elif elapsed_s is not None:
        lines.append(f"`lab report` took {elapsed_s:.0f} s.")
    path = Path(results_dir) / "README.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def _question_order(result: Result) -> tuple[int, str]:
    """Index order: by quick-reference question number (#39 first), then name."""
    digits = "".join(c for c in result.question.split(",")[0] if c.isdigit())
    return (int(digits) if digits else 10**6, result.name)


def _checks_table(checks: list[Check]) -> str:
    rows = "".join(
        f"| {c.quantity} | {_cell(c.theory)} | {_cell(c.observed)} | {c.rtol:g} | **{c.verdict}** | {c.note} |\n"
        for c in checks
    )
    return "| quantity | theory | XLA / measured | rtol | verdict | why |\n|---|---|---|---|---|---|\n" + rows


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value).replace("|", "\\|")


def _as_json(result: Result) -> dict[str, Any]:
    out = asdict(result)
    out.pop("plots")
    out["plots"] = [f"{stem}.png" for stem in result.plots]
    out["files"] = list(result.files)
    return out


def _git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).parent,
            check=False,
        )
        # the pages a running report has already rewritten do not make the code dirty
        code_only = ["--", ":/", ":(top,exclude)results"]
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", *code_only],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).parent,
            check=False,
        )
        return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "") if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def _cpu_count() -> int:

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
