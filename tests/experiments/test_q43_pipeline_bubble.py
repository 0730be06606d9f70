"""Pipeline bubbles: the simulator, the compiled schedule and the numerics agree with the formulas; the
quick-reference's worked example is refuted with numbers. Timings are on the page, never asserted."""

import json

import pytest

from experiments.q43_pipeline_bubble import Config
from lab.errors import LabError
from lab.registry import get
from lab.report import write
from tests.experiments.support import pinned

CONFIG = Config(
    stages=(2, 4), micro_batches=8, measured_stages=(2,), measured_micro_batches=(4,), micro_batch_size=2, repeats=1
)


@pytest.fixture(scope="module")
def result(devices):
    return get("pipeline_bubble").run(CONFIG)


def test_simulator_compiled_schedule_and_numerics_agree(result):
    span = "(P in [2, 4], m = 1..8)"
    executed = {
        f"executed {name} P=2 m=4: {what}": "agrees"
        for name in ("gpipe", "1f1b")
        for what in (
            "ticks the step loop runs = 2(m+P-1)",
            "idle share of the step's (tick, stage) slots = (P-1)/(m+P-1)",
            "micro-batches its tables keep alive on one device" + (" = m" if name == "gpipe" else " = min(P, m)"),
            "loss against the same model without a pipeline",
            "gradient elements off the unpipelined model's by more than 1e-05 of the largest",
        )
    }
    assert pinned(result) == {
        f"simulated GPipe bubble = (P-1)/(m+P-1): (P, m) points that agree {span}": "agrees",
        f"simulated 1F1B bubble = GPipe's (P-1)/(m+P-1): (P, m) points that agree {span}": "agrees",
        "simulated interleaved v=2 bubble = (P-1)/(v·m+P-1): points that agree (m a multiple of P)": "agrees",
        "simulated GPipe peak micro-batches in flight on stage 0 = m: points that agree": "agrees",
        "simulated 1F1B peak micro-batches in flight on stage 0 = min(P, m): points that agree": "agrees",
        "simulated interleaved v=2 peak in flight on stage 0 = min(m, P + (P-1)/v): points that agree": "agrees",
        "simulated ZB-H1 makespan = m(F+I+W) + (P-1)(F+I-W), F=I=W (m >= P): points that agree": "agrees",
        "simulated ZB-H1 peak in flight on stage 0 = 1F1B's min(P, m): points that agree": "agrees",
        "P=4, m=4 GPipe makespan: (m+P-1)(F+B) against the simulator (ticks)": "agrees",
        "P=4, m=4 GPipe bubble: (P-1)/(m+P-1) against the simulator": "agrees",
        **executed,
        "executed P=2: collective-permutes in the tick loop (one forward, one backward)": "agrees",
        "executed P=2: mesh axes of the permutes": "agrees",
        "executed P=2: bytes per permute = one micro-batch's activation b·S·D·4": "agrees",
        "executed P=2: other collectives (the loss, summed over stages once)": "agrees",
        "executed interleaved P=2 m=4 v=2: ticks the step loop runs = 2(v·m+P-1)": "agrees",
        "executed interleaved P=2 m=4 v=2: idle share of the step's (tick, stage) slots = (P-1)/(v·m+P-1)": "agrees",
        "executed interleaved P=2 m=4 v=2: loss against the same model without a pipeline": "agrees",
        "executed interleaved P=2 m=4 v=2: gradient elements off the unpipelined model's by more than 1e-05 of the "
        "largest": "agrees",
    }
    # the clock is judged only by bounds this host can show, and never pinned
    assert {c.kind for c in result.checks if "clock" in c.quantity or "host sharing" in c.quantity} == {"timing"}


def test_the_claims_are_judged_from_this_run(result):
    assert [(c.claim, c.status) for c in result.claims] == [
        ("GPipe's bubble is (P-1)/(m+P-1)", "confirmed"),
        ("the P=4, m=4 example takes 4+4+4-1 = 11 ticks", "refuted"),
        ("the ideal of the P=4, m=4 example is 4x4 = 16 ticks", "refuted"),
        ("the P=4, m=4 figure is a schedule that can run", "refuted"),
        ("1F1B makes the bubble smaller than GPipe's", "refuted"),
        ("1F1B has to keep more activations than GPipe", "refuted"),
    ]
    ledger = {c.claim: c.numbers for c in result.claims}
    assert "14 ticks" in ledger["the P=4, m=4 example takes 4+4+4-1 = 11 ticks"]
    assert ledger["the P=4, m=4 figure is a schedule that can run"].startswith("12 of its actions")


def test_the_page_draws_the_worked_example_and_writes_perfetto_traces(result, tmp_path):
    page = write(result, tmp_path)
    text = page.read_text()
    assert "B0 on stage 0 starts at 4" in text and "not evidence for the bubble" in text
    folder = tmp_path / "pipeline_bubble"
    assert (folder / "timelines.png").exists() and (folder / "bubble.png").exists()
    traces = {path.stem.removeprefix("trace_"): json.loads(path.read_text()) for path in folder.glob("trace_*.json")}
    assert set(traces) == {"gpipe", "1f1b", "interleaved", "zb-h1"}
    assert all(any(event["ph"] == "X" for event in trace["traceEvents"]) for trace in traces.values())  # Perfetto
    assert "[trace_gpipe.json](trace_gpipe.json)" in text


def test_bad_input_is_a_lab_error(devices):
    with pytest.raises(LabError, match="needs a stage axis of 16"):
        get("pipeline_bubble").run(Config(measured_stages=(16,)))
    with pytest.raises(LabError, match="do not split into v=3 chunks"):
        get("pipeline_bubble").run(Config(chunks=3))
