"""all-reduce = all-gather(reduce-scatter(x)): identical values, the expected HLO, the same bytes on the CPU."""

import pytest

from experiments.q40_allreduce_equivalence import Config
from lab.registry import get
from tests.experiments.support import pinned


@pytest.fixture(scope="module")
def result(devices):
    return get("allreduce_equivalence").run(Config(sizes=("4K",), repeats=1))


def test_every_exact_check_agrees_on_the_cpu_and_the_tpu_compiler_is_refined_by_its_kinds(result):
    assert pinned(result) == {
        "D=4 KiB: results identical on every device": "agrees",
        "D=4 KiB: the all-reduce program compiles to": "agrees",
        "D=4 KiB: the split program compiles to": "agrees",
        "D=4 KiB: both run on the fsdp axis": "agrees",
        "D=4 KiB: bytes sent per device, all-reduce = 2(N-1)/N·D": "agrees",
        "D=4 KiB: bytes sent per device, reduce-scatter + all-gather": "agrees",
        "tpu:v5e:2x4 all-reduce: bytes sent per chip": "agrees",
        # the TPU compiler wrote all-reduce + all-gather: 2(N-1)/N·D + (N-1)/N·D = 3·7/8·4 KiB
        "tpu:v5e:2x4 reduce-scatter + all-gather: bytes sent per chip": ("refined", 3 * 7 / 8 * 4096),
    }


def test_the_claims_are_judged_from_this_run(result):
    assert [(c.claim, c.status) for c in result.claims] == [
        ("all-reduce(x) = all-gather(reduce-scatter(x))", "confirmed"),
        ("all-reduce and reduce-scatter + all-gather move the same ~2D", "refined"),
    ]
