"""Choosing tokens: seeds, greedy, top-k, the nucleus, and the validation of sampling parameters."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import Checkpoint, load_ours

from model.generate import MAX_LOGPROBS, GenerationError, SamplingParams, fold_seed, generate
from model.gpt import GPT
from model.sampling import nucleus, sample, top_logprobs

PROMPT = [464, 2068, 7586, 21831]


@pytest.fixture(scope="module")
def flat_model(tiny: Checkpoint) -> GPT:
    """The tiny model with its final LayerNorm scaled down, so its next-token distributions are flat:
    the random-weight logits are otherwise so peaked that sampling at temperature 1 is nearly greedy."""
    model = load_ours(tiny)
    with torch.no_grad():
        model.ln_f.weight.mul_(0.05)
        model.ln_f.bias.mul_(0.05)
        probs = torch.softmax(model(torch.tensor([PROMPT]))[0, -1], dim=-1)
    assert probs.max() < 0.2  # many tokens are likely
    return model


def tokens(model: GPT, **params: object) -> list[int]:
    return generate(model, [PROMPT], SamplingParams(ignore_eos=True, **params))[0].token_ids  # type: ignore[arg-type]


def test_same_seed_same_tokens(flat_model: GPT) -> None:
    first = tokens(flat_model, max_new_tokens=30, temperature=1.0, seed=1234)
    assert tokens(flat_model, max_new_tokens=30, temperature=1.0, seed=1234) == first
    assert tokens(flat_model, max_new_tokens=30, temperature=0.7, top_k=50, top_p=0.9, seed=7) == tokens(
        flat_model, max_new_tokens=30, temperature=0.7, top_k=50, top_p=0.9, seed=7
    )


def test_different_seeds_differ(flat_model: GPT) -> None:
    runs = {tuple(tokens(flat_model, max_new_tokens=30, temperature=1.0, seed=s)) for s in range(4)}
    assert len(runs) == 4
    # and sampling is not greedy
    assert tokens(flat_model, max_new_tokens=30, temperature=0) not in [list(r) for r in runs]


def test_top_k_1_is_greedy(flat_model: GPT) -> None:
    greedy = tokens(flat_model, max_new_tokens=25, temperature=0)
    for seed in (0, 1):
        assert tokens(flat_model, max_new_tokens=25, temperature=1.5, top_k=1, seed=seed) == greedy


def test_tiny_top_p_is_greedy(flat_model: GPT) -> None:
    greedy = tokens(flat_model, max_new_tokens=25, temperature=0)
    assert tokens(flat_model, max_new_tokens=25, temperature=1.5, top_p=1e-6, seed=3) == greedy
    for seed in (0, 1):  # top_p 0 (OpenAI's range is [0, 1]) keeps the most likely token alone
        assert tokens(flat_model, max_new_tokens=25, temperature=1.5, top_p=0, seed=seed) == greedy


def test_sample_with_a_tiny_top_p_returns_the_argmax() -> None:
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        logits = torch.randn(1000, generator=g) * 0.1  # a flat distribution: any token is likely
        assert sample(logits, 1.0, 0, 1e-9, g) == int(logits.argmax())


def test_nucleus_keeps_the_smallest_set_reaching_top_p() -> None:
    probs = torch.tensor([0.125, 0.5, 0.0625, 0.25, 0.0625])  # sorted: 0.5, 0.25, 0.125, 0.0625, 0.0625
    logits = probs.log()

    def kept(top_p: float) -> set[int]:
        return set(torch.isfinite(nucleus(logits, top_p)).nonzero().flatten().tolist())

    assert kept(0.3) == {1}
    assert kept(0.5) == {1}  # 0.5 alone reaches 0.5
    assert kept(0.6) == {1, 3}
    assert kept(0.8) == {1, 3, 0}
    assert len(kept(0.9)) == 4 and kept(0.9) > {0, 1, 3}  # 0.875 < 0.9: one of the two 0.0625 tokens too
    assert kept(1.0) == {0, 1, 2, 3, 4}
    kept_logits = nucleus(logits, 0.6)
    assert torch.equal(kept_logits[[1, 3]], logits[[1, 3]])  # what is kept is unchanged


def test_sampling_draws_only_from_the_nucleus_and_the_top_k() -> None:
    logits = torch.tensor([0.125, 0.5, 0.0625, 0.25, 0.0625]).log()
    g = torch.Generator().manual_seed(0)
    assert {sample(logits, 1.0, 0, 0.6, g) for _ in range(300)} == {1, 3}
    assert {sample(logits, 1.0, 3, 1.0, g) for _ in range(300)} == {0, 1, 3}
    assert {sample(logits, 1.0, 0, 1.0, g) for _ in range(300)} == {0, 1, 2, 3, 4}
    assert {sample(logits, 0.0, 0, 1.0, g) for _ in range(10)} == {1}


def test_a_temperature_past_float32_still_keeps_the_top_k_and_the_nucleus() -> None:
    """Divided by 1e39 (past float32's largest number) every logit is 0: the ranking is still the logits'."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1000, generator=g)
    top5 = set(torch.topk(logits, 5).indices.tolist())
    assert {sample(logits, 1e39, 5, 1.0, g) for _ in range(200)} <= top5
    assert {sample(logits, 1e39, 0, 0.0, g) for _ in range(20)} == {int(logits.argmax())}
    assert len({sample(logits, 1e39, 0, 1.0, g) for _ in range(200)}) > 150  # otherwise uniform, as its limit is


def test_sampling_follows_the_distribution() -> None:
    """Frequencies over 4000 draws at temperature 1 and 0.5 are those of softmax(logits / T)."""
    logits = torch.tensor([0.1, 0.5, 0.2, 0.2]).log()
    g = torch.Generator().manual_seed(1)
    for temperature in (1.0, 0.5):
        counts = torch.bincount(
            torch.tensor([sample(logits, temperature, 0, 1.0, g) for _ in range(4000)]), minlength=4
        )
        expected = torch.softmax(logits / temperature, dim=-1)
        assert (counts / 4000 - expected).abs().max() < 0.03, (temperature, counts)


def test_top_logprobs() -> None:
    logprobs = torch.log_softmax(torch.tensor([1.0, 3.0, 2.0, 0.0]), dim=-1)
    top = top_logprobs(logprobs, 2)
    assert [i for i, _ in top] == [1, 2]
    assert [v for _, v in top] == pytest.approx([logprobs[1].item(), logprobs[2].item()])
    assert top_logprobs(logprobs, 0) == []
    assert [i for i, _ in top_logprobs(logprobs, 20)] == [1, 2, 0, 3]  # a vocabulary smaller than n: all of it


def test_seeds_apart_only_above_32_bits_sample_apart(flat_model: GPT) -> None:
    """A CPU generator keeps 32 bits of its seed: seeds that differ only above them (s and s + 2³², -1 and
    2³²-1) are folded apart, and a seed in 0..2³²-1 is the seed torch's own generator would take."""
    assert [fold_seed(s) for s in (0, 1, 2**32 - 1)] == [0, 1, 2**32 - 1]
    for a, b in [(1, 1 + 2**32), (-1, 2**32 - 1), (0, -(2**63)), (5, 5 + 2**62)]:
        assert fold_seed(a) != fold_seed(b)
        assert tokens(flat_model, max_new_tokens=30, temperature=1.0, seed=a) != tokens(
            flat_model, max_new_tokens=30, temperature=1.0, seed=b
        )
    assert all(0 <= fold_seed(s) < 2**32 for s in (-(2**63), -1, 2**63 - 1))


@pytest.mark.parametrize(
    ("param", "value"),
    [
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("temperature", "1"),
        ("top_p", 1.01),
        ("top_p", -0.5),
        ("top_k", -2),
        ("top_k", 2.5),
        ("logprobs", MAX_LOGPROBS + 1),
        ("logprobs", -1),
        ("prompt_logprobs", 21),
        ("max_new_tokens", -1),
        ("max_new_tokens", True),
        ("seed", "42"),
        ("stop", ("",)),
        ("stop_token_ids", ("50256",)),
    ],
)
def test_invalid_sampling_params(param: str, value: object) -> None:
    with pytest.raises(GenerationError) as info:
        SamplingParams(**{param: value})  # type: ignore[arg-type]
    assert info.value.param == param
    assert str(info.value).startswith(param) and repr(value) in str(info.value)


def test_valid_edges_of_sampling_params() -> None:
    SamplingParams(temperature=0, top_p=1, top_k=0, logprobs=MAX_LOGPROBS, prompt_logprobs=0, max_new_tokens=0)
    SamplingParams(top_p=1e-9, seed=0, stop=("\n",), stop_token_ids=(50256,))
