"""What XLA actually did: a compiled program's HLO, read back into collectives, mesh axes and a schedule.

``jax.jit(f).lower(*args).compile().as_text()`` is the optimized HLO the
compiler will run. This package reads it, in one direction::

    text         one HLO instruction reader: computations, instruction lines, shapes and bytes
      |
    sources      the stack-frame tables: which line of the user's Python made an instruction
    groups       replica groups in XLA's three notations (explicit, iota, mesh) -> device groups -> mesh axes
      |
    collectives  every collective as one `Collective` (async pairs, fusions, combined tuples), `summarize`
      |
    schedule     the window each collective's transfer has in the schedule, priced: what overlap hides
    attribution  why each collective is there: the parameter, gradient, input or activations it moves
    inspection   compile a program and collect it all: `inspect` -> `Inspection` (HLO, collectives, memory, cost)
    dumps        the folder XLA_FLAGS=--xla_dump_to writes: its optimized modules, memory and device assignment

`lab.hlo.text` is the only module that knows what an HLO line looks like;
the others are built on its `Instruction`. Nothing here imports `lab.bench`
(which times what this package reads).

The names below are the package's public API; the submodules hold the rest
(``from lab.hlo.schedule import overlap_report``).
"""

from lab.hlo.collectives import Collective as Collective
from lab.hlo.collectives import CollectiveTotal as CollectiveTotal
from lab.hlo.collectives import Skipped as Skipped
from lab.hlo.collectives import parse_collectives as parse_collectives
from lab.hlo.collectives import summarize as summarize
from lab.hlo.groups import expand_replica_groups as expand_replica_groups
from lab.hlo.inspection import Inspection as Inspection
from lab.hlo.inspection import format_cost as format_cost
from lab.hlo.inspection import format_memory as format_memory
from lab.hlo.inspection import inspect as inspect
from lab.hlo.inspection import inspect_compiled as inspect_compiled
from lab.hlo.inspection import inspect_lowered as inspect_lowered
from lab.hlo.inspection import lower as lower
from lab.hlo.inspection import summary_table as summary_table
from lab.hlo.sources import source_of as source_of
from lab.hlo.sources import stack_frames as stack_frames
from lab.hlo.text import HEADER as HEADER
from lab.hlo.text import INSTRUCTION as INSTRUCTION
from lab.hlo.text import OP_NAME as OP_NAME
from lab.hlo.text import Instruction as Instruction
from lab.hlo.text import computations as computations
from lab.hlo.text import module_devices as module_devices
from lab.hlo.text import op_names as op_names
from lab.hlo.text import parse_instruction as parse_instruction
