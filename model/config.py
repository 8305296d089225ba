"""GPT-2 hyper-parameters: the shape of the network, read from an official `config.json`.

Reference: OpenAI's GPT-2 release (Radford et al., 2019) and the Hugging Face `GPT2Config` format.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .json_file import clip, read_json


class ConfigError(ValueError):
    """A `config.json` that is missing, malformed, or asks for something this model does not implement."""


_MAX_SIZE = 2**31 - 1  # the largest n_layer, n_head, ...: far above any GPT-2's (gpt2-xl's largest is 50257)


@dataclass(frozen=True)
class GPTConfig:
    """The shape of a GPT-2: blocks, heads, width, context and vocabulary (gpt2-small's by default; `PRESETS`
    has the others), as Hugging Face's config.json names them."""

    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    n_positions: int = 1024  # context length
    vocab_size: int = 50257
    layer_norm_epsilon: float = 1e-5

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_head", "n_embd", "n_positions", "vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {clip(value)}")
            if value > _MAX_SIZE:  # a 4000-digit one would fill the message that names it, and any later one
                raise ConfigError(f"{name} must be at most {_MAX_SIZE}, got {clip(value)}")
        if self.n_embd % self.n_head:
            raise ConfigError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if not self.layer_norm_epsilon > 0:
            raise ConfigError(f"layer_norm_epsilon must be positive, got {self.layer_norm_epsilon!r}")
        if not math.isfinite(self.layer_norm_epsilon):
            raise ConfigError(f"layer_norm_epsilon must be finite, got {self.layer_norm_epsilon!r}")

    @property
    def d_head(self) -> int:
        return self.n_embd // self.n_head

    @property
    def d_mlp(self) -> int:
        return 4 * self.n_embd

    def n_params(self) -> int:
        """Parameters counted once (the LM head is tied to `wte`)."""
        C, L = self.n_embd, self.n_layer
        per_block = 2 * 2 * C + (C * 3 * C + 3 * C) + (C * C + C) + (C * 4 * C + 4 * C) + (4 * C * C + C)
        return self.vocab_size * C + self.n_positions * C + L * per_block + 2 * C

    # --- the official format -------------------------------------------------------------

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> GPTConfig:
        """Build from the dict of a Hugging Face GPT-2 `config.json`, refusing what we do not implement."""
        d = _without_aliases(d)
        _refuse_unsupported(d)
        try:
            return cls(
                n_layer=d["n_layer"],
                n_head=d["n_head"],
                n_embd=d["n_embd"],
                n_positions=d.get("n_positions", d.get("n_ctx", 1024)),
                vocab_size=d.get("vocab_size", 50257),
                layer_norm_epsilon=_number(d.get("layer_norm_epsilon", 1e-5)),
            )
        except KeyError as e:
            raise ConfigError(f"config.json lacks the required field {e.args[0]!r}") from None

    @classmethod
    def from_json_file(cls, path: str | Path) -> GPTConfig:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"no config.json found at {path}")
        d = read_json(path, ConfigError, "a GPT-2 config")
        if not isinstance(d, dict):
            raise ConfigError(f"{path} must hold a JSON object, got {type(d).__name__}")
        try:
            return cls.from_hf_dict(d)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None

    def to_hf_dict(self) -> dict[str, Any]:
        """The `config.json` that transformers' `GPT2LMHeadModel.from_pretrained` reads."""
        return {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "activation_function": "gelu_new",
            **asdict(self),
            "n_ctx": self.n_positions,
            "bos_token_id": 50256,
            "eos_token_id": 50256,
            "tie_word_embeddings": True,
            "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False,
            "add_cross_attention": False,
        }


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"layer_norm_epsilon must be a number, got {clip(value)}")
    return float(value)


# Settings of the official format that would change the computation, and the values we implement.
# Everything else in a config.json (dropout rates, task heads, token ids) does not affect inference.
_SUPPORTED: dict[str, tuple[Any, ...]] = {
    "model_type": ("gpt2",),
    "activation_function": ("gelu_new", "gelu_pytorch_tanh"),  # both are GELU's tanh approximation
    "scale_attn_weights": (True,),
    "scale_attn_by_inverse_layer_idx": (False,),
    "reorder_and_upcast_attn": (False,),
    "add_cross_attention": (False,),
    "tie_word_embeddings": (True,),
}


# transformers' other names for GPT-2's fields (GPT2Config.attribute_map), which a config.json may carry
_ALIASES = {
    "num_hidden_layers": "n_layer",
    "num_attention_heads": "n_head",
    "hidden_size": "n_embd",
    "max_position_embeddings": "n_positions",
}


def _without_aliases(d: dict[str, Any]) -> dict[str, Any]:
    """`d` with each of transformers' aliases read as the field it stands for: where both are given they must
    agree (transformers builds the alias's model, so one of the two would be silently wrong)."""
    d = dict(d)
    for alias, name in _ALIASES.items():
        if alias not in d:
            continue
        if name in d and d[name] != d[alias]:
            raise ConfigError(
                f"{name}={clip(d[name])} and its alias {alias}={clip(d[alias])} disagree (transformers reads "
                f"{alias}): give one, or the same value in both"
            )
        d[name] = d.pop(alias)
    return d


def _refuse_unsupported(d: dict[str, Any]) -> None:
    for key, allowed in _SUPPORTED.items():
        if key in d and d[key] not in allowed:
            raise ConfigError(
                f"unsupported setting {key}={clip(d[key])}: this GPT-2 implements only "
                + " or ".join(repr(a) for a in allowed)
            )
    n_inner = d.get("n_inner")
    if n_inner is not None and "n_embd" in d and n_inner != 4 * d["n_embd"]:
        raise ConfigError(f"unsupported setting n_inner={clip(n_inner)}: the MLP width must be 4 * n_embd")


# Shapes of the official checkpoints (openai-community/* and distilbert/distilgpt2 on the hub).
PRESETS: dict[str, GPTConfig] = {
    "gpt2": GPTConfig(n_layer=12, n_head=12, n_embd=768),
    "gpt2-medium": GPTConfig(n_layer=24, n_head=16, n_embd=1024),
    "gpt2-large": GPTConfig(n_layer=36, n_head=20, n_embd=1280),
    "gpt2-xl": GPTConfig(n_layer=48, n_head=25, n_embd=1600),
    "distilgpt2": GPTConfig(n_layer=6, n_head=12, n_embd=768),
}


def preset(name: str) -> GPTConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[name]
