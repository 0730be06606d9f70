"""Experiments: measure, then judge; and where the command line finds them.

An experiment is a module with

* ``QUESTION`` (``"#40"``) and a docstring whose first line is its title;
* ``Config``: a frozen dataclass of its options (``lab run NAME --help``);
* ``Observations``: a frozen dataclass of everything it measured, JSON-serialisable, with a ``setup: Setup``
  field saying where (target, devices, mesh);
* ``measure(config) -> Observations``: all that needs JAX, a compiler or a clock;
* ``judge(observations, config) -> Result``: pure (no JAX, no clock, no randomness): the checks, claims,
  tables, plots (as functions that draw them) and notes;
* optionally ``HEAVY``: why a full ``lab report`` (15 minutes on a laptop) leaves it out; it runs when named
  (``lab report --only NAME``, ``lab run NAME``) and its committed page stays in the index;
* optionally ``COMPILE_ONLY = True`` (it compiles for its own TPU or GPU target, whatever the report's) or
  ``UNTIMED = True`` (it reads no clock): `lab report` may then measure it beside another such page
  (`lab.side_by_side`).

`Experiment.run` measures and judges; `Experiment.rejudge` rebuilds a page
from the observations its result.json stored, in milliseconds, so theory can
be improved and re-judged without re-measuring.

The library sits below the experiments: ``experiments/`` imports ``lab``,
never the other way round. The command line still has to find them, so the
experiments package *registers* itself as a Python entry point (group
``lab.experiments`` in pyproject.toml), the way pytest finds its plugins; any
installed package can add experiments the same way. Each entry point names a
function returning ``{name: Experiment}``.
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass, fields, replace
from importlib import metadata
from pathlib import Path
from types import ModuleType

import dacite

from lab import inputs
from lab.errors import LabError
from lab.provenance import Setup, code_hash, provenance
from lab.report import Result

GROUP = "lab.experiments"
_TYPED = dacite.Config(cast=[tuple, Path], strict=True)  # JSON lists back to tuples, strings to paths


@dataclass(frozen=True)
class Experiment:
    """One question's experiment (see the module docstring for what its module defines)."""

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

    def report_config(self, target: str):
        """Its default Config on `lab report`'s target, where it takes one: a compile-only experiment keeps its own
        TPU or GPU target unless the report's is compile-only too."""
        from lab.targets.devices import parse_target  # local: starts no backend, but imports JAX

        config = self.config()
        if "target" in {f.name for f in fields(config)} and (
            parse_target(target).compile_only or not self.compile_only
        ):
            config = replace(config, target=target)
        return config

    @property
    def untimed(self) -> bool:
        """Whether its measurement reads no clock, so it may run beside another page (`lab.side_by_side`): a
        compile-only page unless it says ``TIMED = True`` (it times the compiles themselves), or ``UNTIMED = True``."""
        if getattr(self.module, "TIMED", False):
            return False
        return self.compile_only or getattr(self.module, "UNTIMED", False)

    @property
    def heavy(self) -> str | None:
        """Why `lab report` leaves it out unless named (``HEAVY = "about 30 min: ..."``), or None."""
        return getattr(self.module, "HEAVY", None)

    @property
    def code_hash(self) -> str:
        """The hash of the code that produces its page (`lab.provenance.code_hash`)."""
        return code_hash(self.module.__name__)

    def run(self, config=None) -> Result:
        """Measure on the config's target, then judge."""
        config = config if config is not None else self.module.Config()
        _check_options(config)
        observations = self.module.measure(config)
        setup: Setup = observations.setup
        where = provenance(target=setup.target, devices=setup.devices, mesh=setup.mesh, module=self.module.__name__)
        return self.judge(observations, config, where)

    def judge(self, observations, config, where: dict) -> Result:
        """The page from observations alone; its name, title, question and provenance come from here."""
        result = self.module.judge(observations, config)
        return replace(
            result,
            name=self.name,
            title=self.title,
            question=self.question,
            observations=asdict(observations),
            config=asdict(config),
            provenance=where,
        )

    def stored(self, folder: Path):
        """(observations, config, provenance) of the page written in `folder`."""
        path = folder / "result.json"
        if not path.is_file():
            raise LabError(f"{path} does not exist: run `lab report --only {self.name}` to measure it first")
        again = f"measure again with `lab report --only {self.name}`"
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:  # cut short while written by another tool, edited
            raise LabError(f"{path} is damaged (not JSON: {err}); {again}") from None
        if not isinstance(data, dict):
            raise LabError(f"{path} is damaged (a JSON {type(data).__name__}, not a page's object); {again}")
        try:
            observations = dacite.from_dict(self.module.Observations, data["observations"], config=_TYPED)
            config = dacite.from_dict(self.module.Config, data["config"], config=_TYPED)
        except (KeyError, TypeError, AttributeError, dacite.DaciteError) as err:  # a field of the wrong shape
            raise LabError(f"{path} holds no observations this experiment can read ({err}); {again}") from None
        return observations, config, data.get("provenance", {})

    def rejudge(self, folder: Path) -> Result:
        """The page rebuilt from what `folder`/result.json observed, with today's theory and judge."""
        observations, config, where = self.stored(folder)
        return self.judge(observations, config, where)


_MAY_BE_ZERO = ("seed", "prefetch", "full_size")  # counts where 0 means something (the first seed, no prefetching,
# no full-size compiles)


def _check_options(config) -> None:
    """Every count an experiment takes is at least 1 (0 where 0 means something); every number is finite."""
    inputs.options(config, least=lambda name, value: 1 if isinstance(value, int) and name not in _MAY_BE_ZERO else 0)


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
