"""Activation tensors to wire formats: JSON (nested lists) or a safetensors file (raw, or base64 in JSON)."""

from __future__ import annotations

import base64
import math
from typing import Any

import torch

from model.config import GPTConfig
from model.dump import dump_bytes
from model.hooks import is_attention_square

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def activation_bytes(config: GPTConfig, names: list[str], n_tokens: int, dtype: str) -> int:
    """Size of the tensors a dump of `names` over `n_tokens` positions will hold, known before running."""
    C, H, D, T = config.n_embd, config.n_head, config.d_head, n_tokens
    per_name = 0
    for name in names:
        if is_attention_square(name):
            per_name += H * T * T
        elif name.endswith(("hook_q", "hook_k", "hook_v", "hook_z")):
            per_name += T * H * D
        elif name.endswith(("mlp.hook_pre", "mlp.hook_post")):
            per_name += T * config.d_mlp
        elif name == "logits":
            per_name += T * config.vocab_size
        else:
            per_name += T * C
    return per_name * DTYPES[dtype].itemsize


def cast(tensors: dict[str, torch.Tensor], dtype: str) -> dict[str, torch.Tensor]:
    return {name: t.to(device="cpu", dtype=DTYPES[dtype]) for name, t in tensors.items()}


def to_json(tensors: dict[str, torch.Tensor], dtype: str) -> dict[str, Any]:
    """`{name: {"shape", "dtype", "data"}}`; JSON has no infinities, so masked scores (-inf) become null."""
    out = {}
    for name, t in cast(tensors, dtype).items():
        data = t.float().tolist()
        if name.endswith("hook_attn_scores"):
            data = _nulls_for_infinities(data)
        out[name] = {"shape": list(t.shape), "dtype": dtype, "data": data}
    return out


def _nulls_for_infinities(data: Any) -> Any:
    if isinstance(data, list):
        return [_nulls_for_infinities(x) for x in data]
    return None if math.isinf(data) else data


def to_safetensors(tensors: dict[str, torch.Tensor], dtype: str, metadata: dict[str, Any]) -> bytes:
    return dump_bytes(cast(tensors, dtype), metadata)


def to_safetensors_base64(tensors: dict[str, torch.Tensor], dtype: str, metadata: dict[str, Any]) -> str:
    return base64.b64encode(to_safetensors(tensors, dtype, metadata)).decode("ascii")
