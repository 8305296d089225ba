"""Choosing tokens: seeds, greedy, top-k, the nucleus, and the validation of sampling parameters."""

from __future__ import annotations

import copy
import math
import pickle

import pytest
import torch
from conftest import Checkpoint, load_ours

from model.config import GPTConfig
from model.generate import MAX_LOGPROBS, GenerationError, SamplingParams, fold_seed, generate
from model.gpt import GPT
from model.sampling import Penalties, above_min_p, draw, nucleus, sample, top_logprobs
from model.tokenizer import Tokenizer

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


@pytest.mark.parametrize("scale", [0.3, 4.0])
def test_nucleus_is_the_smallest_set_at_every_size(scale: float) -> None:
    """The nucleus ranks the most likely tokens only as far as it reaches (the 256 most likely, then the bin of
    logits where it ends): at sizes on both sides of that step and of the bins' it is the set a full sort gives
    (top_p set halfway between two cumulative sums, out of the reach of rounding: not where the token past it
    is less likely than 1e-12, as the last of 50,257 at scale 4 is, 3e-16)."""
    logits = torch.randn(50257, generator=torch.Generator().manual_seed(2)) * scale
    order = torch.sort(logits, descending=True).indices
    probs = torch.softmax(logits.double(), dim=-1)[order]
    cum = probs.cumsum(dim=-1)
    sizes = [s for s in (1, 2, 255, 256, 257, 4096, 4097, 30000, 45000, 50257) if probs[s - 1] > 1e-12]
    assert len(sizes) >= 9
    for size in sizes:
        top_p = float(cum[size - 2] + cum[size - 1]) / 2 if size > 1 else float(cum[0]) / 2
        kept = nucleus(logits, top_p).isfinite()
        assert int(kept.sum()) == size and bool(kept[order[:size]].all()), size


@pytest.mark.parametrize(
    "case",
    ["ties", "masked", "float32-range", "all-equal", "one-huge", "few-finite", "steps"],
)
def test_the_binned_nucleus_is_the_sorted_one(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the 256 most likely tokens, on a CPU, the nucleus is found through bins of logits (`_binned`, not a
    sort of them all): logits that tie, that top-k or min-p made -inf, that span float32's range, that are all
    equal, that one outlier dominates, of which only a few are finite, or that fall in a few steps (many per
    bin), all keep the set a full sort keeps: as many tokens, all at least as likely as any left out."""
    g = torch.Generator().manual_seed(3)
    n = 50257
    logits = torch.randn(n, generator=g)
    if case == "ties":
        logits = (logits * 4).round() / 4  # 40-odd distinct values
    elif case == "masked":
        logits[torch.rand(n, generator=g) < 0.7] = float("-inf")
    elif case == "float32-range":
        logits = logits.sign() * 3e38  # hi - lo overflows float32
        logits[:300] = torch.randn(300, generator=g)
    elif case == "all-equal":
        logits = torch.zeros(n)
    elif case == "one-huge":
        logits[7] = 8.0
    elif case == "few-finite":
        logits[300:] = float("-inf")
    elif case == "steps":
        logits = torch.randint(0, 3, (n,), generator=g).float() * 1e-3 + torch.randn(n, generator=g) * 1e-9
    probs = torch.softmax(logits.double(), dim=-1)
    order = torch.sort(logits, descending=True).indices
    cum = probs[order].cumsum(dim=-1)
    monkeypatch.setattr(torch, "sort", None)  # the reference's sort is done: the nucleus ranks no other way
    for top_p in (0.0, 0.3, 0.5, 0.9, 0.999):
        kept = nucleus(logits, top_p).isfinite()
        want = max(1, int((cum - probs[order] < top_p).sum()))  # the tokens before which top_p is not reached
        assert int(kept.sum()) == want, (top_p, case)
        if want < n:
            assert logits[kept].min() >= logits[~kept].max(), (top_p, case)


def test_the_binned_nucleus_at_the_edges() -> None:
    """Past the 256 most likely tokens: a top_p no bin reaches (within rounding of 1, over equal logits) keeps
    every token, and a temperature below float32's smallest normal number, whose bins would be NaN for the
    logits that tie for the best, still gives a nucleus (both once raised, failing the sequence)."""
    g = torch.Generator().manual_seed(0)
    for n in (257, 300, 4097):
        assert nucleus(torch.zeros(n), 1 - 2**-53).isfinite().all()
        assert 0 <= sample(torch.zeros(n), 1.0, 0, 1 - 2**-53, g) < n
    ties = torch.where(torch.arange(1000) < 500, 0.0, -1.0)
    assert sample(ties, 1e-39, 0, 0.9, g) < 500
    kept = nucleus(ties, 0.9, 1e-39).isfinite()
    assert int(kept.sum()) == 450 and bool(kept[:500].any()) and not kept[500:].any()


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


def test_draw_takes_each_index_with_its_probability_and_never_one_of_none() -> None:
    probs = torch.tensor([0.0, 0.2, 0.0, 0.5, 0.3, 0.0])
    g = torch.Generator().manual_seed(4)
    counts = torch.bincount(torch.tensor([draw(probs, g) for _ in range(6000)]), minlength=6)
    assert counts[[0, 2, 5]].sum() == 0
    assert (counts / 6000 - probs).abs().max() < 0.02, counts
    assert {draw(torch.tensor([0.0, 0.0, 1e-30, 0.0]), g) for _ in range(50)} == {2}  # however small, the only one


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
        ("min_p", 1.5),
        ("min_p", -0.1),
        ("repetition_penalty", 0),
        ("repetition_penalty", -1.2),
        ("repetition_penalty", math.inf),
        ("repetition_penalty", math.nan),
        ("presence_penalty", 2.5),
        ("presence_penalty", True),
        ("frequency_penalty", -2.01),
        ("frequency_penalty", math.nan),
    ],
)
def test_invalid_sampling_params(param: str, value: object) -> None:
    with pytest.raises(GenerationError) as info:
        SamplingParams(**{param: value})  # type: ignore[arg-type]
    assert info.value.param == param
    shown = value[0] if param == "stop" else value  # a stop list's bad string is named alone, by its place
    assert str(info.value).startswith(param) and repr(shown) in str(info.value)


def test_valid_edges_of_sampling_params() -> None:
    SamplingParams(temperature=0, top_p=1, top_k=0, logprobs=MAX_LOGPROBS, prompt_logprobs=0, max_new_tokens=0)
    SamplingParams(top_p=1e-9, seed=0, stop=("\n",), stop_token_ids=(50256,))


# --- biases and penalties on the logits, and min-p ----------------------------------------------------


def _penalties(
    prompt: list[int], generated: list[int], bias: dict[int, float] | None = None, **how: float
) -> Penalties:
    """`Penalties` told of `generated` a token at a time, as a sequence tells them."""
    penalties = Penalties(
        prompt,
        len(generated),
        bias or {},
        how.get("repetition", 1.0),
        how.get("presence", 0.0),
        how.get("frequency", 0.0),
        torch.device("cpu"),
    )
    for token in generated:
        penalties.add(token)
    return penalties


def test_penalties_are_transformers_repetition_penalty_and_openais_presence_and_frequency() -> None:
    from transformers import RepetitionPenaltyLogitsProcessor

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1000, generator=g) * 3  # positive and negative logits
    prompt, generated = [5, 17, 17, 900], [17, 3, 3, 3, 42]
    want = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([prompt + generated]), logits[None].clone())[0]
    assert torch.equal(_penalties(prompt, generated, repetition=1.7)(logits), want)
    # OpenAI: mu[j] - c[j] * frequency - (c[j] > 0) * presence, c[j] counting the generated tokens only
    counts = torch.zeros(1000)
    for t in generated:
        counts[t] += 1
    want = logits - 0.3 * counts - 1.5 * (counts > 0).float()
    penalized = _penalties(prompt, generated, presence=1.5, frequency=0.3)(logits)
    assert torch.allclose(penalized, want, atol=1e-6)
    assert penalized[5] == logits[5]  # a prompt token: not penalized
    biased = _penalties(prompt, generated, {3: -100.0, 999: 7.5})(logits)
    assert biased[3] == logits[3] - 100 and biased[999] == logits[999] + 7.5
    assert torch.equal(biased[4:999], logits[4:999])
    # a penalty far from 1 overflows float32: the largest finite logit instead of inf, and a logit of 0 stays 0
    # (0 times inf would be NaN), so sampling still works
    logits[17] = 0.0
    for huge in (1e-46, 1e39):
        penalized = _penalties(prompt, generated, repetition=huge)(logits)
        assert penalized.isfinite().all() and penalized[17] == 0
    assert int(_penalties(prompt, generated, repetition=1e-46)(logits).argmax()) in prompt + generated


def test_sampling_params_with_a_logit_bias() -> None:
    bias = {5: 0.0, 7: -2}
    params = SamplingParams(logit_bias=bias)
    assert params.logit_bias == {5: 0.0, 7: -2.0} and params.logit_bias is not bias  # a copy of its own
    assert params.adjusts_logits and not SamplingParams(logit_bias={5: 0.0, 9: 0}).adjusts_logits  # zeros: nothing
    assert hash(params) == hash(SamplingParams(logit_bias={7: 3.0}))  # hashable, the bias left out of it
    assert params != SamplingParams(logit_bias={7: 3.0})
    assert pickle.loads(pickle.dumps(params)) == params == copy.deepcopy(params)  # for a worker process


def test_a_logit_bias_on_a_padded_vocabularys_padding_is_refused(tokenizer: Tokenizer) -> None:
    """Only the tokenizer's ids are chosen from (the padding of nanoGPT's 50304 never is): a bias past them
    would do nothing, so it is refused, not ignored."""
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, n_positions=32, vocab_size=50304)).eval()
    params = SamplingParams(max_new_tokens=2, temperature=0, logit_bias={50300: 100})
    with pytest.raises(GenerationError, match=r"logit_bias: token id 50300 is outside the vocabulary \(0..50256\)"):
        generate(model, [PROMPT], params, tokenizer)
    assert generate(model, [PROMPT], params)[0].token_ids == [50300, 50300]  # no tokenizer: every id is chosen


def test_min_p_keeps_what_transformers_keeps() -> None:
    from transformers import MinPLogitsWarper

    g = torch.Generator().manual_seed(1)
    for min_p, temperature in [(0.05, 1.0), (0.3, 0.7), (0.01, 2.0), (1.0, 1.0)]:
        logits = torch.randn(5000, generator=g) * 2
        warped = MinPLogitsWarper(min_p)(torch.zeros(1, 1, dtype=torch.long), (logits / temperature)[None])[0]
        ours = above_min_p(logits, min_p, temperature)
        assert torch.equal(ours.isfinite(), warped.isfinite()), (min_p, temperature)
        assert 1 <= int(ours.isfinite().sum()) < 5000
        drawn = {sample(logits, temperature, 0, 1.0, g, min_p=min_p) for _ in range(200)}
        assert drawn <= set(ours.isfinite().nonzero().flatten().tolist())
    assert {sample(logits, 1.0, 0, 1.0, g, min_p=1.0) for _ in range(20)} == {int(logits.argmax())}


def test_greedy_with_a_repetition_penalty_is_transformers_generate(tiny: Checkpoint, flat_model: GPT) -> None:
    """transformers' `generate(repetition_penalty=...)`, greedy, over the prompt and the tokens generated."""
    model = load_ours(tiny)
    plain = generate(model, [PROMPT], SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True))[0]
    for penalty in (1.3, 4.0, 0.8):
        params = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True, repetition_penalty=penalty)
        ours = generate(model, [PROMPT], params)[0].token_ids
        hf = tiny.hf.generate(
            torch.tensor([PROMPT]),
            do_sample=False,
            repetition_penalty=penalty,
            max_new_tokens=24,
            min_new_tokens=24,
            pad_token_id=0,
        )[0, len(PROMPT) :].tolist()
        assert ours == hf, penalty
        if penalty > 1:
            assert ours != plain.token_ids  # (the random model repeats itself: the penalty shows)


def _openai_greedy(model: GPT, prompt: list[int], n: int, presence: float, frequency: float) -> list[int]:
    """Greedy decoding, every step a full forward pass without a cache, with OpenAI's penalties written out."""
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids]))[0, -1].float()
            for t in set(out):
                logits[t] -= out.count(t) * frequency + presence
            out.append(int(logits.argmax()))
            ids.append(out[-1])
    return out


def test_greedy_with_presence_and_frequency_penalties_is_openais_formula(tiny: Checkpoint) -> None:
    model = load_ours(tiny)
    plain = generate(model, [PROMPT], SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True))[0]
    for presence, frequency in [(2.0, 0.0), (0.0, 1.5), (0.5, 0.7), (-1.0, -0.5)]:
        params = SamplingParams(
            max_new_tokens=20, temperature=0, ignore_eos=True, presence_penalty=presence, frequency_penalty=frequency
        )
        ours = generate(model, [PROMPT], params)[0]
        assert ours.token_ids == _openai_greedy(model, PROMPT, 20, presence, frequency), (presence, frequency)
        if presence > 0 or frequency > 0:
            assert ours.token_ids != plain.token_ids


def test_logit_bias_moves_greedy_and_sampling_and_logprobs_stay_the_models(flat_model: GPT) -> None:
    plain = generate(flat_model, [PROMPT], SamplingParams(max_new_tokens=6, temperature=0, logprobs=2))[0]
    first = plain.token_ids[0]
    banned = generate(
        flat_model, [PROMPT], SamplingParams(max_new_tokens=6, temperature=0, logprobs=2, logit_bias={first: -100})
    )[0]
    assert first not in banned.token_ids
    assert banned.token_ids[0] == plain.logprobs[0].top[1][0]  # the runner-up
    # the log-probabilities given are the model's: the runner-up's as the plain run gave it
    assert banned.logprobs[0].logprob == pytest.approx(plain.logprobs[0].top[1][1], abs=1e-6)
    assert banned.logprobs[0].top == plain.logprobs[0].top
    forced = {"max_new_tokens": 8, "temperature": 1.0, "logit_bias": {1000: 100}}
    for seed in (0, 1):
        assert tokens(flat_model, seed=seed, **forced) == [1000] * 8
    # at bias 0 nothing changes; sampling draws from the biased distribution
    unbiased = tokens(flat_model, max_new_tokens=12, seed=3)
    assert tokens(flat_model, max_new_tokens=12, seed=3, logit_bias={5: 0.0}) == unbiased


def test_rows_with_their_own_penalties_batch_as_they_run_alone(flat_model: GPT) -> None:
    """Each sequence applies its own bias and penalties to its own row: batched as alone."""
    settings = [
        SamplingParams(max_new_tokens=10, temperature=0.8, seed=1, repetition_penalty=1.5),
        SamplingParams(max_new_tokens=10, temperature=0.8, seed=1),
        SamplingParams(max_new_tokens=10, temperature=0, presence_penalty=1.0, frequency_penalty=0.5),
        SamplingParams(max_new_tokens=10, temperature=0.9, seed=2, min_p=0.2, logit_bias={11: 5.0}),
    ]
    prompts = [PROMPT, PROMPT, PROMPT[:2], PROMPT[1:]]
    batched = generate(flat_model, prompts, settings)
    for prompt, params, got in zip(prompts, settings, batched, strict=True):
        assert got.token_ids == generate(flat_model, [prompt], params)[0].token_ids


@pytest.mark.parametrize(
    ("bias", "message"),
    [
        ({-1: 1.0}, "logit_bias: a token id must be an integer >= 0, got -1"),
        ({1.5: 1.0}, "logit_bias: a token id must be an integer >= 0, got 1.5"),
        ({True: 1.0}, "logit_bias: a token id must be an integer >= 0, got True"),
        ({5: 100.5}, "logit_bias: the bias of token 5 must be a number in [-100, 100], got 100.5"),
        ({5: math.nan}, "logit_bias: the bias of token 5 must be a number in [-100, 100], got nan"),
        ({5: "1"}, "logit_bias: the bias of token 5 must be a number in [-100, 100], got '1'"),
        ([(5, 1.0)], "logit_bias must map token ids to biases, got list"),
    ],
)
def test_invalid_logit_bias(bias: object, message: str) -> None:
    with pytest.raises(GenerationError) as info:
        SamplingParams(logit_bias=bias)  # type: ignore[arg-type]
    assert info.value.param == "logit_bias" and str(info.value) == message


def test_logit_bias_past_the_vocabulary_is_refused_before_any_work(tiny_model: GPT) -> None:
    with pytest.raises(GenerationError, match=r"logit_bias: token id 50257 is outside the vocabulary \(0..50256\)"):
        generate(tiny_model, [PROMPT], SamplingParams(max_new_tokens=2, logit_bias={50257: 1.0}))


def test_varied_params_check_only_what_they_change() -> None:
    """A request's samples share its settings, checked once (a bias over every id), each with its own seed."""
    params = SamplingParams(temperature=0.5, logit_bias={i: 1.0 for i in range(50257)}, seed=1)
    other = params.varied(7, 3)
    assert (other.max_new_tokens, other.seed, params.max_new_tokens, params.seed) == (7, 3, 32, 1)
    assert other.logit_bias is params.logit_bias and other.temperature == 0.5 and other.bias_end == 50257
    for length, seed, param in [(-1, None, "max_new_tokens"), (1, 2**63, "seed"), (True, None, "max_new_tokens")]:
        with pytest.raises(GenerationError) as info:
            params.varied(length, seed)
        assert info.value.param == param
