"""Model specs: published decoder configurations, and the ``--model`` text that names one.

A spec is a `lab.model.ModelConfig` at full size, dense or mixture-of-experts. Nothing is allocated for it:
the predictor declares its parameters abstractly (`lab.model.abstract_model`)
and compiles the step for a topology with no chips. ``--model`` takes a preset
name (``llama3-8b``), ``key=value`` pairs with the keys of `KEYS`, or a preset
and pairs that change it (``mixtral-8x7b,capacity=2``)::

    layers=32,d_model=4096,heads=32,kv_heads=8,head_dim=128,d_ff=14336,vocab=128256,mlp=swiglu,block=sequential,tied=false

An MoE spec adds ``experts``, ``top_k``, ``capacity`` (slots per expert as a
multiple of the mean load, MaxText's ``capacity_factor``; ``none`` drops nothing
through a buffer the size of each routing group per expert; ``dropless`` is
MaxText's ``sparse_matmul``: each device sorts its tokens by expert and
multiplies them by megablox's grouped matmul on TPU, `lab.ragged`, with no
expert axis) and ``d_ff`` is then each expert's width; ``shared_experts`` (each
``d_ff`` wide, every token goes through them), ``dense_layers`` (the first
layers dense, DeepSeek's ``first_k_dense_replace``), ``moe_every`` (an MoE
layer every n, Llama 4's ``interleave_moe_layer_step``) and ``d_ff_dense`` (the
dense layers' width) shape the stack. ``kv_rank``, ``q_rank`` and ``rope_dim``
make the attention DeepSeek's latent attention (its ``kv_lora_rank``,
``q_lora_rank``, ``qk_rope_head_dim``; ``head_dim`` is then its
``qk_nope_head_dim`` and ``v_head_dim``). GPT-OSS's blocks: ``biases=true``
(every projection's, the router's), ``sinks=true`` (a learned logit per head in
each softmax), ``window`` (its ``sliding_window``: a query sees the window's
tokens, itself included) and ``global_every`` (every n-th layer attends to every
earlier token, the others within the window; its ``layer_types``).

The presets are the configurations their authors published (each one's
``config.json`` on the Hugging Face hub, or its paper); their parameter counts
are checked against the published totals in the tests: to the parameter where
the count was published exactly, to the digits published otherwise (an MoE's
total and active counts, as its model card gives them). Rotary positions,
RMSNorm and no biases are the family's; GPT-J/PaLM-style parallel blocks and
plain activations are there for specs typed in, not for these presets.

What the presets leave out, each priced as the lab's blocks price it: DeepSeek-V3's
router scores by sigmoid with a bias and picks within 4 of 8 expert groups (the
lab's by softmax over all: the same matmuls), and its multi-token-prediction
module; Llama 4's layers without rotary positions, its chunked attention (the
whole sequence up to its 8192-token chunks) and the vision encoder. Llama 4
Scout is ``llama4-maverick,experts=16,moe_every=1`` (its card's 109B counts the
vision encoder; the text model is 107.8B). GPT-OSS's SwiGLU clamps its inputs and
adds one to the linear half, its router takes the softmax after the top k and its
rotary positions are YaRN-scaled: elementwise differences, priced as the lab's
SwiGLU, softmax and rotary.
"""

from __future__ import annotations

import math
from dataclasses import replace

from lab.errors import LabError
from lab.model import BLOCKS, FEED_FORWARDS, ModelConfig
from lab.moe import parse_capacity_factor


def _llama(layers, d_model, heads, kv_heads, d_ff, vocab, head_dim=128) -> ModelConfig:
    return ModelConfig(
        vocab=vocab,
        embed=d_model,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        mlp=d_ff,
        layers=layers,
        seq=4096,
        feed_forward="swiglu",
    )


def _moe(layers, d_model, heads, kv_heads, d_ff, vocab, experts, top_k, *, qk_norm=False) -> ModelConfig:
    """Llama's blocks with every MLP a top-k mixture of SwiGLU experts `d_ff` wide (Mixtral, Qwen3-MoE)."""
    return replace(_llama(layers, d_model, heads, kv_heads, d_ff, vocab), experts=experts, top_k=top_k, qk_norm=qk_norm)


def _gpt_oss(layers: int, experts: int) -> ModelConfig:
    """GPT-OSS: biases on every projection, a sink per head, a 128-token window on every other layer (from the
    first), top-4 of SwiGLU experts as wide as the model."""
    return replace(
        _moe(layers, 2880, 64, 8, 2880, 201088, experts=experts, top_k=4),
        head_dim=64,
        biases=True,
        sinks=True,
        window=128,
        global_every=2,
    )


# name -> (config, published parameter count, where it was published); an MoE's count as its card gives it,
# "total / active" with the card's digits
PRESETS: dict[str, tuple[ModelConfig, int | str, str]] = {
    "llama2-7b": (
        _llama(32, 4096, 32, None, 11008, 32000),
        6_738_415_616,
        "meta-llama/Llama-2-7b-hf config.json; Touvron et al. 2023, Table 1 (7B)",
    ),
    "llama2-13b": (
        _llama(40, 5120, 40, None, 13824, 32000),
        13_015_864_320,
        "meta-llama/Llama-2-13b-hf config.json (13B)",
    ),
    "llama2-70b": (
        _llama(80, 8192, 64, 8, 28672, 32000),
        68_976_648_192,
        "meta-llama/Llama-2-70b-hf config.json (GQA, 8 K/V heads)",
    ),
    "llama3-8b": (
        _llama(32, 4096, 32, 8, 14336, 128256),
        8_030_261_248,
        "meta-llama/Llama-3.1-8B config.json (8.03B; Llama 3 8B has the same shapes)",
    ),
    "llama3-70b": (
        _llama(80, 8192, 64, 8, 28672, 128256),
        70_553_706_496,
        "meta-llama/Llama-3.1-70B config.json (70.6B)",
    ),
    "llama3-405b": (
        _llama(126, 16384, 128, 8, 53248, 128256),
        405_853_388_800,
        "meta-llama/Llama-3.1-405B config.json; Llama 3 Herd of Models, Table 3",
    ),
    "mistral-7b": (
        _llama(32, 4096, 32, 8, 14336, 32000),
        7_241_732_096,
        "mistralai/Mistral-7B-v0.1 config.json (7.24B)",
    ),
    "gemma-7b": (
        replace(_llama(28, 3072, 16, None, 24576, 256000, head_dim=256), feed_forward="geglu", tied=True),
        8_537_680_896,
        "google/gemma-7b config.json (8.54B: head_dim 256 independent of d_model, GeGLU, tied embeddings)",
    ),
    "mixtral-8x7b": (
        _moe(32, 4096, 32, 8, 14336, 32000, experts=8, top_k=2),
        "46.7B / 12.9B",
        "mistralai/Mixtral-8x7B-v0.1 config.json; Mistral AI, 'Mixtral of experts' (2023-12-11): 46.7B total, "
        "12.9B per token",
    ),
    "mixtral-8x22b": (
        _moe(56, 6144, 48, 8, 16384, 32768, experts=8, top_k=2),
        "141B / 39B",
        "mistralai/Mixtral-8x22B-v0.1 config.json; Mistral AI, 'Cheaper, Better, Faster, Stronger' (2024-04-17): "
        "141B total, 39B active",
    ),
    "qwen3-30b-a3b": (
        _moe(48, 2048, 32, 4, 768, 151936, experts=128, top_k=8, qk_norm=True),
        "30.5B / 3.3B",
        "Qwen/Qwen3-30B-A3B config.json and model card: 30.5B in total, 3.3B activated",
    ),
    "deepseek-v3": (
        replace(
            _moe(61, 7168, 128, None, 2048, 129280, experts=256, top_k=8),
            shared_experts=1,
            dense_layers=3,
            dense_mlp=18432,
            kv_rank=512,
            q_rank=1536,
            rope_dim=64,
        ),
        "671B / 37B",
        "deepseek-ai/DeepSeek-V3 config.json; DeepSeek-V3 Technical Report (arXiv:2412.19437), Section 4.2: 671B "
        "total, 37B activated per token (the 14B multi-token-prediction module not counted)",
    ),
    "llama4-maverick": (
        replace(
            _moe(48, 5120, 40, 8, 8192, 202048, experts=128, top_k=1), shared_experts=1, moe_every=2, dense_mlp=16384
        ),
        "400B / 17B",
        "meta-llama/Llama-4-Maverick-17B-128E config.json (text_config); model card: 17B active, 400B total",
    ),
    "qwen3-235b-a22b": (
        _moe(94, 4096, 64, 4, 1536, 151936, experts=128, top_k=8, qk_norm=True),
        "235B / 22B",
        "Qwen/Qwen3-235B-A22B config.json and model card: 235B in total, 22B activated",
    ),
    "gpt-oss-20b": (
        _gpt_oss(24, experts=32),
        "20.91B / 3.61B",
        "openai/gpt-oss-20b config.json; gpt-oss-120b & gpt-oss-20b Model Card (arXiv:2508.10925), Table 1: 20.91B "
        "total, 3.61B active (the input embedding not counted)",
    ),
    "gpt-oss-120b": (
        _gpt_oss(36, experts=128),
        "116.83B / 5.13B",
        "openai/gpt-oss-120b config.json; gpt-oss-120b & gpt-oss-20b Model Card (arXiv:2508.10925), Table 1: "
        "116.83B total, 5.13B active (the input embedding not counted)",
    ),
}
ACTIVE_WITHOUT_EMBEDDING = ("gpt-oss-20b", "gpt-oss-120b")  # cards whose active count leaves the input embedding out
PRESETS["llama3.1-8b"] = PRESETS["llama3-8b"]
PRESETS["llama3.1-70b"] = PRESETS["llama3-70b"]
PRESETS["llama3.1-405b"] = PRESETS["llama3-405b"]

_MOE_PRESETS = tuple(name for name, (config, _, _) in PRESETS.items() if config.experts)

# --model key -> ModelConfig field
KEYS = {
    "layers": "layers",
    "d_model": "embed",
    "heads": "heads",
    "kv_heads": "kv_heads",
    "head_dim": "head_dim",
    "d_ff": "mlp",
    "vocab": "vocab",
    "mlp": "feed_forward",
    "block": "block",
    "tied": "tied",
    "qk_norm": "qk_norm",
    "experts": "experts",
    "top_k": "top_k",
    "capacity": "capacity_factor",
    "shared_experts": "shared_experts",
    "dense_layers": "dense_layers",
    "moe_every": "moe_every",
    "d_ff_dense": "dense_mlp",
    "kv_rank": "kv_rank",
    "q_rank": "q_rank",
    "rope_dim": "rope_dim",
    "biases": "biases",
    "sinks": "sinks",
    "window": "window",
    "global_every": "global_every",
}
_INTEGER_KEYS = (
    "layers",
    "d_model",
    "heads",
    "kv_heads",
    "head_dim",
    "d_ff",
    "vocab",
    "experts",
    "top_k",
    "shared_experts",
    "dense_layers",
    "moe_every",
    "d_ff_dense",
    "kv_rank",
    "q_rank",
    "rope_dim",
    "window",
    "global_every",
)
_BOOLEAN_KEYS = ("tied", "qk_norm", "biases", "sinks")
_REQUIRED = ("layers", "d_model", "heads", "d_ff", "vocab")
EXAMPLE = "layers=32,d_model=4096,heads=32,kv_heads=8,head_dim=128,d_ff=14336,vocab=128256,mlp=swiglu"


MAX_STEP_TOKENS = 2**31 - 1  # a step's token count is a Python int in the loss: JAX makes it an int32


def check_step_tokens(batch_per_device: int, chips: int, seq: int) -> int:
    """The tokens of one step (batch per device x chips x seq), refused past int32 before anything compiles."""
    if batch_per_device < 1:
        raise LabError(f"--batch-per-device {batch_per_device}: use 1 or more")
    tokens = batch_per_device * chips * seq
    if tokens > MAX_STEP_TOKENS:
        most = MAX_STEP_TOKENS // (chips * seq)
        fix = f"--batch-per-device {most} or less" if most else f"--seq {MAX_STEP_TOKENS // chips:,} or less"
        raise LabError(
            f"--batch-per-device {batch_per_device} x {chips} chips x --seq {seq} = {tokens:,} tokens a step, past "
            f"the {MAX_STEP_TOKENS:,} a step can count (int32); give {fix}"
        )
    return tokens


def parse_model(text: str) -> ModelConfig:
    """A preset name, ``key=value,...`` pairs (see `KEYS`), or a preset then pairs -> ModelConfig; a LabError
    names what is wrong."""
    text = text.strip()
    first, _, rest = text.partition(",")
    if "=" not in first:
        key = first.strip().lower()
        if key not in PRESETS:
            raise LabError(f"unknown model preset {first!r}; use one of {', '.join(PRESETS)} or key=value pairs")
        base = PRESETS[key][0]
        return replace(base, **_fields(text, rest)) if rest.strip() else base
    fields = _fields(text, text)
    missing = [k for k in _REQUIRED if KEYS[k] not in fields]
    if missing:
        raise LabError(f"--model: give {', '.join(missing)} too (e.g. {EXAMPLE})")
    fields.setdefault("seq", 4096)
    if "head_dim" not in fields:
        fields["head_dim"] = _whole(fields["embed"], fields["heads"])
    return ModelConfig(**fields)


def _fields(text: str, pairs: str) -> dict[str, object]:
    """``key=value,...`` -> ModelConfig fields."""
    given: dict[str, str] = {}
    for part in pairs.split(","):
        name, sep, value = (s.strip() for s in part.partition("="))
        if not sep or not name or not value:
            raise LabError(f"--model {text!r}: write key=value pairs separated by commas, e.g. {EXAMPLE}")
        if name not in KEYS:
            raise LabError(f"--model: unknown key {name!r}; the keys are {', '.join(KEYS)}")
        if name in given:
            raise LabError(f"--model: key {name!r} is given twice")
        given[name] = value
    if not given.get("experts") and not text.startswith(_MOE_PRESETS) and {"top_k", "capacity"} & given.keys():
        raise LabError(f"--model {text!r}: top_k and capacity are an MoE's; give experts=E too")
    fields = {KEYS[name]: _value(name, value) for name, value in given.items()}
    if "capacity" in given:  # a factor or none keeps a buffer; dropless has none
        fields["dropless"] = fields["capacity_factor"] == "dropless"
        fields["capacity_factor"] = None if fields["dropless"] else fields["capacity_factor"]
    return fields


def _value(name: str, value: str) -> object:
    if name in _INTEGER_KEYS:
        if not (value.isascii() and value.isdigit()) or int(value) < 1:
            raise LabError(f"--model: {name}={value!r} must be a positive integer")
        return int(value)
    if name in _BOOLEAN_KEYS:
        if value.lower() not in ("true", "false"):
            raise LabError(f"--model: {name}={value!r}; use true or false")
        return value.lower() == "true"
    if name == "capacity":
        if value.strip().lower() == "dropless":
            return "dropless"
        try:
            factor = parse_capacity_factor(value)
        except LabError:
            factor = math.nan
        if factor is not None and not (math.isfinite(factor) and factor > 0):
            raise LabError(f"--model: capacity={value!r}; use a number above 0 such as 1.25, none or dropless")
        return factor
    choices = FEED_FORWARDS if name == "mlp" else BLOCKS
    if value not in choices:
        raise LabError(f"--model: {name}={value!r}; use one of {', '.join(choices)}")
    return value


def _whole(d_model: int, heads: int) -> int:
    if d_model % heads:
        raise LabError(f"--model: d_model={d_model} is not a multiple of heads={heads}; give head_dim")
    return d_model // heads


def published_parameters(name: str) -> tuple[int | str, str]:
    """The parameter count a preset's authors published (exact, or an MoE's "total / active" as its card writes
    them), and where."""
    _, count, source = PRESETS[name]
    return count, source


def model_flops(config, tokens: int) -> float:
    """6 · N' · tokens + 12 · L · H · K · S · tokens MaxText's convention: N' the parameters a token uses, without the
    input embedding; the attention not halved for causality)."""
    dense = config.active_parameters - (0 if config.tied else config.vocab * config.embed)
    return float(6 * dense * tokens) + attention_flops(config, tokens)


def attention_flops(config, tokens: int) -> float:
    """The attention's part of `model_flops`: 12 · L · H · K · S · tokens, the full S x S scores (not halved);
    latent attention's heads score with K + R channels and read K: 6 · L · H · (2K + R) · S · tokens."""
    widths = 2 * config.head_dim + config.rope_dim
    return float(6 * config.layers * config.heads * widths * config.seq * tokens)
