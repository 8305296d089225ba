"""Measures of the residual stream layer by layer: norms, effective rank, rank collapse, token similarity,
attention entropy, and the logit lens; and the model's next-token distribution.

Motivation: Dong, Cordonnier & Loukas 2021, "Attention is not all you need: pure attention loses rank
doubly exponentially with depth": without skip connections, token representations collapse toward one
vector. Effective rank: Roy & Vetterli 2007. Logit lens: nostalgebraist 2020.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from .gpt import GPT
from .hooks import Hooks, run_until
from .interventions import HookChain, NonFiniteActivations
from .overflow import layer_norm_inputs, layer_norm_overflow, variance_overflows


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
    embeddings and after every block. Raises `NonFiniteActivations` at the first layer where the edits drove
    the stream to inf or NaN, too large for its measures (norms, the logit lens) to be finite, or too large
    for a LayerNorm's variance (`variance_overflows`). The work is the pass (`residual_streams`), then one
    `measure` a layer: the server runs each as an engine job of its own, so that decode steps go on between
    them. The memory taken beyond the pass's own is every layer's stream [T, C] and one layer's attention
    pattern, then one layer's logit lens."""
    streams = residual_streams(model, ids, edits)
    return [measure(model, stream, top_k, streams.edited) for stream in streams.take()]


@dataclass
class Stream:
    """One layer's residual stream as the pass left it, for `measure`."""

    layer: int  # -1: the stream entering block 0 (embeddings); L: after block L
    x: torch.Tensor  # [T, C], in the model's dtype
    attention_entropy: list[float] | None  # per head, of the block that made it; None for the embeddings


@dataclass
class Streams:
    """What one pass leaves to measure: its layers' streams in order and, if something ended the pass early
    (a LayerNorm that overflowed), that error. `take` raises it only after the streams before it: the first
    of them that cannot be measured is refused first, as the pass reached it first."""

    streams: deque[Stream]
    edited: bool  # whether the pass had edits (the errors say so)
    error: Exception | None = None

    def take(self) -> Iterator[Stream]:
        """The streams in order, each let go of here once given; then the error that ended the pass, if any."""
        while self.streams:
            yield self.streams.popleft()
        if self.error is not None:
            raise self.error


@torch.inference_mode()
def residual_streams(model: GPT, ids: list[int], edits: Hooks | None = None) -> Streams:
    """A forward pass over `ids` (with `edits` applied) that keeps what `measure` needs: the stream after the
    embeddings and after each block, and each block's attention entropy (its pattern [H, T, T] reduced as it
    comes: one is alive at a time). It ends after the last block (the LM head is not needed), or at the first
    LayerNorm whose variance overflows, or at any error, which the result keeps for `Streams.take`."""
    keep = _Keep(model.config.n_layer, edited=edits is not None)
    last = f"blocks.{model.config.n_layer - 1}.hook_resid_post"
    idx = torch.tensor([ids], device=model.wte.weight.device)
    try:
        run_until(model, idx, HookChain(edits, keep) if edits is not None else keep, last)
    except Exception as e:  # raised once the streams before it are measured, as the one pass did
        keep.streams.error = e
    return keep.streams


class _Keep:
    """Hooks that keep each layer's stream when the pass hands it over (with the attention entropy taken from
    the layer's pattern just before) and stop the pass at the first LayerNorm whose variance overflows."""

    def __init__(self, L: int, edited: bool) -> None:
        self._streams = {"blocks.0.hook_resid_pre": -1, **{f"blocks.{i}.hook_resid_post": i for i in range(L)}}
        self._patterns = {f"blocks.{i}.attn.hook_pattern" for i in range(L)}
        self._layer_norms = layer_norm_inputs(L)
        self._entropy: list[float] | None = None  # the current layer's, until its stream comes
        self.streams = Streams(deque(), edited)

    def active(self, name: str) -> bool:
        return name in self._streams or name in self._patterns  # the patterns need the explicit attention

    def __call__(self, name: str, x: torch.Tensor) -> torch.Tensor:
        if name in self._patterns:
            self._entropy = attention_entropy(x[0].float()).tolist()
        layer = self._streams.get(name)
        if layer is not None:  # a copy: no later hook can change what is measured
            self.streams.streams.append(Stream(layer, x[0].clone(), self._entropy))
            self._entropy = None
        ln = self._layer_norms.get(name)
        if ln is not None and bool(variance_overflows(x)):
            edited = self.streams.edited
            raise NonFiniteActivations(layer_norm_overflow(ln, x.dtype, edited) + ": nothing real to measure")
        return x


@torch.inference_mode()
def measure(model: GPT, stream: Stream, top_k: int, edited: bool) -> LayerStats:
    """One layer's measures (`edited`: whether its pass had edits). Raises `NonFiniteActivations` when they are
    not all finite."""
    x = stream.x.float()
    stats = LayerStats(
        stream.layer,
        residual_norms(x).tolist(),
        effective_rank(x),
        collapse(x),
        mean_cosine(x),
        stream.attention_entropy,
        logit_lens(model, x, top_k),
    )
    if not stats.finite():
        where = "after the embeddings" if stream.layer == -1 else f"at layer {stream.layer}"
        cause = "the edits made the activations" if edited else "the activations became"
        raise NonFiniteActivations(
            f"{cause} non-finite (inf or NaN, or too large to measure) {where}"
            + ("" if edited else ": the weights, or their dtype's range (float16's ends at 65504)")
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


@torch.no_grad()
def next_token_distribution(model: GPT, ids: list[int], top_k: int, hooks: Hooks | None = None) -> NextToken:
    """The top-k next tokens after `ids` and the entropy of the distribution (with `hooks`: edits applied)."""
    idx = torch.tensor([ids], device=model.wte.weight.device)
    logits = model(idx, hooks=hooks, last_only=True)[0, -1].float()  # [vocab]
    if not logits.isfinite().all():
        raise NonFiniteActivations("the edits made the logits non-finite (inf or NaN): no distribution to give")
    logprobs = torch.log_softmax(logits, dim=-1)
    entropy = -(logprobs.exp() * logprobs).nan_to_num().sum()  # 0 log 0 = 0
    top = torch.topk(logprobs, top_k)
    return NextToken(top.values.tolist(), top.indices.tolist(), float(entropy))
