"""Pages, result.json and the index, with provenance."""

import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from lab.report import Result, Table, provenance, render, write, write_index
from lab.verdict import check


def _result():
    figure, axes = plt.subplots()
    axes.plot([1, 2], [3, 4])
    return Result(
        name="demo",
        title="A demo",
        question="#39",
        summary="Two numbers agree.",
        theory="$2(N-1)/N \\cdot D$",
        tables=[Table("sizes", ["n", "bytes"], [[1, 2.5], [2, "a|b"]])],
        checks=[check("bytes", 2, 2), check("count", 1, 2, explained="combined")],
        plots={"curve": figure},
        notes=["XLA combined them."],
        provenance=provenance(target="cpu:8"),
    )


def test_page_has_question_theory_table_verdict_plot_and_provenance(tmp_path):
    page = write(_result(), tmp_path)
    text = page.read_text()
    for piece in (
        "Question #39",
        "## Theory",
        "| bytes | 2 | 2 |",
        "**refined**",
        "![curve](curve.png)",
        "a\\|b",
        "jax:",
        "git_commit",
    ):
        assert piece in text, piece
    assert (tmp_path / "demo" / "curve.png").stat().st_size > 0
    data = json.loads((tmp_path / "demo" / "result.json").read_text())
    assert data["checks"][1]["verdict"] == "refined" and data["plots"] == ["curve.png"]


def test_index_links_each_page_with_its_verdicts(tmp_path):
    path = write_index([_result()], tmp_path, elapsed_s=12.3)
    text = path.read_text()
    assert "[A demo](demo/README.md)" in text and "1 agree, 1 refined, 0 differ" in text and "12 s" in text


def test_render_without_checks_has_no_verdict_line():
    result = Result("x", "X", "#40", "nothing checked")
    assert "Verdict" not in render(result)


def test_extra_files_are_written_beside_the_page_and_linked(tmp_path):
    result = Result("x", "X", "#43", "with a trace", files={"trace.json": {"traceEvents": []}, "note.txt": "hello"})
    page = write(result, tmp_path).read_text()
    assert json.loads((tmp_path / "x" / "trace.json").read_text()) == {"traceEvents": []}
    assert (tmp_path / "x" / "note.txt").read_text() == "hello" and "[trace.json](trace.json)" in page


def test_an_index_of_some_pages_says_which_run_wrote_it(tmp_path):
    text = write_index([_result()], tmp_path, elapsed_s=4.2, only=("demo",)).read_text()
    assert "`lab report --only demo` took 4 s; the other pages are from earlier runs" in text
