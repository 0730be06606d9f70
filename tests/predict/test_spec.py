"""Presets against their published parameter counts; the typed-in --model parser; the model family's shapes."""

from dataclasses import replace

import jax
import pytest
from flax import nnx

from lab.errors import LabError
from lab.model import ModelConfig, abstract_model
from lab.predict.spec import PRESETS, parse_model, published_parameters


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_have_their_published_parameter_counts(name):
    count, source = published_parameters(name)
    assert source
    assert PRESETS[name][0].parameters == count


@pytest.mark.parametrize(
    "config",
    [
        ModelConfig(kv_heads=2, feed_forward="swiglu"),
        ModelConfig(block="parallel", tied=True, feed_forward="relu"),
        ModelConfig(heads=4, kv_heads=1, head_dim=32, feed_forward="geglu", tied=True),
    ],
)
def test_the_formula_counts_what_the_model_declares(config):
    _, state = abstract_model(config)
    declared = sum(leaf.size for leaf in jax.tree.leaves(state))
    assert declared == config.parameters


def test_a_preset_declares_its_shapes_abstractly():
    config = replace(PRESETS["llama3-70b"][0], layers=2)
    _, state = abstract_model(config)
    blocks = state["blocks"]
    assert blocks["attention"]["key"].shape == (2, 8192, 8, 128)
    assert blocks["mlp"]["w_gate"].shape == (2, 8192, 28672)
    assert "mlp_norm" in blocks and "unembed" in state


def test_the_typed_in_spec_reads_every_key():
    config = parse_model(
        "layers=32,d_model=4096,heads=32,kv_heads=8,head_dim=128,d_ff=14336,vocab=128256,mlp=swiglu,"
        "block=sequential,tied=false"
    )
    assert config.parameters == PRESETS["llama3-8b"][0].parameters
    parallel = parse_model("layers=2,d_model=256,heads=4,d_ff=512,vocab=1000,block=parallel,tied=true,mlp=gelu")
    assert (parallel.head_dim, parallel.block, parallel.tied, parallel.gated) == (64, "parallel", True, False)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("llama9-1t", "unknown model preset"),
        ("layers=2,d_model=256,heads=4,d_ff=512,vocab=1000,colour=red", "unknown key 'colour'"),
        ("layers=2,d_model=256,heads=4,d_ff=512", "give vocab"),
        ("layers=two,d_model=256,heads=4,d_ff=512,vocab=9", "positive integer"),
        ("layers=2,d_model=256,heads=4,kv_heads=3,d_ff=512,vocab=9", "must divide heads"),
        ("layers=2,d_model=256,heads=4,d_ff=512,vocab=9,mlp=tanh", "mlp='tanh'"),
        ("layers=2,d_model=250,heads=4,d_ff=512,vocab=9", "give head_dim"),
    ],
)
def test_bad_specs_say_what_is_wrong(text, words):
    with pytest.raises(LabError, match=words.replace("(", r"\(")):
        parse_model(text)


def test_default_config_keeps_todays_model():
    config = ModelConfig()
    assert (config.groups, config.gated, config.block, config.tied, config.attention) == (
        4,
        False,
        "sequential",
        False,
        "xla",
    )
    _, state = abstract_model(config)
    assert set(state["blocks"]["mlp"]) == {"w_in", "w_out"}
    assert nnx.to_pure_dict(state).keys() == {"embedding", "blocks", "final_norm", "unembed"}
