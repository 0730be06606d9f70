"""The README's two commands are the ones people and CI actually run."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _command_after(marker: str) -> str:
    lines = (ROOT / "README.md").read_text().splitlines()
    start = lines.index(f"<!-- {marker} -->")
    assert lines[start + 1] == "```"
    return lines[start + 2]


def _ci_lines() -> list[str]:
    return [
        line
        for line in (ROOT / ".ci" / "run").read_text().splitlines()
        if line and not line.startswith(("#", "set ", "cd "))
    ]


def test_ci_runs_in_a_fresh_venv_the_style_checks_then_the_readme_test_command_exactly():
    place, cleanup, make, style, tests = _ci_lines()
    assert place == 'venv="$(mktemp -d)/venv"'  # outside the checkout, new on every run
    assert cleanup.startswith("""trap 'rm -rf "$(dirname "$venv")"' EXIT""")  # and gone after it, pass or fail
    assert make == 'python3 -m venv "$venv" && . "$venv/bin/activate"'
    assert tests == _command_after("test-command")
    assert "ruff format --check ." in style and "ruff check ." in style


def test_ci_pins_the_ruff_the_test_extra_installs():
    """One ruff version for CI and developers: another version may format the same code differently."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    pin = next(part for part in _ci_lines()[3].split('"') if part.startswith("ruff=="))
    assert f'"{pin}"' in pyproject


def test_report_command_installs_the_tpu_and_gpu_extras_and_runs_the_report():
    command = _command_after("report-command")
    assert '".[tpu,gpu]"' in command and command.endswith("lab report")
