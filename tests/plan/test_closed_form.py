"""The closed form's attention kernels against the kernels libtpu compiles (the compiled prediction's side)."""

from dataclasses import replace

import pytest

from lab.plan.closed_form import _flash_bytes
from lab.predict import calibration
from lab.predict.command import Predict, read_step
from lab.predict.spec import parse_model

NARROW = "layers=2,d_model=128,heads=8,kv_heads=2,head_dim=16,d_ff=448,vocab=1024,mlp=swiglu"  # layout_plans' proxy


@pytest.mark.parametrize("seq", [256, 1024])
def test_the_flash_kernels_bytes_are_what_the_compiled_kernels_read_and_write(seq):
    """Each flash kernel of the compiled step (forward, dK/dV, dQ) moves the bytes `_flash_bytes` derives from the
    kernel's declared operands and results, and the statistics' broadcasts the rest; one sequence per chip, so per
    chip `seq` tokens, read from the ops the compiled prediction prices."""
    reading = read_step(Predict(model=NARROW, seq=seq, mesh="data=8", target="tpu:v5e:2x4", remat="none"))
    step = reading.read.predict(calibration.efficiency("v5e"))
    layers = 2

    def moved(*parts: str) -> float:
        ops = [o for o in step.ops if "flash" in o.op_name and all(part in o.op_name for part in parts)]
        return sum(o.bytes * o.runs for o in ops) / layers / seq

    forward, dkv, dq, broadcasts = _flash_bytes(replace(parse_model(NARROW), seq=seq, attention="flash"), 1)
    assert moved("jit(flash_attention)/pallas_call") == forward
    assert moved("flash_mha_bwd_dkv", "pallas_call") == dkv
    assert moved("flash_mha_bwd_dq", "pallas_call") == dq
    # the broadcasts write `broadcasts` and read their [.., S] fp32 statistics, under 2% of it (not priced)
    assert broadcasts < moved("broadcast_in_dim") < 1.02 * broadcasts
