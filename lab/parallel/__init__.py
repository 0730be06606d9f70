"""Parallelism strategies as layouts over the five-axis mesh.

`fsdp`: DDP, ZeRO-1/2/3 and FSDP (the data-parallel family), as one `Layout`
driven by the rules tables of `lab.rules`.
"""

from lab.parallel.layout import REMAT_POLICIES as REMAT_POLICIES
from lab.parallel.layout import Layout as Layout
