"""Choosing the next token from logits: biases and penalties on the logits, then greedy, or temperature with
min-p, top-k and nucleus (top-p) sampling, in vLLM's order.

References: Keskar et al. 2019, "CTRL" (the repetition penalty); OpenAI's presence and frequency penalties;
Fan et al. 2018 (top-k sampling); Holtzman et al. 2020, "The Curious Case of Neural Text Degeneration"
(nucleus sampling); Nguyen et al. 2024, "Min P Sampling".
"""

from __future__ import annotations

import math

import torch


def penalize(
    logits: torch.Tensor,
    bias: tuple[torch.Tensor, torch.Tensor] | None,
    seen: list[int],
    generated: list[int],
    repetition: float = 1.0,
    presence: float = 0.0,
    frequency: float = 0.0,
) -> torch.Tensor:
    """`logits` [vocab] with, in order: `bias` (ids [n], values [n]) added (OpenAI's logit_bias); the repetition
    penalty on every token in `seen` (the prompt's and the generated ids): a positive logit divided by it, a
    negative one multiplied (CTRL's, as transformers and vLLM apply it); then, for each token j `generated`
    c_j times, `frequency` * c_j + `presence` * (c_j > 0) subtracted (OpenAI's). 1, 0 and 0 are off."""
    if bias is not None:
        logits = logits.index_add(0, *bias)
    if repetition != 1.0 and seen:
        ids = torch.tensor(seen, device=logits.device).unique()
        picked = logits[ids]
        penalized = torch.where(picked > 0, picked / repetition, picked * repetition)
        finite = torch.finfo(logits.dtype).max  # a penalty far from 1 overflows to inf: the largest logit instead
        logits = logits.index_copy(0, ids, penalized.clamp(-finite, finite))
    if (presence or frequency) and generated:
        counts = torch.bincount(torch.tensor(generated, device=logits.device), minlength=logits.shape[-1])
        logits = logits - (frequency * counts + presence * (counts > 0)).to(logits.dtype)
    return logits


def sample(
    logits: torch.Tensor,
    temperature: float,
    top_k: int,
    top_p: float,
    generator: torch.Generator,
    min_p: float = 0.0,
) -> int:
    """One token id from `logits` [vocab] (float32, finite). temperature 0 is greedy; min_p 0, top_k 0 and
    top_p 1 are off. Every valid setting gives a distribution: however small the temperature or top_p, or
    however large min_p, at least the most likely token keeps its chance."""
    if temperature == 0:
        return int(logits.argmax())
    # Shifted so that the best token is at 0: dividing by a tiny temperature then gives -inf at worst, never
    # +inf (softmax would be NaN), so the limit is greedy. A temperature below float32's smallest normal
    # number would round to 0 (0 / 0 = NaN), so it counts as that number; one above its largest, to inf
    # (-inf / inf = NaN), so it counts as that one. The tokens are ranked (top-k, the nucleus' order) on the
    # logits themselves: divided by so large a temperature they all but tie.
    logits = logits - logits.max()
    finfo = torch.finfo(logits.dtype)
    temperature = min(max(temperature, finfo.tiny), finfo.max)
    if min_p > 0:
        logits = above_min_p(logits, min_p, temperature)
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        logits = nucleus(logits, top_p, temperature)
    probs = torch.softmax(logits / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def above_min_p(logits: torch.Tensor, min_p: float, temperature: float = 1.0) -> torch.Tensor:
    """Keep the tokens at least `min_p` times as likely as the most likely one at `temperature` (the most
    likely always): p_i >= min_p * p_max, that is logit_i - max >= temperature * log(min_p)."""
    threshold = logits.max() + temperature * math.log(min_p)
    return logits.masked_fill(logits < threshold, float("-inf"))


def nucleus(logits: torch.Tensor, top_p: float, temperature: float = 1.0) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability at `temperature` adds up to at least
    `top_p` (always the most likely one: top_p 0, as OpenAI allows it, keeps that one alone)."""
    sorted_logits, order = torch.sort(logits, descending=True)
    probs = torch.softmax(sorted_logits / temperature, dim=-1)
    drop_sorted = probs.cumsum(dim=-1) - probs >= top_p  # the more likely tokens already reach top_p
    drop_sorted[0] = False  # the most likely token always stays
    drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def top_logprobs(logprobs: torch.Tensor, n: int) -> list[tuple[int, float]]:
    """The `n` most likely (token id, log-probability) pairs of a log-distribution [vocab]: all of them, most
    likely first, where the vocabulary has fewer than `n`."""
    if n <= 0:
        return []
    values, ids = torch.topk(logprobs, min(n, logprobs.shape[-1]))
    return list(zip(ids.tolist(), values.tolist(), strict=True))
