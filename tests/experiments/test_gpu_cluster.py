"""gpu_cluster compiled for two 8-GPU H100 nodes (the CUDA plugin, no GPU): links read from the HLO, checks pinned."""

from dataclasses import replace

import pytest

from experiments.q50_gpu_cluster import Config, WholeStep, judge, measure, whole_step
from lab.registry import get
from lab.report import render
from lab.targets import gpu
from tests.experiments.support import pinned

pytestmark = pytest.mark.skipif(not gpu.cuda_plugin_installed(), reason="needs the gpu extra (CUDA plugin)")
SMALL = Config(nodes=(2,), models=("8b",), sequences=16, sequence_length=256, whole_steps=False)


@pytest.fixture(scope="module")
def observations():
    return measure(SMALL)


@pytest.fixture(scope="module")
def result(observations):
    return get("gpu_cluster").judge(observations, SMALL, {})  # one compile serves the page and the perturbations


def test_every_check_agrees_on_the_compiled_programs(result):
    verdicts = pinned(result)
    assert len(verdicts) == 9 and set(verdicts.values()) == {"agrees"}
    assert "8b on 16 GPUs (2 nodes): FSDP x TP (fsdp=2,tensor=8): bytes per GPU on InfiniBand (closed form)" in verdicts


def test_tp_stays_in_the_node_and_the_page_says_it_predicts(result):
    claims = {c.claim.split(" (")[0]: c.status for c in result.claims}
    assert claims["TP belongs inside the node"] == "confirmed"
    page = render(result)
    assert "Question #50" in page and "not measurements" in page and "step" in result.plots


def test_the_link_checks_fail_when_the_program_crosses_another_link(observations):
    mixed = next(s for s in observations.steps if s.strategy == "FSDP x TP")
    over_tensor = [i for i, c in enumerate(mixed.crossings) if c.seen.axes == ("tensor",)]
    assert over_tensor
    crossings = list(mixed.crossings)
    crossings[over_tensor[0]] = replace(crossings[over_tensor[0]], nodes=2, per_node=4)  # as if TP spanned nodes
    moved = replace(mixed, crossings=tuple(crossings))
    steps = tuple(moved if s is mixed else s for s in observations.steps)
    checks = {c.quantity: c.verdict for c in judge(replace(observations, steps=steps), SMALL).checks}
    label = "8b on 16 GPUs (2 nodes): FSDP x TP (fsdp=2,tensor=8)"
    assert (
        checks[f"{label}: nodes a TP group spans in the HLO's replica groups (TP inside a node: NVLink)"] == "differs"
    )
    assert checks[f"{label}: bytes per GPU on InfiniBand (closed form)"] == "differs"
    assert checks[f"{label}: bytes per GPU on NVLink (closed form)"] == "differs"


def test_the_flops_check_fails_when_the_count_is_off(observations):
    fsdp = next(s for s in observations.steps if s.strategy == "FSDP")
    steps = tuple(replace(s, flops=s.flops * 1.01) if s is fsdp else s for s in observations.steps)
    checks = judge(replace(observations, steps=steps), SMALL).checks
    assert [c.verdict for c in checks if "FLOPs" in c.quantity and ": FSDP (" in c.quantity] == ["differs"]


def test_the_whole_step_claim_follows_lab_predicts_two_steps(observations):
    def whole(tp_faster: bool):
        return tuple(
            WholeStep("8b", strategy, 16, 3.0, 1.0 if (strategy == "FSDP x TP") == tp_faster else 2.0, 0.9, {})
            for strategy in ("FSDP", "FSDP x TP")
        )

    def claim(tp_faster: bool):
        claims = judge(replace(observations, whole=whole(tp_faster)), SMALL).claims
        return next(c for c in claims if c.claim.endswith("(the whole step)"))

    assert (claim(True).status, claim(False).status) == ("confirmed", "refuted")
    assert "8b on 16 GPUs: lab predict's step with flash attention, FSDP 1.000 s" in claim(False).numbers
    assert not any(c.claim.endswith("(the whole step)") for c in judge(observations, SMALL).claims)  # none measured


def test_the_whole_step_is_lab_predicts_llama_at_the_pages_batch(monkeypatch):
    from lab.predict import command

    class Asked(Exception):
        """Stops whole_step at the prediction: the command is what is checked, not a compile."""

    def ask(c):
        asked.append(c)
        raise Asked

    asked = []
    monkeypatch.setattr(command, "run_prediction", ask)
    with pytest.raises(Asked):
        whole_step("70b", "FSDP x TP", "fsdp=-1,tensor=8", "gpu:h100:4x8", 32, Config())
    (c,) = asked
    assert (c.model, c.seq, c.batch_per_device, c.mesh, c.target) == (
        "llama3-70b",
        2048,
        8,
        "fsdp=-1,tensor=8",
        "gpu:h100:4x8",
    )
    assert c.layers_compiled == 2 and c.remat == "full"
