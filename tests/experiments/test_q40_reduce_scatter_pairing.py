"""Why reduce-scatter and all-gather pair up: the update between them needs only the shard, read from the HLO."""

import pytest

from experiments import q40_reduce_scatter_pairing as pairing
from experiments.q40_reduce_scatter_pairing import Config
from lab.registry import get
from tests.experiments.support import pinned


@pytest.fixture(scope="module")
def result(devices):
    return get("reduce_scatter_pairing").run(Config())


def test_nothing_but_the_shard_lies_between_the_reduction_and_the_gather(result):
    programs = {
        "hand-written sharded AdamW (shard_map)": ("fed", "between", "largest"),
        "lab zero2 training step (XLA-inserted)": ("fed", "between"),
        "lab zero3 training step (XLA-inserted)": ("after",),
    }
    words = {
        "fed": "weight all-gathers fed directly by a gradient reduction",
        "between": "collectives between the reduction and the all-gather",
        "largest": "largest array between them (elements) = one shard, D/N",
        "after": "all-gathers of updated weights in the step",
    }
    expected = {
        "hand-written step: every device's updated weight against AdamW on the summed gradient "
        "(largest difference, float32 ulps of max(|w|, |w'|))": "agrees"
    }
    for target in ("cpu:8", "tpu:v5e:2x4"):
        for program, checks in programs.items():
            expected |= {f"{target} {program}: {words[w]}": "agrees" for w in checks}
    assert pinned(result) == expected


def test_the_claims_are_judged_from_this_run(result):
    assert [c.status for c in result.claims] == [
        "confirmed",  # the update runs on the shard, nothing in between, within 1 ulp of unsharded AdamW
        "refined",  # the lab's ZeRO-2 pairs them, but XLA reduces with all-reduce + slice, not reduce-scatter
        "confirmed",  # ZeRO-3 gathers in the forward, not after the update
    ]


HLO = """HloModule m, num_partitions=2

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

ENTRY %main (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  %rs = f32[4]{0} reduce-scatter(%p), replica_groups={{0,1}}, dimensions={0}, to_apply=%add
  %u = f32[4]{0} multiply(%rs, %rs)
  ROOT %ag = f32[8]{0} all-gather(%u), replica_groups={{0,1}}, dimensions={0}
}
"""


def test_the_entry_computation_is_read_through_lab_hlo_text():
    name, nodes = pairing._entry(HLO)
    assert name == "main"
    assert {k: (v.opcode, v.operands) for k, v in nodes.items()} == {
        "p": ("parameter", ()),
        "rs": ("reduce-scatter", ("p",)),
        "u": ("multiply", ("rs", "rs")),
        "ag": ("all-gather", ("u",)),
    }
    assert pairing._upstream(nodes, "ag") == {"u", "rs", "p"}
    assert pairing._largest_array("(f32[4,8]{1,0}, f32[]{})") == 32
