"""GPTConfig from and to the official `config.json`: presets, defaults, refusals, round trips."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from model.config import PRESETS, ConfigError, GPTConfig, preset
from model.gpt import GPT


def official_config(cfg: GPTConfig) -> dict:
    """A config.json as the hub's GPT-2 repositories hold it (openai-community/gpt2's fields)."""
    return {
        "activation_function": "gelu_new",
        "architectures": ["GPT2LMHeadModel"],
        "attn_pdrop": 0.1,
        "bos_token_id": 50256,
        "embd_pdrop": 0.1,
        "eos_token_id": 50256,
        "initializer_range": 0.02,
        "layer_norm_epsilon": 1e-05,
        "model_type": "gpt2",
        "n_ctx": cfg.n_positions,
        "n_embd": cfg.n_embd,
        "n_head": cfg.n_head,
        "n_layer": cfg.n_layer,
        "n_positions": cfg.n_positions,
        "resid_pdrop": 0.1,
        "summary_activation": None,
        "summary_first_dropout": 0.1,
        "summary_proj_to_labels": True,
        "summary_type": "cls_index",
        "summary_use_proj": True,
        "task_specific_params": {"text-generation": {"do_sample": True, "max_length": 50}},
        "vocab_size": 50257,
    }


@pytest.mark.parametrize("name", list(PRESETS))
def test_official_config_files_give_the_presets(name: str) -> None:
    assert GPTConfig.from_hf_dict(official_config(PRESETS[name])) == PRESETS[name] == preset(name)


def test_preset_shapes() -> None:
    assert (PRESETS["gpt2"].n_layer, PRESETS["gpt2"].n_head, PRESETS["gpt2"].n_embd) == (12, 12, 768)
    assert (PRESETS["distilgpt2"].n_layer, PRESETS["distilgpt2"].n_embd) == (6, 768)
    assert (PRESETS["gpt2-xl"].n_layer, PRESETS["gpt2-xl"].n_head, PRESETS["gpt2-xl"].n_embd) == (48, 25, 1600)
    assert all(c.n_positions == 1024 and c.vocab_size == 50257 for c in PRESETS.values())
    assert PRESETS["gpt2"].d_head == 64 and PRESETS["gpt2"].d_mlp == 3072
    assert PRESETS["gpt2"].n_params() == 124_439_808  # what transformers reports for openai-community/gpt2
    with pytest.raises(ConfigError, match=r"unknown preset 'gpt4'; choose one of gpt2, gpt2-medium"):
        preset("gpt4")


def test_n_params_counts_the_model(tiny_model: GPT) -> None:
    assert sum(p.numel() for p in tiny_model.parameters()) == tiny_model.config.n_params()


@pytest.mark.parametrize(
    "cfg", [*PRESETS.values(), GPTConfig(n_layer=2, n_head=4, n_embd=64, n_positions=128, layer_norm_epsilon=1e-6)]
)
def test_to_hf_dict_round_trip(cfg: GPTConfig) -> None:
    d = cfg.to_hf_dict()
    assert GPTConfig.from_hf_dict(json.loads(json.dumps(d))) == cfg
    assert d["n_ctx"] == d["n_positions"] == cfg.n_positions and d["activation_function"] == "gelu_new"


def test_transformers_reads_our_config_and_we_read_its() -> None:
    from transformers import GPT2Config

    cfg = GPTConfig(n_layer=3, n_head=2, n_embd=32, n_positions=64, vocab_size=1000, layer_norm_epsilon=1e-6)
    theirs = GPT2Config(**cfg.to_hf_dict())
    assert (theirs.n_layer, theirs.n_head, theirs.n_embd, theirs.n_positions) == (3, 2, 32, 64)
    assert (theirs.vocab_size, theirs.layer_norm_epsilon, theirs.tie_word_embeddings) == (1000, 1e-6, True)
    assert GPTConfig.from_hf_dict(theirs.to_dict()) == cfg  # n_inner None, dropout and task fields ignored


def test_transformers_aliases_read_as_transformers_reads_them() -> None:
    """A config.json may name GPT-2's fields by transformers' aliases (num_hidden_layers, hidden_size, ...):
    they are read as transformers reads them, alone or agreeing with the n_* field; disagreeing, refused
    (transformers builds the alias's model: the n_* one was built, logits apart, before)."""
    from transformers import GPT2Config

    aliases = {"num_hidden_layers": 3, "num_attention_heads": 2, "hidden_size": 32, "max_position_embeddings": 64}
    theirs = GPT2Config.from_dict(aliases)
    want = GPTConfig(n_layer=3, n_head=2, n_embd=32, n_positions=64)
    assert (theirs.n_layer, theirs.n_head, theirs.n_embd, theirs.n_positions) == (3, 2, 32, 64)
    assert GPTConfig.from_hf_dict(aliases) == want
    assert GPTConfig.from_hf_dict(aliases | {"n_layer": 3, "n_embd": 32}) == want
    assert GPT2Config.from_dict(aliases | {"n_layer": 2}).n_layer == 3  # the alias wins in transformers
    with pytest.raises(ConfigError, match=r"^n_layer=2 and its alias num_hidden_layers=3 disagree"):
        GPTConfig.from_hf_dict(aliases | {"n_layer": 2})


def test_defaults_of_optional_fields() -> None:
    base = {"n_layer": 2, "n_head": 2, "n_embd": 8}
    assert GPTConfig.from_hf_dict(base) == GPTConfig(n_layer=2, n_head=2, n_embd=8, n_positions=1024, vocab_size=50257)
    assert GPTConfig.from_hf_dict(base | {"n_ctx": 256}).n_positions == 256  # older configs name it n_ctx
    assert GPTConfig.from_hf_dict(base | {"n_ctx": 256, "n_positions": 512}).n_positions == 512
    assert GPTConfig.from_hf_dict(base | {"layer_norm_epsilon": 1e-6}).layer_norm_epsilon == 1e-6
    # settings that are accepted because they mean what we implement
    for ok in ({"activation_function": "gelu_pytorch_tanh"}, {"n_inner": 32}, {"n_inner": None}):
        GPTConfig.from_hf_dict(base | ok)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"activation_function": "relu"}, "unsupported setting activation_function='relu': this GPT-2 implements "
         "only 'gelu_new' or 'gelu_pytorch_tanh'"),
        ({"scale_attn_by_inverse_layer_idx": True}, "unsupported setting scale_attn_by_inverse_layer_idx=True"),
        ({"reorder_and_upcast_attn": True}, "unsupported setting reorder_and_upcast_attn=True"),
        ({"add_cross_attention": True}, "unsupported setting add_cross_attention=True"),
        ({"scale_attn_weights": False}, "unsupported setting scale_attn_weights=False"),
        ({"tie_word_embeddings": False}, "unsupported setting tie_word_embeddings=False"),
        ({"model_type": "llama"}, "unsupported setting model_type='llama'"),
        ({"n_inner": 100}, "unsupported setting n_inner=100: the MLP width must be 4 * n_embd"),
        ({"n_head": 5}, "n_embd (8) must be divisible by n_head (5)"),
        ({"n_layer": 0}, "n_layer must be a positive integer, got 0"),
        ({"n_embd": 8.0}, "n_embd must be a positive integer, got 8.0"),
        ({"n_positions": True}, "n_positions must be a positive integer, got True"),
        ({"vocab_size": -1}, "vocab_size must be a positive integer, got -1"),
        ({"layer_norm_epsilon": 0}, "layer_norm_epsilon must be positive, got 0.0"),
    ],
)  # fmt: skip
def test_refusals(change: dict, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        GPTConfig.from_hf_dict({"n_layer": 2, "n_head": 2, "n_embd": 8} | change)
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("change", "start"),
    [
        ({"model_type": "x" * 1_000_000}, "unsupported setting model_type='xxx"),
        ({"n_inner": [[1] * 1_000_000]}, "unsupported setting n_inner=[[1, 1"),
        ({"n_layer": "x" * 1_000_000}, "n_layer must be a positive integer, got 'xxx"),
        ({"layer_norm_epsilon": ["x" * 1_000_000]}, "layer_norm_epsilon must be a number, got ['xxx"),
        ({"n_embd": 8 * 10**4000}, "n_embd must be at most 2147483647, got 8000"),  # was printed whole
        ({"vocab_size": 2**31}, "vocab_size must be at most 2147483647, got 2147483648"),
    ],
    ids=["model_type", "n_inner", "n_layer", "layer_norm_epsilon", "huge n_embd", "vocab_size 2**31"],
)
def test_a_hostile_value_is_cut_short(change: dict, start: str) -> None:
    """A config.json value of a megabyte is shown by its first hundred characters (model.json_file.clip)."""
    with pytest.raises(ConfigError) as info:
        GPTConfig.from_hf_dict({"n_layer": 2, "n_head": 2, "n_embd": 8} | change)
    assert str(info.value).startswith(start) and len(str(info.value)) < 300


@pytest.mark.parametrize("field", ["n_layer", "n_head", "n_embd"])
def test_required_fields(field: str) -> None:
    d = {"n_layer": 2, "n_head": 2, "n_embd": 8}
    del d[field]
    with pytest.raises(ConfigError, match=f"config.json lacks the required field '{field}'"):
        GPTConfig.from_hf_dict(d)


def test_from_json_file(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    with pytest.raises(ConfigError, match=f"no config.json found at {path}"):
        GPTConfig.from_json_file(path)
    path.write_text(json.dumps(official_config(PRESETS["gpt2-medium"])))
    assert GPTConfig.from_json_file(path) == PRESETS["gpt2-medium"]
    path.write_text("{not json")
    with pytest.raises(ConfigError, match=f"{path} is not valid JSON"):
        GPTConfig.from_json_file(path)
    path.write_text("[1, 2]")
    with pytest.raises(ConfigError, match=f"{path} must hold a JSON object, got list"):
        GPTConfig.from_json_file(path)
    path.write_text(json.dumps(official_config(PRESETS["gpt2"]) | {"activation_function": "relu"}))
    with pytest.raises(ConfigError, match=f"{path}: unsupported setting activation_function='relu'"):
        GPTConfig.from_json_file(path)


def test_config_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        PRESETS["gpt2"].n_layer = 3  # type: ignore[misc]
