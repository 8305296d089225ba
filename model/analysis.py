"""Measures of the residual stream layer by layer: norms, effective rank, rank collapse, token similarity,
attention entropy, and the logit lens; and the model's next-token distribution.

Motivation: Dong, Cordonnier & Loukas 2021, "Attention is not all you need: pure attention loses rank
doubly exponentially with depth": without skip connections, token representations collapse toward one
vector. Effective rank: Roy & Vetterli 2007. Logit lens: nostalgebraist 2020.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from .config import GPTConfig
from .gpt import GPT, LAST
from .hooks import Hooks, check_edit_hooks, check_ids, head_parts
from .interventions import HookChain, NonFiniteActivations
from .json_file import is_int
from .overflow import dtype_range, layer_norm_inputs, layer_norm_overflow, variance_overflows


def residual_norms(x: torch.Tensor) -> torch.Tensor:
    """L2 norm of each token's vector; x [T, C] -> [T]."""
    return x.norm(dim=-1)


def effective_rank(x: torch.Tensor) -> float:
    """exp of the entropy of the normalised singular values of x [T, C]: n for an n x n identity, 1 for
    a rank-1 matrix; NaN when x holds inf or NaN (no SVD exists)."""
    if not x.isfinite().all():
        return math.nan
    s = torch.linalg.svdvals(x.double())
    if s.sum() == 0:
        return 0.0
    p = s / s.sum()
    p = p[p > 0]
    return float(torch.exp(-(p * p.log()).sum()))


def collapse(x: torch.Tensor) -> float:
    """||X - 1 x̄ᵀ|| / ||X|| (Frobenius): the distance from the nearest matrix with identical rows (the
    mean token repeated), relative to X. 0 when every token is the same vector."""
    x = x.double()
    norm = x.norm()
    if norm == 0:
        return 0.0
    return float((x - x.mean(dim=0, keepdim=True)).norm() / norm)


def mean_cosine(x: torch.Tensor) -> float:
    """Mean cosine similarity over distinct pairs of token vectors of x [T, C] (1.0 for one token)."""
    n = x.shape[0]
    if n < 2:
        return 1.0
    u = torch.nn.functional.normalize(x.double(), dim=-1)
    sim = u @ u.T
    return float((sim.sum() - sim.diagonal().sum()) / (n * (n - 1)))


def attention_entropy(pattern: torch.Tensor) -> torch.Tensor:
    """Mean over query positions of each head's attention entropy (nats); pattern [H, T, T] -> [H]."""
    p = pattern.double()
    return -(p * p.clamp_min(1e-300).log()).sum(dim=-1).mean(dim=-1)


@dataclass
class LayerStats:
    layer: int  # -1: the stream entering block 0 (embeddings); L: after block L
    norms: list[float]
    effective_rank: float
    collapse: float
    mean_cosine: float
    attention_entropy: list[float] | None  # per head; None for the embeddings
    logit_lens: list[list[tuple[int, float]]]  # per position: the top (token id, probability)

    def finite(self) -> bool:
        numbers = [*self.norms, self.effective_rank, self.collapse, self.mean_cosine, *(self.attention_entropy or [])]
        numbers += [p for top in self.logit_lens for _, p in top]
        return all(math.isfinite(v) for v in numbers)


def analyze(model: GPT, ids: list[int], top_k: int = 5, edits: Hooks | None = None) -> list[LayerStats]:
    """One forward pass over `ids` (with `edits`, e.g. residual ablation, applied), measured after the
    embeddings and after every block (`AnalysisPass`, run to its end here). Raises `NonFiniteActivations` at
    the first layer where the edits drove the stream to inf or NaN, too large for its measures (norms, the
    logit lens) to be finite, or too large for a LayerNorm's variance (`variance_overflows`). The memory taken
    beyond a block's own is at most three streams [T, C], one layer's attention pattern and the logits of 256
    positions."""
    run = AnalysisPass(model.config, ids, top_k, edits)
    while not run.done:
        run.step(model)
    return run.result()


def check_top_k(top_k: int, vocab_size: int) -> None:
    """A ValueError unless `top_k` is an int in 1..`vocab_size` (what torch.topk can give)."""
    if not is_int(top_k) or not 1 <= top_k <= vocab_size:
        raise ValueError(f"top_k must be an int in 1..{vocab_size} (the vocabulary), got {top_k!r}")


class AnalysisPass:
    """`analyze` a piece at a time, each `step` an engine job on the server, decode steps going on between
    them: a block of the pass (`ResidualPass.step`), or a part of measuring a stream it handed over
    (`LayerMeasure.step`). Each stream is measured before the next block runs, so at most the streams of one
    block wait. An error (a layer's measures not finite, or the pass's own) is raised by the step that finds
    it, or by `result` when the pass ended on it after the streams before it were measured."""

    def __init__(self, config: GPTConfig, ids: list[int], top_k: int, edits: Hooks | None = None) -> None:
        check_ids(ids, config.vocab_size)  # a clear error, not an indexing one from deep in the pass
        check_top_k(top_k, config.vocab_size)
        check_edit_hooks(edits)
        self.top_k = top_k
        self._run = ResidualPass(config, ids, edits)
        self._waiting: list[Stream] = []  # handed over by the last block, not measured yet
        self._layer: LayerMeasure | None = None  # being measured
        self._stats: list[LayerStats] = []

    @property
    def done(self) -> bool:
        return self._run.done and not self._waiting and self._layer is None

    def step(self, model: GPT) -> None:
        assert not self.done, "the analysis is over"
        if self._layer is None and not self._waiting:
            self._waiting = self._run.step(model)
            return
        if self._layer is None:
            self._layer = LayerMeasure(self._waiting.pop(0), self.top_k, self._run.edited)
        self._layer.step(model)
        if self._layer.done:
            self._stats.append(self._layer.result())  # raises when they are not finite
            self._layer = None

    def result(self) -> list[LayerStats]:
        """Every layer's measures, in order; raises the error that ended the pass, if one did."""
        assert self.done, "the analysis is not over"
        self._run.raise_error()
        return self._stats


@dataclass
class Stream:
    """One layer's residual stream as the pass left it, for `LayerMeasure`."""

    layer: int  # -1: the stream entering block 0 (embeddings); L: after block L
    x: torch.Tensor  # [T, C], in the model's dtype
    attention_entropy: list[float] | None  # per head, of the block that made it; None for the embeddings


class ResidualPass:
    """A forward pass over `ids` (with `edits` applied) a block at a time, keeping what `LayerMeasure` needs: the
    stream after the embeddings and after each block, and each block's attention entropy (its pattern
    [H, T, T] reduced as it comes: one is alive at a time). It ends after the last block (the LM head is not
    needed), or at the first LayerNorm whose variance overflows, or at any error, which it keeps
    (`raise_error`): the streams before it are measured first, as the pass reached them first."""

    def __init__(self, config: GPTConfig, ids: list[int], edits: Hooks | None = None) -> None:
        self.ids, self.edited = ids, edits is not None
        self.error: Exception | None = None
        self._keep = _Keep(config.n_layer, self.edited)
        self._hooks: Hooks = HookChain(edits, self._keep) if edits is not None else self._keep
        self._blocks: Iterator[torch.Tensor] | None = None  # `GPT.block_by_block`, from the first step on
        self._next, self._n_layer = 0, config.n_layer

    @property
    def done(self) -> bool:
        return self.error is not None or self._next == self._n_layer

    @torch.inference_mode()
    def step(self, model: GPT) -> list[Stream]:
        """Run the next block (the first after the embeddings) and hand over the streams it made, in order.
        An error ends the pass; it is kept, for `raise_error` once those streams are measured."""
        assert not self.done, "the pass is over"
        try:
            if self._blocks is None:
                self._blocks = model.block_by_block(
                    torch.tensor([self.ids], device=model.wte.weight.device), self._hooks
                )
            next(self._blocks)
            self._next += 1
        except Exception as e:  # raised once the streams before it are measured
            self.error = e
        if self.done:
            self._blocks = None  # and the stream it holds
        return self._keep.take()

    def raise_error(self) -> None:
        """Raise the error that ended the pass, if one did."""
        if self.error is not None:
            raise self.error


class _Keep:
    """Hooks that keep each layer's stream when the pass hands it over (with the attention entropy taken from
    the layer's pattern just before) and stop the pass at the first LayerNorm whose variance overflows."""

    def __init__(self, L: int, edited: bool) -> None:
        self._streams = {"blocks.0.hook_resid_pre": -1, **{f"blocks.{i}.hook_resid_post": i for i in range(L)}}
        self._patterns = {f"blocks.{i}.attn.hook_pattern" for i in range(L)}
        self._layer_norms = layer_norm_inputs(L)
        self._entropy: list[float] | None = None  # the current layer's, until its stream comes
        self._kept: list[Stream] = []
        self.edited = edited

    def take(self) -> list[Stream]:
        """The streams kept since the last call, in order (let go of here)."""
        kept, self._kept = self._kept, []
        return kept

    def active(self, name: str) -> bool:
        return name in self._streams or name in self._patterns  # the patterns need the explicit attention

    def __call__(self, name: str, x: torch.Tensor) -> torch.Tensor:
        if name in self._patterns:
            self._entropy = attention_entropy(x[0].float()).tolist()
        layer = self._streams.get(name)
        if layer is not None:  # a copy: no later hook can change what is measured
            self._kept.append(Stream(layer, x[0].clone(), self._entropy))
            self._entropy = None
        ln = self._layer_norms.get(name)
        if ln is not None and bool(variance_overflows(x)):
            raise NonFiniteActivations(layer_norm_overflow(ln, x.dtype, self.edited) + ": nothing real to measure")
        return x


class LayerMeasure:
    """One layer's measures in parts, each a `step`: the stream's own measures (norms, effective rank, collapse, mean
    cosine) with the logit lens of its first `lens_positions` positions, then the lens of each next ones
    (the lens is most of the work: 1,000 positions of gpt2-small's stream took 1.0 s on a 2-core CPU, its
    other measures 0.2 s). The server runs each part as an engine job of its own."""

    lens_positions = 256  # a part

    def __init__(self, stream: Stream, top_k: int, edited: bool) -> None:
        self.stream, self.top_k, self.edited = stream, top_k, edited
        self._x: torch.Tensor | None = None  # [T, C] in float32, from the first step on
        self._own: tuple[list[float], float, float, float] | None = None
        self._lens: list[list[tuple[int, float]]] = []

    @property
    def done(self) -> bool:
        return self._own is not None and len(self._lens) == self.stream.x.shape[0]

    @torch.inference_mode()
    def step(self, model: GPT) -> None:
        assert not self.done, "the layer is measured"
        if self._x is None:
            self._x = x = self.stream.x.float()
            self._own = (residual_norms(x).tolist(), effective_rank(x), collapse(x), mean_cosine(x))
        start = len(self._lens)
        self._lens += logit_lens(model, self._x[start : start + self.lens_positions], self.top_k)

    def result(self) -> LayerStats:
        """The layer's measures; raises `NonFiniteActivations` when they are not all finite."""
        assert self._own is not None and self.done, "the layer is not measured yet"
        layer = self.stream.layer
        stats = LayerStats(layer, *self._own, self.stream.attention_entropy, self._lens)
        if not stats.finite():
            where = "after the embeddings" if layer == -1 else f"at layer {layer}"
            cause = "the edits made the activations" if self.edited else "the activations became"
            raise NonFiniteActivations(
                f"{cause} non-finite (inf or NaN, or too large to measure) {where}"
                + ("" if self.edited else f": the weights, or {dtype_range(self.stream.x.dtype)}")
            )
        return stats


def logit_lens(model: GPT, x: torch.Tensor, top_k: int, chunk: int = 64) -> list[list[tuple[int, float]]]:
    """Decode a residual stream x [T, C] through the final LayerNorm and the unembedding: per position,
    the `top_k` most likely next tokens with their probabilities (the softmax `chunk` positions at a time:
    one [T, vocab] tensor alive, not two)."""
    w = model.wte.weight
    logits = model.ln_f(x.to(w.dtype)) @ w.T  # [T, vocab]
    out: list[list[tuple[int, float]]] = []
    for rows in logits.split(chunk):
        top = torch.topk(torch.softmax(rows.float(), dim=-1), top_k, dim=-1)  # each row on its own: exact
        out += [list(zip(i.tolist(), p.tolist(), strict=True)) for i, p in zip(top.indices, top.values, strict=True)]
    return out


@dataclass(frozen=True)
class NextToken:
    logprobs: list[float]  # of the top-k next tokens, most likely first
    ids: list[int]
    entropy: float  # of the whole next-token distribution, in nats


class NextTokenPass:
    """The top-k next tokens after `ids` and the entropy of the distribution (with `hooks`: edits applied), a
    piece at a time, each `step` an engine job on the server, decode steps going on between them: the
    embeddings with block 0, then each block, then the LM head at the last position (`head_parts`: in parts
    over every position where an edit uses its output there, as in `GPT.forward`)."""

    def __init__(self, config: GPTConfig, ids: list[int], top_k: int, hooks: Hooks | None = None) -> None:
        check_top_k(top_k, config.vocab_size)
        self.ids, self.top_k, self.hooks = ids, top_k, hooks
        self._blocks: Iterator[torch.Tensor] | None = None  # `GPT.block_by_block`, from the first step on
        self._x: torch.Tensor | None = None  # [1, T, C]: the stream leaving the last block run
        self._parts: list[range] | None = None  # the head's positions, a step each, once the blocks are run
        self._next: NextToken | None = None

    @property
    def done(self) -> bool:
        return self._next is not None

    @torch.no_grad()
    def step(self, model: GPT) -> None:
        assert not self.done, "the pass is over"
        if self._parts is None:
            if self._blocks is None:
                ids = torch.tensor([self.ids], device=model.wte.weight.device)  # [1, T]
                self._blocks = model.block_by_block(ids, self.hooks)
            x = next(self._blocks, None)
            if x is not None:
                self._x = x
                return
            self._parts = head_parts(len(self.ids), self.hooks)
        assert self._x is not None
        rows = self._parts.pop(0)
        logits = model.unembed(self._x[:, rows.start : rows.stop], self.hooks, LAST)
        if self._parts:
            return
        self._x, logits = None, logits[0, -1].float()  # [vocab]
        if not logits.isfinite().all():
            raise NonFiniteActivations("the edits made the logits non-finite (inf or NaN): no distribution to give")
        logprobs = torch.log_softmax(logits, dim=-1)
        entropy = -(logprobs.exp() * logprobs).nan_to_num().sum()  # 0 log 0 = 0
        top = torch.topk(logprobs, self.top_k)
        self._next = NextToken(top.values.tolist(), top.indices.tolist(), float(entropy))

    def result(self) -> NextToken:
        assert self._next is not None, "the pass is not over"
        return self._next
