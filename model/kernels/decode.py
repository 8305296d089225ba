"""The CPU forward pass in one call: `FusedDecode` hands a model's weights and the KV cache to `decode.cpp`,
which runs the embedding, every block and the LM head for new tokens of rows of the KV cache: one per
decoding row (a decode step), prompt chunks, or both packed together (a continuous batch's step).

Why: at batch 1 on a small CPU, an eager step's ~250 ATen calls, views and Python (attention at one query,
the cache writes, LayerNorms, GELU, residual adds) cost as much as its matrix products; a long prompt runs
faster here too (1000 tokens of gpt2-small in 430 ms against GPT.forward's 665, 2-core Zen 5). This is the same
math (the parity tests hold it to the eager pass), for the passes that dominate generation and serving:
no hooks, float32 or int8 weights laid out for our kernels (`model/kernels/layers.py`, `model/quantize.py`),
at most `max_rows()` tokens (`FusedDecode.max_tokens`). Everything else (longer prompts, hooks and
edits, gradients, other dtypes and devices) goes through `GPT.forward`, as `DecodeBatch` chooses.
"""

from __future__ import annotations

import ctypes
from typing import cast

import torch

from ..gpt import GPT, Block, Conv1D, TiedLMHead
from ..kv_cache import KVCache
from . import _library, available, max_rows
from .layers import KernelConv1D, KernelLMHead


class _Linear(ctypes.Structure):
    _fields_ = [("w", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("bias", ctypes.c_void_p)]


class _Norm(ctypes.Structure):
    _fields_ = [("gain", ctypes.c_void_p), ("bias", ctypes.c_void_p)]


class _Block(ctypes.Structure):
    _fields_ = [
        ("ln_1", _Norm),
        ("c_attn", _Linear),
        ("attn_proj", _Linear),
        ("ln_2", _Norm),
        ("c_fc", _Linear),
        ("mlp_proj", _Linear),
    ]


class _Model(ctypes.Structure):
    _fields_ = [
        ("n_layer", ctypes.c_int64),
        ("n_embd", ctypes.c_int64),
        ("n_head", ctypes.c_int64),
        ("d_mlp", ctypes.c_int64),
        ("vocab", ctypes.c_int64),
        ("eps", ctypes.c_float),
        ("wte", ctypes.c_void_p),
        ("wpe", ctypes.c_void_p),
        ("blocks", ctypes.POINTER(_Block)),
        ("ln_f", _Norm),
        ("lm_head", _Linear),
    ]


class _Cache(ctypes.Structure):
    _fields_ = [
        ("k", ctypes.c_void_p),
        ("v", ctypes.c_void_p),
        ("capacity", ctypes.c_int64),
        ("max_len", ctypes.c_int64),
    ]


class _Pointers:
    """Addresses of tensors for decode.cpp, each tensor kept alive for as long as its address may be used."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []

    def __call__(self, t: torch.Tensor, dtype: torch.dtype = torch.float32) -> int:
        assert t.dtype == dtype and t.is_contiguous() and t.device.type == "cpu"
        self.tensors.append(t.detach())  # holds the storage itself, even if the parameter's .data is swapped
        return t.data_ptr()

    def linear(self, layer: Conv1D) -> _Linear:
        """A projection (a Conv1D, or the Int8Conv1D that replaced it) as decode.cpp reads it: [out, in] rows
        (float32, or int8 with a scale per output)."""
        from ..quantize import Int8Conv1D  # quantize imports this package

        if isinstance(layer, Int8Conv1D):
            return _Linear(self(layer.q, torch.int8), self(layer.scale), self(layer.bias))
        return _Linear(self(layer.weight.t()), None, self(layer.bias))  # W [in, out] laid out as [out, in] rows

    def norm(self, ln: torch.nn.LayerNorm) -> _Norm:
        return _Norm(self(ln.weight), self(ln.bias))


def unsupported(model: GPT, cache: KVCache) -> str | None:
    """Why `FusedDecode` cannot run this model's decode steps over this cache, or None if it can."""
    from ..quantize import Int8Conv1D, Int8LMHead

    if not available():
        return "our CPU kernels are not available"
    if not isinstance(model, GPT):
        return f"the model is a {type(model).__name__}, not model.gpt.GPT"
    if cache.k.device.type != "cpu" or cache.k.dtype != torch.float32:
        return "the KV cache is not float32 on the CPU"
    if not (cache.k.is_contiguous() and cache.v.is_contiguous()):
        return "the KV cache is a view (decode.cpp reads whole [layer, row, head, position, d_head] tensors)"
    w = model.wte.weight
    if w.device.type != "cpu" or w.dtype != torch.float32:
        return "the model is not float32 (or int8) on the CPU"
    if not (w.is_contiguous() and model.wpe.weight.is_contiguous()):  # the embeddings' rows, read in any model
        return "the embeddings are not laid out for our kernels"
    for name, module in model.named_modules():
        if isinstance(module, Conv1D) and not (
            isinstance(module, Int8Conv1D) or (type(module) is KernelConv1D and module.weight.t().is_contiguous())
        ):
            return f"{name} is not laid out for our kernels"
        if isinstance(module, TiedLMHead) and not (isinstance(module, Int8LMHead) or type(module) is KernelLMHead):
            return "the LM head is not laid out for our kernels"
    return None


class FusedDecode:
    """Passes of `model` over `cache` without hooks (float32 or int8 weights on the CPU), each in one C++ call:
    decode steps (`__call__`), and new tokens of any rows of the cache (`forward`)."""

    def __init__(self, model: GPT, cache: KVCache) -> None:
        self.model, self.cache = model, cache
        # the most tokens a pass takes: its products run on our kernels, which take up to max_rows() rows (a
        # longer prompt goes through GPT.forward, whose longer products go to torch's GEMM)
        self.max_tokens = max_rows()
        library = _library()
        assert library is not None, "make it with FusedDecode.make"
        self.library = library
        self._model, self._pointers, self._blocks = self._weights()

    @classmethod
    def make(cls, model: GPT, cache: KVCache) -> FusedDecode | None:
        """One for `model` and `cache`, or None where it cannot run (see `unsupported`)."""
        return cls(model, cache) if unsupported(model, cache) is None else None

    def _weights(self) -> tuple[_Model, _Pointers, ctypes.Array[_Block]]:
        """The model's weights as decode.cpp reads them: their addresses, taken once and kept alive (weights
        changed in place are seen; a parameter replaced by a new tensor afterwards is not: make a new
        FusedDecode, as each new DecodeBatch does)."""
        from ..quantize import Int8LMHead

        m, config, ptr = self.model, self.model.config, _Pointers()
        layers = cast(list[Block], list(m.h))
        blocks = (_Block * config.n_layer)(
            *(
                _Block(
                    ptr.norm(b.ln_1),
                    ptr.linear(b.attn.c_attn),
                    ptr.linear(b.attn.c_proj),
                    ptr.norm(b.ln_2),
                    ptr.linear(b.mlp.c_fc),
                    ptr.linear(b.mlp.c_proj),
                )
                for b in layers
            )
        )
        head, wte = m.lm_head, m.wte.weight
        lm_head = (
            _Linear(ptr(head.q, torch.int8), ptr(head.scale), None)
            if isinstance(head, Int8LMHead)
            else _Linear(ptr(wte), None, None)
        )
        weights = _Model(
            config.n_layer,
            config.n_embd,
            config.n_head,
            config.d_mlp,
            config.vocab_size,
            config.layer_norm_epsilon,
            ptr(wte),
            ptr(m.wpe.weight),
            ctypes.cast(blocks, ctypes.POINTER(_Block)),
            ptr.norm(m.ln_f),
            lm_head,
        )
        return weights, ptr, blocks

    def __call__(self, tokens: list[int], lengths: list[int]) -> torch.Tensor:
        """A decode step: logits [B, vocab] of one new token per row, `tokens[b]` at position `lengths[b]` of
        cache row b (its key and value are written there; the caller moves the lengths on)."""
        B = len(tokens)
        return self.forward(tokens, list(range(B)), list(lengths), list(range(B)))

    def forward(self, tokens: list[int], rows: list[int], positions: list[int], outputs: list[int]) -> torch.Tensor:
        """A pass over N new tokens: `tokens[t]` goes at position `positions[t]` of cache row `rows[t]` (each
        row's tokens in order, from its length on). Returns the logits [len(outputs), vocab] of the tokens at
        `outputs` (indices into the N)."""
        N, cache, config = len(tokens), self.cache, self.model.config
        if not N == len(rows) == len(positions) or N == 0:
            raise ValueError("tokens, rows and positions must be of one length, and not empty")
        if not all(0 <= r < cache.batch_size for r in rows) or not all(0 <= o < N for o in outputs):
            raise ValueError(
                f"a row outside the cache's {cache.batch_size} rows in use, or an output outside the tokens"
            )
        if len(set(outputs)) != len(outputs):
            raise ValueError("an output token named twice")
        if max(positions) >= cache.max_len or min(positions) < 0:
            raise ValueError(f"KV cache overflow: position {max(positions)} is past its {cache.max_len}")
        if not all(0 <= t < config.vocab_size for t in tokens):
            raise ValueError(f"a token id is outside the vocabulary (0..{config.vocab_size - 1})")
        kv = _Cache(cache.k.data_ptr(), cache.v.data_ptr(), cache.capacity, cache.max_len)
        ids, at, row, out = (torch.tensor(v, dtype=torch.int64) for v in (tokens, positions, rows, outputs))
        logits = torch.empty(len(outputs), config.vocab_size, dtype=torch.float32)
        self.library.gpt2_forward(
            ctypes.byref(self._model), ctypes.byref(kv), ids.data_ptr(), row.data_ptr(), at.data_ptr(), N,
            out.data_ptr(), len(outputs), logits.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        return logits
