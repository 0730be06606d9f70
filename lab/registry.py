"""Where the command line finds experiments, without the library importing them.

The library sits below the experiments: `experiments/` imports `lab`, never
the other way round. The command line still has to list and run them, so the
experiments package *registers* itself as a Python entry point (group
``lab.experiments`` in pyproject.toml), the way pytest finds its plugins; any
installed package can add experiments the same way. Each entry point names a
function returning ``{name: Experiment}``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from importlib import metadata
from types import ModuleType

from lab.errors import LabError

GROUP = "lab.experiments"


@dataclass(frozen=True)
class Experiment:
    """One question's experiment: its module defines ``Config`` and ``run(config) -> Result``."""

    name: str
    question: str
    title: str  # the first line of the module's docstring: the page, `lab list` and the module say the same
    module: ModuleType

    @property
    def config(self) -> type:
        return self.module.Config

    @property
    def compile_only(self) -> bool:
        """Whether it only compiles (and so may run on a compile-only target)."""
        return getattr(self.module, "COMPILE_ONLY", False)

    def run(self, config=None):
        """Run it; the page's name, title and question come from here, not from the module."""
        result = self.module.run(config if config is not None else self.module.Config())
        return replace(result, name=self.name, title=self.title, question=self.question)


@functools.cache
def experiments() -> dict[str, Experiment]:
    """Every registered experiment, by name, in the order their packages list them."""
    found: dict[str, Experiment] = {}
    for entry in metadata.entry_points(group=GROUP):
        found.update(entry.load()())
    if not found:
        raise LabError(f"no experiments registered under {GROUP!r}; install the lab with: pip install -e .")
    return found


def get(name: str) -> Experiment:
    """One experiment by name; an unknown name lists the known ones."""
    known = experiments()
    if name not in known:
        raise LabError(f"unknown experiment {name!r}; known: {', '.join(known)} (see `lab list`)")
    return known[name]
