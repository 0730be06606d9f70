"""The README's two commands are the ones people and CI actually run."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _command_after(marker: str) -> str:
    lines = (ROOT / "README.md").read_text().splitlines()
    start = lines.index(f"<!-- {marker} -->")
    assert lines[start + 1] == "```"
    return lines[start + 2]


def test_ci_runs_the_readme_test_command_exactly():
    ci_lines = [
        line
        for line in (ROOT / ".ci" / "run").read_text().splitlines()
        if line and not line.startswith(("#", "set ", "cd "))
    ]
    assert ci_lines == [_command_after("test-command")]


def test_report_command_installs_the_tpu_extra_and_runs_the_report():
    command = _command_after("report-command")
    assert '".[tpu]"' in command and command.endswith("lab report")
