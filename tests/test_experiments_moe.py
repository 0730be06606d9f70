"""The MoE experiments run end to end on small configs; their deterministic checks hold.

The drift of an unbalanced router and every timing are reported on the pages,
never asserted here.
"""

import subprocess
import sys

import numpy as np
import pytest

from experiments import get
from experiments.q41_expert_parallel import Config as ExpertParallelConfig
from experiments.q42_hot_expert import Config as HotExpertConfig
from experiments.q42_moe_load_balance import Config as LoadBalanceConfig
from lab.errors import LabError
from lab.report import render


def test_expert_parallel_hlo_matches_padded_theory_and_numerics_hold(devices):
    config = ExpertParallelConfig(
        d_model=16,
        d_ff=32,
        tokens_per_device=32,
        experts=8,
        sweep_experts=(),
        sweep_top_k=(),
        sweep_capacity=("none",),
        sweep_ep=(),
        repeats=1,
        tpu_topology="",
    )
    result = get("expert_parallel").run(config)
    assert result.passed, [c for c in result.checks if not c.passed]
    verdicts = {c.quantity: c.verdict for c in result.checks}
    assert (
        verdicts["every case: the hand-written layer compiles to exactly 2 all-to-alls, both over expert"] == "agrees"
    )
    assert any("2·B·L·d·k" in q and v == "refined" for q, v in verdicts.items())  # padding to capacity
    assert any("single-device MoE" in q and v == "agrees" for q, v in verdicts.items())
    assert "Question #41" in render(result) and "bytes" in result.plots


def test_expert_parallel_rejects_a_bad_capacity_factor(devices):
    with pytest.raises(LabError, match="capacity factor 'lots'"):
        get("expert_parallel").run(ExpertParallelConfig(sweep_capacity=("lots",), tpu_topology=""))


def test_moe_load_balance_records_every_step_and_checks_the_switch_loss(devices):
    config = LoadBalanceConfig(steps=24, batch=4, layers=1, aux_alphas=(0.1,), noise_std=0.0)
    result = get("moe_load_balance").run(config)
    history = result.data["no balancing"]
    assert np.asarray(history["tokens_per_expert"]).shape == (24, 1, 8)
    assert np.allclose(
        np.asarray(history["tokens_per_expert"]).sum(-1), 4 * 32
    )  # top-1: every token chosen once per layer
    verdicts = {c.quantity: c.verdict for c in result.checks}
    assert verdicts["aux loss α=0.1: Switch loss at step 0, router near uniform (theory α·N·Σ f·(1/N) = α)"] == "agrees"
    assert verdicts["expert choice: every expert takes exactly C tokens at every step (max/mean)"] == "agrees"
    assert set(result.plots) == {"load_over_steps", "imbalance", "loss_vs_balance"}


def test_hot_expert_drops_what_theory_says_at_every_share(devices):
    config = HotExpertConfig(
        slots=8,
        tokens_per_device=32,
        d_model=16,
        d_ff=32,
        hot_shares=(0.125, 0.5),
        capacity_factors=("1.0", "none"),
        replicas=(1, 2),
        replicated_at=1.0,
        repeats=1,
    )
    result = get("hot_expert").run(config)
    assert result.passed, [c for c in result.checks if not c.passed]
    dropped = {(d["hot_share"], d["capacity_factor"]): d["measured"] for d in result.data["dropped"]}
    assert dropped[0.5, 1.0] == pytest.approx((16 - 4) / 32)  # 16 tokens want a 4-slot expert
    assert dropped[0.5, None] == 0.0


def test_hot_expert_needs_the_replicated_capacity_among_the_factors(devices):
    with pytest.raises(LabError, match=r"replicated_at=3\.0"):
        get("hot_expert").run(HotExpertConfig(replicated_at=3.0))


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
