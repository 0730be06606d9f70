"""Pruning, ranking and the frontier on small cases (closed form only: no compile)."""

from dataclasses import replace

import jax
import pytest
from flax import nnx

from lab.mesh import MeshSpec
from lab.model import ModelConfig, abstract_model
from lab.plan.closed_form import (
    PARAM_BYTES,
    _embed_minor,
    _layer_weights,
    _links,
    _roofline,
    _seconds,
    _without,
    estimate,
    layer_kinds,
    params_per_chip,
)
from lab.plan.overlap import Overlap
from lab.plan.rank import closed_form_plan, differing_terms, frontier, spearman
from lab.plan.space import Layout
from lab.predict.spec import parse_model
from lab.rules import logical_axes
from tests.plan.test_space import SMALL, problem


def test_parameters_per_chip_add_up_to_the_model_and_split_over_fsdp():
    model = replace(SMALL, layers=4)
    assert params_per_chip(model, MeshSpec(data=8)) == model.parameters
    assert params_per_chip(model, MeshSpec(fsdp=8)) == pytest.approx(model.parameters / 8)
    moe = ModelConfig(vocab=64, embed=32, heads=2, head_dim=16, mlp=16, layers=2, experts=4)
    assert params_per_chip(moe, MeshSpec(data=8)) == moe.parameters


def test_mixed_stacks_add_up_to_the_model_kind_by_kind():
    deepseek_like = ModelConfig(
        embed=32,
        heads=2,
        head_dim=16,
        mlp=16,
        layers=4,
        experts=4,
        shared_experts=1,
        dense_layers=1,
        dense_mlp=64,
        kv_rank=16,
        q_rank=8,
        rope_dim=4,
        feed_forward="swiglu",
    )
    maverick_like = replace(deepseek_like, dense_layers=0, moe_every=2, kv_rank=0, q_rank=0, rope_dim=0, kv_heads=1)
    for model in (deepseek_like, maverick_like):
        assert [n for n, _ in layer_kinds(model)] == [model.layers - model.moe_layers, model.moe_layers]
        assert params_per_chip(model, MeshSpec(data=8)) == model.parameters
        assert params_per_chip(model, MeshSpec(fsdp=2, expert=4)) < model.parameters / 2
    # GPT-OSS's: MoE layers alternately windowed and global, biases and sinks; with Maverick's interleaving too
    gpt_oss_like = replace(
        maverick_like, moe_every=1, shared_experts=0, biases=True, sinks=True, window=8, global_every=2
    )
    interleaved = replace(gpt_oss_like, moe_every=2, global_every=4, layers=8)
    assert [(n, kind.window, kind.experts) for n, kind in layer_kinds(gpt_oss_like)] == [(2, 0, 4), (2, 8, 4)]
    # periods of 4: dense windowed, MoE windowed, dense windowed, MoE global
    assert [(n, kind.window, kind.experts) for n, kind in layer_kinds(interleaved)] == [(4, 8, 0), (2, 0, 4), (2, 8, 4)]
    for model in (gpt_oss_like, interleaved):
        assert params_per_chip(model, MeshSpec(data=8)) == model.parameters
        assert params_per_chip(model, MeshSpec(fsdp=2, expert=4)) < model.parameters / 2


def test_the_weights_fsdp_gathers_one_by_one_add_up_to_the_layer():
    for model in (
        replace(SMALL, layers=4),
        ModelConfig(vocab=64, embed=32, heads=2, head_dim=16, mlp=16, layers=2, experts=4),
    ):
        vocab = (1 if model.tied else 2) * model.vocab * model.embed + model.embed
        assert sum(_layer_weights(model, MeshSpec(data=8))) * model.layers + vocab == model.parameters
        assert sum(_layer_weights(model, MeshSpec(tensor=2, fsdp=4))) < sum(_layer_weights(model, MeshSpec(fsdp=8)))


@pytest.mark.parametrize("shared", [0, 1])
def test_the_gradients_all_reduced_whole_are_the_declared_weights_with_embed_last(shared):
    """`_embed_minor` (what libtpu all-reduces instead of reduce-scattering) against the model's own declarations:
    every block parameter whose last logical axis is ``embed``, a layer's worth."""
    for model in (
        replace(SMALL, layers=4),
        ModelConfig(vocab=64, embed=32, heads=2, head_dim=16, mlp=16, layers=2, experts=4, shared_experts=shared),
    ):
        _, state = abstract_model(model)
        blocks = jax.tree.leaves(state["blocks"], is_leaf=lambda x: isinstance(x, nnx.Variable))
        declared = sorted(v.size / model.layers for v in blocks if logical_axes(v)[-1] == "embed" and v.ndim > 2)
        assert sorted(_embed_minor(model, MeshSpec(data=8))) == declared


def test_a_gradient_split_along_its_minor_dimension_waits_for_its_all_reduce():
    """Over part of a slice the closed form hides the reduce-scatters under the backward, but not the all-reduces of
    the out-projection's and W_out's gradients: the fsdp axis exposes at least their time, every layer (a layer of
    Llama 3 8B's shapes, 8192 tokens a chip: its compute would hide every gather and reduce-scatter)."""
    model = replace(parse_model("llama3-8b"), vocab=512, layers=4, seq=4096)
    case = problem(model, sequences=16)
    layout = Layout(MeshSpec(data=2, fsdp=4), None, "full")
    link = _links(case, layout)["fsdp"]
    all_reduced = sum(_seconds("all-reduce", PARAM_BYTES * w, link) for w in _embed_minor(model, layout.mesh))
    fsdp = next(a for a in estimate(case, layout).axes if a.axis == "fsdp")
    assert all_reduced > 0 and fsdp.exposed_s >= model.layers * all_reduced


def test_a_layers_reduce_scatters_hide_only_where_libtpu_runs_them_asynchronously():
    """libtpu's ``%all-reduce-scatter`` fusions are synchronous on every generation but TPU7x (`lab.plan.overlap`):
    there each layer's reduce-scatters are exposed whole, the major-dimension weights' (the minor ones' all-reduces
    wait either way)."""
    model = replace(parse_model("llama3-8b"), vocab=512, layers=4, seq=4096)
    case, layout = problem(model, sequences=16), Layout(MeshSpec(data=2, fsdp=4), None, "full")
    link = _links(case, layout)["fsdp"]
    scattered = _without(list(_layer_weights(model, layout.mesh)), list(_embed_minor(model, layout.mesh)))
    scatter_s = sum(_seconds("reduce-scatter", PARAM_BYTES * w, link) for w in scattered)

    def fsdp_exposed(overlap: Overlap) -> float:
        return next(a for a in estimate(replace(case, overlap=overlap), layout).axes if a.axis == "fsdp").exposed_s

    waited = fsdp_exposed(Overlap(gathers=True, scatters=False)) - fsdp_exposed(Overlap(gathers=True, scatters=True))
    assert scatter_s > 0 and waited == pytest.approx(model.layers * scatter_s)


def test_an_fsdp_axis_across_slices_rewrites_every_gathered_weight_and_gradient():
    """libtpu gathers across slices in two tiers and rewrites what arrives in the mesh's order (the ``reshard``
    fusions, results/layout_plans): HBM time that fsdp=8 within one slice does not spend, two gathers and a
    gradient per layer, each read and written."""
    model = replace(parse_model("llama3-8b"), vocab=512, layers=4, seq=4096)
    mesh = MeshSpec(fsdp=8)
    across = estimate(problem(model, sequences=32, torus=(2, 2), slices=2), Layout(mesh, "fsdp", "minimal"))
    within = estimate(problem(model, sequences=32, torus=(2, 4)), Layout(mesh, None, "minimal"))
    weights = model.layers * PARAM_BYTES * sum(_layer_weights(model, mesh))
    rewritten = (2 * 2 + 2) * weights / _roofline(problem(model)).bytes_per_s
    assert rewritten > 0 and across.hbm_s - within.hbm_s == pytest.approx(rewritten)


def test_the_experts_rows_follow_the_capacity_and_a_dropless_layer_its_row_tiles():
    """Over a balanced buffer (capacity 1: the k routed rows a token), the experts' matmuls add (cf - 1)·k rows a
    token at a capacity factor, E - k without one (each buffer holds its whole sequence), and dropless the row
    tiles megablox visits beyond the routed rows: 128 tokens a chip x 2 choices = 256 rows, one tile of 256,
    visited once and once more for each of the 7 other experts, 8 x 256 rows in all, 6 rows a token beyond k."""
    moe = replace(SMALL, experts=8, top_k=2, capacity_factor=1.0)
    layout = Layout(MeshSpec(fsdp=8), None, "full")

    def flops(**capacity) -> float:
        return estimate(problem(replace(moe, **capacity)), layout).flops_per_chip

    routed = flops()
    extra_row = (flops(capacity_factor=1.25) - routed) / (0.25 * 2)  # one more row a token through the experts
    assert extra_row > 0
    assert flops(capacity_factor=None) - routed == pytest.approx((8 - 2) * extra_row)
    assert flops(capacity_factor=None, dropless=True) - routed == pytest.approx((8 * 256 / 128 - 2) * extra_row)


def test_everything_ranked_fits_and_is_sorted_by_step_time():
    plan = closed_form_plan(problem(sequences=16))
    assert plan.enumerated > len(plan.candidates) > 0 or plan.enumerated == len(plan.candidates)
    steps = [c.estimate.step_s for c in plan.candidates]
    assert steps == sorted(steps)
    assert all(c.estimate.memory.total <= c.estimate.hbm_bytes for c in plan.candidates)
    assert plan.pure_fsdp is not None and plan.pure_fsdp.layout.mesh.fsdp == 8


def test_pruning_drops_what_does_not_fit_and_names_the_closest():
    big = replace(SMALL, embed=8192, mlp=32768, heads=64, kv_heads=8, head_dim=128, layers=96, vocab=128000)
    plan = closed_form_plan(problem(big, torus=(2, 2)))
    assert plan.candidates == ()
    least = min(e.memory.total for e in plan.everything)
    assert plan.closest.memory.total == least > plan.closest.hbm_bytes


def test_remat_trades_memory_for_recompute():
    plan = closed_form_plan(problem())
    by = {(str(c.layout.mesh), c.layout.remat): c.estimate for c in plan.candidates}
    full, none = by[("fsdp=8", "full")], by[("fsdp=8", "none")]
    assert full.memory.activations < none.memory.activations
    assert full.flops_per_chip > none.flops_per_chip


def test_tensor_parallelism_shows_as_an_exposed_term_against_pure_fsdp():
    plan = closed_form_plan(problem())
    by = {(str(c.layout.mesh), c.layout.remat): c.estimate for c in plan.candidates}
    terms = {t for t, _, _ in differing_terms(by[("fsdp=4,tensor=2", "full")], by[("fsdp=8", "full")])}
    assert "exposed tensor s" in terms and "memory: params bytes" in terms


def test_the_frontier_is_every_layout_nothing_beats_on_both():
    plan = closed_form_plan(problem())
    edge = {id(e) for e in frontier(plan.everything)}
    points = {(e.memory.total, e.step_s) for e in plan.everything}
    for e in plan.everything:
        m, s = e.memory.total, e.step_s
        beaten = any(om <= m and os <= s and (om, os) != (m, s) for om, os in points)
        assert not (id(e) in edge and beaten)
    kept = {(e.memory.total, e.step_s) for e in frontier(plan.everything)}
    assert kept == {
        (m, s) for m, s in points if not any(om <= m and os <= s and (om, os) != (m, s) for om, os in points)
    }


def test_spearman_is_one_for_the_same_order_and_minus_one_reversed_ties_averaged():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1)
    assert spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(0.9486833)  # scipy.stats.spearmanr's value
