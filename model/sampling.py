"""Choosing the next token from logits: biases and penalties on the logits, then greedy, or temperature with
min-p, top-k and nucleus (top-p) sampling, in vLLM's order.

References: Keskar et al. 2019, "CTRL" (the repetition penalty); OpenAI's presence and frequency penalties;
Fan et al. 2018 (top-k sampling); Holtzman et al. 2020, "The Curious Case of Neural Text Degeneration"
(nucleus sampling); Nguyen et al. 2024, "Min P Sampling".
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch


class Ids:
    """Distinct token ids in the order they first came, in a tensor that only grows (`tensor()`): each id's slot
    is kept here, on the host, so that adding one writes one entry on the device (no sync)."""

    def __init__(self, capacity: int, device: torch.device, first: Sequence[int] = ()) -> None:
        distinct = list(dict.fromkeys(first))
        self.slots = {token: slot for slot, token in enumerate(distinct)}  # id -> its slot
        self.ids = torch.empty(capacity, dtype=torch.long, device=device)
        self.ids[: len(distinct)] = torch.tensor(distinct, dtype=torch.long, device=device)  # in one write

    def __len__(self) -> int:
        return len(self.slots)

    def add(self, token: int) -> int:
        """`token`'s slot, a new one where it is new."""
        slot = self.slots.get(token)
        if slot is None:
            slot = self.slots[token] = len(self.slots)
            self.ids[slot] = token
        return slot

    def tensor(self) -> torch.Tensor:
        return self.ids[: len(self.slots)]


class Penalties:
    """One sequence's logit bias and penalties, with what they read kept up to date a token at a time (no pass over
    the text each step, nor over the vocabulary: each touches only the ids it penalizes). The repetition penalty
    (CTRL's, as transformers and vLLM apply it) divides a positive logit of an id in the prompt or the text so far
    and multiplies a negative one; OpenAI's presence and frequency penalties subtract `frequency` * c_j +
    `presence` from the logit of each id j generated c_j > 0 times. The bias (OpenAI's logit_bias, {id: value})
    is added first, as vLLM orders them."""

    def __init__(
        self,
        prompt: list[int],
        max_new_tokens: int,
        bias: Mapping[int, float],
        repetition: float,
        presence: float,
        frequency: float,
        device: torch.device,
    ) -> None:
        self.repetition, self.presence, self.frequency = repetition, presence, frequency
        self.bias = None
        if any(bias.values()):  # (a bias of 0 does nothing)
            ids, values = zip(*((t, b) for t, b in bias.items() if b), strict=True)
            self.bias = (torch.tensor(ids, device=device), torch.tensor(values, device=device))
        repeats, counted = repetition != 1.0, bool(presence or frequency)
        self.seen = Ids(len(prompt) + max_new_tokens if repeats else 0, device, prompt if repeats else ())
        self.generated = Ids(max_new_tokens if counted else 0, device)
        self.counts = torch.zeros(max_new_tokens if counted else 0, device=device)  # [slot of generated]

    def add(self, token: int) -> None:
        """`token` was generated."""
        if self.repetition != 1.0:
            self.seen.add(token)
        if self.presence or self.frequency:
            self.counts[self.generated.add(token)] += 1

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [vocab] (float32, finite) biased and penalized, in a new tensor."""
        if self.bias is not None:
            logits = logits.index_add(0, *self.bias)
        if len(self.seen):
            ids = self.seen.tensor()
            picked, r = logits[ids], self.repetition  # a logit of 0 stays 0 (0 * inf would be NaN)
            penalized = torch.where(picked > 0, picked / r, torch.where(picked < 0, picked * r, picked))
            finite = torch.finfo(logits.dtype).max  # a penalty far from 1 overflows: the largest logit, not inf
            logits = logits.index_copy(0, ids, penalized.clamp(-finite, finite))
        if len(self.generated):
            counts = self.counts[: len(self.generated)]
            logits = logits.index_add(0, self.generated.tensor(), -(self.frequency * counts + self.presence))
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
    return draw(torch.softmax(logits / temperature, dim=-1), generator)


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One index of `probs` [vocab], drawn with its probability: the first whose cumulative sum (`_wide`)
    passes u times the total, u uniform in [0, 1), so an index of probability 0 is never drawn: one uniform
    number, where torch.multinomial draws one exponential an id for a single sample (1.0 ms over 50,257 ids on a
    CPU core, against 0.05 here)."""
    cdf = probs.to(_wide(probs.device)).cumsum(dim=-1)
    u = torch.rand(1, dtype=cdf.dtype, generator=generator, device=probs.device) * cdf[-1]
    i = int(torch.searchsorted(cdf, u, right=True))
    if i == len(cdf):  # u rounded up to the total: the last index that has a probability
        i = int(torch.searchsorted(cdf, cdf[-1:]))
    return i


def above_min_p(logits: torch.Tensor, min_p: float, temperature: float = 1.0) -> torch.Tensor:
    """Keep the tokens at least `min_p` times as likely as the most likely one at `temperature` (the most
    likely always): p_i >= min_p * p_max, that is logit_i - max >= temperature * log(min_p)."""
    threshold = logits.max() + temperature * math.log(min_p)
    return logits.masked_fill(logits < threshold, float("-inf"))


NUCLEUS_FIRST = 256  # most likely tokens ranked first when looking for the nucleus
NUCLEUS_BINS = 4096  # past them, on a CPU: bins of logits whose probabilities are summed, one bin then ranked


def nucleus(logits: torch.Tensor, top_p: float, temperature: float = 1.0) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability at `temperature` adds up to at least
    `top_p` (always the most likely one: top_p 0, as OpenAI allows it, keeps that one alone). The tokens are
    ranked only as far as the nucleus reaches: the 256 most likely first (0.1 ms over 50,257 logits on a CPU
    core); past them, on a CPU, only the tokens of the bin where the sum reaches top_p (`_binned`, 0.4-0.7 ms
    where a full sort takes 3.5); elsewhere all of them (a GPU sorts 50,257 in microseconds, and its
    `bincount` sums in no fixed order). They are ranked on the logits themselves (at a huge temperature the
    probabilities all but tie)."""
    probs = torch.softmax(logits.to(_wide(logits.device)) / temperature, dim=-1)  # the tail: 50,257 terms
    n = logits.shape[-1]
    if n > NUCLEUS_FIRST:
        order = torch.topk(logits, NUCLEUS_FIRST).indices
        ranked = probs[order]  # most likely first
        if float(ranked.sum()) >= top_p:
            return _keep(logits, order, ranked, top_p)
        if logits.device.type == "cpu":
            return _binned(logits, probs, top_p, temperature)
    order = torch.sort(logits, descending=True).indices
    return _keep(logits, order, probs[order], top_p)


def _binned(logits: torch.Tensor, probs: torch.Tensor, top_p: float, temperature: float) -> torch.Tensor:
    """The nucleus (see `nucleus`) found through bins: the logits' range cut into `NUCLEUS_BINS` of equal
    width, most likely first, and each bin's probability summed. The bins before the one where the sum
    reaches top_p are kept whole, those after it not at all, and only that one's tokens are ranked (all of
    them where the logits crowd into one bin). Summed in float64 on one thread, in a fixed order."""
    hi = float(logits.max())
    lo = max(float(logits.min()), hi - 745 * temperature)  # lower: 1e-323 of the best at most, in the last bin
    if lo < hi:  # rounding keeps the bins in the logits' order; past float32's range a product is inf, the last
        scale = min(NUCLEUS_BINS / (hi - lo), torch.finfo(logits.dtype).max)  # (a tiny temperature's range)
        bins = ((hi - logits) * scale).clamp_(0, NUCLEUS_BINS - 1).int()
    else:
        bins = torch.zeros_like(logits, dtype=torch.int)
    mass = torch.bincount(bins, weights=probs, minlength=NUCLEUS_BINS)
    reached = mass.cumsum(dim=-1)
    b = int(torch.searchsorted(reached, reached.new_tensor([top_p])))  # the first bin to reach top_p
    if b == NUCLEUS_BINS:  # none does (top_p within rounding of 1): every token's more likely ones fall short
        return logits
    members = (bins == b).nonzero().squeeze(1)
    order = members[torch.argsort(logits[members], descending=True)]
    return _keep(logits, order, probs[order], top_p, kept=bins < b, above=float(reached[b] - mass[b]))


def _keep(
    logits: torch.Tensor,
    order: torch.Tensor,
    ranked: torch.Tensor,
    top_p: float,
    kept: torch.Tensor | None = None,
    above: float = 0.0,
) -> torch.Tensor:
    """`logits` with -inf but where the tokens `order` (most likely first, of probabilities `ranked`, after more
    likely ones of probability `above`) do not reach top_p before them, and where `kept` [vocab] is true."""
    kept = torch.zeros_like(logits, dtype=torch.bool) if kept is None else kept
    before = above + ranked.cumsum(dim=-1) - ranked  # the probability of the more likely tokens
    kept[order] = before < top_p  # where the more likely tokens do not reach top_p yet; the rest never does
    kept[order[0]] = True  # top_p 0 keeps the most likely token; past a bin, the first of `order` is kept anyway
    return logits.masked_fill(~kept, float("-inf"))


def _wide(device: torch.device) -> torch.dtype:
    """The dtype of sums over a whole vocabulary: float64 (float32's 24 bits drift over 50,257 terms), float32 on
    MPS, which has no float64."""
    return torch.float32 if device.type == "mps" else torch.float64


def top_logprobs(logprobs: torch.Tensor, n: int) -> list[tuple[int, float]]:
    """The `n` most likely (token id, log-probability) pairs of a log-distribution [vocab]: all of them, most
    likely first, where the vocabulary has fewer than `n`."""
    if n <= 0:
        return []
    values, ids = torch.topk(logprobs, min(n, logprobs.shape[-1]))
    return list(zip(ids.tolist(), values.tolist(), strict=True))
