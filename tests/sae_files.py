"""Random SAEs written in SAELens' saved format (`cfg.json` + `sae_weights.safetensors`) without SAELens,
for the tests that need an SAE file but not SAELens itself (the server's, the command line's)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file


def write_sae(
    directory: Path,
    *,
    hook: str,
    d_in: int,
    d_sae: int,
    architecture: str = "standard",
    seed: int = 0,
    legacy: bool = False,
    **cfg: Any,
) -> Path:
    """An SAE with random weights (biases and thresholds too) in SAELens' current layout (`hook_name`
    under `metadata`), or with `legacy` the older one the hub's res-jb files have (`hook_point` at the top
    level, `normalize_activations` a boolean)."""
    g = torch.Generator().manual_seed(seed)
    weights = {
        "W_enc": torch.randn(d_in, d_sae, generator=g) / d_in**0.5,
        "b_enc": torch.randn(d_sae, generator=g) * 0.1,
        "W_dec": torch.randn(d_sae, d_in, generator=g) / d_sae**0.5,
        "b_dec": torch.randn(d_in, generator=g) * 0.1,
    }
    if architecture == "jumprelu":
        weights["threshold"] = torch.rand(d_sae, generator=g) * 0.2
    if legacy:
        body: dict[str, Any] = {
            "hook_point": hook,
            "hook_point_layer": 0,
            "model_name": "tiny",
            "dtype": "float32",
            "d_in": d_in,
            "d_sae": d_sae,
            "normalize_activations": False,
            "apply_b_dec_to_input": True,
        }
    else:
        body = {
            "architecture": architecture,
            "dtype": "float32",
            "d_in": d_in,
            "d_sae": d_sae,
            "apply_b_dec_to_input": True,
            "normalize_activations": "none",
            "metadata": {"hook_name": hook, "model_name": "tiny", "sae_lens_version": "6.0.0"},
        }
    body.update(cfg)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "cfg.json").write_text(json.dumps(body))
    save_file(weights, str(directory / "sae_weights.safetensors"))
    return directory
