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
from typing import TYPE_CHECKING

import torch
from gpt2_scripts.json_flag import read_json_flag

from model.hooks import run_with_cache
from model.interventions import EditSpec, InterventionError
from model.lab.sae import SAE, token_features
from model.lab.steering import Directions
from model.loading import LoadedModel

if TYPE_CHECKING:
    from server.schemas import InterventionSpec


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

    saes = load_saes(args.sae, loaded.model.config, loaded.device)
    no_store = 'the command line stores no vectors: give the direction as numbers or {"sae": ID, "feature": N}'
    return Directions(saes, load_hint="give one with --sae ID=PATH", store_hint=no_store)


def steering_specs(texts: list[str]) -> list[InterventionSpec]:
    """The `--steer` edits, read as the HTTP API reads a request's `interventions` entries (`read_json_flag`;
    `InterventionError` says what is wrong). Before the model loads."""
    from server.schemas import InterventionSpec

    validate = InterventionSpec.model_validate
    return [read_json_flag(f"--steer {i + 1}", text, validate, InterventionError) for i, text in enumerate(texts)]


def steering_edits(specs: list[InterventionSpec], found: Directions, n_layer: int) -> EditSpec | None:
    """The `--steer` edits with their directions resolved (`InterventionError` says what is wrong)."""
    from server.schemas import edit_spec

    return edit_spec(specs, None, n_layer, found, where=lambda i: f"--steer {i + 1}") if specs else None


def features_table(sae_id: str, sae: SAE, loaded: LoadedModel, ids: list[int], top_k: int) -> str:
    """Per token, the SAE's top features and how well it reconstructs the value there."""
    with torch.inference_mode():
        x = run_with_cache(loaded.model, torch.tensor([ids], device=loaded.device), [sae.cfg.hook_name])
    rows = token_features(sae, x[sae.cfg.hook_name][0], top_k, None)
    name = loaded.tokenizer.token_name  # a piece of a character by its bytes, not as U+FFFD
    lines = [f"SAE {sae_id} at {sae.cfg.hook_name} ({sae.cfg.architecture}, {sae.cfg.d_sae} features)", ""]
    lines.append(f"{'pos':>4}  {'token':<16} {'L0':>5} {'var.expl':>8}  top features (id:value)")
    for p, (t, r) in enumerate(zip(ids, rows, strict=True)):
        ve = f"{r.variance_explained:8.3f}" if r.variance_explained is not None else f"{'-':>8}"
        top = "  ".join(f"{i}:{v:.2f}" for i, v in r.features)
        l0 = f"{r.l0:>5}" if r.l0 is not None else f"{'-':>5}"  # not finite: no count
        lines.append(f"{p:>4}  {json.dumps(name(t))[:16]:<16} {l0} {ve}  {top}")
    return "\n".join(lines)
