"""Hostile checkpoints: each is refused with a one-line LoadError that names the file and the problem,
never a traceback of another type, a hang or a silent misreading."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from model.config import ConfigError, GPTConfig
from model.hub import hub_errors
from model.loading import LoadError, load_weights, official_shapes

CPU = {"device": "cpu"}
SMALL = GPTConfig(n_layer=2, n_head=2, n_embd=8, n_positions=8, vocab_size=16)


def write_checkpoint(directory: Path, config: GPTConfig = SMALL) -> Path:
    """A random-weight checkpoint in the official layout (transformers' prefix), small enough to build per test."""
    directory.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    state = {"transformer." + k: torch.randn(shape, generator=g) for k, shape in official_shapes(config).items()}
    save_file(state, directory / "model.safetensors", metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config.to_hf_dict()))
    return directory


def write_raw(path: Path, header: dict | str, body: bytes = b"") -> Path:
    """A .safetensors file with exactly this header (a dict, or JSON text as it is) and data."""
    text = header if isinstance(header, str) else json.dumps(header)
    raw = text.encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + body)
    return path


def f32(shape: list, begin: int, end: int) -> dict:
    return {"dtype": "F32", "shape": shape, "data_offsets": [begin, end]}


# --- 1. a source that looks like a repo id but is not a valid one ---------------------------------


@pytest.mark.parametrize("source", ["nodir/..", "x/.y", "a--b/c", "x/y."])
def test_an_invalid_repo_id_is_a_load_error(source: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)  # none of them exists as a path here
    with pytest.raises(LoadError, match=r"^not a local path, and not a valid hub repo id: ") as info:
        load_weights(source, **CPU)
    assert repr(source) in str(info.value) and "\n" not in str(info.value)


def test_hub_errors_turns_the_hub_clients_refusals_into_the_callers_error() -> None:
    from huggingface_hub import hf_hub_download

    bad_repo = pytest.raises(LoadError, match=r"^x: not a local path, and not a valid hub repo id: 'nodir/\.\.'")
    with bad_repo, hub_errors(LoadError, "nodir/..", None, missing=str, offline="", where="x: "):
        hf_hub_download("nodir/..", "cfg.json", local_files_only=True)
    bad_file = pytest.raises(LoadError, match=r"not a valid path in the hub repository 'a/b': Invalid filename '\.\./x")
    with bad_file, hub_errors(LoadError, "a/b", None, missing=str, offline=""):
        hf_hub_download("a/b", "../x/cfg.json", local_files_only=True)
    with pytest.raises(ConfigError), hub_errors(LoadError, "a/b", None, missing=str, offline=""):
        raise ConfigError("a bad config.json")  # the block's own ValueErrors pass through
