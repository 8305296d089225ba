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


@pytest.mark.parametrize("kwargs", [[1], "x", 3, True, []])
def test_model_kwargs_must_be_an_object(tmp_path: Path, kwargs: Any) -> None:
    path = edit_cfg(sae_dir(tmp_path), model_from_pretrained_kwargs=kwargs)
    with pytest.raises(SAEError, match=r"cfg\.json field model_from_pretrained_kwargs must be a JSON object, got"):
        load_sae(path)


def test_model_kwargs_under_metadata(tmp_path: Path) -> None:
    path = sae_dir(tmp_path)
    edit_cfg(path, metadata={"hook_name": HOOK, "model_from_pretrained_kwargs": ["center_writing_weights"]})
    with pytest.raises(SAEError, match=r"sae: cfg\.json field model_from_pretrained_kwargs must be a JSON object"):
        load_sae(path)
    # metadata's (even an empty one) takes precedence over the top level's, as every other field's does
    edit_cfg(path, metadata={"hook_name": HOOK, "model_from_pretrained_kwargs": {}})
    edit_cfg(path, model_from_pretrained_kwargs={"center_writing_weights": True})
    assert not load_sae(path).cfg.center_writing_weights
    edit_cfg(path, metadata={"hook_name": HOOK}, model_from_pretrained_kwargs={"center_writing_weights": True})
    assert load_sae(path).cfg.center_writing_weights


@pytest.mark.parametrize("value", ["true", 1, [True]])
def test_center_writing_weights_must_be_a_boolean(tmp_path: Path, value: Any) -> None:
    path = edit_cfg(sae_dir(tmp_path), model_from_pretrained_kwargs={"center_writing_weights": value})
    with pytest.raises(SAEError, match=r"cfg\.json field center_writing_weights must be true or false, got"):
        load_sae(path)


@pytest.mark.parametrize("k", [True, False, 0, -3, D_SAE + 1, "5", 5.0, [5]])
def test_topk_k_must_be_a_count(tmp_path: Path, k: Any) -> None:
    path = sae_dir(tmp_path, "topk", k=k)
    with pytest.raises(SAEError, match=rf"a topk SAE needs k in 1\.\.{D_SAE}, got"):
        load_sae(path)


def test_topk_k_from_activation_fn_kwargs(tmp_path: Path) -> None:
    path = sae_dir(tmp_path, activation_fn="topk", activation_fn_kwargs={"k": True})
    with pytest.raises(SAEError, match=r"a topk SAE needs k in 1\.\.48, got True"):
        load_sae(path)
    edit_cfg(path, activation_fn_kwargs={"k": D_SAE})
    assert load_sae(path).cfg.k == D_SAE
    edit_cfg(path, activation_fn_kwargs=[4])
    with pytest.raises(SAEError, match=r"cfg\.json field activation_fn_kwargs must be a JSON object, got \[4\]"):
        load_sae(path)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (b"[" * 100_000 + b"]" * 100_000, r"is not an SAE's cfg\.json: its JSON is nested too deeply$"),
        (b'{"d_in": ' + b"9" * 5000 + b"}", r"is not valid JSON: Exceeds the limit \(4300 digits\)"),
        (b'{"hook_name": "\xff"}', r"is not valid JSON: 'utf-8' codec can't decode byte 0xff"),
        (b"d_in = 16", r"is not valid JSON: Expecting value: line 1 column 1"),
    ],
    ids=["deep", "5000 digits", "not UTF-8", "not JSON"],
)
def test_unparseable_cfg_json(tmp_path: Path, text: bytes, expected: str) -> None:
    """cfg.json is read as every JSON file of a checkpoint is (model.json_file.read_json): UTF-8 whatever
    the locale, and each refusal one line naming the SAE and the file."""
    path = sae_dir(tmp_path)
    (path / "cfg.json").write_bytes(text)
    with pytest.raises(SAEError, match=expected) as e:
        load_sae(path)
    assert str(e.value).startswith(f"{path}: {path / 'cfg.json'} ") and "\n" not in str(e.value)


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


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"d_in": True}, "d_in and d_sae must be positive integers, got True and 48"),
        ({"d_sae": True}, "d_in and d_sae must be positive integers, got 16 and True"),
        ({"d_sae": -48}, "d_in and d_sae must be positive integers, got 16 and -48"),
        ({"d_sae": float("nan")}, "d_in and d_sae must be positive integers, got 16 and nan"),
        ({"d_sae": ..., "expansion_factor": True}, "field expansion_factor must be a positive integer, got True"),
        ({"d_sae": ..., "expansion_factor": -3}, "field expansion_factor must be a positive integer, got -3"),
        ({"d_sae": ..., "expansion_factor": "3"}, "field expansion_factor must be a positive integer, got '3'"),
        ({"apply_b_dec_to_input": "false"}, "field apply_b_dec_to_input must be true or false, got 'false'"),
        ({"apply_b_dec_to_input": 0}, "field apply_b_dec_to_input must be true or false, got 0"),
        (
            {"architecture": "topk", "k": 4, "rescale_acts_by_decoder_norm": "no"},
            "field rescale_acts_by_decoder_norm must be true or false, got 'no'",
        ),
        ({"metadata": [1], "hook_name": HOOK}, r"field metadata must be a JSON object, got \[1\]"),
        ({"metadata": {"hook_name": ["blocks.1.hook_resid_pre"]}}, r"field hook_name must be a string, got \["),
        ({"metadata": {"hook_name": HOOK, "model_name": 7}}, "field model_name must be a string, got 7"),
        ({"normalize_activations": 0}, "normalize_activations 0 is not supported"),
        ({"normalize_activations": []}, r"normalize_activations \[\] is not supported"),
        ({"architecture": ["x"] * 100}, r"architecture \['x', .*\.\.\. is not supported"),
    ],
)
def test_wrong_json_types(tmp_path: Path, fields: dict[str, Any], message: str) -> None:
    path = edit_cfg(sae_dir(tmp_path), **fields)
    with pytest.raises(SAEError, match=message) as e:
        load_sae(path)
    assert str(e.value).startswith(f"{path}: ")
    assert "\n" not in str(e.value) and len(str(e.value)) < 300


def test_what_still_loads(tmp_path: Path) -> None:
    """The layouts real releases use: null fields, the boolean normalisation, only the expansion factor."""
    path = edit_cfg(sae_dir(tmp_path), apply_b_dec_to_input=None, model_from_pretrained_kwargs=None, metadata=None)
    edit_cfg(path, hook_point=HOOK, normalize_activations=True, d_sae=..., expansion_factor=3)
    cfg = load_sae(path).cfg
    assert (cfg.d_sae, cfg.apply_b_dec_to_input, cfg.normalize_activations) == (48, False, "expected_average_only_in")
    assert cfg.model_name is None and not cfg.center_writing_weights


@pytest.mark.parametrize(
    "fields",
    [
        {"d_in": 2**63},
        {"d_sae": 2**63},
        # d_in times the factor has 8002 digits: Python refuses to print it (a ValueError escaped)
        {"d_in": 10**4000, "d_sae": ..., "expansion_factor": 10**4000},
    ],
    ids=["d_in", "d_sae", "from expansion_factor"],
)
def test_sizes_beyond_any_tensor(tmp_path: Path, fields: dict[str, Any]) -> None:
    path = edit_cfg(sae_dir(tmp_path, "topk", k=4), **fields)
    with pytest.raises(
        SAEError, match=r"d_in and d_sae must be below 2\*\*63 \(no tensor has a longer dimension\)"
    ) as e:
        load_sae(path)
    assert len(str(e.value)) < 400


def test_hostile_names_are_cut_short(tmp_path: Path) -> None:
    """A megabyte-long name in either file gives a message of one short line."""
    from model.config import GPTConfig
    from model.lab.sae import load_saes

    long = "x" * 1_000_000
    path = edit_weights(sae_dir(tmp_path), **{long: torch.zeros(1)})
    weights = load_file(str(path / "sae_weights.safetensors"))
    del weights["W_enc"]
    save_file(weights, str(path / "sae_weights.safetensors"))
    with pytest.raises(SAEError, match=r"has no tensor 'W_enc' \(it has \[.*\.\.\.\)$") as e:
        load_sae(path)
    assert len(str(e.value)) < 400
    path = edit_cfg(sae_dir(tmp_path / "b"), metadata={"hook_name": "blocks.1." + long})
    config = GPTConfig(n_layer=2, n_head=2, n_embd=D_IN, n_positions=8, vocab_size=16)
    with pytest.raises(SAEError, match=r"reads 'blocks\.1\.xxx.*\.\.\., which this model does not have$") as e:
        load_saes([f"s={path}"], config)
    assert len(str(e.value)) < 400


def test_a_file_named_as_the_sae_is_a_local_error(tmp_path: Path) -> None:
    """An SAE's cfg.json given for its folder is not looked for on the hub (which took 25 s offline and said
    the hub could not be reached): the path exists, so the error says what to give instead."""
    sae_dir = write_sae(tmp_path / "sae", hook="blocks.0.hook_resid_pre", d_in=8, d_sae=4)
    with pytest.raises(SAEError, match=r"cfg\.json' is a file: give the SAE's directory"):
        load_sae(sae_dir / "cfg.json")
