"""Results with provenance, written as pages under results/.

An experiment measures, then judges (`lab.registry`): what it measured is its
observations, and a pure judge turns them into a `Result`: the answer in a few
sentences, the theory with its formulas, the checks (`lab.verdict.Check`), the
quick-reference's claims (`lab.verdict.Claim`), tables, plots and notes.
`write` turns it into ``results/<name>/README.md`` (the page people read),
``result.json`` (the observations, the config, every check and claim, for
machines and for ``lab report --rejudge``) and one PNG per plot. The page's
files are written into a temporary folder and swapped in whole, so an
interrupted write leaves the previous page as it was.

`write_index` writes ``results/README.md``: per page its verdict counts, and
per question the ledger of the quick-reference's claims.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lab.verdict import Check, Claim, counts, tally


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

    A judge leaves `name`, `title`, `question`, `observations`, `config` and
    `provenance` empty: the registry entry (`lab.registry.Experiment`) fills
    them, so each is said once.
    """

    summary: str  # the answer, in a few sentences, from this run's numbers
    name: str = ""
    title: str = ""
    question: str = ""  # which quick-reference question(s) it answers, e.g. "#39"
    theory: str = ""  # markdown, with the formulas and their sources
    tables: list[Table] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    claims: list[Claim] = field(default_factory=list)
    plots: dict[str, Callable[[], Any]] = field(default_factory=dict)  # file stem -> a function drawing the Figure
    notes: list[str] = field(default_factory=list)
    files: dict[str, Any] = field(default_factory=dict)  # beside the page: name -> text, or an object as JSON
    observations: dict[str, Any] = field(default_factory=dict)  # what was measured: all the judge reads
    config: dict[str, Any] = field(default_factory=dict)
    provenance: dict[str, Any] = field(default_factory=dict)


def write(result: Result, results_dir: Path | str = "results") -> Path:
    """Write the page, result.json and plots as one unit; returns the page's path."""
    folder = Path(results_dir) / result.name
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{result.name}.", dir=folder.parent))
    staging.chmod(0o777 & ~_umask())  # mkdtemp makes it 0700: the page opens to whom any folder of the user's would
    try:
        for stem, draw in result.plots.items():
            figure = draw() if callable(draw) else draw
            figure.savefig(staging / f"{stem}.png", dpi=110, bbox_inches="tight")
        for name, content in result.files.items():
            (staging / name).write_text(content if isinstance(content, str) else json.dumps(content))
        (staging / "result.json").write_text(json.dumps(as_json(result), indent=1, default=str) + "\n")
        (staging / "README.md").write_text(render(result))
        _swap_in(staging, folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder / "README.md"


def _umask() -> int:
    mask = os.umask(0o022)  # reading the mask means setting it: set it back at once
    os.umask(mask)
    return mask


def _swap_in(staging: Path, folder: Path) -> None:
    """Replace `folder` by `staging` with renames: at every moment one whole page is in place."""
    if not folder.exists():
        staging.rename(folder)
        return
    retired = folder.with_name(f".{folder.name}.old")
    shutil.rmtree(retired, ignore_errors=True)
    folder.rename(retired)
    staging.rename(folder)
    shutil.rmtree(retired, ignore_errors=True)


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
        differ = [c for c in result.checks if c.verdict == "differs"]
        if differ:
            parts.append(
                f"**{len(differ)} check(s) differ**: "
                + "; ".join(f"{c.quantity} ({_cell(c.observed)} against {_cell(c.theory)})" for c in differ)
                + ". Nothing in this run explains them; they are findings, listed under What we saw where more is "
                "known.\n"
            )
    if result.claims:
        parts.append("## The quick-reference's claims\n\n" + _claims_table(result.claims))
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
    left_out: tuple[str, ...] = (),
) -> Path:
    """results/README.md: the verdicts per page and the claims per question; with `only`, what that run redid;
    `left_out`: heavy pages a full run skipped, shown from their last run."""
    ordered = sorted(results, key=_question_order)
    lines = [
        "# Results\n",
        "Written by `lab report`; every number comes from that run. Verdicts: *agrees* = observed within the "
        "tolerance of theory; *refined* = the textbook differs and a corrected prediction, computed in the same run "
        "from evidence it read, agrees; *differs* = neither: a finding.\n",
        "| experiment | question | agrees | refined | differs | claims |",
        "|---|---|---|---|---|---|",
    ]
    for r in ordered:
        n = counts(r.checks)
        ledger = ", ".join(f"{k} {v}" for k, v in _claim_counts(r.claims).items() if v) or "-"
        lines.append(
            f"| [{r.title}]({r.name}/README.md) | {r.question} | {n['agrees']} | {n['refined']} | "
            f"**{n['differs']}** | {ledger} |"
            if n["differs"]
            else f"| [{r.title}]({r.name}/README.md) | {r.question} | {n['agrees']} | {n['refined']} | 0 | {ledger} |"
        )
    total = counts(c for r in results for c in r.checks)
    lines.append(f"| **all pages** | | {total['agrees']} | {total['refined']} | {total['differs']} | |")
    lines += ["", "## The quick-reference's claims, by question\n", "| question | claim | status | numbers |"]
    lines.append("|---|---|---|---|")
    for r in ordered:
        lines += [f"| {r.question} | {c.claim} | **{c.status}** | {_cell(c.numbers)} |" for c in r.claims]
    if results:
        prov = results[0].provenance  # the run that wrote this index (with --only, its first fresh page)
        devices = next((r.provenance["devices"] for r in results if r.provenance.get("devices")), "see each page")
        lines.append(
            f"\nTarget `{prov.get('target')}`, {devices}, jax {prov.get('jax')}, "
            f"commit `{prov.get('git_commit')}`, {prov.get('date')}."
        )
    if elapsed_s is not None and only:
        lines.append(
            f"`lab report --only {' '.join(only)}` took {elapsed_s:.0f} s; the other pages are from earlier runs "
            "(each page's provenance says which)."
        )
    elif elapsed_s is not None:
        lines.append(f"`lab report` took {elapsed_s:.0f} s.")
    if left_out:
        names = ", ".join(left_out)
        lines.append(f"Left out of a full `lab report` for their cost and shown from their last run: {names}.")
    path = Path(results_dir) / "README.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def read(folder: Path) -> Result:
    """A written page's Result back from its result.json (plots and files by name only)."""
    data = json.loads((folder / "result.json").read_text())
    return Result(
        summary=data["summary"],
        name=data["name"],
        title=data["title"],
        question=data["question"],
        theory=data.get("theory", ""),
        tables=[Table(**t) for t in data.get("tables", [])],
        checks=[Check(**c) for c in data.get("checks", [])],
        claims=[Claim(**c) for c in data.get("claims", [])],
        notes=data.get("notes", []),
        observations=data.get("observations", {}),
        config=data.get("config", {}),
        provenance=data.get("provenance", {}),
    )


def as_json(result: Result) -> dict[str, Any]:
    """What result.json holds: everything but the figures and extra files, which are named."""
    out = asdict(result)
    out["plots"] = [f"{stem}.png" for stem in result.plots]
    out["files"] = list(result.files)
    return out


def _claim_counts(claims: list[Claim]) -> dict[str, int]:
    return {s: sum(c.status == s for c in claims) for s in ("confirmed", "refined", "refuted")}


def _question_order(result: Result) -> tuple[int, str]:
    """Index order: by quick-reference question number (#39 first), then name."""
    digits = "".join(c for c in result.question.split(",")[0] if c.isdigit())
    return (int(digits) if digits else 10**6, result.name)


def _checks_table(checks: list[Check]) -> str:
    head = "| quantity | kind | theory | XLA / measured | rtol | verdict | refined | why / basis |\n"
    rows = "".join(
        f"| {c.quantity} | {c.kind} | {c.relation.replace('==', '') + ' ' if c.relation != '==' else ''}"
        f"{_cell(c.theory)} | {_cell(c.observed)} | {c.rtol:g} | **{c.verdict}** | "
        f"{_cell(c.refined) if c.refined is not None else ''} | {_cell('; '.join(filter(None, (c.why, c.basis))))} |\n"
        for c in checks
    )
    return head + "|---|---|---|---|---|---|---|---|\n" + rows


def _claims_table(claims: list[Claim]) -> str:
    rows = "".join(f"| {c.claim} | **{c.status}** | {_cell(c.numbers)} |\n" for c in claims)
    return "| claim | status | numbers from this run |\n|---|---|---|\n" + rows


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value).replace("|", "\\|").replace("\n", " ")
