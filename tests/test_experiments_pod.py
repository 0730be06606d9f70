"""Compile-only experiments on TPU topologies (libtpu, no TPU): small configs, deterministic checks."""

from experiments import get
from experiments.q50_scaling_thresholds import Config


def test_scaling_thresholds_counts_flops_and_finds_the_book_threshold_shape():
    config = Config(
        target="tpu:v5p:2x2x2",
        embed=1024,
        mlp=4096,
        batch_per_chip=(64, 8192),
        tensor_ways=(4,),
        pod_topologies=(),
        benchmark_preset="tiny",
        benchmark_topology="v5p:2x2x2",
    )
    result = get("scaling_thresholds").run(config)
    flops = [c for c in result.checks if "FLOPs per chip" in c.quantity]
    assert len(flops) == 3 and all(c.verdict == "agrees" for c in flops), flops
    ratios = {
        name: [row["communication_s"] / row["compute_s"] for row in rows] for name, rows in result.data["sweep"].items()
    }
    # more tokens per chip: compute grows, weight traffic does not, so the ratio falls
    assert all(r[0] > r[-1] for r in ratios.values()), ratios
    assert result.provenance["target"] == "tpu:v5p:2x2x2"
    benchmark = result.data["benchmark"]
    assert (
        benchmark["chips"] == 8
        and benchmark["collectives"] > 0
        and benchmark["bound"] in ("compute", "memory", "communication")
    )
