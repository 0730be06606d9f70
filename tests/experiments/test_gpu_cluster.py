"""gpu_cluster compiled for two 8-GPU H100 nodes (the CUDA plugin, no GPU): links read from the HLO, checks pinned."""

from dataclasses import replace

import pytest

from experiments.q50_gpu_cluster import Config, judge, measure
from lab.registry import get
from lab.report import render
from lab.targets import gpu
from tests.experiments.support import pinned

pytestmark = pytest.mark.skipif(not gpu.cuda_plugin_installed(), reason="needs the gpu extra (CUDA plugin)")
SMALL = Config(nodes=(2,), models=("8b",), sequences=16, sequence_length=256)


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
    claims = {c.claim.split(" (")[0]: c for c in result.claims}
    assert claims["TP belongs inside the node"].status == "confirmed"
    whole = next(c for c in result.claims if c.claim.endswith("(the whole step)"))  # re-judged on lab predict's step
    assert whole.status in ("confirmed", "refined", "refuted") and "8b on 16 GPUs: lab predict's step" in whole.numbers
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
    assert {w.strategy for w in observations.whole} == {"FSDP", "FSDP x TP"} and all(
        w.step_s >= w.step_with_flash_s > 0 and w.gpus == 16 for w in observations.whole
    )

    def status(tp_faster: bool) -> str:
        whole = tuple(
            replace(w, step_with_flash_s=1.0 if (w.strategy == "FSDP x TP") == tp_faster else 2.0)
            for w in observations.whole
        )
        claims = judge(replace(observations, whole=whole), SMALL).claims
        return next(c.status for c in claims if c.claim.endswith("(the whole step)"))

    assert (status(True), status(False)) == ("confirmed", "refuted")
