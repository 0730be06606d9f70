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

Every step records each layer's load counts (tokens per expert, dropped and
unserved assignments, router entropy) and balancing loss; the judge turns
them into max/mean, coefficient of variation and dropped share. The plots
show per-expert load over steps, dropped tokens, and held-out loss against
balance.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from matplotlib.figure import Figure

from lab.errors import LabError
from lab.model import Attention, ModelConfig, RMSNorm, WholeWeights, next_token_loss
from lab.moe import Balance, RouterConfig, update_bias
from lab.parallel.expert import ExpertParams, MoEConfig, moe_local
from lab.progress import track
from lab.provenance import Setup
from lab.report import Result, Table
from lab.targets.devices import DEFAULT_TARGET, devices_for
from lab.theory import switch_aux_loss_range
from lab.verdict import Check, Claim, check

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


@dataclass(frozen=True)
class Layer:
    """One MoE layer over training, as its load counts said: every field a series over steps."""

    tokens_per_expert: tuple[tuple[float, ...], ...]  # [expert][step]: assignments the router chose, before dropping
    dropped: tuple[float, ...]  # chosen assignments that found their expert full
    chosen: tuple[float, ...]  # chosen assignments in all
    unserved: tuple[float, ...]  # tokens no expert processed
    entropy: tuple[float, ...]  # Σ over tokens of the router's entropy, nats
    balance_loss: tuple[float, ...]  # α·Switch loss + β·z-loss, as added to the training loss


@dataclass(frozen=True)
class Trained:
    """One run: its cross-entropy per step, each layer's load, and the held-out loss of every held-out sequence."""

    name: str
    loss: tuple[float, ...]
    layers: tuple[Layer, ...]
    held_out: tuple[float, ...]  # mean next-token cross-entropy per held-out sequence, after training


@dataclass(frozen=True)
class Observations:
    setup: Setup
    tokens: int  # tokens routed per step and layer (batch · seq)
    runs: tuple[Trained, ...]

    def run(self, name: str) -> Trained:
        return next(r for r in self.runs if r.name == name)


# --------------------------------------------------------------------------- measure


def measure(config: Config) -> Observations:
    devices = devices_for(config.target)
    runs = _runs(config)
    batches = skewed_tokens(config, config.steps + 4)
    trained = tuple(_train(r, config, batches, devices[0]) for r in track(runs, "train MoE language models"))
    return Observations(
        Setup.of(config.target, devices[:1], "one device"), config.batch * model_config(config).seq, trained
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


def _train(run_: Run, config: Config, batches: np.ndarray, device) -> Trained:
    """Train one run from the shared initial weights: per step, the loss and each layer's load counts."""
    model = model_config(config)
    moe = MoEConfig(d_model=model.embed, d_ff=model.mlp, router=run_.router)
    params, state = _initial_weights(model, config.experts, config.seed)
    train = _compiled_training(model, moe, config.learning_rate, config.seed)
    balance = jax.tree.map(lambda v: jnp.asarray(v, jnp.float32), run_.balance)
    history, held_out = train(
        params,
        state,
        jax.device_put(batches[: config.steps], device),
        jax.device_put(batches[config.steps :], device),
        balance,
    )
    history = jax.tree.map(np.asarray, history)

    def series(values) -> tuple[float, ...]:
        return tuple(float(v) for v in values)

    layers = tuple(
        Layer(
            tokens_per_expert=tuple(series(history["tokens_per_expert"][:, e, layer]) for e in range(config.experts)),
            dropped=series(history["dropped"][:, layer]),
            chosen=series(history["chosen"][:, layer]),
            unserved=series(history["unserved"][:, layer]),
            entropy=series(history["entropy"][:, layer]),
            balance_loss=series(history["balance_loss"][:, layer]),
        )
        for layer in range(model.layers)
    )
    return Trained(run_.name, series(history["loss"]), layers, series(np.asarray(held_out)))


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
        logits = model(held_out_BT[:, :-1], Balance(), jax.random.key(0))[0]
        per_sequence = optax.softmax_cross_entropy_with_integer_labels(logits, held_out_BT[:, 1:]).mean(-1)
        return history, per_sequence

    return train


def _record(cross_entropy, outputs) -> dict[str, jax.Array]:
    """One step's raw counts, stacked over layers (last axis); the judge makes the metrics."""

    def stacked(read):
        return jnp.stack([read(o) for o in outputs], -1)

    return {
        "loss": cross_entropy,
        "balance_loss": stacked(lambda o: o.balance_loss),
        "tokens_per_expert": stacked(lambda o: o.counts.tokens_per_expert),  # (E, layers)
        "dropped": stacked(lambda o: o.counts.dropped),
        "chosen": stacked(lambda o: o.counts.chosen),
        "unserved": stacked(lambda o: o.counts.unserved_tokens),
        "entropy": stacked(lambda o: o.counts.entropy),
    }


# --------------------------------------------------------------------------- judge

DRIFT = 1.5  # late over early max/mean that counts as the load concentrating
STEP0_RTOL = 0.05


def judge(obs: Observations, config: Config) -> Result:
    return Result(
        summary=_summary(obs, config),
        theory=THEORY,
        tables=[_table(obs, config)],
        checks=_checks(obs, config),
        claims=_claims(obs, config),
        plots={
            "load_over_steps": partial(_plot_load, obs),
            "imbalance": partial(_plot_imbalance, obs),
            "loss_vs_balance": partial(_plot_loss_vs_balance, obs),
        },
        notes=_notes(obs, config),
    )


def _metric(run: Trained, key: str, tokens: int) -> np.ndarray:
    """One metric of every layer at every step, [layers, steps], from the stored counts (`lab.moe.load_metrics`)."""
    return np.stack([_layer_metric(layer, key, tokens) for layer in run.layers])


def _layer_metric(layer: Layer, key: str, tokens: int) -> np.ndarray:
    if key in ("max_over_mean", "coefficient_of_variation"):
        load_ES = np.asarray(layer.tokens_per_expert)
        spread_S = load_ES.max(0) if key == "max_over_mean" else load_ES.std(0)
        return spread_S / np.maximum(load_ES.mean(0), 1e-9)
    if key == "dropped_share":
        return np.asarray(layer.dropped) / np.maximum(np.asarray(layer.chosen), 1.0)
    if key == "unserved_share":
        return np.asarray(layer.unserved) / tokens
    if key == "router_entropy":
        return np.asarray(layer.entropy) / tokens
    return np.asarray(layer.balance_loss)


def _late(values_LS: np.ndarray) -> float:
    """Mean over the last fifth of the steps and over layers."""
    return float(np.mean(values_LS[:, -max(1, values_LS.shape[1] // 5) :]))


def _early(values_LS: np.ndarray) -> float:
    """Mean over the first twentieth of the steps and over layers."""
    return float(np.mean(values_LS[:, : max(1, values_LS.shape[1] // 20)]))


def _late_shares(run: Trained) -> np.ndarray:
    """Each expert's share of the tokens over the last fifth of the steps, [layers, experts]."""
    load_LES = np.asarray([layer.tokens_per_expert for layer in run.layers])
    late_LE = load_LES[:, :, -max(1, load_LES.shape[2] // 5) :].sum(-1)
    return late_LE / late_LE.sum(-1, keepdims=True)


def _held_out(run: Trained) -> float:
    return float(np.mean(run.held_out))


def _aux(alpha: float) -> str:
    return f"aux loss α={alpha:g}"


def _checks(obs: Observations, config: Config) -> list[Check]:
    checks = []
    for alpha in config.aux_alphas:
        run = obs.run(_aux(alpha))
        checks.append(
            check(
                f"{run.name}: Switch loss at step 0, router near uniform (theory α·N·Σ f·(1/N) = α)",
                switch_aux_loss_range(config.experts, alpha)[0],
                float(np.mean(_metric(run, "balance_loss", obs.tokens)[:, 0])),
                kind="model",
                rtol=STEP0_RTOL,
                basis="the router starts at 0.02·N(0,1): at step 0 P_i and the f_i of a few hundred tokens depart "
                "from 1/N by about 1%, well inside 5%",
            )
        )
    z = obs.run(f"z-loss β={config.z_loss:g}")
    checks.append(
        check(
            f"{z.name}: router z-loss at step 0, logits near 0 (theory β·(ln N)²)",
            config.z_loss * np.log(config.experts) ** 2,
            float(np.mean(_metric(z, "balance_loss", obs.tokens)[:, 0])),
            kind="model",
            rtol=STEP0_RTOL,
            basis="logits of std ≈ 0.02·√d = 0.16 on RMS-normalised inputs raise logsumexp² by about 1% over "
            "(ln N)², well inside 5%",
        )
    )
    return checks


def _claims(obs: Observations, config: Config) -> list[Claim]:
    t, none = obs.tokens, obs.run("no balancing")
    mm_none = _metric(none, "max_over_mean", t)
    early, late = _early(mm_none), _late(mm_none)
    shares = _late_shares(none)
    busiest, idlest = shares.max(-1), shares.min(-1)
    per_layer = ", ".join(f"layer {i + 1} {s:.0%}" for i, s in enumerate(busiest))
    claims = [
        Claim(
            "without balancing the router's rich get richer: the load concentrates over training",
            "confirmed" if late / early > DRIFT else "refuted",
            f"max/mean tokens per expert {early:.2f} in the first 5% of {config.steps} steps, {late:.2f} in the last "
            f"20% (×{late / early:.2f}; concentrating means more than ×{DRIFT:g})",
        ),
        Claim(
            "in the end most tokens (the example: 80%) go to one expert",
            "confirmed" if busiest.max() >= 0.8 else "refined" if busiest.max() >= 2 / config.experts else "refuted",
            f"the busiest expert's share of the tokens late: {per_layer} (even: {1 / config.experts:.0%})",
        ),
        Claim(
            "cold experts get almost no tokens (so they barely train)",
            "confirmed" if idlest.min() < 0.01 else "refuted",
            "the idlest expert's share late: "
            + ", ".join(f"layer {i + 1} {s:.2%}" for i, s in enumerate(idlest))
            + " (almost none: under 1%)",
        ),
    ]
    dropped = _late(_metric(none, "dropped_share", t))
    claims.append(
        Claim(
            "hot experts overflow their capacity",
            "confirmed" if dropped > 0 else "refuted",
            f"without balancing {dropped:.1%} of the assignments found their expert full late in training "
            f"(capacity factor {config.capacity_factor:g})",
        )
    )
    sums = [
        float(np.mean(_metric(obs.run(_aux(a)), "balance_loss", t)[:, 0])) / (a * config.experts)
        for a in config.aux_alphas
    ]
    near = all(abs(s * config.experts - 1) <= STEP0_RTOL for s in sums)
    claims.append(
        Claim(
            "Σ f_i·P_i is 1/N when balanced (1 when collapsed), so L_aux = α·N·Σ f_i·P_i runs from α to α·N",
            "confirmed" if near else "refuted",
            "at step 0, router near uniform: Σ f·P = "
            + ", ".join(f"{s:.4f}" for s in sums)
            + f" (1/N = {1 / config.experts:.4f})",
        )
    )
    typical = [a for a in config.aux_alphas if 0.01 <= a <= 0.1]
    if typical:
        share = {}
        for a in typical:
            run = obs.run(_aux(a))
            balance = _metric(run, "balance_loss", t).sum(0)
            cross_entropy = np.asarray(run.loss)
            late_steps = slice(-max(1, len(cross_entropy) // 5), None)
            share[a] = float(np.mean(balance[late_steps] / (cross_entropy[late_steps] + balance[late_steps])))
        inside = [a for a, s in share.items() if 0.01 <= s <= 0.05]
        claims.append(
            Claim(
                "α of 0.01-0.1 makes the balancing loss 1-5% of the total loss",
                "confirmed" if len(inside) == len(share) else "refined" if inside else "refuted",
                "late in training: "
                + ", ".join(f"α={a:g}: {s:.1%}" for a, s in share.items())
                + f" ({config.layers} MoE layers, each adding its own loss)",
            )
        )
    strongest = obs.run(_aux(max(config.aux_alphas)))
    mm_strong = _late(_metric(strongest, "max_over_mean", t))
    claims.append(
        Claim(
            "a balancing loss evens out the routing",
            "confirmed" if mm_strong <= late / DRIFT else "refuted" if mm_strong >= late else "refined",
            f"late max/mean {mm_strong:.2f} with {strongest.name}, {late:.2f} without balancing "
            f"(dropped {_late(_metric(strongest, 'dropped_share', t)):.1%} against {dropped:.1%})",
        )
    )
    bias = obs.run(f"bias γ={config.bias_rate:g}")
    d = np.asarray(strongest.held_out) - np.asarray(bias.held_out)
    margin = 2 * float(np.std(d, ddof=1)) / np.sqrt(len(d)) if len(d) > 1 else float("inf")
    cost = float(np.mean(d))
    resolved = "a cost" if cost > margin else "a gain" if cost < -margin else "no difference resolved"
    claims.append(
        Claim(
            "a balancing loss costs a little task quality, more as α grows",
            "confirmed" if cost > margin else "refuted" if cost < -margin else "refined",
            f"held-out loss {_held_out(strongest):.4f} with {strongest.name} against {_held_out(bias):.4f} with the "
            f"loss-free bias at about the same balance (late max/mean {mm_strong:.2f} and "
            f"{_late(_metric(bias, 'max_over_mean', t)):.2f}): {cost:+.4f} ± {margin:.4f}, {resolved} "
            f"(2 standard errors over {len(d)} held-out sequences, one training seed each); by α: "
            + ", ".join(f"{a:g}: {_held_out(obs.run(_aux(a))):.4f}" for a in sorted(config.aux_alphas))
            + f"; no balancing {_held_out(none):.4f}",
        )
    )
    noisy = next((r for r in obs.runs if r.name.startswith("noisy top-k")), None)
    if noisy:
        mm_noisy = _late(_metric(noisy, "max_over_mean", t))
        claims.append(
            Claim(
                "noise on the router's scores (noisy top-k) relieves hot experts",
                "confirmed" if mm_noisy <= late / DRIFT else "refuted" if mm_noisy >= late else "refined",
                f"late max/mean {mm_noisy:.2f} with {noisy.name}, {late:.2f} without balancing, {mm_strong:.2f} with "
                f"{strongest.name}",
            )
        )
    chosen = obs.run("expert choice")
    worst = float(np.max(_metric(chosen, "max_over_mean", t)))
    claims.append(
        Claim(
            "expert choice routing is balanced by construction",
            "confirmed" if abs(worst - 1) <= 1e-6 else "refuted",
            f"max/mean tokens per expert at most {worst:.4f} over every step and layer; the price: "
            f"{_late(_metric(chosen, 'unserved_share', t)):.1%} of the tokens picked by no expert late",
        )
    )
    return claims


def _table(obs: Observations, config: Config) -> Table:
    t = obs.tokens
    rows = [
        [
            run.name,
            f"{_early(_metric(run, 'max_over_mean', t)):.2f} → {_late(_metric(run, 'max_over_mean', t)):.2f}",
            f"{_late(_metric(run, 'coefficient_of_variation', t)):.2f}",
            f"{_late(_metric(run, 'dropped_share', t)):.1%}",
            f"{_late(_metric(run, 'unserved_share', t)):.1%}",
            f"{_late(_metric(run, 'router_entropy', t)):.2f}",
            f"{_held_out(run):.3f}",
        ]
        for run in obs.runs
    ]
    return Table(
        f"{config.steps} steps, {config.experts} experts, top-1, capacity factor {config.capacity_factor:g}; "
        "late = mean over the last 20% of steps and all layers",
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


def _plot_load(obs: Observations) -> Figure:
    names = [r.name for r in obs.runs]
    shown = [names[0], *[n for n in names if n.startswith("aux loss")][-1:]]
    shown += [n for n in names if n.startswith(("bias", "expert"))]
    figure = Figure(figsize=(3.2 * len(shown), 3.4))
    axes = np.atleast_1d(figure.subplots(1, len(shown), sharey=True))
    for ax, name in zip(axes, shown):
        load_ES = np.asarray(obs.run(name).layers[-1].tokens_per_expert)  # last layer
        ax.stackplot(np.arange(load_ES.shape[1]), load_ES / load_ES.sum(0, keepdims=True), linewidth=0)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("step")
    axes[0].set_ylabel("share of tokens per expert (last layer)")
    figure.suptitle("Per-expert load over training", fontsize=10)
    return figure


def _smooth(values: np.ndarray, width: int = 9) -> np.ndarray:
    return np.convolve(values, np.ones(width) / width, mode="valid")


def _plot_imbalance(obs: Observations) -> Figure:
    figure = Figure(figsize=(11, 4))
    left, right = figure.subplots(1, 2)
    for run in obs.runs:
        left.plot(_smooth(_metric(run, "max_over_mean", obs.tokens).mean(0)), label=run.name)
        right.plot(_smooth(_metric(run, "dropped_share", obs.tokens).mean(0)), label=run.name)
    left.set(xlabel="step", ylabel="max/mean tokens per expert (mean of layers)", title="Imbalance")
    right.set(xlabel="step", ylabel="share of assignments dropped", title="Dropped tokens (capacity overflow)")
    right.legend(fontsize=7)
    return figure


def _plot_loss_vs_balance(obs: Observations) -> Figure:
    figure = Figure(figsize=(6.5, 4.2))
    axes = figure.subplots()
    for run in obs.runs:
        point = (_late(_metric(run, "max_over_mean", obs.tokens)), _held_out(run))
        axes.scatter(*point)
        axes.annotate(run.name, point, fontsize=7, xytext=(4, 2), textcoords="offset points")
    axes.set(xlabel="late max/mean tokens per expert", ylabel="held-out loss", title="Final loss against balance")
    return figure


def _summary(obs: Observations, config: Config) -> str:
    t, none = obs.tokens, obs.run("no balancing")
    mm = {run.name: _late(_metric(run, "max_over_mean", t)) for run in obs.runs}
    best = min((n for n in mm if n != "expert choice"), key=mm.get)
    drift = mm["no balancing"] / _early(_metric(none, "max_over_mean", t))
    losses = [_held_out(run) for run in obs.runs]
    return (
        f"Without balancing the busiest of {config.experts} experts went from "
        f"{_early(_metric(none, 'max_over_mean', t)):.2f}x to {mm['no balancing']:.2f}x the mean load over "
        f"{config.steps} steps, and {_late(_metric(none, 'dropped_share', t)):.0%} of the assignments overflowed "
        f"capacity factor {config.capacity_factor:g}: "
        f"{'the rich-get-richer drift' if drift > DRIFT else 'no clear drift in so few steps'}. Of the token-choice "
        f"counter-measures, {best} balanced best ({mm[best]:.2f}x, "
        f"{_late(_metric(obs.run(best), 'dropped_share', t)):.1%} dropped); expert choice is exactly balanced by "
        f"construction but left {_late(_metric(obs.run('expert choice'), 'unserved_share', t)):.0%} of the tokens "
        f"without any expert. Held-out loss ranged from {min(losses):.3f} to {max(losses):.3f}."
    )


def _notes(obs: Observations, config: Config) -> list[str]:
    t = obs.tokens
    none, z = obs.run("no balancing"), obs.run(f"z-loss β={config.z_loss:g}")
    noisy = next((r for r in obs.runs if r.name.startswith("noisy top-k")), None)
    middle = obs.run(_aux(sorted(config.aux_alphas)[len(config.aux_alphas) // 2]))

    def late(run: Trained) -> float:
        return _late(_metric(run, "max_over_mean", t))

    notes = [
        f"The z-loss alone ended at max/mean {late(z):.2f}, against {late(none):.2f} without balancing and "
        f"{late(middle):.2f} with {middle.name}: smaller logits give a flatter softmax, but nothing in the z-loss "
        "pushes tokens toward idle experts; ST-MoE uses it for stability, next to an auxiliary loss."
    ]
    if noisy:
        notes.append(
            f"Noisy top-k with a fixed σ = {config.noise_std:g} ended at {late(noisy):.2f}: as the router's logits "
            "grow during training, a fixed noise matters less and less (Shazeer et al. learn the noise scale and add "
            "importance and load losses)."
        )
    notes += [
        f"The bias rate γ = {config.bias_rate:g} is {config.bias_rate / 1e-3:g}x DeepSeek-V3's 0.001: the bias moves "
        f"by γ per step, and in {config.steps} steps it must reach the size of the gaps between the router's scores.",
        "Training runs on one device with `moe_local`; the expert-parallel layer computes the same function (see the "
        "expert_parallel page).",
        "The quality claim compares the strongest auxiliary loss with the loss-free bias, which balances about as "
        "well without a gradient: against no balancing the comparison would mix the loss's cost with the tokens "
        "an unbalanced router drops. Its interval covers the held-out sample only; a second training seed would "
        "widen it, and one seed of so small a model cannot show a cost smaller than that.",
        "Every run is seeded and runs on the CPU, so two runs give the same numbers: the claims here are not "
        "decided by a clock.",
    ]
    return notes
