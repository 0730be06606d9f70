"""Mixture of experts on one device: routing, capacity, balance, dispatch and combine.

A mixture-of-experts layer sends each token to k of its E experts (Shazeer et
al. 2017, arXiv:1701.06538). The router is one matmul, logits = x · W_r,
turned into scores by a softmax over experts (Switch, GShard) or a sigmoid
per expert (DeepSeek-V3, arXiv:2412.19437, eq. 15); each token takes its
top-k. Static shapes give each expert a buffer of C slots per group of
tokens, C = ceil(tokens · k / E · capacity factor) (`lab.theory.expert_capacity`);
assignments beyond it are dropped, lowest probability first (V-MoE's batch
prioritized routing, Riquelme et al. 2021), latest first with every token's
first choice before any second choice (GShard), or latest first token after
token, each token's choices in rank order (MaxText's dropping path: a cumulative
sum over the [S·k, E] one-hot, no sort).

Left alone, routing collapses: the experts that get tokens are trained, get
better, and get more tokens. The counter-measures, each selectable:

* Switch auxiliary loss α·N·Σ f_i·P_i (Fedus et al. 2021, arXiv:2101.03961, eq. 4);
* router z-loss β·mean(logsumexp(logits)²) (ST-MoE, Zoph et al. 2022, arXiv:2202.08906, eq. 5);
* auxiliary-loss-free bias (DeepSeek-V3 §2.1.2): a per-expert bias added to
  the scores only to *choose* experts, nudged by γ·sign(mean load - load);
* expert choice (Zhou et al. 2022, arXiv:2202.09368): each expert takes its
  top-C tokens, balanced by construction; a token gets 0 to E experts;
* noisy top-k (Shazeer et al. 2017, eq. 3), here with a fixed noise scale
  instead of the learned softplus(x · W_noise).

A `Routing` is a table with one row per token and k columns: the expert, the
slot in that expert's buffer, and the gate. A dropped assignment has slot C,
one past the buffer, so a scatter with ``mode="drop"`` skips it. Expert
choice fills the same table with k = E columns. `dispatch` scatters tokens
into the [E, C, D] buffers by that table and `combine` gathers them back;
`lab.parallel.expert` puts the buffers' E axis on the ``expert`` mesh axis.
A dropless router (MaxText's ``sparse_matmul``) places nothing: every
assignment is kept, and `lab.ragged` sorts them by expert instead of
scattering them into buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import struct

from lab.errors import LabError
from lab.theory import expert_capacity

SCORES = ("softmax", "sigmoid")
DROP_POLICIES = ("probability", "position", "token")
CHOICES = ("tokens", "experts")


@dataclass(frozen=True)
class RouterConfig:
    """How tokens choose experts (or experts choose tokens), and what overflows."""

    experts: int = 8
    top_k: int = 1
    capacity_factor: float | None = 1.25  # None: no dropping (each buffer holds a whole group)
    dropless: bool = False  # no buffers: assignments sorted by expert, multiplied as ragged groups (`lab.ragged`)
    score: str = "softmax"  # softmax over experts | sigmoid per expert (gates renormalized over the top-k)
    drop_policy: str = "probability"  # drop the lowest-probability assignments | the latest (GShard | MaxText)
    choice: str = "tokens"  # tokens pick experts | experts pick tokens
    noise_std: float = 0.0  # noisy top-k: N(0, noise_std²) added to the logits when a key is given

    def __post_init__(self) -> None:
        if self.experts < 1:
            raise LabError(f"experts={self.experts}: an MoE layer needs at least one expert")
        if not 1 <= self.top_k <= self.experts:
            raise LabError(
                f"top-k {self.top_k} is larger than the {self.experts} experts "
                f"(or below 1); choose k between 1 and {self.experts}"
            )
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise LabError(
                f"capacity factor {self.capacity_factor}: must be > 0 (1.0 = "
                "exactly the mean load); leave it unset (None) to drop nothing"
            )
        for name, value, allowed in (
            ("score", self.score, SCORES),
            ("drop_policy", self.drop_policy, DROP_POLICIES),
            ("choice", self.choice, CHOICES),
        ):
            if value not in allowed:
                raise LabError(f"{name}={value!r}: use one of {', '.join(allowed)}")
        if self.choice == "experts" and self.capacity_factor is None:
            raise LabError(
                "expert-choice routing needs a capacity factor: the capacity is how many tokens each expert picks"
            )
        if self.noise_std < 0:
            raise LabError(f"noise_std={self.noise_std}: the noise scale must be >= 0")
        if self.dropless and (self.capacity_factor is not None or self.choice != "tokens"):
            raise LabError("dropless routing has no capacity and needs token choice: leave capacity_factor unset")

    def capacity(self, tokens: int) -> int:
        """Slots per expert for a group of `tokens`, never more than the group (see module docstring)."""
        if self.capacity_factor is None:  # a dropless router keeps every assignment in slot 0 of this bound
            return tokens  # no dropping: any expert may be chosen by every token of the group
        # capped at the group: a token reaches an expert at most once, and expert choice picks C of the tokens
        return min(tokens, expert_capacity(tokens, self.experts, self.top_k, self.capacity_factor))


def parse_capacity_factor(text: str) -> float | None:
    """A capacity factor as typed on a command line: a number such as ``1.25``, or ``none`` for no dropping."""
    if text.strip().lower() == "none":
        return None
    try:
        return float(text)
    except ValueError:
        raise LabError(f"capacity factor {text!r}: write a number such as 1.25, or none for no dropping") from None


@struct.dataclass
class Balance:
    """Load-balancing coefficients, passed at run time so that one compiled step serves every value."""

    aux_loss: float | jax.Array = 0.0  # α of the Switch loss
    z_loss: float | jax.Array = 0.0  # β of the router z-loss
    bias_rate: float | jax.Array = 0.0  # γ of the auxiliary-loss-free bias update


NO_BALANCING = Balance()


@struct.dataclass
class Routing:
    """Where each (token, choice) goes: expert, slot (== capacity when dropped), gate."""

    expert_TK: jax.Array
    slot_TK: jax.Array
    gate_TK: jax.Array
    chosen_TK: jax.Array  # the router asked for this assignment (always, for token choice)
    probs_TE: jax.Array  # scores normalized to sum to 1 per token: the P_i of the Switch loss
    logits_TE: jax.Array
    capacity: int = struct.field(pytree_node=False)

    @property
    def kept_TK(self) -> jax.Array:
        return self.slot_TK < self.capacity


def route(
    logits_TE: jax.Array, config: RouterConfig, *, bias_E: jax.Array | None = None, noise_key: jax.Array | None = None
) -> Routing:
    """Route one group of tokens: scores, top-k (or expert choice), slots within capacity."""
    tokens = logits_TE.shape[0]
    capacity = config.capacity(tokens)
    logits_TE = logits_TE.astype(jnp.float32)
    if noise_key is not None and config.noise_std > 0:
        logits_TE = logits_TE + config.noise_std * jax.random.normal(noise_key, logits_TE.shape)
    scores_TE = jax.nn.softmax(logits_TE) if config.score == "softmax" else jax.nn.sigmoid(logits_TE)
    probs_TE = scores_TE / scores_TE.sum(-1, keepdims=True)
    if config.choice == "experts":
        return _expert_choice(probs_TE, logits_TE, capacity)
    # the bias steers the choice only; the gate stays the router's own score (DeepSeek-V3 eq. 16)
    choice_TE = scores_TE if bias_E is None else scores_TE + jax.lax.stop_gradient(bias_E)
    _, expert_TK = jax.lax.top_k(choice_TE, config.top_k)
    gate_TK = jnp.take_along_axis(scores_TE, expert_TK, axis=-1)
    if config.score == "sigmoid":
        gate_TK = gate_TK / gate_TK.sum(-1, keepdims=True)
    if config.dropless:  # nothing to place: every assignment is kept (`lab.ragged` sorts them instead)
        slot_TK = jnp.zeros_like(expert_TK)
    else:
        slot_TK = _slots(expert_TK, gate_TK, config.experts, capacity, config.drop_policy)
    return Routing(expert_TK, slot_TK, gate_TK, jnp.ones_like(expert_TK, bool), probs_TE, logits_TE, capacity)


def _slots(expert_TK: jax.Array, gate_TK: jax.Array, experts: int, capacity: int, policy: str) -> jax.Array:
    """Each assignment's place in its expert's buffer, in priority order; `capacity` where it overflows."""
    tokens, k = expert_TK.shape
    if policy == "token":  # MaxText: token after token, each token's choices in rank order (no permutation)
        return _places(expert_TK.reshape(-1), experts, capacity).reshape(tokens, k)
    if policy == "position":  # GShard: all first choices in token order, then all second choices
        order_A = jnp.arange(tokens * k).reshape(tokens, k).T.reshape(-1)
    else:  # batch prioritized routing: the most confident assignments first
        order_A = jnp.argsort(-jax.lax.stop_gradient(gate_TK).reshape(-1), stable=True)
    place_A = _places(expert_TK.reshape(-1)[order_A], experts, capacity)
    return jnp.zeros_like(place_A).at[order_A].set(place_A).reshape(tokens, k)


def _places(expert_A: jax.Array, experts: int, capacity: int) -> jax.Array:
    """Each assignment's place among those before it to the same expert (a cumulative sum of one-hots), capped at
    `capacity`."""
    ranked_AE = jax.nn.one_hot(expert_A, experts, dtype=jnp.int32)
    return jnp.minimum(jnp.sum((jnp.cumsum(ranked_AE, axis=0) - 1) * ranked_AE, axis=-1), capacity)


def _expert_choice(probs_TE: jax.Array, logits_TE: jax.Array, capacity: int) -> Routing:
    """Each expert takes the `capacity` tokens it scores highest (Zhou et al. 2022, eq. 1-2)."""
    tokens, experts = probs_TE.shape
    _, token_EC = jax.lax.top_k(probs_TE.T, capacity)
    slot_TE = (
        jnp.full((tokens, experts), capacity)
        .at[token_EC, jnp.arange(experts)[:, None]]
        .set(jnp.arange(capacity)[None, :])
    )
    expert_TE = jnp.broadcast_to(jnp.arange(experts), (tokens, experts))
    return Routing(expert_TE, slot_TE, probs_TE, slot_TE < capacity, probs_TE, logits_TE, capacity)


# --- load-balancing losses and the bias update --------------------------------------------


def dispatch(x_TD: jax.Array, routing: Routing, experts: int) -> jax.Array:
    """Scatter each kept (token, choice) into its expert's slot: the buffer x_ECD, zeros where unused."""
    buffer_ECD = jnp.zeros((experts, routing.capacity, x_TD.shape[-1]), x_TD.dtype)
    copies_TKD = jnp.broadcast_to(x_TD[:, None, :], (*routing.expert_TK.shape, x_TD.shape[-1]))
    return buffer_ECD.at[routing.expert_TK, routing.slot_TK].set(
        copies_TKD, mode="drop"
    )  # slot C is out of range: dropped


def combine(y_ECD: jax.Array, routing: Routing) -> jax.Array:
    """Each token's gate-weighted sum of its experts' outputs (a dropped choice reads zeros)."""
    y_TKD = y_ECD.at[routing.expert_TK, routing.slot_TK].get(mode="fill", fill_value=0)
    return jnp.einsum("tk,tkd->td", routing.gate_TK.astype(y_TKD.dtype), y_TKD)


def switch_aux_loss(routing: Routing) -> jax.Array:
    """N·Σ_i f_i·P_i (Fedus et al. 2021, eq. 4; times α outside): f_i share of chosen assignments, P_i mean probability.

    f counts what the router asked for, before capacity drops anything; it is
    not differentiable, so the gradient flows through P alone.
    """
    experts = routing.probs_TE.shape[-1]
    chosen_E = _tokens_per_expert(routing)
    share_E = chosen_E / jnp.maximum(chosen_E.sum(), 1.0)
    return experts * jnp.sum(share_E * routing.probs_TE.mean(0))


def router_z_loss(routing: Routing) -> jax.Array:
    """mean_t logsumexp(logits_t)² (ST-MoE eq. 5; times β outside).

    It keeps the logits small, and the softmax in fp32 range.
    """
    return jnp.mean(jax.nn.logsumexp(routing.logits_TE, axis=-1) ** 2)


def balance_loss(routing: Routing, balance: Balance) -> jax.Array:
    """α · Switch loss + β · z-loss, added to the model's loss."""
    return balance.aux_loss * switch_aux_loss(routing) + balance.z_loss * router_z_loss(routing)


def update_bias(bias_E: jax.Array, tokens_per_expert_E: jax.Array, rate: float | jax.Array) -> jax.Array:
    """DeepSeek-V3's auxiliary-loss-free step: b_i += γ·sign(mean load - load_i) (§2.1.2)."""
    return bias_E + rate * jnp.sign(tokens_per_expert_E.mean() - tokens_per_expert_E)


# --- load metrics --------------------------------------------------------------------------


@struct.dataclass
class LoadCounts:
    """Sums over tokens, which add up across groups and devices (psum them, then `load_metrics`)."""

    tokens_per_expert: jax.Array  # (E,) assignments the router chose, before dropping
    dropped: jax.Array  # chosen assignments that found their expert full
    chosen: jax.Array  # chosen assignments in all
    unserved_tokens: jax.Array  # tokens that reach no expert at all
    entropy: jax.Array  # Σ_t H(p_t), nats
    tokens: jax.Array


@struct.dataclass
class LoadMetrics:
    """How evenly the load spreads, for one step."""

    tokens_per_expert: jax.Array
    max_over_mean: jax.Array  # 1 is perfect balance, E is full collapse (top-1)
    coefficient_of_variation: jax.Array  # std / mean of tokens per expert
    dropped_share: jax.Array  # of the chosen assignments
    unserved_share: jax.Array  # of the tokens: no expert processed them (all dropped, or no expert picked them)
    router_entropy: jax.Array  # mean over tokens, nats; log E is uniform


def load_counts(routing: Routing) -> LoadCounts:
    served_T = jnp.any(routing.kept_TK & routing.chosen_TK, axis=-1)
    entropy_T = -jnp.sum(jax.scipy.special.xlogy(routing.probs_TE, routing.probs_TE), axis=-1)
    return LoadCounts(
        tokens_per_expert=_tokens_per_expert(routing),
        dropped=jnp.sum(routing.chosen_TK & ~routing.kept_TK).astype(jnp.float32),
        chosen=jnp.sum(routing.chosen_TK).astype(jnp.float32),
        unserved_tokens=jnp.sum(~served_T).astype(jnp.float32),
        entropy=entropy_T.sum(),
        tokens=jnp.asarray(routing.probs_TE.shape[0], jnp.float32),
    )


def load_metrics(counts: LoadCounts) -> LoadMetrics:
    load_E = counts.tokens_per_expert
    mean = jnp.maximum(load_E.mean(), 1e-9)
    return LoadMetrics(
        tokens_per_expert=load_E,
        max_over_mean=load_E.max() / mean,
        coefficient_of_variation=load_E.std() / mean,
        dropped_share=counts.dropped / jnp.maximum(counts.chosen, 1.0),
        unserved_share=counts.unserved_tokens / counts.tokens,
        router_entropy=counts.entropy / counts.tokens,
    )


def _tokens_per_expert(routing: Routing) -> jax.Array:
    experts = routing.probs_TE.shape[-1]
    return jnp.einsum("tke,tk->e", jax.nn.one_hot(routing.expert_TK, experts), routing.chosen_TK.astype(jnp.float32))
