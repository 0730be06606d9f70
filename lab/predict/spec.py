"""Model specs: published decoder configurations, and the ``--model`` text that names one.

A spec is a `lab.model.ModelConfig` at full size. Nothing is allocated for it:
the predictor declares its parameters abstractly (`lab.model.abstract_model`)
and compiles the step for a topology with no chips. ``--model`` takes a preset
name (``llama3-8b``) or ``key=value`` pairs with the keys of `KEYS`::

    layers=32,d_model=4096,heads=32,kv_heads=8,head_dim=128,d_ff=14336,vocab=128256,mlp=swiglu,block=sequential,tied=false

The presets are the configurations their authors published (each one's
``config.json`` on the Hugging Face hub, or its paper); their parameter counts
are checked against the published totals in the tests. Rotary positions,
RMSNorm and no biases are the family's; GPT-J/PaLM-style parallel blocks and
plain activations are there for specs typed in, not for these presets.
"""

from __future__ import annotations

from dataclasses import replace

from lab.errors import LabError
from lab.model import BLOCKS, FEED_FORWARDS, ModelConfig


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


# name -> (config, published parameter count, where it was published)
PRESETS: dict[str, tuple[ModelConfig, int, str]] = {
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
}
PRESETS["llama3.1-8b"] = PRESETS["llama3-8b"]
PRESETS["llama3.1-70b"] = PRESETS["llama3-70b"]
PRESETS["llama3.1-405b"] = PRESETS["llama3-405b"]

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
}
_INTEGER_KEYS = ("layers", "d_model", "heads", "kv_heads", "head_dim", "d_ff", "vocab")
_REQUIRED = ("layers", "d_model", "heads", "d_ff", "vocab")
EXAMPLE = "layers=32,d_model=4096,heads=32,kv_heads=8,head_dim=128,d_ff=14336,vocab=128256,mlp=swiglu"


MAX_STEP_TOKENS = 2**31 - 1  # a step's token count is a Python int in the loss: JAX makes it an int32


def check_step_tokens(batch_per_device: int, chips: int, seq: int) -> int:
    """The tokens of one step (batch per device x chips x seq), refused past int32 before anything compiles."""
    if batch_per_device < 1:
        raise LabError(f"--batch-per-device {batch_per_device}: use 1 or more")
    tokens = batch_per_device * chips * seq
    if tokens > MAX_STEP_TOKENS:
        most = max(1, MAX_STEP_TOKENS // (chips * seq))
        raise LabError(
            f"--batch-per-device {batch_per_device} x {chips} chips x --seq {seq} = {tokens:,} tokens a step, past "
            f"the {MAX_STEP_TOKENS:,} a step can count (int32); give --batch-per-device {most} or less"
        )
    return tokens


def parse_model(text: str) -> ModelConfig:
    """A preset name or ``key=value,...`` pairs (see `KEYS`) -> ModelConfig; a LabError names what is wrong."""
    text = text.strip()
    if "=" not in text:
        key = text.lower()
        if key not in PRESETS:
            raise LabError(f"unknown model preset {text!r}; use one of {', '.join(PRESETS)} or key=value pairs")
        return PRESETS[key][0]
    given: dict[str, str] = {}
    for part in text.split(","):
        name, sep, value = (s.strip() for s in part.partition("="))
        if not sep or not name or not value:
            raise LabError(f"--model {text!r}: write key=value pairs separated by commas, e.g. {EXAMPLE}")
        if name not in KEYS:
            raise LabError(f"--model: unknown key {name!r}; the keys are {', '.join(KEYS)}")
        if name in given:
            raise LabError(f"--model: key {name!r} is given twice")
        given[name] = value
    missing = [k for k in _REQUIRED if k not in given]
    if missing:
        raise LabError(f"--model: give {', '.join(missing)} too (e.g. {EXAMPLE})")
    fields: dict[str, object] = {"seq": 4096}
    for name, value in given.items():
        fields[KEYS[name]] = _value(name, value)
    if "head_dim" not in given:
        fields["head_dim"] = _whole(fields["embed"], fields["heads"])
    return ModelConfig(**fields)


def _value(name: str, value: str) -> object:
    if name in _INTEGER_KEYS:
        if not (value.isascii() and value.isdigit()) or int(value) < 1:
            raise LabError(f"--model: {name}={value!r} must be a positive integer")
        return int(value)
    if name == "tied":
        if value.lower() not in ("true", "false"):
            raise LabError(f"--model: tied={value!r}; use true or false")
        return value.lower() == "true"
    choices = FEED_FORWARDS if name == "mlp" else BLOCKS
    if value not in choices:
        raise LabError(f"--model: {name}={value!r}; use one of {', '.join(choices)}")
    return value


def _whole(d_model: int, heads: int) -> int:
    if d_model % heads:
        raise LabError(f"--model: d_model={d_model} is not a multiple of heads={heads}; give head_dim")
    return d_model // heads


def published_parameters(name: str) -> tuple[int, str]:
    """The parameter count a preset's authors published, and where."""
    _, count, source = PRESETS[name]
    return count, source
