"""ZeRO-3 and FSDP2 knobs in the HLO: the element types on the wire are refined by probe programs."""

import pytest

from experiments.q49_zero3_vs_fsdp2 import Config
from lab.registry import get
from tests.experiments.support import pinned


@pytest.fixture(scope="module")
def result(devices):
    return get("zero3_vs_fsdp2").run(Config())


def test_each_knob_is_pinned_on_the_cpu_and_the_tpu_compiler(result):
    blocks = 98_560  # the tiny model's block weights
    assert pinned(result) == {
        # XLA:CPU gathers bf16 weights as f32 (the probe shows it on a lone bf16 array): twice the bf16 bytes
        "cpu:8: reshard after forward: S per step beyond keeping the gathered weights = the block weights, bytes": (
            "refined",
            4 * blocks,
        ),
        "cpu:8: reshard_after_forward=False: all-gathers in the backward": "agrees",
        "cpu:8: persistence threshold: S saved per step, bytes": ("refined", 1024),
        "cpu:8: param_dtype=bf16: all-gather element type": ("refined", "f32"),
        "cpu:8: gradient reductions carry the gather's element type": "agrees",
        "cpu:8: fp32 weights cast after the gather: all-gather element type": "agrees",
        "tpu:v5e:2x4: reshard after forward: S per step beyond keeping the gathered weights = the block weights, "
        "bytes": "agrees",
        "tpu:v5e:2x4: reshard_after_forward=False: all-gathers in the backward": "agrees",
        "tpu:v5e:2x4: persistence threshold: S saved per step, bytes": "agrees",
        "tpu:v5e:2x4: param_dtype=bf16: all-gather element type": "agrees",
        "tpu:v5e:2x4: gradient reductions carry the gather's element type": "agrees",
        # the TPU compiler moves the cast before the gather (its probe does the same)
        "tpu:v5e:2x4: fp32 weights cast after the gather: all-gather element type": ("refined", "bf16"),
    }


def test_the_claims_follow_from_the_gathers_and_the_memory(result):
    assert [c.status for c in result.claims] == ["confirmed", "confirmed"]
    assert "gathered on demand in the forward and again in the backward" in result.claims[0].claim
