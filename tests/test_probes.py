"""Every option of every command, probed with a value of each class a user can type by mistake.

The options are read from the commands' own dataclasses (`lab.cli`, `lab.predict`, `lab.plan`, `lab.training`,
each experiment's ``Config``), so an option added later is probed too. Each probe runs the command in this process
up to the moment it would start work: getting its devices (a CPU mesh, a TPU topology, a GPU cluster) is replaced
by a stop. A probe is **clean** when the command

* refuses the value in one line on stderr, exit code 2, no traceback; or
* accepts it and reaches its work; or ends normally (exit 0);

and a value no command can mean (a negative count, nan, a number past any bound, a wrong type) must be refused,
not accepted. What a probe may not do: raise, print a traceback, exit with another code, or explain itself in
several lines.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
import pkgutil
import sys
import types
import typing
from pathlib import Path

import pytest

import experiments as experiments_package
import lab
from lab import cli
from lab.cli import Bench, Doctor, Inspect, Report
from lab.plan.command import Plan
from lab.predict.command import Predict
from lab.registry import experiments
from lab.training.run import RunConfig

M = "layers=2,d_model=128,heads=4,d_ff=256,vocab=256"
BASES = {  # a valid, cheap command line of each command: the probe's option is appended (the last one counts)
    "report": (Report, ["report", "--only", "allreduce_equivalence"]),
    "inspect": (Inspect, ["inspect", "--mesh", "data=8"]),
    "bench": (Bench, ["bench", "-n", "1"]),
    "train": (RunConfig, ["train", "--steps", "1"]),
    "doctor": (Doctor, ["doctor", "--steps", "1"]),
    "predict": (Predict, ["predict", "--model", M, "--seq", "128", "--target", "tpu:v5e:2x2", "--mesh", "fsdp=4"]),
    "plan": (Plan, ["plan", "--model", M, "--seq", "128", "--target", "tpu:v5e:2x2"]),
}
NONSENSE = {  # values no option of its type can mean: each must be refused
    int: ["-1", "99999999999999999999", "1.5", "x"],
    float: ["-1", "nan", "inf", "1e309", "x"],
}
ODD = {  # values an option may accept or refuse, but cleanly
    int: ["0"],
    float: ["0"],
    str: ["", "ünï©ødé ☃", "x" * 300],
}
NOT_NONSENSE: dict[tuple[str, str], str] = {}  # (command, option): why a value of NONSENSE means something there


class _Reached(BaseException):
    """The command got past its checks and asked for devices: where its work starts."""


@functools.cache  # as `topology_devices` is: `lab.targets.libtpu` asks its cache whether libtpu started
def _stop(*args, **kwargs):
    raise _Reached


@pytest.fixture
def stopped_before_work(monkeypatch, tmp_path):
    """Devices of every kind replaced by the stop, in every module that imported the functions by name."""
    from lab.targets import devices

    for package in (lab, experiments_package):  # imported first: a module imported under the stop would keep it
        for module in pkgutil.walk_packages(package.__path__, f"{package.__name__}."):
            if not module.name.endswith("__main__"):  # `python -m lab` itself runs the command
                importlib.import_module(module.name)
    originals = {name: getattr(devices, name) for name in ("devices_for", "topology_devices", "gpu_cluster_devices")}
    for module in [m for m in sys.modules.values() if isinstance(m, types.ModuleType)]:
        for name, original in originals.items():
            if getattr(module, name, None) is original:
                monkeypatch.setattr(module, name, _stop)
    monkeypatch.chdir(tmp_path)  # anything a probe writes lands here
    return tmp_path


def _options(config) -> list[tuple[str, type]]:
    """(flag, element type) of each option of a dataclass whose type is int, float, str or Path, optional or not,
    or a tuple of them; a dataclass field's options are its own."""
    found = []
    for field in dataclasses.fields(config):
        kind = typing.get_type_hints(config, include_extras=True)[field.name]
        while typing.get_origin(kind) is typing.Annotated:
            kind = typing.get_args(kind)[0]
        if typing.get_origin(kind) in (typing.Union, types.UnionType):
            kind = next(a for a in typing.get_args(kind) if a is not type(None))
        if typing.get_origin(kind) is tuple:
            kind = typing.get_args(kind)[0]
        if dataclasses.is_dataclass(kind):  # options shared with another command (the doctor's are lab train's)
            found += _options(kind)
        elif kind in (int, float, str, Path):
            found.append((field.name.replace("_", "-"), kind))
    return found


def _paths(folder: Path) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    file = folder / "a-file"
    file.write_text("not what the option wants\n")
    (folder / "a-folder").mkdir()
    (folder / "a-link").symlink_to(folder / "a-folder")
    return [str(file), str(folder / "a-folder"), str(folder / "a-link"), os.devnull, ""]


def _probe(argv: list[str], capsys) -> str | None:
    """None when the probe is clean, else what was wrong with it."""
    try:
        code = cli.main(argv)
    except _Reached:
        code = "reached"
    except BaseException as err:
        return f"raised {type(err).__name__}: {str(err)[:200]}"
    out, err = capsys.readouterr()
    if "Traceback" in out + err:
        return "printed a traceback"
    if code == 2 and (len(err.strip().splitlines()) != 1 or not err.startswith("lab: error: ")):
        return f"exit 2 with {len(err.strip().splitlines())} lines: {err[:300]!r}"
    if code not in (0, 2, "reached"):
        return f"exit {code}: {err[-300:]!r}"
    return None if code != 2 else "refused"


def _sweep(command: str, config, base: list[str], capsys, folder: Path) -> list[str]:
    """Every probe of `config`'s options on the `base` command line: the dirty ones, described."""
    dirty = []
    for flag, kind in _options(config):
        values = [(v, True) for v in NONSENSE.get(kind, [])] + [(v, False) for v in ODD.get(kind, [])]
        if kind is Path:
            values = [(v, False) for v in _paths(folder / flag)]
        for value, must_refuse in values:
            argv = [*base, f"--{flag}", value]
            found = _probe(argv, capsys)
            if found == "refused":
                continue
            if found is None and must_refuse and (command, flag) not in NOT_NONSENSE:
                found = "accepted a value no option of its type can mean"
            if found is not None:
                dirty.append(f"lab {' '.join(argv[:1] + argv[-2:])!s}: {found}")
    return dirty


@pytest.mark.parametrize("command", list(BASES))
def test_every_option_of_each_command_is_clean_on_every_class_of_value(command, stopped_before_work, capsys):
    config, base = BASES[command]
    assert _probe(base, capsys) is None, "the base command line itself must be clean and reach its work"
    assert _sweep(command, config, base, capsys, stopped_before_work) == []


def test_every_option_of_every_experiment_is_clean(stopped_before_work, capsys):
    dirty = []
    for name, experiment in experiments().items():
        dirty += _sweep(f"run {name}", experiment.config, ["run", name], capsys, stopped_before_work)
    assert dirty == []


def test_a_stopped_probe_is_not_a_refusal(stopped_before_work, capsys):
    """The stop is where work starts: a command line that refuses nothing reaches it (the probes can tell)."""
    assert _probe(["inspect", "--mesh", "data=8"], capsys) is None
    assert _probe(["inspect", "--mesh", "dta=8"], capsys) == "refused"
