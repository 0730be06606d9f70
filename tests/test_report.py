"""Pages, result.json and the index: checks with their kinds, claims, provenance; a page is written whole."""

import json
import os
import stat

import pytest
from matplotlib.figure import Figure

from lab import report
from lab.provenance import provenance
from lab.report import Result, Table, read, render, write, write_index
from lab.verdict import Claim, check


def _figure():
    figure = Figure()
    figure.subplots().plot([1, 2], [3, 4])
    return figure


def _result(**overrides):
    return Result(**(_FIELDS | {"plots": {"curve": _figure}} | overrides))


_FIELDS = dict(  # noqa: C408 - keywords: the fields of a Result, as a call would name them
    name="demo",
    title="A demo",
    question="#39",
    summary="Two numbers agree.",
    theory="$2(N-1)/N \\cdot D$",
    tables=[Table("sizes", ["n", "bytes"], [[1, 2.5], [2, "a|b"]])],
    checks=[
        check("bytes", 2, 2, kind="exact"),
        check("count", 1, 2, kind="exact", refined=2, why="two tuple members"),
        check("ms", 1.0, 3.0, kind="timing", rtol=0.2, basis="the split is no slower on this host"),
    ],
    claims=[Claim("the same bytes both ways", "confirmed", "2 against 2")],
    notes=["XLA combined them."],
    observations={"bytes": 2},
    config={"target": "cpu:8"},
    provenance=provenance(target="cpu:8", devices="8 x cpu", mesh="fsdp=8"),
)


def test_page_has_question_theory_checks_claims_plot_and_provenance(tmp_path):
    page = write(_result(), tmp_path)
    text = page.read_text()
    for piece in (
        "Question #39",
        "## Theory",
        "| bytes | exact | 2 | 2 |",
        "**refined**",
        "two tuple members",
        "the split is no slower on this host",
        "**1 check(s) differ**",
        "## The quick-reference's claims",
        "| the same bytes both ways | **confirmed** | 2 against 2 |",
        "![curve](curve.png)",
        "a\\|b",
        "jax:",
        "git_commit",
    ):
        assert piece in text, piece
    assert (tmp_path / "demo" / "curve.png").stat().st_size > 0
    data = json.loads((tmp_path / "demo" / "result.json").read_text())
    assert data["checks"][1]["verdict"] == "refined" and data["checks"][1]["refined"] == 2
    assert data["plots"] == ["curve.png"] and data["observations"] == {"bytes": 2}


def test_a_written_page_reads_back(tmp_path):
    written = _result()
    write(written, tmp_path)
    back = read(tmp_path / "demo")
    assert (back.checks, back.claims, back.observations) == (written.checks, written.claims, written.observations)


def test_a_page_folder_opens_as_a_folder_the_user_makes(tmp_path):
    """Written through a private staging folder (mode 0700), the page still gets the user's umask's mode."""
    old = os.umask(0o022)
    try:
        write(_result(), tmp_path)
        (tmp_path / "made").mkdir()
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "demo").stat().st_mode) == stat.S_IMODE((tmp_path / "made").stat().st_mode) == 0o755


def test_a_failed_write_leaves_the_previous_page_whole(tmp_path, monkeypatch):
    write(_result(summary="the first run"), tmp_path)

    def broken(_):
        raise OSError("disk full")

    monkeypatch.setattr(report, "render", broken)
    with pytest.raises(OSError, match="disk full"):
        write(_result(summary="the second run"), tmp_path)
    assert "the first run" in (tmp_path / "demo" / "README.md").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo"]  # no staging folder left behind


def test_index_counts_verdicts_per_page_and_lists_the_claims_by_question(tmp_path):
    text = write_index([_result()], tmp_path, elapsed_s=12.3).read_text()
    assert "| [A demo](demo/README.md) | #39 | 1 | 1 | **1** | confirmed 1 |" in text
    assert "| **all pages** | | 1 | 1 | 1 | |" in text
    assert "| #39 | the same bytes both ways | **confirmed** | 2 against 2 |" in text and "12 s" in text


def test_render_without_checks_has_no_verdict_line():
    assert "Verdict" not in render(Result(name="x", title="X", question="#40", summary="nothing checked"))


def test_extra_files_are_written_beside_the_page_and_linked(tmp_path):
    result = _result(files={"trace.json": {"traceEvents": []}, "note.txt": "hello"})
    page = write(result, tmp_path).read_text()
    assert json.loads((tmp_path / "demo" / "trace.json").read_text()) == {"traceEvents": []}
    assert (tmp_path / "demo" / "note.txt").read_text() == "hello" and "[trace.json](trace.json)" in page


def test_an_index_of_some_pages_says_which_run_wrote_it(tmp_path):
    text = write_index([_result()], tmp_path, elapsed_s=4.2, only=("demo",)).read_text()
    assert "`lab report --only demo` took 4 s; the other pages are from earlier runs" in text
