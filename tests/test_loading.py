"""Loading official checkpoints: both layouts, every refusal with a message naming the tensor or file, the
hub path (offline, and with downloads served from a local directory), and export back to the format."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import Checkpoint, write_byte_tokenizer
from safetensors.torch import load, save_file

from model import kernels
from model.config import GPTConfig
from model.gpt import GPT
from model.loading import (
    LoadError,
    load_weights,
    official_shapes,
    official_state,
    resolve_device,
    resolve_dtype,
    save_checkpoint,
    warn_if_slow,
)
from model.loading import load as load_checkpoint
from model.tokenizer import _bytes_to_unicode

CPU = {"device": "cpu", "dtype": "float32"}
IDS = torch.tensor([[464, 2068, 7586, 21831, 18045, 625, 262, 16931]])


def copy_checkpoint(ck: Checkpoint, tmp_path: Path) -> Path:
    return Path(shutil.copytree(ck.path, tmp_path / "ckpt"))


def load_file(path: Path) -> dict[str, torch.Tensor]:
    """Tensors in memory (not a memory map, so the file can be rewritten while they live)."""
    return load(path.read_bytes())


def edit_weights(directory: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    path = directory / "model.safetensors"
    state = load_file(path)
    edit(state)
    save_file(state, path, metadata={"format": "pt"})


def edit_config(directory: Path, **changes: object) -> None:
    path = directory / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | changes))


def logits(model: GPT) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS)


# --- both layouts ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["tiny", "tiny_hub"])
def test_both_official_layouts_load(name: str, request: pytest.FixtureRequest) -> None:
    ck: Checkpoint = request.getfixturevalue(name)
    keys = load_file(ck.path / "model.safetensors").keys()
    if ck.layout == "hub":
        assert "h.0.attn.bias" in keys and not any(k.startswith("transformer.") for k in keys)
    else:
        assert all(k.startswith("transformer.") for k in keys if k != "lm_head.weight")
    model = load_weights(ck.path, **CPU)
    hf = ck.hf.transformer
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    assert set(model.state_dict()) == set(official_shapes(model.config))
    # the Conv1D weights keep the checkpoint's [in, out] and wte its [vocab, C]; in memory they lie as the
    # float32 kernels read them (_stored): [out, in] rows and wte as it is for ours, the transposes for MKL's
    assert torch.equal(model.h[1].attn.c_attn.weight, hf.h[1].attn.c_attn.weight)
    assert torch.equal(model.h[0].mlp.c_proj.weight, hf.h[0].mlp.c_proj.weight)
    assert torch.equal(model.h[0].attn.c_attn.bias, hf.h[0].attn.c_attn.bias)
    assert torch.equal(model.wpe.weight, hf.wpe.weight) and torch.equal(model.ln_f.bias, hf.ln_f.bias)
    assert torch.equal(model.wte.weight, hf.wte.weight)
    ours = kernels.available()
    assert (model.wte.weight if ours else model.wte.weight.T).is_contiguous()
    assert (model.h[1].attn.c_attn.weight.T if ours else model.h[1].attn.c_attn.weight).is_contiguous()
    with torch.no_grad():
        assert (logits(model) - ck.hf(IDS).logits).abs().max() <= 1e-4


def test_low_precision_weights_are_laid_out_for_their_kernels(tiny: Checkpoint) -> None:
    """In bfloat16 the projections are stored column-major (nn.Linear's [out, in] contiguous) and wte as it
    is, the layout oneDNN's bfloat16 kernels read fastest; shapes and values are the checkpoint's."""
    model = load_weights(tiny.path, device="cpu", dtype="bfloat16")
    hf = tiny.hf.transformer
    for w, ref in [
        (model.h[0].attn.c_attn.weight, hf.h[0].attn.c_attn.weight),
        (model.h[1].mlp.c_proj.weight, hf.h[1].mlp.c_proj.weight),
    ]:
        assert w.shape == ref.shape and w.T.is_contiguous() and torch.equal(w, ref.to(torch.bfloat16))
    assert model.wte.weight.is_contiguous() and torch.equal(model.wte.weight, hf.wte.weight.to(torch.bfloat16))


# --- refusals, each naming what is wrong -----------------------------------------------------


def test_missing_tensor(tiny: Checkpoint, tmp_path: Path) -> None:
    ckpt = copy_checkpoint(tiny, tmp_path)
    edit_weights(ckpt, lambda s: s.pop("transformer.h.1.mlp.c_fc.bias"))
    with pytest.raises(LoadError, match=r"checkpoint is missing tensor 'h\.1\.mlp\.c_fc\.bias'"):
        load_weights(ckpt, **CPU)


def test_many_missing_tensors_are_summarised(tiny_hub: Checkpoint, tmp_path: Path) -> None:
    ckpt = copy_checkpoint(tiny_hub, tmp_path)
    edit_weights(ckpt, lambda s: [s.pop(k) for k in list(s) if k.startswith("h.1.")])
    with pytest.raises(LoadError, match=r"missing tensor 'h\.1\.ln_1\.weight'.* and 7 more"):
        load_weights(ckpt, **CPU)


def test_unexpected_tensor(tiny: Checkpoint, tmp_path: Path) -> None:
    ckpt = copy_checkpoint(tiny, tmp_path)
    edit_weights(ckpt, lambda s: s.update({"transformer.h.0.attn.rotary.inv_freq": torch.zeros(8)}))
    with pytest.raises(
        LoadError, match=r"unexpected tensor 'transformer\.h\.0\.attn\.rotary\.inv_freq' in model\.safetensors"
    ):
        load_weights(ckpt, **CPU)


def test_tensor_present_twice(tiny: Checkpoint, tmp_path: Path) -> None:
    ckpt = copy_checkpoint(tiny, tmp_path)
    edit_weights(ckpt, lambda s: s.update({"wpe.weight": s["transformer.wpe.weight"].clone()}))
    with pytest.raises(LoadError, match=r"tensor 'wpe\.weight' appears twice"):
        load_weights(ckpt, **CPU)


def test_wrong_shape(tiny: Checkpoint, tmp_path: Path) -> None:
    """A c_attn weight transposed ([out, in], nn.Linear's layout) instead of the official Conv1D [in, out]."""
    ckpt = copy_checkpoint(tiny, tmp_path)
    key = "transformer.h.0.attn.c_attn.weight"
    edit_weights(ckpt, lambda s: s.update({key: s[key].t().contiguous()}))
    with pytest.raises(LoadError) as info:
        load_weights(ckpt, **CPU)
    message = str(info.value)
    assert repr(key) in message and "shape [192, 64], expected [64, 192]" in message
    assert "n_layer=2, n_head=4, n_embd=64" in message


def test_config_that_does_not_match_the_weights(tiny: Checkpoint, tmp_path: Path) -> None:
    ckpt = copy_checkpoint(tiny, tmp_path)
    edit_config(ckpt, n_positions=256)
    with pytest.raises(LoadError, match=r"'transformer\.wpe\.weight' has shape \[128, 64\], expected \[256, 64\]"):
        load_weights(ckpt, **CPU)


def test_integer_tensor(tiny: Checkpoint, tmp_path: Path) -> None:
    ckpt = copy_checkpoint(tiny, tmp_path)
    key = "transformer.ln_f.bias"
    edit_weights(ckpt, lambda s: s.update({key: s[key].to(torch.int32)}))
    with pytest.raises(LoadError, match=r"'transformer\.ln_f\.bias' has dtype torch\.int32, expected a floating"):
        load_weights(ckpt, **CPU)


def test_truncated_file(tiny: Checkpoint, tmp_path: Path) -> None:
    ckpt = copy_checkpoint(tiny, tmp_path)
    path = ckpt / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    with pytest.raises(LoadError) as info:
        load_weights(ckpt, **CPU)
    message = str(info.value)
    assert str(path) in message and "is truncated" in message and "tensor '" in message


def test_file_cut_inside_its_header(tiny: Checkpoint, tmp_path: Path) -> None:
    ckpt = copy_checkpoint(tiny, tmp_path)
    path = ckpt / "model.safetensors"
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(LoadError, match=r"is not a safetensors file \(or is truncated\): its header claims"):
        load_weights(ckpt, **CPU)


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b"\x00\x01", "only 2 bytes long"),
        (bytes(range(256)) * 64, "not a safetensors file"),
        ((20).to_bytes(8, "little") + b"this is not json!!!!", "its header is not JSON"),
        ((2).to_bytes(8, "little") + b"[]", "its header is not a JSON object"),
        (None, "not a safetensors file"),  # a pickle, as torch.save writes it
    ],
)
def test_not_a_safetensors_file(content: bytes | None, expected: str, tiny: Checkpoint, tmp_path: Path) -> None:
    ckpt = copy_checkpoint(tiny, tmp_path)
    path = ckpt / "model.safetensors"
    if content is None:
        torch.save(load_file(path), path)
    else:
        path.write_bytes(content)
    with pytest.raises(LoadError) as info:
        load_weights(ckpt, **CPU)
    assert expected in str(info.value) and str(path) in str(info.value)


def test_malformed_header_entry(tiny: Checkpoint, tmp_path: Path) -> None:
    header = json.dumps({"wte.weight": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 8]}}).encode()
    path = tmp_path / "w.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header + bytes(8))
    with pytest.raises(LoadError, match=r"tensor 'wte\.weight' of shape \[2, 2\] needs 16 bytes but its header gives"):
        load_weights(path, preset_name="gpt2", **CPU)


def test_a_file_that_is_not_safetensors_by_name(tiny: Checkpoint, tmp_path: Path) -> None:
    path = tmp_path / "pytorch_model.bin"
    torch.save(load_file(tiny.path / "model.safetensors"), path)
    with pytest.raises(LoadError, match=r"pytorch_model\.bin is not a \.safetensors file"):
        load_weights(path, **CPU)


def test_directory_with_only_a_pickle(tiny: Checkpoint, tmp_path: Path) -> None:
    ckpt = copy_checkpoint(tiny, tmp_path)
    torch.save(load_file(ckpt / "model.safetensors"), ckpt / "pytorch_model.bin")
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(LoadError, match=r"holds only pytorch_model\.bin \(a pickle.*safe_serialization=True"):
        load_weights(ckpt, **CPU)
    (ckpt / "pytorch_model.bin").unlink()
    with pytest.raises(LoadError, match=r"no model\.safetensors in"):
        load_weights(ckpt, **CPU)


def test_directory_without_config(tiny: Checkpoint, tmp_path: Path) -> None:
    ckpt = copy_checkpoint(tiny, tmp_path)
    (ckpt / "config.json").unlink()
    with pytest.raises(LoadError, match=rf"no config\.json in {ckpt}"):
        load_weights(ckpt, **CPU)


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("activation_function", "relu"),
        ("scale_attn_by_inverse_layer_idx", True),
        ("reorder_and_upcast_attn", True),
        ("add_cross_attention", True),
        ("scale_attn_weights", False),
        ("tie_word_embeddings", False),
        ("model_type", "gpt_neox"),
        ("n_inner", 100),
    ],
)
def test_unsupported_config_setting(setting: str, value: object, tiny: Checkpoint, tmp_path: Path) -> None:
    ckpt = copy_checkpoint(tiny, tmp_path)
    edit_config(ckpt, **{setting: value})
    with pytest.raises(LoadError) as info:
        load_weights(ckpt, **CPU)
    message = str(info.value)
    assert f"unsupported setting {setting}={value!r}" in message
    assert "config.json" in message


def test_config_that_is_not_json(tiny: Checkpoint, tmp_path: Path) -> None:
    ckpt = copy_checkpoint(tiny, tmp_path)
    (ckpt / "config.json").write_text("{n_layer: 2")
    with pytest.raises(LoadError, match=r"config\.json is not valid JSON"):
        load_weights(ckpt, **CPU)


def test_bare_file_needs_a_preset(distil: Checkpoint, tmp_path: Path) -> None:
    bare = tmp_path / "weights.safetensors"
    shutil.copy(distil.path / "model.safetensors", bare)
    with pytest.raises(LoadError) as info:
        load_weights(bare, **CPU)
    message = str(info.value)
    assert str(bare) in message and "bare weights file" in message and "preset" in message
    assert "distilgpt2" in message


def test_bare_file_with_a_preset_loads(distil: Checkpoint, tmp_path: Path) -> None:
    bare = tmp_path / "weights.safetensors"
    shutil.copy(distil.path / "model.safetensors", bare)
    model = load_weights(bare, preset_name="distilgpt2", **CPU)
    assert model.config == GPTConfig(n_layer=6, n_head=12, n_embd=768)
    assert torch.equal(logits(model), logits(load_weights(distil.path, **CPU)))
    with pytest.raises(LoadError, match=r"missing tensor 'h\.6\.ln_1\.weight'"):
        load_weights(bare, preset_name="gpt2", **CPU)  # 12 layers expected, the file has 6
    with pytest.raises(LoadError, match=r"unknown preset 'gpt3'"):
        load_weights(bare, preset_name="gpt3", **CPU)


def test_a_file_beside_its_config_needs_no_preset(tiny: Checkpoint) -> None:
    model = load_weights(tiny.path / "model.safetensors", **CPU)
    assert torch.equal(logits(model), logits(load_weights(tiny.path, **CPU)))


def test_untied_lm_head_is_refused(tiny: Checkpoint, tmp_path: Path) -> None:
    ckpt = copy_checkpoint(tiny, tmp_path)
    edit_weights(ckpt, lambda s: s.update({"lm_head.weight": s["transformer.wte.weight"] + 0.01}))
    with pytest.raises(LoadError, match=r"'lm_head\.weight' differs from wte\.weight: untied LM heads"):
        load_weights(ckpt, **CPU)


def test_a_head_tied_only_after_a_cast_or_given_twice_is_refused(tiny: Checkpoint, tmp_path: Path) -> None:
    """A head that equals wte only once both are cast to the dtype asked for (a float16 copy of float32
    wte, loaded as float16) is untied in the file: refused in every dtype; and a head in two shards (which
    may differ: the last read won) is refused as any tensor given twice is."""
    ckpt = copy_checkpoint(tiny, tmp_path)
    edit_weights(ckpt, lambda s: s.update({"lm_head.weight": s["transformer.wte.weight"].half()}))
    for dtype in ("float16", "float32"):
        with pytest.raises(LoadError, match=r"'lm_head\.weight' differs from wte\.weight: untied LM heads"):
            load_weights(ckpt, device="cpu", dtype=dtype)
    state = load_file(ckpt / "model.safetensors")
    wte = state["transformer.wte.weight"]
    save_file(
        {k: t for k, t in state.items() if k != "lm_head.weight"} | {"lm_head.weight": wte + 0.5},
        ckpt / "model-00001-of-00002.safetensors",
        metadata={"format": "pt"},
    )
    save_file({"lm_head.weight": wte.clone()}, ckpt / "model-00002-of-00002.safetensors", metadata={"format": "pt"})
    (ckpt / "model.safetensors").unlink()
    weight_map = dict.fromkeys(state, "model-00001-of-00002.safetensors") | {
        "lm_head.weight": "model-00002-of-00002.safetensors"
    }
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with pytest.raises(LoadError, match=r"tensor 'lm_head\.weight' appears twice \(in model-00001-of-00002"):
        load_weights(ckpt, **CPU)


def test_tied_lm_head_is_accepted(tiny: Checkpoint, tmp_path: Path) -> None:
    ckpt = copy_checkpoint(tiny, tmp_path)
    edit_weights(ckpt, lambda s: s.update({"lm_head.weight": s["transformer.wte.weight"].clone()}))
    assert torch.equal(logits(load_weights(ckpt, **CPU)), logits(load_weights(tiny.path, **CPU)))
    edit_weights(ckpt, lambda s: s.update({"lm_head.weight": s["lm_head.weight"][:10].clone()}))
    with pytest.raises(LoadError, match=r"'lm_head\.weight' has shape \[10, 64\], expected the shape of wte"):
        load_weights(ckpt, **CPU)


def test_sharded_checkpoint(tiny_hub: Checkpoint, tmp_path: Path) -> None:
    ckpt = copy_checkpoint(tiny_hub, tmp_path)
    state = load_file(ckpt / "model.safetensors")
    (ckpt / "model.safetensors").unlink()
    shards = {"model-00001-of-00002.safetensors": {}, "model-00002-of-00002.safetensors": {}}
    weight_map = {}
    for i, (key, t) in enumerate(sorted(state.items())):
        shard = list(shards)[i % 2]
        shards[shard][key] = t
        weight_map[key] = shard
    for shard, tensors in shards.items():
        save_file(tensors, ckpt / shard, metadata={"format": "pt"})
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert torch.equal(logits(load_weights(ckpt, **CPU)), logits(load_weights(tiny_hub.path, **CPU)))
    (ckpt / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(LoadError, match=r"names the shard model-00002-of-00002\.safetensors, which is missing"):
        load_weights(ckpt, **CPU)


def test_unknown_source(tmp_path: Path) -> None:
    for source in ["not-a-model", str(tmp_path / "missing"), "./missing/dir"]:
        with pytest.raises(LoadError, match=r"no checkpoint at .*neither an existing file or directory nor a hub"):
            load_weights(source, **CPU)


def test_unknown_dtype_and_device() -> None:
    with pytest.raises(LoadError, match=r"unknown dtype 'int4'; use auto, float32, float16, bfloat16 or int8"):
        resolve_dtype("int4", torch.device("cpu"))
    with pytest.raises(LoadError, match=r"unknown device 'gpu0'"):
        resolve_device("gpu0")
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("bf16", torch.device("cpu")) == torch.bfloat16
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16


@pytest.mark.parametrize(
    ("flags", "converted"),
    [
        ({"avx2", "avx512f"}, {"bfloat16": True, "float16": True}),
        ({"avx2", "avx512f", "avx512_bf16"}, {"bfloat16": False, "float16": True}),  # the Zen 5 hosts
        ({"avx2", "amx_bf16", "amx_fp16"}, {"bfloat16": False, "float16": False}),
    ],
)
def test_half_precision_on_a_cpu_warns_why_it_is_slow(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, flags: set[str], converted: dict[str, bool]
) -> None:
    """bfloat16 and float16 on a CPU run on oneDNN, not on our kernels, slower than float32 on every host
    measured: asking for either says so, whatever the CPU; where it lacks the instructions that multiply that
    format (float16's are not bfloat16's), also that each weight is converted. float32 and int8 say nothing."""
    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset(flags))
    cpu = torch.device("cpu")
    for name in ("bf16", "bfloat16", "fp16", "half", "float16", "float32", "int8", "auto"):
        caplog.clear()
        warn_if_slow(resolve_dtype(name, cpu), cpu)  # as `load` does, once
        warned = [r.getMessage() for r in caplog.records if "slower than float32" in r.getMessage()]
        half = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "half": "float16"}.get(name, name)
        if half not in converted:
            assert warned == [], name
            continue
        (message,) = warned
        assert message.startswith(f"{half} on this CPU will be slower than float32: it runs on oneDNN"), message
        assert ("each weight is converted" in message) == converted[half], message
    caplog.clear()
    warn_if_slow(torch.bfloat16, torch.device("cuda"))
    assert not caplog.records
    warn_if_slow(torch.float16, cpu)  # a torch dtype, as `load` takes it, too
    assert "float16 on this CPU will be slower than float32" in caplog.text


# --- tokenizer files ------------------------------------------------------------------------


def test_load_without_tokenizer_files(tiny: Checkpoint, tmp_path: Path) -> None:
    ckpt = copy_checkpoint(tiny, tmp_path)
    for name in ("tokenizer.json", "vocab.json", "merges.txt"):
        (ckpt / name).unlink(missing_ok=True)
    with pytest.raises(LoadError, match=r"ships no tokenizer .*give a tokenizer directory \(--tokenizer DIR\)"):
        load_checkpoint(ckpt, **CPU)
    with pytest.raises(LoadError, match=r"no tokenizer in .*expected tokenizer\.json, or vocab\.json and merges"):
        load_checkpoint(ckpt, tokenizer_dir=tmp_path / "nowhere", **CPU)


def test_load_with_tokenizer_files_in_the_checkpoint(tiny: Checkpoint, tmp_path: Path) -> None:
    ckpt = copy_checkpoint(tiny, tmp_path)
    write_byte_tokenizer(ckpt)
    loaded = load_checkpoint(ckpt, **CPU)
    assert loaded.tokenizer.encode("hi") == [sorted(_bytes_to_unicode().values()).index(c) for c in "hi"]
    assert loaded.tokenizer.eot_id == 256
    assert loaded.dtype == torch.float32 and loaded.device == torch.device("cpu") and loaded.name == str(ckpt)


# --- the hub ------------------------------------------------------------------------------


def test_hub_offline_with_an_empty_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """huggingface_hub reads these variables when imported, so the load runs in a fresh process."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_CACHE"):
        monkeypatch.delenv(name, raising=False)
    code = (
        "from model.loading import LoadError, load\n"
        "try:\n    load('gpt2', device='cpu')\nexcept LoadError as e:\n    print('LoadError:', e)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[1]
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert out.startswith("LoadError:")
    assert "Hugging Face hub" in out and "openai-community/gpt2" in out and "local checkpoint directory" in out


@pytest.fixture
def fake_hub(tiny: Checkpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, list[tuple]]:
    """hf_hub_download serving files from a local directory, and the list of what was asked for."""
    import huggingface_hub
    from huggingface_hub.errors import EntryNotFoundError

    served = tmp_path / "served"
    served.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny.path / name, served / name)
    calls: list[tuple] = []

    def hf_hub_download(repo_id: str, filename: str, *, revision: str | None = None, **kwargs: object) -> str:
        calls.append((repo_id, filename, revision))
        if not (served / filename).is_file():
            raise EntryNotFoundError(f"{filename} is not in {repo_id}")
        return str(served / filename)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hf_hub_download)
    return served, calls


def test_hub_download_with_tokenizer_json(fake_hub: tuple[Path, list[tuple]], tiny: Checkpoint) -> None:
    served, calls = fake_hub
    write_byte_tokenizer(served)
    from model.tokenizer import Tokenizer

    Tokenizer.from_dir(served).save(served)  # tokenizer.json
    (served / "vocab.json").unlink()
    (served / "merges.txt").unlink()
    loaded = load_checkpoint("gpt2", revision="e7da7f2", **CPU)
    repo = "openai-community/gpt2"
    assert calls == [
        (repo, "config.json", "e7da7f2"),
        (repo, "model.safetensors", "e7da7f2"),
        (repo, "tokenizer.json", "e7da7f2"),
    ]
    assert loaded.name == "gpt2" and loaded.revision == "e7da7f2"
    assert torch.equal(logits(loaded.model), logits(load_weights(tiny.path, **CPU)))
    assert loaded.tokenizer.eot_id == 256


def test_hub_download_with_vocab_and_merges(fake_hub: tuple[Path, list[tuple]]) -> None:
    served, calls = fake_hub
    write_byte_tokenizer(served)
    loaded = load_checkpoint("distilgpt2", **CPU)
    repo = "distilbert/distilgpt2"
    assert [c[1] for c in calls] == ["config.json", "model.safetensors", "tokenizer.json", "vocab.json", "merges.txt"]
    assert all(c[0] == repo and c[2] is None for c in calls)
    assert loaded.tokenizer.eot_id == 256
    calls.clear()
    load_checkpoint("someone/gpt2-finetune", revision="main", **CPU)  # any repo id goes to the hub as it is
    assert {c[0] for c in calls} == {"someone/gpt2-finetune"} and {c[2] for c in calls} == {"main"}


def test_hub_repository_without_weights(fake_hub: tuple[Path, list[tuple]]) -> None:
    served, _ = fake_hub
    (served / "model.safetensors").unlink()
    with pytest.raises(LoadError, match=r"repository 'openai-community/gpt2' lacks a file .*model\.safetensors"):
        load_weights("gpt2", **CPU)


@pytest.mark.parametrize("kind", ["directory", "file"])
def test_a_revision_of_a_local_checkpoint_is_refused(
    kind: str, fake_hub: tuple[Path, list[tuple]], tiny: Checkpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A local source has no revisions: the one asked for would be ignored, and other weights handed back
    than the user believes he has. Refused before anything is read or downloaded, by every entry point
    (`locate` too, which the harvest job calls itself)."""
    from model.loading import locate

    monkeypatch.chdir(tmp_path)
    write_byte_tokenizer(copy_checkpoint(tiny, tmp_path))
    source = "ckpt" if kind == "directory" else "ckpt/model.safetensors"
    expected = (
        rf"^revision 'v2' given for '{re.escape(source)}', which is a local {kind}: a revision applies only to a hub "
    )
    for call in (load_checkpoint, load_weights):
        with pytest.raises(LoadError, match=expected):
            call(source, revision="v2", **CPU)
    with pytest.raises(LoadError, match=expected):
        locate(source, revision="v2")
    assert fake_hub[1] == []  # nothing asked of the hub
    assert load_checkpoint(source, **CPU).revision is None  # without a revision it loads as before
    (tmp_path / "gpt2").mkdir()  # a directory that shadows a hub name is read as the directory: refused too
    with pytest.raises(LoadError, match=r"^revision 'v2' given for 'gpt2', which is a local directory"):
        load_weights("gpt2", revision="v2", **CPU)
    assert fake_hub[1] == []


def test_an_empty_revision_is_refused(fake_hub: tuple[Path, list[tuple]]) -> None:
    """An empty revision (GPT2_REVISION= in a compose file, say) names nothing: refused before the hub is asked."""
    for call in (load_checkpoint, load_weights):
        with pytest.raises(LoadError, match=r"^the revision is empty: name a branch, tag or commit"):
            call("gpt2", revision="", **CPU)
    assert fake_hub[1] == []


def test_an_empty_tokenizer_directory_is_refused(
    tiny: Checkpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Path("") is the current directory: a tokenizer there would be read instead of saying what was wrong."""
    monkeypatch.chdir(tmp_path)
    write_byte_tokenizer(tmp_path)  # a tokenizer in the current directory, which "" must not pick up
    with pytest.raises(LoadError, match=r"^the tokenizer directory is empty: give a directory, or leave it out$"):
        load_checkpoint(tiny.path, tokenizer_dir="", **CPU)


# --- export ---------------------------------------------------------------------------------


def test_export_round_trip(tiny_hub: Checkpoint, tmp_path: Path) -> None:
    model = load_weights(tiny_hub.path, **CPU)
    out = save_checkpoint(model, tmp_path / "export")
    again = load_weights(out, **CPU)
    assert again.config == model.config
    state, state_again = model.state_dict(), again.state_dict()
    assert state.keys() == state_again.keys()
    assert all(torch.equal(state[k], state_again[k]) for k in state)
    assert torch.equal(logits(again), logits(model))
    # the file holds the official names (hub layout) and the Conv1D layout
    saved = load_file(out / "model.safetensors")
    assert set(saved) == set(official_shapes(model.config))
    assert {k: tuple(t.shape) for k, t in saved.items()} == official_shapes(model.config)
    assert all(torch.equal(official_state(model)[k], saved[k]) for k in saved)


def test_export_loads_in_transformers(tiny: Checkpoint, tmp_path: Path) -> None:
    from transformers import GPT2LMHeadModel

    model = load_weights(tiny.path, **CPU)
    out = save_checkpoint(model, tmp_path / "export")
    hf = GPT2LMHeadModel.from_pretrained(out, attn_implementation="eager").eval()
    with torch.no_grad():
        assert (hf(IDS).logits - logits(model)).abs().max() <= 1e-4
        assert (hf(IDS).logits - tiny.hf(IDS).logits).abs().max() <= 1e-5
    assert hf.config.n_layer == 2 and hf.config.n_positions == 128


def test_export_in_half_precision_with_a_tokenizer(tiny: Checkpoint, tmp_path: Path) -> None:
    write_byte_tokenizer(tmp_path)
    from model.tokenizer import Tokenizer

    model = load_weights(tiny.path, dtype=torch.float16, device="cpu")
    out = save_checkpoint(model, tmp_path / "export", Tokenizer.from_dir(tmp_path))
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float16"
    assert all(t.dtype == torch.float16 for t in load_file(out / "model.safetensors").values())
    loaded = load_checkpoint(out, dtype="float16", device="cpu")
    assert torch.equal(logits(loaded.model), logits(model))
    assert loaded.tokenizer.encode("ab") == Tokenizer.from_dir(tmp_path).encode("ab")
    assert os.path.isfile(out / "tokenizer.json")


@pytest.mark.parametrize("value", ["x", None, [1e-5], True])
def test_layer_norm_epsilon_that_is_not_a_number(value: object, tiny: Checkpoint, tmp_path: Path) -> None:
    ckpt = copy_checkpoint(tiny, tmp_path)
    edit_config(ckpt, layer_norm_epsilon=value)
    with pytest.raises(
        LoadError, match=rf"config\.json: layer_norm_epsilon must be a number, got {re.escape(repr(value))}"
    ):
        load_weights(ckpt, **CPU)


def test_unreadable_config(tiny: Checkpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = copy_checkpoint(tiny, tmp_path)

    def denied(self: Path, *args: object, **kwargs: object) -> str:
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "read_text", denied)  # chmod would not stop root
    with pytest.raises(LoadError, match=r"cannot read .*config\.json: Permission denied$"):
        load_weights(ckpt, **CPU)


def test_a_model_for_prefill_only_keeps_stock_layers_and_the_row_major_layout(tiny: Checkpoint) -> None:
    """`decode_kernels=False` (what a harvest loads): no kernel layers, W [in, out] row-major for MKL's
    many-row products, and the same logits as the default load."""
    from model.gpt import Conv1D
    from model.loading import load_weights

    plain = load_weights(tiny.path, dtype="float32", device="cpu", decode_kernels=False)
    default = load_weights(tiny.path, dtype="float32", device="cpu")
    assert type(plain.h[0].attn.c_attn) is Conv1D
    assert plain.h[0].mlp.c_fc.weight.stride() == (plain.h[0].mlp.c_fc.weight.shape[1], 1)
    ids = torch.tensor([[464, 3797, 3332, 319, 262, 2603]])
    with torch.inference_mode():
        torch.testing.assert_close(plain(ids), default(ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
def test_a_weight_that_is_not_finite_is_refused(tiny: Checkpoint, tmp_path: Path, value: float) -> None:
    """One NaN in a query's weights gave NaN logits with a capture and plausible tokens without one (torch's
    fused CPU attention keeps a NaN query's output finite): a damaged checkpoint is refused at load, naming
    the tensor, in every dtype."""
    ckpt = copy_checkpoint(tiny, tmp_path)

    def damage(state: dict[str, torch.Tensor]) -> None:
        state["transformer.h.0.attn.c_attn.weight"][0, :3] = value

    edit_weights(ckpt, damage)
    for dtype in ("float32", "bfloat16", "float16", "int8"):
        with pytest.raises(LoadError, match=r"tensor 'transformer\.h\.0\.attn\.c_attn\.weight' holds 3 values NaN or"):
            load_weights(ckpt, dtype=dtype, device="cpu")


def test_a_weight_beyond_float16_s_range_is_refused_in_float16_only(tiny: Checkpoint, tmp_path: Path) -> None:
    ckpt = copy_checkpoint(tiny, tmp_path)
    edit_weights(ckpt, lambda s: s["transformer.h.1.mlp.c_fc.bias"].__setitem__(0, 1e5))
    with pytest.raises(LoadError, match=r"'transformer\.h\.1\.mlp\.c_fc\.bias' holds 1 values beyond float16's range"):
        load_weights(ckpt, dtype="float16", device="cpu")
    load_weights(ckpt, dtype="bfloat16", device="cpu")
    load_weights(ckpt, **CPU)


def test_an_empty_model_and_a_checkpoint_saved_onto_a_file_are_said(tiny: Checkpoint, tmp_path: Path) -> None:
    """`load("")` is not the current directory ("no config.json in ."), and a checkpoint saved to a path that
    is a file says so (it was a bare FileExistsError)."""
    with pytest.raises(LoadError, match="the model is empty: give a hub name"):
        load_checkpoint("")
    model = load_weights(tiny.path, device="cpu", dtype="float32")
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    with pytest.raises(LoadError, match="it is a file, not a directory"):
        save_checkpoint(model, a_file)
