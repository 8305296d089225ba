"""Weights in 2 MB pages (model/huge_pages.py): the move keeps every tensor as it was (values, layout,
sharing, identity), a loaded CPU model's weights are there and compute the same bits, the mapping goes
with the model, and where there are no 2 MB pages nothing moves."""

from __future__ import annotations

import gc
import io
import pickle
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import Checkpoint
from torch import nn

from model import huge_pages
from model.generate import SamplingParams, generate
from model.kernels.decode import FusedDecode
from model.kv_cache import KVCache
from model.loading import load_weights
from model.quantize import quantize_

needs_huge_pages = pytest.mark.skipif(
    not huge_pages.available(), reason=f"no transparent huge pages here (mode: {huge_pages.mode()})"
)


def mapping_of(address: int) -> tuple[range, list[str]] | None:
    """The address range of this process's mapping that holds `address`, and its VmFlags (/proc/self/smaps)."""
    found: range | None = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            found = range(start, end) if start <= address < end else None
        elif found is not None and line.startswith("VmFlags:"):
            return found, line.split()[1:]
    return None


class Shared(nn.Module):
    """Parameters and buffers of every kind the move must keep: a transposed view (column-major, as the
    kernels lay projections out), two parameters on one storage, an offset view, an int8 buffer."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = nn.Parameter(torch.randn(512, 1024, generator=g).t(), requires_grad=False)  # [1024, 512]
        base = torch.randn(3, 300_000, generator=g)
        self.a = nn.Parameter(base[0], requires_grad=False)
        self.b = nn.Parameter(base[1:], requires_grad=True)  # the same storage as a, 300_000 floats on
        self.register_buffer("q", torch.randint(-127, 128, (700, 900), dtype=torch.int8, generator=g))
        self.register_buffer("small", torch.arange(5.0))


@needs_huge_pages
def test_the_move_keeps_every_tensor_as_it_was() -> None:
    m = Shared()
    before = {n: (t.clone(), t.shape, t.stride(), t.dtype) for n, t in m.state_dict().items()}
    objects = {n: id(p) for n, p in m.named_parameters()}
    old_addresses = {t.data_ptr() for t in m.state_dict().values()}
    assert huge_pages.move_into(m)
    for name, t in m.state_dict().items():
        values, shape, stride, dtype = before[name]
        assert torch.equal(t, values) and (t.shape, t.stride(), t.dtype) == (shape, stride, dtype), name
        assert t.data_ptr() not in old_addresses, name
    assert {n: id(p) for n, p in m.named_parameters()} == objects  # the same Parameter objects
    assert m.b.requires_grad and not m.a.requires_grad
    # a and b still share one storage, b still 300_000 floats after a's start
    assert m.a.untyped_storage().data_ptr() == m.b.untyped_storage().data_ptr()
    assert m.b.data_ptr() - m.a.data_ptr() == 300_000 * 4
    m.a[0] = 7.0  # and writes go through to the one copy
    assert m.state_dict()["a"][0] == 7.0
    # all of them in one mapping that is advised for huge pages and starts on a 2 MB boundary
    where = mapping_of(m.w.data_ptr())
    assert where is not None and "hg" in where[1]
    span, _ = where
    assert all(t.data_ptr() in span for t in m.state_dict().values())
    assert m.w.data_ptr() % huge_pages.page_size() == 0  # w went first, at the start of the region
    # each old storage a storage of its own still: pickle and torch.save see a's and b's, not the mapping
    assert m.w.untyped_storage().nbytes() == 1024 * 512 * 4 and m.q.untyped_storage().nbytes() == 700 * 900
    assert len(pickle.dumps(m.small)) < 10_000
    torch.save(m.state_dict(), io.BytesIO())  # float32 and int8 tensors, no storage of two dtypes
    with pytest.raises(RuntimeError):
        m.small.resize_(10)  # cannot grow into its neighbour's bytes


@needs_huge_pages
def test_the_mapping_goes_with_the_model() -> None:
    m = Shared()
    assert huge_pages.move_into(m)
    address = m.w.data_ptr()
    assert mapping_of(address) is not None
    del m
    gc.collect()
    found = mapping_of(address)
    assert found is None or "hg" not in found[1]  # unmapped (the range may hold something else since)


@needs_huge_pages
def test_a_second_move_and_what_cannot_move_stay_where_they_are() -> None:
    m = Shared()
    m.register_buffer("phase", torch.randn(600_000, dtype=torch.complex64).conj())  # a lazy conjugate
    phase = m.phase.resolve_conj().clone()
    with torch.inference_mode():
        m.register_buffer("made_in_inference", torch.ones(600_000))
    assert huge_pages.move_into(m)
    assert m.phase.is_conj() and torch.equal(m.phase.resolve_conj(), phase)  # left alone, same values
    assert m.made_in_inference.is_inference() and not m.w.is_inference()
    addresses = {n: t.data_ptr() for n, t in m.state_dict().items()}
    assert not huge_pages.move_into(m)  # all in huge pages of ours already
    assert {n: t.data_ptr() for n, t in m.state_dict().items()} == addresses


@needs_huge_pages
def test_each_old_storage_is_freed_as_it_moves() -> None:
    arrays = [np.random.default_rng(i).standard_normal(300_000).astype(np.float32) for i in range(3)]
    alive = [weakref.ref(a) for a in arrays]
    m = nn.Module()
    for i, a in enumerate(arrays):
        m.register_parameter(f"p{i}", nn.Parameter(torch.from_numpy(a), requires_grad=False))
    values = [a.copy() for a in arrays]
    del arrays, a
    assert huge_pages.move_into(m)
    gc.collect()
    assert [r() for r in alive] == [None, None, None]  # nothing holds the old memory
    assert all(np.array_equal(getattr(m, f"p{i}").numpy(), v) for i, v in enumerate(values))


def test_a_fused_step_keeps_the_weights_it_was_made_with(tiny: Checkpoint) -> None:
    """FusedDecode holds the storages whose addresses it took: a parameter's memory swapped afterwards (as
    a move would) neither frees them under it nor changes what it reads."""
    model = load_weights(tiny.path, dtype="int8", device="cpu")
    with torch.inference_mode():
        cache = KVCache(model.config, 1, 16, dtype=torch.float32, device="cpu")
        fused = FusedDecode.make(model, cache)
        assert fused is not None
        before = fused([5], [0])
    for t in (*model.parameters(), *model.buffers()):
        t.data = t.data.clone()
    gc.collect()
    with torch.inference_mode():
        assert torch.equal(fused([5], [0]), before)


def test_loading_keeps_ordinary_pages_when_the_move_fails(
    tiny: Checkpoint, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(huge_pages, "available", lambda: True)

    def no_memory(nbytes: int) -> None:
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(huge_pages, "_mapping", no_memory)
    with caplog.at_level("WARNING"):
        model = load_weights(tiny.path, dtype="float32", device="cpu")
    assert "ordinary pages" in caplog.text and "Cannot allocate memory" in caplog.text
    idx = torch.tensor([[1, 2, 3]])
    with torch.inference_mode():
        assert torch.allclose(model(idx), tiny.hf(idx).logits, atol=1e-4)


def test_nothing_moves_without_huge_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(huge_pages, "available", lambda: False)
    m = Shared()
    addresses = {n: t.data_ptr() for n, t in m.state_dict().items()}
    assert not huge_pages.move_into(m)
    assert {n: t.data_ptr() for n, t in m.state_dict().items()} == addresses


def test_nothing_moves_for_less_than_a_page() -> None:
    m = nn.Linear(16, 16)
    address = m.weight.data_ptr()
    assert not huge_pages.move_into(m)
    assert m.weight.data_ptr() == address


@pytest.mark.parametrize(
    ("text", "mode"),
    [
        ("always [madvise] never\n", "madvise"),
        ("[always] madvise never\n", "always"),
        ("always madvise [never]", "never"),
    ],
)
def test_the_mode_is_read_from_the_kernel(
    text: str, mode: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "enabled").write_text(text)
    monkeypatch.setattr(huge_pages, "THP_MODE", tmp_path / "enabled")
    huge_pages.mode.cache_clear()
    try:
        assert huge_pages.mode() == mode
        assert huge_pages.available() == (mode != "never" and hasattr(huge_pages.mmap, "MADV_HUGEPAGE"))
        monkeypatch.setattr(huge_pages, "THP_MODE", tmp_path / "missing")
        huge_pages.mode.cache_clear()
        assert huge_pages.mode() is None and not huge_pages.available()
    finally:
        huge_pages.mode.cache_clear()


@needs_huge_pages
def test_quantizing_a_loaded_model_lets_its_float32_weights_go(tiny: Checkpoint) -> None:
    """`quantize_` on a float32 model `load` moved into huge pages: the int8 model lies in a mapping of its own,
    as `load(dtype="int8")` leaves it, and the float32 one goes (wte and the LayerNorms, still in it, would
    otherwise hold every float32 projection there as long as they live)."""
    if not huge_pages.available():
        pytest.skip("no transparent huge pages on this host")
    model = load_weights(tiny.path, dtype="float32", device="cpu")
    old = mapping_of(model.wte.weight.data_ptr())
    assert old is not None and "hg" in old[1]
    quantize_(model)
    gc.collect()
    tensors = [*model.parameters(), *model.buffers()]
    new = mapping_of(tensors[0].data_ptr())
    assert new is not None and "hg" in new[1] and all(t.data_ptr() in new[0] for t in tensors)
    assert not huge_pages._ours(old[0].start)  # the old mapping is gone


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_a_loaded_model_is_in_huge_pages_and_computes_the_same(
    tiny: Checkpoint, dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    moved = load_weights(tiny.path, dtype=dtype, device="cpu")
    tensors = [*moved.parameters(), *moved.buffers()]
    where = mapping_of(tensors[0].data_ptr())
    assert where is not None and "hg" in where[1]
    assert all(t.data_ptr() in where[0] for t in tensors)
    with monkeypatch.context() as m:
        m.setattr(huge_pages, "move_into", lambda module, again=False: False)
        stayed = load_weights(tiny.path, dtype=dtype, device="cpu")
    plain = mapping_of(stayed.wte.weight.data_ptr())
    assert plain is not None and "hg" not in plain[1]
    for (name, a), (_, b) in zip(moved.state_dict().items(), stayed.state_dict().items(), strict=True):
        assert torch.equal(a, b) and a.stride() == b.stride(), name
    idx = torch.randint(0, moved.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        assert torch.equal(moved(idx), stayed(idx))
        logits = []
        for model in (moved, stayed):  # the fused decode step reads the moved weights through their addresses
            cache = KVCache(model.config, 2, 16, dtype=torch.float32, device="cpu")
            fused = FusedDecode.make(model, cache)
            assert fused is not None
            logits.append(fused([5, 7], [0, 0]))
        assert torch.equal(logits[0], logits[1])
    greedy = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    assert [c.token_ids for c in generate(moved, prompts, greedy)] == [
        c.token_ids for c in generate(stayed, prompts, greedy)
    ]
