"""A Pallas TPU kernel's grid and blocks, read back from the Mosaic module its custom call carries."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import SingleDeviceSharding

from lab.hlo.mosaic import kernel


def _gmm_calls(m: int, k: int, n: int, tiling: tuple[int, int, int], experts: int) -> list[str]:
    """The attributes of each tpu_custom_call in megablox's gmm of [m, k] rows by [E, k, n], compiled for one v5e
    chip (compile-only)."""
    from jax.experimental.pallas.ops.tpu.megablox import ops as megablox

    from lab.targets.devices import topology_devices

    on = SingleDeviceSharding(topology_devices("v5e:2x2")[0])
    shapes = [((m, k), jnp.bfloat16), ((experts, k, n), jnp.bfloat16), ((experts,), jnp.int32)]
    args = [jax.ShapeDtypeStruct(shape, dtype, sharding=on) for shape, dtype in shapes]
    step = jax.jit(lambda x, w, sizes: megablox.gmm(x, w, sizes, jnp.bfloat16, tiling))
    text = step.lower(*args).compile().as_text()
    return [line.split("custom_call_target=", 1)[1] for line in text.splitlines() if "tpu_custom_call" in line]


def test_a_grouped_matmul_shows_its_tiles_and_its_grid_with_the_row_tiles_set_when_it_runs():
    """[2048, 256] x [8, 256, 1536] in tiles of (512, 256, 1024): 1536 columns are two tiles of 1024 (the second
    half masked), one contraction tile, and the row tiles to visit counted at run time."""
    (attrs,) = _gmm_calls(2048, 256, 1536, (512, 256, 1024), 8)
    found = kernel(attrs)
    assert found is not None
    assert found.grid == (2, None, 1)
    assert found.blocks == ((512, 256), (1, 256, 1024), (512, 1024))


@pytest.mark.parametrize("attrs", ['"body":"TUzvUgFNTElSMjMu"', 'backend_config={"custom_call_config":{}}', "{}"])
def test_a_body_that_is_not_a_readable_module_is_none(attrs):
    assert kernel(attrs) is None
