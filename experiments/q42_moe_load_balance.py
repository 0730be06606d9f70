"""Load balance in MoE: the router's rich get richer, and what stops it.

Question #42 says MoE routing drifts out of balance: experts that receive
tokens are trained, get better, and receive more, until a few take most of
the load, overflow their capacity and drop tokens while the others idle. This
page trains a small MoE language model (attention and RMSNorm from
`lab.model`, the MoE layer of `lab.parallel.expert`, top-1, capacity factor
1.25) on synthetic tokens with a skewed (Zipf) distribution, once with no
balancing and once with each counter-measure of `lab.moe`:

* the Switch auxiliary loss α·N·Σ f_i·P_i at several α;
* the router z-loss alone (ST-MoE: meant for stability, not balance);
* DeepSeek-V3's auxiliary-loss-free bias, nudged by γ·sign(mean - load);
* noisy top-k;
* expert choice, balanced by construction.

Every step records tokens per expert, max/mean, coefficient of variation,
dropped share and router entropy; the plots show per-expert load over steps,
dropped tokens, and final loss against balance.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from matplotlib.figure import Figure

from lab.devices import DEFAULT_TARGET, devices_for
from lab.errors import LabError
from lab.model import Attention, ModelConfig, RMSNorm, WholeWeights, next_token_loss
from lab.moe import Balance, RouterConfig, load_metrics, update_bias
from lab.parallel.expert import ExpertParams, MoEConfig, moe_local
from lab.progress import track
from lab.report import Result, Table, provenance
from lab.theory import switch_aux_loss_range
from lab.verdict import check

QUESTION = "#42"


@dataclass(frozen=True)
class Config:
    target: str = DEFAULT_TARGET
    """where to run; training uses one device of it"""
    steps: int = 240
    """optimizer steps per run"""
    batch: int = 16
    """sequences per step (of 32 tokens: 512 tokens routed per step and layer)"""
    layers: int = 2
    """MoE blocks (attention + MoE layer each)"""
    experts: int = 8
    """experts per MoE layer (top-1 routing)"""
    capacity_factor: float = 1.25
    """C = ceil(T/E · cf) slots per expert"""
    learning_rate: float = 1e-2
    """Adam; high enough for the drift to show within a few hundred steps"""
    aux_alphas: tuple[float, ...] = (0.001, 0.01, 0.1)
    """Switch auxiliary-loss weights α to try"""
    z_loss: float = 1e-3
    """ST-MoE's β"""
    bias_rate: float = 1e-2
    """DeepSeek-V3's γ (they use 1e-3 over far more steps)"""
    noise_std: float = 1.0
    """noisy top-k: standard deviation of the noise added to the router logits (0: no noisy run)"""
    zipf: float = 1.2
    """skew of the token distribution: P(rank r) ∝ r^-zipf"""
    seed: int = 0
    """seed of the data and of the initial weights (every run starts from the same weights)"""


def model_config(config: Config) -> ModelConfig:
    """lab.model's sizes for the attention and norms; `mlp` is each expert's hidden width."""
    return ModelConfig(vocab=128, embed=64, heads=4, head_dim=16, mlp=128, layers=config.layers, seq=32)


@dataclass(frozen=True)
class Run:
    """One training run: a router and its balancing coefficients."""

    name: str
    router: RouterConfig
    balance: Balance


THEORY = r"""
**Why it drifts.** The router's gradient reaches an expert's logit only through the gate of the tokens sent to it.
If that expert helps, its gate grows for every token that resembles them, more tokens come, it is trained more and
helps more: a positive feedback loop (Shazeer et al. 2017, §4: "the gating network tends to converge to a state where
it always produces large weights for the same few experts").

**Switch auxiliary loss** (Fedus et al. 2021, arXiv:2101.03961, eq. 4): L_aux = α · N · Σ_i f_i · P_i, with f_i the
share of tokens routed to expert i (not differentiable) and P_i the router's mean probability for it. Balanced,
f_i = P_i = 1/N and L_aux = α; collapsed onto one expert, L_aux = α·N. The quick reference's bounds 1/N and 1 are
those of Σ f_i·P_i without the factor N (`lab.theory.switch_aux_loss_range`).

**Router z-loss** (Zoph et al. 2022, ST-MoE, arXiv:2202.08906, eq. 5): β · mean_t (log Σ_j e^{x_tj})². It keeps
logits small for numerical stability; it says nothing about which expert wins.

**Auxiliary-loss-free bias** (DeepSeek-V3, arXiv:2412.19437, §2.1.2): a bias b_i is added to the scores only to choose
the top-k, and after each step b_i += γ · sign(mean load − load_i). No gradient, no interference with the loss.

**Noisy top-k** (Shazeer et al. 2017, eq. 3): noise on the logits lets near-tied experts take turns.

**Expert choice** (Zhou et al. 2022, arXiv:2202.09368): each expert takes its top-C tokens, C = T·k/E·cf, so the load
is exactly balanced; the cost moves to tokens: some get several experts, some none.

**Capacity** C = ceil(T·k/E · cf) per expert (here T = batch · 32 tokens per step and layer): what overflows is
dropped and skips the layer through the residual connection.
"""


def run(config: Config) -> Result:
    devices = devices_for(config.target)
    runs = _runs(config)
    batches = skewed_tokens(config, config.steps + 4)
    histories = {r.name: _train(r, config, batches, devices[0]) for r in track(runs, "train MoE language models")}
    checks = _checks(config, histories)
    return Result(
        summary=_summary(config, histories),
        theory=THEORY,
        tables=[_table(config, histories)],
        checks=checks,
        plots={
            "load_over_steps": _plot_load(histories),
            "imbalance": _plot_imbalance(histories),
            "loss_vs_balance": _plot_loss_vs_balance(histories),
        },
        notes=_notes(config, histories),
        provenance=provenance(target=config.target, devices=devices[:1], mesh="one device"),
        data={name: {k: np.asarray(v).tolist() for k, v in h.items()} for name, h in histories.items()},
    )


def _runs(config: Config) -> list[Run]:
    if config.steps < 20:
        raise LabError(f"steps={config.steps}: use at least 20 steps, or the drift has no time to show")
    tokens = RouterConfig(experts=config.experts, top_k=1, capacity_factor=config.capacity_factor)
    return [
        Run("no balancing", tokens, Balance()),
        *(Run(f"aux loss α={alpha:g}", tokens, Balance(aux_loss=alpha)) for alpha in config.aux_alphas),
        Run(f"z-loss β={config.z_loss:g}", tokens, Balance(z_loss=config.z_loss)),
        Run(f"bias γ={config.bias_rate:g}", tokens, Balance(bias_rate=config.bias_rate)),
        *(
            [Run(f"noisy top-k σ={config.noise_std:g}", replace(tokens, noise_std=config.noise_std), Balance())]
            if config.noise_std > 0
            else []
        ),
        Run("expert choice", replace(tokens, choice="experts"), Balance()),
    ]


# --- data: skewed tokens with something to learn ------------------------------------------


def skewed_tokens(config: Config, count: int, follow: float = 0.8) -> np.ndarray:
    """Batches [count, batch, seq+1]: each next token is a fixed successor of the last (prob. `follow`) or a Zipf draw.

    The Zipf draws make a few tokens far more frequent than the rest; the
    successor rule gives the model something to learn beyond the frequencies.
    """
    model, rng = model_config(config), np.random.default_rng(config.seed)
    ranks = np.arange(1, model.vocab + 1, dtype=np.float64)
    zipf = ranks**-config.zipf / np.sum(ranks**-config.zipf)
    successor = np.random.default_rng(config.seed + 1).permutation(model.vocab)
    tokens = np.empty((count, config.batch, model.seq + 1), np.int32)
    tokens[..., 0] = rng.choice(model.vocab, (count, config.batch), p=zipf)
    for position in range(1, model.seq + 1):
        fresh = rng.choice(model.vocab, (count, config.batch), p=zipf)
        tokens[..., position] = np.where(
            rng.random((count, config.batch)) < follow, successor[tokens[..., position - 1]], fresh
        )
    return tokens


# --- the model: lab.model's attention, an MoE layer instead of the MLP -----------------------


WHOLE = WholeWeights()  # one device: weights are used as stored


class RouterBias(nnx.Variable):
    """DeepSeek-V3's selection bias: state, not a parameter (no gradient)."""


class MoEBlock(nnx.Module):
    """Pre-norm block: x + attention(norm(x)), then x + moe(norm(x))."""

    def __init__(self, model: ModelConfig, moe: MoEConfig, rngs: nnx.Rngs):
        e, d, f = moe.router.experts, moe.d_model, moe.d_ff
        self.attention_norm, self.attention, self.moe_norm = (
            RMSNorm(model, rngs),
            Attention(model, rngs),
            RMSNorm(model, rngs),
        )
        self.router = nnx.Param(jax.random.normal(rngs.params(), (d, e)) * 0.02)  # small: routing starts near uniform
        self.w_in = nnx.Param(jax.random.normal(rngs.params(), (e, d, f)) / np.sqrt(d))
        self.w_out = nnx.Param(jax.random.normal(rngs.params(), (e, f, d)) / np.sqrt(f))
        self.bias = RouterBias(jnp.zeros(e))
        self.moe = moe

    def __call__(self, x_BSD: jax.Array, balance: Balance, noise_key: jax.Array):
        x_BSD = x_BSD + self.attention(self.attention_norm(x_BSD, WHOLE), WHOLE)
        b, s, d = x_BSD.shape
        params = ExpertParams(self.router[...], self.w_in[...], self.w_out[...])
        out = moe_local(
            params,
            self.moe_norm(x_BSD, WHOLE).reshape(b * s, d),
            self.moe,
            balance,
            bias_E=self.bias[...],
            noise_key=noise_key,
        )
        return x_BSD + out.y_TD.reshape(b, s, d), out


class MoELanguageModel(nnx.Module):
    """tokens [B, S] -> logits [B, S, V], with each block's MoE output (loss, load counts)."""

    def __init__(self, model: ModelConfig, moe: MoEConfig, rngs: nnx.Rngs):
        self.embedding = nnx.Param(jax.random.normal(rngs.params(), (model.vocab, model.embed)))
        self.blocks = nnx.List([MoEBlock(model, moe, rngs) for _ in range(model.layers)])
        self.final_norm = RMSNorm(model, rngs)
        self.unembed = nnx.Param(jax.random.normal(rngs.params(), (model.embed, model.vocab)) / np.sqrt(model.embed))

    def __call__(self, tokens_BS: jax.Array, balance: Balance, noise_key: jax.Array):
        x_BSD = self.embedding[...][tokens_BS]
        outputs = []
        for index, block in enumerate(self.blocks):
            x_BSD, out = block(x_BSD, balance, jax.random.fold_in(noise_key, index))
            outputs.append(out)
        return self.final_norm(x_BSD, WHOLE) @ self.unembed[...], outputs


# --- training ------------------------------------------------------------------------------


def _train(run_: Run, config: Config, batches: np.ndarray, device) -> dict[str, np.ndarray]:
    """Train one run from the shared initial weights: per step, the loss and load metrics (last axis: layer)."""
    model = model_config(config)
    moe = MoEConfig(d_model=model.embed, d_ff=model.mlp, router=run_.router)
    params, state = _initial_weights(model, config.experts, config.seed)
    train = _compiled_training(model, moe, config.learning_rate, config.seed)
    balance = jax.tree.map(lambda v: jnp.asarray(v, jnp.float32), run_.balance)
    history, eval_loss = train(
        params,
        state,
        jax.device_put(batches[: config.steps], device),
        jax.device_put(batches[config.steps :], device),
        balance,
    )
    return {**jax.tree.map(np.asarray, history), "eval_loss": np.asarray(eval_loss)}


def _model(model: ModelConfig, moe: MoEConfig, seed: int) -> MoELanguageModel:
    with nnx.use_eager_sharding(False):  # lab.model declares logical axes; on one device they mean nothing
        return MoELanguageModel(model, moe, nnx.Rngs(seed))


@functools.cache
def _initial_weights(model: ModelConfig, experts: int, seed: int) -> tuple[nnx.State, nnx.State]:
    """Every run starts from the same weights: router settings change the program, not the parameters."""
    moe = MoEConfig(d_model=model.embed, d_ff=model.mlp, router=RouterConfig(experts=experts))
    return jax.jit(lambda: nnx.split(_model(model, moe, seed), nnx.Param, ...)[1:])()


@functools.cache
def _compiled_training(model: ModelConfig, moe: MoEConfig, learning_rate: float, seed: int):
    """Every step (a scan) and the held-out loss as one jitted program per router structure.

    Router settings are static (they shape the program); the balancing
    coefficients are traced, so all auxiliary-loss, z-loss and bias runs share it.
    """
    optimizer = optax.adam(learning_rate)
    graphdef = nnx.split(nnx.eval_shape(lambda: _model(model, moe, seed)), nnx.Param, ...)[0]

    @jax.jit
    def train(params, state, batches_SBT, held_out_NBT, balance: Balance):
        def step(carry, batch):
            params, state, opt_state = carry
            tokens_BT, index = batch

            def loss_fn(params):
                logits, outputs = nnx.merge(graphdef, params, state)(
                    tokens_BT[:, :-1], balance, jax.random.fold_in(jax.random.key(seed), index)
                )
                cross_entropy = next_token_loss(logits, tokens_BT[:, 1:])
                return cross_entropy + sum(o.balance_loss for o in outputs), (cross_entropy, outputs)

            (_, (cross_entropy, outputs)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            model = nnx.merge(graphdef, optax.apply_updates(params, updates), state)
            for block, out in zip(model.blocks, outputs):
                block.bias[...] = update_bias(block.bias[...], out.counts.tokens_per_expert, balance.bias_rate)
            _, params, state = nnx.split(model, nnx.Param, ...)
            return (params, state, opt_state), _record(cross_entropy, outputs)

        steps = jnp.arange(batches_SBT.shape[0])
        (params, state, _), history = jax.lax.scan(step, (params, state, optimizer.init(params)), (batches_SBT, steps))
        model = nnx.merge(graphdef, params, state)
        held_out_BT = held_out_NBT.reshape(-1, held_out_NBT.shape[-1])  # one forward pass over all held-out sequences
        return history, next_token_loss(model(held_out_BT[:, :-1], Balance(), jax.random.key(0))[0], held_out_BT[:, 1:])

    return train


def _record(cross_entropy, outputs) -> dict[str, jax.Array]:
    metrics = [load_metrics(o.counts) for o in outputs]
    stacked = jax.tree.map(lambda *layers: jnp.stack(layers, -1), *metrics)
    return {
        "loss": cross_entropy,
        "balance_loss": jnp.stack([o.balance_loss for o in outputs], -1),
        "tokens_per_expert": stacked.tokens_per_expert.T,  # (layers, E)
        "max_over_mean": stacked.max_over_mean,
        "coefficient_of_variation": stacked.coefficient_of_variation,
        "dropped_share": stacked.dropped_share,
        "unserved_share": stacked.unserved_share,
        "router_entropy": stacked.router_entropy,
    }


# --- checks and the page ---------------------------------------------------------------------


def _late(history: dict, key: str) -> float:
    """Mean over the last fifth of the steps and over layers."""
    values = history[key]
    return float(np.mean(values[-max(1, len(values) // 5) :]))


def _early(history: dict, key: str) -> float:
    values = history[key]
    return float(np.mean(values[: max(1, len(values) // 20)]))


def _checks(config: Config, histories: dict) -> list:
    none = histories["no balancing"]
    drift = _late(none, "max_over_mean") / _early(none, "max_over_mean")
    checks = [
        check(
            f"no balancing: load concentrates over training (max/mean ×{drift:.2f}, first 5% of steps to last 20%)",
            True,
            drift > 1.5,
        )
    ]
    for alpha in config.aux_alphas:
        name = f"aux loss α={alpha:g}"
        checks.append(
            check(
                f"{name}: Switch loss at step 0, router near uniform (theory α·N·Σ f·(1/N) = α)",
                switch_aux_loss_range(config.experts, alpha)[0],
                float(np.mean(histories[name]["balance_loss"][0])),
                rtol=0.05,
            )
        )
    strongest = f"aux loss α={max(config.aux_alphas):g}"
    for name in (strongest, f"bias γ={config.bias_rate:g}"):
        checks.append(
            check(
                f"{name}: less imbalance than no balancing at the end (max/mean "
                f"{_late(histories[name], 'max_over_mean'):.2f} vs {_late(none, 'max_over_mean'):.2f})",
                True,
                _late(histories[name], "max_over_mean") < _late(none, "max_over_mean"),
            )
        )
    chosen = histories["expert choice"]
    checks.append(
        check(
            "expert choice: every expert takes exactly C tokens at every step (max/mean)",
            1.0,
            float(np.max(chosen["max_over_mean"])),
            rtol=1e-6,
        )
    )
    checks.append(check("expert choice: no assignment is dropped", 0.0, float(np.max(chosen["dropped_share"]))))
    return checks


def _table(config: Config, histories: dict) -> Table:
    rows = [
        [
            name,
            f"{_early(h, 'max_over_mean'):.2f} → {_late(h, 'max_over_mean'):.2f}",
            f"{_late(h, 'coefficient_of_variation'):.2f}",
            f"{_late(h, 'dropped_share'):.1%}",
            f"{_late(h, 'unserved_share'):.1%}",
            f"{_late(h, 'router_entropy'):.2f}",
            f"{float(h['eval_loss']):.3f}",
        ]
        for name, h in histories.items()
    ]
    return Table(
        f"{config.steps} steps, {config.experts} experts, top-1, capacity "
        f"factor {config.capacity_factor:g}; late = mean over the last 20% "
        "of steps and all layers",
        [
            "run",
            "max/mean, first 5% → late",
            "CV late",
            "dropped late",
            "tokens with no expert late",
            f"router entropy late (max ln {config.experts} = {np.log(config.experts):.2f})",
            "held-out loss",
        ],
        rows,
    )


def _plot_load(histories: dict):
    shown = [
        name for name in histories if name == "no balancing" or name.startswith(("aux loss", "bias", "expert choice"))
    ]
    shown = [
        shown[0],
        *[n for n in shown if n.startswith("aux loss")][-1:],
        *[n for n in shown if n.startswith(("bias", "expert"))],
    ]
    figure = Figure(figsize=(3.2 * len(shown), 3.4))
    axes = figure.subplots(1, len(shown), sharey=True)
    for ax, name in zip(np.atleast_1d(axes), shown):
        load_SE = histories[name]["tokens_per_expert"][:, -1, :]  # last layer
        share_ES = (load_SE / load_SE.sum(-1, keepdims=True)).T
        ax.stackplot(np.arange(len(load_SE)), share_ES, linewidth=0)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("step")
    np.atleast_1d(axes)[0].set_ylabel("share of tokens per expert (last layer)")
    figure.suptitle("Per-expert load over training", fontsize=10)
    return figure


def _smooth(values: np.ndarray, width: int = 9) -> np.ndarray:
    return np.convolve(values, np.ones(width) / width, mode="valid")


def _plot_imbalance(histories: dict):
    figure = Figure(figsize=(11, 4))
    left, right = figure.subplots(1, 2)
    for name, h in histories.items():
        left.plot(_smooth(h["max_over_mean"].mean(-1)), label=name)
        right.plot(_smooth(h["dropped_share"].mean(-1)), label=name)
    left.set(xlabel="step", ylabel="max/mean tokens per expert (mean of layers)", title="Imbalance")
    right.set(xlabel="step", ylabel="share of assignments dropped", title="Dropped tokens (capacity overflow)")
    right.legend(fontsize=7)
    return figure


def _plot_loss_vs_balance(histories: dict):
    figure = Figure(figsize=(6.5, 4.2))
    axes = figure.subplots()
    for name, h in histories.items():
        axes.scatter(_late(h, "max_over_mean"), float(h["eval_loss"]))
        axes.annotate(
            name,
            (_late(h, "max_over_mean"), float(h["eval_loss"])),
            fontsize=7,
            xytext=(4, 2),
            textcoords="offset points",
        )
    axes.set(xlabel="late max/mean tokens per expert", ylabel="held-out loss", title="Final loss against balance")
    return figure


def _summary(config: Config, histories: dict) -> str:
    none = histories["no balancing"]
    best = min((n for n in histories if n != "expert choice"), key=lambda n: _late(histories[n], "max_over_mean"))
    return (
        f"Without balancing the busiest of {config.experts} experts went "
        f"from {_early(none, 'max_over_mean'):.2f}x to {_late(none, 'max_over_mean'):.2f}x "
        f"the mean load over {config.steps} steps, and {_late(none, 'dropped_share'):.0%} "
        "of the assignments overflowed capacity factor "
        f"{config.capacity_factor:g}: the rich-get-richer drift. Of the token-choice "
        f"counter-measures, {best} balanced best "
        f"({_late(histories[best], 'max_over_mean'):.2f}x, {_late(histories[best], 'dropped_share'):.1%} "
        "dropped); expert choice is exactly balanced "
        f"by construction but left {_late(histories['expert choice'], 'unserved_share'):.0%} "
        "of the tokens without any expert. "
        f"Held-out loss ranged from {min(float(h['eval_loss']) for h in histories.values()):.3f} "
        f"to {max(float(h['eval_loss']) for h in histories.values()):.3f}."
    )


def _notes(config: Config, histories: dict) -> list[str]:
    none, z = histories["no balancing"], histories[f"z-loss β={config.z_loss:g}"]
    noisy = histories.get(f"noisy top-k σ={config.noise_std:g}")
    middle_alpha = f"aux loss α={sorted(config.aux_alphas)[len(config.aux_alphas) // 2]:g}"
    alphas = sorted(config.aux_alphas)
    losses = [float(histories[f"aux loss α={a:g}"]["eval_loss"]) for a in alphas]
    return [
        (
            f"The z-loss alone ended at max/mean {_late(z, 'max_over_mean'):.2f}, "
            f"against {_late(none, 'max_over_mean'):.2f} without balancing "
            "and "
            f"{_late(histories[middle_alpha], 'max_over_mean'):.2f} with {middle_alpha}: "
            "smaller logits give a flatter softmax, but nothing in the "
            "z-loss pushes tokens toward idle experts; ST-MoE uses it for stability, next to an auxiliary loss."
        ),
        *(
            [
                (
                    f"Noisy top-k with a fixed σ = {config.noise_std:g} ended "
                    f"at {_late(noisy, 'max_over_mean'):.2f}: as the router's "
                    "logits grow during training, "
                    "a fixed noise matters less and less (Shazeer et al. learn "
                    "the noise scale and add importance and load losses)."
                )
            ]
            if noisy
            else []
        ),
        (
            f"The bias rate γ = {config.bias_rate:g} is {config.bias_rate / 1e-3:g}x "
            "DeepSeek-V3's 0.001: the bias moves by γ per step, and in "
            f"{config.steps} steps it must reach the size of the gaps between the router's scores."
        ),
        "Training runs on one device with `moe_local`; the expert-parallel "
        "layer computes the same function (see the expert_parallel page).",
        (
            "Held-out loss by α: "
            + ", ".join(f"α={a:g}: {loss:.3f}" for a, loss in zip(alphas, losses))
            + f" (no balancing: {float(none['eval_loss']):.3f}). The quick "
            "reference warns that a large α costs quality; "
            "one seed of so small a model cannot separate that from run-to-run noise."
        ),
    ]
