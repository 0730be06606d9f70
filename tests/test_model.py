"""The transformer: declared abstractly with logical axes, created sharded, causal."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lab.errors import LabError
from lab.mesh import MeshSpec
from lab.model import PRESETS, abstract_model, create_params, logical_axes, preset
from lab.parallel import Layout
from lab.rules import LOGICAL_AXES, get_strategy


def _variables(state):
    return jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))


@pytest.mark.parametrize("name", ["tiny", "1b"])
def test_the_parameter_formula_counts_the_declared_parameters(name):
    config = preset(name)
    _, state = abstract_model(config)  # eval_shape: a 1B model costs nothing here
    assert sum(v.size for v in _variables(state)) == config.parameters


def test_presets_range_from_tiny_to_about_a_billion():
    assert PRESETS["tiny"].parameters < 200_000
    assert 0.9e9 < PRESETS["1b"].parameters < 1.1e9
    with pytest.raises(LabError, match="unknown model preset 'huge'"):
        preset("huge")


def test_every_parameter_names_only_logical_axes_and_blocks_are_stacked_on_layers():
    _, state = abstract_model(preset("tiny"))
    for variable in _variables(state):
        axes = logical_axes(variable)
        assert len(axes) == variable.ndim and set(axes) <= set(LOGICAL_AXES)
    assert all(logical_axes(v)[0] == "layers" for v in _variables(state["blocks"]))


@pytest.fixture(scope="module")
def single_device_model():
    config = preset("tiny")
    mesh = MeshSpec().build(jax.devices()[:1])
    layout = Layout(mesh, get_strategy("ddp"))
    graphdef, abstract = abstract_model(config)
    params = create_params(config, layout.shardings(abstract, "params"))
    forward = jax.jit(lambda params, tokens: nnx.merge(graphdef, params)(tokens, layout))
    return config, params, forward


def test_logits_have_the_vocabulary_and_only_look_backwards(single_device_model):
    config, params, forward = single_device_model
    tokens = np.random.default_rng(0).integers(0, config.vocab, (2, config.seq), dtype=np.int32)
    changed = tokens.copy()
    changed[:, -1] = (changed[:, -1] + 1) % config.vocab
    logits, logits_changed = forward(params, tokens), forward(params, changed)
    assert logits.shape == (2, config.seq, config.vocab) and logits.dtype == jnp.float32
    np.testing.assert_array_equal(logits[:, :-1], logits_changed[:, :-1])
    assert not np.allclose(logits[:, -1], logits_changed[:, -1])


def test_params_are_created_already_sharded(devices):
    config = preset("tiny")
    mesh = MeshSpec.parse("fsdp=8").build(devices)
    layout = Layout(mesh, get_strategy("zero3"))
    params = create_params(config, layout.shardings(abstract_model(config)[1], "params"))
    w_in = params["blocks"]["mlp"]["w_in"][...]
    assert w_in.shape == (config.layers, config.embed, config.mlp)
    assert {s.data.shape for s in w_in.addressable_shards} == {(config.layers, config.embed // 8, config.mlp)}
