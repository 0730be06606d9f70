"""The pipeline experiments run end to end on small configs; their deterministic checks hold.

Timing verdicts (measured bubbles, predicted step times) are reported on the
pages and never asserted. The shapes match tests/test_pipeline_loop.py, so
the compiled programs are shared within the session.
"""

import json

import pytest

from experiments import get
from experiments.q43_pipeline_bubble import Config as BubbleConfig
from experiments.q43_stage_imbalance import Config as ImbalanceConfig
from experiments.q44_microbatches import Config as MicroBatchConfig
from lab.errors import LabError
from lab.report import render, write

TIMED = (
    "bubble, measured",
    "step time",
    "the most blocks",
    "imbalanced / rebalanced",
    "rule of thumb",
    "best measured m",
)


def deterministic(result):
    return [c for c in result.checks if not any(word in c.quantity for word in TIMED)]


def test_pipeline_bubble_simulates_executes_and_corrects_the_worked_example(devices, tmp_path):
    config = BubbleConfig(
        stages=(2, 4), micro_batches=8, measured_stages=(2,), measured_micro_batches=(4,), micro_batch_size=2, repeats=1
    )
    result = get("pipeline_bubble").run(config)
    checks = deterministic(result)
    assert all(c.passed for c in checks), [c for c in checks if not c.passed]
    by_name = {c.quantity: c for c in result.checks}
    total = next(c for q, c in by_name.items() if "quick-reference's total" in q)
    assert (total.theory, total.observed, total.verdict) == (11, 14.0, "refined")
    assert next(c for q, c in by_name.items() if "before their input exists" in q).observed == 12
    assert any("executed 1f1b P=2 m=4: loss" in q and c.verdict == "agrees" for q, c in by_name.items())
    assert any("executed interleaved" in q and c.verdict == "agrees" for q, c in by_name.items())
    page = write(result, tmp_path)
    assert "B0 on stage 0 starts at 4" in page.read_text() and (tmp_path / "pipeline_bubble" / "timelines.png").exists()
    folder = tmp_path / "pipeline_bubble"
    traces = {path.stem.removeprefix("trace_"): json.loads(path.read_text()) for path in folder.glob("trace_*.json")}
    assert set(traces) == {"gpipe", "1f1b", "interleaved", "zb-h1"}
    assert all(
        any(event["ph"] == "X" for event in trace["traceEvents"]) for trace in traces.values()
    )  # opens in Perfetto
    assert "[trace_gpipe.json](trace_gpipe.json)" in page.read_text()


def test_microbatches_reads_activation_memory_from_xla(devices):
    config = MicroBatchConfig(stages=2, batch=8, micro_batches=(2, 4), gpipe_micro_batches=(4,), repeats=1)
    result = get("microbatches").run(config)
    checks = deterministic(result)
    assert all(c.passed for c in checks), [c for c in checks if not c.passed]
    rows = {r["m"]: r for r in result.data["rows"]}
    assert rows[4]["depth"] == 2 and result.data["gpipe"][4]["depth"] == 4  # P against m micro-batches kept
    assert rows[4]["temp"] < result.data["gpipe"][4]["temp"]
    assert "Question #44" in render(result)


def test_stage_imbalance_simulates_the_textbook_case_and_rebalances(devices):
    result = get("stage_imbalance").run(ImbalanceConfig(split="1,3", micro_batches=2, micro_batch_size=4, repeats=1))
    checks = deterministic(result)
    assert all(c.passed for c in checks), [c for c in checks if not c.passed]
    assert [r["split"] for r in result.data["runs"]] == [(1, 3), (2, 2)]
    assert result.data["textbook"]["makespan"]["gpipe"] == pytest.approx(6 + 1 * 4)


def test_pipeline_experiments_reject_bad_input(devices):
    with pytest.raises(LabError, match="needs a stage axis of 16"):
        get("pipeline_bubble").run(BubbleConfig(measured_stages=(16,)))
    with pytest.raises(LabError, match="do not split into v=3 chunks"):
        get("pipeline_bubble").run(BubbleConfig(chunks=3))
    with pytest.raises(LabError, match="does not split into m=3"):
        get("microbatches").run(MicroBatchConfig(batch=8, micro_batches=(1, 3)))
    with pytest.raises(LabError, match="integers separated by commas"):
        get("stage_imbalance").run(ImbalanceConfig(split="4,four"))
