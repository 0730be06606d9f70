"""Expert parallelism: two all-to-alls over expert, padded to capacity; experts split; bf16 all-to-alls on TPU."""

import subprocess
import sys

import pytest

from experiments.q41_expert_parallel import Config
from lab.errors import LabError
from lab.registry import get
from tests.experiments.support import pinned

SMALL = Config(
    d_model=16,
    d_ff=32,
    tokens_per_device=32,
    experts=8,
    sweep_experts=(16,),
    sweep_top_k=(),
    sweep_capacity=("none",),
    sweep_ep=(),
    repeats=1,
)


@pytest.fixture(scope="module")
def result(devices):
    return get("expert_parallel").run(SMALL)


def test_bytes_follow_the_padded_buffers_and_the_refinements_come_from_shapes_and_dtypes(result):
    c, d, ep = 10, 16, 8  # C = ceil(32·2/8·1.25) = 10 slots per expert, d = 16
    assert pinned(result) == {
        "E=8 k=2 cf=1.25 EP=8, expert_parallel: every output within 1e-05 of the reference with the same groups": (
            "agrees"
        ),
        "E=8 k=2 cf=1.25 EP=8, gshard: every output within 1e-05 of the reference with the same groups": "agrees",
        "E=8 k=2 cf=none EP=8, expert_parallel: every output within 1e-05 of the single-device MoE": "agrees",
        "E=8 k=2 cf=none EP=8, gshard: every output within 1e-05 of the single-device MoE": "agrees",
        "every case: the hand-written layer's all-to-alls, over which axes": "agrees",
        "E=8 k=2 cf=1.25 EP=8: hand-written all-to-all bytes per device = 2·E·C·d·4": "agrees",
        "E=8 k=2 cf=1.25 EP=8: GShard-style (XLA-inserted) all-to-all bytes per device = 2·E·C·d·4": "agrees",
        "E=16 k=2 cf=1.25 EP=8: hand-written all-to-all bytes per device = 2·E·C·d·4": "agrees",
        "E=16 k=2 cf=1.25 EP=8: GShard-style (XLA-inserted) all-to-all bytes per device = 2·E·C·d·4": "agrees",
        "E=8 k=2 cf=none EP=8: hand-written all-to-all bytes per device = 2·E·C·d·4": "agrees",
        "E=8 k=2 cf=none EP=8: GShard-style (XLA-inserted) all-to-all bytes per device = 2·E·C·d·4": "agrees",
        # the textbook's 2·B·L·d·k·4 = 64 KiB; the compiled operands hold E·C slots: 8 devices x 2·8·10·16·4
        "E=8 k=2 cf=1.25 EP=8: dispatch + combine bytes over the EP group, 2·B·L·d·k·4 with B·L = 256": (
            "refined",
            ep * 2 * 8 * c * d * 4,
        ),
        "E=16 k=2 cf=1.25 EP=8: argument bytes per device minus the base case's, 2·Δ(E/EP)·d·f·4 + ΔE·(d+1)·4": (
            "agrees"
        ),
        "data=2,fsdp=2,expert=2: forward all-gathers over fsdp, the local experts' weights whole, 2·(E/EP)·d·f·4": (
            "agrees"
        ),
        "data=2,fsdp=2,expert=2: forward + backward all-to-alls over expert (dispatch, combine and their transposes)": (
            "agrees"
        ),
        "data=2,fsdp=2,expert=2: backward reduce-scatters over fsdp, the expert-weight gradients, 2·(E/EP)·d·f·4": (
            "agrees"
        ),
        # summed over data on the whole gathered weights (4 experts, d=16, f=32, w_in and w_out), not on the shard
        "data=2,fsdp=2,expert=2: backward all-reduce over data, the expert-weight gradients' 1/fsdp shard, "
        "2·(E/EP)·d·(f/fsdp)·4": ("refined", 4 * 2 * 16 * 32 * 4),
        # default precision: dispatch in bf16, combine in f32 (hand-written), both bf16 (GShard): E·C·d = 1280 each
        "tpu:v5e:2x4 expert_parallel (default precision): all-to-all bytes per chip, f32 2·E·C·d·4": (
            "refined",
            1280 * 2 + 1280 * 4,
        ),
        "tpu:v5e:2x4 gshard (default precision): all-to-all bytes per chip, f32 2·E·C·d·4": ("refined", 1280 * 4),
        "tpu:v5e:2x4 expert_parallel (highest precision): all-to-all bytes per chip, f32 2·E·C·d·4": "agrees",
        "tpu:v5e:2x4 gshard (highest precision): all-to-all bytes per chip, f32 2·E·C·d·4": "agrees",
    }


def test_the_claims_are_judged_from_this_run(result):
    assert [(c.claim, c.status) for c in result.claims] == [
        ("EP puts different experts on different devices, so no device holds them all", "confirmed"),
        ("an EP layer moves tokens with two all-to-alls: dispatch, then combine", "confirmed"),
        ("EP's communication is 2·B·L·d·k", "refined"),
        ("the all-to-all's volume depends on the routing (which tokens go to which experts)", "refined"),
        ("EP combines with data parallelism and ZeRO-3/FSDP, at the price of more kinds of communication", "confirmed"),
    ]


def test_the_page_draws_its_plot(result):
    assert set(result.plots) == {"bytes"}
    result.plots["bytes"]()


def test_expert_parallel_rejects_a_bad_capacity_factor(devices):
    with pytest.raises(LabError, match="capacity factor 'lots'"):
        get("expert_parallel").run(Config(sweep_capacity=("lots",), tpu_topology=""))


def test_experts_not_divisible_by_the_expert_axis_exit_2_with_one_line():
    done = subprocess.run(
        [sys.executable, "-m", "lab", "run", "expert_parallel", "--experts", "12", "--tpu-topology", ""],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert (
        "12 experts are not divisible by the expert axis" in done.stderr and len(done.stderr.strip().splitlines()) == 1
    ), done.stderr
