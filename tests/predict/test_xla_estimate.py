"""The compiler's own estimate: XLA:GPU's annotations and libtpu's schedule, read per op and laid over the lab's ops."""

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
    est = xla_estimate.estimate(xla_estimate.xla_times("\n".join([LINE, COLLECTIVE])), step)
    assert est.compute_s == pytest.approx(3 * 250.5e-6) and est.comm_s == pytest.approx(2 * 161.25e-6)
    assert est.unpriced == 1 and est.serial_s == pytest.approx(est.compute_s + est.comm_s)
    assert est.lab_compute_s == pytest.approx(1e-3)  # the lab's seconds for fusion.7 alone: copy.1 is unpriced


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


# a latency-hiding schedule as libtpu dumps it (trimmed): the module's instructions by id, then each computation's
# placed instructions with their estimated start and end in cycles, and the clock
SCHEDULE = """hlo_module {
  name: "jit_step"
  computations {
    name: "body"
    instructions {
      name: "fusion.3"
      opcode: "fusion"
      shape {
        element_type: BF16
      }
      id: 11
      operand_ids: 10
    }
    instructions {
      name: "all-gather-start"
      opcode: "all-gather-start"
      id: 12
    }
    instructions {
      name: "all-gather-done"
      opcode: "all-gather-done"
      id: 13
    }
    id: 2
  }
}
computation_schedules {
  computation_id: 2
  instructions {
    id: 12
    end_timestamp_cycles: 1
  }
  instructions {
    id: 11
    start_timestamp_cycles: 1
    end_timestamp_cycles: 3501
  }
  instructions {
    id: 13
    start_timestamp_cycles: 9000
    end_timestamp_cycles: 9000
  }
  scheduler_statistics {
    total_cycles: 9000
  }
  cycles_per_microsecond: 1750
}
"""


def test_libtpus_schedule_gives_each_op_its_end_less_its_start(tmp_path):
    (tmp_path / f"jit_step{xla_estimate.SCHEDULE_SUFFIX}").write_text(SCHEDULE)
    times = xla_estimate.schedule_times(tmp_path)
    # the fusion's 3500 cycles at 1750 a microsecond; the gather's start takes 1 cycle of its own, its done none
    # (the wait between them is the scheduler's latency, overlapped compute included: not the gather's own time)
    assert times == pytest.approx({"fusion.3": 2e-6, "all-gather-start": 1 / 1750e6})
    assert xla_estimate.schedule_times(tmp_path / "nothing") == {}


def test_libtpu_dumps_its_schedule_per_compile_and_it_names_the_programs_ops(tmp_path):
    """A compile-only TPU step with the options: libtpu writes the schedule, and its ops are the program's."""
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from lab.mesh import MeshSpec
    from lab.targets.devices import topology_devices

    mesh = MeshSpec(fsdp=4).build(topology_devices("v5e:2x2"))

    def loss(w, x):
        return jnp.mean(jnp.tanh(x @ w) ** 2)

    w = jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16, sharding=NamedSharding(mesh, P("fsdp")))
    x = jax.ShapeDtypeStruct((512, 1024), jnp.bfloat16, sharding=NamedSharding(mesh, P("fsdp")))
    compiled = jax.jit(jax.grad(loss)).lower(w, x).compile(xla_estimate.tpu_options(tmp_path))
    times = xla_estimate.schedule_times(tmp_path)
    names = set(re.findall(r"%([\w.\-]+) = ", compiled.as_text()))
    assert times and all(t > 0 for t in times.values())
    assert any(n.startswith(("fusion", "convolution")) for n in times)  # the matmuls, priced by libtpu
    assert set(times) & names  # named as the compiled program names them


def test_the_compilers_prices_are_nearer_on_every_run_some_or_none():
    assert xla_estimate.nearer_status([(0.01, 0.05), (-0.02, 0.03)]) == "confirmed"
    assert xla_estimate.nearer_status([(0.01, 0.05), (0.40, 0.03)]) == "refined"
    assert xla_estimate.nearer_status([(0.41, 0.05), (-0.30, 0.03)]) == "refuted"
