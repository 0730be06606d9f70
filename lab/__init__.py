"""The sharding lab: distributed-training theory next to what XLA actually did.

Data flows one way: a mesh spec becomes a `jax.sharding.Mesh` with the five
axes (lab.mesh); a strategy's rules tables place each logical axis on them
(lab.rules, lab.parallel); a program is written with `shard_map` and explicit
collectives (lab.collectives) or with sharding annotations, compiled, and its
optimized HLO read back (lab.hlo); the closed forms (lab.theory, lab.targets.hardware,
lab.targets.topology) predict it; `check` gives the verdicts (lab.verdict) and
lab.report writes the pages. Training runs are lab.training, their diagnosis
lab.doctor. tests/test_architecture.py keeps the layers in that order.

The public API is listed here explicitly; everything else is internal.

The names are imported on first use (a module ``__getattr__``, PEP 562), so
``import lab`` costs nothing: the ``lab`` command (`lab.entry`) can answer
Ctrl-C before jax, flax and orbax are loaded. (``lab.roofline`` is the module;
its function is ``lab.roofline.roofline``.)
"""

from __future__ import annotations

import importlib

_PUBLIC = {  # each public name, and the module that defines it
    "Timing": "lab.bench",
    "time_fn": "lab.bench",
    "NAMES": "lab.collectives",
    "CollectiveProgram": "lab.collectives",
    "build_program": "lab.collectives",
    "DEFAULT_TARGET": "lab.targets.devices",
    "Target": "lab.targets.devices",
    "devices_for": "lab.targets.devices",
    "parse_target": "lab.targets.devices",
    "Finding": "lab.doctor.checks",
    "Diagnosis": "lab.doctor.diagnosis",
    "diagnose": "lab.doctor.diagnosis",
    "LabError": "lab.errors",
    "Explanation": "lab.explanation.explain",
    "explain": "lab.explanation.explain",
    "ChipProfile": "lab.targets.hardware",
    "profile": "lab.targets.hardware",
    "Collective": "lab.hlo",
    "Inspection": "lab.hlo",
    "inspect": "lab.hlo",
    "parse_collectives": "lab.hlo",
    "summarize": "lab.hlo",
    "AXES": "lab.mesh",
    "MeshSpec": "lab.mesh",
    "ModelConfig": "lab.model",
    "preset": "lab.model",
    "Result": "lab.report",
    "Roofline": "lab.roofline",
    "STRATEGIES": "lab.rules",
    "get_strategy": "lab.rules",
    "CollectiveCost": "lab.theory",
    "collective_cost": "lab.theory",
    "placement": "lab.targets.topology",
    "RunConfig": "lab.training.run",
    "RunLog": "lab.training.run",
    "SeriesSummary": "lab.training.series",
    "TrainConfig": "lab.training.step",
    "Trainer": "lab.training.step",
    "Check": "lab.verdict",
    "Claim": "lab.verdict",
    "check": "lab.verdict",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'lab' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value  # the next use finds it without this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})
