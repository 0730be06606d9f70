"""The transformer: declared abstractly with logical axes, created sharded, causal."""

import re
from dataclasses import replace
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from lab.errors import LabError
from lab.mesh import MeshSpec
from lab.model import PRESETS, Mixing, ModelConfig, WholeWeights, abstract_model, create_params, logical_axes, preset
from lab.parallel import Layout
from lab.parallel.layout import NAMED_ACTIVATIONS
from lab.rules import LOGICAL_AXES, get_strategy


def _variables(state):
    return jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))


@pytest.mark.parametrize("name", ["tiny", "tiny-moe", "1b"])
def test_the_parameter_formula_counts_the_declared_parameters(name):
    config = preset(name)
    _, state = abstract_model(config)  # eval_shape: a 1B model costs nothing here
    assert sum(v.size for v in _variables(state)) == config.parameters


def test_an_moe_token_uses_k_of_the_experts_and_bad_routers_are_refused():
    moe = preset("tiny-moe")
    assert moe.parameters - moe.active_parameters == moe.layers * (moe.experts - moe.top_k) * 2 * moe.embed * moe.mlp
    assert preset("tiny").active_parameters == preset("tiny").parameters
    gated = replace(moe, feed_forward="swiglu")  # each expert three D x F matrices
    assert (
        gated.parameters - gated.active_parameters == moe.layers * (moe.experts - moe.top_k) * 3 * moe.embed * moe.mlp
    )
    with pytest.raises(LabError, match="top-k 3 is larger than the 2 experts"):
        ModelConfig(experts=2, top_k=3)


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


def _single_device_forward(config):
    mesh = MeshSpec().build(jax.devices()[:1])
    layout = Layout(mesh, get_strategy("ddp"))
    graphdef, abstract = abstract_model(config)
    params = create_params(config, layout.shardings(abstract, "params"))
    return params, jax.jit(lambda params, tokens: nnx.merge(graphdef, params).forward(tokens, layout))


# with no dropping (capacity_factor=None) an MoE model is causal too (with a capacity: the next test)
@pytest.mark.parametrize(
    "config",
    [
        preset("tiny"),
        ModelConfig(mlp=32, experts=4, top_k=2, capacity_factor=None),
        # Qwen3's family: SwiGLU experts, a norm on each query and key head
        ModelConfig(mlp=32, experts=4, top_k=2, capacity_factor=None, feed_forward="swiglu", qk_norm=True, kv_heads=2),
        # GPT-OSS's: biases, sinks, a window on every other layer
        ModelConfig(
            mlp=32,
            experts=4,
            top_k=2,
            capacity_factor=None,
            kv_heads=2,
            biases=True,
            sinks=True,
            window=4,
            global_every=2,
        ),
    ],
    ids=["dense", "moe", "gated-moe-qk-norm", "gpt-oss"],
)
def test_logits_have_the_vocabulary_and_only_look_backwards(config):
    params, forward = _single_device_forward(config)
    tokens = np.random.default_rng(0).integers(0, config.vocab, (2, config.seq), dtype=np.int32)
    changed = tokens.copy()
    changed[:, -1] = (changed[:, -1] + 1) % config.vocab
    (logits, stats), (logits_changed, _) = forward(params, tokens), forward(params, changed)
    assert logits.shape == (2, config.seq, config.vocab) and logits.dtype == jnp.float32
    np.testing.assert_array_equal(logits[:, :-1], logits_changed[:, :-1])
    assert not np.allclose(logits[:, -1], logits_changed[:, -1])
    if config.experts:  # per layer: every token routed to k experts, nothing dropped
        assert stats.counts.tokens_per_expert.shape == (config.layers, config.experts)
        np.testing.assert_array_equal(stats.counts.tokens_per_expert.sum(-1), 2 * config.seq * config.top_k)
        np.testing.assert_array_equal(stats.counts.dropped, 0)
    else:
        assert stats is None


def test_a_capacity_that_drops_keeps_the_model_causal_as_maxtexts_drop_order_does():
    """The model drops as MaxText's dropping path does, token after token (`RouterConfig.drop_policy` "token"): a
    token's slot depends on the tokens before it only, so changing the last token changes no earlier logit, even
    where tokens are dropped. (Ranked by probability, a later, more confident token could take an earlier one's
    slot.)"""
    config = replace(preset("tiny-moe"), capacity_factor=0.5)
    assert config.router.drop_policy == "token"
    params, forward = _single_device_forward(config)
    tokens = np.random.default_rng(1).integers(0, config.vocab, (2, config.seq), dtype=np.int32)
    changed = tokens.copy()
    changed[:, -1] = (changed[:, -1] + 1) % config.vocab
    (logits, stats), (logits_changed, _) = forward(params, tokens), forward(params, changed)
    assert int(stats.counts.dropped.sum()) > 0
    np.testing.assert_array_equal(logits[:, :-1], logits_changed[:, :-1])


@pytest.mark.parametrize(
    ("config", "mlp_names"),
    [
        (preset("tiny"), {"mlpwi", "mlpwo"}),
        (ModelConfig(mlp=32, feed_forward="swiglu"), {"mlpwi_0", "mlpwi_1", "mlpwo"}),
        (ModelConfig(mlp=32, experts=4, top_k=2, feed_forward="swiglu"), {"mlpwi_0", "mlpwi_1", "mlpwo"}),
    ],
    ids=["dense", "gated", "gated-moe"],
)
def test_the_forward_names_its_activations_as_maxtext_does(config, mlp_names):
    """What a custom remat policy can place (`NAMED_ACTIVATIONS`) is named in the model, each name MaxText's: the
    MLP's inputs by whether it is gated, and qkv_proj nowhere (MaxText's fused projection, which no model here has)."""
    params, forward = _single_device_forward(config)
    tokens = np.zeros((2, config.seq), dtype=np.int32)
    named = set(re.findall(r"\bname\[name=(\w+)\]", str(jax.make_jaxpr(forward)(params, tokens))))
    attention = {"decoder_layer_input", "context", "query_proj", "key_proj", "value_proj", "out_proj"}
    assert named == attention | mlp_names
    assert named | {"qkv_proj", "mlpwi", "mlpwi_0", "mlpwi_1"} == set(NAMED_ACTIVATIONS)


@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("groups", [4, 2])
def test_windowed_attention_with_sinks_is_the_splash_kernels_reference(window, groups):
    """XLA's attention of a windowed layer with sinks against JAX's own reference for the splash kernel (its
    attention_reference, head by head, on the kernel's LocalMask), which the TPU target compiles."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    b, s, h, k = 2, 16, 4, 8
    rng = np.random.default_rng(window + groups)
    q, key, value = (jnp.asarray(rng.normal(size=(b, s, n, k)), jnp.float32) for n in (h, groups, groups))
    sinks_H = jnp.asarray(rng.normal(size=h) * 2, jnp.float32)
    with nnx.use_eager_sharding(False):
        mixing = Mixing(ModelConfig(heads=h, head_dim=k, sinks=True), nnx.Rngs(0), window)
    mixing.sinks[...] = sinks_H
    identity = nnx.Param(jnp.eye(h * k).reshape(h, k, h * k))  # the output projection: the heads side by side
    mixed = mixing.project(q, key, value, identity, WholeWeights())
    mask = masks.LocalMask((s, s), (window - 1, 0), offset=0) if window else masks.CausalMask((s, s))
    dense_mask = jnp.asarray(mask[:, :])
    for i in range(b):
        for head in range(h):
            group = head // (h // groups)
            expected = splash.attention_reference(
                dense_mask, q[i, :, head] / np.sqrt(k), key[i, :, group], value[i, :, group], None, sinks_H[head]
            )
            np.testing.assert_allclose(mixed[i, :, head * k : (head + 1) * k], expected, rtol=1e-5, atol=1e-6)


def test_params_are_created_already_sharded(devices):
    config = preset("tiny")
    mesh = MeshSpec.parse("fsdp=8").build(devices)
    layout = Layout(mesh, get_strategy("zero3"))
    params = create_params(config, layout.shardings(abstract_model(config)[1], "params"))
    w_in = params["blocks"]["mlp"]["w_in"][...]
    assert w_in.shape == (config.layers, config.embed, config.mlp)
    assert {s.data.shape for s in w_in.addressable_shards} == {(config.layers, config.embed // 8, config.mlp)}


def test_a_tight_capacity_drops_assignments_and_the_counts_say_how_many():
    config = replace(preset("tiny-moe"), capacity_factor=0.5)  # half the mean load fits
    params, forward = _single_device_forward(config)
    tokens = np.random.default_rng(0).integers(0, config.vocab, (2, config.seq), dtype=np.int32)
    _, stats = forward(params, tokens)
    dropped_share = stats.counts.dropped / stats.counts.chosen
    assert np.all(dropped_share >= 0.5) and np.all(dropped_share < 1)  # at least the half that cannot fit


@pytest.mark.parametrize("mesh_spec", ["fsdp=4,tensor=2", "data=2,fsdp=4"])
def test_a_dropless_moe_computes_what_a_buffer_of_the_whole_sequence_does(mesh_spec):
    """Dropless (`lab.ragged`: tokens sorted by expert, ragged matmuls, under shard_map) against the buffered path
    with no dropping: the same loss and the same gradients, the experts' width split over tensor or not."""
    base = ModelConfig(mlp=32, experts=4, top_k=2, capacity_factor=None, feed_forward="swiglu", biases=True)
    mesh = MeshSpec.parse(mesh_spec).build(jax.devices())
    layout = Layout(mesh, get_strategy("zero3"))
    abstract = abstract_model(base)[1]
    params = create_params(base, layout.shardings(abstract, "params"))
    tokens = np.random.default_rng(0).integers(0, base.vocab, (8, base.seq), dtype=np.int32)
    tokens = jax.device_put(tokens, NamedSharding(mesh, layout.batch_spec()))

    def loss_and_grads(config):
        def loss(params, tokens):
            return nnx.merge(graphdef, params).forward(tokens, layout)[0].mean()

        def step(params, tokens):
            value, grads = jax.value_and_grad(loss)(params, tokens)  # summed over the batch axes by the reshard
            return value, jax.tree.map(
                lambda g: jax.reshard(g, NamedSharding(mesh, P(*jax.typeof(g).sharding.spec.partitions))), grads
            )

        graphdef = abstract_model(config)[0]
        return jax.jit(step)(params, tokens)

    (buffered, buffered_grads), (dropless, dropless_grads) = map(loss_and_grads, (base, replace(base, dropless=True)))
    np.testing.assert_allclose(dropless, buffered, rtol=1e-5)
    jax.tree.map(partial(np.testing.assert_allclose, rtol=1e-4, atol=1e-7), dropless_grads, buffered_grads)
    with pytest.raises(LabError, match="dropless routing has no capacity"):
        ModelConfig(experts=4, dropless=True)  # the default capacity factor 1.25 left in place


def test_a_dropless_moe_refuses_experts_split_over_devices():
    """A library caller's expert axis gets the CLI's refusal (`lab.ragged.NO_EXPERT_AXIS`), naming the split."""
    config = ModelConfig(mlp=32, experts=4, top_k=2, capacity_factor=None, dropless=True)
    mesh = MeshSpec.parse("fsdp=4,expert=2").build(jax.devices())
    layout = Layout(mesh, get_strategy("zero3"))
    graphdef, abstract = abstract_model(config)
    params = create_params(config, layout.shardings(abstract, "params"))
    tokens = jax.device_put(np.zeros((8, config.seq), np.int32), NamedSharding(mesh, layout.batch_spec()))
    with pytest.raises(LabError, match="the experts' weights are split over expert: capacity=dropless"):
        jax.jit(lambda p, t: nnx.merge(graphdef, p).forward(t, layout)[0])(params, tokens)
