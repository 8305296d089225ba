"""Activation dumps: one safetensors file (or the same bytes in memory) that loads in one line."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.numpy import load_file as load_numpy
from safetensors.torch import load, load_file

from model.dump import dump_bytes, load_dump, save_dump
from model.generate import SamplingParams, generate
from model.gpt import GPT


@pytest.fixture(scope="module")
def activations(tiny_model: GPT) -> tuple[dict[str, torch.Tensor], list[int]]:
    [c] = generate(
        tiny_model,
        [[464, 2068, 7586]],
        SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True),
        hooks=["blocks.0.attn.hook_pattern", "blocks.*.hook_resid_post", "logits"],
    )
    assert c.activations is not None
    return c.activations, c.prompt_ids + c.token_ids


def test_save_and_load(activations: tuple[dict[str, torch.Tensor], list[int]], tmp_path: Path) -> None:
    tensors, token_ids = activations
    path = tmp_path / "dump.safetensors"
    meta = {"model": "tiny", "token_ids": token_ids, "text": "The quick brown…", "n": 3}
    save_dump(path, tensors, meta)
    loaded, metadata = load_dump(path)
    assert loaded.keys() == tensors.keys()
    assert all(torch.equal(loaded[k], tensors[k]) for k in tensors)
    assert metadata == {"model": "tiny", "token_ids": json.dumps(token_ids), "text": "The quick brown…", "n": "3"}
    assert json.loads(metadata["token_ids"]) == token_ids
    # and it is a plain safetensors file: one line in torch or numpy
    assert all(torch.equal(load_file(path)[k], tensors[k]) for k in tensors)
    arrays = load_numpy(path)
    assert arrays["logits"].shape == (1, 7, 50257) and (arrays["logits"] == tensors["logits"].numpy()).all()
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata()["model"] == "tiny"


def test_a_path_that_is_not_utf8(activations: tuple[dict[str, torch.Tensor], list[int]], tmp_path: Path) -> None:
    """A folder whose name's bytes are not UTF-8 (Linux allows any): the dump is written and loaded back
    (safetensors' own reader refuses such a path: "Path ... is not valid UTF-8")."""
    tensors, _ = activations
    folder = tmp_path / os.fsdecode(b"caf\xe9")
    folder.mkdir()
    save_dump(folder / "dump.safetensors", tensors, {"model": "tiny"})
    for path in (folder / "dump.safetensors", os.fsencode(folder / "dump.safetensors")):  # as text, and as bytes
        loaded, metadata = load_dump(path)
        assert loaded.keys() == tensors.keys() and all(torch.equal(loaded[k], tensors[k]) for k in tensors)
        assert metadata == {"model": "tiny"}


def test_bytes_are_the_file(activations: tuple[dict[str, torch.Tensor], list[int]], tmp_path: Path) -> None:
    tensors, token_ids = activations
    meta = {"token_ids": token_ids}
    data = dump_bytes(tensors, meta)
    path = tmp_path / "dump.safetensors"
    save_dump(path, tensors, meta)
    assert data == path.read_bytes()
    assert all(torch.equal(load(data)[k], tensors[k]) for k in tensors)


def test_the_file_is_written_from_the_tensors_own_memory(tmp_path: Path) -> None:
    """`dump_pieces` is the header, then each tensor's bytes as a view of its memory (a dump of hundreds of MB
    is not copied whole to be sent or written): every dtype a dump can hold, a scalar, an empty tensor, and
    metadata in any script, read back by safetensors in torch and numpy as it wrote them."""
    from safetensors.numpy import load as load_numpy_bytes

    from model.dump import dump_pieces

    tensors = {
        "f32": torch.randn(3, 5),
        "bf16": torch.randn(4, 2).to(torch.bfloat16),
        "f16": torch.randn(7).half(),
        "f64": torch.randn(2, 2, dtype=torch.float64),
        "i64": torch.arange(-3, 3),
        "i32": torch.arange(4, dtype=torch.int32),
        "i16": torch.arange(4, dtype=torch.int16),
        "i8": torch.arange(-2, 2, dtype=torch.int8),
        "u8": torch.arange(5, dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 3),
    }
    meta = {"text": "héllo ✓ 日本", "token_ids": [1, 2]}
    header, *raw = dump_pieces(tensors, meta)
    assert len(header) % 8 == 0  # the data starts 8-byte aligned, as safetensors writes it
    # laid out as safetensors lays them: the widest elements first, then by name, each at a multiple of its size
    entries = json.loads(header[8:])
    order = sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))
    assert [n for n in entries if n != "__metadata__"] == order
    assert all(entries[n]["data_offsets"][0] % tensors[n].element_size() == 0 for n in order)
    for view, name in zip(raw, order, strict=True):  # no copy: the tensor's own bytes
        t = tensors[name]
        assert len(view) == t.numel() * t.element_size()
        if t.numel():
            assert view.obj.ctypes.data == t.data_ptr()  # type: ignore[union-attr]
    blob = dump_bytes(tensors, meta)
    assert blob == b"".join([header, *(bytes(v) for v in raw)])
    got = load(blob)
    for name, t in tensors.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape and torch.equal(got[name], t), name
    arrays = load_numpy_bytes(dump_bytes({k: v for k, v in tensors.items() if k != "bf16"}, {}))
    assert (arrays["i64"] == tensors["i64"].numpy()).all() and arrays["scalar"].shape == ()
    path = tmp_path / "all.safetensors"
    save_dump(path, tensors, meta)
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"text": "héllo ✓ 日本", "token_ids": "[1, 2]"}
        assert torch.equal(f.get_tensor("bf16"), tensors["bf16"])
    # a path's bytes that are not UTF-8 (lone surrogates in Python) would make a header no reader parses
    odd = dump_bytes({"x": torch.ones(1)}, {"model": b"/ckpt/\xff".decode("utf-8", "surrogateescape")})
    with safe_open_bytes(odd) as f:
        assert f["model"] == "/ckpt/\ufffd"
    with pytest.raises(ValueError, match=r"a dump cannot hold torch\.complex64"):
        dump_pieces({"z": torch.zeros(2, dtype=torch.complex64)}, {})


def test_non_contiguous_and_low_precision_tensors(tmp_path: Path) -> None:
    tensors = {
        "transposed": torch.arange(12.0).view(3, 4).t(),
        "bf16": torch.randn(2, 3).to(torch.bfloat16),
        "f16": torch.randn(5).half(),
    }
    path = tmp_path / "d.safetensors"
    save_dump(path, tensors, {})
    loaded, metadata = load_dump(path)
    assert metadata == {}
    for name, t in tensors.items():
        assert loaded[name].dtype == t.dtype and torch.equal(loaded[name], t)


def test_save_dump_follows_symlinks_keeps_modes_and_refuses_devices(tmp_path: Path) -> None:
    """A dump is written to a temporary file and renamed over the path: `save_dump` writes through a symlink to
    its file, gives a new file the umask's mode and a replaced one its own, and refuses a pipe it would replace."""
    import os

    t = {"x": torch.ones(2)}
    real, link = tmp_path / "real.safetensors", tmp_path / "link.safetensors"
    link.symlink_to(real)
    old = os.umask(0o022)
    try:
        save_dump(link, t, {})
    finally:
        os.umask(old)
    assert link.is_symlink() and real.stat().st_mode & 0o777 == 0o644 and torch.equal(load_file(real)["x"], t["x"])
    real.chmod(0o640)
    save_dump(real, t, {})
    assert real.stat().st_mode & 0o777 == 0o640
    fifo = tmp_path / "pipe.safetensors"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="it is not a regular file"):
        save_dump(fifo, t, {})
    assert fifo.is_fifo()
    with pytest.raises(ValueError, match="a dump needs at least one tensor"):  # safetensors could not read it back
        save_dump(tmp_path / "empty.safetensors", {}, {})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.safetensors", "pipe.safetensors", "real.safetensors"]


@pytest.mark.parametrize("stop", [KeyboardInterrupt(), OSError(28, "No space left on device")], ids=["ctrl-c", "full"])
def test_a_dump_that_fails_midway_leaves_the_old_file_or_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stop: BaseException
) -> None:
    """Ctrl-C or a full disk while the file is written: the path keeps the file it held (or stays absent), and
    no temporary file is left beside it (safetensors before 0.8 wrote into the path itself)."""
    import model.dump

    def half_written(tensors: dict, metadata: dict) -> Iterator[bytes]:  # the file's pieces, cut off midway
        yield b"half a file"
        raise stop

    t = {"x": torch.ones(2)}
    old, new = tmp_path / "old.safetensors", tmp_path / "new.safetensors"
    save_dump(old, t, {"model": "m"})
    before = old.read_bytes()
    monkeypatch.setattr(model.dump, "dump_pieces", half_written)
    for path in (old, new):
        with pytest.raises(type(stop)):
            save_dump(path, {"x": torch.zeros(3)}, {})
    assert old.read_bytes() == before and not new.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.safetensors"]


@contextmanager
def safe_open_bytes(blob: bytes) -> Iterator[dict[str, str]]:
    """The metadata of a safetensors file in memory, read by safetensors itself."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "x.safetensors"
        path.write_bytes(blob)
        with safe_open(str(path), framework="pt") as f:
            yield dict(f.metadata())


def test_a_tensor_named_as_the_metadata_is_refused(tmp_path: Path) -> None:
    """ "__metadata__" is the header's own key: a tensor so named would make a file no reader parses (and
    replace a good one with it)."""
    path = tmp_path / "dump.safetensors"
    save_dump(path, {"x": torch.ones(2)}, {"model": "m"})
    with pytest.raises(ValueError, match="a tensor named __metadata__"):
        save_dump(path, {"__metadata__": torch.ones(2)}, {"model": "m"})
    assert torch.equal(load_dump(path)[0]["x"], torch.ones(2))  # the good file is still there
