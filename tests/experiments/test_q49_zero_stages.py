"""ZeRO stages: the paper's bytes against XLA's, each difference refined by a number read from the HLO."""

import pytest

from experiments.q49_zero_stages import Config, Parameter, _padded
from lab.registry import get
from tests.experiments.support import pinned

pytestmark = (
    pytest.mark.long
)  # every ZeRO stage compiled for the CPU and the TPU compiler: scheduled first (tests/conftest.py)

PSI, BLOCKS, BATCH = 131_392, 98_560, 16 // 8 * 33 * 4  # the tiny model's Ψ, its block weights, tokens per device


@pytest.fixture(scope="module")
def result(devices):
    return get("zero_stages").run(Config(timing_model="tiny", repeats=1))


def test_every_difference_is_refined_by_the_hlo_to_the_byte(result):
    ring, wide = 7 / 8, 4 * PSI  # (N-1)/N; the gradients or weights carried in f32
    cpu = {
        # state: the optimizer's s32 step count is the one array the paper does not count
        "arguments per device = params + optimizer + batch, bytes": {
            "ddp": 14 * PSI + BATCH + 4,
            "zero1": 2 * PSI + 12 * PSI // 8 + BATCH + 4,
            "zero2": 2 * PSI + 12 * PSI // 8 + BATCH + 4,
            "zero3": 14 * PSI // 8 + BATCH + 4,
            "zero3-keep": 14 * PSI // 8 + BATCH + 4,
        },
        # the gradients and the loss, and the output tuple's index table: 12 arrays, 8 bytes each
        "gradients program's outputs per device = gradients + the f32 loss, bytes": {
            "ddp": 2 * PSI + 4 + 96,
            "zero1": 2 * PSI + 4 + 96,
            "zero2": 2 * PSI // 8 + 4 + 96,
            "zero3": 2 * PSI // 8 + 4 + 96,
            "zero3-keep": 2 * PSI // 8 + 4 + 96,
        },
        # f32 on the wire; gradient reductions written as all-reduce (2(N-1)/N); the loss combined into DDP's
        "bytes sent per device per step (ring)": {
            "ddp": 2 * ring * (wide + 4),
            "zero1": ring * wide + 2 * ring * wide,
            "zero2": ring * wide + 2 * ring * wide,
            "zero3": ring * 4 * (PSI + BLOCKS) + 2 * ring * wide,
            "zero3-keep": ring * wide + 2 * ring * wide,
        },
    }
    tpu = {  # bf16 on the wire; the layouts' tiles pad the state; part of the reduce-scatter done by all-reduce
        "arguments per device = params + optimizer + batch, bytes": {
            "ddp": 2304512,
            "zero1": 879104,
            "zero2": 879104,
            "zero3": 641536,
            "zero3-keep": 641536,
        },
        "bytes sent per device per step (ring)": {
            "zero1": 632576,
            "zero2": 632576,
            "zero3": 691264,
            "zero3-keep": 518336,
        },
    }
    expected = {f"cpu:8 {s}: {q}": ("refined", v) for q, by in cpu.items() for s, v in by.items()}
    expected |= {f"tpu:v5e:2x4 {s}: {q}": ("refined", v) for q, by in tpu.items() for s, v in by.items()}
    expected["tpu:v5e:2x4 ddp: bytes sent per device per step (ring)"] = "agrees"
    expected["cpu:8: ZeRO-3 bytes sent / DDP bytes sent"] = (
        "refined",
        cpu["bytes sent per device per step (ring)"]["zero3"] / cpu["bytes sent per device per step (ring)"]["ddp"],
    )
    expected["tpu:v5e:2x4: ZeRO-3 bytes sent / DDP bytes sent"] = ("refined", 691264 / 459872)
    got = pinned(result)
    assert got.keys() == expected.keys()
    for quantity, want in expected.items():
        if isinstance(want, tuple):
            assert got[quantity][0] == want[0] and got[quantity][1] == pytest.approx(want[1], rel=1e-12), quantity
        else:
            assert got[quantity] == want, quantity


def test_zero3_moves_more_than_ddp_so_the_same_traffic_claim_is_refuted(result):
    assert [(c.claim.split(" (")[0], c.status) for c in result.claims] == [
        ("ZeRO-3 / FSDP moves the same bytes as DDP", "refuted"),
        ("ZeRO-1/2's reduce-scatter + all-gather moves the same bytes as DDP's all-reduce", "refined"),
        ("Sharding weights, gradients and optimizer state cuts the memory each device holds", "refined"),
    ]


def test_a_tiled_layout_pads_its_two_minor_dimensions_and_a_scalar_to_a_row():
    assert _padded(Parameter("bf16", (2, 64, 4, 16), "1,3,2,0:T(8,128)(2,1)")) == 2 * 4 * 16 * 128 * 2
    assert _padded(Parameter("s32", (), ":T(128)")) == 128 * 4
    assert _padded(Parameter("bf16", (64,), "0:T(256)(128)(2,1)")) == 256 * 2
    assert _padded(Parameter("f32", (64, 256), "1,0")) == 64 * 256 * 4
