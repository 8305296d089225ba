"""Named hook points and per-call activation capture.

Hook points are identity modules placed where a value is born, named as in TransformerLens
(`blocks.3.attn.hook_pattern`), so dumps line up with the interpretability ecosystem. The model keeps no
capture state of its own: whoever wants activations passes a `Hooks` object with the forward call, so
requests served concurrently by one model never see each other's captures, and nothing is left behind.
"""

from __future__ import annotations

import fnmatch
from typing import Protocol

import torch
from torch import nn


class Hooks(Protocol):
    """What a forward pass hands each hook point's value to."""

    def active(self, name: str) -> bool:
        """Whether `name` is of interest (so the model can take the explicit attention path)."""
        ...

    def __call__(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """Receive the value at hook point `name`; return the value the forward pass continues with."""
        ...


class HookPoint(nn.Module):
    """Identity at a named site of the network."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def forward(self, x: torch.Tensor, hooks: Hooks | None) -> torch.Tensor:
        return x if hooks is None else hooks(self.name, x)

    def extra_repr(self) -> str:
        return repr(self.name)


class UnknownHookError(ValueError):
    """A requested hook name or pattern matches no hook point of the model."""


def hook_names(n_layer: int) -> list[str]:
    """Every hook point of a GPT-2 with `n_layer` blocks, in the order the forward pass reaches them."""
    per_layer = [
        "hook_resid_pre",
        "ln1.hook_normalized",
        "attn.hook_q",
        "attn.hook_k",
        "attn.hook_v",
        "attn.hook_attn_scores",
        "attn.hook_pattern",
        "attn.hook_z",
        "hook_attn_out",
        "hook_resid_mid",
        "ln2.hook_normalized",
        "mlp.hook_pre",
        "mlp.hook_post",
        "hook_mlp_out",
        "hook_resid_post",
    ]
    names = ["hook_embed", "hook_pos_embed"]
    names += [f"blocks.{layer}.{site}" for layer in range(n_layer) for site in per_layer]
    return [*names, "ln_final.hook_normalized", "logits"]


def describe_hook_names(n_layer: int) -> str:
    """The valid names in a compact form, for error messages."""
    per_layer = [n.split(".", 2)[2] for n in hook_names(1) if n.startswith("blocks.0.")]
    layers = f"{{0..{n_layer - 1}}}"
    return ", ".join(
        ["hook_embed", "hook_pos_embed"]
        + [f"blocks.{layers}.{site}" for site in per_layer]
        + ["ln_final.hook_normalized", "logits"]
    )


def select_hooks(patterns: list[str] | tuple[str, ...], n_layer: int) -> list[str]:
    """Expand exact names and glob patterns (`blocks.*.hook_resid_post`) into hook names, in model order.

    A pattern that matches nothing is an error naming it and listing the valid names.
    """
    names = hook_names(n_layer)
    chosen: set[str] = set()
    for pattern in patterns:
        if not isinstance(pattern, str) or not pattern:
            raise UnknownHookError(f"hook names must be non-empty strings, got {pattern!r}")
        matched = fnmatch.filter(names, pattern) if _is_glob(pattern) else [pattern] if pattern in names else []
        if not matched:
            raise UnknownHookError(
                f"unknown hook {pattern!r}: no hook point matches it; valid names are {describe_hook_names(n_layer)}"
            )
        chosen.update(matched)
    return [n for n in names if n in chosen]


def _is_glob(pattern: str) -> bool:
    return any(c in pattern for c in "*?[")


def is_attention_square(name: str) -> bool:
    """Hooks shaped [batch, head, query_pos, key_pos]: their masked future is filled in when assembled."""
    return name.endswith(("hook_attn_scores", "hook_pattern"))


class Capture:
    """Records the values of chosen hook points, across one or several forward passes.

    Generation with a KV cache runs the prompt, then one token at a time; each pass adds a chunk of
    positions. `tensors()` glues the chunks together so that the result equals one forward pass over the
    whole sequence: [batch, pos, ...] chunks are concatenated along `pos`; attention scores and patterns
    [batch, head, q, k] are widened to the full key length (scores with -inf, patterns with 0, the values
    the causal mask gives) and concatenated along `q`. Chunks must come from one sequence in order.
    """

    def __init__(self, names: list[str] | tuple[str, ...]) -> None:
        self.names = list(names)
        self._wanted = frozenset(self.names)
        self._chunks: dict[str, list[torch.Tensor]] = {n: [] for n in self.names}

    def active(self, name: str) -> bool:
        return name in self._wanted

    def __call__(self, name: str, x: torch.Tensor) -> torch.Tensor:
        if name in self._wanted:
            self._chunks[name].append(x.detach())
        return x

    def tensors(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for name, chunks in self._chunks.items():
            if not chunks:
                continue
            if is_attention_square(name):
                n_keys = chunks[-1].shape[-1]
                fill = float("-inf") if name.endswith("hook_attn_scores") else 0.0
                chunks = [_widen(c, n_keys, fill) for c in chunks]
                out[name] = torch.cat(chunks, dim=2)  # [batch, head, pos, pos]
            else:
                out[name] = torch.cat(chunks, dim=1)  # [batch, pos, ...]
        return out


def _widen(chunk: torch.Tensor, n_keys: int, fill: float) -> torch.Tensor:
    missing = n_keys - chunk.shape[-1]
    if missing == 0:
        return chunk
    pad = chunk.new_full((*chunk.shape[:-1], missing), fill)
    return torch.cat([chunk, pad], dim=-1)
