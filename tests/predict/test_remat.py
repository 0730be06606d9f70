"""What each remat name keeps for the backward pass, read from JAX's saved residuals of the predicted step.

``minimal`` is MaxText's: the weight matmuls' outputs (dots without batch dimensions); the attention's scores and
the norms' scale (an einsum with a batch dimension) are recomputed. ``minimal_flash`` also keeps the attention's
output. Sequence parallelism keeps the sub-layers' outputs split over tensor.
"""

import contextlib
import io
import math
import re
from dataclasses import replace

import jax
import pytest
from jax.ad_checkpoint import print_saved_residuals

from lab.mesh import MeshSpec
from lab.predict.spec import parse_model
from lab.predict.step import _ChunkedLossTrainer, layout_remat
from lab.training.step import TrainConfig

MODEL = "layers=3,d_model=256,heads=4,kv_heads=2,head_dim=64,d_ff=1024,vocab=1024,mlp=relu,qk_norm=true"
SEQ, BATCH = 128, 8
RESIDUAL = re.compile(r"^(\w+)\[([^\]]*)\](?:\{[^}]*\})? (.*)$")  # bf16[2,8@fsdp,128] output of scan from ...


def _kept_per_layer(devices, remat: str, mesh: str = "fsdp=8", **config) -> list[tuple[tuple[int, ...], str]]:
    """(shape on a device, dtype) of each array the layers' scan keeps for the backward pass, one layer's."""
    model = replace(parse_model(MODEL), seq=SEQ, attention="xla")
    spec = MeshSpec.parse(mesh)
    train = TrainConfig(strategy="zero3", compute_dtype="bfloat16", remat=layout_remat(remat), **config)
    trainer = _ChunkedLossTrainer(model, train, spec.build(devices))
    state, batch = trainer.abstract_state(), trainer.abstract_batch(BATCH)
    printed = io.StringIO()
    with jax.set_mesh(trainer.mesh), contextlib.redirect_stdout(printed):
        print_saved_residuals(lambda p, b: trainer._loss(p, b)[0], state.params, batch)
    kept = []
    for dtype, dims, why in (RESIDUAL.match(line).groups() for line in printed.getvalue().splitlines()):
        shape = tuple(_on_a_device(dim, spec.sizes) for dim in dims.split(",") if dim)
        if why.startswith("output of scan") and shape[:1] == (model.layers,):
            kept.append((shape[1:], dtype))
    return kept


def _on_a_device(dim: str, sizes: dict[str, int]) -> int:
    """One dimension as JAX prints it (``16``, ``16@fsdp``, ``16@(fsdp,tensor)``), divided by its axes."""
    size, _, axes = dim.partition("@")
    return int(size) // math.prod(sizes[a] for a in re.findall(r"\w+", axes))


def _bytes(kept) -> int:
    return sum(math.prod(shape) * (2 if dtype == "bf16" else 4) for shape, dtype in kept)


@pytest.mark.parametrize("remat", ["minimal", "minimal_flash"])
def test_minimal_keeps_the_weight_matmuls_outputs_as_maxtexts(devices, remat):
    b = BATCH // 8  # sequences on a device
    q, kv, d, f = (b, SEQ, 4, 64), (b, SEQ, 2, 64), (b, SEQ, 256), (b, SEQ, 1024)
    weight_dots = [q, kv, kv, d, f, d]  # the projections, the out-projection, the MLP's hidden and output
    context = [q] if remat == "minimal_flash" else []  # the attention's output, before the out-projection
    kept = _kept_per_layer(devices, remat)
    assert all(dtype == "bf16" for _, dtype in kept)  # no fp32 norm output, no softmax
    assert sorted(shape for shape, _ in kept) == sorted(weight_dots + context)  # no [b, h, S, S] scores


@pytest.mark.parametrize("remat", ["minimal", "full"])
def test_sequence_parallelism_keeps_the_sub_layers_outputs_split_over_tensor(devices, remat):
    tp = _kept_per_layer(devices, remat, "fsdp=4,tensor=2")
    sp = _kept_per_layer(devices, remat, "fsdp=4,tensor=2", sequence_parallel=True)
    b, d = BATCH // 4, 256
    whole, split = (b, SEQ, d), (b, SEQ // 2, d)  # the residual stream, whole or split over tensor
    assert whole in {s for s, _ in tp} and whole not in {s for s, _ in sp} and split in {s for s, _ in sp}
    assert _bytes(sp) < _bytes(tp)
