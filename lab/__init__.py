"""The sharding lab: distributed-training theory next to what XLA actually did.

Data flows one way: a mesh spec becomes a `jax.sharding.Mesh` with the five
axes (lab.mesh); a strategy's rules tables place each logical axis on them
(lab.rules, lab.parallel); a program is written with `shard_map` and explicit
collectives (lab.collectives) or with sharding annotations, compiled, and its
optimized HLO read back (lab.hlo); the closed forms (lab.theory, lab.hardware,
lab.topology) predict it; `check` gives the verdicts (lab.verdict) and
lab.report writes the pages. Training runs are lab.training, their diagnosis
lab.doctor. tests/test_architecture.py keeps the layers in that order.

The public API is listed here explicitly; everything else is internal.
"""

from lab.bench import Timing as Timing
from lab.bench import time_fn as time_fn
from lab.collectives import NAMES as NAMES
from lab.collectives import CollectiveProgram as CollectiveProgram
from lab.collectives import build_program as build_program
from lab.devices import DEFAULT_TARGET as DEFAULT_TARGET
from lab.devices import Target as Target
from lab.devices import devices_for as devices_for
from lab.devices import parse_target as parse_target
from lab.doctor.checks import Finding as Finding
from lab.doctor.diagnosis import Diagnosis as Diagnosis
from lab.doctor.diagnosis import diagnose as diagnose
from lab.errors import LabError as LabError
from lab.explanation import Explanation as Explanation
from lab.explanation import explain as explain
from lab.hardware import ChipProfile as ChipProfile
from lab.hardware import profile as profile
from lab.hlo import Collective as Collective
from lab.hlo import Inspection as Inspection
from lab.hlo import inspect as inspect
from lab.hlo import parse_collectives as parse_collectives
from lab.hlo import summarize as summarize
from lab.mesh import AXES as AXES
from lab.mesh import MeshSpec as MeshSpec
from lab.model import ModelConfig as ModelConfig
from lab.model import preset as preset
from lab.report import Result as Result
from lab.roofline import Roofline as Roofline
from lab.roofline import roofline as roofline
from lab.rules import STRATEGIES as STRATEGIES
from lab.rules import get_strategy as get_strategy
from lab.theory import CollectiveCost as CollectiveCost
from lab.theory import collective_cost as collective_cost
from lab.topology import placement as placement
from lab.training.run import RunConfig as RunConfig
from lab.training.run import RunLog as RunLog
from lab.training.series import SeriesSummary as SeriesSummary
from lab.training.step import TrainConfig as TrainConfig
from lab.training.step import Trainer as Trainer
from lab.verdict import Check as Check
from lab.verdict import Claim as Claim
from lab.verdict import check as check
