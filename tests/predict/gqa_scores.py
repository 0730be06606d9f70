"""A grouped-query attention step compiled for XLA:GPU with cuBLAS GEMMs (MaxText's flag), and the ops
`lab.predict.ops.score_ops` finds in it: a module of its own, so that a spawned process can run it (XLA:GPU takes
its flags once, when it starts)."""

from lab.predict import calibration
from lab.predict.command import Predict, read_step
from lab.predict.ops import score_ops


def score_ops_of_a_gqa_step() -> tuple[set, set, set, set]:
    """In a process of its own: XLA:GPU takes the cuBLAS flag (MaxText's) once, when it starts."""
    gqa = "layers=2,d_model=256,heads=8,kv_heads=2,head_dim=32,d_ff=512,vocab=512,mlp=swiglu"
    command = Predict(
        model=gqa, target="gpu:h100:1x2", seq=256, mesh="fsdp=2", xla_flags="--xla_gpu_enable_triton_gemm=false"
    )
    reading = read_step(command)
    step = reading.read.predict(calibration.efficiency("h100"))
    found = {op.name for op in score_ops(reading.read, step, 256, 8)}

    def named(*parts: str) -> set:
        return {op.name for op in step.ops if any(part in op.op_name for part in parts)}

    return (
        found,
        named("bsgrk,btgk->bgrst/dot_general"),
        named("bgrst,btgk->bsgrk/dot_general"),
        named("mlp/", "bsd,", "->bsd"),
    )
