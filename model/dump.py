"""Activation dumps: hook name -> tensor, in one safetensors file that loads in one line.

    tensors = safetensors.torch.load_file("dump.safetensors")          # torch
    arrays = safetensors.numpy.load_file("dump.safetensors")           # numpy (bfloat16 needs torch)

The header's metadata (strings only, as the format requires) carries what the dump is of: the model,
the token ids (as JSON) and the text.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save, save_file


def _metadata(meta: dict[str, Any]) -> dict[str, str]:
    return {k: v if isinstance(v, str) else json.dumps(v) for k, v in meta.items()}


def _contiguous(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each tensor on the CPU, contiguous, and in memory of its own: safetensors refuses tensors that share
    memory, and two hook points can hold the same tensor (a gradient at blocks.3.hook_resid_post is the one at
    blocks.4.hook_resid_pre; logits and unembed.hook_out are one tensor)."""
    out: dict[str, torch.Tensor] = {}
    storages: set[int] = set()
    for name, t in tensors.items():
        t = t.detach().cpu().contiguous()
        storage = t.untyped_storage().data_ptr()
        out[name] = t.clone() if storage in storages else t
        storages.add(storage)
    return out


def save_dump(path: str | Path, tensors: dict[str, torch.Tensor], metadata: dict[str, Any]) -> None:
    """Write `tensors` with `metadata` (values that are not strings are stored as JSON)."""
    save_file(_contiguous(tensors), str(path), metadata=_metadata(metadata))


def dump_bytes(tensors: dict[str, torch.Tensor], metadata: dict[str, Any]) -> bytes:
    """The same file as `save_dump` writes, in memory (for sending over HTTP)."""
    return save(_contiguous(tensors), metadata=_metadata(metadata))


def load_dump(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and the metadata of a dump."""
    with safe_open(str(path), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}, dict(f.metadata() or {})  # noqa: SIM118
