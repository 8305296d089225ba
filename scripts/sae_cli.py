"""The command line's SAEs and steering, shared by gpt2-generate and gpt2-analyze, with the HTTP API's
semantics: `--sae ID=PATH` as gpt2-serve's (a directory in SAELens' format, or a hub repo/path[@revision]),
and `--steer` taking one edit as the API's `interventions` entries spell it (the same schema reads it).

    gpt2-analyze "The cat sat on the mat" --model gpt2 \
        --sae res8=jbloom/GPT2-Small-SAEs-Reformatted/blocks.8.hook_resid_pre
    gpt2-generate "I think that" --model gpt2 --greedy --sae res8=./res-jb/blocks.8.hook_resid_pre \
        --steer '{"hook": "blocks.8.hook_resid_pre", "op": "steer", "scale": 8,
                  "direction": {"sae": "res8", "feature": 7}}'
"""

from __future__ import annotations

import argparse
import json

import torch

from model.hooks import run_with_cache
from model.interventions import EditSpec, InterventionError
from model.lab.sae import SAE, token_features
from model.lab.steering import Directions
from model.loading import LoadedModel


def add_sae_arguments(p: argparse.ArgumentParser, steer: bool) -> None:
    p.add_argument(
        "--sae",
        action="append",
        default=[],
        metavar="ID=PATH",
        help="an SAE in SAELens' format: a directory or a hub repo/path[@revision] (repeatable)",
    )
    if steer:
        p.add_argument(
            "--steer",
            action="append",
            default=[],
            metavar="JSON",
            help='an edit as the HTTP API\'s interventions spell it, e.g. {"hook": "blocks.8.hook_resid_pre", '
            '"op": "steer", "scale": 8, "direction": {"sae": "res8", "feature": 1234}} (repeatable)',
        )


def directions(args: argparse.Namespace, loaded: LoadedModel) -> Directions:
    """The SAEs named by `--sae`, checked against the model (`SAEError` names what is wrong)."""
    from model.lab.sae import load_saes

    return Directions(load_saes(args.sae, loaded.model.config, loaded.device))


def steering_edits(texts: list[str], found: Directions, n_layer: int) -> EditSpec | None:
    """The `--steer` edits, read by the HTTP API's own schema (`InterventionError` says what is wrong)."""
    from pydantic import ValidationError

    from server.schemas import InterventionSpec, edit_spec

    specs = []
    for i, text in enumerate(texts):
        try:
            specs.append(InterventionSpec.model_validate_json(text))
        except ValidationError as e:
            problem = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'edit'}: {err['msg']}" for err in e.errors())
            raise InterventionError(f"--steer {i + 1} ({text!r}): {problem}") from None
    return edit_spec(specs, None, n_layer, found) if specs else None


def features_table(sae_id: str, sae: SAE, loaded: LoadedModel, ids: list[int], top_k: int) -> str:
    """Per token, the SAE's top features and how well it reconstructs the value there."""
    with torch.inference_mode():
        x = run_with_cache(loaded.model, torch.tensor([ids], device=loaded.device), [sae.cfg.hook_name])
    rows = token_features(sae, x[sae.cfg.hook_name][0], top_k, None)
    text = loaded.tokenizer.token_text
    lines = [f"SAE {sae_id} at {sae.cfg.hook_name} ({sae.cfg.architecture}, {sae.cfg.d_sae} features)", ""]
    lines.append(f"{'pos':>4}  {'token':<16} {'L0':>5} {'var.expl':>8}  top features (id:value)")
    for p, (t, r) in enumerate(zip(ids, rows, strict=True)):
        ve = f"{r.variance_explained:8.3f}" if r.variance_explained is not None else f"{'-':>8}"
        top = "  ".join(f"{i}:{v:.2f}" for i, v in r.features)
        l0 = f"{r.l0:>5}" if r.l0 is not None else f"{'-':>5}"  # not finite: no count
        lines.append(f"{p:>4}  {json.dumps(text(t))[:16]:<16} {l0} {ve}  {top}")
    return "\n".join(lines)
