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
from model.safetensors_file import SafetensorsFile

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


# --- 2. a malformed model.safetensors.index.json -------------------------------------------------


def sharded(tmp_path: Path) -> Path:
    """SMALL as two shards and their index."""
    ckpt = write_checkpoint(tmp_path / "ckpt")
    state = SafetensorsFile(ckpt / "model.safetensors")
    tensors = {k: state.read(k) for k in state.entries}
    (ckpt / "model.safetensors").unlink()
    names = sorted(tensors)
    weight_map = {k: f"model-0000{1 + i % 2}-of-00002.safetensors" for i, k in enumerate(names)}
    for shard in set(weight_map.values()):
        save_file({k: tensors[k] for k in names if weight_map[k] == shard}, ckpt / shard)
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return ckpt


def test_a_sharded_checkpoint_loads(tmp_path: Path) -> None:
    assert load_weights(sharded(tmp_path), **CPU).config == SMALL


@pytest.mark.parametrize(
    ("index", "expected"),
    [
        ({"weight_map": ["a"]}, r'it needs a non-empty "weight_map" object'),
        ({"weight_map": {}}, r'it needs a non-empty "weight_map" object'),
        ({"weight_map": "model.safetensors"}, r'it needs a non-empty "weight_map" object'),
        ([1], r'it needs a non-empty "weight_map" object'),
        ({"weight_map": {"wte.weight": 3}}, r"the shard of tensor 'wte\.weight' must be the name of a file in .*got 3"),
        ({"weight_map": {"wte.weight": "."}}, r"must be the name of a file in .*got '\.'"),
        ({"weight_map": {"wte.weight": ""}}, r"must be the name of a file in .*got ''"),
        ({"weight_map": {"wte.weight": "../../etc/passwd"}}, r"got '\.\./\.\./etc/passwd'"),
        ({"weight_map": {"wte.weight": "sub/model.safetensors"}}, r"got 'sub/model\.safetensors'"),
        ({"weight_map": {"wte.weight": None}}, r"got None"),
    ],
)  # fmt: skip
def test_a_malformed_index(index: object, expected: str, tmp_path: Path) -> None:
    ckpt = sharded(tmp_path)
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(
        LoadError, match=r"model\.safetensors\.index\.json is not a valid safetensors index: .*" + expected
    ):
        load_weights(ckpt, **CPU)


def test_an_index_nested_too_deeply(tmp_path: Path) -> None:
    ckpt = sharded(tmp_path)
    (ckpt / "model.safetensors.index.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(LoadError, match=r"index\.json is not a valid safetensors index: its JSON is nested too deeply"):
        load_weights(ckpt, **CPU)


def test_a_tensor_in_two_shards_names_both_files(tmp_path: Path) -> None:
    ckpt = sharded(tmp_path)
    first = SafetensorsFile(ckpt / "model-00001-of-00002.safetensors")
    key = next(iter(first.entries))
    second = SafetensorsFile(ckpt / "model-00002-of-00002.safetensors")
    tensors = {k: second.read(k) for k in second.entries} | {key: first.read(key)}
    save_file(tensors, ckpt / "model-00002-of-00002.safetensors")
    name = key.removeprefix("transformer.")
    with pytest.raises(
        LoadError,
        match=rf"tensor '{name}' appears twice \(as '{key}' in model-00001-of-00002\.safetensors and '{key}' in "
        r"model-00002-of-00002\.safetensors\)",
    ):
        load_weights(ckpt, **CPU)
