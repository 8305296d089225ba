"""Measures of the residual stream layer by layer: norms, effective rank, rank collapse, token similarity,
attention entropy, and the logit lens; and the model's next-token distribution.

Motivation: Dong, Cordonnier & Loukas 2021, "Attention is not all you need: pure attention loses rank
doubly exponentially with depth": without skip connections, token representations collapse toward one
vector. Effective rank: Roy & Vetterli 2007. Logit lens: nostalgebraist 2020.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .gpt import GPT
from .hooks import Capture, Hooks
from .interventions import HookChain, NonFiniteActivations


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
    embeddings and after every block. Raises `NonFiniteActivations` when the edits drove a layer's
    stream to inf or NaN, or too large for its measures (norms, the logit lens) to be finite."""
    L = model.config.n_layer
    names = ["blocks.0.hook_resid_pre"]
    names += [f"blocks.{i}.{site}" for i in range(L) for site in ("attn.hook_pattern", "hook_resid_post")]
    capture = Capture(names)
    with torch.inference_mode():
        hooks = HookChain(edits, capture) if edits is not None else capture
        model(torch.tensor([ids], device=model.wte.weight.device), hooks=hooks)
        acts = {k: v[0].float() for k, v in capture.tensors().items()}
        streams = [acts["blocks.0.hook_resid_pre"]] + [acts[f"blocks.{i}.hook_resid_post"] for i in range(L)]
        out = []
        for i, x in enumerate(streams):
            layer = i - 1
            pattern = acts.get(f"blocks.{layer}.attn.hook_pattern")
            stats = LayerStats(
                layer,
                residual_norms(x).tolist(),
                effective_rank(x),
                collapse(x),
                mean_cosine(x),
                attention_entropy(pattern).tolist() if pattern is not None else None,
                logit_lens(model, x, top_k),
            )
            if not stats.finite():
                where = "after the embeddings" if layer == -1 else f"at layer {layer}"
                cause = "the edits made the activations" if edits is not None else "the activations became"
                raise NonFiniteActivations(
                    f"{cause} non-finite (inf or NaN, or too large to measure) {where}"
                    + ("" if edits is not None else ": the weights, or their dtype's range (float16's ends at 65504)")
                )
            out.append(stats)
    return out


def logit_lens(model: GPT, x: torch.Tensor, top_k: int) -> list[list[tuple[int, float]]]:
    """Decode a residual stream x [T, C] through the final LayerNorm and the unembedding: per position,
    the `top_k` most likely next tokens with their probabilities."""
    w = model.wte.weight
    probs = torch.softmax((model.ln_f(x.to(w.dtype)) @ w.T).float(), dim=-1)  # [T, vocab]
    top = torch.topk(probs, top_k, dim=-1)
    return [list(zip(i.tolist(), p.tolist(), strict=True)) for i, p in zip(top.indices, top.values, strict=True)]


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
