"""The shape of the package: data flows one way, and the library never imports the application.

Read from the source with `ast`, not by importing: every ``import`` of a
``lab`` module, at module level or inside a function, is an edge of the graph.

- no import circles between lab modules, function-local imports included
  (a function-local import hides a circle from Python, not from the design);
- nothing in ``lab/`` imports ``experiments`` (the CLI finds experiments
  through `lab.registry`'s entry points);
- a package's modules do not import the modules of a package above it in the
  data flow (`LAYERS`);
- a module above ~500 lines says in its docstring why it is one concept;
- every function-local import says why it is local (a comment on its line or
  the line above, or a reason in the module docstring for whole modules such
  as the CLI that keep JAX from starting before the target is chosen).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

LAB = Path(__file__).resolve().parents[1] / "lab"

# The data flow, bottom to top: a module may import its own layer and those below, never above.
LAYERS = (
    ("lab.errors", "lab.interrupts", "lab.units", "lab.progress", "lab.verdict", "lab.inputs", "lab.provenance"),
    ("lab.mesh", "lab.targets", "lab.collectives"),
    ("lab.rules", "lab.targets.topology", "lab.theory"),
    ("lab.hlo", "lab.moe", "lab.ragged", "lab.model", "lab.roofline", "lab.bench", "lab.explanation"),
    ("lab.parallel",),
    ("lab.report", "lab.training"),
    ("lab.doctor", "lab.predict", "lab.plan"),
    ("lab.registry", "lab.side_by_side", "lab.cli", "lab.entry", "lab.__main__", "lab"),
)
MAX_LINES = 500


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(LAB.rglob("*.py")):
        parts = path.relative_to(LAB.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = _modules()


def _imports(path: Path) -> list[tuple[str, int, bool]]:
    """(imported module, line, inside a function) for every import in the file; `from a import b` yields a.b if a
    module, else a."""
    tree = ast.parse(path.read_text())
    local_lines = {
        sub.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        for sub in ast.walk(node)
        if isinstance(sub, ast.Import | ast.ImportFrom)
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno, node.lineno in local_lines) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                target = full if full in MODULES else node.module
                found.append((target, node.lineno, node.lineno in local_lines))
    return found


def _graph() -> dict[str, set[str]]:
    graph = {}
    for name, path in MODULES.items():
        graph[name] = {target for target, _, _ in _imports(path) if target in MODULES and target != name}
    return graph


def _layer(module: str) -> int:
    """The layer of the most specific entry that holds `module` (``lab.targets.topology`` before ``lab.targets``)."""
    if module == "lab":
        return len(LAYERS) - 1
    holding = [
        (len(top), index)
        for index, layer in enumerate(LAYERS)
        for top in layer
        if top != "lab" and (module == top or module.startswith(top + "."))
    ]
    if not holding:
        raise AssertionError(f"{module} is in no layer of tests/test_architecture.py LAYERS: place it")
    return max(holding)[1]


def test_every_module_has_a_layer():
    for module in MODULES:
        _layer(module)


def test_no_import_cycles():
    graph, state, cycles = _graph(), {}, []

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if nxt == "lab" or nxt.endswith("__init__"):
                continue
            if state.get(nxt) == "open":
                cycles.append(" -> ".join([*stack[stack.index(nxt) :], nxt]))
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = "done"

    for module in sorted(graph):
        if module != "lab" and module not in state:
            visit(module, [module])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_library_never_imports_the_experiments():
    offenders = [
        f"{path.relative_to(LAB.parent)}:{line}"
        for name, path in MODULES.items()
        for target, line, _ in _imports(path)
        if target == "experiments" or target.startswith("experiments.")
    ]
    assert not offenders, f"lab/ imports experiments at {offenders}; find them through lab.registry"


def test_imports_follow_the_data_flow():
    upward = []
    for name, path in MODULES.items():
        if name == "lab":  # the package's public API re-exports from every layer
            continue
        for target, line, _ in _imports(path):
            if target in MODULES and target != "lab" and _layer(target) > _layer(name):
                upward.append(f"{path.relative_to(LAB.parent)}:{line} ({name}) imports {target}, a layer above it")
    assert not upward, "\n".join(upward)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_a_long_module_says_why_it_is_one_concept(name):
    path = MODULES[name]
    lines = len(path.read_text().splitlines())
    if lines <= MAX_LINES:
        return
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    assert "one concept" in doc.lower(), (
        f"{path.relative_to(LAB.parent)} has {lines} lines (over {MAX_LINES}): split it, or say in its docstring "
        "why it is one concept"
    )


@pytest.mark.parametrize("name", sorted(MODULES))
def test_function_local_imports_say_why(name):
    path = MODULES[name]
    text = path.read_text()
    doc = ast.get_docstring(ast.parse(text)) or ""
    if "imported inside" in doc:  # the module explains its local imports once, for all of them
        return
    lines = text.splitlines()
    unexplained = [
        f"{path.relative_to(LAB.parent)}:{line}: {lines[line - 1].strip()}"
        for _, line, local in _imports(path)
        if local and "#" not in lines[line - 1] and not lines[line - 2].strip().startswith("#")
    ]
    assert not unexplained, "function-local imports without a reason (a cost or a cycle):\n" + "\n".join(
        sorted(set(unexplained))
    )
