"""Presets against their published parameter counts; the typed-in --model parser; the model family's shapes."""

import math
from dataclasses import replace

import jax
import pytest
from flax import nnx

from lab.errors import LabError
from lab.model import ModelConfig, abstract_model
from lab.predict.spec import ACTIVE_WITHOUT_EMBEDDING, PRESETS, parse_model, published_parameters


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_have_their_published_parameter_counts(name):
    count, source = published_parameters(name)
    config = PRESETS[name][0]
    assert source
    if isinstance(count, int):
        assert config.parameters == count
        return
    # an MoE's card: "total / active" in billions, to the digits it gives, rounded (Mistral) or cut (Qwen3: 3.35B
    # active written 3.3B); GPT-OSS's card counts the active parameters without the input embedding
    active = config.active_parameters - (config.vocab * config.embed if name in ACTIVE_WITHOUT_EMBEDDING else 0)
    for ours, published in zip((config.parameters, active), count.split(" / "), strict=True):
        digits = len(published.removesuffix("B").partition(".")[2])
        unit = 10.0**-digits
        cut = math.floor(ours / 1e9 / unit) * unit
        assert published in (f"{ours / 1e9:.{digits}f}B", f"{cut:.{digits}f}B"), (ours, published)


@pytest.mark.parametrize(
    "config",
    [
        ModelConfig(kv_heads=2, feed_forward="swiglu"),
        ModelConfig(block="parallel", tied=True, feed_forward="relu"),
        ModelConfig(heads=4, kv_heads=1, head_dim=32, feed_forward="geglu", tied=True),
        ModelConfig(kv_heads=2, qk_norm=True, experts=4, top_k=2, feed_forward="swiglu"),
        ModelConfig(block="parallel", qk_norm=True, experts=4, top_k=1),
        ModelConfig(experts=4, layers=3, dense_layers=1, dense_mlp=96, shared_experts=2, feed_forward="swiglu"),
        ModelConfig(experts=4, layers=4, moe_every=2, dense_mlp=96, shared_experts=1, top_k=1),
        ModelConfig(kv_rank=24, q_rank=20, rope_dim=8),
        ModelConfig(kv_rank=24, rope_dim=4, experts=4, layers=3, dense_layers=2),
        ModelConfig(biases=True, sinks=True, kv_heads=2, window=8, global_every=2, experts=4, feed_forward="swiglu"),
        ModelConfig(biases=True, layers=4, experts=4, moe_every=2, window=8, global_every=4, shared_experts=1),
        ModelConfig(biases=True, window=8, block="parallel"),
        ModelConfig(sinks=True, kv_rank=24, rope_dim=4, window=8),
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


def test_the_mixed_moe_presets_declare_their_stacks():
    deepseek = replace(PRESETS["deepseek-v3"][0], layers=5)  # 3 dense layers, then 2 MoE ones
    _, state = abstract_model(deepseek)
    assert state["dense_blocks"]["mlp"]["w_in"].shape == (3, 7168, 18432)
    assert state["blocks"]["moe"]["w_in"].shape == (2, 256, 7168, 2048)
    assert state["blocks"]["moe"]["shared"]["w_in"].shape == (2, 7168, 2048)
    # MaxText's wkv_b: one up-projection for each head's key (no rope) and value [layers, kv_rank, heads, 2 head_dim]
    assert state["blocks"]["attention"]["key_value"].shape == (2, 512, 128, 2 * 128)
    assert state["blocks"]["attention"]["kv_down"].shape == (2, 7168, 512 + 64)
    maverick = replace(PRESETS["llama4-maverick"][0], layers=4)  # periods of a dense layer, then an MoE one
    _, state = abstract_model(maverick)
    assert state["blocks"]["blocks"][0]["mlp"]["w_in"].shape == (2, 5120, 16384)
    assert state["blocks"]["blocks"][1]["moe"]["w_in"].shape == (2, 128, 5120, 8192)
    assert (maverick.moe_layers, maverick.scan_length, maverick.with_scan_length(3).layers) == (2, 2, 6)


def test_gpt_oss_declares_windowed_and_global_layers_with_biases_and_sinks():
    gpt_oss = replace(PRESETS["gpt-oss-120b"][0], layers=4)  # periods of a windowed layer, then a global one
    assert gpt_oss.layer_pattern == ((True, 128), (True, 0))
    assert (gpt_oss.scan_length, gpt_oss.with_scan_length(3).layers, gpt_oss.moe_layers) == (2, 6, 4)
    _, state = abstract_model(gpt_oss)
    windowed, global_ = state["blocks"]["blocks"][0], state["blocks"]["blocks"][1]
    assert windowed["attention"]["query_bias"].shape == (2, 64, 64)
    assert windowed["attention"]["mixing"]["sinks"].shape == (2, 64)
    assert global_["moe"]["in_bias"].shape == (2, 128, 2880)
    assert global_["moe"]["router_bias"].shape == (2, 128)


def test_an_moe_is_typed_in_or_a_preset_changed():
    typed = parse_model(
        "layers=32,d_model=4096,heads=32,kv_heads=8,d_ff=14336,vocab=32000,mlp=swiglu,experts=8,top_k=2,capacity=1.25"
    )
    assert typed.parameters == PRESETS["mixtral-8x7b"][0].parameters
    changed = parse_model("mixtral-8x7b,capacity=none,top_k=1")
    assert (changed.capacity_factor, changed.top_k, changed.experts, changed.layers) == (None, 1, 8, 32)
    assert not changed.dropless
    dropless = parse_model("mixtral-8x7b,capacity=dropless")  # MaxText's sparse_matmul: no buffer, no factor
    assert (dropless.dropless, dropless.capacity_factor) == (True, None)
    qwen = parse_model("qwen3-30b-a3b")
    assert (qwen.qk_norm, qwen.experts, qwen.top_k, qwen.mlp) == (True, 128, 8, 768)


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
        ("layers=2,d_model=256,heads=4,d_ff=512,vocab=9,experts=4,top_k=5", "top-k 5 is larger than the 4 experts"),
        ("layers=2,d_model=256,heads=4,d_ff=512,vocab=9,top_k=2", "give experts=E too"),
        ("mixtral-8x7b,capacity=0", "capacity='0'"),
        ("mixtral-8x7b,capacity=lots", "capacity='lots'; use a number above 0 such as 1.25, none or dropless"),
        ("mixtral-8x7b,colour=red", "unknown key 'colour'"),
        ("mixtral-8x7b,experts", "write key=value pairs"),
        ("llama3-8b,shared_experts=1", "a dense model has no MoE layers"),
        ("deepseek-v3,dense_layers=61", "must be a positive multiple of moe_every=1"),
        ("llama4-maverick,moe_every=5", "layers=48 after dense_layers=0 must be a positive multiple of moe_every=5"),
        ("llama3-8b,rope_dim=64", "give kv_rank too"),
        ("llama3-8b,kv_rank=512,rope_dim=64", "latent attention has a key and value per head"),
        ("deepseek-v3,rope_dim=63", "even rope_dim"),
        ("llama3-8b,global_every=2", "give window too"),
        ("gpt-oss-20b,global_every=5", "layers=24 must be a multiple of global_every=5"),
        ("deepseek-v3,window=128", "window with dense_layers"),
        ("gpt-oss-20b,sinks=maybe", "sinks='maybe'; use true or false"),
        ("deepseek-v3,biases=true", "latent attention has a key and value per head and no biases"),
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
