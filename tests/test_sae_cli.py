"""gpt2-generate --steer and gpt2-analyze --sae: the HTTP API's semantics on the command line (in process,
on the tiny checkpoint with the real tokenizer and a random SAE in SAELens' format)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import Checkpoint
from gpt2_scripts import analyze, generate
from sae_files import write_sae

from model.generate import SamplingParams
from model.generate import generate as generate_tokens
from model.gpt import GPT
from model.hooks import run_with_cache
from model.interventions import Edit, EditSpec
from model.lab.sae import load_sae, token_features
from model.tokenizer import Tokenizer

HOOK = "blocks.1.hook_resid_pre"
PROMPT = "The cat sat on the"


@pytest.fixture(scope="module")
def sae_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_sae(tmp_path_factory.mktemp("sae"), hook=HOOK, d_in=64, d_sae=256, seed=4)


def checkpoint_args(tiny: Checkpoint, tokenizer_dir: Path) -> list[str]:
    return ["--model", str(tiny.path), "--tokenizer", str(tokenizer_dir), "--device", "cpu"]


def test_generate_with_steering_equals_the_model_level_run(
    tiny: Checkpoint, tokenizer_dir: Path, tiny_model: GPT, tokenizer: Tokenizer, sae_dir: Path, capsys
) -> None:
    steer = {"hook": HOOK, "op": "steer", "scale": 6.0, "direction": {"sae": "s", "feature": 17}}
    args = [PROMPT, *checkpoint_args(tiny, tokenizer_dir), "--greedy", "--max-new-tokens", "8", "--ignore-eos"]
    assert generate.main([*args, "--sae", f"s={sae_dir}", "--steer", json.dumps(steer)]) == 0
    steered = capsys.readouterr().out
    assert generate.main(args) == 0
    plain = capsys.readouterr().out
    spec = EditSpec((Edit(HOOK, "steer", 6.0, direction=load_sae(sae_dir).direction(17)),))
    params = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    (want,) = generate_tokens(tiny_model, [tokenizer.encode(PROMPT)], params, tokenizer, edits=spec)
    assert steered == PROMPT + want.text + "\n" and steered != plain


@pytest.mark.parametrize(
    ("steer", "says"),
    [
        (
            {"hook": HOOK, "op": "steer", "scale": 1.0, "direction": {"sae": "nope", "feature": 0}},
            "--steer 1.direction: unknown SAE 'nope'",
        ),
        (
            {"hook": HOOK, "op": "steer", "scale": 1e308, "direction": [1.0] * 64},
            "--steer 1 ('blocks.1.hook_resid_pre'): scale 1e+308 is not a finite float32 number",
        ),
        ({"hook": HOOK, "op": "steer", "scale": 1.0, "direction": [1.0, 2.0]}, "direction of shape [2] does not fit"),
        ({"hook": HOOK, "op": "steer", "direction": [1.0] * 64}, "scale must be a finite number"),
        ({"hook": HOOK, "op": "tilt"}, "--steer 1"),
        ({"hook": HOOK, "op": "steer", "direction": [1.0] * 64}, "--steer 1.scale"),  # named as the flag, not
        ({"hook": HOOK, "op": "scale", "factor": 2, "scale": 3}, "--steer 1.scale does not apply"),  # the API's field
        (
            {"hook": HOOK, "op": "steer", "scale": 1.0, "direction": {"vector": "v"}},
            "stored: none (the command line stores no vectors: give the direction as numbers or",
        ),
    ],
)
def test_bad_steering_is_one_line(tiny: Checkpoint, tokenizer_dir: Path, sae_dir: Path, capsys, steer, says) -> None:
    args = [PROMPT, *checkpoint_args(tiny, tokenizer_dir), "--sae", f"s={sae_dir}", "--steer", json.dumps(steer)]
    assert generate.main(args) == 1
    err = capsys.readouterr().err
    assert err.startswith("gpt2-generate: error: ") and says in err and err.count("\n") == 1, err
    assert "interventions[" not in err and "POST" not in err and "start the server" not in err


def test_an_edit_the_model_refuses_is_named_by_its_flag(tiny: Checkpoint, tokenizer_dir: Path, capsys) -> None:
    """The second --steer's direction does not fit the hook: found as the edits meet the model, and named
    `--steer 2` as the schema's errors are, not by the model's own 0-based count."""
    good = {"hook": HOOK, "op": "steer", "scale": 1.0, "direction": [1.0] * 64}
    bad = {"hook": HOOK, "op": "steer", "scale": 1.0, "direction": [1.0, 2.0]}
    args = [PROMPT, *checkpoint_args(tiny, tokenizer_dir), "--steer", json.dumps(good), "--steer", json.dumps(bad)]
    assert generate.main(args) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"gpt2-generate: error: --steer 2 ({HOOK!r}): direction of shape [2]"), err


def test_steering_with_no_sae_says_to_give_one(tiny: Checkpoint, tokenizer_dir: Path, capsys) -> None:
    steer = {"hook": HOOK, "op": "steer", "scale": 1.0, "direction": {"sae": "s", "feature": 0}}
    assert generate.main([PROMPT, *checkpoint_args(tiny, tokenizer_dir), "--steer", json.dumps(steer)]) == 1
    assert "unknown SAE 's'; loaded SAEs: none (give one with --sae ID=PATH)\n" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ('{"hook": "h", "op": "steer", "op": "scale", "factor": 2}', "names the key 'op' more than once"),
        ('{"hook": "h", "op": "scale", "factor": 2', "not valid JSON: Expecting ',' delimiter"),
        ('{"hook": "h", "op": "scale", "factor": 1' + "0" * 5000 + "}", "not valid JSON: Exceeds the limit"),
        ("[" * 100_000 + "]" * 100_000, "not valid JSON"),
        ("[1]", "must be an object ({...}), got a list"),
        (json.dumps({"hook": "x" * 5000, "op": "scale", "factor": 2}), "a hook name or glob of 5000 characters"),
        ('{"hook": "h", "op": "tilt"}', "op: Input should be 'zero', 'mean', "),  # the server's words, whole
        ('{"hook": "h", "op": "tilt"}', "'projection_cap' or 'clamp'"),
        ('{"hook": "h", "op": "steer", "scale": 1, "direction": {"sae": "s"}}', "): direction.feature: Field required"),
        ('{"hook": "h", "op": "scale", "factor": 2, "a\\nb": 1}', "): a\\nb: Extra inputs are not permitted"),
    ],
)
def test_a_steer_that_is_not_an_edit_is_refused_before_the_model_loads(tmp_path: Path, capsys, text, says) -> None:
    """As the server reads a request: each key once, a clear line (clipped: a value can be megabytes long)."""
    assert generate.main([PROMPT, "--model", str(tmp_path / "no-model"), "--steer", text]) == 1
    err = capsys.readouterr().err
    assert err.startswith("gpt2-generate: error: --steer 1 (") and says in err, err
    assert err.count("\n") == 1 and len(err) < 1000, err


def test_an_sae_path_that_is_not_one(tiny: Checkpoint, tokenizer_dir: Path, tmp_path: Path, capsys) -> None:
    assert generate.main([PROMPT, *checkpoint_args(tiny, tokenizer_dir), "--sae", f"s={tmp_path}"]) == 1
    assert "no cfg.json" in capsys.readouterr().err


def test_analyze_prints_each_tokens_features(
    tiny: Checkpoint, tokenizer_dir: Path, tiny_model: GPT, tokenizer: Tokenizer, sae_dir: Path, capsys
) -> None:
    args = [PROMPT, *checkpoint_args(tiny, tokenizer_dir), "--no-ablated", "--top-k", "3", "--sae", f"s={sae_dir}"]
    assert analyze.main(args) == 0
    out = capsys.readouterr().out
    table = out[out.index("SAE s at blocks.1.hook_resid_pre") :].splitlines()
    ids = tokenizer.encode(PROMPT)
    x = run_with_cache(tiny_model, torch.tensor([ids]), [HOOK])[HOOK][0]
    rows = token_features(load_sae(sae_dir), x, 3, None)
    body = table[3:]
    assert len(body) == len(ids)
    for line, row in zip(body, rows, strict=True):
        assert line.split()[-len(row.features) :] == [f"{i}:{v:.2f}" for i, v in row.features]
