"""The sharding lab: distributed-training theory next to what XLA actually did.

The public API is listed here explicitly; everything else is internal.
"""

from lab.devices import DEFAULT_TARGET as DEFAULT_TARGET
from lab.devices import Target as Target
from lab.devices import devices_for as devices_for
from lab.devices import parse_target as parse_target
from lab.errors import LabError as LabError
from lab.mesh import AXES as AXES
from lab.mesh import MeshSpec as MeshSpec
