"""The experiments: one module per question of the quick-reference.

Each module ``qNN_<name>.py`` answers question #NN and defines

* ``QUESTION``: the question number(s) it answers, e.g. ``"#39"``;
* ``Config``: a frozen dataclass of its options (the CLI is generated from it);
* ``run(config) -> lab.report.Result``.

Its docstring's first line is its title: the page, ``lab list`` and the
module say the same. `registry()` finds them all; the package registers it as
the ``lab.experiments`` entry point, which is how the command line finds them
(`lab.registry`) without the library importing this package.
"""

from __future__ import annotations

import importlib
import pkgutil

from lab.registry import Experiment, get

__all__ = ["Experiment", "get", "registry"]


def registry() -> dict[str, Experiment]:
    """Every experiment, by name, in question order."""
    found = []
    for info in pkgutil.iter_modules(__path__):
        prefix, _, name = info.name.partition("_")
        if not (prefix.startswith("q") and prefix[1:].isdigit() and name):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        title = (module.__doc__ or name).strip().splitlines()[0].rstrip(".")
        found.append((int(prefix[1:]), Experiment(name, module.QUESTION, title, module)))
    return {e.name: e for _, e in sorted(found, key=lambda p: (p[0], p[1].name))}
