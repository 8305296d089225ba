"""The decode loop: stop strings and streaming, stop tokens, EOS, length, log-probabilities, chunked
prefill, and the refusal of requests that cannot be generated.

Text-level behaviour is checked twice: on the tiny random model with the real tokenizer, and on a scripted
model whose next token is fixed in advance, so that a stop string can be made to span tokens or a
character to be split across tokens on purpose.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from conftest import Checkpoint, load_ours
from torch import nn

from model.config import GPTConfig
from model.generate import (
    Completion,
    DecodeBatch,
    Generation,
    GenerationError,
    SamplingParams,
    SequenceState,
    TokenEvent,
    _longest_stop_prefix,
    generate,
    new_sequence,
    validate_prompt,
)
from model.gpt import GPT
from model.hooks import Capture
from model.interventions import Edit
from model.kv_cache import KVCache
from model.tokenizer import EOT, EOT_ID, Tokenizer, _bytes_to_unicode

PROMPT = [464, 2068, 7586, 21831, 18045, 625]
GREEDY = {"temperature": 0.0, "ignore_eos": True}


def run(
    model: nn.Module, prompts: list[list[int]], params: SamplingParams, tokenizer: Tokenizer | None = None
) -> tuple[list[Completion], list[TokenEvent]]:
    generation = Generation(model, prompts, params, tokenizer)  # type: ignore[arg-type]
    events = list(generation)
    return generation.results, events


def streamed_text(events: list[TokenEvent], index: int = 0) -> str:
    return "".join(e.text for e in events if e.index == index)


def full_logprobs(model: GPT, sequence: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([sequence]))[0].float(), dim=-1)  # [T, vocab]


class ScriptedModel(nn.Module):
    """Stands in for GPT in the decode loop: after a prompt of `prompt_len` tokens it produces `script`,
    one token per position, whatever the tokens fed (and EOS after the script)."""

    def __init__(self, prompt_len: int, script: list[int]) -> None:
        super().__init__()
        self.config = GPTConfig(n_layer=1, n_head=1, n_embd=4, n_positions=64)
        self.wte = nn.Embedding(1, 4)
        self.prompt_len, self.script = prompt_len, script

    def forward(self, idx: torch.Tensor, cache: KVCache, hooks: object = None, last_only: bool = False) -> torch.Tensor:
        B, T = idx.shape
        positions = cache.begin(T)  # [B, T]
        logits = torch.full((B, T, self.config.vocab_size), -30.0)
        for b in range(B):
            for t in range(T):
                k = int(positions[b, t]) + 1 - self.prompt_len  # which scripted token comes next
                if 0 <= k:
                    logits[b, t, self.script[k] if k < len(self.script) else EOT_ID] = 30.0
        return logits[:, -1:] if last_only else logits


def byte_token(tokenizer: Tokenizer, byte: int) -> int:
    token = tokenizer._tok.token_to_id(_bytes_to_unicode()[byte])
    assert token is not None
    return token


# --- stop strings and streaming --------------------------------------------------------------------


def test_stop_string_on_the_real_model(tiny_model: GPT, tokenizer: Tokenizer) -> None:
    [full], _ = run(tiny_model, [PROMPT], SamplingParams(max_new_tokens=40, **GREEDY), tokenizer)
    assert full.text == tokenizer.decode(full.token_ids) and full.finish_reason == "length"
    start = len(full.text) // 2
    stop = full.text[start : start + 3]
    assert "\ufffd" not in stop and len(stop) == 3
    [result], events = run(tiny_model, [PROMPT], SamplingParams(max_new_tokens=40, stop=(stop,), **GREEDY), tokenizer)
    assert result.finish_reason == "stop"
    assert result.text == full.text[: full.text.find(stop)]
    assert stop not in result.text
    assert streamed_text(events) == result.text
    assert result.token_ids == full.token_ids[: len(result.token_ids)] and len(result.token_ids) < 40
    assert [e.finish_reason for e in events] == [None] * (len(events) - 1) + ["stop"]


def test_stop_string_spanning_tokens_is_held_back_while_unsure(tokenizer: Tokenizer) -> None:
    script = [18435, 476, 335, 0]  # " Hello", " wor", "ld", "!"
    model = ScriptedModel(1, script)
    [result], events = run(model, [[50]], SamplingParams(max_new_tokens=10, stop=("world",), **GREEDY), tokenizer)
    assert result.text == " Hello "
    assert result.finish_reason == "stop" and result.token_ids == [18435, 476, 335]
    assert [e.text for e in events] == [" Hello", " ", ""]  # " wor" could begin "world": held back
    # the earliest of several stop strings wins, whatever their order
    [result], _ = run(model, [[50]], SamplingParams(max_new_tokens=10, stop=("!", "llo w"), **GREEDY), tokenizer)
    assert result.text == " He"
    # matches that overlap, found in one step: the earliest wins in either order (cutting at the later one first
    # hid the earlier: " Hello" with stops "llo" and "Hel" gave " He")
    for stop in (("llo", "Hel"), ("Hel", "llo"), ("ello", "lo"), ("lo", "ello")):
        [result], _ = run(model, [[50]], SamplingParams(max_new_tokens=10, stop=stop, **GREEDY), tokenizer)
        want = " " if "Hel" in stop else " H"
        assert result.text == want and result.finish_reason == "stop", stop
    # a held-back prefix that does not become the stop string is released
    [result], events = run(model, [[50]], SamplingParams(max_new_tokens=10, stop=("word",), temperature=0), tokenizer)
    assert result.text == " Hello world!" and result.finish_reason == "eos"
    assert [e.text for e in events] == [" Hello", " ", "world", "!", ""]


def test_a_character_split_across_tokens_is_streamed_whole(tokenizer: Tokenizer) -> None:
    e_acute = [byte_token(tokenizer, b) for b in "é".encode()]  # two byte tokens
    script = [64, *e_acute, 65, byte_token(tokenizer, "€".encode()[0])]  # "a", "é", "b", then half a "€"
    [result], events = run(ScriptedModel(1, script), [[50]], SamplingParams(max_new_tokens=5, **GREEDY), tokenizer)
    assert [e.text for e in events] == ["a", "", "é", "b", "\ufffd"]  # the unfinished one shows once finished
    assert streamed_text(events) == result.text == "aéb\ufffd"
    # a stop string that holds U+FFFD is not matched by the placeholder of a character still unfinished, only
    # by a U+FFFD in the text, as soon as it is sure: "é" in two tokens, then "!", never held one; a byte no
    # character starts with is one at once; so is the first byte of a character that the next token's do not
    # finish, and U+FFFD itself (its three bytes: a real character)
    params = SamplingParams(max_new_tokens=5, stop=("\ufffd",), **GREEDY)
    euro = byte_token(tokenizer, "€".encode()[0])
    for script, text, tokens in (
        ([*e_acute, 0, byte_token(tokenizer, 0xFF), 65], "é!", 4),
        ([64, euro, 65, 66], "a", 3),
        ([64, *(byte_token(tokenizer, b) for b in b"\xed\xa0"), 65], "a", 3),  # a surrogate's: never a character
        ([64, *(byte_token(tokenizer, b) for b in "\ufffd".encode()), 65], "a", 4),
    ):
        [result], events = run(ScriptedModel(1, script), [[50]], params, tokenizer)
        assert (result.text, result.finish_reason, len(result.token_ids)) == (text, "stop", tokens), script
        assert streamed_text(events) == text
    # a stop string found in the settled text ends the generation with this token: its unfinished character's
    # placeholder is then final, and a stop string that matches it earlier wins (" 裏\xe7" is one token)
    token = 20174
    assert tokenizer.token_bytes(token) == " 裏".encode() + b"\xe7"
    for max_new_tokens in (1, 2):
        params = SamplingParams(max_new_tokens=max_new_tokens, stop=("裏", " 裏\ufffd"), **GREEDY)
        [result], events = run(ScriptedModel(1, [token, 64]), [[50]], params, tokenizer)
        assert (result.text, result.finish_reason, result.token_ids) == ("", "stop", [token]), max_new_tokens
        assert streamed_text(events) == ""
    # and once no token follows (the last one, EOS, a stop token id), the U+FFFD at the end is what it stays
    script = [64, byte_token(tokenizer, 0xFF)]  # "a", a byte no character starts with
    for tail, params in (
        ([], SamplingParams(max_new_tokens=2, stop=("\ufffd",), **GREEDY)),
        ([], SamplingParams(max_new_tokens=5, stop=("\ufffd",), temperature=0.0)),  # EOS after the script
        ([65], SamplingParams(max_new_tokens=5, stop=("\ufffd",), stop_token_ids=(65,), **GREEDY)),
    ):
        [result], _ = run(ScriptedModel(1, script + tail), [[50]], params, tokenizer)
        assert (result.text, result.finish_reason) == ("a", "stop"), params


def test_stop_token_ids(tiny_model: GPT, tokenizer: Tokenizer) -> None:
    [full], _ = run(tiny_model, [PROMPT], SamplingParams(max_new_tokens=20, **GREEDY), tokenizer)
    stop_token = full.token_ids[6]
    first = full.token_ids.index(stop_token)
    [result], events = run(
        tiny_model, [PROMPT], SamplingParams(max_new_tokens=20, stop_token_ids=(stop_token,), **GREEDY), tokenizer
    )
    assert result.token_ids == full.token_ids[: first + 1]  # the stop token is in the ids...
    assert result.text == tokenizer.decode(full.token_ids[:first])  # ...not in the text
    assert result.finish_reason == "stop" and events[-1].finish_reason == "stop"
    assert streamed_text(events) == result.text


@pytest.fixture(scope="module")
def eos_model(tiny: Checkpoint) -> GPT:
    """The tiny model changed so that <|endoftext|> always wins: ln_f outputs the (enlarged) EOT embedding."""
    model = load_ours(tiny)
    with torch.no_grad():
        model.wte.weight[EOT_ID] *= 20
        model.ln_f.weight.zero_()
        model.ln_f.bias.copy_(model.wte.weight[EOT_ID])
    return model


def test_eos_ends_generation_unless_ignored(eos_model: GPT, tokenizer: Tokenizer) -> None:
    for temperature in (0.0, 1.0):
        [result], events = run(eos_model, [PROMPT], SamplingParams(max_new_tokens=5, temperature=temperature, seed=0))
        assert result.token_ids == [EOT_ID] and result.finish_reason == "eos"
        assert result.text == "" and len(events) == 1 and events[0].finish_reason == "eos"
    [result], _ = run(eos_model, [PROMPT], SamplingParams(max_new_tokens=5, temperature=0.0), tokenizer)
    assert result.text == "" and result.finish_reason == "eos"
    [result], events = run(eos_model, [PROMPT], SamplingParams(max_new_tokens=5, **GREEDY), tokenizer)
    assert result.token_ids == [EOT_ID] * 5 and result.finish_reason == "length"
    assert result.text == EOT * 5 == streamed_text(events)
    [result], _ = run(
        eos_model, [PROMPT], SamplingParams(max_new_tokens=5, stop_token_ids=(EOT_ID,), **GREEDY), tokenizer
    )
    assert result.token_ids == [EOT_ID] and result.finish_reason == "stop"


def test_max_new_tokens_ends_with_length(tiny_model: GPT) -> None:
    results, events = run(
        tiny_model, [PROMPT, PROMPT[:2]], [SamplingParams(max_new_tokens=n, **GREEDY) for n in (7, 0)]
    )
    assert len(results[0].token_ids) == 7 and results[0].finish_reason == "length"
    assert results[1].token_ids == [] and results[1].finish_reason == "length" and results[1].text == ""
    assert [e.token_id for e in events if e.index == 0] == results[0].token_ids
    assert [e.finish_reason for e in events] == [None] * 6 + ["length"]
    assert [r.prompt_ids for r in results] == [PROMPT, PROMPT[:2]] and [r.index for r in results] == [0, 1]


# --- log-probabilities -----------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_equal_the_full_forward(tiny_model: GPT, temperature: float) -> None:
    params = SamplingParams(max_new_tokens=12, temperature=temperature, seed=5, ignore_eos=True, logprobs=5)
    [result], events = run(tiny_model, [PROMPT], params)
    assert result.logprobs is not None and len(result.logprobs) == 12
    assert [e.logprob for e in events] == result.logprobs
    expected = full_logprobs(tiny_model, PROMPT + result.token_ids)
    for i, (token, lp) in enumerate(zip(result.token_ids, result.logprobs, strict=True)):
        row = expected[len(PROMPT) - 1 + i]  # the position that predicts token i
        assert lp.id == token
        assert lp.logprob == pytest.approx(row[token].item(), abs=1e-4)
        values, ids = row.topk(5)
        assert [t for t, _ in lp.top] == ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(values.tolist(), abs=1e-4)
        if temperature == 0:
            assert lp.top[0][0] == token
    [plain], _ = run(tiny_model, [PROMPT], SamplingParams(max_new_tokens=3, **GREEDY))
    assert plain.logprobs is None
    [zero], _ = run(tiny_model, [PROMPT], SamplingParams(max_new_tokens=3, logprobs=0, **GREEDY))
    assert zero.logprobs is not None and all(lp.top == [] for lp in zero.logprobs)


def test_prompt_logprobs_equal_the_full_forward(tiny_model: GPT) -> None:
    params = SamplingParams(max_new_tokens=2, prompt_logprobs=3, **GREEDY)
    results, _ = run(tiny_model, [PROMPT, PROMPT[:3]], params)
    for result in results:
        prompt = result.prompt_ids
        assert result.prompt_logprobs is not None and len(result.prompt_logprobs) == len(prompt)
        assert result.prompt_logprobs[0] is None
        expected = full_logprobs(tiny_model, prompt)
        for t in range(1, len(prompt)):
            lp = result.prompt_logprobs[t]
            assert lp is not None and lp.id == prompt[t]
            assert lp.logprob == pytest.approx(expected[t - 1, prompt[t]].item(), abs=1e-4)
            assert [i for i, _ in lp.top] == expected[t - 1].topk(3).indices.tolist()
    [plain], _ = run(tiny_model, [PROMPT], SamplingParams(max_new_tokens=2, **GREEDY))
    assert plain.prompt_logprobs is None


def test_chunked_prefill_gives_the_same_tokens_and_logprobs(tiny_model: GPT) -> None:
    prompts = [PROMPT * 3, PROMPT[:4], PROMPT[:1]]
    params = SamplingParams(max_new_tokens=6, logprobs=2, prompt_logprobs=2, **GREEDY)
    expected, _ = run(tiny_model, prompts, params)
    with torch.inference_mode():
        batch = DecodeBatch(tiny_model, 3, 32, prefill_chunk=4)
        seqs = [new_sequence(tiny_model, i, p, params, None) for i, p in enumerate(prompts)]
        for seq in seqs:
            batch.add(seq)
        while batch:
            batch.step()
    for seq, want in zip(seqs, expected, strict=True):
        got = seq.result()
        assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason
        assert got.prompt_logprobs is not None and want.prompt_logprobs is not None
        assert len(got.prompt_logprobs) == len(want.prompt_logprobs) == len(want.prompt_ids)
        for a, b in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:], strict=True):
            assert a is not None and b is not None
            assert a.id == b.id and a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert got.logprobs is not None and want.logprobs is not None
        assert [lp.logprob for lp in got.logprobs] == pytest.approx([lp.logprob for lp in want.logprobs], abs=1e-4)


def test_joining_a_running_batch_changes_no_tokens(tiny_model: GPT) -> None:
    """Continuous batching: sequences join a 3-row batch as rows free up, their prompt chunks packed into
    the same passes as the others' decode tokens (2 prompt tokens a step, so a row may wait for its turn
    with only a dummy token in the pass); each gets the tokens and log-probabilities it gets alone."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 50257, (n,), generator=g).tolist() for n in (7, 2, 11, 5, 9, 4)]
    params = [
        SamplingParams(max_new_tokens=n, logprobs=1, prompt_logprobs=1 if n == 4 else None, **GREEDY)
        for n in (3, 8, 4, 6, 2, 5)
    ]
    alone = [run(tiny_model, [p], q)[0][0] for p, q in zip(prompts, params, strict=True)]
    with torch.inference_mode():
        batch = DecodeBatch(tiny_model, 3, 32, prefill_chunk=2)
        seqs = [new_sequence(tiny_model, i, p, q, None) for i, (p, q) in enumerate(zip(prompts, params, strict=True))]
        waiting, packed, waited = list(seqs), 0, 0
        while waiting or batch:
            while waiting and batch.has_room:
                batch.add(waiting.pop(0))
            decoding = any(s.prefilled == len(s.prompt) for s in batch.seqs)
            chunked = {b for b, _, _ in batch._chunks()}
            prefilling = {b for b, s in enumerate(batch.seqs) if s.prefilled < len(s.prompt)}
            packed += decoding and bool(chunked)
            waited += decoding and bool(prefilling - chunked)  # a prefilling row with no chunk this pass
            batch.step()
    assert packed >= 3 and waited >= 1  # the cases under test did happen
    for seq, want in zip(seqs, alone, strict=True):
        got = seq.result()
        assert got.token_ids == want.token_ids
        assert got.logprobs is not None and want.logprobs is not None
        assert [x.logprob for x in got.logprobs] == pytest.approx([x.logprob for x in want.logprobs], abs=1e-4)
        if want.prompt_logprobs is not None:
            assert got.prompt_logprobs is not None and len(got.prompt_logprobs) == len(want.prompt_logprobs)
            for a, b in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:], strict=True):
                assert a is not None and b is not None
                assert a.id == b.id and a.logprob == pytest.approx(b.logprob, abs=1e-4)


def test_prompts_are_prefilled_in_the_order_they_joined(tiny_model: GPT) -> None:
    """The prompt-token budget of a step goes to the earliest sequence first, even after a sequence that
    left moved a later one into a lower row."""
    params = SamplingParams(max_new_tokens=1, **GREEDY)
    with torch.inference_mode():
        batch = DecodeBatch(tiny_model, 3, 32, prefill_chunk=2)
        first, second, third = (new_sequence(tiny_model, i, PROMPT[:n], params, None) for i, n in enumerate((1, 6, 6)))
        for seq in (first, second, third):
            batch.add(seq)
        batch.step()  # first: its 1 token, done and gone (third moves into row 0); second: 1 token
        assert first.finish_reason == "length" and batch.seqs == [third, second]
        assert (second.prefilled, third.prefilled) == (1, 0)
        batch.step()
        assert (second.prefilled, third.prefilled) == (3, 0)


def test_warm_up_runs_every_step_size_in_bfloat16_on_cpu(tiny: Checkpoint, caplog: pytest.LogCaptureFixture) -> None:
    """oneDNN compiles a kernel per shape on first use: a bfloat16 batch runs each token count a step can
    carry (1 .. rows + prompt-token budget) once, saying so (with a large prefill chunk it takes minutes);
    float32 (MKL) needs no warm-up."""

    def pass_sizes(dtype: torch.dtype) -> list[int]:
        model = load_ours(tiny, dtype)
        seen: list[int] = []
        model.register_forward_pre_hook(lambda _, args: seen.append(args[0].shape[1]))
        DecodeBatch(model, 3, 32, prefill_chunk=4).warm_up()
        return seen

    with caplog.at_level("INFO", logger="model.generate"):
        assert pass_sizes(torch.bfloat16) == list(range(1, 3 + 4 + 1))
    assert "one pass of each token count a step can carry (1..7), so that oneDNN's bfloat16 kernels" in caplog.text
    caplog.clear()
    assert pass_sizes(torch.float32) == []
    assert not caplog.text


# --- refusals --------------------------------------------------------------------------------------


def test_a_batch_refuses_a_prefill_chunk_below_one(tiny_model: GPT) -> None:
    with pytest.raises(ValueError, match="prefill_chunk must be at least 1, got 0"):
        DecodeBatch(tiny_model, 2, 32, prefill_chunk=0)


@pytest.mark.parametrize(
    "ids", [[-1] * 2_000_000, ["x"] * 2_000_000, torch.full((2_000_000,), 7)], ids=["ids", "odd", "tensor"]
)
def test_a_prompt_longer_than_the_context_is_refused_for_its_length_first(tiny_model: GPT, ids: object) -> None:
    """Two million ids (a 4 MB body): refused for their number before any is looked at, whatever they hold, so
    the server's event loop, which checks prompts, does not spend a second of Python on them (it did, looking
    for odd or out-of-vocabulary ids first)."""
    with pytest.raises(GenerationError, match=r"^the prompt \(2000000 tokens\) is longer than the context of 128"):
        validate_prompt(tiny_model, ids, 0, "input_ids")  # type: ignore[arg-type]


def test_prompt_plus_max_new_tokens_beyond_the_context(tiny_model: GPT) -> None:
    n_ctx = tiny_model.config.n_positions  # 128
    prompt = (PROMPT * 20)[:100]
    assert len(generate(tiny_model, [prompt], SamplingParams(max_new_tokens=n_ctx - 100, **GREEDY))[0].token_ids) == 28
    with pytest.raises(GenerationError) as info:
        generate(tiny_model, [prompt], SamplingParams(max_new_tokens=n_ctx - 99))
    assert info.value.param == "max_new_tokens"
    assert "the prompt (100 tokens) plus max_new_tokens (29) exceeds the context of 128 tokens" in str(info.value)


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ([], "the prompt is empty"),
        ([1, 50257], "token id 50257 is outside the vocabulary (0..50256)"),
        ([-1], "token id -1 is outside the vocabulary"),
        ([1, True], "token ids must be integers, got True"),
        ([1.0], "token ids must be integers, got 1.0"),
        (torch.tensor([[1, 2]]), "a prompt given as a tensor must be 1-D and of integers, got 2-D torch.int64"),
        (torch.tensor([1.0]), "a prompt given as a tensor must be 1-D and of integers, got 1-D torch.float32"),
    ],
)
def test_bad_prompts(tiny_model: GPT, prompt: list, message: str) -> None:
    with pytest.raises(GenerationError) as info:
        generate(tiny_model, [PROMPT, prompt], SamplingParams(max_new_tokens=2))
    assert info.value.param == "prompt"
    assert message in str(info.value)


def test_prompts_as_tensors_and_numpy_ids_and_a_single_stop(tiny_model: GPT) -> None:
    """A 1-D integer tensor or numpy ints are a prompt like a list of ints (a tensor's ids were reported
    "outside the vocabulary"); `stop="ab"` is one stop string, not "a" and "b"; hooks named by one string
    are that one name (it was read letter by letter)."""
    import numpy as np

    params = SamplingParams(max_new_tokens=3, **GREEDY)
    want = generate(tiny_model, [PROMPT], params)[0].token_ids
    assert generate(tiny_model, [torch.tensor(PROMPT)], params)[0].token_ids == want
    assert generate(tiny_model, [np.array(PROMPT)], params)[0].token_ids == want
    assert generate(tiny_model, np.array([PROMPT]), params)[0].token_ids == want  # a batch as one array
    assert generate(tiny_model, torch.tensor([PROMPT]), params)[0].token_ids == want
    assert SamplingParams(stop="Ars").stop == ("Ars",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(stop_token_ids=7).stop_token_ids == (7,)
    numpy_params = SamplingParams(
        max_new_tokens=np.int64(3),
        temperature=np.float32(0.5),
        seed=np.int64(5),
        top_k=np.int32(4),
        stop_token_ids=[np.int64(7)],
        logprobs=np.int8(2),
    )
    assert numpy_params == SamplingParams(
        max_new_tokens=3, temperature=0.5, seed=5, top_k=4, stop_token_ids=(7,), logprobs=2
    )  # numpy's numbers taken as Python's
    assert type(numpy_params.seed) is int and type(numpy_params.temperature) is float
    assert SamplingParams(stop_token_ids=np.int64(7)).stop_token_ids == (7,)
    assert SamplingParams(stop_token_ids=np.array([7, 8])).stop_token_ids == (7, 8)
    assert type(SamplingParams(top_p=np.float64(0.5)).top_p) is float
    with pytest.raises(GenerationError, match="max_new_tokens must be an integer >= 0"):
        SamplingParams(max_new_tokens=np.bool_(True))
    with pytest.raises(GenerationError, match="stop must be a list or tuple, got set"):
        SamplingParams(stop={"a"})
    (done,) = generate(tiny_model, [PROMPT], params, hooks="blocks.0.hook_resid_pre")
    assert done.activations is not None and list(done.activations) == ["blocks.0.hook_resid_pre"]


def test_bad_requests(tiny_model: GPT) -> None:
    with pytest.raises(GenerationError, match="no prompts given"):
        generate(tiny_model, [])
    with pytest.raises(GenerationError, match="2 parameter sets for 1 prompts"):
        generate(tiny_model, [PROMPT], [SamplingParams(), SamplingParams()])
    with pytest.raises(GenerationError, match="stop strings need a tokenizer") as info:
        generate(tiny_model, [PROMPT], SamplingParams(stop=("x",)))
    assert info.value.param == "stop"
    generation = Generation(tiny_model, [PROMPT], SamplingParams(max_new_tokens=1))
    with pytest.raises(RuntimeError, match="iterate it to the end first"):
        _ = generation.results


def test_a_generation_that_failed_says_so(tiny_model: GPT) -> None:
    """Its results after the error: "failed", with the error (it said to iterate to the end, which gives
    nothing more)."""
    from model.interventions import EditSpec

    T = len(PROMPT)
    overflow = EditSpec(edits=(Edit("blocks.0.hook_resid_post", "scale", factor=3e38, positions=(T + 2,)),))
    generation = Generation(tiny_model, [PROMPT], SamplingParams(max_new_tokens=6, **GREEDY), edits=overflow)
    with pytest.raises(GenerationError, match="non-finite"):
        list(generation)
    assert list(generation) == []
    with pytest.raises(RuntimeError, match="the generation failed: the logits became non-finite") as info:
        _ = generation.results
    assert isinstance(info.value.__cause__, GenerationError)


def test_each_prompt_keeps_its_own_settings_in_a_batch(tiny_model: GPT, tokenizer: Tokenizer) -> None:
    params = [
        SamplingParams(max_new_tokens=4, **GREEDY),
        SamplingParams(max_new_tokens=9, temperature=0.9, seed=1, ignore_eos=True, logprobs=1),
        SamplingParams(max_new_tokens=2, **GREEDY),
    ]
    prompts = [PROMPT, PROMPT[:3], PROMPT[2:]]
    results, events = run(tiny_model, prompts, params, tokenizer)
    assert [len(r.token_ids) for r in results] == [4, 9, 2]
    assert [r.logprobs is not None for r in results] == [False, True, False]
    for i, r in enumerate(results):
        assert [e.token_id for e in events if e.index == i] == r.token_ids
        assert streamed_text(events, i) == r.text == tokenizer.decode(r.token_ids)
        alone, _ = run(tiny_model, [prompts[i]], params[i], tokenizer)
        assert alone[0].token_ids == r.token_ids


# --- sampling at its limits, and a row that fails alone ---------------------------------------------


def test_a_tiny_temperature_or_top_p_samples_the_best_token(tiny_model: GPT) -> None:
    """Temperatures and top_p values that vanish in float32 are greedy in the limit, in a batch beside a
    greedy row and a seeded row that get the tokens they get alone."""
    sampled = SamplingParams(max_new_tokens=6, temperature=0.9, seed=5, ignore_eos=True)
    params = [
        SamplingParams(max_new_tokens=6, **GREEDY),
        SamplingParams(max_new_tokens=6, temperature=1e-300, ignore_eos=True),
        SamplingParams(max_new_tokens=6, temperature=1e-45, ignore_eos=True),
        SamplingParams(max_new_tokens=6, temperature=1.0, top_p=1e-46, ignore_eos=True),
        SamplingParams(max_new_tokens=6, temperature=1e-300, top_k=3, top_p=1e-46, ignore_eos=True),
        sampled,
    ]
    prompts = [PROMPT, PROMPT[:2], PROMPT[1:], PROMPT[:4], PROMPT[3:], PROMPT[:5]]
    results, _ = run(tiny_model, prompts, params)
    for prompt, result in zip(prompts[:5], results[:5], strict=True):
        assert result.token_ids == run(tiny_model, [prompt], params[0])[0][0].token_ids
    assert results[5].token_ids == run(tiny_model, [prompts[5]], sampled)[0][0].token_ids


def poisoned(tiny: Checkpoint, position: int) -> GPT:
    """The tiny model with an infinite position embedding at `position`: a sequence that reaches it gets
    NaN logits, one that stays before it is unaffected."""
    model = load_ours(tiny)
    with torch.no_grad():
        model.wpe.weight[position] = float("inf")
    return model


def test_a_row_with_non_finite_logits_fails_alone(tiny: Checkpoint) -> None:
    """Two rows (one greedy, one sampled) whose second token comes from non-finite logits end with a clear
    error and leave the batch; the rows beside them get the tokens and log-probabilities they get alone."""
    model = poisoned(tiny, 20)
    bad = [SamplingParams(max_new_tokens=5, **GREEDY), SamplingParams(max_new_tokens=5, temperature=1.0, seed=1)]
    good = [
        SamplingParams(max_new_tokens=12, logprobs=1, **GREEDY),
        SamplingParams(max_new_tokens=12, temperature=0.9, seed=2, ignore_eos=True, logprobs=1),
    ]
    good_prompts = [PROMPT, PROMPT[:3]]
    with torch.inference_mode():
        batch = DecodeBatch(model, 4, 32)
        # prompts of 20 tokens with nothing in common (a shared prefix would be copied, not prefilled in step 1)
        bad_seqs = [new_sequence(model, i, (PROMPT * 4)[i : i + 20], p, None) for i, p in enumerate(bad)]
        good_seqs = [
            new_sequence(model, 2 + i, q, p, None) for i, (q, p) in enumerate(zip(good_prompts, good, strict=True))
        ]
        for seq in (good_seqs[0], bad_seqs[0], good_seqs[1], bad_seqs[1]):
            batch.add(seq)
        batch.step()  # every prompt, and a first token each (from finite logits: position 19)
        assert len(batch) == 4
        events = batch.step()  # the bad rows decode at position 20
        assert len(batch) == 2 and set(map(id, batch.seqs)) == set(map(id, good_seqs))
        while batch:
            batch.step()
    assert {id(s) for s, e in events if e is None} == set(map(id, bad_seqs))
    for seq in bad_seqs:
        assert isinstance(seq.error, GenerationError) and seq.finish_reason == "error"
        assert "logits became non-finite" in str(seq.error) and "overflowed" in str(seq.error)
        assert len(seq.tokens) == 1
    for seq, prompt, params in zip(good_seqs, good_prompts, good, strict=True):
        got, want = seq.result(), run(model, [prompt], params)[0][0]
        assert got.token_ids == want.token_ids
        assert got.logprobs is not None and want.logprobs is not None
        assert [x.logprob for x in got.logprobs] == pytest.approx([x.logprob for x in want.logprobs], abs=1e-4)
    with pytest.raises(GenerationError, match="logits became non-finite"):  # the library raises it
        generate(model, [(PROMPT * 4)[:20]], bad[0])


def test_which_rows_of_logits_count_as_non_finite(tiny: Checkpoint) -> None:
    """A NaN, +inf or -inf anywhere in a row fails that row alone; finite logits as large as float32 goes, or
    a tie for the largest, choose as argmax does (the first of equal maxima)."""
    model = load_ours(tiny)
    V, big = model.config.vocab_size, torch.finfo(torch.float32).max
    logits = torch.zeros(6, V)
    logits[0, 7], logits[1, 9], logits[2, 11] = math.nan, math.inf, -math.inf  # one bad value each
    logits[3, 0], logits[3, 1], logits[3, 5] = big, -big, big  # finite, extremes of float32, a tie
    logits[4, 123] = 5.0
    logits[5, V - 1] = math.nan  # the last position too
    batch = DecodeBatch(model, 6, 32)
    seqs = [new_sequence(model, i, PROMPT, SamplingParams(max_new_tokens=4, **GREEDY), None) for i in range(6)]
    events = batch._accept(seqs, logits)
    assert [e is None for _, e in events] == [True, True, True, False, False, True]
    assert [s.tokens for s in seqs[3:5]] == [[0], [123]]
    assert all("logits became non-finite" in str(s.error) for s in (seqs[0], seqs[1], seqs[2], seqs[5]))


@pytest.mark.parametrize("chunk", [None, 4])
def test_non_finite_logits_under_a_prompt_token_fail_its_scoring_alone(tiny: Checkpoint, chunk: int | None) -> None:
    """Prompt log-probabilities from logits that are not finite fail the sequence, as a new token's do, and
    name the prompt token (here the 7th, which position 5 predicts), in a pass of its own or in chunks beside
    a row that decodes; that row, and one whose prompt ends before the poisoned position, go on as alone."""
    model = poisoned(tiny, 5)
    scoring = SamplingParams(max_new_tokens=0, prompt_logprobs=1)
    short = PROMPT[:3]  # with 2 new tokens, positions 0-4: every logit finite
    with torch.inference_mode():
        batch = DecodeBatch(model, 3, 32, prefill_chunk=chunk)
        seqs = [
            new_sequence(model, 0, short, SamplingParams(max_new_tokens=2, logprobs=1, **GREEDY), None),
            new_sequence(model, 1, (PROMPT * 2)[:12], scoring, None),
            new_sequence(model, 2, short, scoring, None),
        ]
        for seq in seqs:
            batch.add(seq)
        while batch:
            batch.step()
    bad = seqs[1]
    assert bad.finish_reason == "error" and isinstance(bad.error, GenerationError)
    assert str(bad.error).startswith("the logits became non-finite (inf or NaN) at prompt token 7: the activations")
    last = new_sequence(model, 3, (PROMPT * 2)[:6], scoring, None)  # position 5 predicts no prompt token
    with torch.inference_mode():
        batch.add(last)
        while batch:
            batch.step()
    assert last.finish_reason == "length" and last.error is None and last.prompt_logprobs is not None
    assert len(last.prompt_logprobs) == 6 and all(math.isfinite(x.logprob) for x in last.prompt_logprobs[1:] if x)
    for seq in (seqs[0], seqs[2]):
        assert seq.error is None, seq.error
        got, want = seq.result(), run(model, [short], seq.params)[0][0]
        assert got.token_ids == want.token_ids
        mine, alone = (got.logprobs, want.logprobs) if seq is seqs[0] else (got.prompt_logprobs, want.prompt_logprobs)
        assert mine is not None and alone is not None and len(mine) == len(alone) > 1
        assert [x and x.logprob for x in mine] == pytest.approx([x and x.logprob for x in alone], abs=1e-4)
        assert all(math.isfinite(x.logprob) for x in mine if x is not None)


@pytest.mark.parametrize("temperature", [math.inf, -math.inf, math.nan, -0.5])
def test_a_temperature_that_is_not_a_finite_number_at_least_0_is_refused(temperature: float) -> None:
    """An infinite temperature would sample uniformly, whatever the model says."""
    with pytest.raises(GenerationError, match="finite number >= 0") as info:
        SamplingParams(temperature=temperature)
    assert info.value.param == "temperature"


@pytest.mark.parametrize("seed", [2**63, 2**64, 2**64 - 1, 10**30, -(2**63) - 1])
def test_a_seed_outside_int64_is_refused(seed: int) -> None:
    with pytest.raises(GenerationError) as info:
        SamplingParams(seed=seed)
    assert info.value.param == "seed"
    assert str(seed) in str(info.value) and "int64" in str(info.value)


def test_the_ends_of_the_seed_range_generate(tiny_model: GPT) -> None:
    for seed in (2**63 - 1, -(2**63)):
        params = SamplingParams(max_new_tokens=3, seed=seed, ignore_eos=True)
        assert len(generate(tiny_model, [PROMPT], params)[0].token_ids) == 3


def test_stop_strings_are_limited_in_number_and_length() -> None:
    SamplingParams(stop=tuple(f"{i:02}" + "x" * 254 for i in range(16)))  # 16 of 256 characters: the most
    for stop, message in (
        (("x",) * 17, "stop must hold at most 16 strings, got 17"),
        (("x" * 257,), "stop strings must be at most 256 characters each, got one of 257"),
        (("x" * 1000,) * 1000, "stop must hold at most 16 strings, got 1000"),
        (("x" * 256,) * 15 + ("",), "stop[15] must be a non-empty string, got ''"),  # which one, not all 16
        (("a", 5), "stop[1] must be a non-empty string, got 5"),
    ):
        with pytest.raises(GenerationError) as info:
            SamplingParams(stop=stop)
        assert info.value.param == "stop" and str(info.value) == message


def test_longest_stop_prefix_equals_trying_every_length() -> None:
    """The tail that may still grow into a stop string (held back from the stream), found by trying only
    where a stop string's first character occurs: the same as trying every length."""

    def every_length(text: str, stops: tuple[str, ...]) -> int:
        return max((n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)

    g = random.Random(0)
    for _ in range(20_000):
        text = "".join(g.choices("ab\ufffd", k=g.randint(0, 12)))
        stops = tuple("".join(g.choices("ab\ufffd", k=g.randint(1, 8))) for _ in range(g.randint(0, 3)))
        assert _longest_stop_prefix(text, stops) == every_length(text, stops), (text, stops)


def test_a_vocabulary_padded_past_the_tokenizers_chooses_only_its_ids(tokenizer: Tokenizer) -> None:
    """nanoGPT pads GPT-2's 50,257 ids to 50,304: the padding has no text, so a token is chosen (greedy,
    sampled, or handed over as the pass's argmax) only among the tokenizer's ids, and log-probabilities are
    normalised over them, as vLLM does."""
    logits = torch.zeros(50304)
    logits[50300], logits[7] = 30.0, 5.0  # a padding id far ahead
    for params, argmax in ((SamplingParams(temperature=0, logprobs=2), 50300), (SamplingParams(seed=1), None)):
        seq = SequenceState(0, [1], params, tokenizer, EOT_ID, torch.Generator().manual_seed(1))
        event = seq.accept(logits, argmax)
        assert event.token_id < tokenizer.vocab_size
        if params.temperature == 0:
            assert event.token_id == 7 and event.logprob is not None
            want = 5.0 - torch.logsumexp(logits[: tokenizer.vocab_size], 0)
            assert event.logprob.logprob == pytest.approx(float(want), abs=1e-5)
            assert all(i < tokenizer.vocab_size for i, _ in event.logprob.top)


def test_a_generation_runs_once_and_resumes_after_a_break(tiny_model: GPT) -> None:
    """Iterating a `Generation` again after a `break` goes on where it stopped (the same tokens as one run);
    after its end it gives nothing more (it once ran its sequences again, past max_new_tokens, capturing their
    positions twice). The caller's code between events does not run in inference mode."""
    params = SamplingParams(max_new_tokens=5, temperature=0, ignore_eos=True)
    whole = generate(tiny_model, [[5, 6, 7]], params, hooks=["blocks.0.hook_resid_post"])[0]
    g = Generation(tiny_model, [[5, 6, 7]], params, hooks=["blocks.0.hook_resid_post"])
    first = []
    for event in g:
        assert not torch.is_inference_mode_enabled()
        first.append(event.token_id)
        break
    rest = [e.token_id for e in g]
    assert first + rest == whole.token_ids and list(g) == []
    (result,) = g.results
    assert result.token_ids == whole.token_ids
    assert result.activations is not None and result.activations["blocks.0.hook_resid_post"].shape[1] == 3 + 5


def test_generate_says_what_its_arguments_are(tiny_model: GPT) -> None:
    """One prompt's flat ids, a dict for the parameters, a list of edits, a Capture for the hooks: each said in
    words (they failed with "object of type 'int' has no len()" and the like); a [batch, pos] tensor of ids
    is taken as its prompts."""
    params = SamplingParams(max_new_tokens=2, temperature=0)
    for kwargs, error, says in (
        ({"prompts": [5, 6, 7]}, GenerationError, "prompts is a list of prompts"),
        ({"prompts": [[5, 6]], "params": {"max_new_tokens": 2}}, TypeError, "params is a SamplingParams"),
        ({"prompts": [[5, 6]], "edits": [Edit("hook_embed", "zero")]}, TypeError, "edits is an EditSpec"),
        ({"prompts": [[5, 6]], "hooks": Capture(["hook_embed"])}, TypeError, "hooks are hook names or globs"),
    ):
        with pytest.raises(error, match=says):
            generate(tiny_model, **({"params": params} | kwargs))  # type: ignore[arg-type]
    as_tensor = generate(tiny_model, torch.tensor([[5, 6, 7]]), params)  # type: ignore[arg-type]
    assert as_tensor[0].token_ids == generate(tiny_model, [[5, 6, 7]], params)[0].token_ids


def test_prompt_logprobs_of_a_padded_vocabulary_are_over_the_tokenizers_ids(tokenizer: Tokenizer) -> None:
    """As the generated tokens' (above): the prompt's log-probabilities and their alternatives are over the
    tokenizer's ids, not the padding's."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, n_positions=32, vocab_size=50304)).eval()
    with torch.no_grad():  # the padding far ahead of every real id, whichever way the stream points
        u = torch.nn.functional.normalize(torch.randn(16), dim=0)
        model.wte.weight[50257:50280], model.wte.weight[50280:] = 1000 * u, -1000 * u
    params = SamplingParams(max_new_tokens=1, temperature=0, prompt_logprobs=3, logprobs=3)
    (bare,) = generate(model, [[464, 2068, 7586, 21831]], params)  # no tokenizer: every id is the model's
    assert bare.token_ids[0] >= tokenizer.vocab_size
    (c,) = generate(model, [[464, 2068, 7586, 21831]], params, tokenizer)
    assert c.prompt_logprobs is not None and c.logprobs is not None
    entries = [e for e in c.prompt_logprobs if e is not None] + c.logprobs
    assert all(i < tokenizer.vocab_size for e in entries for i, _ in [(e.id, 0), *e.top])
    assert c.token_ids[0] < tokenizer.vocab_size
