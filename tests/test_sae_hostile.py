"""Broken SAE files: each is a one-line `SAEError` naming the file and the field, never a traceback from
deeper down (a TypeError in the config's parsing, a RecursionError in json, a topk() of a bool) nor an SAE
that loads and then reads NaN or integer weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from sae_files import write_sae
from safetensors.torch import load_file, save_file

from model.lab.sae import SAEError, load_sae

D_IN, D_SAE = 16, 48
HOOK = "blocks.1.hook_resid_pre"


def sae_dir(tmp_path: Path, architecture: str = "standard", **cfg: Any) -> Path:
    return write_sae(tmp_path / "sae", hook=HOOK, d_in=D_IN, d_sae=D_SAE, architecture=architecture, **cfg)


def edit_cfg(path: Path, **fields: Any) -> Path:
    """Set top-level cfg.json fields (a value of `...` removes the field)."""
    cfg = json.loads((path / "cfg.json").read_text())
    for name, value in fields.items():
        if value is ...:
            cfg.pop(name, None)
        else:
            cfg[name] = value
    (path / "cfg.json").write_text(json.dumps(cfg))
    return path


def edit_weights(path: Path, **tensors: torch.Tensor) -> Path:
    weights = load_file(str(path / "sae_weights.safetensors")) | tensors
    save_file(weights, str(path / "sae_weights.safetensors"))
    return path


@pytest.mark.parametrize(
    "text", ["[" * 100_000 + "]" * 100_000, '{"d_in": ' + "9" * 5000 + "}"], ids=["deep", "5000 digits"]
)
def test_unparseable_cfg_json(tmp_path: Path, text: str) -> None:
    path = sae_dir(tmp_path)
    (path / "cfg.json").write_text(text)
    with pytest.raises(SAEError, match=r"sae: cfg\.json is not readable JSON"):
        load_sae(path)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8, torch.bool])
def test_integer_weights(tmp_path: Path, dtype: torch.dtype) -> None:
    path = edit_weights(sae_dir(tmp_path), W_enc=torch.ones(D_IN, D_SAE, dtype=dtype))
    with pytest.raises(SAEError, match=r"sae_weights\.safetensors holds W_enc as \w+; an SAE's weights are floating"):
        load_sae(path)


def test_half_weights_load(tmp_path: Path) -> None:
    path = sae_dir(tmp_path)
    edit_weights(path, **{name: t.half() for name, t in load_file(str(path / "sae_weights.safetensors")).items()})
    assert load_sae(path).W_enc.dtype == torch.float32


@pytest.mark.parametrize(
    ("name", "value"),
    [("W_enc", float("nan")), ("b_enc", float("inf")), ("W_dec", float("-inf")), ("b_dec", float("nan"))],
)
def test_non_finite_weights(tmp_path: Path, name: str, value: float) -> None:
    path = sae_dir(tmp_path)
    t = load_file(str(path / "sae_weights.safetensors"))[name].clone()
    t.view(-1)[-1] = value
    edit_weights(path, **{name: t})
    with pytest.raises(SAEError, match=rf"sae_weights\.safetensors holds NaN or infinite values in {name}$"):
        load_sae(path)


def test_non_finite_threshold_and_float64_overflow(tmp_path: Path) -> None:
    path = edit_weights(sae_dir(tmp_path, "jumprelu"), threshold=torch.full((D_SAE,), float("nan")))
    with pytest.raises(SAEError, match="NaN or infinite values in threshold"):
        load_sae(path)
    # finite in float64, infinite in the float32 the SAE runs in
    path = edit_weights(sae_dir(tmp_path / "b"), b_dec=torch.full((D_IN,), 1e300, dtype=torch.float64))
    with pytest.raises(SAEError, match="NaN or infinite values in b_dec"):
        load_sae(path)
