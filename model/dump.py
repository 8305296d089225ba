"""Activation dumps: hook name -> tensor, in one safetensors file that loads in one line.

    tensors = safetensors.torch.load_file("dump.safetensors")          # torch
    arrays = safetensors.numpy.load_file("dump.safetensors")           # numpy (bfloat16 needs torch)

The header's metadata (strings only, as the format requires) carries what the dump is of: the model,
the token ids (as JSON) and the text.
"""

from __future__ import annotations

import json
import os
import stat
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


def dump_path_problem(path: str | Path) -> str | None:
    """Why a dump cannot be written to `path` (None: it looks writable), to ask before the work that makes
    the dump. The file is written to a temporary name and renamed over the target, which would replace a
    device or a pipe; a symlink is followed to the file it names."""
    if not Path(path).parent.is_dir():
        return f"cannot write {path}: no directory {Path(path).parent}"
    try:
        target = Path(path).resolve()  # through symlinks: where the file will be
    except (OSError, RuntimeError) as e:  # a symlink loop
        return f"cannot write {path}: {e}"
    if not target.parent.is_dir():
        return f"cannot write {path}: it links to {target}, in no directory"
    if target.exists() and not stat.S_ISREG(target.stat().st_mode):
        return f"cannot write {path}: it is not a regular file"
    return None


def save_dump(path: str | Path, tensors: dict[str, torch.Tensor], metadata: dict[str, Any]) -> None:
    """Write `tensors` with `metadata` (values that are not strings are stored as JSON) to `path`, through a
    symlink to the file it names, with the mode of the file it replaces or the one a new file gets from the
    umask (safetensors writes a temporary file, private to its owner, and renames it over the path). A path
    `dump_path_problem` refuses is a `ValueError`."""
    if problem := dump_path_problem(path):
        raise ValueError(problem)
    target = Path(path).resolve()
    new = not target.exists()
    if new:
        target.touch()  # created as any new file is: its mode is the one the dump keeps
    mode = stat.S_IMODE(target.stat().st_mode)
    try:
        save_file(_contiguous(tensors), str(target), metadata=_metadata(metadata))
    except BaseException:
        if new:
            target.unlink(missing_ok=True)
        raise
    os.chmod(target, mode)


def dump_bytes(tensors: dict[str, torch.Tensor], metadata: dict[str, Any]) -> bytes:
    """The same file as `save_dump` writes, in memory (for sending over HTTP)."""
    return save(_contiguous(tensors), metadata=_metadata(metadata))


def load_dump(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and the metadata of a dump."""
    with safe_open(str(path), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}, dict(f.metadata() or {})  # noqa: SIM118
