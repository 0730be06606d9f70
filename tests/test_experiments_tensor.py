"""The tensor-parallel experiments run end to end on small configs; their deterministic checks hold.

Step times are reported on the pages, never asserted here.
"""

from experiments import get
from experiments.q50_tp_fsdp_vs_fsdp import Config as TpFsdpConfig
from experiments.q51_tensor_sequence_parallel import Config as TensorSequenceConfig
from lab.report import render


def test_tensor_sequence_parallel_counts_collectives_and_activations(devices):
    config = TensorSequenceConfig(
        tensor=2, tensor_sweep=(1, 2), memory_batch=2, timing_tensor=8, timing_batch=2, repeats=1, tpu_topology=""
    )
    result = get("tensor_sequence_parallel").run(config)
    assert result.passed, [c for c in result.checks if not c.passed]
    verdicts = {c.quantity: c.verdict for c in result.checks}
    assert verdicts["TP, shard_map: collectives per layer over tensor"] == "agrees"
    assert (
        verdicts["TP+SP, shard_map: collectives per layer over tensor"] == "agrees"
    )  # 4 all-gathers + 4 reduce-scatters
    assert verdicts["TP+SP, shard_map: largest collective S = b·s·h·4 (b on one data shard)"] == "agrees"
    assert verdicts["TP+SP, t=2: activations shrink by (theory factor)"] == "agrees"
    memory = {(r["mode"], r["tensor"]): r["measured"] for r in result.data["memory"]}
    assert memory[("TP+SP", 2)] < memory[("TP", 2)] < memory[("TP", 1)]  # SP splits what TP leaves whole
    assert "Question #51" in render(result) and "activation_memory" in result.plots


def test_tp_fsdp_vs_fsdp_compiles_both_splits_on_a_small_slice():
    config = TpFsdpConfig(topologies=("2x2x2",), dcn_topology="", global_tokens=2048, embed=512, mlp=2048)
    result = get("tp_fsdp_vs_fsdp").run(config)
    assert result.passed, [c for c in result.checks if not c.passed]
    fsdp, tp = result.data["rows"]
    assert fsdp["chips"] == tp["chips"] == 8 and tp["tensor"] >= 2
    assert set(fsdp["per_axis"]) == {"fsdp"} and "tensor" in tp["per_axis"]  # pure FSDP moves nothing over tensor
    assert tp["per_axis"]["fsdp"][1] < fsdp["per_axis"]["fsdp"][1]  # TP shrinks the weights FSDP gathers
    assert "Question #50" in render(result) and "crossover" in result.plots
