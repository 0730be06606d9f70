"""XLA:GPU's own estimate: the option only annotates, the times are read per op and laid over the lab's ops."""

import re
from dataclasses import replace

import jax
import pytest

from lab.predict import xla_estimate
from lab.predict.ops import OpCost, StepPrediction
from lab.targets import gpu

LINE = (
    '  %fusion.7 = bf16[8,4096]{1,0} fusion(%p.1), kind=kLoop, calls=%fc.7, backend_config={"operation_queue_id":"0",'
    '"reification_cost":[{"end_to_end_cycles":9.9,"exec_time_us":9e9,"compute_time_us":1,"memory_access_time_us":2,'
    '"name":""},{"end_to_end_cycles":3.1,"exec_time_us":250.5,"compute_time_us":1,"memory_access_time_us":2,'
    '"name":"indexing-cost-model"},{"end_to_end_cycles":0,"exec_time_us":0.01,"compute_time_us":0,'
    '"memory_access_time_us":0,"name":"sol"}],"device_type":"DEVICE_TYPE_INVALID"}'
)
COLLECTIVE = (
    '  %all-reduce-start = f32[2]{0} all-reduce-start(%x), channel_id=54, backend_config={"operation_queue_id":"0",'
    '"reification_cost":[{"end_to_end_cycles":0,"exec_time_us":161.25,"compute_time_us":0,'
    '"memory_access_time_us":0,"name":"sol"}],"device_type":"DEVICE_TYPE_INVALID"}'
)


def test_the_indexing_model_is_read_first_then_the_older_one_then_speed_of_light():
    times = xla_estimate.xla_times("\n".join([LINE, COLLECTIVE, "  %p.1 = bf16[8,4096]{1,0} parameter(0)"]))
    assert times == pytest.approx({"fusion.7": 250.5e-6, "all-reduce-start": 161.25e-6})


def test_the_estimate_counts_runs_and_keeps_compute_and_collectives_apart():
    from lab.predict.ops import CommCost

    op = OpCost("fusion.7", "main", "jit(step)/mlp", 3, 0.0, 1e6, 1e-3)
    comm = CommCost("all-reduce", ("data",), "nvlink", "-", 8, 2, 1e-4, 0.0, True, "all-reduce-start")
    step = StepPrediction(1e-3, 1e-3, 0.0, [op, replace(op, name="copy.1")], [comm])
    est = xla_estimate.estimate("\n".join([LINE, COLLECTIVE]), step)
    assert est.compute_s == pytest.approx(3 * 250.5e-6) and est.comm_s == pytest.approx(2 * 161.25e-6)
    assert est.unpriced == 1 and est.serial_s == pytest.approx(est.compute_s + est.comm_s)


@pytest.mark.skipif(not gpu.cuda_plugin_installed(), reason="needs the gpu extra (CUDA plugin)")
def test_the_option_only_annotates_the_program():
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from lab.mesh import MeshSpec
    from lab.targets.devices import gpu_cluster_devices

    mesh = MeshSpec(fsdp=4).build(gpu_cluster_devices("h100:1x4"))

    def loss(w, x):  # a sharded matmul, a softmax and their gradient: GEMM and loop fusions, gathers, reductions
        return jnp.mean(jax.nn.softmax(x @ w) ** 2)

    w = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16, sharding=NamedSharding(mesh, P("fsdp")))
    x = jax.ShapeDtypeStruct((64, 256), jnp.bfloat16, sharding=NamedSharding(mesh, P("fsdp")))
    lowered = jax.jit(jax.value_and_grad(loss)).lower(w, x)
    plain, annotated = lowered.compile().as_text(), lowered.compile(xla_estimate.COMPILER_OPTIONS).as_text()

    def body(text):  # the instructions without their backend configs (the module's header line aside)
        return [re.sub(r",? backend_config=.*", "", line) for line in text.splitlines()[1:]]

    assert body(plain) == body(annotated)
    times = xla_estimate.xla_times(annotated)
    assert not xla_estimate.xla_times(plain) and len(times) >= 3 and all(t > 0 for t in times.values())
    assert any("all-" in name or "reduce-scatter" in name for name in times)  # a collective, by speed of light
