"""`lab inspect --fn` and `lab.explain` on the programs in examples/, written the way users write them.

Every collective of every example is attributed to a line of that example and to a parameter, an input, a
gradient or activations; the one surprise planted in `optax_train_step.py` (a norm over the `fsdp`-sharded
dimension of a weight) is listed first, at its line, with a hint. The same step read back from the dump XLA wrote
while compiling it gives the same collectives.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lab.cli import main

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
CASES = {
    "nnx_fsdp.py:train_step": "data=2,fsdp=4",
    "shard_map_collectives.py:tensor_parallel_mlp": "data=2,tensor=4",
    "optax_train_step.py:train_step": "data=2,fsdp=4",
}
EXPLAINED = {"parameter", "input", "gradient", "activation"}


def inspect_json(capsys, *argv) -> dict:
    assert main(["inspect", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def line_of(example: str, marker: str) -> int:
    lines = (EXAMPLES / example).read_text().splitlines()
    return next(number for number, line in enumerate(lines, 1) if marker in line)


@pytest.mark.parametrize("name", CASES)
def test_every_collective_has_a_line_of_the_example_and_a_reason(capsys, devices, name):
    found = inspect_json(capsys, "--fn", str(EXAMPLES / name), "--mesh", CASES[name])
    example = name.split(":")[0]
    assert found["collectives"], "an example with no collective explains nothing"
    for c in found["collectives"]:
        assert c["source"].startswith(str(EXAMPLES / example) + ":"), c
        # the call chain: innermost (the source) first, every frame the example's, none of the lab's
        assert c["stack"] and f"{c['stack'][0]['file']}:{c['stack'][0]['line']}" == c["source"], c
        assert all(frame["file"] == str(EXAMPLES / example) for frame in c["stack"]), c["stack"]
        assert c["op_name"] and c["link"] == "host" and c["count"] == 1
        assert set(c) >= {"kind", "axes", "dtype", "size_bytes", "groups", "origin", "async"}
        if not (example == "optax_train_step.py" and c["origin"]["kind"] == "surprise"):
            assert c["origin"]["kind"] in EXPLAINED, c
    totals = {(tuple(t["axes"]), t["kind"]): t["bytes"] for t in found["totals"]}
    assert sum(totals.values()) == sum(c["size_bytes"] * c["count"] for c in found["collectives"])
    assert found["memory"]["argument_size"] > 0 and found["roofline"] is None  # no roofline on emulated devices


def test_what_each_example_communicates_and_why(capsys, devices):
    nnx = inspect_json(
        capsys, "--fn", str(EXAMPLES / "nnx_fsdp.py:train_step"), "--mesh", CASES["nnx_fsdp.py:train_step"]
    )
    by_kind = {(c["kind"], tuple(c["axes"])): c["origin"] for c in nnx["collectives"]}
    # the gradients of both weights are reduced over data (one combined all-reduce)
    assert by_kind["all-reduce", ("data",)]["kind"] == "gradient"
    assert set(by_kind["all-reduce", ("data",)]["name"].split(", ")) == {
        "params['w_down']['kernel'].value",
        "params['w_up']['kernel'].value",
    }
    # the weight that moves is named, and moves over fsdp, where the program sharded it
    moved = [o for (kind, axes), o in by_kind.items() if o["kind"] == "parameter"]
    assert moved and all("kernel" in o["name"] for o in moved)
    # w_up, split along its input features (what x @ w_up sums over), is moved onto its output features, where
    # propagation laid the product out: an all-to-all, no gather, and the matmul named as its cause
    (turned,) = [c for c in nnx["collectives"] if c["kind"] == "all-to-all"]
    assert turned["origin"]["name"] == "params['w_up']['kernel'].value" and turned["cause"]["op"] == "dot_general"
    assert "sums over the dimension params['w_up']['kernel'].value splits over fsdp" in turned["cause"]["why"]
    assert "moves params['w_up']['kernel'].value's split onto that dimension" in turned["cause"]["why"]

    mlp = inspect_json(
        capsys, "--fn", str(EXAMPLES / "shard_map_collectives.py:tensor_parallel_mlp"), "--mesh", "data=2,tensor=4"
    )
    kinds = {(c["kind"], tuple(c["axes"])): c for c in mlp["collectives"]}
    assert set(kinds) == {
        ("all-gather", ("tensor",)),
        ("all-reduce", ("tensor",)),
        ("collective-permute", ("data",)),
        ("all-reduce", ("data",)),
    }
    assert kinds["all-gather", ("tensor",)]["origin"] == {
        **kinds["all-gather", ("tensor",)]["origin"],
        "kind": "input",
        "name": "x",
    }
    # asked for by name in shard_map (all_gather): moved as the program says, not resharded against a declaration
    assert kinds["all-gather", ("tensor",)]["origin"]["why"] == "moves x over tensor, as the program asks by name"
    assert kinds["all-reduce", ("tensor",)]["origin"]["kind"] == "activation"
    assert kinds["all-reduce", ("data",)]["size_bytes"] == 4  # the loss, a scalar
    example = "shard_map_collectives.py"
    assert kinds["collective-permute", ("data",)]["source"].endswith(f":{line_of(example, 'ppermute(')}")


DOCS = Path(__file__).resolve().parents[1] / "data" / "programs" / "public_docs.py"


def line_of_docs(marker: str) -> int:
    lines = DOCS.read_text().splitlines()
    return next(number for number, line in enumerate(lines, 1) if marker in line)


def test_a_weight_as_wide_as_the_batch_is_reduced_as_a_gradient(capsys, devices):
    """JAX's data-and-tensor-parallel MLP, its hidden width equal to the batch: the combined all-reduce over data
    carries every weight's gradient (each of a weight's size), the all-reduces over tensor the activations."""
    found = inspect_json(capsys, "--fn", f"{DOCS}:data_and_tensor_parallel_mlp", "--mesh", "data=4,tensor=2")
    origins = {(c["kind"], tuple(c["axes"])): c["origin"] for c in found["collectives"]}
    assert origins["all-reduce", ("data",)]["kind"] == "gradient"
    assert origins["all-reduce", ("data",)]["why"].startswith("reduces the gradient of params[0][0], params[0][1]")
    assert origins["all-reduce", ("tensor",)]["kind"] == "activation"
    assert found["surprises"] == 0


def test_a_pipelines_ppermutes_are_asked_for_and_carry_no_gradient(capsys, devices):
    """The shard_map tutorial's GPipe loop: each stage-to-stage send is asked for by name, so none is a surprise,
    and none is read as a weight's gradient (only the replicated weights' all-reduce over stage is one)."""
    found = inspect_json(capsys, "--fn", f"{DOCS}:spmd_pipeline", "--mesh", "stage=2,data=4")
    permutes = [c for c in found["collectives"] if c["kind"] == "collective-permute"]
    assert len(permutes) > 10 and found["surprises"] == 0
    assert all(c["cause"]["kind"] == "shard_map" and c["hint"] is None for c in permutes)
    assert not [c["origin"] for c in permutes if c["origin"]["kind"] == "gradient"]
    (reduced,) = [c for c in found["collectives"] if c["kind"] == "all-reduce" and c["size_bytes"] > 4]
    assert reduced["origin"]["kind"] == "gradient" and reduced["axes"] == ["stage"]


def test_zero1_reduces_the_gradients_whole_and_gathers_the_updated_weights(capsys, devices):
    """The scaling book's ZeRO-1: each device updates its rows of the gradient (a slice of the all-reduced one),
    and the step gathers the new weights it returns replicated: gradients, then parameters; nothing a surprise."""
    found = inspect_json(capsys, "--fn", f"{DOCS}:zero1_adam", "--mesh", "data=8")
    reduced, *gathered = found["collectives"]
    assert (reduced["kind"], reduced["origin"]["kind"]) == ("all-reduce", "gradient")
    assert reduced["origin"]["name"] == "p['w1'], p['w2']"
    assert [(c["kind"], c["origin"]["kind"], c["origin"]["name"]) for c in gathered] == [
        ("all-gather", "parameter", "p['w1']"),
        ("all-gather", "parameter", "p['w2']"),
    ]
    assert found["surprises"] == 0 and not [c for c in found["collectives"] if c["surprise"]]
    # declared whole and computed split: the gather is the update's, never a declared split's (there is none)
    for c in gathered:
        assert c["cause"]["why"].startswith(f"{c['origin']['name']} is declared whole, not split over data")
        assert "as declared" not in c["cause"]["why"]


def test_a_scanned_layers_gradient_is_followed_through_the_loops_carry(capsys, devices):
    """Flax's guide, its layers under nn.scan: each layer's gradient is all-reduced over data inside the scanned
    backward and written into the stacked gradient the loop carries out to the Adam update."""
    found = inspect_json(capsys, "--fn", f"{DOCS}:flax_scanned_mlp", "--mesh", "data=2,tensor=4")
    (reduced,) = [c for c in found["collectives"] if c["axes"] == ["data"]]
    assert (reduced["kind"], reduced["count"], reduced["origin"]["kind"]) == ("all-reduce", 4, "gradient")
    assert "['W2']" in reduced["origin"]["name"] and "['kernel']" in reduced["origin"]["name"]
    assert {c["origin"]["kind"] for c in found["collectives"] if c["axes"] == ["tensor"]} == {"activation"}
    assert found["surprises"] == 0


def test_each_gradient_in_a_combined_all_reduce_is_named_after_its_weight(capsys, devices):
    """Flax's NNX guide: the scanned backward all-reduces both layers' gradients over data in one collective; `w2`
    is a weight by its name too (w1, w2, ...), so its gradient is not taken for its Adam moment's."""
    found = inspect_json(capsys, "--fn", f"{DOCS}:flax_nnx_scanned_train_step", "--mesh", "data=2,tensor=4")
    (combined,) = [c for c in found["collectives"] if c["origin"]["kind"] == "gradient"]
    assert combined["axes"] == ["data"]
    assert combined["origin"]["name"] == "model.layers.dot1.kernel.value, model.layers.w2.value"


def test_a_scanned_micro_batchs_gathers_and_gradient_sums_say_who_asked(capsys, devices):
    """MaxText's gradient accumulation: inside the scanned micro-batch, where Shardy's record names no line, each
    FSDP gather is of a weight stored split, each reduction a gradient summed over what splits the batch; both
    asked for by the layouts (no hint)."""
    found = inspect_json(capsys, "--fn", f"{DOCS}:scanned_microbatch_gradients", "--mesh", "data=2,fsdp=4")
    weights = [c for c in found["collectives"] if c["origin"]["kind"] in ("parameter", "gradient")]
    assert {c["origin"]["kind"] for c in weights} == {"parameter", "gradient"}
    for c in weights:
        assert c["cause"] is not None and c["cause"]["hint"] is None, c
        assert c["origin"]["name"] in c["cause"]["why"]
    gathers = {c["origin"]["name"] for c in weights if c["kind"] == "all-gather"}
    assert gathers == {"w['w_in']", "w['w_out']"} and found["surprises"] == 0


def test_an_nnx_jit_steps_inputs_are_named_as_jax_jit_names_them(capsys, devices):
    """Flax NNX's own train step, @nnx.jit: JAX names the objects' leaves by position (model.states[0][3]); they are
    read by their paths in the objects. The biases' gradients, combined with the loss in one all-reduce, each update
    this device's slice of a replicated bias: gradients, not a surprise."""
    found = inspect_json(capsys, "--fn", f"{DOCS}:flax_nnx_jit_train_step", "--mesh", "data=2,fsdp=2,tensor=2")
    names = [i["name"] for i in found["inputs"]]
    assert names[:4] == ["model.l1.bias.value", "model.l1.kernel.value", "model.l2.bias.value", "model.l2.kernel.value"]
    assert "optimizer.opt_state[0].mu['l2']['kernel'].value" in names and not [n for n in names if "states[" in n]
    reduced = {c["origin"]["name"] for c in found["collectives"] if c["origin"]["kind"] == "gradient"}
    assert "model.l1.bias.value, model.l2.bias.value" in reduced
    assert {c["origin"]["name"] for c in found["collectives"] if c["kind"] == "all-gather"} <= {
        "model.l1.kernel.value",
        "model.l2.kernel.value",
    }
    assert found["surprises"] == 0


def test_shard_maps_backward_collectives_are_autodiffs_not_asked_by_name(capsys, devices):
    """Megatron's sequence parallelism by hand in shard_map: the forward gather and scatter are asked for by name
    (psum_scatter spelled as the program calls it); the backward's gather is the transpose of the scatter at its
    line; the weights, replicated over data by the in_specs, have their gradients summed over data by autodiff
    (psum_invariant, the transpose of the implicit pvary) in the step's last op, which returns them."""
    found = inspect_json(capsys, "--fn", f"{DOCS}:sequence_parallel_mlp", "--mesh", "data=2,fsdp=2,tensor=2")
    why = {(c["kind"], "transpose(" in c["op_name"]): c["cause"]["why"] for c in found["collectives"]}
    assert why["all-gather", False].startswith("asked for by name: all_gather inside shard_map")
    assert why["reduce-scatter", False].startswith("asked for by name: psum_scatter inside shard_map")
    assert why["all-gather", True].startswith("the backward pass of the collective at public_docs.py:")
    (summed,) = [c for c in found["collectives"] if c["axes"] == ["data"]]
    assert (summed["origin"]["kind"], summed["origin"]["name"]) == ("gradient", "w1, w2")
    assert summed["cause"]["why"].startswith("autodiff sums a gradient over data")
    assert found["surprises"] == 0


def test_an_explicit_reshard_is_the_move_it_asks_for(capsys, devices):
    """JAX's explicit sharding: `reshard` asks for the move, so its collectives are asked for (no hint, no surprise,
    not counted as decided by a conflicting annotation); the matmul's sum over the split contraction is named."""
    found = inspect_json(
        capsys, "--fn", f"{DOCS}:explicit_reshard", "--mesh", "data=2,fsdp=2,tensor=2", "--axis-types", "explicit"
    )
    moved = [c for c in found["collectives"] if c["cause"]["op"] == "reshard"]
    assert moved and all(c["cause"]["why"].startswith("asked for: reshard at") and c["hint"] is None for c in moved)
    (summed,) = [c for c in found["collectives"] if c["cause"]["kind"] == "sum"]
    assert (summed["kind"], summed["axes"]) == ("all-reduce", ["tensor"])
    assert found["surprises"] == 0 and "0 collective(s) decided by a conflicting annotation" in found["origins"]


def test_a_roll_over_the_stage_axis_is_the_pipelines_shift_forward_and_back(capsys, devices):
    """A pipeline vmapped over stage-sharded states, rotated to the next stage with jnp.roll: each roll is a permute
    over stage, and so is its transpose in the backward pass (XLA writes it as a pad and a split); both are the
    shift the program asks for, at the roll's line, none a surprise; the weights' gradient is summed over data."""
    found = inspect_json(capsys, "--fn", f"{DOCS}:rolled_pipeline", "--mesh", "data=2,stage=4")
    permutes = [c for c in found["collectives"] if c["kind"] == "collective-permute"]
    assert {(tuple(c["axes"]), c["cause"]["op"], c["hint"]) for c in permutes} == {(("stage",), "roll", None)}
    assert len({c["source"] for c in permutes}) == 1 and len(permutes) == 4 * 3  # 4 rolls, each forward and back
    assert found["surprises"] == 0


def test_a_gradient_summed_twice_in_shard_map_gets_a_hint_at_the_second_sum(capsys, devices):
    """pmap-era code in shard_map: autodiff sums the replicated weights' gradient (psum_invariant), and the step's
    own pmean sums it again, returning the devices' sum where a mean was meant; the second sum's line says so."""
    found = inspect_json(capsys, "--fn", f"{DOCS}:pmap_era_pmean_of_grads", "--mesh", "data=2,fsdp=2,tensor=2")
    autodiff, asked = sorted(found["collectives"], key=lambda c: "transpose(" not in c["op_name"])
    assert [(c["origin"]["kind"], c["origin"]["name"], c["axes"]) for c in (autodiff, asked)] == [
        ("gradient", "w", ["data", "fsdp"])
    ] * 2
    assert autodiff["hint"] is None and autodiff["cause"]["why"].startswith("autodiff sums a gradient")
    pmean = line_of_docs("grads = jax.lax.pmean(grads")
    assert asked["hint"].startswith(f"at public_docs.py:{pmean}: the gradient of w is summed over data,fsdp twice")


def test_a_ragged_all_to_all_compiles_for_tpu_and_on_cpu_says_where_it_does(capsys, devices):
    """MoE dispatch with ragged_all_to_all: asked for by name over expert on a TPU topology; XLA:CPU cannot compile
    it, and the one line says which targets can."""
    found = inspect_json(capsys, "--fn", f"{DOCS}:ragged_dispatch", "--mesh", "expert=8", "--target", "tpu:v5e:2x4")
    ((dispatch,),) = [found["collectives"]]
    assert dispatch["axes"] == ["expert"] and dispatch["cause"]["op"] == "ragged_all_to_all"
    assert main(["inspect", "--fn", f"{DOCS}:ragged_dispatch", "--mesh", "expert=8"]) == 2
    assert "XLA:CPU cannot compile it: compile for a TPU or GPU target" in capsys.readouterr().err


def test_ring_attentions_backward_sends_carry_the_gradients_of_k_and_v(capsys, devices):
    """Ring attention: the forward sends k and v around the ring, the backward sends their gradients back; q, k and v
    are one size, so which gradient each send carries is read from where it leaves the step (output k is input k's)."""
    found = inspect_json(capsys, "--fn", f"{DOCS}:ring_attention", "--mesh", "data=2,fsdp=4")
    permutes = [c["origin"] for c in found["collectives"] if c["kind"] == "collective-permute"]
    assert sorted((o["kind"], o["name"]) for o in permutes) == [
        ("gradient", "k"),
        ("gradient", "v"),
        ("parameter", "k"),
        ("parameter", "v"),
    ]
    # the psum that returns the gradients, over no axis: XLA:CPU keeps it in the optimized program, moving nothing
    (kept,) = [c for c in found["collectives"] if c["kind"] == "all-reduce"]
    assert kept["size_bytes"] == 0 and not kept["surprise"] and "sends no bytes" in kept["origin"]["why"]


UNKNOWN_TRIPS = """
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

def loop(mesh):
    def f(x, n):  # n iterations, known only when it runs: each all-reduces a sum over fsdp
        return jax.lax.fori_loop(0, n, lambda i, c: c * 0.5 + (c * x).sum(), jnp.float32(1.0))
    x = jax.ShapeDtypeStruct((1024,), jnp.float32, sharding=NamedSharding(mesh, P("fsdp")))
    n = jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, P()))
    return jax.jit(f), (x, n)
"""


VOCAB_PARALLEL = """
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

def embed(mesh):  # sgl-project/sglang-jax#1083, before its fix: the lookup's mask is gathered over data
    def f(table, ids):
        out = jnp.take(table, ids, axis=0)
        return jax.lax.with_sharding_constraint(out, NamedSharding(mesh, P(None, None)))
    table = jax.ShapeDtypeStruct((32768, 1024), jnp.bfloat16, sharding=NamedSharding(mesh, P("tensor", None)))
    ids = jax.ShapeDtypeStruct((256,), jnp.int32, sharding=NamedSharding(mesh, P("data")))
    return jax.jit(f), (table, ids)
"""


def test_a_collective_larger_than_the_input_it_is_made_from_says_so(capsys, devices, tmp_path):
    (tmp_path / "embed.py").write_text(VOCAB_PARALLEL)
    found = inspect_json(capsys, "--fn", f"{tmp_path / 'embed.py'}:embed", "--mesh", "data=2,tensor=4")
    (mask,) = [c for c in found["collectives"] if c["dtype"] == "pred"]
    assert mask["origin"]["name"] == "ids"
    assert "262,144 elements, more than its 256: made from it" in mask["origin"]["why"]
    assert "(declared P('data');" in mask["origin"]["why"]  # as the user wrote it, not {devices=[2,4]<=[8]...}
    assert [i["spec"] for i in found["inputs"]] == ["P('tensor', None)", "P('data')"]
    # the constraint after jnp.take (a nested jit, which no location joins) decided both gathers over data
    constraint = next(n for n, text in enumerate(VOCAB_PARALLEL.splitlines(), 1) if "with_sharding_constraint" in text)
    for gathered in (c for c in found["collectives"] if c["kind"] == "all-gather"):
        assert gathered["cause"]["op"] == "with_sharding_constraint"
        assert gathered["cause"]["line"] == f"{tmp_path / 'embed.py'}:{constraint}"
        assert "the layout P(None, None)" in gathered["cause"]["why"] and "P('data', None)" in gathered["cause"]["why"]


PACKED = """
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P


def step(mesh):
    def pack(a, b):
        both = jnp.concatenate([a, b], axis=1)
        return jax.lax.with_sharding_constraint(both, NamedSharding(mesh, P("data", None)))

    x = jax.ShapeDtypeStruct((64, 512), jnp.float32, sharding=NamedSharding(mesh, P("data", "fsdp")))
    return jax.jit(pack), (x, x)
"""


def test_a_concatenate_along_a_split_dimension_and_the_constraint_after_it_are_named_as_causes(
    capsys, devices, tmp_path
):
    """The concatenate takes the constraint's layout, not its operands': the gather over fsdp is the constraint's,
    at the constraint's line, and its hint is not to pin a layout there again."""
    (tmp_path / "pack.py").write_text(PACKED)
    found = inspect_json(capsys, "--fn", f"{tmp_path / 'pack.py'}:step", "--mesh", "data=2,fsdp=4")
    (gathered,) = [c for c in found["collectives"] if c["kind"] == "all-gather"]
    assert gathered["source"] == f"{tmp_path / 'pack.py'}:8"  # the concatenate
    assert gathered["cause"]["op"] == "with_sharding_constraint"
    assert gathered["cause"]["line"] == f"{tmp_path / 'pack.py'}:9"
    why = gathered["cause"]["why"]
    assert "gives the concatenate at pack.py:8 the layout P('data', None)" in why
    assert "operands (a, b) come as P('data', 'fsdp')" in why
    # before it, each input moves its split off the joined dimension: XLA names those all-to-alls after the input,
    # with no line of their own; the concatenate they feed is their line and their cause
    moves = [c for c in found["collectives"] if c["kind"] == "all-to-all"]
    assert sorted(c["origin"]["name"] for c in moves) == ["a", "b"]
    for moved in moves:
        assert moved["source"] == f"{tmp_path / 'pack.py'}:8"
        assert moved["cause"]["op"] == "concatenate"
        assert f"the all-to-all over fsdp reshards {moved['origin']['name']} before it" in moved["cause"]["why"]


CAPACITY_MOE = """
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

def step(mesh):  # GShard's einsum dispatch with a capacity (MaxText's capacity path): groups of 64 tokens
    G, S, D, E, F = 8, 64, 256, 8, 512
    C = 2 * S // E

    def moe(params, x):
        probs = jax.nn.softmax(jnp.einsum("gsd,de->gse", x, params["gate"]), axis=-1)
        mask = jax.nn.one_hot(jnp.argmax(probs, axis=-1), E, dtype=x.dtype)
        pos = jnp.cumsum(mask, axis=1) * mask - 1.0
        mask = mask * (pos < C)
        gate = jnp.sum(probs * mask, axis=-1)
        dispatch = jax.nn.one_hot(pos.astype(jnp.int32), C, dtype=x.dtype) * mask[..., None]
        ex = jnp.einsum("gsec,gsd->egcd", dispatch, x)
        ex = jax.lax.with_sharding_constraint(ex, NamedSharding(mesh, P("expert", None, None, None)))
        eo = jnp.einsum("egcf,efd->egcd", jax.nn.relu(jnp.einsum("egcd,edf->egcf", ex, params["wi"])), params["wo"])
        eo = jax.lax.with_sharding_constraint(eo, NamedSharding(mesh, P("expert", None, None, None)))
        return jnp.einsum("gsec,egcd->gsd", dispatch * gate[..., None, None], eo)

    def update(params, x):
        grads = jax.grad(lambda p: jnp.mean(moe(p, x) ** 2))(params)
        return jax.tree.map(lambda p, g: p - 1e-2 * g, params, grads)

    split = NamedSharding(mesh, P("expert", None, None))
    params = {
        "gate": jax.ShapeDtypeStruct((D, E), jnp.float32, sharding=NamedSharding(mesh, P())),
        "wi": jax.ShapeDtypeStruct((E, D, F), jnp.float32, sharding=split),
        "wo": jax.ShapeDtypeStruct((E, F, D), jnp.float32, sharding=split),
    }
    return jax.jit(update), (params, jax.ShapeDtypeStruct((G, S, D), jnp.float32, sharding=split))
"""


def test_a_dispatch_mask_carries_the_tokens_of_its_group(capsys, devices, tmp_path):
    """One group of 64 tokens per device: the router's masks travel as [1, 64, ...], the per-device batch 1 and
    the sequence 64; they are the tokens' activations, not surprises. The one surprise is the dispatch: the constraint
    after its einsum splits the experts' dimension, so XLA gathers every device's tokens (x whole, 8 x an all-to-all's
    bytes) where GShard's dispatch is an all-to-all; the constraint is named at its line."""
    (tmp_path / "moe.py").write_text(CAPACITY_MOE)
    found = inspect_json(capsys, "--fn", f"{tmp_path / 'moe.py'}:step", "--mesh", "expert=8")
    masks = [c for c in found["collectives"] if c["size_bytes"] == 2048 and c["kind"] != "all-reduce"]
    assert masks and all(c["origin"]["kind"] == "activation" for c in masks)
    assert all("(64 = the sequence of x" in c["origin"]["why"] for c in masks)
    (dispatch,) = [c for c in found["collectives"] if c["surprise"]]
    assert (dispatch["kind"], dispatch["origin"]["kind"], dispatch["origin"]["name"]) == ("all-gather", "input", "x")
    constraint = CAPACITY_MOE.splitlines().index(
        next(line for line in CAPACITY_MOE.splitlines() if "ex = jax.lax" in line)
    )
    assert dispatch["cause"]["why"].startswith(f"the with_sharding_constraint at moe.py:{constraint + 1} gives the")


ROUTER_LOAD = """
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

def load(mesh):  # a router's load per expert, summed over the tokens of a batch split over data and fsdp
    def f(x, w):
        return jax.nn.softmax(jnp.einsum("bsd,de->bse", x, w), axis=-1).sum((0, 1))

    x = jax.ShapeDtypeStruct((16, 64, 128), jnp.float32, sharding=NamedSharding(mesh, P(("data", "fsdp"))))
    w = jax.ShapeDtypeStruct((128, 8), jnp.float32, sharding=NamedSharding(mesh, P()))
    return jax.jit(f), (x, w)
"""


def test_a_statistic_of_the_batch_summed_over_its_axes_is_the_batchs(capsys, devices, tmp_path):
    """A reduce over the batch leaves no batch dimension to read it by: the load per expert, [8], summed over the
    axes the batch is split over, is a statistic of the batch, not a surprise."""
    (tmp_path / "router.py").write_text(ROUTER_LOAD)
    found = inspect_json(capsys, "--fn", f"{tmp_path / 'router.py'}:load", "--mesh", "data=2,fsdp=4")
    (summed,) = found["collectives"]
    assert (summed["kind"], summed["axes"], summed["origin"]["kind"]) == ("all-reduce", ["data", "fsdp"], "activation")
    assert summed["origin"]["why"].startswith("shape [8]: statistics of the batch")
    assert found["surprises"] == 0


def test_totals_over_a_loop_of_unknown_length_say_they_are_a_floor(capsys, devices, tmp_path):
    (tmp_path / "loop.py").write_text(UNKNOWN_TRIPS)
    found = inspect_json(capsys, "--fn", f"{tmp_path / 'loop.py'}:loop", "--mesh", "fsdp=8")
    ((collective,), (total,)) = found["collectives"], found["totals"]
    assert collective["count"] is None and (total["runs"], total["bytes"], total["exact"]) == (1, 4, False)
    assert main(["inspect", "--fn", f"{tmp_path / 'loop.py'}:loop", "--mesh", "fsdp=8"]) == 0
    shown = capsys.readouterr().out
    assert ">= 1 " in shown and "trip count is unknown" in shown


def test_the_planted_surprise_comes_first_at_its_line_with_a_hint(capsys, devices):
    found = inspect_json(capsys, "--fn", str(EXAMPLES / "optax_train_step.py:train_step"), "--mesh", "data=2,fsdp=4")
    surprises = [c for c in found["collectives"] if c["origin"]["kind"] == "surprise"]
    assert len(surprises) == 1
    surprise = found["collectives"][0]
    assert surprise is not None and surprise == surprises[0]
    # and one not planted: the embedding lookup in a table whose rows fsdp splits, whose partial lookups of
    # activations an all-reduce adds (XLA combines it with the norm's other sum: its op name holds both)
    forced = [c for c in found["collectives"] if c["surprise"] and c is not surprise]
    assert sorted((c["origin"]["kind"], c["cause"]["op"]) for c in forced) == [
        ("activation", "dot_general"),
        ("activation", "dot_general"),
        ("activation", "gather"),
    ]
    lookup = line_of("optax_train_step.py", 'params["embed"][tokens]')
    (looked_up,) = [c for c in forced if c["cause"]["op"] == "gather"]
    assert looked_up["source"].endswith(f":{lookup}")
    # and two the layouts force in w_up's gradient, x^T dh: propagation split x's features over fsdp (from w_up's
    # rows) and dh's (from w_down's), two dimensions of the product one axis cannot both split, so dh is gathered
    for clash in (c for c in forced if c["cause"]["op"] == "dot_general"):
        assert clash["kind"] == "all-gather" and clash["source"].endswith(f":{line_of('optax_train_step.py', 'gelu(')}")
        assert "would split two of its result's dimensions over fsdp" in clash["cause"]["why"]
    assert found["surprises"] == 4  # each row says whether it is one
    assert (surprise["kind"], surprise["axes"]) == ("all-reduce", ["fsdp"])
    assert surprise["source"].endswith(f":{line_of('optax_train_step.py', 'the surprise')}")
    # the norm's sum over the dimension fsdp splits in w_up, inside jnp.linalg.norm: named, and what to change there
    assert (surprise["cause"]["kind"], surprise["cause"]["op"]) == ("sum", "reduce_sum")
    assert surprise["hint"].endswith("in the sharding declared for params['w_up']")
    gradients = [c for c in found["collectives"] if c["origin"]["kind"] == "gradient"]
    named = {n for c in gradients for n in c["origin"]["name"].split(", ")}
    assert named == {"params['embed']", "params['w_up']", "params['w_down']"}  # the weights, not AdamW's moments


def test_what_the_users_code_prints_goes_to_stderr_so_json_stays_json(capsys, devices, tmp_path):
    (tmp_path / "chatty.py").write_text(
        "import jax.numpy as jnp\n\nprint('importing')\n\n\ndef step(mesh):\n    print('building')\n"
        "    return (lambda x: jnp.sum(x * 2)), (jnp.ones(8),)\n"
    )
    assert main(["inspect", "--fn", f"{tmp_path}/chatty.py:step", "--json"]) == 0
    out, err = capsys.readouterr()
    json.loads(out)
    assert "importing" in err and "building" in err


def test_a_tpu_topology_compile_only_places_each_collective_on_ici_and_prices_it(capsys):
    found = inspect_json(
        capsys, "--fn", str(EXAMPLES / "nnx_fsdp.py:train_step"), "--mesh", "data=2,fsdp=4", "--target", "tpu:v5e:2x4"
    )
    assert found["collectives"] and all(c["link"] == "ici" and c["predicted_s"] > 0 for c in found["collectives"])
    assert all(c["origin"]["kind"] in EXPLAINED for c in found["collectives"])
    assert found["roofline"]["chip"] == "v5e" and found["roofline"]["compute_s"] > 0


def test_an_embeddings_gradient_summed_over_the_batch_is_autodiffs_sum_not_the_scatters(capsys):
    """On TPU the optax example's embedding gradient (a scatter-add) is all-reduced over data, which splits the
    batch and not the table: autodiff's sum over the batch, not a scatter into a split dimension."""
    argv = ["--fn", str(EXAMPLES / "optax_train_step.py:train_step"), "--mesh", "data=2,fsdp=4"]
    found = inspect_json(capsys, *argv, "--target", "tpu:v5e:2x4")
    (summed,) = [c for c in found["collectives"] if "scatter" in c["op_name"] and c["axes"] == ["data"]]
    assert summed["origin"]["kind"] == "gradient" and "params['embed']" in summed["origin"]["name"]
    assert (summed["cause"]["kind"], summed["cause"]["op"]) == ("sum", "gradient") and summed["hint"] is None


def test_a_scanned_fsdp_step_on_tpu_has_every_gather_a_weight_and_every_reduction_a_gradient(capsys):
    """libtpu wraps each collective in an async collective fusion, moves weights by asynchronous slices put back
    together, carries them through the forward loop into the backward one (where remat gathers them again), gathers
    a small weight as an all-reduce of zeros, and reduces a whole gradient to slice this device's rows in the
    optimizer's fusion: each read through, so no FSDP collective of the lab's own step is a surprise."""
    priced = Path(__file__).resolve().parents[1] / "data" / "programs" / "priced.py"
    found = inspect_json(
        capsys, "--fn", f"{priced}:lab_model", "--mesh", "fsdp=4", "--target", "tpu:v5e:2x2", "--axis-types", "explicit"
    )
    kinds = {c["name"]: (c["kind"], c["origin"]["kind"]) for c in found["collectives"]}
    assert found["surprises"] == 0 and len(kinds) >= 20
    assert all(c["cause"] is not None for c in found["collectives"])  # inside the scans too, from what each moves
    assert all(origin == "parameter" for kind, origin in kinds.values() if kind == "all-gather")
    assert all(origin == "gradient" for kind, origin in kinds.values() if kind == "reduce-scatter")
    rematted = [
        c for c in found["collectives"] if "rematted_computation" in (c["op_name"] or "") and c["kind"] == "all-gather"
    ]
    assert rematted and all(c["origin"]["name"].startswith("state.params['blocks']") for c in rematted)


REMOTE_COPY = """
import jax, jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import NamedSharding, PartitionSpec as P


def right_permute(mesh):  # the Pallas TPU distributed guide's ppermute by remote DMA
    n = mesh.shape["data"]

    def kernel(x_ref, y_ref, send, recv):
        right = jax.lax.rem(jax.lax.axis_index("data") + 1, n)
        copy = pltpu.make_async_remote_copy(x_ref, y_ref, send, recv, device_id={"data": right})
        copy.start()
        copy.wait()

    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=0,
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec(memory_space=pl.ANY),
        scratch_shapes=[pltpu.SemaphoreType.DMA] * 2,
    )
    call = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32), grid_spec=spec)

    def shift(x):
        return call(x)

    layout = P(None, "data")
    f = jax.jit(jax.shard_map(shift, mesh=mesh, in_specs=layout, out_specs=layout, check_vma=False))
    return f, (jax.ShapeDtypeStruct((8, 128 * n), jnp.float32, sharding=NamedSharding(mesh, layout)),)
"""


def test_a_kernel_that_sends_by_remote_dma_is_listed_beside_the_collectives(capsys, tmp_path):
    """A Pallas ppermute is no XLA collective: the lab finds no collective, and lists the kernel that communicates
    (libtpu marks it so) at the program's line, with the mesh axes it addresses."""
    (tmp_path / "remote.py").write_text(REMOTE_COPY)
    argv = ["--fn", f"{tmp_path / 'remote.py'}:right_permute", "--mesh", "data=8", "--target", "tpu:v5e:2x4"]
    found = inspect_json(capsys, *argv)
    (kernel,) = found["kernels"]
    assert found["collectives"] == [] and kernel["axes"] == ["data"]
    assert kernel["operand_bytes"] == kernel["result_bytes"] == 8 * 128 * 4
    assert kernel["function"] == "kernel" and kernel["remote_copies"] == [8 * 128 * 4]  # one copy of the block
    assert kernel["source"] == f"{tmp_path / 'remote.py'}:26"  # return call(x), in shift
    assert main(["inspect", *argv]) == 0
    assert "sends by itself (remote DMA, no XLA collective)" in capsys.readouterr().out


def test_the_python_api_renders_as_tables_html_and_json(devices):
    import lab
    from lab.explanation.program import build, load
    from lab.mesh import MeshSpec

    mesh = MeshSpec.parse("data=2,fsdp=4").build(devices, explicit=False)
    fn, args = build(load(str(EXAMPLES / "nnx_fsdp.py:train_step")), mesh, "nnx_fsdp")
    import jax

    with jax.set_mesh(mesh):
        explained = lab.explain(fn, *args)
    assert isinstance(explained, lab.Explanation) and len(explained.collectives) == 3
    html = explained._repr_html_()
    assert "<html" in html.lower() and "all-reduce" in html and "gradient" in html
    assert json.loads(json.dumps(explained.to_json()))["collectives"][0]["kind"]


def _dump(tmp_path: Path, *target: str) -> Path:
    """Compile an example in a fresh process with XLA_FLAGS=--xla_dump_to, as a user would on their machine."""
    folder = tmp_path / "dump"
    env = {**os.environ, "XLA_FLAGS": f"--xla_dump_to={folder}"}
    argv = ["inspect", "--fn", str(EXAMPLES / "nnx_fsdp.py:train_step"), "--mesh", "data=2,fsdp=4", "--json", *target]
    done = subprocess.run([sys.executable, "-m", "lab", *argv], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return folder, json.loads(done.stdout)


@pytest.mark.parametrize("target", [(), ("--target", "tpu:v5e:2x4")], ids=["cpu", "tpu-compile-only"])
def test_a_dump_reads_back_to_the_same_collectives(capsys, tmp_path, target):
    folder, compiled = _dump(tmp_path, *target)
    found = inspect_json(capsys, "--dump", str(folder), "--mesh", "data=2,fsdp=4", *target)
    assert any(m["name"] == "jit_step" for m in found["modules"])
    assert max(found["modules"], key=lambda m: m["lines"])["id"] == found["chosen"]

    def essentials(c):
        return (c["kind"], c["axes"], c["size_bytes"], c["source"], c["origin"]["kind"])

    assert sorted(map(essentials, found["collectives"])) == sorted(map(essentials, compiled["collectives"]))
    # a dump holds no machine: its links are known only on a compile-only target of its size
    assert {c["link"] for c in found["collectives"]} == ({"ici"} if target else {None})
    assert found["memory"]["total"] > 0
    # without a mesh the groups stay raw: no axes, the device ids as XLA wrote them
    raw = inspect_json(capsys, "--dump", str(folder))
    assert all(c["axes"] is None and c["groups"] for c in raw["collectives"])


SHARDED = """
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P


def explicit(mesh):  # JAX's explicit sharding: reshard needs axes of type Explicit
    x = jax.ShapeDtypeStruct((64, 256), jnp.float32, sharding=NamedSharding(mesh, P("data", None)))
    return jax.jit(lambda x: jax.sharding.reshard(x * 2, P(None, "data"))), (x,)


def auto(mesh):  # the partitioner's: a constraint that differs is an assertion on axes of type Explicit
    x = jax.ShapeDtypeStruct((64, 256), jnp.float32, sharding=NamedSharding(mesh, P("data", None)))
    return jax.jit(lambda x: jax.lax.with_sharding_constraint(x * 2, NamedSharding(mesh, P(None, "data")))), (x,)


def own_devices(mesh):  # a mesh of jax.devices(): this machine's, which on a compile-only target are not the target's
    import numpy as np
    from jax.sharding import Mesh

    own = Mesh(np.array(jax.devices()).reshape(4, 2), ("dp", "mp"))
    return jax.jit(lambda x: x * 2), (jax.ShapeDtypeStruct((64,), jnp.float32, sharding=NamedSharding(own, P("dp"))),)


def real_array(mesh):  # an array put on the devices: a compile-only target's run nothing
    x = jax.device_put(jnp.ones((64,)), NamedSharding(mesh, P("data")))
    return jax.jit(lambda x: x * 2), (x,)


def manual_spec(mesh):  # shard_map's own check: in_specs name an axis it leaves to the partitioner
    smap = jax.shard_map(lambda x: x, mesh=mesh, in_specs=P("data"), out_specs=P("data"), axis_names={"fsdp"})
    return jax.jit(smap), (jax.ShapeDtypeStruct((64,), jnp.float32, sharding=NamedSharding(mesh, P("data"))),)


def bare_spec(mesh):  # a bare PartitionSpec made under a mesh of its own, which the builder does not return
    with jax.set_mesh(jax.make_mesh((8,), ("x",), devices=mesh.devices.flat)):
        x = jax.ShapeDtypeStruct((64, 256), jnp.float32, sharding=P("x", None))
    return jax.jit(lambda x: x * 2), (x,)
"""


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--fn", "no_such_file.py:step"], "no file no_such_file.py"),
        (["--fn", "examples/nnx_fsdp.py"], "write FILE.py:NAME"),
        (["--fn", "examples/nnx_fsdp.py:nope"], "has no 'nope'"),
        (["--fn", "examples/nnx_fsdp.py:D_MODEL"], "is of type int, not a function"),
        (["--fn", "examples/nnx_fsdp.py:loss_fn"], "must take one argument, the mesh"),
        (["--fn", "examples/nnx_fsdp.py:MLP"], "raised"),
        (["--fn", "no.such.module:step"], "no module 'no.such.module'"),
        (["--fn", "math:pi"], "is of type float, not a function"),
        (["--fn", "examples/nnx_fsdp.py:train_step", "--mesh", "data=3"], "uses 3 devices"),
        (["--fn", "examples/nnx_fsdp.py:train_step", "--dump", "x"], "exclude each other"),
        (["--dump", "{tmp}/empty"], "holds no optimized HLO module"),
        (["--dump", "{tmp}/no_such_folder"], "no such folder"),
        (["--dump", "{tmp}/two", "--module", "jit_step"], "matches 2 modules"),
        (["--dump", "{tmp}/two", "--module", "jit_other"], "is not in the dump"),
        (["--dump", "{tmp}/two", "--mesh", "data=3"], "runs on 8 devices"),
        (["--dump", "{tmp}/two", "--mesh", "data=3,fsdp=-1"], "runs on 8 devices"),
        (["--fn", "{tmp}/user.py:returns_a_number"], "returned a value of type int; it must return (fn, args)"),
        (["--fn", "{tmp}/user.py:returns_three"], "returned a tuple of 3 items"),
        (["--fn", "{tmp}/user.py:fails"], "raised ZeroDivisionError: division by zero (user.py:10)"),
        (["--fn", "{tmp}/broken.py:step"], "importing"),
        (["--fn", "{tmp}/user.py:exits_0"], "called sys.exit(0)"),
        (["--fn", "{tmp}/user.py:exits_3"], "called sys.exit(3)"),
        (["--fn", "{tmp}/user.py:base_exception"], "raised Stop (user.py:29)"),
        (["--fn", "{tmp}/exits.py:step"], "importing"),
        (["--fn", "{tmp}/user.py:forever", "--timeout", "0.5"], "forever(mesh) did not finish within 0.5 s"),
        (["--fn", "{tmp}/user.py:fails", "--timeout", "-1"], "--timeout -1: must be at least 0"),
        (["--fn", "{tmp}/sharded.py:explicit", "--mesh", "data=8"], "give --axis-types explicit"),
        (["--fn", "{tmp}/sharded.py:auto", "--mesh", "data=8", "--axis-types", "explicit"], "--axis-types auto"),
        (["--fn", "{tmp}/sharded.py:bare_spec", "--mesh", "data=8"], "give it NamedSharding(mesh, P(...))"),
        (["--fn", "{tmp}/sharded.py:own_devices", "--target", "tpu:v5e:2x4"], "build the mesh from mesh.devices"),
        (["--fn", "{tmp}/sharded.py:real_array", "--target", "tpu:v5e:2x4"], "create no arrays"),
        (["--fn", "{tmp}/remote.py:right_permute", "--mesh", "data=8"], "give a compile-only TPU target"),
        (["--fn", "{tmp}/sharded.py:manual_spec", "--mesh", "data=2,fsdp=4", "--target", "tpu:v5e:2x4"], "manual"),
    ],
)
def test_mistakes_give_one_line_and_exit_2(capsys, devices, tmp_path, monkeypatch, argv, words):
    monkeypatch.chdir(EXAMPLES.parent)
    (tmp_path / "empty").mkdir()
    two = tmp_path / "two"
    two.mkdir()
    module = (
        "HloModule jit_step, num_partitions=8\nENTRY %main (p: f32[8]) -> f32[8] {\n  ROOT %p = f32[8] parameter(0)\n}"
    )
    for number in ("0001", "0002"):
        (two / f"module_{number}.jit_step.cpu_after_optimizations.txt").write_text(module)
    (tmp_path / "user.py").write_text(
        "def returns_a_number(mesh):\n    return 3\n\n\ndef returns_three(mesh):\n    return 1, 2, 3\n\n\n"
        "def fails(mesh):\n    return 1 / 0\n\n\n"
        "import sys\n\n\ndef exits_0(mesh):\n    sys.exit(0)\n\n\ndef exits_3(mesh):\n    sys.exit(3)\n\n\n"
        "class Stop(BaseException):\n    pass\n\n\ndef base_exception(mesh):\n    raise Stop\n\n\n"
        "def forever(mesh):\n    while True:\n        pass\n"
    )
    (tmp_path / "sharded.py").write_text(SHARDED)
    (tmp_path / "remote.py").write_text(REMOTE_COPY)
    (tmp_path / "broken.py").write_text("import no_such_module_anywhere\n")
    (tmp_path / "exits.py").write_text("import sys\n\nsys.exit(1)\n")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert main(["inspect", *argv]) == 2
    err = capsys.readouterr().err
    assert words in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    if "manual_spec" in argv[1]:  # the program's own mistake, not the compile-only target's
        assert "create no arrays" not in err


def test_a_gpu_cluster_compile_only_puts_fsdp_on_nvlink_and_data_on_infiniband(capsys):
    found = inspect_json(
        capsys, "--fn", str(EXAMPLES / "nnx_fsdp.py:train_step"), "--mesh", "data=2,fsdp=4", "--target", "gpu:h100:2x4"
    )
    links = {tuple(c["axes"]): c["link"] for c in found["collectives"]}
    assert links == {("fsdp",): "nvlink", ("data",): "infiniband"}  # 2 nodes of 4: fsdp inside a node, data across
    assert all(c["predicted_s"] > 0 and c["source"] for c in found["collectives"])
    gradient = next(c for c in found["collectives"] if c["axes"] == ["data"])
    # XLA:GPU concatenates both gradients into one buffer; both weights are still named
    assert gradient["origin"]["kind"] == "gradient" and gradient["origin"]["name"].count("kernel") == 2
    assert found["roofline"]["counted_from"] == "the HLO" and found["roofline"]["flops"] > 0


def test_a_gpu_module_from_the_test_data_reads_with_its_async_pairs(capsys):
    module = Path(__file__).parents[1] / "data" / "hlo" / "gpu_h100_2x4_matmul.hlo"
    found = inspect_json(capsys, "--hlo", str(module), "--mesh", "data=2,tensor=4", "--target", "gpu:h100:1x8")
    assert found["collectives"] and all(c["link"] == "nvlink" for c in found["collectives"])
    # two of the four NCCL pairs are marked is_sync (run in place, nothing overlaps them), two are async
    assert [c["async"] for c in found["collectives"]].count(True) == 2
    assert {c["kind"] for c in found["collectives"]} == {"all-gather"}


SLICED = """
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P


def step(mesh):
    def f(x, i):
        shifted = jnp.pad(x, ((0, 0), (1, 0)))[:, :-1]
        window = jax.lax.dynamic_slice_in_dim(x, i, 128, axis=1)
        return shifted, window

    x = jax.ShapeDtypeStruct((64, 512), jnp.float32, sharding=NamedSharding(mesh, P("data", "fsdp")))
    return jax.jit(f), (x, jax.ShapeDtypeStruct((), jnp.int32))
"""


def test_a_pad_and_a_dynamic_slice_along_a_split_dimension_are_named_at_their_lines(capsys, devices, tmp_path):
    (tmp_path / "sliced.py").write_text(SLICED)
    found = inspect_json(capsys, "--fn", f"{tmp_path / 'sliced.py'}:step", "--mesh", "data=2,fsdp=4")
    causes = {c["cause"]["op"]: c for c in found["collectives"] if c["cause"]}
    assert causes["pad"]["kind"] == "collective-permute" and causes["pad"]["source"].endswith("sliced.py:8")
    assert causes["pad"]["cause"]["why"].startswith("pad at sliced.py:8 pads a dimension that is split")
    assert causes["dynamic_slice"]["kind"] == "all-gather" and causes["dynamic_slice"]["source"].endswith("sliced.py:9")


SPLIT_OPS = """
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P


def _rows(mesh, shape, spec=P("fsdp")):
    return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, spec))


def flip(mesh):
    return jax.jit(lambda x: jnp.flip(x, axis=0)), (_rows(mesh, (1024, 16)),)


def shift(mesh):
    return jax.jit(lambda x: x[1:]), (_rows(mesh, (1024, 16)),)


def argmax(mesh):
    return jax.jit(lambda x: jnp.argmax(x, axis=0)), (_rows(mesh, (1024, 64)),)


def softmax(mesh):  # over the columns of a batch of 64 rows
    return jax.jit(lambda x: jax.nn.softmax(x, axis=1)), (_rows(mesh, (64, 1024), P(None, "fsdp")),)


def gram(mesh):
    return jax.jit(lambda a: a @ a.T), (_rows(mesh, (512, 256)),)


def attention(mesh):  # the sequence of q, k and v split over fsdp, as context parallelism by sharding does
    a = _rows(mesh, (2, 512, 8, 64), P("data", "fsdp"))
    return jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)), (a, a, a)


def batched(mesh):  # a batched matmul whose operands' batches two axes split
    a, b = _rows(mesh, (8, 256, 256), P("data")), _rows(mesh, (8, 256, 256), P("fsdp"))
    return jax.jit(lambda a, b: jnp.einsum("bij,bjk->bik", a, b)), (a, b)


def totals(mesh):  # a batch's column totals and its grand total, the batch split over fsdp
    return jax.jit(lambda x: (x.sum(axis=0), x.sum())), (_rows(mesh, (1024, 64)),)


def lookup(mesh):
    return jax.jit(lambda a, v: jnp.searchsorted(a, v)), (_rows(mesh, (1024,)), _rows(mesh, (64,), P()))
"""


@pytest.mark.parametrize(
    ("name", "op", "words"),
    [
        ("flip", "rev", "reverses a dimension that is split"),
        ("shift", "slice", "so they send it (a halo off a shard's edge"),
        ("argmax", "reduce", "argmax and argmin carry a value and its index"),
        ("softmax", "reduce_max", "each device takes the max of its own part, and the all-reduce takes the max of"),
        ("gram", "dot_general", "would split two of its result's dimensions over fsdp"),
    ],
)
def test_each_op_that_needs_a_split_dimension_whole_is_named_with_what_it_does(
    capsys, devices, tmp_path, name, op, words
):
    (tmp_path / "split_ops.py").write_text(SPLIT_OPS)
    found = inspect_json(capsys, "--fn", f"{tmp_path / 'split_ops.py'}:{name}", "--mesh", "fsdp=8")
    causes = [c["cause"] for c in found["collectives"]]
    assert causes and all(c is not None for c in causes), found["collectives"]
    assert any(op in c["op"] and words in c["why"] for c in causes), causes
    if name == "softmax":  # a row's max over a split dimension: the rows' statistics, as their sum's
        assert found["surprises"] == 0 and {c["origin"]["kind"] for c in found["collectives"]} == {"activation"}


def test_queries_and_keys_whose_sequences_one_axis_splits_are_told_apart_at_the_scores(capsys, devices, tmp_path):
    """Attention's scores [B, N, T, S]: q splits T and k splits S over fsdp, which cannot split both, so XLA gathers
    k whole: the lab says so from both declarations."""
    (tmp_path / "split_ops.py").write_text(SPLIT_OPS)
    found = inspect_json(capsys, "--fn", f"{tmp_path / 'split_ops.py'}:attention", "--mesh", "data=2,fsdp=4")
    (gathered,) = [c for c in found["collectives"] if c["origin"]["name"] == "k"]
    why = gathered["cause"]["why"]
    assert gathered["kind"] == "all-gather" and "would split two of its result's dimensions over fsdp" in why
    assert "from the sharding declared for q and the sharding declared for k" in why
    # the output, probabilities [B, N, T, S] times v [B, S, N, H]: the probabilities keep q's split of T, v's
    # split of S is summed over, and one axis cannot do both (NVIDIA/TransformerEngine#2023 resets it for FSDP)
    (gathered,) = [c for c in found["collectives"] if c["origin"]["name"] == "v"]
    why = gathered["cause"]["why"]
    assert gathered["kind"] == "all-gather" and "sums over a dimension v splits over fsdp, while" in why
    assert "keeps fsdp on a dimension of the result" in why and "the sharding declared for v" in why


def test_a_batched_matmul_whose_batches_two_axes_split_lines_them_up(capsys, devices, tmp_path):
    """einsum('bij,bjk->bik') of a split over data and b over fsdp along b: one dimension has one split (JAX's
    explicit sharding refuses it: 'dot_general requires lhs batch dimensions and rhs batch dimensions to have the
    consistent sharding'); under auto sharding XLA moves both, and the lab names the clash at the einsum."""
    (tmp_path / "split_ops.py").write_text(SPLIT_OPS)
    found = inspect_json(capsys, "--fn", f"{tmp_path / 'split_ops.py'}:batched", "--mesh", "data=2,fsdp=4")
    moved = {c["origin"]["name"]: c for c in found["collectives"]}
    assert set(moved) == {"a", "b"} and all(c["surprise"] for c in moved.values())
    lines = SPLIT_OPS.splitlines()
    einsum = lines.index(next(line for line in lines if "einsum(" in line)) + 1
    for c in moved.values():
        assert c["cause"]["op"] == "dot_general" and c["cause"]["line"].endswith(f"split_ops.py:{einsum}")
        assert "lines up a, split over data, and b, split over fsdp, along one dimension" in c["cause"]["why"]
        assert "split a and b over the same axis" in c["cause"]["hint"]


def test_a_sum_over_the_batch_of_an_unnamed_input_is_a_statistic_of_the_batch(capsys, devices, tmp_path):
    """x.sum(axis=0) over rows fsdp splits: a reduction of the input, not the input moved, and over its batch:
    what the layouts ask for, no surprise."""
    (tmp_path / "split_ops.py").write_text(SPLIT_OPS)
    found = inspect_json(capsys, "--fn", f"{tmp_path / 'split_ops.py'}:totals", "--mesh", "fsdp=8")
    (summed,) = found["collectives"]
    assert summed["origin"]["kind"] == "activation" and "statistics of the batch" in summed["origin"]["why"]
    assert found["surprises"] == 0


def test_a_program_with_no_backward_pass_reduces_no_gradient(capsys, devices, tmp_path):
    """searchsorted's result is the size of its second input, and nothing names either a weight: without autodiff
    in the program, no result is the gradient of an input."""
    (tmp_path / "split_ops.py").write_text(SPLIT_OPS)
    found = inspect_json(capsys, "--fn", f"{tmp_path / 'split_ops.py'}:lookup", "--mesh", "fsdp=8")
    assert found["collectives"] and all(c["origin"]["kind"] != "gradient" for c in found["collectives"])


FSDP_TP_MLP = """
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

def grads(mesh):  # MaxText's layout: weights over (fsdp, tensor), the batch over data and fsdp
    def a(shape, spec):
        return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, spec))

    def loss(p, x):
        h = jax.nn.silu(x @ p["wg"]) * (x @ p["wu"])
        return jnp.mean((h @ p["wd"]) ** 2)

    p = {"wg": a((512, 2048), P("fsdp", "tensor")), "wu": a((512, 2048), P("fsdp", "tensor")),
         "wd": a((2048, 512), P("tensor", "fsdp"))}
    return jax.jit(jax.grad(loss)), (p, a((8, 256, 512), P(("data", "fsdp"))))
"""


def test_gradients_returned_split_over_fewer_axes_than_their_weights_are_still_gradients(capsys, devices, tmp_path):
    """jax.grad of an FSDP x TP MLP with no out_shardings: XLA returns each gradient split over tensor only, twice
    a weight's shard, after one all-reduce over data and fsdp; that is the gradients' sum over the batch, not a
    surprise, and each weight's FSDP gather is one."""
    (tmp_path / "mlp.py").write_text(FSDP_TP_MLP)
    found = inspect_json(capsys, "--fn", f"{tmp_path / 'mlp.py'}:grads", "--mesh", "data=2,fsdp=2,tensor=2")
    (summed,) = [c for c in found["collectives"] if c["axes"] == ["data", "fsdp"]]
    assert summed["origin"]["kind"] == "gradient" and summed["origin"]["name"] == "p['wd'], p['wg'], p['wu']"
    assert "2 shards of the parameters (returned split over fewer axes" in summed["origin"]["why"]
    gathers = [c for c in found["collectives"] if c["kind"] == "all-gather"]
    assert gathers and all(c["origin"]["kind"] == "parameter" and "FSDP's gather" in c["cause"]["why"] for c in gathers)
    assert found["surprises"] == 0


GROUPED_QUERY = """
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

def step(mesh):  # grouped-query attention: 8 query heads over tensor=4, 2 key/value heads replicated
    B, S, D, H, KV, K = 8, 256, 512, 8, 2, 64

    def attention(p, x):
        q = jnp.einsum("bsd,dhk->bshk", x, p["wq"])
        k = jnp.einsum("bsd,dhk->bshk", x, p["wk"])
        v = jnp.einsum("bsd,dhk->bshk", x, p["wv"])
        k, v = jnp.repeat(k, H // KV, axis=2), jnp.repeat(v, H // KV, axis=2)
        o = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        return jnp.einsum("bshk,hkd->bsd", o, p["wo"])

    def grads(p, x):
        return jax.grad(lambda p: jnp.mean(attention(p, x) ** 2))(p)

    def a(shape, spec):
        return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, spec))

    p = {"wq": a((D, H, K), P(None, "tensor")), "wk": a((D, KV, K), P()), "wv": a((D, KV, K), P()),
         "wo": a((H, K, D), P("tensor"))}
    return jax.jit(grads), (p, a((B, S, D), P("data")))
"""


def test_key_value_heads_fewer_than_the_tensor_axis_move_over_part_of_it(capsys, devices, tmp_path):
    """2 key/value heads where tensor=4 splits 8 query heads: XLA lays each key/value head over half of tensor's
    devices, so their collectives run within groups no whole axis forms, which the lab names as Shardy does
    (tensor:(1)2, devices 2 apart; tensor:(2)2, neighbours). The repeat's backward pass sums the gradients of the 4
    query heads that share a key/value head over the neighbours that hold 2 of them each; the key/value weights,
    declared whole, are never said to be stored split."""
    (tmp_path / "gqa.py").write_text(GROUPED_QUERY)
    found = inspect_json(capsys, "--fn", f"{tmp_path / 'gqa.py'}:step", "--mesh", "data=2,tensor=4")
    by_axes = {}
    for c in found["collectives"]:
        by_axes.setdefault(tuple(c["axes"] or ()), []).append(c)
    (summed,) = by_axes["tensor:(2)2",]
    assert summed["kind"] == "all-reduce" and summed["cause"]["op"] == "reduce_sum"
    repeat = GROUPED_QUERY.splitlines().index(next(line for line in GROUPED_QUERY.splitlines() if "repeat(" in line))
    assert summed["source"].endswith(f"gqa.py:{repeat + 1}") and "split over tensor:(2)2" in summed["cause"]["why"]
    gathered = by_axes["tensor:(1)2",]
    assert sorted(c["origin"]["name"] for c in gathered) == ["p['wk']", "p['wv']"]
    assert all(c["kind"] == "all-gather" and "declared whole" in c["cause"]["why"] for c in gathered)
    assert not [c for c in found["collectives"] if c["cause"] and "as declared" in c["cause"]["why"]]


OWN_MESH = """
import jax, jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P


def step(_):  # the script's own mesh and axis names, as an issue's reproducer has them
    mesh = jax.make_mesh((2, 4), ("batch", "model"), axis_types=(AxisType.Auto,) * 2)
    x = jax.ShapeDtypeStruct((64, 256), jnp.float32, sharding=NamedSharding(mesh, P("batch", "model")))
    w = jax.ShapeDtypeStruct((256, 512), jnp.float32, sharding=NamedSharding(mesh, P("model", None)))
    return jax.jit(lambda x, w: jnp.tanh(x @ w)), (x, w)
"""


def test_a_program_on_a_mesh_of_its_own_is_told_in_its_own_axis_names(capsys, devices, tmp_path):
    (tmp_path / "own.py").write_text(OWN_MESH)
    found = inspect_json(capsys, "--fn", f"{tmp_path / 'own.py'}:step", "--mesh", "data=2,tensor=4")
    assert found["mesh"] == {"batch": 2, "model": 4}
    assert [c["axes"] for c in found["collectives"]] == [["model"]]  # the contraction over model, summed


REMATERIALIZED = """
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P


def step(mesh):
    x = jax.ShapeDtypeStruct((64, 256), jnp.float32, sharding=NamedSharding(mesh, P("data", "tensor")))
    w = jax.ShapeDtypeStruct((256, 512), jnp.float32, sharding=NamedSharding(mesh, P("tensor", None)))

    def f(x, w):
        y = jnp.einsum("bd,df->bf", x, w, out_sharding=P("data", None))
        return jax.sharding.reshard(y, P(None, "tensor"))

    return jax.jit(f), (x, w)
"""


def test_the_partitioners_involuntary_rematerialization_is_told_at_its_line_in_partition_specs(capsys, tmp_path):
    """XLA:CPU's partitioner writes it to stderr from C++ when it finds no efficient reshard between two layouts;
    the report carries it, in the user's specs, and stderr does not."""
    (tmp_path / "remat.py").write_text(REMATERIALIZED)
    argv = ["--fn", f"{tmp_path / 'remat.py'}:step", "--mesh", "data=2,tensor=4", "--axis-types", "explicit"]
    done = subprocess.run([sys.executable, "-m", "lab", "inspect", *argv, "--json"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    (remat,) = json.loads(done.stdout)["rematerializations"]
    assert remat["line"] == f"{tmp_path / 'remat.py'}:11" and remat["op"].endswith("bd,df->bf/dot_general")
    assert (remat["from"], remat["to"]) == ("P('data', None)", "P(None, 'tensor')")
    assert "Involuntary" not in done.stderr


SHIFTED_TOKENS = """HloModule jit_step, num_partitions=2

ENTRY %main (p0: s32[4,65], p1: f32[16,32]) -> f32[64,16] {
  %p0 = s32[4,65]{1,0} parameter(0), sharding={devices=[2,1]<=[2]}, metadata={op_name="tokens"}
  %p1 = f32[16,32]{1,0} parameter(1), sharding={replicated}, metadata={op_name="params['w']"}
  %t = f32[4,65]{1,0} convert(%p0)
  %s = f32[4,64]{1,0} slice(%t), slice={[0:4], [0:64]}
  %w = f32[4,16]{1,0} slice(%p1), slice={[0:4], [0:16]}
  %x = f32[64,16]{1,0} dot(%s, %w), lhs_contracting_dims={0}, rhs_contracting_dims={0}
  ROOT %a2a = f32[64,16]{1,0} all-to-all(%x), channel_id=1, replica_groups={{0,1}}, dimensions={0}
}
"""


def test_s_plus_one_token_ids_make_an_activation_of_the_sequence_s():
    """Token ids [B, S + 1] (inputs and targets shifted by one): a value with a dimension S carries the tokens."""
    from lab.explanation.explain import explain_hlo

    (moved,) = explain_hlo(SHIFTED_TOKENS, (2, 1, 1, 1, 1)).collectives
    assert moved.origin.kind == "activation" and "64 = the sequence of tokens, less the token" in moved.origin.why
