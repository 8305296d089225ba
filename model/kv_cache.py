"""A preallocated key/value cache with one row per sequence (gpt-fast's static cache, with ragged lengths).

Keys and values of every layer live in two tensors of shape [n_layer, capacity, head, max_len, d_head],
so memory is fixed when the cache is made. The rows in use are always the first ones, each with its own
length: rows of different lengths decode together, each query seeing only its own row's keys. Sequences
join (`add_row`) and leave (`remove_row`, which moves the last row into the gap) between forward passes,
as continuous batching needs. A forward pass reads the rows' start positions with `begin`, each attention
layer writes its new keys and values with `update`, and the caller moves the lengths on with `advance`.
`PackedBatch` puts a decode step and prompt chunks of some rows into one forward pass.
"""

from __future__ import annotations

import torch

from .config import GPTConfig
from .hooks import Hooks


class KVCache:
    """The keys and values of every block [n_layer, batch, head, pos, d_head], a row per sequence, each row
    with its own length: a pass over a row's next tokens attends to its stored positions and adds its own."""

    def __init__(
        self,
        config: GPTConfig,
        batch_size: int,
        max_len: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        """A cache of `batch_size` rows, all in use and empty (see `empty` for one with no rows in use)."""
        if not 0 < max_len <= config.n_positions:
            raise ValueError(f"max_len must be in 1..{config.n_positions}, got {max_len}")
        shape = (config.n_layer, batch_size, config.n_head, max_len, config.d_head)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = [0] * batch_size  # tokens stored per row
        self._step: _Step | None = None

    @classmethod
    def empty(
        cls, config: GPTConfig, capacity: int, max_len: int, *, dtype: torch.dtype, device: torch.device | str
    ) -> KVCache:
        """Room for `capacity` sequences, none in use yet."""
        cache = cls(config, capacity, max_len, dtype=dtype, device=device)
        cache.lengths = []
        return cache

    @classmethod
    def _view(cls, k: torch.Tensor, v: torch.Tensor, lengths: list[int]) -> KVCache:
        view = cls.__new__(cls)
        view.k, view.v, view.lengths, view._step = k, v, lengths, None
        return view

    @property
    def batch_size(self) -> int:
        """Rows in use."""
        return len(self.lengths)

    @property
    def capacity(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def row(self, b: int) -> KVCache:
        """A one-row cache sharing this cache's memory (to prefill one sequence of a batch alone)."""
        return KVCache._view(self.k[:, b : b + 1], self.v[:, b : b + 1], [self.lengths[b]])

    def set_length(self, b: int, length: int) -> None:
        self.lengths[b] = length

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Row `dst` takes the keys and values of row `src`'s first `n` positions, and their length."""
        self.k[:, dst, :, :n] = self.k[:, src, :, :n]
        self.v[:, dst, :, :n] = self.v[:, src, :, :n]
        self.lengths[dst] = n

    def add_row(self) -> int:
        """Take a free row for a new sequence; returns its index."""
        if self.batch_size == self.capacity:
            raise RuntimeError(f"KV cache full: all {self.capacity} rows are in use")
        self.lengths.append(0)
        return self.batch_size - 1

    def remove_row(self, b: int, written: int, last_written: int) -> None:
        """Free row `b`, whose first `written` positions its sequence may have written. The last row (its
        first `last_written`) moves into its place, copying only its stored positions. Every position freed
        is zeroed: a later sequence's attention multiplies the positions of its row past its length before
        it masks them (a ragged batch's keys run to its longest row), and a masked key that is inf, left by
        a sequence whose edits overflowed, would still make that softmax NaN."""
        last = self.batch_size - 1
        if b == last:
            self._zero(b, 0, written)
        else:
            n = self.lengths[last]
            self.k[:, b, :, :n] = self.k[:, last, :, :n]
            self.v[:, b, :, :n] = self.v[:, last, :, :n]
            self._zero(b, n, written)
            self._zero(last, 0, last_written)
            self.lengths[b] = n
        self.lengths.pop()

    def _zero(self, b: int, start: int, end: int) -> None:
        end = min(end, self.max_len)
        if start < end:
            self.k[:, b, :, start:end] = 0
            self.v[:, b, :, start:end] = 0

    # --- one forward pass ---------------------------------------------------------------

    def begin(self, n_new: int) -> torch.Tensor:
        """Start a forward pass over `n_new` positions per row; return their position ids [batch, n_new]."""
        start = max(self.lengths)
        if start + n_new > self.max_len:
            raise ValueError(f"KV cache overflow: {start} + {n_new} positions exceed its {self.max_len}")
        device = self.k.device
        starts = torch.tensor(self.lengths, device=device)[:, None]  # [B, 1]
        positions = starts + torch.arange(n_new, device=device)  # [B, T]
        uniform = all(n == start for n in self.lengths)
        n_keys = start + n_new
        if uniform and (n_new == 1 or start == 0):
            allowed = None  # every query sees all earlier keys of its row: plain causal attention
        else:
            keys = torch.arange(n_keys, device=device)
            allowed = (keys[None, None, :] <= positions[:, :, None])[:, None]  # [B, 1, T, S]
        self._step = _Step(start if uniform else None, positions, n_keys, allowed)
        return positions

    def begin_static(self, positions: torch.Tensor) -> torch.Tensor:
        """Start a decode pass of fixed shape (what a CUDA graph replays): `positions` [B, 1] is a device
        tensor of where each of the first B rows writes its token, and every query attends over the whole
        `max_len` keys, masked. No Python-side bookkeeping: the caller tracks the lengths."""
        keys = torch.arange(self.max_len, device=positions.device)
        allowed = (keys[None, None, :] <= positions[:, :, None])[:, None]  # [B, 1, 1, max_len]
        self._step = _Step(None, positions, self.max_len, allowed)
        return positions

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Store this pass's keys and values ([B, T, H, D]) of `layer`.

        Returns every key and value of the rows so far ([B, H, S, D]) and the mask of which keys each
        query may see ([B, 1, T, S], True = visible), or None when plain causal attention is right.
        """
        step = self._step
        assert step is not None, "call begin() before update()"
        n = k.shape[0]  # the rows of this pass: the first n
        k_layer, v_layer = self.k[layer, :n], self.v[layer, :n]  # [B, H, max_len, D]
        if step.uniform_start is not None:
            s = step.uniform_start
            k_layer[:, :, s : s + k.shape[1]] = k.transpose(1, 2)
            v_layer[:, :, s : s + v.shape[1]] = v.transpose(1, 2)
        else:
            rows = torch.arange(k.shape[0], device=k.device)[:, None]  # [B, 1]
            k_layer[rows, :, step.positions] = k  # indexed view is [B, T, H, D]
            v_layer[rows, :, step.positions] = v
        return k_layer[:, :, : step.n_keys], v_layer[:, :, : step.n_keys], step.allowed

    def advance(self, n_new: int | list[int]) -> None:
        """Count the positions of the last pass as stored: `n_new` for every row, or one count per row."""
        counts = [n_new] * self.batch_size if isinstance(n_new, int) else n_new
        self.lengths = [n + c for n, c in zip(self.lengths, counts, strict=True)]
        self._step = None


class _Step:
    __slots__ = ("allowed", "n_keys", "positions", "uniform_start")

    def __init__(
        self, uniform_start: int | None, positions: torch.Tensor, n_keys: int, allowed: torch.Tensor | None
    ) -> None:
        self.uniform_start = uniform_start
        self.positions = positions
        self.n_keys = n_keys
        self.allowed = allowed


class PackedBatch:
    """Several pieces of work side by side in one forward pass over a [1, N] batch of tokens: a decode token
    for each of the cache's rows in use, then prompt chunks, each of one row. This is continuous batching
    with chunked prefill in one pass: the projections and the MLP see all N tokens as one matrix (the
    weights are read once for all), while attention runs piece by piece, each piece against its own rows'
    keys (`CausalSelfAttention`). Logits come out only at `outputs` (indices into the N tokens), or at
    those of them that `logit_rows` picks.

    A row whose prompt is still being prefilled also takes part in the decode piece (every row does), with
    a dummy token written at its length: its own chunk, if it has one in this pass, comes after and
    overwrites it; if not, it lies past the row's length, seen by no query, until the row's next chunk
    overwrites it. The caller moves the lengths on after the pass (`advance`, `set_length`).
    """

    def __init__(
        self,
        cache: KVCache,
        decode: bool,
        chunks: list[tuple[int, int]],
        outputs: list[int],
        piece_hooks: list[Hooks | None] | None = None,
        logit_rows: list[int] | None = None,
    ) -> None:
        """`decode`: begin with one token per row in use; `chunks`: (row, tokens) for each prompt chunk;
        `piece_hooks`: what each piece's attention scores and patterns are handed to (per piece, since
        each has its own shape), None for none; `logit_rows`: the `outputs` whose logits are wanted, where
        not all are (the others go through the final LayerNorm only, for its hooks: `GPT.unembed`)."""
        self.pieces: list[tuple[slice, int, KVCache]] = []  # (its tokens among the N, its rows, its cache)
        n = 0
        if decode:
            self.pieces.append((slice(0, cache.batch_size), cache.batch_size, cache))
            n = cache.batch_size
        for row, length in chunks:
            self.pieces.append((slice(n, n + length), 1, cache.row(row)))
            n += length
        self.n_tokens = n
        self.piece_hooks = piece_hooks if piece_hooks is not None else [None] * len(self.pieces)
        assert len(self.piece_hooks) == len(self.pieces), "one entry of piece_hooks per piece"
        self.outputs = torch.tensor(outputs, dtype=torch.long, device=cache.k.device)
        self.logit_rows = (
            None if logit_rows is None else torch.tensor(logit_rows, dtype=torch.long, device=cache.k.device)
        )

    def begin(self, n_new: int) -> torch.Tensor:
        """Start the pass over the `n_new` packed tokens; return their position ids [1, N]."""
        assert n_new == self.n_tokens, f"the batch packs {self.n_tokens} tokens, got {n_new}"
        return torch.cat([piece.begin((s.stop - s.start) // rows).view(1, -1) for s, rows, piece in self.pieces], dim=1)
