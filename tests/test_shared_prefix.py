"""A prompt prefix shared by sequences in the batch is prefilled once: the `n` samples of one prompt, and
prompts that begin with the same context (the choices of a multiple-choice question, scored with prompt
logprobs), copy its keys and values from the row that computed them (`DecodeBatch._take_prefixes`), and
each gets what it gets alone."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
from inprocess import assert_still_serving, engine_held, post_ok, serve, wait_until
from prometheus_client.parser import text_string_to_metric_families

from model.generate import (
    SHARED_PREFIX_MIN,
    Completion,
    DecodeBatch,
    SamplingParams,
    SequenceState,
    generate,
    new_sequence,
)
from model.gpt import GPT
from model.loading import LoadedModel

CMPL = "/v1/completions"


def random_prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 50257, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run_batch(
    model: GPT, prompts: list[list[int]], params: list[SamplingParams], chunk: int, hooks: list[str] | None = None
) -> tuple[list[SequenceState], DecodeBatch, int]:
    """The prompts through one DecodeBatch, all joining at once; also the prompt tokens its passes computed."""
    with torch.inference_mode():
        batch = DecodeBatch(model, len(prompts), 128, prefill_chunk=chunk)
        seqs = [new_sequence(model, i, p, q, None, hooks) for i, (p, q) in enumerate(zip(prompts, params, strict=True))]
        for seq in seqs:
            batch.add(seq)
        computed = 0
        while batch:
            batch._take_prefixes()  # as step() does first, so that the chunks counted are the step's
            computed += sum(end - start for _, start, end in batch._chunks())
            batch.step()
    return seqs, batch, computed


def alone(model: GPT, prompt: list[int], params: SamplingParams) -> Completion:
    return generate(model, [prompt], params)[0]


def assert_same(got: Completion, want: Completion) -> None:
    assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason
    for mine, theirs in ((got.logprobs, want.logprobs), (got.prompt_logprobs, want.prompt_logprobs)):
        assert (mine is None) == (theirs is None)
        if mine is not None and theirs is not None:
            assert len(mine) == len(theirs)
            for a, b in zip(mine, theirs, strict=True):
                assert (a is None) == (b is None)
                if a is not None and b is not None:
                    assert a.id == b.id and a.logprob == pytest.approx(b.logprob, abs=1e-4)
                    assert [i for i, _ in a.top] == [i for i, _ in b.top]


def test_the_samples_of_one_prompt_prefill_it_once(tiny_model: GPT) -> None:
    """Four seeded samples of a 40-token prompt, 8 prompt tokens a pass: the first computes the prompt, the
    other three wait for it, copy its first 39 positions and compute the last one (whose logits choose
    their first token); each sample is the one it is alone."""
    prompt = random_prompt(40, 0)
    params = [SamplingParams(max_new_tokens=6, temperature=1.0, seed=s, logprobs=2, ignore_eos=True) for s in range(4)]
    seqs, batch, computed = run_batch(tiny_model, [prompt] * 4, params, chunk=8)
    assert batch.shared_tokens == 3 * 39
    assert computed == 40 + 3
    for seq, q in zip(seqs, params, strict=True):
        assert_same(seq.result(), alone(tiny_model, prompt, q))


def test_choices_after_one_context_share_it_with_their_prompt_logprobs(tiny_model: GPT) -> None:
    """lm-eval's multiple choice: a 30-token context, then four endings, scored with prompt logprobs and no
    new token. The context's logprobs are copied with its keys and values; each ending's are its own."""
    context = random_prompt(30, 1)
    prompts = [context + random_prompt(n, 10 + n) for n in (3, 5, 1, 4)]
    params = [SamplingParams(max_new_tokens=0, prompt_logprobs=2) for _ in prompts]
    seqs, batch, computed = run_batch(tiny_model, prompts, params, chunk=16)
    # each ending computes from the context's last token on: its logits score the ending's first token
    assert batch.shared_tokens == 3 * 29
    assert computed == sum(len(p) for p in prompts) - 3 * 29
    for seq, p, q in zip(seqs, prompts, params, strict=True):
        assert_same(seq.result(), alone(tiny_model, p, q))


def test_a_prefix_is_copied_only_from_a_row_that_lists_the_same_prompt_logprobs(tiny_model: GPT) -> None:
    prompt = random_prompt(24, 2)
    params = [
        SamplingParams(max_new_tokens=0, prompt_logprobs=1),
        SamplingParams(max_new_tokens=0, prompt_logprobs=3),  # deeper than the other's: computed itself
        SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True),  # none wanted: copies
    ]
    seqs, batch, _ = run_batch(tiny_model, [prompt] * 3, params, chunk=64)
    assert batch.shared_tokens == 23
    for seq, q in zip(seqs, params, strict=True):
        assert_same(seq.result(), alone(tiny_model, prompt, q))


def test_a_prompt_the_step_carries_whole_does_not_wait(tiny_model: GPT) -> None:
    """Four samples of a 20-token prompt with 128 prompt tokens a pass: one pass prefills them all and gives
    each its first token; waiting for the first to copy from it would cost the others a pass."""
    prompt = random_prompt(20, 8)
    params = [SamplingParams(max_new_tokens=1, temperature=1.0, seed=s, ignore_eos=True) for s in range(4)]
    with torch.inference_mode():
        batch = DecodeBatch(tiny_model, 4, 128, prefill_chunk=128)
        seqs = [new_sequence(tiny_model, i, prompt, q, None) for i, q in enumerate(params)]
        for seq in seqs:
            batch.add(seq)
        batch.step()
    assert all(s.finish_reason == "length" for s in seqs) and batch.shared_tokens == 0


def test_of_equal_prefixes_one_already_held_is_copied(tiny_model: GPT) -> None:
    """Two rows hold the same prompt, one still prefilling it: a third copies from the one that holds it now."""
    prompt = random_prompt(40, 9)
    params = SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True)
    with torch.inference_mode():
        batch = DecodeBatch(tiny_model, 3, 128, prefill_chunk=8)
        first, second, third = (new_sequence(tiny_model, i, prompt, params, None) for i in range(3))
        batch.add(first)
        batch.add(second)
        first.prefilled, second.prefilled = 8, 40  # as if the second had prefilled it (the policy alone)
        batch.add(third)
        assert batch._prefixes[id(third)] == (second, 39)


def test_sequences_of_other_groups_do_not_share(tiny_model: GPT) -> None:
    """A server's requests are groups: one client's prompt is neither copied into nor timed by another's."""
    prompt = random_prompt(40, 10)
    params = SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True)
    with torch.inference_mode():
        batch = DecodeBatch(tiny_model, 3, 128, prefill_chunk=8)
        seqs = [new_sequence(tiny_model, i, prompt, params, None) for i in range(3)]
        for seq, group in zip(seqs, (1, 2, 1), strict=True):
            seq.group = group
            batch.add(seq)
        assert id(seqs[1]) not in batch._prefixes and batch._prefixes[id(seqs[2])] == (seqs[0], 39)
        while batch:
            batch.step()
    assert batch.shared_tokens == 39
    want = alone(tiny_model, prompt, params)
    for seq in seqs:
        assert_same(seq.result(), want)


def test_a_short_common_prefix_is_not_shared(tiny_model: GPT) -> None:
    prompt = random_prompt(SHARED_PREFIX_MIN, 3)  # the follower could copy SHARED_PREFIX_MIN - 1 positions
    params = [SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)] * 2
    _, batch, computed = run_batch(tiny_model, [prompt] * 2, params, chunk=64)
    assert batch.shared_tokens == 0 and computed == 2 * SHARED_PREFIX_MIN


def test_a_sequence_joining_later_copies_from_one_already_decoding(tiny_model: GPT) -> None:
    prompt = random_prompt(33, 4)
    params = SamplingParams(max_new_tokens=8, temperature=0.0, logprobs=1, ignore_eos=True)
    with torch.inference_mode():
        batch = DecodeBatch(tiny_model, 2, 128, prefill_chunk=8)
        first, second = (new_sequence(tiny_model, i, prompt, params, None) for i in range(2))
        batch.add(first)
        for _ in range(6):  # its prompt (5 passes), then a decode step: its row now holds more than its prompt
            batch.step()
        assert first.prefilled == 33 and len(first.tokens) == 2
        batch.add(second)
        batch.step()  # copies 32 positions, computes the last and takes its first token in the same pass
        assert batch.shared_tokens == 32 and second.prefilled == 33 and len(second.tokens) == 1
        while batch:
            batch.step()
    want = alone(tiny_model, prompt, params)
    assert_same(first.result(), want)
    assert_same(second.result(), want)


def test_a_row_whose_source_leaves_before_it_is_prefilled_prefills_itself(tiny_model: GPT) -> None:
    prompt = random_prompt(40, 5)
    params = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)
    with torch.inference_mode():
        batch = DecodeBatch(tiny_model, 2, 128, prefill_chunk=8)
        first, second = (new_sequence(tiny_model, i, prompt, params, None) for i in range(2))
        batch.add(first)
        batch.add(second)
        batch.step()
        assert first.prefilled == 8 and second.prefilled == 0  # the second waits
        batch.cancel(first)
        while batch:
            batch.step()
    assert batch.shared_tokens == 0
    assert_same(second.result(), alone(tiny_model, prompt, params))


def test_sequences_with_hooks_neither_copy_nor_are_copied(tiny_model: GPT) -> None:
    """A capture must see every position of its own prompt, and an edit changes the keys and values."""
    prompt = random_prompt(30, 6)
    params = [SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True)] * 3
    seqs, batch, computed = run_batch(tiny_model, [prompt] * 3, params, chunk=8, hooks=["blocks.0.hook_resid_post"])
    assert batch.shared_tokens == 0 and computed == 3 * 30
    want = generate(tiny_model, [prompt], params[0], hooks=["blocks.0.hook_resid_post"])[0]
    for seq in seqs:
        got = seq.result()
        assert got.token_ids == want.token_ids and got.activations is not None and want.activations is not None
        name = "blocks.0.hook_resid_post"
        torch.testing.assert_close(got.activations[name], want.activations[name])


def shared_metric(text: str) -> float:
    """gpt2_prompt_tokens_shared_total, read from /metrics as a scraper reads it."""
    for family in text_string_to_metric_families(text):
        if family.name == "gpt2_prompt_tokens_shared":
            return sum(s.value for s in family.samples if s.name == "gpt2_prompt_tokens_shared_total")
    raise AssertionError("no gpt2_prompt_tokens_shared in /metrics")


def sample(client: Any, name: str) -> float | None:
    return client.app.state.metrics.registry.get_sample_value(name)


def test_completions_n_samples_share_their_prompt_and_n_goes_to_128(loaded: LoadedModel) -> None:
    prompt = random_prompt(50, 7)
    with serve(loaded, max_queue=200) as c:
        before = shared_metric(c.get("/metrics").text)
        body = post_ok(c, CMPL, {"prompt": prompt, "max_tokens": 4, "n": 4, "seed": 11, "logprobs": 1})
        assert len(body["choices"]) == 4
        assert shared_metric(c.get("/metrics").text) - before == 3 * 49
        for j, choice in enumerate(body["choices"]):  # each the choice a request of its own seed gives
            one = post_ok(c, CMPL, {"prompt": prompt, "max_tokens": 4, "seed": 11 + j, "logprobs": 1})["choices"][0]
            assert choice["text"] == one["text"]
            assert choice["logprobs"]["token_logprobs"] == pytest.approx(one["logprobs"]["token_logprobs"], abs=1e-4)
        with ThreadPoolExecutor(2) as pool:  # two requests of one prompt, in the batch together: not shared
            with engine_held(c):
                both = [pool.submit(c.post, CMPL, json={"prompt": prompt, "max_tokens": 2}) for _ in range(2)]
                wait_until(lambda: sample(c, "gpt2_queue_depth") == 2)
            assert all(f.result(20).status_code == 200 for f in both)
        assert shared_metric(c.get("/metrics").text) - before == 3 * 49
        body = post_ok(c, CMPL, {"prompt": "Hello", "max_tokens": 1, "n": 128})
        assert len(body["choices"]) == 128
        error = c.post(CMPL, json={"prompt": "Hello", "max_tokens": 1, "n": 129})
        assert error.status_code == 400 and error.json()["error"]["param"] == "n"
        assert "1..128" in error.json()["error"]["message"]
        assert_still_serving(c)
